package local

import (
	"math"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/time/rate"

	"github.com/hybridlimit/hybridlimit/remote"
)

// t0 is the start of every test's clock; times are offsets from it.
var t0 = time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)

const ms = time.Millisecond

// allow is one AllowN call at t0+at and the Result it should return.
type allow struct {
	at    time.Duration
	key   string
	r     rate.Limit
	burst int
	n     int
	want  Result
}

// run makes the calls in order and reports every Result that differs.
func run(t *testing.T, s *Shares, steps []allow) {
	t.Helper()
	for i, st := range steps {
		got := s.AllowN(t0.Add(st.at), st.key, st.r, st.burst, float64(st.burst), st.n)
		if got != st.want {
			t.Errorf("step %d: AllowN(%q, %d) at t0+%v = %+v; want %+v", i, st.key, st.n, st.at, got, st.want)
		}
	}
}

// repeat returns count copies of st, with Remaining counting down by n from
// st.want.Remaining and ResetAfter growing by step.
func repeat(count int, st allow, step time.Duration) []allow {
	steps := make([]allow, count)
	for i := range steps {
		steps[i] = st
		steps[i].want.Remaining -= int64(i * st.n)
		steps[i].want.ResetAfter += time.Duration(i) * step
	}
	return steps
}

// ok and denied build expected Results.
func ok(remaining int64, reset time.Duration) Result {
	return Result{Allowed: true, Remaining: remaining, ResetAfter: reset}
}

func denied(remaining int64, retry, reset time.Duration) Result {
	return Result{Remaining: remaining, RetryAfter: retry, ResetAfter: reset}
}

func concat(parts ...[]allow) []allow {
	var all []allow
	for _, p := range parts {
		all = append(all, p...)
	}
	return all
}

// inf is rate.InfDuration, for short tables.
const inf = rate.InfDuration

func TestAllowN(t *testing.T) {
	// A global 100/s with burst 100 shared by 3 instances: 100/3 per second
	// (one token every 30ms exactly) and burst 33.
	const third = rate.Limit(100.0 / 3)
	// The same share written as 33.3/s: one token every 30.03003003ms, so
	// 30ms refills only 0.999 of a token.
	const r333 = rate.Limit(33.3)

	tests := []struct {
		name  string
		steps []allow
	}{
		{"doc example", []allow{
			{0, "k", 10, 10, 3, ok(7, 300*ms)},
			{0, "k", 10, 10, 9, denied(7, 200*ms, 300*ms)},
		}},
		{"share 100/3", concat(
			repeat(33, allow{0, "k", third, 33, 1, ok(32, 30*ms)}, 30*ms),
			[]allow{
				{0, "k", third, 33, 1, denied(0, 30*ms, 990*ms)},
				{29 * ms, "k", third, 33, 1, denied(0, 1*ms, 961*ms)},
				{30 * ms, "k", third, 33, 1, ok(0, 990*ms)},
				{30 * ms, "k", third, 33, 1, denied(0, 30*ms, 990*ms)},
			},
		)},
		{"share 33.3", []allow{
			{0, "k", r333, 33, 33, ok(0, 990990991)},
			{0, "k", r333, 33, 1, denied(0, 30030030, 990990991)},
			{30 * ms, "k", r333, 33, 1, denied(0, 30030, 960990991)},
			{30030029, "k", r333, 33, 1, denied(0, 1, 960960962)},
			// x/time/rate admits a deficit it would refill in under 1ns:
			// 0.999999999 tokens are enough at t0+RetryAfter.
			{30030030, "k", r333, 33, 1, ok(0, 990990991)},
			{30030030, "k", r333, 33, 1, denied(0, 30030030, 990990991)},
		}},
		{"keys are separate", []allow{
			{0, "a", 1, 2, 2, ok(0, 2*time.Second)},
			{0, "b", 1, 2, 1, ok(1, 1*time.Second)},
			{0, "a", 1, 2, 1, denied(0, 1*time.Second, 2*time.Second)},
		}},
		{"n > burst never fits", []allow{
			{0, "k", 10, 5, 6, denied(5, inf, 0)},
			{0, "k", 10, 5, 5, ok(0, 500*ms)},
		}},
		{"limit change keeps level", []allow{
			{0, "k", 10, 10, 6, ok(4, 600*ms)},
			{0, "k", 20, 20, 0, ok(4, 800*ms)},              // faster and bigger, still 4
			{100 * ms, "k", 20, 20, 6, ok(0, time.Second)},  // 4 + 100ms × 20/s
			{200 * ms, "k", 5, 10, 0, ok(2, 1600*ms)},       // 0 + 100ms × 20/s
			{600 * ms, "k", 5, 10, 4, ok(0, 2*time.Second)}, // 2 + 400ms × 5/s
		}},
		{"burst cut clamps level", []allow{
			{0, "k", 10, 10, 2, ok(8, 200*ms)},
			{0, "k", 10, 5, 0, ok(5, 0)},
			{0, "k", 10, 5, 5, ok(0, 500*ms)},
		}},
		{"n <= 0 takes nothing", []allow{
			{0, "k", 10, 10, 0, ok(10, 0)},
			{0, "k", 10, 10, -5, ok(10, 0)},
			{0, "k", 10, 10, 10, ok(0, time.Second)},
		}},
		{"zero rate never refills", []allow{
			{0, "k", 0, 2, 1, ok(1, inf)},
			{0, "k", 0, 2, 1, ok(0, inf)},
			{time.Hour, "k", 0, 2, 1, denied(0, inf, inf)},
		}},
		{"NaN and negative rates count as zero", []allow{
			{0, "nan", rate.Limit(math.NaN()), 1, 1, ok(0, inf)},
			{time.Hour, "nan", rate.Limit(math.NaN()), 1, 1, denied(0, inf, inf)},
			{0, "neg", -1, 1, 1, ok(0, inf)},
			{time.Hour, "neg", -1, 1, 1, denied(0, inf, inf)},
		}},
		{"infinite rates allow all", []allow{
			{0, "inf", rate.Inf, 0, 1000, ok(0, 0)},
			{0, "inf", rate.Inf, 3, 1000, ok(3, 0)},
			{0, "+Inf", rate.Limit(math.Inf(1)), 3, 1000, ok(3, 0)},
		}},
		{"zero and negative burst deny", []allow{
			{0, "zero", 10, 0, 1, denied(0, inf, 0)},
			{0, "neg", 10, -3, 1, denied(0, inf, 0)},
		}},
		{"tiny rate waits are capped", []allow{
			{0, "k", 1e-12, 1, 1, ok(0, inf)},
			{0, "k", 1e-12, 1, 1, denied(0, inf, inf)},
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			run(t, New(0), tt.steps)
		})
	}
}

