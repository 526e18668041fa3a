package hybridlimit

import (
	"context"
	"net"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/hybridlimit/hybridlimit/breaker"
	"github.com/hybridlimit/hybridlimit/internal/simnet"
	"github.com/hybridlimit/hybridlimit/internal/simredis"
	"github.com/hybridlimit/hybridlimit/remote"
)

// TestRefilledLocalSpendingIsCharged: a decision whose caller's deadline
// ends while its connection is still being dialed is admitted locally with
// the breaker closed, and charged to Redis 100 ms later (reconcileAfter).
// By then a fast share has refilled to its burst, while Redis's bucket,
// which the remote decisions since spent, has not: the charge must be what
// the local bucket spent, or a key at its limit admits it on top.
func TestRefilledLocalSpendingIsCharged(t *testing.T) {
	bubble(t, func(t *testing.T) {
		client := slowDialing(t)
		limit := Limit{Rate: 100, Burst: 10}
		lim, err := New(Config{Redis: client, Limit: limit, Instances: 1, Heartbeat: -1,
			Timeout: 20 * time.Millisecond, Breaker: BreakerConfig{Failures: 1000}})
		if err != nil {
			t.Fatal(err)
		}
		defer lim.Close()
		start := time.Now()
		short, cancel := context.WithTimeout(context.Background(), 5*time.Millisecond)
		d, err := lim.AllowN(short, "k", limit.Burst)
		cancel()
		if err != nil || !d.Allowed || d.Mode != ModeLocal {
			t.Fatalf("AllowN(burst) before the first dial ended = %+v, %v; want allowed locally", d, err)
		}
		admitted := limit.Burst
		// A key at its limit: a decision every millisecond, on Redis, past
		// the charge.
		ctx := context.Background()
		for time.Since(start) < 300*time.Millisecond {
			time.Sleep(time.Millisecond)
			d, err := lim.Allow(ctx, "k")
			if err != nil {
				t.Fatal(err)
			}
			if d.Allowed {
				admitted++
			}
		}
		elapsed := time.Since(start)
		// The bucket's bound, and a token of rounding.
		bound := float64(limit.Burst) + limit.Rate*elapsed.Seconds() + 1
		if float64(admitted) > bound {
			t.Errorf("%d admitted in %v; want at most %.0f: the local admissions were not charged", admitted, elapsed, bound)
		}
		t.Logf("%d admitted in %v (bound %.0f)", admitted, elapsed, bound)
	})
}

// TestRefundedLocalSpendingIsNotCharged: a decision admitted locally with
// the breaker closed (its caller's deadline ended during the first dial)
// and then refunded (a later rule refused the request, as httplimit and
// grpclimit do) spent nothing: Redis must not be charged for it.
func TestRefundedLocalSpendingIsNotCharged(t *testing.T) {
	bubble(t, func(t *testing.T) {
		client := slowDialing(t)
		limit := Limit{Rate: 0.1, Burst: 10}
		lim, err := New(Config{Redis: client, Limit: limit, Instances: 1, Heartbeat: -1,
			Timeout: 20 * time.Millisecond, Breaker: BreakerConfig{Failures: 1000}})
		if err != nil {
			t.Fatal(err)
		}
		defer lim.Close()
		short, cancel := context.WithTimeout(context.Background(), 5*time.Millisecond)
		d, err := lim.AllowN(short, "k", 3)
		cancel()
		if err != nil || !d.Allowed || d.Mode != ModeLocal {
			t.Fatalf("AllowN(3) before the first dial ended = %+v, %v; want allowed locally", d, err)
		}
		if err := lim.Refund(context.Background(), "k", d, 3); err != nil {
			t.Fatal(err)
		}
		time.Sleep(300 * time.Millisecond) // past the reconciliation
		d, err = lim.AllowN(context.Background(), "k", limit.Burst)
		if err != nil || d.Mode != ModeRemote {
			t.Fatalf("AllowN(burst) = %+v, %v; want a decision of Redis", d, err)
		}
		if !d.Allowed {
			t.Errorf("AllowN(burst) on Redis denied, %d left: the refunded local admission was charged", d.Remaining)
		}
	})
}

// slowDialing returns a client of a simulated Redis whose every dial takes
// 10 ms (a TLS handshake, another zone), closed when t ends.
func slowDialing(t *testing.T) *redis.Client {
	srv := simredis.New()
	t.Cleanup(srv.Close)
	link := simnet.NewLink()
	client := redis.NewClient(&redis.Options{
		Addr: "10.0.0.1:6379", // an IP: a hostname would be looked up
		Dialer: func(context.Context, string, string) (net.Conn, error) {
			time.Sleep(10 * time.Millisecond)
			return link.Dial(func(c net.Conn) { srv.Serve(c, 0) })
		},
	})
	t.Cleanup(func() { client.Close() })
	return client
}

