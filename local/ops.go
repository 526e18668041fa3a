package local

import (
	"math"
	"time"

	"golang.org/x/time/rate"

	"github.com/hybridlimit/hybridlimit/remote"
)

// start returns the level a new local bucket for b starts from, and when:
// what Redis last said of the key, refilled since, or capacity at now if
// it said nothing; less owed, spending that Redis was not charged with
// yet: Redis does not know of it. Never below zero for what Redis
// reported: a debt in Redis's bucket (WaitN's reservations, or a clock that
// went back, which Redis's bucket shows as a debt too) is not taken over;
// started in it, a share after a failover to a replica whose clock was 2 s
// behind admitted nothing for 2 s of an outage (simulator seed 8302). What
// this instance's own waiters were admitted on since (Woke) comes off it,
// below zero if need be: those tokens are known to be spent.
// start requires that the shard's mu is held.
func (s *Shares) start(b *bucket, now time.Time, burst int, capacity, owed float64) (float64, mono) {
	if b.seen != 0 {
		return clamp(b.tokens/b.size*capacity-owed, burst) - b.woke(), b.seen
	}
	return clamp(capacity-owed, burst), s.mono(now)
}

// Peek returns the tokens the next AllowN on key, with the same rate,
// burst and capacity, would find at now, without taking any and without
// creating a bucket: the key's local bucket, or, if it has none (or Redis
// said something newer since it started), the level AllowN would start
// one from. resetAfter is the time until that bucket is full, as AllowN
// reports it.
func (s *Shares) Peek(now time.Time, key string, r rate.Limit, burst int, capacity float64) (tokens float64, resetAfter time.Duration) {
	r, burst = clean(r, burst)
	level := s.peek(now, key, r, burst, capacity)
	return max(level, 0), wait(float64(burst)-level, r)
}

func (s *Shares) peek(now time.Time, key string, r rate.Limit, burst int, capacity float64) float64 {
	if r == rate.Inf {
		return float64(burst) // x/time/rate ignores the bucket then
	}
	sh := s.shard(key)
	sh.mu.Lock()
	b := sh.m[key]
	if b == nil {
		sh.mu.Unlock()
		return clamp(capacity, burst)
	}
	if lim := b.lim; lim != nil && !b.stale() {
		sh.mu.Unlock()
		return math.Min(lim.TokensAt(now), float64(burst))
	}
	seed, at := s.start(b, now, burst, capacity, b.owed+s.spent(b, now))
	sh.mu.Unlock()
	return math.Min(level(seed, burst)+float64(r)*max(now.Sub(s.time(at)).Seconds(), 0), float64(burst))
}

// AllowAtMost takes as many whole tokens as key's bucket holds at now, up
// to n, and returns how many it took (0 if the bucket holds less than
// one); the bucket is found or made as AllowN does it. A denial's
// RetryAfter is the time until one token is there.
func (s *Shares) AllowAtMost(now time.Time, key string, r rate.Limit, burst int, capacity float64, n int) (Result, int) {
	res := s.AllowN(now, key, r, burst, capacity, 0)
	// A take that fails found fewer tokens than the look before it:
	// concurrent takes spent them. Each try looks again.
	for range 8 {
		k := min(n, int(res.Remaining))
		if k < 1 {
			break
		}
		if res = s.AllowN(now, key, r, burst, capacity, k); res.Allowed {
			return res, k
		}
	}
	if res = s.AllowN(now, key, r, burst, capacity, 1); res.Allowed {
		return res, 1
	}
	return res, 0
}

// TakeLeaseUpTo takes as many tokens of key's lease as it holds, up to
// n, if it is still valid at now under lim (see TakeLease) and holds one
// at least, and returns how many it took and how many are left in it.
func (s *Shares) TakeLeaseUpTo(now time.Time, key string, lim remote.Limit, n int64) (taken, left int64) {
	sh := s.shard(key)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	l, found := sh.leases[key]
	switch {
	case !found:
		return 0, 0
	case !l.spendable(s.mono(now), lim):
		delete(sh.leases, key)
		return 0, 0
	}
	taken = min(l.tokens, n)
	l.tokens -= taken
	sh.leases[key] = l
	return taken, l.tokens
}

// Leased returns the tokens of key's lease that are still valid at now
// under lim.
func (s *Shares) Leased(now time.Time, key string, lim remote.Limit) int64 {
	sh := s.shard(key)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if l, found := sh.leases[key]; found && l.spendable(s.mono(now), lim) {
		return l.tokens
	}
	return 0
}

// Reset forgets everything held for key: its local bucket, what Redis
// last said of it, the spending not yet charged to Redis, and its lease.
// The next AllowN on key starts a full bucket (at capacity).
func (s *Shares) Reset(key string) {
	sh := s.shard(key)
	sh.mu.Lock()
	delete(sh.m, key)
	delete(sh.leases, key)
	sh.mu.Unlock()
}
