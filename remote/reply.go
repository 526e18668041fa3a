package remote

import (
	"errors"
	"fmt"
	"time"
)

// ErrReply is returned when the script's reply does not have the expected
// shape: a sign that the key space or the script was tampered with.
var ErrReply = errors.New("remote: unexpected script reply")

// Result is the outcome of one run of the token-bucket script.
type Result struct {
	// Allowed reports whether the n tokens were taken.
	Allowed bool
	// Level is what the bucket holds after the decision, in units of 1/P
	// token. With PerSecond(10) (P=100000), a bucket left with 2.5 tokens
	// has Level 250000; Remaining whole tokens are Level/P = 2. It is
	// negative, down to -Cap, while charges for spending made without Redis
	// keep the bucket in debt: -150000 is a debt of 1.5 tokens, paid by the
	// refill in 150 ms.
	Level int64
	// RetryAfter is, when denied, how long until the bucket holds n tokens;
	// negative if it never can (n > Burst). Zero when allowed.
	RetryAfter time.Duration
	// ResetAfter is how long until the bucket is full again.
	ResetAfter time.Duration
	// Repaired reports that the key held something that was not a bucket
	// (another type, or a string the script cannot read) and was replaced
	// by a full bucket.
	Repaired bool
	// Now is Redis TIME when the script ran, in microseconds since the epoch.
	Now int64
	// Leased is, for Lease, the whole tokens taken beyond n.
	Leased int64
	// Again is, for a charge with a Once, that Redis had applied it
	// before: nothing was taken now.
	Again bool
}

// parseReply turns the script's reply {flags, level, now} (and leased, in
// lease mode) to a call of cost units in mode m on lim's bucket into a
// Result,
// computing RetryAfter and ResetAfter from the level: the script leaves
// what need not be atomic to the client. It uses checked type assertions
// only: a reply of any other shape is an error, never a panic.
func parseReply(v any, lim Limit, cost int64, m mode) (Result, error) {
	want := 3
	if m == modeLease {
		want = 4
	}
	vals, ok := v.([]any)
	if !ok || len(vals) != want {
		return Result{}, fmt.Errorf("%w: %T of %d values", ErrReply, v, lenOf(v))
	}
	var n [4]int64
	for i, x := range vals {
		if n[i], ok = x.(int64); !ok {
			return Result{}, fmt.Errorf("%w: value %d is %T", ErrReply, i, x)
		}
	}
	flags, level, now, leased := n[0], n[1], n[2], n[3]
	if flags == 4 && m == modeCharge {
		// Applied before, under the same Once: nothing taken now.
		if lim.Q < 1 || lim.P < 1 || level < -maxExact || level > lim.Cap() {
			return Result{}, fmt.Errorf("%w: %v", ErrReply, vals)
		}
		return Result{Allowed: true, Again: true, Level: level, ResetAfter: micros(ceilDiv(lim.Cap()-level, lim.Q)), Now: now}, nil
	}
	if lim.Q < 1 || lim.P < 1 {
		return Result{}, fmt.Errorf("%w: for a zero limit %+v", ErrReply, lim)
	}
	capacity := lim.Cap()
	allowed := flags&1 == 1
	if flags < 0 || flags > 3 || level < -maxExact || level > capacity || !allowed && m != modeUnreserve && (m == modeCharge || cost < 0 || cost <= level) ||
		allowed && m != modeCharge && m != modeReserve && m != modeUnreserve && cost >= 0 && level < 0 ||
		leased < 0 || leased%lim.P != 0 || leased > capacity || !allowed && leased != 0 ||
		m == modeReset && (!allowed || level != capacity) {
		return Result{}, fmt.Errorf("%w: %v", ErrReply, vals)
	}
	res := Result{
		Allowed:    allowed,
		Level:      level,
		ResetAfter: micros(ceilDiv(capacity-level, lim.Q)),
		Repaired:   flags&2 == 2,
		Now:        now,
		Leased:     leased / lim.P,
	}
	if !allowed && m != modeUnreserve {
		res.RetryAfter = -1
		if cost <= capacity {
			res.RetryAfter = micros(ceilDiv(cost-level, lim.Q))
		}
	}
	return res, nil
}

// ceilDiv returns a/b rounded up, for a >= 0 and b > 0.
func ceilDiv(a, b int64) int64 {
	return a/b + min(a%b, 1)
}

func lenOf(v any) int {
	if vals, ok := v.([]any); ok {
		return len(vals)
	}
	return -1
}

// micros converts microseconds to a Duration, saturating instead of
// overflowing; negative stays negative (-1 means never).
func micros(us int64) time.Duration {
	const max = int64(1<<63-1) / int64(time.Microsecond)
	switch {
	case us < 0:
		return -1
	case us > max:
		return time.Duration(1<<63 - 1)
	}
	return time.Duration(us) * time.Microsecond
}
