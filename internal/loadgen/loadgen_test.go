package loadgen

import (
	"context"
	"math"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"
)

// firstPerSecond returns a Decide that allows the first n decisions of every
// second since it was made, all in mode "remote".
func firstPerSecond(n int) Decide {
	start := time.Now()
	var mu sync.Mutex
	sec, used := 0, 0
	return func(ctx context.Context, key string) (bool, string, error) {
		mu.Lock()
		defer mu.Unlock()
		if s := int(time.Since(start) / time.Second); s != sec {
			sec, used = s, 0
		}
		used++
		return used <= n, "remote", nil
	}
}

// within reports whether got is within frac of want.
func within(got int, want, frac float64) bool {
	return float64(got) >= want*(1-frac) && float64(got) <= want*(1+frac)
}

func TestRunOffersRate(t *testing.T) {
	t.Parallel()
	// At virtual time: a busy machine cannot move a slot.
	synctest.Test(t, func(t *testing.T) {
		decide := firstPerSecond(100)
		res := Run(context.Background(), Config{
			Instances: []Decide{decide, decide, decide},
			Rate:      300,
			Duration:  2 * time.Second,
		})
		if len(res.Seconds) != 2 {
			t.Fatalf("len(Seconds) = %d; want 2", len(res.Seconds))
		}
		for s, sec := range res.Seconds {
			// The schedule puts exactly 300 slots in each second, and
			// decisions take no time: none is skipped.
			if sec.Total() != 300 || sec.Skipped != 0 {
				t.Errorf("second %d: made %d, skipped %d; want 300 made, none skipped", s, sec.Total(), sec.Skipped)
			}
			if sec.Modes["remote"] != sec.Total() || sec.Errors != 0 {
				t.Errorf("second %d: %+v; want every decision remote, no errors", s, sec)
			}
			if sec.Allowed != 100 {
				t.Errorf("second %d: allowed %d; want 100", s, sec.Allowed)
			}
		}
		for i, secs := range res.PerInstance {
			for s, sec := range secs {
				if sec.Total() != 100 {
					t.Errorf("instance %d second %d: made %d; want 100", i, s, sec.Total())
				}
			}
		}
		t.Logf("\n%s", Table(res.Seconds))
	})
}

func TestRunWeights(t *testing.T) {
	t.Parallel()
	// At virtual time: a busy machine cannot move a slot.
	synctest.Test(t, func(t *testing.T) {
		allow := func(context.Context, string) (bool, string, error) { return true, "local", nil }
		res := Run(context.Background(), Config{
			Instances: []Decide{allow, allow, allow},
			Weights:   []float64{3, 1, 0},
			Workers:   2,
			Rate:      400,
			Duration:  time.Second,
		})
		want := []float64{300, 100, 0}
		for i, w := range want {
			sec := res.PerInstance[i][0]
			// Each worker's share of the slots is rounded to whole slots.
			if math.Abs(float64(sec.Total())-w) > 2 || sec.Skipped != 0 {
				t.Errorf("instance %d: made %d, skipped %d; want %v made (± 2, a slot per worker)", i, sec.Total(), sec.Skipped, w)
			}
		}
		if got := res.Combined(0, 1, 2)[0].Total(); got != res.Seconds[0].Total() {
			t.Errorf("Combined(0, 1, 2) made %d; want Seconds' %d", got, res.Seconds[0].Total())
		}
	})
}

func TestRunKeys(t *testing.T) {
	t.Parallel()
	// At virtual time: a busy machine cannot move a slot.
	synctest.Test(t, func(t *testing.T) {
		var mu sync.Mutex
		seen := map[string]int{}
		record := func(ctx context.Context, key string) (bool, string, error) {
			mu.Lock()
			seen[key]++
			mu.Unlock()
			return true, "remote", nil
		}
		Run(context.Background(), Config{
			Instances: []Decide{record, record},
			Workers:   2,
			Rate:      40,
			Duration:  500 * time.Millisecond,
			Key: func(instance, worker, i int) string {
				return string(rune('a'+instance)) + string(rune('0'+worker))
			},
		})
		for _, k := range []string{"a0", "a1", "b0", "b1"} {
			if seen[k] != 5 {
				t.Errorf("key %q used %d times; want 5 (all: %v)", k, seen[k], seen)
			}
		}
	})
}

