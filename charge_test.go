package hybridlimit

import (
	"context"
	"net"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/hybridlimit/hybridlimit/internal/simnet"
	"github.com/hybridlimit/hybridlimit/internal/simredis"
)

// TestRefilledLocalSpendingIsCharged: a decision whose caller's deadline
// ends while its connection is still being dialed is admitted locally with
// the breaker closed, and charged to Redis 100 ms later (reconcileAfter).
// By then a fast share has refilled to its burst, while Redis's bucket,
// which the remote decisions since spent, has not: the charge must be what
// the local bucket spent, or a key at its limit admits it on top.
func TestRefilledLocalSpendingIsCharged(t *testing.T) {
	bubble(t, func(t *testing.T) {
		srv := simredis.New()
		defer srv.Close()
		link := simnet.NewLink()
		client := redis.NewClient(&redis.Options{
			Addr: "10.0.0.1:6379", // an IP: a hostname would be looked up
			Dialer: func(context.Context, string, string) (net.Conn, error) {
				time.Sleep(10 * time.Millisecond) // a TLS handshake, another zone
				return link.Dial(func(c net.Conn) { srv.Serve(c, 0) })
			},
		})
		defer client.Close()
		limit := Limit{Rate: 100, Burst: 10}
		lim, err := New(Config{Redis: client, Limit: limit, Instances: 1, Heartbeat: -1,
			Timeout: 20 * time.Millisecond, Breaker: BreakerConfig{Failures: 1000}})
		if err != nil {
			t.Fatal(err)
		}
		defer lim.Close()
		start := time.Now()
		short, cancel := context.WithTimeout(context.Background(), 5*time.Millisecond)
		d, err := lim.AllowN(short, "k", limit.Burst)
		cancel()
		if err != nil || !d.Allowed || d.Mode != ModeLocal {
			t.Fatalf("AllowN(burst) before the first dial ended = %+v, %v; want allowed locally", d, err)
		}
		admitted := limit.Burst
		// A key at its limit: a decision every millisecond, on Redis, past
		// the charge.
		ctx := context.Background()
		for time.Since(start) < 300*time.Millisecond {
			time.Sleep(time.Millisecond)
			d, err := lim.Allow(ctx, "k")
			if err != nil {
				t.Fatal(err)
			}
			if d.Allowed {
				admitted++
			}
		}
		elapsed := time.Since(start)
		// The bucket's bound, and a token of rounding.
		bound := float64(limit.Burst) + limit.Rate*elapsed.Seconds() + 1
		if float64(admitted) > bound {
			t.Errorf("%d admitted in %v; want at most %.0f: the local admissions were not charged", admitted, elapsed, bound)
		}
		t.Logf("%d admitted in %v (bound %.0f)", admitted, elapsed, bound)
	})
}
