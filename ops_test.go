package hybridlimit

import (
	"context"
	"errors"
	"math"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/hybridlimit/hybridlimit/internal/faultproxy"
	"github.com/hybridlimit/hybridlimit/internal/redistest"
)

// oom makes every command on m fail at once with an error that means the
// node cannot decide, until the test ends or it is cleared.
func oom(m *miniredis.Miniredis) {
	m.SetError("OOM command not allowed when used memory > 'maxmemory'.")
}

// TestResetClearsCachedDenial: after Reset the key is a full bucket in
// Redis and this instance forgets the denial it would have answered
// without asking.
func TestResetClearsCachedDenial(t *testing.T) {
	m, c := miniClient(t)
	clock := newFakeClock(m)
	lim := newLimiter(t, Config{Redis: c, Limit: PerMinute(10), Instances: 1, Heartbeat: -1, now: clock.Now})
	ctx := context.Background()
	if d, err := lim.AllowN(ctx, "k", 10); err != nil || !d.Allowed {
		t.Fatalf("AllowN(10) = %+v, %v", d, err)
	}
	lim.Allow(ctx, "k") // denied by Redis, for 6 s
	if d, _ := lim.Allow(ctx, "k"); d.Allowed || !d.Cached {
		t.Fatalf("Allow = %+v; want a cached denial", d)
	}
	if err := lim.Reset(ctx, "k"); err != nil {
		t.Fatalf("Reset = %v", err)
	}
	if d, err := lim.Allow(ctx, "k"); err != nil || !d.Allowed || d.Cached || d.Mode != ModeRemote || d.Remaining != 9 {
		t.Errorf("Allow after Reset = %+v, %v; want allowed by Redis, 9 left", d, err)
	}
	if d, err := lim.AllowN(ctx, "k", 9); err != nil || !d.Allowed {
		t.Errorf("AllowN(9) after Reset = %+v, %v; want allowed: the bucket was full", d, err)
	}
}

// TestResetBehindAReconcile: a reconcile sending its charges holds the
// token that Reset needs to drop the key's owed charges; Reset waits for it
// no longer than its caller's deadline, and says what was left undone.
func TestResetBehindAReconcile(t *testing.T) {
	_, c := miniClient(t)
	lim := newLimiter(t, Config{Redis: c, Limit: PerMinute(10), Instances: 1, Heartbeat: -1})
	lim.reconciling <- struct{}{} // a reconcile under way, its charges unanswered
	defer func() { <-lim.reconciling }()
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- lim.Reset(ctx, "k") }()
	select {
	case err := <-done:
		if !errors.Is(err, ErrUnavailable) || !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("Reset behind a reconcile = %v; want ErrUnavailable and the caller's deadline", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Reset behind a reconcile still waiting 5s after its 200ms deadline")
	}
}

// TestResetWhileRedisIsDown: Reset forgets the local bucket and the lease
// even when Redis cannot confirm, and says so with ErrUnavailable.
func TestResetWhileRedisIsDown(t *testing.T) {
	m, c := miniClient(t)
	clock := newFakeClock(m)
	lim := newLimiter(t, Config{Redis: c, Limit: Limit{Rate: 1.0 / 3600, Burst: 10}, Instances: 1, Heartbeat: -1,
		Lease: 3, now: clock.Now})
	ctx := context.Background()
	if d, err := lim.Allow(ctx, "k"); err != nil || !d.Allowed || d.Mode != ModeRemote {
		t.Fatalf("Allow = %+v, %v; want allowed by Redis, 3 more leased", d, err)
	}
	if st, _ := lim.Peek(ctx, "k"); st.Leased != 3 {
		t.Fatalf("Peek = %+v; want 3 leased", st)
	}
	oom(m)
	// Redis said 6 of 10; the lease holds 3: 9 tokens for this instance.
	granted := int64(0)
	for range 20 {
		d, err := lim.Allow(ctx, "k")
		if err != nil {
			t.Fatal(err)
		}
		if d.Allowed {
			granted++
		}
	}
	if granted != 9 {
		t.Fatalf("granted %d while Redis is down; want 9 (3 leased, 6 local)", granted)
	}
	err := lim.Reset(ctx, "k")
	if !errors.Is(err, ErrUnavailable) {
		t.Fatalf("Reset while Redis is down = %v; want ErrUnavailable", err)
	}
	t.Logf("Reset: %v", err)
	st, err := lim.Peek(ctx, "k")
	if err != nil || st.Mode != ModeLocal || st.Tokens != 10 || st.Leased != 0 {
		t.Errorf("Peek after Reset = %+v, %v; want a full local bucket of 10, nothing leased", st, err)
	}
	if d, err := lim.AllowN(ctx, "k", 10); err != nil || !d.Allowed || d.Mode != ModeLocal {
		t.Errorf("AllowN(10) after Reset = %+v, %v; want allowed on a full local bucket", d, err)
	}
}

