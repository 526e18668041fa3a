package hybridlimit

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/hybridlimit/hybridlimit/breaker"
	"github.com/hybridlimit/hybridlimit/internal/faultproxy"
	"github.com/hybridlimit/hybridlimit/internal/redistest"
	"github.com/hybridlimit/hybridlimit/internal/simnet"
	"github.com/hybridlimit/hybridlimit/internal/simredis"
	"github.com/hybridlimit/hybridlimit/lua"
	"github.com/hybridlimit/hybridlimit/remote"
)

// The conditions of this file are those every production deployment meets
// and a hand-written outage does not: callers with deadlines shorter than
// Timeout, several probes, workers that wait, idle instances, keys whose
// bucket is deleted, pods started during an outage.

// refused returns a client of a port nothing listens on: every call fails
// at once. It retries neither commands nor dials: with go-redis's
// defaults a failed call takes about a second of back-offs, so each
// limiter's first contact lasted coldFor and newLimiter waited for it.
func refused(t *testing.T) *redis.Client {
	t.Helper()
	c := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", MaxRetries: -1, DialerRetries: 1})
	t.Cleanup(func() { c.Close() })
	return c
}

// TestShortDeadlinesOpenTheBreaker: callers whose deadline (30 ms) is
// shorter than Timeout (50 ms), against a Redis that does not answer, still
// open the breaker after Breaker.Failures calls and get the failure
// policy's decision, with a nil error, within their deadline.
func TestShortDeadlinesOpenTheBreaker(t *testing.T) {
	srv := redistest.Start(t)
	lim := newLimiter(t, Config{Redis: srv.Client(t), Limit: PerSecond(1000), Instances: 1, Heartbeat: -1})
	if d, err := lim.Allow(context.Background(), "k"); err != nil || d.Mode != ModeRemote {
		t.Fatalf("Allow before the pause = %+v, %v; want remote", d, err)
	}
	srv.Pause(t)
	defer srv.Resume(t)
	const deadline = 30 * time.Millisecond
	local, errs := 0, 0
	for i := range 40 {
		ctx, cancel := context.WithTimeout(context.Background(), deadline)
		start := time.Now()
		d, err := lim.Allow(ctx, "k")
		took := time.Since(start)
		cancel()
		// Until the breaker opens, a caller whose own deadline passed
		// (a stall of this machine past the budget's tenth of slack) may
		// get its context's error; after, never.
		if err != nil {
			errs++
			if i >= DefaultBreakerFailures || errs > DefaultBreakerFailures {
				t.Errorf("call %d: Allow = %v; want the failure policy's decision", i, err)
			}
		}
		if took > deadline+latencyMargin {
			t.Errorf("call %d took %v; want within its deadline %v (+%v)", i, took, deadline, latencyMargin)
		}
		if d.Mode == ModeLocal {
			local++
		}
	}
	if local+errs != 40 || local < 40-DefaultBreakerFailures {
		t.Errorf("%d of 40 decisions local, %d errors; want 40 local, or a few errors before the breaker opened", local, errs)
	}
	if st := lim.Stats().Breakers; st[srv.Addr()] != "open" {
		t.Errorf("breakers %v; want %s open", st, srv.Addr())
	}
}

// TestWaitNBeyondTheShare: during an outage, n larger than the local
// share's burst gets a finite RetryAfter (until the next probe), and WaitN
// sleeps on it rather than spinning, and says at once when its deadline
// cannot be met.
func TestWaitNBeyondTheShare(t *testing.T) {
	obs := &countingObserver{}
	lim := newLimiter(t, Config{Redis: refused(t), Limit: PerSecond(10), Instances: 3, Observer: obs})
	ctx := context.Background()
	d, err := lim.AllowN(ctx, "k", 5) // the share holds 3
	if err != nil || d.Allowed || d.RetryAfter <= 0 || d.RetryAfter > time.Second {
		t.Fatalf("AllowN(5) on a share of 3 = %+v, %v; want denied with a RetryAfter in (0, 1s]", d, err)
	}
	wctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	start := time.Now()
	err = lim.WaitN(wctx, "k", 5)
	if took := time.Since(start); err == nil || took > 300*time.Millisecond+latencyMargin {
		t.Errorf("WaitN(5) = %v after %v; want an error within its 300 ms deadline", err, took)
	}
	if n := obs.decisions.Load(); n > 20 {
		t.Errorf("WaitN made %d decisions in 300 ms; want a few (it must sleep, not spin)", n)
	}
}

// TestProbesCloseTheBreaker: with Breaker.Probes 3, the prober sends all
// three, and the breaker closes soon after Redis is back.
func TestProbesCloseTheBreaker(t *testing.T) {
	m, c := miniClient(t)
	lim := newLimiter(t, Config{Redis: c, Limit: PerSecond(100), Instances: 1, Heartbeat: -1,
		Breaker: BreakerConfig{Failures: 2, OpenFor: 50 * time.Millisecond, Jitter: -1, Probes: 3}})
	ctx := context.Background()
	m.SetError("LOADING Redis is loading the dataset in memory")
	for range 2 {
		lim.Allow(ctx, "k")
	}
	if st := lim.Stats().Breakers; st[m.Addr()] != "open" {
		t.Fatalf("breakers %v after 2 failures; want open", st)
	}
	m.SetError("")
	healed := time.Now()
	for {
		d, err := lim.Allow(ctx, "k")
		if err != nil {
			t.Fatal(err)
		}
		if d.Mode == ModeRemote {
			break
		}
		if time.Since(healed) > time.Second {
			t.Fatalf("still %v a second after Redis was back, breakers %v; want remote within 50 ms + 3 probes", d.Mode, lim.Stats().Breakers)
		}
		time.Sleep(5 * time.Millisecond)
	}
	t.Logf("back to Redis %v after it healed", time.Since(healed).Round(time.Millisecond))
}

