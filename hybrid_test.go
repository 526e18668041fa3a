package hybridlimit

import (
	"context"
	"errors"
	"math"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"go.uber.org/goleak"

	"github.com/hybridlimit/hybridlimit/internal/redistest"
)

func TestMain(m *testing.M) {
	// Tests that point a client at a closed port make go-redis log every
	// failed dial; the tests assert what matters.
	redis.SetLogger(quiet{})
	// go-redis redials a refused address once a second from a goroutine of
	// its own that a closed client does not stop: not the limiter's.
	goleak.VerifyTestMain(m, goleak.IgnoreAnyFunction("github.com/redis/go-redis/v9/internal/pool.(*ConnPool).tryDial"))
}

type quiet struct{}

func (quiet) Printf(context.Context, string, ...any) {}

// newLimiter returns a Limiter closed by t.Cleanup, with a per-test prefix.
func newLimiter(t testing.TB, cfg Config) *Limiter {
	t.Helper()
	if cfg.Prefix == "" {
		cfg.Prefix = t.Name() + ":"
	}
	lim, err := New(cfg)
	if err != nil {
		t.Fatalf("New(%+v) = %v", cfg, err)
	}
	t.Cleanup(func() { lim.Close() })
	// Tests start on a limiter whose first contact with Redis is over
	// (or has lasted coldFor), so that the faults they inject next are
	// judged as faults; TestColdStart is the one that does not wait.
	select {
	case <-lim.warmed:
	case <-time.After(coldFor):
	}
	return lim
}

func miniClient(t *testing.T) (*miniredis.Miniredis, *redis.Client) {
	t.Helper()
	m := miniredis.RunT(t)
	c := redis.NewClient(&redis.Options{Addr: m.Addr()})
	t.Cleanup(func() { c.Close() })
	return m, c
}

func TestNewRejectsBadConfig(t *testing.T) {
	c := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
	defer c.Close()
	ok := Config{Redis: c, Limit: PerSecond(10)}
	tests := []struct {
		field string
		edit  func(*Config)
	}{
		{"Redis", func(c *Config) { c.Redis = nil }},
		{"Limit.Rate", func(c *Config) { c.Limit.Rate = 0 }},
		{"Limit.Rate", func(c *Config) { c.Limit.Rate = -1 }},
		{"Limit.Rate", func(c *Config) { c.Limit.Rate = math.NaN() }},
		{"Limit.Rate", func(c *Config) { c.Limit.Rate = math.Inf(1) }},
		{"Limit.Burst", func(c *Config) { c.Limit.Burst = 0 }},
		{"Limit.Burst", func(c *Config) { c.Limit.Burst = -5 }},
		{"Limit", func(c *Config) { c.Limit = Limit{Rate: 1.0 / (365 * 86400), Burst: 1e9} }},
		{"Instances", func(c *Config) { c.Instances = -1 }},
		{"Timeout", func(c *Config) { c.Timeout = -time.Second }},
		{"OnFailure", func(c *Config) { c.OnFailure = 7 }},
		{"Breaker.Failures", func(c *Config) { c.Breaker.Failures = -1 }},
		{"Breaker.OpenFor", func(c *Config) { c.Breaker.OpenFor = -1 }},
		{"Breaker.Jitter", func(c *Config) { c.Breaker.Jitter = math.NaN() }},
		{"Breaker.Probes", func(c *Config) { c.Breaker.Probes = -1 }},
		{"MaxLocalKeys", func(c *Config) { c.MaxLocalKeys = -1 }},
		{"Heartbeat", func(c *Config) { c.Heartbeat = time.Nanosecond }},
		{"Lease", func(c *Config) { c.Lease = -1 }},
		{"LeaseFor", func(c *Config) { c.LeaseFor = -time.Second }},
	}
	if strconv.IntSize == 64 {
		// The breaker counts in uint32: 1<<32 must not wrap to 0, the
		// default.
		big := int(uint64(1) << 32)
		tests = append(tests, []struct {
			field string
			edit  func(*Config)
		}{
			{"Breaker.Failures", func(c *Config) { c.Breaker.Failures = big }},
			{"Breaker.Probes", func(c *Config) { c.Breaker.Probes = big }},
		}...)
	}
	for _, tt := range tests {
		cfg := ok
		tt.edit(&cfg)
		lim, err := New(cfg)
		if !errors.Is(err, ErrInvalidConfig) || !strings.Contains(err.Error(), tt.field) {
			t.Errorf("New with bad %s = %v, %v; want ErrInvalidConfig naming %s", tt.field, lim, err, tt.field)
		}
		if lim != nil {
			lim.Close()
		}
	}
}

