package hybridlimit

import (
	"context"
	"net"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/hybridlimit/hybridlimit/internal/simnet"
	"github.com/hybridlimit/hybridlimit/internal/simredis"
	"github.com/hybridlimit/hybridlimit/remote"
)

// TestDecisionsSurviveResetConnsOverTLS: after a reset (a failover, a
// restart, a proxy's reset), a client that cannot see the reset before it
// uses a pooled connection (go-redis over TLS cannot: a tls.Conn is not a
// socket it can peek at) fails the write of the next command on each of
// them. Such a decision did not run, so it goes again on the next
// connection; none may fall to the local share.
func TestDecisionsSurviveResetConnsOverTLS(t *testing.T) {
	bubble(t, func(t *testing.T) {
		srv := simredis.New()
		defer srv.Close()
		link := simnet.NewLink()
		client := redis.NewClient(&redis.Options{
			Addr: "10.0.0.1:6379", // an IP: a hostname would be looked up
			Dialer: func(context.Context, string, string) (net.Conn, error) {
				c, err := link.Dial(func(c net.Conn) { srv.Serve(c, 0) })
				if err != nil {
					return nil, err
				}
				return struct{ net.Conn }{c}, nil // no SyscallConn, as a tls.Conn
			},
		})
		defer client.Close()
		lim, err := New(Config{Redis: client, Limit: PerSecond(1000), Instances: 1})
		if err != nil {
			t.Fatal(err)
		}
		defer lim.Close()
		ctx := context.Background()
		// Several decisions at once leave several connections pooled.
		var wg sync.WaitGroup
		for range 16 {
			wg.Go(func() {
				if _, err := lim.Allow(ctx, "k"); err != nil {
					t.Error(err)
				}
			})
		}
		wg.Wait()
		pooled := link.Dials()
		if pooled < 2 {
			t.Fatalf("%d connections pooled, want several", pooled)
		}
		link.Reset()
		for i := range 2 * pooled {
			d, err := lim.Allow(ctx, "k")
			if err != nil || d.Mode != ModeRemote || !d.Allowed {
				t.Fatalf("decision %d after the reset: %+v, %v; want allowed by Redis", i, d, err)
			}
		}
	})
}

// TestChargesAppliedOnce: with replies slower than the budget, every
// decision times out and is decided locally, and every charge for that
// spending runs in Redis while its instance hears nothing back, so each
// is sent again at the next reconciliation. Redis must apply the spending
// once: the charges it applied add up to at most what was admitted
// locally.
func TestChargesAppliedOnce(t *testing.T) {
	bubble(t, func(t *testing.T) {
		srv := simredis.New()
		defer srv.Close()
		var mu sync.Mutex
		var charged int64 // units Redis took in charges
		srv.Hook = func(_ int, _, _ string, argv []string, reply any) {
			r, _ := reply.([]any)
			if len(argv) > 4 && argv[4] == "charge" && len(r) > 0 && r[0] != int64(4) {
				units, _ := strconv.ParseInt(argv[3], 10, 64)
				mu.Lock()
				charged += units
				mu.Unlock()
			}
		}
		link := simnet.NewLink()
		client := redis.NewClient(&redis.Options{
			Addr:   "10.0.0.1:6379", // an IP: a hostname would be looked up
			Dialer: link.Dialer(func(c net.Conn) { srv.Serve(c, 0) }),
		})
		defer client.Close()
		lim, err := New(Config{Redis: client, Limit: PerSecond(10), Instances: 1, Timeout: 50 * time.Millisecond,
			Breaker: BreakerConfig{Failures: 1000}, Heartbeat: -1})
		if err != nil {
			t.Fatal(err)
		}
		defer lim.Close()
		ctx := context.Background()
		if d, err := lim.Allow(ctx, "k"); err != nil || d.Mode != ModeRemote {
			t.Fatalf("first decision: %+v, %v", d, err)
		}
		link.SetLatency(80 * time.Millisecond)
		local := int64(0)
		for range 10 {
			d, err := lim.AllowN(ctx, "k", 3)
			if err != nil {
				t.Fatal(err)
			}
			if d.Mode == ModeLocal && d.Allowed {
				local += 3
			}
			time.Sleep(150 * time.Millisecond) // a reconciliation between decisions
		}
		link.SetLatency(0)
		time.Sleep(time.Second)
		rl, _ := remote.NewLimit(10, 10)
		mu.Lock()
		got := float64(charged) / float64(rl.P)
		mu.Unlock()
		if local == 0 || got > float64(local)+0.5 {
			t.Errorf("Redis applied charges of %.2f tokens for %d admitted locally; want at most those", got, local)
		}
		t.Logf("%d tokens admitted locally, %.2f charged", local, got)
	})
}