func TestRunEvents(t *testing.T) {
	t.Parallel()
	// At virtual time: a busy machine cannot move a slot.
	synctest.Test(t, func(t *testing.T) {
		var mu sync.Mutex
		var fired []string
		var at []time.Duration
		begin := time.Now()
		event := func(name string) func() {
			return func() {
				mu.Lock()
				defer mu.Unlock()
				fired = append(fired, name)
				at = append(at, time.Since(begin))
			}
		}
		allow := func(context.Context, string) (bool, string, error) { return true, "remote", nil }
		Run(context.Background(), Config{
			Instances: []Decide{allow},
			Rate:      10,
			Duration:  time.Second,
			Events: []Event{
				{At: 600 * time.Millisecond, Do: event("resume")},
				{At: 200 * time.Millisecond, Do: event("pause")},
				{At: 2 * time.Second, Do: event("after the end")},
			},
		})
		if got := strings.Join(fired, ","); got != "pause,resume" {
			t.Fatalf("events fired %q; want %q", got, "pause,resume")
		}
		for i, want := range []time.Duration{200 * time.Millisecond, 600 * time.Millisecond} {
			if at[i] < want || at[i] > want+100*time.Millisecond {
				t.Errorf("event %q fired at %v; want %v (+100ms)", fired[i], at[i], want)
			}
		}
	})
}

func TestRunSkipsMissedSlots(t *testing.T) {
	t.Parallel()
	// At virtual time: a busy machine cannot move a slot.
	synctest.Test(t, func(t *testing.T) {
		slow := func(ctx context.Context, key string) (bool, string, error) {
			time.Sleep(35 * time.Millisecond)
			return true, "remote", nil
		}
		res := Run(context.Background(), Config{
			Instances: []Decide{slow},
			Workers:   1,
			Rate:      100, // a slot every 10ms, but a decision takes 35ms
			Duration:  time.Second,
		})
		sec := res.Seconds[0]
		if sec.Total() > 30 || sec.Skipped < 60 {
			t.Errorf("made %d, skipped %d; want at most 30 made (no catching up), the rest skipped", sec.Total(), sec.Skipped)
		}
		if !within(sec.Total()+sec.Skipped, 100, 0.05) {
			t.Errorf("made %d + skipped %d; want 100 slots ± 5%%", sec.Total(), sec.Skipped)
		}
		if sec.Mean < 35*time.Millisecond {
			t.Errorf("mean latency %v; want at least 35ms", sec.Mean)
		}
	})
}

func TestRunStopsOnContext(t *testing.T) {
	t.Parallel()
	// At virtual time: a busy machine cannot move a slot.
	synctest.Test(t, func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
		defer cancel()
		var calls atomic.Int64
		block := func(ctx context.Context, key string) (bool, string, error) {
			calls.Add(1)
			<-ctx.Done()
			return false, "", ctx.Err()
		}
		begin := time.Now()
		res := Run(ctx, Config{Instances: []Decide{block}, Rate: 100, Duration: 10 * time.Second})
		if d := time.Since(begin); d > 2*time.Second {
			t.Errorf("Run took %v after its context ended at 200ms", d)
		}
		if got := res.Seconds[0].Errors; got != int(calls.Load()) || got == 0 {
			t.Errorf("Errors = %d; want every one of the %d calls", got, calls.Load())
		}
		if len(res.Seconds) != 10 {
			t.Errorf("len(Seconds) = %d; want 10", len(res.Seconds))
		}
	})
}

