package httplimit

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"testing"
)

func prefixes(s ...string) []netip.Prefix {
	var ps []netip.Prefix
	for _, p := range s {
		ps = append(ps, netip.MustParsePrefix(p))
	}
	return ps
}

func request(remote string, kv ...string) *http.Request {
	r := httptest.NewRequest(http.MethodGet, "/", nil)
	r.RemoteAddr = remote
	for i := 0; i+1 < len(kv); i += 2 {
		r.Header.Add(kv[i], kv[i+1])
	}
	return r
}

func TestClientIP(t *testing.T) {
	proxies := prefixes("10.0.0.0/8", "2001:db8:ffff::/48")
	xff := ClientIP{TrustedProxies: proxies}
	fwd := ClientIP{TrustedProxies: proxies, Header: "forwarded"}
	real := ClientIP{TrustedProxies: proxies, Header: "X-Real-IP"}
	v6 := ClientIP{IPv6Prefix: 64}
	tests := []struct {
		name   string
		c      ClientIP
		remote string
		kv     []string
		want   string
	}{
		// No trusted proxy: the peer, whatever the headers say.
		{"peer", ClientIP{}, "192.0.2.1:1234", nil, "192.0.2.1"},
		{"peer ignores XFF", ClientIP{}, "192.0.2.1:1234", []string{"X-Forwarded-For", "203.0.113.9"}, "192.0.2.1"},
		{"untrusted XFF", xff, "192.0.2.1:1234", []string{"X-Forwarded-For", "203.0.113.9, 10.0.0.1"}, "192.0.2.1"},
		{"untrusted Forwarded", fwd, "192.0.2.1:1234", []string{"Forwarded", "for=203.0.113.9"}, "192.0.2.1"},
		{"untrusted X-Real-IP", real, "192.0.2.1:1234", []string{"X-Real-IP", "203.0.113.9"}, "192.0.2.1"},
		{"peer without port", ClientIP{}, "192.0.2.1", nil, "192.0.2.1"},
		{"peer IPv6", ClientIP{}, "[2001:db8::1]:443", nil, "2001:db8::1"},
		{"peer IPv4-mapped", ClientIP{}, "[::ffff:192.0.2.1]:443", nil, "192.0.2.1"},
		{"peer zone", ClientIP{}, "[fe80::1%eth0]:443", nil, "fe80::1"},

		// X-Forwarded-For from trusted proxies.
		{"one proxy", xff, "10.0.0.1:80", []string{"X-Forwarded-For", "203.0.113.9"}, "203.0.113.9"},
		{"spoofed left", xff, "10.0.0.1:80", []string{"X-Forwarded-For", "6.6.6.6, 203.0.113.9"}, "203.0.113.9"},
		{"chain", xff, "10.0.0.2:80", []string{"X-Forwarded-For", "6.6.6.6, 203.0.113.9, 10.1.1.1, 10.0.0.1"}, "203.0.113.9"},
		{"lines", xff, "10.0.0.2:80", []string{"X-Forwarded-For", "6.6.6.6", "X-Forwarded-For", "203.0.113.9, 10.0.0.1"}, "203.0.113.9"},
		{"all trusted", xff, "10.0.0.2:80", []string{"X-Forwarded-For", "10.3.3.3, 10.0.0.1"}, "10.3.3.3"},
		{"with port", xff, "10.0.0.1:80", []string{"X-Forwarded-For", "203.0.113.9:5555"}, "203.0.113.9"},
		{"IPv6 entry", xff, "10.0.0.1:80", []string{"X-Forwarded-For", "2001:db8::9"}, "2001:db8::9"},
		{"bracketed IPv6", xff, "10.0.0.1:80", []string{"X-Forwarded-For", "[2001:db8::9]:4711"}, "2001:db8::9"},
		{"IPv6 proxy", xff, "[2001:db8:ffff::1]:80", []string{"X-Forwarded-For", "203.0.113.9"}, "203.0.113.9"},
		{"garbage left of client", xff, "10.0.0.1:80", []string{"X-Forwarded-For", "<script>, 203.0.113.9"}, "203.0.113.9"},
		{"no header", xff, "10.0.0.1:80", nil, "10.0.0.1"},
		{"malformed", xff, "10.0.0.1:80", []string{"X-Forwarded-For", "not-an-ip"}, "10.0.0.1"},
		{"malformed past proxy", xff, "10.0.0.1:80", []string{"X-Forwarded-For", "nope, 10.0.0.5"}, "10.0.0.1"},
		{"empty entry", xff, "10.0.0.1:80", []string{"X-Forwarded-For", "203.0.113.9,"}, "10.0.0.1"},
		{"empty value", xff, "10.0.0.1:80", []string{"X-Forwarded-For", ""}, "10.0.0.1"},
		{"other header not read", xff, "10.0.0.1:80", []string{"Forwarded", "for=203.0.113.9"}, "10.0.0.1"},

		// Forwarded (RFC 7239) from trusted proxies.
		{"fwd", fwd, "10.0.0.1:80", []string{"Forwarded", "for=203.0.113.9;proto=https"}, "203.0.113.9"},
		{"fwd case", fwd, "10.0.0.1:80", []string{"Forwarded", "For=203.0.113.9"}, "203.0.113.9"},
		{"fwd quoted v6", fwd, "10.0.0.1:80", []string{"Forwarded", `for="[2001:db8:cafe::17]:4711"`}, "2001:db8:cafe::17"},
		{"fwd chain", fwd, "10.0.0.1:80", []string{"Forwarded", `for=6.6.6.6, for=203.0.113.9;by=10.0.0.2, for=10.0.0.2`}, "203.0.113.9"},
		{"fwd quoted comma", fwd, "10.0.0.1:80", []string{"Forwarded", `for=6.6.6.6;x="a,b", for=203.0.113.9;host="h,1", for=10.0.0.2`}, "203.0.113.9"},
		{"fwd unbalanced quote left", fwd, "10.0.0.1:80", []string{"Forwarded", `for="6.6.6.6, for=203.0.113.9`}, "203.0.113.9"},
		{"fwd unbalanced line", fwd, "10.0.0.1:80", []string{"Forwarded", `for="6.6.6.6`, "Forwarded", "for=203.0.113.9"}, "203.0.113.9"},
		{"fwd escaped quote", fwd, "10.0.0.1:80", []string{"Forwarded", `for=6.6.6.6, for=203.0.113.9;x="a\",b\\", for=10.0.0.2`}, "203.0.113.9"},
		{"fwd unknown", fwd, "10.0.0.1:80", []string{"Forwarded", "for=unknown"}, "10.0.0.1"},
		{"fwd obfuscated", fwd, "10.0.0.1:80", []string{"Forwarded", `for="_hidden"`}, "10.0.0.1"},
		{"fwd no for", fwd, "10.0.0.1:80", []string{"Forwarded", "proto=https"}, "10.0.0.1"},
		{"fwd two for", fwd, "10.0.0.1:80", []string{"Forwarded", "for=1.2.3.4;for=203.0.113.9"}, "10.0.0.1"},
		{"fwd garbage", fwd, "10.0.0.1:80", []string{"Forwarded", "for"}, "10.0.0.1"},
		{"fwd unterminated", fwd, "10.0.0.1:80", []string{"Forwarded", `for="203.0.113.9`}, "10.0.0.1"},
		{"fwd XFF not read", fwd, "10.0.0.1:80", []string{"X-Forwarded-For", "203.0.113.9"}, "10.0.0.1"},

		// One-address headers.
		{"real", real, "10.0.0.1:80", []string{"X-Real-IP", "203.0.113.9"}, "203.0.113.9"},
		{"real twice", real, "10.0.0.1:80", []string{"X-Real-IP", "6.6.6.6", "X-Real-IP", "203.0.113.9"}, "10.0.0.1"},
		{"real list", real, "10.0.0.1:80", []string{"X-Real-IP", "6.6.6.6, 203.0.113.9"}, "10.0.0.1"},

		// IPv6 grouping.
		{"v6 /64", v6, "[2001:db8:1:2:3:4:5:6]:443", nil, "2001:db8:1:2::/64"},
		{"v6 /64 v4", v6, "192.0.2.1:1", nil, "192.0.2.1"},
		{"v6 /64 mapped", v6, "[::ffff:192.0.2.1]:1", nil, "192.0.2.1"},
	}
	for _, tt := range tests {
		got, err := tt.c.Key(request(tt.remote, tt.kv...))
		if err != nil || got != tt.want {
			t.Errorf("%s: Key(RemoteAddr %q, %q) = %q, %v; want %q", tt.name, tt.remote, tt.kv, got, err, tt.want)
		}
	}
}

