package redistest

import (
	"context"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// joinTimeout bounds how long StartCluster waits for redis-cli and for every
// node to report cluster_state:ok, and how long StartReplicated waits for the
// replica to sync.
const joinTimeout = 20 * time.Second

// Cluster is a Redis Cluster started by StartCluster (masters only) or
// StartClusterWithReplicas.
type Cluster struct {
	// Nodes holds the masters in the order they were started.
	Nodes []*Server
	// Replicas holds, for StartClusterWithReplicas, the replica of each
	// master: Replicas[i] replicates Nodes[i].
	Replicas []*Server
}

// StartCluster starts masters redis-server processes in cluster mode, joins
// them with redis-cli --cluster create, and waits until every node reports
// cluster_state:ok. Redis needs at least 3 masters. Options apply to every
// node, after the cluster flags, so that WithArgs can override them (for
// example "--cluster-require-full-coverage", "no"). t.Cleanup kills every node.
func StartCluster(t testing.TB, masters int, opts ...Option) *Cluster {
	t.Helper()
	return startCluster(t, masters, 0, opts...)
}

// StartClusterWithReplicas is StartCluster with one replica per master: it
// waits, too, until every replica's link to its master is up.
func StartClusterWithReplicas(t testing.TB, masters int, opts ...Option) *Cluster {
	t.Helper()
	return startCluster(t, masters, 1, opts...)
}

func startCluster(t testing.TB, masters, replicas int, opts ...Option) *Cluster {
	t.Helper()
	if masters < 3 {
		t.Fatalf("redistest: StartCluster(%d): Redis Cluster needs at least 3 masters", masters)
	}
	cli, err := exec.LookPath("redis-cli")
	if err != nil {
		t.Fatal("redis-cli not found: install it with `apt-get install -y redis-server`")
	}
	first := []Option{func(c *config) { c.cluster = true }}
	if replicas > 0 {
		// Diskless sync waits 5 s for more replicas by default before it
		// serves the first one (see StartReplicated): five seconds of
		// every Cluster with replicas spent waiting for its links.
		first = append(first, WithArgs("--repl-diskless-sync", "no"))
	}
	var all []*Server
	for range masters * (1 + replicas) {
		all = append(all, Start(t, append(first[:len(first):len(first)], opts...)...))
	}
	ctx, cancel := context.WithTimeout(context.Background(), joinTimeout)
	defer cancel()
	args := []string{"--cluster", "create"}
	for _, s := range all {
		args = append(args, s.Addr())
	}
	args = append(args, "--cluster-replicas", strconv.Itoa(replicas), "--cluster-yes")
	if out, err := exec.CommandContext(ctx, cli, args...).CombinedOutput(); err != nil {
		t.Fatalf("redistest: redis-cli %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	known := "cluster_known_nodes:" + strconv.Itoa(len(all)) + "\r\n"
	for _, s := range all {
		waitInfo(t, ctx, s, func(ctx context.Context, rc *redis.Client) (string, error) {
			return rc.ClusterInfo(ctx).Result()
		}, "cluster_state:ok\r\n", known)
	}
	c := &Cluster{}
	if replicas == 0 {
		c.Nodes = all
		return c
	}
	// Which node redis-cli made a replica of which is read back from
	// CLUSTER NODES ("<id> <addr>@<bus> <flags> <master id> ..."), once
	// every replica's role has reached the first node.
	rc := probe(all[0].Addr())
	defer rc.Close()
	byAddr := map[string]*Server{}
	for _, s := range all {
		byAddr[s.Addr()] = s
	}
	for {
		out, err := rc.ClusterNodes(ctx).Result()
		if err != nil {
			t.Fatalf("redistest: CLUSTER NODES: %v", err)
		}
		ids := map[string]*Server{}
		masterOf := map[*Server]string{}
		for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
			f := strings.Fields(line)
			if len(f) < 4 {
				continue
			}
			addr, _, _ := strings.Cut(f[1], "@")
			ids[f[0]] = byAddr[addr]
			if strings.Contains(f[2], "slave") {
				masterOf[byAddr[addr]] = f[3]
			}
		}
		c.Nodes, c.Replicas = nil, nil
		for _, s := range all {
			if _, ok := masterOf[s]; !ok {
				c.Nodes = append(c.Nodes, s)
			}
		}
		c.Replicas = make([]*Server, len(c.Nodes))
		complete := len(masterOf) == masters*replicas
		for r, id := range masterOf {
			for i, m := range c.Nodes {
				if ids[id] == m {
					c.Replicas[i] = r
				}
			}
		}
		for _, r := range c.Replicas {
			complete = complete && r != nil
		}
		if complete {
			break
		}
		select {
		case <-ctx.Done():
			t.Fatalf("redistest: the replicas' roles did not reach %s: %s", all[0].Addr(), out)
		case <-time.After(50 * time.Millisecond):
		}
	}
	for _, r := range c.Replicas {
		waitInfo(t, ctx, r, func(ctx context.Context, rc *redis.Client) (string, error) {
			return rc.Info(ctx, "replication").Result()
		}, "master_link_status:up\r\n")
	}
	return c
}

// waitInfo polls get on s until its reply contains every one of want,
// failing the test when ctx is done.
func waitInfo(t testing.TB, ctx context.Context, s *Server, get func(context.Context, *redis.Client) (string, error), want ...string) {
	t.Helper()
	rc := probe(s.Addr())
	defer rc.Close()
	var last string
	for {
		if reply, err := get(ctx, rc); err == nil {
			last = reply
			ok := true
			for _, w := range want {
				ok = ok && strings.Contains(reply, w)
			}
			if ok {
				return
			}
		}
		select {
		case <-ctx.Done():
			t.Fatalf("redistest: %s: want %q, last reply:\n%s\n%s", s.Addr(), want, last, s.logTail())
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// Addrs returns the address of every node, in the order of Nodes.
func (c *Cluster) Addrs() []string {
	addrs := make([]string, len(c.Nodes))
	for i, s := range c.Nodes {
		addrs[i] = s.Addr()
	}
	return addrs
}

// Client returns a go-redis cluster client seeded with every node, closed by
// t.Cleanup.
func (c *Cluster) Client(t testing.TB) *redis.ClusterClient {
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs()})
	t.Cleanup(func() { cc.Close() })
	return cc
}

// NodeForKey returns the master that serves key's hash slot, as reported by
// CLUSTER KEYSLOT and CLUSTER SLOTS on the first node.
func (c *Cluster) NodeForKey(t testing.TB, key string) *Server {
	t.Helper()
	rc := probe(c.Nodes[0].Addr())
	defer rc.Close()
	ctx, cancel := context.WithTimeout(context.Background(), readyTimeout)
	defer cancel()
	slot, err := rc.ClusterKeySlot(ctx, key).Result()
	if err != nil {
		t.Fatalf("redistest: CLUSTER KEYSLOT %q: %v", key, err)
	}
	ranges, err := rc.ClusterSlots(ctx).Result()
	if err != nil {
		t.Fatalf("redistest: CLUSTER SLOTS: %v", err)
	}
	for _, r := range ranges {
		if int64(r.Start) > slot || slot > int64(r.End) || len(r.Nodes) == 0 {
			continue
		}
		for _, s := range c.Nodes {
			if s.Addr() == r.Nodes[0].Addr {
				return s
			}
		}
		t.Fatalf("redistest: slot %d of %q is served by %s, not one of %v", slot, key, r.Nodes[0].Addr, c.Addrs())
	}
	t.Fatalf("redistest: slot %d of %q is not served", slot, key)
	return nil
}

// StartReplicated starts a master and a replica of it, and waits until the
// replica reports master_link_status:up and the master reports it online.
// t.Cleanup kills both.
func StartReplicated(t testing.TB) (master, replica *Server) {
	t.Helper()
	// Diskless sync waits 5 s for more replicas by default, and then counts
	// the replica for WAIT only after its first ACK, up to a second later.
	// The replica too syncs from disk, at once, when a test promotes it and
	// turns the old master into its replica: waiting 5 s, it forked in the
	// middle of the test's measurement of the new master, and decisions
	// missed their budget then (45-52 ms at p99, seven seconds into
	// TestFaultFailover).
	master = Start(t, WithArgs("--repl-diskless-sync", "no"))
	replica = Start(t, WithArgs("--repl-diskless-sync", "no", "--replicaof", "127.0.0.1", strconv.Itoa(master.Port())))
	ctx, cancel := context.WithTimeout(context.Background(), joinTimeout)
	defer cancel()
	info := func(ctx context.Context, rc *redis.Client) (string, error) {
		return rc.Info(ctx, "replication").Result()
	}
	waitInfo(t, ctx, replica, info, "master_link_status:up\r\n")
	waitInfo(t, ctx, master, info, "port="+strconv.Itoa(replica.Port())+",state=online,")
	return master, replica
}
