package hybridlimit

import (
	"context"
	"math"
	"strconv"
	"sync"
	"time"

	"github.com/hybridlimit/hybridlimit/breaker"
	"github.com/hybridlimit/hybridlimit/local"
	"github.com/hybridlimit/hybridlimit/remote"
)

// reconcileAfter is how long the reconciler waits, after a local decision
// on a node whose breaker stayed closed, before it charges Redis: the
// decisions of a burst of time-outs are charged together.
const reconcileAfter = 100 * time.Millisecond

// chargers bounds the charges in flight at once; the node's pipe batches
// them.
const chargers = 64

// owe tells the reconciler that a local decision was made on a node whose
// breaker is closed, so that nothing else would charge Redis for it.
func (lim *Limiter) owe() {
	select {
	case lim.owed <- struct{}{}:
	default: // one is pending already
	}
}

// reconciler charges Redis with what this instance spent on its local
// shares while Redis did not answer: when a node's breaker closes, and
// shortly after local decisions made while a breaker stayed closed (a
// time-out now and then). Meanwhile Redis's buckets refilled in Redis time;
// without the charge, the fleet would admit the local spending on top of
// the limit.
func (lim *Limiter) reconciler() {
	defer lim.wg.Done()
	t := time.NewTimer(time.Hour)
	t.Stop()
	defer t.Stop()
	for {
		select {
		case <-lim.healed:
		case <-lim.owed:
			t.Reset(reconcileAfter)
			select {
			case <-t.C:
			case <-lim.done:
				return
			}
		case <-lim.done:
			return
		}
		lim.reconcile(lim.ctx, nil)
	}
}

// reconcile charges Redis with the local spending on every key whose node
// can take the charge now: its breaker is closed, or it is probing, the
// node whose probe holds the half-open ticket (nil if none). Each key's
// current owner is charged, so that after a Cluster failover the spending
// goes to the new master.
//
// Each instance charges what it spent itself, at most a burst per key, and
// the script lets a charge take the bucket into debt, down to one burst:
// instances come back one by one, each at its own probe, and a charge that
// met a bucket already emptied by others is kept rather than lost. Over
// the fleet the charges add up to what it spent without Redis, and the
// refill pays the debt. A charge that fails is owed to the next
// reconciliation, and its spending is kept off the local buckets meanwhile.
//
// It reports whether the probing node took every charge sent to it: a
// probe whose node stopped answering during the pass must not close the
// breaker on its earlier success.
func (lim *Limiter) reconcile(ctx context.Context, probing *node) bool {
	ok, held := lim.charge(ctx, probing, false)
	if ok && held {
		// What was spent behind a charge sent again goes under a new
		// Once once that one is answered (see charge): now, in a second
		// pass, rather than reconcileAfter later, so that a probe closes
		// its breaker on a bucket charged with all of it; the decisions
		// in between would take from a bucket not yet charged with it.
		ok, _ = lim.charge(ctx, probing, false)
	}
	return ok
}

// settle charges a new master, nd, with the local spending on its keys
// only, before it decides: decisions on it wait for that within their
// budget, and the other nodes' keys are the reconciler's.
func (lim *Limiter) settle(ctx context.Context, nd *node) {
	lim.charge(ctx, nd, true)
}

