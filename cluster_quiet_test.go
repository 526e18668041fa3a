package hybridlimit

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/hybridlimit/hybridlimit/breaker"
	"github.com/hybridlimit/hybridlimit/internal/simnet"
	"github.com/hybridlimit/hybridlimit/internal/simredis"
	"github.com/hybridlimit/hybridlimit/remote"
)

// clientKinds runs f in a synctest bubble of its own for each kind of
// client these tests give the Limiter: go-redis's default options, whose
// reads wait out ReadTimeout whatever the caller's deadline, so that the
// limiter sends each call from a goroutine of its own; and
// ContextTimeoutEnabled, whose reads stop at the caller's deadline, so
// that a call alone on an idle pipe runs on its caller's goroutine.
func clientKinds(t *testing.T, f func(t *testing.T, ctxTimeout bool)) {
	for _, ctxTimeout := range []bool{false, true} {
		t.Run(map[bool]string{false: "default", true: "ContextTimeoutEnabled"}[ctxTimeout], func(t *testing.T) {
			bubble(t, func(t *testing.T) { f(t, ctxTimeout) })
		})
	}
}

// onSimCluster starts, in the calling synctest bubble, a simulated Cluster
// of three shards whose nodes each sit behind a link of their own, and a
// Limiter of cfg on a ClusterClient of default options but for
// ContextTimeoutEnabled, which is ctxTimeout; t.Cleanup closes them, then
// waits out go-redis's dial back-offs and layout reloads.
func onSimCluster(t *testing.T, cfg Config, ctxTimeout bool) (*simredis.Cluster, []*simnet.Link, *Limiter) {
	return onSimClusterWith(t, cfg, ctxTimeout, nil)
}

// onSimClusterWith is onSimCluster, calling before (if not nil) with the
// Cluster client before its first command.
func onSimClusterWith(t *testing.T, cfg Config, ctxTimeout bool, before func(*redis.ClusterClient)) (*simredis.Cluster, []*simnet.Link, *Limiter) {
	return onSimClusterOpts(t, cfg, ctxTimeout, nil, before)
}

// onSimClusterOpts is onSimClusterWith, calling opts (if not nil) with the
// Cluster client's options (every node of the Cluster as its seeds) before
// the client is made.
func onSimClusterOpts(t *testing.T, cfg Config, ctxTimeout bool, opts func(*simredis.Cluster, *redis.ClusterOptions), before func(*redis.ClusterClient)) (*simredis.Cluster, []*simnet.Link, *Limiter) {
	return onSimClusterOf(t, 3, cfg, ctxTimeout, opts, before)
}

// onSimClusterOf is onSimClusterOpts with a Cluster of shards shards, the
// slots split evenly among them.
func onSimClusterOf(t *testing.T, shards int, cfg Config, ctxTimeout bool, opts func(*simredis.Cluster, *redis.ClusterOptions), before func(*redis.ClusterClient)) (*simredis.Cluster, []*simnet.Link, *Limiter) {
	t.Cleanup(func() { time.Sleep(30 * time.Second) }) // last
	cl := simredis.NewCluster(shards, func(slot int) int { return slot * shards / remote.Slots })
	t.Cleanup(cl.Close)
	links := make([]*simnet.Link, len(cl.Nodes))
	for i := range links {
		links[i] = simnet.NewLink()
	}
	o := &redis.ClusterOptions{Addrs: cl.Addrs(), Dialer: cl.Dialer(links, 0), ContextTimeoutEnabled: ctxTimeout}
	if opts != nil {
		opts(cl, o)
	}
	client := redis.NewClusterClient(o)
	t.Cleanup(func() { client.Close() })
	if before != nil {
		before(client)
	}
	// go-redis reads COMMAND once, under a mutex, from a random node:
	// now, before that node can hang (see sim_cluster_test.go).
	_ = client.Ping(context.Background()).Err()
	cfg.Redis = client
	lim, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { lim.Close() })
	return cl, links, lim
}

// hangMaster makes shard's master hang, as a SIGSTOPped process does,
// until the test ends; its replica has what reached it (simredis.Cluster).
func hangMaster(t *testing.T, cl *simredis.Cluster, links []*simnet.Link, shard int) {
	master := cl.Master(shard)
	cl.Stop(shard)
	links[master].Hang()
	t.Cleanup(links[master].Resume)
}

