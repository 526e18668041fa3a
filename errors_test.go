package hybridlimit

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"
)

// redis6OOM is what Redis 6 answers a script whose first write meets
// maxmemory under noeviction: the OOM comes wrapped in the script's error.
const redis6OOM = "ERR Error running script (call to f_6e1d): @user_script:57: @user_script: 57: -OOM command not allowed when used memory > 'maxmemory'."

// TestRedis6ScriptOOMOpensBreaker: a Redis 6 node out of memory refuses
// every decision's write. It cannot decide: the breaker must open (no
// round trip per decision, one log line per transition rather than an
// error per decision), and a probe must not close it while the node is
// still out of memory.
func TestRedis6ScriptOOMOpensBreaker(t *testing.T) {
	m, c := miniClient(t)
	// A budget no busy machine misses: the first decision must be Redis's.
	lim := newLimiter(t, Config{Redis: c, Limit: Limit{Rate: 100, Burst: 100}, Heartbeat: -1, Instances: 1,
		Timeout: time.Second, Breaker: BreakerConfig{Failures: 3, OpenFor: 20 * time.Millisecond}})
	ctx := context.Background()
	if d, err := lim.Allow(ctx, "k"); err != nil || d.Mode != ModeRemote {
		t.Fatalf("Allow = %+v, %v; want Redis's decision", d, err)
	}
	m.SetError(redis6OOM)
	for range 10 {
		if _, err := lim.Allow(ctx, "k"); err != nil {
			t.Fatalf("Allow on an OOM node = %v; want the failure policy's decision", err)
		}
	}
	if st := lim.Stats().Breakers; st[c.Options().Addr] == "closed" {
		t.Errorf("breaker %v after 10 decisions refused with %q; want it open", st, redis6OOM)
	}
	// Probes run every OpenFor; none may close the breaker while the node
	// still refuses writes.
	time.Sleep(100 * time.Millisecond)
	if d, _ := lim.Allow(ctx, "k"); d.Mode == ModeRemote {
		t.Errorf("decision %+v on a node still out of memory; want the failure policy's", d)
	}
}

// syncBuffer is a log destination safe for the limiter's goroutines.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// TestMisconfiguredClientSaysWhy: a plain client pointed at a Cluster
// node (a cluster-mode endpoint configured as a standalone Redis) gets
// MOVED for the keys of other nodes' slots, for good: the breaker opens
// and its probe, on such a key, never closes it. The log must say why,
// not only that a breaker changed state: the failures' errors are logged
// nowhere else.
func TestMisconfiguredClientSaysWhy(t *testing.T) {
	m, c := miniClient(t)
	var logs syncBuffer
	lim := newLimiter(t, Config{Redis: c, Limit: Limit{Rate: 100, Burst: 100}, Heartbeat: -1, Instances: 1,
		Breaker: BreakerConfig{Failures: 3, OpenFor: 20 * time.Millisecond},
		Logger:  slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn}))})
	m.SetError("MOVED 3999 10.0.0.7:6379")
	for range 5 {
		if _, err := lim.Allow(context.Background(), "k"); err != nil {
			t.Fatalf("Allow = %v; want the failure policy's decision", err)
		}
	}
	out := logs.String()
	if !strings.Contains(out, "to=open") {
		t.Fatalf("no breaker opening logged:\n%s", out)
	}
	if !strings.Contains(out, "MOVED") {
		t.Errorf("the log never says why the breaker opened:\n%s", out)
	}
	if n := strings.Count(out, "level=ERROR msg=\"hybridlimit: Redis answered MOVED"); n != 1 {
		t.Errorf("logged the misconfiguration %d times; want once:\n%s", n, out)
	}
}

// TestMisconfiguredClientBetweenAnswers: a plain client of one node of a
// Cluster, whose own keys answer between the MOVED of the others' (so the
// breaker never opens): the misconfiguration is logged once, at Error.
// Before, the decisions on the other nodes' keys went to the failure
// policy with no log at all (190 of 300 on a real Cluster).
func TestMisconfiguredClientBetweenAnswers(t *testing.T) {
	m, c := miniClient(t)
	var logs syncBuffer
	lim := newLimiter(t, Config{Redis: c, Limit: Limit{Rate: 100, Burst: 100}, Heartbeat: -1, Instances: 1,
		Logger: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn}))})
	for i := range 12 {
		if i%2 == 0 {
			m.SetError("MOVED 3999 10.0.0.7:6379")
		} else {
			m.SetError("")
		}
		if _, err := lim.Allow(context.Background(), "k"); err != nil {
			t.Fatalf("Allow = %v; want a decision", err)
		}
	}
	out := logs.String()
	if strings.Contains(out, "to=open") {
		t.Fatalf("the breaker opened; the test wants answers between the MOVED:\n%s", out)
	}
	if n := strings.Count(out, "level=ERROR msg=\"hybridlimit: Redis answered MOVED"); n != 1 {
		t.Errorf("logged the misconfiguration %d times; want once:\n%s", n, out)
	}
}
