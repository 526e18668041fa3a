package service_test

import (
	"net"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/hybridlimit/hybridlimit"
	"github.com/hybridlimit/hybridlimit/examples/service"
	"github.com/hybridlimit/hybridlimit/internal/redistest"
)

// start serves the service on a fresh redis-server with lim's limit and
// returns the HTTP URL of GET /hello and a gRPC client connection.
func start(t *testing.T, limit hybridlimit.Limit) (string, *grpc.ClientConn) {
	t.Helper()
	rdb := redistest.Start(t).Client(t)
	lim, err := hybridlimit.New(hybridlimit.Config{Redis: rdb, Limit: limit, Instances: 1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { lim.Close() })
	handler, srv, err := service.New(lim)
	if err != nil {
		t.Fatal(err)
	}
	hs := httptest.NewServer(handler)
	t.Cleanup(hs.Close)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go srv.Serve(lis)
	t.Cleanup(srv.Stop)
	cc, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	return hs.URL + "/hello", cc
}

// TestOneBucketForBothProtocols spends a client's bucket of 3 with two
// HTTP requests and a gRPC call; then each protocol denies in its own way
// and the health service still answers.
func TestOneBucketForBothProtocols(t *testing.T) {
	url, cc := start(t, hybridlimit.PerMinute(3))
	get := func() *http.Response {
		t.Helper()
		resp, err := http.Get(url)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp
	}
	hello := func() (metadata.MD, error) {
		t.Helper()
		var md metadata.MD
		_, err := service.Hello(t.Context(), cc, "test", grpc.Header(&md))
		return md, err
	}

	for i, want := range []string{`"client";r=2;t=20`, `"client";r=1;t=40`} {
		resp := get()
		if got := resp.Header.Get("RateLimit"); resp.StatusCode != http.StatusOK || got != want {
			t.Errorf("GET %d = %d, RateLimit %q; want 200, %q", i+1, resp.StatusCode, got, want)
		}
	}
	if md, err := hello(); err != nil || len(md.Get("ratelimit")) != 1 || md.Get("ratelimit")[0] != `"client";r=0;t=60` {
		t.Errorf("SayHello = %v, ratelimit %q; want OK, %q", err, md.Get("ratelimit"), `"client";r=0;t=60`)
	}

	resp := get()
	if resp.StatusCode != http.StatusTooManyRequests {
		t.Errorf("GET after 3 = %d; want 429", resp.StatusCode)
	}
	for field, want := range map[string]string{
		"Retry-After":      "20",
		"RateLimit":        `"client";r=0;t=20`,
		"RateLimit-Policy": `"client";q=3;w=60`,
	} {
		if got := resp.Header.Get(field); got != want {
			t.Errorf("GET after 3: %s = %q; want %q", field, got, want)
		}
	}

	md, err := hello()
	st := status.Convert(err)
	if st.Code() != codes.ResourceExhausted {
		t.Fatalf("SayHello after 3 = %v; want ResourceExhausted", err)
	}
	var retry time.Duration
	for _, d := range st.Details() {
		if ri, ok := d.(*errdetails.RetryInfo); ok {
			retry = ri.GetRetryDelay().AsDuration()
		}
	}
	if retry < 19*time.Second || retry > 20*time.Second {
		t.Errorf("SayHello after 3: RetryInfo delay %v; want about 20s", retry)
	}
	if got := md.Get("ratelimit"); len(got) != 1 || got[0] != `"client";r=0;t=20` {
		t.Errorf("SayHello after 3: ratelimit %q; want %q", got, `"client";r=0;t=20`)
	}

	res, err := healthpb.NewHealthClient(cc).Check(t.Context(), &healthpb.HealthCheckRequest{})
	if err != nil || res.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Errorf("Health.Check after 3 = %v, %v; want SERVING: health checks are not limited", res, err)
	}
}
