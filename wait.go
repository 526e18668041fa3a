package hybridlimit

import (
	"context"
	"fmt"
	"time"

	"github.com/hybridlimit/hybridlimit/remote"
)

// Wait is shorthand for WaitN(ctx, key, 1).
func (lim *Limiter) Wait(ctx context.Context, key string) error {
	return lim.WaitN(ctx, key, 1)
}

// WaitN blocks until n tokens are granted for key or ctx ends.
//
// It reserves the tokens in Redis: one script call takes them even if the
// bucket then owes them (at most a burst, and no more than the refill pays
// before ctx's deadline), and WaitN sleeps until the refill has paid them.
// So waiters, on every instance, are served in the order they reached
// Redis, a waiter for many tokens keeps its place behind those for few, and
// each grant costs Redis one call however many wait. If the queue is
// full, it tries again at once allowed deeper than the others by n tokens
// and the refill of the time since it was first refused (workers that loop
// on Wait, re-queueing the moment they are served, would otherwise take
// every place as it opens), and if that is full too it sleeps until the
// queue has room for it. While Redis
// is away and the local share decides, it sleeps for the RetryAfter of
// the denial. Each sleep between tries is lengthened by up to a tenth at
// random; it never spins. If ctx ends while it sleeps
// until a granted reservation falls due, or the reservation falls due
// after ctx's deadline (the round trip spent part of what it was sized
// to), the tokens are given back in the background, best-effort, if no
// reservation was made behind them since: the waiters queued behind keep
// the times they were told, and a queue shortened under them would let
// the next reservations fall due among theirs (a key admitted 15 in a
// second where its limit allows 11). Behind later reservations the tokens
// are lost, erring on refusing.
// A reservation whose answer had not come when ctx ended stays taken: the
// limiter cannot tell whether Redis ran it, and errs on refusing (the
// waiters behind it wait n/Rate longer). It returns at once
// with an error wrapping context.DeadlineExceeded when its deadline cannot
// be met, ctx's error if ctx ends first, ErrClosed at once if Close comes
// while it sleeps, between tries or on a reservation (whose tokens are
// then lost: a service shutting down does not wait for a slow limit's
// refill), and the errors of AllowN; with Config.Shadow it never waits.
//
// A limit lowered while waiters sleep on their reservations applies to the
// reservations made after it: those made before are admitted on the
// schedule they were given (at most a burst, or 10 s of the old rate).
func (lim *Limiter) WaitN(ctx context.Context, key string, n int64) error {
	var t *time.Timer
	// sleep waits d, or until ctx ends; with closing, also until Close
	// (a try after it would only meet ErrClosed).
	sleep := func(d time.Duration, closing <-chan struct{}) error {
		if t == nil {
			t = time.NewTimer(d)
		} else {
			t.Reset(d)
		}
		select {
		case <-t.C:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		case <-closing:
			return ErrClosed
		}
	}
	defer func() {
		if t != nil {
			t.Stop()
		}
	}()
	// refused is when Redis first refused a reservation for a queue full
	// to its depth: from then on this waiter may queue deeper than the
	// others, n tokens and the refill of the time since (see depth), so
	// that those who re-queue the moment they are served (workers looping
	// on Wait keep a queue full, and each of their calls is refused once
	// too) cannot take every place as it opens, and the longest refused
	// is served first.
	var refused time.Time
	for {
		var d Decision
		var reserve int64
		var span time.Duration // the refill that pays reserve
		// A shadow limiter never makes anyone wait.
		if !lim.cfg.Shadow {
			reserve, span = lim.depth(ctx, key, n, refused)
		}
		if err := lim.allowN(ctx, key, n, reserve, false, &d); err != nil {
			return err
		}
		if d.Allowed {
			if d.wait <= 0 {
				return nil
			}
			// The give-back goes in the background: the caller's deadline
			// has come, or is nearer than the tokens, and a round trip to
			// Redis must not hold it past. Close waits for one under way;
			// after Close, as any Refund, it is not sent.
			giveBack := func() {
				if !lim.enter() {
					return
				}
				go func() {
					defer lim.wg.Done()
					rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), lim.cfg.Timeout)
					defer cancel()
					lim.unreserve(rctx, key, d, n)
				}()
			}
			// The reservation was sized to ctx's deadline when it was
			// sent; the round trip may have spent what it left. A waiter
			// that cannot live to spend it gives it back now, not at its
			// deadline: until then the waiters queued behind it would
			// wait for it too.
			if dl, ok := ctx.Deadline(); ok && time.Until(dl) < d.wait {
				giveBack()
				return fmt.Errorf("hybridlimit: WaitN(n=%d) reserved tokens due in %v, past the context's deadline: %w",
					n, d.wait, context.DeadlineExceeded)
			}
			// Granted: the wait ends with the tokens, or at Close (a
			// service shutting down must not wait for a slow limit's
			// refill; the tokens are lost, erring on refusing).
			if err := sleep(d.wait, lim.done); err != nil {
				if err != ErrClosed {
					giveBack() // not spent
				}
				return err
			}
			// Admitted on tokens Redis took already: a local share in use
			// meanwhile must not grant their refill again.
			lim.shares.Woke(lim.cfg.now(), key, int(n))
			return nil
		}
		// RetryAfter is when the bucket holds n tokens: no sooner can
		// this waiter be served.
		delay := max(d.RetryAfter, time.Millisecond)
		if dl, ok := ctx.Deadline(); ok && time.Until(dl) < delay {
			return fmt.Errorf("hybridlimit: WaitN(n=%d) for %v would exceed the context's deadline: %w",
				n, delay, context.DeadlineExceeded)
		}
		if reserve > 0 && d.Mode == ModeRemote && !d.Cached {
			// Redis refused the reservation: the queue is full to its
			// depth. Once refused, this waiter may queue n tokens deeper,
			// at once (the queue may be full, not overfull) and then once
			// there is room for it, a depth's refill before the bucket
			// would hold n.
			if refused.IsZero() {
				refused = time.Now()
				continue
			}
			delay = max(delay-span, time.Millisecond)
		}
		delay = min(delay, maxWaitStep)
		delay += time.Duration(lim.rand.Int64N(int64(delay/10) + 1))
		if err := sleep(delay, lim.done); err != nil {
			return err
		}
	}
}