// TestQuietFailover: an instance that decides on a key every two seconds
// meets a failover of the key's master. Its calls to the hung master are
// too few to open the breaker, so the prober never reads the layout; the
// limiter must still learn from the failed calls that the slots moved,
// and decide on the new master, rather than wait its budget on the hung
// one and fall to the local share until Failures decisions have failed.
// Simulated Cluster (internal/simredis) at virtual time.
func TestQuietFailover(t *testing.T) {
	clientKinds(t, func(t *testing.T, ctxTimeout bool) {
		cl, links, lim := onSimCluster(t, Config{Limit: PerSecond(10), Timeout: 50 * time.Millisecond}, ctxTimeout)
		ctx := context.Background()
		const key = "k"
		shard := cl.ShardOf(DefaultPrefix + key)
		master := cl.Master(shard)
		start := time.Now()
		var modes []Mode
		for at := time.Second; at <= 11*time.Second; at += 2 * time.Second {
			time.Sleep(time.Until(start.Add(at)))
			switch at {
			case 3 * time.Second:
				cl.Stop(shard)
				links[master].Hang()
				time.AfterFunc(time.Second, func() {
					if err := cl.Takeover(shard); err != nil {
						t.Error(err)
					}
				})
			}
			d, err := lim.Allow(ctx, key)
			if err != nil {
				t.Fatalf("Allow at %v: %v", at, err)
			}
			modes = append(modes, d.Mode)
		}
		links[master].Resume()
		// Decisions at 1, 3, 5, 7, 9, 11 s; the master hangs at 3 s and
		// its replica takes over at 4 s. The one at 3 s waits its budget;
		// the one at 5 s goes to the hung master, whose slots the layout
		// read after the first failure did not move yet, but is watched
		// (the node is quiet): the layout read when it is late names the
		// new master, which decides it.
		want := []Mode{ModeRemote, ModeLocal, ModeRemote, ModeRemote, ModeRemote, ModeRemote}
		for i, m := range modes {
			if i >= 2 && m != want[i] {
				t.Errorf("decision at %ds: %v; want %v (the replica took over at 4 s). All: %v", 1+2*i, m, want[i], modes)
				break
			}
		}
		if modes[0] != ModeRemote {
			t.Errorf("decision at 1 s, before any fault: %v; want remote", modes[0])
		}
	})
}

// TestUnseenFailover: an instance decides once, then nothing while the
// key's master hangs and its replica takes over. Its next decision finds
// go-redis still routing the key to the hung master and no call of its
// own that failed there; it must still be decided by the new master
// within its budget (the call is watched: the layout is read from the
// other nodes once the call is late, and the call goes to the master they
// name), and the old master's node be forgotten. With spent set, the
// instance also spent locally before the takeover: the new master is
// charged with it first, within the same budget, and the decision is
// still Redis's.
func TestUnseenFailover(t *testing.T) {
	for _, spent := range []bool{false, true} {
		t.Run(map[bool]string{false: "quiet", true: "spent"}[spent], func(t *testing.T) {
			clientKinds(t, func(t *testing.T, ctxTimeout bool) { unseenFailover(t, spent, ctxTimeout) })
		})
	}
}

func unseenFailover(t *testing.T, spent, ctxTimeout bool) {
	const timeout = 50 * time.Millisecond
	// A token a second: the local grants are not refilled in the 0.1 s
	// they take, nor is what they took from Redis's bucket.
	cl, links, lim := onSimCluster(t, Config{Limit: Limit{Rate: 1, Burst: 10}, Timeout: timeout, Heartbeat: -1, Instances: 1}, ctxTimeout)
	ctx := context.Background()
	const key = "k"
	shard := cl.ShardOf(DefaultPrefix + key)
	master := cl.Master(shard)
	oldAddr := cl.Nodes[master].Addr
	time.Sleep(time.Second)
	if d, err := lim.Allow(ctx, key); err != nil || d.Mode != ModeRemote {
		t.Fatalf("before the fault: %+v, %v; want a remote decision", d, err)
	}
	time.Sleep(time.Second)
	hangMaster(t, cl, links, shard)
	var local int
	if spent {
		// Calls that fail fall back to the local share, which grants.
		for range 2 {
			d, err := lim.Allow(ctx, key)
			if err != nil || d.Mode != ModeLocal || !d.Allowed {
				t.Fatalf("on the hung master: %+v, %v; want a local grant", d, err)
			}
			local++
		}
	}
	time.Sleep(500 * time.Millisecond)
	if err := cl.Takeover(shard); err != nil {
		t.Fatal(err)
	}
	time.Sleep(1500 * time.Millisecond)
	// Two callers at once, one with a deadline shorter than Timeout: the
	// first call watched finds the new master and forgets the old node,
	// whose pipe the other call waits in; that one must follow too.
	var wg sync.WaitGroup
	for _, dl := range []time.Duration{0, 30 * time.Millisecond} {
		wg.Go(func() {
			cctx := ctx
			if dl > 0 {
				var cancel context.CancelFunc
				cctx, cancel = context.WithTimeout(ctx, dl)
				defer cancel()
			}
			start := time.Now()
			d, err := lim.Allow(cctx, key)
			took := time.Since(start)
			if err != nil || d.Mode != ModeRemote {
				t.Errorf("decision (deadline %v) 1.5 s after a takeover this instance did not see: %+v, %v; want ModeRemote", dl, d, err)
			}
			budget := timeout
			if dl > 0 {
				budget = min(budget, dl*9/10)
			}
			if took > budget {
				t.Errorf("the decision (deadline %v) took %v; budget %v", dl, took, budget)
			}
		})
	}
	wg.Wait()
	if nd := (*lim.nodes.Load())[oldAddr]; nd != nil {
		t.Errorf("the old master %s, which owns no slots, is still a node", oldAddr)
	}
	// The new master's bucket: full again (9 after the decision at 1 s,
	// 3.5 s of refill since), less these two decisions and what was spent
	// locally.
	newMaster := cl.Nodes[cl.Master(shard)]
	rl, err := remote.NewLimit(1, 10)
	if err != nil {
		t.Fatal(err)
	}
	level := float64(newMaster.Level(DefaultPrefix+key, rl.Q, rl.P, rl.Burst*rl.P)) / float64(rl.P)
	if want := float64(10 - 2 - local); math.Abs(level-want) > 0.5 {
		t.Errorf("the new master's bucket holds %.2f tokens; want %v (two decisions and %d local grants charged)", level, want, local)
	}
}

