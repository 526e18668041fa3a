package grpclimit

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/ratelimit"
	"github.com/redis/go-redis/v9"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/test/bufconn"

	"github.com/hybridlimit/hybridlimit"
	"github.com/hybridlimit/hybridlimit/httplimit"
)

// Interceptor must plug into go-grpc-middleware's ratelimit interceptors.
var _ ratelimit.Limiter = (*Interceptor)(nil)

func TestMain(m *testing.M) {
	// Tests that stop Redis make go-redis log every failed dial.
	redis.SetLogger(quiet{})
	m.Run()
}

type quiet struct{}

func (quiet) Printf(context.Context, string, ...any) {}

var discard = slog.New(slog.DiscardHandler)

// epoch is the miniredis clock: it stands still, so that Redis refills
// nothing between the calls of a test.
var epoch = time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)

const (
	check = "/grpc.health.v1.Health/Check"
	watch = "/grpc.health.v1.Health/Watch"
)

// newLimiter returns a Limiter on a fresh miniredis whose clock stands at
// epoch, with no heartbeat (shares stay 1/Instances) and a Timeout of 2 s
// unless cfg has one, both closed by t.Cleanup.
func newLimiter(t *testing.T, cfg hybridlimit.Config) (*hybridlimit.Limiter, *miniredis.Miniredis) {
	t.Helper()
	m := miniredis.RunT(t)
	m.SetTime(epoch)
	c := redis.NewClient(&redis.Options{Addr: m.Addr()})
	t.Cleanup(func() { c.Close() })
	cfg.Redis = c
	cfg.Heartbeat = -1
	if cfg.Instances == 0 {
		cfg.Instances = 1 // without a heartbeat, the share must be said
	}
	if cfg.Timeout == 0 {
		// The default 50 ms is short for a race-detecting run on a busy
		// machine, where a late answer would make a decision degraded.
		cfg.Timeout = 2 * time.Second
	}
	lim, err := hybridlimit.New(cfg)
	if err != nil {
		t.Fatalf("hybridlimit.New: %v", err)
	}
	t.Cleanup(func() { lim.Close() })
	return lim, m
}

// newInterceptor returns New(cfg), failing t on an error.
func newInterceptor(t *testing.T, cfg Config) *Interceptor {
	t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = discard
	}
	ic, err := New(cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	return ic
}

// health is the service under test: Check answers, Watch sends one
// message; both count the calls they serve.
type health struct {
	healthpb.UnimplementedHealthServer
	served atomic.Int64
}

func (h *health) Check(context.Context, *healthpb.HealthCheckRequest) (*healthpb.HealthCheckResponse, error) {
	h.served.Add(1)
	return &healthpb.HealthCheckResponse{Status: healthpb.HealthCheckResponse_SERVING}, nil
}

func (h *health) Watch(_ *healthpb.HealthCheckRequest, s healthpb.Health_WatchServer) error {
	h.served.Add(1)
	return s.Send(&healthpb.HealthCheckResponse{Status: healthpb.HealthCheckResponse_SERVING})
}

// peerListener is a bufconn listener whose connections report addr as
// their remote address, so that the server sees the client at addr.
type peerListener struct {
	*bufconn.Listener
	addr net.Addr
}

func (l peerListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return peerConn{c, l.addr}, nil
}

type peerConn struct {
	net.Conn
	addr net.Addr
}

func (c peerConn) RemoteAddr() net.Addr { return c.addr }

// serve starts a gRPC server with opts over bufconn, which sees its
// client at peer ("192.0.2.1:1234"; "" for bufconn's own address), and
// returns a client of its health service. t.Cleanup stops both.
func serve(t *testing.T, peer string, opts ...grpc.ServerOption) (healthpb.HealthClient, *health) {
	t.Helper()
	bl := bufconn.Listen(1 << 20)
	var lis net.Listener = bl
	if peer != "" {
		lis = peerListener{bl, net.TCPAddrFromAddrPort(netip.MustParseAddrPort(peer))}
	}
	srv := grpc.NewServer(opts...)
	h := &health{}
	healthpb.RegisterHealthServer(srv, h)
	go srv.Serve(lis)
	t.Cleanup(srv.Stop)
	cc, err := grpc.NewClient("passthrough:///bufnet",
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return bl.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatalf("grpc.NewClient: %v", err)
	}
	t.Cleanup(func() { cc.Close() })
	return healthpb.NewHealthClient(cc), h
}

// serveWith is serve with ic's unary and stream interceptors.
func serveWith(t *testing.T, peer string, ic *Interceptor) (healthpb.HealthClient, *health) {
	t.Helper()
	return serve(t, peer, grpc.ChainUnaryInterceptor(ic.Unary), grpc.ChainStreamInterceptor(ic.Stream))
}

// outcome is what a client saw of one call.
type outcome struct {
	code   codes.Code
	policy string // ratelimit-policy
	limit  string // ratelimit
	retry  time.Duration
}