// TestSeed: a local bucket created after Observe starts from what Redis
// said, refilled since, keeping fractions of a token.
func TestSeed(t *testing.T) {
	tests := []struct {
		name   string
		at     time.Duration // Seed's time, from t0
		r      rate.Limit
		burst  int
		tokens float64
		steps  []allow
	}{
		{"level", 0, 10, 100, 10, concat(
			repeat(10, allow{0, "k", 10, 100, 1, ok(9, 9100*ms)}, 100*ms),
			[]allow{{0, "k", 10, 100, 1, denied(0, 100*ms, 10*time.Second)}},
		)},
		{"earlier time refills since", -500 * ms, 10, 100, 0, []allow{
			{0, "k", 10, 100, 0, ok(5, 9500*ms)},
			{0, "k", 10, 100, 5, ok(0, 10*time.Second)},
		}},
		{"fraction kept", 0, 10, 10, 2.5, []allow{
			{0, "k", 10, 10, 0, ok(2, 750*ms)},
			{0, "k", 10, 10, 3, denied(2, 50*ms, 750*ms)},
			{50 * ms, "k", 10, 10, 3, ok(0, time.Second)},
		}},
		{"above burst is full", 0, 10, 10, 1000, []allow{
			{0, "k", 10, 10, 0, ok(10, 0)},
		}},
		{"below zero is empty", 0, 10, 10, -1, []allow{
			{0, "k", 10, 10, 1, denied(0, 100*ms, time.Second)},
		}},
		{"NaN is empty", 0, 10, 10, math.NaN(), []allow{
			{0, "k", 10, 10, 1, denied(0, 100*ms, time.Second)},
		}},
		{"zero rate", 0, 0, 10, 2.5, []allow{
			{0, "k", 0, 10, 2, ok(0, inf)},
			{time.Hour, "k", 0, 10, 1, denied(0, inf, inf)},
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			// Redis said the bucket, of the same burst, held tokens at at;
			// the local bucket starts from there.
			s := New(0)
			s.Observe(t0.Add(tt.at), 1, "k", tt.tokens, float64(tt.r), float64(tt.burst))
			run(t, s, tt.steps)
		})
	}
}

func TestSweep(t *testing.T) {
	s := New(0)
	run(t, s, []allow{
		{0, "full", 10, 10, 0, ok(10, 0)},
		{0, "refilled", 10, 10, 1, ok(9, 100*ms)},
		{0, "taken", 10, 10, 5, ok(5, 500*ms)},
	})
	if got := s.Sweep(t0.Add(100 * ms)); got != 2 {
		t.Errorf("Sweep(t0+100ms) = %d; want 2", got)
	}
	if got := s.Len(); got != 1 {
		t.Errorf("Len() = %d; want 1", got)
	}
	// The bucket that was not full kept its level.
	run(t, s, []allow{{100 * ms, "taken", 10, 10, 0, ok(6, 400*ms)}})
	if got := s.Sweep(t0.Add(time.Second)); got != 1 {
		t.Errorf("Sweep(t0+1s) = %d; want 1", got)
	}
	if got := s.Len(); got != 0 {
		t.Errorf("Len() = %d; want 0", got)
	}
}

func TestNewSplitsCap(t *testing.T) {
	for _, maxKeys := range []int{-1, 0, 1, 2, 63, 64, 65, 1000, 1 << 20} {
		s := New(maxKeys)
		want := maxKeys
		if want < 1 {
			want = DefaultMaxKeys
		}
		sum := 0
		for i := range s.shards {
			if s.shards[i].max < 1 {
				t.Errorf("New(%d): shard %d has cap %d; want >= 1", maxKeys, i, s.shards[i].max)
			}
			sum += s.shards[i].max
		}
		if sum != want || len(s.shards) > maxShards {
			t.Errorf("New(%d): %d shards, caps sum to %d; want <= %d shards, sum %d", maxKeys, len(s.shards), sum, maxShards, want)
		}
	}
}

func TestCap(t *testing.T) {
	const maxKeys = 1000
	s := New(maxKeys)
	for i := range 100_000 {
		key := "key-" + strconv.Itoa(i)
		// Each bucket is left non-full, so nothing can be swept: the cap
		// holds by eviction alone.
		if got := s.AllowN(t0, key, 1, 10, 10.0, 1); !got.Allowed {
			t.Fatalf("AllowN(%q, 1) = %+v; want allowed", key, got)
		}
		if i%1000 == 0 {
			if got := s.Len(); got > maxKeys {
				t.Fatalf("after %d keys: Len() = %d; want <= %d", i+1, got, maxKeys)
			}
		}
	}
	// 100,000 keys over 64 shards of 15 or 16 fill every shard.
	if got := s.Len(); got != maxKeys {
		t.Errorf("Len() = %d; want %d", got, maxKeys)
	}
}

// sameShard returns n keys that s keeps in one shard.
func sameShard(s *Shares, n int) []string {
	byShard := map[*shard][]string{}
	for i := 0; ; i++ {
		key := "key-" + strconv.Itoa(i)
		sh := s.shard(key)
		byShard[sh] = append(byShard[sh], key)
		if len(byShard[sh]) == n {
			return byShard[sh]
		}
	}
}

func TestCapDropsFullFirst(t *testing.T) {
	s := New(2 * maxShards) // 64 shards of 2
	k := sameShard(s, 4)
	run(t, s, []allow{
		{0, k[0], 10, 10, 0, ok(10, 0)},
		{0, k[1], 10, 10, 1, ok(9, 100*ms)},
		{0, k[2], 10, 10, 1, ok(9, 100*ms)}, // drops the full k[0]
		{0, k[1], 10, 10, 0, ok(9, 100*ms)}, // k[1] kept its level
	})
	if got := s.Len(); got != 2 {
		t.Errorf("Len() = %d; want 2", got)
	}
	// Neither k[1] nor k[2] is full: one of them is evicted.
	run(t, s, []allow{{0, k[3], 10, 10, 1, ok(9, 100*ms)}})
	if got := s.Len(); got != 2 {
		t.Errorf("Len() = %d; want 2", got)
	}
	sh := s.shard(k[3])
	_, has1 := sh.m[k[1]]
	_, has2 := sh.m[k[2]]
	if has1 == has2 {
		t.Errorf("after eviction: have k[1] %v, k[2] %v; want exactly one", has1, has2)
	}
}

func TestConcurrentOneKey(t *testing.T) {
	const (
		goroutines = 16
		tries      = 1000
		burst      = 100
	)
	s := New(0)
	var allowed atomic.Int64
	var wg sync.WaitGroup
	for range goroutines {
		wg.Go(func() {
			for range tries {
				// One instant for all: no refill, so exactly burst fit.
				if s.AllowN(t0, "hot", 10, burst, float64(burst), 1).Allowed {
					allowed.Add(1)
				}
			}
		})
	}
	wg.Wait()
	if got := allowed.Load(); got != burst {
		t.Errorf("%d goroutines × %d AllowN(%q, 1) admitted %d; want %d", goroutines, tries, "hot", got, burst)
	}
}

