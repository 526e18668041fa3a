package hybridlimit_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/hybridlimit/hybridlimit"
)

// ExampleNew is the README's example: one limit shared by three instances.
// It needs a Redis, so it is compiled but not run.
func ExampleNew() {
	rdb := redis.NewClient(&redis.Options{Addr: "localhost:6379"})
	defer rdb.Close()
	lim, err := hybridlimit.New(hybridlimit.Config{
		Redis:     rdb,
		Limit:     hybridlimit.PerSecond(100), // shared by the whole fleet
		Instances: 3,                          // each holds about a third while Redis is away
	})
	if err != nil {
		log.Fatal(err)
	}
	defer lim.Close()

	http.HandleFunc("/api", func(w http.ResponseWriter, r *http.Request) {
		d, err := lim.Allow(r.Context(), "user:42")
		if err != nil { // bad key, closed limiter, or the request's context ended
			http.Error(w, "unavailable", http.StatusServiceUnavailable)
			return
		}
		if !d.Allowed {
			w.Header().Set("Retry-After", strconv.Itoa(int((d.RetryAfter+time.Second-1)/time.Second)))
			http.Error(w, "too many requests", http.StatusTooManyRequests)
			return
		}
		fmt.Fprintln(w, "ok, decided by", d.Mode)
	})
}

// ExamplePerMinute shows the limits PerSecond and PerMinute build.
func ExamplePerMinute() {
	fmt.Println(hybridlimit.PerSecond(10))
	fmt.Println(hybridlimit.PerMinute(30))
	fmt.Println(hybridlimit.Limit{Rate: 0.5, Burst: 3})
	// Output:
	// 10/s burst 10
	// 0.5/s burst 30
	// 0.5/s burst 3
}

// ExampleConfig_limitFor gives each key the limit of its tier.
func ExampleConfig_limitFor() {
	rdb := redis.NewClient(&redis.Options{Addr: "localhost:6379"})
	defer rdb.Close()
	tiers := map[string]hybridlimit.Limit{
		"free": hybridlimit.PerMinute(60),
		"pro":  hybridlimit.PerSecond(50),
	}
	lim, err := hybridlimit.New(hybridlimit.Config{
		Redis: rdb,
		Limit: hybridlimit.PerMinute(60), // keys LimitFor does not know
		LimitFor: func(key string) hybridlimit.Limit {
			tier, _, _ := strings.Cut(key, ":")
			return tiers[tier] // the zero Limit means Config.Limit
		},
	})
	if err != nil {
		log.Fatal(err)
	}
	defer lim.Close()
	d, _ := lim.Allow(context.Background(), "pro:acme")
	fmt.Println(d.Allowed, d.Limit)
}

// ExampleLimiter_WaitN paces a batch job: each bulk write of 500 documents
// waits for 500 tokens of the shared limit.
func ExampleLimiter_WaitN() {
	rdb := redis.NewClient(&redis.Options{Addr: "localhost:6379"})
	defer rdb.Close()
	lim, err := hybridlimit.New(hybridlimit.Config{
		Redis: rdb,
		Limit: hybridlimit.Limit{Rate: 2000, Burst: 1000}, // documents per second
	})
	if err != nil {
		log.Fatal(err)
	}
	defer lim.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for batch := range 10 {
		if err := lim.WaitN(ctx, "search-cluster", 500); err != nil {
			log.Fatal(err)
		}
		fmt.Println("writing batch", batch)
	}
}

// ExampleLimiter_SetLimit changes the limit at run time, for example when
// an operator edits it: buckets keep their tokens.
func ExampleLimiter_SetLimit() {
	rdb := redis.NewClient(&redis.Options{Addr: "localhost:6379"})
	defer rdb.Close()
	lim, err := hybridlimit.New(hybridlimit.Config{Redis: rdb, Limit: hybridlimit.PerSecond(100)})
	if err != nil {
		log.Fatal(err)
	}
	defer lim.Close()
	if err := lim.SetLimit(hybridlimit.PerSecond(50)); err != nil {
		log.Fatal(err)
	}
	fmt.Println(lim.Limit())
}

// ExampleLimiter_AllowN charges a request by its cost, and reports who
// decided.
func ExampleLimiter_AllowN() {
	rdb := redis.NewClient(&redis.Options{Addr: "localhost:6379"})
	defer rdb.Close()
	lim, err := hybridlimit.New(hybridlimit.Config{Redis: rdb, Limit: hybridlimit.PerSecond(100)})
	if err != nil {
		log.Fatal(err)
	}
	defer lim.Close()
	d, err := lim.AllowN(context.Background(), "tenant:7", 25) // a batch of 25 items
	switch {
	case err != nil:
		log.Print(err) // errors.Is(err, hybridlimit.ErrInvalidN), ErrClosed, ctx's error
	case !d.Allowed:
		fmt.Println("retry in", d.RetryAfter)
	case d.Mode.Degraded():
		fmt.Println("allowed on this instance's share; Redis is away")
	default:
		fmt.Println("allowed;", d.Remaining, "left")
	}
}

