package hybridlimit

import (
	"context"
	"errors"
	"math"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/hybridlimit/hybridlimit/internal/redistest"
	"github.com/hybridlimit/hybridlimit/remote"
)

// fakeClock drives miniredis's TIME and the limiter's local clock together.
type fakeClock struct {
	mu  sync.Mutex
	now time.Time
	m   *miniredis.Miniredis
}

func newFakeClock(m *miniredis.Miniredis) *fakeClock {
	c := &fakeClock{now: time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC), m: m}
	m.SetTime(c.now)
	return c
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *fakeClock) Add(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
	c.m.SetTime(c.now)
}

// TestCachedDenialsMatchRedis: answering denials from what Redis said gives
// exactly the answers Redis gives, on a key offered far more than its limit.
func TestCachedDenialsMatchRedis(t *testing.T) {
	// In a bubble, against the simulated Redis: the limiters and Redis
	// share the virtual clock, which only the test moves.
	bubble(t, func(t *testing.T) {
		c := simClient(t)
		limit := Limit{Rate: 10, Burst: 5}
		// The test compares answers: a budget no stall of a busy machine
		// reaches, so that every decision is Redis's (or the cache's).
		cached := newLimiter(t, Config{Redis: c, Limit: limit, Prefix: "cached:", Heartbeat: -1, Instances: 1,
			Timeout: 5 * time.Second})
		direct := newLimiter(t, Config{Redis: c, Limit: limit, Prefix: "direct:", Heartbeat: -1, Instances: 1,
			Timeout: 5 * time.Second, noCache: true})
		ctx := context.Background()
		var allowed int
		for i := range 2000 {
			n := int64(1 + i%3)
			a, err1 := cached.AllowN(ctx, "k", n)
			b, err2 := direct.AllowN(ctx, "k", n)
			if err1 != nil || err2 != nil || a.Allowed != b.Allowed || a.Remaining != b.Remaining ||
				a.RetryAfter != b.RetryAfter || a.ResetAfter != b.ResetAfter {
				t.Fatalf("decision %d (n=%d): cached %+v, %v; Redis %+v, %v", i, n, a, err1, b, err2)
			}
			if a.Allowed {
				allowed++
			}
			time.Sleep(7 * time.Millisecond) // 2000 × 7 ms = 14 s at 10/s
		}
		if allowed < 100 || allowed > 150 {
			t.Errorf("allowed %d of 2000 over 14 s at 10/s with burst 5; want about 140", allowed)
		}
	})
}

// TestCachedDenialsSpareRedis: under abuse (one key offered 100 times its
// limit from 3 instances), Redis sees about one call per allowed token plus
// one per RetryAfter per instance, instead of every attempt.
func TestCachedDenialsSpareRedis(t *testing.T) {
	withRedis(t, func(t *testing.T, srv *testRedis) {
		for _, cache := range []bool{true, false} {
			before := srv.scriptCalls(t)
			var lims []*Limiter
			for range 3 {
				lims = append(lims, newLimiter(t, Config{Redis: srv.client(t), Limit: PerSecond(20),
					Timeout: time.Second, Heartbeat: -1, Instances: 1, noCache: !cache, Prefix: "abuse" + strconv.FormatBool(cache)}))
			}
			var attempts, allowed atomic.Int64
			deadline := time.Now().Add(time.Second)
			var wg sync.WaitGroup
			for _, lim := range lims {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for time.Now().Before(deadline) {
						d, err := lim.Allow(context.Background(), "k")
						if err != nil {
							t.Error(err)
							return
						}
						attempts.Add(1)
						if d.Allowed {
							allowed.Add(1)
						}
						time.Sleep(time.Millisecond) // about 2000 attempts/s: 100x the limit
					}
				}()
			}
			wg.Wait()
			got := srv.scriptCalls(t) - before
			t.Logf("cache %v: %d attempts, %d allowed, %d script calls in Redis", cache, attempts.Load(), allowed.Load(), got)
			if cache {
				// One call per allowed token, plus one per RetryAfter (50 ms)
				// per instance: 3 × 20 = 60 over the second; allow double.
				if limit := allowed.Load() + 2*60; got > limit {
					t.Errorf("with the cache Redis ran %d scripts for %d allowed; want at most %d", got, allowed.Load(), limit)
				}
			} else if got < attempts.Load() {
				t.Errorf("without the cache Redis ran %d scripts for %d attempts; want every attempt", got, attempts.Load())
			}
		}
	})
}

