package httplimit

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/hybridlimit/hybridlimit"
	"github.com/hybridlimit/hybridlimit/internal/redistest"
)

func TestMain(m *testing.M) {
	// Tests that pause Redis make go-redis log every failed read.
	redis.SetLogger(quiet{})
	m.Run()
}

type quiet struct{}

func (quiet) Printf(context.Context, string, ...any) {}

var discard = slog.New(slog.DiscardHandler)

// epoch is the miniredis clock: it stands still, so that Redis refills
// nothing between the requests of a test.
var epoch = time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)

// newLimiter returns a Limiter on a fresh miniredis whose clock stands at
// epoch, closed by t.Cleanup. Its Timeout, unless cfg says one, is 5 s:
// these tests check what the middleware says of Redis's decisions, and a
// cold miniredis under -race on a busy machine can take longer than the
// default 50 ms to run its first script, which would make it a local one.
func newLimiter(t *testing.T, cfg hybridlimit.Config) *hybridlimit.Limiter {
	t.Helper()
	m := miniredis.RunT(t)
	m.SetTime(epoch)
	c := redis.NewClient(&redis.Options{Addr: m.Addr()})
	t.Cleanup(func() { c.Close() })
	cfg.Redis = c
	if cfg.Timeout == 0 {
		cfg.Timeout = 5 * time.Second
	}
	return limiterOn(t, cfg)
}

// limiterOn returns a Limiter for cfg, with no heartbeat (shares stay
// 1/Instances), closed by t.Cleanup.
func limiterOn(t *testing.T, cfg hybridlimit.Config) *hybridlimit.Limiter {
	t.Helper()
	cfg.Heartbeat = -1
	if cfg.Instances == 0 {
		cfg.Instances = 1 // without a heartbeat, the share must be said
	}
	lim, err := hybridlimit.New(cfg)
	if err != nil {
		t.Fatalf("hybridlimit.New: %v", err)
	}
	t.Cleanup(func() { lim.Close() })
	return lim
}

// newHandler returns cfg's middleware around a handler that answers "ok"
// and counts its calls.
func newHandler(t *testing.T, cfg Config) (http.Handler, *atomic.Int64) {
	t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = discard
	}
	mw, err := New(cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	var served atomic.Int64
	return mw.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		served.Add(1)
		io.WriteString(w, "ok")
	}), &served
}

// get serves a GET from remote with the header pairs kv.
func get(h http.Handler, remote string, kv ...string) *http.Response {
	r := httptest.NewRequest(http.MethodGet, "/", nil)
	r.RemoteAddr = remote
	for i := 0; i+1 < len(kv); i += 2 {
		r.Header.Add(kv[i], kv[i+1])
	}
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	return w.Result()
}

func body(resp *http.Response) string {
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}

// want is the expected outcome of one request.
type want struct {
	status     int
	policy     string // RateLimit-Policy
	limit      string // RateLimit
	retryAfter string
}

// run serves each request of steps from remote with the header pairs kv,
// checking status and fields exactly and parsing them strictly.
func run(t *testing.T, h http.Handler, remote string, kv []string, steps []want) {
	t.Helper()
	for i, w := range steps {
		resp := get(h, remote, kv...)
		got := want{resp.StatusCode, resp.Header.Get(HeaderPolicy), resp.Header.Get(HeaderRateLimit),
			resp.Header.Get("Retry-After")}
		if got != w {
			t.Errorf("request %d = %+v; want %+v", i+1, got, w)
		}
		if w.policy != "" {
			checkFields(t, resp.Header.Values(HeaderPolicy), resp.Header.Values(HeaderRateLimit))
		}
	}
}

var perIP = ClientIP{}.Key

func TestHeaders(t *testing.T) {
	lim := newLimiter(t, hybridlimit.Config{Limit: hybridlimit.Limit{Rate: 1, Burst: 3}})
	h, served := newHandler(t, Config{Rules: []Rule{{Name: "default", Limiter: lim, Key: perIP}}})
	const pol = `"default";q=3;w=3`
	run(t, h, "192.0.2.1:1234", nil, []want{
		{200, pol, `"default";r=2;t=1`, ""},
		{200, pol, `"default";r=1;t=2`, ""},
		{200, pol, `"default";r=0;t=3`, ""},
		{429, pol, `"default";r=0;t=1`, "1"},
		{429, pol, `"default";r=0;t=1`, "1"},
	})
	if served.Load() != 3 {
		t.Errorf("served %d requests; want 3", served.Load())
	}
	// Another client has its own bucket.
	run(t, h, "192.0.2.2:1234", nil, []want{{200, pol, `"default";r=2;t=1`, ""}})
}

