// Package hybridlimit limits the rate of events per key across the many
// instances of a service, through one token bucket per key in Redis, and
// keeps limiting sensibly while Redis is slow, restarting or gone.
//
// Every decision goes to Redis, where one Lua script refills, checks and
// deducts the key's bucket atomically, reading the clock with Redis TIME so
// that client clocks never matter. The call runs through a circuit breaker
// per Redis node and within a time budget (Config.Timeout) that holds
// whatever the Redis client's own time-outs are. When a call fails, or the
// node's breaker is open, the FailurePolicy decides instead:
//
//   - FailLocal (the default) decides on this instance's share of the limit:
//     a local golang.org/x/time/rate bucket per key holding its share of
//     the rate and burst. The share is 1/Instances until the fleet's
//     heartbeats say how many instances are live and how busy each is;
//     for a key used near its limit it is the part of that key this
//     instance served, measured from Redis's answers.
//     A key's local bucket starts from what Redis last said of the key, not
//     full, and what it spent is charged to Redis when Redis is back;
//   - FailOpen allows everything;
//   - FailClosed denies everything.
//
// Decision.Mode says which path decided. A Redis failure is never returned
// as an error, and never reported as a denial of its own making: the
// policy's decision is returned with a nil error.
//
// Limiter is safe for concurrent use by multiple goroutines.
package hybridlimit

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	"golang.org/x/time/rate"

	"github.com/hybridlimit/hybridlimit/breaker"
	"github.com/hybridlimit/hybridlimit/local"
	"github.com/hybridlimit/hybridlimit/remote"
)

// Mode says which path made a decision.
type Mode int

// The decision paths.
const (
	// ModeRemote: the shared bucket in Redis decided, or what Redis said
	// of the key proves its answer (a denial that Redis would repeat).
	ModeRemote Mode = iota
	// ModeLocal: this instance's local share decided (FailLocal).
	ModeLocal
	// ModeFailOpen: Redis could not decide and FailOpen allowed.
	ModeFailOpen
	// ModeFailClosed: Redis could not decide and FailClosed denied.
	ModeFailClosed
	// ModeLease: tokens that Redis leased to this instance decided
	// (Config.Lease).
	ModeLease
)

// String returns the mode's name, such as "remote".
func (m Mode) String() string {
	switch m {
	case ModeRemote:
		return "remote"
	case ModeLocal:
		return "local"
	case ModeFailOpen:
		return "fail-open"
	case ModeFailClosed:
		return "fail-closed"
	case ModeLease:
		return "lease"
	}
	return fmt.Sprintf("Mode(%d)", int(m))
}

// Degraded reports whether m is a decision made without Redis: leased
// tokens came from Redis, so ModeLease is not degraded.
func (m Mode) Degraded() bool { return m != ModeRemote && m != ModeLease }

// Decision is the outcome of AllowN or AllowAtMost.
type Decision struct {
	// Allowed reports whether the n tokens were granted; for AllowAtMost,
	// whether one token at least was.
	Allowed bool
	// Granted is how many tokens the caller may spend: n when AllowN
	// allows, 0 when it denies; for AllowAtMost, from 0 to n, as many as
	// the bucket held. With PerSecond(10), AllowAtMost(ctx, key, 7) on a
	// fresh key grants 7, and then 3. A Shadowed decision grants n.
	Granted int64
	// Remaining is how many whole tokens the deciding bucket holds after
	// the decision. With PerSecond(10), a fresh key after AllowN(ctx, key, 3)
	// has Remaining 7. Under ModeLocal it counts this instance's share.
	// With Config.Lease it counts the tokens left in this instance's lease
	// too: under ModeLease, those and what Redis's bucket held when it
	// last answered for the key, refilled since. Under ModeFailOpen and
	// ModeFailClosed it is 0 (unknown).
	Remaining int64
	// RetryAfter is, when denied, how long until the bucket can hold n
	// tokens, for AllowAtMost one token (under ModeFailClosed: until the
	// breaker next probes Redis; under ModeLocal, at most what the whole
	// limit takes to refill n tokens, or until the next probe if that is
	// later). Zero when allowed.
	RetryAfter time.Duration
	// ResetAfter is how long until the deciding bucket is full again
	// (under ModeLease, Redis's).
	ResetAfter time.Duration
	// Mode says which path decided.
	Mode Mode
	// Limit is the limit that applied to the key.
	Limit Limit
	// Shadowed reports that Config.Shadow let through more than the limit
	// gave: a denial, or an AllowAtMost granted fewer than the n asked
	// (Granted is then n). Allowed is true; after a denial, RetryAfter
	// says what the denial would. Refund gives back at most what the
	// bucket gave.
	Shadowed bool
	// Cached reports a denial answered without a round trip, from what
	// Redis said of the key less than a second ago (Mode is ModeRemote):
	// Redis was not asked, so it may be away by now.
	Cached bool

	wait time.Duration // WaitN: how long a reservation must wait
	due  int64         // WaitN: when Redis's bucket has paid the reservation (remote.Due)
	dueQ int64         // WaitN: the reservation's limit's Q: a give-back under another is not sent
	// took is, for a Shadowed decision, the tokens the limit did grant
	// and the bucket gave (AllowAtMost's partial grant): Refund gives
	// back no more.
	took int64
}