// TestUnansweredChargesDoNotPileUp: while Redis answers after the budget
// and the breaker stays closed, every decision goes local and every charge
// goes unanswered. Each reconciliation sends again the key's charge under
// its Once; what was spent since stays owed until that one is answered,
// rather than going under a new Once each time, which would send one more
// charge each reconciliation, all of them every time (ten minutes of
// OnceFor: thousands).
func TestUnansweredChargesDoNotPileUp(t *testing.T) {
	bubble(t, func(t *testing.T) {
		r := newChargeRig(t, Config{Limit: Limit{Rate: 1000, Burst: 1000}, Instances: 1, Heartbeat: -1,
			Timeout: 50 * time.Millisecond, Breaker: BreakerConfig{Failures: 1000}})
		ctx := context.Background()
		r.decideRemote(t, "k")
		r.link.SetLatency(80 * time.Millisecond)
		const rounds = 30
		for range rounds {
			if d, err := r.lim.Allow(ctx, "k"); err != nil || d.Mode != ModeLocal {
				t.Fatalf("Allow = %+v, %v; want local", d, err)
			}
			time.Sleep(200 * time.Millisecond) // one reconciliation
		}
		r.lim.reconciling <- struct{}{}
		pending := len(r.lim.unanswered["k"])
		<-r.lim.reconciling
		sent := r.sent("k")
		t.Logf("after %d reconciliations: %d charges of k pending, %d sent", rounds, pending, sent)
		if pending > 2 || sent > 3*rounds {
			t.Errorf("after %d reconciliations: %d charges of k pending, %d sent; want at most 2 and %d", rounds, pending, sent, 3*rounds)
		}
	})
}

// TestUnansweredChargeIsSentAgain: a local admission (a time-out, breaker
// closed) is charged 100 ms later, but the charge meets a hung connection
// that is then reset: it never ran. Redis answers again at once, the
// breaker never opened, and no local decision follows: the answers
// themselves must bring the charge back, or the spending is never charged.
func TestUnansweredChargeIsSentAgain(t *testing.T) {
	bubble(t, func(t *testing.T) {
		limit := Limit{Rate: 0.01, Burst: 10}
		r := newChargeRig(t, Config{Limit: limit, Instances: 1, Heartbeat: -1, Timeout: 50 * time.Millisecond})
		ctx := context.Background()
		r.unansweredCharge(t, "k", 5)
		for range 10 { // Redis decides again, on another key
			time.Sleep(time.Second)
			if d, err := r.lim.Allow(ctx, "j"); err != nil || d.Mode != ModeRemote {
				t.Fatalf("Allow(j) = %+v, %v; want a decision of Redis", d, err)
			}
		}
		rl, err := remote.NewLimit(limit.Rate, limit.Burst)
		if err != nil {
			t.Fatal(err)
		}
		if got := r.charged("k", rl); got < 5-0.5 {
			t.Errorf("Redis was charged %.2f of the 5 tokens admitted locally, 10 s after it answered again", got)
		}
		// The first charge went unanswered, the second landed.
		if st := r.lim.Stats(); st.ChargesFailed != 1 || st.Charges != 2 {
			t.Errorf("Stats: %d charges, %d failed; want 2, 1 failed", st.Charges, st.ChargesFailed)
		}
	})
}

// TestDecisionEvent: the Observer hears what the caller got: the tokens
// an AllowAtMost granted, and a denial answered from what Redis said of
// the key, without a round trip.
func TestDecisionEvent(t *testing.T) {
	bubble(t, func(t *testing.T) {
		var mu sync.Mutex
		var evs []DecisionEvent
		obs := observerFuncs{decision: func(e DecisionEvent) { mu.Lock(); evs = append(evs, e); mu.Unlock() }}
		r := newChargeRig(t, Config{Limit: Limit{Rate: 0.01, Burst: 3}, Instances: 1, Heartbeat: -1, Observer: obs})
		<-r.lim.warmed
		ctx := context.Background()
		if d, err := r.lim.AllowAtMost(ctx, "k", 5); err != nil || d.Granted != 3 || d.Mode != ModeRemote {
			t.Fatalf("AllowAtMost(5) = %+v, %v; want 3 granted by Redis", d, err)
		}
		if d, err := r.lim.Allow(ctx, "k"); err != nil || d.Allowed || !d.Cached {
			t.Fatalf("Allow on the empty bucket = %+v, %v; want a cached denial", d, err)
		}
		mu.Lock()
		defer mu.Unlock()
		if len(evs) != 2 || evs[0].Granted != 3 || evs[0].N != 3 || evs[0].Cached ||
			evs[1].Granted != 0 || !evs[1].Cached || evs[1].Allowed {
			t.Errorf("events %+v; want AllowAtMost's with Granted 3, then a cached denial with Granted 0", evs)
		}
	})
}

// observerFuncs is an Observer of funcs; a nil one is not called.
type observerFuncs struct {
	decision func(DecisionEvent)
	breaker  func(BreakerEvent)
}

func (o observerFuncs) ObserveDecision(e DecisionEvent) {
	if o.decision != nil {
		o.decision(e)
	}
}

func (o observerFuncs) ObserveBreaker(e BreakerEvent) {
	if o.breaker != nil {
		o.breaker(e)
	}
}

