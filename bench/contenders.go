// Package bench compares hybridlimit's remote decisions with other Redis
// rate limiters and with the floors they share: one bare EVALSHA of
// hybridlimit's script per decision, and golang.org/x/time/rate in memory.
//
// Every contender is run the same way (Run): the same goroutines, the same
// keys, a latency recorded for every decision. The benchmarks in
// bench_test.go drive Run; cmd/perf runs them with redis-benchmark and the
// memory measurements and writes docs/performance.md.
//
// It is a module of its own so that the alternatives stay out of
// hybridlimit's go.mod.
package bench

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/go-redis/redis_rate/v10"
	"github.com/redis/go-redis/v9"
	"github.com/ulule/limiter/v3"
	ulredis "github.com/ulule/limiter/v3/drivers/store/redis"
	"golang.org/x/time/rate"

	"github.com/hybridlimit/hybridlimit"
	"github.com/hybridlimit/hybridlimit/lua"
	"github.com/hybridlimit/hybridlimit/remote"
)

// Rate and Burst are the limit every contender gets: large enough that every
// decision is allowed, and every one writes its key (TestContendersWrite).
// Not a higher rate: at 1e9 per second, redis_rate's increment of one
// nanosecond is below the resolution of its floating-point time (about
// 60 ns for seconds since 2017), so its script never writes and never
// limits anything, and a benchmark of it measures a read.
const (
	Rate  = 1_000_000
	Burst = 1_000_000_000
)

// EnvRedis names the environment variable that gives the benchmarks a
// redis-server to use, as host:port (cmd/perf sets it to the server it
// started). Without it, the first test or benchmark that needs Redis starts
// one, and TestMain stops it.
const EnvRedis = "HYBRIDLIMIT_BENCH_REDIS"

// Decide makes one decision for the key it was bound to.
type Decide func(ctx context.Context) (allowed bool, err error)

// Instance is an open contender.
type Instance interface {
	// Bind returns the decision function for key. Work that does not have
	// to happen per decision (building the key, its arguments, finding a
	// local bucket) happens here, outside the timed loop, when the
	// contender's own API allows it.
	Bind(key string) Decide
	// Close releases what Open made. It leaves the Redis client open.
	Close() error
}

// Contender is one limiter under test.
type Contender struct {
	Name string
	// Remote reports whether the contender decides in Redis.
	Remote bool
	// Leases reports that it takes tokens from Redis in batches, so that
	// most decisions do not reach Redis.
	Leases bool
	// Open returns an instance deciding through rdb (nil for local ones).
	Open func(rdb redis.UniversalClient) (Instance, error)
}

// Contenders are the limiters compared, in the order the reports list them.
var Contenders = []Contender{
	{Name: "hybridlimit", Remote: true, Open: openHybrid},
	{Name: "hybridlimit-ctx", Remote: true, Open: openHybridCtx},
	{Name: "hybridlimit-lease", Remote: true, Leases: true, Open: openHybridLease},
	{Name: "script", Remote: true, Open: openScript},
	{Name: "script-autopipe", Remote: true, Open: openScriptAutoPipe},
	{Name: "redis_rate", Remote: true, Open: openRedisRate},
	{Name: "ulule", Remote: true, Open: openUlule},
	{Name: "xrate", Open: openXRate},
}

// errDegraded is returned when hybridlimit decided without Redis: the run
// would no longer measure the remote path.
var errDegraded = errors.New("bench: hybridlimit decided without Redis")

// hybrid is hybridlimit.Limiter, as a user would configure it, with no
// heartbeat (it would add its own Redis traffic).
type hybrid struct{ lim *hybridlimit.Limiter }

func openHybrid(rdb redis.UniversalClient) (Instance, error) {
	return OpenHybrid(rdb, "", hybridlimit.Limit{Rate: Rate, Burst: Burst})
}

// LeaseTokens is hybridlimit-lease's Config.Lease.
const LeaseTokens = 100

