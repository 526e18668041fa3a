package simredis

import (
	"context"
	"fmt"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hybridlimit/hybridlimit/internal/simnet"
	"github.com/hybridlimit/hybridlimit/remote"
)

// Cluster is a Redis Cluster of Servers: shards of one master and one
// replica each, the slots split among the shards. Every node answers
// CLUSTER SLOTS with the current layout and MOVED for a key whose slot its
// shard's master is not, as go-redis's ClusterClient expects.
//
// A replica holds no data of its own until it takes over: the Cluster logs
// the master's writes, and Takeover gives the replica what had reached it,
// those written at least the shard's lag before the master stopped
// (asynchronous replication: what the master wrote in its last moments is
// lost). Each node has its own clock (Server.SetSkew): the buckets the
// replica inherits were stamped by the master's clock, and key expiry is
// absolute, as Redis 7 replicates it.
//
// The layout changes at once on every node that answers: the news of a
// failover spreads through the Cluster's gossip in a moment, which the
// model leaves out. A master that hangs and resumes after its replica took
// over knows it is a replica from the start: the commands it had buffered
// get MOVED rather than running on its stale data.
type Cluster struct {
	Nodes []*Node // shard i's master is Nodes[i] at the start, its replica Nodes[shards+i]

	layout     atomic.Pointer[clusterLayout]
	slotsReads []atomic.Int64 // of each node
	mu         sync.Mutex     // protects shards, and replaces layout
	shards     []*shard
}

// Node is one node of a Cluster.
type Node struct {
	*Server
	Addr string
	ID   string
}

// shard is a master, its replica, and the replication between them.
type shard struct {
	lag     time.Duration // how far the replica's copy trails the master's writes
	log     []logged      // the master's writes since it became master
	stopped time.Time     // when the master stopped replicating; zero while it does
}

type logged struct {
	at  time.Time
	key string
	v   *value // nil: deleted
}

// clusterLayout is who owns what, immutable once published.
type clusterLayout struct {
	owner       [remote.Slots]uint8 // shard of each slot
	master      []int               // node of each shard's master
	replica     []int               // node of each shard's replica, -1: none listed
	slotsReply  []any               // CLUSTER SLOTS
	slotsRESP   encoded             // slotsReply in RESP2
	takenOver   []bool              // the shard had its takeover
	replicaDown []bool
}

// ErrNoReplica is returned by Takeover for a shard whose replica already
// took over.
var ErrNoReplica = fmt.Errorf("simredis: the shard has no replica left to take over")

// NewCluster returns a Cluster of shards masters and as many replicas,
// each an empty Server; owner(slot) names the shard of each slot. Master i
// listens on 10.0.1.(i+1):6379, its replica on 10.0.2.(i+1):6379: IPs,
// so that go-redis looks nothing up.
func NewCluster(shards int, owner func(slot int) int) *Cluster {
	c := &Cluster{slotsReads: make([]atomic.Int64, 2*shards)}
	l := &clusterLayout{}
	for i := range 2 * shards {
		host := fmt.Sprintf("10.0.%d.%d", 1+i/shards, 1+i%shards)
		n := &Node{Server: New(), Addr: net.JoinHostPort(host, "6379"), ID: fmt.Sprintf("%040x", i+1)}
		c.Nodes = append(c.Nodes, n)
		idx := i
		n.moved = func(key string) string { return c.moved(idx, key) }
		n.clusterCmd = func(args []string) any { return c.command(idx, args) }
		n.wrote = func(key string, v *value) { c.wrote(idx, key, v) }
	}
	for i := range shards {
		c.shards = append(c.shards, &shard{})
		l.master = append(l.master, i)
		l.replica = append(l.replica, shards+i)
		l.takenOver = append(l.takenOver, false)
		l.replicaDown = append(l.replicaDown, false)
	}
	for s := range remote.Slots {
		l.owner[s] = uint8(owner(s))
	}
	c.publish(l)
	return c
}

// Addrs returns the masters' addresses, the seeds a client starts from.
func (c *Cluster) Addrs() []string {
	l := c.layout.Load()
	var out []string
	for _, m := range l.master {
		out = append(out, c.Nodes[m].Addr)
	}
	return out
}

// Node returns the node at addr, nil if none.
func (c *Cluster) Node(addr string) (*Node, int) {
	for i, n := range c.Nodes {
		if n.Addr == addr {
			return n, i
		}
	}
	return nil, -1
}