// TestPeekSpendsNothing: a thousand Peeks, from three instances, leave the
// bucket admitting exactly its burst, on a real redis-server.
func TestPeekSpendsNothing(t *testing.T) {
	srv := redistest.Start(t)
	var lims []*Limiter
	for range 3 {
		lims = append(lims, newLimiter(t, Config{Redis: srv.Client(t), Limit: Limit{Rate: 1e-3, Burst: 100},
			Instances: 3, Timeout: 5 * time.Second, Prefix: "peek:"}))
	}
	ctx := context.Background()
	for i := range 1000 {
		st, err := lims[i%3].Peek(ctx, "k")
		if err != nil || st.Mode != ModeRemote || st.Remaining != 100 || st.ResetAfter != 0 {
			t.Fatalf("Peek %d = %+v, %v; want 100 tokens in Redis", i, st, err)
		}
	}
	if keys := srv.Do(t, "keys", "peek:k"); len(keys.([]any)) != 0 {
		t.Errorf("Peek created the key: %v", keys)
	}
	allowed, modes := spend(t, lims, "k", 8, 300)
	if allowed != 100 || modes[ModeRemote] != 300 {
		t.Errorf("allowed %d of 300 after 1000 Peeks (%v); want exactly 100, all by Redis", allowed, modes)
	}
	st, err := lims[0].Peek(ctx, "k")
	if err != nil || st.Remaining != 0 || st.Tokens < 0 || st.Tokens > 0.01 || st.Limit != (Limit{Rate: 1e-3, Burst: 100}) {
		t.Errorf("Peek after spending the burst = %+v, %v; want about 0 tokens", st, err)
	}
}

// TestAllowAtMost: exact grants on miniredis at a set clock.
func TestAllowAtMost(t *testing.T) {
	m, c := miniClient(t)
	clock := newFakeClock(m)
	lim := newLimiter(t, Config{Redis: c, Limit: PerSecond(10), Instances: 1, Heartbeat: -1, now: clock.Now})
	ctx := context.Background()
	for i, tc := range []struct {
		at      time.Duration // since the step before
		n       int64
		granted int64
		left    int64
		retry   time.Duration
	}{
		{0, 7, 7, 3, 0},
		{0, 7, 3, 0, 0},
		{0, 7, 0, 0, 100 * time.Millisecond}, // denied until one token is there
		{50 * time.Millisecond, 7, 0, 0, 50 * time.Millisecond},
		{200 * time.Millisecond, 1000, 2, 0, 0}, // n beyond the burst: what there is
		{2 * time.Second, 1000, 10, 0, 0},
	} {
		clock.Add(tc.at)
		d, err := lim.AllowAtMost(ctx, "k", tc.n)
		if err != nil || d.Granted != tc.granted || d.Allowed != (tc.granted > 0) || d.Remaining != tc.left ||
			d.RetryAfter != tc.retry || d.Mode != ModeRemote {
			t.Errorf("step %d: AllowAtMost(%d) = %+v, %v; want %d granted, %d left, RetryAfter %v",
				i, tc.n, d, err, tc.granted, tc.left, tc.retry)
		}
	}
	// AllowN says what it granted too.
	clock.Add(time.Second)
	if d, _ := lim.AllowN(ctx, "k", 4); d.Granted != 4 {
		t.Errorf("AllowN(4) = %+v; want Granted 4", d)
	}
	if d, _ := lim.AllowN(ctx, "k", 7); d.Allowed || d.Granted != 0 {
		t.Errorf("AllowN(7) on 6 = %+v; want denied, Granted 0", d)
	}

	shadow := newLimiter(t, Config{Redis: c, Limit: PerSecond(10), Instances: 1, Heartbeat: -1, now: clock.Now,
		Shadow: true, Prefix: "shadow:"})
	for i, want := range []bool{false, true, true} {
		d, err := shadow.AllowAtMost(ctx, "k", 6)
		if err != nil || !d.Allowed || d.Granted != 6 || d.Shadowed != want {
			t.Errorf("shadow AllowAtMost(6) %d = %+v, %v; want 6 granted, Shadowed %v", i, d, err, want)
		}
	}
}

