package hybridlimit

import (
	"cmp"
	"context"
	"net"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/hybridlimit/hybridlimit/breaker"
	"github.com/hybridlimit/hybridlimit/remote"
)

// A Cluster's failover moves a master's slots to its replica. go-redis
// learns of it by reloading its layout from a random node, which, if it
// picks the master that hangs, waits for the client's ReadTimeout and its
// retries (seconds, with default options); meanwhile it routes the keys to
// the dead master, and the limiter keeps them local. So while a breaker is
// open the limiter reads the layout itself, from a few nodes at once through
// clients of its own that stop at their deadline, and routes a key whose
// node is not closed to the master its own layout names, through a client
// of its own, until go-redis agrees.

// layout is the Cluster's slot layout as the limiter last read it.
type layout struct {
	// The slots in runs of one owner, in order: a handful, where a table
	// of every slot costs a pass over 16,384 entries per answer read.
	spans []span
	addrs []string
	// replicas[i-1]: the replicas the answers named for addrs[i-1]
	replicas [][]string
	nodes    []string  // every node the answers named, replicas included
	began    time.Time // when its reading began
}

// span is the slots first to last, both included, and their owner: an
// index into the layout's addrs, +1; 0: nobody.
type span struct {
	first, last int
	owner       uint16
}

// at returns the master of slot, "" if the layout names none.
func (l *layout) at(slot int) string {
	if i := l.ownerOf(slot); i > 0 {
		return l.addrs[i-1]
	}
	return ""
}

// ownerOf returns the owner of slot, as a span holds it.
func (l *layout) ownerOf(slot int) uint16 {
	i, _ := slices.BinarySearchFunc(l.spans, slot, func(s span, slot int) int { return cmp.Compare(s.last, slot) })
	if i < len(l.spans) && l.spans[i].first <= slot {
		return l.spans[i].owner
	}
	return 0
}

// claim gives the slots of each of ranges, one answer's (they do not
// overlap; an empty one is dropped), to the range's owner where they have
// no owner yet, or one that is down while the range's is not (down[j-1]:
// owner j is failing here). It sorts ranges, and costs one pass over the
// spans and the ranges: a Cluster resharded slot by slot answers with
// thousands of ranges.
func (l *layout) claim(ranges []span, down []bool) {
	ranges = slices.DeleteFunc(ranges, func(r span) bool { return r.first > r.last })
	slices.SortFunc(ranges, func(a, b span) int { return cmp.Compare(a.first, b.first) })
	spans := l.spans
	if spans == nil {
		spans = []span{{0, remote.Slots - 1, 0}}
	}
	out := make([]span, 0, len(spans)+2*len(ranges))
	put := func(s span) {
		if s.first > s.last {
			return
		}
		if n := len(out); n > 0 && out[n-1].owner == s.owner && out[n-1].last+1 == s.first {
			out[n-1].last = s.last
			return
		}
		out = append(out, s)
	}
	j := 0
	for _, s := range spans {
		for pos := s.first; pos <= s.last; {
			for j < len(ranges) && ranges[j].last < pos {
				j++
			}
			if j == len(ranges) || ranges[j].first > s.last {
				put(span{pos, s.last, s.owner})
				break
			}
			r := ranges[j]
			if r.first > pos {
				put(span{pos, r.first - 1, s.owner})
				pos = r.first
			}
			end := min(r.last, s.last)
			o := s.owner
			if o == 0 || down[o-1] && !down[r.owner-1] {
				o = r.owner
			}
			put(span{pos, end, o})
			pos = end + 1
		}
	}
	l.spans = out
}

// layoutTimeout bounds one reading of the layout.
const layoutTimeout = 500 * time.Millisecond

// relayout asks go-redis to reload the Cluster's slot layout (ReloadState
// does not wait), starts a reading of the layout of its own if none is
// under way, and forgets the nodes that no longer own the key they were
// last probed on: a master that lost its slots to a failover, or a pod
// whose address is gone. Their keys go to their new master's node, where
// what this instance spent on them locally is charged (masterFor).
func (lim *Limiter) relayout() {
	lim.cluster.ReloadState(lim.ctx)
	lim.startReading()
	for _, nd := range *lim.nodes.Load() {
		p := nd.probe.Load()
		if nd.cb.State() == breaker.StateClosed || p == nil {
			continue
		}
		if now := lim.route(p.key); now != nil && now != nd {
			lim.forget(nd)
		}
	}
}