// TestSetLimit: the Redis bucket takes a new limit on its next decision and
// keeps its level; a smaller burst caps it. The local share follows.
func TestSetLimit(t *testing.T) {
	m, c := miniClient(t)
	clock := newFakeClock(m)
	lim := newLimiter(t, Config{Redis: c, Limit: PerSecond(10), now: clock.Now, Heartbeat: -1, Instances: 1})
	ctx := context.Background()
	if d, _ := lim.AllowN(ctx, "k", 4); d.Remaining != 6 {
		t.Fatalf("AllowN(4) = %+v; want 6 left", d)
	}
	if err := lim.SetLimit(PerSecond(100)); err != nil {
		t.Fatal(err)
	}
	// Same level (6 of the old 10), now out of a burst of 100.
	if d, _ := lim.AllowN(ctx, "k", 1); !d.Allowed || d.Remaining != 5 || d.Limit != PerSecond(100) {
		t.Errorf("AllowN after raising the limit = %+v; want 5 left of PerSecond(100)", d)
	}
	clock.Add(100 * time.Millisecond) // +10 at 100/s
	if err := lim.SetLimit(PerSecond(3)); err != nil {
		t.Fatal(err)
	}
	if d, _ := lim.AllowN(ctx, "k", 1); !d.Allowed || d.Remaining != 2 {
		t.Errorf("AllowN after lowering the burst to 3 = %+v; want 15 capped to 3, 2 left", d)
	}
	for _, bad := range []Limit{{}, {Rate: -1, Burst: 1}, {Rate: 1, Burst: 0}} {
		if err := lim.SetLimit(bad); !errors.Is(err, ErrInvalidLimit) {
			t.Errorf("SetLimit(%v) = %v; want ErrInvalidLimit", bad, err)
		}
	}
	if lim.Limit() != PerSecond(3) {
		t.Errorf("Limit() = %v after rejected SetLimits; want PerSecond(3)", lim.Limit())
	}
}

// TestLimitFor: each key gets its tier's limit, remote and local alike;
// a bad limit from LimitFor is an error, never a panic.
func TestLimitFor(t *testing.T) {
	tiers := func(key string) Limit {
		switch {
		case strings.HasPrefix(key, "pro:"):
			return PerSecond(50)
		case strings.HasPrefix(key, "bad:"):
			return Limit{Rate: -1, Burst: 1}
		}
		return Limit{} // the default
	}
	m, c := miniClient(t)
	clock := newFakeClock(m) // stands still: no refill
	dead := refused(t)
	for _, tc := range []struct {
		client redis.UniversalClient
		mode   Mode
	}{{c, ModeRemote}, {dead, ModeLocal}} {
		lim := newLimiter(t, Config{Redis: tc.client, Limit: PerSecond(5), LimitFor: tiers, Heartbeat: -1, Instances: 1, now: clock.Now})
		ctx := context.Background()
		for _, k := range []struct {
			key  string
			want int
		}{{"free:1", 5}, {"pro:1", 50}} {
			got := 0
			for range 100 {
				d, err := lim.Allow(ctx, k.key)
				if err != nil || d.Mode != tc.mode {
					t.Fatalf("Allow(%q) = %+v, %v; want %v", k.key, d, err, tc.mode)
				}
				if d.Allowed {
					got++
				}
			}
			if got != k.want {
				t.Errorf("%v: %q allowed %d of 100; want its burst %d", tc.mode, k.key, got, k.want)
			}
		}
		if _, err := lim.Allow(ctx, "bad:1"); !errors.Is(err, ErrInvalidLimit) {
			t.Errorf("Allow with a bad LimitFor limit = %v; want ErrInvalidLimit", err)
		}
		if _, err := lim.AllowN(ctx, "pro:2", 51); !errors.Is(err, ErrInvalidN) {
			t.Errorf("AllowN(51) over a pro burst of 50 = %v; want ErrInvalidN", err)
		}
	}
}

// TestShadow: nothing is denied, but what would be is reported.
func TestShadow(t *testing.T) {
	_, c := miniClient(t)
	obs := &countingObserver{}
	lim := newLimiter(t, Config{Redis: c, Limit: PerSecond(3), Shadow: true, Observer: obs, Heartbeat: -1, Instances: 1})
	shadowed := 0
	for range 10 {
		d, err := lim.Allow(context.Background(), "k")
		if err != nil || !d.Allowed {
			t.Fatalf("Allow in shadow mode = %+v, %v; want allowed", d, err)
		}
		if d.Shadowed {
			shadowed++
			if d.RetryAfter <= 0 {
				t.Errorf("shadowed decision %+v; want the RetryAfter a denial would have", d)
			}
		}
	}
	if shadowed != 7 || obs.shadowed.Load() != 7 || obs.decisions.Load() != 10 {
		t.Errorf("shadowed %d, observed %d of %d; want 7, 7 of 10", shadowed, obs.shadowed.Load(), obs.decisions.Load())
	}
}

type countingObserver struct {
	decisions, allowed, shadowed, breaker atomic.Int64
	mu                                    sync.Mutex
	modes                                 map[Mode]int
	transitions                           []string
}

