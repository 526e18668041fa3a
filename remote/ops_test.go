package remote

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/hybridlimit/hybridlimit/internal/redistest"
	"github.com/hybridlimit/hybridlimit/lua"
)

// peek runs the script in peek mode on key and fails the test on an error.
func peek(t *testing.T, p *Pipe, key string, lim Limit) Result {
	t.Helper()
	res, err := p.Do(context.Background(), Request{Key: key, Limit: lim, Peek: true})
	if err != nil {
		t.Fatalf("peek %q: %v", key, err)
	}
	return res
}

// reset runs the script in reset mode on key and fails the test on an
// error.
func reset(t *testing.T, p *Pipe, key string, lim Limit) Result {
	t.Helper()
	res, err := p.Do(context.Background(), Request{Key: key, Limit: lim, Reset: true})
	if err != nil {
		t.Fatalf("reset %q: %v", key, err)
	}
	return res
}

// TestPeek: peek mode reports the refilled level to the unit and leaves
// the key exactly as it was: the same bytes, the same TTL, no key where
// there was none, a foreign value in place.
func TestPeek(t *testing.T) {
	m, p := newMini(t)
	lim := mustLimit(t, 10, 10) // P = 100000 units a token, 10 tokens a second
	if res := peek(t, p, "k", lim); !res.Allowed || res.Level != lim.Cap() || res.ResetAfter != 0 || res.Repaired {
		t.Errorf("peek of a missing key = %+v; want allowed, level %d, ResetAfter 0", res, lim.Cap())
	}
	if m.Exists("k") {
		t.Fatalf("peek of a missing key created it")
	}
	if res, err := p.Take(context.Background(), "k", lim, 3); err != nil || !res.Allowed {
		t.Fatalf("Take(3) = %+v, %v", res, err)
	}
	stored, _ := m.Get("k")
	m.SetTime(t0.Add(150 * time.Millisecond))
	for range 100 {
		res := peek(t, p, "k", lim)
		if want := 7*lim.P + 15*lim.P/10; !res.Allowed || res.Level != want || res.ResetAfter != 150*time.Millisecond {
			t.Fatalf("peek 150 ms after taking 3 = %+v; want level %d (8.5 tokens), ResetAfter 150ms", res, want)
		}
	}
	if got, _ := m.Get("k"); got != stored {
		t.Errorf("peek changed the value: %x, was %x", got, stored)
	}
	if got, want := m.TTL("k"), 1300*time.Millisecond; got != want {
		t.Errorf("TTL after peeks = %v; want %v, as the take set it", got, want)
	}
	// Peeking spent nothing: 8 of the 8.5 tokens are there.
	if res, err := p.Take(context.Background(), "k", lim, 8); err != nil || !res.Allowed || res.Level != lim.P/2 {
		t.Errorf("Take(8) after the peeks = %+v, %v; want allowed, level %d", res, err, lim.P/2)
	}

	// A bucket in debt: peek says so, with the time until it is paid.
	if _, err := p.Charge(context.Background(), "k", lim, 3*lim.P); err != nil {
		t.Fatal(err)
	}
	if res := peek(t, p, "k", lim); res.Allowed || res.Level != -25*lim.P/10 || res.RetryAfter != 250*time.Millisecond {
		t.Errorf("peek of a bucket 2.5 tokens in debt = %+v; want not allowed, level %d, RetryAfter 250ms", res, -25*lim.P/10)
	}

	// A level stored under another limit is converted in the reply only.
	other := mustLimit(t, 20, 10) // P = 50000
	stored, _ = m.Get("k")
	ttl := m.TTL("k")
	// The debt is stored as a time 250 ms ahead: 5 tokens at 20/s.
	if res := peek(t, p, "k", other); res.Level != -5*other.P {
		t.Errorf("peek under another limit = %+v; want level %d", res, -5*other.P)
	}
	if got, _ := m.Get("k"); got != stored || m.TTL("k") != ttl {
		t.Errorf("peek under another limit wrote the key")
	}

	// A foreign value reads as the full bucket a decision would make of
	// it, and stays.
	m.Set("f", "hello")
	if res := peek(t, p, "f", lim); !res.Allowed || !res.Repaired || res.Level != lim.Cap() {
		t.Errorf("peek of a foreign string = %+v; want allowed, repaired, level %d", res, lim.Cap())
	}
	if got, _ := m.Get("f"); got != "hello" {
		t.Errorf("peek of a foreign string left %q", got)
	}
	m.Del("f")
	m.HSet("f", "a", "b")
	if res := peek(t, p, "f", lim); !res.Allowed || !res.Repaired || res.Level != lim.Cap() {
		t.Errorf("peek of a hash = %+v; want allowed, repaired, level %d", res, lim.Cap())
	}
	if typ := m.Type("f"); typ != "hash" || m.HGet("f", "a") != "b" {
		t.Errorf("peek of a hash left a %s", typ)
	}
}

