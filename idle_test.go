//go:build unix

package hybridlimit

import (
	"context"
	"math"
	"sync"
	"sync/atomic"
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

// BenchmarkFleet2000 runs 2,000 Limiters of one group in one process,
// sharing one client and a limit of 2,000/s (burst 2,000), each offered
// 2 decisions a second (4,000/s in all), with the default Heartbeat. Redis
// is healthy for 6 s, paused (SIGSTOP) for 4 s, then resumed for 3 s. It
// logs, per second, what was admitted and how many decisions Redis made,
// and reports the healthy seconds' part decided by Redis and the least and
// most admitted in an outage second (after the switch second), as parts
// of the limit. Too heavy for CI; run it with
//
//	go test -run '^$' -bench Fleet2000 -benchtime 1x -v .
func BenchmarkFleet2000(b *testing.B) {
	const n, limit = 2000, 2000
	const healthy, paused, after = 6, 4, 3
	srv := redistest.Start(b)
	c := srv.Client(b)
	lims := make([]*Limiter, n)
	for i := range lims {
		lims[i] = newLimiter(b, Config{Redis: c, Limit: PerSecond(limit), Name: "fleet2000", Prefix: "f2000:"})
	}
	time.Sleep(4 * time.Second) // every Limiter has read a window with all of them
	for b.Loop() {
		const secs = healthy + paused + after
		var allowed, remoteN, total, slow [secs]atomic.Int64
		t0 := time.Now()
		ctx, cancel := context.WithTimeout(context.Background(), secs*time.Second)
		var wg sync.WaitGroup
		for i, lim := range lims {
			wg.Add(1)
			go func() {
				defer wg.Done()
				// Spread the instances' decisions over the half second.
				t := time.NewTimer(time.Duration(i) * 500 * time.Millisecond / n)
				defer t.Stop()
				for {
					select {
					case <-ctx.Done():
						return
					case <-t.C:
					}
					t.Reset(500 * time.Millisecond)
					start := time.Now()
					s := int(start.Sub(t0) / time.Second)
					d, err := lim.Allow(ctx, "k")
					if err != nil || s >= secs {
						continue
					}
					total[s].Add(1)
					if time.Since(start) > 20*time.Millisecond {
						slow[s].Add(1)
					}
					if d.Allowed {
						allowed[s].Add(1)
					}
					if d.Mode == ModeRemote {
						remoteN[s].Add(1)
					}
				}
			}()
		}
		var weight [secs]atomic.Pointer[[2]float64]
		wg.Add(1)
		go func() {
			defer wg.Done()
			for s := range secs {
				time.Sleep(time.Until(t0.Add(time.Duration(s)*time.Second + 500*time.Millisecond)))
				w := [2]float64{math.Inf(1), 0}
				for _, lim := range lims {
					v := lim.view.Load().weight
					w[0], w[1] = min(w[0], v), w[1]+v
				}
				weight[s].Store(&w)
			}
		}()
		time.Sleep(time.Until(t0.Add(healthy * time.Second)))
		srv.Pause(b)
		time.Sleep(time.Until(t0.Add((healthy + paused) * time.Second)))
		srv.Resume(b)
		wg.Wait()
		cancel()
		var rem, tot int64
		lo, hi := math.Inf(1), math.Inf(-1)
		for s := range secs {
			w := weight[s].Load()
			b.Logf("second %2d: %5d decisions (%4d slower than 20 ms), %4d admitted, %5d by Redis; weights: least %.6f, sum %.4f", s, total[s].Load(), slow[s].Load(), allowed[s].Load(), remoteN[s].Load(), w[0], w[1])
			switch {
			case s >= 1 && s < healthy:
				rem += remoteN[s].Load()
				tot += total[s].Load()
			case s > healthy && s < healthy+paused:
				p := float64(allowed[s].Load()) / limit
				lo, hi = min(lo, p), max(hi, p)
			}
		}
		b.ReportMetric(float64(rem)/float64(tot)*100, "%remote-healthy")
		b.ReportMetric(lo*100, "%limit-outage-min")
		b.ReportMetric(hi*100, "%limit-outage-max")
	}
}
