package grpclimit

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/netip"
	"net/textproto"
	"strings"

	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"

	"github.com/hybridlimit/hybridlimit/httplimit"
	"github.com/hybridlimit/hybridlimit/internal/ctxkey"
)

// KeyFunc returns the key of a call of fullMethod ("/pkg.Service/Method")
// under one rule: calls with the same key share a bucket. ctx is the
// call's server context, which holds its peer (peer.FromContext), its
// incoming metadata (metadata.FromIncomingContext) and whatever the
// interceptors before this one put there, such as the authenticated
// identity. An empty key skips the rule for the call (anonymous calls
// under a per-user rule, say). An error means the rule cannot decide: see
// Config.ErrorHandler and Config.PassOnError.
//
// Any function of this shape will do; ClientIP.Key, Metadata, FromContext,
// Identity, FullMethod and Hashed build the common ones.
type KeyFunc func(ctx context.Context, fullMethod string) (string, error)

// The forwarding metadata keys that ClientIP.Header names. Proxies in front
// of gRPC servers (Envoy, nginx, cloud load balancers) forward the HTTP/2
// headers they set as metadata of the same names, lowercased.
const (
	// XForwardedFor is the de facto standard list of addresses,
	// "client, proxy1, proxy2", each proxy appending the address it
	// received the call from.
	XForwardedFor = "x-forwarded-for"
	// Forwarded is RFC 7239's header: `for=client, for="[2001:db8::1]:4711"`.
	Forwarded = "forwarded"
)

// ClientIP finds the address of the client that made a call: the peer
// address of the connection (peer.FromContext) or, when the peer is a
// trusted proxy, the address that the trusted proxies' forwarding metadata
// gives. It reads them exactly as httplimit.ClientIP reads RemoteAddr and
// the forwarding header, with the same code: from the right, past the
// trusted proxies, to the first untrusted address, so that whatever a
// client puts in its own x-forwarded-for or forwarded metadata is never
// read, and the forwarding metadata of a peer that is not a trusted proxy
// is ignored altogether.
//
// The zero ClientIP trusts no proxy: the key is always the peer address.
type ClientIP struct {
	// TrustedProxies are the networks of the proxies in front of the
	// server. IPv4 addresses, also IPv4-mapped IPv6 ones, match IPv4
	// prefixes only.
	TrustedProxies []netip.Prefix
	// Header is the metadata key of the forwarding header that the
	// trusted proxies set: XForwardedFor, Forwarded, or a key carrying one
	// address that the proxy sets and overwrites (x-real-ip). Only that
	// key is read. Zero means XForwardedFor.
	Header string
	// IPv6Prefix groups IPv6 clients by their first IPv6Prefix bits: 64
	// gives one key per /64 network. Zero means 128, one key per address;
	// other values outside 1 to 128 make Key fail with ErrInvalidConfig.
	IPv6Prefix int
}

// Addr returns the client's address, without zone, IPv4-mapped IPv6
// addresses as IPv4, and an error wrapping ErrNoClientIP if the call has
// no peer or its address is not an IP address with or without a port.
func (c ClientIP) Addr(ctx context.Context) (netip.Addr, error) {
	r, err := c.request(ctx)
	if err != nil {
		return netip.Addr{}, err
	}
	a, err := c.http(0).Addr(r)
	if err != nil {
		return netip.Addr{}, fmt.Errorf("%w: %q", ErrNoClientIP, r.RemoteAddr)
	}
	return a, nil
}

// Key is a KeyFunc: the client's address as text ("203.0.113.7",
// "2001:db8::1"), or its IPv6 network ("2001:db8:1:2::/64") with
// IPv6Prefix; the same keys as httplimit.ClientIP.Key gives.
func (c ClientIP) Key(ctx context.Context, fullMethod string) (string, error) {
	if c.IPv6Prefix < 0 || c.IPv6Prefix > 128 {
		return "", fmt.Errorf("%w: ClientIP.IPv6Prefix is %d, want 0 to 128", ErrInvalidConfig, c.IPv6Prefix)
	}
	r, err := c.request(ctx)
	if err != nil {
		return "", err
	}
	key, err := c.http(c.IPv6Prefix).Key(r)
	if errors.Is(err, httplimit.ErrNoClientIP) {
		return "", fmt.Errorf("%w: %q", ErrNoClientIP, r.RemoteAddr)
	}
	return key, err
}