// startReading starts a reading of the layout, unless one is under way.
func (lim *Limiter) startReading() {
	if lim.reading.CompareAndSwap(false, true) {
		lim.wg.Go(func() {
			defer lim.reading.Store(false)
			ctx, cancel := context.WithTimeout(lim.ctx, layoutTimeout)
			defer cancel()
			if l := lim.readLayout(ctx, "", -1); l != nil {
				lim.keepLayout(l)
			}
		})
	}
}

// failedLayoutEvery bounds the layout reads that failed calls start: a read
// asks several nodes at once, and a latency spike that fails calls on every
// instance of a large fleet must not multiply into reads of a Cluster that
// is slow already. A quiet instance needs one read per failover.
const failedLayoutEvery = time.Second

// relayoutAfterFailure reads a Cluster's layout again after a failed call,
// at most once per failedLayoutEvery. The prober reads it while a breaker is
// open, but an instance whose calls to a node are too few to open its
// breaker (a quiet key, a large fleet) would never learn that the node's
// slots moved to its replica, and would wait its budget on every decision
// there.
func (lim *Limiter) relayoutAfterFailure() {
	if lim.cluster == nil {
		return
	}
	now, last := lim.cfg.now().UnixNano(), lim.relaid.Load()
	if now-last < int64(failedLayoutEvery) || !lim.relaid.CompareAndSwap(last, now) {
		return
	}
	if lim.enter() {
		defer lim.wg.Done()
		lim.startReading()
	}
}

// enter counts the calling goroutine in lim.wg, which Close waits for,
// unless Close has begun: a goroutine that was not started by one the
// limiter counts already (a timer's) calls it before it uses the limiter's
// clients, and lim.wg.Done when it is over.
func (lim *Limiter) enter() bool {
	lim.mu.Lock()
	defer lim.mu.Unlock()
	if lim.closed.Load() {
		return false
	}
	lim.wg.Add(1)
	return true
}

// layoutFanout is how many nodes a reading of the layout asks at once,
// and how many answers it takes at most. A reading asks one more for each
// answer that fails or is slow (layoutHedge), so a node that hangs costs
// it a round trip, not the reading; the replicas of a failing master go
// first, and after a takeover one of them answers with the news. Asking every node at once would cost the Cluster one CLUSTER
// SLOTS per node for every reading of every instance, ten a second each
// while a breaker is open, at the moment some of its nodes take over.
const layoutFanout = 2

// layoutHedge is the part of the reading's time (Timeout, or what is left
// of its context's, if less) after which, with no answer since the last
// node was asked, another is asked beside it.
const layoutHedge = 4