// TestCachedDenialsEveryLimit: denials are answered without a round trip
// for every limit, also those whose rate the fixed point holds one rounding
// step away from the user's float (PerMinute(5), a rate of 1/3), and they
// say so.
func TestCachedDenialsEveryLimit(t *testing.T) {
	// In a bubble time stands still (every denial is due) while the
	// simulated Redis answers in virtual time: 1,001 limiters cost a
	// fraction of what they cost on miniredis's Lua under -race.
	bubble(t, func(t *testing.T) {
		c := simClient(t)
		ctx := context.Background()
		limits := []Limit{{Rate: 1.0 / 3, Burst: 3}}
		for n := int64(1); n <= 1000; n++ {
			limits = append(limits, PerMinute(n))
		}
		var uncached []Limit
		for _, l := range limits {
			// A budget a busy machine cannot miss: a denial decided locally
			// would record nothing to answer the next one from.
			lim := newLimiter(t, Config{Redis: c, Limit: l, Instances: 1, Heartbeat: -1, Timeout: 5 * time.Second})
			key := l.String()
			if d, err := lim.AllowN(ctx, key, l.Burst); err != nil || !d.Allowed {
				t.Fatalf("%v: AllowN(burst) = %+v, %v", l, d, err)
			}
			lim.Allow(ctx, key) // denied by Redis: what it says is recorded
			// Cached is set only on the path that returns before any call to
			// Redis (a count of the server's commands would also count the
			// scripts New loads in the background).
			d, err := lim.Allow(ctx, key)
			if err != nil || d.Allowed || !d.Cached || d.Mode != ModeRemote {
				uncached = append(uncached, l)
			}
			lim.Close()
		}
		if len(uncached) > 0 {
			t.Errorf("%d of %d limits sent a denial to Redis, or did not mark it Cached: %v", len(uncached), len(limits), uncached[:min(len(uncached), 10)])
		}
	})
}

// TestCachedDenialsExpire: after the key is deleted (an operator's DEL,
// Redis losing its data), a cached denial stands for at most a second.
func TestCachedDenialsExpire(t *testing.T) {
	m, c := miniClient(t)
	clock := newFakeClock(m)
	lim := newLimiter(t, Config{Redis: c, Limit: PerMinute(1), Instances: 1, Heartbeat: -1, now: clock.Now,
		Prefix: "x:"})
	ctx := context.Background()
	lim.Allow(ctx, "k")
	lim.Allow(ctx, "k") // denied by Redis, for a minute
	if d, _ := lim.Allow(ctx, "k"); d.Allowed || !d.Cached {
		t.Fatalf("Allow = %+v; want a cached denial", d)
	}
	m.Del("x:k")
	clock.Add(1100 * time.Millisecond)
	if d, err := lim.Allow(ctx, "k"); err != nil || !d.Allowed || d.Mode != ModeRemote {
		t.Errorf("Allow 1.1 s after the key was deleted = %+v, %v; want allowed by Redis", d, err)
	}
}

// TestReconcileChargesOwnSpending: an instance holding a hundredth of the
// limit that spent one token during an outage charges Redis one token, not
// the whole burst.
func TestReconcileChargesOwnSpending(t *testing.T) {
	m, c := miniClient(t)
	lim := newLimiter(t, Config{Redis: c, Limit: Limit{Rate: 100.0 / 3600, Burst: 100}, Instances: 100,
		Heartbeat: -1, Breaker: BreakerConfig{OpenFor: 20 * time.Millisecond}})
	ctx := context.Background()
	// An answer that the node cannot decide (OOM): the decisions fail at
	// once, and none is left unanswered (which Redis might still run, and
	// which go-redis retries for LOADING or READONLY).
	m.SetError("OOM command not allowed when used memory > 'maxmemory'.")
	allowed := 0
	for range 10 {
		if d, _ := lim.Allow(ctx, "k"); d.Allowed {
			allowed++
		}
	}
	if allowed != 1 {
		t.Fatalf("%d allowed locally on a share of one token; want 1", allowed)
	}
	m.SetError("")
	waitRemote(t, lim, "other")
	if d, err := lim.AllowN(ctx, "k", 99); err != nil || !d.Allowed {
		t.Errorf("AllowN(99) after the outage = %+v, %v; want allowed: the instance spent 1 of 100", d, err)
	}
}

// waitRemote waits until a decision on key is Redis's again.
func waitRemote(t *testing.T, lim *Limiter, key string) {
	t.Helper()
	for start := time.Now(); ; time.Sleep(5 * time.Millisecond) {
		if d, err := lim.Allow(context.Background(), key); err == nil && d.Mode == ModeRemote {
			return
		}
		if time.Since(start) > 2*time.Second {
			t.Fatalf("not back to Redis 2 s after it healed: %v", lim.Stats().Breakers)
		}
	}
}

