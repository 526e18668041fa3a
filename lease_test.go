package hybridlimit

import (
	"context"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/hybridlimit/hybridlimit/internal/loadgen"
	"github.com/hybridlimit/hybridlimit/internal/redistest"
)

// TestLeaseExactCounts: with leases, 3 instances × 16 goroutines offered
// 3200 attempts on a bucket of 1000 account for exactly its 1000 tokens,
// admitted or still leased (leased tokens are taken from it), with a
// fraction of the script calls.
func TestLeaseExactCounts(t *testing.T) {
	srv := redistest.Start(t)
	const instances, workers, attempts = 3, 16, 3200
	var lims []*Limiter
	for range instances {
		lims = append(lims, newLimiter(t, Config{
			Redis: srv.Client(t), Limit: Limit{Rate: 1e-3, Burst: 1000}, Instances: instances,
			Timeout: 5 * time.Second, Prefix: "lease:",
			// Leases that outlive the test: every leased token is spent.
			Lease: 10, LeaseFor: time.Minute,
		}))
	}
	allowed, modes := spend(t, lims, "bucket", workers, attempts)
	leased, local := modes[ModeLease], attempts-modes[ModeLease]-modes[ModeRemote]
	// An instance whose workers ran out of attempts may still hold leased
	// tokens: every token of the bucket is either admitted or held.
	var held int64
	for _, lim := range lims {
		left, _ := lim.shares.TakeLease(time.Now(), "bucket", lim.limit.Load().rl, 0)
		held += left
	}
	calls := srv.ScriptCalls(t)
	t.Logf("allowed %d of %d, %d leased tokens left; %d decisions from leases; %d script calls",
		allowed, attempts, held, leased, calls)
	if allowed+held != 1000 || local != 0 {
		t.Errorf("allowed %d and %d held, %d decided without Redis; want exactly 1000 in all, none",
			allowed, held, local)
	}
	if leased < allowed/2 || calls > attempts/4 {
		t.Errorf("%d of %d admitted from leases, %d script calls; want at least half from leases, under %d calls",
			leased, allowed, calls, attempts/4)
	}
}

// TestLeaseAccuracy: 3 instances offered 200/s on one key of 100/s with
// Lease 5 admit about the limit in every second after the first: leased
// tokens are taken from the shared bucket, and spent within LeaseFor.
func TestLeaseAccuracy(t *testing.T) {
	withRedis(t, func(t *testing.T, srv *testRedis) {
		var deciders []loadgen.Decide
		for range 3 {
			c := srv.client(t)
			deciders = append(deciders, decider(newLimiter(t, Config{
				Redis: c, Limit: PerSecond(100), Instances: 3, Timeout: 50 * time.Millisecond,
				Prefix: "leaseacc:", Lease: 5,
			})))
		}
		res := loadgen.Run(context.Background(), loadgen.Config{
			Instances: deciders, Workers: 4, Rate: 200, Duration: 4 * time.Second,
		})
		t.Logf("Lease 5:\n%s", loadgen.Table(res.Seconds))
		checkSeconds(t, res.Seconds, "with leases", 1, 3, 90, 110)
		leased := 0
		for _, s := range res.Seconds {
			leased += s.Modes["lease"]
		}
		if leased == 0 {
			t.Errorf("no decision from a lease")
		}
	})
}