// Limiter decides, per key, whether an event may happen now. Create it
// with New; the zero value is not usable.
type Limiter struct {
	cfg     Config
	limit   atomic.Pointer[limits]  // the default limit; SetLimit changes it
	view    atomic.Pointer[fleet]   // this instance's share of every limit
	shares  *local.Shares           // local buckets and what Redis said per key
	cluster *redis.ClusterClient    // nil unless cfg.Redis is a Cluster client
	single  *node                   // the one node unless cluster
	nodes   atomic.Pointer[nodeMap] // cluster nodes by address; copy on write
	count   atomic.Int64            // tokens offered, for the fleet's weights (see demand)
	demand  *demand                 // counts count; nil without a heartbeat
	heart   *heart                  // the heartbeat; nil without one
	pacer   *pacer                  // runs heart, with the others of cfg.Redis
	healed  chan *node              // nodes whose breaker closed, to reconcile
	owed    chan struct{}           // local decisions on nodes whose breaker is closed
	opened  chan struct{}           // a breaker opened: wakes the prober

	mu     sync.Mutex // serializes writers of nodes, and closed with them
	closed atomic.Bool
	// reconciling holds one token, taken by reconcile: it protects
	// unanswered and onces. A channel, not a mutex: reconcile holds it
	// across its charges' round trips, and a reconcile that waits for
	// another gives up when its context ends.
	reconciling chan struct{}
	// unanswered holds, by key, the charges sent and not answered: sent
	// again under the same Once, Redis applies each at most once.
	unanswered map[string][]pendingCharge
	// pending is set while unanswered holds charges of keys with no known
	// node: any node's answer then asks for a reconciliation. Those with
	// a node set its owedCharges instead.
	pending  atomic.Bool
	onces    uint64     // charges named so far
	onceBase string     // this Limiter's part of every Once, random
	rand     *rand.Rand // every random draw of the Limiter, from Config.rand
	// charges and chargesFailed count the charges of local spending sent
	// to Redis and those it did not confirm, for Stats.
	charges, chargesFailed atomic.Uint64
	// spentLocally is set by the first local decision that granted tokens:
	// from then on there can be local spending to charge.
	spentLocally atomic.Bool
	// misrouted logs, once, that a client of one node answered MOVED: a
	// plain client of a Cluster node (see send).
	misrouted sync.Once

	// For a Cluster: the layout the limiter read itself, whether a reading
	// is under way, and its own node clients (protected by mu).
	layout    atomic.Pointer[layout]
	reading   atomic.Bool
	watchRead chan struct{} // closed when the watched calls' reading ends; nil: none (protected by mu)
	relaid    atomic.Int64  // when a failed call last had the layout read (lim.cfg.now, Unix ns)
	own       map[string]*redis.Client

	// For a Cluster: mapped is set once go-redis has loaded the slot
	// layout; tried is closed when the first attempt to load it ended.
	mapped atomic.Bool
	tried  chan struct{}
	// warmed is closed when warm has returned: the first contact with
	// Redis is over, whatever came of it.
	warmed chan struct{}
	born   time.Time // when New returned it, for coldFor

	// ctx is the context of every Redis call the limiter makes of its own
	// (probes, charges, heartbeats); Close cancels it.
	ctx    context.Context
	cancel context.CancelFunc
	done   chan struct{} // closed by Close
	wg     sync.WaitGroup
	once   sync.Once
}

type nodeMap = map[string]*node

// node is one Redis node (one master of a Cluster): its breaker, the pipe
// its decisions go through, and the key the prober sends probes to.
type node struct {
	addr  string
	cb    *breaker.Breaker
	pipe  *remote.Pipe
	probe atomic.Pointer[probe] // the last key that failed; set before the breaker opens
	// settling is set while the local spending on a new master's keys is
	// charged to it: a decision on a key this instance spent on locally
	// waits for it within its budget (and goes local past it), so that
	// none takes from a bucket its charge has not reached yet.
	settling atomic.Bool
	settled  chan struct{} // closed when settling ends; nil if it never began
	// failed is when (lim.cfg.now, in Unix nanoseconds) a call to the node
	// last failed: what Redis said of a key before then may be gone (a
	// restart without its data fails the calls sent meanwhile), so it
	// answers no cached denial.
	failed atomic.Int64
	// lastErr is the error of the node's last failed call, for the log
	// of its breaker's transitions: the only place the cause is told.
	lastErr atomic.Pointer[error]
	// failing is set while the node's last call failed. A Cluster node's
	// keys are then routed by the limiter's own layout (override): an
	// instance whose traffic is too sparse to open the breaker would
	// otherwise follow go-redis to a master that failed over, for good.
	failing atomic.Bool
	// answered is when (lim.cfg.now, Unix ns) a Cluster node last answered
	// a call, kept to within a tenth of quietFor: calls to a node quiet for
	// longer, or never heard, are watched for a failover (watch).
	answered atomic.Int64
	// window is the last window of the fleet's heartbeats (Redis TIME)
	// in which a call to the node was answered: a key whose answers
	// ended well before it moved to another instance (keyWeight).
	window atomic.Int64
	// owedCharges is set while a charge of a key routed to this node is
	// pending (Limiter.unanswered): its answers then ask for a
	// reconciliation. Another node's answers cannot send it again.
	owedCharges atomic.Bool
	// direct is the pipe of a Cluster node's probes, to its own address;
	// made once, by the prober (probePipe).
	once   sync.Once
	direct *remote.Pipe
	// probing is set while the prober's goroutine for the node probes it.
	probing atomic.Bool
}

// probe is a key the node owns and its limit: a probe charges it nothing.
type probe struct {
	key string
	rl  remote.Limit
}

// cachedFor is how long what Redis said of a key may answer denials
// without a round trip: a second bounds what an operator's DEL, or Redis
// losing its data, can cost, at one call per key, instance and second
// under abuse.
const cachedFor = time.Second

// sweepEvery is how often idle full local buckets are dropped.
const sweepEvery = 10 * time.Second

