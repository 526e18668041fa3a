// Command tryit shows the example service through a Redis outage. It
// serves the service on loopback with its Redis behind a TCP proxy, sends
// HTTP and gRPC requests to it, cuts the proxy off for a while and prints,
// per second, what was admitted and denied and what the RateLimit fields
// said. examples/try.sh runs it against a throwaway redis-server:
//
//	go run ./cmd/tryit -redis 127.0.0.1:6379
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/hybridlimit/hybridlimit"
	"github.com/hybridlimit/hybridlimit/examples/service"
	"github.com/hybridlimit/hybridlimit/httplimit"
	"github.com/hybridlimit/hybridlimit/internal/faultproxy"
)

func main() {
	// A burst of 100 drained by 10 a second: Remaining counts down through
	// the outage, from Redis's level to the local bucket's and back.
	sc := scenario{Limit: hybridlimit.Limit{Rate: 50, Burst: 100}}
	flag.StringVar(&sc.Redis, "redis", "", "Redis `address` (required); only keys under hybridlimit-tryit: are written")
	flag.DurationVar(&sc.Before, "before", 4*time.Second, "how long to run before Redis is cut off")
	flag.DurationVar(&sc.Cut, "cut", 4*time.Second, "how long Redis is cut off")
	flag.DurationVar(&sc.After, "after", 4*time.Second, "how long to run after Redis is back")
	flag.IntVar(&sc.Rate, "rate", 60, "requests per `second`, half over HTTP, half over gRPC")
	flag.Parse()
	if sc.Redis == "" || sc.Rate < 2 {
		flag.Usage()
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if _, err := sc.run(ctx, os.Stdout); err != nil && !errors.Is(err, context.Canceled) {
		log.Fatal(err)
	}
}

// scenario is one run: Before with Redis reachable, Cut with the proxy
// before it black-holed (connections stay open, nothing gets through),
// After with Redis back, all the while Rate requests per second from one
// client, half over HTTP, half over gRPC.
type scenario struct {
	Redis              string
	Before, Cut, After time.Duration
	Rate               int
	Limit              hybridlimit.Limit
}

// second is what the client saw in one second of a run, counted when each
// answer arrived.
type second struct {
	Cut                bool   // Redis was cut off in the middle of the second
	HTTPOK, HTTPDenied int    // 200 and 429
	GRPCOK, GRPCDenied int    // OK and ResourceExhausted
	Errors             int    // anything else
	Degraded           int    // answers whose RateLimit field carried hl-degraded
	RateLimit          string // the RateLimit field of the second's last answer
	Breaker            string // the breaker's state when the second was printed
}

func (s second) answers() int { return s.HTTPOK + s.HTTPDenied + s.GRPCOK + s.GRPCDenied }

// answer is what one request got back; field is its RateLimit field.
type answer struct {
	grpc, allowed, failed bool
	field                 string
}

// tally counts answers into the second they arrived in.
type tally struct {
	start time.Time
	mu    sync.Mutex // protects rows
	rows  []second
}

func (t *tally) add(a answer) {
	t.mu.Lock()
	defer t.mu.Unlock()
	i := min(int(time.Since(t.start)/time.Second), len(t.rows)-1)
	r := &t.rows[i]
	switch {
	case a.failed:
		r.Errors++
		return
	case a.grpc && a.allowed:
		r.GRPCOK++
	case a.grpc:
		r.GRPCDenied++
	case a.allowed:
		r.HTTPOK++
	default:
		r.HTTPDenied++
	}
	if strings.Contains(a.field, ";"+httplimit.ParamDegraded) {
		r.Degraded++
	}
	r.RateLimit = a.field
}

// close records the breaker's state in row i and returns the row.
func (t *tally) close(i int, breaker string) second {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.rows[i].Breaker = breaker
	return t.rows[i]
}

// run runs sc against the service and prints a line per second to out; it
// returns the seconds.
func (sc scenario) run(ctx context.Context, out io.Writer) ([]second, error) {
	proxy, err := faultproxy.New(sc.Redis)
	if err != nil {
		return nil, err
	}
	defer proxy.Close()
	rdb := redis.NewClient(&redis.Options{Addr: proxy.Addr(), ContextTimeoutEnabled: true})
	defer rdb.Close()
	if err := rdb.Ping(ctx).Err(); err != nil {
		return nil, fmt.Errorf("no Redis at %s: %w", sc.Redis, err)
	}
	lim, err := hybridlimit.New(hybridlimit.Config{
		Redis:     rdb,
		Name:      "tryit",
		Prefix:    "hybridlimit-tryit:",
		Limit:     sc.Limit,
		Instances: 1,
	})
	if err != nil {
		return nil, err
	}
	defer lim.Close()

	handler, srv, err := service.New(lim)
	if err != nil {
		return nil, err
	}
	httpLis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	hs := &http.Server{Handler: handler}
	go hs.Serve(httpLis)
	defer hs.Close()
	grpcLis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	go srv.Serve(grpcLis)
	defer srv.Stop()
	cc, err := grpc.NewClient(grpcLis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, err
	}
	defer cc.Close()
	hc := &http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: 32}}
	defer hc.CloseIdleConnections()
	url := "http://" + httpLis.Addr().String() + "/hello"

	total := sc.Before + sc.Cut + sc.After
	n := int((total + time.Second - 1) / time.Second)
	t := &tally{start: time.Now(), rows: make([]second, n)}
	for i := range t.rows {
		mid := time.Duration(i)*time.Second + time.Second/2
		t.rows[i].Cut = mid >= sc.Before && mid < sc.Before+sc.Cut
	}
	fmt.Fprintf(out, "limit %v per client, shared by HTTP and gRPC; offered %d/s; Redis cut off from %v to %v\n",
		sc.Limit, sc.Rate, sc.Before, sc.Before+sc.Cut)
	fmt.Fprintln(out, "(gRPC RE: ResourceExhausted; degraded: answers marked hl-degraded, decided without Redis)")
	fmt.Fprintln(out, "sec  Redis  breaker    HTTP 200  HTTP 429  gRPC OK  gRPC RE  degraded  errors  RateLimit field of the last answer")
	printRow := func(i int) {
		var breaker string
		for _, state := range lim.Stats().Breakers { // one node
			breaker = state
		}
		r := t.close(i, breaker)
		reach := "up"
		if r.Cut {
			reach = "CUT"
		}
		fmt.Fprintf(out, "%3d  %-5s  %-9s  %8d  %8d  %7d  %7d  %8d  %6d  %s\n",
			i+1, reach, r.Breaker, r.HTTPOK, r.HTTPDenied, r.GRPCOK, r.GRPCDenied, r.Degraded, r.Errors, r.RateLimit)
	}

	cut := time.AfterFunc(sc.Before, func() { proxy.Blackhole(true) })
	defer cut.Stop()
	restore := time.AfterFunc(sc.Before+sc.Cut, func() { proxy.Blackhole(false) })
	defer restore.Stop()
	load, stop := context.WithTimeout(ctx, total)
	defer stop()
	var wg sync.WaitGroup
	wg.Go(func() { send(load, sc.Rate/2, func() { t.add(callHTTP(hc, url)) }) })
	wg.Go(func() { send(load, sc.Rate-sc.Rate/2, func() { t.add(callGRPC(cc)) }) })
	for i := range n - 1 {
		select {
		case <-time.After(time.Until(t.start.Add(time.Duration(i+1) * time.Second))):
			printRow(i)
		case <-ctx.Done():
		}
	}
	wg.Wait()
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	printRow(n - 1)
	return t.rows, nil
}

// send calls f rate times a second, each call on a goroutine of its own,
// so that a slow answer does not delay the next request, until ctx ends;
// then it waits for the calls to return.
func send(ctx context.Context, rate int, f func()) {
	var wg sync.WaitGroup
	defer wg.Wait()
	tick := time.NewTicker(time.Second / time.Duration(rate))
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
			wg.Go(f)
		}
	}
}

func callHTTP(hc *http.Client, url string) answer {
	resp, err := hc.Get(url)
	if err != nil {
		return answer{failed: true}
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	ok, denied := resp.StatusCode == http.StatusOK, resp.StatusCode == http.StatusTooManyRequests
	return answer{allowed: ok, failed: !ok && !denied, field: resp.Header.Get(httplimit.HeaderRateLimit)}
}

func callGRPC(cc *grpc.ClientConn) answer {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	var md metadata.MD
	_, err := service.Hello(ctx, cc, "tryit", grpc.Header(&md))
	code := status.Code(err)
	a := answer{grpc: true, allowed: err == nil, failed: err != nil && code != codes.ResourceExhausted}
	if f := md.Get("ratelimit"); len(f) > 0 {
		a.field = f[0]
	}
	return a
}