// chargeRig is a Limiter on one simulated Redis that counts, per key, the
// charges Redis was sent and the units it applied (a charge found applied
// under its Once before is not counted twice).
type chargeRig struct {
	srv     *simredis.Server
	link    *simnet.Link
	lim     *Limiter
	mu      sync.Mutex
	applied map[string]int64 // units, by Redis key
	sentTo  map[string]int   // charges, by Redis key
}

func newChargeRig(t *testing.T, cfg Config) *chargeRig {
	r := &chargeRig{srv: simredis.New(), link: simnet.NewLink(), applied: map[string]int64{}, sentTo: map[string]int{}}
	t.Cleanup(r.srv.Close)
	r.srv.Hook = func(_ int, key, _ string, argv []string, reply any) {
		if len(argv) <= 4 || argv[4] != "charge" {
			return
		}
		r.mu.Lock()
		defer r.mu.Unlock()
		r.sentTo[key]++
		if rep, _ := reply.([]any); len(rep) > 0 && rep[0] != int64(4) {
			units, _ := strconv.ParseInt(argv[3], 10, 64)
			r.applied[key] += units
		}
	}
	client := redis.NewClient(&redis.Options{
		Addr:   "10.0.0.1:6379", // an IP: a hostname would be looked up
		Dialer: r.link.Dialer(func(c net.Conn) { r.srv.Serve(c, 0) }),
	})
	t.Cleanup(func() { client.Close() })
	cfg.Redis = client
	lim, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { lim.Close() })
	r.lim = lim
	return r
}

// passesWhileDeciding returns how many reconciliations (counted by passes)
// start while lim decides on keys, one every 100 ms for 10 s, each decided
// by Redis.
func passesWhileDeciding(t *testing.T, lim *Limiter, passes *atomic.Int64, keys []string) int64 {
	t.Helper()
	before := passes.Load()
	for i := range 100 {
		time.Sleep(100 * time.Millisecond)
		if d, err := lim.Allow(context.Background(), keys[i%len(keys)]); err != nil || d.Mode != ModeRemote {
			t.Fatalf("Allow(%s) = %+v, %v; want a decision of Redis", keys[i%len(keys)], d, err)
		}
	}
	return passes.Load() - before
}

// unansweredCharge makes a local admission of n tokens of key (its call's
// reply comes after the budget, the breaker staying closed), whose charge
// 100 ms later meets a hung connection that is then reset: it never ran.
// Redis answers again at once.
func (r *chargeRig) unansweredCharge(t *testing.T, key string, n int64) Decision {
	t.Helper()
	ctx := context.Background()
	r.decideRemote(t, key)
	r.link.SetLatency(80 * time.Millisecond)
	d, err := r.lim.AllowN(ctx, key, n)
	if err != nil || !d.Allowed || d.Mode != ModeLocal {
		t.Fatalf("AllowN(%d) = %+v, %v; want a local admission", n, d, err)
	}
	time.Sleep(60 * time.Millisecond) // the decision's late reply
	r.link.SetLatency(0)
	r.link.Hang()
	time.Sleep(100 * time.Millisecond) // the charge meets the hang
	r.link.Reset()                     // and dies unread
	r.link.Resume()
	return d
}

// decideRemote makes a decision on key that Redis must make, once the
// limiter's first contact is over.
func (r *chargeRig) decideRemote(t *testing.T, key string) {
	t.Helper()
	<-r.lim.warmed
	if d, err := r.lim.Allow(context.Background(), key); err != nil || d.Mode != ModeRemote {
		t.Fatalf("first decision on %s: %+v, %v", key, d, err)
	}
}

// charged returns the tokens of rl that Redis applied in charges of key.
func (r *chargeRig) charged(key string, rl remote.Limit) float64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return float64(r.applied[DefaultPrefix+key]) / float64(rl.P)
}

// sent returns how many charges of key Redis was sent.
func (r *chargeRig) sent(key string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.sentTo[DefaultPrefix+key]
}

// TestRefundedPendingChargeIsDropped: a local admission's charge goes
// unanswered, then the caller refunds the admission (a later rule refused
// the request). Nothing is owed on the key any more: its pending charge
// must be dropped, not kept for OnceFor, during which every answer of
// Redis would start another reconciliation, each a pass over every key.
func TestRefundedPendingChargeIsDropped(t *testing.T) {
	bubble(t, func(t *testing.T) {
		var passes atomic.Int64
		cfg := Config{Limit: Limit{Rate: 0.01, Burst: 10}, Instances: 1, Heartbeat: -1, Timeout: 50 * time.Millisecond}
		cfg.onPass = func() { passes.Add(1) }
		r := newChargeRig(t, cfg)
		ctx := context.Background()
		d := r.unansweredCharge(t, "k", 5)
		if err := r.lim.Refund(ctx, "k", d, 5); err != nil {
			t.Fatal(err)
		}
		if n := passesWhileDeciding(t, r.lim, &passes, []string{"j0", "j1", "j2", "j3", "j4"}); n > 3 {
			t.Errorf("%d reconciliations in 10 s of a healthy Redis with nothing owed; want at most 3", n)
		}
	})
}

