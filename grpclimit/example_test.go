package grpclimit_test

import (
	"context"
	"fmt"
	"log"
	"net"
	"net/netip"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/ratelimit"
	"github.com/redis/go-redis/v9"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/hybridlimit/hybridlimit"
	"github.com/hybridlimit/hybridlimit/grpclimit"
)

type userKey struct{}

// A per-address rule for everyone, behind the load balancers, and a
// per-user rule for authenticated calls, on a server's unary calls and
// streams. It needs a Redis, so it is compiled but not run.
func ExampleNew() {
	rdb := redis.NewClient(&redis.Options{Addr: "localhost:6379"})
	perIP, err := hybridlimit.New(hybridlimit.Config{Redis: rdb, Name: "ip", Limit: hybridlimit.PerSecond(20), Instances: 3})
	if err != nil {
		log.Fatal(err)
	}
	defer perIP.Close()
	perUser, err := hybridlimit.New(hybridlimit.Config{Redis: rdb, Name: "user", Limit: hybridlimit.PerMinute(600), Instances: 3})
	if err != nil {
		log.Fatal(err)
	}
	defer perUser.Close()

	ip := grpclimit.ClientIP{TrustedProxies: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}}
	ic, err := grpclimit.New(grpclimit.Config{Rules: []grpclimit.Rule{
		{Name: "ip", Limiter: perIP, Key: ip.Key},
		// Set by an authentication interceptor that runs first;
		// anonymous calls skip this rule.
		{Name: "user", Limiter: perUser, Key: grpclimit.FromContext(userKey{})},
	}})
	if err != nil {
		log.Fatal(err)
	}
	srv := grpc.NewServer(
		grpc.ChainUnaryInterceptor(ic.Unary),
		grpc.ChainStreamInterceptor(ic.Stream),
	)
	healthpb.RegisterHealthServer(srv, health.NewServer())
	lis, err := net.Listen("tcp", ":50051")
	if err != nil {
		log.Fatal(err)
	}
	log.Fatal(srv.Serve(lis))
}

// A server already built on go-grpc-middleware's ratelimit interceptors
// takes an Interceptor as their Limiter. It needs a Redis, so it is
// compiled but not run.
func ExampleInterceptor_Limit() {
	rdb := redis.NewClient(&redis.Options{Addr: "localhost:6379"})
	lim, err := hybridlimit.New(hybridlimit.Config{Redis: rdb, Limit: hybridlimit.PerSecond(100)})
	if err != nil {
		log.Fatal(err)
	}
	defer lim.Close()
	ic, err := grpclimit.New(grpclimit.Config{Rules: []grpclimit.Rule{
		{Name: "tenant", Limiter: lim, Key: grpclimit.Hashed(grpclimit.Metadata("x-api-key"))},
	}})
	if err != nil {
		log.Fatal(err)
	}
	_ = grpc.NewServer(
		grpc.ChainUnaryInterceptor(ratelimit.UnaryServerInterceptor(ic)),
		grpc.ChainStreamInterceptor(ratelimit.StreamServerInterceptor(ic)),
	)
}

// What a client sees: the ratelimit fields on every call, and on a denial
// codes.ResourceExhausted with a RetryInfo. A per-method rule on an
// embedded Redis (miniredis) whose clock stands still, over loopback.
func Example_client() {
	m, err := miniredis.Run()
	if err != nil {
		log.Fatal(err)
	}
	defer m.Close()
	m.SetTime(time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC))
	rdb := redis.NewClient(&redis.Options{Addr: m.Addr()})
	defer rdb.Close()
	lim, err := hybridlimit.New(hybridlimit.Config{Redis: rdb, Limit: hybridlimit.PerMinute(2), Timeout: time.Second})
	if err != nil {
		log.Fatal(err)
	}
	defer lim.Close()
	ic, err := grpclimit.New(grpclimit.Config{Rules: []grpclimit.Rule{
		{Name: "check", Limiter: lim, Key: grpclimit.FullMethod, Methods: []string{"/grpc.health.v1.Health/Check"}},
	}})
	if err != nil {
		log.Fatal(err)
	}

	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(ic.Unary))
	healthpb.RegisterHealthServer(srv, health.NewServer())
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		log.Fatal(err)
	}
	go srv.Serve(lis)
	defer srv.Stop()
	cc, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		log.Fatal(err)
	}
	defer cc.Close()

	client := healthpb.NewHealthClient(cc)
	for range 3 {
		var hdr metadata.MD
		_, err := client.Check(context.Background(), &healthpb.HealthCheckRequest{}, grpc.Header(&hdr))
		fmt.Println(status.Code(err), hdr.Get("ratelimit"))
		for _, d := range status.Convert(err).Details() {
			if ri, ok := d.(*errdetails.RetryInfo); ok {
				// Less than 30 s by the microseconds since Redis answered.
				fmt.Println("retry in about", ri.RetryDelay.AsDuration().Round(time.Second))
			}
		}
	}
	// Output:
	// OK ["check";r=1;t=30]
	// OK ["check";r=0;t=60]
	// ResourceExhausted ["check";r=0;t=30]
	// retry in about 30s
}