// TestReset: reset mode stores a full bucket whatever the key held, which
// expires a second later, when it is the same as no key.
func TestReset(t *testing.T) {
	m, p := newMini(t)
	lim := mustLimit(t, 10, 10)
	ctx := context.Background()
	if res, err := p.Take(ctx, "k", lim, 10); err != nil || !res.Allowed {
		t.Fatalf("Take(10) = %+v, %v", res, err)
	}
	if _, err := p.Charge(ctx, "k", lim, 5*lim.P); err != nil {
		t.Fatal(err)
	}
	if res := reset(t, p, "k", lim); !res.Allowed || res.Level != lim.Cap() || res.ResetAfter != 0 {
		t.Errorf("reset of a bucket in debt = %+v; want allowed, level %d", res, lim.Cap())
	}
	if got, want := m.TTL("k"), time.Second; got != want {
		t.Errorf("TTL after reset = %v; want %v", got, want)
	}
	run(t, m, p, "k", lim, []step{
		{0, 10, true, 0, 0},
		{0, 1, false, 0, 100 * time.Millisecond},
	})
	for name, set := range map[string]func(){
		"missing key": func() {},
		"string":      func() { m.Set("f", strings.Repeat("x", 22)) },
		"list":        func() { m.Lpush("f", "v") },
	} {
		m.Del("f")
		set()
		if res := reset(t, p, "f", lim); !res.Allowed || res.Level != lim.Cap() {
			t.Errorf("reset of a %s = %+v; want allowed, level %d", name, res, lim.Cap())
		}
		run(t, m, p, "f", lim, []step{{0, 10, true, 0, 0}})
	}
}

// TestPeekReadOnlyOnRedis runs peek mode with EVAL_RO on a real
// redis-server, which refuses any write a script attempts: so peek writes
// nothing whatever the key holds, and could be sent to a replica. Charge
// mode under EVAL_RO fails, which shows the check can fail.
func TestPeekReadOnlyOnRedis(t *testing.T) {
	srv := redistest.Start(t)
	c := srv.Client(t)
	ctx := context.Background()
	key := "{" + t.Name() + "}:k"
	lim := mustLimit(t, 1.0/3600, 10) // one token an hour: no refill to speak of
	p := NewPipe(c, 0, nil)
	defer p.Close()
	evalRO := func(argv ...any) (any, error) {
		return c.Do(ctx, append([]any{"eval_ro", lua.TokenBucket, 1, key, lim.Q, lim.P, lim.Cap()}, argv...)...).Result()
	}
	for name, set := range map[string]func(){
		"missing key":    func() { c.Del(ctx, key) },
		"bucket":         func() { c.Del(ctx, key); p.Take(ctx, key, lim, 4) },
		"other limit":    func() { c.Del(ctx, key); p.Take(ctx, key, mustLimit(t, 1.0/60, 10), 4) },
		"foreign string": func() { c.Set(ctx, key, "hello", time.Hour) },
		"foreign hash":   func() { c.Del(ctx, key); c.HSet(ctx, key, "a", "b") },
	} {
		set()
		if _, err := evalRO(int64(0), "peek"); err != nil {
			t.Errorf("%s: peek under EVAL_RO: %v", name, err)
		}
	}
	c.Del(ctx, key)
	if _, err := evalRO(int64(0), "charge"); err == nil || !strings.Contains(err.Error(), "Write commands are not allowed") {
		t.Errorf("charge under EVAL_RO = %v; want a refused write", err)
	}

	// Exact levels through the pipe: 10, 6 after taking 4, 10 after a
	// reset; and the TTL only goes down while peeking.
	c.Del(ctx, key)
	if res := peek(t, p, key, lim); res.Level != lim.Cap() {
		t.Errorf("peek of a missing key = %+v; want level %d", res, lim.Cap())
	}
	if n, _ := c.Exists(ctx, key).Result(); n != 0 {
		t.Errorf("peek created the key")
	}
	if res, err := p.Take(ctx, key, lim, 4); err != nil || !res.Allowed {
		t.Fatalf("Take(4) = %+v, %v", res, err)
	}
	before := c.PTTL(ctx, key).Val()
	for range 50 {
		if res := peek(t, p, key, lim); res.Level/lim.P != 6 {
			t.Fatalf("peek after taking 4 = %d whole tokens; want 6", res.Level/lim.P)
		}
	}
	if after := c.PTTL(ctx, key).Val(); after > before {
		t.Errorf("PTTL %v after peeks, %v before: peek set the TTL", after, before)
	}
	if res := reset(t, p, key, lim); res.Level != lim.Cap() {
		t.Errorf("reset = %+v; want level %d", res, lim.Cap())
	}
	if ttl := c.PTTL(ctx, key).Val(); ttl <= 0 || ttl > time.Second {
		t.Errorf("PTTL after reset = %v; want at most 1s", ttl)
	}
	if res := peek(t, p, key, lim); res.Level != lim.Cap() {
		t.Errorf("peek after reset = %+v; want level %d", res, lim.Cap())
	}
}

