package hybridlimit

import (
	"errors"
	"fmt"
	"log/slog"
	"math"
	"math/rand/v2"
	"reflect"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/hybridlimit/hybridlimit/remote"
)

// Defaults used where a Config field is zero. docs/design.md says why.
const (
	// DefaultTimeout bounds one remote decision: well above a healthy
	// Redis's tail latency (a millisecond or two on a LAN, tens of
	// milliseconds during a fork for a snapshot), small enough that the few
	// decisions paying it before the breaker opens stay tolerable.
	DefaultTimeout = 50 * time.Millisecond
	// DefaultPrefix is put before every key in Redis.
	DefaultPrefix = "hybridlimit:"
	// DefaultBreakerFailures is how many consecutive failed remote decisions
	// open a node's breaker.
	DefaultBreakerFailures = 5
	// DefaultBreakerOpenFor is how long a breaker stays open before a probe.
	// Probes are sent by a background goroutine, never by a decision, so a
	// short period costs callers nothing; it bounds how long an instance
	// keeps deciding locally after Redis is back, while other instances
	// may already be back on the shared bucket.
	DefaultBreakerOpenFor = 250 * time.Millisecond
	// DefaultBreakerJitter lengthens each open period by a random fraction
	// of up to 20%, so a fleet opened by one outage does not probe at once.
	DefaultBreakerJitter = 0.2
	// DefaultMaxLocalKeys bounds the local buckets held for FailLocal.
	DefaultMaxLocalKeys = 1_000_000
	// DefaultLeaseFor is how long leased tokens may be spent (Config.Lease).
	DefaultLeaseFor = 100 * time.Millisecond
	// MaxKeyLen is the longest key AllowN accepts, in bytes.
	MaxKeyLen = 1024
	// DefaultHeartbeat is how often an instance tells the fleet it is live
	// and how busy it is.
	DefaultHeartbeat = time.Second
	// DefaultName names a limiter group.
	DefaultName = "default"
	// MinHeartbeat is the shortest Heartbeat New accepts: each heartbeat
	// is a script call, and windows shorter than this count too few
	// decisions to weigh the fleet by.
	MinHeartbeat = 10 * time.Millisecond
)

// Limit is a token bucket: it refills at Rate tokens per second up to Burst
// tokens, and a decision of cost n succeeds if the bucket holds n tokens.
type Limit struct {
	Rate  float64 // tokens added per second; must be > 0 and finite
	Burst int64   // capacity in tokens, and the largest n a decision may ask for
}

// PerSecond returns a Limit of n tokens per second with a burst of n.
func PerSecond(n int64) Limit { return Limit{Rate: float64(n), Burst: n} }

// PerMinute returns a Limit of n tokens per minute with a burst of n.
func PerMinute(n int64) Limit { return Limit{Rate: float64(n) / 60, Burst: n} }

// String returns the limit as "Rate/s burst Burst", for logs.
func (l Limit) String() string { return fmt.Sprintf("%g/s burst %d", l.Rate, l.Burst) }

// FailurePolicy says who decides while Redis cannot.
type FailurePolicy int

// The failure policies. The zero value is FailLocal.
const (
	// FailLocal decides on this instance's share of the limit: per key, a
	// local token bucket of Rate/Instances tokens per second holding
	// Burst/Instances tokens (at least 1).
	FailLocal FailurePolicy = iota
	// FailOpen allows every decision: no limit while Redis is away.
	FailOpen
	// FailClosed denies every decision while Redis is away.
	FailClosed
)

// String returns the policy's name, such as "FailLocal".
func (p FailurePolicy) String() string {
	switch p {
	case FailLocal:
		return "FailLocal"
	case FailOpen:
		return "FailOpen"
	case FailClosed:
		return "FailClosed"
	}
	return fmt.Sprintf("FailurePolicy(%d)", int(p))
}

// BreakerConfig says when a Redis node's circuit breaker opens and how it
// closes again. Each Redis node (each master of a Cluster) has its own.
type BreakerConfig struct {
	// Failures is how many consecutive failed remote decisions open the
	// breaker. Zero means DefaultBreakerFailures.
	Failures int
	// OpenFor is how long the breaker stays open before probing Redis again.
	// Zero means DefaultBreakerOpenFor.
	OpenFor time.Duration
	// Jitter lengthens each open period by a random fraction in [0, Jitter)
	// of OpenFor. Zero means DefaultBreakerJitter; negative means none.
	Jitter float64
	// Probes is how many half-open decisions go to Redis, all of which must
	// succeed to close the breaker. Zero means 1.
	Probes int
}

