package remote

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/hybridlimit/hybridlimit/internal/redistest"
)

// BenchmarkFleetRedis measures what one heartbeat costs Redis when the
// group has 10 to 10,000 members, simulated round-robin, each reporting
// once per window of 1 s (the default Heartbeat) as fast as one client
// sends them.
// It reports Redis's own accounting: redis-µs/op is usec per call of
// FCALL and EVALSHA in INFO commandstats (the script's run: by FCALL on
// Redis 7 once the node's check found the library), cpu-µs/op the growth
// of used_cpu_user+used_cpu_sys in INFO cpu per call (the whole process:
// the socket reads and writes too). Run it with
//
//	go test -run '^$' -bench FleetRedis -benchtime 40000x ./remote
//
// so that every member reports in several windows at 10,000. PING, sent
// the same way, shows what any command costs Redis's CPU beside the
// script: reading, parsing and answering it.
func BenchmarkFleetRedis(b *testing.B) {
	b.Run("PING", func(b *testing.B) {
		srv := redistest.Start(b)
		c := srv.Client(b)
		ctx := context.Background()
		cpu0 := srv.CPU(b)
		for b.Loop() {
			if err := c.Ping(ctx).Err(); err != nil {
				b.Fatal(err)
			}
		}
		b.ReportMetric((srv.CPU(b)-cpu0)*1e6/float64(b.N), "cpu-µs/op")
	})
	for _, members := range []int{10, 100, 1000, 10000} {
		b.Run("members="+strconv.Itoa(members), func(b *testing.B) {
			srv := redistest.Start(b)
			c := srv.Client(b)
			ctx := context.Background()
			const every = time.Second
			now, err := c.Time(ctx).Result()
			if err != nil {
				b.Fatal(err)
			}
			window := now.UnixMilli()/every.Milliseconds() - 1
			info := func(section, field string) float64 {
				s := srv.Do(b, "INFO", section).(string)
				for _, line := range strings.Split(s, "\r\n") {
					if rest, ok := strings.CutPrefix(line, field); ok {
						if i := strings.IndexByte(rest, ','); i >= 0 {
							rest = rest[:i]
						}
						v, _ := strconv.ParseFloat(rest, 64)
						return v
					}
				}
				return 0
			}
			if err := Load(ctx, c); err != nil {
				b.Fatal(err)
			}
			// One Node for the client, as the pacer keeps: its one check
			// for functions is made before the clock starts.
			var node Node
			// The mark of each window's sum, as the members' reports were
			// taken under it: a member counted in the window it reads
			// says so, and takes no ticket.
			marks := map[int64]int64{}
			beat := func(window, offered int64, ticket bool) Heartbeat {
				bs := []Beat{{Base: "{bench}", Window: window, Offered: offered, Ticket: ticket, Every: every}}
				if !ticket {
					bs[0].Mark = marks[window-2]
				}
				Beats(ctx, c, &node, bs)
				if bs[0].Err != nil {
					b.Fatal(bs[0].Err)
				}
				if h := bs[0].Heartbeat; h.Taken {
					marks[window] = h.Mark
				}
				return bs[0].Heartbeat
			}
			beat(window, 0, false)
			srv.Do(b, "CONFIG", "RESETSTAT")
			cpu0 := srv.CPU(b)
			i := 0
			for b.Loop() {
				// Member i%members reports; one in a hundred was not
				// counted and asks for a ticket.
				h := beat(window, int64(i%97), i%members%100 == 99)
				window = h.Now/every.Milliseconds() - 1
				i++
			}
			b.StopTimer()
			var calls, usec float64
			for _, cmd := range []string{"fcall", "evalsha"} {
				n := info("commandstats", "cmdstat_"+cmd+":calls=")
				if n > 0 {
					calls += n
					usec += info("commandstats", "cmdstat_"+cmd+":calls="+strconv.FormatFloat(n, 'f', -1, 64)+",usec=")
				}
			}
			if calls < float64(b.N) {
				b.Fatalf("Redis counted %v FCALL and EVALSHA for %d heartbeats", calls, b.N)
			}
			b.ReportMetric(usec/calls, "redis-µs/op")
			b.ReportMetric((srv.CPU(b)-cpu0)*1e6/calls, "cpu-µs/op")
			// At one heartbeat per member per second, the part of one
			// core the fleet's heartbeats take.
			b.ReportMetric(float64(members)*usec/calls/1e6*100, "%core")
		})
	}
}