// TestAtMostExact: taking at most n whole tokens is lease mode asked for
// one token and n-1 more. From 50 goroutines asking for at most 7 each on
// a real redis-server, the grants add up to the burst exactly.
func TestAtMostExact(t *testing.T) {
	srv := redistest.Start(t)
	c := srv.Client(t)
	ctx := context.Background()
	key := "{" + t.Name() + "}:k"
	lim := mustLimit(t, 1.0/3600, 100)
	p := NewPipe(c, 0, nil)
	defer p.Close()
	var granted, calls atomic.Int64
	var wg sync.WaitGroup
	for range 50 {
		wg.Go(func() {
			for {
				res, err := p.Do(ctx, Request{Key: key, Limit: lim, Units: lim.Units(1), Lease: 6})
				if err != nil {
					t.Error(err)
					return
				}
				calls.Add(1)
				if !res.Allowed {
					return
				}
				granted.Add(1 + res.Leased)
			}
		})
	}
	wg.Wait()
	if granted.Load() != 100 {
		t.Errorf("granted %d in %d calls from a bucket of 100; want 100", granted.Load(), calls.Load())
	}
	if v, err := c.Get(ctx, key).Bytes(); err != nil && err != redis.Nil || len(v) != 22 {
		t.Errorf("GET = %x, %v", v, err)
	}
}

// TestParsePeekAndReset: replies of the new modes that cannot be right
// are errors: a reset that did not leave a full bucket, a peek that says
// allowed on a bucket in debt.
func TestParsePeekAndReset(t *testing.T) {
	lim := Limit{Q: 1, P: 100000, Burst: 10}
	if res, err := parseReply([]any{int64(1), lim.Cap(), int64(1)}, lim, 0, modeReset); err != nil || res.Level != lim.Cap() {
		t.Errorf("reset reply = %+v, %v; want a full bucket", res, err)
	}
	for _, bad := range [][]any{{int64(1), lim.Cap() - 1, int64(1)}, {int64(0), lim.Cap(), int64(1)}} {
		if res, err := parseReply(bad, lim, 0, modeReset); !errors.Is(err, ErrReply) {
			t.Errorf("reset reply %v = %+v, %v; want ErrReply", bad, res, err)
		}
	}
	if res, err := parseReply([]any{int64(0), int64(-5), int64(1)}, lim, 0, modePeek); err != nil || res.Allowed || res.RetryAfter != 5*time.Microsecond {
		t.Errorf("peek reply in debt = %+v, %v; want not allowed, RetryAfter 5µs", res, err)
	}
	if res, err := parseReply([]any{int64(1), int64(-5), int64(1)}, lim, 0, modePeek); !errors.Is(err, ErrReply) {
		t.Errorf("peek reply allowed in debt = %+v, %v; want ErrReply", res, err)
	}
}

// BenchmarkPeek compares a look with a decision on a real redis-server,
// one key, from parallel callers.
func BenchmarkPeek(b *testing.B) {
	srv := redistest.Start(b)
	c := srv.Client(b)
	lim := Limit{Q: 1, P: 1, Burst: 1 << 40} // never empty
	for _, bc := range []struct {
		name string
		req  Request
	}{
		{"take", Request{Key: "k", Limit: lim, Units: 1}},
		{"peek", Request{Key: "k", Limit: lim, Peek: true}},
	} {
		b.Run(bc.name, func(b *testing.B) {
			p := NewPipe(c, 0, nil)
			defer p.Close()
			b.ReportAllocs()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					if _, err := p.Do(context.Background(), bc.req); err != nil {
						b.Error(err)
						return
					}
				}
			})
		})
	}
}
