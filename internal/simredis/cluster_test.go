package simredis

import (
	"context"
	"testing"
	"testing/synctest"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/hybridlimit/hybridlimit/internal/simnet"
	"github.com/hybridlimit/hybridlimit/remote"
)

// clusterClient returns a go-redis ClusterClient with default options that
// dials c's nodes over links of its own, one per node.
func clusterClient(c *Cluster) (*redis.ClusterClient, []*simnet.Link) {
	links := make([]*simnet.Link, len(c.Nodes))
	for i := range links {
		links[i] = simnet.NewLink()
	}
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs(), Dialer: c.Dialer(links, 0)})
	return cc, links
}

// TestClusterFailover runs a go-redis ClusterClient against the model: it
// routes a key to its shard's master, follows MOVED to the replica once it
// took over, and the replica holds what reached it: every write of a
// planned takeover, none of the last lag's when the master stopped.
func TestClusterFailover(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		// go-redis's lazy layout reload sleeps a moment after it ends:
		// the bubble waits for it, after everything is closed.
		defer time.Sleep(time.Second)
		c := NewCluster(3, func(slot int) int { return slot * 3 / remote.Slots })
		defer c.Close()
		cc, links := clusterClient(c)
		defer cc.Close()
		ctx := context.Background()
		lim, err := remote.NewLimit(1, 10) // slow: a second refills one token
		if err != nil {
			t.Fatal(err)
		}
		p := remote.NewPipe(cc, 1, nil)
		defer p.Close()
		take := func(key string, n int64) int64 {
			t.Helper()
			res, err := p.Take(ctx, key, lim, n)
			if err != nil {
				t.Fatalf("Take(%q, %d): %v", key, n, err)
			}
			return res.Level / lim.P
		}
		slots, err := cc.ClusterSlots(ctx).Result()
		if err != nil || len(slots) != 3 || len(slots[0].Nodes) != 2 {
			t.Fatalf("CLUSTER SLOTS = %v, %v; want 3 ranges of a master and a replica", slots, err)
		}
		for _, key := range []string{"a", "b", "c", "d"} {
			if got := take(key, 4); got != 6 {
				t.Fatalf("Take(%q, 4) left %d tokens; want 6", key, got)
			}
		}
		// A planned takeover: the replica has every write.
		sa := c.ShardOf("a")
		old := c.Master(sa)
		before := c.Nodes[old].Calls()
		if err := c.Takeover(sa); err != nil {
			t.Fatal(err)
		}
		if got := take("a", 1); got != 5 {
			t.Errorf("after the takeover Take(a, 1) left %d tokens; want 5 (the replica had a's writes)", got)
		}
		if got := c.Nodes[old].Calls(); got != before {
			t.Errorf("after the takeover the old master ran %d more script calls; want 0 (MOVED)", got-before)
		}
		// A master that stops 50 ms after a write, with a lag of 100 ms:
		// that write never reached its replica, the one before did.
		sb := c.ShardOf("b")
		if sb == sa {
			t.Fatal("a and b on one shard: pick other keys")
		}
		c.SetLag(sb, 100*time.Millisecond)
		time.Sleep(50 * time.Millisecond)
		if got := take("b", 2); got != 4 {
			t.Fatalf("Take(b, 2) left %d tokens; want 4", got)
		}
		time.Sleep(50 * time.Millisecond)
		c.Stop(sb)
		oldB := c.Master(sb)
		links[oldB].Hang()
		if err := c.Takeover(sb); err != nil {
			t.Fatal(err)
		}
		if err := c.Takeover(sb); err != ErrNoReplica {
			t.Errorf("a second Takeover: %v; want ErrNoReplica", err)
		}
		// The old master comes back as a replica: what it had buffered,
		// and go-redis's next call of b, get MOVED.
		links[oldB].Resume()
		if got := take("b", 1); got != 5 {
			t.Errorf("after a takeover with lag Take(b, 1) left %d tokens; want 5 (the take of 4 100 ms before the stop reached the replica, the take of 2 50 ms before did not)", got)
		}
		slots, err = cc.ClusterSlots(ctx).Result()
		for _, s := range slots {
			if len(s.Nodes) != 2 && (s.Nodes[0].Addr != c.Nodes[c.Master(sa)].Addr && s.Nodes[0].Addr != c.Nodes[c.Master(sb)].Addr) {
				t.Errorf("CLUSTER SLOTS range %v: only the taken-over shards lack a replica", s)
			}
		}
	})
}
