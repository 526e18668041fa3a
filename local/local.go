// Package local holds this instance's share of each key's limit in
// per-key golang.org/x/time/rate buckets, for use while Redis is unreachable.
//
// Time is an argument, as in x/time/rate's AllowN(t, n). Callers must pass
// this machine's monotonic clock (time.Now, never Redis TIME), and each key
// must see times that only move forward: x/time/rate mints tokens when a
// call's time is earlier than the previous call's (golang/go#56287).
// Goroutines that read the clock and then race to the same bucket can still
// reorder by a few microseconds; that mints at most rate × skew tokens.
package local

import (
	"hash/maphash"
	"math"
	"strings"
	"sync"
	"time"

	"golang.org/x/time/rate"
)

// DefaultMaxKeys is the number of buckets New allows when maxKeys < 1.
// A bucket costs about 200 bytes of heap (measured by TestMemoryPerKey),
// so a million keys cost about 200 MB: enough keys for a busy instance,
// little enough to fit beside it.
const DefaultMaxKeys = 1_000_000

// scanLimit is how many entries a full shard looks at for full buckets
// before it evicts one to admit a new key. Scanning a whole shard of 15,625
// buckets (DefaultMaxKeys over 64 shards) took 1.6ms per new key under the
// shard's lock; 32 entries take about 5µs (BenchmarkAllowNNewKeys).
const scanLimit = 32

// maxShards is the number of shards when maxKeys allows it. 64 shards keep
// lock contention low on machines with up to a few dozen cores.
const maxShards = 64

// Shares holds per-key golang.org/x/time/rate buckets, at most the maxKeys
// given to New. Each bucket holds this instance's share of the key's limit.
//
// Buckets are kept in shards chosen by a hash of the key; a call locks one
// shard only to find or create the bucket, then takes tokens under the
// bucket's own lock. When a shard is full and a new key arrives, the shard
// drops the full buckets among the first few that map iteration yields; if
// none of them is full, it evicts the first. An evicted bucket that was not
// full lets its key start full again: a bounded over-admission of at most
// one burst per eviction. Calling Sweep periodically keeps shards below
// their cap so that this stays rare.
//
// Shares is safe for concurrent use by multiple goroutines.
type Shares struct {
	seed   maphash.Seed
	shards []shard
}

// shard is one part of the key space.
type shard struct {
	mu  sync.Mutex // protects m
	m   map[string]bucket
	max int // most entries m may hold; at least 1

	_ [40]byte // pads a shard to 64 bytes on 64-bit platforms, a cache line
}

// bucket is one key's limiter together with the rate and burst it was last
// given, so that AllowN can see a change without taking the limiter's lock.
// Fields r and burst are protected by the shard's mu.
type bucket struct {
	lim   *rate.Limiter
	r     rate.Limit
	burst int
}

// New returns Shares holding at most maxKeys buckets.
// maxKeys < 1 means DefaultMaxKeys.
//
// The cap is split over up to 64 shards (fewer when maxKeys < 64, so each
// shard may hold at least one bucket), and the shard caps add up to maxKeys.
// Keys do not hash evenly, so a shard may evict before the total reaches
// maxKeys: 1,000,000 distinct keys with maxKeys 1,000,000 leave about
// 997,000 buckets.
func New(maxKeys int) *Shares {
	if maxKeys < 1 {
		maxKeys = DefaultMaxKeys
	}
	n := min(maxKeys, maxShards)
	s := &Shares{
		seed:   maphash.MakeSeed(),
		shards: make([]shard, n),
	}
	for i := range s.shards {
		sh := &s.shards[i]
		sh.max = maxKeys / n
		if i < maxKeys%n {
			sh.max++
		}
		sh.m = make(map[string]bucket)
	}
	return s
}

