package otelmetrics_test

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric/noop"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/hybridlimit/hybridlimit"
	"github.com/hybridlimit/hybridlimit/otelmetrics"
)

func TestMain(m *testing.M) {
	// The limiter pointed at a closed port makes go-redis log every failed
	// dial; the tests assert what matters.
	redis.SetLogger(quiet{})
	m.Run()
}

type quiet struct{}

func (quiet) Printf(context.Context, string, ...any) {}

// newObserver returns an Observer on an SDK MeterProvider read by the
// returned ManualReader.
func newObserver(t *testing.T, opts ...otelmetrics.Option) (*otelmetrics.Observer, *sdkmetric.ManualReader) {
	t.Helper()
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { mp.Shutdown(context.Background()) })
	obs, err := otelmetrics.New(mp, opts...)
	if err != nil {
		t.Fatalf("New = %v", err)
	}
	return obs, reader
}

// newLimiter returns a Limiter closed by t.Cleanup, with a prefix of its
// own, no heartbeat (so its share stays 1/Instances) and the breaker
// opening after two failures for an hour.
func newLimiter(t *testing.T, cfg hybridlimit.Config) *hybridlimit.Limiter {
	t.Helper()
	cfg.Prefix = t.Name() + ":" + cfg.Name + ":"
	cfg.Heartbeat = -1
	if cfg.Instances == 0 {
		cfg.Instances = 1 // without a heartbeat, the share must be said
	}
	cfg.Breaker = hybridlimit.BreakerConfig{Failures: 2, OpenFor: time.Hour}
	if cfg.Timeout == 0 {
		// The default 50 ms is short for miniredis under -race on a busy
		// machine, where a late answer makes a decision local; these tests
		// check the metrics, not the budget.
		cfg.Timeout = 5 * time.Second
	}
	lim, err := hybridlimit.New(cfg)
	if err != nil {
		t.Fatalf("hybridlimit.New(%+v) = %v", cfg, err)
	}
	t.Cleanup(func() { lim.Close() })
	return lim
}

// allow makes n decisions on key and fails unless each is made by mode.
func allow(t *testing.T, lim *hybridlimit.Limiter, key string, n int, mode hybridlimit.Mode) {
	t.Helper()
	for range n {
		d, err := lim.Allow(context.Background(), key)
		if err != nil || d.Mode != mode {
			t.Fatalf("Allow(%q) = %+v, %v; want a %v decision", key, d, err, mode)
		}
	}
}

// collect returns the metrics of the hybridlimit meter by name.
func collect(t *testing.T, r *sdkmetric.ManualReader) map[string]metricdata.Metrics {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := r.Collect(context.Background(), &rm); err != nil {
		t.Fatalf("Collect = %v", err)
	}
	got := map[string]metricdata.Metrics{}
	for _, sm := range rm.ScopeMetrics {
		if sm.Scope.Name != otelmetrics.ScopeName {
			t.Errorf("scope %q; want %q", sm.Scope.Name, otelmetrics.ScopeName)
		}
		for _, m := range sm.Metrics {
			got[m.Name] = m
		}
	}
	return got
}

// attrs returns the encoded attribute set of key, value pairs, such as
// "hybridlimit.limiter=up,hybridlimit.mode=remote".
func attrs(kv ...string) string {
	var list []attribute.KeyValue
	for i := 0; i+1 < len(kv); i += 2 {
		list = append(list, attribute.String(kv[i], kv[i+1]))
	}
	set := attribute.NewSet(list...)
	return set.Encoded(attribute.DefaultEncoder())
}

// points returns the values of a sum or gauge by encoded attribute set,
// after checking its unit.
func points[N int64 | float64](t *testing.T, m metricdata.Metrics, unit string) map[string]N {
	t.Helper()
	if m.Unit != unit {
		t.Errorf("%s: unit %q; want %q", m.Name, m.Unit, unit)
	}
	var dps []metricdata.DataPoint[N]
	switch d := m.Data.(type) {
	case metricdata.Sum[N]:
		if !d.IsMonotonic || d.Temporality != metricdata.CumulativeTemporality {
			t.Errorf("%s: monotonic %v, %v; want a cumulative counter", m.Name, d.IsMonotonic, d.Temporality)
		}
		dps = d.DataPoints
	case metricdata.Gauge[N]:
		dps = d.DataPoints
	case nil: // not collected
	default:
		t.Fatalf("%s: data %T; want a sum or gauge of %T", m.Name, m.Data, N(0))
	}
	got := map[string]N{}
	for _, dp := range dps {
		got[dp.Attributes.Encoded(attribute.DefaultEncoder())] = dp.Value
	}
	return got
}

