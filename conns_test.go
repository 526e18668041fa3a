package hybridlimit

import (
	"context"
	"net"
	"sync"
	"testing"
	"testing/synctest"

	"github.com/redis/go-redis/v9"

	"github.com/hybridlimit/hybridlimit/internal/simnet"
	"github.com/hybridlimit/hybridlimit/internal/simredis"
)

// TestDecisionsSurviveResetConnsOverTLS: after a reset (a failover, a
// restart, a proxy's reset), a client that cannot see the reset before it
// uses a pooled connection (go-redis over TLS cannot: a tls.Conn is not a
// socket it can peek at) fails the write of the next command on each of
// them. Such a decision did not run, so it goes again on the next
// connection; none may fall to the local share.
func TestDecisionsSurviveResetConnsOverTLS(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
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
