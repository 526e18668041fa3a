package httplimit

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/hybridlimit/hybridlimit"
	"github.com/hybridlimit/hybridlimit/internal/ctxend"
)

// ErrInvalidConfig is wrapped by every error New returns, and by the error
// of a ClientIP whose IPv6Prefix is out of range. Test for it with
// errors.Is.
var ErrInvalidConfig = errors.New("httplimit: invalid config")

// Rule is one limit on requests: the requests with the same key share one
// token bucket of Limiter.
type Rule struct {
	// Name names the rule's policy in the RateLimit header fields and
	// prefixes its keys: the limiter sees RuleKey(Name, key), Name + ":" +
	// key (or its SHA-256 for a key too long, holding '{' or starting
	// "sha256:"), so rules that share a Limiter never share a bucket, and
	// a Config.LimitFor can tell them apart. Printable ASCII without ':',
	// unique within a Config. Required.
	Name string
	// Limiter decides. Required.
	Limiter *hybridlimit.Limiter
	// Key returns the key of a request; an empty key skips the rule for
	// that request. Required.
	Key KeyFunc
	// Cost is how many tokens a request takes, at most the limit's Burst.
	// Zero means 1.
	Cost int64
}

// Denial describes a denied request to Config.DenyHandler.
type Denial struct {
	// Rule is the Name of the rule that denied the request.
	Rule string
	// Key is what the rule's KeyFunc returned. It may identify the client
	// (an address, an API key): keep it out of responses.
	Key string
	// Decision is the limiter's decision. Decision.Mode says who decided;
	// Decision.RetryAfter how long until the request could pass.
	Decision hybridlimit.Decision
	// RetryAfter is the Retry-After header already set: Decision.RetryAfter
	// rounded up to whole seconds, at least one second.
	RetryAfter time.Duration
}

// Config configures a Middleware. Only Rules is required.
type Config struct {
	// Rules are checked in order on every request, which passes only if
	// every rule allows it. Put the rule most likely to deny first: a
	// denial stops the checking, and the tokens taken by the rules before
	// it are refunded. Required: at least one.
	Rules []Rule
	// DenyHandler writes the response to a denied request. The RateLimit
	// fields and Retry-After are set on w's header before it is called.
	// Nil means DefaultDenyHandler.
	DenyHandler func(w http.ResponseWriter, r *http.Request, d Denial)
	// ErrorHandler writes the response to a request that a rule could not
	// decide: its KeyFunc returned an error, or its Limiter did (a limit
	// that Config.LimitFor got wrong, a Cost above the key's burst, a
	// closed Limiter), or the request's deadline passed first. These are
	// bugs, shutdown or a spent deadline, never Redis failures. err is
	// logged already. Nil means DefaultErrorHandler.
	ErrorHandler func(w http.ResponseWriter, r *http.Request, err error)
	// PassOnError skips a rule that cannot decide, as if its key were "",
	// instead of calling ErrorHandler: the request is served without that
	// rule. The error is logged all the same.
	PassOnError bool
	// LegacyHeaders adds X-RateLimit-Limit, X-RateLimit-Remaining and
	// X-RateLimit-Reset, for the first (most restrictive) policy of the
	// RateLimit field. X-RateLimit-Reset is in seconds from now, like the
	// t parameter, not a Unix time.
	LegacyHeaders bool
	// Logger receives the errors of rules that could not decide, at
	// level Error, or Debug for a request whose deadline passed before
	// its rules decided. Nil means slog.Default().
	Logger *slog.Logger
}

// Middleware limits the requests to the handlers it wraps. Create it with
// New. Middleware is safe for concurrent use by multiple goroutines.
type Middleware struct {
	rules  []Rule
	deny   func(http.ResponseWriter, *http.Request, Denial)
	fail   func(http.ResponseWriter, *http.Request, error)
	pass   bool
	legacy bool
	log    *slog.Logger
}

