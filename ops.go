package hybridlimit

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/hybridlimit/hybridlimit/breaker"
	"github.com/hybridlimit/hybridlimit/remote"
)

// AllowAtMost takes as many tokens from key's bucket as it holds now, up
// to n, and Decision.Granted says how many: a batch worker asks for the
// batch and processes what it is granted. It is denied (Allowed false,
// Granted 0, RetryAfter until one token is there) only when the bucket
// holds less than one token. n may exceed the burst: no more than a burst
// is ever granted. Tokens leased to this instance (Config.Lease) are spent
// first; AllowAtMost leases no more.
//
// It decides like AllowN, on the same path and with the same errors,
// except that n > Burst is not an error; while Redis cannot decide,
// FailLocal takes at most n from this instance's share, FailOpen grants n
// and FailClosed grants nothing.
func (lim *Limiter) AllowAtMost(ctx context.Context, key string, n int64) (d Decision, err error) {
	return d, lim.allowN(ctx, key, n, 0, true, &d)
}

// Status is what a key holds, as Peek reports it.
type Status struct {
	// Tokens is what the bucket holds now, with its fraction; negative
	// while it is in debt (WaitN's reservations, or spending charged to
	// Redis after an outage). With PerSecond(10), a key 150 ms after
	// AllowN(ctx, key, 3) on a fresh bucket holds 8.5. Under ModeLocal it
	// counts this instance's share; under ModeFailOpen and ModeFailClosed
	// it is 0 (unknown).
	Tokens float64
	// Remaining is the whole tokens in Tokens, at least 0: what
	// AllowAtMost would grant now, and Decision.Remaining's measure.
	Remaining int64
	// ResetAfter is how long until the bucket is full again.
	ResetAfter time.Duration
	// Leased is the tokens leased to this instance for the key
	// (Config.Lease) and not spent yet. Redis's bucket no longer holds
	// them, and other instances may hold leases of their own.
	Leased int64
	// Limit is the limit in force for the key.
	Limit Limit
	// Mode says where the view comes from: ModeRemote for Redis's bucket,
	// ModeLocal for this instance's share while Redis cannot answer
	// (FailLocal), ModeFailOpen or ModeFailClosed for the other policies,
	// which hold nothing. Mode.Degraded reports whether Redis was not
	// asked or did not answer.
	Mode Mode
}

// Peek reports what key's bucket holds without spending anything: nothing
// is taken and nothing is written to Redis, not even a TTL, so that an
// admin page or a support tool can look as often as it likes. It is named
// for what it does not do, like bufio.Reader.Peek; Status is what it
// returns.
//
// The look goes to the key's master, on the path of a decision (breaker,
// Config.Timeout), not to a replica: a replica lags, and would need a
// client and a breaker of its own. When Redis cannot answer, Peek reports
// the failure policy's view with a nil error, marked by Status.Mode: under
// FailLocal what this instance's share would hold for the next local
// decision. It returns the errors of AllowN for bad input, after Close or
// when ctx ends first.
func (lim *Limiter) Peek(ctx context.Context, key string) (Status, error) {
	ls, err := lim.checkOp(ctx, key)
	if err != nil {
		return Status{}, err
	}
	st := Status{Limit: ls.Limit}
	if lim.cfg.Lease > 0 {
		st.Leased = lim.shares.Leased(lim.cfg.now(), key, ls.rl)
	}
	rl := ls.rl
	res, o, err := lim.op(ctx, remote.Request{Key: lim.cfg.Prefix + key, Limit: rl, Peek: true})
	switch {
	case err != nil:
		return Status{}, err
	case o == answered:
		st.Tokens = rl.Tokens(res.Level)
		st.Remaining = max(res.Level, 0) / rl.P
		st.ResetAfter = res.ResetAfter
		st.Mode = ModeRemote
		return st, nil
	}
	switch lim.cfg.OnFailure {
	case FailOpen:
		st.Mode = ModeFailOpen
	case FailClosed:
		st.Mode = ModeFailClosed
	default:
		st.Mode = ModeLocal
		r, burst, capacity := lim.share(key, ls.Limit, lim.route(lim.cfg.Prefix+key))
		if capacity > 0 {
			st.Tokens, st.ResetAfter = lim.shares.Peek(lim.cfg.now(), key, r, burst, capacity)
			st.Remaining = int64(max(st.Tokens, 0))
		}
	}
	return st, nil
}