func (o *countingObserver) ObserveDecision(e DecisionEvent) {
	o.decisions.Add(1)
	if e.Allowed {
		o.allowed.Add(1)
	}
	if e.Shadowed {
		o.shadowed.Add(1)
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.modes == nil {
		o.modes = map[Mode]int{}
	}
	o.modes[e.Mode]++
}

func (o *countingObserver) ObserveBreaker(e BreakerEvent) {
	o.breaker.Add(1)
	o.mu.Lock()
	defer o.mu.Unlock()
	o.transitions = append(o.transitions, e.From+"->"+e.To)
}

// TestObserverAndStats: the observer sees every decision with its mode and
// every breaker change; Stats reports the breaker and the local keys.
func TestObserverAndStats(t *testing.T) {
	srv := redistest.Start(t)
	obs := &countingObserver{}
	lim := newLimiter(t, Config{Redis: srv.Client(t), Limit: PerSecond(1000), Observer: obs,
		Timeout: 20 * time.Millisecond, Heartbeat: -1, Instances: 1, Name: "api"})
	ctx := context.Background()
	for range 5 {
		lim.Allow(ctx, "k")
	}
	srv.Pause(t)
	for i := range 20 {
		lim.Allow(ctx, "p"+strconv.Itoa(i))
	}
	st := lim.Stats()
	srv.Resume(t)
	if obs.decisions.Load() != 25 || obs.modes[ModeRemote] != 5 || obs.modes[ModeLocal] != 20 {
		t.Errorf("observed %d decisions, modes %v; want 25: 5 remote, 20 local", obs.decisions.Load(), obs.modes)
	}
	if len(obs.transitions) == 0 || obs.transitions[0] != "closed->open" {
		t.Errorf("breaker transitions %v; want closed->open first", obs.transitions)
	}
	if st.Breakers[srv.Addr()] != "open" || st.LocalKeys < 20 || st.Fleet != 1 || st.Weight != 1 {
		t.Errorf("Stats = %+v; want the breaker open, >= 20 local keys, fleet 1, weight 1", st)
	}
}

// TestWaitHoldsTheLimit: workers on several instances that Wait for their
// turn together get no more than the limit.
func TestWaitHoldsTheLimit(t *testing.T) {
	withRedis(t, func(t *testing.T, srv *testRedis) {
		const rate, burst = 50, 5
		start := time.Now()
		var granted atomic.Int64
		var wg sync.WaitGroup
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		for range 3 {
			lim := newLimiter(t, Config{Redis: srv.client(t), Limit: Limit{Rate: rate, Burst: burst},
				Timeout: time.Second, Heartbeat: -1, Instances: 1})
			for range 4 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for {
						if err := lim.Wait(ctx, "jobs"); err != nil {
							if !errors.Is(err, context.DeadlineExceeded) {
								t.Errorf("Wait = %v", err)
							}
							return
						}
						granted.Add(1)
					}
				}()
			}
		}
		wg.Wait()
		elapsed := time.Since(start).Seconds()
		most := int64(burst + rate*elapsed + 1)
		t.Logf("12 workers on 3 instances: %d granted in %.2fs (limit allows %d)", granted.Load(), elapsed, most)
		if g := granted.Load(); g > most || g < most*8/10 {
			t.Errorf("granted %d in %.2fs; want at most %d and not far below", g, elapsed, most)
		}
	})
}

// TestWaitRespectsContext: a deadline too short for the wait ends it early.
func TestWaitRespectsContext(t *testing.T) {
	_, c := miniClient(t)
	lim := newLimiter(t, Config{Redis: c, Limit: Limit{Rate: 0.1, Burst: 1}, Heartbeat: -1, Instances: 1})
	if err := lim.Wait(context.Background(), "k"); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	start := time.Now()
	if err := lim.Wait(ctx, "k"); !errors.Is(err, context.DeadlineExceeded) || time.Since(start) > 50*time.Millisecond {
		t.Errorf("Wait for 10 s with 100 ms left = %v after %v; want DeadlineExceeded at once", err, time.Since(start))
	}
}

// TestRefund gives tokens back to the path that granted them.
func TestRefund(t *testing.T) {
	_, c := miniClient(t)
	dead := refused(t)
	for _, client := range []redis.UniversalClient{c, dead} {
		// The cache stays on: a refund must lift a denial it would answer.
		lim := newLimiter(t, Config{Redis: client, Limit: PerSecond(3), Heartbeat: -1, Instances: 1})
		ctx := context.Background()
		d, err := lim.AllowN(ctx, "k", 3)
		if err != nil || !d.Allowed {
			t.Fatalf("AllowN(3) = %+v, %v", d, err)
		}
		if err := lim.Refund(ctx, "k", d, 2); err != nil {
			t.Fatalf("Refund = %v", err)
		}
		if d2, _ := lim.AllowN(ctx, "k", 2); !d2.Allowed || d2.Mode != d.Mode {
			t.Errorf("%v: AllowN(2) after refunding 2 = %+v; want allowed", d.Mode, d2)
		}
		if err := lim.Refund(ctx, "k", d, 0); !errors.Is(err, ErrInvalidN) {
			t.Errorf("Refund(0) = %v; want ErrInvalidN", err)
		}
	}
}