// TestTimeoutsAreCharged: decisions that time out now and then, too few to
// open the breaker, are decided locally and then charged to Redis, so a
// key at its limit does not get the local share on top of it.
func TestTimeoutsAreCharged(t *testing.T) {
	srv := redistest.Start(t)
	px := faultproxy.Start(t, srv.Addr())
	limit := Limit{Rate: 10.0 / 3600, Burst: 10}
	lim := newLimiter(t, Config{Redis: clients(t, px.Addr(), 1)[0], Limit: limit,
		Instances: 1, Heartbeat: -1, Timeout: 50 * time.Millisecond, Breaker: BreakerConfig{Failures: 100}})
	ctx := context.Background()
	if d, err := lim.AllowN(ctx, "k", 4); err != nil || !d.Allowed || d.Mode != ModeRemote {
		t.Fatalf("AllowN(4) = %+v, %v; want allowed by Redis", d, err)
	}
	px.SetDelay(150 * time.Millisecond)
	for i := range 3 {
		if d, err := lim.Allow(ctx, "k"); err != nil || !d.Allowed || d.Mode != ModeLocal {
			t.Fatalf("timed-out Allow %d = %+v, %v; want allowed locally", i, d, err)
		}
	}
	px.SetDelay(0)
	// Redis runs the three late calls (3 left), and the three local
	// admissions are charged (0 left). An onlooker with a budget no busy
	// machine overruns reads the bucket without spending; a charge that
	// a busy machine delays goes again, so the onlooker reads until the
	// bucket is empty or the charges have had ample time.
	onlooker := newLimiter(t, Config{Redis: srv.Client(t), Limit: limit, Prefix: t.Name() + ":",
		Instances: 1, Heartbeat: -1, Timeout: 2 * time.Second})
	var st Status
	for deadline := time.Now().Add(reconcileAfter + 3*time.Second); ; {
		var err error
		st, err = onlooker.Peek(ctx, "k")
		if err != nil || st.Mode != ModeRemote {
			t.Fatalf("Peek = %+v, %v; want Redis's bucket", st, err)
		}
		if st.Tokens < 1 || time.Now().After(deadline) {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if st.Tokens >= 1 {
		t.Errorf("bucket after the time-outs holds %.3f tokens; want < 1: 4 + 3 late + 3 local spent", st.Tokens)
	}
}

// TestNewPodDuringOutage: an instance that starts while Redis is away and
// is not told how many share the limit holds nothing (the instances that
// heard from the fleet hold it all); told Instances, it holds its share.
func TestNewPodDuringOutage(t *testing.T) {
	ctx := context.Background()
	unknown := newLimiter(t, Config{Redis: refused(t), Limit: PerSecond(100)})
	if d, err := unknown.Allow(ctx, "k"); err != nil || d.Allowed || d.Mode != ModeLocal || d.RetryAfter <= 0 {
		t.Errorf("Allow on a pod that never heard of its fleet = %+v, %v; want denied locally with a RetryAfter", d, err)
	}
	now := time.Now()
	told := newLimiter(t, Config{Redis: refused(t), Limit: PerSecond(100), Instances: 4,
		now: func() time.Time { return now }})
	allowed := 0
	for range 100 {
		if d, _ := told.Allow(ctx, "k"); d.Allowed {
			allowed++
		}
	}
	if allowed != 25 {
		t.Errorf("a pod told of 4 instances allowed %d of 100 at once; want 25", allowed)
	}
	if _, err := New(Config{Redis: refused(t), Limit: PerSecond(1), Heartbeat: -1}); err == nil {
		t.Errorf("New with FailLocal, no heartbeat and no Instances = nil error; want ErrInvalidConfig")
	}
}

// TestColdStart: decisions made at once after New, on a Cluster the client
// has never reached, wait at most their budget (the layout and the scripts
// load in the background), return no error, and do not open a breaker
// however slow the first contact is. Simulated Cluster at virtual time,
// every reply 20 ms late: the limiter's first contact (the layout, the
// scripts, the connections each pipe keeps busy, dialed with HELLO) takes
// several budgets of 50 ms, as it did on a busy machine against a real
// Cluster, where the test measured the machine's load as much as the
// limiter.
func TestColdStart(t *testing.T) {
	clientKinds(t, func(t *testing.T, ctxTimeout bool) {
		t.Cleanup(func() { time.Sleep(30 * time.Second) }) // go-redis's back-offs and reloads, last
		cl := simredis.NewCluster(3, func(slot int) int { return slot * 3 / remote.Slots })
		t.Cleanup(cl.Close)
		const timeout = DefaultTimeout
		var lims []*Limiter
		for i := range 3 {
			links := make([]*simnet.Link, len(cl.Nodes))
			for j := range links {
				links[j] = simnet.NewLink()
				links[j].SetLatency(20 * time.Millisecond)
			}
			client := redis.NewClusterClient(&redis.ClusterOptions{Addrs: cl.Addrs(), Dialer: cl.Dialer(links, i), ContextTimeoutEnabled: ctxTimeout})
			t.Cleanup(func() { client.Close() })
			// go-redis reads COMMAND on a Cluster client's first command,
			// holding a mutex across the round trip: a goroutine waiting on
			// a mutex is not durably blocked, so in the bubble concurrent
			// first commands would stop virtual time. The client's first
			// command goes first, alone; the limiter's first contact (the
			// layout, the scripts, the connections) is still all ahead.
			_ = client.Ping(context.Background()).Err()
			lim, err := New(Config{Redis: client, Limit: PerSecond(1e6), Instances: 3, Timeout: timeout})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { lim.Close() })
			lims = append(lims, lim)
		}
		var wg sync.WaitGroup
		var remoteN atomic.Int64
		for _, lim := range lims {
			for w := range 8 {
				wg.Go(func() {
					for i := range 20 {
						start := time.Now()
						d, err := lim.Allow(context.Background(), fmt.Sprintf("k%d-%d", w, i))
						if err != nil {
							t.Errorf("Allow = %v; want a decision", err)
						}
						if took := time.Since(start); took > timeout {
							t.Errorf("a cold decision took %v; want within its budget %v", took, timeout)
						}
						if d.Mode == ModeRemote {
							remoteN.Add(1)
						}
					}
				})
			}
		}
		wg.Wait()
		for i, lim := range lims {
			for addr, st := range lim.Stats().Breakers {
				if st != "closed" {
					t.Errorf("instance %d: breaker of %s %s after a cold start; want closed", i, addr, st)
				}
			}
		}
		// Once the first contact is over, Redis decides: the budget
		// holds two round trips.
		if remoteN.Load() == 0 {
			t.Errorf("no decision of %d by Redis; want those after the first contact", 3*8*20)
		}
	})
}

// TestReconnectsOffTheDecisions: every reply 20 ms late, a budget of 50 ms,
// and every connection reset (a restart, a failover, a proxy's idle
// reset). A call that must open its connection pays the dial, go-redis's
// handshake and itself: three round trips and more, past its budget. A
// client with ContextTimeoutEnabled then closes the connection at the
// deadline, so each decision and each probe lost the connection it had
// opened, and the breaker never closed again: 0 remote decisions in the
// five seconds after the reset. The connections are opened again in the
// background, where they get the time they take.
func TestReconnectsOffTheDecisions(t *testing.T) {
	clientKinds(t, func(t *testing.T, ctxTimeout bool) {
		t.Cleanup(func() { time.Sleep(30 * time.Second) }) // go-redis's dial back-offs, last
		sim, link := simredis.New(), simnet.NewLink()
		t.Cleanup(sim.Close)
		link.SetLatency(20 * time.Millisecond)
		c := redis.NewClient(&redis.Options{Addr: "10.0.0.1:6379", ContextTimeoutEnabled: ctxTimeout,
			Dialer: link.Dialer(func(c net.Conn) { sim.Serve(c, 0) })})
		t.Cleanup(func() { c.Close() })
		lim := newLimiter(t, Config{Redis: c, Limit: PerSecond(1e6), Instances: 1, Heartbeat: -1})
		reconnectsAfterReset(t, lim, []*simnet.Link{link})
	})
}

// TestReconnectsOffTheDecisionsOnCluster is TestReconnectsOffTheDecisions
// on a Cluster: the connections a reset broke are those of the key's
// master, which a ClusterClient pools apart from the other nodes'.
func TestReconnectsOffTheDecisionsOnCluster(t *testing.T) {
	clientKinds(t, func(t *testing.T, ctxTimeout bool) {
		_, links, lim := onSimCluster(t, Config{Limit: PerSecond(1e6), Instances: 1, Heartbeat: -1}, ctxTimeout)
		for _, l := range links {
			l.SetLatency(20 * time.Millisecond)
		}
		reconnectsAfterReset(t, lim, links)
	})
}

// reconnectsAfterReset checks that every decision of lim in a second is
// Redis's, then resets every connection of links (each 20 ms from Redis,
// against lim's 50 ms budget), and checks that every decision of the
// second and third seconds after the reset is Redis's again.
func reconnectsAfterReset(t *testing.T, lim *Limiter, links []*simnet.Link) {
	time.Sleep(2 * time.Second) // the first contact is over
	second := func() (remoteN, all int) {
		for end := time.Now().Add(time.Second); time.Now().Before(end); all++ {
			d, err := lim.Allow(context.Background(), "k")
			if err != nil {
				t.Fatalf("Allow = %v; want a decision", err)
			}
			if d.Mode == ModeRemote {
				remoteN++
			} else {
				time.Sleep(time.Millisecond)
			}
		}
		return remoteN, all
	}
	if r, all := second(); r != all {
		t.Fatalf("before the reset: %d of %d decisions by Redis; want all", r, all)
	}
	for _, l := range links {
		l.Reset()
	}
	second() // the connections are opened again
	for s := 2; s <= 3; s++ {
		if r, all := second(); r != all {
			t.Errorf("second %d after the reset: %d of %d decisions by Redis (breakers %v); want all", s, r, all, lim.Stats().Breakers)
		}
	}
}

// TestOneTripCountsOnce: the calls of one batch that Redis does not answer
// count once against the node's breaker (remote.TestOneClaimPerTrip). A
// caller of the batch that cancelled, whose failure is its own and not
// Redis's, does not take that one count from the others, nor does a charge
// sent in the batch, whose verdict no breaker is told: the round trip would
// then count for nothing.
func TestOneTripCountsOnce(t *testing.T) {
	lim := newLimiter(t, Config{Redis: refused(t), Limit: PerSecond(10), Instances: 1, Heartbeat: -1})
	bubble(t, func(t *testing.T) {
		const n = 5
		errs := make([]error, n)
		ctxs := make([]context.Context, n)
		link := simnet.NewLink()
		c := redis.NewClient(&redis.Options{
			Addr: "10.0.0.1:6379",
			Dialer: func(context.Context, string, string) (net.Conn, error) {
				return link.Dial(func(c net.Conn) { go io.Copy(io.Discard, c) }) // reads, never answers
			},
		})
		defer c.Close()
		p := remote.NewPipe(c, 1, nil)
		defer p.Close()
		rl, _ := remote.NewLimit(10, 10)
		start := time.Now()
		var wg sync.WaitGroup
		// The first call holds the pipe's only slot until its deadline; the
		// next five queue meanwhile and go out together. The first of them
		// is cancelled by its caller at 200 ms, the others end at 300 ms.
		wg.Go(func() {
			_, _ = p.Do(context.Background(), remote.Request{Key: "a", Limit: rl, Units: rl.Units(1), Deadline: start.Add(100 * time.Millisecond)})
		})
		time.Sleep(10 * time.Millisecond)
		for i := range n {
			ctx := context.Background()
			if i == 0 {
				var cancel context.CancelFunc
				ctx, cancel = context.WithCancel(ctx)
				time.AfterFunc(200*time.Millisecond, cancel)
			}
			ctxs[i] = ctx
			wg.Go(func() {
				_, errs[i] = p.Do(ctx, remote.Request{Key: fmt.Sprint("k", i), Limit: rl, Units: rl.Units(1), Deadline: start.Add(300 * time.Millisecond)})
			})
		}
		wg.Wait()
		failures := 0
		for i, err := range errs {
			o, verdict := lim.classify(ctxs[i], err, lim.cfg.Timeout)
			switch i {
			case 0:
				if o != callerGone || verdict != breaker.Excluded {
					t.Errorf("the cancelled caller's call (%v): %v, %v; want caller gone, excluded", err, o, verdict)
				}
			case 1:
				if verdict != breaker.Failure {
					t.Errorf("the charge (%v): %v; want a failure", err, verdict)
				}
				if v := ticketVerdict(err, verdict, false); v != breaker.Excluded {
					t.Errorf("the charge (%v) tells a ticket %v; want excluded", err, v)
				}
				continue
			}
			switch verdict = ticketVerdict(err, verdict, true); verdict {
			case breaker.Failure:
				failures++
			case breaker.Excluded:
			default:
				t.Errorf("call %d (%v): %v; want a failure or excluded", i, err, verdict)
			}
		}
		if failures != 1 {
			t.Errorf("one unanswered round trip of %d calls, %d of them decisions, counted %d failures; want 1", len(errs), len(errs)-2, failures)
		}
	})
}

// TestFirstContactDials: once the first contact is over, the client's pool
// holds the connections a node's pipe keeps busy at once, so that the
// first decisions do not dial them inside their budgets (on a busy
// machine that opens breakers: TestColdStart).
func TestFirstContactDials(t *testing.T) {
	withRedis(t, func(t *testing.T, r *testRedis) {
		c := r.client(t)
		newLimiter(t, Config{Redis: c, Limit: PerSecond(10), Instances: 1, Heartbeat: -1})
		if n := c.PoolStats().TotalConns; n < remote.DefaultInFlight {
			t.Errorf("%d connections after the first contact; want at least %d", n, remote.DefaultInFlight)
		}
	})
}

// TestWaitNFairness: 12 workers on 3 instances wait on one key for 4 s,
// one of them for 5 tokens at a time and the others for 1. The one that asks for
// more is not starved, the limit holds, and Redis runs about one script
// call per grant, not one per waiter per refilled token.
func TestWaitNFairness(t *testing.T) {
	withRedis(t, func(t *testing.T, srv *testRedis) {
		const rate, burst = 20, 10
		var lims []*Limiter
		for range 3 {
			lims = append(lims, newLimiter(t, Config{Redis: srv.client(t), Limit: Limit{Rate: rate, Burst: burst},
				Instances: 3, Heartbeat: -1, Timeout: time.Second}))
		}
		ctx, cancel := context.WithTimeout(context.Background(), 4*time.Second)
		defer cancel()
		before := srv.scriptCalls(t)
		var wg sync.WaitGroup
		var tokens, grants, big atomic.Int64
		for i, lim := range lims {
			for w := range 4 {
				n := int64(1)
				if i == 0 && w == 0 {
					n = 5
				}
				wg.Go(func() {
					for ctx.Err() == nil {
						if err := lim.WaitN(ctx, "w", n); err != nil {
							return
						}
						tokens.Add(n)
						grants.Add(1)
						if n == 5 {
							big.Add(1)
						}
					}
				})
			}
		}
		wg.Wait()
		calls := srv.scriptCalls(t) - before
		t.Logf("4 s, 12 waiters: %d tokens in %d grants (%d of them of 5 tokens), %d script calls", tokens.Load(), grants.Load(), big.Load(), calls)
		if max := int64(rate*4 + burst); tokens.Load() > max {
			t.Errorf("granted %d tokens in 4 s; want at most %d", tokens.Load(), max)
		}
		if big.Load() < 3 {
			t.Errorf("the waiter for 5 tokens was granted %d times in 4 s; want at least 3 (its turn comes every 16 tokens, 0.8 s)", big.Load())
		}
		if calls > 2*grants.Load()+12 {
			t.Errorf("%d script calls for %d grants; want at most 2 per grant (and one last call per waiter)", calls, grants.Load())
		}
	})
}

// TestRefundKeepsOffAnOpenBreaker: a Refund while the node's breaker is
// not closed goes nowhere: it neither takes the half-open ticket, which
// would close the breaker on the refund's success before the local
// spending was charged, nor reaches Redis.
func TestRefundKeepsOffAnOpenBreaker(t *testing.T) {
	m, c := miniClient(t)
	lim := newLimiter(t, Config{Redis: c, Limit: PerSecond(10), Instances: 1, Heartbeat: -1,
		Breaker: BreakerConfig{Failures: 1, OpenFor: 10 * time.Millisecond, Jitter: -1}})
	ctx := context.Background()
	d, err := lim.AllowN(ctx, "k", 10)
	if err != nil || !d.Allowed || d.Mode != ModeRemote {
		t.Fatalf("AllowN(10) = %+v, %v; want allowed by Redis", d, err)
	}
	// Open the breaker without a failed call, so that the prober has no
	// key to probe and leaves it alone.
	ticket, ok := lim.single.cb.Allow()
	if !ok {
		t.Fatal("breaker closed but Allow refused")
	}
	ticket.Done(breaker.Failure)
	time.Sleep(20 * time.Millisecond) // past the open period: the next Allow would be a probe
	before := m.CommandCount()
	if err := lim.Refund(ctx, "k", d, 5); err != nil {
		t.Fatal(err)
	}
	if st := lim.single.cb.State(); st == breaker.StateClosed {
		t.Errorf("breaker %v after a Refund while open; want it not closed by the refund", st)
	}
	if n := m.CommandCount() - before; n != 0 {
		t.Errorf("Redis got %d commands from a Refund while the breaker was open; want none", n)
	}
}

// takeCounter counts the token-bucket scripts a client sends, alone or in
// pipelines.
type takeCounter struct{ takes atomic.Int64 }

func isTake(cmd redis.Cmder) bool {
	args := cmd.Args()
	if len(args) < 2 {
		return false
	}
	s, _ := args[1].(string)
	fn, _ := remote.FunctionNames()
	return s == remote.Hash() || s == lua.TokenBucket || s == fn // EVALSHA, EVAL, FCALL
}

func (h *takeCounter) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *takeCounter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if isTake(cmd) {
			h.takes.Add(1)
		}
		return next(ctx, cmd)
	}
}