// ShardOf returns the shard that owns key's slot.
func (c *Cluster) ShardOf(key string) int { return int(c.layout.Load().owner[remote.Slot(key)]) }

// Master returns the node index of shard's master now.
func (c *Cluster) Master(shard int) int { return c.layout.Load().master[shard] }

// SetLag sets how far shard's replica trails its master.
func (c *Cluster) SetLag(shard int, d time.Duration) {
	c.mu.Lock()
	c.shards[shard].lag = d
	c.mu.Unlock()
}

// Stop marks shard's master as stopped now (hung or dead): nothing it
// does from now on reaches its replica. The caller cuts its network.
func (c *Cluster) Stop(shard int) {
	c.mu.Lock()
	if sh := c.shards[shard]; sh.stopped.IsZero() {
		sh.stopped = time.Now()
	}
	c.mu.Unlock()
}

// Takeover makes shard's replica its master, as CLUSTER FAILOVER TAKEOVER
// does: with the master's writes that had reached it (those at least the
// shard's lag before the master stopped, or before now), an empty script
// cache, and the slots; the old master is left out of the layout until
// Rejoin.
func (c *Cluster) Takeover(shard int) error {
	c.mu.Lock()
	old := c.layout.Load()
	if old.takenOver[shard] {
		c.mu.Unlock()
		return ErrNoReplica
	}
	sh := c.shards[shard]
	cut := time.Now()
	if !sh.stopped.IsZero() {
		cut = sh.stopped
	}
	cut = cut.Add(-sh.lag)
	data := map[string]*value{}
	for _, w := range sh.log {
		if w.at.After(cut) {
			break
		}
		if w.v == nil {
			delete(data, w.key)
		} else {
			data[w.key] = w.v
		}
	}
	sh.log, sh.stopped = nil, time.Time{}
	l := *old
	l.master = slices.Clone(old.master)
	l.replica = slices.Clone(old.replica)
	l.takenOver = slices.Clone(old.takenOver)
	l.replicaDown = slices.Clone(old.replicaDown)
	l.master[shard], l.replica[shard] = old.replica[shard], old.master[shard]
	l.takenOver[shard], l.replicaDown[shard] = true, true
	c.mu.Unlock()
	// The new master takes its data before any node names it (a node's
	// lock is never taken under c.mu: a node's command takes c.mu under
	// its own).
	n := c.Nodes[l.master[shard]]
	n.mu.Lock()
	n.data = data
	n.mu.Unlock()
	c.mu.Lock()
	c.publish(&l)
	c.mu.Unlock()
	return nil
}

// Rejoin brings shard's old master back as a replica of the new one, after
// Takeover: it resynchronises (its own data goes) and is listed again.
func (c *Cluster) Rejoin(shard int) {
	old := c.layout.Load()
	if !old.takenOver[shard] || !old.replicaDown[shard] {
		return
	}
	c.Nodes[old.replica[shard]].FlushAll()
	c.mu.Lock()
	defer c.mu.Unlock()
	l := *c.layout.Load()
	l.replicaDown = slices.Clone(l.replicaDown)
	l.replicaDown[shard] = false
	c.publish(&l)
}

// Level is Server.Level on the master that owns key now.
func (c *Cluster) Level(key string, q, p, capacity int64) int64 {
	l := c.layout.Load()
	return c.Nodes[l.master[l.owner[remote.Slot(key)]]].Level(key, q, p, capacity)
}

// SetHooks sets Hook and FleetHook on every node, before serving.
func (c *Cluster) SetHooks(hook func(tag int, key, marker string, argv []string, reply any), fleet func(tag int)) {
	for _, n := range c.Nodes {
		n.Hook, n.FleetHook = hook, fleet
	}
}

// Close closes every node.
func (c *Cluster) Close() {
	for _, n := range c.Nodes {
		n.Close()
	}
}

// publish stores l with its CLUSTER SLOTS reply. publish requires that
// c.mu is held, or that c is not yet shared; the layout changes only
// there, so Takeover and Rejoin, which read it before, must not run at
// once (the simulator's schedule runs them one after another).
func (c *Cluster) publish(l *clusterLayout) {
	l.slotsReply = nil
	node := func(i int) any {
		host, port, _ := net.SplitHostPort(c.Nodes[i].Addr)
		p, _ := strconv.ParseInt(port, 10, 64)
		return []any{host, p, c.Nodes[i].ID}
	}
	for start := 0; start < remote.Slots; {
		sh := int(l.owner[start])
		end := start
		for end+1 < remote.Slots && int(l.owner[end+1]) == sh {
			end++
		}
		rg := []any{int64(start), int64(end), node(l.master[sh])}
		if !l.replicaDown[sh] {
			rg = append(rg, node(l.replica[sh]))
		}
		l.slotsReply = append(l.slotsReply, rg)
		start = end + 1
	}
	l.slotsRESP = appendReply(nil, l.slotsReply)
	c.layout.Store(l)
}