// charge is reconcile, and with only, settle. ok reports whether no charge
// to probing met a node that could not answer; held, whether spending was
// held back behind charges sent again, all of which were answered: a pass
// now would charge it.
func (lim *Limiter) charge(ctx context.Context, probing *node, only bool) (ok, held bool) {
	if lim.cfg.noReconcile {
		return true, false
	}
	// The prober and the reconciler both reconcile: one at a time, or
	// both would report what the other has in flight.
	select {
	case lim.reconciling <- struct{}{}:
	case <-ctx.Done():
		return true, false // owed to the next reconciliation
	}
	defer func() { <-lim.reconciling }()
	if lim.cfg.onPass != nil {
		lim.cfg.onPass()
	}
	reachable := func(key string) *node {
		nd := lim.route(lim.cfg.Prefix + key)
		if nd == nil || nd != probing && (only || nd.cb.State() != breaker.StateClosed) {
			return nil
		}
		return nd
	}
	type charge struct {
		nd    *node
		key   string
		spent float64
		first time.Time   // when it was first sent
		entry local.Entry // the key's entry Drain reported it of
		req   remote.Request
	}
	var charges []charge
	now := lim.cfg.now()
	for key, ps := range lim.unanswered {
		// A key whose bucket went (evicted, reset) never drains again and
		// owes nothing: its charges would never be sent again. Nor would
		// one whose Once Redis forgot.
		if now.Sub(ps[len(ps)-1].sent) >= remote.OnceFor || !lim.shares.Local(key) {
			delete(lim.unanswered, key)
		}
	}
	// However the pass ends, what is left unanswered is sent again at the
	// next reconciliation, which a node's next answer asks for (see send):
	// neither a breaker closing nor a local decision may come again.
	//
	// Only the pending charges' own nodes ask: another node's answers
	// (a Cluster whose node of the key is down) would start a full pass
	// every reconcileAfter that can do nothing for them. pending is left
	// for keys with no known node.
	defer func() {
		owing := map[*node]bool{}
		unrouted := false
		for key := range lim.unanswered {
			if nd := lim.route(lim.cfg.Prefix + key); nd != nil {
				owing[nd] = true
			} else {
				unrouted = true
			}
		}
		lim.forNodes(func(nd *node) { nd.owedCharges.Store(owing[nd]) })
		lim.pending.Store(unrouted)
	}()
	// Keys with a pending charge that Drain looked at (their node is
	// reachable) and did not report owe nothing any more (a refund took
	// it off): their charges are dropped, not kept for OnceFor.
	looked, reported := map[string]bool{}, map[string]bool{}
	lim.shares.Drain(now, func(key string) bool {
		ok := reachable(key) != nil
		if _, p := lim.unanswered[key]; ok && p {
			looked[key] = true
		}
		return ok
	}, func(key string, spent float64, entry local.Entry) {
		if looked[key] {
			reported[key] = true
		}
		nd := reachable(key)
		var own limits
		ls, err := lim.limitFor(key, &own)
		if nd == nil || err != nil {
			return // reported again by the next Drain
		}
		rl := ls.rl
		add := func(p pendingCharge) {
			units := int64(math.Round(math.Min(p.spent, float64(ls.Burst)) * float64(rl.P)))
			charges = append(charges, charge{nd, key, p.spent, p.sent, p.entry,
				remote.Request{Key: lim.cfg.Prefix + key, Limit: rl, Units: units, Charge: true, Once: p.once}})
		}
		// What was charged and not answered goes again under its Once,
		// while Redis still keeps it and it is still owed (a bucket
		// dropped or reset meanwhile owes nothing). What was spent since
		// goes under a new one once those are answered, and stays owed
		// until then: a new Once for each pass while Redis answers late
		// would send one more charge each time, all of them every time.
		// A charge drained from an entry the key no longer has (evicted,
		// and made again) is not: the new entry owes nothing of it, and
		// under a Once Redis may have applied already, the new entry's
		// spending would be settled without ever being charged.
		//
		// A pending charge of which less is owed now (the caller refunded
		// part of the admission) goes again under its Once for what is
		// still owed: Redis may have applied it already, and under a new
		// Once would take that part again on top of it (8 tokens applied
		// for 5 admitted, 2 of them refunded).
		resent := false
		for _, p := range lim.unanswered[key] {
			if p.entry == entry && spent > local.Negligible && now.Sub(p.sent) < remote.OnceFor {
				p.spent = min(p.spent, spent)
				add(p)
				spent -= p.spent
				resent = true
			}
		}
		delete(lim.unanswered, key)
		if resent && spent > local.Negligible {
			held = true
		}
		if !resent && spent > local.Negligible {
			lim.onces++
			add(pendingCharge{once: lim.onceBase + strconv.FormatUint(lim.onces, 36), spent: spent, sent: now, entry: entry})
		}
	})
	for key := range lim.unanswered {
		if looked[key] && !reported[key] {
			delete(lim.unanswered, key)
		}
	}
	if len(charges) == 0 {
		return true, false
	}
	var (
		mu     sync.Mutex
		failed int
		wg     sync.WaitGroup
		sem    = make(chan struct{}, chargers)
		// troubled holds the nodes a charge of this pass found unable to
		// answer (or the pass's ctx ended): their other charges are not
		// sent in this pass, each of which would wait its whole budget,
		// chargers at a time (a pass over 1,280 keys of a Redis that hung
		// again took a second, a million keys 13 minutes, holding the
		// probe's half-open ticket and the prober throughout). They stay
		// pending under their Once, as an unanswered charge does.
		troubled = map[*node]bool{}
		keep     = func(c charge) {
			failed++
			lim.unanswered[c.key] = append(lim.unanswered[c.key], pendingCharge{once: c.req.Once, spent: c.spent, sent: c.first, entry: c.entry})
		}
	)
	for _, c := range charges {
		sem <- struct{}{}
		mu.Lock()
		skip := troubled[c.nd] || ctx.Err() != nil
		if skip {
			keep(c)
		}
		mu.Unlock()
		if skip {
			<-sem
			continue
		}
		wg.Go(func() {
			defer func() { <-sem }()
			p := charging
			if c.nd == probing {
				p = underProbe
			}
			// A charge that was not answered stays owed, although a
			// paused Redis may run it when it resumes (go-redis cannot say
			// whether it was written): it goes again under the same Once,
			// which Redis applies at most once.
			start, budget := time.Now(), lim.budget(ctx)
			_, o := lim.call(ctx, c.nd, p, c.req)
			if o == answered {
				lim.shares.Settle(c.key, c.spent, c.entry)
				return
			}
			mu.Lock()
			defer mu.Unlock()
			if o == badValue {
				// Redis refused it with an error about the key (WRONGTYPE, a
				// script error; remote.IsKeyError): it took
				// nothing and would refuse it again. Kept pending, its own
				// answer would ask for the next pass (see send): a pass
				// and a refusal every reconcileAfter. It stays owed, for
				// the next pass something else starts.
				failed++
				return
			}
			// Perhaps run: the next one goes under this Once, which is
			// harmless if this one never left.
			keep(c)
			if o == callerGone || (o == unanswered || o == down) && time.Since(start) >= budget*9/10 {
				// The node did not answer within the budget. A charge that
				// failed at once (a connection pooled before a restart,
				// broken; a key whose slot moved) costs the pass nothing,
				// and the client's next connection may well answer.
				troubled[c.nd] = true
			}
		})
	}
	wg.Wait()
	lim.charges.Add(uint64(len(charges)))
	lim.chargesFailed.Add(uint64(failed))
	lim.cfg.Logger.Info("hybridlimit: charged Redis for local spending",
		"limiter", lim.cfg.Name, "keys", len(charges), "failed", failed)
	return probing == nil || !troubled[probing], held && failed == 0
}

// pendingCharge is a charge of spent tokens, named once so that Redis
// applies it at most once however often it is sent.
type pendingCharge struct {
	once  string
	spent float64
	sent  time.Time   // first sent: Redis keeps once for remote.OnceFor from about then
	entry local.Entry // the key's entry Drain reported it of
}
