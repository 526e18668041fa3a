package hybridlimit

import (
	"context"
	"flag"
	"fmt"
	"math"
	"math/rand/v2"
	"net"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/hybridlimit/hybridlimit/internal/simnet"
	"github.com/hybridlimit/hybridlimit/internal/simredis"
	"github.com/hybridlimit/hybridlimit/remote"
)

// A quarter of the seeds (-sim.cluster) run the fleet against a Redis Cluster
// (simredis.Cluster): three shards of a master and a replica, every
// instance with a go-redis ClusterClient of default options dialing each
// node over a link of its own. Every key of the traffic lives on one shard,
// the keys' shard; the fleet's heartbeat key on another. The Cluster's
// faults replace the single node's: a master that hangs and whose replica
// takes over (with the data that had reached it, a lag behind, under its
// own clock), the old master staying down or coming back as a replica; a
// master lost for good, with no replica to take over; a shard's
// connections reset. A fault of the keys' shard is a fault of every
// instance for the single-node invariants (a takeover is also a data loss:
// the replica may lack the last writes); a fault of another shard must
// leave the decisions on Redis. The failover invariant adds the bounds of
// docs/design.md for what follows a takeover.

// simClusterShare is the share of seeds that are Cluster runs. Which seeds
// they are is drawn from a stream of the seed's own, so the others draw the
// same single-node schedule whatever the share.
var simClusterShare = flag.Float64("sim.cluster", 0.25, "simulator: share of the seeds run against a Redis Cluster (0: none, 1: all)")

// clusterPlan is what a Cluster run draws.
type clusterPlan struct {
	Shards     int
	KeyShard   int             // the shard of every traffic key
	FleetShard int             // the shard of the heartbeat key
	Lag        time.Duration   // how far every replica trails its master
	Skew       []time.Duration // each replica's clock, against the masters'
	Events     []clusterEvent
}

// clusterEvent is one fault of a Cluster run.
type clusterEvent struct {
	At    time.Duration
	Kind  string // failover, lost, reset
	Shard int
	After time.Duration // failover: from the hang to the takeover
	Back  time.Duration // failover: from the takeover to the old master's return as a replica; 0: never
}

func (e clusterEvent) String() string {
	switch e.Kind {
	case "failover":
		back := "stays down"
		if e.Back > 0 {
			back = fmt.Sprintf("back as a replica %v later", e.Back)
		}
		return fmt.Sprintf("%v failover of shard %d: its master hangs, its replica takes over %v later, the old master %s", e.At, e.Shard, e.After, back)
	case "lost":
		return fmt.Sprintf("%v shard %d lost for good", e.At, e.Shard)
	}
	return fmt.Sprintf("%v %s shard %d", e.At, e.Kind, e.Shard)
}

func (p *clusterPlan) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "  Cluster of %d shards: keys on shard %d, heartbeats on shard %d, replica lag %v, replica clocks %v\n",
		p.Shards, p.KeyShard, p.FleetShard, p.Lag, p.Skew)
	for _, e := range p.Events {
		fmt.Fprintf(&b, "  %v\n", e)
	}
	return b.String()
}

func (p *clusterPlan) features() []string {
	f := []string{"cluster"}
	for _, e := range p.Events {
		where := "other"
		switch e.Shard {
		case p.KeyShard:
			where = "keys"
		case p.FleetShard:
			where = "fleet"
		}
		f = append(f, "cluster-"+e.Kind+"-"+where)
	}
	return f
}

// failoverRemote bounds how long after a takeover of the keys' shard every
// instance decides on Redis again (docs/design.md).
const failoverRemote = 5 * time.Second

// drawCluster draws, from a stream of its own (the other draws of a seed
// stay as they were), whether s is a Cluster run, and if so its Cluster
// and faults; it lengthens s so that the failover's bounds are checked.
func drawCluster(seed uint64, s *schedule) *clusterPlan {
	r := rand.New(rand.NewPCG(seed, 0xc105))
	if r.Float64() >= *simClusterShare {
		return nil
	}
	dur := func(lo, hi time.Duration) time.Duration {
		return lo + time.Duration(r.Int64N(int64(hi-lo)/int64(time.Millisecond)+1))*time.Millisecond
	}
	p := &clusterPlan{Shards: 3, KeyShard: r.IntN(3)}
	p.FleetShard = (p.KeyShard + 1 + r.IntN(2)) % 3
	p.Lag = []time.Duration{0, time.Millisecond, 10 * time.Millisecond, 100 * time.Millisecond}[r.IntN(4)]
	for range p.Shards {
		skew := time.Duration(0)
		if r.IntN(2) == 0 {
			skew = time.Duration(r.Int64N(2001)-1000) * time.Millisecond
		}
		p.Skew = append(p.Skew, skew)
	}
	used := map[int]bool{}
	for range 1 + r.IntN(2) {
		e := clusterEvent{At: dur(300*time.Millisecond, s.Duration-time.Second)}
		switch x := r.IntN(10); {
		case x < 6:
			e.Shard = p.KeyShard
		case x < 8:
			e.Shard = p.FleetShard
		default:
			e.Shard = 3 - p.KeyShard - p.FleetShard
		}
		if used[e.Shard] {
			continue // one fault per shard
		}
		used[e.Shard] = true
		switch x := r.IntN(4); {
		case x < 2:
			e.Kind, e.After = "failover", dur(200*time.Millisecond, 2500*time.Millisecond)
			if r.IntN(2) == 0 {
				e.Back = dur(100*time.Millisecond, 2*time.Second)
			}
			// Long enough to see the bounds that follow a takeover.
			s.Duration = max(s.Duration, e.At+e.After+failoverRemote+time.Second)
		case x < 3:
			e.Kind = "lost"
		default:
			e.Kind = "reset"
		}
		p.Events = append(p.Events, e)
	}
	sort.SliceStable(p.Events, func(i, j int) bool { return p.Events[i].At < p.Events[j].At })
	return p
}