func TestHeadersPerMinute(t *testing.T) {
	lim := newLimiter(t, hybridlimit.Config{Limit: hybridlimit.PerMinute(100)})
	h, _ := newHandler(t, Config{Rules: []Rule{{Name: "api", Limiter: lim, Key: perIP, Cost: 10}}})
	resp := get(h, "192.0.2.1:1")
	// 10 tokens at 100/60 per second come back in 6 s.
	if got, want := resp.Header.Get(HeaderPolicy), `"api";q=100;w=60`; got != want {
		t.Errorf("RateLimit-Policy = %q; want %q", got, want)
	}
	if got, want := resp.Header.Get(HeaderRateLimit), `"api";r=90;t=6`; got != want {
		t.Errorf("RateLimit = %q; want %q", got, want)
	}
}

func TestLegacyHeaders(t *testing.T) {
	lim := newLimiter(t, hybridlimit.Config{Limit: hybridlimit.Limit{Rate: 1, Burst: 3}})
	h, _ := newHandler(t, Config{Rules: []Rule{{Name: "default", Limiter: lim, Key: perIP}}, LegacyHeaders: true})
	resp := get(h, "192.0.2.1:1")
	for name, want := range map[string]string{
		"X-RateLimit-Limit": "3", "X-RateLimit-Remaining": "2", "X-RateLimit-Reset": "1",
	} {
		if got := resp.Header.Get(name); got != want {
			t.Errorf("%s = %q; want %q", name, got, want)
		}
	}
	h, _ = newHandler(t, Config{Rules: []Rule{{Name: "other", Limiter: lim, Key: perIP}}})
	if got := get(h, "192.0.2.1:1").Header.Get("X-RateLimit-Limit"); got != "" {
		t.Errorf("X-RateLimit-Limit = %q without LegacyHeaders; want none", got)
	}
}

func TestPolicyNameEscaped(t *testing.T) {
	lim := newLimiter(t, hybridlimit.Config{Limit: hybridlimit.PerSecond(5)})
	name := `say "hi" \o/`
	h, _ := newHandler(t, Config{Rules: []Rule{{Name: name, Limiter: lim, Key: perIP}}})
	resp := get(h, "192.0.2.1:1")
	if got, want := resp.Header.Get(HeaderPolicy), `"say \"hi\" \\o/";q=5;w=1`; got != want {
		t.Errorf("RateLimit-Policy = %q; want %q", got, want)
	}
	pol, _ := checkFields(t, resp.Header.Values(HeaderPolicy), resp.Header.Values(HeaderRateLimit))
	if pol[0].name != name {
		t.Errorf("parsed name %q; want %q", pol[0].name, name)
	}
}

func TestNewRejectsBadConfig(t *testing.T) {
	c := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
	defer c.Close()
	lim := limiterOn(t, hybridlimit.Config{Redis: c, Limit: hybridlimit.PerSecond(5)})
	ok := Rule{Name: "ok", Limiter: lim, Key: perIP}
	tests := []struct {
		name  string
		rules []Rule
	}{
		{"no rules", nil},
		{"empty name", []Rule{{Limiter: lim, Key: perIP}}},
		{"colon", []Rule{{Name: "a:b", Limiter: lim, Key: perIP}}},
		{"non-ASCII", []Rule{{Name: "é", Limiter: lim, Key: perIP}}},
		{"control", []Rule{{Name: "a\nb", Limiter: lim, Key: perIP}}},
		{"twice", []Rule{ok, ok}},
		{"no limiter", []Rule{{Name: "x", Key: perIP}}},
		{"no key", []Rule{{Name: "x", Limiter: lim}}},
		{"negative cost", []Rule{{Name: "x", Limiter: lim, Key: perIP, Cost: -1}}},
		{"cost above burst", []Rule{{Name: "x", Limiter: lim, Key: perIP, Cost: 6}}},
	}
	for _, tt := range tests {
		if _, err := New(Config{Rules: tt.rules}); !errors.Is(err, ErrInvalidConfig) {
			t.Errorf("%s: New = %v; want ErrInvalidConfig", tt.name, err)
		}
	}
	if _, err := New(Config{Rules: []Rule{ok}}); err != nil {
		t.Errorf("New(%+v) = %v; want nil", ok, err)
	}
}

type userKey struct{}

// withUser puts the X-User header, if any, in the context as the
// authenticated user, as an authentication middleware would.
func withUser(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if u := r.Header.Get("X-User"); u != "" {
			r = r.WithContext(context.WithValue(r.Context(), userKey{}, u))
		}
		h.ServeHTTP(w, r)
	})
}

