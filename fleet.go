package hybridlimit

import (
	"container/heap"
	"context"
	"hash/maphash"
	"math"
	"reflect"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hybridlimit/hybridlimit/breaker"
	"github.com/hybridlimit/hybridlimit/remote"
	"github.com/redis/go-redis/v9"
)

// fleet is this instance's view of its limiter group, from the last
// heartbeat that reached Redis: how many instances are live and which part
// of every limit this instance holds while Redis is away.
type fleet struct {
	weight float64 // this instance's part of each limit, in [0, 1]
	size   int     // instances counted in the window read, this one included
	window int64   // the window weight was read from; 0 before any
	// known is the last window read, if every window after window up to
	// it was read and had no reports; else window.
	known int64
	// prior is the window before whose part weight is the lesser of
	// (the last one with reports before window, unless weigh had to take
	// an older one); 0 if none.
	prior int64
	raw   float64 // the part that window alone gives
	// even is the even part of a key's share, (evenPart-reservePart)/n
	// for the larger n of window and the one before it with reports, if
	// this instance was counted in both and knows it read the one before;
	// 0 if not, and then it holds no per-key share.
	even    float64
	counted bool // this instance was counted in window
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
	return lim.cfg.Prefix + reservedKeys + lim.cfg.Name + "}"
}

// heart is one Limiter's heartbeat: it reports to the fleet once per
// window of Config.Heartbeat the tokens offered on this instance (see
// demand) over its last reportWindows windows, and sizes the local share
// from the fleet's reports it gets back. While Redis is away it keeps the
// last view. The hearts of Limiters that share a client are run by one
// pacer (below), which sends the heartbeats that are due together in one
// round trip.
//
// Windows are aligned to Redis TIME (window k covers [k×Heartbeat,
// (k+1)×Heartbeat)), the one clock every instance shares: this machine's
// clock, corrected by what the last reply said, counts the tokens in each
// window, and the report names its window. So every instance counts over
// the same windows, and the weights compare like with like: rates
// measured over different intervals (one fresh, others a heartbeat old)
// overstate the growing ones. Each instance reports at an offset into
// the next window, 5% to 85% of it, one of its pacer's pacerSlots (whose
// phase is random), so that the fleet's heartbeats spread over the whole
// window and one process's share round trips; Redis takes a report up to a window
// later still, so that a late timer or a slow Redis does not drop it, and
// the window read is the one before the last reported: two windows old.
//
// A heart has two steps per window: at the window's end it counts what
// was offered in it (counting), and at the offset into the next one it
// sends the report. Its fields are only touched by the pacer's goroutine,
// but for due and at, which the pacer's mutex protects.
type heart struct {
	lim    *Limiter
	every  time.Duration
	offset time.Duration

	skew     time.Duration // Redis TIME less this machine's clock
	snap     int64         // lim.count at the last count
	counts   [reportWindows]int64
	offered  int64     // the sum of counts, to report for window k
	sent     [4]report // the last reports Redis took, a ring
	prev     int64     // the last window counted
	k        int64     // the window counted next, or reported next
	end      time.Time // window k's end, on this machine's clock
	counting bool      // the next step counts window k; else it reports it
	sending  string    // the master the report in flight was sent to (heart.master)

	due time.Time // the next step's time
	at  int       // index in the pacer's heap; -1 if not in it
}

func newHeart(lim *Limiter) *heart {
	every := lim.cfg.Heartbeat.Truncate(time.Millisecond)
	h := &heart{
		lim:   lim,
		every: every,
		snap:  lim.count.Load(),
		prev:  math.MinInt64,
		at:    -1,
	}
	h.nextWindow(time.Now(), false)
	return h
}