func (h *takeCounter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		for _, cmd := range cmds {
			if isTake(cmd) {
				h.takes.Add(1)
			}
		}
		return next(ctx, cmds)
	}
}

// TestDecisionsRunLaterHooks: a hook added to the client after New (a
// user's tracing, say) sees every decision, including those sent alone
// from the caller's goroutine on a default client.
func TestDecisionsRunLaterHooks(t *testing.T) {
	srv := redistest.Start(t)
	c := srv.Client(t)
	lim := newLimiter(t, Config{Redis: c, Limit: PerSecond(1000), Instances: 1, Heartbeat: -1})
	var hook takeCounter
	c.AddHook(&hook)
	const n = 20
	for i := range n {
		if d, err := lim.Allow(context.Background(), "k"); err != nil || d.Mode != ModeRemote {
			t.Fatalf("Allow %d = %+v, %v; want remote", i, d, err)
		}
	}
	if got := hook.takes.Load(); got != n {
		t.Errorf("the hook added after New saw %d of %d decisions; want all", got, n)
	}
}

// onSimWaiter runs f in a synctest bubble on a simulated Redis whose
// replies come 20 ms late, with a Limiter of 10/s, burst 1, whose bucket
// is empty.
func onSimWaiter(t *testing.T, f func(t *testing.T, r *testRedis, lim *Limiter)) {
	bubble(t, func(t *testing.T) {
		r := &testRedis{sim: simredis.New(), link: simnet.NewLink()}
		t.Cleanup(r.sim.Close)
		// No heartbeat: the tests count the server's script calls.
		lim, err := New(Config{Redis: r.client(t), Limit: Limit{Rate: 10, Burst: 1}, Timeout: 200 * time.Millisecond,
			Heartbeat: -1, Instances: 1})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { lim.Close() })
		ctx := context.Background()
		if d, err := lim.Allow(ctx, "k"); err != nil || !d.Allowed {
			t.Fatalf("first token: %+v, %v", d, err)
		}
		// Once the first contact's connections are open (a decision that
		// must dial would be answered late), the refilled token is taken
		// too, and replies come 20 ms late.
		time.Sleep(time.Second)
		if d, err := lim.Allow(ctx, "k"); err != nil || !d.Allowed {
			t.Fatalf("the refilled token: %+v, %v", d, err)
		}
		r.link.SetLatency(20 * time.Millisecond)
		f(t, r, lim)
	})
}