// TestSeveralRulesRefund: a per-IP rule passes, a per-user rule denies, and
// the per-IP token comes back. Both rules share one Limiter, which tells
// them apart by the rule prefix of the key.
func TestSeveralRulesRefund(t *testing.T) {
	lim := newLimiter(t, hybridlimit.Config{
		Limit: hybridlimit.Limit{Rate: 1, Burst: 3},
		LimitFor: func(key string) hybridlimit.Limit {
			if strings.HasPrefix(key, "user:") {
				return hybridlimit.Limit{Rate: 0.5, Burst: 1}
			}
			return hybridlimit.Limit{}
		},
	})
	h, served := newHandler(t, Config{Rules: []Rule{
		{Name: "ip", Limiter: lim, Key: perIP},
		{Name: "user", Limiter: lim, Key: FromContext(userKey{})},
	}})
	h = withUser(h)
	const ip = "192.0.2.1:1"
	alice := []string{"X-User", "alice"}
	run(t, h, ip, alice, []want{
		{200, `"user";q=1;w=2, "ip";q=3;w=3`, `"user";r=0;t=2, "ip";r=2;t=1`, ""},
		// user denies; ip's token is refunded: r=2, not 1.
		{429, `"user";q=1;w=2, "ip";q=3;w=3`, `"user";r=0;t=2, "ip";r=2;t=2`, "2"},
	})
	// Anonymous requests skip the user rule: two tokens are left for
	// the address, which the denial above would have taken one of.
	run(t, h, ip, nil, []want{
		{200, `"ip";q=3;w=3`, `"ip";r=1;t=2`, ""},
		{200, `"ip";q=3;w=3`, `"ip";r=0;t=3`, ""},
		{429, `"ip";q=3;w=3`, `"ip";r=0;t=1`, "1"},
	})
	if served.Load() != 3 {
		t.Errorf("served %d requests; want 3", served.Load())
	}
}

// TestRefundEmptiedBucket: when the grant that a later rule's denial
// refunds had emptied the bucket, the next request gets the token back.
func TestRefundEmptiedBucket(t *testing.T) {
	lim := newLimiter(t, hybridlimit.Config{
		Limit: hybridlimit.Limit{Rate: 1, Burst: 2},
		LimitFor: func(key string) hybridlimit.Limit {
			if strings.HasPrefix(key, "user:") {
				return hybridlimit.Limit{Rate: 1, Burst: 1}
			}
			return hybridlimit.Limit{}
		},
	})
	h, _ := newHandler(t, Config{Rules: []Rule{
		{Name: "ip", Limiter: lim, Key: perIP},
		{Name: "user", Limiter: lim, Key: FromContext(userKey{})},
	}})
	h = withUser(h)
	const ip = "192.0.2.1:1"
	run(t, h, ip, []string{"X-User", "alice"}, []want{
		{200, `"user";q=1;w=1, "ip";q=2;w=2`, `"user";r=0;t=1, "ip";r=1;t=1`, ""},
		{429, `"user";q=1;w=1, "ip";q=2;w=2`, `"user";r=0;t=1, "ip";r=1;t=2`, "1"},
	})
	run(t, h, ip, nil, []want{{200, `"ip";q=2;w=2`, `"ip";r=0;t=2`, ""}})
}

// TestRetryAfterNotBeforeT: on every 429, Retry-After is at least the t of
// the denying (first) member, and at least 1.
func TestRetryAfterNotBeforeT(t *testing.T) {
	lim := newLimiter(t, hybridlimit.Config{Limit: hybridlimit.Limit{Rate: 0.3, Burst: 2}})
	other := newLimiter(t, hybridlimit.Config{Limit: hybridlimit.PerMinute(1000)})
	h, _ := newHandler(t, Config{Rules: []Rule{
		{Name: "wide", Limiter: other, Key: perIP},
		{Name: "tight", Limiter: lim, Key: perIP},
	}})
	denials := 0
	for range 6 {
		resp := get(h, "192.0.2.9:1")
		_, ml := checkFields(t, resp.Header.Values(HeaderPolicy), resp.Header.Values(HeaderRateLimit))
		if resp.StatusCode != http.StatusTooManyRequests {
			continue
		}
		denials++
		ra, err := strconv.ParseInt(resp.Header.Get("Retry-After"), 10, 64)
		tt, _ := ml[0].int("t")
		if err != nil || ra < 1 || ra < tt || ml[0].name != "tight" {
			t.Errorf("429 with Retry-After %q and RateLimit %q; want Retry-After >= t of \"tight\", first",
				resp.Header.Get("Retry-After"), resp.Header.Get(HeaderRateLimit))
		}
		// 1/0.3 s for one token, rounded up.
		if tt != 4 {
			t.Errorf("t = %d; want 4", tt)
		}
	}
	if denials != 4 {
		t.Errorf("%d denials; want 4", denials)
	}
}

