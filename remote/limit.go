package remote

import (
	"errors"
	"fmt"
	"math"
)

// maxExact is the largest integer that Lua's doubles (and float64) hold
// exactly. Every number the script computes stays at or below it; a
// bucket's capacity stays below it, so that a cost of one unit more than
// the capacity is still exact.
const maxExact = 1 << 53

// ErrInexact is returned by NewLimit for a rate and burst that the script's
// fixed-point arithmetic cannot hold exactly.
var ErrInexact = errors.New("remote: limit cannot be represented exactly")

// Limit is a token-bucket limit in the script's fixed point: Q tokens are
// added every P microseconds, up to Burst tokens. A token is P units, so one
// microsecond adds exactly Q units and no fraction of a token is ever lost.
//
// For example PerMinute(100) is Q=1, P=600000, Burst=100: one token every
// 0.6 s, a full bucket of 60,000,000 units.
type Limit struct {
	Q     int64 // tokens added per period
	P     int64 // period in microseconds; also the units per token
	Burst int64 // capacity in tokens
}

// NewLimit converts rate (tokens per second) and burst to a Limit. It picks
// the fraction Q/P closest to rate/1e6 tokens per microsecond whose P keeps
// Burst*P within 2^53, and returns an error wrapping ErrInexact if even that
// fraction differs from rate by more than one part in 10^9, or if the
// inputs are out of range.
func NewLimit(rate float64, burst int64) (Limit, error) {
	if !(rate > 0) || math.IsInf(rate, 0) || burst < 1 {
		return Limit{}, fmt.Errorf("%w: rate %v, burst %d", ErrInexact, rate, burst)
	}
	maxP := int64(maxExact-1) / burst
	if maxP < 1 {
		return Limit{}, fmt.Errorf("%w: burst %d exceeds 2^53", ErrInexact, burst)
	}
	perMicro := rate / 1e6
	q, p := bestFraction(perMicro, maxP)
	if q < 1 || p < 1 || q > maxExact/2 {
		return Limit{}, fmt.Errorf("%w: rate %v with burst %d", ErrInexact, rate, burst)
	}
	got := float64(q) / float64(p) * 1e6
	if math.Abs(got-rate) > rate*1e-9 {
		return Limit{}, fmt.Errorf("%w: rate %v with burst %d is at best %v", ErrInexact, rate, burst, got)
	}
	return Limit{Q: q, P: p, Burst: burst}, nil
}

// bestFraction returns the continued-fraction convergent q/p of x with the
// largest p <= maxP, stopping early once it matches x to float64 precision.
func bestFraction(x float64, maxP int64) (q, p int64) {
	// Convergents h/k: h(-1)=1, k(-1)=0, h(-2)=0, k(-2)=1.
	h0, k0 := int64(0), int64(1)
	h1, k1 := int64(1), int64(0)
	r := x
	for i := 0; i < 64; i++ {
		a := math.Floor(r)
		if a > maxExact {
			break
		}
		ai := int64(a)
		h2 := ai*h1 + h0
		k2 := ai*k1 + k0
		if k2 > maxP || h2 > maxExact || h2 < 0 || k2 < 0 {
			break
		}
		h0, k0, h1, k1 = h1, k1, h2, k2
		frac := r - a
		if frac < 1e-15 || math.Abs(float64(h1)/float64(k1)-x) <= x*1e-15 {
			break
		}
		r = 1 / frac
	}
	if k1 == 0 {
		return 0, 0
	}
	return h1, k1
}

// Cap is the bucket's capacity in units: Burst*P, below 2^53.
func (l Limit) Cap() int64 {
	return l.Burst * l.P
}

// Units converts n tokens to units for Take: n*P, saturated just past
// the capacity either way (a cost above it is refused with RetryAfter -1,
// a refund beyond it fills the bucket), so that it never overflows.
func (l Limit) Units(n int64) int64 {
	switch {
	case n > l.Burst:
		return l.Cap() + 1
	case n < -l.Burst:
		return -l.Cap() - 1
	}
	return n * l.P
}

// Tokens converts a level in units to tokens, keeping the fraction.
func (l Limit) Tokens(level int64) float64 {
	return float64(level) / float64(l.P)
}

// Rate returns the limit's rate in tokens per second.
func (l Limit) Rate() float64 {
	return float64(l.Q) / float64(l.P) * 1e6
}
