package hybridlimit

import "time"

// Observer is told of every decision and every breaker state change, for
// metrics and logs. ObserveDecision is called on the deciding goroutine,
// ObserveBreaker on the goroutine whose call changed the state (a
// decision's, or the prober's), never while the limiter holds a lock; they
// must be quick and safe for concurrent use. A nil Config.Observer costs
// nothing.
//
// Every decision that returns without an error is one DecisionEvent: Allow,
// AllowN and AllowAtMost one each, WaitN one per try (a try whose tokens it
// then gives back, its deadline too close, counts as allowed). A call that
// returns an error (ErrInvalidN, ErrInvalidKey, ErrClosed, the caller's
// context) makes none, nor do Refund, Peek, Reset, and the limiter's own
// charges and probes.
type Observer interface {
	ObserveDecision(DecisionEvent)
	ObserveBreaker(BreakerEvent)
}

// DecisionEvent describes one decision. It carries no key: keys are
// unbounded, labels should not be.
type DecisionEvent struct {
	Limiter  string        // Config.Name
	Mode     Mode          // who decided
	Allowed  bool          // as returned (true for a shadowed denial)
	Shadowed bool          // granted less than asked (denied, or an AllowAtMost short of n), let through by Config.Shadow
	Cached   bool          // a denial answered from what Redis said of the key, without a round trip
	N        int64         // tokens asked for (for AllowAtMost, at most the limit's burst)
	Granted  int64         // tokens the caller may spend, as Decision.Granted (0 for a denial)
	Latency  time.Duration // from the call to the decision
}

// BreakerEvent describes a breaker state change of one Redis node.
type BreakerEvent struct {
	Limiter  string // Config.Name
	Node     string // the node's address ("FailoverClient" for a Sentinel client, "redis" for a wrapper of unknown kind)
	From, To string // "closed", "half-open" or "open"
}

// Stats is a snapshot of a Limiter's state, for gauges.
type Stats struct {
	// LocalKeys is how many keys have local state: a local bucket or what
	// Redis last said of them.
	LocalKeys int
	// Breakers maps each Redis node's address to its breaker's state:
	// "closed", "half-open" or "open".
	Breakers map[string]string
	// Fleet is how many live instances the last heartbeat saw (or
	// Config.Instances before one succeeded), and Weight this instance's
	// part of every limit while Redis is away.
	Fleet  int
	Weight float64
	// Charges counts the charges of local spending sent to Redis since
	// New (one per key and reconciliation), and ChargesFailed those Redis
	// did not confirm: not answered, refused, or held back because the
	// key's node stopped answering meanwhile. A failed charge stays owed
	// and goes again; ChargesFailed growing while every breaker is
	// closed means the spending is not reaching Redis (an ACL that
	// refuses the charge's key, a script error).
	Charges, ChargesFailed uint64
}

// Stats returns a snapshot of the limiter's state. It takes a lock per
// local shard, so call it for gauges, not per decision.
func (lim *Limiter) Stats() Stats {
	v := lim.view.Load()
	st := Stats{
		LocalKeys:     lim.shares.Len(),
		Breakers:      map[string]string{},
		Fleet:         v.size,
		Weight:        v.weight,
		Charges:       lim.charges.Load(),
		ChargesFailed: lim.chargesFailed.Load(),
	}
	add := func(nd *node) { st.Breakers[nd.addr] = nd.cb.State().String() }
	if lim.single != nil {
		add(lim.single)
	}
	for _, nd := range *lim.nodes.Load() {
		add(nd)
	}
	return st
}
