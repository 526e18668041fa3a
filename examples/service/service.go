// Package service is a small service that answers over HTTP and gRPC and
// limits both with one hybridlimit.Limiter: a client's HTTP requests and
// gRPC calls draw on one bucket per client address, shared by every
// instance of the service through Redis.
package service

import (
	"context"
	"fmt"
	"net/http"

	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/hybridlimit/hybridlimit"
	"github.com/hybridlimit/hybridlimit/grpclimit"
	"github.com/hybridlimit/hybridlimit/httplimit"
)

// Rule names the one rule of both protocols. The limiter sees the key
// Rule + ":" + the client's address from either, so the two share buckets.
const Rule = "client"

// SayHello is the full name of the gRPC method that the rule limits.
const SayHello = "/hello.Greeter/SayHello"

// New returns the service's HTTP handler (GET /hello, limited) and its
// gRPC server (hello.Greeter, limited, and the standard health service,
// not limited so that load balancers can always check it).
//
// The client's address is the peer of the connection: behind a proxy or a
// load balancer, set TrustedProxies in both ClientIPs to the proxies'
// networks, or every client shares the proxy's bucket.
func New(lim *hybridlimit.Limiter) (http.Handler, *grpc.Server, error) {
	mw, err := httplimit.New(httplimit.Config{Rules: []httplimit.Rule{
		{Name: Rule, Limiter: lim, Key: httplimit.ClientIP{}.Key},
	}})
	if err != nil {
		return nil, nil, err
	}
	mux := http.NewServeMux()
	mux.Handle("GET /hello", mw.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintln(w, "hello")
	}))

	ic, err := grpclimit.New(grpclimit.Config{Rules: []grpclimit.Rule{
		{Name: Rule, Limiter: lim, Key: grpclimit.ClientIP{}.Key, Methods: []string{"/hello.Greeter/"}},
	}})
	if err != nil {
		return nil, nil, err
	}
	srv := grpc.NewServer(
		grpc.ChainUnaryInterceptor(ic.Unary),
		grpc.ChainStreamInterceptor(ic.Stream),
	)
	srv.RegisterService(&greeterDesc, nil)
	healthpb.RegisterHealthServer(srv, health.NewServer())
	return mux, srv, nil
}

// greeterDesc describes hello.Greeter, a service with one method that
// takes and returns a google.protobuf.StringValue. protoc-gen-go-grpc
// writes such a descriptor for a service of your own; this one is written
// by hand so that the example needs no code generation.
var greeterDesc = grpc.ServiceDesc{
	ServiceName: "hello.Greeter",
	HandlerType: (*any)(nil),
	Methods:     []grpc.MethodDesc{{MethodName: "SayHello", Handler: sayHello}},
}

func sayHello(srv any, ctx context.Context, dec func(any) error, interceptor grpc.UnaryServerInterceptor) (any, error) {
	in := new(wrapperspb.StringValue)
	if err := dec(in); err != nil {
		return nil, err
	}
	say := func(ctx context.Context, req any) (any, error) {
		return wrapperspb.String("hello, " + req.(*wrapperspb.StringValue).GetValue()), nil
	}
	if interceptor == nil {
		return say(ctx, in)
	}
	return interceptor(ctx, in, &grpc.UnaryServerInfo{Server: srv, FullMethod: SayHello}, say)
}

// Hello calls hello.Greeter/SayHello on cc, as generated client code
// would.
func Hello(ctx context.Context, cc grpc.ClientConnInterface, name string, opts ...grpc.CallOption) (string, error) {
	out := new(wrapperspb.StringValue)
	if err := cc.Invoke(ctx, SayHello, wrapperspb.String(name), out, opts...); err != nil {
		return "", err
	}
	return out.GetValue(), nil
}