// New returns a Middleware for cfg, or an error wrapping ErrInvalidConfig
// that names the offending rule and field.
func New(cfg Config) (*Middleware, error) {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: "+format, append([]any{ErrInvalidConfig}, args...)...)
	}
	if len(cfg.Rules) == 0 {
		return nil, bad("no Rules")
	}
	m := &Middleware{
		rules:  make([]Rule, len(cfg.Rules)),
		deny:   cfg.DenyHandler,
		fail:   cfg.ErrorHandler,
		pass:   cfg.PassOnError,
		legacy: cfg.LegacyHeaders,
		log:    cfg.Logger,
	}
	seen := make(map[string]bool, len(cfg.Rules))
	for i, rule := range cfg.Rules {
		if err := checkName(rule.Name); err != nil {
			return nil, bad("Rules[%d].Name: %v", i, err)
		}
		if seen[rule.Name] {
			return nil, bad("Rules[%d].Name %q used twice", i, rule.Name)
		}
		seen[rule.Name] = true
		switch {
		case rule.Limiter == nil:
			return nil, bad("rule %q: Limiter is nil", rule.Name)
		case rule.Key == nil:
			return nil, bad("rule %q: Key is nil", rule.Name)
		case rule.Cost < 0:
			return nil, bad("rule %q: Cost must not be negative, got %d", rule.Name, rule.Cost)
		}
		if rule.Cost == 0 {
			rule.Cost = 1
		}
		if b := rule.Limiter.Limit().Burst; rule.Cost > b {
			return nil, bad("rule %q: Cost %d exceeds the limit's burst %d", rule.Name, rule.Cost, b)
		}
		m.rules[i] = rule
	}
	if m.deny == nil {
		m.deny = DefaultDenyHandler
	}
	if m.fail == nil {
		m.fail = DefaultErrorHandler
	}
	if m.log == nil {
		m.log = slog.Default()
	}
	return m, nil
}

// checkName says why name cannot be a Rule's Name, or returns nil.
func checkName(name string) error {
	if name == "" {
		return errors.New("empty")
	}
	if !ValidName(name) {
		return fmt.Errorf("%q: want printable ASCII without ':'", name)
	}
	return nil
}

// ValidName reports whether name can be a Rule's Name: not empty, an
// sf-string in the header fields (printable ASCII) and a key prefix (no
// ':'). Other packages that name rules the same way, such as grpclimit,
// check their names with it.
func ValidName(name string) bool {
	for i := 0; i < len(name); i++ {
		if c := name[i]; c < 0x20 || c > 0x7e || c == ':' {
			return false
		}
	}
	return name != ""
}

// Handler returns a handler that serves next if every rule allows the
// request. Its method value m.Handler is a func(http.Handler) http.Handler,
// the middleware shape of chi's Use and gorilla/mux's Use.
func (m *Middleware) Handler(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		m.serve(w, r, next)
	})
}

// HandlerFunc is like Handler for a handler function.
func (m *Middleware) HandlerFunc(next func(http.ResponseWriter, *http.Request)) http.Handler {
	return m.Handler(http.HandlerFunc(next))
}

// DefaultDenyHandler answers 429 Too Many Requests with a short plain-text
// body. The response's header already holds Retry-After and the RateLimit
// fields; a DenyHandler of your own can log d and then call this one.
func DefaultDenyHandler(w http.ResponseWriter, r *http.Request, d Denial) {
	http.Error(w, "too many requests", http.StatusTooManyRequests)
}

// DefaultErrorHandler answers StatusClientClosedRequest (499) when the
// client hung up before the rules decided (nobody reads the answer: it is
// for access logs and metrics, which should not count it as the server's
// error); 503 Service Unavailable for a closed Limiter
// (hybridlimit.ErrClosed: the server is shutting down, and the client may
// try another) or a time-out (the request's deadline, or a KeyFunc's own);
// and 500 Internal Server Error for every other error, which is a bug on
// the server's side; each with a generic plain-text body that says
// nothing of err.
func DefaultErrorHandler(w http.ResponseWriter, r *http.Request, err error) {
	switch {
	case errors.Is(err, context.Canceled) && errors.Is(r.Context().Err(), context.Canceled):
		w.WriteHeader(StatusClientClosedRequest)
	case errors.Is(err, hybridlimit.ErrClosed) || errors.Is(err, context.DeadlineExceeded):
		http.Error(w, "service unavailable", http.StatusServiceUnavailable)
	default:
		http.Error(w, "internal server error", http.StatusInternalServerError)
	}
}

// StatusClientClosedRequest is the status DefaultErrorHandler answers for
// a request whose client hung up before the rules decided: nginx's 499,
// which access logs and dashboards know as the client's doing.
const StatusClientClosedRequest = 499

// grant is a rule that took tokens for the request in hand.
type grant struct {
	rule *Rule
	key  string // the key the limiter saw
	d    hybridlimit.Decision
	item int // index in the items
}

