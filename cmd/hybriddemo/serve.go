package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/hybridlimit/hybridlimit"
	"github.com/hybridlimit/hybridlimit/httplimit"
	"github.com/hybridlimit/hybridlimit/internal/faultproxy"
)

// The limits of the -serve mode's two rules.
var (
	perIP  = hybridlimit.PerSecond(5)
	perKey = hybridlimit.PerMinute(100)
)

// service is the HTTP service of -serve: GET / behind httplimit's
// middleware, on one Limiter whose Redis is reached through a fault proxy,
// and the outage switch that blackholes the proxy. Create it with
// newService; Close stops everything it started.
type service struct {
	handler   http.Handler
	where     string // the Redis, for people
	proxy     *faultproxy.Proxy
	outage    atomic.Bool // whether the proxy's blackhole is on
	log       *slog.Logger
	lim       *hybridlimit.Limiter
	rdb       *redis.Client
	stopRedis func()
}

// newService starts the service's Redis (the one at redisAddr, or an
// embedded miniredis if it is empty), the fault proxy before it, a client
// and the Limiter, and builds the handler. Breaker changes and switches of
// the outage are logged to log.
func newService(ctx context.Context, redisAddr string, log *slog.Logger) (_ *service, err error) {
	s := &service{log: log}
	defer func() {
		if err != nil {
			s.Close()
		}
	}()
	addr, where, stop, err := startRedis(ctx, redisAddr)
	if err != nil {
		return nil, err
	}
	s.where, s.stopRedis = where, stop
	if s.proxy, err = faultproxy.New(addr); err != nil {
		return nil, err
	}
	s.rdb = newClient(s.proxy.Addr())
	s.lim, err = hybridlimit.New(hybridlimit.Config{
		Redis: s.rdb,
		Name:  "hybriddemo",
		// One Limiter for both rules: the middleware prefixes each key with
		// its rule's name, and LimitFor gives the API keys their limit.
		Limit: perIP,
		LimitFor: func(key string) hybridlimit.Limit {
			if strings.HasPrefix(key, "apikey:") {
				return perKey
			}
			return hybridlimit.Limit{} // perIP
		},
		Prefix:    fmt.Sprintf("hybriddemo:serve:%d:", time.Now().UnixMilli()),
		Timeout:   50 * time.Millisecond,
		OnFailure: hybridlimit.FailLocal,
		Logger:    log,
	})
	if err != nil {
		return nil, err
	}
	warmUp(ctx, func(ctx context.Context, key string) (bool, string, error) {
		d, err := s.lim.Allow(ctx, key)
		return d.Allowed, d.Mode.String(), err
	})
	mw, err := httplimit.New(httplimit.Config{
		Rules: []httplimit.Rule{
			// The rule most likely to deny goes first.
			{Name: "ip", Limiter: s.lim, Key: httplimit.ClientIP{}.Key},
			// Hashed keeps API keys out of Redis; no header, no rule.
			{Name: "apikey", Limiter: s.lim, Key: httplimit.Hashed(httplimit.Header("X-API-Key"))},
		},
		LegacyHeaders: true,
		Logger:        log,
	})
	if err != nil {
		return nil, err
	}
	mux := http.NewServeMux()
	mux.Handle("GET /{$}", mw.HandlerFunc(hello))
	// The switch is not limited, so that it works when you are.
	mux.HandleFunc("GET /outage", s.showOutage)
	mux.HandleFunc("POST /outage", s.setOutage)
	mux.HandleFunc("POST /outage/{state}", s.setOutage)
	s.handler = mux
	return s, nil
}

// Handler returns the service's handler.
func (s *service) Handler() http.Handler { return s.handler }

// Close closes the Limiter, the client, the proxy and the Redis, those
// that were started. The handler must not be used after Close.
func (s *service) Close() {
	if s.lim != nil {
		s.lim.Close()
	}
	if s.rdb != nil {
		s.rdb.Close()
	}
	if s.proxy != nil {
		s.proxy.Close()
	}
	if s.stopRedis != nil {
		s.stopRedis()
	}
}