func TestWeigh(t *testing.T) {
	const m = 1_800_000_000 // the window the heartbeat reads
	type beat struct {
		h    remote.Heartbeat
		mine int64
	}
	hb := func(reporters, total, mine, ticket int64) beat {
		return beat{remote.Heartbeat{Window: m, Now: (m+3)*1000 + 500, Taken: true, Reporters: reporters, Total: total, Ticket: ticket}, mine}
	}
	start := &fleet{weight: 1.0 / 3, size: 3} // New's view: 1/Instances
	before := func(b beat, reporters, total, ticket int64) beat {
		b.h.Before = remote.Reading{Read: true, Reporters: reporters, Total: total, Ticket: ticket}
		return b
	}
	tests := []struct {
		name   string
		prev   *fleet
		h      beat
		before int64 // this instance's report in window m-1
		want   float64
		size   int
	}{
		{"no window reported yet", start, hb(0, 0, -1, 0), -1, 1.0 / 3, 3},
		// All of the traffic, less the reserve for instances not counted.
		{"alone", start, hb(1, 10, 10, 0), -1, 0.99, 1},
		{"80/15/5", start, hb(3, 100, 80, 0), -1, 0.9*0.8 + 0.09/3, 3},
		{"5 of 80/15/5", start, hb(3, 100, 5, 0), -1, 0.9*0.05 + 0.09/3, 3},
		{"nobody decided", start, hb(2, 0, 0, 0), -1, 0.99 / 2, 2},
		// Not counted in the window (just started, a heartbeat lost):
		// half the reserve for the first, a quarter for the second.
		{"not counted, first", start, hb(3, 100, -1, 1), -1, 0.01 / 2, 4},
		{"not counted, second", start, hb(3, 100, -1, 2), -1, 0.01 / 4, 4},
		{"not counted, the millionth", start, hb(3, 100, -1, 1e6), -1, 0, 4},
		{"more than the total", start, hb(3, 100, 101, 0), -1, 0, 4},
		// The lesser of the last two windows' parts, if they follow.
		{"rising", &fleet{weight: 0.5, window: m - 1, known: m - 1, raw: 0.5}, hb(3, 100, 80, 0), -1, 0.5, 3},
		{"falling", &fleet{weight: 0.9, window: m - 1, known: m - 1, raw: 0.9}, hb(3, 100, 5, 0), -1, 0.9*0.05 + 0.09/3, 3},
		// Windows nobody reported for leave the last one with reports
		// the one before.
		{"after windows without reports", &fleet{weight: 0.5, window: m - 3, known: m - 1, raw: 0.5}, hb(3, 100, 80, 0), -1, 0.5, 3},
		// A window this instance did not read comes with the next.
		{"missed the window before", &fleet{weight: 0.9, window: m - 2, known: m - 2, raw: 0.9}, before(hb(3, 100, 80, 0), 3, 100, 0), 5, 0.9*0.05 + 0.09/3, 3},
		{"missed it, not counted there", &fleet{weight: 0.9, window: m - 2, known: m - 2, raw: 0.9}, before(hb(3, 100, 80, 0), 3, 100, 1), -1, 0.01 / 2, 3},
		{"missed it, nobody reported there", &fleet{weight: 0.5, window: m - 2, known: m - 2, raw: 0.5}, before(hb(3, 100, 80, 0), 0, 0, 0), -1, 0.5, 3},
		// Redis could not say (too late for it): the last view's part.
		{"after a gap", &fleet{weight: 0.5, window: m - 2, known: m - 2, raw: 0.5}, hb(3, 100, 80, 0), -1, 0.5, 3},
		{"first view", &fleet{weight: 0.5}, hb(3, 100, 80, 0), -1, 0.9*0.8 + 0.09/3, 3},
		{"read twice", &fleet{weight: 0.25, size: 7, window: m, known: m, raw: 0.3}, hb(3, 100, 80, 0), -1, 0.25, 7},
	}
	for _, tt := range tests {
		got := weigh(tt.h.h, tt.h.mine, tt.before, tt.prev)
		if math.Abs(got.weight-tt.want) > 1e-12 || got.size != tt.size {
			t.Errorf("%s: weigh(%+v) = %+v; want weight %v, size %d", tt.name, tt.h, *got, tt.want, tt.size)
		}
	}
}