// outcomeOf describes a call's error and response header.
func outcomeOf(t *testing.T, err error, hdr metadata.MD) outcome {
	t.Helper()
	st := status.Convert(err)
	o := outcome{code: st.Code(), policy: strings.Join(hdr.Get(MetadataPolicy), ", "),
		limit: strings.Join(hdr.Get(MetadataRateLimit), ", ")}
	for _, d := range st.Details() {
		if ri, ok := d.(*errdetails.RetryInfo); ok {
			o.retry = ri.RetryDelay.AsDuration()
		}
	}
	return o
}

// unary makes a Check call with the metadata pairs kv.
func unary(t *testing.T, c healthpb.HealthClient, kv ...string) outcome {
	t.Helper()
	ctx := metadata.NewOutgoingContext(t.Context(), metadata.Pairs(kv...))
	var hdr metadata.MD
	_, err := c.Check(ctx, &healthpb.HealthCheckRequest{}, grpc.Header(&hdr))
	return outcomeOf(t, err, hdr)
}

// stream opens a Watch stream with the metadata pairs kv and reads it to
// its end.
func stream(t *testing.T, c healthpb.HealthClient, kv ...string) outcome {
	t.Helper()
	ctx := metadata.NewOutgoingContext(t.Context(), metadata.Pairs(kv...))
	s, err := c.Watch(ctx, &healthpb.HealthCheckRequest{})
	if err != nil {
		t.Fatalf("Watch: %v", err)
	}
	for err == nil {
		_, err = s.Recv()
	}
	if err == io.EOF {
		err = nil
	}
	hdr, herr := s.Header()
	if herr != nil && err == nil {
		t.Errorf("Header: %v", herr)
	}
	return outcomeOf(t, err, hdr)
}

// run makes one call per step with call, checking each outcome exactly but
// for retry, which may be less than the step's but not zero: Redis's clock
// stands still, but a denial that the limiter answers from what Redis last
// said counts down on the local clock, by however long a loaded machine
// took. TestDenialDetails checks RetryInfo exactly.
func run(t *testing.T, call func() outcome, steps []outcome) {
	t.Helper()
	for i, want := range steps {
		got := call()
		if got.retry <= want.retry && got.retry > 0 {
			got.retry = want.retry
		}
		if got != want {
			t.Errorf("call %d = %+v; want %+v", i+1, got, want)
		}
	}
}

var perIP = ClientIP{}.Key

func TestUnary(t *testing.T) {
	lim, _ := newLimiter(t, hybridlimit.Config{Limit: hybridlimit.Limit{Rate: 1, Burst: 3}})
	ic := newInterceptor(t, Config{Rules: []Rule{{Name: "ip", Limiter: lim, Key: perIP}}})
	c, h := serveWith(t, "192.0.2.1:1234", ic)
	const pol = `"ip";q=3;w=3`
	run(t, func() outcome { return unary(t, c) }, []outcome{
		{codes.OK, pol, `"ip";r=2;t=1`, 0},
		{codes.OK, pol, `"ip";r=1;t=2`, 0},
		{codes.OK, pol, `"ip";r=0;t=3`, 0},
		{codes.ResourceExhausted, pol, `"ip";r=0;t=1`, time.Second},
		{codes.ResourceExhausted, pol, `"ip";r=0;t=1`, time.Second},
	})
	if n := h.served.Load(); n != 3 {
		t.Errorf("served %d calls; want 3", n)
	}
}

func TestStream(t *testing.T) {
	lim, _ := newLimiter(t, hybridlimit.Config{Limit: hybridlimit.Limit{Rate: 1, Burst: 2}})
	ic := newInterceptor(t, Config{Rules: []Rule{{Name: "ip", Limiter: lim, Key: perIP}}})
	c, h := serveWith(t, "192.0.2.1:1234", ic)
	const pol = `"ip";q=2;w=2`
	run(t, func() outcome { return stream(t, c) }, []outcome{
		{codes.OK, pol, `"ip";r=1;t=1`, 0},
		{codes.OK, pol, `"ip";r=0;t=2`, 0},
		{codes.ResourceExhausted, pol, `"ip";r=0;t=1`, time.Second},
	})
	if n := h.served.Load(); n != 2 {
		t.Errorf("served %d streams; want 2", n)
	}
	// Unary calls and streams of one client share the rule's bucket.
	if got := unary(t, c); got.code != codes.ResourceExhausted {
		t.Errorf("Check after the streams = %+v; want ResourceExhausted", got)
	}
}