func TestConcurrentManyKeys(t *testing.T) {
	const goroutines = 16
	s := New(100) // small, so that calls race with evictions
	var wg sync.WaitGroup
	for g := range goroutines {
		wg.Go(func() {
			for i := range 2000 {
				now := t0.Add(time.Duration(i) * ms)
				key := strconv.Itoa((g*7 + i) % 300)
				s.AllowN(now, key, 100, 10, 10.0, 1)
				if i%100 == 0 {
					s.Observe(now, int64(i), key, 5, 100, 10)
					s.Settle(key, 1, Entry{})
					s.Drain(now, nil, func(string, float64, Entry) {})
					s.Sweep(now)
				}
			}
		})
	}
	wg.Wait()
	if got := s.Len(); got > 100 {
		t.Errorf("Len() = %d; want <= 100", got)
	}
}

func TestAllowNAllocs(t *testing.T) {
	s := New(0)
	s.AllowN(t0, "k", 1000, 10, 10.0, 1)
	now := t0
	allocs := testing.AllocsPerRun(1000, func() {
		now = now.Add(ms)
		s.AllowN(now, "k", 1000, 10, 10.0, 1)
	})
	if allocs != 0 {
		t.Errorf("AllowN on an existing key: %v allocs; want 0", allocs)
	}
	// A changed limit does not allocate either.
	lim := rate.Limit(1000)
	allocs = testing.AllocsPerRun(1000, func() {
		lim++
		s.AllowN(now, "k", lim, 10, 10.0, 1)
	})
	if allocs != 0 {
		t.Errorf("AllowN with a new limit: %v allocs; want 0", allocs)
	}
}

// maxBytesPerKey bounds the heap per bucket in TestMemoryPerKey. Measured on
// linux/amd64 with Go 1.26: 248 bytes per key for keys of up to 10 bytes
// (the bucket, the key's string and its share of the shard's map).
const maxBytesPerKey = 256

// TestMemoryPerKey fills 250,000 buckets: a map doubles as it grows, so the
// bytes per key depend on where in its growth the map stands, and a
// quarter of 1,000,000 keys puts each shard's map at the same point as
// 1,000,000 keys do (248 bytes per key for both), in a sixth of the time.
func TestMemoryPerKey(t *testing.T) {
	if testing.Short() {
		t.Skip("fills 250,000 buckets")
	}
	const keys = 250_000
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)

	s := New(keys)
	buf := make([]byte, 0, 32)
	for i := range keys {
		buf = strconv.AppendInt(append(buf[:0], "key-"...), int64(i), 10)
		s.AllowN(t0, string(buf), 100, 100, 100.0, 1)
	}
	// Each shard holds at most keys/64 buckets, and the hash does not
	// split the keys evenly, so shards that got more keys evicted some.
	held := s.Len()
	if held > keys || held < keys*99/100 {
		t.Fatalf("Len() = %d; want between %d and %d", held, keys*99/100, keys)
	}

	runtime.GC()
	runtime.ReadMemStats(&after)
	runtime.KeepAlive(s)
	perKey := float64(after.HeapAlloc-before.HeapAlloc) / float64(held)
	t.Logf("%d keys, %d held: %.0f bytes of heap per key", keys, held, perKey)
	if perKey > maxBytesPerKey {
		t.Errorf("%d buckets take %.0f bytes of heap per key; want <= %d", held, perKey, maxBytesPerKey)
	}
}

func BenchmarkAllowN(b *testing.B) {
	const nkeys = 10_000
	keys := make([]string, nkeys)
	for i := range keys {
		keys[i] = "key-" + strconv.Itoa(i)
	}
	run := func(b *testing.B, key func(i int) string) {
		s := New(0)
		for _, k := range keys {
			s.AllowN(t0, k, 1e6, 1000, 1000.0, 1)
		}
		s.AllowN(t0, "hot", 1e6, 1000, 1000.0, 1)
		b.ReportAllocs()
		b.ResetTimer()
		b.RunParallel(func(pb *testing.PB) {
			now := t0
			for i := 0; pb.Next(); i++ {
				now = now.Add(time.Microsecond)
				s.AllowN(now, key(i), 1e6, 1000, 1000.0, 1)
			}
		})
	}
	b.Run("keys=10000", func(b *testing.B) {
		run(b, func(i int) string { return keys[(i*7919)%nkeys] })
	})
	b.Run("hot", func(b *testing.B) {
		run(b, func(int) string { return "hot" })
	})
}

// BenchmarkAllowNNewKeys measures a flood of new keys into full shards
// whose buckets are all partly used, so that every new key first scans its
// shard for full buckets and then evicts one.
func BenchmarkAllowNNewKeys(b *testing.B) {
	for _, maxKeys := range []int{1000, DefaultMaxKeys} {
		b.Run("maxKeys="+strconv.Itoa(maxKeys), func(b *testing.B) {
			s := New(maxKeys)
			var next atomic.Int64
			for range maxKeys {
				s.AllowN(t0, "fill-"+strconv.FormatInt(next.Add(1), 10), 1, 10, 10.0, 1)
			}
			b.ReportAllocs()
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				buf := make([]byte, 0, 32)
				for pb.Next() {
					buf = strconv.AppendInt(append(buf[:0], "new-"...), next.Add(1), 10)
					s.AllowN(t0, string(buf), 1, 10, 10.0, 1)
				}
			})
		})
	}
}

// TestObserveSeeds: a local bucket starts from what Redis last said of the
// key, refilled since, instead of full.
func TestObserveSeeds(t *testing.T) {
	s := New(100)
	// Redis said the key held 20 of its 100 tokens at t0, refilling 10/s.
	// This instance holds a third: 33 tokens, 3.33/s, so its bucket starts
	// at 6.6 at t0 (20% of 33).
	s.Observe(t0, 1, "k", 20, 10, 100)
	if tokens, r, at, ok := s.Seen("k"); !ok || tokens != 20 || r != 10 || !at.Equal(t0) {
		t.Errorf("Seen = %v, %v, %v, %v; want 20, 10, t0, true", tokens, r, at, ok)
	}
	// An answer Redis gave earlier, arriving later, does not replace it;
	// one from a Redis whose clock went back by more than a second does.
	s.Observe(t0, 0, "k", 30, 10, 100)
	if tokens, _, _, _ := s.Seen("k"); tokens != 20 {
		t.Errorf("Seen after an older answer = %v tokens; want 20", tokens)
	}
	s.Observe(t0, -2e6, "k", 20, 10, 100)
	if _, _, _, ok := s.Seen("other"); ok {
		t.Errorf("Seen(other) = ok; want nothing observed")
	}
	r := rate.Limit(100.0 / 3)
	// 300 ms later it holds 6.6 + 10 = 16.6 tokens.
	got := s.AllowN(t0.Add(300*ms), "k", r, 33, 33.0, 16)
	if !got.Allowed || got.Remaining != 0 {
		t.Errorf("AllowN(16) after the hand-off = %+v; want allowed, 0 left", got)
	}
	if got := s.AllowN(t0.Add(300*ms), "k", r, 33, 33.0, 1); got.Allowed {
		t.Errorf("AllowN(1) = %+v; want denied: the bucket did not start full", got)
	}
}