// New returns a Limiter for cfg, or an error wrapping ErrInvalidConfig that
// names the offending field.
//
// New starts a few goroutines per Redis node, which send decisions, one
// that makes the first contact with Redis, one that drops idle local
// buckets, one that probes nodes whose breaker is open, one that charges
// Redis for local spending when a node's breaker closes; Close stops them
// and waits for them to return (with a client that bounds no read, not for
// those still inside it: see Close). The fleet heartbeats of all Limiters that
// share one client are sent by one goroutine, which the first of them
// starts and the last to Close stops and waits for.
//
// New itself does not wait for Redis. The first contact, in the
// background, loads the scripts (and a Cluster's layout) on every node and
// sends remote.DefaultInFlight PINGs to each, each on a connection of its
// own: a client's hooks see them. No decision waits for it beyond its own
// budget.
func New(cfg Config) (*Limiter, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	lim := &Limiter{
		reconciling: make(chan struct{}, 1),
		cfg:         cfg,
		shares:      local.New(cfg.MaxLocalKeys),
		unanswered:  map[string][]pendingCharge{},
		rand:        rand.New(cfg.rand),
		healed:      make(chan *node, 1),
		owed:        make(chan struct{}, 1),
		opened:      make(chan struct{}, 1),
		tried:       make(chan struct{}),
		warmed:      make(chan struct{}),
		done:        make(chan struct{}),
	}
	lim.onceBase = strconv.FormatUint(lim.rand.Uint64(), 36) + "."
	lim.ctx, lim.cancel = context.WithCancel(context.Background())
	lim.born = time.Now()
	ls, _ := cfg.Limit.check() // validate checked it
	lim.limit.Store(&ls)
	lim.view.Store(initialView(cfg.Instances))
	lim.nodes.Store(&nodeMap{})
	if cc, ok := cfg.Redis.(*redis.ClusterClient); ok {
		lim.cluster = cc
	} else {
		name := "redis"
		if c, ok := cfg.Redis.(*redis.Client); ok {
			name = c.Options().Addr
		}
		lim.single = lim.newNode(name, nil)
	}
	lim.wg.Add(4)
	go lim.sweep()
	go lim.reconciler()
	go lim.prober()
	go lim.warm()
	if cfg.Heartbeat > 0 {
		lim.demand = newDemand()
		lim.heart = newHeart(lim)
		lim.pacer = join(lim.heart)
	}
	return lim, nil
}

// newNode returns the node of addr. Its pipe sends through c, the
// limiter's own client of that node, or if c is nil through Config.Redis,
// which routes each key (and follows MOVED and ASK) itself.
func (lim *Limiter) newNode(addr string, c *redis.Client) *node {
	b := lim.cfg.Breaker
	var via redis.UniversalClient = lim.cfg.Redis
	if c != nil {
		via = c
	}
	nd := &node{addr: addr, pipe: remote.NewPipe(via, 0, &remote.Node{Name: addr, Log: lim.cfg.Logger, Now: lim.cfg.now})}
	nd.cb = breaker.New(breaker.Settings{
		Name:     addr,
		Failures: uint32(b.Failures),
		OpenFor:  b.OpenFor,
		Jitter:   b.Jitter,
		Probes:   uint32(b.Probes),
		Rand:     lim.cfg.rand,
		OnStateChange: func(name string, from, to breaker.State) {
			// The limiter's own wake-ups first: a Logger or an Observer of
			// the user's that panics must not leave the prober asleep
			// while the breaker is open (decisions local for good).
			switch to {
			case breaker.StateClosed:
				select {
				case lim.healed <- nd:
				default: // a reconciliation is pending already
				}
			case breaker.StateOpen:
				select {
				case lim.opened <- struct{}{}:
				default: // the prober is awake already
				}
			}
			args := []any{"limiter", lim.cfg.Name, "node", name, "from", from.String(), "to", to.String(),
				"policy", lim.cfg.OnFailure.String()}
			if e := nd.lastErr.Load(); e != nil && to == breaker.StateOpen {
				args = append(args, "err", *e)
			}
			// Warn when the node is lost, Info when it is back; the
			// probes between (open, half-open, open again: about seven a
			// second for the whole outage) at Debug.
			level := slog.LevelDebug
			switch {
			case from == breaker.StateClosed:
				level = slog.LevelWarn
			case to == breaker.StateClosed:
				level = slog.LevelInfo
			}
			lim.cfg.Logger.Log(context.Background(), level, "hybridlimit: breaker state changed", args...)
			if lim.cfg.Observer != nil {
				lim.cfg.Observer.ObserveBreaker(BreakerEvent{
					Limiter: lim.cfg.Name, Node: name, From: from.String(), To: to.String(),
				})
			}
		},
	})
	return nd
}

// errNoLayout is nodeFor's error while the Cluster's layout is unknown.
var errNoLayout = errors.New("hybridlimit: the Cluster's slot layout is not loaded")

// nodeFor returns the node that owns key: for a Cluster, the key's master.
// It never loads the Cluster's layout itself, which go-redis would do
// synchronously, for up to its ReadTimeout per seed node whatever ctx
// says: New loads it in the background, and until that first attempt has
// ended a decision waits for it until ctx ends (decide bounds ctx by the
// budget then). After a failed attempt it returns errNoLayout at once,
// while loading goes on.
func (lim *Limiter) nodeFor(ctx context.Context, key string) (*node, error) {
	if lim.single != nil {
		return lim.single, nil
	}
	if !lim.mapped.Load() {
		select {
		case <-lim.tried:
		case <-ctx.Done():
			if errors.Is(ctx.Err(), context.Canceled) {
				return nil, ctx.Err()
			}
		}
		if !lim.mapped.Load() {
			return nil, errNoLayout
		}
	}
	return lim.masterFor(key)
}