// http returns the httplimit.ClientIP that reads c's request.
func (c ClientIP) http(bits int) httplimit.ClientIP {
	return httplimit.ClientIP{TrustedProxies: c.TrustedProxies, Header: c.header(), IPv6Prefix: bits}
}

func (c ClientIP) header() string {
	if c.Header == "" {
		return XForwardedFor
	}
	return strings.ToLower(c.Header)
}

// request returns an http.Request that holds what httplimit.ClientIP reads
// of a request: the call's peer address as RemoteAddr and, if any proxy is
// trusted, the forwarding metadata as its header. Building it is cheaper
// than a second copy of the forwarding-header parsers, which are subtle.
func (c ClientIP) request(ctx context.Context) (*http.Request, error) {
	p, ok := peer.FromContext(ctx)
	if !ok || p.Addr == nil {
		return nil, fmt.Errorf("%w: the call has no peer", ErrNoClientIP)
	}
	r := &http.Request{RemoteAddr: p.Addr.String()}
	if len(c.TrustedProxies) > 0 {
		md, _ := metadata.FromIncomingContext(ctx)
		if v := md.Get(c.header()); len(v) > 0 {
			r.Header = http.Header{textproto.CanonicalMIMEHeaderKey(c.header()): v}
		}
	}
	return r, nil
}

// Metadata returns a KeyFunc that keys calls by the first value of the
// named incoming metadata key, such as "x-api-key" or "x-tenant"; a call
// without it skips the rule. Keys are matched in lowercase, as gRPC sends
// them. The value is the key as is: wrap the KeyFunc in Hashed to keep
// secrets such as API keys out of Redis. Metadata is whatever the client
// sends: key by it only what is checked before this interceptor runs or
// what a client gains nothing by varying.
func Metadata(name string) KeyFunc {
	name = strings.ToLower(name)
	return func(ctx context.Context, _ string) (string, error) {
		md, _ := metadata.FromIncomingContext(ctx)
		if v := md.Get(name); len(v) > 0 {
			return v[0], nil
		}
		return "", nil
	}
}

// FromContext returns a KeyFunc that keys calls by the value of the call's
// context under key, as an authentication interceptor that runs before
// this one leaves it: a string, or a fmt.Stringer. A missing (nil) value,
// a nil pointer (a nil *User stored for an anonymous call), or an empty
// string, skips the rule; a value of another type is an error.
func FromContext(key any) KeyFunc {
	return func(ctx context.Context, _ string) (string, error) {
		v := ctx.Value(key)
		k, ok := ctxkey.String(v)
		if !ok {
			return "", fmt.Errorf("grpclimit: context value %v is a %T, want a string or a fmt.Stringer", key, v)
		}
		return k, nil
	}
}

// Identity returns a KeyFunc that keys calls by the authenticated identity
// that id finds in the call's context: a user ID that an authentication
// interceptor stored, the subject of a verified token, or the client
// certificate in the peer's credentials.TLSInfo. An empty identity skips
// the rule (anonymous calls); an error means the rule cannot decide.
func Identity(id func(ctx context.Context) (string, error)) KeyFunc {
	return func(ctx context.Context, _ string) (string, error) {
		return id(ctx)
	}
}

// FullMethod is a KeyFunc that keys calls by their full method name, such
// as "/pkg.Service/Method": one bucket per method for the whole fleet, to
// protect an expensive method whoever calls it.
func FullMethod(ctx context.Context, fullMethod string) (string, error) {
	return fullMethod, nil
}

// Hashed returns a KeyFunc that keys calls by the SHA-256 of what k
// returns (128 bits of it, in hex), so that secrets such as API keys never
// reach Redis; it is httplimit.Hashed's key, so a secret sent over HTTP and
// over gRPC has one bucket. An empty key still skips the rule; errors pass
// through.
func Hashed(k KeyFunc) KeyFunc {
	return func(ctx context.Context, fullMethod string) (string, error) {
		// httplimit.Hashed hashes what its KeyFunc returns and reads
		// nothing of the request.
		return httplimit.Hashed(func(*http.Request) (string, error) {
			return k(ctx, fullMethod)
		})(nil)
	}
}
