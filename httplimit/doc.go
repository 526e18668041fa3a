// Package httplimit is net/http middleware that limits requests with
// hybridlimit: token buckets shared through Redis by every instance of a
// service, which keep limiting on each instance's share when Redis is away.
//
// # Rules
//
// A Middleware checks one or more rules on every request. A Rule has a
// Name, a hybridlimit.Limiter, and a KeyFunc that picks the request's
// bucket:
//
//	perIP, _ := hybridlimit.New(hybridlimit.Config{Redis: rdb, Limit: hybridlimit.PerSecond(20)})
//	perUser, _ := hybridlimit.New(hybridlimit.Config{Redis: rdb, Limit: hybridlimit.PerMinute(600)})
//	ip := httplimit.ClientIP{TrustedProxies: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}}
//	mw, err := httplimit.New(httplimit.Config{Rules: []httplimit.Rule{
//		{Name: "ip", Limiter: perIP, Key: ip.Key},
//		{Name: "user", Limiter: perUser, Key: httplimit.FromContext(userKey{})},
//	}})
//
// The method value mw.Handler is a func(http.Handler) http.Handler: wrap a
// whole http.ServeMux with it, pass it to chi's or gorilla/mux's Use, or
// wrap one route with mw.Handler(h) or mw.HandlerFunc(f). Each Middleware
// has its own rules, so routes may have different ones; nested
// middlewares add their rules to the same header fields.
//
// The limiter sees the key Name + ":" + key, so rules may share a Limiter
// without sharing buckets, and a hybridlimit.Config.LimitFor can tell the
// rules apart by the prefix. A key that would be longer than
// hybridlimit.MaxKeyLen, or that holds a '{' (a hash tag would let a
// client pick its bucket's Redis Cluster shard) or starts "sha256:", is
// replaced by its SHA-256 (see RuleKey).
//
// # Keys
//
// A KeyFunc is any func(*http.Request) (string, error). These build the
// common ones:
//
//   - ClientIP.Key: the client's IP address (see below), or its IPv6 /64
//     network with IPv6Prefix: 64;
//   - Header: a request header, such as an API key or a tenant;
//   - FromContext: a value that an authentication middleware put in the
//     request's context, such as the user's ID;
//   - Hashed: the SHA-256 of another KeyFunc's key, to keep secrets out of
//     Redis.
//
// A KeyFunc that returns "" skips its rule for the request: a per-user rule
// does not apply to anonymous requests, say, which a per-IP rule limits.
//
// # Client addresses behind proxies
//
// ClientIP takes the client's address from http.Request.RemoteAddr, the
// peer of the connection, which the client cannot forge. Only when the
// peer is in ClientIP.TrustedProxies does it read the forwarding header
// that those proxies set: X-Forwarded-For (the default), Forwarded (RFC
// 7239), or a one-address header such as X-Real-IP. It reads the header
// from the right, skipping trusted proxies, and takes the first untrusted
// address. Whatever a client puts in its own X-Forwarded-For or Forwarded
// lies to the left of what the trusted proxies appended and is never read:
//
//	RemoteAddr 10.0.0.2 (trusted), X-Forwarded-For: 6.6.6.6, 203.0.113.7, 10.0.0.1
//	→ 203.0.113.7; 6.6.6.6 is what the client sent
//
// A malformed entry where the client's address should be, "unknown", or
// an obfuscated Forwarded identifier make the peer address the key.
//
// # Several rules, and refunds
//
// The rules are checked in order, one round trip to Redis each, and a
// request passes only if every rule allows it. The first denial stops the
// checking, and the tokens that the rules before it took are given back
// with hybridlimit.Limiter.Refund. The refund is not atomic with the
// grant: between the two, other requests saw those tokens taken and may
// have been denied for it; and a refund that Redis does not answer within
// the limiter's Config.Timeout is lost. Put the rule most likely to deny
// first. Rules that should be given back together belong in one
// Middleware: nested Middlewares decide on their own, and one that refuses
// a request does not give back what the ones around it took for it.
//
// # Denials
//
// A denied request gets 429 Too Many Requests, a Retry-After header in
// whole seconds (the limiter's RetryAfter rounded up, at least 1, never
// earlier than the denying policy's t), the header fields below, and the
// body "too many requests". The body never holds keys, Redis errors or
// script text. Config.DenyHandler writes a response of your own (an
// application/problem+json "quota-exceeded" document, say) from a Denial.
//
// # Errors
//
// hybridlimit never reports a Redis failure as an error: while Redis is
// down its failure policy decides, and requests get 200 or 429, never a
// 5xx for Redis's sake. What remains are bugs and shutdown: a KeyFunc's
// error, a bad limit from Config.LimitFor, a Cost above a key's burst, a
// closed Limiter. Such an error is logged (Config.Logger), the tokens
// already taken are refunded, and Config.ErrorHandler answers; the
// default answers 503 Service Unavailable for a closed Limiter (the server
// is shutting down; the client may try another, logged at Debug) or a
// KeyFunc's time-out, and 500 Internal Server Error for the rest, with a
// generic body. A KeyFunc that looks the key up under the request's
// context fails when the client hangs up: that is logged at Debug, and
// the default answers StatusClientClosedRequest (499, nginx's), which
// nobody reads but access logs, where it is not a server error. With Config.PassOnError, the
// failing rule is skipped instead and the request served. A decision does
// not end with the request's cancellation: the limiter bounds it by its
// Config.Timeout, and a client that hangs up has spent its tokens all the
// same. A deadline of the request's context (http.TimeoutHandler's, say)
// does bound it: a Redis slower than what is left of it leaves the
// decision to the failure policy within the deadline, and a request whose
// deadline has passed before its rules decided gets the ErrorHandler's
// answer (the default's is 503), logged at Debug only.
//
// # Header fields
//
// Every response to a request that a rule decided carries the RateLimit
// header fields of draft-ietf-httpapi-ratelimit-headers-10, Lists of
// structured fields (RFC 9651) with one member per rule that decided, the
// most restrictive first (a denial, then a shadow rule's, then the fewest remaining):
//
//	RateLimit-Policy: "ip";q=20;w=1, "user";q=600;w=60
//	RateLimit: "ip";r=19;t=1, "user";r=599;t=1
//
// In RateLimit-Policy, the member is the rule's Name as an sf-string, q is
// the key's Limit.Burst, and w the whole seconds in which the bucket
// refills from empty: Burst/Rate rounded up, at least 1. In RateLimit, r
// is the tokens remaining, and t is the seconds until the bucket is full
// again or, on a denial, until the request could pass, rounded up. A rule
// whose tokens were refunded reports them in r; its t stays that of the
// grant, an upper bound.
//
// While Redis is away, both members of a rule decided without it
// (hybridlimit.Mode.Degraded) carry the boolean parameter hl-degraded,
// which clients and operators can see on the response:
//
//	RateLimit-Policy: "ip";q=20;w=1;hl-degraded
//	RateLimit: "ip";r=9;t=1;hl-degraded
//
// Then q is still the shared limit, while r counts this instance's share
// of it (hybridlimit.FailLocal), or is 0, unknown, under
// hybridlimit.FailOpen and hybridlimit.FailClosed.
//
// Fields builds the same two values from decisions made elsewhere, and
// RuleKey and ValidName key and name rules as here, so that other
// protocols (the grpclimit module for gRPC) report and share limits the
// same way.
//
// With Config.LegacyHeaders, X-RateLimit-Limit, X-RateLimit-Remaining and
// X-RateLimit-Reset repeat q, r and t of the first member. Reset is in
// seconds from now, like t, not a Unix time.
//
// # Shadow mode
//
// A rule whose Limiter has hybridlimit.Config.Shadow set never denies: a
// request it would have denied is served with the header fields that the
// denial would have had, and X-RateLimit-Shadow: deny, but no Retry-After.
// Watch for that header, or the limiter's Observer, before turning the
// limit on.
package httplimit