func TestDenyHandler(t *testing.T) {
	lim := newLimiter(t, hybridlimit.Config{Limit: hybridlimit.Limit{Rate: 1, Burst: 1}})
	var got Denial
	h, served := newHandler(t, Config{
		Rules: []Rule{{Name: "ip", Limiter: lim, Key: perIP}},
		DenyHandler: func(w http.ResponseWriter, r *http.Request, d Denial) {
			got = d
			if w.Header().Get("Retry-After") == "" || w.Header().Get(HeaderRateLimit) == "" {
				t.Errorf("DenyHandler called before the header fields were set: %v", w.Header())
			}
			w.Header().Set("Content-Type", "application/problem+json")
			w.WriteHeader(http.StatusTooManyRequests)
			json.NewEncoder(w).Encode(map[string]any{
				"type":              "https://iana.org/assignments/http-problem-types#quota-exceeded",
				"violated-policies": []string{d.Rule},
			})
		},
	})
	get(h, "192.0.2.1:1")
	resp := get(h, "192.0.2.1:1")
	if resp.StatusCode != 429 || resp.Header.Get("Content-Type") != "application/problem+json" ||
		!strings.Contains(body(resp), `"violated-policies":["ip"]`) {
		t.Errorf("denied response %d %v; want the DenyHandler's", resp.StatusCode, resp.Header)
	}
	if got.Rule != "ip" || got.Key != "192.0.2.1" || got.Decision.Allowed || got.RetryAfter != time.Second {
		t.Errorf("Denial = %+v; want rule ip, key 192.0.2.1, RetryAfter 1s", got)
	}
	if served.Load() != 1 {
		t.Errorf("served %d; want 1", served.Load())
	}
}

func TestDefaultDenyBody(t *testing.T) {
	lim := newLimiter(t, hybridlimit.Config{Limit: hybridlimit.Limit{Rate: 1, Burst: 1}, Prefix: "secret-prefix:"})
	h, _ := newHandler(t, Config{Rules: []Rule{{Name: "ip", Limiter: lim, Key: perIP}}})
	get(h, "192.0.2.1:1")
	resp := get(h, "192.0.2.1:1")
	if b := body(resp); resp.StatusCode != 429 || b != "too many requests\n" {
		t.Errorf("denied response %d %q; want 429 \"too many requests\\n\"", resp.StatusCode, b)
	}
	if ct := resp.Header.Get("Content-Type"); ct != "text/plain; charset=utf-8" {
		t.Errorf("Content-Type = %q; want text/plain", ct)
	}
}

func TestShadow(t *testing.T) {
	lim := newLimiter(t, hybridlimit.Config{Limit: hybridlimit.Limit{Rate: 1, Burst: 2}, Shadow: true})
	h, served := newHandler(t, Config{Rules: []Rule{{Name: "ip", Limiter: lim, Key: perIP}}})
	for i, w := range []struct {
		limit, shadow string
	}{
		{`"ip";r=1;t=1`, ""},
		{`"ip";r=0;t=2`, ""},
		{`"ip";r=0;t=1`, "deny"},
		{`"ip";r=0;t=1`, "deny"},
	} {
		resp := get(h, "192.0.2.1:1")
		if resp.StatusCode != 200 || resp.Header.Get(HeaderRateLimit) != w.limit ||
			resp.Header.Get(HeaderShadow) != w.shadow || resp.Header.Get("Retry-After") != "" {
			t.Errorf("request %d: %d %v; want 200, RateLimit %q, X-RateLimit-Shadow %q, no Retry-After",
				i+1, resp.StatusCode, resp.Header, w.limit, w.shadow)
		}
	}
	if served.Load() != 4 {
		t.Errorf("served %d; want 4", served.Load())
	}
}

