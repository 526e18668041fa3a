package hybridlimit

import (
	"context"
	"slices"
	"sync"
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
// open the limiter reads the layout itself, from every node at once through
// clients of its own that stop at their deadline, and routes a key whose
// node is not closed to the master its own layout names, through a client
// of its own, until go-redis agrees.

// layout is the Cluster's slot layout as the limiter last read it.
type layout struct {
	owner [remote.Slots]uint16 // index into addrs, +1; 0: nobody
	addrs []string
	nodes []string // every node the answers named, replicas included
}

// at returns the master of slot, "" if the layout names none.
func (l *layout) at(slot int) string {
	if i := l.owner[slot]; i > 0 {
		return l.addrs[i-1]
	}
	return ""
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
			if l := lim.readLayout(); l != nil {
				lim.layout.Store(l)
			}
		})
	}
}

// failedLayoutEvery bounds the layout reads that failed calls start: a read
// asks every node at once, and a latency spike that fails calls on every
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
	lim.mu.Lock()
	defer lim.mu.Unlock()
	if !lim.closed.Load() {
		lim.startReading()
	}
}

// readLayout asks every node it knows of (the client's seeds, the nodes
// and the last layout read) for CLUSTER SLOTS at once, and returns the
// layout they give, nil if none answered within layoutTimeout.
func (lim *Limiter) readLayout() *layout {
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
	// A node that does not answer (the master that hangs) is waited for
	// at most layoutTimeout; the others answer in a round trip.
	failing := map[string]bool{}
	for a, nd := range *lim.nodes.Load() {
		failing[a] = nd.cb.State() != breaker.StateClosed
	}
	ctx, cancel := context.WithTimeout(lim.ctx, layoutTimeout)
	defer cancel()
	type reply struct {
		addr  string
		slots []redis.ClusterSlot
	}
	got := make(chan reply, len(addrs))
	var wg sync.WaitGroup
	waiting := 0
	for _, a := range addrs {
		c := lim.ownClient(a)
		if c == nil {
			continue
		}
		if !failing[a] {
			waiting++
		}
		wg.Go(func() {
			slots, err := c.ClusterSlots(ctx).Result()
			if err != nil {
				slots = nil
			}
			got <- reply{a, slots}
		})
	}
	// Nodes can disagree for a moment after a failover, while the news
	// spreads: for each slot the owner is taken from the first answer that
	// names one that is not failing here.
	l := &layout{}
	index := map[string]uint16{}
	answered := false
	for pending := len(addrs); pending > 0 && waiting > 0; pending-- {
		var r reply
		select {
		case r = <-got:
		case <-ctx.Done():
			pending = 0
			continue
		}
		if !failing[r.addr] {
			waiting--
		}
		for _, rg := range r.slots {
			if len(rg.Nodes) == 0 {
				continue
			}
			for _, n := range rg.Nodes {
				if !slices.Contains(l.nodes, n.Addr) {
					l.nodes = append(l.nodes, n.Addr)
				}
			}
			a := rg.Nodes[0].Addr
			i, ok := index[a]
			if !ok {
				l.addrs = append(l.addrs, a)
				i = uint16(len(l.addrs))
				index[a] = i
			}
			for s := max(rg.Start, 0); s <= rg.End && s < remote.Slots; s++ {
				if cur := l.owner[s]; cur == 0 || failing[l.addrs[cur-1]] && !failing[a] {
					l.owner[s] = i
				}
			}
			answered = true
		}
	}
	cancel()
	wg.Wait() // the clients stop at ctx's end: nothing outlives the reading
	if !answered {
		return nil
	}
	return l
}

// ownClient returns the limiter's own client of the node at addr, made
// from the Cluster client's options but bounded by the context's deadline
// and never retrying, so that a node that hangs costs a reading or a
// decision its budget, not the client's ReadTimeout. Close closes them.
// It returns nil once the limiter is closed.
func (lim *Limiter) ownClient(addr string) *redis.Client {
	lim.mu.Lock()
	defer lim.mu.Unlock()
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
		ReadTimeout:                  o.ReadTimeout,
		WriteTimeout:                 o.WriteTimeout,
		PoolSize:                     o.PoolSize,
		DisableIdentity:              o.DisableIdentity,
		ContextTimeoutEnabled:        true,
		MaxRetries:                   -1,
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