func TestDenialDetails(t *testing.T) {
	// 2 tokens a second: the next one is due in exactly 500 ms, which
	// RetryInfo carries as it is and the t parameter rounds up.
	lim, _ := newLimiter(t, hybridlimit.Config{Limit: hybridlimit.Limit{Rate: 2, Burst: 1}})
	var seen Denial
	ic := newInterceptor(t, Config{Rules: []Rule{{Name: "ip", Limiter: lim, Key: perIP}},
		DenyHandler: func(ctx context.Context, d Denial) error {
			seen = d
			return DefaultDenyHandler(ctx, d)
		}})
	c, _ := serveWith(t, "192.0.2.1:1234", ic)
	unary(t, c)
	_, err := c.Check(t.Context(), &healthpb.HealthCheckRequest{})
	st := status.Convert(err)
	if st.Code() != codes.ResourceExhausted || st.Message() != "too many requests" {
		t.Fatalf("status = %v; want ResourceExhausted, \"too many requests\"", st)
	}
	var ri *errdetails.RetryInfo
	var qf *errdetails.QuotaFailure
	for _, d := range st.Details() {
		switch d := d.(type) {
		case *errdetails.RetryInfo:
			ri = d
		case *errdetails.QuotaFailure:
			qf = d
		default:
			t.Errorf("unexpected detail %T %v", d, d)
		}
	}
	// The limiter's RetryAfter to the millisecond, not rounded to seconds
	// as the t parameter is: at most 500 ms, less by the time since Redis
	// answered (see run).
	if got := ri.GetRetryDelay().AsDuration(); got != seen.RetryAfter || got != retryDelay(seen.Decision.RetryAfter) ||
		got > 500*time.Millisecond || got <= 0 {
		t.Errorf("RetryInfo = %v; want RetryDelay %v, the decision's %v rounded up to a millisecond, at most 500ms",
			ri, seen.RetryAfter, seen.Decision.RetryAfter)
	}
	if got := unary(t, c).limit; got != `"ip";r=0;t=1` {
		t.Errorf("ratelimit = %q; want t=1, rounded up", got)
	}
	if qf == nil || len(qf.Violations) != 1 || qf.Violations[0].Subject != "rule:ip" {
		t.Errorf("QuotaFailure = %v; want one violation of rule:ip", qf)
	}
	if strings.Contains(st.String(), "192.0.2.1") {
		t.Errorf("status %v holds the key", st)
	}
}

func TestRetryDelay(t *testing.T) {
	for _, tt := range []struct{ in, want time.Duration }{
		{0, time.Millisecond},
		{-time.Second, time.Millisecond},
		{time.Microsecond, time.Millisecond},
		{time.Millisecond, time.Millisecond},
		{1001 * time.Microsecond, 2 * time.Millisecond},
		{1500 * time.Millisecond, 1500 * time.Millisecond},
	} {
		if got := retryDelay(tt.in); got != tt.want {
			t.Errorf("retryDelay(%v) = %v; want %v", tt.in, got, tt.want)
		}
	}
}

func TestSeveralRulesRefund(t *testing.T) {
	ipLim, _ := newLimiter(t, hybridlimit.Config{Limit: hybridlimit.Limit{Rate: 1, Burst: 5}})
	userLim, _ := newLimiter(t, hybridlimit.Config{Limit: hybridlimit.Limit{Rate: 1, Burst: 1}})
	ic := newInterceptor(t, Config{Rules: []Rule{
		{Name: "ip", Limiter: ipLim, Key: perIP},
		{Name: "user", Limiter: userLim, Key: Metadata("X-User")},
	}})
	c, h := serveWith(t, "192.0.2.1:1234", ic)
	const pol = `"user";q=1;w=1, "ip";q=5;w=5`
	call := func(user string) func() outcome {
		return func() outcome { return unary(t, c, "x-user", user) }
	}
	run(t, call("alice"), []outcome{
		{codes.OK, pol, `"user";r=0;t=1, "ip";r=4;t=1`, 0},
		// The user rule denies; the ip token is given back, and r says so
		// (t stays that of the grant, an upper bound).
		{codes.ResourceExhausted, pol, `"user";r=0;t=1, "ip";r=4;t=2`, time.Second},
		{codes.ResourceExhausted, pol, `"user";r=0;t=1, "ip";r=4;t=2`, time.Second},
	})
	// Redis has the refunds: bob's call finds 4 ip tokens, not 2.
	run(t, call("bob"), []outcome{{codes.OK, pol, `"user";r=0;t=1, "ip";r=3;t=2`, 0}})
	// A call without the user key skips that rule.
	run(t, func() outcome { return unary(t, c) }, []outcome{{codes.OK, `"ip";q=5;w=5`, `"ip";r=2;t=3`, 0}})
	if n := h.served.Load(); n != 3 {
		t.Errorf("served %d calls; want 3", n)
	}
}