// Config configures a Limiter. Only Redis and Limit are required.
type Config struct {
	// Redis is the client to decide through: a *redis.Client, a
	// *redis.ClusterClient (one breaker per master), or a Sentinel failover
	// client (NewFailoverClient, NewFailoverClusterClient). A *redis.Ring
	// or a *redis.AutoPipeliner is refused with ErrInvalidConfig; any other
	// UniversalClient (a wrapper of your own) is taken for one node, with
	// one breaker. The Limiter never closes it. Required.
	Redis redis.UniversalClient
	// Limit is the limit shared by every instance, for every key that
	// LimitFor does not give another; SetLimit changes it. Required.
	Limit Limit
	// LimitFor, if not nil, chooses the limit of each key (tiers, say); a
	// zero Limit means Limit. It is called on every decision, so it should
	// be quick. A bucket whose limit changes keeps its level.
	LimitFor func(key string) Limit
	// Name names the limiter group: the instances that share these limits.
	// It labels logs and observations and names the fleet's heartbeat key,
	// so two Limiters with other limits or keys that use one Redis and one
	// Prefix must have different Names, or each would count the other's
	// instances and traffic as its own. Zero means DefaultName.
	Name string
	// Instances is how many instances share the limit, until the fleet's
	// heartbeats say better; under FailLocal each holds its share of the
	// limit while Redis is away. Zero means unknown: an instance that has
	// not heard from the fleet yet (it started while Redis was away) then
	// holds nothing, and FailLocal denies, since the instances that did
	// hear hold the whole limit between them. Set it to hold 1/Instances
	// instead (Instances: 1 for a service that runs alone). Required with
	// FailLocal when Heartbeat is negative.
	Instances int
	// Heartbeat is how often this instance records in Redis that it is
	// live and how many decisions per second it makes, so that every
	// instance can size its local share from the live fleet, weighted by
	// traffic. Zero means DefaultHeartbeat; negative means no heartbeat,
	// and shares stay 1/Instances; otherwise at least MinHeartbeat.
	Heartbeat time.Duration
	// Prefix is put before every key in Redis. A Cluster user may put a
	// hash tag in it or in the keys. Zero means DefaultPrefix.
	Prefix string
	// Timeout bounds one remote decision; past it the failure policy
	// decides. Zero means DefaultTimeout.
	Timeout time.Duration
	// OnFailure says who decides while Redis cannot. Zero means FailLocal.
	OnFailure FailurePolicy
	// Breaker configures the per-node circuit breakers.
	Breaker BreakerConfig
	// MaxLocalKeys bounds the local buckets held for FailLocal. Zero means
	// DefaultMaxLocalKeys. Past it, a key whose bucket was evicted starts
	// full again when it comes back: set it above the keys a service sees
	// during an outage.
	MaxLocalKeys int
	// Lease, above zero, turns on lease mode, for keys hotter than one
	// Redis core can serve: a decision sent to Redis also takes up to
	// Lease more whole tokens, as many as the bucket holds, and the next
	// decisions on the key spend them here without asking Redis
	// (ModeLease), until they run out or LeaseFor has passed. Concurrent
	// decisions that find no lease each take one; they add up. Leased
	// tokens are taken from the shared bucket, so over time the fleet
	// admits no more than the limit allows, and in any window no more than
	// the bucket grants in it plus the tokens leased before it (the bucket
	// refills below its cap while they are held); but tokens this instance
	// does not spend within LeaseFor are lost, and while it holds them
	// other instances may be refused. A key's limit lowered (SetLimit,
	// LimitFor) drops the tokens leased under the higher one. Zero (the
	// default) turns it off. docs/guide.md, "Lease", has the measured
	// cost.
	Lease int64
	// LeaseFor is how long leased tokens may be spent after the request
	// that leased them was sent; tokens leased by a request sent while a
	// lease is held join it, and the whole lease lasts until the later of
	// the two. Zero means DefaultLeaseFor.
	LeaseFor time.Duration
	// Shadow computes, observes and reports every decision but never
	// enforces it: a denial is returned with Allowed true and Shadowed true.
	// Use it to watch what a new limit would deny before turning it on.
	Shadow bool
	// Observer, if not nil, is told of every decision and breaker change.
	Observer Observer
	// Logger receives breaker state changes and repaired keys. Nil means
	// silent.
	Logger *slog.Logger

	// now is the clock of the local buckets; nil means time.Now. Tests set it.
	now func() time.Time
	// rand is the source of the Limiter's random draws (its Once prefix,
	// its breakers' jitter, WaitN's, its pacer's phase), safe for
	// concurrent use; nil means math/rand/v2's global source. The
	// simulator sets it so that a seed replays the same draws.
	rand rand.Source
	// noCache turns off answering denials from what Redis said; noHandoff
	// stops recording what Redis said (so local buckets start full and no
	// denial is cached); noReconcile stops charging Redis for local
	// spending; noKeyShares holds every key's local share at the
	// instance's weight. The accuracy tests set them to measure each
	// mechanism.
	noCache, noHandoff, noReconcile, noKeyShares bool
	// onPass, if set, is called at the start of every reconciliation
	// pass, which tests count.
	onPass func()
	// onView, if set, is called with each view a heartbeat stores, which
	// the simulator checks across the fleet.
	onView func(*fleet)
	// onLayoutRead, if set, is called at the start of every reading of a
	// Cluster's layout with the nodes it asks, in the order it asks them
	// (a node is asked only if those before it failed or were slow).
	onLayoutRead func(order []string)
}

