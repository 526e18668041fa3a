package httplimit_test

import (
	"encoding/json"
	"fmt"
	"log"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/hybridlimit/hybridlimit"
	"github.com/hybridlimit/hybridlimit/httplimit"
)

type userKey struct{}

// A per-address rule for everyone and a per-user rule for signed-in users,
// in front of a whole ServeMux. It needs a Redis, so it is compiled but not
// run.
func ExampleMiddleware() {
	rdb := redis.NewClient(&redis.Options{Addr: "localhost:6379"})
	perIP, err := hybridlimit.New(hybridlimit.Config{Redis: rdb, Name: "ip", Limit: hybridlimit.PerSecond(20), Instances: 3})
	if err != nil {
		log.Fatal(err)
	}
	defer perIP.Close()
	perUser, err := hybridlimit.New(hybridlimit.Config{Redis: rdb, Name: "user", Limit: hybridlimit.PerMinute(600), Instances: 3})
	if err != nil {
		log.Fatal(err)
	}
	defer perUser.Close()

	ip := httplimit.ClientIP{
		TrustedProxies: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}, // the load balancers
		IPv6Prefix:     64,
	}
	mw, err := httplimit.New(httplimit.Config{Rules: []httplimit.Rule{
		{Name: "ip", Limiter: perIP, Key: ip.Key},
		// Set by an authentication middleware that runs first; anonymous
		// requests skip this rule.
		{Name: "user", Limiter: perUser, Key: httplimit.FromContext(userKey{})},
	}})
	if err != nil {
		log.Fatal(err)
	}

	mux := http.NewServeMux()
	mux.HandleFunc("GET /hello", func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintln(w, "hello")
	})
	// With chi or gorilla/mux: r.Use(mw.Handler).
	log.Fatal(http.ListenAndServe(":8080", mw.Handler(mux)))
}

// A DenyHandler that answers with the draft's quota-exceeded problem type.
func ExampleConfig_denyHandler() {
	rdb := redis.NewClient(&redis.Options{Addr: "localhost:6379"})
	lim, err := hybridlimit.New(hybridlimit.Config{Redis: rdb, Limit: hybridlimit.PerSecond(10)})
	if err != nil {
		log.Fatal(err)
	}
	defer lim.Close()
	mw, err := httplimit.New(httplimit.Config{
		Rules: []httplimit.Rule{{Name: "ip", Limiter: lim, Key: httplimit.ClientIP{}.Key}},
		DenyHandler: func(w http.ResponseWriter, r *http.Request, d httplimit.Denial) {
			// Retry-After and the RateLimit fields are set already.
			w.Header().Set("Content-Type", "application/problem+json")
			w.WriteHeader(http.StatusTooManyRequests)
			json.NewEncoder(w).Encode(map[string]any{
				"type":              "https://iana.org/assignments/http-problem-types#quota-exceeded",
				"title":             "Request cannot be satisfied as assigned quota has been exceeded",
				"violated-policies": []string{d.Rule},
			})
		},
	})
	if err != nil {
		log.Fatal(err)
	}
	http.Handle("/api/", mw.Handler(http.NotFoundHandler()))
}

// The keys of requests: the peer address, unless the peer is a trusted
// proxy; a spoofed X-Forwarded-For changes nothing.
func ExampleClientIP() {
	ip := httplimit.ClientIP{
		TrustedProxies: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")},
		IPv6Prefix:     64,
	}
	show := func(remote, xff string) {
		r := httptest.NewRequest("GET", "/", nil)
		r.RemoteAddr = remote
		if xff != "" {
			r.Header.Set("X-Forwarded-For", xff)
		}
		key, err := ip.Key(r)
		fmt.Printf("%-22s %-32q → %s %v\n", remote, xff, key, err)
	}
	show("198.51.100.7:5555", "")
	show("198.51.100.7:5555", "203.0.113.9")              // not from a proxy: ignored
	show("10.0.0.1:80", "6.6.6.6, 203.0.113.9")           // the client sent 6.6.6.6
	show("10.0.0.2:80", "203.0.113.9, 10.0.0.1")          // two proxies
	show("10.0.0.1:80", "garbage")                        // malformed: the peer
	show("[2001:db8:1:2::99]:443", "")                    // grouped by /64
	show("10.0.0.1:80", "2001:db8:1:2:aaaa:bbbb:cccc:dd") // grouped too
	// Output:
	// 198.51.100.7:5555      ""                               → 198.51.100.7 <nil>
	// 198.51.100.7:5555      "203.0.113.9"                    → 198.51.100.7 <nil>
	// 10.0.0.1:80            "6.6.6.6, 203.0.113.9"           → 203.0.113.9 <nil>
	// 10.0.0.2:80            "203.0.113.9, 10.0.0.1"          → 203.0.113.9 <nil>
	// 10.0.0.1:80            "garbage"                        → 10.0.0.1 <nil>
	// [2001:db8:1:2::99]:443 ""                               → 2001:db8:1:2::/64 <nil>
	// 10.0.0.1:80            "2001:db8:1:2:aaaa:bbbb:cccc:dd" → 2001:db8:1:2::/64 <nil>
}

// Keys from a header, hashed to keep API keys out of Redis.
func ExampleHashed() {
	key := httplimit.Hashed(httplimit.Header("X-API-Key"))
	r := httptest.NewRequest("GET", "/", nil)
	r.Header.Set("X-API-Key", "secret")
	k, _ := key(r)
	fmt.Println(k)
	anonymous, _ := key(httptest.NewRequest("GET", "/", nil))
	fmt.Printf("%q skips the rule\n", anonymous)
	// Output:
	// 2bb80d537b1da3e38bd30361aa855686
	// "" skips the rule
}

// The header fields of two rules' decisions, built outside a Middleware
// (for another protocol's metadata, say): the per-user rule denied, so the
// per-address tokens were refunded and its r shows them back.
func ExampleFields() {
	var f httplimit.Fields
	ip := f.Add("ip", hybridlimit.Decision{Allowed: true, Remaining: 19, ResetAfter: 50 * time.Millisecond,
		Limit: hybridlimit.PerSecond(20)})
	f.Add("user", hybridlimit.Decision{RetryAfter: 1500 * time.Millisecond, Mode: hybridlimit.ModeLocal,
		Limit: hybridlimit.PerMinute(600)})
	f.Refunded(ip, 1)
	policy, limit := f.Values()
	fmt.Println(httplimit.HeaderPolicy+":", policy)
	fmt.Println(httplimit.HeaderRateLimit+":", limit)
	// Output:
	// RateLimit-Policy: "user";q=600;w=60;hl-degraded, "ip";q=20;w=1
	// RateLimit: "user";r=0;t=2;hl-degraded, "ip";r=20;t=1
}