// TestWaitNReservationPastDeadline: a WaitN's reservation is sized to its
// deadline when the call is sent, and the round trip spends some of what
// is left. A waiter whose reserved tokens fall due after its deadline must
// give them back and return at once, as its doc promises, not hold them
// until the deadline: the waiters queued behind it would wait for them.
func TestWaitNReservationPastDeadline(t *testing.T) {
	onSimWaiter(t, func(t *testing.T, r *testRedis, lim *Limiter) {
		ctx := context.Background()
		// Sent with 100 ms left (a token's refill), the reservation owes
		// a token (100 ms), and its answer comes back with 80 ms left.
		wctx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
		defer cancel()
		before := r.sim.Calls()
		start := time.Now()
		err := lim.Wait(wctx, "k")
		took := time.Since(start)
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Wait = %v; want context.DeadlineExceeded", err)
		}
		if took > 30*time.Millisecond {
			t.Errorf("Wait returned after %v; want at the reservation's answer, 20 ms, with the give-back in the background", took)
		}
		time.Sleep(60 * time.Millisecond) // the give-back lands
		if calls := r.sim.Calls() - before; calls != 2 {
			t.Errorf("the server ran %d script calls for the Wait; want 2, the reservation and its give-back", calls)
		}
	})
}

// TestWaitNCancelledReturnsAtOnce: a WaitN whose context ends while it
// sleeps for its reservation gives the tokens back, and returns when the
// context ends, not a round trip to Redis later.
func TestWaitNCancelledReturnsAtOnce(t *testing.T) {
	onSimWaiter(t, func(t *testing.T, r *testRedis, lim *Limiter) {
		ctx := context.Background()
		// The reservation is answered at 20 ms, its tokens due at
		// 100 ms; the context ends at 50 ms.
		wctx, cancel := context.WithCancel(ctx)
		time.AfterFunc(50*time.Millisecond, cancel)
		before := r.sim.Calls()
		start := time.Now()
		err := lim.Wait(wctx, "k")
		took := time.Since(start)
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("Wait = %v; want context.Canceled", err)
		}
		if took != 50*time.Millisecond {
			t.Errorf("Wait returned %v after its start; want when its context ended, 50 ms (the give-back's round trip is 20 ms)", took)
		}
		time.Sleep(100 * time.Millisecond) // the give-back lands
		if calls := r.sim.Calls() - before; calls != 2 {
			t.Errorf("the server ran %d script calls for the Wait; want 2, the reservation and its give-back", calls)
		}
	})
}