func TestMethods(t *testing.T) {
	lim, _ := newLimiter(t, hybridlimit.Config{Limit: hybridlimit.Limit{Rate: 1, Burst: 1}})
	ic := newInterceptor(t, Config{Rules: []Rule{
		{Name: "check", Limiter: lim, Key: FullMethod, Methods: []string{check}},
		{Name: "svc", Limiter: lim, Key: FullMethod, Methods: []string{"/other.Service/", "/grpc.health.v1.Health/"}},
		{Name: "none", Limiter: lim, Key: FullMethod, Methods: []string{"/other.Service/Check"}},
	}})
	c, _ := serveWith(t, "192.0.2.1:1234", ic)
	// Check is under "check" and "svc"; the watch stream under "svc" only,
	// and in its own bucket, keyed by its method.
	run(t, func() outcome { return unary(t, c) }, []outcome{
		{codes.OK, `"check";q=1;w=1, "svc";q=1;w=1`, `"check";r=0;t=1, "svc";r=0;t=1`, 0},
		{codes.ResourceExhausted, `"check";q=1;w=1`, `"check";r=0;t=1`, time.Second},
	})
	run(t, func() outcome { return stream(t, c) }, []outcome{
		{codes.OK, `"svc";q=1;w=1`, `"svc";r=0;t=1`, 0},
		{codes.ResourceExhausted, `"svc";q=1;w=1`, `"svc";r=0;t=1`, time.Second},
	})
}

func TestTrustedProxies(t *testing.T) {
	lim, _ := newLimiter(t, hybridlimit.Config{Limit: hybridlimit.Limit{Rate: 1, Burst: 1}})
	ip := ClientIP{TrustedProxies: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}}
	ic := newInterceptor(t, Config{Rules: []Rule{{Name: "ip", Limiter: lim, Key: ip.Key}}})
	// One interceptor, two servers: behind the proxy at 10.0.0.1, and
	// reached directly from 198.51.100.7.
	proxied, _ := serveWith(t, "10.0.0.1:5555", ic)
	direct, _ := serveWith(t, "198.51.100.7:5555", ic)
	code := func(c healthpb.HealthClient, xff string) codes.Code {
		return unary(t, c, "x-forwarded-for", xff).code
	}
	steps := []struct {
		name string
		c    healthpb.HealthClient
		xff  string
		want codes.Code
	}{
		{"proxied client", proxied, "6.6.6.6, 203.0.113.9", codes.OK},
		// The client changed what it sent itself: the same key.
		{"proxied client, spoofed part changed", proxied, "7.7.7.7, 203.0.113.9", codes.ResourceExhausted},
		{"another proxied client", proxied, "203.0.113.10", codes.OK},
		// Not from a proxy: its x-forwarded-for is not read, so it
		// neither takes 203.0.113.11's bucket nor gets fresh ones.
		{"direct client", direct, "203.0.113.11", codes.OK},
		{"direct client, spoofed", direct, "203.0.113.12", codes.ResourceExhausted},
		{"proxied client that direct claimed", proxied, "203.0.113.11", codes.OK},
	}
	for _, s := range steps {
		if got := code(s.c, s.xff); got != s.want {
			t.Errorf("%s (x-forwarded-for %q) = %v; want %v", s.name, s.xff, got, s.want)
		}
	}
}

func TestLoopbackPeer(t *testing.T) {
	// A real TCP connection: the key is the peer address grpc-go reports.
	lim, _ := newLimiter(t, hybridlimit.Config{Limit: hybridlimit.Limit{Rate: 1, Burst: 1}})
	var keys atomic.Value
	key := func(ctx context.Context, m string) (string, error) {
		k, err := perIP(ctx, m)
		keys.Store(k)
		return k, err
	}
	ic := newInterceptor(t, Config{Rules: []Rule{{Name: "ip", Limiter: lim, Key: key}}})
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(ic.Unary))
	healthpb.RegisterHealthServer(srv, &health{})
	go srv.Serve(lis)
	defer srv.Stop()
	cc, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	run(t, func() outcome { return unary(t, healthpb.NewHealthClient(cc)) }, []outcome{
		{codes.OK, `"ip";q=1;w=1`, `"ip";r=0;t=1`, 0},
		{codes.ResourceExhausted, `"ip";q=1;w=1`, `"ip";r=0;t=1`, time.Second},
	})
	if got := keys.Load(); got != "127.0.0.1" {
		t.Errorf("key = %v; want 127.0.0.1", got)
	}
}

