package hybridlimit

import (
	"context"
	"fmt"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"golang.org/x/time/rate"

	"github.com/hybridlimit/hybridlimit/internal/redistest"
	"github.com/hybridlimit/hybridlimit/lua"
	"github.com/hybridlimit/hybridlimit/remote"
)

// openLimiter returns a Limiter whose only node's breaker is open for an
// hour: every decision takes the local path.
func openLimiter(b *testing.B) *Limiter {
	b.Helper()
	c := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", MaxRetries: -1})
	b.Cleanup(func() { c.Close() })
	lim, err := New(Config{Redis: c, Limit: Limit{Rate: 1e9, Burst: 1e9}, Instances: 3,
		Heartbeat: -1, Breaker: BreakerConfig{OpenFor: time.Hour}})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { lim.Close() })
	for lim.single.cb.State().String() != "open" {
		lim.Allow(context.Background(), "warm")
	}
	return lim
}

func benchKeys(n int) []string {
	keys := make([]string, n)
	for i := range keys {
		keys[i] = "user:" + strconv.Itoa(i)
	}
	return keys
}

// BenchmarkLocal measures a decision on the local path (breaker open) and,
// beside it, bare x/time/rate limiters on the same keys: one hot key, and
// 10,000 keys. Run with -cpu 1,2 and see docs/performance.md:
//
//	go test -run xxx -bench 'Local' -benchmem -count 5 .
func BenchmarkLocal(b *testing.B) {
	ctx := context.Background()
	for _, nkeys := range []int{1, 10_000} {
		keys := benchKeys(nkeys)
		b.Run("hybridlimit/keys="+strconv.Itoa(nkeys), func(b *testing.B) {
			lim := openLimiter(b)
			var next atomic.Uint64
			b.ReportAllocs()
			b.SetParallelism(32) // 64 goroutines on 2 CPUs
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				i := int(next.Add(7919))
				for pb.Next() {
					i++
					d, err := lim.Allow(ctx, keys[i%nkeys])
					if err != nil || d.Mode != ModeLocal {
						b.Fatalf("Allow = %+v, %v; want a local decision", d, err)
					}
				}
			})
		})
		b.Run("x-time-rate/keys="+strconv.Itoa(nkeys), func(b *testing.B) {
			lims := make(map[string]*rate.Limiter, nkeys)
			for _, k := range keys {
				lims[k] = rate.NewLimiter(1e9/3, 333_333_333)
			}
			var next atomic.Uint64
			b.ReportAllocs()
			b.SetParallelism(32)
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				i := int(next.Add(7919))
				for pb.Next() {
					i++
					if !lims[keys[i%nkeys]].AllowN(time.Now(), 1) {
						b.Fatal("denied")
					}
				}
			})
		})
	}
}

// BenchmarkLocalSerial is one goroutine on the local path, hot key.
func BenchmarkLocalSerial(b *testing.B) {
	lim := openLimiter(b)
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		lim.Allow(ctx, "hot")
	}
}

// TestLocalPathAllocs: a local decision allocates nothing.
func TestLocalPathAllocs(t *testing.T) {
	for _, hb := range []time.Duration{-1, 0} { // without the fleet heartbeat, and with it (the default)
		c := refused(t)
		lim := newLimiter(t, Config{Redis: c, Limit: PerSecond(1e6), Heartbeat: hb, Instances: 1,
			Breaker: BreakerConfig{OpenFor: time.Hour}})
		ctx := context.Background()
		for lim.single.cb.State().String() != "open" {
			lim.Allow(ctx, "warm")
		}
		lim.Allow(ctx, "k")
		if n := testing.AllocsPerRun(1000, func() { lim.Allow(ctx, "k") }); n != 0 {
			t.Errorf("Heartbeat %v: a local decision allocates %v times; want 0", hb, n)
		}
	}
}

// TestLocalDecisionsCountForTheWeights: what an instance decides locally
// counts for the fleet's weights, as Redis's decisions do: admitted tokens
// count once demand's bounded entries (64 × 1024 keys near their limit in
// a window) are taken, so that an instance deciding locally on many keys
// (one per user or per address) is not counted for fewer than one
// deciding on Redis. Counted as offered and denied, 70,000 keys counted
// about 65,500.
func TestLocalDecisionsCountForTheWeights(t *testing.T) {
	c := refused(t)
	lim := newLimiter(t, Config{Redis: c, Limit: PerSecond(1e6), Instances: 1, Breaker: BreakerConfig{OpenFor: time.Hour}})
	ctx := context.Background()
	for lim.single.cb.State().String() != "open" {
		lim.Allow(ctx, "warm")
	}
	before := lim.count.Load()
	const keys = 70_000
	for i := range keys {
		if d, err := lim.Allow(ctx, "k"+strconv.Itoa(i)); err != nil || !d.Allowed || d.Mode != ModeLocal {
			t.Fatalf("key %d: %+v, %v; want allowed locally", i, d, err)
		}
	}
	if got := lim.count.Load() - before; got != keys {
		t.Errorf("%d keys decided locally counted %d tokens for the weights; want %d", keys, got, keys)
	}
}

