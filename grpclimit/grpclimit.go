package grpclimit

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/hybridlimit/hybridlimit"
	"github.com/hybridlimit/hybridlimit/httplimit"
	"github.com/hybridlimit/hybridlimit/internal/ctxend"
)

// Errors of this package. Test for them with errors.Is.
var (
	// ErrInvalidConfig is wrapped by every error New returns, and by the
	// error of a ClientIP whose IPv6Prefix is out of range.
	ErrInvalidConfig = errors.New("grpclimit: invalid config")
	// ErrNoClientIP is returned by ClientIP when the call has no peer, or
	// its peer address is not an IP address (a Unix socket, bufconn).
	ErrNoClientIP = errors.New("grpclimit: peer address holds no IP address")
	// ErrLimited is wrapped by the error that Limit returns for a denied
	// call.
	ErrLimited = errors.New("grpclimit: too many requests")
)

// The response header metadata keys that the interceptors set. gRPC
// metadata keys are lowercase; the values are those of httplimit's
// RateLimit-Policy, RateLimit and X-RateLimit-Shadow header fields.
const (
	// MetadataPolicy is the RateLimit-Policy field: one member per rule,
	// "name";q=burst;w=window.
	MetadataPolicy = "ratelimit-policy"
	// MetadataRateLimit is the RateLimit field: one member per rule,
	// "name";r=remaining;t=seconds.
	MetadataRateLimit = "ratelimit"
	// MetadataShadow is set to "deny" on a call that a rule in shadow
	// mode (hybridlimit.Config.Shadow) would have denied.
	MetadataShadow = "x-ratelimit-shadow"
)

// Rule is one limit on calls: the calls with the same key share one token
// bucket of Limiter.
type Rule struct {
	// Name names the rule's policy in the RateLimit fields and prefixes
	// its keys: the limiter sees httplimit.RuleKey(Name, key), as with
	// httplimit (Name + ":" + key, hashed when too long, holding '{' or
	// starting "sha256:"), so a gRPC rule and an httplimit rule with the
	// same Name and Limiter share their buckets. Printable ASCII without
	// ':', unique within a Config. Required.
	Name string
	// Limiter decides. Required.
	Limiter *hybridlimit.Limiter
	// Key returns the key of a call; an empty key skips the rule for that
	// call. Required.
	Key KeyFunc
	// Cost is how many tokens a call takes, at most the limit's Burst. A
	// stream takes them once, when it opens. Zero means 1.
	Cost int64
	// Methods restricts the rule to some methods: full method names such
	// as "/pkg.Service/Method", or "/pkg.Service/" for every method of a
	// service. Empty means every method.
	Methods []string
}

// Denial describes a denied call to Config.DenyHandler.
type Denial struct {
	// Rule is the Name of the rule that denied the call.
	Rule string
	// Method is the call's full method name, "/pkg.Service/Method".
	Method string
	// Key is what the rule's KeyFunc returned. It may identify the client
	// (an address, an API key): keep it out of responses.
	Key string
	// Decision is the limiter's decision. Decision.Mode says who decided;
	// Decision.RetryAfter how long until the call could pass.
	Decision hybridlimit.Decision
	// RetryAfter is the delay for the client: Decision.RetryAfter rounded
	// up to a whole millisecond, at least one millisecond.
	RetryAfter time.Duration
}

// Config configures an Interceptor. Only Rules is required.
type Config struct {
	// Rules are checked in order on every call, which passes only if
	// every rule that applies allows it. Put the rule most likely to deny
	// first: a denial stops the checking, and the tokens taken by the
	// rules before it are refunded. Required: at least one.
	Rules []Rule
	// DenyHandler returns the error that a denied call ends with. The
	// RateLimit fields are set in the response header metadata before it
	// is called. Nil means DefaultDenyHandler, and so does a nil error
	// from it: a denied call is never served.
	DenyHandler func(ctx context.Context, d Denial) error
	// ErrorHandler returns the error that a call ends with when a rule
	// could not decide it: its KeyFunc returned an error, or its Limiter
	// did (a limit that Config.LimitFor got wrong, a Cost above the key's
	// burst, a closed Limiter). These are bugs or shutdown, never Redis
	// failures; err is logged already. Nil means DefaultErrorHandler, and
	// so does a nil error from it.
	ErrorHandler func(ctx context.Context, method string, err error) error
	// PassOnError skips a rule that cannot decide, as if its key were "",
	// instead of calling ErrorHandler: the call is served without that
	// rule. The error is logged all the same.
	PassOnError bool
	// Logger receives the errors of rules that could not decide, at
	// level Error. Nil means slog.Default().
	Logger *slog.Logger
}