func TestClientIPErrors(t *testing.T) {
	if _, err := (ClientIP{}).Key(request("@")); !errors.Is(err, ErrNoClientIP) {
		t.Errorf("Key(RemoteAddr @) = %v; want ErrNoClientIP", err)
	}
	if _, err := (ClientIP{}).Key(request("")); !errors.Is(err, ErrNoClientIP) {
		t.Errorf("Key(RemoteAddr \"\") = %v; want ErrNoClientIP", err)
	}
	for _, bits := range []int{-1, 129} {
		if _, err := (ClientIP{IPv6Prefix: bits}).Key(request("192.0.2.1:1")); !errors.Is(err, ErrInvalidConfig) {
			t.Errorf("IPv6Prefix %d: Key = %v; want ErrInvalidConfig", bits, err)
		}
	}
}

// FuzzClientIP: any forwarding headers yield a valid address; from an
// untrusted peer, always the peer's.
func FuzzClientIP(f *testing.F) {
	f.Add("10.0.0.1:80", "6.6.6.6, 203.0.113.9", `for="[2001:db8::1]:1", for=203.0.113.9`)
	f.Add("192.0.2.1:80", "203.0.113.9", "for=203.0.113.9")
	f.Add("10.0.0.1:80", `"`, `for="\`)
	f.Add("10.0.0.1:80", ",,,", `;;for=1.2.3.4;;`)
	f.Fuzz(func(t *testing.T, remote, xff, fwd string) {
		for _, c := range []ClientIP{
			{TrustedProxies: prefixes("10.0.0.0/8")},
			{TrustedProxies: prefixes("10.0.0.0/8"), Header: Forwarded},
		} {
			r := request(remote, "X-Forwarded-For", xff, "Forwarded", fwd)
			a, err := c.Addr(r)
			peer, ok := parseAddr(remote)
			if !ok {
				if !errors.Is(err, ErrNoClientIP) {
					t.Fatalf("Addr(%q) = %v, %v; want ErrNoClientIP", remote, a, err)
				}
				continue
			}
			if err != nil || !a.IsValid() || a.Zone() != "" || a.Is4In6() {
				t.Fatalf("Addr(%q, %q, %q) = %v, %v", remote, xff, fwd, a, err)
			}
			if !c.trusted(peer) && a != peer {
				t.Fatalf("untrusted %q: Addr = %v; want the peer", remote, a)
			}
		}
	})
}

type stringer struct{ s string }

func (s stringer) String() string { return s.s }

func TestKeyFuncs(t *testing.T) {
	type ctxKey struct{}
	withValue := func(v any) *http.Request {
		r := request("192.0.2.1:1")
		return r.WithContext(context.WithValue(r.Context(), ctxKey{}, v))
	}
	tests := []struct {
		name    string
		k       KeyFunc
		r       *http.Request
		want    string
		wantErr bool
	}{
		{"header", Header("x-api-key"), request("192.0.2.1:1", "X-Api-Key", "k1"), "k1", false},
		{"header missing", Header("X-API-Key"), request("192.0.2.1:1"), "", false},
		{"context string", FromContext(ctxKey{}), withValue("alice"), "alice", false},
		{"context stringer", FromContext(ctxKey{}), withValue(stringer{"bob"}), "bob", false},
		{"context missing", FromContext(ctxKey{}), request("192.0.2.1:1"), "", false},
		{"context other type", FromContext(ctxKey{}), withValue(42), "", true},
		{"hashed", Hashed(Header("X-API-Key")), request("192.0.2.1:1", "X-API-Key", "secret"),
			"2bb80d537b1da3e38bd30361aa855686", false},
		{"hashed empty", Hashed(Header("X-API-Key")), request("192.0.2.1:1"), "", false},
		{"hashed error", Hashed(FromContext(ctxKey{})), withValue(42), "", true},
	}
	for _, tt := range tests {
		got, err := tt.k(tt.r)
		if got != tt.want || (err != nil) != tt.wantErr {
			t.Errorf("%s: key %q, %v; want %q, error %v", tt.name, got, err, tt.want, tt.wantErr)
		}
	}
}

func TestBucketKey(t *testing.T) {
	if got := RuleKey("ip", "192.0.2.1"); got != "ip:192.0.2.1" {
		t.Errorf("RuleKey = %q; want ip:192.0.2.1", got)
	}
	long := string(make([]byte, 2000))
	got := RuleKey("h", long)
	if len(got) != len("h:sha256:")+64 || got[:9] != "h:sha256:" {
		t.Errorf("RuleKey(long) = %q; want h:sha256:<64 hex>", got)
	}
	// A key from a request that holds a hash tag (a client picking its
	// bucket's Cluster shard, or naming a key the limiter reserves), or
	// that is written as the hash of another key, is hashed too.
	for _, key := range []string{"{same-shard}", "{hybridlimit-fleet:default}:1796259443", got[2:]} {
		h := RuleKey("h", key)
		if len(h) != len("h:sha256:")+64 || h[:9] != "h:sha256:" || h == got && key != long {
			t.Errorf("RuleKey(%q) = %q; want h:sha256:<64 hex> of it", key, h)
		}
	}
}
