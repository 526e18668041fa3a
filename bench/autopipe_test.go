package bench

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/hybridlimit/hybridlimit/internal/redistest"
)

// BenchmarkAutoPipelinerBudget measures how long a command sent through
// go-redis's AutoPipeliner with a 50 ms deadline waits on a Redis paused by
// SIGSTOP, on a client of default options and on one with
// ContextTimeoutEnabled: whether the AutoPipeliner could carry decisions
// whose time budget must hold. It reports the wait as wait-ns; the paused
// server is resumed after each command. Slow by design (tens of seconds a
// command): run it on demand.
//
//	go test -run '^$' -bench AutoPipelinerBudget -benchtime 1x -v .
func BenchmarkAutoPipelinerBudget(b *testing.B) {
	srv := redistest.Start(b)
	for _, ctxTimeout := range []bool{false, true} {
		b.Run(map[bool]string{false: "default", true: "ContextTimeoutEnabled"}[ctxTimeout], func(b *testing.B) {
			c := redis.NewClient(&redis.Options{Addr: srv.Addr(), ContextTimeoutEnabled: ctxTimeout})
			defer c.Close()
			ap, err := c.AutoPipeline()
			if err != nil {
				b.Fatal(err)
			}
			defer ap.Close()
			var waited time.Duration
			for b.Loop() {
				if err := ap.Ping(context.Background()).Err(); err != nil {
					b.Fatal(err)
				}
				srv.Pause(b)
				ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
				start := time.Now()
				err := ap.Get(ctx, "k").Err()
				took := time.Since(start)
				cancel()
				srv.Resume(b)
				waited += took
				b.Logf("a GET with a 50ms deadline returned after %v: %v", took.Round(time.Millisecond), err)
			}
			b.ReportMetric(float64(waited.Nanoseconds())/float64(b.N), "wait-ns")
		})
	}
}