func TestRunNothingToDo(t *testing.T) {
	allow := func(context.Context, string) (bool, string, error) { return true, "remote", nil }
	for _, cfg := range []Config{
		{},
		{Instances: []Decide{allow}, Duration: time.Second},
		{Instances: []Decide{allow}, Rate: 10},
		{Instances: []Decide{allow}, Rate: 10, Duration: time.Second, Weights: []float64{0}},
	} {
		if res := Run(context.Background(), cfg); len(res.Seconds) != 0 {
			t.Errorf("Run(%+v) = %+v; want no seconds", cfg, res)
		}
	}
}

func TestLatency(t *testing.T) {
	ms := func(n int) []time.Duration { // 1ms..n ms, shuffled a little
		var d []time.Duration
		for i := n; i >= 1; i-- {
			d = append(d, time.Duration(i)*time.Millisecond)
		}
		return d
	}
	for _, tt := range []struct {
		name           string
		lat            []time.Duration
		mean, p99, max time.Duration
	}{
		{"none", nil, 0, 0, 0},
		{"one", []time.Duration{7 * time.Millisecond}, 7 * time.Millisecond, 7 * time.Millisecond, 7 * time.Millisecond},
		{"1..100ms", ms(100), 50500 * time.Microsecond, 99 * time.Millisecond, 100 * time.Millisecond},
		{"1..1000ms", ms(1000), 500500 * time.Microsecond, 990 * time.Millisecond, 1000 * time.Millisecond},
		{"1..50ms", ms(50), 25500 * time.Microsecond, 50 * time.Millisecond, 50 * time.Millisecond},
		{"99 fast, 1 slow", append(make([]time.Duration, 99), time.Second), 10 * time.Millisecond, 0, time.Second},
		{"98 fast, 2 slow", append(make([]time.Duration, 98), time.Second, time.Second), 20 * time.Millisecond, time.Second, time.Second},
	} {
		mean, p99, max := Latency(tt.lat)
		if mean != tt.mean || p99 != tt.p99 || max != tt.max {
			t.Errorf("Latency(%s) = %v, %v, %v; want %v, %v, %v", tt.name, mean, p99, max, tt.mean, tt.p99, tt.max)
		}
	}
}

func TestCombined(t *testing.T) {
	ms := time.Millisecond
	r := Result{raw: [][]tally{
		{{allowed: 2, lat: []time.Duration{1 * ms, 2 * ms}, modes: map[string]int{"remote": 2}}},
		{{denied: 1, errors: 1, lat: []time.Duration{9 * ms, 4 * ms}, modes: map[string]int{"local": 1}}},
	}}
	r.Seconds = summarize(merge(1, r.raw...))
	got := r.Combined(0, 1)[0]
	if got.Allowed != 2 || got.Denied != 1 || got.Errors != 1 || got.Mean != 4*ms || got.Max != 9*ms ||
		FormatModes(got.Modes) != "local 1 remote 2" {
		t.Errorf("Combined(0, 1) = %+v; want 2 allowed, 1 denied, 1 error, mean 4ms, max 9ms, local 1 remote 2", got)
	}
	if got := r.Combined(1)[0]; got.Allowed != 0 || got.Mean != 6500*time.Microsecond {
		t.Errorf("Combined(1) = %+v; want 0 allowed, mean 6.5ms", got)
	}
}

func TestTable(t *testing.T) {
	got := Table([]Second{
		{Allowed: 100, Denied: 100, Modes: map[string]int{"remote": 200},
			Mean: 410 * time.Microsecond, P99: 1520 * time.Microsecond, Max: 2 * time.Millisecond},
		{Allowed: 66, Denied: 130, Errors: 1, Skipped: 3, Modes: map[string]int{"remote": 2, "local": 194},
			Mean: 5 * time.Millisecond, P99: 50100 * time.Microsecond, Max: 1200 * time.Millisecond},
	})
	want := `  second  allowed  denied  errors  skipped    mean     p99     max  modes
     0-1      100     100       0        0   410µs  1.52ms  2.00ms  remote 200
     1-2       66     130       1        3  5.00ms  50.1ms   1.20s  local 194 remote 2
`
	if got != want {
		t.Errorf("Table() =\n%s\nwant\n%s", got, want)
	}
}
