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
//     a local golang.org/x/time/rate bucket per key holding
//     Rate/Instances tokens per second and Burst/Instances tokens;
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
	// ModeRemote: the shared bucket in Redis decided.
	ModeRemote Mode = iota
	// ModeLocal: this instance's local share decided (FailLocal).
	ModeLocal
	// ModeFailOpen: Redis could not decide and FailOpen allowed.
	ModeFailOpen
	// ModeFailClosed: Redis could not decide and FailClosed denied.
	ModeFailClosed
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
	}
	return fmt.Sprintf("Mode(%d)", int(m))
}

// Decision is the outcome of AllowN.
type Decision struct {
	// Allowed reports whether the n tokens were granted.
	Allowed bool
	// Remaining is how many whole tokens the deciding bucket holds after
	// the decision. With PerSecond(10), a fresh key after AllowN(ctx, key, 3)
	// has Remaining 7. Under ModeLocal it counts this instance's share;
	// under ModeFailOpen and ModeFailClosed it is 0 (unknown).
	Remaining int64
	// RetryAfter is, when denied, how long until the bucket can hold n
	// tokens (under ModeFailClosed: until the breaker next probes Redis).
	// Zero when allowed.
	RetryAfter time.Duration
	// ResetAfter is how long until the deciding bucket is full again.
	ResetAfter time.Duration
	// Mode says which path decided.
	Mode Mode
}

// Limiter decides, per key, whether an event may happen now. Create it
// with New; the zero value is not usable.
type Limiter struct {
	cfg     Config
	limit   remote.Limit // cfg.Limit in the script's fixed point
	share   rate.Limit   // local share: tokens per second
	burst   int          // local share: capacity
	shares  *local.Shares
	cluster *redis.ClusterClient // nil unless cfg.Redis is a Cluster client
	single  *node                // the one node unless cluster

	mu     sync.Mutex // protects nodes' writers and closed
	nodes  atomic.Pointer[map[string]*node]
	closed atomic.Bool

	done chan struct{}
	wg   sync.WaitGroup
	once sync.Once
}

// node is one Redis node (one master of a Cluster): its breaker and the
// pipe its decisions go through.
type node struct {
	cb   *breaker.Breaker
	pipe *remote.Pipe
}

// sweepEvery is how often idle full local buckets are dropped.
const sweepEvery = 10 * time.Second

// New returns a Limiter for cfg, or an error wrapping ErrInvalidConfig that
// names the offending field.
//
// New starts a few goroutines per Redis node, which send decisions, and one
// that drops idle local buckets; Close stops them and waits for them to
// return. New does not talk to Redis: the first decision loads the script.
func New(cfg Config) (*Limiter, error) {
	rl, err := cfg.validate()
	if err != nil {
		return nil, err
	}
	burst := cfg.Limit.Burst / int64(cfg.Instances)
	if burst < 1 {
		burst = 1
	}
	lim := &Limiter{
		cfg:    cfg,
		limit:  rl,
		share:  rate.Limit(cfg.Limit.Rate / float64(cfg.Instances)),
		burst:  int(burst),
		shares: local.New(cfg.MaxLocalKeys),
		done:   make(chan struct{}),
	}
	lim.nodes.Store(&map[string]*node{})
	if cc, ok := cfg.Redis.(*redis.ClusterClient); ok {
		lim.cluster = cc
	} else {
		name := "redis"
		if c, ok := cfg.Redis.(*redis.Client); ok {
			name = c.Options().Addr
		}
		lim.single = lim.newNode(name)
	}
	lim.wg.Add(1)
	go lim.sweep()
	return lim, nil
}

func (lim *Limiter) newNode(name string) *node {
	log := lim.cfg.Logger
	b := lim.cfg.Breaker
	return &node{
		cb: breaker.New(breaker.Settings{
			Name:     name,
			Failures: uint32(b.Failures),
			OpenFor:  b.OpenFor,
			Jitter:   b.Jitter,
			Probes:   uint32(b.Probes),
			OnStateChange: func(name string, from, to breaker.State) {
				log.Warn("hybridlimit: breaker state changed",
					"node", name, "from", from.String(), "to", to.String(),
					"policy", lim.cfg.OnFailure.String())
			},
		}),
		pipe: remote.NewPipe(lim.cfg.Redis, 0),
	}
}

// nodeFor returns the node that owns key: for a Cluster, the key's master.
func (lim *Limiter) nodeFor(ctx context.Context, key string) (*node, error) {
	if lim.single != nil {
		return lim.single, nil
	}
	c, err := lim.cluster.MasterForKey(ctx, key)
	if err != nil {
		return nil, err
	}
	addr := c.Options().Addr
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
	nodes := make(map[string]*node, len(old)+1)
	for k, v := range old {
		nodes[k] = v
	}
	nd := lim.newNode(addr)
	nodes[addr] = nd
	lim.nodes.Store(&nodes)
	return nd, nil
}

// Allow is shorthand for AllowN(ctx, key, 1).
func (lim *Limiter) Allow(ctx context.Context, key string) (Decision, error) {
	return lim.AllowN(ctx, key, 1)
}