func TestAllowNRejectsBadInput(t *testing.T) {
	_, c := miniClient(t)
	lim := newLimiter(t, Config{Redis: c, Limit: PerSecond(10)})
	ctx := context.Background()
	tests := []struct {
		key  string
		n    int64
		want error
	}{
		{"", 1, ErrInvalidKey},
		{strings.Repeat("k", MaxKeyLen+1), 1, ErrInvalidKey},
		{"k", 0, ErrInvalidN},
		{"k", -1, ErrInvalidN},
		{"k", 11, ErrInvalidN},
		{"k", math.MaxInt64, ErrInvalidN},
	}
	for _, tt := range tests {
		d, err := lim.AllowN(ctx, tt.key, tt.n)
		if !errors.Is(err, tt.want) || d.Allowed {
			t.Errorf("AllowN(%.10q, %d) = %+v, %v; want %v", tt.key, tt.n, d, err, tt.want)
		}
	}
	if d, err := lim.AllowN(ctx, strings.Repeat("k", MaxKeyLen), 10); err != nil || !d.Allowed {
		t.Errorf("AllowN(key of MaxKeyLen, burst) = %+v, %v; want allowed", d, err)
	}
}

func TestStrings(t *testing.T) {
	for v, want := range map[interface{ String() string }]string{
		ModeRemote: "remote", ModeLocal: "local", ModeFailOpen: "fail-open", ModeFailClosed: "fail-closed",
		Mode(9): "Mode(9)", FailLocal: "FailLocal", FailOpen: "FailOpen", FailClosed: "FailClosed",
		FailurePolicy(9): "FailurePolicy(9)", PerMinute(6): "0.1/s burst 6",
	} {
		if got := v.String(); got != want {
			t.Errorf("%#v.String() = %q; want %q", v, got, want)
		}
	}
}

// allow is one decision and what it must return.
type allow struct {
	n    int64
	want Decision
}

func run(t *testing.T, lim *Limiter, key string, steps []allow) {
	t.Helper()
	for i, s := range steps {
		s.want.Limit = lim.Limit()
		got, err := lim.AllowN(context.Background(), key, s.n)
		if err != nil || got != s.want {
			t.Errorf("step %d: AllowN(%q, %d) = %+v, %v; want %+v", i, key, s.n, got, err, s.want)
		}
	}
}