// route returns the node that owns key without waiting: nil while the
// Cluster's layout is unknown.
func (lim *Limiter) route(key string) *node {
	if lim.single != nil {
		return lim.single
	}
	if !lim.mapped.Load() {
		return nil
	}
	nd, _ := lim.masterFor(key)
	return nd
}

// masterFor returns the node of key's master from go-redis's loaded
// layout, which MasterForKey reads without network I/O once it is loaded.
func (lim *Limiter) masterFor(key string) (*node, error) {
	c, err := lim.cluster.MasterForKey(lim.ctx, key)
	if err != nil {
		return nil, err
	}
	addr := c.Options().Addr
	if o := lim.override(key, addr); o != "" {
		// go-redis still routes the key to a node that is not usable,
		// and the layout read since names another master.
		return lim.ownNode(o)
	}
	return lim.nodeAt(addr, nil)
}

// ownNode returns the node of the master at addr; one made now sends
// through the limiter's own client of addr, since go-redis routes its
// keys elsewhere still.
func (lim *Limiter) ownNode(addr string) (*node, error) {
	if nd := (*lim.nodes.Load())[addr]; nd != nil {
		return nd, nil
	}
	own := lim.ownClient(addr)
	if own == nil {
		return nil, ErrClosed
	}
	return lim.nodeAt(addr, own)
}

// nodeAt returns the node of the master at addr, made with own (see
// newNode) if there is none.
func (lim *Limiter) nodeAt(addr string, own *redis.Client) (*node, error) {
	if nd := (*lim.nodes.Load())[addr]; nd != nil {
		return nd, nil
	}
	lim.mu.Lock()
	defer lim.mu.Unlock()
	if lim.closed.Load() {
		return nil, ErrClosed
	}
	old := *lim.nodes.Load()
	if nd := old[addr]; nd != nil {
		return nd, nil
	}
	if own != nil && lim.own[addr] != own {
		// Closed since ownNode had it: no layout named addr then.
		own = lim.ownClientLocked(addr)
	}
	nodes := make(nodeMap, len(old)+1)
	for k, v := range old {
		nodes[k] = v
	}
	nd := lim.newNode(addr, own)
	settle := lim.spentLocally.Load()
	if settle {
		// A master that appeared after local decisions were made (a
		// failover, a new shard) took slots from another: what this
		// instance spent locally on their keys is charged to it before it
		// decides.
		nd.settling.Store(true)
		nd.settled = make(chan struct{})
	}
	nodes[addr] = nd
	lim.nodes.Store(&nodes)
	if settle {
		lim.wg.Go(func() {
			defer close(nd.settled)
			defer nd.settling.Store(false)
			lim.settle(lim.ctx, nd)
		})
	}
	return nd, nil
}

// waitSettled waits until nd is not settling or ctx ends, and reports
// whether it is not.
func (nd *node) waitSettled(ctx context.Context) bool {
	if !nd.settling.Load() {
		return true
	}
	select {
	case <-nd.settled:
		return true
	case <-ctx.Done():
		return false
	}
}

// close closes nd's pipes.
func (nd *node) close() {
	nd.pipe.Close()
	nd.once.Do(func() {}) // no probe pipe from now on
	if nd.direct != nil {
		nd.direct.Close()
	}
}

// forget drops nd, a node that no longer owns slots, from the nodes: its
// breaker and its pipe go, so that addresses that come and go (pods of a
// managed Cluster) do not pile up. Its pipe is closed in the background:
// calls still in flight there wait on the client's own time-outs.
func (lim *Limiter) forget(nd *node) {
	lim.mu.Lock()
	defer lim.mu.Unlock()
	if lim.closed.Load() {
		return
	}
	old := *lim.nodes.Load()
	if old[nd.addr] != nd {
		return
	}
	nodes := make(nodeMap, len(old))
	for k, v := range old {
		if v != nd {
			nodes[k] = v
		}
	}
	lim.nodes.Store(&nodes)
	lim.cfg.Logger.Info("hybridlimit: forgot a node that owns no slots", "limiter", lim.cfg.Name, "node", nd.addr)
	drop := lim.unnamedClients()
	lim.wg.Go(func() {
		nd.close()
		closeClients(drop)
	})
}

// Allow is shorthand for AllowN(ctx, key, 1).
func (lim *Limiter) Allow(ctx context.Context, key string) (Decision, error) {
	return lim.AllowN(ctx, key, 1)
}

// AllowN reports whether n tokens may be taken from key's bucket now, and
// takes them if so.
//
// It returns an error only for bad input (ErrInvalidKey, ErrInvalidN, or
// ErrInvalidLimit from Config.LimitFor), after Close (ErrClosed), or when
// ctx ends before Redis answers (ctx's error: the caller gave up, and no
// decision was made). Redis failures are not errors: the FailurePolicy
// decides, and Decision.Mode says so. AllowN waits at most Config.Timeout
// for Redis. On a client with ContextTimeoutEnabled, a decision alone on
// an idle node runs its call on the caller's goroutine, and go-redis stops
// its read at a deadline only: a cancellation of ctx before its deadline
// (a client that hung up) is then seen once Redis answers or that wait
// ends, not at once.
func (lim *Limiter) AllowN(ctx context.Context, key string, n int64) (d Decision, err error) {
	return d, lim.allowN(ctx, key, n, 0, false, &d)
}

// reservedKeys is in the names of keys that are no bucket: the fleet's
// heartbeat hashes (fleetKey) sit beside the buckets, under the Prefix.
const reservedKeys = "{hybridlimit-fleet:"

