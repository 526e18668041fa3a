package httplimit

import (
	"math"
	"net/http"
	"slices"
	"strconv"
	"time"

	"github.com/hybridlimit/hybridlimit"
)

// The header fields the middleware sets, besides Retry-After.
const (
	// HeaderPolicy is the RateLimit-Policy field: one member per rule,
	// "name";q=burst;w=window.
	HeaderPolicy = "RateLimit-Policy"
	// HeaderRateLimit is the RateLimit field: one member per rule,
	// "name";r=remaining;t=seconds.
	HeaderRateLimit = "RateLimit"
	// HeaderShadow is set to "deny" on a response that a rule in shadow
	// mode (hybridlimit.Config.Shadow) would have denied.
	HeaderShadow = "X-RateLimit-Shadow"
	// ParamDegraded is the boolean parameter on both members of a rule
	// whose decision was made without Redis (hybridlimit.Mode.Degraded).
	ParamDegraded = "hl-degraded"
)

// maxInteger is the largest sf-integer (RFC 9651, section 3.3.1).
const maxInteger = 999_999_999_999_999

// item is one rule's members in the RateLimit-Policy and RateLimit fields.
type item struct {
	name     string
	q, w     int64 // quota (burst) and window in seconds
	r, t     int64 // remaining and seconds
	denied   bool  // denied, or would have been (shadow)
	shadowed bool  // would have been denied, let through by Config.Shadow
	degraded bool
	bucket   bool // the decision took tokens from a bucket, so a refund shows in r
}

// newItem describes d, a decision of the named rule.
func newItem(name string, d hybridlimit.Decision) item {
	it := item{
		name:     name,
		q:        clamp(d.Limit.Burst),
		w:        window(d.Limit),
		r:        clamp(d.Remaining),
		denied:   !d.Allowed || d.Shadowed,
		shadowed: d.Shadowed,
		degraded: d.Mode.Degraded(),
		bucket:   d.Mode == hybridlimit.ModeRemote || d.Mode == hybridlimit.ModeLocal || d.Mode == hybridlimit.ModeLease,
	}
	if it.denied {
		it.t = ceilSeconds(d.RetryAfter)
	} else {
		it.t = ceilSeconds(d.ResetAfter)
	}
	return it
}

// window returns the whole seconds in which l refills from empty: Burst/Rate
// rounded up, at least 1. A quotient within a billionth of an integer is
// taken as that integer, so that PerMinute(100) has a window of 60, not 61.
func window(l hybridlimit.Limit) int64 {
	if !(l.Rate > 0) {
		return 1
	}
	w := float64(l.Burst) / l.Rate
	if r := math.Round(w); math.Abs(w-r) <= 1e-9*w {
		w = r
	}
	w = math.Ceil(w)
	if !(w < maxInteger) {
		return maxInteger
	}
	return max(int64(w), 1)
}

// ceilSeconds returns d in whole seconds, rounded up; 0 if d <= 0.
func ceilSeconds(d time.Duration) int64 {
	if d <= 0 {
		return 0
	}
	s := int64(d / time.Second)
	if d%time.Second != 0 {
		s++
	}
	return clamp(s)
}

// refunded raises the remaining count by n tokens given back, up to the
// quota. Only the modes that took tokens from a bucket get them back
// (hybridlimit.Limiter.Refund), so only theirs change.
func (it *item) refunded(n int64) {
	if it.bucket {
		it.r = min(it.r+n, it.q)
	}
}

// clamp returns n within the sf-integers that cannot be negative.
func clamp(n int64) int64 { return min(max(n, 0), maxInteger) }

