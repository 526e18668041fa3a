package hybridlimit

import (
	"context"
	"fmt"
	"math/rand/v2"
	"time"

	"github.com/hybridlimit/hybridlimit/remote"
)

// Wait is shorthand for WaitN(ctx, key, 1).
func (lim *Limiter) Wait(ctx context.Context, key string) error {
	return lim.WaitN(ctx, key, 1)
}

// WaitN blocks until n tokens are granted for key or ctx ends. Between
// tries it sleeps for the RetryAfter of the denial, plus up to a tenth more
// at random, so that a fleet of workers denied together does not retry
// together; it never spins. While Redis is away it waits on this instance's
// local share. It returns ctx's error if ctx ends first, and the errors of
// AllowN; with Config.Shadow it never waits.
func (lim *Limiter) WaitN(ctx context.Context, key string, n int64) error {
	var t *time.Timer
	for {
		d, err := lim.AllowN(ctx, key, n)
		if err != nil {
			return err
		}
		if d.Allowed {
			return nil
		}
		delay := d.RetryAfter
		if delay <= 0 {
			delay = time.Millisecond
		}
		delay += time.Duration(rand.Int64N(int64(delay/10) + 1))
		if dl, ok := ctx.Deadline(); ok && time.Until(dl) < delay {
			return fmt.Errorf("hybridlimit: WaitN(n=%d) for %v would exceed the context's deadline: %w",
				n, delay, context.DeadlineExceeded)
		}
		if t == nil {
			t = time.NewTimer(delay)
			defer t.Stop()
		} else {
			t.Reset(delay)
		}
		select {
		case <-t.C:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// Refund gives n tokens back to key's bucket in the path that granted d: to
// Redis for ModeRemote, to the local share for ModeLocal, to the lease for
// ModeLease (to Redis once the lease has expired), and nowhere for the
// other modes. Use it when a later check rejects what an earlier one
// allowed (several limits on one request). It is best-effort: a refund that
// Redis does not answer within Config.Timeout is lost, and between the
// grant and the refund other decisions saw fewer tokens. It returns an
// error only for bad input or after Close.
func (lim *Limiter) Refund(ctx context.Context, key string, d Decision, n int64) error {
	if len(key) == 0 || len(key) > MaxKeyLen {
		return fmt.Errorf("%w: length %d, want 1 to %d bytes", ErrInvalidKey, len(key), MaxKeyLen)
	}
	var own limits
	ls, err := lim.limitFor(key, &own)
	if err != nil {
		return err
	}
	if n < 1 || n > ls.Burst {
		return fmt.Errorf("%w: n=%d, want 1 to burst %d", ErrInvalidN, n, ls.Burst)
	}
	if lim.closed.Load() {
		return ErrClosed
	}
	switch d.Mode {
	case ModeLocal:
		lim.shares.Refund(lim.cfg.now(), key, int(n))
		return nil
	case ModeLease:
		// Back to the lease while it is valid; after, to Redis.
		if lim.shares.RefundLease(lim.cfg.now(), key, n) {
			return nil
		}
	case ModeRemote:
	default:
		return nil
	}
	rkey := lim.cfg.Prefix + key
	nd, err := lim.nodeFor(ctx, rkey)
	if err != nil {
		return nil
	}
	rl := ls.rl
	sent := lim.cfg.now()
	// The decision's path: a refund goes nowhere while the node's breaker
	// is not closed, so it never takes a probe's ticket.
	if res, o := lim.call(ctx, nd, whenClosed, remote.Request{Key: rkey, Limit: rl, Units: rl.Units(-n)}); o == answered {
		// What Redis says now supersedes what a cached denial would use.
		lim.observe(sent, key, rl, res)
	}
	return nil
}
