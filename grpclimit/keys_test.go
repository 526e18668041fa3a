package grpclimit

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http/httptest"
	"net/netip"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"

	"github.com/hybridlimit/hybridlimit"
	"github.com/hybridlimit/hybridlimit/httplimit"
)

// callCtx returns the server context of a call from the peer addr (nil:
// none) with the incoming metadata pairs kv.
func callCtx(addr net.Addr, kv ...string) context.Context {
	ctx := metadata.NewIncomingContext(context.Background(), metadata.Pairs(kv...))
	if addr != nil {
		ctx = peer.NewContext(ctx, &peer.Peer{Addr: addr})
	}
	return ctx
}

func tcp(s string) net.Addr { return net.TCPAddrFromAddrPort(netip.MustParseAddrPort(s)) }

func TestClientIP(t *testing.T) {
	trusted := []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8"), netip.MustParsePrefix("2001:db8:ffff::/48")}
	tests := []struct {
		name string
		ip   ClientIP
		peer net.Addr
		kv   []string
		want string
	}{
		{"peer", ClientIP{}, tcp("198.51.100.7:5555"), nil, "198.51.100.7"},
		{"untrusted peer's xff ignored", ClientIP{TrustedProxies: trusted}, tcp("198.51.100.7:5555"),
			[]string{"x-forwarded-for", "203.0.113.9"}, "198.51.100.7"},
		{"no trusted proxies: xff ignored", ClientIP{}, tcp("10.0.0.1:80"),
			[]string{"x-forwarded-for", "203.0.113.9"}, "10.0.0.1"},
		{"trusted proxy", ClientIP{TrustedProxies: trusted}, tcp("10.0.0.1:80"),
			[]string{"x-forwarded-for", "6.6.6.6, 203.0.113.9"}, "203.0.113.9"},
		{"two proxies, two values", ClientIP{TrustedProxies: trusted}, tcp("10.0.0.2:80"),
			[]string{"x-forwarded-for", "6.6.6.6, 203.0.113.9", "x-forwarded-for", "10.0.0.1"}, "203.0.113.9"},
		{"malformed: the peer", ClientIP{TrustedProxies: trusted}, tcp("10.0.0.1:80"),
			[]string{"x-forwarded-for", "garbage"}, "10.0.0.1"},
		{"forwarded", ClientIP{TrustedProxies: trusted, Header: Forwarded}, tcp("10.0.0.1:80"),
			[]string{"forwarded", `for=6.6.6.6, for="[2001:db8::1]:4711";proto=https`}, "2001:db8::1"},
		{"forwarded named in capitals", ClientIP{TrustedProxies: trusted, Header: "Forwarded"}, tcp("10.0.0.1:80"),
			[]string{"forwarded", "for=203.0.113.9"}, "203.0.113.9"},
		{"x-real-ip", ClientIP{TrustedProxies: trusted, Header: "X-Real-IP"}, tcp("10.0.0.1:80"),
			[]string{"x-real-ip", "203.0.113.9", "x-forwarded-for", "6.6.6.6"}, "203.0.113.9"},
		{"ipv6 /64", ClientIP{IPv6Prefix: 64}, tcp("[2001:db8:1:2::99]:443"), nil, "2001:db8:1:2::/64"},
		{"ipv6 behind a v6 proxy", ClientIP{TrustedProxies: trusted, IPv6Prefix: 64}, tcp("[2001:db8:ffff::1]:443"),
			[]string{"x-forwarded-for", "2001:db8:1:2:aaaa:bbbb:cccc:dd"}, "2001:db8:1:2::/64"},
		{"ipv4-mapped", ClientIP{}, tcp("[::ffff:192.0.2.1]:80"), nil, "192.0.2.1"},
	}
	for _, tt := range tests {
		got, err := tt.ip.Key(callCtx(tt.peer, tt.kv...), check)
		if got != tt.want || err != nil {
			t.Errorf("%s: Key = %q, %v; want %q", tt.name, got, err, tt.want)
		}
	}
}

func TestClientIPSameAsHTTP(t *testing.T) {
	// The same peer and forwarding header give httplimit's key.
	trusted := []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}
	for _, xff := range []string{"", "203.0.113.9", "6.6.6.6, 203.0.113.9, 10.0.0.3", "unknown", "2001:db8::1"} {
		r := httptest.NewRequest("GET", "/", nil)
		r.RemoteAddr = "10.0.0.1:80"
		var kv []string
		if xff != "" {
			r.Header.Set("X-Forwarded-For", xff)
			kv = []string{"x-forwarded-for", xff}
		}
		want, _ := httplimit.ClientIP{TrustedProxies: trusted}.Key(r)
		got, err := ClientIP{TrustedProxies: trusted}.Key(callCtx(tcp("10.0.0.1:80"), kv...), check)
		if got != want || err != nil {
			t.Errorf("x-forwarded-for %q: Key = %q, %v; want httplimit's %q", xff, got, err, want)
		}
	}
}

type fakeAddr string

func (a fakeAddr) Network() string { return "fake" }
func (a fakeAddr) String() string  { return string(a) }