// TestWaitNReturnsAtClose: a WaitN sleeping between tries (its queue in
// Redis is full, or the local share is empty during an outage) sleeps up
// to maxWaitStep, a minute, before it tries again and meets ErrClosed; one
// granted a reservation sleeps until its tokens are due, here a minute. A
// service that closes its limiter on shutdown then has callers blocked in
// WaitN for up to a minute after Close returned: Close must wake both
// with ErrClosed.
func TestWaitNReturnsAtClose(t *testing.T) {
	bubble(t, func(t *testing.T) {
		c := simClient(t)
		lim, err := New(Config{Redis: c, Limit: PerMinute(10), Heartbeat: -1, Instances: 1})
		if err != nil {
			t.Fatal(err)
		}
		defer lim.Close()
		ctx := context.Background()
		if d, err := lim.AllowN(ctx, "k", 10); err != nil || !d.Allowed || d.Mode != ModeRemote {
			t.Fatalf("AllowN(10) = %+v, %v; want allowed by Redis", d, err)
		}
		// A waiter reserves the next 10 tokens, a minute of refill: the
		// queue is a burst deep, full.
		first := make(chan error, 1)
		var firstReturned time.Duration
		go func() {
			start := time.Now()
			err := lim.WaitN(ctx, "k", 10)
			firstReturned = time.Since(start)
			first <- err
		}()
		defer func() {
			// Granted before Close, due a minute on: it ends at Close.
			if err := <-first; !errors.Is(err, ErrClosed) || firstReturned > 2*time.Second+10*time.Millisecond {
				t.Errorf("WaitN(10) granted before Close = %v, %v after it started (Close came 2 s in); want ErrClosed at Close", err, firstReturned)
			}
		}()
		time.Sleep(time.Second)
		// The next waiter is refused, then granted one place deeper
		// (due in 66 s); the one after it is refused at that depth too
		// and sleeps until there is room, 6 s.
		done := make(chan error, 2)
		var returned [2]atomic.Int64
		for i := range 2 {
			go func() {
				start := time.Now()
				err := lim.Wait(ctx, "k")
				returned[i].Store(int64(time.Since(start)))
				done <- err
			}()
			time.Sleep(time.Millisecond)
		}
		time.Sleep(time.Second)
		lim.Close()
		for range 2 {
			err = <-done
			if !errors.Is(err, ErrClosed) {
				t.Errorf("Wait blocked at Close returned %v; want ErrClosed", err)
			}
		}
		for i := range returned {
			if took := time.Duration(returned[i].Load()); took > time.Second+10*time.Millisecond {
				t.Errorf("waiter %d returned %v after it started (Close came 1 s in); want at Close", i, took)
			}
		}
	})
}