// Errors returned by New and Limiter methods. Test for them with errors.Is.
var (
	// ErrInvalidConfig is wrapped by every error New returns; the message
	// names the field.
	ErrInvalidConfig = errors.New("hybridlimit: invalid config")
	// ErrInvalidKey is returned for an empty key, one longer than
	// MaxKeyLen, or one holding "{hybridlimit-fleet:", which names the
	// fleet's heartbeat keys.
	ErrInvalidKey = errors.New("hybridlimit: invalid key")
	// ErrInvalidN is returned for n < 1, for n > the key's Limit.Burst
	// (except by AllowAtMost), and by Refund for n above what the
	// decision granted.
	ErrInvalidN = errors.New("hybridlimit: invalid n")
	// ErrInvalidLimit is returned for a Limit that is not positive and
	// finite, or that the script cannot hold exactly, from SetLimit or
	// from Config.LimitFor.
	ErrInvalidLimit = errors.New("hybridlimit: invalid limit")
	// ErrClosed is returned by decisions after Close.
	ErrClosed = errors.New("hybridlimit: limiter closed")
	// ErrUnavailable is wrapped by the error of Reset when Redis did not
	// confirm the reset: an operator's action, unlike a decision, has no
	// failure policy to fall back on. The message says why.
	ErrUnavailable = errors.New("hybridlimit: Redis unavailable")
)

// limits is a Limit with its form in the script's fixed point.
type limits struct {
	Limit
	rl remote.Limit
}

// check returns l with its fixed-point form, or an error wrapping
// ErrInvalidLimit if the script cannot hold it exactly.
func (l Limit) check() (limits, error) {
	if !(l.Rate > 0) || math.IsInf(l.Rate, 0) {
		return limits{}, fmt.Errorf("%w: Rate must be positive and finite, got %v", ErrInvalidLimit, l.Rate)
	}
	if l.Burst < 1 {
		return limits{}, fmt.Errorf("%w: Burst must be at least 1, got %d", ErrInvalidLimit, l.Burst)
	}
	rl, err := remote.NewLimit(l.Rate, l.Burst)
	if err != nil {
		return limits{}, fmt.Errorf("%w: %v: %v", ErrInvalidLimit, l, err)
	}
	return limits{l, rl}, nil
}

