// Package otelmetrics records hybridlimit decisions and breaker changes as
// OpenTelemetry metrics. It is a module of its own, so the OpenTelemetry
// dependencies stay out of hybridlimit's go.mod; it uses the metric API
// only, and any MeterProvider (the SDK's, or a no-op one) may be given.
//
// New returns an Observer to set as Config.Observer; Register adds the
// gauges read from a Limiter's Stats. The instruments come from the meter
// named "github.com/hybridlimit/hybridlimit":
//
//	instrument                       kind       unit          attributes
//	hybridlimit.decisions            counter    {decision}    hybridlimit.limiter, hybridlimit.mode, hybridlimit.outcome
//	hybridlimit.decision.duration    histogram  s             hybridlimit.limiter, hybridlimit.mode
//	hybridlimit.breaker.transitions  counter    {transition}  hybridlimit.limiter, hybridlimit.node, hybridlimit.breaker.from, hybridlimit.breaker.to
//	hybridlimit.breaker.state        gauge      {state}       hybridlimit.limiter, hybridlimit.node
//	hybridlimit.local.keys           gauge      {key}         hybridlimit.limiter
//	hybridlimit.fleet.instances      gauge      {instance}    hybridlimit.limiter
//	hybridlimit.local.share          gauge      1             hybridlimit.limiter
//	hybridlimit.charges              counter    {charge}      hybridlimit.limiter, hybridlimit.charge.outcome
//
// The attributes take these values:
//
//   - hybridlimit.limiter: Config.Name ("default" when unset);
//   - hybridlimit.mode: who decided, as Mode.String prints it: "remote",
//     "local", "fail-open", "fail-closed" or "lease";
//   - hybridlimit.outcome: "allowed", "denied", or "shadowed" for a denial
//     that Config.Shadow let through;
//   - hybridlimit.node: the Redis node's address;
//   - hybridlimit.breaker.from, hybridlimit.breaker.to: "closed",
//     "half-open" or "open";
//   - hybridlimit.charge.outcome: "confirmed", or "failed" for a charge
//     Redis did not confirm (it stays owed and goes again).
//
// hybridlimit.decisions counts decisions, not tokens. The duration
// histogram's bucket boundaries run from 50µs to 100ms (0.00005, 0.0001,
// 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05 and 0.1
// seconds; WithDurationBoundaries changes them), so a decision that waited
// out the default 50ms Timeout lands above 0.05.
// hybridlimit.breaker.state is 0 while the node's breaker is closed, 1
// half-open and 2 open. hybridlimit.local.keys counts the keys with local
// state (a local bucket, or what Redis last said of the key),
// hybridlimit.fleet.instances the live instances the last heartbeat saw,
// and hybridlimit.local.share is the part of every limit this instance
// holds while Redis is away, in [0, 1] (0 before its first heartbeat when
// Config.Instances is unset: FailLocal then denies).
// hybridlimit.charges counts the charges of local spending sent to Redis
// when it answers again (Stats.Charges, one per key and reconciliation);
// failed charges that keep growing while every breaker is closed mean the
// spending during outages is not reaching Redis (an ACL that refuses the
// charge's key, a script error).
//
// Recording a decision looks up attribute sets built once per limiter and
// mode, and allocates nothing of its own.
package otelmetrics

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sync"
	"sync/atomic"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/hybridlimit/hybridlimit"
)

// ScopeName is the name of the meter the instruments come from.
const ScopeName = "github.com/hybridlimit/hybridlimit"

// Attribute keys.
const (
	keyLimiter = attribute.Key("hybridlimit.limiter")
	keyMode    = attribute.Key("hybridlimit.mode")
	keyOutcome = attribute.Key("hybridlimit.outcome")
	keyNode    = attribute.Key("hybridlimit.node")
	keyFrom    = attribute.Key("hybridlimit.breaker.from")
	keyTo      = attribute.Key("hybridlimit.breaker.to")

	keyChargeOutcome = attribute.Key("hybridlimit.charge.outcome")
)

// Outcomes, the values of hybridlimit.outcome, index modeSets.decisions.
const (
	allowed = iota
	denied
	shadowed
	outcomes
)

var outcomeNames = [outcomes]string{allowed: "allowed", denied: "denied", shadowed: "shadowed"}

// defaultBounds are the bucket boundaries, in seconds, of the
// hybridlimit.decision.duration histogram: from 50µs (a local decision) to
// 100ms (twice the default Timeout).
var defaultBounds = []float64{
	0.00005, 0.0001, 0.00025, 0.0005,
	0.001, 0.0025, 0.005,
	0.01, 0.025, 0.05, 0.1,
}