// TestPendingChargeOfADownNode: on a Cluster, a key's charge goes
// unanswered on its master, which then stays down (no failover yet). The
// other masters' answers cannot send it: each must not start a
// reconciliation, a pass over every key, every reconcileAfter.
func TestPendingChargeOfADownNode(t *testing.T) {
	bubble(t, func(t *testing.T) {
		var passes atomic.Int64
		cfg := Config{Limit: Limit{Rate: 1000, Burst: 1000}, Timeout: 50 * time.Millisecond, Heartbeat: -1, Instances: 1,
			Breaker: BreakerConfig{Failures: 3}}
		cfg.onPass = func() { passes.Add(1) }
		cl, links, lim := onSimCluster(t, cfg, false)
		ctx := context.Background()
		const key = "k"
		shard := cl.ShardOf(DefaultPrefix + key)
		var others []string
		for i := 0; len(others) < 10; i++ {
			if k := "o" + strconv.Itoa(i); cl.ShardOf(DefaultPrefix+k) != shard {
				others = append(others, k)
			}
		}
		time.Sleep(time.Second)
		if d, err := lim.Allow(ctx, key); err != nil || d.Mode != ModeRemote {
			t.Fatalf("before the fault: %+v, %v", d, err)
		}
		hangMaster(t, cl, links, shard)
		if d, err := lim.Allow(ctx, key); err != nil || d.Mode != ModeLocal {
			t.Fatalf("on the hung master: %+v, %v", d, err)
		}
		time.Sleep(200 * time.Millisecond) // its charge goes, unanswered
		for range 5 {
			lim.Allow(ctx, key) // the breaker opens
		}
		lim.reconciling <- struct{}{}
		left := len(lim.unanswered[key])
		<-lim.reconciling
		if left == 0 {
			t.Fatal("no charge of k pending: the test proves nothing")
		}
		if n := passesWhileDeciding(t, lim, &passes, others); n > 3 {
			t.Errorf("%d reconciliations in 10 s, none able to send k's charge; want at most 3", n)
		}
	})
}

// TestRefusedChargeIsNotResentAtOnce: Redis answers a charge with an error
// that says nothing of the node (NOPERM: an ACL that does not cover the
// key). The answer must not ask for the next pass, which would send the
// charge to be refused again: a pass and a refusal every reconcileAfter,
// with no traffic at all.
func TestRefusedChargeIsNotResentAtOnce(t *testing.T) {
	bubble(t, func(t *testing.T) {
		var passes atomic.Int64
		cfg := Config{Limit: Limit{Rate: 0.01, Burst: 10}, Instances: 1, Heartbeat: -1, Timeout: 50 * time.Millisecond}
		cfg.onPass = func() { passes.Add(1) }
		r := newChargeRig(t, cfg)
		refused := &refuseCharges{key: DefaultPrefix + "k"}
		r.lim.cfg.Redis.(*redis.Client).AddHook(refused)
		ctx := context.Background()
		r.decideRemote(t, "k")
		r.link.SetLatency(80 * time.Millisecond)
		if d, err := r.lim.AllowN(ctx, "k", 5); err != nil || !d.Allowed || d.Mode != ModeLocal {
			t.Fatalf("AllowN(5) = %+v, %v; want a local admission", d, err)
		}
		time.Sleep(60 * time.Millisecond) // the decision's late reply
		r.link.SetLatency(0)
		time.Sleep(200 * time.Millisecond) // the charge, refused
		if d, err := r.lim.Allow(ctx, "j"); err != nil || d.Mode != ModeRemote {
			t.Fatalf("Allow(j) = %+v, %v; want a decision of Redis", d, err)
		}
		before, sent := passes.Load(), refused.n.Load()
		if sent == 0 {
			t.Fatal("no charge of k was refused: the test proves nothing")
		}
		time.Sleep(10 * time.Second) // no traffic
		if n, m := passes.Load()-before, refused.n.Load()-sent; n > 3 || m > 3 {
			t.Errorf("%d reconciliations and %d charges refused in 10 s with no traffic; want at most 3 of each", n, m)
		}
	})
}

// refuseCharges is a go-redis hook that answers every charge of key alone
// with NOPERM, without sending it, and counts them.
type refuseCharges struct {
	key string
	n   atomic.Int64
}

type noPerm struct{}

func (noPerm) Error() string { return "NOPERM this user has no permissions to access one of the keys" }
func (noPerm) RedisError()   {}

func (h *refuseCharges) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *refuseCharges) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if slices.Contains(cmd.Args(), any(h.key)) && slices.Contains(cmd.Args(), any("charge")) {
			h.n.Add(1)
			cmd.SetErr(noPerm{})
			return cmd.Err()
		}
		return next(ctx, cmd)
	}
}