// validate checks cfg and fills in the defaults.
func (cfg *Config) validate() error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: "+format, append([]any{ErrInvalidConfig}, args...)...)
	}
	if cfg.Redis == nil {
		return bad("Redis is nil")
	}
	if v := reflect.ValueOf(cfg.Redis); v.Kind() == reflect.Pointer && v.IsNil() {
		// A typed nil, such as a *redis.Client variable never assigned:
		// the first call on it would panic, the first contact's in a
		// goroutine of ours, which no recover of the caller's can catch.
		return bad("Redis is a nil %T", cfg.Redis)
	}
	switch cfg.Redis.(type) {
	case *redis.Ring:
		// Its shards are separate servers chosen by key, which the
		// limiter cannot see: one breaker for all of them, so a shard
		// that hangs sends the others' keys to the failure policy too.
		return bad("Redis is a *redis.Ring, whose shards the limiter cannot tell apart: use a *redis.ClusterClient, or a Limiter per shard")
	case *redis.AutoPipeliner:
		return bad("Redis is a *redis.AutoPipeliner: pass the client it wraps; the limiter batches its own calls")
	}
	if r := cfg.Limit.Rate; !(r > 0) || math.IsInf(r, 0) {
		return bad("Limit.Rate must be positive and finite, got %v", r)
	}
	if cfg.Limit.Burst < 1 {
		return bad("Limit.Burst must be at least 1, got %d", cfg.Limit.Burst)
	}
	if _, err := cfg.Limit.check(); err != nil {
		return bad("Limit: %v", err)
	}
	switch {
	case cfg.Instances < 0:
		return bad("Instances must not be negative, got %d", cfg.Instances)
	case cfg.Timeout < 0:
		return bad("Timeout must not be negative, got %v", cfg.Timeout)
	case cfg.OnFailure < FailLocal || cfg.OnFailure > FailClosed:
		return bad("OnFailure is %v", cfg.OnFailure)
	case cfg.Breaker.Failures < 0 || uint64(cfg.Breaker.Failures) > math.MaxUint32:
		return bad("Breaker.Failures must be 0 to %d, got %d", uint64(math.MaxUint32), cfg.Breaker.Failures)
	case cfg.Breaker.OpenFor < 0:
		return bad("Breaker.OpenFor must not be negative, got %v", cfg.Breaker.OpenFor)
	case math.IsNaN(cfg.Breaker.Jitter) || math.IsInf(cfg.Breaker.Jitter, 0) || cfg.Breaker.Jitter > 10:
		return bad("Breaker.Jitter must be at most 10, got %v", cfg.Breaker.Jitter)
	case cfg.Breaker.Probes < 0 || uint64(cfg.Breaker.Probes) > math.MaxUint32:
		return bad("Breaker.Probes must be 0 to %d, got %d", uint64(math.MaxUint32), cfg.Breaker.Probes)
	case cfg.MaxLocalKeys < 0:
		return bad("MaxLocalKeys must not be negative, got %d", cfg.MaxLocalKeys)
	case cfg.Lease < 0:
		return bad("Lease must not be negative, got %d", cfg.Lease)
	case cfg.LeaseFor < 0:
		return bad("LeaseFor must not be negative, got %v", cfg.LeaseFor)
	case cfg.Heartbeat < 0 && cfg.Instances == 0 && cfg.OnFailure == FailLocal:
		return bad("Instances must be set with FailLocal when Heartbeat is negative: nothing else says the share")
	case cfg.Heartbeat > 0 && cfg.Heartbeat < MinHeartbeat:
		return bad("Heartbeat must be at least %v (or negative: none), got %v", MinHeartbeat, cfg.Heartbeat)
	}
	if cfg.Name == "" {
		cfg.Name = DefaultName
	}
	if cfg.Heartbeat == 0 {
		cfg.Heartbeat = DefaultHeartbeat
	}
	if cfg.Prefix == "" {
		cfg.Prefix = DefaultPrefix
	}
	if cfg.Timeout == 0 {
		cfg.Timeout = DefaultTimeout
	}
	if cfg.Breaker.Failures == 0 {
		cfg.Breaker.Failures = DefaultBreakerFailures
	}
	if cfg.Breaker.OpenFor == 0 {
		cfg.Breaker.OpenFor = DefaultBreakerOpenFor
	}
	if cfg.Breaker.Jitter == 0 {
		cfg.Breaker.Jitter = DefaultBreakerJitter
	}
	if cfg.Breaker.Probes == 0 {
		cfg.Breaker.Probes = 1
	}
	if cfg.MaxLocalKeys == 0 {
		cfg.MaxLocalKeys = DefaultMaxLocalKeys
	}
	if cfg.LeaseFor == 0 {
		cfg.LeaseFor = DefaultLeaseFor
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.now == nil {
		cfg.now = time.Now
	}
	if cfg.rand == nil {
		cfg.rand = globalSource{}
	}
	return nil
}

// limitFor returns key's limit: Config.LimitFor's, filled into own, or
// the default.
func (lim *Limiter) limitFor(key string, own *limits) (*limits, error) {
	if lim.cfg.LimitFor != nil {
		if l := lim.cfg.LimitFor(key); l != (Limit{}) {
			ls, err := l.check()
			if err != nil {
				return nil, fmt.Errorf("LimitFor(%q): %w", key, err)
			}
			*own = ls
			return own, nil
		}
	}
	return lim.limit.Load(), nil
}

// Name returns Config.Name, the limiter group's name.
func (lim *Limiter) Name() string { return lim.cfg.Name }

// Limit returns the default limit: Config.Limit, or what SetLimit set.
func (lim *Limiter) Limit() Limit { return lim.limit.Load().Limit }

// SetLimit changes the default limit at run time. Each key's bucket in
// Redis takes the new limit on its next decision and keeps its tokens (a
// smaller burst caps them); the local shares follow. Every instance of the
// group should be given the same limit. It returns an error wrapping
// ErrInvalidLimit for a limit the script cannot hold exactly.
func (lim *Limiter) SetLimit(l Limit) error {
	ls, err := l.check()
	if err != nil {
		return err
	}
	lim.limit.Store(&ls)
	return nil
}

// globalSource is math/rand/v2's global source, as a Source.
type globalSource struct{}

func (globalSource) Uint64() uint64 { return rand.Uint64() }
