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
	t := time.NewTicker(probeTick)
	defer t.Stop()
	for {
		select {
		case <-t.C:
		case <-lim.done:
			return
		}
		if lim.single != nil {
			lim.probe(lim.single)
		}
		for _, nd := range *lim.nodes.Load() {
			lim.probe(nd)
		}
	}
}

// probe sends one probe to nd if its breaker is open and due: the charge
// script, taking nothing, on the last key that failed there. It runs the
// same code path as a decision, writes included, so a Redis that answers
// PING but cannot run or write scripts (OOM, READONLY, BUSY) stays open.
func (lim *Limiter) probe(nd *node) {
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
	ctx, cancel := context.WithTimeout(context.Background(), lim.cfg.Timeout)
	defer cancel()
	_, err := nd.pipe.Charge(ctx, p.key, p.rl, 0)
	ticket.Done(err)
}