func TestDegraded(t *testing.T) {
	// Redis goes away: the local share decides, and both members say so.
	// A token every 100 s: the local bucket, on the local clock, refills
	// nothing during the test however slow the machine.
	lim, m := newLimiter(t, hybridlimit.Config{Limit: hybridlimit.Limit{Rate: 0.01, Burst: 3}})
	ic := newInterceptor(t, Config{Rules: []Rule{{Name: "ip", Limiter: lim, Key: perIP}}})
	c, _ := serveWith(t, "192.0.2.1:1234", ic)
	run(t, func() outcome { return unary(t, c) }, []outcome{{codes.OK, `"ip";q=3;w=300`, `"ip";r=2;t=100`, 0}})
	m.Close()
	// The local bucket starts from what Redis last said (2 left); the
	// local clock runs, so t may be rounded either way and is not checked.
	for i, wantCode := range []codes.Code{codes.OK, codes.OK, codes.ResourceExhausted} {
		got := unary(t, c)
		if got.code != wantCode || got.policy != `"ip";q=3;w=300;hl-degraded` ||
			!strings.HasPrefix(got.limit, `"ip";r=`) || !strings.HasSuffix(got.limit, ";hl-degraded") {
			t.Errorf("call %d with Redis down = %+v; want %v with hl-degraded members", i+1, got, wantCode)
		}
	}
	got := stream(t, c)
	if got.code != codes.ResourceExhausted || !strings.HasSuffix(got.limit, ";hl-degraded") {
		t.Errorf("stream with Redis down = %+v; want ResourceExhausted, hl-degraded", got)
	}
}

func TestShadow(t *testing.T) {
	lim, _ := newLimiter(t, hybridlimit.Config{Limit: hybridlimit.Limit{Rate: 1, Burst: 1}, Shadow: true})
	ic := newInterceptor(t, Config{Rules: []Rule{{Name: "ip", Limiter: lim, Key: perIP}}})
	c, h := serveWith(t, "192.0.2.1:1234", ic)
	for i, want := range []string{"", "deny"} {
		var hdr metadata.MD
		_, err := c.Check(t.Context(), &healthpb.HealthCheckRequest{}, grpc.Header(&hdr))
		if err != nil {
			t.Fatalf("call %d: %v", i+1, err)
		}
		if got := strings.Join(hdr.Get(MetadataShadow), ","); got != want {
			t.Errorf("call %d: %s = %q; want %q", i+1, MetadataShadow, got, want)
		}
	}
	if n := h.served.Load(); n != 2 {
		t.Errorf("served %d calls; want 2", n)
	}
}

func TestErrors(t *testing.T) {
	lim, _ := newLimiter(t, hybridlimit.Config{Limit: hybridlimit.Limit{Rate: 1, Burst: 5}})
	closed, _ := newLimiter(t, hybridlimit.Config{Limit: hybridlimit.PerSecond(5)})
	closed.Close()
	boom := errors.New("boom")
	failing := func(context.Context, string) (string, error) { return "", boom }
	var logged atomic.Int64
	logger := slog.New(countHandler{&logged})

	tests := []struct {
		name   string
		cfg    Config
		want   codes.Code
		served int64
	}{
		{"key error", Config{Rules: []Rule{{Name: "k", Limiter: lim, Key: failing}}}, codes.Internal, 0},
		// Every call while the server shuts down: logged at Debug, not
		// as an Error each.
		{"closed limiter", Config{Rules: []Rule{{Name: "c", Limiter: closed, Key: perIP}}}, codes.Unavailable, 0},
		{"pass on error", Config{Rules: []Rule{{Name: "p", Limiter: lim, Key: failing}}, PassOnError: true}, codes.OK, 1},
		{"error handler", Config{Rules: []Rule{{Name: "e", Limiter: lim, Key: failing}},
			ErrorHandler: func(_ context.Context, method string, err error) error {
				if method != check || !errors.Is(err, boom) {
					t.Errorf("ErrorHandler(%q, %v); want %q and boom", method, err, check)
				}
				return status.Error(codes.FailedPrecondition, "no")
			}}, codes.FailedPrecondition, 0},
		{"error handler returning nil", Config{Rules: []Rule{{Name: "n", Limiter: lim, Key: failing}},
			ErrorHandler: func(context.Context, string, error) error { return nil }}, codes.Internal, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			logged.Store(0)
			tt.cfg.Logger = logger
			c, h := serveWith(t, "192.0.2.1:1234", newInterceptor(t, tt.cfg))
			if got := unary(t, c).code; got != tt.want {
				t.Errorf("code = %v; want %v", got, tt.want)
			}
			if n := h.served.Load(); n != tt.served {
				t.Errorf("served %d; want %d", n, tt.served)
			}
			want := int64(1)
			if tt.want == codes.Unavailable {
				want = 0
			}
			if logged.Load() != want {
				t.Errorf("logged %d errors; want %d", logged.Load(), want)
			}
		})
	}
}

// countHandler is a slog.Handler that counts the records at level Error.
type countHandler struct{ n *atomic.Int64 }

func (h countHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h countHandler) Handle(_ context.Context, r slog.Record) error {
	if r.Level == slog.LevelError {
		h.n.Add(1)
	}
	return nil
}
func (h countHandler) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h countHandler) WithGroup(string) slog.Handler      { return h }