// TestWeighSumsToAtMostOne: for any reports, newcomers, windows nobody
// reported for and heartbeats that failed, at any moment between two
// windows (some instances hold the last window's parts, others the one
// before), the parts held add up to at most 1. Only an instance that
// missed reads and whose window before had no reports may hold more than
// its part (weigh); the trials where one does are not checked, and they
// must be few.
func TestWeighSumsToAtMostOne(t *testing.T) {
	const m = 1_800_000_000
	// Many newcomers at once: one counted instance and 200 that were not.
	sum := weigh(remote.Heartbeat{Window: m, Reporters: 1, Total: 10}, 10, -1, &fleet{}).weight
	for i := range int64(200) {
		sum += weigh(remote.Heartbeat{Window: m, Reporters: 1, Total: 10, Ticket: i + 1}, -1, -1, &fleet{}).weight
	}
	if sum > 1+1e-9 {
		t.Errorf("one instance and 200 newcomers: parts add up to %v", sum)
	}
	// Traffic moves between two instances while A misses two reads (its
	// breaker was open): A took 90% of window m-2, 10% of m-1 and m, and
	// 90% again of m+1. B, which read m-1 and m, holds 0.855. A reading
	// m+1 must not take its part there (or in m-2) beside it: it gets
	// window m with m+1 and holds the lesser.
	tokens := map[int64][2]int64{m - 2: {90, 10}, m - 1: {10, 90}, m: {10, 90}, m + 1: {90, 10}}
	read := func(w int64, who int, before bool, prev *fleet) *fleet {
		h := remote.Heartbeat{Window: w, Reporters: 2, Total: 100}
		if before {
			h.Before = remote.Reading{Read: true, Reporters: 2, Total: 100}
		}
		return weigh(h, tokens[w][who], tokens[w-1][who], prev)
	}
	a := read(m-2, 0, false, &fleet{})
	b := read(m, 1, false, read(m-1, 1, false, read(m-2, 1, false, &fleet{})))
	a = read(m+1, 0, true, a)
	if sum := a.weight + b.weight; sum > 1+1e-9 {
		t.Errorf("A back after missing two reads holds %.3f, B %.3f: %.3f in all; want at most 1", a.weight, b.weight, sum)
	}

	r := rand.New(rand.NewPCG(1, 2))
	const windows = 6 // windows m .. m+windows-1
	var checked, missed, unchained int
	for trial := range 6000 {
		n := 1 + r.IntN(40)
		// Each instance's report for each window; -1: none (not started
		// yet, or its heartbeat was lost). Some windows have none at all.
		reports := make([][windows]int64, n)
		empty := [windows]bool{}
		for w := range windows {
			empty[w] = r.IntN(5) == 0
		}
		for i := range reports {
			for w := range windows {
				switch {
				case empty[w] || r.IntN(6) == 0:
					reports[i][w] = -1
				case r.IntN(5) == 0:
					reports[i][w] = 0
				default:
					reports[i][w] = r.Int64N(1000)
				}
			}
		}
		sums := func(w int) (reporters, total int64) {
			for _, rep := range reports {
				if rep[w] >= 0 {
					reporters++
					total += rep[w]
				}
			}
			return reporters, total
		}
		// Each instance reads windows in order up to the last or the one
		// before (the moment between them); one of its earlier reads may
		// fail. Redis gives out tickets in each window in the order they
		// are asked for, window by window.
		var tickets [windows]int64
		views := make([]*fleet, n)
		last := make([]int, n)
		learned := make([][windows]bool, n) // windows whose sums each instance got
		for i := range views {
			views[i] = &fleet{weight: 1.0 / 3, size: 3}
			last[i] = windows - 1 - r.IntN(2)
		}
		for w := range windows {
			for _, i := range r.Perm(n) {
				if w > last[i] || w < last[i] && r.IntN(4) == 0 {
					continue // not yet, or its heartbeat failed
				}
				prev := views[i]
				h := remote.Heartbeat{Window: m + int64(w), Now: (m+int64(w)+3)*1000 + 1}
				h.Reporters, h.Total = sums(w)
				if h.Reporters > 0 && reports[i][w] < 0 {
					tickets[w]++
					h.Ticket = tickets[w]
				}
				learned[i][w] = true
				if prev.known < h.Window-1 && w > 0 {
					missed++
					learned[i][w-1] = true
					b := &h.Before
					b.Read = true
					b.Reporters, b.Total = sums(w - 1)
					if b.Reporters > 0 && reports[i][w-1] < 0 {
						tickets[w-1]++
						b.Ticket = tickets[w-1]
					}
				}
				before := int64(-1)
				if w > 0 {
					before = reports[i][w-1]
				}
				views[i] = weigh(h, reports[i][w], before, prev)
			}
		}
		// The rule bounds the sum when every instance learned the sum of
		// the last window with reports it could have read, V, and of
		// every window back to the one with reports before it, P: it then
		// holds the view of V, and no more than its part of P, and all of
		// them hold no more than their parts of one window (P, or V for
		// those a window behind). An instance that did not (its reads of
		// them failed) holds an older part, which the rule leaves out.
		lastReported := func(w int) int {
			for ; w >= 0; w-- {
				if n, _ := sums(w); n > 0 {
					return w
				}
			}
			return -1
		}
		var sum float64
		ok := true
		for i, v := range views {
			if v.window == 0 {
				continue // no window yet: 1/Instances, the configured guess
			}
			sum += v.weight
			V := lastReported(last[i])
			entitled := V >= 0 && learned[i][V]
			for w := V - 1; entitled && w >= 0; w-- {
				entitled = learned[i][w]
				if n, _ := sums(w); n > 0 {
					break // P
				}
			}
			if !entitled {
				ok = false
				continue
			}
			if v.window != m+int64(V) {
				t.Fatalf("trial %d: instance %d learned every window back from %d, and holds the view of %d", trial, i, V, v.window-m)
			}
		}
		if !ok {
			unchained++
			continue
		}
		checked++
		if sum > 1+1e-9 {
			t.Fatalf("trial %d: %d instances, reports %v: parts add up to %v", trial, n, reports, sum)
		}
	}
	t.Logf("%d trials checked, %d not (an instance held an older part); %d reads came with the window before", checked, unchained, missed)
	if checked < 3000 || missed < 1000 {
		t.Errorf("%d trials checked, %d reads with the window before; want at least 3000 and 1000", checked, missed)
	}
}

