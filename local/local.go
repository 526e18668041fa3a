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

	"github.com/hybridlimit/hybridlimit/remote"
)

// DefaultMaxKeys is the number of buckets New allows when maxKeys < 1.
// A bucket costs about 250 bytes of heap (measured by TestMemoryPerKey),
// so a million keys cost about 250 MB: enough keys for a busy instance,
// little enough to fit beside it.
const DefaultMaxKeys = 1_000_000

// scanLimit is how many entries a full shard looks at for full buckets
// before it evicts one to admit a new key. Scanning a whole shard of 15,625
// buckets (DefaultMaxKeys over 64 shards) took 1.6ms per new key under the
// shard's lock; 32 entries take about 5µs (BenchmarkAllowNNewKeys).
const scanLimit = 32

// Negligible is the spending, in tokens, at or below which a measure is
// the rounding of two float refills (a bucket's starting level plus its
// rate times the time since, against x/time/rate's own): Drain does not
// report it, the caller does not charge it, and kept as owed it does not
// keep a bucket from Sweep.
const Negligible = 1e-9

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
	epoch  time.Time // the origin of every mono
	shards []shard
	made   chan struct{} // see Made
}

// shard is one part of the key space.
type shard struct {
	mu     sync.Mutex // protects m, leases and every field of their entries
	m      map[string]*bucket
	leases map[string]lease // nil until the first lease; at most max entries
	max    int              // most entries m may hold; at least 1
	epoch  *time.Time       // the Shares' epoch
	made   chan struct{}    // the Shares' made

	_ [16]byte // pads a shard to 64 bytes on 64-bit platforms, a cache line
}

// lease is the whole tokens Redis leased to this instance for a key
// (Config.Lease) and not spent yet, valid until until. Leases live apart
// from the buckets, so that a bucket costs nothing more without them.
type lease struct {
	tokens int64
	until  mono
	// lim is the limit the tokens were granted under: a lowered limit
	// (SetLimit, LimitFor) drops them, as Redis's bucket caps its own.
	lim remote.Limit
}

// spendable reports whether l's tokens may still be spent at now under
// lim, the key's limit now: before their end, and under no lower limit
// than they were granted under.
func (l lease) spendable(now mono, lim remote.Limit) bool {
	return now < l.until && !lowered(l.lim, lim)
}

// lowered reports whether limit to is below limit from, in rate or in
// burst: tokens leased under from may not be spent under to. Redis's
// bucket caps its tokens at a lowered burst and refills at a lowered rate;
// tokens this instance holds apart from it would escape both.
func lowered(from, to remote.Limit) bool {
	// NewLimit picks Q/P by the burst: the same rate under another burst
	// may differ in its last bits (within NewLimit's 1e-9), which is not
	// a lowered rate.
	return from != to && (to.Burst < from.Burst || to.Rate() < from.Rate()*(1-1e-9))
}

// bucket is what this instance knows of one key: its local limiter, if a
// local decision needed one, and what Redis last said of the key.
// Every field is protected by the shard's mu; the limiter has its own lock.
type bucket struct {
	// lim is the local bucket, nil until a local decision needs it and
	// again after Drain. r and burst are the rate and burst it was last
	// given, so that AllowN can see a change without taking its lock.
	lim   *rate.Limiter
	r     rate.Limit
	burst int
	// seed is what lim held at seedAt when it was created, for Drain.
	// While lim is nil it is instead what Woke recorded: the tokens of
	// this instance's waiters admitted on Redis's reservations since
	// Redis last spoke of the key, which a bucket started from what Redis
	// said starts without (a field of its own would take every bucket to
	// the next size class).
	seed   float64
	seedAt mono
	// owed is spending that Drain reported and Redis has not confirmed
	// (Settle) yet: the next Drain reports it again, and a new local
	// bucket starts with as many fewer tokens.
	owed float64

	// tokens is what Redis reported the key's bucket held at time seen
	// (zero: never), rate what it refills per second and size its burst;
	// order is when Redis decided, by its own clock.
	tokens, rate, size float64
	order              int64
	seen               mono

	// part is this instance's part of the key's consumption, from the
	// answers Count recorded; nil before any. It is kept apart so that
	// keys only decided locally do not pay for it.
	part *remote.Part
}