// readLayout asks the nodes it knows of (the client's seeds, the nodes and
// the last layout read), layoutFanout at a time, for CLUSTER SLOTS: first
// the replicas of masters failing here (after a failover one of them is
// the master, and the first to know it), then the others in random order.
// It returns the layout that the first layoutFanout answers give (one is
// enough if every master it names is not failing here), nil if none
// answered before ctx ended. Nodes whose breaker is not closed, and
// suspect, are not asked: a node lost for good would hold the reading
// until ctx ends. With a slot (not -1), it returns at the first answer
// that names a master of that slot that is neither.
func (lim *Limiter) readLayout(ctx context.Context, suspect string, slot int) *layout {
	seen := map[string]bool{}
	var addrs []string
	add := func(a string) {
		if a != "" && !seen[a] {
			seen[a] = true
			addrs = append(addrs, a)
		}
	}
	for _, a := range lim.cluster.Options().Addrs {
		add(a)
	}
	for a := range *lim.nodes.Load() {
		add(a)
	}
	if l := lim.layout.Load(); l != nil {
		// Replicas too: after a failover one of them is the master, and
		// the first to know it.
		for _, a := range l.nodes {
			add(a)
		}
	}
	// A node failing here (the master that hangs) would hold its reading
	// until ctx ends: it is not asked, and an answer naming it gives way
	// to another's.
	failing := map[string]bool{}
	for a, nd := range *lim.nodes.Load() {
		failing[a] = nd.cb.State() != breaker.StateClosed
	}
	if suspect != "" {
		failing[suspect] = true
	}
	live := slices.DeleteFunc(addrs, func(a string) bool { return failing[a] })
	lim.rand.Shuffle(len(live), func(i, j int) { live[i], live[j] = live[j], live[i] })
	if l := lim.layout.Load(); l != nil {
		front := 0
		for i, m := range l.addrs {
			if !failing[m] {
				continue
			}
			for _, r := range l.replicas[i] {
				if j := slices.Index(live, r); j >= front {
					live[front], live[j] = live[j], live[front]
					front++
				}
			}
		}
	}
	if lim.cfg.onLayoutRead != nil {
		lim.cfg.onLayoutRead(slices.Clone(live))
	}
	began := time.Now()
	type reply struct {
		addr  string
		slots []redis.ClusterSlot
	}
	got := make(chan reply, len(live))
	hedge := time.NewTimer(time.Hour)
	defer hedge.Stop()
	asked, pending := 0, 0
	ask := func() {
		for ; asked < len(live); asked++ {
			a := live[asked]
			c := lim.ownClient(a)
			if c == nil {
				continue
			}
			// A node that hangs holds its goroutine until ctx's deadline
			// (go-redis reads until the deadline, not the cancel), which
			// the reading does not wait for: Close does.
			lim.wg.Go(func() {
				slots, err := c.ClusterSlots(ctx).Result()
				if err != nil {
					slots = nil
				}
				got <- reply{a, slots}
			})
			asked++
			pending++
			wait := lim.cfg.Timeout
			if dl, ok := ctx.Deadline(); ok {
				wait = min(wait, time.Until(dl))
			}
			hedge.Reset(max(wait/layoutHedge, time.Millisecond))
			return
		}
	}
	for range layoutFanout {
		ask()
	}
	// Nodes can disagree for a moment after a failover, while the news
	// spreads: for each slot the owner is taken from the first answer that
	// names one that is not failing here.
	l := &layout{began: began}
	index := map[string]uint16{}
	var down []bool // down[i-1]: l.addrs[i-1] is failing here
	answers := 0
read:
	for pending > 0 {
		var r reply
		select {
		case r = <-got:
		case <-hedge.C:
			ask()
			continue
		case <-ctx.Done():
			break read
		}
		pending--
		var ranges []span
		for _, rg := range r.slots {
			if len(rg.Nodes) == 0 {
				continue
			}
			for _, n := range rg.Nodes {
				if a := nodeAddr(n.Addr, r.addr); !slices.Contains(l.nodes, a) {
					l.nodes = append(l.nodes, a)
				}
			}
			a := nodeAddr(rg.Nodes[0].Addr, r.addr)
			i, ok := index[a]
			if !ok {
				l.addrs = append(l.addrs, a)
				l.replicas = append(l.replicas, nil)
				down = append(down, failing[a])
				i = uint16(len(l.addrs))
				index[a] = i
			}
			for _, n := range rg.Nodes[1:] {
				if rep := nodeAddr(n.Addr, r.addr); !slices.Contains(l.replicas[i-1], rep) {
					l.replicas[i-1] = append(l.replicas[i-1], rep)
				}
			}
			if first, last := max(rg.Start, 0), min(rg.End, remote.Slots-1); first <= last {
				ranges = append(ranges, span{first, last, i})
			}
		}
		if len(ranges) == 0 {
			ask() // it failed: another in its place
			continue
		}
		l.claim(ranges, down)
		answers++
		if slot >= 0 {
			if i := l.ownerOf(slot); i > 0 && !down[i-1] {
				break read // what the caller asked for, the slot's master now
			}
		} else if !slices.ContainsFunc(l.spans, func(s span) bool { return s.owner > 0 && down[s.owner-1] }) {
			break read // every slot's master answers here
		}
		if answers >= layoutFanout {
			break read
		}
	}
	if answers == 0 {
		return nil
	}
	return l
}

// nodeAddr is addr, a node's address in the CLUSTER SLOTS answer of the
// node at origin, as go-redis's ClusterClient names the node (its
// newClusterState): a loopback host is replaced by origin's host unless
// that is loopback too (a Cluster behind NAT or in containers announces
// 127.0.0.1), and a port 0 by origin's port (a TLS-only Cluster announces
// port 0). Routing compares the two names, so they must agree.
func nodeAddr(addr, origin string) string {
	host, port, err := net.SplitHostPort(origin)
	if err != nil {
		return addr
	}
	nhost, nport, err := net.SplitHostPort(addr)
	if err != nil {
		return addr
	}
	if ip := net.ParseIP(nhost); ip != nil && ip.IsLoopback() && !loopbackHost(host) {
		nhost = host
	}
	if nport == "0" && port != "" && port != "0" {
		nport = port
	}
	return net.JoinHostPort(nhost, nport)
}

// loopbackHost is go-redis's isLoopback: a loopback IP, localhost, or a
// Docker host's *.docker.internal.
func loopbackHost(host string) bool {
	if ip := net.ParseIP(host); ip != nil {
		return ip.IsLoopback()
	}
	h := strings.ToLower(host)
	return h == "localhost" || strings.HasSuffix(h, ".docker.internal")
}