// TestDrain: Drain reports what was spent beyond the untouched level,
// measures from there on, leaves other keys alone, and reports again what
// Settle did not confirm.
func TestDrain(t *testing.T) {
	s := New(1000) // room for every key in any shard: none is evicted
	r := rate.Limit(10)
	s.Observe(t0, 1, "a", 5, 10, 10) // 5 of 10 tokens
	s.AllowN(t0, "a", r, 10, 10.0, 4)
	s.AllowN(t0, "b", r, 10, 10.0, 10) // starts full: spends 10, 2 refilled by at
	s.AllowN(t0, "c", r, 10, 10.0, 2)  // not matched
	s.Observe(t0, 1, "d", 5, 10, 10)   // observed only: nothing to charge
	at := t0.Add(200 * ms)             // 2 tokens refilled since t0
	drain := func(at time.Time, match func(string) bool) map[string]float64 {
		got := map[string]float64{}
		s.Drain(at, match, func(key string, spent float64, _ Entry) { got[key] = spent })
		return got
	}
	// a: untouched 5+2, holds 1+2. b: untouched 10 (full), holds 2.
	got := drain(at, func(key string) bool { return key != "c" })
	if len(got) != 2 || math.Abs(got["a"]-4) > 1e-9 || math.Abs(got["b"]-8) > 1e-9 {
		t.Errorf("Drain = %v; want map[a:4 b:8]", got)
	}
	s.Settle("a", 4, Entry{}) // Redis took a's charge; b's failed
	// The drained buckets go on: a held 3 at t0+200ms, full at t0+1s.
	if res := s.AllowN(t0.Add(time.Second), "a", r, 10, 10.0, 10); !res.Allowed {
		t.Errorf("AllowN(10) on a after Drain = %+v; want allowed: 3 + 8 refilled", res)
	}
	// b goes on from the 2 it held, not from a fresh bucket.
	if res := s.AllowN(at, "b", r, 10, 10.0, 3); res.Allowed || res.Remaining != 2 {
		t.Errorf("AllowN(3) on b after Drain = %+v; want denied, 2 left", res)
	}
	// At t0+1s, a spent all 10 of a bucket that would be full; b reports
	// its 8 again, and nothing more (its new bucket is full again); c,
	// left alone by the first Drain, has refilled what it spent.
	got = drain(t0.Add(time.Second), nil)
	if len(got) != 2 || math.Abs(got["a"]-10) > 1e-9 || math.Abs(got["b"]-8) > 1e-9 {
		t.Errorf("second Drain = %v; want map[a:10 b:8]", got)
	}
	s.Settle("a", 10, Entry{})
	s.Settle("b", 8, Entry{})
	if got := drain(t0.Add(time.Second), nil); len(got) != 0 {
		t.Errorf("Drain after Settle = %v; want nothing", got)
	}
}

func TestRefund(t *testing.T) {
	s := New(100)
	s.AllowN(t0, "k", 1, 5, 5.0, 5)
	s.Refund(t0, "k", 2)
	s.Refund(t0, "absent", 2)
	run(t, s, []allow{
		{0, "k", 1, 5, 2, ok(0, 5*time.Second)},
		{0, "k", 1, 5, 1, denied(0, time.Second, 5*time.Second)},
	})
	if s.Len() != 1 {
		t.Errorf("Len() = %d after refunding an absent key; want 1", s.Len())
	}
}

// TestDrainThenNewerObservation: after a Drain the bucket goes on, until
// Redis says something newer: the next local bucket then starts from that,
// less what the old one spent since the Drain and nobody reported.
func TestDrainThenNewerObservation(t *testing.T) {
	s := New(1000)
	r := rate.Limit(10)
	s.AllowN(t0, "k", r, 10, 10.0, 6) // 4 left
	s.Drain(t0, nil, func(string, float64, Entry) {})
	s.Settle("k", 6, Entry{})
	s.AllowN(t0, "k", r, 10, 10.0, 1)         // 3 left, unreported
	s.Observe(t0.Add(ms), 2, "k", 10, 10, 10) // Redis: full
	if res := s.AllowN(t0.Add(ms), "k", r, 10, 10.0, 10); res.Allowed || res.Remaining != 9 {
		t.Errorf("AllowN(10) after a newer observation = %+v; want denied, 9 left (10 less the 1 unreported)", res)
	}
	got := map[string]float64{}
	s.Drain(t0.Add(ms), nil, func(key string, spent float64, _ Entry) { got[key] = spent })
	if math.Abs(got["k"]-1) > 1e-9 {
		t.Errorf("Drain = %v; want k: 1, the token spent before the observation", got)
	}
}

// TestFractionalCapacity: a share of less than one token starts with that
// fraction, so a fleet of such shares cannot each grant a token at once.
func TestFractionalCapacity(t *testing.T) {
	s := New(100)
	r := rate.Limit(0.1) // one token in 10 s
	if got := s.AllowN(t0, "k", r, 1, 0.25, 1); got.Allowed {
		t.Errorf("AllowN(1) on a share of 0.25 token = %+v; want denied", got)
	}
	if got := s.AllowN(t0.Add(7499*ms), "k", r, 1, 0.25, 1); got.Allowed {
		t.Errorf("AllowN(1) 7.499 s later = %+v; want denied", got)
	}
	if got := s.AllowN(t0.Add(7500*ms), "k", r, 1, 0.25, 1); !got.Allowed {
		t.Errorf("AllowN(1) 7.5 s later = %+v; want allowed", got)
	}
	// Seeded from Redis: half full there, an eighth of a token here.
	s.Observe(t0, 1, "o", 5, 1, 10)
	if got := s.AllowN(t0.Add(8749*ms), "o", r, 1, 0.25, 1); got.Allowed {
		t.Errorf("AllowN(1) on a seeded share 8.749 s later = %+v; want denied", got)
	}
}