// owner returns the shard of each slot: the traffic keys' slots to
// KeyShard, the heartbeat key's to FleetShard, the others by thirds.
func (p *clusterPlan) owner(keys int) func(slot int) int {
	own := map[int]int{remote.Slot(DefaultPrefix + "{hybridlimit-fleet:" + DefaultName + "}"): p.FleetShard}
	for k := range keys {
		own[remote.Slot(fmt.Sprintf("%sk%d", DefaultPrefix, k))] = p.KeyShard
	}
	return func(slot int) int {
		if s, ok := own[slot]; ok {
			return s
		}
		return slot * p.Shards / remote.Slots
	}
}

// simCluster is a Cluster run's state.
type simCluster struct {
	cl    *simredis.Cluster
	links [][]*simnet.Link // by slot, then node
}

// level is Server.Level on the node that holds key now.
func (r *simRun) level(key string, q, p, capacity int64) int64 {
	if r.cluster != nil {
		return r.cluster.cl.Level(key, q, p, capacity)
	}
	return r.srv.Level(key, q, p, capacity)
}

// planCluster adds the faults of the keys' shard to every slot's
// intervals: a failover cuts every instance off from the hang to the
// takeover, and loses data (the replica may lack the last writes); a
// shard lost for good cuts them off to the end; a reset disturbs them.
func (r *simRun) planCluster() {
	p := r.s.Cluster
	for _, e := range p.Events {
		if e.Shard != p.KeyShard {
			continue
		}
		var iv interval
		switch e.Kind {
		case "failover":
			iv = interval{e.At, e.At + e.After}
		case "lost":
			// Until the run's end, where every link heals while the
			// decisions in flight finish.
			iv = interval{e.At, r.s.Duration}
		case "reset":
			for i := range r.s.Slots {
				r.disturb[i] = append(r.disturb[i], interval{e.At, e.At + time.Millisecond})
			}
			continue
		}
		for i := range r.s.Slots {
			r.cut[i] = append(r.cut[i], iv)
			r.disturb[i] = append(r.disturb[i], iv)
		}
		r.killed = append(r.killed, iv)
	}
}