// observed is a bucket and its part, allocated together for a key that
// Redis answered first.
type observed struct {
	bucket
	part remote.Part
}

// mono is a time as nanoseconds since the Shares' epoch, on the monotonic
// clock: 8 bytes where a time.Time takes 24, in every bucket.
type mono int64

func (s *Shares) mono(t time.Time) mono {
	if d := t.Sub(s.epoch); d != 0 {
		return mono(d)
	}
	return 1 // zero means never
}

func (s *Shares) time(m mono) time.Time { return s.epoch.Add(time.Duration(m)) }

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
		epoch:  time.Now(),
		shards: make([]shard, n),
		made:   make(chan struct{}, 1),
	}
	for i := range s.shards {
		sh := &s.shards[i]
		sh.epoch = &s.epoch
		sh.made = s.made
		sh.max = maxKeys / n
		if i < maxKeys%n {
			sh.max++
		}
		sh.m = make(map[string]*bucket)
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
// with the given rate (tokens/second) and burst if the key has none. A new
// bucket holds capacity tokens (at most burst), or, if Observe recorded
// what Redis said of the key, the same part of capacity that Redis's bucket
// held, refilled since. capacity may be a fraction of a token (an
// instance's share of a small burst): the bucket then starts with that
// fraction, and a token is granted only once the refill has made it whole. If
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
func (s *Shares) AllowN(now time.Time, key string, r rate.Limit, burst int, capacity float64, n int) Result {
	r, burst = clean(r, burst)
	lim := s.get(now, key, r, burst, capacity)

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

// newLimiter returns a limiter of rate r and burst that holds tokens at
// time at, at most burst, and below zero if tokens is (a debt: the bucket
// refills it before it grants a token). x/time/rate has no setter for
// tokens (golang/go#68677), so it takes the whole tokens above the level
// from a full limiter; to keep a fraction of a token, it takes them
// slightly before at, so that the fraction has refilled by at.
func newLimiter(at time.Time, r rate.Limit, burst int, tokens float64) *rate.Limiter {
	tokens = level(tokens, burst)
	lim := rate.NewLimiter(r, burst)
	take := math.Ceil(float64(burst) - tokens)
	t := at
	if d := wait(take-(float64(burst)-tokens), r); d > 0 && d < rate.InfDuration {
		t = at.Add(-d)
	}
	debit(lim, t, take, burst)
	return lim
}

// debit takes n whole tokens from lim, of burst burst, at time at, below
// zero if it holds fewer. x/time/rate reserves at most a burst at once, so
// a take beyond it goes through a burst raised for the take. A zero rate
// never refills a debt, so lim then takes only the whole tokens it holds.
func debit(lim *rate.Limiter, at time.Time, n float64, burst int) {
	switch {
	case n <= 0:
	case lim.Limit() == 0:
		if k := math.Min(n, math.Floor(lim.TokensAt(at))); k >= 1 {
			lim.AllowN(at, int(k))
		}
	case n <= float64(burst):
		lim.ReserveN(at, int(n))
	default:
		lim.SetBurstAt(at, int(n))
		lim.ReserveN(at, int(n))
		lim.SetBurstAt(at, burst)
	}
}

// maxDebt bounds how far below zero a local bucket starts, in tokens: far
// beyond what waiters reserve, and within what the arithmetic of
// x/time/rate holds exactly.
const maxDebt = 1 << 40

// level returns tokens as a bucket of burst starts from: at most burst, at
// least -maxDebt, and 0 if NaN.
func level(tokens float64, burst int) float64 {
	if tokens != tokens {
		return 0
	}
	return math.Max(math.Min(tokens, float64(burst)), -maxDebt)
}

// Observe records what Redis said of key: its bucket of the given burst,
// refilling rate tokens per second, held tokens at time at. A later AllowN
// that needs a local bucket starts it from the same part of its own burst,
// refilled since, instead of full: the hand-off from Redis to local does not
// forget what was spent. Time at must be a local monotonic time no later
// than when Redis decided, such as when the request was sent.
//
// Answers to concurrent decisions can arrive out of order; redisTime, the
// clock Redis decided by (microseconds), orders them: an answer older than
// the one recorded is ignored, unless it is older by more than a second,
// which means Redis's clock changed (a failover to another host).
func (s *Shares) Observe(at time.Time, redisTime int64, key string, tokens, rate, burst float64) {
	sh := s.shard(key)
	sh.mu.Lock()
	// No part: Count, which runs first where key shares are in use, makes
	// the entry with one; without them a part would be 144 idle bytes.
	b := sh.entry(at, key, false)
	s.record(b, at, redisTime, tokens, rate, burst)
	sh.mu.Unlock()
}

// record is Observe's record of an answer in b. record requires that the
// shard's mu is held.
func (s *Shares) record(b *bucket, at time.Time, redisTime int64, tokens, rate, burst float64) {
	if redisTime >= b.order || b.order-redisTime > 1e6 {
		b.tokens, b.rate, b.size, b.seen, b.order = tokens, rate, burst, s.mono(at), redisTime
		if b.lim == nil {
			// Woke's tokens: in what Redis said, which reserved them.
			// Those of a waiter admitted after the call was sent are
			// not, and are forgotten too: kept, every answer would leave
			// the admissions of a round trip behind, and waiters admitted
			// more often than that would pile them up for good. The error
			// is at most the tokens of the waiters admitted in the round
			// trip of Redis's last word, toward admitting.
			b.seed = 0
		}
	}
}

// Woke records that a waiter of this instance was admitted at now on n
// tokens of key that Redis reserved for it earlier. Redis took them when
// it granted the reservation, and the waiter is admitted on its schedule
// whether Redis is there or not; while this instance decides key locally,
// its share must not grant that refill again. So the tokens come out of
// key's local bucket if one is in use (below zero if it holds fewer:
// refused until the refill has paid them), or out of the one that starts
// from what Redis said before, if that is where the next local decision
// starts; they are not spending to charge Redis with. Reservations of
// other instances do not come out of this one's share: what the fleet
// admits locally beside waiters is at most the shares of the instances
// that have none.
func (s *Shares) Woke(now time.Time, key string, n int) {
	if n <= 0 {
		return
	}
	sh := s.shard(key)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	b := sh.m[key]
	switch {
	case b == nil, b.lim == nil && b.seen == 0:
		// Evicted, or nothing Redis said to start from: a bucket starts
		// full anyway.
	case b.lim != nil && !b.stale():
		if b.r == rate.Inf {
			return // an infinite share holds no count of its tokens
		}
		// Spending is measured afresh after the take, which is not
		// spending, as Hold does; but seedAt stays, so that Redis's word
		// from a call sent since the bucket started still replaces it.
		// (From a call sent before the take, that word does not hold it,
		// and the bucket started again from it goes without it: the error
		// of record's, at most a round trip's admissions.)
		b.owed += s.spent(b, now)
		debit(b.lim, now, float64(n), b.burst)
		b.seed = b.lim.TokensAt(now) - float64(b.r)*now.Sub(s.time(b.seedAt)).Seconds()
	default:
		if b.lim != nil {
			// Redis spoke since the bucket started, and the next local
			// decision starts one again from that: as AllowN does then.
			b.owed += s.spent(b, now)
			b.lim, b.seed = nil, 0
		}
		b.seed += float64(n)
	}
}

// stale reports whether Redis said something of b's key after its local
// bucket started: the next local decision starts one again from that.
// stale requires that the shard's mu is held.
func (b *bucket) stale() bool { return b.seen != 0 && b.seen > b.seedAt }

// woke returns the tokens Woke recorded while no local bucket is in use
// (see seed). woke requires that the shard's mu is held.
func (b *bucket) woke() float64 {
	if b.lim != nil {
		return 0
	}
	return b.seed
}

// Count records the answer to one of this instance's calls on key for its
// part of the key's consumption: see remote.Part.Add, whose arguments
// follow key. at is when the call was sent, as for Observe. With handoff,
// it also records the answer as Observe does, under the same lock: one
// lock per answer on the decisions' path.
func (s *Shares) Count(at time.Time, key string, lim remote.Limit, every, now, level, took int64, handoff bool) {
	sh := s.shard(key)
	sh.mu.Lock()
	b := sh.entry(at, key, true)
	if b.part == nil {
		b.part = new(remote.Part) // the key had a local bucket first
	}
	b.part.Add(lim, every, now, level, took)
	if handoff {
		s.record(b, at, now, lim.Tokens(level), lim.Rate(), float64(lim.Burst))
	}
	sh.mu.Unlock()
}

// Part returns this instance's part of key's consumption in windows e and
// e-1, the lesser of the two, and whether the bucket was near empty in
// either; ok is false if either has no part (see remote.Part.At). heard is
// the last window in which the key's Redis node answered this instance
// (0: not known). If that is no more than a window after the key's last
// answer, windows after the key's last answers count as the last that had
// a part.
func (s *Shares) Part(key string, e, heard int64) (part float64, near, ok bool) {
	sh := s.shard(key)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	b := sh.m[key]
	if b == nil || b.part == nil {
		return 0, false, false
	}
	// The spans end where the key's answers ended if they ended with the
	// node's: a key whose Redis node stopped answering keeps the part it
	// had then, while the fleet's view may move on (heartbeats on another
	// Cluster shard, or a Redis slow for decisions and not for
	// heartbeats). A key whose answers ended while its node went on
	// answering others stopped coming to this instance (a deploy
	// reshaped a consistent-hash ring, a session moved): its part is of
	// the past, and another instance may hold it now.
	if heard <= b.part.Last()+2 {
		e = min(e, b.part.Last())
	}
	p1, n1, ok1 := b.part.At(e)
	p0, n0, ok0 := b.part.At(e - 1)
	return min(p0, p1), n0 || n1, ok0 && ok1
}

// Seen returns what Observe last recorded for key: the tokens Redis
// reported, its rate, and when. ok is false if nothing was observed.
func (s *Shares) Seen(key string) (tokens, rate float64, at time.Time, ok bool) {
	sh := s.shard(key)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	b := sh.m[key]
	if b == nil || b.seen == 0 {
		return 0, 0, time.Time{}, false
	}
	return b.tokens, b.rate, s.time(b.seen), true
}

// Local reports whether key has a local bucket, or spending reported and
// not settled: whether Drain would look at it.
func (s *Shares) Local(key string) bool {
	sh := s.shard(key)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	b := sh.m[key]
	return b != nil && (b.lim != nil || b.owed > 0)
}

// Settle records that Redis was charged with spent tokens of key that
// Drain reported of entry e (the zero Entry: of whichever entry key has).
// If key's entry is another one (e was evicted, and a new one made), it
// owes nothing of that charge.
func (s *Shares) Settle(key string, spent float64, e Entry) {
	sh := s.shard(key)
	sh.mu.Lock()
	if b := sh.m[key]; b != nil && (e.b == nil || e.b == b) {
		b.owed = max(b.owed-spent, 0)
	}
	sh.mu.Unlock()
}

// Entry names the entry of a key that Drain reported, for Settle: a key
// whose entry was evicted and made again since owes nothing of what was
// reported then, and its new debt (Hold's) must not pay for it.
type Entry struct{ b *bucket }

// Drain reports, for every key that has a local bucket and for which match
// (if not nil) is true, how many tokens this instance spent from it beyond
// what it would hold untouched (its starting level refilled since, up to
// burst), plus what earlier Drains reported and Settle did not confirm;
// from then on the bucket's spending is measured from its level at now.
// The bucket itself is kept: a local decision before Redis says anything
// newer goes on from it, and one after starts again from what Redis said,
// less what is reported and not confirmed. It is called when Redis
// answers, to charge Redis for what was spent without it; the caller calls
// Settle for each charge Redis took.
//
// match is called under a shard's lock: it must be quick and must not call
// back into s. fn is called after each shard's lock is released.
func (s *Shares) Drain(now time.Time, match func(key string) bool, fn func(key string, spent float64, e Entry)) {
	type spend struct {
		key   string
		spent float64
		e     Entry
	}
	var out []spend
	for i := range s.shards {
		sh := &s.shards[i]
		sh.mu.Lock()
		for k, b := range sh.m {
			if b.lim == nil && b.owed == 0 || match != nil && !match(k) {
				continue
			}
			spent := b.owed + s.spent(b, now)
			if spent <= Negligible {
				spent = 0
			}
			if spent > 0 {
				out = append(out, spend{k, spent, Entry{b}})
			}
			b.owed = max(spent, 0)
			if b.lim != nil {
				// Kept, and measured from here on: the next local
				// decision may come before Redis says anything newer.
				b.seed, b.seedAt = b.lim.TokensAt(now), s.mono(now)
			}
		}
		sh.mu.Unlock()
		for _, sp := range out {
			fn(sp.key, sp.spent, sp.e)
		}
		out = out[:0]
	}
}

// Hold keeps what key's local bucket spent by now as owed, as Drain
// reports it, and measures its spending afresh from now, so that a local
// decision made while Redis's breaker stays closed is charged in full:
// measured when the reconciler runs, later, a bucket that has refilled to
// its burst meanwhile would report nothing, while Redis's bucket, which
// the remote decisions spent, never had that refill to spare. A key
// without a local bucket is left alone.
func (s *Shares) Hold(now time.Time, key string) {
	sh := s.shard(key)
	sh.mu.Lock()
	if b := sh.m[key]; b != nil && b.lim != nil {
		b.owed += s.spent(b, now)
		b.seed, b.seedAt = b.lim.TokensAt(now), s.mono(now)
	}
	sh.mu.Unlock()
}

// TakeLease takes n tokens from key's lease if it holds n and is still
// valid at now under lim, the key's limit now, and returns the tokens left
// in it. A lease granted under a limit above lim is dropped. It does not
// allocate.
func (s *Shares) TakeLease(now time.Time, key string, lim remote.Limit, n int64) (left int64, ok bool) {
	sh := s.shard(key)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	l, found := sh.leases[key]
	switch {
	case !found:
		return 0, false
	case !l.spendable(s.mono(now), lim):
		delete(sh.leases, key)
		return 0, false
	case l.tokens < n:
		return 0, false
	}
	l.tokens -= n
	sh.leases[key] = l
	return l.tokens, true
}

// Lease records that Redis leased tokens of key to this instance under
// limit lim, to be spent until until. They add to what is left of a lease
// still valid at now (concurrent decisions each lease), and the whole lease
// is then valid until until, under lim; unless lim is below the limit that
// lease was granted under, whose tokens are then dropped. A full shard
// first drops the expired leases among the first few that map iteration
// yields (Sweep makes the full pass); if it is still full, the tokens are
// not kept: never more than Redis granted, at worst fewer.
func (s *Shares) Lease(now time.Time, key string, lim remote.Limit, tokens int64, until time.Time) {
	sh := s.shard(key)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if sh.leases == nil {
		sh.leases = make(map[string]lease)
	}
	l, found := sh.leases[key]
	end := s.mono(until)
	switch {
	case !found:
		if len(sh.leases) >= sh.max {
			sh.dropLeases(s.mono(now), scanLimit)
			if len(sh.leases) >= sh.max {
				return
			}
		}
		key = strings.Clone(key)
		sh.tell()
	case l.spendable(s.mono(now), lim):
		tokens += l.tokens
		end = max(end, l.until)
	}
	sh.leases[key] = lease{tokens, end, lim}
}

// RefundLease gives n tokens back to key's lease, if it is still valid at
// now under lim, the key's limit now, and reports whether it did.
func (s *Shares) RefundLease(now time.Time, key string, lim remote.Limit, n int64) bool {
	sh := s.shard(key)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	l, found := sh.leases[key]
	if !found || !l.spendable(s.mono(now), lim) {
		return false
	}
	l.tokens += n
	sh.leases[key] = l
	return true
}

// dropLeases drops the leases expired at now among the first limit that
// map iteration yields, or among all of them if limit < 1: a shard full of
// valid leases is not scanned whole for every new key.
// dropLeases requires that sh.mu is held.
func (sh *shard) dropLeases(now mono, limit int) {
	seen := 0
	for k, l := range sh.leases {
		if now >= l.until {
			delete(sh.leases, k)
		}
		if seen++; seen == limit {
			return
		}
	}
}

// Refund gives n tokens back to key's local bucket, up to its burst, and
// off what the bucket owes Redis: tokens given back were not spent. A key
// without a local bucket is left alone.
func (s *Shares) Refund(now time.Time, key string, n int) {
	sh := s.shard(key)
	sh.mu.Lock()
	b := sh.m[key]
	var lim *rate.Limiter
	if b != nil {
		lim = b.lim
	}
	if lim != nil && n > 0 && b.owed > 0 {
		// What is owed (held, or kept from a charge that failed) is
		// charged to Redis whatever the bucket's level: the tokens given
		// back come off it, and spending is measured afresh from the
		// level after the refund.
		b.owed += s.spent(b, now)
		b.owed -= min(b.owed, float64(n))
		lim.ReserveN(now, -n) // AllowN refuses while the bucket is in debt
		b.seed, b.seedAt = lim.TokensAt(now), s.mono(now)
		sh.mu.Unlock()
		return
	}
	sh.mu.Unlock()
	if lim != nil && n > 0 {
		// A negative take adds tokens; the next call caps them at burst.
		// ReserveN: AllowN refuses one that leaves the bucket in debt.
		lim.ReserveN(now, -n)
	}
}

// Sweep drops every bucket that is full at now, and every lease expired at
// now, and returns how many buckets it dropped. A dropped full bucket and a
// new full one are the same state, so dropping loses nothing, except that
// a call that found the bucket just before it was dropped takes from the
// dropped one.
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
		sh.dropLeases(s.mono(now), 0)
		sh.mu.Unlock()
	}
	return dropped
}