func TestLease(t *testing.T) {
	s := New(2) // two shards of one entry each
	ms := time.Millisecond
	if _, ok := s.TakeLease(t0, "k", remote.Limit{}, 1); ok {
		t.Fatal("TakeLease on a key without a lease succeeded")
	}
	s.Lease(t0, "k", remote.Limit{}, 3, t0.Add(100*ms))
	for i, want := range []int64{1, 0} {
		if left, ok := s.TakeLease(t0.Add(10*ms), "k", remote.Limit{}, 2-int64(i)); !ok || left != want {
			t.Errorf("TakeLease %d = %d, %v; want %d left", i, left, ok, want)
		}
	}
	if _, ok := s.TakeLease(t0.Add(10*ms), "k", remote.Limit{}, 1); ok {
		t.Error("TakeLease on a spent lease succeeded")
	}
	if !s.RefundLease(t0.Add(20*ms), "k", remote.Limit{}, 2) {
		t.Error("RefundLease on a valid lease failed")
	}
	if left, ok := s.TakeLease(t0.Add(99*ms), "k", remote.Limit{}, 2); !ok || left != 0 {
		t.Errorf("TakeLease after a refund = %d, %v; want 0 left", left, ok)
	}
	s.Lease(t0.Add(50*ms), "k", remote.Limit{}, 4, t0.Add(150*ms)) // adds to the 0 left, valid longer
	if left, ok := s.TakeLease(t0.Add(120*ms), "k", remote.Limit{}, 1); !ok || left != 3 {
		t.Errorf("TakeLease after a second lease = %d, %v; want 3 left", left, ok)
	}
	s.Lease(t0.Add(130*ms), "k", remote.Limit{}, 2, t0.Add(150*ms)) // adds to the 3 left
	if left, ok := s.TakeLease(t0.Add(140*ms), "k", remote.Limit{}, 5); !ok || left != 0 {
		t.Errorf("TakeLease of both leases = %d, %v; want 0 left", left, ok)
	}
	s.Lease(t0, "k", remote.Limit{}, 5, t0.Add(100*ms))
	if _, ok := s.TakeLease(t0.Add(150*ms), "k", remote.Limit{}, 1); ok {
		t.Error("TakeLease on an expired lease succeeded")
	}
	if s.RefundLease(t0.Add(150*ms), "k", remote.Limit{}, 1) {
		t.Error("RefundLease on an expired lease succeeded")
	}
	// A full shard drops expired leases for a new one, and keeps nothing
	// rather than grow past its cap.
	var other string
	for i := 0; other == ""; i++ {
		if k := strconv.Itoa(i); s.shard(k) == s.shard("k") && k != "k" {
			other = k
		}
	}
	s.Lease(t0, "k", remote.Limit{}, 5, t0.Add(time.Second))
	s.Lease(t0, other, remote.Limit{}, 5, t0.Add(time.Second))
	if _, ok := s.TakeLease(t0, other, remote.Limit{}, 1); ok {
		t.Error("a full shard kept a second lease")
	}
	s.Lease(t0.Add(2*time.Second), other, remote.Limit{}, 5, t0.Add(3*time.Second))
	if _, ok := s.TakeLease(t0.Add(2*time.Second), other, remote.Limit{}, 1); !ok {
		t.Error("a full shard did not drop an expired lease for a new one")
	}
	if got := testing.AllocsPerRun(100, func() { s.TakeLease(t0.Add(2*time.Second), other, remote.Limit{}, 0) }); got != 0 {
		t.Errorf("TakeLease allocates %v times; want 0", got)
	}
}

// TestDrainAcrossLimitChange: a raised limit is not spending. Measured
// from the bucket's start at the new rate and burst, the refill before the
// change would look spent; what was spent before it is kept.
func TestDrainAcrossLimitChange(t *testing.T) {
	s := New(1000)
	s.Observe(t0, 1, "a", 10, 10, 10) // full
	s.AllowN(t0, "a", 10, 10, 10.0, 4)
	// A second later, full again; the limit becomes 20/s burst 100.
	at := t0.Add(time.Second)
	s.AllowN(at, "a", 20, 100, 100.0, 1)
	var got float64
	s.Drain(at.Add(time.Second), nil, func(_ string, spent float64, _ Entry) { got = spent })
	// 4 spent and refilled before the change; 1 spent after it, at a
	// refill of 20/s, in a bucket below its burst of 100.
	if math.Abs(got-1) > 1e-9 {
		t.Errorf("Drain after a raised limit = %v; want 1, the token taken after the change", got)
	}
}

// TestDrainAcrossShareChanges: a share kept empty by its traffic through
// an outage, whose weight moves a little twice meanwhile (the fleet's
// heartbeats answered by a slow Redis): what it spent beyond what the
// bucket would hold untouched is one burst, as for no change. Started
// again from the bucket's own level at each change, the untouched bucket,
// at its cap, counted as spent once more each time: three bursts.
func TestDrainAcrossShareChanges(t *testing.T) {
	s := New(1000)
	s.Observe(t0, 1, "a", 10, 10, 10) // full
	rates := []rate.Limit{10, 10.01, 10.02}
	for ms := 0; ms < 3000; ms += 10 {
		at := t0.Add(time.Duration(ms) * time.Millisecond)
		r := rates[ms/1000]
		for s.AllowN(at, "a", r, 10, 10, 1).Allowed {
		}
	}
	end := t0.Add(3 * time.Second)
	left, _ := s.Peek(end, "a", rates[2], 10, 10)
	var got float64
	s.Drain(end, nil, func(_ string, spent float64, _ Entry) { got = spent })
	if want := 10 - left; math.Abs(got-want) > 0.01 {
		t.Errorf("Drain after two small changes of the share's rate = %.2f; want %.2f, a burst less the %.2f tokens left", got, want, left)
	}
}

// TestObserveHoldsNoPart: what Redis said of a key is kept without a part
// of its consumption, which only Count, used where key shares are in use,
// adds: a Limiter without heartbeats would keep 144 idle bytes per key.
func TestObserveHoldsNoPart(t *testing.T) {
	s := New(0)
	s.Observe(t0, 1, "observed", 5, 10, 10)
	if b := s.shard("observed").m["observed"]; b == nil || b.part != nil {
		t.Errorf("entry after Observe = %+v; want one without a part", b)
	}
	s.Count(t0, "counted", remote.Limit{Q: 1, P: 100000, Burst: 10}, 1_000_000, 1, 5, 0, true)
	s.Observe(t0, 1, "counted", 5, 10, 10)
	if b := s.shard("counted").m["counted"]; b == nil || b.part == nil {
		t.Errorf("entry after Count and Observe = %+v; want one with a part", b)
	}
}