// Interceptor limits the calls of a gRPC server. Create it with New, and
// install its Unary and Stream methods as interceptors, or pass it to the
// ratelimit interceptors of go-grpc-middleware, whose Limiter interface it
// implements. Interceptor is safe for concurrent use by multiple
// goroutines.
type Interceptor struct {
	rules []rule
	deny  func(context.Context, Denial) error
	fail  func(context.Context, string, error) error
	pass  bool
	log   *slog.Logger
}

// rule is a Rule with its Methods ready to match.
type rule struct {
	Rule
	methods  map[string]bool // full method names; nil with services: every method
	services []string        // "/pkg.Service/" prefixes
}

// applies reports whether r limits the method.
func (r *rule) applies(method string) bool {
	if r.methods == nil && r.services == nil {
		return true
	}
	if r.methods[method] {
		return true
	}
	for _, s := range r.services {
		if strings.HasPrefix(method, s) {
			return true
		}
	}
	return false
}

// New returns an Interceptor for cfg, or an error wrapping
// ErrInvalidConfig that names the offending rule and field.
func New(cfg Config) (*Interceptor, error) {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: "+format, append([]any{ErrInvalidConfig}, args...)...)
	}
	if len(cfg.Rules) == 0 {
		return nil, bad("no Rules")
	}
	ic := &Interceptor{
		rules: make([]rule, len(cfg.Rules)),
		deny:  cfg.DenyHandler,
		fail:  cfg.ErrorHandler,
		pass:  cfg.PassOnError,
		log:   cfg.Logger,
	}
	seen := make(map[string]bool, len(cfg.Rules))
	for i, r := range cfg.Rules {
		if !httplimit.ValidName(r.Name) {
			return nil, bad("Rules[%d].Name %q: want printable ASCII without ':', not empty", i, r.Name)
		}
		if seen[r.Name] {
			return nil, bad("Rules[%d].Name %q used twice", i, r.Name)
		}
		seen[r.Name] = true
		switch {
		case r.Limiter == nil:
			return nil, bad("rule %q: Limiter is nil", r.Name)
		case r.Key == nil:
			return nil, bad("rule %q: Key is nil", r.Name)
		case r.Cost < 0:
			return nil, bad("rule %q: Cost must not be negative, got %d", r.Name, r.Cost)
		}
		if r.Cost == 0 {
			r.Cost = 1
		}
		if b := r.Limiter.Limit().Burst; r.Cost > b {
			return nil, bad("rule %q: Cost %d exceeds the limit's burst %d", r.Name, r.Cost, b)
		}
		rr := rule{Rule: r}
		rr.Methods = append([]string(nil), r.Methods...) // the caller's slice may change
		for _, m := range r.Methods {
			if !validMethod(m) {
				return nil, bad("rule %q: Methods entry %q: want \"/pkg.Service/Method\" or \"/pkg.Service/\"", r.Name, m)
			}
			if strings.HasSuffix(m, "/") {
				rr.services = append(rr.services, m)
				continue
			}
			if rr.methods == nil {
				rr.methods = make(map[string]bool)
			}
			rr.methods[m] = true
		}
		ic.rules[i] = rr
	}
	if ic.deny == nil {
		ic.deny = DefaultDenyHandler
	}
	if ic.fail == nil {
		ic.fail = DefaultErrorHandler
	}
	if ic.log == nil {
		ic.log = slog.Default()
	}
	return ic, nil
}

// validMethod reports whether m is "/service/method" or "/service/", with
// a service name that is not empty.
func validMethod(m string) bool {
	rest, ok := strings.CutPrefix(m, "/")
	if !ok {
		return false
	}
	svc, method, ok := strings.Cut(rest, "/")
	return ok && svc != "" && !strings.Contains(method, "/")
}

// Unary is a grpc.UnaryServerInterceptor: it serves the call with handler
// if every rule allows it. Install it with
// grpc.ChainUnaryInterceptor(ic.Unary), after the interceptors that
// authenticate the call if a rule keys by the identity.
func (ic *Interceptor) Unary(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	md, err := ic.check(ctx, info.FullMethod)
	if md != nil {
		// SetHeader fails only outside a server or after the header is
		// sent, which an interceptor that runs first never sees; the
		// fields are informative, so the call goes on without them.
		_ = grpc.SetHeader(ctx, md)
	}
	if err != nil {
		return nil, callErr(err)
	}
	return handler(ctx, req)
}