// nextWindow makes the next step the count of the window now is in (a
// window at a time, even if the skew moves back). With follow (the last
// report was answered), it is the window after the last one if its report
// can still be taken: a report answered after that window ended (Redis
// slower than what was left of it) is followed at once by that window's
// count, and its report goes at its offset, about a window late, which
// Redis takes, rather than leaving the instance out of that window's sum.
// Not after a report that went unanswered: its node may have hung and been
// replaced by a replica that lacked the last reports, and a read sent at
// once, before the Cluster client has loaded the new layout, would count
// reports the replica does not hold (heart.master).
//
// What was offered in windows skipped goes into the count of the window
// now is in, their places in the report's ring emptied; after a stall
// longer than the report's span it is dropped, so that a report never
// spans more than reportWindows windows.
func (h *heart) nextWindow(now time.Time, follow bool) {
	cur := now.Add(h.skew).UnixNano() / int64(h.every)
	h.k = h.prev + 1
	if cur > h.k && (!follow || cur > h.k+1) {
		for w := max(h.k, cur-reportWindows+1); w < cur; w++ {
			h.counts[w%reportWindows] = 0
		}
		if h.prev == math.MinInt64 || cur-h.k >= reportWindows {
			h.snap = h.lim.count.Load()
		}
		h.k = cur
	}
	h.prev = h.k
	h.end = time.Unix(0, (h.k+1)*int64(h.every)).Add(-h.skew)
	h.counting, h.due = true, h.end
}

// count counts window k, which has ended, and makes the next step its
// report.
func (h *heart) count() {
	lim := h.lim
	if lim.demand != nil {
		lim.demand.window.Add(1)
	}
	n := lim.count.Load()
	h.counts[h.k%reportWindows] = n - h.snap
	h.snap = n
	h.offered = 0
	for _, c := range h.counts {
		h.offered += c
	}
	h.counting, h.due = false, h.end.Add(h.offset)
}

// mine returns this instance's report in window w (one of the last four),
// if Redis took it, else -1: it was not counted there, or may not have
// been.
func (h *heart) mine(w int64) int64 {
	if r := h.sent[w%4]; r.window == w && r.taken {
		return r.tokens
	}
	return -1
}

// taken returns whether Redis took this instance's report in window w, and
// under which mark; on a Cluster, only if the master that took it still
// holds the heartbeats' slot, as master names it.
func (h *heart) taken(w int64, master string) (bool, int64) {
	r := h.sent[w%4]
	return r.window == w && r.taken && r.master == master, r.mark
}

// master returns the address of the master of the heartbeats' slot, as
// the Cluster client's loaded layout says, "" for a single Redis. A
// replica that took over may lack the last reports its master took (the
// replication's lag), under the same mark: a report taken by another
// master than the one that holds the slot now is counted out.
func (h *heart) master() string {
	lim := h.lim
	if lim.cluster == nil {
		return ""
	}
	if !lim.mapped.Load() {
		return "?" // MasterForKey would load the layout, waiting on the network
	}
	c, err := lim.cluster.MasterForKey(lim.ctx, lim.fleetKey())
	if err != nil {
		return "?"
	}
	return c.Options().Addr
}

// beat returns the heartbeat that reports window k: it reads window k-2,
// and, if this instance did not read the one before, that one too (see
// weigh), with a ticket in each where it was not counted.
func (h *heart) beat() remote.Beat {
	h.sending = h.master()
	if nd := h.lim.single; nd != nil && nd.cb.State() != breaker.StateClosed || h.unsure(h.k-2) {
		// The report goes, so that the instance stays counted where Redis
		// takes it (a Redis too slow for decisions may answer a
		// heartbeat), but nothing is read, and the view Redis gave before
		// holds: while Redis is away for decisions, and while the window
		// to read is one whose report went unanswered. Redis may have
		// counted that report (a Redis slower than the heartbeat's budget
		// runs it, and the answer comes too late); the instance, not
		// knowing, would take a ticket, a few thousandths of the limit,
		// and hold it through an outage starting then. Reads while the
		// breaker is open meet such windows too, and take the view away
		// from what the fleet's traffic was when Redis last served this
		// instance. The windows not read are read later, as the window
		// before, if this instance's part in them is known. If a report
		// in fact never reached Redis, or traffic moved while this
		// instance held its older part, the weights add up to more than
		// 1 by the difference, as they do while an instance is cut off
		// from Redis (docs/design.md, partial partitions).
		return remote.Beat{Base: h.lim.fleetKey(), Window: h.k, Offered: h.offered, Every: h.every, ReportOnly: true}
	}
	before := h.lim.view.Load().known < h.k-3 && !h.unsure(h.k-3)
	in, mark := h.taken(h.k-2, h.sending)
	bin, bmark := h.taken(h.k-3, h.sending)
	return remote.Beat{Base: h.lim.fleetKey(), Window: h.k, Offered: h.offered, Every: h.every,
		Ticket: !in, Mark: mark, Before: before, BeforeTicket: before && !bin, BeforeMark: bmark}
}