func (h *refuseCharges) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// TestResentChargeOfAnEvictedEntry: a local admission's charge runs in
// Redis but its answer comes after the budget, so it stays pending under
// its Once. Meanwhile the key's entry is evicted (MaxLocalKeys) and a new
// one made, which spends as much again locally. The next pass must not
// send the old entry's pending charge for the new entry's spending: Redis,
// which applied that Once already, applies it again as nothing, and the
// answer then settles the new entry's debt -- which Redis never gets.
func TestResentChargeOfAnEvictedEntry(t *testing.T) {
	bubble(t, func(t *testing.T) {
		limit := Limit{Rate: 0.01, Burst: 10}
		r := newChargeRig(t, Config{Limit: limit, Instances: 1, Heartbeat: -1, Timeout: 50 * time.Millisecond,
			MaxLocalKeys: 1})
		ctx := context.Background()
		// The connections warm opens are ready: a call that had to dial
		// one over the slow link below would not reach Redis at all.
		<-r.lim.warmed
		local := func(key string, n int64) {
			t.Helper()
			r.link.SetLatency(80 * time.Millisecond)
			if d, err := r.lim.AllowN(ctx, key, n); err != nil || !d.Allowed || d.Mode != ModeLocal {
				t.Fatalf("AllowN(%s, %d) = %+v, %v; want a local admission", key, n, d, err)
			}
		}
		r.decideRemote(t, "k")
		local("k", 5)                      // the first entry spends 5, held
		time.Sleep(200 * time.Millisecond) // the pass, 100 ms on: its charge runs late, unanswered
		r.link.SetLatency(0)
		time.Sleep(200 * time.Millisecond) // its late answer is dropped
		r.lim.reconciling <- struct{}{}
		pending := len(r.lim.unanswered["k"])
		<-r.lim.reconciling
		rl, err := remote.NewLimit(limit.Rate, limit.Burst)
		if err != nil {
			t.Fatal(err)
		}
		if pending != 1 || r.charged("k", rl) < 5-0.5 {
			t.Fatalf("the first charge: %d pending, %.2f applied; want 1 pending, 5 applied", pending, r.charged("k", rl))
		}
		// j's answer evicts k's entry (one local key at most) and asks for
		// a pass, 100 ms on; before it, a new entry of k spends 5 more.
		if d, err := r.lim.Allow(ctx, "j"); err != nil || d.Mode != ModeRemote {
			t.Fatalf("Allow(j) = %+v, %v; want a decision of Redis", d, err)
		}
		local("k", 5)
		time.Sleep(60 * time.Millisecond) // the decision's late reply
		r.link.SetLatency(0)
		for range 5 {
			time.Sleep(time.Second)
			if d, err := r.lim.Allow(ctx, "j"); err != nil || d.Mode != ModeRemote {
				t.Fatalf("Allow(j) = %+v, %v; want a decision of Redis", d, err)
			}
		}
		if got := r.charged("k", rl); got < 10-0.5 {
			t.Errorf("Redis was charged %.2f of the 10 tokens admitted locally by two entries of k (%d charges sent)", got, r.sent("k"))
		}
	})
}

// TestProbeAfterSetLimit: the limit is lowered during an outage (an
// operator reacting to the incident). The probe that closes the breaker
// writes the key that failed last; it must refill it at the limit in
// force, not at the one of the decision that failed, or that key finds
// its bucket refilled at the old rate over the whole outage. (An outage
// longer than the key's TTL under the old limit finds no key, and a full
// bucket of the new limit, as a healthy Redis would.)
func TestProbeAfterSetLimit(t *testing.T) {
	bubble(t, func(t *testing.T) {
		r := newChargeRig(t, Config{Limit: PerSecond(100), Instances: 1, Heartbeat: -1,
			Timeout: 50 * time.Millisecond, Breaker: BreakerConfig{Failures: 1}})
		ctx := context.Background()
		if d, err := r.lim.AllowN(ctx, "k", 100); err != nil || !d.Allowed || d.Mode != ModeRemote {
			t.Fatalf("AllowN(100) = %+v, %v; want the bucket emptied by Redis", d, err)
		}
		time.Sleep(20 * time.Millisecond) // past the cached denial
		r.link.Refuse(true)
		r.link.Reset()
		if d, err := r.lim.Allow(ctx, "k"); err != nil || d.Mode != ModeLocal {
			t.Fatalf("Allow during the outage = %+v, %v; want a local decision", d, err)
		}
		lowered := Limit{Rate: 1, Burst: 100}
		if err := r.lim.SetLimit(lowered); err != nil {
			t.Fatal(err)
		}
		time.Sleep(500 * time.Millisecond) // shorter than the key's TTL, 2 s
		r.link.Refuse(false)
		for i := 0; ; i++ {
			time.Sleep(50 * time.Millisecond)
			if d, err := r.lim.Allow(ctx, "j"); err != nil || d.Mode == ModeRemote {
				break
			}
			if i > 100 {
				t.Fatal("Redis back for 5 s and the breaker still not closed")
			}
		}
		st, err := r.lim.Peek(ctx, "k")
		// 1 token a second for under a second since the bucket was emptied
		// (at 100 a second: about 70).
		if err != nil || st.Mode != ModeRemote || st.Tokens > 2 {
			t.Errorf("after the outage, Peek(k) = %+v, %v; want at most 2 tokens (1/s since it was emptied)", st, err)
		}
	})
}

