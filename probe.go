package hybridlimit

import (
	"context"
	"strings"
	"time"

	"github.com/hybridlimit/hybridlimit/breaker"
	"github.com/hybridlimit/hybridlimit/remote"
)

// probeTick is how often the prober looks for breakers due for a probe
// while any breaker is not closed.
const probeTick = 20 * time.Millisecond

// prober probes every node whose breaker's open period has ended, until
// Close. Decisions never probe: while a breaker is not closed they go to
// the failure policy at once, so no caller waits on a Redis that is still
// away, and the open period can be short. While every breaker is closed
// the prober sleeps until one opens: an idle Limiter wakes no goroutine.
func (lim *Limiter) prober() {
	defer lim.wg.Done()
	t := time.NewTimer(probeTick)
	defer t.Stop()
	var reloaded time.Time
	for {
		if !lim.anyOpen() {
			select {
			case <-lim.opened:
			case <-lim.done:
				return
			}
		}
		t.Reset(probeTick)
		select {
		case <-t.C:
		case <-lim.done:
			return
		}
		if lim.cluster != nil && time.Since(reloaded) >= reloadEvery {
			reloaded = time.Now()
			lim.relayout()
		}
		lim.forNodes(func(nd *node) {
			// Each node is probed on a goroutine of its own: one after
			// another, the probes of nodes that do not answer (a zone of
			// a Cluster gone dark) would each wait their budget, and the
			// next layout reading, the other nodes' probes with it, would
			// wait for all of them.
			if due(nd) && nd.probing.CompareAndSwap(false, true) {
				lim.wg.Go(func() {
					defer nd.probing.Store(false)
					lim.probe(lim.ctx, nd)
				})
			}
		})
	}
}

// due reports whether nd's breaker is due for a probe: open past its open
// period, or half-open.
func due(nd *node) bool {
	switch nd.cb.State() {
	case breaker.StateClosed:
		return false
	case breaker.StateOpen:
		return !time.Now().Before(nd.cb.OpenUntil())
	}
	return true
}

// reloadEvery is how often, while a Cluster node's breaker is not closed,
// the slot layout is read again: a failover moves the node's slots to its
// replica, and the keys should follow them back to Redis, at every
// instance at about the same time (while some are back on a bucket that
// refilled during the outage and others still spend their local shares,
// the fleet admits more than the limit). A reading is a CLUSTER SLOTS to
// each of a few nodes (layoutFanout), only while a breaker is open.
const reloadEvery = 100 * time.Millisecond

// probePipe returns the pipe nd's probes go through. A Cluster node's
// decisions go through the Cluster client, which routes each key by its
// own layout: after a failover it may send the node's probe key to the new
// master, and the old node's breaker would close on another node's answer.
// So its probes go to its own address, through the limiter's own client.
func (lim *Limiter) probePipe(nd *node) *remote.Pipe {
	if lim.cluster == nil {
		return nd.pipe
	}
	nd.once.Do(func() {
		lim.mu.Lock()
		defer lim.mu.Unlock()
		// A node forgotten meanwhile names its address no more: a client
		// made for it now would be kept by nothing (unnamedClients).
		if (*lim.nodes.Load())[nd.addr] != nd {
			return
		}
		if c := lim.ownClientLocked(nd.addr); c != nil {
			nd.direct = remote.NewPipe(c, 1, nd.pipe.Node()) // the same node: what is known of it is shared
		}
	})
	if nd.direct == nil {
		return nd.pipe // closing
	}
	return nd.direct
}

// brokenRetries bounds how many more connections a call tries after its
// write failed on a broken one (it did not run): go-redis drops each
// broken one from its pool, and a pool holds ten per CPU by default.
const brokenRetries = 32

// probeRetries bounds the connections a probe tries again after one
// found broken: a broken read may come from a proxy whose Redis is down,
// where each try dials, so a probe's tries stay few.
const probeRetries = 3

// anyOpen reports whether any node's breaker is not closed.
func (lim *Limiter) anyOpen() bool {
	open := false
	lim.forNodes(func(nd *node) { open = open || nd.cb.State() != breaker.StateClosed })
	return open
}

// forNodes calls fn for every node.
func (lim *Limiter) forNodes(fn func(*node)) {
	if lim.single != nil {
		fn(lim.single)
	}
	for _, nd := range *lim.nodes.Load() {
		fn(nd)
	}
}

// probe sends nd's probes if its breaker is due: open past its open
// period, or half-open. A probe is the charge script, taking nothing, on
// the last key that failed there: it runs the same code path as a
// decision, writes included, so a Redis that answers PING but cannot run
// or write scripts (OOM, READONLY, BUSY) stays open. Config.Breaker.Probes
// probes are sent one after another; the first failure reopens the breaker.
//
// Before a probe reports its success, it charges Redis with the local
// spending (reconcile): once closed, decisions go to buckets that refilled
// in Redis time all along, and any decision sent before the charge landed
// would take from a bucket still full. Every success charges, not only a
// pass's last: the breaker counts consecutive successes across passes,
// and a pass that ends on a probe that says nothing of the node (a MOVED,
// an ASK) leaves its count standing, so the next pass's first success
// may be the one that closes.
func (lim *Limiter) probe(ctx context.Context, nd *node) {
	for {
		if !due(nd) {
			return
		}
		p := nd.probe.Load()
		if p == nil {
			return
		}
		ticket, ok := nd.cb.Allow()
		if !ok {
			return
		}
		pipe, req := lim.probePipe(nd), remote.Request{Key: p.key, Limit: lim.probeLimit(p), Charge: true}
		budget := lim.budget(ctx)
		_, o, verdict, _ := lim.send(ctx, nd, pipe, req, budget, false, true)
		// A probe takes nothing, so it may run twice: on a connection
		// found broken, it goes again on the client's next one rather
		// than leaving the breaker open for another open period per
		// connection the client pooled before Redis came back.
		for again := 0; o == broken && again < probeRetries && ctx.Err() == nil; again++ {
			_, o, verdict, _ = lim.send(ctx, nd, pipe, req, budget, false, true)
		}
		if verdict == breaker.Success && !lim.reconcile(ctx, nd) {
			// The node stopped answering the charges sent after the
			// probe's answer: its success is no longer evidence. What was
			// not charged stays pending for the next probe.
			verdict = breaker.Failure
		}
		ticket.Done(verdict)
		if verdict != breaker.Success {
			return
		}
	}
}

// probeLimit returns the limit a probe of p sends: the key's limit in force
// now, which SetLimit or LimitFor may have changed since the decision that
// failed. The probe refills the key's bucket at the rate it sends, over
// the whole outage: at the old one, a limit lowered during the outage
// would find that key refilled at the rate it replaced.
func (lim *Limiter) probeLimit(p *probe) remote.Limit {
	if key, ok := strings.CutPrefix(p.key, lim.cfg.Prefix); ok {
		if ls, err := lim.limitFor(key, new(limits)); err == nil {
			return ls.rl
		}
	}
	return p.rl
}