// Option configures New.
type Option func(*config)

type config struct {
	bounds []float64
}

// WithDurationBoundaries sets the bucket boundaries, in seconds and
// increasing, of the hybridlimit.decision.duration histogram instead of
// the default ones, 50µs to 100ms.
func WithDurationBoundaries(bounds ...float64) Option {
	return func(c *config) { c.bounds = append([]float64(nil), bounds...) }
}

// Observer records hybridlimit decisions and breaker changes on
// OpenTelemetry instruments. Create it with New and set it as
// Config.Observer; one Observer may serve several limiters. Observer is
// safe for concurrent use by multiple goroutines.
type Observer struct {
	meter       metric.Meter
	decisions   metric.Int64Counter
	duration    metric.Float64Histogram
	transitions metric.Int64Counter

	breakerState metric.Int64ObservableGauge
	localKeys    metric.Int64ObservableGauge
	fleet        metric.Int64ObservableGauge
	share        metric.Float64ObservableGauge
	charges      metric.Int64ObservableCounter

	sets atomic.Pointer[map[setKey]*modeSets] // copy on write
	mu   sync.Mutex                           // serializes writers of sets
}

// setKey names the attribute sets of one limiter and mode.
type setKey struct {
	limiter string
	mode    hybridlimit.Mode
}

// modeSets holds the measurement options of one limiter and mode, built
// once: passing a stored slice allocates nothing, where calling
// metric.WithAttributeSet on every decision would.
type modeSets struct {
	decisions [outcomes][]metric.AddOption
	duration  []metric.RecordOption
}

var _ hybridlimit.Observer = (*Observer)(nil)

// New returns an Observer that records hybridlimit decisions and breaker
// changes on instruments from mp's meter "github.com/hybridlimit/hybridlimit",
// for use as Config.Observer. It returns an error if mp is nil, if the
// duration boundaries are not increasing and finite, or if mp fails to
// create an instrument.
func New(mp metric.MeterProvider, opts ...Option) (*Observer, error) {
	if mp == nil {
		return nil, errors.New("otelmetrics: nil MeterProvider")
	}
	cfg := config{bounds: defaultBounds}
	for _, opt := range opts {
		opt(&cfg)
	}
	for i, b := range cfg.bounds {
		if math.IsNaN(b) || math.IsInf(b, 0) || i > 0 && !(b > cfg.bounds[i-1]) {
			return nil, fmt.Errorf("otelmetrics: duration boundaries must be finite and increasing, got %v", cfg.bounds)
		}
	}
	m := mp.Meter(ScopeName)
	o := &Observer{meter: m}
	var errs [8]error
	o.decisions, errs[0] = m.Int64Counter("hybridlimit.decisions",
		metric.WithUnit("{decision}"),
		metric.WithDescription("Rate-limit decisions, by who decided and the outcome."))
	o.duration, errs[1] = m.Float64Histogram("hybridlimit.decision.duration",
		metric.WithUnit("s"),
		metric.WithDescription("Time from the call to the decision."),
		metric.WithExplicitBucketBoundaries(cfg.bounds...))
	o.transitions, errs[2] = m.Int64Counter("hybridlimit.breaker.transitions",
		metric.WithUnit("{transition}"),
		metric.WithDescription("State changes of the circuit breaker of a Redis node."))
	o.breakerState, errs[3] = m.Int64ObservableGauge("hybridlimit.breaker.state",
		metric.WithUnit("{state}"),
		metric.WithDescription("State of the circuit breaker of a Redis node: 0 closed, 1 half-open, 2 open."))
	o.localKeys, errs[4] = m.Int64ObservableGauge("hybridlimit.local.keys",
		metric.WithUnit("{key}"),
		metric.WithDescription("Keys with local state: a local bucket or what Redis last said of them."))
	o.fleet, errs[5] = m.Int64ObservableGauge("hybridlimit.fleet.instances",
		metric.WithUnit("{instance}"),
		metric.WithDescription("Live instances of the limiter group, as the last heartbeat saw."))
	o.share, errs[6] = m.Float64ObservableGauge("hybridlimit.local.share",
		metric.WithUnit("1"),
		metric.WithDescription("Part of every limit this instance holds while Redis is away."))
	o.charges, errs[7] = m.Int64ObservableCounter("hybridlimit.charges",
		metric.WithUnit("{charge}"),
		metric.WithDescription("Charges of local spending sent to Redis when it answers again, by whether Redis confirmed them."))
	if err := errors.Join(errs[:]...); err != nil {
		return nil, fmt.Errorf("otelmetrics: %w", err)
	}
	o.sets.Store(&map[setKey]*modeSets{})
	return o, nil
}

