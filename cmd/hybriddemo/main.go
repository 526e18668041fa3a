// Command hybriddemo shows what hybridlimit does while Redis is unreachable.
//
// Three simulated instances share one limit on one key. Each has its own
// Redis client, reaching Redis through a fault-injecting proxy, and its own
// Limiter. Partway through, the proxy cuts Redis off: connections stay open
// but nothing comes back, the worst kind of outage for a client. The three
// failure policies run side by side over the same outage, and the demo
// prints, second by second, what each allowed, how long decisions took and
// which path decided.
//
// Usage:
//
//	go run ./cmd/hybriddemo [-redis host:port] [-duration 8s] [-outage-start 2s] [-outage-end 5s] [-rate 200] [-limit 100]
//
// Without -redis it runs an embedded Redis (miniredis). With -redis it uses
// that Redis, through the proxy, under keys "hybriddemo:<run>:..." that
// expire a second or two after the run.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"text/tabwriter"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/hybridlimit/hybridlimit"
	"github.com/hybridlimit/hybridlimit/internal/faultproxy"
	"github.com/hybridlimit/hybridlimit/internal/loadgen"
)

// instances is how many instances share the limit under each policy.
const instances = 3

// policies run side by side, each with its own limiters and keys.
var policies = []hybridlimit.FailurePolicy{hybridlimit.FailLocal, hybridlimit.FailOpen, hybridlimit.FailClosed}

// options are the command-line flags.
type options struct {
	redis       string        // Redis address; empty means an embedded miniredis
	duration    time.Duration // how long load is offered
	outageStart time.Duration // when the proxy cuts Redis off
	outageEnd   time.Duration // when it lets Redis through again
	rate        float64       // decisions per second offered under each policy, over all instances
	limit       int64         // the shared limit, per second
}

func main() {
	o := options{}
	flag.StringVar(&o.redis, "redis", "", "use the Redis at `host:port` instead of an embedded miniredis")
	flag.DurationVar(&o.duration, "duration", 8*time.Second, "how long to offer load")
	flag.DurationVar(&o.outageStart, "outage-start", 2*time.Second, "when Redis becomes unreachable")
	flag.DurationVar(&o.outageEnd, "outage-end", 5*time.Second, "when Redis becomes reachable again")
	flag.Float64Var(&o.rate, "rate", 200, "decisions per second offered under each policy, over the 3 instances")
	flag.Int64Var(&o.limit, "limit", 100, "the shared limit, per second (and the burst)")
	flag.Parse()

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if _, err := run(ctx, o, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "hybriddemo:", err)
		os.Exit(1)
	}
}

// run runs the demo, writes its report to w, and returns each policy's
// seconds. Everything it starts is stopped when it returns.
func run(ctx context.Context, o options, w io.Writer) (map[hybridlimit.FailurePolicy][]loadgen.Second, error) {
	switch {
	case o.duration <= 0:
		return nil, fmt.Errorf("-duration must be positive, got %v", o.duration)
	case !(o.rate > 0):
		return nil, fmt.Errorf("-rate must be positive, got %v", o.rate)
	case o.limit < 1:
		return nil, fmt.Errorf("-limit must be at least 1, got %d", o.limit)
	case o.outageStart < 0 || o.outageEnd < o.outageStart:
		return nil, fmt.Errorf("want 0 <= -outage-start <= -outage-end, got %v and %v", o.outageStart, o.outageEnd)
	}

	addr, where := o.redis, "Redis at "+o.redis
	if addr == "" {
		mr := miniredis.NewMiniRedis()
		if err := mr.Start(); err != nil {
			return nil, err
		}
		defer mr.Close()
		addr, where = mr.Addr(), "an embedded Redis (miniredis)"
	} else if err := ping(ctx, addr); err != nil {
		return nil, fmt.Errorf("Redis at %s: %w", addr, err)
	}
	proxy, err := faultproxy.New(addr)
	if err != nil {
		return nil, err
	}
	defer proxy.Close()

	// Each instance has its own client and limiter, as separate processes
	// would. Deferred calls close the limiters, then the clients.
	prefix := fmt.Sprintf("hybriddemo:%d:", time.Now().UnixMilli())
	var decide []loadgen.Decide
	for _, p := range policies {
		for range instances {
			rdb := redis.NewClient(&redis.Options{
				Addr: proxy.Addr(),
				// Let the limiter's time budget bound socket reads too, so
				// a timed-out connection is dropped rather than reused.
				ContextTimeoutEnabled: true,
			})
			defer rdb.Close()
			lim, err := hybridlimit.New(hybridlimit.Config{
				Redis:     rdb,
				Limit:     hybridlimit.PerSecond(o.limit),
				Instances: instances,
				Prefix:    prefix + p.String() + ":",
				Timeout:   50 * time.Millisecond,
				OnFailure: p,
			})
			if err != nil {
				return nil, err
			}
			defer lim.Close()
			warmUp(ctx, lim)
			decide = append(decide, func(ctx context.Context, key string) (bool, string, error) {
				d, err := lim.Allow(ctx, key)
				if err != nil {
					return false, "", err
				}
				return d.Allowed, d.Mode.String(), nil
			})
		}
	}

	fmt.Fprintf(w, header, instances, o.limit, o.limit, o.rate, o.rate/instances, where,
		o.outageStart, o.outageEnd, instances, o.limit, instances,
		hybridlimit.DefaultBreakerFailures, hybridlimit.DefaultBreakerOpenFor, 100*hybridlimit.DefaultBreakerJitter)
	fmt.Fprintf(w, "\nrunning for %v ...\n\n", o.duration)
	res := loadgen.Run(ctx, loadgen.Config{
		Instances: decide,
		Workers:   8,
		Rate:      o.rate * float64(len(policies)),
		Duration:  o.duration,
		Key:       func(instance, worker, i int) string { return "user:42" },
		Events: []loadgen.Event{
			// Blackhole drops what is read on every connection, old and
			// new: requests are swallowed and no reply ever arrives. No
			// connection is reset at either end: every connection that
			// swallowed a request timed out and was dropped by its client,
			// so clients find Redis again on new connections.
			{At: o.outageStart, Do: func() { proxy.Blackhole(true) }},
			{At: o.outageEnd, Do: func() { proxy.Blackhole(false) }},
		},
	})
	if err := ctx.Err(); err != nil {
		return nil, err
	}

	out := map[hybridlimit.FailurePolicy][]loadgen.Second{}
	for i, p := range policies {
		var mine []int // the instances of policy p, in the order they were made
		for j := range instances {
			mine = append(mine, i*instances+j)
		}
		out[p] = res.Combined(mine...)
	}
	report(w, o, out)
	return out, nil
}