// Result is the outcome of AllowN.
//
// For example, with rate 10 and burst 10, AllowN(now, key, 10, 10, 3) on a
// new key returns Allowed true, Remaining 7, RetryAfter 0 and ResetAfter
// 300ms. Calling AllowN(now, key, 10, 10, 9) next returns Allowed false,
// Remaining 7, RetryAfter 200ms (until 9 tokens are there) and ResetAfter
// 300ms.
type Result struct {
	// Allowed reports whether the n tokens were taken.
	Allowed bool

	// Remaining is the number of whole tokens left in the key's bucket
	// just after this call: 7.6 tokens give 7.
	Remaining int64

	// RetryAfter is, when denied, the time until n tokens will be in the
	// bucket if nobody else takes any, to the nearest nanosecond; 0 when
	// allowed. It is
	// rate.InfDuration when n tokens will never be there: n > burst, or
	// the rate is zero.
	RetryAfter time.Duration

	// ResetAfter is the time until the bucket is full again; 0 when full
	// and rate.InfDuration when it will never be (a zero rate).
	ResetAfter time.Duration
}

// AllowN takes n tokens from key's bucket at time now, creating the bucket
// full with the given rate (tokens/second) and burst if the key has none. If
// the key's bucket exists with another rate or burst, it is changed to the new
// values first (SetLimitAt/SetBurstAt at now), keeping its level.
//
// Time now must come from the local monotonic clock (see the package
// comment). A rate that is NaN or below zero counts as zero, and a burst
// below zero as zero. n <= 0 takes nothing and reports the bucket with
// Allowed true. AllowN on an existing key does not allocate.
//
// Remaining and ResetAfter are read just after the take, so concurrent calls
// on the same key may already show in them.
func (s *Shares) AllowN(now time.Time, key string, r rate.Limit, burst int, n int) Result {
	r, burst = clean(r, burst)
	lim := s.get(now, key, r, burst)

	ok := true
	if n > 0 {
		ok = lim.AllowN(now, n)
	}
	tokens := lim.TokensAt(now)
	if r == rate.Inf {
		tokens = float64(burst) // x/time/rate ignores the bucket then
	}

	res := Result{
		Allowed:    ok,
		Remaining:  floor(tokens, burst),
		ResetAfter: wait(float64(burst)-tokens, r),
	}
	if !ok {
		if n > burst {
			res.RetryAfter = rate.InfDuration
		} else {
			res.RetryAfter = wait(float64(n)-tokens, r)
		}
	}
	return res
}

// Seed sets key's bucket (created if absent) so that it holds tokens at time
// at, clamped to [0, burst]. It is used when switching from Redis to local,
// so that the bucket starts from what Redis last said instead of full.
//
// Time at must be a local monotonic time no later than the next call's now,
// such as when Redis's reply arrived; never Redis TIME. The bucket refills
// from at, so seeding at an earlier time counts the refill since.
//
// x/time/rate has no setter for tokens (golang/go#68677), so Seed builds a
// fresh limiter, takes the whole tokens above the level from it, and swaps it
// in. To keep a fraction of a token, it takes them slightly before at, so
// that the fraction has refilled by at. A call that found the old limiter just
// before the swap takes from the old one.
func (s *Shares) Seed(at time.Time, key string, r rate.Limit, burst int, tokens float64) {
	r, burst = clean(r, burst)
	if !(tokens > 0) { // also NaN
		tokens = 0
	}
	if tokens > float64(burst) {
		tokens = float64(burst)
	}

	lim := rate.NewLimiter(r, burst)
	take := math.Ceil(float64(burst) - tokens)
	t := at
	if d := wait(take-(float64(burst)-tokens), r); d > 0 && d < rate.InfDuration {
		t = at.Add(-d)
	}
	lim.AllowN(t, int(take))

	sh := s.shard(key)
	sh.mu.Lock()
	if _, ok := sh.m[key]; !ok {
		if len(sh.m) >= sh.max {
			sh.makeRoom(at)
		}
		key = strings.Clone(key)
	}
	sh.m[key] = bucket{lim: lim, r: r, burst: burst}
	sh.mu.Unlock()
}

// Sweep drops every bucket that is full at now and returns how many it
// dropped. A dropped full bucket and a new full one are the same state, so
// dropping loses nothing, except that a call that found the bucket just
// before it was dropped takes from the dropped one.
//
// Sweep locks one shard at a time. The owner should call it periodically,
// for example every few seconds from a goroutine, so that shards rarely
// reach their cap and evict buckets that are not full.
func (s *Shares) Sweep(now time.Time) int {
	dropped := 0
	for i := range s.shards {
		sh := &s.shards[i]
		sh.mu.Lock()
		dropped += sh.dropFull(now)
		sh.mu.Unlock()
	}
	return dropped
}