// Stream is a grpc.StreamServerInterceptor: it serves the stream with
// handler if every rule allows it. A stream takes its rules' tokens once,
// when it opens; its messages are not limited. Install it with
// grpc.ChainStreamInterceptor(ic.Stream).
func (ic *Interceptor) Stream(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	md, err := ic.check(ss.Context(), info.FullMethod)
	if md != nil {
		_ = ss.SetHeader(md) // as in Unary
	}
	if err != nil {
		return callErr(err)
	}
	return handler(srv, ss)
}

// Limit implements the Limiter interface of the ratelimit interceptors of
// github.com/grpc-ecosystem/go-grpc-middleware/v2, for servers that use
// them already:
//
//	grpc.ChainUnaryInterceptor(ratelimit.UnaryServerInterceptor(ic))
//
// It checks the rules as Unary does, with the method that grpc.Method
// finds in ctx, and sets the same response header metadata. Those
// interceptors answer every error with codes.ResourceExhausted and its
// text, so a denial loses its RetryInfo detail (the error says the delay
// and wraps ErrLimited) and a rule that cannot decide is reported as
// ResourceExhausted too: use Unary and Stream where that matters. On the
// client side, where ctx holds no method or incoming metadata, keys from
// those are empty and their rules skipped; it holds no peer either, and a
// ClientIP rule, which on a server must not skip a call whose peer it
// cannot read, fails every call there with ErrNoClientIP: key a client's
// rules by something else.
func (ic *Interceptor) Limit(ctx context.Context) error {
	method, _ := grpc.Method(ctx)
	md, err := ic.check(ctx, method)
	if md != nil {
		_ = grpc.SetHeader(ctx, md) // as in Unary
	}
	var d *denied
	if errors.As(err, &d) {
		return fmt.Errorf("%w: rule %q: retry after %v", ErrLimited, d.Rule, d.RetryAfter)
	}
	return err
}

// DefaultDenyHandler returns codes.ResourceExhausted with the message "too
// many requests" and two details: a google.rpc.RetryInfo whose RetryDelay
// is d.RetryAfter, and a google.rpc.QuotaFailure that names the rule (not
// the key) as the violation's subject.
func DefaultDenyHandler(ctx context.Context, d Denial) error {
	st := status.New(codes.ResourceExhausted, "too many requests")
	ds, err := st.WithDetails(
		&errdetails.RetryInfo{RetryDelay: durationpb.New(d.RetryAfter)},
		&errdetails.QuotaFailure{Violations: []*errdetails.QuotaFailure_Violation{{
			Subject:     "rule:" + d.Rule,
			Description: "rate limit exceeded",
		}}},
	)
	if err != nil {
		return st.Err()
	}
	return ds.Err()
}

// DefaultErrorHandler returns codes.Unavailable for a closed Limiter
// (hybridlimit.ErrClosed: the server is shutting down, and the client may
// try another) or a time-out while the call lives (a KeyFunc's own, such
// as an auth service's: transient), and codes.Internal for every other
// error, which is a bug on the server's side; no message says anything of
// err.
func DefaultErrorHandler(ctx context.Context, method string, err error) error {
	if errors.Is(err, hybridlimit.ErrClosed) || errors.Is(err, context.DeadlineExceeded) {
		return status.Error(codes.Unavailable, "rate limiter unavailable")
	}
	return status.Error(codes.Internal, "internal error")
}

// grant is a rule that took tokens for the call in hand.
type grant struct {
	rule *rule
	key  string // the key the limiter saw
	d    hybridlimit.Decision
	item int // index in the Fields
}

// denied is the error of check for a denied call: the status error that
// DenyHandler returned, and the Denial for Limit.
type denied struct {
	Denial
	err error
}

func (d *denied) Error() string { return d.err.Error() }

// callErr returns the error a call ends with for check's err: a denial's
// is DenyHandler's, unwrapped so that gRPC sees its status as it is.
func callErr(err error) error {
	if d, ok := err.(*denied); ok {
		return d.err
	}
	return err
}

