package main

import (
	"context"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
	"golang.org/x/time/rate"

	"github.com/hybridlimit/hybridlimit"
	"github.com/hybridlimit/hybridlimit/lua"
	"github.com/hybridlimit/hybridlimit/remote"
)

// plain is the baseline that hybridlimit is measured against: the "plain
// local fallback" of docs/accuracy.md, the naive strategy the project
// measured before hybridlimit existed. One plain is one instance.
//
// Every decision goes to Redis, to the same token-bucket script as
// hybridlimit's, within the same time budget. On any error the instance
// decides on a local x/time/rate bucket per key holding an equal part of
// the limit (Rate/instances, Burst/instances), which starts full. Nothing
// else: no breaker (every decision waits out its budget while Redis is
// away), no hand-off (the local bucket knows nothing of what Redis said),
// no reconciliation (Redis never hears of what was spent locally) and no
// fleet shares (the parts are equal whatever the load).
type plain struct {
	rdb    *redis.Client
	prefix string
	rl     remote.Limit // the limit in the script's fixed point
	share  rate.Limit   // the local bucket's rate
	burst  int          // and its capacity

	mu      sync.Mutex // protects buckets
	buckets map[string]*rate.Limiter
}

// plainTimeout bounds one remote decision, as Config.Timeout does the
// demo's Limiters.
const plainTimeout = 50 * time.Millisecond

// tokenBucket is hybridlimit's script; Run sends EVALSHA, and EVAL on
// NOSCRIPT.
var tokenBucket = redis.NewScript(lua.TokenBucket)

// newPlain returns an instance that shares l with instances-1 others
// through rdb, under keys prefix+key.
func newPlain(rdb *redis.Client, prefix string, l hybridlimit.Limit, instances int) (*plain, error) {
	rl, err := remote.NewLimit(l.Rate, l.Burst)
	if err != nil {
		return nil, err
	}
	return &plain{
		rdb:     rdb,
		prefix:  prefix,
		rl:      rl,
		share:   rate.Limit(l.Rate / float64(instances)),
		burst:   max(int(l.Burst)/instances, 1),
		buckets: map[string]*rate.Limiter{},
	}, nil
}

// Allow decides one event for key: by Redis ("remote"), or by the local
// bucket ("local") if Redis fails to answer within plainTimeout. It is a
// loadgen.Decide and never returns an error.
func (pl *plain) Allow(ctx context.Context, key string) (allowed bool, mode string, err error) {
	rctx, cancel := context.WithTimeout(ctx, plainTimeout)
	defer cancel()
	args := []any{pl.rl.Q, pl.rl.P, pl.rl.Cap(), pl.rl.Units(1)}
	reply, err := tokenBucket.Run(rctx, pl.rdb, []string{pl.prefix + key}, args...).Slice()
	// The reply is {flags, level, now_us}; flags&1 is allowed.
	if err == nil && len(reply) == 3 {
		if f, ok := reply[0].(int64); ok {
			return f&1 == 1, "remote", nil
		}
	}
	return pl.bucket(key).Allow(), "local", nil
}

// bucket returns key's local bucket, full when new. Buckets are never
// dropped: the demo has one key.
func (pl *plain) bucket(key string) *rate.Limiter {
	pl.mu.Lock()
	defer pl.mu.Unlock()
	b := pl.buckets[key]
	if b == nil {
		b = rate.NewLimiter(pl.share, pl.burst)
		pl.buckets[key] = b
	}
	return b
}