// Len returns the number of buckets held.
func (s *Shares) Len() int {
	n := 0
	for i := range s.shards {
		sh := &s.shards[i]
		sh.mu.Lock()
		n += len(sh.m)
		sh.mu.Unlock()
	}
	return n
}

// shard returns the shard that holds key.
func (s *Shares) shard(key string) *shard {
	h := maphash.String(s.seed, key)
	return &s.shards[h%uint64(len(s.shards))]
}

// get returns key's limiter, creating it full if absent and changing its
// rate and burst at now if they differ from r and burst.
func (s *Shares) get(now time.Time, key string, r rate.Limit, burst int) *rate.Limiter {
	sh := s.shard(key)
	sh.mu.Lock()
	defer sh.mu.Unlock()

	b, ok := sh.m[key]
	if !ok {
		if len(sh.m) >= sh.max {
			sh.makeRoom(now)
		}
		b = bucket{lim: rate.NewLimiter(r, burst), r: r, burst: burst}
		sh.m[strings.Clone(key)] = b
		return b.lim
	}
	if b.r != r || b.burst != burst {
		// Rare: the limit changed. Changing the limiter under sh.mu keeps
		// it in step with b when calls with different limits race.
		b.lim.SetLimitAt(now, r)
		b.lim.SetBurstAt(now, burst)
		b.r, b.burst = r, burst
		sh.m[key] = b
	}
	return b.lim
}

// makeRoom makes room for one more entry. It looks at up to scanLimit
// entries, from where map iteration starts, and drops those that are full at
// now; if none was full, it evicts the first one it looked at. Looking at a
// few entries instead of all keeps a flood of new keys from scanning the
// whole shard for each one; Sweep makes the full pass.
// makeRoom requires that sh.mu is held.
func (sh *shard) makeRoom(now time.Time) {
	var first string
	seen, dropped := 0, 0
	for k, b := range sh.m {
		if seen == 0 {
			first = k
		}
		if b.full(now) {
			delete(sh.m, k)
			dropped++
		}
		if seen++; seen == scanLimit {
			break
		}
	}
	if dropped == 0 && seen > 0 {
		delete(sh.m, first)
	}
}

// dropFull drops the buckets that are full at now and returns how many.
// dropFull requires that sh.mu is held.
func (sh *shard) dropFull(now time.Time) int {
	n := 0
	for k, b := range sh.m {
		if b.full(now) {
			delete(sh.m, k)
			n++
		}
	}
	return n
}

// full reports whether b is full at now. A bucket with rate.Inf counts as
// full: x/time/rate ignores its tokens.
func (b bucket) full(now time.Time) bool {
	return b.r == rate.Inf || b.lim.TokensAt(now) >= float64(b.burst)
}

// clean maps rates and bursts that x/time/rate mishandles onto ones it
// handles: NaN and negative rates become 0 (a NaN rate would admit
// everything), +Inf becomes rate.Inf, and a negative burst becomes 0.
func clean(r rate.Limit, burst int) (rate.Limit, int) {
	switch {
	case !(r > 0):
		r = 0
	case r > rate.Inf:
		r = rate.Inf
	}
	return r, max(burst, 0)
}

// floor returns the whole tokens in tokens, within [0, burst].
func floor(tokens float64, burst int) int64 {
	if !(tokens > 0) {
		return 0
	}
	if tokens >= float64(burst) {
		return int64(burst)
	}
	return int64(tokens)
}

// wait returns how long rate r takes to add tokens: 0 when tokens <= 0 or r
// is rate.Inf, and rate.InfDuration when r is zero or the wait does not fit
// in a time.Duration. It rounds to the nearest nanosecond, so one token at
// 100/3 tokens per second takes 30ms, not 29.999999ms. x/time/rate admits a
// take whose deficit it would refill in under 1ns, so AllowN(n) at
// now+RetryAfter succeeds if nobody else took tokens.
func wait(tokens float64, r rate.Limit) time.Duration {
	switch {
	case !(tokens > 0), r == rate.Inf:
		return 0
	case r <= 0:
		return rate.InfDuration
	}
	ns := math.Round(tokens / float64(r) * float64(time.Second))
	if ns >= float64(rate.InfDuration) {
		return rate.InfDuration
	}
	return time.Duration(ns)
}