// runCluster is run against a Cluster.
func (r *simRun) runCluster() {
	s, p := r.s, r.s.Cluster
	r.plan()
	r.planCluster()
	cl := simredis.NewCluster(p.Shards, p.owner(s.Keys))
	sc := &simCluster{cl: cl}
	r.cluster = sc
	for sh := range p.Shards {
		cl.SetLag(sh, p.Lag)
		cl.Nodes[p.Shards+sh].SetSkew(p.Skew[sh])
	}
	r.answered = map[answeredKey][]time.Duration{}
	r.heard = map[int][]time.Duration{}
	cl.SetHooks(r.scriptRan, r.heartbeatRan)
	sc.links = make([][]*simnet.Link, s.Slots)
	for i := range sc.links {
		for range cl.Nodes {
			sc.links[i] = append(sc.links[i], simnet.NewLink())
		}
	}
	// every link to node n
	each := func(n int, f func(*simnet.Link)) {
		for i := range sc.links {
			f(sc.links[i][n])
		}
	}
	insts := make([]*instance, s.Slots)
	clients := make([]*redis.ClusterClient, s.Slots)
	var bg sync.WaitGroup
	ctx, cancelAll := context.WithCancel(context.Background())
	dial := func(i int) {
		client := redis.NewClusterClient(&redis.ClusterOptions{
			Addrs:          cl.Addrs(),
			ReadBufferSize: simBuffer, WriteBufferSize: simBuffer, PipelineReadBufferSize: simBuffer, PipelineWriteBufferSize: simBuffer,
			ContextTimeoutEnabled:    s.CtxTimeout,
			PoolSize:                 s.Pool,
			MaintNotificationsConfig: simMaint(),
			Dialer: func(ctx context.Context, network, addr string) (net.Conn, error) {
				defer r.dialing(i)()
				time.Sleep(s.DialDelay)
				c, err := cl.Dialer(sc.links[i], i)(ctx, network, addr)
				if err != nil || !s.TLS {
					return c, err
				}
				return struct{ net.Conn }{c}, nil // no SyscallConn, as a tls.Conn
			},
		})
		clients[i] = client
		// go-redis's ClusterClient reads COMMAND once, from a random node,
		// under a mutex and with no deadline of the caller, the first time
		// a command goes through it unpipelined (a heartbeat). Were that
		// node hung, the goroutines waiting for the mutex would not be
		// durably blocked, and the bubble's clock would stop for good
		// (in real time they wait the client's read time-outs). So the
		// table is read now, before any fault, and before the run's
		// clock starts: a Ping that dials (DialDelay) takes virtual time,
		// which would otherwise delay every event of the schedule past
		// its At, while the checks cut the decisions at At.
		_ = client.Ping(ctx).Err()
	}
	for i := range s.Instances {
		dial(i)
	}
	r.mu.Lock() // the clients' own goroutines may dial (dialing reads t0)
	r.t0 = time.Now()
	r.mu.Unlock()
	for i := range s.Instances {
		insts[i] = r.startInstance(ctx, i, clients[i])
	}
	later := func(d time.Duration, f func()) {
		bg.Go(func() {
			time.Sleep(d)
			f()
		})
	}
	for _, e := range p.Events {
		r.until(e.At, e.Kind)
		master := cl.Master(e.Shard)
		switch e.Kind {
		case "failover":
			cl.Stop(e.Shard)
			each(master, (*simnet.Link).Hang)
			later(e.After, func() {
				if err := cl.Takeover(e.Shard); err != nil {
					panic(err)
				}
			})
			if e.Back > 0 {
				later(e.After+e.Back, func() {
					cl.Rejoin(e.Shard)
					each(master, (*simnet.Link).Resume)
				})
			}
		case "lost":
			cl.Stop(e.Shard)
			each(master, func(l *simnet.Link) {
				l.Refuse(true)
				l.Reset()
			})
		case "reset":
			each(master, (*simnet.Link).Reset)
		}
	}
	if d := s.Duration - r.since(); d > 0 {
		time.Sleep(d)
	}
	cancelAll()
	bg.Wait()
	for n := range cl.Nodes {
		each(n, func(l *simnet.Link) {
			l.Resume()
			l.Refuse(false)
		})
	}
	for i, in := range insts {
		if in != nil {
			in.wg.Wait()
			in.lim.Close()
			clients[i].Close()
		}
	}
	cl.Close()
	// go-redis's dial retries, read time-outs and layout reloads may
	// still be sleeping: give them time to end.
	time.Sleep(30 * time.Second)
}

// checkFailover checks the bounds that follow a takeover of the keys'
// shard (docs/design.md): from failoverRemote after the takeover, every
// decision is ModeRemote, and every key admits in any window [a, a+1 s)
// at most the bucket's Rate×W + Burst, with no outage allowance.
func (r *simRun) checkFailover(add func(string, string, ...any)) {
	p := r.s.Cluster
	if p == nil {
		return
	}
	for _, e := range p.Events {
		if e.Kind != "failover" || e.Shard != p.KeyShard {
			continue
		}
		from := e.At + e.After + failoverRemote
		late := map[int]bool{}
		for _, rec := range r.recs {
			if rec.wait || rec.err != nil || rec.start < from || rec.mode == ModeRemote || rec.mode == ModeLease || late[rec.inst] {
				continue
			}
			if r.dialed(rec) {
				// It waited for a new connection whose dial takes time
				// (DialDelay): a quiet instance's first call after the
				// takeover needs two, the layout's node and the new
				// master, and times out when its budget is shorter (see
				// recovery).
				continue
			}
			late[rec.inst] = true
			add("failover", "instance %d AllowN(%s) at %v decided %v; the replica took over at %v",
				rec.inst, rec.key, rec.start, rec.mode, e.At+e.After)
		}
		var rmax float64
		var bmax int64
		for _, l := range r.limits {
			rmax, bmax = math.Max(rmax, l.l.Rate), max(bmax, l.l.Burst)
		}
		for k := range r.s.Keys {
			key := fmt.Sprintf("k%d", k)
			adm := r.admissions(key)
			for j, x := range adm {
				if x.at < from {
					continue
				}
				var got int64
				for _, y := range adm[j:] {
					if y.at >= x.at+time.Second {
						break
					}
					got += y.n
				}
				if bound := rmax + float64(bmax); float64(got) > bound+1e-9 {
					add("failover", "key %s admitted %d in [%v, %v), %v after the takeover; bound %.1f (the bucket, no allowance)",
						key, got, x.at, x.at+time.Second, x.at-(e.At+e.After), bound)
					break
				}
			}
		}
	}
}
