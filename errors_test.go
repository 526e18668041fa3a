package hybridlimit

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
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

// TestRefusedHandshakeOpensBreaker: rotated credentials (the client's
// password no longer Redis's) fail every connection's handshake with
// WRONGPASS. Taken for a healthy node's answer about one key, they kept
// the breaker closed: every decision dialed a new connection and went to
// the failure policy, with an Error line each (200 decisions, 203
// connections, 203 lines). The breaker now opens: decisions go local at
// once, the prober alone dials, once an open period.
func TestRefusedHandshakeOpensBreaker(t *testing.T) {
	m := miniredis.RunT(t)
	m.RequireUserAuth("app", "new")
	c := redis.NewClient(&redis.Options{Addr: m.Addr(), Username: "app", Password: "old"})
	t.Cleanup(func() { c.Close() })
	var logs syncBuffer
	lim := newLimiter(t, Config{Redis: c, Limit: PerSecond(1000), Instances: 1, Heartbeat: -1,
		Logger: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn}))})
	time.Sleep(50 * time.Millisecond) // the first contact's own dials
	before := m.TotalConnectionCount()
	for range 200 {
		if d, err := lim.Allow(context.Background(), "k"); err != nil || d.Mode == ModeRemote {
			t.Fatalf("Allow = %+v, %v; want the failure policy's decision", d, err)
		}
	}
	if st := lim.Stats().Breakers[m.Addr()]; st == "closed" {
		t.Errorf("breaker %s after 200 refused handshakes; want it open", st)
	}
	if n := m.TotalConnectionCount() - before; n > 20 {
		t.Errorf("%d connections dialed for 200 decisions; want the breaker to stop them", n)
	}
	out := logs.String()
	if n := strings.Count(out, "level=ERROR"); n > 0 {
		t.Errorf("%d Error lines; want none, the breaker's Warn says it:\n%s", n, out)
	}
	if !strings.Contains(out, "WRONGPASS") {
		t.Errorf("no log line names the refusal:\n%s", out)
	}
}

// TestProxyErrorKeepsBreakerOpen: behind a proxy (Envoy's redis_proxy, a
// managed Redis's endpoint), Redis away answers the proxy's own error, not
// a Redis state. Taken for a healthy node's answer, a probe answered so
// closed the open breaker while Redis was still away, and every decision
// then paid a round trip for the failure policy's answer.
func TestProxyErrorKeepsBreakerOpen(t *testing.T) {
	m, c := miniClient(t)
	lim := newLimiter(t, Config{Redis: c, Limit: PerSecond(100), Instances: 1, Heartbeat: -1,
		Breaker: BreakerConfig{Failures: 2, OpenFor: 50 * time.Millisecond, Jitter: -1}})
	ctx := context.Background()
	m.SetError("no upstream host")
	for range 2 {
		lim.Allow(ctx, "k")
	}
	if st := lim.Stats().Breakers[m.Addr()]; st != "open" {
		t.Fatalf("breaker %s after two proxy errors; want open", st)
	}
	time.Sleep(300 * time.Millisecond) // several probes, each answered by the proxy
	if st := lim.Stats().Breakers[m.Addr()]; st == "closed" {
		t.Errorf("breaker %s while the proxy still answers for a Redis away; want it not closed", st)
	}
	m.SetError("")
	time.Sleep(300 * time.Millisecond)
	if d, err := lim.Allow(ctx, "k"); err != nil || d.Mode != ModeRemote {
		t.Errorf("Allow once Redis is back = %+v, %v; want remote", d, err)
	}
}

// panicObserver panics once, on the first breaker opening it is told of:
// a bug in a user's Observer.
type panicObserver struct{ armed atomic.Bool }

func (o *panicObserver) ObserveDecision(DecisionEvent) {}
func (o *panicObserver) ObserveBreaker(e BreakerEvent) {
	if e.To == "open" && o.armed.CompareAndSwap(true, false) {
		panic("observer bug")
	}
}

// TestPanickingObserverLeavesProberAwake: an Observer that panics on a
// breaker's opening (the panic recovered by the caller, as net/http does)
// took the prober's wake-up with it: the prober, asleep while every
// breaker was closed, never probed, and decisions stayed local after
// Redis was back (2 s later, with OpenFor 50 ms).
func TestPanickingObserverLeavesProberAwake(t *testing.T) {
	m, c := miniClient(t)
	obs := &panicObserver{}
	obs.armed.Store(true)
	lim := newLimiter(t, Config{Redis: c, Limit: PerSecond(100), Instances: 1, Heartbeat: -1, Observer: obs,
		Logger:  slog.New(slog.DiscardHandler),
		Breaker: BreakerConfig{Failures: 2, OpenFor: 50 * time.Millisecond, Jitter: -1}})
	ctx := context.Background()
	time.Sleep(50 * time.Millisecond) // the prober sleeps: every breaker closed
	m.SetError("LOADING Redis is loading the dataset in memory")
	panicked := false
	for range 2 {
		func() {
			defer func() { panicked = panicked || recover() != nil }()
			lim.Allow(ctx, "k")
		}()
	}
	if !panicked {
		t.Fatal("the Observer never panicked: the test proves nothing")
	}
	m.SetError("")
	time.Sleep(500 * time.Millisecond)
	if d, err := lim.Allow(ctx, "k"); err != nil || d.Mode != ModeRemote {
		t.Errorf("Allow 500 ms after Redis is back (OpenFor 50 ms) = %+v, %v; want remote", d, err)
	}
}

// TestOutageLogsTwoLines: an outage is one Warn line when the breaker
// opens and one Info line when it closes again; the open periods and
// probes between go at Debug. At Warn each of them was a line, about
// seven a second per node and instance for the whole outage.
func TestOutageLogsTwoLines(t *testing.T) {
	withRedis(t, func(t *testing.T, r *testRedis) {
		var logs syncBuffer
		lim := newLimiter(t, Config{Redis: r.client(t), Limit: PerSecond(100), Instances: 1, Heartbeat: -1, Timeout: 50 * time.Millisecond,
			Logger: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelInfo}))})
		ctx := context.Background()
		lim.Allow(ctx, "k")
		r.pause(t)
		for range 100 { // 10 s of decisions into a paused Redis
			lim.Allow(ctx, "k")
			time.Sleep(100 * time.Millisecond)
		}
		r.resume(t)
		time.Sleep(2 * time.Second)
		if d, err := lim.Allow(ctx, "k"); err != nil || d.Mode != ModeRemote {
			t.Fatalf("Allow after the outage = %+v, %v; want remote", d, err)
		}
		out := logs.String()
		warn, info := strings.Count(out, "level=WARN msg=\"hybridlimit: breaker state changed\""), strings.Count(out, "level=INFO msg=\"hybridlimit: breaker state changed\"")
		if warn != 1 || info != 1 || !strings.Contains(out, "from=closed to=open") || !strings.Contains(out, "to=closed") {
			t.Errorf("a 10 s outage logged %d Warn and %d Info breaker lines; want one of each, the opening and the closing:\n%s", warn, info, out)
		}
	})
}