// checkKey returns an error wrapping ErrInvalidKey if key cannot name a
// bucket: empty, longer than MaxKeyLen, or one that may name a heartbeat
// hash, which a decision would replace with a bucket (a key taken from a
// request could then stop the fleet's heartbeats). Not only at its start:
// with Limiters on one Redis whose Prefixes nest ("hl:" and "hl:api:"),
// the key "api:{hybridlimit-fleet:..." of the first names a hash of the
// second.
func checkKey(key string) error {
	if len(key) == 0 || len(key) > MaxKeyLen {
		return fmt.Errorf("%w: length %d, want 1 to %d bytes", ErrInvalidKey, len(key), MaxKeyLen)
	}
	if strings.Contains(key, reservedKeys) {
		return fmt.Errorf("%w: keys holding %q are reserved", ErrInvalidKey, reservedKeys)
	}
	return nil
}

// allowN is AllowN, filling d in place (a Decision is a few words, copied
// through every frame otherwise, and this is the hottest path there is);
// reserve and atMost are decide's.
func (lim *Limiter) allowN(ctx context.Context, key string, n, reserve int64, atMost bool, d *Decision) error {
	if err := checkKey(key); err != nil {
		return err
	}
	var own limits
	ls, err := lim.limitFor(key, &own)
	if err != nil {
		return err
	}
	asked := n
	if atMost {
		if n < 1 {
			return fmt.Errorf("%w: n=%d, want at least 1", ErrInvalidN, n)
		}
		n = min(n, ls.Burst) // no bucket holds more
	} else if n < 1 || n > ls.Burst {
		return fmt.Errorf("%w: n=%d, want 1 to burst %d", ErrInvalidN, n, ls.Burst)
	}
	if lim.closed.Load() {
		return ErrClosed
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	var start time.Time
	if lim.cfg.Observer != nil {
		start = time.Now()
	}
	if err := lim.decide(ctx, key, n, ls, reserve, atMost, d); err != nil {
		*d = Decision{}
		return err
	}
	d.Limit = ls.Limit
	if !atMost && d.Allowed {
		d.Granted = n
	}
	if lim.cfg.Shadow && d.Granted < asked {
		d.took = d.Granted
		d.Allowed, d.Shadowed, d.Granted = true, true, asked
	}
	if lim.cfg.Observer != nil {
		lim.cfg.Observer.ObserveDecision(DecisionEvent{
			Limiter: lim.cfg.Name, Mode: d.Mode, Allowed: d.Allowed, Shadowed: d.Shadowed,
			Cached: d.Cached, N: n, Granted: d.Granted, Latency: time.Since(start),
		})
	}
	return nil
}

// decide makes the decision: from leased tokens, from what Redis said of
// the key, by Redis, or by the failure policy. With reserve above zero
// (WaitN), Redis grants the tokens even if the bucket then owes up to
// reserve units, and d.wait says how long the caller must wait for them.
// With atMost (AllowAtMost), it takes as many whole tokens as the
// deciding bucket holds, up to n, and d.Granted says how many.
func (lim *Limiter) decide(ctx context.Context, key string, n int64, ls *limits, reserve int64, atMost bool, d *Decision) error {
	// Tokens leased from Redis are spent first, whether Redis is there
	// or not: it granted them already.
	if lim.cfg.Lease > 0 && atMost {
		if taken, left := lim.shares.TakeLeaseUpTo(lim.cfg.now(), key, ls.rl, n); taken > 0 {
			lim.count.Add(taken) // granted by Redis, for the fleet's weights
			*d = Decision{Allowed: true, Granted: taken, Mode: ModeLease}
			lim.leased(key, ls, left, d)
			return nil
		}
	} else if lim.cfg.Lease > 0 {
		if left, ok := lim.shares.TakeLease(lim.cfg.now(), key, ls.rl, n); ok {
			lim.count.Add(n) // granted by Redis, for the fleet's weights
			*d = Decision{Allowed: true, Mode: ModeLease}
			lim.leased(key, ls, left, d)
			return nil
		}
	}
	// While the one node is away, decide at once, without building
	// anything for Redis: this path allocates nothing.
	if nd := lim.single; nd != nil && nd.cb.State() != breaker.StateClosed {
		lim.fallback(key, n, ls, nd, atMost, d)
		return nil
	}
	rkey := lim.cfg.Prefix + key
	caller := ctx
	if lim.cluster != nil && !lim.mapped.Load() {
		// Waiting for the Cluster's layout spends the decision's budget:
		// the call that follows gets only what is left of it.
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, lim.cfg.Timeout)
		defer cancel()
		if err := caller.Err(); err != nil {
			return err
		}
	}
	nd, err := lim.nodeFor(ctx, rkey)
	if err != nil {
		if errors.Is(err, ErrClosed) {
			return err
		}
		if errors.Is(err, context.Canceled) {
			return err
		}
		// The Cluster's layout is unknown: no node to ask.
		lim.fallback(key, n, ls, nil, atMost, d)
		return nil
	}
	// While the breaker is not closed, only the prober talks to the node:
	// no decision waits on a probe.
	if nd.cb.State() != breaker.StateClosed {
		lim.fallback(key, n, ls, nd, atMost, d)
		return nil
	}
	if nd.settling.Load() && lim.shares.Local(key) {
		// A new master is being charged with what this instance spent
		// locally on its keys (a round trip per batch of keys), this one
		// perhaps among them: worth waiting for, within the decision's
		// budget, which the call then shares. A key this instance never
		// decided locally owes nothing and goes at once.
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, lim.budget(ctx))
		defer cancel()
		if !nd.waitSettled(ctx) {
			if ended(caller) {
				return ctxErr(caller)
			}
			lim.fallback(key, n, ls, nd, atMost, d)
			return nil
		}
	}
	// AllowAtMost is denied only if the bucket holds less than a token.
	least := n
	if atMost {
		least = 1
	}
	if !lim.cfg.noCache && reserve == 0 && lim.cached(nd, key, least, ls, d) {
		lim.tally(key, n, ls, false, 0)
		return nil
	}
	rl := ls.rl
	sent := lim.cfg.now()
	req := remote.Request{Key: rkey, Limit: rl, Units: rl.Units(n), Lease: lim.cfg.Lease, Reserve: reserve}
	if atMost {
		// Lease mode's grant is the script's "as many whole tokens as the
		// bucket holds": one token, and up to n-1 more.
		req = remote.Request{Key: rkey, Limit: rl, Units: rl.Units(1), Lease: n - 1}
	}
	var heldBefore int64 // leased tokens held when the call was sent
	if lim.cfg.Lease > 0 && !atMost {
		heldBefore = lim.shares.Leased(sent, key, rl)
	}
	res, o := lim.call(ctx, nd, whenClosed, req)
	switch o {
	case answered:
		lim.tally(key, n, ls, res.Allowed, max(res.Level, 0)/rl.P)
		if res.Leased > 0 && !atMost {
			lim.shares.Lease(sent, key, rl, res.Leased, sent.Add(lim.cfg.LeaseFor))
		}
		if res.Repaired {
			lim.cfg.Logger.Warn("hybridlimit: replaced a foreign value with a full bucket", "key", rkey)
		}
		took := int64(0)
		if res.Allowed {
			took = req.Units + res.Leased*rl.P
		}
		lim.observe(sent, key, rl, res, took)
		*d = Decision{
			Allowed:    res.Allowed,
			Remaining:  max(res.Level, 0) / rl.P,
			RetryAfter: res.RetryAfter,
			ResetAfter: res.ResetAfter,
			Mode:       ModeRemote,
		}
		if atMost && res.Allowed {
			d.Granted = 1 + res.Leased
		}
		if res.Leased > 0 && !atMost {
			// The lease just taken is the caller's to spend too, as a
			// decision from it says: Remaining does not fall by the lease
			// at each grant and rise back at the next decision. With
			// what was leased before this call left (those tokens left
			// Redis's bucket before it ran), and no more than the lease
			// holds now: a lease another call took after this one ran is
			// in this one's level already, and an expired one is nobody's.
			now := lim.cfg.now()
			d.Remaining = min(d.Remaining+min(heldBefore+res.Leased, lim.shares.Leased(now, key, rl)), ls.Burst)
		}
		if res.Allowed && res.Level < 0 {
			d.wait = ceilMicros(-res.Level, rl.Q) // granted ahead of the refill
			d.due, d.dueQ = remote.Due(res, rl), rl.Q
		}
		return nil
	case callerGone:
		if lim.closed.Load() {
			return ErrClosed
		}
		if ended(caller) {
			return ctxErr(caller)
		}
		// Only the budget ran out (waiting for the Cluster's layout took
		// it): the caller still gets a decision.
	}
	lim.fallback(key, n, ls, nd, atMost, d)
	return nil
}