// TestAllowAtMostExact: 50 goroutines over 2 instances asking for at most
// 7 at a time are granted exactly the burst of 100 in all, on a real
// redis-server.
func TestAllowAtMostExact(t *testing.T) {
	srv := redistest.Start(t)
	var lims []*Limiter
	for range 2 {
		lims = append(lims, newLimiter(t, Config{Redis: srv.Client(t), Limit: Limit{Rate: 1e-3, Burst: 100},
			Instances: 2, Timeout: 5 * time.Second, Prefix: "atmost:"}))
	}
	var granted, calls atomic.Int64
	var wg sync.WaitGroup
	for i := range 50 {
		lim := lims[i%2]
		wg.Go(func() {
			for {
				d, err := lim.AllowAtMost(context.Background(), "k", 7)
				if err != nil || d.Mode != ModeRemote {
					t.Errorf("AllowAtMost = %+v, %v; want decided by Redis", d, err)
					return
				}
				calls.Add(1)
				if d.Granted < 0 || d.Granted > 7 || d.Allowed != (d.Granted > 0) {
					t.Errorf("AllowAtMost(7) = %+v", d)
				}
				if !d.Allowed {
					return
				}
				granted.Add(d.Granted)
			}
		})
	}
	wg.Wait()
	t.Logf("granted %d in %d calls", granted.Load(), calls.Load())
	if granted.Load() != 100 {
		t.Errorf("granted %d in all; want exactly 100", granted.Load())
	}
}

// TestOpsDegraded: while Redis cannot answer, Peek shows the failure
// policy's view with a nil error and AllowAtMost takes from it.
func TestOpsDegraded(t *testing.T) {
	ctx := context.Background()
	t.Run("FailLocal", func(t *testing.T) {
		m, c := miniClient(t)
		clock := newFakeClock(m)
		lim := newLimiter(t, Config{Redis: c, Limit: Limit{Rate: 1.0 / 3600, Burst: 20}, Instances: 2,
			Heartbeat: -1, now: clock.Now})
		if d, err := lim.AllowN(ctx, "k", 4); err != nil || !d.Allowed || d.Mode != ModeRemote {
			t.Fatalf("AllowN(4) = %+v, %v", d, err)
		}
		oom(m)
		// Redis said 16 of 20: this instance's half starts at 8.
		for i, tc := range []struct {
			before, granted, tokens int64
		}{{8, 5, 3}, {3, 3, 0}, {0, 0, 0}} {
			st, err := lim.Peek(ctx, "k")
			if err != nil || st.Mode != ModeLocal || !st.Mode.Degraded() || math.Abs(st.Tokens-float64(tc.before)) > 0.01 {
				t.Errorf("Peek %d = %+v, %v; want the local share's view, %d tokens", i, st, err, tc.before)
			}
			d, err := lim.AllowAtMost(ctx, "k", 5)
			if err != nil || d.Mode != ModeLocal || d.Granted != tc.granted || d.Remaining != tc.tokens {
				t.Errorf("AllowAtMost(5) %d = %+v, %v; want %d granted locally, %d left", i, d, err, tc.granted, tc.tokens)
			}
		}
	})
	for _, tc := range []struct {
		p       FailurePolicy
		mode    Mode
		granted int64
	}{{FailOpen, ModeFailOpen, 5}, {FailClosed, ModeFailClosed, 0}} {
		t.Run(tc.p.String(), func(t *testing.T) {
			m, c := miniClient(t)
			lim := newLimiter(t, Config{Redis: c, Limit: PerSecond(10), OnFailure: tc.p, Heartbeat: -1})
			oom(m)
			if st, err := lim.Peek(ctx, "k"); err != nil || st.Mode != tc.mode || st.Tokens != 0 {
				t.Errorf("Peek = %+v, %v; want mode %v, nothing known", st, err, tc.mode)
			}
			if d, err := lim.AllowAtMost(ctx, "k", 5); err != nil || d.Mode != tc.mode || d.Granted != tc.granted {
				t.Errorf("AllowAtMost(5) = %+v, %v; want %d granted, mode %v", d, err, tc.granted, tc.mode)
			}
			if err := lim.Reset(ctx, "k"); !errors.Is(err, ErrUnavailable) {
				t.Errorf("Reset = %v; want ErrUnavailable", err)
			}
		})
	}
}