// TestKeySharesSumToAtMostOnePlus: for random fleets (weights that add up
// to at most 1, per-key parts that add up to at most 1, as
// remote.TestPartsSumToAtMostOne checks they do, and any instance with or
// without a part, near the limit or not), the shares held of one key add
// up to at most 1 + min(A, W): A the parts of the instances that hold
// their part, W the weights of those that hold their weight. A fleet where
// every instance holds the same kind stays within 1, and one instance
// holding all of a sticky key beside two that never saw it reaches the
// bound.
func TestKeySharesSumToAtMostOnePlus(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	split := func(n int, total float64) []float64 {
		xs := make([]float64, n)
		var sum float64
		for i := range xs {
			xs[i] = r.ExpFloat64()
			sum += xs[i]
		}
		for i := range xs {
			xs[i] *= total / sum
		}
		return xs
	}
	worst := 0.0
	for trial := range 20000 {
		n := 1 + r.IntN(40)
		weights, parts := split(n, 1-r.Float64()*r.Float64()), split(n, 1-r.Float64()*r.Float64())
		var sum, a, w float64
		var byPart, byWeight int
		for i := range n {
			ok, near := r.IntN(3) > 0, r.IntN(2) == 0
			s := keyShare(weights[i], parts[i], near, ok)
			sum += s
			if ok && s == parts[i] {
				a += s
				byPart++
			} else {
				w += s
				byWeight++
			}
		}
		bound := 1 + min(a, w)
		if byPart == 0 || byWeight == 0 {
			bound = 1
		}
		if sum > bound+1e-9 {
			t.Fatalf("trial %d: %d instances: shares add up to %v; want at most %v (parts held %v, weights held %v)", trial, n, sum, bound, a, w)
		}
		worst = max(worst, sum-1)
	}
	t.Logf("largest excess over 1: %.3f", worst)
	// Sticky: instance 0 took all of the key, the others never saw it.
	sum := keyShare(0.53, 0.99, true, true) + keyShare(0.235, 0, false, false) + keyShare(0.235, 0, false, false)
	if want := 0.99 + 0.47; math.Abs(sum-want) > 1e-9 {
		t.Errorf("sticky key: shares add up to %v; want %v", sum, want)
	}
	// One of four even instances whose measured part fell under its
	// weight (a lower bound, scattered from 0.15 to 0.29 around 0.25)
	// keeps its weight: taking the part left the fleet under the limit.
	if got := keyShare(0.247, 0.15, true, true); got != 0.247 {
		t.Errorf("keyShare(weight 0.247, key share 0.15, near) = %v; want the weight", got)
	}
	// An instance whose weight comes from another key takes its measured
	// share of a busy key it served a third of.
	if got := keyShare(0.53, 0.32, true, true); got != 0.32 {
		t.Errorf("keyShare(weight 0.53, key share 0.32, near) = %v; want the key share", got)
	}
}