// check checks the rules on a call of method, and returns the response
// header metadata to set (nil if no rule decided) and the error that the
// call must end with: nil if it may be served, a *denied if a rule denied
// it.
func (ic *Interceptor) check(ctx context.Context, method string) (metadata.MD, error) {
	var (
		fields    httplimit.Fields
		grantsBuf [4]grant
		grants    = grantsBuf[:0]
		shadow    bool
	)
	for i := range ic.rules {
		r := &ic.rules[i]
		if !r.applies(method) {
			continue
		}
		key, err := r.Key(ctx, method)
		if err != nil {
			if err := ic.failed(ctx, method, grants, fmt.Errorf("grpclimit: rule %q: key: %w", r.Name, err)); err != nil {
				return nil, err
			}
			continue
		}
		if key == "" {
			continue
		}
		bkey := httplimit.RuleKey(r.Name, key)
		// The caller's context bounds the decision: a call whose deadline
		// passes gets no decision (AllowN's contract) and, from failed,
		// DEADLINE_EXCEEDED, as any handler would give it.
		d, err := r.Limiter.AllowN(ctx, bkey, r.Cost)
		if err != nil {
			if err := ic.failed(ctx, method, grants, fmt.Errorf("grpclimit: rule %q: %w", r.Name, err)); err != nil {
				return nil, err
			}
			continue
		}
		item := fields.Add(r.Name, d)
		if !d.Allowed {
			ic.refund(ctx, grants, &fields)
			dn := Denial{Rule: r.Name, Method: method, Key: key, Decision: d, RetryAfter: retryDelay(d.RetryAfter)}
			err := ic.deny(ctx, dn)
			if err == nil {
				err = DefaultDenyHandler(ctx, dn)
			}
			return fieldsMD(&fields, false), &denied{Denial: dn, err: err}
		}
		shadow = shadow || d.Shadowed
		if !d.Shadowed {
			grants = append(grants, grant{rule: r, key: bkey, d: d, item: item})
		}
	}
	return fieldsMD(&fields, shadow), nil
}

// failed refunds grants and returns the error that a call must end with
// because a rule could not decide it (err): the status of the caller's
// context if that ended, else, after logging err, ErrorHandler's, or nil
// with PassOnError.
func (ic *Interceptor) failed(ctx context.Context, method string, grants []grant, err error) error {
	if cerr := ctxend.Err(ctx); cerr != nil {
		// The caller gave up or its deadline passed: not an error of ours
		// to log, and the call is not served. Its status says only that
		// (a KeyFunc's error text never reaches the client). A KeyFunc's
		// own time-out while the call lives is an error of ours.
		ic.refund(ctx, grants, nil)
		return status.FromContextError(cerr).Err()
	}
	level := slog.LevelError
	if errors.Is(err, hybridlimit.ErrClosed) {
		level = slog.LevelDebug // every call while the server shuts down
	}
	ic.log.Log(ctx, level, "grpclimit: rule could not decide", "method", method, "err", err, "pass", ic.pass)
	if ic.pass {
		return nil
	}
	ic.refund(ctx, grants, nil)
	if serr := ic.fail(ctx, method, err); serr != nil {
		return serr
	}
	return DefaultErrorHandler(ctx, method, err)
}

// refund gives back the tokens of grants, and, with fields, raises the
// remaining counts of their members accordingly.
func (ic *Interceptor) refund(ctx context.Context, grants []grant, fields *httplimit.Fields) {
	// A refund must reach Redis even if the caller has gone.
	ctx = context.WithoutCancel(ctx)
	for _, g := range grants {
		if err := g.rule.Limiter.Refund(ctx, g.key, g.d, g.rule.Cost); err != nil {
			ic.log.ErrorContext(ctx, "grpclimit: refund failed", "rule", g.rule.Name, "err", err)
			continue
		}
		if fields != nil {
			fields.Refunded(g.item, g.rule.Cost)
		}
	}
}

// fieldsMD returns the response header metadata for fields, nil if empty,
// with the shadow mark when shadow.
func fieldsMD(fields *httplimit.Fields, shadow bool) metadata.MD {
	if fields.Len() == 0 {
		return nil
	}
	policy, limit := fields.Values()
	md := metadata.Pairs(MetadataPolicy, policy, MetadataRateLimit, limit)
	if shadow {
		md.Set(MetadataShadow, "deny")
	}
	return md
}

// retryDelay returns d rounded up to a whole millisecond, at least one: a
// client that retries at once would only be denied again.
func retryDelay(d time.Duration) time.Duration {
	if d <= time.Millisecond {
		return time.Millisecond
	}
	return (d + time.Millisecond - 1).Truncate(time.Millisecond)
}