// TestSettlingWaitBudget: a decision on a new master that is still being
// charged with this instance's local spending waits for the charge. A
// caller whose deadline is shorter than Timeout must still get the
// failure policy's decision within nine tenths of that deadline, not its
// context's error: Redis trouble (a slow new master) is never the caller's
// error.
func TestSettlingWaitBudget(t *testing.T) {
	clientKinds(t, func(t *testing.T, ctxTimeout bool) {
		const timeout = 50 * time.Millisecond
		cl, links, lim := onSimCluster(t, Config{Limit: Limit{Rate: 1, Burst: 10}, Timeout: timeout, Heartbeat: -1, Instances: 1}, ctxTimeout)
		ctx := context.Background()
		const key = "k"
		shard := cl.ShardOf(DefaultPrefix + key)
		time.Sleep(time.Second)
		if d, err := lim.Allow(ctx, key); err != nil || d.Mode != ModeRemote {
			t.Fatalf("before the fault: %+v, %v", d, err)
		}
		time.Sleep(time.Second)
		hangMaster(t, cl, links, shard)
		if d, err := lim.Allow(ctx, key); err != nil || d.Mode != ModeLocal || !d.Allowed {
			t.Fatalf("on the hung master: %+v, %v; want a local grant", d, err)
		}
		time.Sleep(500 * time.Millisecond)
		if err := cl.Takeover(shard); err != nil {
			t.Fatal(err)
		}
		// The new master answers slowly: charging it the local grant
		// takes up to Timeout (50 ms), longer than the callers' deadlines below.
		links[cl.Master(shard)].SetLatency(40 * time.Millisecond)
		time.Sleep(1500 * time.Millisecond)
		for i := range 3 {
			const dl = 20 * time.Millisecond
			cctx, cancel := context.WithTimeout(ctx, dl)
			start := time.Now()
			d, err := lim.Allow(cctx, key)
			took := time.Since(start)
			cancel()
			t.Logf("decision %d: mode %v, err %v, took %v", i, d.Mode, err, took)
			if err != nil {
				t.Errorf("decision %d (deadline %v, new master settling): error %v; want the failure policy's decision", i, dl, err)
			}
			if took > dl*9/10 {
				t.Errorf("decision %d took %v; budget %v", i, took, dl*9/10)
			}
		}
	})
}

// TestMigrationAfterFailover: after a failover that the limiter followed
// itself (go-redis still routed the key to the hung master), so that the
// new master's node sends through the limiter's own client of it, the
// key's slot is migrated to another, healthy shard. Every decision on it
// must stay Redis's, as go-redis's Cluster client follows MOVED, and the
// node the slot left (healthy) must count no failure.
func TestMigrationAfterFailover(t *testing.T) {
	clientKinds(t, func(t *testing.T, ctxTimeout bool) {
		cl, links, lim := onSimCluster(t, Config{Limit: PerSecond(1000), Timeout: 50 * time.Millisecond, Heartbeat: -1, Instances: 1}, ctxTimeout)
		ctx := context.Background()
		const key = "k"
		shard := cl.ShardOf(DefaultPrefix + key)
		time.Sleep(time.Second)
		if d, err := lim.Allow(ctx, key); err != nil || d.Mode != ModeRemote {
			t.Fatalf("before the fault: %+v, %v; want remote", d, err)
		}
		time.Sleep(time.Second)
		hangMaster(t, cl, links, shard)
		time.Sleep(500 * time.Millisecond)
		if err := cl.Takeover(shard); err != nil {
			t.Fatal(err)
		}
		time.Sleep(1500 * time.Millisecond)
		if d, err := lim.Allow(ctx, key); err != nil || d.Mode != ModeRemote {
			t.Fatalf("after the takeover: %+v, %v; want remote", d, err)
		}
		newAddr := cl.Nodes[cl.Master(shard)].Addr
		nd := (*lim.nodes.Load())[newAddr]
		if nd == nil {
			t.Fatalf("no node for %s, the new master", newAddr)
		}
		failed := nd.failed.Load()
		time.Sleep(time.Second)
		cl.MoveSlot(remote.Slot(DefaultPrefix+key), (shard+1)%3)
		// Another key of the shard the slot left, decided between them:
		// its successes would hide failures from the breaker's state.
		key2 := ""
		for i := 0; key2 == ""; i++ {
			if k := fmt.Sprint("o", i); cl.ShardOf(DefaultPrefix+k) == shard {
				key2 = k
			}
		}
		var modes []Mode
		for range 20 {
			if _, err := lim.Allow(ctx, key2); err != nil {
				t.Fatal(err)
			}
			d, err := lim.Allow(ctx, key)
			if err != nil {
				t.Fatal(err)
			}
			modes = append(modes, d.Mode)
			time.Sleep(10 * time.Millisecond)
		}
		for _, m := range modes {
			if m != ModeRemote {
				t.Errorf("decisions after the slot moved to a healthy shard: %v; want all remote", modes)
				break
			}
		}
		if nd.failed.Load() != failed {
			t.Errorf("%s, the healthy master the slot left, counted a failure", newAddr)
		}
	})
}

