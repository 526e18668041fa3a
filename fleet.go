package hybridlimit

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
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
)

// initialView is the view of an instance that has not heard from the
// fleet: 1/instances of every limit if Config.Instances says how many
// share it, and none if it does not. The instances that did hear from
// the fleet hold shares that add up to the whole limit without this one,
// so a new instance's fair share, until its first heartbeat, is nothing.
func initialView(instances int) *fleet {
	if instances < 1 {
		return &fleet{}
	}
	return &fleet{weight: 1 / float64(instances), size: instances}
}

// fleetKey returns the fleet hash of the group, beside its buckets.
func (lim *Limiter) fleetKey() string {
	return lim.cfg.Prefix + "{hybridlimit-fleet:" + lim.cfg.Name + "}"
}

// heartbeat records this instance in the fleet once per window of
// Config.Heartbeat and sizes the local share from the live fleet it gets
// back. While Redis is away it keeps the last view.
//
// Windows are aligned to the wall clock (window k covers
// [k×Heartbeat, (k+1)×Heartbeat)), so that every instance counts its
// decisions over the same windows, and the weights compare like with like:
// rates measured over different intervals (one fresh, others a heartbeat
// old) overstate the growing ones, and the shares then add up to more than
// the limit. Each instance counts at each window's end and reports a
// random offset later, so that the fleet's heartbeats do not arrive
// together: the decisions it made in the last two completed windows.
func (lim *Limiter) heartbeat() {
	defer lim.wg.Done()
	every := lim.cfg.Heartbeat
	offset := time.Duration(rand.Int64N(int64(every)/5 + 1))
	t := time.NewTimer(time.Hour)
	defer t.Stop()
	sleep := func(until time.Time) bool {
		t.Reset(time.Until(until))
		select {
		case <-t.C:
			return true
		case <-lim.done:
			return false
		}
	}
	// counts[0] is the window before the last completed one, counts[1]
	// the last; -1 when this instance was not running for all of it.
	counts := [2]int64{-1, -1}
	var snap int64 = -1 // decisions at the start of the current window
	// After this instance's first heartbeat, every live member has had a
	// window to write its own: the fleet it sees is then complete.
	settled := false
	for {
		k := time.Now().UnixNano() / int64(every)
		end := time.Unix(0, (k+1)*int64(every))
		if !sleep(end) {
			return
		}
		n := lim.count.Load()
		last := int64(-1)
		if snap >= 0 {
			last = n - snap
		}
		counts = [2]int64{counts[1], last}
		snap = n
		if !sleep(end.Add(offset)) {
			return
		}
		if lim.beat(fmt.Sprintf("%d:%d:%d", k, counts[1], counts[0]), settled) {
			settled = true
		}
	}
}

// beat sends one heartbeat with report and stores the new view; it
// reports whether the heartbeat reached Redis.
func (lim *Limiter) beat(report string, settled bool) bool {
	if lim.single != nil && lim.single.cb.State() == breaker.StateOpen {
		return false
	}
	every := lim.cfg.Heartbeat
	ctx, cancel := context.WithTimeout(lim.ctx, every)
	defer cancel()
	members, err := remote.Fleet(ctx, lim.cfg.Redis, lim.fleetKey(), lim.id, report, fleetTTL*every, fleetMost)
	if err != nil {
		lim.cfg.Logger.Debug("hybridlimit: heartbeat failed", "limiter", lim.cfg.Name, "err", err)
		return false
	}
	lim.view.Store(weigh(members, lim.id, lim.cfg.Instances, settled))
	return true
}

// report is one member's heartbeat: the decisions it made in window idx
// and in the one before (-1: unknown).
type report struct {
	idx          int64
	last, before int64
}

func parseReport(s string) (report, bool) {
	a, rest, ok1 := strings.Cut(s, ":")
	b, c, ok2 := strings.Cut(rest, ":")
	idx, err1 := strconv.ParseInt(a, 10, 64)
	last, err2 := strconv.ParseInt(b, 10, 64)
	before, err3 := strconv.ParseInt(c, 10, 64)
	if !ok1 || !ok2 || err1 != nil || err2 != nil || err3 != nil {
		return report{}, false
	}
	return report{idx, last, before}, true
}

// weigh returns the part of every limit that instance id holds in the
// fleet: (1-evenPart) × its part of the fleet's decisions in one window,
// plus evenPart split evenly. The window is the one before the newest any
// member reported, which every live member has reported too (as its last
// or its before). If a member's count for it is unknown (it has just
// started, or missed heartbeats), or nobody decided, the split is even.
// With no members (or not id among them) it falls back to 1/instances.
// Until the view is settled (this instance's first heartbeat: instances
// started with it may not have written theirs yet) the split is over at
// least instances members.
func weigh(members []remote.Member, id string, instances int, settled bool) *fleet {
	reports := make([]report, 0, len(members))
	found := false
	var newest int64 = -1 << 63
	for _, m := range members {
		r, ok := parseReport(m.Report)
		if !ok {
			r = report{idx: -1 << 63, last: -1, before: -1}
		}
		newest = max(newest, r.idx)
		reports = append(reports, r)
		found = found || m.ID == id
	}
	if !found {
		return initialView(instances)
	}
	size := len(members)
	if !settled {
		size = max(size, instances)
	}
	n := float64(size)
	even := &fleet{weight: 1 / n, size: size}
	window := newest - 1
	var total, mine int64
	for i, r := range reports {
		var c int64 = -1
		switch r.idx {
		case window:
			c = r.last
		case window + 1:
			c = r.before
		}
		if c < 0 {
			return even
		}
		total += c
		if members[i].ID == id {
			mine = c
		}
	}
	if total == 0 {
		return even
	}
	return &fleet{weight: (1-evenPart)*float64(mine)/float64(total) + evenPart/n, size: size}
}