// BenchmarkRemotePath is one goroutine's decisions on Redis (a fresh
// redis-server), with the fleet heartbeat on: a hot key, and 10,000 keys
// seen before. Each answer also counts for the instance's part of its key.
//
//	go test -run xxx -bench RemotePath -benchmem .
func BenchmarkRemotePath(b *testing.B) {
	srv := redistest.Start(b)
	ctx := context.Background()
	for _, nkeys := range []int{1, 10_000} {
		b.Run("keys="+strconv.Itoa(nkeys), func(b *testing.B) {
			c := redis.NewClient(&redis.Options{Addr: srv.Addr()})
			b.Cleanup(func() { c.Close() })
			lim := newLimiter(b, Config{Redis: c, Limit: PerSecond(1e9), Instances: 1, Prefix: b.Name() + ":"})
			keys := benchKeys(nkeys)
			for _, k := range keys {
				lim.Allow(ctx, k)
			}
			i := 0
			b.ReportAllocs()
			for b.Loop() {
				i++
				if d, err := lim.Allow(ctx, keys[i%nkeys]); err != nil || d.Mode != ModeRemote {
					b.Fatalf("Allow = %+v, %v; want a remote decision", d, err)
				}
			}
		})
	}
}

// TestRemotePathAllocs: a decision Redis makes allocates at most two
// more times than a bare Script.Run of the same script on the same client
// (the key with its prefix, and gobreaker's ticket), on a client of
// default options (the read on a sender goroutine) and on one with
// ContextTimeoutEnabled (on the caller's); three more with a caller's
// context that can end. A context.WithTimeout for each decision's budget
// made it six, with such a context or without.
func TestRemotePathAllocs(t *testing.T) {
	if raceEnabled {
		// The pipe pools its calls; under the race detector sync.Pool
		// drops a quarter of them, and a dropped call is made again (14
		// or 15 allocations then, at random). scripts/test.sh runs this
		// test without -race too.
		t.Skip("allocation counts of pooled calls are not meaningful under the race detector")
	}
	srv := redistest.Start(t)
	ctx := context.Background()
	rl, err := remote.NewLimit(1e6, 1e9)
	if err != nil {
		t.Fatal(err)
	}
	args := []any{strconv.FormatInt(rl.Q, 10), strconv.FormatInt(rl.P, 10),
		strconv.FormatInt(rl.Cap(), 10), strconv.FormatInt(rl.Units(1), 10)}
	for _, ctxTimeout := range []bool{false, true} {
		c := redis.NewClient(&redis.Options{Addr: srv.Addr(), ContextTimeoutEnabled: ctxTimeout})
		t.Cleanup(func() { c.Close() })
		script, keys := redis.NewScript(lua.TokenBucket), []string{"script:k"}
		bare := testing.AllocsPerRun(200, func() {
			if err := script.Run(ctx, c, keys, args...).Err(); err != nil {
				t.Fatal(err)
			}
		})
		lim := newLimiter(t, Config{Redis: c, Limit: Limit{Rate: 1e6, Burst: 1e9}, Instances: 1, Heartbeat: -1,
			Timeout: time.Second, Prefix: fmt.Sprintf("allocs%v:", ctxTimeout)})
		for range 10 {
			lim.Allow(ctx, "k")
		}
		decisionAllocs := func(ctx context.Context) float64 {
			return testing.AllocsPerRun(200, func() {
				if d, err := lim.Allow(ctx, "k"); err != nil || d.Mode != ModeRemote {
					t.Fatalf("Allow = %+v, %v; want a remote decision", d, err)
				}
			})
		}
		got := decisionAllocs(ctx)
		if got > bare+2 {
			t.Errorf("ContextTimeoutEnabled %v: a remote decision allocates %v times, a bare Script.Run %v; want at most 2 more",
				ctxTimeout, got, bare)
		}
		// A caller's context that can end (a request's) is followed by a
		// context.AfterFunc, which allocates twice.
		live, cancel := context.WithCancel(ctx)
		defer cancel()
		withCancel := decisionAllocs(live)
		if withCancel > bare+3 {
			t.Errorf("ContextTimeoutEnabled %v: a remote decision with a cancelable context allocates %v times, a bare Script.Run %v; want at most 3 more",
				ctxTimeout, withCancel, bare)
		}
		t.Logf("ContextTimeoutEnabled %v: %v allocations a decision (%v with a cancelable context), %v for a bare Script.Run",
			ctxTimeout, got, withCancel, bare)
	}
}

// TestKeySharePathAllocs: a local decision that looks up the key's part
// allocates nothing.
func TestKeySharePathAllocs(t *testing.T) {
	c := refused(t)
	lim := newLimiter(t, Config{Redis: c, Limit: PerSecond(1e6), Instances: 1,
		Breaker: BreakerConfig{OpenFor: time.Hour}})
	ctx := context.Background()
	for lim.single.cb.State().String() != "open" {
		lim.Allow(ctx, "warm")
	}
	lim.view.Store(&fleet{weight: 0.5, size: 2, window: 1_800_000_000, even: 0.045, counted: true})
	lim.shares.Count(time.Now(), "k", lim.limit.Load().rl, 1_000_000, 1, 1, 0, true)
	lim.Allow(ctx, "k")
	if n := testing.AllocsPerRun(1000, func() { lim.Allow(ctx, "k") }); n != 0 {
		t.Errorf("a local decision allocates %v times; want 0", n)
	}
}
