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
	// has Level 250000; Remaining whole tokens are Level/P = 2.
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
}

// parseReply turns the script's reply into a Result. It uses checked type
// assertions only: a reply of any other shape is an error, never a panic.
func parseReply(v any) (Result, error) {
	vals, ok := v.([]any)
	if !ok || len(vals) != 6 {
		return Result{}, fmt.Errorf("%w: %T of %d values", ErrReply, v, lenOf(v))
	}
	var n [6]int64
	for i, x := range vals {
		if n[i], ok = x.(int64); !ok {
			return Result{}, fmt.Errorf("%w: value %d is %T", ErrReply, i, x)
		}
	}
	allowed, level, retry, reset, repaired, now := n[0], n[1], n[2], n[3], n[4], n[5]
	if allowed != 0 && allowed != 1 || repaired != 0 && repaired != 1 || level < 0 || reset < 0 {
		return Result{}, fmt.Errorf("%w: %v", ErrReply, n)
	}
	return Result{
		Allowed:    allowed == 1,
		Level:      level,
		RetryAfter: micros(retry),
		ResetAfter: micros(reset),
		Repaired:   repaired == 1,
		Now:        now,
	}, nil
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
