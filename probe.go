package hybridlimit

import (
	"context"
	"time"

	"github.com/hybridlimit/hybridlimit/breaker"
)

// probeTick is how often the prober looks for breakers due for a probe.
const probeTick = 20 * time.Millisecond

// prober probes every node whose breaker's open period has ended, until
// Close. Decisions never probe: while a breaker is not closed they go to
// the failure policy at once, so no caller waits on a Redis that is still
// away, and the open period can be short.
func (lim *Limiter) prober() {
	defer lim.wg.Done()
	ctx, cancel := lim.background() // Close ends a probe or charge in flight
	defer cancel()
	t := time.NewTicker(probeTick)
	defer t.Stop()
	for {
		select {
		case <-t.C:
		case <-lim.done:
			return
		}
		if lim.single != nil {
			lim.probe(ctx, lim.single)
		}
		for _, nd := range *lim.nodes.Load() {
			lim.probe(ctx, nd)
		}
	}
}

// probe sends one probe to nd if its breaker is open and due: the charge
// script, taking nothing, on the last key that failed there. It runs the
// same code path as a decision, writes included, so a Redis that answers
// PING but cannot run or write scripts (OOM, READONLY, BUSY) stays open.
//
// When the probe succeeds, it charges Redis with the local spending
// (reconcile) before it reports the success that closes the breaker: once
// closed, decisions go to buckets that refilled in Redis time all along,
// and any decision sent before the charge landed would take from a bucket
// still full. The reconciler charges again, when the breaker has closed,
// what was spent locally in between.
func (lim *Limiter) probe(ctx context.Context, nd *node) {
	if nd.cb.State() != breaker.StateOpen || time.Now().Before(nd.cb.OpenUntil()) {
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
	pctx, cancel := context.WithTimeout(ctx, lim.cfg.Timeout)
	defer cancel()
	_, err := nd.pipe.Charge(pctx, p.key, p.rl, 0)
	if err == nil {
		lim.reconcile(ctx, nd)
	}
	ticket.Done(err)
}
