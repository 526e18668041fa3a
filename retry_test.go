package hybridlimit

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/hybridlimit/hybridlimit/breaker"
)

// TestLocalRetryAfterOfASlowLimit: a thirty-fifth of 5 a minute refills a
// token in seven minutes, but a denial by that share is told to wait no
// longer than the whole limit takes to refill the tokens asked (12 s for
// one), or until the next probe if that is later: Redis may be back first,
// and its bucket refills at the whole rate.
func TestLocalRetryAfterOfASlowLimit(t *testing.T) {
	c := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", MaxRetries: -1, DialerRetries: 1})
	defer c.Close()
	ctx := context.Background()
	for _, tc := range []struct {
		openFor     time.Duration
		least, most time.Duration
	}{
		{100 * time.Millisecond, 12 * time.Second, 12 * time.Second}, // the limit's refill of a token
		{time.Hour, 5 * time.Minute, 7 * time.Minute},                // the share's own (from 5/35 of a token): Redis is not back sooner
	} {
		lim := newLimiter(t, Config{Redis: c, Limit: PerMinute(5), Instances: 35, Heartbeat: -1,
			Prefix: tc.openFor.String() + ":", Breaker: BreakerConfig{OpenFor: tc.openFor}})
		var d Decision
		for i := 0; i < 100 && (d.Allowed || lim.single.cb.State() != breaker.StateOpen); i++ {
			var err error
			if d, err = lim.Allow(ctx, "slow"); err != nil {
				t.Fatal(err)
			}
		}
		if d, _ = lim.Allow(ctx, "slow"); d.Allowed || d.Mode != ModeLocal {
			t.Fatalf("decision = %+v; want a local denial", d)
		}
		if d.RetryAfter < tc.least || d.RetryAfter > tc.most {
			t.Errorf("breaker open for %v: RetryAfter = %v; want %v to %v", tc.openFor, d.RetryAfter, tc.least, tc.most)
		}
		// AllowAtMost is denied until one token, whatever it asks.
		if d, _ = lim.AllowAtMost(ctx, "slow", 3); d.Allowed || d.Mode != ModeLocal {
			t.Fatalf("AllowAtMost = %+v; want a local denial", d)
		}
		if d.RetryAfter < tc.least || d.RetryAfter > tc.most {
			t.Errorf("breaker open for %v: AllowAtMost's RetryAfter = %v; want %v to %v", tc.openFor, d.RetryAfter, tc.least, tc.most)
		}
	}
}
