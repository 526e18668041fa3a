package otelmetrics_test

import (
	"context"
	"log"

	"github.com/redis/go-redis/v9"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/hybridlimit/hybridlimit"
	"github.com/hybridlimit/hybridlimit/otelmetrics"
)

// ExampleNew wires a Limiter to a MeterProvider: decisions and breaker
// changes through Config.Observer, gauges through Register. It needs
// Redis, so it is compiled, not run.
func ExampleNew() {
	// The application's MeterProvider, with a reader and exporter of its
	// choice (sdkmetric.WithReader(sdkmetric.NewPeriodicReader(exp))).
	mp := sdkmetric.NewMeterProvider()
	defer mp.Shutdown(context.Background())

	obs, err := otelmetrics.New(mp)
	if err != nil {
		log.Fatal(err)
	}
	rdb := redis.NewClient(&redis.Options{Addr: "localhost:6379"})
	lim, err := hybridlimit.New(hybridlimit.Config{
		Redis:    rdb,
		Limit:    hybridlimit.PerSecond(100),
		Name:     "api",
		Observer: obs,
	})
	if err != nil {
		log.Fatal(err)
	}
	defer lim.Close()
	reg, err := obs.Register(lim)
	if err != nil {
		log.Fatal(err)
	}
	defer reg.Unregister()

	d, err := lim.Allow(context.Background(), "user:42")
	if err != nil {
		log.Fatal(err)
	}
	log.Println(d.Allowed, d.Mode)
}