// TestContract runs one table against the remote path and the local path:
// with one instance both must give the same answers.
func TestContract(t *testing.T) {
	ms := time.Millisecond
	steps := func(mode Mode) []allow {
		return []allow{
			{1, Decision{Allowed: true, Granted: 1, Remaining: 9, ResetAfter: 100 * ms, Mode: mode}},
			{9, Decision{Allowed: true, Granted: 9, Remaining: 0, ResetAfter: time.Second, Mode: mode}},
			{1, Decision{Allowed: false, Remaining: 0, RetryAfter: 100 * ms, ResetAfter: time.Second, Mode: mode}},
			{5, Decision{Allowed: false, Remaining: 0, RetryAfter: 500 * ms, ResetAfter: time.Second, Mode: mode}},
		}
	}
	t.Run("remote", func(t *testing.T) {
		m, c := miniClient(t)
		m.SetTime(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
		// miniredis's clock stands still while ours runs: answers from
		// what Redis said earlier would differ in RetryAfter.
		lim := newLimiter(t, Config{Redis: c, Limit: PerSecond(10), noCache: true})
		run(t, lim, "k", steps(ModeRemote))
	})
	t.Run("local", func(t *testing.T) {
		// Nothing listens on port 1: every call fails and FailLocal decides.
		c := refused(t)
		now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
		lim := newLimiter(t, Config{Redis: c, Limit: PerSecond(10), Instances: 1, now: func() time.Time { return now }})
		run(t, lim, "k", steps(ModeLocal))
	})
	t.Run("fail-open", func(t *testing.T) {
		c := refused(t)
		lim := newLimiter(t, Config{Redis: c, Limit: PerSecond(10), OnFailure: FailOpen})
		run(t, lim, "k", []allow{
			{10, Decision{Allowed: true, Granted: 10, Mode: ModeFailOpen}},
			{10, Decision{Allowed: true, Granted: 10, Mode: ModeFailOpen}},
		})
	})
}

func TestLocalShare(t *testing.T) {
	c := refused(t)
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	clock := func() time.Time { return now }
	tests := []struct {
		limit     Limit
		instances int
		burst     int64 // tokens this instance may take at once
	}{
		{PerSecond(100), 3, 33},
		{PerSecond(100), 1, 100},
		{PerSecond(2), 5, 0}, // 0.4 of a token: none until the refill makes one
		{PerMinute(600), 4, 150},
	}
	for _, tt := range tests {
		lim := newLimiter(t, Config{Redis: c, Limit: tt.limit, Instances: tt.instances, now: clock})
		key := tt.limit.String()
		allowed := int64(0)
		for range 2 * tt.limit.Burst {
			d, err := lim.Allow(context.Background(), key)
			if err != nil || d.Mode != ModeLocal {
				t.Fatalf("Allow = %+v, %v; want a local decision", d, err)
			}
			if d.Allowed {
				allowed++
			}
		}
		if allowed != tt.burst {
			t.Errorf("%v over %d instances: local burst %d; want %d", tt.limit, tt.instances, allowed, tt.burst)
		}
	}
}

// TestExactCounts: 3 instances × 16 goroutines spend one bucket of 1000 on
// a real redis-server: exactly 1000 are allowed, all by Redis.
func TestExactCounts(t *testing.T) {
	srv := redistest.Start(t)
	const instances, workers, attempts = 3, 16, 3200
	var lims []*Limiter
	for range instances {
		lims = append(lims, newLimiter(t, Config{
			Redis: srv.Client(t), Limit: Limit{Rate: 1e-3, Burst: 1000}, Instances: instances,
			// Exactness is the point here, not the time budget: a loaded
			// CI machine must not turn a slow answer into a local one.
			Timeout: 5 * time.Second, Prefix: "exact:",
		}))
	}
	allowed, modes := spend(t, lims, "bucket", workers, attempts)
	t.Logf("allowed %d of %d, %d decided by Redis", allowed, attempts, modes[ModeRemote])
	if allowed != 1000 || modes[ModeRemote] != attempts {
		t.Errorf("allowed %d with %d remote decisions of %d; want exactly 1000, all remote",
			allowed, modes[ModeRemote], attempts)
	}
}

// spend has workers goroutines for each of lims decide one event at a time
// on key until attempts decisions were made in all, and returns how many
// were allowed and how many each mode decided.
func spend(t *testing.T, lims []*Limiter, key string, workers int, attempts int64) (allowed int64, modes map[Mode]int64) {
	t.Helper()
	var ok, tried atomic.Int64
	var byMode [ModeLease + 1]atomic.Int64
	var wg sync.WaitGroup
	for _, lim := range lims {
		for range workers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for tried.Add(1) <= attempts {
					d, err := lim.Allow(context.Background(), key)
					if err != nil {
						t.Errorf("Allow = %v", err)
						return
					}
					byMode[d.Mode].Add(1)
					if d.Allowed {
						ok.Add(1)
					}
				}
			}()
		}
	}
	wg.Wait()
	modes = map[Mode]int64{}
	for m := range byMode {
		if n := byMode[m].Load(); n > 0 {
			modes[Mode(m)] = n
		}
	}
	return ok.Load(), modes
}