// AllowN reports whether n tokens may be taken from key's bucket now, and
// takes them if so.
//
// It returns an error only for bad input (ErrInvalidKey, ErrInvalidN),
// after Close (ErrClosed), or when ctx ends before Redis answers (ctx's
// error: the caller gave up, and no decision was made). Redis failures are
// not errors: the FailurePolicy decides, and Decision.Mode says so. AllowN
// waits at most Config.Timeout for Redis.
func (lim *Limiter) AllowN(ctx context.Context, key string, n int64) (Decision, error) {
	if len(key) == 0 || len(key) > MaxKeyLen {
		return Decision{}, fmt.Errorf("%w: length %d, want 1 to %d bytes", ErrInvalidKey, len(key), MaxKeyLen)
	}
	if n < 1 || n > lim.cfg.Limit.Burst {
		return Decision{}, fmt.Errorf("%w: n=%d, want 1 to burst %d", ErrInvalidN, n, lim.cfg.Limit.Burst)
	}
	if lim.closed.Load() {
		return Decision{}, ErrClosed
	}
	if err := ctx.Err(); err != nil {
		return Decision{}, err
	}
	rkey := lim.cfg.Prefix + key
	rctx, cancel := context.WithTimeout(ctx, lim.cfg.Timeout)
	defer cancel()
	nd, err := lim.nodeFor(rctx, rkey)
	if err != nil {
		if errors.Is(err, ErrClosed) {
			return Decision{}, err
		}
		// The Cluster's layout is unknown: no node to ask.
		if ctx.Err() != nil {
			return Decision{}, ctx.Err()
		}
		return lim.fallback(key, n, nil), nil
	}
	done, ok := nd.cb.Allow()
	if !ok {
		return lim.fallback(key, n, nd), nil
	}
	res, err := nd.pipe.Take(rctx, rkey, lim.limit, n)
	switch {
	case err == nil:
		done(nil)
		if res.Repaired {
			lim.cfg.Logger.Warn("hybridlimit: replaced a foreign value with a full bucket", "key", rkey)
		}
		return Decision{
			Allowed:    res.Allowed,
			Remaining:  res.Level / lim.limit.P,
			RetryAfter: res.RetryAfter,
			ResetAfter: res.ResetAfter,
			Mode:       ModeRemote,
		}, nil
	case callerEnded(ctx, rctx, err):
		// The caller's own context ended: not Redis's fault.
		done(fmt.Errorf("%w: %w", breaker.ErrCallerCanceled, err))
		if cerr := ctx.Err(); cerr != nil {
			return Decision{}, cerr
		}
		return Decision{}, context.DeadlineExceeded
	case errors.Is(err, remote.ErrClosed):
		done(breaker.ErrCallerCanceled)
		return Decision{}, ErrClosed
	}
	if errors.Is(err, remote.ErrReply) || !breaker.IsFailure(err) {
		// Redis answered, but not with a decision (a script error, a
		// reply of the wrong shape): the node is healthy, the key is not.
		done(nil)
		lim.cfg.Logger.Error("hybridlimit: remote decision failed", "key", rkey, "err", err)
		return lim.fallback(key, n, nd), nil
	}
	done(err)
	return lim.fallback(key, n, nd), nil
}

// callerEnded reports whether err comes from the caller's context ending
// rather than from Redis or from our own budget running out. A deadline
// error counts as the caller's when the caller's deadline is the one rctx
// inherited: a context's Err lags its deadline by a timer's firing, so the
// deadlines are compared rather than ctx.Err alone.
func callerEnded(ctx, rctx context.Context, err error) bool {
	if ctx.Err() != nil {
		return true
	}
	if !errors.Is(err, context.DeadlineExceeded) {
		return false
	}
	cd, ok := ctx.Deadline()
	rd, _ := rctx.Deadline()
	return ok && !cd.After(rd)
}

// fallback decides by the failure policy. nd is the node that could not
// decide, nil if none was found.
func (lim *Limiter) fallback(key string, n int64, nd *node) Decision {
	switch lim.cfg.OnFailure {
	case FailOpen:
		return Decision{Allowed: true, Mode: ModeFailOpen}
	case FailClosed:
		d := Decision{Mode: ModeFailClosed, RetryAfter: lim.cfg.Breaker.OpenFor}
		if nd != nil {
			if until := nd.cb.OpenUntil(); !until.IsZero() {
				d.RetryAfter = max(until.Sub(time.Now()), 0)
			}
		}
		return d
	}
	r := lim.shares.AllowN(lim.cfg.now(), key, lim.share, lim.burst, int(n))
	return Decision{
		Allowed:    r.Allowed,
		Remaining:  r.Remaining,
		RetryAfter: r.RetryAfter,
		ResetAfter: r.ResetAfter,
		Mode:       ModeLocal,
	}
}

// sweep drops full local buckets every sweepEvery until Close.
func (lim *Limiter) sweep() {
	defer lim.wg.Done()
	t := time.NewTicker(sweepEvery)
	defer t.Stop()
	for {
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
// finish. Close leaves the Redis client open. It is idempotent and always
// returns nil.
func (lim *Limiter) Close() error {
	lim.once.Do(func() {
		lim.mu.Lock()
		lim.closed.Store(true)
		lim.mu.Unlock()
		close(lim.done)
		if lim.single != nil {
			lim.single.pipe.Close()
		}
		for _, nd := range *lim.nodes.Load() {
			nd.pipe.Close()
		}
		lim.wg.Wait()
	})
	return nil
}
