package redistest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

func TestStart(t *testing.T) {
	s := Start(t, WithArgs("--maxmemory", "1mb", "--maxmemory-policy", "noeviction"))
	ctx := context.Background()
	if got := s.Addr(); got != "127.0.0.1:"+strconv.Itoa(s.Port()) {
		t.Errorf("Addr() = %q; want 127.0.0.1:%d", got, s.Port())
	}
	if s.Port() >= maxPort {
		t.Errorf("Port() = %d; want < %d", s.Port(), maxPort)
	}
	c := s.Client(t)
	if got, err := c.Ping(ctx).Result(); got != "PONG" || err != nil {
		t.Fatalf("PING = %q, %v; want PONG, nil", got, err)
	}
	got := s.Do(t, "CONFIG", "GET", "maxmemory-policy")
	if m, ok := got.(map[any]any); !ok || m["maxmemory-policy"] != "noeviction" {
		t.Errorf("CONFIG GET maxmemory-policy = %#v; want noeviction", got)
	}
	if got := s.Do(t, "GET", "missing"); got != nil {
		t.Errorf("Do(GET missing) = %#v; want nil", got)
	}
}

func TestPauseResume(t *testing.T) {
	s := Start(t)
	ctx := context.Background()
	c := redis.NewClient(&redis.Options{Addr: s.Addr(), ReadTimeout: 100 * time.Millisecond, MaxRetries: -1})
	t.Cleanup(func() { c.Close() })
	if err := c.Ping(ctx).Err(); err != nil {
		t.Fatalf("PING before Pause: %v", err)
	}

	s.Pause(t)
	start := time.Now()
	err := c.Ping(ctx).Err()
	var ne net.Error
	if !errors.As(err, &ne) || !ne.Timeout() {
		t.Errorf("PING while paused: %v; want a timeout", err)
	}
	if d := time.Since(start); d < 100*time.Millisecond || d > 2*time.Second {
		t.Errorf("PING while paused took %v; want about 100ms", d)
	}

	s.Resume(t)
	if err := c.Ping(ctx).Err(); err != nil {
		t.Errorf("PING after Resume: %v", err)
	}
}

func TestKillRestart(t *testing.T) {
	s := Start(t, WithArgs("--maxmemory", "2mb"))
	port := s.Port()
	s.Do(t, "SET", "k", "v")
	s.Kill(t)
	s.Kill(t) // no-op

	c := redis.NewClient(&redis.Options{Addr: s.Addr(), MaxRetries: -1, DialerRetries: 1})
	t.Cleanup(func() { c.Close() })
	start := time.Now()
	err := c.Ping(context.Background()).Err()
	if err == nil {
		t.Errorf("PING after Kill succeeded")
	}
	t.Logf("PING after Kill: %v after %v", err, time.Since(start))

	s.Restart(t)
	if s.Port() != port {
		t.Errorf("Port() after Restart = %d; want %d", s.Port(), port)
	}
	if got := s.Do(t, "DBSIZE"); got != int64(0) {
		t.Errorf("DBSIZE after Restart = %v; want 0", got)
	}
	if got := s.Do(t, "CONFIG", "GET", "maxmemory").(map[any]any)["maxmemory"]; got != "2097152" {
		t.Errorf("maxmemory after Restart = %v; want 2097152", got)
	}
	err = c.Ping(context.Background()).Err()
	if err != nil {
		t.Errorf("PING on old client after Restart: %v", err)
	}

	s.Pause(t) // cleanup must kill a paused server too
}

func TestCluster(t *testing.T) {
	cl := StartCluster(t, 3)
	if len(cl.Nodes) != 3 || len(cl.Addrs()) != 3 {
		t.Fatalf("got %d nodes, %d addrs; want 3", len(cl.Nodes), len(cl.Addrs()))
	}
	ctx := context.Background()
	c := cl.Client(t)
	used := map[*Server]bool{}
	for i := range 50 {
		key := fmt.Sprintf("key:%d", i)
		if err := c.Set(ctx, key, i, 0).Err(); err != nil {
			t.Fatalf("SET %s: %v", key, err)
		}
		if got, err := c.Get(ctx, key).Int(); got != i || err != nil {
			t.Fatalf("GET %s = %d, %v; want %d", key, got, err, i)
		}
		// Other nodes answer MOVED, which Do reports as a failure.
		n := cl.NodeForKey(t, key)
		if got := n.Do(t, "EXISTS", key); got != int64(1) {
			t.Errorf("EXISTS %s on NodeForKey = %s: %v; want 1", key, n.Addr(), got)
		}
		used[n] = true
	}
	if len(used) != 3 {
		t.Errorf("50 keys landed on %d nodes; want 3", len(used))
	}
	var total int64
	for _, s := range cl.Nodes {
		total += s.Do(t, "DBSIZE").(int64)
	}
	if total != 50 {
		t.Errorf("DBSIZE summed over nodes = %d; want 50", total)
	}
}

func TestReplicated(t *testing.T) {
	master, replica := StartReplicated(t)
	master.Do(t, "SET", "k", "v")
	start := time.Now()
	if got := master.Do(t, "WAIT", 1, 3000); got != int64(1) {
		t.Fatalf("WAIT 1 3000 = %v after %v; want 1", got, time.Since(start))
	}
	t.Logf("WAIT took %v", time.Since(start))
	if got := replica.Do(t, "GET", "k"); got != "v" {
		t.Errorf("GET k on replica = %#v; want v", got)
	}
}