// TestProbeReconcileMeetsAHang: after an outage of many keys, the probe
// that finds Redis back charges every key before it reports the success
// that closes the breaker. Redis hangs again right after that probe's
// answer: each charge then waits its whole budget, chargers at a time, and
// the probe reports its old success once they have all failed. The pass
// must end within a few budgets of the hang, and must not close the
// breaker on a Redis that has not answered since.
func TestProbeReconcileMeetsAHang(t *testing.T) {
	bubble(t, func(t *testing.T) {
		var armed atomic.Bool
		var hungAt atomic.Int64
		var r *chargeRig
		cfg := Config{Limit: Limit{Rate: 0.01, Burst: 10}, Instances: 1, Heartbeat: -1,
			Timeout: 50 * time.Millisecond, Breaker: BreakerConfig{Failures: 1}}
		cfg.onPass = func() {
			if armed.CompareAndSwap(true, false) {
				r.link.Hang() // Redis stops again, right after the probe's answer
				hungAt.Store(time.Now().UnixNano())
			}
		}
		r = newChargeRig(t, cfg)
		ctx := context.Background()
		r.decideRemote(t, "k0")
		r.link.Refuse(true)
		r.link.Reset()
		const keys = 1280
		for i := range keys {
			if d, err := r.lim.Allow(ctx, "k"+strconv.Itoa(i)); err != nil || !d.Allowed || d.Mode != ModeLocal {
				t.Fatalf("Allow during the outage = %+v, %v; want a local admission", d, err)
			}
		}
		armed.Store(true)
		r.link.Refuse(false)
		nd := r.lim.single
		for hungAt.Load() == 0 {
			time.Sleep(time.Millisecond)
		}
		hung := time.Unix(0, hungAt.Load())
		// The probe holds the half-open ticket until its pass ends.
		for nd.cb.State() == breaker.StateHalfOpen {
			time.Sleep(time.Millisecond)
		}
		held := time.Since(hung)
		state := nd.cb.State()
		t.Logf("%d keys owed: the probe's pass held the half-open ticket %v after Redis hung; then %v", keys, held, state)
		start := time.Now()
		d, err := r.lim.Allow(ctx, "x")
		t.Logf("next decision: %v after %v", d.Mode, time.Since(start))
		if err != nil {
			t.Fatal(err)
		}
		if held > 4*cfg.Timeout {
			t.Errorf("the probe's pass went on %v after Redis stopped answering (%d keys, Timeout %v); want within a few budgets", held, keys, cfg.Timeout)
		}
		if state == breaker.StateClosed {
			t.Errorf("the breaker closed on the probe's success %v old, Redis hung since", held)
		}
		r.link.Resume()
	})
}

// TestProbeSuccessCountedBeforeItsPass: with Probes 2, the breaker
// counts consecutive successes across the prober's passes, and a pass that
// ends on a probe that says nothing of the node (a MOVED, an ASK, a
// time-out while cold) leaves its count standing: the next pass's first
// success then closes the breaker. It must have charged Redis with the
// local spending first, or the decisions after the close take from a
// bucket that refilled all through the outage. The success of the earlier
// pass is the test's own half-open ticket.
func TestProbeSuccessCountedBeforeItsPass(t *testing.T) {
	bubble(t, func(t *testing.T) {
		limit := Limit{Rate: 0.01, Burst: 10}
		const openFor = 50 * time.Millisecond
		r := newChargeRig(t, Config{Limit: limit, Instances: 1, Heartbeat: -1, Timeout: 50 * time.Millisecond,
			Breaker: BreakerConfig{Failures: 1, OpenFor: openFor, Jitter: -1, Probes: 2}})
		ctx := context.Background()
		r.decideRemote(t, "k")
		r.link.Refuse(true)
		r.link.Reset()
		for range 5 {
			if d, err := r.lim.Allow(ctx, "k"); err != nil || !d.Allowed || d.Mode != ModeLocal {
				t.Fatalf("Allow during the outage = %+v, %v; want a local admission", d, err)
			}
		}
		nd := r.lim.single
		if nd.cb.State() != breaker.StateOpen {
			t.Fatalf("breaker %v; want open", nd.cb.State())
		}
		r.link.Refuse(false)
		// Every reply a millisecond late: a charge sent once the breaker
		// closed cannot have landed before the test looks.
		r.link.SetLatency(time.Millisecond)
		time.Sleep(time.Until(nd.cb.OpenUntil()) + time.Millisecond)
		earlier, ok := nd.cb.Allow() // before the prober's next tick
		if !ok {
			t.Fatal("no half-open ticket at the end of the open period")
		}
		time.Sleep(20 * time.Millisecond) // the prober's pass: one success, then no ticket left
		synctest.Wait()
		if st := nd.cb.State(); st != breaker.StateHalfOpen {
			t.Fatalf("after the prober's pass: %v; want half-open", st)
		}
		earlier.Done(breaker.Success) // the second consecutive success closes
		if st := nd.cb.State(); st != breaker.StateClosed {
			t.Fatalf("after two successes: %v; want closed", st)
		}
		rl, err := remote.NewLimit(limit.Rate, limit.Burst)
		if err != nil {
			t.Fatal(err)
		}
		if got := r.charged("k", rl); got < 5-0.5 {
			t.Errorf("the breaker closed with %.2f of the 5 tokens admitted locally charged to Redis; want all of them", got)
		}
		time.Sleep(time.Second) // go-redis's dials refused in the outage end their back-off
	})
}

