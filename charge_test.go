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
		client := slowDialing(t)
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

// TestRefundedLocalSpendingIsNotCharged: a decision admitted locally with
// the breaker closed (its caller's deadline ended during the first dial)
// and then refunded (a later rule refused the request, as httplimit and
// grpclimit do) spent nothing: Redis must not be charged for it.
func TestRefundedLocalSpendingIsNotCharged(t *testing.T) {
	bubble(t, func(t *testing.T) {
		client := slowDialing(t)
		limit := Limit{Rate: 0.1, Burst: 10}
		lim, err := New(Config{Redis: client, Limit: limit, Instances: 1, Heartbeat: -1,
			Timeout: 20 * time.Millisecond, Breaker: BreakerConfig{Failures: 1000}})
		if err != nil {
			t.Fatal(err)
		}
		defer lim.Close()
		short, cancel := context.WithTimeout(context.Background(), 5*time.Millisecond)
		d, err := lim.AllowN(short, "k", 3)
		cancel()
		if err != nil || !d.Allowed || d.Mode != ModeLocal {
			t.Fatalf("AllowN(3) before the first dial ended = %+v, %v; want allowed locally", d, err)
		}
		if err := lim.Refund(context.Background(), "k", d, 3); err != nil {
			t.Fatal(err)
		}
		time.Sleep(300 * time.Millisecond) // past the reconciliation
		d, err = lim.AllowN(context.Background(), "k", limit.Burst)
		if err != nil || d.Mode != ModeRemote {
			t.Fatalf("AllowN(burst) = %+v, %v; want a decision of Redis", d, err)
		}
		if !d.Allowed {
			t.Errorf("AllowN(burst) on Redis denied, %d left: the refunded local admission was charged", d.Remaining)
		}
	})
}

// slowDialing returns a client of a simulated Redis whose every dial takes
// 10 ms (a TLS handshake, another zone), closed when t ends.
func slowDialing(t *testing.T) *redis.Client {
	srv := simredis.New()
	t.Cleanup(srv.Close)
	link := simnet.NewLink()
	client := redis.NewClient(&redis.Options{
		Addr: "10.0.0.1:6379", // an IP: a hostname would be looked up
		Dialer: func(context.Context, string, string) (net.Conn, error) {
			time.Sleep(10 * time.Millisecond)
			return link.Dial(func(c net.Conn) { srv.Serve(c, 0) })
		},
	})
	t.Cleanup(func() { client.Close() })
	return client
}