// TestOpsRejectBadInput: the sentinels of AllowN, for every operation.
func TestOpsRejectBadInput(t *testing.T) {
	_, c := miniClient(t)
	lim := newLimiter(t, Config{Redis: c, Limit: PerSecond(10), Instances: 1, Heartbeat: -1,
		LimitFor: func(key string) Limit {
			if key == "bad" {
				return Limit{Rate: -1, Burst: 1}
			}
			return Limit{}
		}})
	ctx := context.Background()
	long := strings.Repeat("k", MaxKeyLen+1)
	for _, tc := range []struct {
		key  string
		n    int64
		want error
	}{
		{"", 1, ErrInvalidKey}, {long, 1, ErrInvalidKey}, {"k", 0, ErrInvalidN}, {"k", -1, ErrInvalidN},
		{"k", math.MinInt64, ErrInvalidN}, {"bad", 1, ErrInvalidLimit},
	} {
		if d, err := lim.AllowAtMost(ctx, tc.key, tc.n); !errors.Is(err, tc.want) || d != (Decision{}) {
			t.Errorf("AllowAtMost(%.10q, %d) = %+v, %v; want %v", tc.key, tc.n, d, err, tc.want)
		}
		if tc.want == ErrInvalidN {
			continue
		}
		if st, err := lim.Peek(ctx, tc.key); !errors.Is(err, tc.want) || st != (Status{}) {
			t.Errorf("Peek(%.10q) = %+v, %v; want %v", tc.key, st, err, tc.want)
		}
		if err := lim.Reset(ctx, tc.key); !errors.Is(err, tc.want) {
			t.Errorf("Reset(%.10q) = %v; want %v", tc.key, err, tc.want)
		}
	}
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := lim.Peek(cancelled, "k"); !errors.Is(err, context.Canceled) {
		t.Errorf("Peek with a cancelled context = %v", err)
	}
	if err := lim.Reset(cancelled, "k"); !errors.Is(err, context.Canceled) {
		t.Errorf("Reset with a cancelled context = %v", err)
	}
	lim.Close()
	if _, err := lim.AllowAtMost(ctx, "k", 1); !errors.Is(err, ErrClosed) {
		t.Errorf("AllowAtMost after Close = %v; want ErrClosed", err)
	}
	if _, err := lim.Peek(ctx, "k"); !errors.Is(err, ErrClosed) {
		t.Errorf("Peek after Close = %v; want ErrClosed", err)
	}
	if err := lim.Reset(ctx, "k"); !errors.Is(err, ErrClosed) {
		t.Errorf("Reset after Close = %v; want ErrClosed", err)
	}
}