// TestKeySharesOfAFleetSumBelowTheReserve: the key shares the instances of
// a fleet would hold for one key, each (1-evenPart) × its part plus the
// even part of its view (keyWeight), add up to at most 1 - reservePart for
// any parts that add up to at most 1, whatever the traffic and however many
// others reported in either window: the reserve stays for newcomers.
func TestKeySharesOfAFleetSumBelowTheReserve(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 6))
	worst := 0.0
	for trial := range 5000 {
		n := 1 + r.IntN(40)                      // counted in both windows
		others1, others2 := r.IntN(5), r.IntN(5) // reported in one window only
		mine1, mine2 := make([]int64, n), make([]int64, n)
		total1, total2 := r.Int64N(100), r.Int64N(100) // the others' traffic
		for i := range n {
			mine1[i], mine2[i] = r.Int64N(100), r.Int64N(100)
			total1 += mine1[i]
			total2 += mine2[i]
		}
		parts := make([]float64, n)
		var psum float64
		for i := range parts {
			parts[i] = r.ExpFloat64()
			psum += parts[i]
		}
		scale := (1 - r.Float64()*r.Float64()) / psum
		var sum float64
		for i := range n {
			v1 := weigh(remote.Heartbeat{Window: 10, Reporters: int64(n + others1), Total: total1}, mine1[i], -1, &fleet{})
			v2 := weigh(remote.Heartbeat{Window: 11, Reporters: int64(n + others2), Total: total2}, mine2[i], mine1[i], v1)
			if !v2.counted || v2.even == 0 {
				t.Fatalf("trial %d: instance %d counted in both windows has view %+v; want counted, with an even part", trial, i, v2)
			}
			sum += (1-evenPart)*parts[i]*scale + v2.even
		}
		if sum > 1-reservePart+1e-9 {
			t.Fatalf("trial %d: %d instances: key shares add up to %v; want at most %v", trial, n, sum, 1-reservePart)
		}
		worst = max(worst, sum)
	}
	t.Logf("largest sum of key shares: %.4f (bound %.2f)", worst, 1-reservePart)
}

// TestRefundGivesBackOnlyWhatWasGranted: Refund gives back tokens "in the
// path that granted d". A denial (Redis's, the cache's or the local
// share's) granted nothing, a Shadowed decision's tokens were never taken,
// and AllowAtMost's Granted may be less than asked: refunding more than
// that mints tokens the bucket never gave. The per-IP/per-user pattern of
// ExampleLimiter_Refund makes that easy: the refund is written for the
// token asked, not for the one granted.
func TestRefundGivesBackOnlyWhatWasGranted(t *testing.T) {
	m, c := miniClient(t)
	clock := newFakeClock(m)
	for _, tc := range []struct {
		name   string
		client redis.UniversalClient
		mode   Mode
	}{
		{"remote", c, ModeRemote},
		{"local", refused(t), ModeLocal},
	} {
		t.Run(tc.name, func(t *testing.T) {
			lim := newLimiter(t, Config{Redis: tc.client, Limit: PerMinute(10), Heartbeat: -1, Instances: 1,
				now: clock.Now, Prefix: t.Name() + ":"})
			ctx := context.Background()
			// take spends n tokens of key and returns the decision and
			// the tokens it granted.
			take := func(key string, n int64, atMost bool) (Decision, int64) {
				t.Helper()
				var d Decision
				var err error
				if atMost {
					d, err = lim.AllowAtMost(ctx, key, n)
				} else {
					d, err = lim.AllowN(ctx, key, n)
				}
				if err != nil || d.Mode != tc.mode {
					t.Fatalf("AllowN(%q, %d) = %+v, %v; want mode %v", key, n, d, err, tc.mode)
				}
				if !d.Allowed {
					return d, 0
				}
				if atMost {
					return d, d.Granted
				}
				return d, n
			}
			// A denied token, refunded: nothing was granted, so nothing
			// goes back.
			_, a := take("denied", 10, false)
			d, _ := take("denied", 1, false)
			if d.Allowed {
				t.Fatalf("AllowN(1) on an empty bucket = %+v; want denied", d)
			}
			if err := lim.Refund(ctx, "denied", d, 5); err != nil {
				t.Fatalf("Refund(denied) = %v", err)
			}
			_, b := take("denied", 5, false)
			if got := a + b; got > 10 {
				t.Errorf("%v: refunding a denial: admitted %d tokens without any time passing; want at most the burst, 10", tc.mode, got)
			}
			// AllowAtMost asked for 8 and was granted the 3 the bucket held;
			// the caller gives back the 8 it asked for.
			_, a = take("atmost", 7, false)
			d, g := take("atmost", 8, true)
			if g != 3 {
				t.Fatalf("AllowAtMost(8) after 7 of 10 = %+v; want 3 granted", d)
			}
			if err := lim.Refund(ctx, "atmost", d, 8); err != nil && !errors.Is(err, ErrInvalidN) {
				t.Fatalf("Refund(8) of an AllowAtMost that granted 3 = %v; want nil or ErrInvalidN", err)
			}
			_, b = take("atmost", 8, false)
			if got := a + b; got > 10 {
				t.Errorf("%v: refunding 8 of an AllowAtMost that granted 3: admitted %d tokens without any time passing; want at most the burst, 10", tc.mode, got)
			}
		})
	}
}