// unsure says whether this instance's report in window w was sent and
// went unanswered: Redis may or may not have counted it.
func (h *heart) unsure(w int64) bool {
	r := h.sent[w%4]
	return r.window == w && r.unsure
}

// skip says whether the report of window k is not to be sent: the
// Limiter is closed. An open breaker does not stop it: a Redis slower than
// the decisions' Timeout may still answer within the heartbeat's budget
// of a window, and an instance that skipped its report would be left out
// of that window's sum, to hold a ticket's part (thousandths of the
// limit) if Redis went away altogether in the next windows, while the
// instances counted split its part among them.
func (h *heart) skip() bool {
	return h.lim.ctx.Err() != nil
}

// answer stores what the report of window k sent at sent, and answered at
// got, came to (b; nil if it was not sent), and makes the next step the
// count of the next window.
func (h *heart) answer(b *remote.Beat, sent, got time.Time) {
	lim := h.lim
	taken, mark := false, int64(0)
	switch {
	case b == nil:
	case b.Err != nil:
		// The report may have been counted or not: not knowing, the
		// instance counts itself out of that window (which keeps the sum
		// at most 1 either way).
		lim.cfg.Logger.Debug("hybridlimit: heartbeat failed", "limiter", lim.cfg.Name, "err", b.Err)
	default:
		// The script reads window i only if Redis is at least three
		// windows past it (r = Now/w, i <= r-3), and its hash is gone from
		// r = i+6 on; outside that its reply, {now, taken, 0, 0}, is the
		// same as for a closed window nobody reported for. A heartbeat
		// that reached Redis before the window closed (this machine's idea
		// of Redis's clock ahead: a Redis stall inflated the skew, a
		// failover to a host whose clock is behind) read nothing: weigh
		// must not mark the window known, or the next heartbeat would not
		// ask for it as the window before (see weigh).
		if r := b.Heartbeat.Now / h.every.Milliseconds(); !b.ReportOnly && b.Heartbeat.Window <= r-3 && b.Heartbeat.Window >= r-5 {
			// A ticket it did not ask for says that its report went
			// into a hash Redis lost since (remote.Beat.Mark): the sum
			// read does not hold it.
			mine, before := h.mine(h.k-2), h.mine(h.k-3)
			if b.Heartbeat.Ticket > 0 {
				mine = -1
			}
			if b.Heartbeat.Before.Ticket > 0 {
				before = -1
			}
			v := weigh(b.Heartbeat, mine, before, lim.view.Load())
			lim.view.Store(v)
			if lim.cfg.onView != nil {
				lim.cfg.onView(v)
			}
		}
		rtt := got.Sub(sent)
		h.skew = time.UnixMilli(b.Heartbeat.Now).Sub(sent.Add(rtt / 2))
		taken, mark = b.Heartbeat.Taken, b.Heartbeat.Mark
	}
	h.sent[h.k%4] = report{window: h.k, tokens: min(h.offered, remote.MaxReport), taken: taken, mark: mark, master: h.sending,
		unsure: b != nil && remote.MayHaveRun(b.Err)}
	h.nextWindow(got, b != nil && b.Err == nil)
}

// report is one heartbeat's report, as this instance remembers it.
type report struct {
	window, tokens int64
	taken          bool   // Redis said it counted it
	unsure         bool   // sent, and unanswered: Redis may have counted it
	mark           int64  // if taken, the mark of the sum it went into
	master         string // on a Cluster, the heartbeats' master when it was sent
}