// TestNoScriptUnderLoad: SCRIPT FLUSH while decisions run costs neither a
// denial nor a local decision nor a breaker trip.
func TestNoScriptUnderLoad(t *testing.T) {
	srv := redistest.Start(t)
	c := srv.Client(t)
	lim := newLimiter(t, Config{Redis: c, Limit: Limit{Rate: 1e-3, Burst: 500}, Timeout: 5 * time.Second})
	stop := make(chan struct{})
	flushed := make(chan int)
	go func() {
		n := 0
		defer func() { flushed <- n }()
		for {
			select {
			case <-stop:
				return
			case <-time.After(10 * time.Millisecond):
				srv.Do(t, "SCRIPT", "FLUSH")
				n++
			}
		}
	}()
	var allowed, nonRemote atomic.Int64
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 100 {
				d, err := lim.Allow(context.Background(), "k")
				if err != nil {
					t.Errorf("Allow = %v", err)
					return
				}
				if d.Mode != ModeRemote {
					nonRemote.Add(1)
				}
				if d.Allowed {
					allowed.Add(1)
				}
			}
		}()
	}
	wg.Wait()
	close(stop)
	n := <-flushed
	t.Logf("%d SCRIPT FLUSH during 800 decisions", n)
	if allowed.Load() != 500 || nonRemote.Load() != 0 || n == 0 {
		t.Errorf("allowed %d, %d not remote, %d flushes; want 500, 0, > 0", allowed.Load(), nonRemote.Load(), n)
	}
}

// TestPausedRedis: with a client built from default options (no context
// deadlines on reads, 3 retries), a paused Redis costs no decision more
// than the time budget; decisions go local while it is paused and back to
// Redis after it resumes.
func TestPausedRedis(t *testing.T) {
	srv := redistest.Start(t)
	c := redis.NewClient(&redis.Options{Addr: srv.Addr()}) // defaults on purpose
	defer c.Close()
	const budget = 50 * time.Millisecond
	lim := newLimiter(t, Config{Redis: c, Limit: PerSecond(1000), Timeout: budget,
		Breaker: BreakerConfig{OpenFor: 200 * time.Millisecond}})
	ctx := context.Background()
	if d, err := lim.Allow(ctx, "k"); err != nil || d.Mode != ModeRemote {
		t.Fatalf("Allow before the pause = %+v, %v; want remote", d, err)
	}

	srv.Pause(t)
	paused := true
	defer func() {
		if paused {
			srv.Resume(t)
		}
	}()
	var slowest time.Duration
	modes := map[Mode]int{}
	for range 50 {
		start := time.Now()
		d, err := lim.Allow(ctx, "k")
		took := time.Since(start)
		slowest = max(slowest, took)
		if err != nil {
			t.Fatalf("Allow while paused = %v", err)
		}
		modes[d.Mode]++
	}
	t.Logf("paused: slowest decision %v, modes %v", slowest, modes)
	// The budget plus room for a loaded machine running the race detector;
	// a socket time-out would be seconds.
	if limit := budget + 100*time.Millisecond; slowest > limit {
		t.Errorf("slowest decision while paused took %v; want at most %v", slowest, limit)
	}
	if modes[ModeLocal] != 50 {
		t.Errorf("modes while paused = %v; want all 50 local", modes)
	}

	srv.Resume(t)
	paused = false
	resumed := time.Now()
	for {
		d, err := lim.Allow(ctx, "k")
		if err != nil {
			t.Fatalf("Allow after resume = %v", err)
		}
		if d.Mode == ModeRemote {
			break
		}
		// OpenFor plus jitter, plus go-redis's second of failing fast
		// after a dead connection, plus margin.
		if time.Since(resumed) > 3*time.Second {
			t.Fatalf("still %v 3s after resume", d.Mode)
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Logf("back to remote %v after resume", time.Since(resumed).Round(time.Millisecond))
}

// TestPolicies: while Redis is paused, FailOpen allows and FailClosed denies
// everything, each with its Mode and a nil error.
func TestPolicies(t *testing.T) {
	withRedis(t, func(t *testing.T, srv *testRedis) {
		srv.pause(t)
		defer srv.resume(t)
		for _, tc := range []struct {
			p       FailurePolicy
			allowed bool
			mode    Mode
		}{
			{FailOpen, true, ModeFailOpen},
			{FailClosed, false, ModeFailClosed},
		} {
			lim := newLimiter(t, Config{Redis: srv.client(t), Limit: PerSecond(5), OnFailure: tc.p,
				Timeout: 20 * time.Millisecond})
			for i := range 20 {
				d, err := lim.Allow(context.Background(), "k")
				if err != nil || d.Allowed != tc.allowed || d.Mode != tc.mode {
					t.Fatalf("%v: decision %d = %+v, %v; want allowed=%v mode %v", tc.p, i, d, err, tc.allowed, tc.mode)
				}
				if !d.Allowed && d.RetryAfter <= 0 {
					t.Errorf("%v: denied with RetryAfter %v; want > 0", tc.p, d.RetryAfter)
				}
			}
		}
	})
}

// TestCallerCancellation: decisions whose context is cancelled or expires
// return the context's error and never open the breaker.
func TestCallerCancellation(t *testing.T) {
	srv := redistest.Start(t)
	lim := newLimiter(t, Config{Redis: srv.Client(t), Limit: PerSecond(1e6), Timeout: time.Second})
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	for i := range 1000 {
		ctx := cancelled
		if i%2 == 1 {
			var c context.CancelFunc
			ctx, c = context.WithTimeout(context.Background(), time.Microsecond)
			defer c()
		}
		d, err := lim.Allow(ctx, "k")
		if err == nil && d.Mode != ModeRemote {
			t.Fatalf("decision %d = %+v; want an error or a remote decision", i, d)
		}
		if err != nil && !errors.Is(err, context.Canceled) && !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("decision %d error = %v; want the context's", i, err)
		}
	}
	if st := lim.single.cb.State(); st.String() != "closed" {
		t.Errorf("breaker after 1000 cancelled decisions is %v; want closed", st)
	}
	if d, err := lim.Allow(context.Background(), "k"); err != nil || d.Mode != ModeRemote {
		t.Errorf("Allow after the cancellations = %+v, %v; want remote", d, err)
	}
}

func TestClose(t *testing.T) {
	_, c := miniClient(t)
	if err := c.Ping(context.Background()).Err(); err != nil {
		t.Fatal(err)
	}
	before := goleak.IgnoreCurrent()
	lim, err := New(Config{Redis: c, Limit: PerSecond(10)})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := lim.Allow(context.Background(), "k"); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if err := lim.Close(); err != nil {
			t.Errorf("Close = %v; want nil", err)
		}
	}
	if d, err := lim.Allow(context.Background(), "k"); !errors.Is(err, ErrClosed) || d.Allowed {
		t.Errorf("Allow after Close = %+v, %v; want ErrClosed", d, err)
	}
	if err := c.Ping(context.Background()).Err(); err != nil {
		t.Errorf("client after Close: %v; want it left open", err)
	}
	// Every goroutine New started has returned. The client's connections
	// (the heartbeat opened one more) stay open, and miniredis serves them.
	goleak.VerifyNone(t, before,
		goleak.IgnoreAnyFunction("github.com/alicebob/miniredis/v2/server.(*Server).servePeer"),
		goleak.IgnoreAnyFunction("github.com/alicebob/miniredis/v2/server.(*Server).servePeer.func2"))
}