// TestLeaseLifecycle, on miniredis with a fake local clock: leased tokens
// are spent without Redis (also while it is away), a refund goes back to
// the lease, and a lease past LeaseFor is not spent.
func TestLeaseLifecycle(t *testing.T) {
	m, c := miniClient(t)
	var mu sync.Mutex
	now := time.Now()
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	advance := func(d time.Duration) { mu.Lock(); now = now.Add(d); mu.Unlock() }
	lim := newLimiter(t, Config{
		Redis: c, Limit: Limit{Rate: 1e-3, Burst: 20}, Lease: 4, LeaseFor: time.Second,
		Heartbeat: -1, Instances: 1, now: clock,
	})
	ctx := context.Background()
	step := func(what string, wantMode Mode, wantAllowed bool, wantRemaining int64) Decision {
		t.Helper()
		d, err := lim.Allow(ctx, "k")
		if err != nil || d.Mode != wantMode || d.Allowed != wantAllowed || d.Remaining != wantRemaining {
			t.Fatalf("%s: Allow = %+v, %v; want %v, allowed %v, remaining %d", what, d, err, wantMode, wantAllowed, wantRemaining)
		}
		return d
	}
	// A decision tells what the caller may still spend: what the lease
	// holds, and what Redis's bucket held (the refill of a token in
	// 1,000 s adds nothing). It falls by one a decision.
	step("first", ModeRemote, true, 4+15) // 1 taken, 4 leased, 15 left in Redis
	counted := lim.count.Load()
	for i := int64(3); i >= 0; i-- {
		step("from the lease", ModeLease, true, i+15)
	}
	// Leased decisions are this instance's traffic, for the fleet's weights.
	if got := lim.count.Load() - counted; got != 4 {
		t.Errorf("4 decisions from the lease counted %d times for the fleet; want 4", got)
	}
	step("lease spent", ModeRemote, true, 4+10)
	d := step("from the second lease", ModeLease, true, 3+10)
	if err := lim.Refund(ctx, "k", d, 1); err != nil {
		t.Fatal(err)
	}
	step("after a refund to the lease", ModeLease, true, 3+10)
	if got, _ := m.Get(lim.cfg.Prefix + "k"); len(got) != 22 {
		t.Fatalf("bucket value %q", got)
	}
	// Redis away: the lease is still spent, then the local share decides.
	m.Close()
	step("lease, Redis away", ModeLease, true, 2+10)
	advance(time.Second) // the lease has expired
	d, err := lim.Allow(ctx, "k")
	if err != nil || d.Mode == ModeLease {
		t.Fatalf("Allow after LeaseFor = %+v, %v; want no lease", d, err)
	}
}

// BenchmarkLeaseCost measures what leases cost below the limit: 3
// instances offered 900/s in all on one key of 1000/s (burst 100) for 3 s,
// for several Config.Lease. Without leases every decision is allowed;
// leased tokens that an instance does not spend within LeaseFor (100 ms)
// are lost, so a lease larger than an instance spends in LeaseFor drains
// the bucket. Run on demand (docs/guide.md quotes it):
//
//	go test -run '^$' -bench LeaseCost -benchtime 1x .
func BenchmarkLeaseCost(b *testing.B) {
	for _, lease := range []int64{0, 10, 30, 100} {
		b.Run("lease="+strconv.FormatInt(lease, 10), func(b *testing.B) {
			for range b.N {
				srv := redistest.Start(b)
				var deciders []loadgen.Decide
				for range 3 {
					c := redis.NewClient(&redis.Options{Addr: srv.Addr()})
					b.Cleanup(func() { c.Close() })
					deciders = append(deciders, decider(newLimiter(b, Config{
						Redis: c, Limit: Limit{Rate: 1000, Burst: 100}, Instances: 3,
						Prefix: "leasecost:", Lease: lease, Heartbeat: -1,
					})))
				}
				calls0 := srv.ScriptCalls(b)
				res := loadgen.Run(context.Background(), loadgen.Config{
					Instances: deciders, Workers: 8, Rate: 900, Duration: 3 * time.Second,
				})
				allowed, total := 0, 0
				for _, s := range res.Seconds {
					allowed += s.Allowed
					total += s.Total()
				}
				calls := srv.ScriptCalls(b) - calls0
				b.Logf("Lease %d: allowed %d of %d (%.1f%%), %d script calls\n%s", lease, allowed, total,
					100*float64(allowed)/float64(total), calls, loadgen.Table(res.Seconds))
				b.ReportMetric(100*float64(allowed)/float64(total), "%allowed")
				b.ReportMetric(float64(calls)/float64(total), "calls/decision")
			}
		})
	}
}