func TestErrorRefunds(t *testing.T) {
	// The first rule's token is given back when the second cannot decide.
	lim, _ := newLimiter(t, hybridlimit.Config{Limit: hybridlimit.Limit{Rate: 1, Burst: 5}})
	ic := newInterceptor(t, Config{Rules: []Rule{
		{Name: "ip", Limiter: lim, Key: perIP},
		{Name: "bad", Limiter: lim, Key: func(context.Context, string) (string, error) { return "", errors.New("bad") }},
	}})
	c, _ := serveWith(t, "192.0.2.1:1234", ic)
	for range 3 {
		if got := unary(t, c).code; got != codes.Internal {
			t.Fatalf("code = %v; want Internal", got)
		}
	}
	ic = newInterceptor(t, Config{Rules: []Rule{{Name: "ip", Limiter: lim, Key: perIP}}})
	c, _ = serveWith(t, "192.0.2.1:1234", ic)
	if got := unary(t, c); got.limit != `"ip";r=4;t=1` {
		t.Errorf("after 3 refunded calls: ratelimit %q; want r=4", got.limit)
	}
}

func TestCallerContextEnded(t *testing.T) {
	// Called directly: a client cannot make a call arrive with its
	// context already ended.
	lim, _ := newLimiter(t, hybridlimit.Config{Limit: hybridlimit.Limit{Rate: 1, Burst: 5}})
	first, _ := newLimiter(t, hybridlimit.Config{Limit: hybridlimit.Limit{Rate: 1, Burst: 5}})
	var logged atomic.Int64
	var cancel context.CancelFunc
	ic := newInterceptor(t, Config{Logger: slog.New(countHandler{&logged}), Rules: []Rule{
		{Name: "first", Limiter: first, Key: Metadata("x-user")},
		// The caller goes away between the two rules.
		{Name: "second", Limiter: lim, Key: func(context.Context, string) (string, error) { cancel(); return "k", nil }},
	}})
	for _, tt := range []struct {
		name string
		ctx  func() context.Context
		want codes.Code
	}{
		{"canceled", func() context.Context {
			ctx, c := context.WithCancel(context.Background())
			cancel = c
			return ctx
		}, codes.Canceled},
		{"deadline", func() context.Context {
			// Past its deadline before the first rule: no rule decides.
			ctx, c := context.WithDeadline(context.Background(), time.Now().Add(-time.Second))
			cancel = c
			return ctx
		}, codes.DeadlineExceeded},
	} {
		ctx := metadata.NewIncomingContext(tt.ctx(), metadata.Pairs("x-user", "u"))
		defer cancel()
		served := false
		_, err := ic.Unary(ctx, nil, &grpc.UnaryServerInfo{FullMethod: check},
			func(context.Context, any) (any, error) { served = true; return nil, nil })
		if got := status.Code(err); got != tt.want || served {
			t.Errorf("%s: code %v, served %v; want %v, not served", tt.name, got, served, tt.want)
		}
	}
	if logged.Load() != 0 {
		t.Errorf("logged %d errors; want none for a caller that went away", logged.Load())
	}
	// The canceled call's first-rule token went back; the deadline one
	// ended before the first rule decided.
	d, err := first.Allow(context.Background(), "first:u")
	if err != nil || d.Remaining != 4 {
		t.Errorf("first rule's bucket: %+v, %v; want 4 remaining", d, err)
	}
}

func TestGoGRPCMiddleware(t *testing.T) {
	lim, _ := newLimiter(t, hybridlimit.Config{Limit: hybridlimit.Limit{Rate: 1, Burst: 1}})
	ic := newInterceptor(t, Config{Rules: []Rule{
		{Name: "ip", Limiter: lim, Key: perIP},
		{Name: "watch", Limiter: lim, Key: FullMethod, Methods: []string{watch}},
	}})
	c, h := serve(t, "192.0.2.1:1234",
		grpc.ChainUnaryInterceptor(ratelimit.UnaryServerInterceptor(ic)),
		grpc.ChainStreamInterceptor(ratelimit.StreamServerInterceptor(ic)))
	var hdr metadata.MD
	_, err := c.Check(t.Context(), &healthpb.HealthCheckRequest{}, grpc.Header(&hdr))
	if err != nil {
		t.Fatalf("first call: %v", err)
	}
	if got := hdr.Get(MetadataRateLimit); len(got) != 1 || got[0] != `"ip";r=0;t=1` {
		t.Errorf("ratelimit = %q; want \"ip\";r=0;t=1", got)
	}
	_, err = c.Check(t.Context(), &healthpb.HealthCheckRequest{}, grpc.Header(&hdr))
	st := status.Convert(err)
	if st.Code() != codes.ResourceExhausted || !strings.Contains(st.Message(), `grpclimit: too many requests: rule "ip": retry after `) {
		t.Errorf("denial = %v; want ResourceExhausted saying rule \"ip\" and the delay", st)
	}
	if got := hdr.Get(MetadataRateLimit); len(got) != 1 || got[0] != `"ip";r=0;t=1` {
		t.Errorf("ratelimit on the denial = %q; want \"ip\";r=0;t=1", got)
	}
	// grpc.Method finds the stream's method, so the watch rule applies to
	// streams only. The ip rule denies first; its "watch" has no tokens
	// taken.
	got := stream(t, c)
	if got.code != codes.ResourceExhausted || got.limit != `"ip";r=0;t=1` {
		// No RetryInfo: these interceptors drop the details.
		t.Errorf("stream = %+v; want ResourceExhausted by ip", got)
	}
	if n := h.served.Load(); n != 1 {
		t.Errorf("served %d; want 1", n)
	}

	// Limit called directly says what denied it, and errors.Is finds it.
	ic = newInterceptor(t, Config{Rules: []Rule{{Name: "key", Limiter: lim, Key: Metadata("x-key")}}})
	ctx := metadata.NewIncomingContext(t.Context(), metadata.Pairs("x-key", "k"))
	if err := ic.Limit(ctx); err != nil {
		t.Fatalf("Limit: %v", err)
	}
	if err := ic.Limit(ctx); !errors.Is(err, ErrLimited) {
		t.Errorf("Limit = %v; want ErrLimited", err)
	}
}

