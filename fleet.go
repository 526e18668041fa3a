package hybridlimit

import (
	"context"
	"hash/maphash"
	"math"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hybridlimit/hybridlimit/breaker"
	"github.com/hybridlimit/hybridlimit/remote"
)

// fleet is this instance's view of its limiter group, from the last
// heartbeat that reached Redis: how many instances are live and which part
// of every limit this instance holds while Redis is away.
type fleet struct {
	weight float64 // this instance's part of each limit, in [0, 1]
	size   int     // instances counted in the window read, this one included
	window int64   // the window weight was read from; 0 before any
	raw    float64 // the part that window alone gives
}

// Weighting. evenPart of every limit is split evenly rather than by
// traffic, so that an instance idle before an outage still gets a share;
// reservePart of it is kept for instances not counted in the window
// (newcomers): little, since a newcomer only holds it when an outage
// starts within its first windows. Each report is the tokens offered
// over the last reportWindows windows: a window's count is noisy, and the
// weight takes the lesser of two windows' parts (see weigh), which would
// turn noise into a loss.
const (
	evenPart      = 0.1
	reservePart   = 0.01
	reportWindows = 4
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

// demand counts, for the fleet's weights, the tokens offered to the limit
// on this instance, capped per key and window at the key's limit for a
// window: what a flood on one key adds is at most what using that key to
// its limit would, so denied traffic cannot take the other instances'
// shares. Counting only what Redis admitted would not do either: when a
// key is saturated, who gets each refilled token is a race (four
// instances offered the same 50/s of a 100/s key were admitted 71, 82,
// 111 and 134 in 3 s), and the shares would follow the race, not the
// traffic.
//
// Admitted tokens always count. Only keys near their limit get an entry
// for the window: denied ones, and admitted ones whose bucket was left
// with less than a window's refill; the entry counts what the key was
// offered since, up to the key's limit (or what Redis admitted, if more).
// The number of entries is bounded (beyond it, the denials of further
// keys do not count), and the entries go at each window's end.
type demand struct {
	seed   maphash.Seed
	window atomic.Int64 // bumped by the heartbeat at each window's end
	shards [demandShards]demandShard
}

type demandShard struct {
	mu     sync.Mutex       // protects window and keys
	window int64            // the window keys counts
	keys   map[string]tally // keys near their limit in window
}

// tally is what one key was offered since it got an entry: counted is at
// most the larger of the key's limit and admitted.
type tally struct{ counted, admitted int64 }

// demandShards spreads the counting of denials over locks; demandKeys
// bounds the keys each shard counts in one window.
const (
	demandShards = 64
	demandKeys   = 1024
)

func newDemand() *demand {
	d := &demand{seed: maphash.MakeSeed()}
	for i := range d.shards {
		d.shards[i].keys = make(map[string]tally)
	}
	return d
}

// tally counts one decision of n tokens on key that the limit decided:
// Redis, or what Redis said of the key, which left the bucket holding
// left tokens. limit is the key's tokens per window. It returns the
// tokens it counted.
func (d *demand) tally(key string, n int64, allowed bool, left, limit int64) int64 {
	s := &d.shards[maphash.String(d.seed, key)%demandShards]
	w := d.window.Load()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.window != w {
		clear(s.keys)
		s.window = w
	}
	e, seen := s.keys[key]
	if !seen && (allowed && left >= limit || len(s.keys) >= demandKeys) {
		return n * b2i(allowed)
	}
	if allowed {
		e.admitted += n
	}
	add := max(min(e.counted+n, max(limit, e.admitted))-e.counted, 0)
	e.counted += add
	s.keys[key] = e
	return add
}

func b2i(b bool) int64 {
	if b {
		return 1
	}
	return 0
}

// tally counts a decision of n tokens on key for the fleet's weights,
// which left key's bucket holding left tokens; see demand.
func (lim *Limiter) tally(key string, n int64, ls *limits, allowed bool, left int64) {
	if lim.demand == nil {
		return
	}
	limit := int64(ls.Rate * lim.cfg.Heartbeat.Seconds())
	lim.count.Add(lim.demand.tally(key, n, allowed, left, max(limit, 1)))
}

// fleetKey returns the name the group's heartbeat keys start with, beside
// its buckets; its hash tag puts them in one Cluster slot.
func (lim *Limiter) fleetKey() string {
	return lim.cfg.Prefix + "{hybridlimit-fleet:" + lim.cfg.Name + "}"
}

// heartbeat reports to the fleet once per window of Config.Heartbeat the
// tokens offered on this instance (see demand) over its last reportWindows
// windows, and sizes the local share from the fleet's reports it gets
// back. While Redis is away it keeps the last view.
//
// Windows are aligned to Redis TIME (window k covers [k×Heartbeat,
// (k+1)×Heartbeat)), the one clock every instance shares: this machine's
// clock, corrected by what the last reply said, counts the tokens in each
// window, and the report names its window. So every instance counts over
// the same windows, and the weights compare like with like: rates
// measured over different intervals (one fresh, others a heartbeat old)
// overstate the growing ones. Each instance reports at a random offset
// into the next window, 5% to 90% of it, so that the fleet's heartbeats
// spread over the whole window; Redis takes a report up to a window
// later still, so that a late timer or a slow Redis does not drop it, and
// the window read is the one before the last reported: two windows old.
func (lim *Limiter) heartbeat() {
	defer lim.wg.Done()
	ctx := lim.ctx // Close ends a heartbeat in flight
	every := lim.cfg.Heartbeat.Truncate(time.Millisecond)
	offset := every/20 + time.Duration(rand.Int64N(int64(every)*17/20))
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
	var skew time.Duration // Redis TIME less this machine's clock
	snap := lim.count.Load()
	var counts [reportWindows]int64 // offered in the last windows, a ring
	var sent [4]report              // the last reports Redis took, a ring
	prev := int64(math.MinInt64)
	for {
		// A window at a time, even if the skew moves back.
		k := max(time.Now().Add(skew).UnixNano()/int64(every), prev+1)
		prev = k
		end := time.Unix(0, (k+1)*int64(every)).Add(-skew)
		if !sleep(end) {
			return
		}
		if lim.demand != nil {
			lim.demand.window.Add(1)
		}
		n := lim.count.Load()
		counts[k%reportWindows] = n - snap
		snap = n
		var offered int64
		for _, c := range counts {
			offered += c
		}
		if !sleep(end.Add(offset)) {
			return
		}
		// Window k-2 is read: this instance's part of it is its report,
		// if Redis took it.
		mine := int64(-1)
		if r := sent[(k-2)%4]; r.window == k-2 && r.taken {
			mine = r.tokens
		}
		s, taken, ok := lim.beat(ctx, k, offered, mine, every)
		if ok {
			skew = s
		}
		sent[k%4] = report{window: k, tokens: min(offered, remote.MaxReport), taken: taken}
	}
}

// report is one heartbeat's report, as this instance remembers it.
type report struct {
	window, tokens int64
	taken          bool // Redis said it counted it
}

// beat sends one heartbeat reporting offered tokens for window k and
// stores the new view; mine is this instance's report in the window read
// (k-2), -1 if it was not counted there or may not have been. It returns
// Redis TIME less this machine's clock, as the reply says, whether Redis
// took the report, and whether the heartbeat reached Redis.
func (lim *Limiter) beat(ctx context.Context, k, offered, mine int64, every time.Duration) (time.Duration, bool, bool) {
	if lim.single != nil && lim.single.cb.State() == breaker.StateOpen {
		return 0, false, false
	}
	ctx, cancel := context.WithTimeout(ctx, every)
	defer cancel()
	sent := time.Now()
	h, err := remote.Fleet(ctx, lim.cfg.Redis, lim.fleetKey(), k, offered, mine < 0, every)
	if err != nil {
		// The report may have been counted or not: not knowing, the
		// instance counts itself out of that window (which keeps the sum
		// at most 1 either way).
		lim.cfg.Logger.Debug("hybridlimit: heartbeat failed", "limiter", lim.cfg.Name, "err", err)
		return 0, false, false
	}
	rtt := time.Since(sent)
	lim.view.Store(weigh(h, mine, lim.view.Load()))
	return time.UnixMilli(h.Now).Sub(sent.Add(rtt / 2)), h.Taken, true
}

// weigh returns the view after heartbeat h, given the view before, prev.
//
// The window h describes was reported by Reporters instances, Total tokens
// in all, and every instance that reads it reads the same numbers. One
// that reported mine of them gets
//
//	(1-evenPart) × mine/Total + (evenPart-reservePart)/Reporters
//
// (an even split of the traffic part if Total is 0), and these add up to
// 1 - reservePart. The reserve is for the instances that did not report
// for the window (they have just started, or a heartbeat was lost): the
// one with ticket i gets 2^-i of it, so that however many there are, the
// parts of all instances add up to at most 1.
//
// Instances read a window at different times in the next one, so at any
// moment some hold the parts of window m and others those of m+1. Each
// takes the lesser of its parts in the last two windows it read, and the
// sum stays at most 1 across that boundary too: every part held is at most
// the part of the one window all of them read. The cost is that a share
// follows rising traffic a window later than falling traffic.
//
// Before any window was reported (the fleet has just started, or Redis
// was away for a whole window) the view stays as it was: 1/Instances
// before the first heartbeat.
func weigh(h remote.Heartbeat, mine int64, prev *fleet) *fleet {
	m := h.Window
	if h.Reporters == 0 || m == prev.window {
		return prev
	}
	n := float64(h.Reporters)
	v := &fleet{size: int(h.Reporters), window: m}
	if mine >= 0 && mine <= h.Total {
		part := 1 / n
		if h.Total > 0 {
			part = float64(mine) / float64(h.Total)
		}
		v.raw = (1-evenPart)*part + (evenPart-reservePart)/n
	} else {
		if h.Ticket > 0 { // else counted, Redis says, in nothing: no part
			v.raw = math.Ldexp(reservePart, -int(min(h.Ticket, 1100)))
		}
		v.size++
	}
	v.weight = v.raw
	if prev.window == m-1 {
		v.weight = min(v.raw, prev.raw)
	}
	return v
}