// FuzzOps: any key and n give AllowAtMost, Peek and Reset a result or an
// error that errors.Is a sentinel, never a panic; a grant is never more
// than n or the burst.
func FuzzOps(f *testing.F) {
	const burst = 100
	m := miniredis.NewMiniRedis()
	if err := m.Start(); err != nil {
		f.Fatal(err)
	}
	f.Cleanup(m.Close)
	c := redis.NewClient(&redis.Options{Addr: m.Addr()})
	f.Cleanup(func() { c.Close() })
	lim, err := New(Config{Redis: c, Limit: PerSecond(burst), Prefix: "fuzz:", Timeout: 5 * time.Second})
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { lim.Close() })
	f.Add([]byte("k"), int64(7))
	f.Add([]byte("k"), int64(burst+1))
	f.Add([]byte("k"), int64(math.MaxInt64))
	f.Add([]byte("k"), int64(0))
	f.Add([]byte(""), int64(1))
	f.Add([]byte(strings.Repeat("k", MaxKeyLen+1)), int64(1))
	ctx := context.Background()
	f.Fuzz(func(t *testing.T, key []byte, n int64) {
		k := string(key)
		validKey := len(k) >= 1 && len(k) <= MaxKeyLen
		d, err := lim.AllowAtMost(ctx, k, n)
		switch {
		case !validKey || n < 1:
			if !errors.Is(err, ErrInvalidKey) && !errors.Is(err, ErrInvalidN) {
				t.Fatalf("AllowAtMost(%q, %d) = %+v, %v; want ErrInvalidKey or ErrInvalidN", k, n, d, err)
			}
		case err != nil || d.Granted < 0 || d.Granted > min(n, burst) || d.Allowed != (d.Granted > 0):
			t.Fatalf("AllowAtMost(%q, %d) = %+v, %v", k, n, d, err)
		}
		st, err := lim.Peek(ctx, k)
		if validKey && (err != nil || st.Tokens < 0 || st.Tokens > burst) || !validKey && !errors.Is(err, ErrInvalidKey) {
			t.Fatalf("Peek(%q) = %+v, %v", k, st, err)
		}
		err = lim.Reset(ctx, k)
		if validKey && err != nil || !validKey && !errors.Is(err, ErrInvalidKey) {
			t.Fatalf("Reset(%q) = %v", k, err)
		}
	})
}

// TestOpsWithinBudget: against a Redis that stops answering (a black hole
// in front of a real redis-server), Reset says so with ErrUnavailable and
// Peek and AllowAtMost answer from the local share, each within the
// decision's budget.
func TestOpsWithinBudget(t *testing.T) {
	srv := redistest.Start(t)
	px := faultproxy.Start(t, srv.Addr())
	const budget = 50 * time.Millisecond
	lim := newLimiter(t, Config{Redis: clients(t, px.Addr(), 1)[0], Limit: Limit{Rate: 1.0 / 3600, Burst: 10},
		Instances: 1, Heartbeat: -1, Timeout: budget})
	ctx := context.Background()
	if d, err := lim.AllowN(ctx, "k", 4); err != nil || d.Mode != ModeRemote {
		t.Fatalf("AllowN(4) = %+v, %v; want decided by Redis", d, err)
	}
	px.Blackhole(true)
	// The calls left in the black hole, and a background call that dials
	// into it after the test (the layout's check), would hold Close for
	// the client's ReadTimeout: lift it and reset their connections when
	// the test is done.
	defer func() {
		px.Blackhole(false)
		px.ResetAll()
	}()
	// Honest margins for a busy 2-core machine: the budget is 50 ms.
	const slack = 200 * time.Millisecond
	start := time.Now()
	err := lim.Reset(ctx, "k")
	took := time.Since(start)
	t.Logf("Reset into a black hole: %v after %v", err, took)
	if !errors.Is(err, ErrUnavailable) || took > budget+slack {
		t.Errorf("Reset into a black hole = %v after %v; want ErrUnavailable within %v", err, took, budget)
	}
	start = time.Now()
	st, err := lim.Peek(ctx, "k")
	took = time.Since(start)
	t.Logf("Peek into a black hole: %v after %v", st.Mode, took)
	if err != nil || st.Mode != ModeLocal || st.Tokens != 10 || took > budget+slack {
		t.Errorf("Peek into a black hole = %+v, %v after %v; want the full local share (Reset forgot the key), within %v",
			st, err, took, budget)
	}
	start = time.Now()
	d, err := lim.AllowAtMost(ctx, "k", 25)
	took = time.Since(start)
	t.Logf("AllowAtMost into a black hole: %v after %v", d.Mode, took)
	if err != nil || d.Mode != ModeLocal || d.Granted != 10 || took > budget+slack {
		t.Errorf("AllowAtMost(25) into a black hole = %+v, %v after %v; want 10 granted locally, within %v", d, err, took, budget)
	}
}