// moved returns the MOVED error for key on node i, "" if i owns its slot.
func (c *Cluster) moved(i int, key string) string {
	l := c.layout.Load()
	slot := remote.Slot(key)
	if m := l.master[l.owner[slot]]; m != i {
		return fmt.Sprintf("MOVED %d %s", slot, c.Nodes[m].Addr)
	}
	return ""
}

// SlotsReads returns how many CLUSTER SLOTS node i has answered.
func (c *Cluster) SlotsReads(i int) int64 { return c.slotsReads[i].Load() }

// command answers CLUSTER for node i.
func (c *Cluster) command(i int, args []string) any {
	if len(args) >= 2 && strings.EqualFold(args[1], "SLOTS") {
		c.slotsReads[i].Add(1)
		return c.layout.Load().slotsRESP
	}
	return rerror("ERR simredis: unknown CLUSTER subcommand")
}

// wrote logs a write of node i, if it is a master that still replicates.
func (c *Cluster) wrote(i int, key string, v *value) {
	l := c.layout.Load()
	c.mu.Lock()
	defer c.mu.Unlock()
	for s, m := range l.master {
		if m == i && c.shards[s].stopped.IsZero() {
			c.shards[s].log = append(c.shards[s].log, logged{time.Now(), key, v.clone()})
		}
	}
}

func (v *value) clone() *value {
	if v == nil {
		return nil
	}
	w := *v
	w.s = slices.Clone(v.s)
	w.fields = slices.Clone(v.fields)
	return &w
}

// redirect returns the MOVED error for a keyed command, named name in
// upper case, on a node that does not own its key's slot, "" otherwise.
// redirect requires that s.mu is held.
func (s *Server) redirect(name string, args []string) string {
	if s.moved == nil || len(args) < 2 {
		return ""
	}
	switch name {
	case "GET", "DEL", "PTTL":
		return s.moved(args[1])
	case "EVAL", "EVALSHA":
		if len(args) >= 4 && args[2] != "0" {
			return s.moved(args[3])
		}
	}
	return ""
}

// replicate logs key's value for the replica, on a Cluster's master.
// replicate requires that s.mu is held.
func (s *Server) replicate(key string) {
	if s.wrote != nil {
		s.wrote(key, s.data[key])
	}
}

// Dialer returns a go-redis dialer (ClusterOptions.Dialer) to c's nodes
// over links, one per node (links[i] reaches c.Nodes[i]); the nodes serve
// each connection as tag's (see Server.Serve).
func (c *Cluster) Dialer(links []*simnet.Link, tag int) func(context.Context, string, string) (net.Conn, error) {
	return func(_ context.Context, _, addr string) (net.Conn, error) {
		n, i := c.Node(addr)
		if n == nil {
			return nil, &net.OpError{Op: "dial", Net: "sim", Err: net.UnknownNetworkError(addr)}
		}
		return links[i].Dial(func(conn net.Conn) { n.Serve(conn, tag) })
	}
}

// MoveSlot gives slot to shard, with the keys of slot its old master
// holds, as a finished migration (MIGRATE, then CLUSTER SETSLOT NODE)
// leaves it: every node answers MOVED for it from then on.
func (c *Cluster) MoveSlot(slot, shard int) {
	l := c.layout.Load()
	from, to := c.Nodes[l.master[l.owner[slot]]], c.Nodes[l.master[shard]]
	moved := map[string]*value{}
	from.mu.Lock()
	for k, v := range from.data {
		if remote.Slot(k) == slot {
			moved[k] = v
			delete(from.data, k)
		}
	}
	from.mu.Unlock()
	to.mu.Lock()
	for k, v := range moved {
		to.data[k] = v
	}
	to.mu.Unlock()
	c.mu.Lock()
	defer c.mu.Unlock()
	nl := *c.layout.Load()
	nl.owner[slot] = uint8(shard)
	c.publish(&nl)
}