// unreserve gives back the n tokens of reservation d, which Redis granted
// to a waiter that gave up, if nothing was reserved behind it since
// (remote.Request.Unreserve).
func (lim *Limiter) unreserve(ctx context.Context, key string, d Decision, n int64) {
	var own limits
	ls, err := lim.limitFor(key, &own)
	if err != nil || d.Mode != ModeRemote || d.due == 0 {
		return
	}
	rkey := lim.cfg.Prefix + key
	nd, err := lim.nodeFor(ctx, rkey)
	if err != nil {
		return
	}
	rl := ls.rl
	if rl.Q != d.dueQ {
		// The limit changed since the reservation (its P the script
		// checks): given back at another rate, the debt it removes is not
		// the one the reservation added (lowered from 9/s to 1/s, nine
		// times as much: an empty bucket granted 8 tokens at once). The
		// tokens are lost, erring on refusing.
		return
	}
	sent := lim.cfg.now()
	// The decision's path, as a Refund's: nowhere while the node's breaker
	// is not closed.
	res, o := lim.call(ctx, nd, whenClosed, remote.Request{Key: rkey, Limit: rl, Units: rl.Units(n), Unreserve: d.due})
	if o == answered {
		took := int64(0)
		if res.Allowed {
			took = -rl.Units(n)
		}
		lim.observe(sent, key, rl, res, took)
	}
}

