package hybridlimit

import (
	"context"
	"math"

	"github.com/hybridlimit/hybridlimit/remote"
)

// reconciler charges Redis, when a node's breaker closes, with what this
// instance spent on its local shares of that node's keys while the node was
// away. Meanwhile the node's buckets refilled in Redis time; without the
// charge, the first second back could grant a full burst on top of what the
// local shares just spent.
func (lim *Limiter) reconciler() {
	defer lim.wg.Done()
	ctx, cancel := lim.background() // Close ends a charge in flight
	defer cancel()
	for {
		select {
		case nd := <-lim.healed:
			lim.reconcile(ctx, nd)
		case <-lim.done:
			return
		}
	}
}

// reconcile charges nd with the local spending on its keys, one script
// call per key, sent together so that the node's pipe batches them.
//
// Each instance knows only its own spending, and instances come back one
// by one, each at its own next probe. So each charges what the whole fleet
// would have spent at its pace: its own spending divided by its share of
// the limit, up to the burst. The first instance back thus brings the
// bucket down to about what the fleet left in it, rather than leaving it
// full for itself while the others still spend their local shares; those
// that follow charge a bucket that is about empty already, and the script
// never takes it below zero. The error is on the side of refusing: the
// bucket may hold a little less than the fleet really left in it.
func (lim *Limiter) reconcile(ctx context.Context, nd *node) {
	if lim.cfg.noReconcile {
		return
	}
	w := lim.view.Load().weight
	var match func(key string) bool
	if lim.cluster != nil {
		match = func(key string) bool {
			c, err := lim.cluster.MasterForKey(ctx, lim.cfg.Prefix+key)
			return err == nil && c.Options().Addr == nd.addr
		}
	}
	var charges []remote.Spend
	lim.shares.Drain(lim.cfg.now(), match, func(key string, spent float64) {
		var own limits
		ls, err := lim.limitFor(key, &own)
		if err != nil {
			return
		}
		l, rl := ls.Limit, ls.rl
		fleet := math.Min(spent/w, float64(l.Burst))
		charges = append(charges, remote.Spend{
			Key: lim.cfg.Prefix + key, Limit: rl, Units: int64(math.Round(fleet * float64(rl.P))),
		})
	})
	if len(charges) == 0 {
		return
	}
	// Each charge gets the decision budget; they are sent together.
	cctx, cancel := context.WithTimeout(ctx, lim.cfg.Timeout*4)
	defer cancel()
	failed := nd.pipe.ChargeAll(cctx, charges)
	lim.cfg.Logger.Info("hybridlimit: charged Redis for local spending",
		"limiter", lim.cfg.Name, "node", nd.addr, "keys", len(charges), "failed", failed)
}