// ExampleLimiter_Refund gives back what a first check took when a second
// one refuses the request.
func ExampleLimiter_Refund() {
	rdb := redis.NewClient(&redis.Options{Addr: "localhost:6379"})
	defer rdb.Close()
	perIP, _ := hybridlimit.New(hybridlimit.Config{Redis: rdb, Name: "ip", Limit: hybridlimit.PerSecond(20)})
	defer perIP.Close()
	perUser, _ := hybridlimit.New(hybridlimit.Config{Redis: rdb, Name: "user", Limit: hybridlimit.PerMinute(100)})
	defer perUser.Close()

	ctx := context.Background()
	ip, err := perIP.Allow(ctx, "203.0.113.9")
	if err != nil || !ip.Allowed {
		return
	}
	user, err := perUser.Allow(ctx, "user:42")
	if err == nil && !user.Allowed {
		// The request is refused after all: the per-IP token was not used.
		_ = perIP.Refund(ctx, "203.0.113.9", ip, 1)
	}
}

// ExampleConfig_shadow watches what a new, stricter limit would deny
// before it is enforced.
func ExampleConfig_shadow() {
	rdb := redis.NewClient(&redis.Options{Addr: "localhost:6379"})
	defer rdb.Close()
	lim, err := hybridlimit.New(hybridlimit.Config{
		Redis:  rdb,
		Name:   "search-v2",
		Limit:  hybridlimit.PerSecond(10),
		Shadow: true, // report, never deny
	})
	if err != nil {
		log.Fatal(err)
	}
	defer lim.Close()
	d, _ := lim.Allow(context.Background(), "user:42")
	if d.Shadowed {
		log.Printf("the new limit would deny user:42 for %v", d.RetryAfter)
	}
	fmt.Println(d.Allowed) // always true in shadow mode
}

// ExampleLimiter_Stats reads the limiter's state for gauges.
func ExampleLimiter_Stats() {
	rdb := redis.NewClient(&redis.Options{Addr: "localhost:6379"})
	defer rdb.Close()
	lim, err := hybridlimit.New(hybridlimit.Config{Redis: rdb, Limit: hybridlimit.PerSecond(100), Instances: 3})
	if err != nil {
		log.Fatal(err)
	}
	defer lim.Close()
	st := lim.Stats()
	for node, state := range st.Breakers {
		fmt.Printf("redis %s: breaker %s\n", node, state)
	}
	fmt.Printf("%d live instances; this one holds %.0f%% of each limit while Redis is away\n",
		st.Fleet, 100*st.Weight)
}

// ExampleLimiter_AllowAtMost has a batch worker take what the limit allows
// of its queue, up to a batch, and leave the rest for later. miniredis
// stands in for Redis here, with its clock held still, so that the
// example runs as it is.
func ExampleLimiter_AllowAtMost() {
	mr, err := miniredis.Run()
	if err != nil {
		log.Fatal(err)
	}
	defer mr.Close()
	mr.SetTime(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	defer rdb.Close()
	lim, err := hybridlimit.New(hybridlimit.Config{Redis: rdb, Limit: hybridlimit.PerMinute(100)})
	if err != nil {
		log.Fatal(err)
	}
	defer lim.Close()

	queue := 260 // emails waiting
	for queue > 0 {
		d, err := lim.AllowAtMost(context.Background(), "smtp-relay", int64(min(queue, 64)))
		if err != nil {
			log.Fatal(err)
		}
		if !d.Allowed {
			// In whole seconds, rounded up, as a Retry-After header has it.
			fmt.Println("none left; retry in", int64((d.RetryAfter+time.Second-1)/time.Second), "s")
			break
		}
		queue -= int(d.Granted)
		fmt.Println("sending", d.Granted)
	}
	// Output:
	// sending 64
	// sending 36
	// none left; retry in 1 s
}

// ExampleLimiter_Peek shows a key's state on an admin page without
// spending any of it.
func ExampleLimiter_Peek() {
	mr, err := miniredis.Run()
	if err != nil {
		log.Fatal(err)
	}
	defer mr.Close()
	mr.SetTime(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	defer rdb.Close()
	lim, err := hybridlimit.New(hybridlimit.Config{Redis: rdb, Limit: hybridlimit.PerSecond(10)})
	if err != nil {
		log.Fatal(err)
	}
	defer lim.Close()

	ctx := context.Background()
	lim.AllowN(ctx, "user:42", 3)
	for range 2 { // looking twice takes nothing
		st, err := lim.Peek(ctx, "user:42")
		if err != nil {
			log.Fatal(err)
		}
		fmt.Printf("%.1f tokens of %d, full in %v, from %v\n", st.Tokens, st.Limit.Burst, st.ResetAfter, st.Mode)
	}
	// Output:
	// 7.0 tokens of 10, full in 300ms, from remote
	// 7.0 tokens of 10, full in 300ms, from remote
}

// ExampleLimiter_Reset lifts a limit an operator was asked to lift: the
// key's bucket is full again.
func ExampleLimiter_Reset() {
	mr, err := miniredis.Run()
	if err != nil {
		log.Fatal(err)
	}
	defer mr.Close()
	mr.SetTime(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	defer rdb.Close()
	lim, err := hybridlimit.New(hybridlimit.Config{Redis: rdb, Limit: hybridlimit.PerMinute(5)})
	if err != nil {
		log.Fatal(err)
	}
	defer lim.Close()

	ctx := context.Background()
	lim.AllowN(ctx, "login:alice", 5)
	d, _ := lim.Allow(ctx, "login:alice")
	fmt.Println("before:", d.Allowed)
	if err := lim.Reset(ctx, "login:alice"); errors.Is(err, hybridlimit.ErrUnavailable) {
		log.Print(err) // Redis did not confirm; try again later
	}
	d, _ = lim.Allow(ctx, "login:alice")
	fmt.Println("after:", d.Allowed, d.Remaining, "left")
	// Output:
	// before: false
	// after: true 4 left
}