// TestNewRejectsNilClient: a typed nil client (a *redis.Client variable
// never assigned, put in the interface) is a bad Config like an untyped
// nil: New returns ErrInvalidConfig, it does not panic, nor crash the
// process from its background goroutine (a nil *redis.ClusterClient).
func TestNewRejectsNilClient(t *testing.T) {
	var (
		single  *redis.Client
		cluster *redis.ClusterClient
		ring    *redis.Ring
	)
	for _, c := range []redis.UniversalClient{single, cluster, ring} {
		func() {
			defer func() {
				if r := recover(); r != nil {
					t.Errorf("New(Redis: (%T)(nil)) panicked: %v", c, r)
				}
			}()
			lim, err := New(Config{Redis: c, Limit: PerSecond(10), Instances: 1, Heartbeat: -1})
			if lim != nil {
				lim.Close()
			}
			if !errors.Is(err, ErrInvalidConfig) {
				t.Errorf("New(Redis: (%T)(nil)) = %v; want ErrInvalidConfig", c, err)
			}
		}()
	}
}

// TestNewRejectsClientKinds: a Ring, whose shards are separate servers
// chosen by key, got one breaker for all of them (a shard paused made
// every decision on the others' keys wait its budget too, or go local),
// and an AutoPipeliner hid whatever it wrapped: both are refused.
func TestNewRejectsClientKinds(t *testing.T) {
	ring := redis.NewRing(&redis.RingOptions{Addrs: map[string]string{"a": "127.0.0.1:1", "b": "127.0.0.1:2"}})
	defer ring.Close()
	plain := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
	defer plain.Close()
	auto, err := plain.AutoPipeline()
	if err != nil {
		t.Fatal(err)
	}
	defer auto.Close()
	for _, c := range []redis.UniversalClient{ring, auto} {
		lim, err := New(Config{Redis: c, Limit: PerSecond(10), Instances: 1, Heartbeat: -1})
		if lim != nil {
			lim.Close()
		}
		if !errors.Is(err, ErrInvalidConfig) {
			t.Errorf("New(Redis: %T) = %v; want ErrInvalidConfig", c, err)
		}
	}
}