// maxWaitStep bounds one sleep of WaitN between tries, so that a
// RetryAfter of hours (a per-day limit, or a share that can never hold n)
// is looked at again, and the arithmetic of the jitter never overflows.
const maxWaitStep = time.Minute

// reserveFor is how much refill a WaitN may reserve ahead, beyond a burst:
// waiters queue for about that long, twice as long at most for those that
// were refused (see depth), and the tokens of a process that dies while
// queued are lost for at most that long.
const reserveFor = 10 * time.Second

// maxExactUnits bounds a reservation's depth, so that the script's
// arithmetic stays exact.
const maxExactUnits = 1 << 52

// depth returns how many units of key's bucket a WaitN for n tokens may
// reserve ahead of the refill: a burst, or reserveFor of refill if that is
// more (a queue only a burst deep would let waiters for one token,
// re-queueing as soon as they are served, keep a waiter for more from ever
// finding room), and for a waiter that was refused since refused (not
// zero), n tokens more and the refill of the time since, up to the depth
// again (see
// WaitN); and no more than the refill pays before ctx's deadline, so that
// a reservation is never granted to a waiter that cannot live to spend it.
//
// span is the time the refill takes to pay depth.
func (lim *Limiter) depth(ctx context.Context, key string, n int64, refused time.Time) (depth int64, span time.Duration) {
	var own limits
	ls, err := lim.limitFor(key, &own)
	if err != nil || n < 1 || n > ls.Burst {
		return 0, 0 // allowN reports it
	}
	rl := ls.rl
	depth = max(rl.Cap(), min(int64(reserveFor/time.Microsecond), maxExactUnits/rl.Q)*rl.Q)
	if !refused.IsZero() {
		waited := min(int64(time.Since(refused)/time.Microsecond), depth/rl.Q)
		depth = min(depth+rl.Units(n)+waited*rl.Q, maxExactUnits)
	}
	if dl, ok := ctx.Deadline(); ok {
		us := int64(time.Until(dl) / time.Microsecond)
		if us <= 0 {
			return 0, 0
		}
		if us < depth/rl.Q {
			depth = us * rl.Q
		}
	}
	depth = max(depth, 1)
	return depth, time.Duration(depth/rl.Q) * time.Microsecond
}

// Refund gives n tokens back to key's bucket in the path that granted d: to
// Redis for ModeRemote, to the local share for ModeLocal, to the lease for
// ModeLease (to Redis once the lease has expired), and nowhere for the
// other modes. Use it when a later check rejects what an earlier one
// allowed (several limits on one request). It is best-effort: a refund that
// Redis does not answer within Config.Timeout is lost, and between the
// grant and the refund other decisions saw fewer tokens. A decision that
// granted nothing (denied, or Shadowed: the limit denied it) has nothing
// to give back, a Shadowed AllowAtMost gives back at most what the bucket
// did grant, and otherwise n above d.Granted is an error wrapping
// ErrInvalidN: tokens never taken would be minted. It returns an error
// only for bad input or after Close.
func (lim *Limiter) Refund(ctx context.Context, key string, d Decision, n int64) error {
	if err := checkKey(key); err != nil {
		return err
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
	if !d.Allowed {
		return nil // nothing was taken
	}
	if d.Shadowed {
		// Granted counts what Shadow let through; the bucket gave only
		// d.took (AllowAtMost's partial grant; 0 for a denial).
		if d.took == 0 {
			return nil
		}
		n = min(n, d.took)
	} else if n > d.Granted {
		return fmt.Errorf("%w: n=%d, more than the decision granted, %d", ErrInvalidN, n, d.Granted)
	}
	switch d.Mode {
	case ModeLocal:
		lim.shares.Refund(lim.cfg.now(), key, int(n))
		return nil
	case ModeLease:
		// Back to the lease while it is valid; after, to Redis.
		if lim.shares.RefundLease(lim.cfg.now(), key, ls.rl, n) {
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
		lim.observe(sent, key, rl, res, rl.Units(-n))
	}
	return nil
}
