// Command service runs the example service on a Redis: HTTP on -http,
// gRPC on -grpc, both limited by one hybridlimit.Limiter.
//
//	go run ./cmd/service -redis localhost:6379
//	curl -i localhost:8080/hello
package main

import (
	"context"
	"errors"
	"flag"
	"log"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"

	"github.com/redis/go-redis/v9"

	"github.com/hybridlimit/hybridlimit"
	"github.com/hybridlimit/hybridlimit/examples/service"
)

func main() {
	redisAddr := flag.String("redis", "localhost:6379", "Redis `address`")
	httpAddr := flag.String("http", "localhost:8080", "HTTP listen `address`")
	grpcAddr := flag.String("grpc", "localhost:50051", "gRPC listen `address`")
	perSecond := flag.Int64("rate", 10, "requests per `second` per client, shared by HTTP and gRPC")
	instances := flag.Int("instances", 1, "instances of the service sharing the limit")
	flag.Parse()

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	rdb := redis.NewClient(&redis.Options{
		Addr: *redisAddr,
		// Reads stop at the decision's deadline: the lowest latency.
		ContextTimeoutEnabled: true,
	})
	defer rdb.Close()
	lim, err := hybridlimit.New(hybridlimit.Config{
		Redis:     rdb,
		Limit:     hybridlimit.PerSecond(*perSecond),
		Instances: *instances,
		Logger:    slog.Default(), // breaker changes at Warn
	})
	if err != nil {
		log.Fatal(err)
	}
	defer lim.Close()
	handler, srv, err := service.New(lim)
	if err != nil {
		log.Fatal(err)
	}

	lis, err := net.Listen("tcp", *grpcAddr)
	if err != nil {
		log.Fatal(err)
	}
	go srv.Serve(lis)
	defer srv.GracefulStop()
	hs := &http.Server{Addr: *httpAddr, Handler: handler}
	go func() {
		<-ctx.Done()
		hs.Shutdown(context.Background())
	}()
	log.Printf("HTTP on %s, gRPC on %s, Redis at %s", *httpAddr, lis.Addr(), *redisAddr)
	if err := hs.ListenAndServe(); !errors.Is(err, http.ErrServerClosed) {
		log.Print(err)
	}
}