// hello answers "hello" and who decided. The middleware has set the
// RateLimit fields already, and a rule decided without Redis marks its
// members hl-degraded: under FailLocal, the instance's local share decided.
func hello(w http.ResponseWriter, r *http.Request) {
	mode := hybridlimit.ModeRemote
	for _, v := range w.Header().Values(httplimit.HeaderRateLimit) {
		if strings.Contains(v, ";"+httplimit.ParamDegraded) {
			mode = hybridlimit.ModeLocal
		}
	}
	how := "the shared buckets in Redis"
	if mode.Degraded() {
		how = "this instance's share of the limit, Redis being away"
	}
	fmt.Fprintf(w, "hello (mode %s: %s)\n", mode, how)
}

// setOutage turns the outage on or off: POST /outage?on=true|false, or
// POST /outage/on and /outage/off.
func (s *service) setOutage(w http.ResponseWriter, r *http.Request) {
	v, path := r.URL.Query().Get("on"), r.PathValue("state")
	on, err := strconv.ParseBool(v)
	switch {
	case path == "on" || path == "off":
		on = path == "on"
	case path != "" || err != nil:
		http.Error(w, "want POST /outage?on=true or ?on=false, /outage/on or /outage/off", http.StatusBadRequest)
		return
	}
	s.outage.Store(on)
	s.proxy.Blackhole(on)
	s.log.Info("hybriddemo: outage switched", "on", on)
	s.showOutage(w, r)
}

// showOutage says whether Redis is cut off.
func (s *service) showOutage(w http.ResponseWriter, r *http.Request) {
	if s.outage.Load() {
		fmt.Fprintln(w, "outage on: Redis is cut off (connections stay open, nothing comes back)")
		return
	}
	fmt.Fprintln(w, "outage off: Redis is reachable")
}

// serve runs the service on o.serve until ctx ends, then shuts the server
// down gracefully and stops everything. It writes how to use it to w and
// logs to standard error.
func serve(ctx context.Context, o options, w io.Writer) error {
	ln, err := net.Listen("tcp", o.serve)
	if err != nil {
		return err
	}
	defer ln.Close()
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	s, err := newService(ctx, o.redis, log)
	if err != nil {
		return err
	}
	defer s.Close()

	host, _, _ := net.SplitHostPort(o.serve)
	if ip := net.ParseIP(host); host == "" || ip != nil && ip.IsUnspecified() {
		host = "localhost"
	}
	_, port, _ := net.SplitHostPort(ln.Addr().String())
	url := "http://" + net.JoinHostPort(host, port)
	fmt.Fprint(w, strings.NewReplacer("$URL", url, "$WHERE", s.where).Replace(serveUsage))

	srv := &http.Server{Handler: s.Handler(), ReadHeaderTimeout: 5 * time.Second}
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ln) }()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
	}
	log.Info("hybriddemo: shutting down")
	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	err = srv.Shutdown(sctx)
	if serr := <-done; !errors.Is(serr, http.ErrServerClosed) {
		err = errors.Join(err, serr)
	}
	return err
}

const serveUsage = `hybriddemo -serve: listening on $URL until interrupted (Ctrl-C).
Redis: $WHERE, reached through a fault proxy.

GET / answers "hello" and who decided, behind httplimit's middleware on one hybridlimit Limiter
(FailLocal, Timeout 50ms, the default breaker) with two rules:
  "ip"      5 requests/s (burst 5) per client address
  "apikey"  100 requests/min (burst 100) per X-API-Key header; skipped without the header
Responses carry RateLimit-Policy and RateLimit, and X-RateLimit-Limit, -Remaining and -Reset; a
denial is 429 with Retry-After. While Redis is away the Limiter decides on this instance's share
(all of the limit: it is the only instance), and those members say ;hl-degraded.
POST /outage?on=true|false, or /outage/on and /outage/off, cuts Redis off and lets it back (the
proxy's connections stay open, nothing comes back); GET /outage says which. Breaker changes are
logged below.

Try:
  curl -i $URL/
  for i in 1 2 3 4 5 6 7; do curl -s -o /dev/null -w '%{http_code} ' $URL/; done; echo
  curl -i -H 'X-API-Key: demo' $URL/
  curl -X POST '$URL/outage?on=true'
  curl -i $URL/
  curl -X POST $URL/outage/off

`