// TestOpsOnCluster: Reset, Peek and AllowAtMost reach each key's master
// on a 3-master Cluster.
func TestOpsOnCluster(t *testing.T) {
	leakCheck(t)
	parallel(t) // as TestClusterFunctions
	cl := redistest.StartCluster(t, 3)
	const prefix = "ops:"
	lim := newLimiter(t, Config{Redis: cl.Client(t), Limit: Limit{Rate: 1e-3, Burst: 10}, Instances: 1,
		Heartbeat: -1, Timeout: time.Second, Prefix: prefix})
	ctx := context.Background()
	for _, keys := range keysOn(t, cl, prefix, "k", 1) {
		key := strings.TrimPrefix(keys[0], prefix)
		if d, err := lim.AllowAtMost(ctx, key, 25); err != nil || d.Granted != 10 || d.Mode != ModeRemote {
			t.Errorf("AllowAtMost(%s, 25) = %+v, %v; want 10 granted by Redis", key, d, err)
		}
		if st, err := lim.Peek(ctx, key); err != nil || st.Remaining != 0 || st.Mode != ModeRemote {
			t.Errorf("Peek(%s) = %+v, %v; want 0 left, from Redis", key, st, err)
		}
		if err := lim.Reset(ctx, key); err != nil {
			t.Errorf("Reset(%s) = %v", key, err)
		}
		if st, err := lim.Peek(ctx, key); err != nil || st.Remaining != 10 || st.Mode != ModeRemote {
			t.Errorf("Peek(%s) after Reset = %+v, %v; want 10, from Redis", key, st, err)
		}
	}
}

// TestPeekOfASlowLimit: the local share of a limit that refills a token
// in centuries reports a ResetAfter that saturates, as a decision's does,
// rather than one that wraps negative. A token every 31 years shared by 100
// instances leaves each a rate of one in 3,100 years and a burst of one.
func TestPeekOfASlowLimit(t *testing.T) {
	m, c := miniClient(t)
	clock := newFakeClock(m)
	lim := newLimiter(t, Config{Redis: c, Limit: Limit{Rate: 1e-9, Burst: 1}, Instances: 100, Heartbeat: -1, now: clock.Now})
	ctx := context.Background()
	if d, err := lim.Allow(ctx, "k"); err != nil || !d.Allowed || d.Mode != ModeRemote {
		t.Fatalf("Allow = %+v, %v; want allowed by Redis", d, err)
	}
	if st, err := lim.Peek(ctx, "k"); err != nil || st.Mode != ModeRemote || st.ResetAfter < time.Second*(1e9-1) {
		t.Fatalf("Peek from Redis = %+v, %v; want ResetAfter about 1e9 s", st, err)
	}
	oom(m)
	st, err := lim.Peek(ctx, "k")
	if err != nil || st.Mode != ModeLocal || st.Remaining != 0 || st.ResetAfter != time.Duration(math.MaxInt64) {
		t.Errorf("Peek of the local share = %+v, %v; want an empty share, ResetAfter saturated at %v", st, err, time.Duration(math.MaxInt64))
	}
}