// TestErrors: a rule that cannot decide gets a generic 500 that leaks
// nothing, the tokens of the rules before it back, and a log line, at
// Error but for a closed Limiter (a server shutting down answers every
// request so until it stops: at Debug); with PassOnError it is skipped.
func TestErrors(t *testing.T) {
	lim := newLimiter(t, hybridlimit.Config{
		Limit: hybridlimit.Limit{Rate: 1, Burst: 3},
		LimitFor: func(key string) hybridlimit.Limit {
			if strings.HasPrefix(key, "bad:") {
				return hybridlimit.Limit{Rate: -1, Burst: 1}
			}
			return hybridlimit.Limit{}
		},
	})
	closed := newLimiter(t, hybridlimit.Config{Limit: hybridlimit.PerSecond(5), Prefix: "secret-prefix:"})
	closed.Close()
	failing := func(*http.Request) (string, error) { return "", errors.New("secret-key-error") }
	for _, tc := range []struct {
		name   string
		rule   Rule
		log    string
		level  string
		status int
		body   string
	}{
		{"closed", Rule{Name: "c", Limiter: closed, Key: perIP}, "limiter closed", "DEBUG", 503, "service unavailable\n"},
		{"key", Rule{Name: "k", Limiter: lim, Key: failing}, "secret-key-error", "ERROR", 500, "internal server error\n"},
		{"limit", Rule{Name: "bad", Limiter: lim, Key: perIP}, "invalid limit", "ERROR", 500, "internal server error\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var logs bytes.Buffer
			ip := Rule{Name: "ip-" + tc.name, Limiter: lim, Key: perIP}
			h, served := newHandler(t, Config{Rules: []Rule{ip, tc.rule},
				Logger: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))})
			resp := get(h, "192.0.2.1:1")
			b := body(resp)
			if resp.StatusCode != tc.status || b != tc.body || served.Load() != 0 {
				t.Errorf("response %d %q, served %d; want %d %q, not served",
					resp.StatusCode, b, served.Load(), tc.status, tc.body)
			}
			if !strings.Contains(logs.String(), tc.log) || !strings.Contains(logs.String(), "level="+tc.level) {
				t.Errorf("log %q; want it to hold %q at %s", logs.String(), tc.log, tc.level)
			}
			// The ip rule's token was given back: a full bucket.
			h, _ = newHandler(t, Config{Rules: []Rule{ip}})
			if got := get(h, "192.0.2.1:1").Header.Get(HeaderRateLimit); got != `"`+ip.Name+`";r=2;t=1` {
				t.Errorf("after the error, RateLimit = %q; want r=2 (refunded)", got)
			}

			h, served = newHandler(t, Config{Rules: []Rule{tc.rule}, PassOnError: true})
			resp = get(h, "192.0.2.1:1")
			if resp.StatusCode != 200 || served.Load() != 1 || resp.Header.Get(HeaderRateLimit) != "" {
				t.Errorf("PassOnError: %d %v, served %d; want 200 without fields, served", resp.StatusCode,
					resp.Header, served.Load())
			}
		})
	}
}

func TestSkip(t *testing.T) {
	lim := newLimiter(t, hybridlimit.Config{Limit: hybridlimit.Limit{Rate: 1, Burst: 1}})
	h, served := newHandler(t, Config{Rules: []Rule{{Name: "user", Limiter: lim, Key: FromContext(userKey{})}}})
	for range 3 {
		if resp := get(h, "192.0.2.1:1"); resp.StatusCode != 200 || len(resp.Header.Values(HeaderPolicy)) != 0 {
			t.Errorf("anonymous: %d %v; want 200 without fields", resp.StatusCode, resp.Header)
		}
	}
	if served.Load() != 3 {
		t.Errorf("served %d; want 3", served.Load())
	}
}

// TestNested: a global middleware and a per-route one add their members to
// the same fields.
func TestNested(t *testing.T) {
	lim := newLimiter(t, hybridlimit.Config{Limit: hybridlimit.Limit{Rate: 1, Burst: 5}})
	outer, err := New(Config{Rules: []Rule{{Name: "global", Limiter: lim, Key: perIP}}})
	if err != nil {
		t.Fatal(err)
	}
	inner, err := New(Config{Rules: []Rule{{Name: "search", Limiter: lim, Key: perIP, Cost: 3}}})
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("/search", inner.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {}))
	var mw func(http.Handler) http.Handler = outer.Handler // the chi/gorilla shape
	h := mw(mux)
	r := httptest.NewRequest(http.MethodGet, "/search", nil)
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	_, ml := checkFields(t, w.Result().Header.Values(HeaderPolicy), w.Result().Header.Values(HeaderRateLimit))
	if len(ml) != 2 || ml[0].name != "global" || ml[1].name != "search" {
		t.Errorf("RateLimit %q; want global then search", w.Result().Header.Values(HeaderRateLimit))
	}
}