// TestRefundNotGranted: a Refund of a decision that granted nothing (a
// denial, or a denial that Config.Shadow let through) gives nothing back:
// otherwise every denied request would mint a token, and a client whose
// code refunds both checks of a request when either denies (the natural
// way to write ExampleLimiter_Refund for two limits) doubles its limit.
func TestRefundNotGranted(t *testing.T) {
	_, c := miniClient(t)
	for _, shadow := range []bool{false, true} {
		lim := newLimiter(t, Config{Redis: c, Limit: PerMinute(1), Heartbeat: -1, Instances: 1, Shadow: shadow,
			Prefix: t.Name() + ":" + map[bool]string{false: "enforce", true: "shadow"}[shadow] + ":"})
		ctx := context.Background()
		if d, err := lim.Allow(ctx, "k"); err != nil || !d.Allowed || d.Shadowed {
			t.Fatalf("shadow %v: first Allow = %+v, %v; want allowed", shadow, d, err)
		}
		denied, err := lim.Allow(ctx, "k")
		if err != nil || denied.Allowed != shadow || denied.Shadowed != shadow {
			t.Fatalf("shadow %v: second Allow = %+v, %v; want a denial", shadow, denied, err)
		}
		if err := lim.Refund(ctx, "k", denied, 1); err != nil {
			t.Fatalf("shadow %v: Refund = %v", shadow, err)
		}
		st, err := lim.Peek(ctx, "k")
		if err != nil || st.Remaining != 0 {
			t.Errorf("shadow %v: after refunding a denial, Peek = %+v, %v; want Remaining 0 (nothing was taken)",
				shadow, st, err)
		}
	}
}

// TestRefundShadowedPartialGrant: under Config.Shadow, an AllowAtMost that
// the bucket grants only part of (3 of 8) is Shadowed with Granted 8, but
// the bucket did give its 3: a Refund of them must put them back, as it
// does without Shadow. Treating every Shadowed decision as "nothing taken"
// loses them.
func TestRefundShadowedPartialGrant(t *testing.T) {
	_, c := miniClient(t)
	lim := newLimiter(t, Config{Redis: c, Limit: PerMinute(10), Heartbeat: -1, Instances: 1, Shadow: true,
		Prefix: t.Name() + ":"})
	ctx := context.Background()
	if d, err := lim.AllowN(ctx, "k", 7); err != nil || !d.Allowed || d.Shadowed {
		t.Fatalf("AllowN(7) = %+v, %v; want allowed, not Shadowed", d, err)
	}
	d, err := lim.AllowAtMost(ctx, "k", 8)
	if err != nil || !d.Shadowed {
		t.Fatalf("AllowAtMost(8) after 7 of 10 = %+v, %v; want Shadowed", d, err)
	}
	if err := lim.Refund(ctx, "k", d, 8); err != nil {
		t.Fatalf("Refund(8) = %v", err)
	}
	st, err := lim.Peek(ctx, "k")
	if err != nil || st.Remaining != 3 {
		t.Errorf("after refunding a Shadowed AllowAtMost that took 3, Peek = %+v, %v; want Remaining 3", st, err)
	}
}

// TestCachedDenialOfABucketInDebt: a denial answered from what Redis said
// of a bucket in debt (a WaitN's reservation) reports Remaining as Redis's
// answer does, at least 0: not a negative count of tokens.
func TestCachedDenialOfABucketInDebt(t *testing.T) {
	m, c := miniClient(t)
	clock := newFakeClock(m) // stands still: the debt stays
	lim := newLimiter(t, Config{Redis: c, Limit: PerSecond(10), Heartbeat: -1, Instances: 1, now: clock.Now})
	ctx := context.Background()
	if d, err := lim.AllowN(ctx, "k", 10); err != nil || !d.Allowed {
		t.Fatalf("AllowN(10) = %+v, %v", d, err)
	}
	// A waiter reserves 10 tokens ahead of the refill: the bucket owes 10.
	wctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- lim.WaitN(wctx, "k", 10) }()
	defer func() { cancel(); <-done }()
	for {
		if st, err := lim.Peek(ctx, "k"); err == nil && st.Tokens < -9 {
			break
		}
		time.Sleep(time.Millisecond)
	}
	d, err := lim.Allow(ctx, "k")
	if err != nil || d.Allowed {
		t.Fatalf("Allow = %+v, %v; want denied", d, err)
	}
	if d.Remaining < 0 {
		t.Errorf("Allow on a bucket owing 10 = %+v; want Remaining 0 (cached %v), not %d", d, d.Cached, d.Remaining)
	}
}