// TestZoneOutage: a zone of a Cluster goes dark. 16 of its 24 masters
// hang at once, every instance's breakers for them open, and a second
// later the Cluster fails each over to its replica in another zone. While
// a breaker is open the layout is read every reloadEvery, so every key
// must be decided by its new master well within a second of the
// takeovers, as with one master down: the prober must not read the layout
// only once per round of probes of the hung nodes, each waiting its
// budget, one after another (16 × Timeout).
func TestZoneOutage(t *testing.T) {
	clientKinds(t, func(t *testing.T, ctxTimeout bool) {
		const shards, hung, timeout = 24, 16, 50 * time.Millisecond
		cl, links, lim := onSimClusterOf(t, shards, Config{Limit: PerSecond(1000), Timeout: timeout, Heartbeat: -1, Instances: 1}, ctxTimeout, nil, nil)
		ctx := context.Background()
		keys := make([]string, shards) // keys[s] is a key of shard s
		for i := 0; slices.Contains(keys, ""); i++ {
			if k := fmt.Sprint("z", i); keys[cl.ShardOf(DefaultPrefix+k)] == "" {
				keys[cl.ShardOf(DefaultPrefix+k)] = k
			}
		}
		time.Sleep(time.Second)
		for _, k := range keys {
			if d, err := lim.Allow(ctx, k); err != nil || d.Mode != ModeRemote {
				t.Fatalf("%s before the fault: %+v, %v; want remote", k, d, err)
			}
		}
		for s := range hung {
			hangMaster(t, cl, links, s)
		}
		var wg sync.WaitGroup
		for s := range hung {
			wg.Go(func() { // until the node's breaker opens
				for range 2 * DefaultBreakerFailures {
					if _, err := lim.Allow(ctx, keys[s]); err != nil {
						t.Error(err)
					}
				}
			})
		}
		wg.Wait()
		for s := range hung {
			if nd := lim.route(DefaultPrefix + keys[s]); nd == nil || nd.cb.State() == breaker.StateClosed {
				t.Fatalf("shard %d's master hung: its breaker is not open", s)
			}
		}
		time.Sleep(time.Second)
		start := time.Now()
		for s := range hung {
			if err := cl.Takeover(s); err != nil {
				t.Fatal(err)
			}
		}
		back := make([]time.Duration, hung) // when each key was first decided by Redis again
		for s := range hung {
			wg.Go(func() {
				for time.Since(start) < 5*time.Second {
					if d, err := lim.Allow(ctx, keys[s]); err == nil && d.Mode == ModeRemote {
						back[s] = time.Since(start)
						return
					}
					time.Sleep(10 * time.Millisecond)
				}
				back[s] = time.Since(start)
			})
		}
		wg.Wait()
		last := slices.Max(back)
		t.Logf("%d of %d masters hung, then taken over: their keys back on Redis after %v (first %v)", hung, shards, last, slices.Min(back))
		// The bound for one master: the next reading, every reloadEvery,
		// answered in a round trip (replicas are asked first), a reading
		// begun just before the takeovers to wait out, and the new
		// master's charge within a decision's budget.
		if bound := 2*reloadEvery + timeout; last > bound {
			t.Errorf("the last key of the %d taken-over shards was back on Redis %v after the takeovers; want within %v", hung, last, bound)
		}
	})
}

// TestKeepLayout: readings overlap, and the one that began last wins
// whatever order they end in: one begun before a takeover, still waiting
// for the master that hangs, must not replace what a later reading found.
func TestKeepLayout(t *testing.T) {
	var lim Limiter
	t0 := time.Now()
	older := &layout{addrs: []string{"old:6379"}, began: t0}
	newer := &layout{addrs: []string{"new:6379"}, began: t0.Add(time.Millisecond)}
	lim.keepLayout(newer)
	lim.keepLayout(older)
	if got := lim.layout.Load(); got != newer {
		t.Errorf("kept the reading that began at %v over the one begun at %v", got.began, newer.began)
	}
	newest := &layout{began: t0.Add(2 * time.Millisecond)}
	lim.keepLayout(newest)
	if lim.layout.Load() != newest {
		t.Error("a later reading was not kept")
	}
}