const header = `hybriddemo: %d instances share one limit of %d/s (burst %d) on one key.
Each policy is offered %.0f decisions/s in total (%.1f/s per instance) on %s,
reached through a fault proxy. Redis is cut off from %v to %v: connections stay open, nothing comes back.

The three failure policies run at once, each with its own %d limiters and keys:
  FailLocal   while Redis is away, each instance allows its share: %d/%d per second under even load
  FailOpen    while Redis is away, everything is allowed
  FailClosed  while Redis is away, everything is denied
Every Limiter has Timeout 50ms and the default breaker: open after %d failures in a row, probe Redis
after %v (+ up to %.0f%% jitter) open. Each has its own go-redis client (ContextTimeoutEnabled: true)
and has made a decision on another key first, so the client is connected when the clock starts.

Legend: one row per second and policy, over its 3 instances, by when each decision started.
  allowed, denied  decisions made in that second
  mean, p99, max   how long Allow took
  modes            who decided: remote = the shared bucket in Redis; local = the instance's share;
                   fail-open, fail-closed = the policy, without Redis
`

// report writes the table of seconds, policy by policy, and the totals.
func report(w io.Writer, o options, out map[hybridlimit.FailurePolicy][]loadgen.Second) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "second\tredis\tpolicy\tallowed\tdenied\t   mean\t    p99\t    max\tmodes")
	for s := range out[policies[0]] {
		redisState := "up"
		from, to := time.Duration(s)*time.Second, time.Duration(s+1)*time.Second
		if from < o.outageEnd && to > o.outageStart {
			redisState = "CUT"
		}
		for i, p := range policies {
			sec := out[p][s]
			label, state := "", ""
			if i == 0 {
				label, state = fmt.Sprintf("%d-%d", s, s+1), redisState
			}
			modes := loadgen.FormatModes(sec.Modes)
			if sec.Errors > 0 {
				modes += fmt.Sprintf(" (errors %d)", sec.Errors)
			}
			if sec.Skipped > 0 {
				modes += fmt.Sprintf(" (%d not offered: workers busy)", sec.Skipped)
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%7d\t%6d\t%7s\t%7s\t%7s\t%s\n", label, state, p, sec.Allowed, sec.Denied,
				loadgen.FormatDuration(sec.Mean), loadgen.FormatDuration(sec.P99), loadgen.FormatDuration(sec.Max), modes)
		}
	}
	tw.Flush()

	fmt.Fprintf(w, "\nallowed in all:")
	for _, p := range policies {
		total := 0
		for _, sec := range out[p] {
			total += sec.Allowed
		}
		fmt.Fprintf(w, " %v %d,", p, total)
	}
	fmt.Fprintf(w, " against %d that the limit admits in %v (a full bucket of %d, then %d/s).\n",
		o.limit+int64(float64(o.limit)*o.duration.Seconds()), o.duration, o.limit, o.limit)
}

// warmUp makes a few decisions on a key of its own until Redis answers one,
// so that the client has a connection and Redis has the script before the
// clock starts. Otherwise, on a busy machine, the first decisions can take
// longer than Timeout (dial, handshake, NOSCRIPT and EVAL) and fall back.
func warmUp(ctx context.Context, lim *hybridlimit.Limiter) {
	for range 5 {
		if d, err := lim.Allow(ctx, "warm-up"); err != nil || d.Mode == hybridlimit.ModeRemote {
			return
		}
	}
}

// ping checks that Redis answers at addr, directly, not through the proxy.
func ping(ctx context.Context, addr string) error {
	rdb := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1, DialerRetries: 1, DialTimeout: 2 * time.Second})
	defer rdb.Close()
	ctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	if err := rdb.Ping(ctx).Err(); err != nil {
		return errors.New("no answer to PING: " + err.Error())
	}
	return nil
}