// TestSpoofedForwarding: a client that is not a trusted proxy cannot change
// its key with forwarding headers; behind a trusted proxy, the client's own
// entries are ignored too.
func TestSpoofedForwarding(t *testing.T) {
	lim := newLimiter(t, hybridlimit.Config{Limit: hybridlimit.Limit{Rate: 1, Burst: 2}})
	ip := ClientIP{TrustedProxies: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}}
	h, _ := newHandler(t, Config{Rules: []Rule{{Name: "ip", Limiter: lim, Key: ip.Key}}})
	spoofs := [][]string{
		{"X-Forwarded-For", "1.1.1.1"},
		{"X-Forwarded-For", "2.2.2.2, 10.0.0.1"},
		{"Forwarded", "for=3.3.3.3"},
		{"X-Real-IP", "4.4.4.4"},
	}
	for i, kv := range spoofs {
		resp := get(h, "198.51.100.7:5555", kv...)
		if want := i < 2; (resp.StatusCode == 200) != want {
			t.Errorf("untrusted client, %q: %d; want 200 %v", kv, resp.StatusCode, want)
		}
	}
	// Behind the trusted proxy: the key is 203.0.113.5 whatever it sent.
	for i, xff := range []string{"203.0.113.5", "1.1.1.1, 203.0.113.5", "garbage, 203.0.113.5", "10.9.9.9, 203.0.113.5"} {
		resp := get(h, "10.0.0.1:80", "X-Forwarded-For", xff)
		if want := i < 2; (resp.StatusCode == 200) != want {
			t.Errorf("behind proxy, X-Forwarded-For %q: %d; want 200 %v", xff, resp.StatusCode, want)
		}
	}
}

