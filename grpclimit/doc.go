// Package grpclimit is a pair of gRPC server interceptors that limit calls
// with hybridlimit: token buckets shared through Redis by every instance of
// a service, which keep limiting on each instance's share when Redis is
// away. It is httplimit for gRPC: the same rules, keys, refunds and
// RateLimit fields, in a module of its own so that importing hybridlimit
// never brings in gRPC.
//
// # Rules
//
// An Interceptor checks one or more rules on every call. A Rule has a
// Name, a hybridlimit.Limiter, a KeyFunc that picks the call's bucket and,
// optionally, the Methods it applies to:
//
//	perIP, _ := hybridlimit.New(hybridlimit.Config{Redis: rdb, Name: "ip", Limit: hybridlimit.PerSecond(20)})
//	perUser, _ := hybridlimit.New(hybridlimit.Config{Redis: rdb, Name: "user", Limit: hybridlimit.PerMinute(600)})
//	ip := grpclimit.ClientIP{TrustedProxies: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}}
//	ic, err := grpclimit.New(grpclimit.Config{Rules: []grpclimit.Rule{
//		{Name: "ip", Limiter: perIP, Key: ip.Key},
//		{Name: "user", Limiter: perUser, Key: grpclimit.FromContext(userKey{})},
//	}})
//	srv := grpc.NewServer(
//		grpc.ChainUnaryInterceptor(auth, ic.Unary),
//		grpc.ChainStreamInterceptor(authStream, ic.Stream),
//	)
//
// A unary call takes its rules' Cost once; so does a stream, when it opens
// (its messages are not limited). The limiter sees the key Name + ":" +
// key, as with httplimit (httplimit.RuleKey: hashed when too long, holding
// '{' or starting "sha256:"), so rules may share a Limiter without sharing
// buckets, and a gRPC rule and an httplimit rule with the same Name and
// Limiter share theirs: a user's HTTP and gRPC calls can draw on one limit.
//
// # Keys
//
// A KeyFunc is any func(ctx context.Context, fullMethod string) (string,
// error). These build the common ones:
//
//   - ClientIP.Key: the client's IP address (see below), or its IPv6 /64
//     network with IPv6Prefix: 64;
//   - Metadata: an incoming metadata value, such as an API key or a tenant;
//   - FromContext: a value that an authentication interceptor put in the
//     call's context, such as the user's ID;
//   - Identity: the authenticated identity, as a func of yours finds it in
//     the context (a token's subject, a client certificate);
//   - FullMethod: the method itself, one bucket per method for everyone;
//   - Hashed: the SHA-256 of another KeyFunc's key, to keep secrets out of
//     Redis.
//
// A KeyFunc that returns "" skips its rule for the call: a per-user rule
// does not apply to anonymous calls, say, which a per-IP rule limits.
//
// # Client addresses behind proxies
//
// ClientIP takes the client's address from the peer of the connection,
// which the client cannot forge. Only when the peer is in
// ClientIP.TrustedProxies does it read the forwarding metadata that those
// proxies set: x-forwarded-for (the default), forwarded (RFC 7239), or a
// one-address key such as x-real-ip. It reads them with httplimit.ClientIP,
// from the right, skipping trusted proxies, and takes the first untrusted
// address: what a client puts in its own x-forwarded-for is never read.
// A peer that is not an IP address (a Unix socket, bufconn) makes the key
// an error wrapping ErrNoClientIP.
//
// # Several rules, and refunds
//
// The rules that apply to the method are checked in order, one round trip
// to Redis each, and a call passes only if every one allows it. The first
// denial stops the checking, and the tokens that the rules before it took
// are given back with hybridlimit.Limiter.Refund (best-effort, as
// httplimit explains). Rules that should be given back together belong in
// one Interceptor: two chained ones decide on their own, and one that
// refuses a call does not give back what the one before it took.
//
// # Denials
//
// A denied call ends with codes.ResourceExhausted, the message "too many
// requests" and two details: a google.rpc.RetryInfo whose RetryDelay is
// the limiter's RetryAfter rounded up to a millisecond, and a
// google.rpc.QuotaFailure naming the rule. The status never holds keys,
// Redis errors or script text. Config.DenyHandler returns a status of your
// own from a Denial.
//
// # Errors
//
// hybridlimit never reports a Redis failure as an error: while Redis is
// down its failure policy decides, and calls are served or denied, never
// failed for Redis's sake. What remains are bugs and shutdown: a KeyFunc's
// error, a bad limit from Config.LimitFor, a Cost above a key's burst, a
// closed Limiter. Such an error is logged (Config.Logger), the tokens
// already taken are refunded, and Config.ErrorHandler returns the call's
// status; the default is codes.Unavailable for a closed Limiter (the
// server is shutting down; the client may try another, logged at Debug)
// or a KeyFunc's own time-out (an auth service's, while the call lives:
// transient), and codes.Internal for the rest; no status message says
// anything of the error. With Config.PassOnError, the failing rule is
// skipped instead and the call served.
//
// The call's own context bounds each decision, unlike httplimit's: gRPC
// clients send deadlines, and a call whose deadline passes or that the
// client cancels before the limiter has decided gets no decision
// (hybridlimit.Limiter.AllowN returns the context's error), is not served
// or logged, and ends with its context's status, codes.DeadlineExceeded or
// codes.Canceled. The tokens of its earlier rules are refunded.
//
// # Response metadata
//
// Every call that a rule decided, served or denied, gets the RateLimit
// fields of httplimit in its response header metadata, under the
// lowercase keys ratelimit-policy and ratelimit, one member per rule that
// decided, the most restrictive first:
//
//	ratelimit-policy: "ip";q=20;w=1, "user";q=600;w=60
//	ratelimit: "ip";r=19;t=1, "user";r=599;t=1
//
// The values are built by httplimit.Fields and mean what httplimit's
// documentation says: q the burst, w the seconds to refill from empty, r
// the tokens remaining, t the seconds until full or, on a denial, until
// the call could pass. While Redis is away, the members of a rule decided
// without it (hybridlimit.Mode.Degraded) carry the boolean parameter
// hl-degraded:
//
//	ratelimit: "ip";r=9;t=1;hl-degraded
//
// Read them with grpc.Header on a unary call, or ClientStream.Header on a
// stream. A call that a rule in shadow mode (hybridlimit.Config.Shadow)
// would have denied is served with x-ratelimit-shadow: deny.
//
// # go-grpc-middleware
//
// Interceptor implements the Limiter interface of the ratelimit
// interceptors of github.com/grpc-ecosystem/go-grpc-middleware/v2 with its
// Limit method, so a service that uses them already can pass it to
// ratelimit.UnaryServerInterceptor and ratelimit.StreamServerInterceptor.
// Those answer every error with codes.ResourceExhausted and the error's
// text, without details: see Limit.
package grpclimit