func checkPoints[N int64 | float64](t *testing.T, m metricdata.Metrics, unit string, want map[string]N) {
	t.Helper()
	got := points[N](t, m, unit)
	if !maps.Equal(got, want) {
		t.Errorf("%s = %s; want %s", m.Name, show(got), show(want))
	}
}

func show[N int64 | uint64 | float64](m map[string]N) string {
	s := ""
	for _, k := range slices.Sorted(maps.Keys(m)) {
		s += fmt.Sprintf("\n\t{%s}: %v", k, m[k])
	}
	return s
}

// TestObserver makes remote decisions on miniredis and local ones with
// Redis unreachable, then checks every instrument.
func TestObserver(t *testing.T) {
	obs, reader := newObserver(t)

	mr := miniredis.RunT(t)
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	t.Cleanup(func() { rdb.Close() })
	// Nothing listens on port 1: every call fails at once.
	down := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", DialTimeout: 100 * time.Millisecond})
	t.Cleanup(func() { down.Close() })

	upLim := newLimiter(t, hybridlimit.Config{
		Redis: rdb, Name: "up", Limit: hybridlimit.PerMinute(3), Instances: 2, Observer: obs,
	})
	allow(t, upLim, "k", 5, hybridlimit.ModeRemote) // 3 allowed, 2 denied
	shadowLim := newLimiter(t, hybridlimit.Config{
		Redis: rdb, Name: "shadow", Limit: hybridlimit.PerMinute(1), Shadow: true, Observer: obs,
	})
	allow(t, shadowLim, "k", 3, hybridlimit.ModeRemote) // 1 allowed, 2 shadowed
	// Two failures open the breaker; the local share of PerMinute(4) over
	// 2 instances holds 2 tokens.
	downLim := newLimiter(t, hybridlimit.Config{
		Redis: down, Name: "down", Limit: hybridlimit.PerMinute(4), Instances: 2,
		Timeout: time.Second, Observer: obs,
	})
	allow(t, downLim, "k", 4, hybridlimit.ModeLocal) // 2 allowed, 2 denied

	regUp, err := obs.Register(upLim)
	if err != nil {
		t.Fatalf("Register(up) = %v", err)
	}
	regDown, err := obs.Register(downLim)
	if err != nil {
		t.Fatalf("Register(down) = %v", err)
	}

	const (
		lim, mode, out = "hybridlimit.limiter", "hybridlimit.mode", "hybridlimit.outcome"
		node           = "hybridlimit.node"
	)
	got := collect(t, reader)
	checkPoints(t, got["hybridlimit.decisions"], "{decision}", map[string]int64{
		attrs(lim, "up", mode, "remote", out, "allowed"):      3,
		attrs(lim, "up", mode, "remote", out, "denied"):       2,
		attrs(lim, "shadow", mode, "remote", out, "allowed"):  1,
		attrs(lim, "shadow", mode, "remote", out, "shadowed"): 2,
		attrs(lim, "down", mode, "local", out, "allowed"):     2,
		attrs(lim, "down", mode, "local", out, "denied"):      2,
	})
	checkPoints(t, got["hybridlimit.breaker.transitions"], "{transition}", map[string]int64{
		attrs(lim, "down", node, "127.0.0.1:1", "hybridlimit.breaker.from", "closed", "hybridlimit.breaker.to", "open"): 1,
	})
	checkPoints(t, got["hybridlimit.breaker.state"], "{state}", map[string]int64{
		attrs(lim, "up", node, mr.Addr()):       0,
		attrs(lim, "down", node, "127.0.0.1:1"): 2,
	})
	// up holds what Redis said of "k", down a local bucket for "k".
	checkPoints(t, got["hybridlimit.local.keys"], "{key}", map[string]int64{
		attrs(lim, "up"): 1, attrs(lim, "down"): 1,
	})
	checkPoints(t, got["hybridlimit.fleet.instances"], "{instance}", map[string]int64{
		attrs(lim, "up"): 2, attrs(lim, "down"): 2,
	})
	checkPoints(t, got["hybridlimit.local.share"], "1", map[string]float64{
		attrs(lim, "up"): 0.5, attrs(lim, "down"): 0.5,
	})

	// No charge yet: up never spent locally, down's Redis never answers.
	checkPoints(t, got["hybridlimit.charges"], "{charge}", map[string]int64{
		attrs(lim, "up", "hybridlimit.charge.outcome", "confirmed"): 0, attrs(lim, "up", "hybridlimit.charge.outcome", "failed"): 0,
		attrs(lim, "down", "hybridlimit.charge.outcome", "confirmed"): 0, attrs(lim, "down", "hybridlimit.charge.outcome", "failed"): 0,
	})

	h := got["hybridlimit.decision.duration"]
	if h.Unit != "s" {
		t.Errorf("%s: unit %q; want \"s\"", h.Name, h.Unit)
	}
	hist, ok := h.Data.(metricdata.Histogram[float64])
	if !ok {
		t.Fatalf("%s: data %T; want a Histogram[float64]", h.Name, h.Data)
	}
	counts := map[string]uint64{}
	for _, dp := range hist.DataPoints {
		counts[dp.Attributes.Encoded(attribute.DefaultEncoder())] = dp.Count
		if want := []float64{0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1}; !slices.Equal(dp.Bounds, want) {
			t.Errorf("%s: bounds %v; want %v", h.Name, dp.Bounds, want)
		}
		var sum uint64
		for _, c := range dp.BucketCounts {
			sum += c
		}
		if sum != dp.Count || !(dp.Sum > 0) {
			t.Errorf("%s{%s}: buckets hold %d, sum %v; want count %d and a positive sum",
				h.Name, dp.Attributes.Encoded(attribute.DefaultEncoder()), sum, dp.Sum, dp.Count)
		}
	}
	if want := map[string]uint64{
		attrs(lim, "up", mode, "remote"):     5,
		attrs(lim, "shadow", mode, "remote"): 3,
		attrs(lim, "down", mode, "local"):    4,
	}; !maps.Equal(counts, want) {
		t.Errorf("%s counts = %s; want %s", h.Name, show(counts), show(want))
	}

	// Unregistered, the gauges are no longer observed.
	if err := regUp.Unregister(); err != nil {
		t.Errorf("Unregister(up) = %v", err)
	}
	if err := regDown.Unregister(); err != nil {
		t.Errorf("Unregister(down) = %v", err)
	}
	got = collect(t, reader)
	for _, name := range []string{"hybridlimit.breaker.state", "hybridlimit.local.keys", "hybridlimit.fleet.instances", "hybridlimit.local.share", "hybridlimit.charges"} {
		if m, ok := got[name]; ok {
			t.Errorf("after Unregister: %s = %+v; want nothing", name, m.Data)
		}
	}
	checkPoints(t, got["hybridlimit.decisions"], "{decision}", map[string]int64{
		attrs(lim, "up", mode, "remote", out, "allowed"):      3,
		attrs(lim, "up", mode, "remote", out, "denied"):       2,
		attrs(lim, "shadow", mode, "remote", out, "allowed"):  1,
		attrs(lim, "shadow", mode, "remote", out, "shadowed"): 2,
		attrs(lim, "down", mode, "local", out, "allowed"):     2,
		attrs(lim, "down", mode, "local", out, "denied"):      2,
	})
}