// Made returns a channel that receives a value after a bucket or a lease
// is made: an owner that calls Sweep only while Empty reports false (an
// idle owner then wakes nothing) waits on it to start again.
func (s *Shares) Made() <-chan struct{} { return s.made }

// Empty reports whether s holds no bucket and no lease: Sweep would find
// nothing to do.
func (s *Shares) Empty() bool {
	for i := range s.shards {
		sh := &s.shards[i]
		sh.mu.Lock()
		n := len(sh.m) + len(sh.leases)
		sh.mu.Unlock()
		if n > 0 {
			return false
		}
	}
	return true
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
func (s *Shares) get(now time.Time, key string, r rate.Limit, burst int, capacity float64) *rate.Limiter {
	sh := s.shard(key)
	sh.mu.Lock()
	defer sh.mu.Unlock()

	b := sh.m[key]
	if b == nil {
		b = sh.entry(now, key, false)
	}
	if b.lim != nil && b.stale() {
		// Redis said something newer than what the bucket started from:
		// start again from that, keeping as owed what this bucket spent
		// that no Drain has reported yet.
		b.owed += s.spent(b, now)
		b.lim, b.seed = nil, 0
	}
	if b.lim == nil {
		b.seed, b.seedAt = s.start(b, now, burst, capacity, b.owed)
		b.lim, b.r, b.burst = newLimiter(s.time(b.seedAt), r, burst, b.seed), r, burst
		return b.lim
	}
	if b.r != r || b.burst != burst {
		// Rare: the limit changed (a share's weight moves with the
		// fleet's heartbeats, a little, in the middle of an outage).
		// Changing the limiter under sh.mu keeps it in step with b when
		// calls with different limits race. The bucket left untouched goes
		// on from where it is, under the new limit, from now: measured
		// from the old start at the new rate, a raised limit would look
		// spent. What was spent and the new limit no longer shows (a
		// lowered burst cuts both buckets) is kept as owed. Started again
		// from the bucket's own level instead, the untouched bucket,
		// which had lost its refill at its cap as Redis's did, was
		// counted as spent once more at each change: two weight changes
		// in an outage charged 169 tokens where 105 were due.
		untouched := s.untouched(b, now)
		before := max(untouched-b.lim.TokensAt(now), 0)
		b.lim.SetLimitAt(now, r)
		b.lim.SetBurstAt(now, burst)
		b.r, b.burst = r, burst
		b.seed, b.seedAt = math.Min(untouched, float64(burst)), s.mono(now)
		b.owed += max(before-max(b.seed-b.lim.TokensAt(now), 0), 0)
	}
	return b.lim
}

// spent returns what b's local bucket spent by now beyond what it would
// hold untouched: its starting level refilled since, up to its burst.
// spent requires that the shard's mu is held.
func (s *Shares) spent(b *bucket, now time.Time) float64 {
	if b.lim == nil {
		return 0
	}
	return max(s.untouched(b, now)-b.lim.TokensAt(now), 0)
}

// untouched returns what b's local bucket would hold at now had nothing
// been taken from it: its starting level refilled since, up to its burst.
// untouched requires that the shard's mu is held and that b.lim is set.
func (s *Shares) untouched(b *bucket, now time.Time) float64 {
	return math.Min(float64(b.burst), b.seed+float64(b.r)*now.Sub(s.time(b.seedAt)).Seconds())
}

// entry returns key's entry, creating an empty one (making room at now if
// the shard is full) if there is none, with an empty part if withPart.
// entry requires that sh.mu is held.
func (sh *shard) entry(now time.Time, key string, withPart bool) *bucket {
	b := sh.m[key]
	if b == nil {
		if len(sh.m) >= sh.max {
			sh.makeRoom(now)
		}
		if withPart {
			o := new(observed)
			b = &o.bucket
			b.part = &o.part
		} else {
			b = new(bucket)
		}
		sh.m[strings.Clone(key)] = b
		sh.tell()
	}
	return b
}

// tell says on made that an entry or a lease was made.
func (sh *shard) tell() {
	select {
	case sh.made <- struct{}{}:
	default: // told already
	}
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
		if b.full(now, *sh.epoch) {
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
		if b.full(now, *sh.epoch) {
			delete(sh.m, k)
			n++
		}
	}
	return n
}

// full reports whether b is as good as new at now: it owes Redis nothing
// (spending held or kept from a charge that failed, which a new bucket
// would forget), its local bucket, if any, is full (a bucket with rate.Inf
// counts as full: x/time/rate ignores its tokens), and what Redis said of
// the key, if anything, has refilled to a full bucket since.
func (b *bucket) full(now time.Time, epoch time.Time) bool {
	if b.owed > Negligible {
		return false
	}
	if b.lim != nil && b.r != rate.Inf && b.lim.TokensAt(now) < float64(b.burst) {
		return false
	}
	return b.seen == 0 || b.tokens-b.woke()+b.rate*now.Sub(epoch.Add(time.Duration(b.seen))).Seconds() >= b.size
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

// clamp returns tokens within [0, burst]; NaN counts as 0.
func clamp(tokens float64, burst int) float64 {
	if !(tokens > 0) {
		return 0
	}
	return math.Min(tokens, float64(burst))
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
