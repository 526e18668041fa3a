// Package loadgen offers a steady load of rate-limit decisions from several
// simulated instances and reports, second by second, what was allowed, which
// path decided and how long the decisions took.
//
// It knows nothing of hybridlimit: each instance is a Decide function, so the
// demo, the fault tests and the accuracy measurements can all wrap a Limiter
// (or anything else) the same way.
//
// Pacing is open-loop on an absolute schedule: worker w of an instance makes
// its i-th decision at start + phase + i*interval, where interval is chosen
// so that the instance's workers together offer its share of Rate, and the
// phases spread the workers' slots evenly. A decision that overruns its slot
// does not make the worker burst to catch up: of the slots that began in the
// meantime it sends only the latest, at once, and skips the others (counted
// in Second.Skipped). So a worker owes at most one decision at any time, and
// a slow decision path lowers the load offered rather than piling it into
// the next second.
package loadgen

import (
	"cmp"
	"context"
	"fmt"
	"math"
	"slices"
	"sort"
	"strings"
	"sync"
	"text/tabwriter"
	"time"
)

// Decide makes one decision for key. mode is a short name of the path that
// decided, such as "remote", "local", "fail-open", "fail-closed" or "lease"; it is
// ignored when err is not nil.
type Decide func(ctx context.Context, key string) (allowed bool, mode string, err error)

// Config says what load Run offers.
type Config struct {
	// Instances holds one Decide per simulated instance.
	Instances []Decide
	// Weights is each instance's share of the offered load, in any unit:
	// {2, 1, 1} gives the first instance half of Rate. Nil means even.
	// An instance of weight zero, or without a weight, offers nothing.
	Weights []float64
	// Workers is the number of goroutines per instance. Zero means 4. A
	// worker waits for its decision, so Workers bounds the decisions of one
	// instance in flight at once.
	Workers int
	// Rate is the total offered decisions per second, over all instances.
	Rate float64
	// Duration is how long load is offered.
	Duration time.Duration
	// Key returns the key of the decision in slot i (0, 1, 2, ...; skipped
	// slots count) of a worker of an instance. Nil means every decision
	// uses the key "k".
	Key func(instance, worker, i int) string
	// Events are run at their offsets from the start, in order, on one
	// goroutine of their own.
	Events []Event
}

// Event is something to do at an offset from the start of a run, such as
// cutting Redis off at 2s and restoring it at 5s.
type Event struct {
	At time.Duration
	Do func()
}

// Second is what happened in one second of a run. Decisions are counted in
// the second in which they started, skipped slots in the second they were
// scheduled for.
type Second struct {
	// Allowed, Denied and Errors count the decisions made: Errors those
	// whose Decide returned an error.
	Allowed, Denied, Errors int
	// Skipped counts the slots left out because a worker's previous decision
	// overran them: offered load that was never sent.
	Skipped int
	// Modes counts the decisions without error per mode.
	Modes map[string]int
	// Mean, P99 and Max summarise the decisions' latency (see Latency).
	Mean, P99, Max time.Duration
}

// Total returns the decisions made in the second: Allowed+Denied+Errors.
func (s Second) Total() int { return s.Allowed + s.Denied + s.Errors }

// Result is the outcome of Run.
type Result struct {
	// Seconds has one Second per started second of Duration, over all
	// instances.
	Seconds []Second
	// PerInstance[i] has instance i's seconds.
	PerInstance [][]Second

	raw [][]tally // per instance, per second; kept for Combined
}

// Combined returns the seconds of the given instances taken together, with
// their latency statistics computed over all of their decisions. With no
// instances it returns Seconds.
func (r Result) Combined(instances ...int) []Second {
	if len(instances) == 0 {
		return r.Seconds
	}
	var parts [][]tally
	for _, i := range instances {
		parts = append(parts, r.raw[i])
	}
	return summarize(merge(len(r.Seconds), parts...))
}

// tally is the raw record of one second: counts and every latency.
type tally struct {
	allowed, denied, errors, skipped int
	modes                            map[string]int
	lat                              []time.Duration
}

func (t *tally) add(u tally) {
	t.allowed += u.allowed
	t.denied += u.denied
	t.errors += u.errors
	t.skipped += u.skipped
	for m, n := range u.modes {
		if t.modes == nil {
			t.modes = map[string]int{}
		}
		t.modes[m] += n
	}
	t.lat = append(t.lat, u.lat...)
}