// leased sets d's Remaining and ResetAfter for a decision spent from this
// instance's lease of key, which holds left tokens after it: what the
// caller may still spend is those and what Redis's bucket held when it
// last answered for the key, refilled since, up to the burst (the lease's
// tokens left the bucket when they were granted); ResetAfter is when that
// bucket is full again. Told only the lease (4 where the bucket held 94), a
// client pacing itself on the RateLimit field backed off a limit it had
// barely touched.
func (lim *Limiter) leased(key string, ls *limits, left int64, d *Decision) {
	d.Remaining = left
	tokens, r, at, ok := lim.shares.Seen(key)
	if !ok || !(r > 0) {
		return
	}
	burst := float64(ls.Burst)
	level := math.Min(burst, tokens+r*max(lim.cfg.now().Sub(at).Seconds(), 0))
	d.Remaining = min(left+int64(max(level, 0)), ls.Burst)
	if level < burst {
		d.ResetAfter = time.Duration(math.Ceil((burst - level) / r * float64(time.Second)))
	}
}

// observe records what Redis said of key at sent: res.Level units of 1/rl.P
// token, after a call that took took units (negative for a refund). The
// local bucket starts from it if Redis fails, cached answers denials from
// it, and it counts for this instance's part of the key (see keyWeight).
func (lim *Limiter) observe(sent time.Time, key string, rl remote.Limit, res remote.Result, took int64) {
	switch {
	case lim.heart != nil && !lim.cfg.noKeyShares:
		lim.shares.Count(sent, key, rl, lim.heart.every.Microseconds(), res.Now, res.Level, took, !lim.cfg.noHandoff)
	case !lim.cfg.noHandoff:
		lim.shares.Observe(sent, res.Now, key, rl.Tokens(res.Level), rl.Rate(), float64(rl.Burst))
	}
}