// setHeaders adds the RateLimit-Policy and RateLimit fields of items to h,
// the most restrictive member first, and the legacy fields, and on a
// request that passes (not denied) the shadow field. It adds rather than
// sets, so that nested middlewares list all their rules.
func (m *Middleware) setHeaders(h http.Header, items []item, denied bool) {
	if len(items) == 0 {
		return
	}
	policy, limit := format(items)
	h.Add(HeaderPolicy, policy)
	h.Add(HeaderRateLimit, limit)
	shadow := false
	for _, it := range items {
		shadow = shadow || it.shadowed
	}
	if shadow && !denied {
		h.Set(HeaderShadow, "deny")
	}
	if m.legacy {
		first := items[0]
		h.Set("X-RateLimit-Limit", strconv.FormatInt(first.q, 10))
		h.Set("X-RateLimit-Remaining", strconv.FormatInt(first.r, 10))
		h.Set("X-RateLimit-Reset", strconv.FormatInt(first.t, 10))
	}
}

// format sorts items, the most restrictive first (a denial, then a
// shadow rule's, the longest wait, then the fewest remaining), and returns
// the values of the RateLimit-Policy and RateLimit fields that list them.
// A shadow rule that would deny never comes before a rule that did: the
// first member, and the legacy fields taken from it, must be the limit a
// client waits for, not one that is not switched on.
func format(items []item) (policy, limit string) {
	rank := func(it item) int {
		switch {
		case it.denied && !it.shadowed:
			return 0
		case it.denied:
			return 1
		}
		return 2
	}
	slices.SortStableFunc(items, func(a, b item) int {
		switch {
		case rank(a) != rank(b):
			return cmpInt(int64(rank(a)), int64(rank(b)))
		case a.denied && a.t != b.t:
			return cmpInt(b.t, a.t) // the longer wait first
		case a.r != b.r:
			return cmpInt(a.r, b.r)
		}
		return cmpInt(b.t, a.t)
	})
	var p, l []byte
	for i, it := range items {
		if i > 0 {
			p = append(p, ", "...)
			l = append(l, ", "...)
		}
		p = appendString(p, it.name)
		p = appendParam(p, "q", it.q)
		p = appendParam(p, "w", it.w)
		l = appendString(l, it.name)
		l = appendParam(l, "r", it.r)
		l = appendParam(l, "t", it.t)
		if it.degraded {
			p = append(p, ";"+ParamDegraded...)
			l = append(l, ";"+ParamDegraded...)
		}
	}
	return string(p), string(l)
}

// Fields builds the values of the RateLimit-Policy and RateLimit fields
// from the decisions of the rules that decided one request, exactly as
// Middleware does, for servers that carry the fields elsewhere than in an
// http.Header: the grpclimit module puts them in gRPC metadata. The zero
// Fields has no members and is ready to use.
type Fields struct {
	items []item
}

// Add adds the members of the rule named name for its decision d, and
// returns their index for Refunded. The name must be one that ValidName
// accepts.
func (f *Fields) Add(name string, d hybridlimit.Decision) int {
	f.items = append(f.items, newItem(name, d))
	return len(f.items) - 1
}

// Refunded records that n tokens of the decision added at index i were
// given back with hybridlimit.Limiter.Refund: its remaining count rises by
// n, up to the quota, if its Mode took them from a bucket. An index that
// Add did not return is ignored.
func (f *Fields) Refunded(i int, n int64) {
	if i >= 0 && i < len(f.items) {
		f.items[i].refunded(n)
	}
}

// Len returns the number of decisions added.
func (f *Fields) Len() int { return len(f.items) }

// Values returns the values of the RateLimit-Policy and RateLimit fields,
// one member per decision added, the most restrictive first; two empty
// strings if none was added.
func (f *Fields) Values() (policy, limit string) {
	if len(f.items) == 0 {
		return "", ""
	}
	// A copy, so that the indices that Add returned stay valid.
	return format(slices.Clone(f.items))
}

func cmpInt(a, b int64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// appendString appends s as an sf-string; s must be printable ASCII.
func appendString(b []byte, s string) []byte {
	b = append(b, '"')
	for i := 0; i < len(s); i++ {
		if c := s[i]; c == '"' || c == '\\' {
			b = append(b, '\\')
		}
		b = append(b, s[i])
	}
	return append(b, '"')
}

// appendParam appends the parameter ;key=n.
func appendParam(b []byte, key string, n int64) []byte {
	b = append(b, ';')
	b = append(b, key...)
	b = append(b, '=')
	return strconv.AppendInt(b, n, 10)
}