// serve checks the rules on r, then serves next or answers the denial.
func (m *Middleware) serve(w http.ResponseWriter, r *http.Request, next http.Handler) {
	// The limiter bounds each decision by its Config.Timeout, so the
	// request's end need not: a client that hangs up has still spent
	// its tokens, and a refund must still reach Redis. The request's
	// deadline does bound the decisions (the limiter then decides within
	// it, by its failure policy if Redis is slow), but not the refunds.
	ctx := context.WithoutCancel(r.Context())
	dctx := ctx
	if dl, ok := r.Context().Deadline(); ok {
		var cancel context.CancelFunc
		dctx, cancel = context.WithDeadline(ctx, dl)
		defer cancel()
	}
	var (
		itemsBuf  [4]item
		grantsBuf [4]grant
		items     = itemsBuf[:0]
		grants    = grantsBuf[:0]
	)
	for i := range m.rules {
		rule := &m.rules[i]
		key, err := rule.Key(r)
		if err != nil {
			if m.failed(ctx, w, r, grants, fmt.Errorf("httplimit: rule %q: key: %w", rule.Name, err)) {
				return
			}
			continue
		}
		if key == "" {
			continue
		}
		bkey := RuleKey(rule.Name, key)
		d, err := rule.Limiter.AllowN(dctx, bkey, rule.Cost)
		if err != nil {
			if m.failed(ctx, w, r, grants, fmt.Errorf("httplimit: rule %q: %w", rule.Name, err)) {
				return
			}
			continue
		}
		it := newItem(rule.Name, d)
		if !d.Allowed {
			m.refund(ctx, grants, items)
			items = append(items, it)
			retry := max(it.t, 1)
			h := w.Header()
			m.setHeaders(h, items, true)
			h.Set("Retry-After", strconv.FormatInt(retry, 10))
			m.deny(w, r, Denial{Rule: rule.Name, Key: key, Decision: d,
				RetryAfter: time.Duration(retry) * time.Second})
			return
		}
		if !d.Shadowed {
			grants = append(grants, grant{rule: rule, key: bkey, d: d, item: len(items)})
		}
		items = append(items, it)
	}
	m.setHeaders(w.Header(), items, false)
	next.ServeHTTP(w, r)
}

// failed logs err, a rule's failure to decide, and reports whether the
// request was answered: unless PassOnError, the granted tokens are
// refunded and ErrorHandler writes the response.
func (m *Middleware) failed(ctx context.Context, w http.ResponseWriter, r *http.Request, grants []grant, err error) bool {
	level := slog.LevelError
	if ctxend.Err(r.Context()) != nil || errors.Is(err, hybridlimit.ErrClosed) {
		// The client hung up or the request's deadline passed (a KeyFunc
		// that looks the key up under the request's context fails
		// then), or the server is shutting down (every request then,
		// until it stops): not a bug. A KeyFunc's own time-out while the
		// request lives is one.
		level = slog.LevelDebug
	}
	m.log.Log(ctx, level, "httplimit: rule could not decide", "method", r.Method, "path", r.URL.Path,
		"err", err, "pass", m.pass)
	if m.pass {
		return false
	}
	m.refund(ctx, grants, nil)
	m.fail(w, r, err)
	return true
}

// refund gives back the tokens of grants, and raises the remaining counts
// of their items accordingly.
func (m *Middleware) refund(ctx context.Context, grants []grant, items []item) {
	for _, g := range grants {
		err := g.rule.Limiter.Refund(ctx, g.key, g.d, g.rule.Cost)
		if err != nil {
			m.log.ErrorContext(ctx, "httplimit: refund failed", "rule", g.rule.Name, "err", err)
			continue
		}
		if items != nil {
			items[g.item].refunded(g.rule.Cost)
		}
	}
}

// RuleKey returns the limiter's key for key under the rule named name:
// name + ":" + key, or name + ":sha256:" + the hex SHA-256 of key when
// that is longer than hybridlimit.MaxKeyLen, or key holds a '{' or starts
// "sha256:". Keys come from requests: a '{' would let a client pick the
// Redis Cluster shard of its bucket by a hash tag (or name a key the
// limiter reserves), and a key written as a hash would share the bucket of
// the long key it hashes. Other packages that key rules the same way, such
// as grpclimit, use it, so that a rule of theirs with the same Name and
// Limiter shares its buckets with this package's.
func RuleKey(name, key string) string {
	if len(name)+1+len(key) <= hybridlimit.MaxKeyLen && !strings.ContainsRune(key, '{') &&
		!strings.HasPrefix(key, "sha256:") {
		return name + ":" + key
	}
	sum := sha256.Sum256([]byte(key))
	return name + ":sha256:" + hex.EncodeToString(sum[:])
}