// cached answers a decision that Redis would deny, from what Redis said of
// the key less than cachedFor ago: the bucket held part frac of its burst
// at time at (when
// that request was sent, no later than when Redis decided) and cannot have
// gained more than the refill since, whatever other instances do. If that
// is less than n, Redis would deny too, so nothing is sent. RetryAfter is
// then a lower bound of Redis's: other instances may have spent more.
// A Refund by another instance, or a raised limit, can make the bucket
// hold more than that bound; the error lasts at most one RetryAfter.
func (lim *Limiter) cached(nd *node, key string, n int64, ls *limits, d *Decision) bool {
	tokens, r, at, ok := lim.shares.Seen(key)
	// Rates are compared in the form they were recorded in, the fixed
	// point's: the user's float can differ from it by a rounding step.
	if !ok || r > ls.rl.Rate() || lim.cfg.now().Sub(at) > cachedFor || at.UnixNano() <= nd.failed.Load() {
		// The limit was lowered since (Redis refilled faster meanwhile),
		// Redis has not confirmed the key's state for too long (an
		// operator may have deleted the key, or Redis lost it), or a
		// call to the node failed since (it may have restarted empty).
		return false
	}
	rl := ls.rl
	// In the script's fixed point, so that the answer is Redis's to the
	// microsecond: units of 1/P token, Q units a microsecond.
	capacity := rl.Burst * rl.P
	units := min(int64(math.Round(tokens*float64(rl.P))), capacity)
	// Rounded up: Redis counts whole microseconds of its clock, and the
	// microseconds between two readings of it are at most the elapsed
	// time rounded up. Rounded down, the cache could deny a microsecond
	// before Redis's refill reaches n.
	us := int64((lim.cfg.now().Sub(at) + time.Microsecond - 1) / time.Microsecond)
	if us > (capacity-units)/rl.Q {
		return false // full again
	}
	units += us * rl.Q
	if units >= n*rl.P {
		return false
	}
	*d = Decision{
		Remaining:  max(units, 0) / rl.P, // as Redis's answer says it: a debt holds none
		RetryAfter: ceilMicros(n*rl.P-units, rl.Q),
		ResetAfter: ceilMicros(capacity-units, rl.Q),
		Mode:       ModeRemote,
		Cached:     true,
	}
	return true
}

// ceilMicros returns ceil(units/q) microseconds, as the script computes it.
func ceilMicros(units, q int64) time.Duration {
	return time.Duration((units+q-1)/q) * time.Microsecond
}

// ctxErr returns ctx's error, or DeadlineExceeded if its deadline has
// passed but its timer has not fired yet.
func ctxErr(ctx context.Context) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	return context.DeadlineExceeded
}

// fallback decides by the failure policy. nd is the node that could not
// decide, nil if none was found; atMost is decide's.
func (lim *Limiter) fallback(key string, n int64, ls *limits, nd *node, atMost bool, d *Decision) {
	switch lim.cfg.OnFailure {
	case FailOpen:
		*d = Decision{Allowed: true, Granted: n, Mode: ModeFailOpen}
		return
	case FailClosed:
		*d = Decision{Mode: ModeFailClosed, RetryAfter: lim.untilProbe(nd)}
		return
	}
	r, burst, capacity := lim.share(key, ls.Limit, nd)
	asked := n
	if atMost {
		n = min(n, int64(burst))
	}
	if capacity <= 0 || n > int64(burst) {
		// The share can never hold n (or this instance holds none: it has
		// not heard of the fleet yet): denied until Redis may be back.
		lim.tally(key, asked, ls, false, 0)
		*d = Decision{Mode: ModeLocal, RetryAfter: lim.untilProbe(nd)}
		return
	}
	var res local.Result
	granted := n
	now := lim.cfg.now()
	if atMost {
		var k int
		res, k = lim.shares.AllowAtMost(now, key, r, burst, capacity, int(n))
		granted = int64(k)
	} else {
		res = lim.shares.AllowN(now, key, r, burst, capacity, int(n))
	}
	if res.Allowed && !lim.spentLocally.Load() {
		lim.spentLocally.Store(true)
	}
	// What is offered while Redis is away counts for the fleet's weights
	// as it does while Redis decides: the heartbeats go on reaching a
	// Redis too slow for decisions but not for them, and weights that
	// counted only Redis's decisions would fall to an even split after a
	// few windows of it. As for Redis's answers, a key is near its limit
	// (and takes one of demand's bounded entries) if it was denied or the
	// share was left with less than a window's refill.
	left := int64(0)
	if float64(res.Remaining) >= float64(r)*lim.cfg.Heartbeat.Seconds() {
		left = math.MaxInt64
	}
	lim.tally(key, asked, ls, res.Allowed, left)
	*d = Decision{
		Allowed:    res.Allowed,
		Remaining:  res.Remaining,
		RetryAfter: res.RetryAfter,
		ResetAfter: res.ResetAfter,
		Mode:       ModeLocal,
	}
	if !res.Allowed {
		// A share of a slow limit refills far slower than the limit (a
		// thirty-fifth of 5 a minute: a token in seven minutes), while
		// Redis may be back at the next probe, and its bucket then refills
		// n tokens in n/Rate: a denial is not told to wait longer than
		// that.
		want := n
		if atMost {
			want = 1 // AllowAtMost is denied until one token
		}
		if whole := float64(want) / ls.Rate * float64(time.Second); whole < float64(d.RetryAfter) {
			d.RetryAfter = min(d.RetryAfter, max(lim.untilProbe(nd), time.Duration(whole)))
		}
	}
	if atMost && res.Allowed {
		d.Granted = granted
	}
	if res.Allowed && nd != nil && nd.cb.State() == breaker.StateClosed {
		// A decision that Redis did not answer, on a node whose breaker
		// stays closed: nothing else would charge Redis for it. What it
		// took is owed at once: by the reconciliation, 100 ms on, a fast
		// share may have refilled and would report nothing spent.
		lim.shares.Hold(now, key)
		lim.owe()
	}
}

// untilProbe returns how long until the next probe of nd can have closed
// its breaker: the rest of its open period, or, once that is over (or for
// a breaker still closed), a probe's round.
func (lim *Limiter) untilProbe(nd *node) time.Duration {
	d := probeTick + lim.cfg.Timeout
	if nd != nil {
		if until := nd.cb.OpenUntil(); !until.IsZero() {
			d = max(time.Until(until), d)
		}
	}
	return d
}

// share returns this instance's share of key's limit l, whose node is nd
// (nil: not known): its rate, the burst of its local bucket (at least 1,
// so that a token can be granted at all), and its capacity, which may be
// a fraction of a token: the local bucket starts from that, so that a
// fleet of many instances holding a small burst does not grant a token at
// each instance at once.
func (lim *Limiter) share(key string, l Limit, nd *node) (rate.Limit, int, float64) {
	w := lim.keyWeight(key, lim.view.Load(), nd)
	capacity := float64(l.Burst) * w
	return rate.Limit(l.Rate * w), int(max(int64(capacity), 1)), capacity
}