// labelled is a wrapper of a client such as a user may write to carry
// metadata: a value no map can hold.
type labelled struct {
	redis.UniversalClient
	labels []string
}

// TestUnhashableClient: a client value no map can hold (a wrapper with a
// slice in it) works: New panicked on it, hashing it as the key of the
// heartbeats' pacer, after starting goroutines that then leaked.
func TestUnhashableClient(t *testing.T) {
	withRedis(t, func(t *testing.T, r *testRedis) {
		c := labelled{UniversalClient: r.client(t), labels: []string{"team:a"}}
		for range 2 {
			lim := newLimiter(t, Config{Redis: c, Limit: PerSecond(10), Instances: 1, Heartbeat: 100 * time.Millisecond})
			if d, err := lim.Allow(context.Background(), "k"); err != nil || !d.Allowed {
				t.Errorf("Allow = %+v, %v; want allowed", d, err)
			}
		}
		time.Sleep(time.Second) // heartbeats
	})
}

// TestReservedKeys: a key that names a heartbeat hash of the fleet
// (Prefix + "{hybridlimit-fleet:" + Name + "}:" + window, a window being
// Redis's time in Heartbeats, easy to guess) is refused with
// ErrInvalidKey. Taken, its decision replaced the hash with a bucket, and
// every later heartbeat of the window failed: a client whose API key (or
// any value keyed by as is) names the coming windows kept the whole
// fleet's heartbeats from forming a view (weight 0, no log), so that
// under FailLocal with Instances unset an outage denied everything.
func TestReservedKeys(t *testing.T) {
	_, c := miniClient(t)
	lim := newLimiter(t, Config{Redis: c, Limit: PerSecond(10), Heartbeat: -1, Instances: 1})
	ctx := context.Background()
	key := "{hybridlimit-fleet:default}:" + strconv.FormatInt(time.Now().Unix(), 10)
	if d, err := lim.Allow(ctx, key); !errors.Is(err, ErrInvalidKey) {
		t.Errorf("Allow(%q) = %+v, %v; want ErrInvalidKey", key, d, err)
	}
	if _, err := lim.Peek(ctx, key); !errors.Is(err, ErrInvalidKey) {
		t.Errorf("Peek(%q) = %v; want ErrInvalidKey", key, err)
	}
	if err := lim.Reset(ctx, key); !errors.Is(err, ErrInvalidKey) {
		t.Errorf("Reset(%q) = %v; want ErrInvalidKey", key, err)
	}
	if err := lim.Refund(ctx, key, Decision{Allowed: true, Granted: 1, Mode: ModeRemote}, 1); !errors.Is(err, ErrInvalidKey) {
		t.Errorf("Refund(%q) = %v; want ErrInvalidKey", key, err)
	}
	if d, err := lim.AllowAtMost(ctx, key, 1); !errors.Is(err, ErrInvalidKey) {
		t.Errorf("AllowAtMost(%q) = %+v, %v; want ErrInvalidKey", key, d, err)
	}
	if err := lim.Wait(ctx, key); !errors.Is(err, ErrInvalidKey) {
		t.Errorf("Wait(%q) = %v; want ErrInvalidKey", key, err)
	}
	// Another Limiter on the same Redis whose Prefix is this one's and
	// "api:" has its heartbeat hashes at this one's key "api:{hybridlimit-fleet:...".
	if d, err := lim.Allow(ctx, "api:"+key); !errors.Is(err, ErrInvalidKey) {
		t.Errorf("Allow(%q) = %+v, %v; want ErrInvalidKey", "api:"+key, d, err)
	}
	if d, err := lim.Allow(ctx, "{hybridlimit}:user:42"); err != nil || !d.Allowed {
		t.Errorf("Allow of a key with another hash tag = %+v, %v; want allowed", d, err)
	}
}
