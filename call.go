package hybridlimit

import (
	"context"
	"errors"
	"strings"
	"time"

	"github.com/hybridlimit/hybridlimit/breaker"
	"github.com/hybridlimit/hybridlimit/internal/ctxend"
	"github.com/hybridlimit/hybridlimit/remote"
)

// outcome is what became of one remote call.
type outcome uint8

const (
	// answered: Redis ran the script; the Result is its answer.
	answered outcome = iota
	// unanswered: the call was sent but not answered within its budget;
	// Redis may still run it.
	unanswered
	// down: the node could not decide: its breaker is not closed, it
	// failed, or it answered that it cannot (LOADING, READONLY, OOM, ...)
	// or with any error not about the key (a refused handshake, an ACL, a
	// proxy's own error: remote.IsKeyError).
	down
	// broken: down, found at once: the connection the call went out on
	// was closed or reset, as pooled connections are after a restart, a
	// failover or a proxy's reset. Like down, the call may have run; a
	// call that takes nothing (a probe) may be sent again at once on the
	// client's next connection.
	broken
	// badValue: Redis answered, but not with a decision (a script error, a
	// reply of the wrong shape): the node is healthy, the key is not.
	badValue
	// callerGone: the caller's context was cancelled, or Close began,
	// before an answer came: there is nothing to decide.
	callerGone
	// moved: a Cluster node no longer owns the key's slot: the call was
	// abandoned (watch), or the node forgotten while the call waited, to
	// go to the new master, or the node refused it with MOVED (nothing
	// ran). Whatever the old master runs is on data the takeover left
	// behind.
	moved
)

// pass says in which breaker state a call may go to its node.
type pass uint8

const (
	// whenClosed: decisions, refunds and charges go only while the
	// breaker is closed; otherwise the call is down at once, without
	// touching the network or taking a half-open ticket.
	whenClosed pass = iota
	// charging: background charges, only while the breaker is closed but
	// without a ticket: the breaker counts consecutive failed decisions,
	// and a charge sent beside them says nothing they do not.
	charging
	// underProbe: charges sent while a probe holds the node's half-open
	// ticket, before it reports the success that closes the breaker: no
	// gate, no ticket of their own; the probe judges the node.
	underProbe
)

// call sends req to nd: the one path of every remote call of a decision, a
// refund or a charge (probes take their ticket themselves, then send). It
// owns the breaker's gate and ticket, the time budget and the
// classification of what came back; the pipe below it owns NOSCRIPT and
// the wire.
//
// The budget is Config.Timeout, or nine tenths of what is left of ctx's
// deadline if that is less, so that a caller with a short deadline still
// gets the failure policy's decision within it. A call that was sent and
// not answered within its budget counts against the breaker whoever's
// deadline it was: a hung Redis must open the breaker for callers with
// short deadlines too. Only a budget too short to say anything of Redis
// (under minJudged) keeps it out. A cancelled caller is never Redis's
// fault.
func (lim *Limiter) call(ctx context.Context, nd *node, p pass, req remote.Request) (remote.Result, outcome) {
	budget := lim.budget(ctx)
	if p == underProbe {
		res, o, _, _ := lim.send(ctx, nd, nd.pipe, req, budget, false, false)
		return res, o
	}
	if nd.cb.State() != breaker.StateClosed {
		return remote.Result{}, down
	}
	if p == charging {
		res, o, _, _ := lim.send(ctx, nd, nd.pipe, req, budget, false, false)
		return res, o
	}
	ticket, ok := nd.cb.Allow()
	if !ok {
		return remote.Result{}, down
	}
	var start time.Time
	if lim.cluster != nil {
		start = time.Now()
	}
	res, o, verdict, movedTo := lim.send(ctx, nd, nd.pipe, req, budget, lim.cluster != nil, true)
	ticket.Done(verdict)
	if o != moved {
		return res, o
	}
	// The key's slot moved: the same call once more, to the master that
	// owns it now, within what is left of the budget.
	if budget-time.Since(start) <= 0 {
		return remote.Result{}, down // nothing left: the failure policy's
	}
	to := lim.route(req.Key)
	if movedTo != "" {
		// The master the MOVED names owns the slot, whatever go-redis's
		// layout (reloading since) or the limiter's still say.
		to, _ = lim.ownNode(movedTo)
	}
	if to == nil || to == nd {
		return remote.Result{}, down
	}
	if to.settling.Load() && lim.shares.Local(strings.TrimPrefix(req.Key, lim.cfg.Prefix)) {
		// What this instance spent locally on the key may be being
		// charged to the new master: worth waiting for, within the budget.
		wctx, cancel := context.WithTimeout(ctx, budget-time.Since(start))
		defer cancel()
		if !to.waitSettled(wctx) {
			if ctx.Err() != nil {
				return remote.Result{}, callerGone
			}
			return remote.Result{}, down
		}
	}
	if to.cb.State() != breaker.StateClosed {
		return remote.Result{}, down // the prober's, not a decision's
	}
	if ticket, ok = to.cb.Allow(); !ok {
		return remote.Result{}, down
	}
	res, o, verdict, _ = lim.send(ctx, to, to.pipe, req, budget-time.Since(start), false, true)
	ticket.Done(verdict)
	return res, o
}