// TestLeaseAfterLimitLowered: a lease taken under a high limit is not
// spent after SetLimit lowers the limit: the bucket in Redis is capped at
// the new burst, and tokens this instance holds leased must not add to it.
func TestLeaseAfterLimitLowered(t *testing.T) {
	m, c := miniClient(t)
	clock := newFakeClock(m) // stands still: no refill, leases never expire
	lim := newLimiter(t, Config{Redis: c, Limit: PerSecond(1000), Lease: 100, Heartbeat: -1, Instances: 1, now: clock.Now})
	ctx := context.Background()
	if d, err := lim.Allow(ctx, "k"); err != nil || !d.Allowed {
		t.Fatalf("Allow = %+v, %v", d, err)
	}
	if err := lim.SetLimit(Limit{Rate: 1, Burst: 10}); err != nil {
		t.Fatal(err)
	}
	admitted := 0
	for range 500 {
		d, err := lim.Allow(ctx, "k")
		if err != nil {
			t.Fatal(err)
		}
		if d.Allowed {
			admitted++
		}
	}
	if admitted > 10 {
		t.Errorf("admitted %d after lowering the limit to burst 10 (the bucket held 899, capped to 10); want at most 10", admitted)
	}
}

// TestLeaseAfterTierDowngrade: the same through LimitFor, a key moved to
// a lower tier (an abusive client demoted) while this instance holds a
// lease of its old tier.
func TestLeaseAfterTierDowngrade(t *testing.T) {
	m, c := miniClient(t)
	clock := newFakeClock(m)
	var demoted atomic.Bool
	tiers := func(string) Limit {
		if demoted.Load() {
			return Limit{Rate: 1, Burst: 5}
		}
		return PerSecond(500)
	}
	lim := newLimiter(t, Config{Redis: c, Limit: PerSecond(1), LimitFor: tiers, Lease: 50, Heartbeat: -1, Instances: 1, now: clock.Now})
	ctx := context.Background()
	if d, err := lim.Allow(ctx, "k"); err != nil || !d.Allowed {
		t.Fatalf("Allow = %+v, %v", d, err)
	}
	demoted.Store(true)
	admitted := 0
	for range 200 {
		if d, err := lim.Allow(ctx, "k"); err != nil {
			t.Fatal(err)
		} else if d.Allowed {
			admitted++
		}
	}
	if admitted > 5 {
		t.Errorf("admitted %d after the key's tier went to burst 5; want at most 5", admitted)
	}
}

// TestLeaseHeldBeyondTheBurst: leased tokens are out of Redis's bucket,
// which refills below its cap while they are held, so at one instant an
// instance can admit its lease and a full bucket: the bound of a window
// is the bucket's plus the tokens leased before it (documented on
// Config.Lease).
func TestLeaseHeldBeyondTheBurst(t *testing.T) {
	m, c := miniClient(t)
	clock := newFakeClock(m)
	lim := newLimiter(t, Config{Redis: c, Limit: Limit{Rate: 100, Burst: 2}, Lease: 1, Heartbeat: -1, Instances: 1, now: clock.Now})
	ctx := context.Background()
	if d, err := lim.Allow(ctx, "k"); err != nil || !d.Allowed || d.Mode != ModeRemote {
		t.Fatalf("Allow = %+v, %v; want allowed by Redis, 1 more leased", d, err)
	}
	clock.Add(20 * time.Millisecond) // the bucket refills to its burst; the lease is still valid
	admitted := 0
	for range 5 {
		d, err := lim.Allow(ctx, "k")
		if err != nil {
			t.Fatal(err)
		}
		if d.Allowed {
			admitted++
		}
	}
	if admitted != 3 {
		t.Errorf("at one instant, %d admitted; want 3: the burst of 2 and the token leased before", admitted)
	}
}

// TestLeaseRemainingFallsByOne: one client alone on PerSecond(100) with
// Lease 5, no time passing: Remaining falls by the one token each decision
// spends, whether Redis decided (and leased) or the lease did. Left out of
// the Redis decision that took it, the lease made Remaining fall by
// 1+Lease at every renewal and rise again at the next decision: 94, 98,
// 97, 96, 95, 94, 88, 92.
func TestLeaseRemainingFallsByOne(t *testing.T) {
	bubble(t, func(t *testing.T) {
		_, lim := waitLimiter(t, Config{Limit: PerSecond(100), Lease: 5, LeaseFor: time.Second, Heartbeat: -1, Instances: 1})
		ctx := context.Background()
		prev := int64(-1)
		var seq []int64
		for i := range 14 {
			d, err := lim.Allow(ctx, "k")
			if err != nil || !d.Allowed {
				t.Fatalf("Allow %d = %+v, %v", i, d, err)
			}
			seq = append(seq, d.Remaining)
			if d.Remaining > 100 || d.Remaining < 0 {
				t.Errorf("decision %d (%v): Remaining %d; want 0 to the burst, 100", i, d.Mode, d.Remaining)
			}
			if prev >= 0 && d.Remaining < prev-1 {
				t.Errorf("decision %d (%v): Remaining fell from %d to %d for one token spent", i, d.Mode, prev, d.Remaining)
			}
			if prev >= 0 && d.Remaining > prev {
				t.Errorf("decision %d (%v): Remaining rose from %d to %d with no time passing", i, d.Mode, prev, d.Remaining)
			}
			prev = d.Remaining
		}
		t.Logf("Remaining: %v", seq)
	})
}