// TestLayoutClaim: the layout's spans give every slot the owner a table of
// every slot gives it, taking for each slot the first answer's master that
// is not down, over random answers that disagree and leave gaps, each of
// ranges that do not overlap, in any order.
func TestLayoutClaim(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for run := range 500 {
		owners := 1 + r.IntN(5)
		down := make([]bool, owners)
		for j := range down {
			down[j] = r.IntN(3) == 0
		}
		var l layout
		var want [remote.Slots]uint16
		for range 1 + r.IntN(6) {
			var ranges []span
			for first := r.IntN(300); first < remote.Slots; {
				last := min(first+r.IntN(remote.Slots/4), remote.Slots-1)
				if r.IntN(4) == 0 {
					last = min(first+r.IntN(3), remote.Slots-1) // a slot or two, as resharding leaves
				}
				i := uint16(1 + r.IntN(owners))
				ranges = append(ranges, span{first, last, i})
				for s := first; s <= last; s++ {
					if cur := want[s]; cur == 0 || down[cur-1] && !down[i-1] {
						want[s] = i
					}
				}
				first = last + 1 + r.IntN(200)
			}
			r.Shuffle(len(ranges), func(a, b int) { ranges[a], ranges[b] = ranges[b], ranges[a] })
			l.claim(ranges, down)
		}
		for s := range remote.Slots {
			if got := l.ownerOf(s); got != want[s] {
				t.Fatalf("run %d: slot %d owned by %d; want %d (spans %v, down %v)", run, s, got, want[s], l.spans, down)
			}
		}
		for j := 1; j < len(l.spans); j++ {
			if a, b := l.spans[j-1], l.spans[j]; a.last+1 != b.first || a.owner == b.owner {
				t.Fatalf("run %d: spans %v and %v neither adjoin nor differ", run, a, b)
			}
		}
	}
}

// TestLayoutClaimFragmented: a Cluster resharded slot by slot answers with
// a range per slot. Six such answers, as a reading of six nodes gets, cost
// a pass each, not one per range: a copy of the spans per range took 10 s
// and 36 GB here.
func TestLayoutClaimFragmented(t *testing.T) {
	ranges := make([]span, remote.Slots)
	down := []bool{false, false, false}
	allocs := testing.AllocsPerRun(3, func() {
		var l layout
		for range 6 {
			for s := range ranges {
				ranges[s] = span{s, s, uint16(1 + s%3)}
			}
			l.claim(ranges, down)
		}
		if len(l.spans) != remote.Slots || l.ownerOf(remote.Slots-1) != uint16(1+(remote.Slots-1)%3) {
			t.Fatalf("%d spans, last slot owned by %d; want %d and %d", len(l.spans), l.ownerOf(remote.Slots-1), remote.Slots, 1+(remote.Slots-1)%3)
		}
	})
	if allocs > 6*2 {
		t.Errorf("six answers of %d ranges: %v allocations; want at most 2 an answer", remote.Slots, allocs)
	}
}

// TestNodeAddr: a node's address in a CLUSTER SLOTS answer is named as
// go-redis's ClusterClient names it, which routing compares it with.
func TestNodeAddr(t *testing.T) {
	for _, c := range []struct{ addr, origin, want string }{
		{"10.0.0.5:7000", "10.0.0.1:7001", "10.0.0.5:7000"},
		{"127.0.0.1:7000", "redis.example:7001", "redis.example:7000"}, // announced loopback, behind NAT
		{"127.0.0.1:7000", "127.0.0.1:7001", "127.0.0.1:7000"},         // a local Cluster
		{"127.0.0.1:7000", "localhost:7001", "127.0.0.1:7000"},
		{"127.0.0.1:7000", "host.docker.internal:7001", "127.0.0.1:7000"},
		{"10.0.0.5:0", "10.0.0.1:6380", "10.0.0.5:6380"}, // TLS only: port 0 announced
		{"[::1]:7000", "10.0.0.1:7001", "10.0.0.1:7000"},
		{"node-a:7000", "10.0.0.1:7001", "node-a:7000"},
	} {
		if got := nodeAddr(c.addr, c.origin); got != c.want {
			t.Errorf("nodeAddr(%q, %q) = %q; want %q", c.addr, c.origin, got, c.want)
		}
	}
}

