package bench

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"
)

// Pattern says which keys the goroutines of a run decide on.
type Pattern string

// The key patterns.
const (
	// Hot: every goroutine decides on one key.
	Hot Pattern = "hot"
	// Spread: each goroutine decides on a key of its own.
	Spread Pattern = "spread"
)

// Patterns are the key patterns, in the order the reports list them.
var Patterns = []Pattern{Hot, Spread}

// Concurrencies are the numbers of goroutines compared.
var Concurrencies = []int{1, 16, 64, 256}

// Keys returns the key each of conc goroutines decides on.
func Keys(p Pattern, conc int) []string {
	keys := make([]string, conc)
	for i := range keys {
		if p == Hot {
			keys[i] = "bench:hot"
		} else {
			keys[i] = fmt.Sprintf("bench:g%d", i)
		}
	}
	return keys
}

// Run is one run of n decisions by conc goroutines, prepared by Prepare and
// started by Go. The goroutines share the n decisions out equally (the
// first n%conc make one more), so no goroutine ever allocates while timed:
// each records its latencies in a slice made by Prepare.
type Run struct {
	start   chan struct{}
	done    sync.WaitGroup
	lats    []time.Duration // all latencies; goroutine i owns lats[off[i]:off[i+1]]
	errs    []error         // per goroutine
	denied  []int64         // per goroutine
	elapsed time.Duration
}

// Result is what a Run measured.
type Result struct {
	N       int
	Elapsed time.Duration // from the start of the first decision to the end of the last
	Denied  int64
	P50     time.Duration
	P99     time.Duration
}

// PerSecond returns decisions per second.
func (r Result) PerSecond() float64 { return float64(r.N) / r.Elapsed.Seconds() }

// Prepare binds conc goroutines to their keys and starts them. Each makes
// one decision untimed (which dials its connection and loads scripts), and
// waits for Go. Prepare returns when all of them wait, or the first error of
// those warm-up decisions, in which case nothing is left running.
func Prepare(ctx context.Context, inst Instance, p Pattern, conc, n int) (*Run, error) {
	if conc < 1 || n < 0 {
		return nil, fmt.Errorf("bench: conc %d, n %d", conc, n)
	}
	r := &Run{
		start:  make(chan struct{}),
		lats:   make([]time.Duration, n),
		errs:   make([]error, conc),
		denied: make([]int64, conc),
	}
	keys := Keys(p, conc)
	var ready sync.WaitGroup
	abort := make(chan struct{})
	off := 0
	for i := range conc {
		size := n / conc
		if i < n%conc {
			size++
		}
		lat := r.lats[off : off+size : off+size]
		off += size
		decide := inst.Bind(keys[i])
		ready.Add(1)
		r.done.Add(1)
		go func() {
			defer r.done.Done()
			_, err := decide(ctx)
			r.errs[i] = err
			ready.Done()
			select {
			case <-r.start:
			case <-abort:
				return
			}
			if err != nil {
				return
			}
			r.denied[i], r.errs[i] = loop(ctx, decide, lat)
		}()
	}
	ready.Wait()
	if err := errors.Join(r.errs...); err != nil {
		close(abort)
		r.done.Wait()
		return nil, fmt.Errorf("bench: warm-up: %w", err)
	}
	return r, nil
}

// loop makes len(lat) decisions, recording the latency of each. One clock
// reading per decision: each latency ends where the next one starts.
func loop(ctx context.Context, decide Decide, lat []time.Duration) (denied int64, err error) {
	t0 := time.Now()
	for j := range lat {
		ok, err := decide(ctx)
		t1 := time.Now()
		lat[j] = t1.Sub(t0)
		t0 = t1
		if err != nil {
			return denied, err
		}
		if !ok {
			denied++
		}
	}
	return denied, nil
}

// Go starts the decisions and waits until every goroutine has made its
// share.
func (r *Run) Go() {
	t0 := time.Now()
	close(r.start)
	r.done.Wait()
	r.elapsed = time.Since(t0)
}

// Result returns what the run measured, or the first decision error.
func (r *Run) Result() (Result, error) {
	if err := errors.Join(r.errs...); err != nil {
		return Result{}, err
	}
	res := Result{N: len(r.lats), Elapsed: r.elapsed}
	for _, d := range r.denied {
		res.Denied += d
	}
	if len(r.lats) > 0 {
		slices.Sort(r.lats)
		res.P50 = r.lats[(len(r.lats)-1)*50/100]
		res.P99 = r.lats[(len(r.lats)-1)*99/100]
	}
	return res, nil
}
