//go:build unix

package hybridlimit

import (
	"syscall"
	"testing"
	"time"

	"github.com/hybridlimit/hybridlimit/internal/redistest"
)

// BenchmarkIdleLimiters measures what 2,000 idle Limiters of one group,
// sharing one client, cost this process and Redis: no decisions, every
// breaker closed, with the default Heartbeat and without one (the rest:
// the prober's ticks, the sweeper). It reports the process's CPU
// (getrusage) and Redis's (INFO cpu) over 10 s as a part of one core,
// after the heartbeats have settled. Run it with
//
//	go test -run '^$' -bench IdleLimiters -benchtime 1x -cpuprofile idle.prof .
//
// and `go tool pprof -top idle.prof` to see which goroutines spend it.
func BenchmarkIdleLimiters(b *testing.B) {
	for _, hb := range []time.Duration{0, -1} {
		name := "heartbeat"
		if hb < 0 {
			name = "no heartbeat"
		}
		b.Run(name, func(b *testing.B) { idle(b, hb) })
	}
}

func idle(b *testing.B, heartbeat time.Duration) {
	const n, measure = 2000, 10 * time.Second
	srv := redistest.Start(b)
	c := srv.Client(b)
	for range n {
		newLimiter(b, Config{Redis: c, Limit: PerSecond(2000), Name: "idle", Prefix: "idle:", Heartbeat: heartbeat, Instances: n})
	}
	cpu := func() time.Duration {
		var ru syscall.Rusage
		if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
			b.Fatal(err)
		}
		return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
	}
	time.Sleep(4 * time.Second) // every Limiter past its first heartbeats
	for b.Loop() {
		c0, r0, t0 := cpu(), srv.CPU(b), time.Now()
		time.Sleep(measure)
		el := time.Since(t0)
		b.ReportMetric(float64(cpu()-c0)/float64(el)*100, "%core")
		b.ReportMetric((srv.CPU(b)-r0)/el.Seconds()*100, "redis-%core")
	}
}
