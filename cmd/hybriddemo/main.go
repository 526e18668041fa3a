// Command hybriddemo shows what hybridlimit does while Redis is unreachable.
//
// By default it runs for a few seconds and prints a table. Four strategies
// share one limit on one key, each over three simulated instances: the
// hybridlimit Limiter with FailLocal, the plain local fallback it replaced
// (plain.go, the baseline of docs/accuracy.md), and the Limiter with
// FailOpen and with FailClosed. Every instance has its own Redis client,
// reaching one Redis through one fault-injecting proxy. Partway through,
// the proxy cuts Redis off: connections stay open but nothing comes back,
// the worst kind of outage for a client. The demo prints, second by second,
// what each strategy allowed, how long decisions took and which path
// decided, then each strategy's total and its fewest and most allowed in
// one second during and right after the outage.
//
// With -serve it runs a small HTTP service instead (serve.go): one Limiter
// behind httplimit's middleware, and an endpoint that cuts Redis off, to
// try with curl. It runs until interrupted.
//
// Usage:
//
//	go run ./cmd/hybriddemo [-redis host:port] [-duration 8s] [-outage-start 2s] [-outage-end 5s] [-rate 200] [-limit 100] [-uneven]
//	go run ./cmd/hybriddemo -serve :8080 [-redis host:port]
//
// Without -redis it runs an embedded Redis (miniredis). With -redis it uses
// that Redis, through the proxy, under keys "hybriddemo:<run>:..." that
// expire a second or two after the run (a minute after, for -serve's
// per-minute rule).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"os/signal"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/hybridlimit/hybridlimit"
	"github.com/hybridlimit/hybridlimit/internal/faultproxy"
	"github.com/hybridlimit/hybridlimit/internal/loadgen"
)

// instances is how many instances share the limit under each strategy.
const instances = 3

// unevenWeights is each instance's part of the load under -uneven.
var unevenWeights = []float64{80, 15, 5}

// strategy is one way of deciding while Redis is away: a hybridlimit
// FailurePolicy, or the plain local fallback.
type strategy struct {
	name   string // in the table
	key    string // in the Redis keys
	policy hybridlimit.FailurePolicy
	plain  bool   // the baseline of plain.go rather than a Limiter
	mode   string // the mode that decides while Redis is away
}

// strategies run side by side, each with its own instances and keys.
var strategies = []strategy{
	{name: "hybridlimit (FailLocal)", key: "FailLocal", policy: hybridlimit.FailLocal, mode: hybridlimit.ModeLocal.String()},
	{name: "plain local fallback", key: "plain", plain: true, mode: "local"},
	{name: "FailOpen", key: "FailOpen", policy: hybridlimit.FailOpen, mode: hybridlimit.ModeFailOpen.String()},
	{name: "FailClosed", key: "FailClosed", policy: hybridlimit.FailClosed, mode: hybridlimit.ModeFailClosed.String()},
}

// options are the command-line flags.
type options struct {
	redis       string        // Redis address; empty means an embedded miniredis
	duration    time.Duration // how long load is offered
	outageStart time.Duration // when the proxy cuts Redis off
	outageEnd   time.Duration // when it lets Redis through again
	rate        float64       // decisions per second offered under each strategy, over all instances
	limit       int64         // the shared limit, per second
	uneven      bool          // offer the load 80/15/5 across the instances
	heartbeat   time.Duration // Config.Heartbeat of the Limiters
	serve       string        // listen address of the HTTP service; empty means the timed run
}

func main() {
	o := options{}
	flag.StringVar(&o.redis, "redis", "", "use the Redis at `host:port` instead of an embedded miniredis")
	flag.DurationVar(&o.duration, "duration", 8*time.Second, "how long to offer load")
	flag.DurationVar(&o.outageStart, "outage-start", 2*time.Second, "when Redis becomes unreachable")
	flag.DurationVar(&o.outageEnd, "outage-end", 5*time.Second, "when Redis becomes reachable again")
	flag.Float64Var(&o.rate, "rate", 200, "decisions per second offered under each strategy, over the 3 instances")
	flag.Int64Var(&o.limit, "limit", 100, "the shared limit, per second (and the burst)")
	flag.BoolVar(&o.uneven, "uneven", false, "offer the load 80/15/5% across the 3 instances instead of evenly")
	flag.DurationVar(&o.heartbeat, "heartbeat", 200*time.Millisecond,
		"how often each Limiter sends its fleet heartbeat (the library's default is 1s)")
	flag.StringVar(&o.serve, "serve", "", "instead of the timed run, serve HTTP on `addr` (such as :8080) until interrupted")
	flag.Parse()

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	var err error
	if o.serve != "" {
		err = serve(ctx, o, os.Stdout)
	} else {
		_, err = run(ctx, o, os.Stdout)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "hybriddemo:", err)
		os.Exit(1)
	}
}