// Run offers cfg's load until cfg.Duration has passed or ctx ends, waits
// for every decision in flight and every event running, and returns what
// happened. Decide gets ctx, so ending ctx also cuts decisions short. Events
// not reached by then are not run.
//
// Run starts Workers goroutines per instance and one for the events; all
// have returned when Run returns.
func Run(ctx context.Context, cfg Config) Result {
	seconds := int(math.Ceil(cfg.Duration.Seconds()))
	if cfg.Duration <= 0 || cfg.Rate <= 0 || len(cfg.Instances) == 0 {
		return Result{}
	}
	workers := cfg.Workers
	if workers <= 0 {
		workers = 4
	}
	weights := cfg.Weights
	if weights == nil {
		weights = slices.Repeat([]float64{1}, len(cfg.Instances))
	}
	weight := func(i int) float64 {
		if i < len(weights) && weights[i] > 0 {
			return weights[i]
		}
		return 0
	}
	var sum float64
	for i := range cfg.Instances {
		sum += weight(i)
	}
	if !(sum > 0) || math.IsInf(sum, 0) {
		return Result{}
	}

	runCtx, cancel := context.WithTimeout(ctx, cfg.Duration)
	defer cancel()
	start := time.Now()
	raw := make([][][]tally, len(cfg.Instances)) // instance, worker, second
	var wg sync.WaitGroup
	for i, decide := range cfg.Instances {
		raw[i] = make([][]tally, workers)
		rate := cfg.Rate * weight(i) / sum
		if !(rate > 0) {
			continue
		}
		n := len(cfg.Instances)
		interval := max(time.Duration(float64(workers)/rate*float64(time.Second)), 1)
		for w := range workers {
			raw[i][w] = make([]tally, seconds)
			// Slots spread evenly over the workers of all instances.
			phase := interval * time.Duration(w*n+i) / time.Duration(workers*n)
			wk := worker{
				ctx:      ctx,
				stop:     runCtx.Done(),
				decide:   decide,
				key:      keyFunc(cfg.Key, i, w),
				start:    start,
				phase:    phase,
				interval: interval,
				end:      cfg.Duration,
				tallies:  raw[i][w],
			}
			wg.Go(wk.run)
		}
	}
	wg.Go(func() { runEvents(runCtx, start, cfg.Events) })
	wg.Wait()

	r := Result{PerInstance: make([][]Second, len(cfg.Instances)), raw: make([][]tally, len(cfg.Instances))}
	for i := range cfg.Instances {
		r.raw[i] = merge(seconds, raw[i]...)
		r.PerInstance[i] = summarize(r.raw[i])
	}
	r.Seconds = summarize(merge(seconds, r.raw...))
	return r
}

func keyFunc(key func(instance, worker, i int) string, instance, worker int) func(int) string {
	if key == nil {
		return func(int) string { return "k" }
	}
	return func(i int) string { return key(instance, worker, i) }
}

// worker is one paced goroutine of one instance.
type worker struct {
	ctx      context.Context // passed to decide
	stop     <-chan struct{} // closed when the run ends
	decide   Decide
	key      func(i int) string
	start    time.Time
	phase    time.Duration // offset of slot 0 from start
	interval time.Duration // between slots
	end      time.Duration // no slot at or after this offset
	tallies  []tally       // one per second, written only by this worker
}

func (wk worker) run() {
	timer := time.NewTimer(0)
	defer timer.Stop()
	<-timer.C
	for i := 0; ; i++ {
		at := wk.phase + time.Duration(i)*wk.interval
		if at >= wk.end {
			return
		}
		timer.Reset(time.Until(wk.start.Add(at)))
		select {
		case <-timer.C:
		case <-wk.stop:
			return
		}
		t0 := time.Now()
		offset := t0.Sub(wk.start)
		if offset >= wk.end { // the timer fired late, past the end
			return
		}
		allowed, mode, err := wk.decide(wk.ctx, wk.key(i))
		lat := time.Since(t0)

		t := &wk.tallies[int(offset/time.Second)]
		t.lat = append(t.lat, lat)
		switch {
		case err != nil:
			t.errors++
		case allowed:
			t.allowed++
		default:
			t.denied++
		}
		if err == nil {
			if t.modes == nil {
				t.modes = map[string]int{}
			}
			t.modes[mode]++
		}

		// Of the slots that began during the decision (or while the timer
		// fired late), skip all but the latest, which goes out at once.
		if late := int((time.Since(wk.start) - wk.phase) / wk.interval); late > i+1 {
			for j := i + 1; j < late; j++ {
				if at := wk.phase + time.Duration(j)*wk.interval; at < wk.end {
					wk.tallies[int(at/time.Second)].skipped++
				}
			}
			i = late - 1
		}
	}
}

