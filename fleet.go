package hybridlimit

import (
	"context"
	"time"

	"github.com/hybridlimit/hybridlimit/breaker"
	"github.com/hybridlimit/hybridlimit/remote"
)

// fleet is this instance's view of its limiter group, from the last
// heartbeat that reached Redis: how many instances are live and which part
// of every limit this instance holds while Redis is away.
type fleet struct {
	weight float64 // this instance's part of each limit, in (0, 1]
	size   int     // live instances
}

// Heartbeat tuning. A heartbeat counts for fleetTTL heartbeats, so one or
// two lost ones do not drop an instance; the hash keeps at most fleetMost
// instances. Weights mix traffic and an even split (evenPart of the
// weight), so an instance idle before an outage still gets a share.
const (
	fleetTTL  = 3
	fleetMost = 1000
	evenPart  = 0.1
	rateAlpha = 0.5 // weight of the newest interval in the decision rate
)

// fleetKey returns the fleet hash of the group, beside its buckets.
func (lim *Limiter) fleetKey() string {
	return lim.cfg.Prefix + "{hybridlimit-fleet:" + lim.cfg.Name + "}"
}

// heartbeat records this instance in the fleet every Config.Heartbeat,
// with its recent decision rate, and sizes the local share from the live
// fleet it gets back. While Redis is away it keeps the last view.
func (lim *Limiter) heartbeat() {
	defer lim.wg.Done()
	every := lim.cfg.Heartbeat
	t := time.NewTicker(every)
	defer t.Stop()
	last, smoothed, first := lim.count.Load(), 0.0, true
	beat := func() {
		n := lim.count.Load()
		r := float64(n-last) / every.Seconds()
		last = n
		if first {
			smoothed, first = r, false
		} else {
			smoothed = rateAlpha*r + (1-rateAlpha)*smoothed
		}
		if lim.single != nil && lim.single.cb.State() == breaker.StateOpen {
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), every)
		defer cancel()
		members, err := remote.Fleet(ctx, lim.cfg.Redis, lim.fleetKey(), lim.id, smoothed, fleetTTL*every, fleetMost)
		if err != nil {
			lim.cfg.Logger.Debug("hybridlimit: heartbeat failed", "limiter", lim.cfg.Name, "err", err)
			return
		}
		lim.view.Store(weigh(members, lim.id, lim.cfg.Instances))
	}
	beat()
	for {
		select {
		case <-t.C:
			beat()
		case <-lim.done:
			return
		}
	}
}

// weigh returns the part of every limit that instance id holds in the
// fleet members: mostly its part of the fleet's decisions, plus an even
// split of evenPart. With no members (or not id among them) it falls back
// to 1/instances.
func weigh(members []remote.Member, id string, instances int) *fleet {
	var total, mine float64
	found := false
	for _, m := range members {
		total += m.Rate
		if m.ID == id {
			mine, found = m.Rate, true
		}
	}
	if !found {
		return &fleet{weight: 1 / float64(instances), size: instances}
	}
	n := float64(len(members))
	w := 1 / n
	if total > 0 {
		w = (1-evenPart)*mine/total + evenPart/n
	}
	return &fleet{weight: w, size: len(members)}
}