// keepLayout stores l unless a reading that began after l's was stored
// already: readings overlap (one waits up to layoutTimeout for a node that
// hangs, while a watched call's reading is answered at once), and one that
// began before a takeover must not replace what a later one found.
func (lim *Limiter) keepLayout(l *layout) {
	for {
		cur := lim.layout.Load()
		if cur != nil && cur.began.After(l.began) {
			return
		}
		if lim.layout.CompareAndSwap(cur, l) {
			lim.mu.Lock()
			drop := lim.unnamedClients()
			lim.mu.Unlock()
			closeClients(drop)
			return
		}
	}
}

// unnamedClients removes from lim.own, and returns for closing, the
// clients of addresses that neither the layout, the Cluster client's seeds
// nor a node names any more: a master that a failover left out, or a pod
// whose address is gone (Kubernetes gives a replaced pod a new one). Kept,
// each would hold its pool, and its sockets to a host that is gone, until
// Close. A reading still under way on one fails, as a reading of a node
// that is gone does. unnamedClients requires that lim.mu is held: a node
// made under it (nodeAt) names its address before its client can go.
func (lim *Limiter) unnamedClients() []*redis.Client {
	if len(lim.own) == 0 || lim.closed.Load() {
		return nil
	}
	named := map[string]bool{}
	for _, a := range lim.cluster.Options().Addrs {
		named[a] = true
	}
	if l := lim.layout.Load(); l != nil {
		for _, a := range l.nodes {
			named[a] = true
		}
	}
	for a := range *lim.nodes.Load() {
		named[a] = true
	}
	var drop []*redis.Client
	for a, c := range lim.own {
		if !named[a] {
			drop = append(drop, c)
			delete(lim.own, a)
		}
	}
	return drop
}

// closeClients closes cs.
func closeClients(cs []*redis.Client) {
	for _, c := range cs {
		c.Close()
	}
}

// ownClient returns the limiter's own client of the node at addr, made
// from the Cluster client's options but bounded by the context's deadline
// and never retrying, so that a node that hangs costs a reading or a
// decision its budget, not the client's ReadTimeout. Close closes them.
// It returns nil once the limiter is closed.
func (lim *Limiter) ownClient(addr string) *redis.Client {
	lim.mu.Lock()
	defer lim.mu.Unlock()
	return lim.ownClientLocked(addr)
}

// ownClientLocked is ownClient for a caller that holds lim.mu.
func (lim *Limiter) ownClientLocked(addr string) *redis.Client {
	if lim.closed.Load() {
		return nil
	}
	if c := lim.own[addr]; c != nil {
		return c
	}
	o := lim.cluster.Options()
	c := redis.NewClient(&redis.Options{
		Addr:                         addr,
		ClientName:                   o.ClientName,
		Dialer:                       o.Dialer,
		OnConnect:                    o.OnConnect,
		Protocol:                     o.Protocol,
		Username:                     o.Username,
		Password:                     o.Password,
		CredentialsProvider:          o.CredentialsProvider,
		CredentialsProviderContext:   o.CredentialsProviderContext,
		StreamingCredentialsProvider: o.StreamingCredentialsProvider,
		TLSConfig:                    o.TLSConfig,
		DialTimeout:                  o.DialTimeout,
		// Its reads and writes stop at the context's deadline: a negative
		// time-out (-2: no socket deadline at all) becomes go-redis's
		// default, which the deadline of every call here undercuts.
		ReadTimeout:           max(o.ReadTimeout, 0),
		WriteTimeout:          max(o.WriteTimeout, 0),
		PoolSize:              o.PoolSize,
		DisableIdentity:       o.DisableIdentity,
		DisableIndentity:      o.DisableIndentity, //nolint:staticcheck // deprecated, still honoured by go-redis
		IdentitySuffix:        o.IdentitySuffix,
		UnstableResp3:         o.UnstableResp3,
		ContextTimeoutEnabled: true,
		MaxRetries:            -1,
	})
	if lim.own == nil {
		lim.own = map[string]*redis.Client{}
	}
	lim.own[addr] = c
	return c
}

// override returns the address that key's slot should be routed to
// instead of addr, go-redis's choice, or "" if none: the master the
// limiter's own layout names, when go-redis's node is not usable (its
// breaker is not closed, its last call failed, or it was forgotten) and
// the layout differs.
func (lim *Limiter) override(key, addr string) string {
	l := lim.layout.Load()
	if l == nil {
		return ""
	}
	own := l.at(remote.Slot(key))
	if own == "" || own == addr {
		return ""
	}
	if nd := (*lim.nodes.Load())[addr]; nd != nil && nd.cb.State() == breaker.StateClosed && !nd.failing.Load() {
		return ""
	}
	return own
}

