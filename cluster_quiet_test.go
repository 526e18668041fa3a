package hybridlimit

import (
	"context"
	"testing"
	"testing/synctest"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/hybridlimit/hybridlimit/internal/simnet"
	"github.com/hybridlimit/hybridlimit/internal/simredis"
	"github.com/hybridlimit/hybridlimit/remote"
)

// TestQuietFailover: an instance that decides on a key every two seconds
// meets a failover of the key's master. Its calls to the hung master are
// too few to open the breaker, so the prober never reads the layout; the
// limiter must still learn from the failed calls that the slots moved,
// and decide on the new master, rather than wait its budget on the hung
// one and fall to the local share until Failures decisions have failed.
// Simulated Cluster (internal/simredis) at virtual time.
func TestQuietFailover(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		defer time.Sleep(30 * time.Second) // go-redis's dial back-offs and reloads end
		cl := simredis.NewCluster(3, func(slot int) int { return slot * 3 / remote.Slots })
		defer cl.Close()
		links := make([]*simnet.Link, len(cl.Nodes))
		for i := range links {
			links[i] = simnet.NewLink()
		}
		client := redis.NewClusterClient(&redis.ClusterOptions{Addrs: cl.Addrs(), Dialer: cl.Dialer(links, 0)})
		defer client.Close()
		ctx := context.Background()
		// go-redis reads COMMAND once, under a mutex, from a random node:
		// now, before that node can hang (see sim_cluster_test.go).
		_ = client.Ping(ctx).Err()
		lim, err := New(Config{Redis: client, Limit: PerSecond(10), Timeout: 50 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		defer lim.Close()
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
		// the one at 5 s still goes to the hung master, whose slots the
		// layout read after the first failure did not move yet; from 7 s
		// on the layout read after the second names the new master.
		want := []Mode{ModeRemote, ModeLocal, ModeLocal, ModeRemote, ModeRemote, ModeRemote}
		for i, m := range modes {
			if i >= 3 && m != want[i] {
				t.Errorf("decision at %ds: %v; want %v (the replica took over at 4 s). All: %v", 1+2*i, m, want[i], modes)
				break
			}
		}
		if modes[0] != ModeRemote {
			t.Errorf("decision at 1 s, before any fault: %v; want remote", modes[0])
		}
	})
}
