package bench

import (
	"context"
	"fmt"
	"os"
	"runtime/metrics"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/hybridlimit/hybridlimit/bench/internal/redisserver"
)

var (
	serverOnce sync.Once
	server     *redisserver.Server
	serverAddr string
	serverErr  error
)

// redisAddr returns the address of the Redis to benchmark against.
func redisAddr(tb testing.TB) string {
	tb.Helper()
	serverOnce.Do(func() {
		if serverAddr = os.Getenv(EnvRedis); serverAddr != "" {
			return
		}
		server, serverErr = redisserver.Start()
		if serverErr == nil {
			serverAddr = server.Addr()
		}
	})
	if serverErr != nil {
		tb.Fatal(serverErr)
	}
	return serverAddr
}

func TestMain(m *testing.M) {
	code := m.Run()
	if server != nil {
		server.Close()
	}
	os.Exit(code)
}

// BenchmarkRemote runs every Redis contender with 1 to 256 goroutines on
// one hot key and on a key per goroutine. The concurrency is exact,
// whatever -cpu says. Besides ns/op (wall time over decisions) and
// allocations, it reports decisions per second, the p50 and p99 latency of
// single decisions, and the CPU time this process spent per decision
// (cpu-ns/op: the client's cost, whatever else runs on the machine) and
// the CPU time redis-server spent per decision (srv-ns/op, from INFO cpu),
// and goroutines started per decision (goroutines/op).
//
//	go test -run '^$' -bench '^BenchmarkRemote$' -benchtime 20000x
func BenchmarkRemote(b *testing.B) {
	for _, c := range Contenders {
		if !c.Remote {
			continue
		}
		b.Run("contender="+c.Name, func(b *testing.B) {
			// A client of go-redis's default options per contender, as a
			// user would make it.
			rdb := redis.NewClient(&redis.Options{Addr: redisAddr(b)})
			defer rdb.Close()
			benchGrid(b, c, rdb)
		})
	}
}

// BenchmarkLocal runs golang.org/x/time/rate alone, the floor of a decision
// in memory, on the same grid as BenchmarkRemote.
//
//	go test -run '^$' -bench '^BenchmarkLocal$' -benchtime 2000000x
func BenchmarkLocal(b *testing.B) {
	for _, c := range Contenders {
		if c.Remote {
			continue
		}
		b.Run("contender="+c.Name, func(b *testing.B) { benchGrid(b, c, nil) })
	}
}

func benchGrid(b *testing.B, c Contender, rdb redis.UniversalClient) {
	inst, err := c.Open(rdb)
	if err != nil {
		b.Fatal(err)
	}
	defer inst.Close()
	for _, conc := range Concurrencies {
		for _, p := range Patterns {
			b.Run(fmt.Sprintf("conc=%d/keys=%s", conc, p), func(b *testing.B) {
				benchRun(b, inst, rdb, p, conc)
			})
		}
	}
}

// benchRun makes b.N decisions with conc goroutines. rdb, if not nil, is
// asked for redis-server's CPU time before and after.
func benchRun(b *testing.B, inst Instance, rdb redis.UniversalClient, p Pattern, conc int) {
	ctx := context.Background()
	r, err := Prepare(ctx, inst, p, conc, b.N)
	if err != nil {
		b.Fatal(err)
	}
	var srv0 time.Duration
	if rdb != nil {
		if srv0, err = ServerCPU(ctx, rdb); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportAllocs()
	cpu0, gor0 := cpuTime(), goroutinesCreated()
	b.ResetTimer()
	r.Go()
	b.StopTimer()
	cpu, gor := cpuTime()-cpu0, goroutinesCreated()-gor0
	var srv time.Duration
	if rdb != nil {
		srv1, err := ServerCPU(ctx, rdb)
		if err != nil {
			b.Fatal(err)
		}
		srv = srv1 - srv0
	}
	res, err := r.Result()
	if err != nil {
		b.Fatal(err)
	}
	if res.Denied*100 > int64(res.N) {
		// Denials skip the write: the run would not compare like with like.
		b.Fatalf("%d of %d decisions denied", res.Denied, res.N)
	}
	b.ReportMetric(res.PerSecond(), "dec/s")
	b.ReportMetric(float64(res.P50.Nanoseconds()), "p50-ns")
	b.ReportMetric(float64(res.P99.Nanoseconds()), "p99-ns")
	b.ReportMetric(float64(cpu.Nanoseconds())/float64(res.N), "cpu-ns/op")
	b.ReportMetric(float64(gor)/float64(res.N), "goroutines/op")
	if rdb != nil {
		b.ReportMetric(float64(srv.Nanoseconds())/float64(res.N), "srv-ns/op")
	}
}

// goroutinesCreated returns how many goroutines the process has started.
func goroutinesCreated() uint64 {
	s := []metrics.Sample{{Name: "/sched/goroutines-created:goroutines"}}
	metrics.Read(s)
	if s[0].Value.Kind() != metrics.KindUint64 {
		return 0
	}
	return s[0].Value.Uint64()
}

// cpuTime returns the user and system CPU time this process has used: all
// its goroutines, the garbage collector included, but not Redis's.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// startServer starts a redis-server of the test's own, stopped by
// t.Cleanup.
func startServer(t *testing.T) string {
	t.Helper()
	s, err := redisserver.Start()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s.Addr()
}