// An instance that made no call to a Cluster node while its master hung
// and its replica took over (a quiet key, a pod idle through the night)
// learns nothing of the takeover: no call failed, no breaker opened, and
// go-redis, which reloads its layout only now and then and from one node
// at a time, still routes the node's keys to the old master. Its next
// call there would wait its whole budget, and the decision go local, on
// every such instance. So a call to a node that has not answered for
// quietFor is watched: if it is not answered within watchAfter of its
// budget, the other nodes are asked for the layout, and if they name
// another master for the key's slot, the call is abandoned and goes to
// that master within what is left of the budget. Calls to nodes that
// answer often are not watched: their failures open the breaker, and the
// prober follows the layout. A slow answer of a quiet node costs one
// reading of the layout, at most one at a time per Limiter. Nothing is
// watched during the first contact (warmedUp): the first calls of a pod
// that has just started are slow for their own reasons (dials, scripts to
// load).

// quietFor is how long a node must have been silent for its calls to be
// watched.
const quietFor = time.Second

// watchAfter is the part of its budget a watched call waits before the
// layout is read: long enough that a healthy node's slow answer rarely
// costs a reading, short enough that a reading, one round trip to the
// nodes that answer, fits in the rest.
const watchAfter = 4 // a quarter

// heard records that nd answered at now.
func (nd *node) heard(now time.Time) {
	t := now.UnixNano()
	if t-nd.answered.Load() > int64(quietFor/10) {
		nd.answered.Store(t)
	}
}

// watcher watches one call; see watch.
type watcher struct {
	state atomic.Uint32 // watchPending, watchEnded or watchMoved
	timer *time.Timer
	since time.Time // when the call was sent: only a reading begun since counts
}

const (
	watchPending uint32 = iota
	watchEnded          // the call ended first
	watchMoved          // the slot moved: the call was abandoned
)

// moved ends the watch and reports whether the call was abandoned because
// its key's slot moved.
func (w *watcher) moved() bool {
	w.timer.Stop()
	return !w.state.CompareAndSwap(watchPending, watchEnded) && w.state.Load() == watchMoved
}

// quiet reports whether a call to nd is to be watched: nd answered
// nothing for quietFor, and the first contact is over.
func (lim *Limiter) quiet(nd *node) bool {
	return lim.cfg.now().UnixNano()-nd.answered.Load() >= int64(quietFor) && lim.warmedUp()
}

// watch watches a call of key to nd, a quiet node, whose budget is budget
// and whose context abandon cancels.
//
// Watched calls share one reading at a time: a call whose watch comes
// while another's reading is under way waits for it, and judges its own
// slot by the layout it leaves, if it began after the call was sent.
func (lim *Limiter) watch(nd *node, key string, budget time.Duration, abandon context.CancelFunc) *watcher {
	w := &watcher{since: time.Now()}
	w.timer = time.AfterFunc(budget/watchAfter, func() {
		if w.state.Load() != watchPending || !lim.enter() {
			return
		}
		defer lim.wg.Done()
		ctx, cancel := context.WithTimeout(lim.ctx, budget-budget/watchAfter)
		defer cancel()
		slot := remote.Slot(key)
		lim.mu.Lock()
		rd, mine := lim.watchRead, false
		if rd == nil {
			rd, mine = make(chan struct{}), true
			lim.watchRead = rd
		}
		lim.mu.Unlock()
		if mine {
			if l := lim.readLayout(ctx, nd.addr, slot); l != nil {
				lim.keepLayout(l)
			}
			lim.mu.Lock()
			lim.watchRead = nil
			lim.mu.Unlock()
			close(rd)
		} else {
			select {
			case <-rd:
			case <-ctx.Done():
				return
			}
		}
		l := lim.layout.Load()
		if l == nil || l.began.Before(w.since) {
			return
		}
		owner := l.at(slot)
		if owner == "" || owner == nd.addr || !w.state.CompareAndSwap(watchPending, watchMoved) {
			return
		}
		lim.cfg.Logger.Info("hybridlimit: a quiet node's slot has another master: the call goes there",
			"limiter", lim.cfg.Name, "node", nd.addr, "master", owner)
		nd.failing.Store(true) // its keys follow the layout read (override)
		abandon()
		if !slices.Contains(l.addrs, nd.addr) {
			lim.forget(nd)
		}
	})
	return w
}
