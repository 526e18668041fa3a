package httplimit

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http"
	"net/netip"
	"net/textproto"
	"strings"

	"github.com/hybridlimit/hybridlimit/internal/ctxkey"
)

// KeyFunc returns the key of a request under one rule: requests with the
// same key share a bucket. An empty key skips the rule for the request
// (anonymous requests under a per-user rule, say). An error means the rule
// cannot decide: see Config.ErrorHandler and Config.PassOnError.
//
// Any function of this shape will do; ClientIP.Key, Header, FromContext
// and Hashed build the common ones.
type KeyFunc func(r *http.Request) (string, error)

// ErrNoClientIP is returned by ClientIP when the request's RemoteAddr holds
// no IP address (a server on a Unix socket, say).
var ErrNoClientIP = errors.New("httplimit: RemoteAddr holds no IP address")

// The forwarding headers that ClientIP.Header names.
const (
	// XForwardedFor is the de facto standard list of addresses,
	// "client, proxy1, proxy2", each proxy appending the address it
	// received the request from.
	XForwardedFor = "X-Forwarded-For"
	// Forwarded is RFC 7239's header: `for=client, for="[2001:db8::1]:4711"`.
	Forwarded = "Forwarded"
)

// ClientIP finds the address of the client that sent a request: the peer
// address (http.Request.RemoteAddr) or, when the peer is a trusted proxy,
// the address that the trusted proxies' forwarding header gives.
//
// The forwarding header is read from the right, the end each proxy appends
// to: past the addresses of trusted proxies, the first untrusted address is
// the client's. A client can put anything in the header, but only to the
// left of what the trusted proxies appended, which is never read: a
// client's own forwarding header never changes its key. If every address
// is trusted, the leftmost is the client's. If the header is absent, or an
// entry that must be read is not an address ("unknown", an obfuscated
// identifier, garbage), the peer address is the client's.
//
// The zero ClientIP trusts no proxy: the key is always the peer address.
type ClientIP struct {
	// TrustedProxies are the networks of the proxies in front of the
	// server, such as 10.0.0.0/8 or the load balancer's addresses. IPv4
	// addresses, also IPv4-mapped IPv6 ones, match IPv4 prefixes only.
	TrustedProxies []netip.Prefix
	// Header is the forwarding header the trusted proxies set:
	// XForwardedFor, Forwarded, or a header carrying one address that the
	// proxy sets and overwrites (X-Real-IP, CF-Connecting-IP). Only that
	// header is read. A header that the proxies pass through without
	// setting is the client's to forge, so name the one they set. Zero
	// means XForwardedFor.
	Header string
	// IPv6Prefix groups IPv6 clients by their first IPv6Prefix bits: 64
	// gives one key per /64 network, as one host is often given a whole
	// /64. Zero means 128, one key per address; other values outside 1 to
	// 128 make Key and Addr fail with ErrInvalidConfig.
	IPv6Prefix int
}

// Addr returns the client's address, without zone, IPv4-mapped IPv6
// addresses as IPv4, and an error wrapping ErrNoClientIP if RemoteAddr is
// not an IP address with or without a port.
func (c ClientIP) Addr(r *http.Request) (netip.Addr, error) {
	peer, ok := parseAddr(r.RemoteAddr)
	if !ok {
		return netip.Addr{}, fmt.Errorf("%w: %q", ErrNoClientIP, r.RemoteAddr)
	}
	if !c.trusted(peer) {
		return peer, nil
	}
	name := XForwardedFor
	if c.Header != "" {
		name = textproto.CanonicalMIMEHeaderKey(c.Header)
	}
	values := r.Header.Values(name)
	if len(values) == 0 {
		return peer, nil
	}
	s := strings.Join(values, ",")
	client := peer
	for s != "" {
		var elem string
		switch name {
		case XForwardedFor:
			elem, s = cut(s)
		case Forwarded:
			elem, s = cutForwarded(s)
			elem, ok = forwardedFor(elem)
			if !ok {
				return peer, nil
			}
		default:
			if len(values) != 1 {
				return peer, nil
			}
			elem, s = s, ""
		}
		a, ok := parseAddr(strings.Trim(elem, " \t"))
		if !ok {
			return peer, nil
		}
		client = a
		if !c.trusted(a) {
			break
		}
	}
	return client, nil
}

// Key is a KeyFunc: the client's address as text ("203.0.113.7",
// "2001:db8::1"), or its IPv6 network ("2001:db8:1:2::/64") with
// IPv6Prefix.
func (c ClientIP) Key(r *http.Request) (string, error) {
	bits := c.IPv6Prefix
	if bits == 0 {
		bits = 128
	}
	if bits < 1 || bits > 128 {
		return "", fmt.Errorf("%w: ClientIP.IPv6Prefix is %d, want 0 to 128", ErrInvalidConfig, c.IPv6Prefix)
	}
	a, err := c.Addr(r)
	if err != nil {
		return "", err
	}
	if a.Is6() && bits < 128 {
		p, err := a.Prefix(bits)
		if err != nil {
			return "", err
		}
		return p.String(), nil
	}
	return a.String(), nil
}

// trusted reports whether a is in a trusted network.
func (c ClientIP) trusted(a netip.Addr) bool {
	for _, p := range c.TrustedProxies {
		if p.Contains(a) {
			return true
		}
	}
	return false
}