// TestPartOutlastsAnswers: a key's part of its consumption stays what its
// last answers said when the fleet's view moves on past them, as it does
// while heartbeats reach Redis and the key's node does not (another
// Cluster shard down, or a Redis slow for decisions only): a sticky key
// keeps its share through the outage instead of falling to the weight.
// Not if the node went on answering this instance: the key's traffic
// moved to another instance, which measures its own part.
func TestPartOutlastsAnswers(t *testing.T) {
	const every = 200_000 // µs: windows of 200 ms
	lim, err := remote.NewLimit(1000, 100)
	if err != nil {
		t.Fatal(err)
	}
	s := New(0)
	level, now := int64(0), int64(1_000_000_000)
	for range 30_000 { // 3 s, a call every 100 µs at 10 × the limit, every one this instance's
		next := now + 100
		level = min(level+lim.Q*(next-now), lim.Burst*lim.P)
		now = next
		took := int64(0)
		if level >= lim.P {
			level -= lim.P
			took = lim.P
		}
		s.Count(t0, "k", lim, every, now, level, took, false)
	}
	e := now/every - 2
	last := now / every // the window of the key's last answer
	if p, near, ok := s.Part("k", e, last); !ok || !near || p < 0.95 {
		t.Fatalf("Part(k, %d) = %.3f, near %v, ok %v; want at least 0.95, near", e, p, near, ok)
	}
	for _, later := range []int64{e + 2, e + 10, e + 1000} {
		// The node stopped answering with the key (or is not known).
		for _, heard := range []int64{0, last, last + 1} {
			if p, near, ok := s.Part("k", later, heard); !ok || !near || p < 0.95 {
				t.Errorf("Part(k, %d, heard %d), the view %d windows past the last answers = %.3f, near %v, ok %v; want the last part, at least 0.95",
					later, heard, later-e-1, p, near, ok)
			}
		}
		// The node went on answering other keys: the key stopped coming
		// here, and its part is over once the view passes its answers.
		if p, _, ok := s.Part("k", later, last+2); ok {
			t.Errorf("Part(k, %d), the node answering 2 windows after the key = %.3f, ok; want none", later, p)
		}
	}
	if p, _, ok := s.Part("k", e, last+100); !ok || p < 0.95 {
		t.Errorf("Part(k, %d), within the key's answers, the node answering long after = %.3f, ok %v; want the part", e, p, ok)
	}
}

// TestCountRecordsTheHandoff: Count, with handoff, records what Observe
// would, under the one lock it takes; without, only the part.
func TestCountRecordsTheHandoff(t *testing.T) {
	s := New(0)
	lim := remote.Limit{Q: 1, P: 100000, Burst: 10}
	s.Count(t0, "with", lim, 1_000_000, 1, 5*lim.P, 0, true)
	if tokens, rate, _, ok := s.Seen("with"); !ok || tokens != 5 || rate != lim.Rate() {
		t.Errorf("Seen after Count with handoff = %v, %v, ok %v; want 5 tokens at %v/s", tokens, rate, ok, lim.Rate())
	}
	s.Count(t0, "without", lim, 1_000_000, 1, 5*lim.P, 0, false)
	if _, _, _, ok := s.Seen("without"); ok {
		t.Errorf("Seen after Count without handoff: ok; want nothing recorded")
	}
}

// TestHoldKeepsSpendingPastRefill: a token taken and held is reported by a
// Drain made after the bucket refilled to its burst; unheld, the refill
// hides it.
func TestHoldKeepsSpendingPastRefill(t *testing.T) {
	for _, hold := range []bool{false, true} {
		s := New(0)
		if res := s.AllowN(t0, "k", 50, 50, 50.0, 1); !res.Allowed {
			t.Fatalf("AllowN = %+v; want allowed", res)
		}
		if hold {
			s.Hold(t0, "k")
		}
		var got float64
		s.Drain(t0.Add(100*time.Millisecond), nil, func(_ string, spent float64, _ Entry) { got += spent })
		want := 0.0 // refilled in 20 ms: nothing beyond the untouched bucket
		if hold {
			want = 1
		}
		if math.Abs(got-want) > 1e-9 {
			t.Errorf("hold %v: Drain 100 ms after the take reports %.4f tokens spent; want %v", hold, got, want)
		}
	}
}

// TestSweepKeepsWhatIsOwed: a bucket that refilled to its burst but owes
// Redis what it spent (held, or kept from a charge that failed) is not as
// good as new: Sweep must keep it, or the spending is never charged.
func TestSweepKeepsWhatIsOwed(t *testing.T) {
	s := New(0)
	if res := s.AllowN(t0, "k", 50, 50, 50.0, 1); !res.Allowed {
		t.Fatalf("AllowN = %+v; want allowed", res)
	}
	s.Hold(t0, "k")
	if n := s.Sweep(t0.Add(50 * time.Millisecond)); n != 0 {
		t.Errorf("Sweep dropped %d buckets; want the one that owes kept", n)
	}
	var got float64
	s.Drain(t0.Add(100*time.Millisecond), nil, func(_ string, spent float64, _ Entry) { got += spent })
	if math.Abs(got-1) > 1e-9 {
		t.Errorf("Drain after Sweep reports %.4f tokens spent; want 1", got)
	}
	s.Settle("k", got, Entry{})
	if n := s.Sweep(t0.Add(200 * time.Millisecond)); n != 1 {
		t.Errorf("Sweep once the charge is settled dropped %d buckets; want 1", n)
	}
}

// TestSweepDropsWhatRoundingLeaves: a bucket whose spending was drained
// and settled, then left to refill to its burst, is as good as new, and
// Sweep drops it. Drain's measure (the starting level plus the refill
// since, against x/time/rate's own) leaves residues of about 1e-16 tokens:
// kept as owed, they would keep the bucket for good, and a shard at its cap
// would evict buckets that do owe Redis.
func TestSweepDropsWhatRoundingLeaves(t *testing.T) {
	kept := 0
	for i := range 200 {
		s := New(100)
		s.AllowN(t0, "k", rate.Limit(100.0/3), 10, 10, 7)
		// Drains a few ms apart, as the reconciler runs them, each
		// settled as a charge would be (none is sent at or below
		// Negligible).
		now := t0
		for j := range 5 {
			now = now.Add(time.Duration(1+i*7+j*13) * time.Millisecond / 3)
			s.Drain(now, nil, func(key string, spent float64, e Entry) {
				if spent > Negligible {
					s.Settle(key, spent, e)
				}
			})
		}
		if s.Sweep(now.Add(time.Hour)) != 1 {
			kept++
		}
	}
	if kept > 0 {
		t.Errorf("Sweep kept %d of 200 idle buckets whose spending was settled; want none kept", kept)
	}
}