// budget is how long a call may wait for its answer: Config.Timeout, or
// nine tenths of what is left of ctx's deadline if that is less.
func (lim *Limiter) budget(ctx context.Context) time.Duration {
	budget := lim.cfg.Timeout
	if dl, ok := ctx.Deadline(); ok {
		budget = min(budget, time.Until(dl)*9/10)
	}
	return budget
}

// send sends req through pipe, nd's, within budget and classifies what
// came back; the caller holds nd's ticket (ticketed: the verdict returned
// is the ticket's, see ticketVerdict), or sends under a probe's. With
// watch, a call to a quiet Cluster node is watched for a failover this
// instance has not seen (see watch). movedTo is the address of the master
// a MOVED named, if the node answered with one.
func (lim *Limiter) send(ctx context.Context, nd *node, pipe *remote.Pipe, req remote.Request, budget time.Duration, watch, ticketed bool) (_ remote.Result, _ outcome, _ breaker.Outcome, movedTo string) {
	if budget <= 0 {
		return remote.Result{}, callerGone, breaker.Excluded, ""
	}
	deadline := time.Now().Add(budget)
	rctx := ctx
	var w *watcher
	if watch && lim.quiet(nd) {
		// A watched call is abandoned by cancelling its context, and
		// must return then, not at its deadline: a context of its own,
		// which carries the deadline too.
		var cancel context.CancelFunc
		rctx, cancel = context.WithDeadline(ctx, deadline)
		defer cancel()
		w = lim.watch(nd, req.Key, budget, cancel)
		req.Cancelable = true
	} else {
		// The pipe ends the call at the deadline, as it would a
		// context's, without making one.
		req.Deadline = deadline
	}
	res, err := pipe.Do(rctx, req)
	// A connection the client pooled before a reset fails the write at
	// once when the client cannot see the reset beforehand (over TLS,
	// go-redis cannot): the call did not run, so it goes again, on the
	// client's next connection, within the same budget.
	for again := 0; remote.IsUnsent(err) && again < brokenRetries && rctx.Err() == nil && time.Now().Before(deadline); again++ {
		res, err = pipe.Do(rctx, req)
	}
	// The call was abandoned (an answer that came meanwhile is kept), or
	// its node forgotten (its pipe closed) while it waited: the node lost
	// the key's slot. A call running on its caller's goroutine (a client
	// with ContextTimeoutEnabled) is not stopped by the pipe's Close: it
	// waits for its answer or its budget, then goes to the failure policy.
	// Few calls meet that: a node is forgotten once its breaker opened (no
	// decision is sent to it then) or a watched call, never sent that way,
	// found it gone.
	abandoned := w != nil && w.moved()
	if err != nil && (abandoned || errors.Is(err, remote.ErrClosed) && !lim.closed.Load()) {
		return remote.Result{}, moved, breaker.Excluded, ""
	}
	// A MOVED or ASK reaches the calls that go through the limiter's own
	// client of a node (the new master after a failover it followed
	// itself, a probe's), which, unlike go-redis's Cluster client, follows
	// neither: the node refused the call before running it, and is not
	// failing. go-redis is told to reload its layout, and a MOVED is
	// followed (call). An ASK would need ASKING before the call on the
	// node it names, which the pipe does not send: the failure policy
	// decides, once per key until the slot's migration ends.
	if lim.cluster != nil {
		if addr, ask, ok := remote.Redirected(err); ok {
			lim.cluster.ReloadState(lim.ctx)
			if ask {
				return remote.Result{}, down, breaker.Excluded, ""
			}
			return remote.Result{}, moved, breaker.Excluded, nodeAddr(addr, nd.addr)
		}
	} else if _, _, ok := remote.Redirected(err); ok {
		// A plain client of one node of a Cluster (NewUniversalClient
		// with one address and no IsClusterMode makes one): the keys of
		// the other nodes' slots go to the failure policy, and with the
		// node's own keys answering between them, the breaker may never
		// open to say so.
		lim.misrouted.Do(func() {
			lim.cfg.Logger.Error("hybridlimit: Redis answered MOVED: Config.Redis is a client of one node of a Redis Cluster; use a *redis.ClusterClient (redis.NewClusterClient, or NewUniversalClient with IsClusterMode)",
				"limiter", lim.cfg.Name, "err", err)
		})
	}
	o, verdict := lim.classify(ctx, err, budget)
	ticket := ticketVerdict(err, verdict, ticketed)
	switch verdict {
	case breaker.Failure:
		// The prober probes the node on the last key that failed there.
		nd.probe.Store(&probe{key: req.Key, rl: req.Limit})
		nd.failed.Store(lim.cfg.now().UnixNano())
		nd.failing.Store(true)
		if err != nil {
			nd.lastErr.Store(&err)
		}
		lim.relayoutAfterFailure()
	case breaker.Success:
		nd.failing.Store(false)
		if nd.owedCharges.Load() || lim.pending.Load() {
			lim.owe()
		}
		if lim.cluster != nil {
			nd.heard(lim.cfg.now())
		}
		if lim.heart != nil && res.Now > 0 {
			// Answers arrive out of order: the window only moves on.
			w := res.Now / lim.heart.every.Microseconds()
			for old := nd.window.Load(); w > old && !nd.window.CompareAndSwap(old, w); old = nd.window.Load() {
			}
		}
	}
	if o == badValue {
		lim.cfg.Logger.Error("hybridlimit: remote call failed", "key", req.Key, "err", err)
	}
	return res, o, ticket, ""
}