// warm makes the first contact with Redis in the background, so that the
// first decisions do not pay for it inside their budget: it loads the
// scripts into every node's cache and, for a Cluster, the slot layout,
// retrying the layout until it loads or Close, and it opens the
// connections to each node that its pipe keeps busy at once with calls
// sent alone: dialing them, go-redis's handshake included, inside the
// first decisions' budgets can take a busy machine past several budgets in
// a row and open a breaker on a healthy Redis. A failure to load the
// scripts is harmless: decisions load them as they go.
func (lim *Limiter) warm() {
	defer lim.wg.Done()
	defer close(lim.warmed)
	if lim.cluster == nil {
		close(lim.tried)
		ctx, cancel := context.WithTimeout(lim.ctx, time.Second)
		defer cancel()
		err := remote.Load(ctx, lim.cfg.Redis)
		if err != nil {
			lim.cfg.Logger.Debug("hybridlimit: loading the scripts failed", "limiter", lim.cfg.Name, "err", err)
		}
		if !remote.IsFailure(err) {
			remote.Ping(ctx, lim.cfg.Redis, remote.DefaultInFlight, lim.cfg.Timeout)
		}
		return
	}
	t := time.NewTimer(time.Hour)
	defer t.Stop()
	// stuck is closed when the last attempt, which outlived its context
	// inside a client that bounds no read (remote.Detach), returns: the
	// next waits for it rather than wait there beside it.
	var stuck <-chan struct{}
	for wait := 100 * time.Millisecond; ; wait = min(2*wait, 5*time.Second) {
		if stuck != nil {
			select {
			case <-stuck:
			case <-lim.done:
				return
			}
		}
		ctx, cancel := context.WithTimeout(lim.ctx, time.Second)
		var err, done error // done: ForEachMaster's, once it returned
		stuck = remote.Detach(ctx, lim.cluster, func() {
			done = lim.cluster.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error {
				lim.mapped.Store(true) // ForEachMaster calls fn only once a layout is loaded
				err := remote.Load(ctx, c)
				if !remote.IsFailure(err) {
					remote.Ping(ctx, c, remote.DefaultInFlight, lim.cfg.Timeout)
				}
				return err
			})
		})
		if err = ctx.Err(); stuck == nil {
			err = done
		}
		cancel()
		if wait == 100*time.Millisecond {
			close(lim.tried)
		}
		if lim.mapped.Load() {
			// go-redis reads the servers' command table (COMMAND) on the
			// first command its Cluster client routes, tens of
			// milliseconds under load: part of the first contact, not of
			// the first decision's budget.
			ctx, cancel := context.WithTimeout(lim.ctx, time.Second)
			remote.Detach(ctx, lim.cluster, func() { _ = lim.cluster.Ping(ctx).Err() })
			cancel()
			if err != nil {
				lim.cfg.Logger.Debug("hybridlimit: loading the scripts failed", "limiter", lim.cfg.Name, "err", err)
			}
			return
		}
		lim.cfg.Logger.Debug("hybridlimit: loading the Cluster's layout failed", "limiter", lim.cfg.Name, "err", err)
		t.Reset(wait)
		select {
		case <-t.C:
		case <-lim.done:
			return
		}
	}
}

// sweep drops full local buckets every sweepEvery until Close. While
// there is none (nor a lease), it sleeps until one is made: an idle
// Limiter wakes nothing.
func (lim *Limiter) sweep() {
	defer lim.wg.Done()
	t := time.NewTimer(sweepEvery)
	defer t.Stop()
	for {
		if lim.shares.Empty() {
			select {
			case <-lim.shares.Made():
			case <-lim.done:
				return
			}
		}
		t.Reset(sweepEvery)
		select {
		case <-t.C:
			lim.shares.Sweep(lim.cfg.now())
		case <-lim.done:
			return
		}
	}
}

// Close stops the limiter's goroutines and waits for them to return;
// decisions after Close return ErrClosed. A decision in flight may still
// finish, and Close waits for Redis calls already sent, which the client's
// own time-outs bound (on a client with ContextTimeoutEnabled, the calls'
// budgets, and up to a second more after a budget cut a read short: the
// connection is being opened again). With a client that bounds no read
// (ReadTimeout -1 without ContextTimeoutEnabled, or -2 in any case) it
// does not wait for those calls: the goroutines that sent them return when
// Redis answers or the client is closed. Before it stops them, it charges
// Redis, within one Timeout, with what this instance spent locally and
// still owes, where the key's breaker is closed. Close leaves the Redis
// client open. It is idempotent and always returns nil.
func (lim *Limiter) Close() error {
	lim.once.Do(func() {
		lim.mu.Lock()
		lim.closed.Store(true)
		lim.mu.Unlock()
		if lim.spentLocally.Load() {
			// What this instance spent locally and still owes (held on a
			// time-out reconcileAfter ago at most, or charged and not
			// answered) is charged now, within one budget: no later pass
			// will (a rolling deploy closes every instance in turn).
			ctx, cancel := context.WithTimeout(lim.ctx, lim.cfg.Timeout)
			lim.reconcile(ctx, nil)
			cancel()
		}
		close(lim.done)
		lim.cancel()
		if lim.pacer != nil {
			lim.pacer.leave(lim.heart)
		}
		lim.wg.Wait()
		if lim.single != nil {
			lim.single.pipe.Close()
		}
		for _, nd := range *lim.nodes.Load() {
			nd.close()
		}
		for _, c := range lim.own {
			c.Close()
		}
	})
	return nil
}
