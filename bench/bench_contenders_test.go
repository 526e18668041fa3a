package bench

import (
	"context"
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/hybridlimit/hybridlimit/remote"
)

// TestContenders runs every contender briefly on both key patterns: each
// decision is allowed and none fails.
func TestContenders(t *testing.T) {
	addr := redisAddr(t)
	for _, c := range Contenders {
		t.Run(c.Name, func(t *testing.T) {
			var rdb redis.UniversalClient
			if c.Remote {
				cl := redis.NewClient(&redis.Options{Addr: addr})
				defer cl.Close()
				rdb = cl
			}
			inst, err := c.Open(rdb)
			if err != nil {
				t.Fatalf("Open: %v", err)
			}
			defer inst.Close()
			for _, p := range Patterns {
				r, err := Prepare(context.Background(), inst, p, 4, 41)
				if err != nil {
					t.Fatalf("Prepare(%s): %v", p, err)
				}
				r.Go()
				res, err := r.Result()
				if err != nil {
					t.Fatalf("Result(%s): %v", p, err)
				}
				if res.N != 41 || res.Denied != 0 || res.P50 <= 0 || res.P99 < res.P50 {
					t.Errorf("%s: Result = %+v; want 41 decisions, none denied, 0 < p50 <= p99", p, res)
				}
			}
		})
	}
}

// TestContendersWrite checks that every Redis contender records each
// decision under the benchmark's limit: its key's value changes with every
// decision. (At 1e9 per second redis_rate's did not, see Rate.) Lease mode
// writes once per lease, by design.
func TestContendersWrite(t *testing.T) {
	addr := redisAddr(t)
	ctx := context.Background()
	for _, c := range Contenders {
		if !c.Remote || c.Leases {
			continue
		}
		t.Run(c.Name, func(t *testing.T) {
			cl := redis.NewClient(&redis.Options{Addr: addr})
			defer cl.Close()
			inst, err := c.Open(cl)
			if err != nil {
				t.Fatalf("Open: %v", err)
			}
			defer inst.Close()
			name := "writecheck-" + c.Name
			decide := inst.Bind(name)
			var last string
			for i := range 3 {
				if ok, err := decide(ctx); err != nil || !ok {
					t.Fatalf("decision %d = %v, %v; want allowed", i, ok, err)
				}
				keys, err := cl.Keys(ctx, "*"+name+"*").Result()
				if err != nil || len(keys) != 1 {
					t.Fatalf("keys for %q = %q, %v; want one", name, keys, err)
				}
				v, err := cl.Dump(ctx, keys[0]).Result()
				if err != nil {
					t.Fatal(err)
				}
				if v == last {
					t.Errorf("decision %d left %s unchanged", i, keys[0])
				}
				last = v
			}
		})
	}
}

// TestKeys checks the key patterns: one key for all, or one each.
func TestKeys(t *testing.T) {
	if got := Keys(Hot, 3); got[0] != got[1] || got[1] != got[2] {
		t.Errorf("Keys(Hot, 3) = %q; want one key", got)
	}
	got := Keys(Spread, 3)
	if got[0] == got[1] || got[1] == got[2] || got[0] == got[2] {
		t.Errorf("Keys(Spread, 3) = %q; want three keys", got)
	}
}

// TestScriptArgs checks that the bare script is sent what hybridlimit
// sends for the benchmark's limit: q, p, capacity and cost in units.
func TestScriptArgs(t *testing.T) {
	got, err := ScriptArgs()
	if err != nil {
		t.Fatal(err)
	}
	if want := "1 1 1000000000 1"; strings.Join(got, " ") != want {
		t.Errorf("ScriptArgs() = %q; want %q", got, want)
	}
}

// TestRedisRateSHA checks that redis_rate's script is found and loaded.
func TestRedisRateSHA(t *testing.T) {
	sha, args, err := RedisRateSHA(context.Background(), redisAddr(t))
	if err != nil {
		t.Fatal(err)
	}
	if len(sha) != 40 || sha == remote.Hash() {
		t.Errorf("RedisRateSHA() = %q; want a SHA1 other than hybridlimit's", sha)
	}
	if want := "1000000000 1000000 1 1"; strings.Join(args, " ") != want {
		t.Errorf("RedisRateSHA() args = %q; want %q", args, want)
	}
}

// TestMeasureMemory measures a few keys of each limiter, on a server of its
// own (MeasureMemory flushes it).
func TestMeasureMemory(t *testing.T) {
	srv := startServer(t)
	for _, name := range MemoryContenders {
		m, err := MeasureMemory(context.Background(), srv, name, 100)
		if err != nil {
			t.Fatalf("MeasureMemory(%s): %v", name, err)
		}
		if m.Keys != 100 || m.Delta <= 0 || m.Usage <= 0 || m.Encoding == "" || m.Value == "" || m.TTL <= 0 {
			t.Errorf("MeasureMemory(%s) = %+v; want 100 keys, positive sizes and a TTL", name, m)
		}
	}
}