// openHybridLease is hybridlimit in lease mode: each script call also takes
// up to LeaseTokens tokens, which the next decisions spend without Redis.
func openHybridLease(rdb redis.UniversalClient) (Instance, error) {
	return newHybrid(hybridlimit.Config{Redis: rdb, Limit: hybridlimit.Limit{Rate: Rate, Burst: Burst}, Lease: LeaseTokens})
}

// openHybridCtx is hybridlimit on a client of its own with
// ContextTimeoutEnabled, which bounds reads by the context's deadline: a
// decision alone on an idle node then runs on its caller's goroutine.
func openHybridCtx(rdb redis.UniversalClient) (Instance, error) {
	c, ok := rdb.(*redis.Client)
	if !ok {
		return nil, fmt.Errorf("bench: hybridlimit-ctx needs a *redis.Client, got %T", rdb)
	}
	opts := *c.Options()
	opts.ContextTimeoutEnabled = true
	own := redis.NewClient(&opts)
	inst, err := OpenHybrid(own, "", hybridlimit.Limit{Rate: Rate, Burst: Burst})
	if err != nil {
		own.Close()
		return nil, err
	}
	return ownClient{inst, own}, nil
}

// ownClient closes the client it was opened with.
type ownClient struct {
	Instance
	c *redis.Client
}

func (o ownClient) Close() error {
	err := o.Instance.Close()
	o.c.Close()
	return err
}

// OpenHybrid returns a hybridlimit instance with the given key prefix
// (empty: hybridlimit's default) and limit.
func OpenHybrid(rdb redis.UniversalClient, prefix string, l hybridlimit.Limit) (Instance, error) {
	return newHybrid(hybridlimit.Config{Redis: rdb, Limit: l, Prefix: prefix})
}

// newHybrid returns a hybridlimit instance for cfg, with the benchmarks'
// Timeout (1 s: a slow answer must not become a local decision) and no
// heartbeat (it would add its own Redis traffic).
func newHybrid(cfg hybridlimit.Config) (Instance, error) {
	// Alone, without a heartbeat: its share, were Redis away, is all of it.
	cfg.Timeout, cfg.Heartbeat, cfg.Instances = time.Second, -1, 1
	lim, err := hybridlimit.New(cfg)
	if err != nil {
		return nil, err
	}
	return hybrid{lim}, nil
}
func (h hybrid) Bind(key string) Decide {
	return func(ctx context.Context) (bool, error) {
		d, err := h.lim.Allow(ctx, key)
		if err != nil {
			return false, err
		}
		if d.Mode != hybridlimit.ModeRemote && d.Mode != hybridlimit.ModeLease {
			return false, fmt.Errorf("%w: mode %v", errDegraded, d.Mode)
		}
		return d.Allowed, nil
	}
}

func (h hybrid) Close() error { return h.lim.Close() }

// script is the floor of one round trip per decision: go-redis's Script.Run
// (EVALSHA, EVAL on NOSCRIPT) of hybridlimit's own script, with the key and
// arguments that hybridlimit sends, prepared once per key.
type script struct {
	rdb    redis.Scripter
	prefix string       // of its keys
	close  func() error // nil: nothing to close
	s      *redis.Script
	args   []any
}

// ScriptArgs returns the arguments hybridlimit sends after the key for a
// decision of one token under Rate and Burst: q, p, capacity and cost in
// units.
func ScriptArgs() ([]string, error) {
	rl, err := remote.NewLimit(Rate, Burst)
	if err != nil {
		return nil, err
	}
	return []string{
		fmt.Sprint(rl.Q), fmt.Sprint(rl.P), fmt.Sprint(rl.Cap()), fmt.Sprint(rl.Units(1)),
	}, nil
}

func openScript(rdb redis.UniversalClient) (Instance, error) {
	args, err := ScriptArgs()
	if err != nil {
		return nil, err
	}
	s := &script{rdb: rdb, prefix: "script:", s: redis.NewScript(lua.TokenBucket)}
	for _, a := range args {
		s.args = append(s.args, a)
	}
	return s, nil
}