// pacer runs the hearts of the Limiters that share one Redis client, in
// one goroutine with one timer: it wakes when the earliest step is due,
// takes every step due within pacerSlack of it, and sends the reports
// among them in one pipeline. 2,000 Limiters of one client then cost a
// few dozen wakeups and round trips per window instead of 4,000 wakeups
// and 2,000 round trips. The first Limiter of a client starts its pacer;
// the last to Close stops it and waits for its goroutine to return.
type pacer struct {
	c   redis.UniversalClient
	key any // in pacers.by
	// node is what is known of the heartbeats' node: one for the client,
	// though on a Cluster the heartbeats of Limiters of other names may go
	// to other masters. It only picks each call's first try: a call that
	// meets a node without the library, or one refusing TIME, is answered
	// on its own.
	node *remote.Node
	wake chan struct{} // a heart joined: the earliest step may be earlier
	ctx  context.Context
	stop context.CancelFunc
	done chan struct{} // closed when run returns

	phase float64 // where its slots start, in slots: random in [0, pacerSlots)

	mu      sync.Mutex // protects hearts, members and every heart's due and at
	hearts  heartHeap  // the hearts waiting for their next step
	members int        // hearts joined and not left, in hearts or stepping
}

// pacerSlots is how many offsets into a window a pacer's hearts report
// at: few, so that the hearts of many Limiters share a few round trips,
// but more than one, so that one process does not send them all at once.
const pacerSlots = 8

// pacerSlack is how much earlier than due a step may run, as a part of
// the heart's window, so that steps close in time share a wakeup and a
// round trip: a count 2% early moves 2% of a window's traffic into the
// next window, which a report of 4 windows smooths out.
const pacerSlack = 50

// pacers holds the pacer of each client that Limiters use, by pacerKey.
var pacers struct {
	mu sync.Mutex // protects by
	by map[any]*pacer
}

// pacerKey returns the key of the pacer h's Limiter shares: its client,
// unless the client is a value no map can hold (a wrapper of the user's
// with a slice or a func in it), whose Limiter gets a pacer of its own.
func pacerKey(h *heart) any {
	c := h.lim.cfg.Redis
	if !reflect.ValueOf(c).Comparable() {
		return h
	}
	return c
}

// join adds h to the pacer of its Limiter's client, starting the pacer if
// h is its first.
func join(h *heart) *pacer {
	key := pacerKey(h)
	pacers.mu.Lock()
	defer pacers.mu.Unlock()
	p := pacers.by[key]
	if p == nil {
		if pacers.by == nil {
			pacers.by = make(map[any]*pacer)
		}
		p = &pacer{c: h.lim.cfg.Redis, key: key, wake: make(chan struct{}, 1), done: make(chan struct{}), phase: h.lim.rand.Float64() * pacerSlots,
			node: &remote.Node{Name: "heartbeats", Log: h.lim.cfg.Logger, Now: h.lim.cfg.now}}
		p.ctx, p.stop = context.WithCancel(context.Background())
		pacers.by[key] = p
		go p.run()
	}
	p.mu.Lock()
	// Slot i starts (phase+i mod pacerSlots)/10 of the window after its
	// first 5%: a process with one Limiter reports anywhere in 5-85%.
	slot := math.Mod(float64(p.members)+p.phase, pacerSlots)
	h.offset = h.every/20 + time.Duration(slot*float64(h.every)/10)
	heap.Push(&p.hearts, h)
	p.members++
	p.mu.Unlock()
	select {
	case p.wake <- struct{}{}:
	default:
	}
	return p
}

// leave removes h from p; if it was p's last, it stops p and waits for its
// goroutine. A report of h's in flight, sent with others, may still store
// h's Limiter's view, which is closed.
func (p *pacer) leave(h *heart) {
	pacers.mu.Lock()
	p.mu.Lock()
	if h.at >= 0 {
		heap.Remove(&p.hearts, h.at)
	}
	h.at = -2 // gone: not to be pushed again
	p.members--
	last := p.members == 0
	p.mu.Unlock()
	if last && pacers.by[p.key] == p {
		delete(pacers.by, p.key)
	}
	pacers.mu.Unlock()
	if last {
		p.stop()
		<-p.done
	}
}