// unboundedClient returns, for a test inside a bubble, a client of a
// fresh simulated Redis that bounds no read (ReadTimeout -1, without
// ContextTimeoutEnabled: a read waits until Redis answers), and the link
// it dials over.
func unboundedClient(t *testing.T) (*redis.Client, *simnet.Link) {
	sim, link := simredis.New(), simnet.NewLink()
	t.Cleanup(sim.Close)
	c := redis.NewClient(&redis.Options{Addr: "10.0.0.1:6379", ReadTimeout: -1,
		Dialer: link.Dialer(func(c net.Conn) { sim.Serve(c, 0) })})
	t.Cleanup(func() { c.Close() })
	return c, link
}

// closesWithinAMinute closes lim, inside a bubble, and fails the test if
// Close has not returned a minute later, after what (a hang of a client
// that bounds no read); then resume ends the hang, so that Close and the
// bubble can end.
func closesWithinAMinute(t *testing.T, lim *Limiter, what string, resume func()) {
	t.Helper()
	closed := make(chan struct{})
	go func() { lim.Close(); close(closed) }()
	select {
	case <-closed:
	case <-time.After(time.Minute):
		t.Errorf("Close did not return a minute after %s, with ReadTimeout -1", what)
		resume()
		<-closed
	}
}

// TestCloseWithUnboundedReadTimeout: a client whose ReadTimeout is -1 (no
// socket deadline) and whose Redis hangs: decisions still go local within
// their budget, and Close must return, not wait for a read that only the
// user's client could end (it never does). Also through a wrapper that
// hides the client's options, as a user's instrumentation may: Close
// waited there, as for a client known to bound its reads, for as long as
// Redis hung; a client whose options are not known is now taken for one
// that may bound nothing.
func TestCloseWithUnboundedReadTimeout(t *testing.T) {
	for _, wrap := range []bool{false, true} {
		t.Run(map[bool]string{false: "client", true: "wrapped"}[wrap], func(t *testing.T) {
			bubble(t, func(t *testing.T) {
				c, link := unboundedClient(t)
				var rc redis.UniversalClient = c
				if wrap {
					rc = hidden{c}
				}
				lim, err := New(Config{Redis: rc, Limit: PerSecond(10), Instances: 1, Heartbeat: -1, Timeout: 50 * time.Millisecond})
				if err != nil {
					t.Fatal(err)
				}
				ctx := context.Background()
				if d, err := lim.Allow(ctx, "k"); err != nil || d.Mode != ModeRemote {
					t.Fatalf("Allow = %+v, %v; want remote", d, err)
				}
				time.Sleep(2 * time.Second) // the first contact (warm) is over
				link.Hang()
				t.Cleanup(link.Resume)
				start := time.Now()
				if d, err := lim.Allow(ctx, "k"); err != nil || d.Mode != ModeLocal || time.Since(start) > 51*time.Millisecond {
					t.Fatalf("Allow into a hung Redis = %+v, %v after %v; want local within 50ms", d, err, time.Since(start))
				}
				closesWithinAMinute(t, lim, "Redis hung", link.Resume)
			})
		})
	}
}