// Reset refills key's bucket in Redis, as if the key had never been used,
// and forgets what this instance holds for it: its cached denial, its
// local bucket (which starts full next time), the local spending not yet
// charged to Redis, and its lease. Use it when an operator lifts a limit
// on a key (a support ticket, a test).
//
// Other instances are not told: their cached denials of the key last at
// most a second (what Redis said of a key answers denials for that long),
// their leases until Config.LeaseFor after their latest grant (a grant
// sent while a lease is held joins it), and a local share started before
// the reset keeps what it held until Redis is back. So within about a
// second of Reset every instance decides on the full bucket.
//
// If Redis does not confirm the reset (its breaker is open, or it did not
// answer within Config.Timeout), Reset still forgets this instance's
// state and returns an error wrapping ErrUnavailable; a reset sent and not
// answered may still be applied. Reset is an operator's action, not a
// decision: it has no failure policy to fall back on. It returns the
// errors of AllowN for bad input, after Close or when ctx ends first.
func (lim *Limiter) Reset(ctx context.Context, key string) error {
	ls, err := lim.checkOp(ctx, key)
	if err != nil {
		return err
	}
	rl := ls.rl
	sent := lim.cfg.now()
	res, o, err := lim.op(ctx, remote.Request{Key: lim.cfg.Prefix + key, Limit: rl, Reset: true})
	// After the answer: what an earlier decision's answer recorded goes,
	// and the reset's own answer, later in Redis's time than any of
	// theirs, is what later answers are ordered against.
	lim.shares.Reset(key)
	// A reconcile holds the token across its charges' round trips: the
	// caller's deadline bounds the wait for it.
	select {
	case lim.reconciling <- struct{}{}:
		delete(lim.unanswered, key) // nothing owed on it any more
		<-lim.reconciling
	case <-ctx.Done():
		return fmt.Errorf("%w: reset of %q: %w while charges were being sent; charges owed on the key may still follow the reset",
			ErrUnavailable, key, ctx.Err())
	}
	switch {
	case err != nil:
		return err
	case o == answered:
		lim.observe(sent, key, rl, res, 0)
		return nil
	case o == unanswered:
		return fmt.Errorf("%w: reset of %q sent but not answered within its time budget (Timeout %v); it may still be applied",
			ErrUnavailable, key, lim.cfg.Timeout)
	case o == badValue:
		return fmt.Errorf("%w: reset of %q: Redis answered, not with a bucket (see the error log)", ErrUnavailable, key)
	}
	return fmt.Errorf("%w: reset of %q: the key's Redis node cannot be reached (its breaker is not closed, or it failed)", ErrUnavailable, key)
}

// checkOp checks what Peek and Reset are given, as allowN does, and
// returns the key's limits.
func (lim *Limiter) checkOp(ctx context.Context, key string) (*limits, error) {
	if err := checkKey(key); err != nil {
		return nil, err
	}
	ls, err := lim.limitFor(key, new(limits))
	if err != nil {
		return nil, err
	}
	if lim.closed.Load() {
		return nil, ErrClosed
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	return ls, nil
}

// op sends req on the decisions' path: to the key's node while
// its breaker is closed, through call. err is set only when there is
// nothing to report: Close, or ctx ended; any other outcome but answered
// means Redis did not answer.
func (lim *Limiter) op(ctx context.Context, req remote.Request) (remote.Result, outcome, error) {
	wait := ctx
	if lim.cluster != nil && !lim.mapped.Load() {
		// Waiting for the Cluster's layout is bounded as a decision's is.
		var cancel context.CancelFunc
		wait, cancel = context.WithTimeout(ctx, lim.cfg.Timeout)
		defer cancel()
	}
	nd, err := lim.nodeFor(wait, req.Key)
	switch {
	case errors.Is(err, ErrClosed):
		return remote.Result{}, callerGone, err
	case err != nil && ended(ctx):
		return remote.Result{}, callerGone, ctxErr(ctx)
	case err != nil:
		return remote.Result{}, down, nil // the Cluster's layout is unknown
	case nd.cb.State() != breaker.StateClosed:
		return remote.Result{}, down, nil
	}
	res, o := lim.call(ctx, nd, whenClosed, req)
	if o == callerGone {
		if lim.closed.Load() {
			return res, o, ErrClosed
		}
		return res, o, ctxErr(ctx)
	}
	return res, o, nil
}