// TestProbeChargesWhatFollowsAResentCharge: a local admission's charge
// goes unanswered (a latency spike, the breaker closed), then Redis goes
// away and the instance spends more of the key locally. When Redis is
// back, the probe's pass sends the unanswered charge again under its Once,
// and what was spent after it goes under a new Once once that one is
// answered: in the same probe, before the breaker closes. Left to the
// reconciler's next pass, 100 ms after the close, it let the decisions
// meanwhile take from a bucket not yet charged with it.
func TestProbeChargesWhatFollowsAResentCharge(t *testing.T) {
	bubble(t, func(t *testing.T) {
		limit := Limit{Rate: 0.01, Burst: 10}
		var r *chargeRig
		var atClose atomic.Int64 // units charged when the breaker closed, plus one
		obs := observerFuncs{breaker: func(e BreakerEvent) {
			if e.To == "closed" && atClose.Load() == 0 {
				rl, _ := remote.NewLimit(limit.Rate, limit.Burst)
				atClose.Store(int64(r.charged("k", rl)*float64(rl.P)) + 1)
			}
		}}
		r = newChargeRig(t, Config{Limit: limit, Instances: 1, Heartbeat: -1, Timeout: 50 * time.Millisecond,
			Observer: obs, Breaker: BreakerConfig{OpenFor: 50 * time.Millisecond, Jitter: -1}})
		ctx := context.Background()
		r.decideRemote(t, "k")
		// Redis slower than the budget: a decision times out and is
		// admitted locally, and its charge, 100 ms on, is sent and not
		// answered within its budget.
		r.link.SetLatency(80 * time.Millisecond)
		admit := func(n int64) {
			t.Helper()
			if d, err := r.lim.AllowN(ctx, "k", n); err != nil || !d.Allowed || d.Mode != ModeLocal {
				t.Fatalf("AllowN(%d) = %+v, %v; want a local admission", n, d, err)
			}
		}
		admit(2)
		time.Sleep(250 * time.Millisecond)
		// Four more time-outs open the breaker; two more while it is open.
		for range 4 + 2 {
			admit(1)
		}
		if st := r.lim.single.cb.State(); st != breaker.StateOpen {
			t.Fatalf("breaker %v; want open", st)
		}
		r.link.SetLatency(0)
		time.Sleep(time.Second)
		rl, err := remote.NewLimit(limit.Rate, limit.Burst)
		if err != nil {
			t.Fatal(err)
		}
		if atClose.Load() == 0 {
			t.Fatal("the breaker did not close")
		}
		closed := float64(atClose.Load()-1) / float64(rl.P)
		t.Logf("charged when the breaker closed: %.2f of 8 tokens; a second later: %.2f", closed, r.charged("k", rl))
		if closed < 8-0.5 {
			t.Errorf("the breaker closed with %.2f of the 8 tokens spent locally charged; want all of them", closed)
		}
		time.Sleep(time.Second) // go-redis's dials refused in the outage end their back-off
	})
}

// TestCloseChargesWhatIsOwed: a rolling deploy closes an instance right
// after a decision of its timed out and was admitted locally, its breaker
// closed (a latency spike). What it spent is owed to Redis and charged
// reconcileAfter later; closed before then, the instance must still charge
// it, or the fleet admits it on top of the limit.
func TestCloseChargesWhatIsOwed(t *testing.T) {
	bubble(t, func(t *testing.T) {
		limit := Limit{Rate: 0.01, Burst: 10}
		r := newChargeRig(t, Config{Limit: limit, Instances: 1, Heartbeat: -1, Timeout: 50 * time.Millisecond})
		ctx := context.Background()
		r.decideRemote(t, "k")
		r.link.SetLatency(80 * time.Millisecond)
		if d, err := r.lim.AllowN(ctx, "k", 5); err != nil || !d.Allowed || d.Mode != ModeLocal {
			t.Fatalf("AllowN(5) = %+v, %v; want a local admission", d, err)
		}
		r.link.SetLatency(0)
		time.Sleep(40 * time.Millisecond) // the decision's late reply
		start := time.Now()
		r.lim.Close()
		took := time.Since(start)
		time.Sleep(time.Second)
		rl, err := remote.NewLimit(limit.Rate, limit.Burst)
		if err != nil {
			t.Fatal(err)
		}
		got := r.charged("k", rl)
		t.Logf("Close took %v; Redis was charged %.2f of the 5 tokens admitted locally", took, got)
		if got < 5-0.5 {
			t.Errorf("Redis was charged %.2f of the 5 tokens admitted locally before Close", got)
		}
		if took > 60*time.Millisecond {
			t.Errorf("Close took %v; want at most about Timeout", took)
		}
	})
}