// run steps the hearts until stop.
func (p *pacer) run() {
	defer close(p.done)
	t := time.NewTimer(time.Hour)
	defer t.Stop()
	var steps []*heart
	var beats []remote.Beat
	var sending []*heart
	for {
		p.mu.Lock()
		next := time.Now().Add(time.Hour)
		if len(p.hearts) > 0 {
			next = p.hearts[0].due
		}
		p.mu.Unlock()
		t.Reset(time.Until(next))
		select {
		case <-t.C:
		case <-p.wake:
			continue
		case <-p.ctx.Done():
			return
		}
		now := time.Now()
		steps = steps[:0]
		p.mu.Lock()
		for len(p.hearts) > 0 {
			h := p.hearts[0]
			if h.due.Sub(now) > h.every/pacerSlack {
				break
			}
			heap.Pop(&p.hearts)
			steps = append(steps, h)
		}
		p.mu.Unlock()
		beats, sending = beats[:0], sending[:0]
		var every time.Duration
		for _, h := range steps {
			switch {
			case h.counting:
				h.count()
			case h.skip():
				h.answer(nil, now, now)
			default:
				beats = append(beats, h.beat())
				sending = append(sending, h)
				every = max(every, h.every)
			}
		}
		if len(beats) > 0 {
			ctx, cancel := context.WithTimeout(p.ctx, every)
			sent := time.Now()
			remote.Beats(ctx, p.c, p.node, beats)
			got := time.Now()
			cancel()
			for i, h := range sending {
				h.answer(&beats[i], sent, got)
			}
		}
		p.mu.Lock()
		for _, h := range steps {
			if h.at == -1 {
				heap.Push(&p.hearts, h)
			}
		}
		p.mu.Unlock()
	}
}

// heartHeap orders hearts by their next step's time.
type heartHeap []*heart

func (q heartHeap) Len() int           { return len(q) }
func (q heartHeap) Less(i, j int) bool { return q[i].due.Before(q[j].due) }
func (q heartHeap) Swap(i, j int) {
	q[i], q[j] = q[j], q[i]
	q[i].at, q[j].at = i, j
}
func (q *heartHeap) Push(x any) {
	h := x.(*heart)
	h.at = len(*q)
	*q = append(*q, h)
}
func (q *heartHeap) Pop() any {
	old := *q
	h := old[len(old)-1]
	old[len(old)-1] = nil
	*q = old[:len(old)-1]
	h.at = -1
	return h
}

// weigh returns the view after heartbeat h, given the view before, prev;
// mine and before are this instance's reports in the window h read and
// the one before it (-1: not counted there, or not known to be).
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
// moment some hold the parts of window m and others those of the window
// before, m-1. Each holds the lesser of its parts in the two, and the sum
// stays at most 1 across that boundary too: every part held is at most
// the part of the one window all of them read. The cost is that a share
// follows rising traffic a window later than falling traffic. A window
// that nobody reported for leaves every view as it was, so "the window
// before" is the last one with reports. An instance that did not read it
// (its heartbeat failed or came late, its breaker was open, or its report
// in that window went unanswered) gets it from Redis with
// window m (h.Before), with a ticket if it was not counted there, even if
// window m has no reports. Only if Redis could not give it (the heartbeat
// was more than a window late, or window m-1 had no reports and the
// instance missed m-2 too) is the part of the instance's last view taken
// instead, which may be older: the bound then holds if every window
// between had no reports (a whole fleet back from an outage), and may not
// otherwise.
//
// Before any window was reported (the fleet has just started, or Redis
// was away for a whole window) the view stays as it was: 1/Instances
// before the first heartbeat.
func weigh(h remote.Heartbeat, mine, before int64, prev *fleet) *fleet {
	m := h.Window
	if m <= prev.known {
		return prev // read already
	}
	if b := h.Before; b.Read && prev.known < m-1 {
		prev = weigh(remote.Heartbeat{Window: m - 1, Reporters: b.Reporters, Total: b.Total, Ticket: b.Ticket}, before, -1, prev)
	}
	if h.Reporters == 0 {
		if prev.known == m-1 && prev.window > 0 {
			v := *prev
			v.known = m
			return &v
		}
		return prev
	}
	v := part(m, h.Reporters, h.Total, h.Ticket, mine)
	v.weight = v.raw
	if prev.window > 0 {
		v.weight = min(v.raw, prev.raw)
		v.prior = prev.window
	}
	if prev.known >= m-1 && v.counted && prev.counted {
		v.even = (evenPart - reservePart) / float64(max(prev.size, v.size))
	}
	return v
}