func TestDenyHandler(t *testing.T) {
	lim, _ := newLimiter(t, hybridlimit.Config{Limit: hybridlimit.Limit{Rate: 1, Burst: 1}})
	var seen Denial
	ic := newInterceptor(t, Config{Rules: []Rule{{Name: "ip", Limiter: lim, Key: perIP}},
		DenyHandler: func(ctx context.Context, d Denial) error {
			seen = d
			return status.Error(codes.Unavailable, "slow down")
		}})
	c, _ := serveWith(t, "192.0.2.1:1234", ic)
	unary(t, c)
	_, err := c.Check(t.Context(), &healthpb.HealthCheckRequest{})
	if st := status.Convert(err); st.Code() != codes.Unavailable || st.Message() != "slow down" {
		t.Errorf("status = %v; want DenyHandler's", st)
	}
	if seen.Rule != "ip" || seen.Method != check || seen.Key != "192.0.2.1" || seen.Decision.Allowed ||
		seen.RetryAfter != retryDelay(seen.Decision.RetryAfter) || seen.RetryAfter > time.Second {
		t.Errorf("Denial = %+v", seen)
	}
	// A DenyHandler that returns nil still denies.
	ic = newInterceptor(t, Config{Rules: []Rule{{Name: "ip", Limiter: lim, Key: perIP}},
		DenyHandler: func(context.Context, Denial) error { return nil }})
	c, h := serveWith(t, "192.0.2.1:1234", ic)
	if got := unary(t, c).code; got != codes.ResourceExhausted || h.served.Load() != 0 {
		t.Errorf("with a nil from DenyHandler: %v, served %d; want ResourceExhausted, 0", got, h.served.Load())
	}
}

func TestNewRejectsBadConfig(t *testing.T) {
	lim, _ := newLimiter(t, hybridlimit.Config{Limit: hybridlimit.PerSecond(5)})
	ok := Rule{Name: "ok", Limiter: lim, Key: perIP}
	with := func(f func(*Rule)) []Rule { r := ok; f(&r); return []Rule{r} }
	tests := []struct {
		name  string
		rules []Rule
	}{
		{"no rules", nil},
		{"empty name", with(func(r *Rule) { r.Name = "" })},
		{"colon in name", with(func(r *Rule) { r.Name = "a:b" })},
		{"control in name", with(func(r *Rule) { r.Name = "a\nb" })},
		{"name used twice", []Rule{ok, ok}},
		{"nil limiter", with(func(r *Rule) { r.Limiter = nil })},
		{"nil key", with(func(r *Rule) { r.Key = nil })},
		{"negative cost", with(func(r *Rule) { r.Cost = -1 })},
		{"cost above burst", with(func(r *Rule) { r.Cost = 6 })},
		{"method without slash", with(func(r *Rule) { r.Methods = []string{"pkg.Service/Method"} })},
		{"method without service", with(func(r *Rule) { r.Methods = []string{"//Method"} })},
		{"method with three parts", with(func(r *Rule) { r.Methods = []string{"/a/b/c"} })},
		{"method with no method part", with(func(r *Rule) { r.Methods = []string{"/pkg.Service"} })},
	}
	for _, tt := range tests {
		ic, err := New(Config{Rules: tt.rules})
		if !errors.Is(err, ErrInvalidConfig) || ic != nil {
			t.Errorf("%s: New = %v, %v; want nil, ErrInvalidConfig", tt.name, ic, err)
		}
	}
	if _, err := New(Config{Rules: with(func(r *Rule) { r.Methods = []string{check, "/pkg.Service/"}; r.Cost = 5 })}); err != nil {
		t.Errorf("New with valid Methods and Cost = burst: %v", err)
	}
}