func TestClientIPErrors(t *testing.T) {
	for _, tt := range []struct {
		name string
		ip   ClientIP
		ctx  context.Context
		want error
	}{
		{"no peer", ClientIP{}, callCtx(nil), ErrNoClientIP},
		{"bufconn", ClientIP{}, callCtx(fakeAddr("bufconn")), ErrNoClientIP},
		{"unix socket", ClientIP{}, callCtx(&net.UnixAddr{Name: "/run/s.sock", Net: "unix"}), ErrNoClientIP},
		{"IPv6Prefix 129", ClientIP{IPv6Prefix: 129}, callCtx(tcp("192.0.2.1:1")), ErrInvalidConfig},
		{"IPv6Prefix -1", ClientIP{IPv6Prefix: -1}, callCtx(tcp("192.0.2.1:1")), ErrInvalidConfig},
	} {
		if _, err := tt.ip.Key(tt.ctx, check); !errors.Is(err, tt.want) {
			t.Errorf("%s: Key error %v; want %v", tt.name, err, tt.want)
		}
	}
	if _, err := (ClientIP{}).Addr(callCtx(fakeAddr("bufconn"))); !errors.Is(err, ErrNoClientIP) {
		t.Errorf("Addr(bufconn) error %v; want ErrNoClientIP", err)
	}
	a, err := ClientIP{}.Addr(callCtx(tcp("[2001:db8::1]:80")))
	if a != netip.MustParseAddr("2001:db8::1") || err != nil {
		t.Errorf("Addr = %v, %v; want 2001:db8::1", a, err)
	}
}

type user struct{ id int }

func (u user) String() string { return fmt.Sprintf("user-%d", u.id) }

type ctxKey struct{}

func TestKeyFuncs(t *testing.T) {
	md := callCtx(nil, "x-api-key", "first", "x-api-key", "second")
	withValue := func(v any) context.Context { return context.WithValue(context.Background(), ctxKey{}, v) }
	tests := []struct {
		name    string
		key     KeyFunc
		ctx     context.Context
		want    string
		wantErr bool
	}{
		{"metadata: first value", Metadata("X-API-Key"), md, "first", false},
		{"metadata absent", Metadata("x-tenant"), md, "", false},
		{"metadata without any", Metadata("x-tenant"), context.Background(), "", false},
		{"context string", FromContext(ctxKey{}), withValue("alice"), "alice", false},
		{"context Stringer", FromContext(ctxKey{}), withValue(user{7}), "user-7", false},
		{"context missing", FromContext(ctxKey{}), context.Background(), "", false},
		{"context other type", FromContext(ctxKey{}), withValue(42), "", true},
		{"identity", Identity(func(ctx context.Context) (string, error) { return "sub-1", nil }), md, "sub-1", false},
		{"identity error", Identity(func(ctx context.Context) (string, error) { return "", errors.New("no") }), md, "", true},
		{"full method", FullMethod, md, check, false},
		{"hashed empty", Hashed(Metadata("x-tenant")), md, "", false},
	}
	for _, tt := range tests {
		got, err := tt.key(tt.ctx, check)
		if got != tt.want || (err != nil) != tt.wantErr {
			t.Errorf("%s = %q, %v; want %q, error %v", tt.name, got, err, tt.want, tt.wantErr)
		}
	}
	// Hashed gives httplimit.Hashed's key, so a secret sent over HTTP
	// and gRPC has one bucket.
	r := httptest.NewRequest("GET", "/", nil)
	r.Header.Set("X-API-Key", "first")
	want, _ := httplimit.Hashed(httplimit.Header("X-API-Key"))(r)
	if got, err := Hashed(Metadata("x-api-key"))(md, check); got != want || err != nil || len(got) != 32 {
		t.Errorf("Hashed = %q, %v; want httplimit's %q", got, err, want)
	}
}

// TestFromContextNilPointer: an authentication interceptor that stores
// a nil *User for anonymous calls must get the per-user rule skipped, as a
// missing value is. A panic in an interceptor is not recovered by grpc-go:
// it takes the whole server process down.
func TestFromContextNilPointer(t *testing.T) {
	lim, _ := newLimiter(t, hybridlimit.Config{Limit: hybridlimit.PerSecond(5)})
	ic := newInterceptor(t, Config{Rules: []Rule{{Name: "user", Limiter: lim, Key: FromContext(userCtxKey{})}}})
	var anon *nilableUser
	ctx := context.WithValue(callCtx(tcp("192.0.2.1:1")), userCtxKey{}, anon)
	served := false
	var err error
	func() {
		defer func() {
			if p := recover(); p != nil {
				t.Errorf("anonymous call (typed nil user in the context): interceptor panicked: %v", p)
			}
		}()
		_, err = ic.Unary(ctx, nil, &grpc.UnaryServerInfo{FullMethod: check},
			func(context.Context, any) (any, error) { served = true; return nil, nil })
	}()
	if err != nil || !served {
		t.Errorf("anonymous call: err %v, served %v; want served, rule skipped", err, served)
	}
}

type nilableUser struct{ id string }

func (u *nilableUser) String() string { return u.id }

type userCtxKey struct{}