// parseAddr parses an address with or without a port: "192.0.2.1",
// "192.0.2.1:80", "2001:db8::1", "[2001:db8::1]", "[2001:db8::1]:80". It
// drops the zone and unmaps IPv4-mapped IPv6 addresses.
func parseAddr(s string) (netip.Addr, bool) {
	a, err := netip.ParseAddr(s)
	if err != nil {
		if len(s) > 2 && s[0] == '[' && s[len(s)-1] == ']' {
			a, err = netip.ParseAddr(s[1 : len(s)-1])
		} else {
			var ap netip.AddrPort
			ap, err = netip.ParseAddrPort(s)
			a = ap.Addr()
		}
		if err != nil {
			return netip.Addr{}, false
		}
	}
	return a.WithZone("").Unmap(), true
}

// cut splits the comma-separated list s into its last element and the
// rest before it.
func cut(s string) (last, rest string) {
	i := strings.LastIndexByte(s, ',')
	if i < 0 {
		return s, ""
	}
	return s[i+1:], s[:i]
}

// cutForwarded is cut for a Forwarded header, whose elements may hold
// quoted strings with commas in them. It scans from the right, so that an
// element with an unbalanced quote spoils only itself and the elements to
// its left, never the ones that trusted proxies appended after it.
func cutForwarded(s string) (last, rest string) {
	quoted := false
	for i := len(s) - 1; i >= 0; i-- {
		switch {
		case quoted && s[i] == '"':
			// The opening quote, unless escaped by an odd run of
			// backslashes.
			j := i
			for j > 0 && s[j-1] == '\\' {
				j--
			}
			if (i-j)%2 == 0 {
				quoted = false
			}
		case quoted:
		case s[i] == '"':
			quoted = true
		case s[i] == ',':
			return s[i+1:], s[:i]
		}
	}
	return s, ""
}

// forwardedFor returns the value of the for parameter of elem, one element
// of a Forwarded header (RFC 7239, section 4): pairs token=value separated
// by semicolons, each value a token or a quoted string. It reports false
// if elem is malformed or has no for parameter, or more than one.
func forwardedFor(elem string) (string, bool) {
	var val string
	found := false
	s := strings.Trim(elem, " \t")
	for s != "" {
		i := 0
		for i < len(s) && isTchar(s[i]) {
			i++
		}
		if i == 0 || i == len(s) || s[i] != '=' {
			return "", false
		}
		name := s[:i]
		s = s[i+1:]
		var v string
		if s != "" && s[0] == '"' {
			var b strings.Builder
			i = 1
			for ; i < len(s) && s[i] != '"'; i++ {
				if s[i] == '\\' {
					i++
					if i == len(s) {
						return "", false
					}
				}
				b.WriteByte(s[i])
			}
			if i == len(s) {
				return "", false // no closing quote
			}
			v, s = b.String(), s[i+1:]
		} else {
			// A token, leniently: IPv4 addresses with a port appear
			// unquoted in the wild, though ':' is no token character.
			i = 0
			for i < len(s) && (isTchar(s[i]) || s[i] == ':' || s[i] == '[' || s[i] == ']') {
				i++
			}
			if i == 0 {
				return "", false
			}
			v, s = s[:i], s[i:]
		}
		if strings.EqualFold(name, "for") {
			if found {
				return "", false
			}
			val, found = v, true
		}
		s = strings.TrimLeft(s, " \t")
		if s == "" {
			break
		}
		if s[0] != ';' {
			return "", false
		}
		s = strings.TrimLeft(s[1:], " \t")
	}
	return val, found
}

// isTchar reports whether c is a token character (RFC 9110, section 5.6.2).
func isTchar(c byte) bool {
	switch {
	case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9':
		return true
	}
	return strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0
}

// Header returns a KeyFunc that keys requests by the value of the named
// request header, such as "X-API-Key" or "X-Tenant"; a request without it
// skips the rule. The value is the key as is: wrap the KeyFunc in Hashed
// to keep secrets such as API keys out of Redis. A header is whatever the
// client sends: key by it only what is checked before this middleware runs
// or what a client gains nothing by varying.
func Header(name string) KeyFunc {
	name = textproto.CanonicalMIMEHeaderKey(name)
	return func(r *http.Request) (string, error) {
		return r.Header.Get(name), nil
	}
}

// FromContext returns a KeyFunc that keys requests by the value of the
// request's context under key, as an authentication middleware that runs
// before this one leaves it: a string, or a fmt.Stringer. A missing (nil)
// value, a nil pointer (a nil *User stored for an anonymous request), or an
// empty string, skips the rule; a value of another type is an error.
func FromContext(key any) KeyFunc {
	return func(r *http.Request) (string, error) {
		v := r.Context().Value(key)
		k, ok := ctxkey.String(v)
		if !ok {
			return "", fmt.Errorf("httplimit: context value %v is a %T, want a string or a fmt.Stringer", key, v)
		}
		return k, nil
	}
}

// Hashed returns a KeyFunc that keys requests by the SHA-256 of what k
// returns (128 bits of it, in hex), so that secrets such as API keys never
// reach Redis. An empty key still skips the rule; errors pass through.
func Hashed(k KeyFunc) KeyFunc {
	return func(r *http.Request) (string, error) {
		key, err := k(r)
		if err != nil || key == "" {
			return key, err
		}
		sum := sha256.Sum256([]byte(key))
		return hex.EncodeToString(sum[:16]), nil
	}
}
