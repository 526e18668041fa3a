package simnet_test

import (
	"context"
	"net"
	"testing"
	"testing/synctest"
	"time"

	"github.com/hybridlimit/hybridlimit/internal/simnet"
	"github.com/hybridlimit/hybridlimit/internal/simredis"
	"github.com/redis/go-redis/v9"
)

// TestResetConnsDroppedFromPool: over TCP, go-redis asks the kernel about
// each pooled connection before it uses one, and drops those the peer
// reset; a Conn must answer the same, or every connection a reset broke
// fails one command after the reset.
func TestResetConnsDroppedFromPool(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		link, c := newClient(t)
		ctx := context.Background()
		// Fill the pool with several connections: with a latency, each
		// ping waits for its reply on its own connection while the others
		// start (the server answers as it reads, so without one the pings
		// could run one after another on one connection).
		link.SetLatency(time.Millisecond)
		done := make(chan error, 8)
		for range 8 {
			go func() { done <- c.Ping(ctx).Err() }()
		}
		for range 8 {
			if err := <-done; err != nil {
				t.Fatal(err)
			}
		}
		if got := link.Dials(); got < 2 {
			t.Fatalf("dials: %d, want several pooled connections", got)
		}
		link.Reset()
		for i := range 8 {
			if err := c.Ping(ctx).Err(); err != nil {
				t.Fatalf("ping %d after the reset: %v", i, err)
			}
		}
	})
}

// TestLatencyOncePerReply: a link's latency delays each reply once, as a
// longer path does, whatever the number of writes the server makes of it.
func TestLatencyOncePerReply(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		link, c := newClient(t)
		ctx := context.Background()
		if err := c.Ping(ctx).Err(); err != nil {
			t.Fatal(err)
		}
		link.SetLatency(15 * time.Millisecond)
		for _, cmd := range []redis.Cmder{redis.NewStatusCmd(ctx, "PING"), redis.NewCmd(ctx, "EVAL", "return {1, 2, 3}", "0")} {
			start := time.Now()
			_ = c.Process(ctx, cmd)
			if took := time.Since(start); took != 15*time.Millisecond {
				t.Errorf("%v took %v, want the link's latency, 15ms", cmd.Args()[0], took)
			}
		}
	})
}

// TestResetNew: while ResetNew is on, a dial succeeds and its connection
// is reset at once, new ones included, as behind a proxy that accepts and
// sends a TCP RST; once it is off, connections work again.
func TestResetNew(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		link, c := newClient(t)
		ctx := context.Background()
		link.ResetNew(true)
		for i := range 3 {
			if err := c.Ping(ctx).Err(); !simnet.ErrReset(err) {
				t.Fatalf("ping %d while new connections are reset: %v; want a reset", i, err)
			}
		}
		if got := link.Dials(); got != 3 {
			t.Errorf("dials: %d; want 3, each accepted and then reset", got)
		}
		link.ResetNew(false)
		if err := c.Ping(ctx).Err(); err != nil {
			t.Fatalf("ping after ResetNew(false): %v", err)
		}
	})
}

// newClient returns a new link to a fresh simulated Redis and a client
// that dials it, both closed when t ends: RESP2, and no retries, as the
// limiter's scripts are never retried.
func newClient(t *testing.T) (*simnet.Link, *redis.Client) {
	srv := simredis.New()
	t.Cleanup(srv.Close) // after the client's Close, registered next
	link := simnet.NewLink()
	c := redis.NewClient(&redis.Options{
		Addr:       "10.0.0.1:6379", // an IP: a hostname would be looked up
		Protocol:   2,
		MaxRetries: -1,
		Dialer:     link.Dialer(func(c net.Conn) { srv.Serve(c, 0) }),
	})
	t.Cleanup(func() { c.Close() })
	return link, c
}