// run runs the timed demo, writes its report to w, and returns each
// strategy's seconds, in the order of strategies. Everything it starts is
// stopped when it returns.
func run(ctx context.Context, o options, w io.Writer) ([][]loadgen.Second, error) {
	switch {
	case o.duration <= 0:
		return nil, fmt.Errorf("-duration must be positive, got %v", o.duration)
	case !(o.rate > 0) || math.IsInf(o.rate, 0):
		return nil, fmt.Errorf("-rate must be positive, got %v", o.rate)
	case o.limit < 1:
		return nil, fmt.Errorf("-limit must be at least 1, got %d", o.limit)
	case o.outageStart < 0 || o.outageEnd < o.outageStart:
		return nil, fmt.Errorf("want 0 <= -outage-start <= -outage-end, got %v and %v", o.outageStart, o.outageEnd)
	}
	limit := hybridlimit.PerSecond(o.limit)

	addr, where, stopRedis, err := startRedis(ctx, o.redis)
	if err != nil {
		return nil, err
	}
	defer stopRedis()
	proxy, err := faultproxy.New(addr)
	if err != nil {
		return nil, err
	}
	defer proxy.Close()

	// Each instance has its own client and limiter, as separate processes
	// would. Deferred calls close the limiters, then the clients.
	prefix := fmt.Sprintf("hybriddemo:%d:", time.Now().UnixMilli())
	var (
		decide  []loadgen.Decide
		weights []float64
	)
	for _, st := range strategies {
		for i := range instances {
			rdb := newClient(proxy.Addr())
			defer rdb.Close()
			var d loadgen.Decide
			if st.plain {
				pl, err := newPlain(rdb, prefix+st.key+":", limit, instances)
				if err != nil {
					return nil, err
				}
				d = pl.Allow
			} else {
				lim, err := hybridlimit.New(hybridlimit.Config{
					Redis:     rdb,
					Limit:     limit,
					Instances: instances,
					Prefix:    prefix + st.key + ":",
					Timeout:   50 * time.Millisecond,
					OnFailure: st.policy,
					Heartbeat: o.heartbeat,
				})
				if err != nil {
					return nil, err
				}
				defer lim.Close()
				d = func(ctx context.Context, key string) (bool, string, error) {
					dec, err := lim.Allow(ctx, key)
					if err != nil {
						return false, "", err
					}
					return dec.Allowed, dec.Mode.String(), nil
				}
			}
			warmUp(ctx, d)
			weight := 1.0
			if o.uneven {
				weight = unevenWeights[i]
			}
			decide = append(decide, d)
			weights = append(weights, weight)
		}
	}

	writeHeader(w, o, where)
	fmt.Fprintf(w, "\nrunning for %v ...\n\n", o.duration)
	res := loadgen.Run(ctx, loadgen.Config{
		Instances: decide,
		Weights:   weights,
		// Enough that the busiest instance (160/s under -uneven) keeps up
		// while every plain decision waits out its 50ms.
		Workers:  16,
		Rate:     o.rate * float64(len(strategies)),
		Duration: o.duration,
		Key:      func(instance, worker, i int) string { return "user:42" },
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

	out := make([][]loadgen.Second, len(strategies))
	for i := range strategies {
		var mine []int // the instances of strategy i, in the order they were made
		for j := range instances {
			mine = append(mine, i*instances+j)
		}
		out[i] = res.Combined(mine...)
	}
	report(w, o, out)
	return out, nil
}

// newClient returns a go-redis client of one instance, to addr.
func newClient(addr string) *redis.Client {
	return redis.NewClient(&redis.Options{
		Addr: addr,
		// Let the caller's time budget bound socket reads too, so a
		// timed-out connection is dropped rather than reused.
		ContextTimeoutEnabled: true,
	})
}

// startRedis returns the address of the Redis to use, how to describe it,
// and a func that stops it: addr itself, once it answers PING, or an
// embedded miniredis if addr is empty.
func startRedis(ctx context.Context, addr string) (string, string, func(), error) {
	if addr != "" {
		if err := ping(ctx, addr); err != nil {
			return "", "", nil, fmt.Errorf("no Redis at %s: %w", addr, err)
		}
		return addr, "Redis at " + addr, func() {}, nil
	}
	mr := miniredis.NewMiniRedis()
	if err := mr.Start(); err != nil {
		return "", "", nil, err
	}
	return mr.Addr(), "an embedded Redis (miniredis)", mr.Close, nil
}

// writeHeader says what the timed run does, and how to read its table.
func writeHeader(w io.Writer, o options, where string) {
	load := fmt.Sprintf("%.1f/s per instance", o.rate/instances)
	if o.uneven {
		load = fmt.Sprintf("80/15/5%%: %.0f, %.0f and %.0f/s on the 3 instances",
			o.rate*0.80, o.rate*0.15, o.rate*0.05)
	}
	fmt.Fprintf(w, `hybriddemo: %d instances share one limit of %d/s (burst %d) on one key, under each of %d strategies.
Each strategy is offered %.0f decisions/s in total (%s),
on %s reached through a fault proxy.
Redis is cut off from %v to %v: connections stay open, nothing comes back.

The strategies run at once on that Redis, each with its own %d instances and keys:
  hybridlimit (FailLocal)  while Redis is away, each instance decides on its share of the limit, sized
                           by the fleet's traffic; its local bucket starts from what Redis last said,
                           and what it spent is charged to Redis when Redis is back
  plain local fallback     the baseline of docs/accuracy.md (plain.go): every decision goes to Redis
                           within 50ms; on any error, a local bucket per instance of %.4g/s (burst %d)
                           that starts full; no breaker, hand-off, reconciliation or fleet shares
  FailOpen                 the Limiter allows everything while Redis is away
  FailClosed               the Limiter denies everything while Redis is away
The Limiters have Timeout 50ms and the default breaker: open after %d failures in a row, probe Redis
after %v (+ up to %.0f%% jitter) open. They send the fleet heartbeat every %v, as in docs/accuracy.md
(the default is 1s): the shares follow the traffic from the third heartbeat on, and before that
they are even. Every instance has its own go-redis client (ContextTimeoutEnabled: true) and has
made a decision on another key first, so the client is connected when the clock starts.

Legend: one row per second and strategy, over its 3 instances, by when each decision started.
  allowed, denied  decisions made in that second; a perfect limiter allows %d in each (and the
                   burst of %d on top in the first)
  mean, p99, max   how long a decision took
  modes            who decided: remote = the shared bucket in Redis; local = the instance's own
                   bucket; fail-open, fail-closed = the policy, without Redis
`, instances, o.limit, o.limit, len(strategies), o.rate, load, where, o.outageStart, o.outageEnd,
		instances, float64(o.limit)/instances, max(o.limit/instances, 1),
		hybridlimit.DefaultBreakerFailures, hybridlimit.DefaultBreakerOpenFor, 100*hybridlimit.DefaultBreakerJitter,
		o.heartbeat, o.limit, o.limit)
}

// report writes the table of seconds, strategy by strategy, and the totals.
func report(w io.Writer, o options, out [][]loadgen.Second) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "second\tredis\tstrategy\tallowed\tdenied\t   mean\t    p99\t    max\tmodes")
	for s := range out[0] {
		redisState := "up"
		from, to := time.Duration(s)*time.Second, time.Duration(s+1)*time.Second
		if from < o.outageEnd && to > o.outageStart {
			redisState = "CUT"
		}
		for i, st := range strategies {
			sec := out[i][s]
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
			fmt.Fprintf(tw, "%s\t%s\t%s\t%7d\t%6d\t%7s\t%7s\t%7s\t%s\n", label, state, st.name, sec.Allowed, sec.Denied,
				loadgen.FormatDuration(sec.Mean), loadgen.FormatDuration(sec.P99), loadgen.FormatDuration(sec.Max), modes)
		}
	}
	tw.Flush()

	// The seconds of the switch, the outage, the recovery and the one
	// after: where the strategies differ.
	first := int(o.outageStart / time.Second)
	last := min(int((o.outageEnd+time.Second-1)/time.Second)+1, len(out[0])-1)
	admits := o.limit + int64(float64(o.limit)*o.duration.Seconds())
	fmt.Fprintf(w, "\nAllowed in all, against the %d that the limit admits in %v (a full bucket of %d, then %d/s)",
		admits, o.duration, o.limit, o.limit)
	cols := []string{"allowed", fmt.Sprintf("of %d", admits)}
	if first <= last {
		fmt.Fprintf(w, ",\nand the fewest and most allowed in one second of the cut, the outage, Redis's return and the\n"+
			"second after: seconds %d-%d (the rows %d-%d to %d-%d), against %d per second", first, last, first, first+1, last, last+1, o.limit)
		cols = append(cols, fmt.Sprintf("min in %d-%d", first, last), fmt.Sprintf("max in %d-%d", first, last))
	}
	fmt.Fprint(w, ":\n\n")
	tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprint(tw, "strategy")
	for _, c := range cols {
		fmt.Fprintf(tw, "\t%s", c)
	}
	fmt.Fprintln(tw)
	for i, st := range strategies {
		total := 0
		for _, sec := range out[i] {
			total += sec.Allowed
		}
		cells := []string{fmt.Sprint(total), fmt.Sprintf("%.0f%%", 100*float64(total)/float64(admits))}
		if first <= last {
			lo, hi := math.MaxInt, 0
			for _, sec := range out[i][first : last+1] {
				lo, hi = min(lo, sec.Allowed), max(hi, sec.Allowed)
			}
			cells = append(cells, fmt.Sprint(lo), fmt.Sprint(hi))
		}
		fmt.Fprint(tw, st.name)
		for j, c := range cells {
			fmt.Fprintf(tw, "\t%*s", len(cols[j]), c) // numbers flush right under their heading
		}
		fmt.Fprintln(tw)
	}
	tw.Flush()
}

// warmUp makes a few decisions on a key of its own until Redis answers one,
// so that the client has a connection and Redis has the script before the
// clock starts. Otherwise, on a busy machine, the first decisions can take
// longer than 50ms (dial, handshake, NOSCRIPT and EVAL) and fall back.
func warmUp(ctx context.Context, decide loadgen.Decide) {
	for range 5 {
		if _, mode, err := decide(ctx, "warm-up"); err != nil || mode == hybridlimit.ModeRemote.String() {
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