func TestSharesBucketsWithHTTP(t *testing.T) {
	// An httplimit rule and a gRPC rule with one Name and Limiter draw on
	// one bucket per client.
	lim, _ := newLimiter(t, hybridlimit.Config{Limit: hybridlimit.Limit{Rate: 1, Burst: 2}})
	mw, err := httplimit.New(httplimit.Config{Logger: discard,
		Rules: []httplimit.Rule{{Name: "ip", Limiter: lim, Key: httplimit.ClientIP{}.Key}}})
	if err != nil {
		t.Fatal(err)
	}
	r := httptest.NewRequest("GET", "/", nil)
	r.RemoteAddr = "192.0.2.1:999"
	w := httptest.NewRecorder()
	mw.Handler(http.NotFoundHandler()).ServeHTTP(w, r)
	if got := w.Header().Get(httplimit.HeaderRateLimit); got != `"ip";r=1;t=1` {
		t.Fatalf("HTTP RateLimit = %q", got)
	}
	c, _ := serveWith(t, "192.0.2.1:1234", newInterceptor(t, Config{Rules: []Rule{{Name: "ip", Limiter: lim, Key: perIP}}}))
	run(t, func() outcome { return unary(t, c) }, []outcome{
		{codes.OK, `"ip";q=2;w=2`, `"ip";r=0;t=2`, 0},
		{codes.ResourceExhausted, `"ip";q=2;w=2`, `"ip";r=0;t=1`, time.Second},
	})
}

// TestKeyFuncOwnTimeout: a KeyFunc (Identity) that asks an auth
// service under its own time-out fails with an error wrapping
// context.DeadlineExceeded while the caller's call is alive. The call is
// then treated as if the caller's deadline had passed: PassOnError is
// ignored (the call is refused), nothing is logged, ErrorHandler is not
// asked, and the KeyFunc's error text is sent to the client in the status
// message.
func TestKeyFuncOwnTimeout(t *testing.T) {
	lim, _ := newLimiter(t, hybridlimit.Config{Limit: hybridlimit.PerSecond(5)})
	var logged atomic.Int64
	introspect := Identity(func(ctx context.Context) (string, error) {
		actx, cancel := context.WithTimeout(context.Background(), time.Millisecond)
		defer cancel()
		<-actx.Done()
		return "", fmt.Errorf("POST https://auth.internal:8443/introspect: %w", actx.Err())
	})
	ic := newInterceptor(t, Config{PassOnError: true, Logger: slog.New(countHandler{&logged}),
		Rules: []Rule{{Name: "user", Limiter: lim, Key: introspect}}})
	ctx, cancel := context.WithTimeout(callCtx(tcp("192.0.2.1:1")), time.Minute) // the caller's deadline is far
	defer cancel()
	served := false
	_, err := ic.Unary(ctx, nil, &grpc.UnaryServerInfo{FullMethod: check},
		func(context.Context, any) (any, error) { served = true; return nil, nil })
	if !served || err != nil {
		t.Errorf("PassOnError, KeyFunc's own time-out: err %v, served %v; want served (rule skipped)", err, served)
	}
	if logged.Load() != 1 {
		t.Errorf("logged %d errors; want 1", logged.Load())
	}
	// Without PassOnError: the default ErrorHandler's Unavailable (a
	// time-out of the server's own: transient), saying nothing of the
	// error.
	ic = newInterceptor(t, Config{Rules: []Rule{{Name: "user", Limiter: lim, Key: introspect}}})
	_, err = ic.Unary(ctx, nil, &grpc.UnaryServerInfo{FullMethod: check},
		func(context.Context, any) (any, error) { return nil, nil })
	st := status.Convert(err)
	if st.Code() != codes.Unavailable || strings.Contains(st.Message(), "auth.internal") {
		t.Errorf("KeyFunc's own time-out: status %v %q; want Unavailable with a message saying nothing of the error",
			st.Code(), st.Message())
	}
}

// TestLimitClientSide: on the client side (go-grpc-middleware's client
// interceptors) a context holds no method, metadata or peer: rules keyed
// by the first two are skipped, and a ClientIP rule fails the call rather
// than skip it, as it would on a server whose peer it cannot read.
func TestLimitClientSide(t *testing.T) {
	lim, _ := newLimiter(t, hybridlimit.Config{Limit: hybridlimit.PerSecond(5)})
	ic := newInterceptor(t, Config{Rules: []Rule{
		{Name: "method", Limiter: lim, Key: FullMethod},
		{Name: "tenant", Limiter: lim, Key: Metadata("x-tenant")},
	}})
	if err := ic.Limit(context.Background()); err != nil {
		t.Errorf("Limit on a client context, rules by method and metadata = %v; want nil (rules skipped)", err)
	}
	ic = newInterceptor(t, Config{Rules: []Rule{{Name: "ip", Limiter: lim, Key: ClientIP{}.Key}}})
	if err := ic.Limit(context.Background()); err == nil {
		t.Error("Limit on a client context, a ClientIP rule = nil; want an error: no peer to read")
	}
}