// runEvents runs events at their offsets from start until ctx ends.
func runEvents(ctx context.Context, start time.Time, events []Event) {
	events = slices.Clone(events)
	slices.SortStableFunc(events, func(a, b Event) int { return cmp.Compare(a.At, b.At) })
	for _, e := range events {
		t := time.NewTimer(time.Until(start.Add(e.At)))
		select {
		case <-t.C:
			e.Do()
		case <-ctx.Done():
			t.Stop()
			return
		}
	}
}

// merge adds up parts second by second into n tallies.
func merge(n int, parts ...[]tally) []tally {
	out := make([]tally, n)
	for _, p := range parts {
		for s := range p {
			out[s].add(p[s])
		}
	}
	return out
}

func summarize(ts []tally) []Second {
	out := make([]Second, len(ts))
	for s, t := range ts {
		out[s] = Second{
			Allowed: t.allowed, Denied: t.denied, Errors: t.errors, Skipped: t.skipped,
			Modes: t.modes,
		}
		out[s].Mean, out[s].P99, out[s].Max = Latency(t.lat)
	}
	return out
}

// Latency returns the mean, the 99th percentile and the maximum of lat, or
// zeros if lat is empty. The percentile is the nearest-rank one: the
// smallest value that at least 99% of lat do not exceed, so of the 100
// values 1ms..100ms it is 99ms, and of fewer than 100 values it is the
// maximum. Latency sorts lat in place.
func Latency(lat []time.Duration) (mean, p99, max time.Duration) {
	if len(lat) == 0 {
		return 0, 0, 0
	}
	slices.Sort(lat)
	var sum time.Duration
	for _, d := range lat {
		sum += d
	}
	rank := (99*len(lat) + 99) / 100 // ceil(0.99 n), 1-based
	return sum / time.Duration(len(lat)), lat[rank-1], lat[len(lat)-1]
}

// Table formats seconds as an aligned text table: one row per second with
// the decisions allowed, denied, failed and skipped, the latency mean, p99
// and max, and the decisions per mode, as in
//
//	second  allowed  denied  errors  skipped   mean     p99     max  modes
//	   0-1      100     100       0        0  410µs  1.52ms  2.01ms  remote 200
func Table(seconds []Second) string {
	var b strings.Builder
	// The last cell of a line is in no column, so the modes stay flush left
	// after the right-aligned numbers.
	tw := tabwriter.NewWriter(&b, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "second\tallowed\tdenied\terrors\tskipped\tmean\tp99\tmax\t  modes")
	for s, sec := range seconds {
		fmt.Fprintf(tw, "%d-%d\t%d\t%d\t%d\t%d\t%s\t%s\t%s\t  %s\n",
			s, s+1, sec.Allowed, sec.Denied, sec.Errors, sec.Skipped,
			FormatDuration(sec.Mean), FormatDuration(sec.P99), FormatDuration(sec.Max), FormatModes(sec.Modes))
	}
	tw.Flush()
	return b.String()
}

// FormatModes formats decisions per mode as "local 198 remote 2", modes in
// alphabetical order, or "-" if there are none.
func FormatModes(modes map[string]int) string {
	if len(modes) == 0 {
		return "-"
	}
	names := make([]string, 0, len(modes))
	for m := range modes {
		names = append(names, m)
	}
	sort.Strings(names)
	parts := make([]string, len(names))
	for i, m := range names {
		parts[i] = fmt.Sprintf("%s %d", m, modes[m])
	}
	return strings.Join(parts, " ")
}

// FormatDuration formats a latency briefly: "0", "830µs", "1.52ms", "50.1ms", "1.20s".
func FormatDuration(d time.Duration) string {
	switch {
	case d == 0:
		return "0"
	case d < time.Millisecond:
		return fmt.Sprintf("%dµs", d.Microseconds())
	case d < 10*time.Millisecond:
		return fmt.Sprintf("%.2fms", float64(d)/float64(time.Millisecond))
	case d < time.Second:
		return fmt.Sprintf("%.1fms", float64(d)/float64(time.Millisecond))
	}
	return fmt.Sprintf("%.2fs", d.Seconds())
}