// TestRegisterDefaultName: the gauges of a Limiter whose Config.Name is
// unset carry hybridlimit.DefaultName.
func TestRegisterDefaultName(t *testing.T) {
	obs, reader := newObserver(t)
	c := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
	t.Cleanup(func() { c.Close() })
	lim := newLimiter(t, hybridlimit.Config{Redis: c, Limit: hybridlimit.PerSecond(10), Instances: 4, Observer: obs})
	if _, err := obs.Register(lim); err != nil {
		t.Fatalf("Register = %v", err)
	}
	got := collect(t, reader)
	checkPoints(t, got["hybridlimit.fleet.instances"], "{instance}", map[string]int64{
		attrs("hybridlimit.limiter", hybridlimit.DefaultName): 4,
	})
	checkPoints(t, got["hybridlimit.breaker.state"], "{state}", map[string]int64{
		attrs("hybridlimit.limiter", hybridlimit.DefaultName, "hybridlimit.node", "127.0.0.1:1"): 0,
	})
}

func TestNewRejects(t *testing.T) {
	mp := noop.NewMeterProvider()
	tests := []struct {
		name string
		mp   *noop.MeterProvider
		opts []otelmetrics.Option
	}{
		{"nil provider", nil, nil},
		{"decreasing bounds", &mp, []otelmetrics.Option{otelmetrics.WithDurationBoundaries(0.1, 0.01)}},
		{"repeated bound", &mp, []otelmetrics.Option{otelmetrics.WithDurationBoundaries(0.01, 0.01)}},
	}
	for _, tt := range tests {
		var err error
		if tt.mp == nil {
			_, err = otelmetrics.New(nil, tt.opts...)
		} else {
			_, err = otelmetrics.New(tt.mp, tt.opts...)
		}
		if err == nil {
			t.Errorf("New(%s) = nil error; want an error", tt.name)
		}
	}
	obs, err := otelmetrics.New(mp, otelmetrics.WithDurationBoundaries(0.001, 0.01))
	if err != nil {
		t.Fatalf("New(increasing bounds) = %v", err)
	}
	if _, err := obs.Register(nil); err == nil {
		t.Errorf("Register(nil) = nil error; want an error")
	}
}