// TestRefundCancelsWhatIsOwed: tokens held as owed and then given back
// were not spent; Drain must not report them.
func TestRefundCancelsWhatIsOwed(t *testing.T) {
	s := New(0)
	if res := s.AllowN(t0, "k", 0.1, 10, 10, 3); !res.Allowed {
		t.Fatalf("AllowN = %+v; want allowed", res)
	}
	s.Hold(t0, "k")
	s.Refund(t0.Add(time.Millisecond), "k", 2)
	var got float64
	s.Drain(t0.Add(100*time.Millisecond), nil, func(_ string, spent float64, _ Entry) { got += spent })
	if math.Abs(got-1) > 1e-6 {
		t.Errorf("Drain after 3 tokens held and 2 refunded reports %.4f tokens spent; want 1", got)
	}
	if res := s.AllowN(t0.Add(100*time.Millisecond), "k", 0.1, 10, 10, 9); !res.Allowed {
		t.Errorf("AllowN(9) after the refund = %+v; want the 2 refunded tokens back in the bucket", res)
	}
}

// TestSettleOfAnEvictedEntry: a charge of what Drain reported of a key's
// entry, answered after that entry was evicted and a new one made for the
// key, settles nothing of the new entry's debt: the new spending (held in
// full at once, as a decision on a time-out is) is still owed.
func TestSettleOfAnEvictedEntry(t *testing.T) {
	s := New(maxShards) // 64 shards of 1
	k := sameShard(s, 2)
	r := rate.Limit(10)
	s.AllowN(t0, k[0], r, 10, 10.0, 6)
	var e Entry
	s.Drain(t0, nil, func(key string, spent float64, entry Entry) {
		if key == k[0] && math.Abs(spent-6) < 1e-9 {
			e = entry
		}
	})
	if e == (Entry{}) {
		t.Fatalf("Drain did not report the 6 spent on %s", k[0])
	}
	s.AllowN(t0, k[1], r, 10, 10.0, 1) // evicts k[0], whose charge is in flight
	s.AllowN(t0, k[0], r, 10, 10.0, 3) // a new entry for k[0] (evicting k[1])
	s.Hold(t0, k[0])
	s.Settle(k[0], 6, e) // the charge of the old entry is answered
	var owed float64
	s.Drain(t0, nil, func(key string, spent float64, _ Entry) {
		if key == k[0] {
			owed = spent
		}
	})
	if math.Abs(owed-3) > 1e-9 {
		t.Errorf("after the old entry's charge settled, %s owes %v; want the new entry's 3", k[0], owed)
	}
}

// TestPartOfAFractionalShare: a share whose capacity is not whole (its
// burst is the whole tokens of it, as hybridlimit's share makes it) starts
// from its capacity's part of what Redis's bucket held, capped at its
// burst: Redis at 4 of 5, a share of 5/3 starts at 1 token, not at 4/5 of
// its burst (0.8, denied).
func TestPartOfAFractionalShare(t *testing.T) {
	t0 := time.Now()
	s := New(0)
	s.Observe(t0, 1, "p", 4, 5, 5)
	if res := s.AllowN(t0, "p", rate.Limit(5.0/3), 1, 5.0/3, 1); !res.Allowed {
		t.Errorf("Redis at 4/5 of its burst, capacity 1.67, burst 1: denied (RetryAfter %v); want 1 token", res.RetryAfter)
	}
}

// TestWoke: tokens this instance's waiters were admitted on, which Redis
// reserved for them, come out of the key's local share (below zero if it
// holds fewer) and are not spending to charge Redis with; with no local
// bucket in use they come off the one the next local decision starts from
// what Redis said, and what Redis says after them already holds them.
func TestWoke(t *testing.T) {
	r := rate.Limit(10)
	drained := func(s *Shares, at time.Time) float64 {
		var spent float64
		s.Drain(at, nil, func(_ string, sp float64, _ Entry) { spent += sp })
		return spent
	}

	// A bucket in use: 10 held, a waiter admitted on 15, then 1 s of
	// refill (10) leaves 5: the Allow callers get 5, and Drain reports
	// those 5 and not the waiter's 15.
	s := New(1000)
	s.Observe(t0, 1, "k", 10, 10, 10)
	if res := s.AllowN(t0, "k", r, 10, 10.0, 0); res.Remaining != 10 {
		t.Fatalf("the bucket starts with %d; want 10", res.Remaining)
	}
	s.Woke(t0, "k", 15)
	if res := s.AllowN(t0.Add(400*ms), "k", r, 10, 10.0, 1); res.Allowed {
		t.Errorf("AllowN at -1 tokens = %+v; want denied, the waiter's debt not paid yet", res)
	}
	at := t0.Add(time.Second)
	if res := s.AllowN(at, "k", r, 10, 10.0, 5); !res.Allowed || res.Remaining != 0 {
		t.Errorf("AllowN(5) once the refill paid the debt = %+v; want allowed, 0 left", res)
	}
	if spent := drained(s, at); math.Abs(spent-5) > 1e-9 {
		t.Errorf("Drain = %v; want 5, the Allow callers' alone", spent)
	}

	// No bucket in use: the next local bucket starts from what Redis
	// said (4), less the waiters' 6, refilled since.
	s = New(1000)
	s.Observe(t0, 1, "k", 4, 10, 10)
	s.Woke(t0.Add(100*ms), "k", 6)
	if res := s.AllowN(t0.Add(200*ms), "k", r, 10, 10.0, 1); res.Allowed {
		t.Errorf("AllowN at 4-6+2 = 0 tokens = %+v; want denied", res)
	}
	if res := s.AllowN(t0.Add(300*ms), "k", r, 10, 10.0, 1); !res.Allowed {
		t.Errorf("AllowN at 1 token = %+v; want allowed", res)
	}
	if spent := drained(s, t0.Add(300*ms)); math.Abs(spent-1) > 1e-9 {
		t.Errorf("Drain = %v; want 1", spent)
	}

	// Redis spoke after the waiters woke: its word holds them.
	s = New(1000)
	s.Observe(t0, 1, "k", 4, 10, 10)
	s.Woke(t0.Add(100*ms), "k", 6)
	s.Observe(t0.Add(200*ms), 2, "k", 0, 10, 10)
	if res := s.AllowN(t0.Add(300*ms), "k", r, 10, 10.0, 1); !res.Allowed {
		t.Errorf("AllowN at 0+1 tokens after Redis spoke again = %+v; want allowed", res)
	}

	// A stale bucket (Redis spoke since it started) is started again from
	// Redis's word, less the waiters', keeping what it spent as owed.
	s = New(1000)
	s.Observe(t0, 1, "k", 10, 10, 10)
	s.AllowN(t0, "k", r, 10, 10.0, 3)            // spends 3, 2 by the time Redis speaks
	s.Observe(t0.Add(100*ms), 2, "k", 8, 10, 10) // Redis: 8
	s.Woke(t0.Add(100*ms), "k", 8)               // a waiter on 8
	if res := s.AllowN(t0.Add(100*ms), "k", r, 10, 10.0, 1); res.Allowed {
		t.Errorf("AllowN at 8-2-8 tokens = %+v; want denied", res)
	}
	if spent := drained(s, t0.Add(100*ms)); math.Abs(spent-2) > 1e-9 {
		t.Errorf("Drain = %v; want the 2 spent locally (full, the bucket lost 1 of refill)", spent)
	}
}