// ObserveDecision implements hybridlimit.Observer: it counts the decision
// and records its duration.
func (o *Observer) ObserveDecision(ev hybridlimit.DecisionEvent) {
	s := o.setsFor(ev.Limiter, ev.Mode)
	out := denied
	switch {
	case ev.Shadowed:
		out = shadowed
	case ev.Allowed:
		out = allowed
	}
	ctx := context.Background()
	o.decisions.Add(ctx, 1, s.decisions[out]...)
	o.duration.Record(ctx, ev.Latency.Seconds(), s.duration...)
}

// ObserveBreaker implements hybridlimit.Observer: it counts the transition.
func (o *Observer) ObserveBreaker(ev hybridlimit.BreakerEvent) {
	o.transitions.Add(context.Background(), 1, metric.WithAttributeSet(attribute.NewSet(
		keyLimiter.String(ev.Limiter),
		keyNode.String(ev.Node),
		keyFrom.String(ev.From),
		keyTo.String(ev.To),
	)))
}

// setsFor returns the measurement options of limiter and mode, building
// them on first use.
func (o *Observer) setsFor(limiter string, mode hybridlimit.Mode) *modeSets {
	k := setKey{limiter, mode}
	if s := (*o.sets.Load())[k]; s != nil {
		return s
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	old := *o.sets.Load()
	if s := old[k]; s != nil {
		return s
	}
	s := &modeSets{}
	l, m := keyLimiter.String(limiter), keyMode.String(mode.String())
	for i, name := range outcomeNames {
		set := attribute.NewSet(l, m, keyOutcome.String(name))
		s.decisions[i] = []metric.AddOption{metric.WithAttributeSet(set)}
	}
	s.duration = []metric.RecordOption{metric.WithAttributeSet(attribute.NewSet(l, m))}
	sets := make(map[setKey]*modeSets, len(old)+1)
	for k, v := range old {
		sets[k] = v
	}
	sets[k] = s
	o.sets.Store(&sets)
	return s
}

// Register adds observable gauges read from lim.Stats() on each
// collection: breaker state per node (0 closed, 1 half-open, 2 open),
// local keys held, fleet size, local share weight, and the charges of
// local spending, confirmed and failed. Returns a registration
// to Unregister.
//
// The gauges' hybridlimit.limiter attribute is lim.Name(). Register each
// Limiter once, and give limiters registered with the same Observer
// different names (Config.Name).
func (o *Observer) Register(lim *hybridlimit.Limiter) (metric.Registration, error) {
	if lim == nil {
		return nil, errors.New("otelmetrics: Register of a nil Limiter")
	}
	l := keyLimiter.String(lim.Name())
	limOpt := metric.WithAttributeSet(attribute.NewSet(l))
	confirmedOpt := metric.WithAttributeSet(attribute.NewSet(l, keyChargeOutcome.String("confirmed")))
	failedOpt := metric.WithAttributeSet(attribute.NewSet(l, keyChargeOutcome.String("failed")))
	reg, err := o.meter.RegisterCallback(func(_ context.Context, obs metric.Observer) error {
		st := lim.Stats()
		for node, state := range st.Breakers {
			v, ok := stateValue(state)
			if !ok {
				continue
			}
			obs.ObserveInt64(o.breakerState, v, metric.WithAttributeSet(attribute.NewSet(l, keyNode.String(node))))
		}
		obs.ObserveInt64(o.localKeys, int64(st.LocalKeys), limOpt)
		obs.ObserveInt64(o.fleet, int64(st.Fleet), limOpt)
		obs.ObserveFloat64(o.share, st.Weight, limOpt)
		obs.ObserveInt64(o.charges, int64(st.Charges-st.ChargesFailed), confirmedOpt)
		obs.ObserveInt64(o.charges, int64(st.ChargesFailed), failedOpt)
		return nil
	}, o.breakerState, o.localKeys, o.fleet, o.share, o.charges)
	if err != nil {
		return nil, fmt.Errorf("otelmetrics: %w", err)
	}
	return reg, nil
}

// stateValue returns the gauge value of a breaker state as Stats names it.
func stateValue(state string) (int64, bool) {
	switch state {
	case "closed":
		return 0, true
	case "half-open":
		return 1, true
	case "open":
		return 2, true
	}
	return 0, false
}