// TestSettleWaitsOnlyForOwedKeys: after a takeover, the new master is
// charged with what this instance spent locally on 5,000 of its keys, a
// round trip per batch. A decision on a key this instance never decided
// locally owes nothing, and must not wait for those charges: it goes to
// the new master at once, rather than waiting its budget and going local.
func TestSettleWaitsOnlyForOwedKeys(t *testing.T) {
	clientKinds(t, func(t *testing.T, ctxTimeout bool) {
		const timeout = 50 * time.Millisecond
		cl, links, lim := onSimCluster(t, Config{Limit: Limit{Rate: 1, Burst: 10}, Timeout: timeout, Heartbeat: -1, Instances: 1}, ctxTimeout)
		ctx := context.Background()
		const key = "k"
		shard := cl.ShardOf(DefaultPrefix + key)
		var keys []string
		for i := 0; len(keys) < 5000; i++ {
			if k := "u" + strconv.Itoa(i); cl.ShardOf(DefaultPrefix+k) == shard {
				keys = append(keys, k)
			}
		}
		time.Sleep(time.Second)
		if d, err := lim.Allow(ctx, key); err != nil || d.Mode != ModeRemote {
			t.Fatalf("before the fault: %+v, %v", d, err)
		}
		hangMaster(t, cl, links, shard)
		for _, k := range keys {
			lim.Allow(ctx, k) // local, once the breaker opens
		}
		time.Sleep(500 * time.Millisecond)
		if err := cl.Takeover(shard); err != nil {
			t.Fatal(err)
		}
		links[cl.Master(shard)].SetLatency(time.Millisecond)
		// The prober finds the new master and starts charging it; key,
		// which this instance never decided locally, owes nothing.
		newAddr := cl.Nodes[cl.Master(shard)].Addr
		var nd *node
		for range 1000 {
			if nd = (*lim.nodes.Load())[newAddr]; nd != nil {
				break
			}
			time.Sleep(time.Millisecond)
		}
		if nd == nil || !nd.settling.Load() {
			t.Fatalf("the new master's node: %v; want one being charged", nd)
		}
		start := time.Now()
		d, err := lim.Allow(ctx, key)
		took := time.Since(start)
		if !nd.settling.Load() {
			t.Fatal("the charges ended before the decision: the test proves nothing")
		}
		// It may queue behind the charges in the node's pipe (a few ms at
		// 1 ms a round trip), not wait for all of them.
		if err != nil || d.Mode != ModeRemote || took > timeout/2 {
			t.Errorf("a key with nothing owed, while 5,000 others are charged to the new master: %v, %v after %v; want remote, within %v", d.Mode, err, took, timeout/2)
		}
	})
}

// TestLayoutReadsBounded: while a master hangs and its breaker stays
// open, an instance reads the Cluster's layout every reloadEvery to learn
// of a failover. Each reading must cost the Cluster layoutFanout CLUSTER
// SLOTS, not one per node: a fleet of a thousand instances reads ten times
// a second each, on the nodes that are about to take over. And each must
// ask the hung master's replica, the node that knows first when it takes
// over.
func TestLayoutReadsBounded(t *testing.T) {
	clientKinds(t, func(t *testing.T, ctxTimeout bool) {
		// go-redis's own readings, through its node clients, are counted
		// apart from the limiter's.
		// readings counts the limiter's readings of the layout in its
		// high 32 bits, and those that asked the replica first in its low
		// ones: one word, so that a snapshot reads both at one instant.
		var theirs, readings atomic.Int64
		var replicaAddr atomic.Pointer[string]
		cfg := Config{Limit: PerSecond(100), Timeout: 50 * time.Millisecond, onLayoutRead: func(order []string) {
			add := int64(1) << 32
			if a := replicaAddr.Load(); a != nil && len(order) > 0 && order[0] == *a {
				add++
			}
			readings.Add(add)
		}}
		cl, links, lim := onSimClusterWith(t, cfg, ctxTimeout, func(c *redis.ClusterClient) {
			c.OnNewNode(func(c *redis.Client) { c.AddHook(slotsCounter{&theirs}) })
		})
		ctx := context.Background()
		const key = "k"
		shard := cl.ShardOf(DefaultPrefix + key)
		replica := len(cl.Nodes)/2 + shard
		replicaAddr.Store(&cl.Nodes[replica].Addr)
		if _, err := lim.Allow(ctx, key); err != nil {
			t.Fatal(err)
		}
		hangMaster(t, cl, links, shard)
		decide := func(d time.Duration) {
			for end := time.Now().Add(d); time.Now().Before(end); time.Sleep(50 * time.Millisecond) {
				if _, err := lim.Allow(ctx, key); err != nil {
					t.Fatal(err)
				}
			}
		}
		reads := func() (all int64) {
			for i := range cl.Nodes {
				all += cl.SlotsReads(i)
			}
			return all
		}
		decide(time.Second) // the breaker opens
		// The span starts once the breaker is open and the limiter knows
		// the replicas: a reading before that (one a failed call starts
		// as the breaker opens, with no layout read yet since the hang)
		// cannot ask them first.
		for deadline := time.Now().Add(2 * time.Second); ; decide(50 * time.Millisecond) {
			l := lim.layout.Load()
			if lim.Stats().Breakers[cl.Nodes[cl.Master(shard)].Addr] != "closed" && l != nil && slices.Contains(l.nodes, *replicaAddr.Load()) {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("three seconds into the hang: breakers %v, layout %+v; want one open, and a layout naming the replica", lim.Stats().Breakers, l)
			}
		}
		all, mine, atReplica, read0 := reads(), theirs.Load(), cl.SlotsReads(replica), readings.Load()
		const span = 3 * time.Second
		decide(span)
		delta := readings.Load() - read0
		n, first := delta>>32, delta&(1<<32-1)
		own := reads() - all - (theirs.Load() - mine)
		t.Logf("the limiter's own CLUSTER SLOTS in %v of an open breaker: %d (6 nodes, %d readings); at the replica: %d; go-redis's: %d",
			span, own, n, cl.SlotsReads(replica)-atReplica, theirs.Load()-mine)
		// Two a reading. The prober reads every reloadEvery (30 in the
		// span), failed and watched calls start about one more a second
		// (3), and one may be under way at either end of the span: 35
		// readings, 70 CLUSTER SLOTS. Every node but the hung one, five a
		// reading, would be 175.
		if want := int64(70); own > want {
			t.Errorf("the limiter sent %d CLUSTER SLOTS in %v of an open breaker; want at most %d", own, span, want)
		}
		// The prober reads once it is reloadEvery since the last reading,
		// at its next tick, after a probe of the hung master, which waits
		// its Timeout, if one was due: at least every reloadEvery +
		// probeTick + Timeout, 17 readings in the span (30 if no probe
		// were ever due).
		if least := int64(span/(reloadEvery+probeTick+cfg.Timeout)) - 1; n < least {
			t.Errorf("%d readings of the layout in %v of an open breaker; want at least %d", n, span, least)
		}
		// Every reading asks the replica first. (What reaches the
		// replica's server may be fewer: a reading that has its answers
		// before the replica's request went out, the replica slower than
		// the hedge, drops it.)
		if first != n {
			t.Errorf("%d of %d readings asked the hung master's replica first; want every one", first, n)
		}
	})
}