// TestSpendingBehindAResentChargeIsCharged: a local admission's charge goes
// unanswered (Redis runs it late), and the key spends again locally before
// the next pass. That pass sends the pending charge again under its Once
// and keeps the new spending owed until it is answered. Once it is, the
// new spending must still be charged: Redis answers normally from then on,
// with no time-out, no breaker change and no local decision to start a
// pass.
func TestSpendingBehindAResentChargeIsCharged(t *testing.T) {
	bubble(t, func(t *testing.T) {
		limit := Limit{Rate: 0.01, Burst: 10}
		r := newChargeRig(t, Config{Limit: limit, Instances: 1, Heartbeat: -1, Timeout: 50 * time.Millisecond})
		ctx := context.Background()
		r.decideRemote(t, "k")
		r.link.SetLatency(80 * time.Millisecond)
		if d, err := r.lim.AllowN(ctx, "k", 3); err != nil || !d.Allowed || d.Mode != ModeLocal {
			t.Fatalf("AllowN(3) = %+v, %v; want a local admission", d, err)
		}
		time.Sleep(160 * time.Millisecond) // the pass, 100 ms on: its charge of 3 goes unanswered
		if d, err := r.lim.AllowN(ctx, "k", 2); err != nil || !d.Allowed || d.Mode != ModeLocal {
			t.Fatalf("AllowN(2) = %+v, %v; want a local admission", d, err)
		}
		r.link.SetLatency(0) // the next pass's charges are answered
		for range 10 {       // Redis decides again, on another key
			time.Sleep(time.Second)
			if d, err := r.lim.Allow(ctx, "j"); err != nil || d.Mode != ModeRemote {
				t.Fatalf("Allow(j) = %+v, %v; want a decision of Redis", d, err)
			}
		}
		rl, err := remote.NewLimit(limit.Rate, limit.Burst)
		if err != nil {
			t.Fatal(err)
		}
		r.lim.reconciling <- struct{}{}
		pending := len(r.lim.unanswered["k"])
		<-r.lim.reconciling
		got := r.charged("k", rl)
		t.Logf("Redis was charged %.2f of the 5 tokens admitted locally (%d charges sent, %d pending)", got, r.sent("k"), pending)
		if got < 5-0.5 {
			t.Errorf("Redis was charged %.2f of the 5 tokens admitted locally, 10 s after it answered again", got)
		}
	})
}

// TestPartlyRefundedPendingChargeIsNotChargedTwice: a local admission of 5
// is charged, and Redis runs the charge but answers late: it stays pending
// under its Once. The caller then gives 2 of the tokens back. The 3 still
// owed must go under the pending charge's Once, which Redis applied
// already: under a new one, Redis takes them on top of the 5.
func TestPartlyRefundedPendingChargeIsNotChargedTwice(t *testing.T) {
	bubble(t, func(t *testing.T) {
		limit := Limit{Rate: 0.01, Burst: 10}
		r := newChargeRig(t, Config{Limit: limit, Instances: 1, Heartbeat: -1, Timeout: 50 * time.Millisecond})
		ctx := context.Background()
		r.decideRemote(t, "k")
		r.link.SetLatency(80 * time.Millisecond)
		d, err := r.lim.AllowN(ctx, "k", 5)
		if err != nil || !d.Allowed || d.Mode != ModeLocal {
			t.Fatalf("AllowN(5) = %+v, %v; want a local admission", d, err)
		}
		time.Sleep(160 * time.Millisecond) // the pass, 100 ms on: its charge runs late, unanswered
		r.link.SetLatency(0)
		time.Sleep(100 * time.Millisecond) // its late answer is dropped
		rl, err := remote.NewLimit(limit.Rate, limit.Burst)
		if err != nil {
			t.Fatal(err)
		}
		r.lim.reconciling <- struct{}{}
		pending := len(r.lim.unanswered["k"])
		<-r.lim.reconciling
		if pending != 1 || r.charged("k", rl) < 5-0.5 {
			t.Fatalf("the first charge: %d pending, %.2f applied; want 1 pending, 5 applied", pending, r.charged("k", rl))
		}
		if err := r.lim.Refund(ctx, "k", d, 2); err != nil {
			t.Fatal(err)
		}
		for range 5 { // Redis decides again, on another key
			time.Sleep(time.Second)
			if d, err := r.lim.Allow(ctx, "j"); err != nil || d.Mode != ModeRemote {
				t.Fatalf("Allow(j) = %+v, %v; want a decision of Redis", d, err)
			}
		}
		got := r.charged("k", rl)
		t.Logf("Redis applied %.2f tokens of charges for 5 admitted locally, 2 of them refunded after the charge ran (%d charges sent)", got, r.sent("k"))
		if got > 5+0.5 {
			t.Errorf("Redis applied %.2f tokens of charges for 5 tokens admitted locally", got)
		}
	})
}