// ticketVerdict returns what a call's ticket is told of verdict, what
// the call's error err says of its node. A failed round trip that carried
// several calls, or a wait for the pipe that several left unsent, says it
// once (remote.ClaimTrip): the first of them whose ticket is told a
// failure takes it, the others are left out. A call without a ticket (a
// charge), whose verdict no breaker is told, claims nothing.
func ticketVerdict(err error, verdict breaker.Outcome, ticketed bool) breaker.Outcome {
	if verdict == breaker.Failure && (!ticketed || !remote.ClaimTrip(err)) {
		return breaker.Excluded
	}
	return verdict
}

// classify turns a call's error into its outcome and what it says of the
// node.
func (lim *Limiter) classify(ctx context.Context, err error, budget time.Duration) (outcome, breaker.Outcome) {
	// A time-out says something of Redis only if the budget was long
	// enough, and once the first contact (dialing, loading the scripts and
	// the Cluster's layout, in the background from New) is over: a cold
	// client on a busy machine is not a failing node.
	judged := breaker.Failure
	if budget < lim.minJudged() || !lim.warmedUp() {
		judged = breaker.Excluded
	}
	switch {
	case err == nil:
		return answered, breaker.Success
	case errors.Is(err, remote.ErrClosed), errors.Is(ctx.Err(), context.Canceled):
		return callerGone, breaker.Excluded
	case ended(ctx):
		// The caller's own deadline passed too: it gets its error. If the
		// call was sent, Redis still did not answer within the budget.
		if errors.Is(err, remote.ErrUnanswered) {
			return callerGone, judged
		}
		return callerGone, breaker.Excluded
	case errors.Is(err, remote.ErrUnanswered):
		return unanswered, judged
	case errors.Is(err, context.DeadlineExceeded):
		// Not even sent within the budget: the node's pipe is stuck on
		// calls it does not answer.
		return down, judged
	case errors.Is(err, remote.ErrReply) || remote.IsKeyError(err):
		// About the key, not the node: another key may well succeed.
		return badValue, breaker.Success
	case remote.IsBrokenConn(err):
		return broken, breaker.Failure
	}
	return down, breaker.Failure
}

// ended reports whether ctx is done or its deadline has passed: a
// context's Err lags its deadline by a timer's firing.
func ended(ctx context.Context) bool { return ctxend.Err(ctx) != nil }

// coldFor bounds the first contact: past it, time-outs count whether or
// not warm has returned, so that a pod started against a hung Redis (whose
// first contact can wait on the client's ReadTimeout and its retries)
// opens its breakers after a second rather than paying the budget on every
// decision until then.
const coldFor = time.Second

// warmedUp reports whether the first contact with Redis is over: warm has
// returned, or coldFor has passed since New.
func (lim *Limiter) warmedUp() bool {
	select {
	case <-lim.warmed:
		return true
	default:
		return time.Since(lim.born) > coldFor
	}
}

// minJudged is the shortest budget whose time-out says something of Redis:
// a healthy Redis answers in a millisecond or two, so a call that had less
// than a tenth of Timeout proves nothing when it is not answered.
func (lim *Limiter) minJudged() time.Duration { return lim.cfg.Timeout / 10 }