// hidden is a wrapper of a client that hides its options, as a user's
// instrumentation wrapper may.
type hidden struct{ redis.UniversalClient }

// TestCloseDuringFirstContactWithUnboundedReadTimeout: a client whose
// ReadTimeout is -1 against a Redis that hangs from the start: the first
// contact (warm) waits in go-redis's read, which nothing but Redis's answer
// ends. Decisions still go local within their budget, and Close must
// return, not wait for warm.
func TestCloseDuringFirstContactWithUnboundedReadTimeout(t *testing.T) {
	bubble(t, func(t *testing.T) {
		c, link := unboundedClient(t)
		link.Hang()
		t.Cleanup(link.Resume)
		lim, err := New(Config{Redis: c, Limit: PerSecond(10), Instances: 1, Heartbeat: -1, Timeout: 50 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		time.Sleep(10 * time.Millisecond) // warm has sent its pipeline
		start := time.Now()
		if d, err := lim.Allow(context.Background(), "k"); err != nil || d.Mode != ModeLocal || time.Since(start) > 51*time.Millisecond {
			t.Fatalf("Allow into a hung Redis = %+v, %v after %v; want local within 50ms", d, err, time.Since(start))
		}
		closesWithinAMinute(t, lim, "Redis hung during the first contact", link.Resume)
	})
}

// TestIdleLimiterWakesNothing: a Limiter without a heartbeat that decides
// nothing (every breaker closed, no local bucket) wakes no goroutine of
// its own: 2,000 of them in one process should cost nothing
// (docs/accuracy.md, "Idle Limiters"). Every wakeup that does work reads
// the Limiter's clock.
func TestIdleLimiterWakesNothing(t *testing.T) {
	bubble(t, func(t *testing.T) {
		c := simClient(t)
		var reads atomic.Int64
		cfg := Config{Redis: c, Limit: PerSecond(10), Instances: 1, Heartbeat: -1}
		cfg.now = func() time.Time { reads.Add(1); return time.Now() }
		lim, err := New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { lim.Close() })
		time.Sleep(2 * time.Second) // the first contact is over
		reads.Store(0)
		time.Sleep(time.Minute)
		if n := reads.Load(); n != 0 {
			t.Errorf("an idle Limiter read its clock %d times in a minute; want 0 (it wakes nothing)", n)
		}
	})
}