func TestDurationBoundaries(t *testing.T) {
	obs, reader := newObserver(t, otelmetrics.WithDurationBoundaries(0.001, 0.01))
	for _, d := range []time.Duration{500 * time.Microsecond, 5 * time.Millisecond, 50 * time.Millisecond} {
		obs.ObserveDecision(hybridlimit.DecisionEvent{Limiter: "x", Mode: hybridlimit.ModeRemote, Allowed: true, N: 1, Latency: d})
	}
	h := collect(t, reader)["hybridlimit.decision.duration"].Data.(metricdata.Histogram[float64])
	if len(h.DataPoints) != 1 {
		t.Fatalf("%d histogram points; want 1", len(h.DataPoints))
	}
	dp := h.DataPoints[0]
	if !slices.Equal(dp.Bounds, []float64{0.001, 0.01}) || !slices.Equal(dp.BucketCounts, []uint64{1, 1, 1}) {
		t.Errorf("bounds %v, counts %v; want [0.001 0.01], [1 1 1]", dp.Bounds, dp.BucketCounts)
	}
}

// TestConcurrent observes from many goroutines, over limiters and modes
// seen for the first time at once, and checks that nothing is lost.
func TestConcurrent(t *testing.T) {
	obs, reader := newObserver(t)
	const goroutines, each = 8, 200
	modes := []hybridlimit.Mode{hybridlimit.ModeRemote, hybridlimit.ModeLocal, hybridlimit.ModeFailOpen, hybridlimit.ModeFailClosed}
	var wg sync.WaitGroup
	for g := range goroutines {
		wg.Go(func() {
			for i := range each {
				obs.ObserveDecision(hybridlimit.DecisionEvent{
					Limiter: fmt.Sprint("l", i%2), Mode: modes[(g+i)%len(modes)], Allowed: true, N: 1,
				})
			}
		})
	}
	wg.Wait()
	got := points[int64](t, collect(t, reader)["hybridlimit.decisions"], "{decision}")
	want := map[string]int64{}
	for l := range 2 {
		for _, m := range modes {
			want[attrs("hybridlimit.limiter", fmt.Sprint("l", l), "hybridlimit.mode", m.String(), "hybridlimit.outcome", "allowed")] = goroutines * each / 8
		}
	}
	if !maps.Equal(got, want) {
		t.Errorf("hybridlimit.decisions = %s; want %s", show(got), show(want))
	}
}

// TestObserveDecisionAllocs: once a limiter and mode have been seen,
// recording a decision allocates nothing, on the SDK.
func TestObserveDecisionAllocs(t *testing.T) {
	obs, _ := newObserver(t)
	ev := hybridlimit.DecisionEvent{Limiter: "api", Mode: hybridlimit.ModeRemote, Allowed: true, N: 1, Latency: 300 * time.Microsecond}
	obs.ObserveDecision(ev)
	if n := testing.AllocsPerRun(1000, func() { obs.ObserveDecision(ev) }); n != 0 {
		t.Errorf("ObserveDecision: %v allocations; want 0", n)
	}
}

func BenchmarkObserveDecision(b *testing.B) {
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer mp.Shutdown(context.Background())
	obs, err := otelmetrics.New(mp)
	if err != nil {
		b.Fatal(err)
	}
	ev := hybridlimit.DecisionEvent{Limiter: "api", Mode: hybridlimit.ModeRemote, Allowed: true, N: 1, Latency: 300 * time.Microsecond}
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			obs.ObserveDecision(ev)
		}
	})
}