// part returns the view of window m alone, reported by reporters
// instances, total tokens in all, given this instance's report mine (-1:
// not counted) and its ticket.
func part(m, reporters, total, ticket, mine int64) *fleet {
	n := float64(reporters)
	v := &fleet{size: int(reporters), window: m, known: m}
	v.counted = mine >= 0 && mine <= total
	if v.counted {
		part := 1 / n
		if total > 0 {
			part = float64(mine) / float64(total)
		}
		v.raw = (1-evenPart)*part + (evenPart-reservePart)/n
	} else {
		if ticket > 0 { // else counted, Redis says, in nothing: no part
			v.raw = math.Ldexp(reservePart, -int(min(ticket, 1100)))
		}
		v.size++
	}
	v.weight = v.raw
	return v
}

// keyWeight returns this instance's part of key's limit while Redis is
// away, given its view v and the key's node nd (nil: not known). If it
// has a part of the key's consumption in the spans that end with the two
// windows of its view (the lesser of the two), its key share is that part
// weighed as the weights weigh traffic:
//
//	(1-evenPart) × part + (evenPart-reservePart)/n
//
// where the even part is only for an instance counted in both windows (n
// the larger of their reporters; see fleet.even). It holds that if it is
// more than its weight, or, for a key used near its limit, less than its
// weight by more than keyNoise; otherwise it holds its weight. So an
// instance that served all of a key holds nearly all of it, one that
// served a third of a busy key while other keys made its weight about a
// third, and one that never saw the key its weight (see keyShare). The key shares of all
// instances that hold one add up to at most 1 - reservePart; with the
// weights of the others the sum is at most 1 plus the lesser of the two
// (docs/design.md, per-key shares). A key whose answers ended while nd
// went on answering has no part here (see local.Shares.Part): its traffic
// moved to another instance.
func (lim *Limiter) keyWeight(key string, v *fleet, nd *node) float64 {
	if v.window == 0 || lim.heart == nil || lim.cfg.noKeyShares {
		return v.weight
	}
	var heard int64
	if nd != nil {
		heard = nd.window.Load()
	}
	part, near, ok := lim.shares.Part(key, v.window, heard)
	return keyShare(v.weight, (1-evenPart)*part+v.even, near, ok)
}

// keyShare is keyWeight's choice between an instance's weight and its
// share of a key (ok: it has one; near: the key was used near its limit).
// A key share replaces the weight where it says what the weight cannot:
// that the instance served more of the key than its weight (sticky
// routing), or, for a key near its limit, clearly less (its weight comes
// from other keys). Clearly: by more than keyNoise, for a key share is a
// lower bound of the instance's part measured over a few windows, and it
// scatters around the true part by about a tenth (0.15 to 0.29 for an even
// part of 0.25 among four instances, run to run): taken where it fell
// under a weight that already matched the instance's traffic, it left the
// fleet under the limit in an outage (83 of 100 per second).
func keyShare(weight, share float64, near, ok bool) float64 {
	if ok && (share > weight || near && share < weight-keyNoise) {
		return share
	}
	return weight
}

// keyNoise: see keyShare.
const keyNoise = 0.15