// TestWokeAndAnAnswer: Redis's word holds the tokens of a waiter
// admitted before its call was sent, and the share starts from it; one
// admitted after it, whose tokens Redis's word does not hold, is forgotten
// with it, a round trip's error toward admitting (docs/design.md, WaitN).
func TestWokeAndAnAnswer(t *testing.T) {
	for _, c := range []struct {
		name     string
		sent     time.Duration // the answer's call, Redis saying 5 then
		woke     time.Duration // the waiter admitted on 5
		answered bool          // the answer arrives before the waiter
		left     int64         // at +600ms, after a take of 1
	}{
		{"waiter first", 400 * ms, 300 * ms, false, 6},     // 5 + 2
		{"answer first", 400 * ms, 500 * ms, true, 1},      // 5 - 5 + 2
		{"answer in flight", 400 * ms, 500 * ms, false, 6}, // forgotten
	} {
		s := New(1000)
		s.Observe(t0, 1, "k", -5, 10, 10)
		if c.answered {
			s.Observe(t0.Add(c.sent), 2, "k", 5, 10, 10)
		}
		s.Woke(t0.Add(c.woke), "k", 5)
		if !c.answered {
			s.Observe(t0.Add(c.sent), 2, "k", 5, 10, 10)
		}
		res := s.AllowN(t0.Add(600*ms), "k", 10, 10, 10, 1)
		if !res.Allowed || res.Remaining != c.left {
			t.Errorf("%s: %+v; want allowed, %d left", c.name, res, c.left)
		}
	}
}

// TestSweepKeepsWokeTokens: an entry holding only Woke's tokens is not
// full while they are not paid: Sweep would erase them.
func TestSweepKeepsWokeTokens(t *testing.T) {
	for _, sweep := range []bool{false, true} {
		s := New(1000)
		s.Observe(t0, 1, "k", -50, 10, 10) // 50 reserved by this instance's waiters
		for i := 1; i <= 50; i++ {
			s.Woke(t0.Add(time.Duration(i)*100*ms), "k", 1)
		}
		at := t0.Add(6 * time.Second)
		if sweep {
			if n := s.Sweep(at); n != 1 {
				t.Logf("Sweep dropped %d", n)
			}
		}
		// Half of a 10/s burst-10 limit: 5/s, burst 5. 0 - 50 + 6*5 = -20.
		res := s.AllowN(at, "k", rate.Limit(5), 5, 5, 1)
		t.Logf("sweep=%v: %+v", sweep, res)
		if res.Allowed {
			t.Errorf("sweep=%v: allowed with %d left; want denied, 20 tokens of the waiters' still unpaid", sweep, res.Remaining)
		}
	}
}

// TestWokeAtZeroRate: a share that never refills takes only the whole
// tokens it holds: a debt would never be paid.
func TestWokeAtZeroRate(t *testing.T) {
	s := New(1000)
	s.AllowN(t0, "k", 0, 10, 10, 7) // holds 3
	s.Woke(t0, "k", 5)              // n <= burst
	s.Refund(t0, "k", 3)
	if res := s.AllowN(t0, "k", 0, 10, 10, 0); res.Remaining != 3 {
		t.Errorf("zero rate, held 3, Woke(5), Refund(3): %d left; want 3 (took only the 3 it held)", res.Remaining)
	}
	s = New(1000)
	s.AllowN(t0, "k", 0, 10, 10, 7) // holds 3
	s.Woke(t0, "k", 15)             // n > burst
	if res := s.AllowN(t0, "k", 0, 10, 10, 0); res.Remaining != 0 {
		t.Errorf("zero rate, held 3, Woke(15): %d left; want 0 (took the 3 it held)", res.Remaining)
	}
}

// TestPeekInDebt: Peek's ResetAfter counts a debt as AllowN's does.
func TestPeekInDebt(t *testing.T) {
	s := New(1000)
	s.Observe(t0, 1, "k", 10, 10, 10)
	s.AllowN(t0, "k", 10, 10, 10, 0)
	s.Woke(t0, "k", 15) // -5
	_, pr := s.Peek(t0, "k", 10, 10, 10)
	ar := s.AllowN(t0, "k", 10, 10, 10, 0).ResetAfter
	if pr != ar {
		t.Errorf("Peek ResetAfter %v, AllowN ResetAfter %v", pr, ar)
	}
}

// TestWokeKeepsTheBucketsStart: a waiter admitted on a bucket in use does
// not hide Redis's word from a call sent after the bucket started and
// answered after the waiter: the next local decision starts from it (9
// left when the waiter's take moved the bucket's start).
func TestWokeKeepsTheBucketsStart(t *testing.T) {
	for _, woke := range []bool{false, true} {
		s := New(1000)
		s.Observe(t0, 1, "k", 10, 10, 10)
		s.AllowN(t0, "k", 10, 10, 10, 0) // local bucket from Redis's 10
		if woke {
			s.Woke(t0.Add(200*ms), "k", 1)
		}
		// Call sent at +100ms, answered at +300ms: other instances emptied
		// the bucket, and a waiter of theirs owes 5.
		s.Observe(t0.Add(100*ms), 2, "k", -5, 10, 10)
		// The bucket starts again from it: 0 (its debt is not taken
		// over) and 2 of refill by +300ms, less the take of 1.
		res := s.AllowN(t0.Add(300*ms), "k", 10, 10, 10, 1)
		if !res.Allowed || res.Remaining != 1 {
			t.Errorf("woke=%v: %+v; want allowed, 1 left, from Redis's word at +100ms", woke, res)
		}
	}
}

// TestRefundInDebt: a refund to a bucket in debt (a waiter's tokens) is
// not refused, as x/time/rate's AllowN refuses a take that leaves it so.
func TestRefundInDebt(t *testing.T) {
	s := New(1000)
	s.AllowN(t0, "k", 10, 10, 10, 2) // 8
	s.Woke(t0, "k", 15)              // -7
	s.Refund(t0, "k", 2)             // -5
	if res := s.AllowN(t0, "k", 10, 10, 10, 0); res.ResetAfter != 1500*ms {
		t.Errorf("ResetAfter = %v; want 1.5s, from -5", res.ResetAfter)
	}
}