// TestRedisOutage: with the Redis server paused, the service keeps
// answering 200 or 429, never a 5xx, and marks every decision degraded;
// after it resumes, decisions go back to Redis.
func TestRedisOutage(t *testing.T) {
	srv := redistest.Start(t)
	c := redis.NewClient(&redis.Options{Addr: srv.Addr()}) // default options on purpose
	t.Cleanup(func() { c.Close() })
	lim := limiterOn(t, hybridlimit.Config{Redis: c, Limit: hybridlimit.Limit{Rate: 2, Burst: 8}, Instances: 2,
		Timeout: 20 * time.Millisecond, Breaker: hybridlimit.BreakerConfig{OpenFor: 200 * time.Millisecond}})
	h, _ := newHandler(t, Config{Rules: []Rule{{Name: "ip", Limiter: lim, Key: perIP}}})
	// The first contact (dialing, loading the scripts) runs in the
	// background from New; a request that meets it on a busy machine may
	// miss its 20 ms and be decided locally. Wait for it on another key.
	for warm := time.Now(); strings.Contains(get(h, "192.0.2.250:1").Header.Get(HeaderRateLimit), ParamDegraded); {
		if time.Since(warm) > 5*time.Second {
			t.Fatal("Redis's decisions still degraded 5 s after New")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if resp := get(h, "192.0.2.1:1"); resp.StatusCode != 200 || strings.Contains(resp.Header.Get(HeaderRateLimit), ParamDegraded) {
		t.Fatalf("before the pause: %d %v; want 200, not degraded", resp.StatusCode, resp.Header)
	}

	srv.Pause(t)
	paused := true
	defer func() {
		if paused {
			srv.Resume(t)
		}
	}()
	codes := map[int]int{}
	for i := range 30 {
		resp := get(h, "192.0.2."+strconv.Itoa(1+i%3)+":1")
		codes[resp.StatusCode]++
		pol, ml := checkFields(t, resp.Header.Values(HeaderPolicy), resp.Header.Values(HeaderRateLimit))
		if pol[0].params[ParamDegraded] != true || ml[0].params[ParamDegraded] != true {
			t.Errorf("request %d while paused: %v; want %s on both fields", i, resp.Header, ParamDegraded)
		}
		if resp.StatusCode == 429 {
			ra, _ := strconv.ParseInt(resp.Header.Get("Retry-After"), 10, 64)
			if tt, _ := ml[0].int("t"); ra < 1 || ra < tt {
				t.Errorf("429 while paused with Retry-After %d, t %d; want >= max(1, t)", ra, tt)
			}
		}
	}
	t.Logf("while paused: %v", codes)
	if len(codes) != 2 || codes[200] == 0 || codes[429] == 0 {
		t.Errorf("status codes while paused %v; want 200s and 429s only", codes)
	}

	srv.Resume(t)
	paused = false
	// The breaker probes after OpenFor; go-redis may fail fast for a
	// second after its connection failed.
	deadline := time.Now().Add(5 * time.Second)
	for {
		resp := get(h, "192.0.2.200:1")
		if resp.StatusCode >= 500 {
			t.Fatalf("after resume: %d", resp.StatusCode)
		}
		if !strings.Contains(resp.Header.Get(HeaderRateLimit), ParamDegraded) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("still degraded 5 s after resume: %v", resp.Header)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// hungRedis returns the address of a server that accepts connections and
// reads them but never answers, a Redis that hangs, and a func that closes
// it and its connections.
func hungRedis(t *testing.T) (string, func()) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	conns := make(chan net.Conn, 100)
	stop := func() {
		ln.Close()
		for {
			select {
			case c := <-conns:
				c.Close()
			default:
				return
			}
		}
	}
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			select {
			case conns <- c:
			default:
			}
			go func() {
				defer c.Close()
				buf := make([]byte, 4096)
				for {
					if _, err := c.Read(buf); err != nil {
						return
					}
				}
			}()
		}
	}()
	return ln.Addr().String(), stop
}

// TestDecisionWithinRequestDeadline: a request whose context has a
// deadline (http.TimeoutHandler, a gateway's per-request budget) shorter
// than the limiter's Timeout gets the failure policy's decision within its
// deadline when Redis hangs, as AllowN promises a caller with a short
// deadline, instead of waiting the whole Timeout after its deadline passed.
func TestDecisionWithinRequestDeadline(t *testing.T) {
	addr, stop := hungRedis(t)
	c := redis.NewClient(&redis.Options{Addr: addr})
	t.Cleanup(func() { c.Close() })
	lim := limiterOn(t, hybridlimit.Config{Redis: c, Limit: hybridlimit.PerSecond(100), Timeout: time.Second})
	t.Cleanup(stop) // before the Limiter's Close, which waits for the calls sent
	h, served := newHandler(t, Config{Rules: []Rule{{Name: "ip", Limiter: lim, Key: perIP}}})

	const deadline = 100 * time.Millisecond
	ctx, cancel := context.WithTimeout(context.Background(), deadline)
	defer cancel()
	r := httptest.NewRequest(http.MethodGet, "/", nil).WithContext(ctx)
	r.RemoteAddr = "192.0.2.1:1"
	w := httptest.NewRecorder()
	start := time.Now()
	h.ServeHTTP(w, r)
	took := time.Since(start)
	resp := w.Result()
	if took > deadline+200*time.Millisecond {
		t.Errorf("the middleware took %v for a request with a %v deadline; want the decision within the deadline", took, deadline)
	}
	if resp.StatusCode != 200 || served.Load() != 1 || !strings.Contains(resp.Header.Get(HeaderRateLimit), ParamDegraded) {
		t.Errorf("response %d %v, served %d; want 200, served, decided locally", resp.StatusCode, resp.Header, served.Load())
	}
}

// TestExpiredDeadline: a request whose deadline passed before its rules
// decided is answered 503 by the default ErrorHandler, not 500, and not
// served.
func TestExpiredDeadline(t *testing.T) {
	lim := newLimiter(t, hybridlimit.Config{Limit: hybridlimit.PerSecond(5)})
	h, served := newHandler(t, Config{Rules: []Rule{{Name: "ip", Limiter: lim, Key: perIP}}})
	ctx, cancel := context.WithDeadline(context.Background(), time.Now().Add(-time.Second))
	defer cancel()
	r := httptest.NewRequest(http.MethodGet, "/", nil).WithContext(ctx)
	r.RemoteAddr = "192.0.2.1:1"
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	if w.Code != http.StatusServiceUnavailable || served.Load() != 0 {
		t.Errorf("expired deadline: %d, served %d; want 503, not served", w.Code, served.Load())
	}
}

// TestFromContextNilPointer: an authentication middleware that stores a
// nil *User for anonymous requests (a typed nil in the context) must skip
// the per-user rule, as a missing value does, not panic.
func TestFromContextNilPointer(t *testing.T) {
	lim := newLimiter(t, hybridlimit.Config{Limit: hybridlimit.PerSecond(5)})
	h, served := newHandler(t, Config{Rules: []Rule{{Name: "user", Limiter: lim, Key: FromContext(userKey{})}}})
	var anon *nilableUser // auth found no user
	r := httptest.NewRequest(http.MethodGet, "/", nil)
	r = r.WithContext(context.WithValue(r.Context(), userKey{}, anon))
	r.RemoteAddr = "192.0.2.1:1"
	w := httptest.NewRecorder()
	func() {
		defer func() {
			if p := recover(); p != nil {
				t.Errorf("anonymous request (typed nil user in the context): middleware panicked: %v", p)
			}
		}()
		h.ServeHTTP(w, r)
	}()
	if served.Load() != 1 {
		t.Errorf("served %d; want 1 (rule skipped for an anonymous request)", served.Load())
	}
}

type nilableUser struct{ id string }

func (u *nilableUser) String() string { return u.id }

// TestClientGoneInKeyFunc: a KeyFunc that looks the key up with the
// request's context (an API-key or session store) fails with
// context.Canceled when the client hangs up. That is the client's doing,
// not a server bug: it must not be answered 500 nor logged at Error.
func TestClientGoneInKeyFunc(t *testing.T) {
	lim := newLimiter(t, hybridlimit.Config{Limit: hybridlimit.PerSecond(5)})
	var logs bytes.Buffer
	lookup := func(r *http.Request) (string, error) {
		<-r.Context().Done() // the store call returns when the client hangs up
		return "", r.Context().Err()
	}
	h, served := newHandler(t, Config{Rules: []Rule{{Name: "tenant", Limiter: lim, Key: lookup}},
		Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	ctx, cancel := context.WithCancel(context.Background())
	cancel() // the client went away
	r := httptest.NewRequest(http.MethodGet, "/", nil).WithContext(ctx)
	r.RemoteAddr = "192.0.2.1:1"
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	if w.Code == http.StatusInternalServerError || strings.Contains(logs.String(), "level=ERROR") {
		t.Errorf("client hung up during its KeyFunc: status %d, log %q; want no 500 and no Error log",
			w.Code, logs.String())
	}
	if served.Load() != 0 {
		t.Errorf("served %d", served.Load())
	}
}

// TestShadowRuleAfterADenial: a new policy in shadow mode beside an
// enforced one (the rollout the Shadow docs describe). When the enforced
// rule denies, it comes first in RateLimit and the legacy fields describe
// it, not the shadow rule with its longer t (a client that honours them
// would wait for a limit that is not on).
func TestShadowRuleAfterADenial(t *testing.T) {
	shadow := newLimiter(t, hybridlimit.Config{Limit: hybridlimit.Limit{Rate: 0.1, Burst: 1}, Shadow: true})
	enforced := newLimiter(t, hybridlimit.Config{Limit: hybridlimit.Limit{Rate: 1, Burst: 1}})
	h, _ := newHandler(t, Config{LegacyHeaders: true, Rules: []Rule{
		{Name: "new", Limiter: shadow, Key: perIP},
		{Name: "enforced", Limiter: enforced, Key: perIP},
	}})
	get(h, "192.0.2.1:1")
	resp := get(h, "192.0.2.1:1")
	if resp.StatusCode != http.StatusTooManyRequests {
		t.Fatalf("second request: %d; want 429 from the enforced rule", resp.StatusCode)
	}
	_, ml := checkFields(t, resp.Header.Values(HeaderPolicy), resp.Header.Values(HeaderRateLimit))
	if ml[0].name != "enforced" {
		t.Errorf("429: RateLimit %q; want the denying rule \"enforced\" first", resp.Header.Values(HeaderRateLimit))
	}
	if reset, ra := resp.Header.Get("X-RateLimit-Reset"), resp.Header.Get("Retry-After"); reset != ra {
		t.Errorf("429: X-RateLimit-Reset %s, Retry-After %s; want the denying policy's reset", reset, ra)
	}
}

// TestLeaseFields: with Config.Lease, a decision spent from the lease
// reports what the client may still spend, the lease's tokens and the
// shared bucket's, and when that bucket is full again. Told only the
// lease, one client alone saw r go 94, then 4, 3, 2 (the shared bucket
// held 94 all along), with t=0 claiming a full bucket: a client pacing
// itself on r saw a 100-token limit as nearly spent.
func TestLeaseFields(t *testing.T) {
	lim := newLimiter(t, hybridlimit.Config{Limit: hybridlimit.PerSecond(100), Lease: 5})
	h, _ := newHandler(t, Config{Rules: []Rule{{Name: "ip", Limiter: lim, Key: perIP}}})
	prev := int64(-1)
	for i := range 4 {
		resp := get(h, "192.0.2.1:1")
		_, ml := checkFields(t, resp.Header.Values(HeaderPolicy), resp.Header.Values(HeaderRateLimit))
		r, _ := ml[0].int("r")
		tt, _ := ml[0].int("t")
		if prev >= 0 && r < prev-1 {
			t.Errorf("request %d: RateLimit %q: r fell from %d to %d for one token spent",
				i+1, resp.Header.Get(HeaderRateLimit), prev, r)
		}
		if r < 100 && tt == 0 {
			t.Errorf("request %d: RateLimit %q: r=%d of q=100 with t=0; want t > 0 when the bucket is not full",
				i+1, resp.Header.Get(HeaderRateLimit), r)
		}
		prev = r
	}
}