// slotsCounter counts the CLUSTER SLOTS a client sends.
type slotsCounter struct{ n *atomic.Int64 }

func (h slotsCounter) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h slotsCounter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if args := cmd.Args(); len(args) >= 2 && strings.EqualFold(fmt.Sprint(args[0]), "cluster") && strings.EqualFold(fmt.Sprint(args[1]), "slots") {
			h.n.Add(1)
		}
		return next(ctx, cmd)
	}
}

func (h slotsCounter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// TestLayoutReadingHedged: a node asked for the layout that does not
// answer (a replica on a host that froze: no breaker of the limiter's
// watches replicas) costs a reading a quarter of its time, when another
// node is asked beside it, not the whole reading. The reading is one that
// needs two answers (a master is failing here, its replica is asked
// first), and the replica that hangs is that master's.
func TestLayoutReadingHedged(t *testing.T) {
	bubble(t, func(t *testing.T) {
		const timeout = 40 * time.Millisecond
		cl, links, lim := onSimCluster(t, Config{Limit: PerSecond(100), Timeout: timeout}, false)
		if _, err := lim.Allow(context.Background(), "k"); err != nil {
			t.Fatal(err)
		}
		// A first reading names the replicas, which the client's seeds do
		// not.
		if l := lim.readLayout(context.Background(), "", -1); l != nil {
			lim.keepLayout(l)
		}
		suspect := cl.Nodes[cl.Master(0)].Addr
		hung := len(cl.Nodes)/2 + 0 // shard 0's replica
		links[hung].Hang()
		t.Cleanup(links[hung].Resume)
		before := cl.SlotsReads(hung)
		var slowest time.Duration
		for range 40 {
			ctx, cancel := context.WithTimeout(context.Background(), layoutTimeout)
			start := time.Now()
			l := lim.readLayout(ctx, suspect, -1)
			slowest = max(slowest, time.Since(start))
			cancel()
			if l == nil {
				t.Fatal("no layout read")
			}
			if l.at(0) != cl.Nodes[cl.Master(0)].Addr {
				t.Fatalf("slot 0's master %q; want %q", l.at(0), cl.Nodes[cl.Master(0)].Addr)
			}
		}
		if cl.SlotsReads(hung) != before {
			t.Fatal("the hung replica answered")
		}
		t.Logf("slowest of 40 readings: %v", slowest)
		if want := timeout/4 + 5*time.Millisecond; slowest > want {
			t.Errorf("slowest of 40 readings with a replica hung: %v; want at most %v", slowest, want)
		}
	})
}

// TestCloseDuringClusterFirstContactWithUnboundedReadTimeout: a Cluster
// client whose ReadTimeout is -1, and every node hung from before New:
// the first contact waits in go-redis's reads of the layout, which only
// Redis's answer ends. Close must return all the same.
func TestCloseDuringClusterFirstContactWithUnboundedReadTimeout(t *testing.T) {
	bubble(t, func(t *testing.T) {
		t.Cleanup(func() { time.Sleep(30 * time.Second) }) // last
		cl := simredis.NewCluster(3, func(slot int) int { return slot * 3 / remote.Slots })
		t.Cleanup(cl.Close)
		links := make([]*simnet.Link, len(cl.Nodes))
		for i := range links {
			links[i] = simnet.NewLink()
		}
		client := redis.NewClusterClient(&redis.ClusterOptions{Addrs: cl.Addrs(), Dialer: cl.Dialer(links, 0), ReadTimeout: -1})
		t.Cleanup(func() { client.Close() })
		for _, l := range links {
			l.Hang()
			t.Cleanup(l.Resume)
		}
		lim, err := New(Config{Redis: client, Limit: PerSecond(10), Instances: 1, Heartbeat: -1, Timeout: 50 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		time.Sleep(10 * time.Millisecond) // the first contact is under way
		closesWithinAMinute(t, lim, "the Cluster hung during the first contact", func() {
			for _, l := range links {
				l.Resume()
			}
		})
	})
}

// TestOwnClientsFollowTheLayout: the limiter's own clients of Cluster
// nodes (probes, layout readings, keys routed by its own layout) are
// closed once no layout, seed or node names their address. Redis Cluster
// on Kubernetes gives a replaced pod a new address at every restart and
// failover; kept, each old address's client would hold its pool, and its
// sockets to a host that is gone, until Close.
func TestOwnClientsFollowTheLayout(t *testing.T) {
	clientKinds(t, func(t *testing.T, ctxTimeout bool) {
		const key = "k"
		var seed string
		cl, links, lim := onSimClusterOpts(t, Config{Limit: PerSecond(1000), Timeout: 50 * time.Millisecond, Heartbeat: -1, Instances: 1}, ctxTimeout,
			func(cl *simredis.Cluster, o *redis.ClusterOptions) {
				// One seed, the master of a shard that is not the key's.
				seed = cl.Nodes[cl.Master((cl.ShardOf(DefaultPrefix+key)+1)%3)].Addr
				o.Addrs = []string{seed}
			}, nil)
		ctx := context.Background()
		shard := cl.ShardOf(DefaultPrefix + key)
		old := cl.Nodes[cl.Master(shard)].Addr
		time.Sleep(time.Second)
		if d, err := lim.Allow(ctx, key); err != nil || d.Mode != ModeRemote {
			t.Fatalf("before the fault: %+v, %v; want remote", d, err)
		}
		hangMaster(t, cl, links, shard)
		for range 10 { // the breaker opens, and the prober probes the old master
			if _, err := lim.Allow(ctx, key); err != nil {
				t.Fatal(err)
			}
			time.Sleep(50 * time.Millisecond)
		}
		lim.mu.Lock()
		_, made := lim.own[old]
		lim.mu.Unlock()
		if !made {
			t.Fatalf("the limiter made no client of its own for %s, the master that hung", old)
		}
		if err := cl.Takeover(shard); err != nil { // the old master leaves the layout
			t.Fatal(err)
		}
		time.Sleep(1500 * time.Millisecond)
		if d, err := lim.Allow(ctx, key); err != nil || d.Mode != ModeRemote {
			t.Fatalf("after the takeover: %+v, %v; want remote", d, err)
		}
		for i := 0; ; i++ {
			lim.mu.Lock()
			c := lim.own[old]
			lim.mu.Unlock()
			if c == nil {
				break
			}
			if i == 100 {
				t.Fatalf("10 s after the takeover, the limiter still holds its client of %s, a master that left the layout", old)
			}
			time.Sleep(100 * time.Millisecond)
		}
		if d, err := lim.Allow(ctx, key); err != nil || d.Mode != ModeRemote {
			t.Fatalf("after the old client went: %+v, %v; want remote", d, err)
		}
	})
}

// TestOwnClientsKeepTheUsersOptions: the limiter's own client of a node
// (after a failover it followed before go-redis, and for probes) sends
// the handshake the user's Cluster client would: identity settings
// included, so that an ACL log or CLIENT LIST shows what the user chose.
func TestOwnClientsKeepTheUsersOptions(t *testing.T) {
	bubble(t, func(t *testing.T) {
		cl, _, lim := onSimClusterOpts(t, Config{Limit: PerSecond(10), Heartbeat: -1, Instances: 1}, false, func(_ *simredis.Cluster, o *redis.ClusterOptions) {
			o.ClientName, o.IdentitySuffix, o.DisableIdentity, o.UnstableResp3 = "svc", "-a", true, true
			o.DisableIndentity = true //nolint:staticcheck // deprecated, still honoured by go-redis
		}, nil)
		lim.mu.Lock()
		c := lim.ownClientLocked(cl.Addrs()[0])
		lim.mu.Unlock()
		if c == nil {
			t.Fatal("no own client")
		}
		o := c.Options()
		if o.ClientName != "svc" || o.IdentitySuffix != "-a" || !o.DisableIdentity || !o.DisableIndentity || !o.UnstableResp3 { //nolint:staticcheck
			t.Errorf("own client's options: ClientName %q IdentitySuffix %q DisableIdentity %v DisableIndentity %v UnstableResp3 %v; want the Cluster client's",
				o.ClientName, o.IdentitySuffix, o.DisableIdentity, o.DisableIndentity, o.UnstableResp3) //nolint:staticcheck
		}
	})
}