func (s *script) Bind(key string) Decide {
	keys := []string{s.prefix + key}
	return func(ctx context.Context) (bool, error) {
		v, err := s.s.Run(ctx, s.rdb, keys, s.args...).Slice()
		if err != nil {
			return false, err
		}
		if len(v) != 3 {
			return false, fmt.Errorf("bench: script reply %v", v)
		}
		allowed, _ := v[0].(int64)
		return allowed == 1, nil
	}
}

func (s *script) Close() error {
	if s.close == nil {
		return nil
	}
	return s.close()
}

// openScriptAutoPipe is script sent through go-redis's AutoPipeliner
// (v9.23, experimental), which coalesces concurrent commands into
// pipelines as hybridlimit's Pipe does: its ceiling, beside the Pipe's. A
// command waits there for its batch whatever its context says.
func openScriptAutoPipe(rdb redis.UniversalClient) (Instance, error) {
	c, ok := rdb.(*redis.Client)
	if !ok {
		return nil, fmt.Errorf("bench: %T has no AutoPipeliner", rdb)
	}
	ap, err := c.AutoPipeline()
	if err != nil {
		return nil, err
	}
	in, err := openScript(rdb)
	if err != nil {
		ap.Close()
		return nil, err
	}
	s := in.(*script)
	s.rdb, s.prefix, s.close = ap, "autopipe:", ap.Close
	return s, nil
}

// redisRate is github.com/go-redis/redis_rate/v10: GCRA, one EVALSHA of its
// script per decision. It puts "rate:" before every key itself.
type redisRate struct {
	lim *redis_rate.Limiter
	l   redis_rate.Limit
}

func openRedisRate(rdb redis.UniversalClient) (Instance, error) {
	return OpenRedisRate(rdb, redis_rate.Limit{Rate: Rate, Burst: Burst, Period: time.Second}), nil
}

// OpenRedisRate returns a redis_rate instance with limit l.
func OpenRedisRate(rdb redis.UniversalClient, l redis_rate.Limit) Instance {
	return redisRate{lim: redis_rate.NewLimiter(rdb), l: l}
}

func (r redisRate) Bind(key string) Decide {
	return func(ctx context.Context) (bool, error) {
		res, err := r.lim.Allow(ctx, key, r.l)
		if err != nil {
			return false, err
		}
		return res.Allowed > 0, nil
	}
}

func (r redisRate) Close() error { return nil }

// ulule is github.com/ulule/limiter/v3 with its Redis store: a fixed window
// counter, one EVALSHA (INCRBY, PEXPIRE or PTTL) per decision.
type ulule struct{ lim *limiter.Limiter }

func openUlule(rdb redis.UniversalClient) (Instance, error) {
	c, ok := rdb.(ulredis.Client)
	if !ok {
		return nil, fmt.Errorf("bench: %T is not a ulule redis client", rdb)
	}
	store, err := ulredis.NewStoreWithOptions(c, limiter.StoreOptions{Prefix: "limiter"})
	if err != nil {
		return nil, err
	}
	return ulule{limiter.New(store, limiter.Rate{Period: time.Second, Limit: Rate})}, nil
}

func (u ulule) Bind(key string) Decide {
	return func(ctx context.Context) (bool, error) {
		c, err := u.lim.Get(ctx, key)
		if err != nil {
			return false, err
		}
		return !c.Reached, nil
	}
}

func (u ulule) Close() error { return nil }

// xrate is golang.org/x/time/rate alone, one limiter per key found at Bind:
// the floor of a decision in memory.
type xrate struct{ m map[string]*rate.Limiter }

func openXRate(redis.UniversalClient) (Instance, error) {
	return &xrate{m: make(map[string]*rate.Limiter)}, nil
}

// Bind is called before the timed loop, from one goroutine.
func (x *xrate) Bind(key string) Decide {
	l := x.m[key]
	if l == nil {
		l = rate.NewLimiter(Rate, Burst)
		x.m[key] = l
	}
	return func(context.Context) (bool, error) { return l.Allow(), nil }
}

func (x *xrate) Close() error { return nil }