// TestLeaseCountedOnceInRemaining: one instance, a bucket of 100 with no
// refill to speak of, Lease 40. Two decisions on the
// key find no lease and go to Redis at once; Redis runs A first (1 taken,
// 40 leased: 59 left) and B next (1 taken, 40 leased: 18 left), but B's
// answer comes first (A's connection is slower). A's decision added the
// whole lease, B's 40 included, to its level of 59, which still held B's
// 40 tokens: Remaining 100, a full bucket, where 99 were left when A was
// decided (98 in all after B). It counts its own lease, and what was
// leased before it was sent.
func TestLeaseCountedOnceInRemaining(t *testing.T) {
	bubble(t, func(t *testing.T) {
		r, lim := waitLimiter(t, Config{Limit: Limit{Rate: 1e-3, Burst: 100}, Lease: 40, LeaseFor: time.Minute,
			Timeout: time.Second, Heartbeat: -1, Instances: 1})
		ctx := context.Background()
		r.link.SetLatency(10 * time.Millisecond) // A's reply is slow
		var a Decision
		var wg sync.WaitGroup
		wg.Go(func() {
			var err error
			if a, err = lim.Allow(ctx, "k"); err != nil {
				t.Errorf("A: %v", err)
			}
		})
		synctest.Wait() // A ran in Redis, its reply on the way
		r.link.SetLatency(0)
		b, err := lim.Allow(ctx, "k")
		if err != nil {
			t.Fatal(err)
		}
		wg.Wait()
		t.Logf("A: %v Remaining %d; B: %v Remaining %d", a.Mode, a.Remaining, b.Mode, b.Remaining)
		if a.Mode != ModeRemote || b.Mode != ModeRemote {
			t.Fatalf("want both decided by Redis; got %v and %v", a.Mode, b.Mode)
		}
		if a.Remaining != 99 || b.Remaining != 58 {
			t.Errorf("A's Remaining = %d, B's %d; want 99 (the 59 Redis held after A, and A's lease of 40: B's, taken after A ran, is in A's level already) and 58 (18 and B's lease)", a.Remaining, b.Remaining)
		}
	})
}

// TestExpiredLeaseNotInRemaining: Lease 5, LeaseFor 2 ms, and an
// answer that takes 5 ms (Timeout 50 ms). The lease a Redis decision
// takes has expired when its answer comes, and the next decision cannot
// spend it (it goes to Redis again); Remaining counted it, as valid at
// the time the request was sent: 99 where the caller may spend 94, and
// then 93 after one more token.
func TestExpiredLeaseNotInRemaining(t *testing.T) {
	bubble(t, func(t *testing.T) {
		r, lim := waitLimiter(t, Config{Limit: Limit{Rate: 1e-3, Burst: 100}, Lease: 5, LeaseFor: 2 * time.Millisecond,
			Timeout: 50 * time.Millisecond, Heartbeat: -1, Instances: 1})
		ctx := context.Background()
		r.link.SetLatency(5 * time.Millisecond)
		d, err := lim.Allow(ctx, "k")
		if err != nil || d.Mode != ModeRemote {
			t.Fatalf("Allow = %+v, %v", d, err)
		}
		next, err := lim.Allow(ctx, "k")
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("first: %v Remaining %d; next: %v Remaining %d", d.Mode, d.Remaining, next.Mode, next.Remaining)
		if d.Remaining > 94 {
			t.Errorf("Remaining = %d with a lease expired before the answer came; want 94, what Redis holds (the next decision, %v, could not spend the lease)", d.Remaining, next.Mode)
		}
	})
}
