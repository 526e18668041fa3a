package breaker

import (
	"fmt"
	"math/rand/v2"
	"runtime"
	"slices"
	"sync"
	"testing"
	"testing/synctest"
	"time"
)

// call is one step of a run: Allow, then Done(o) if Allow let it through.
type call struct {
	o      Outcome // result of the remote call
	wantOK bool    // want from Allow
	want   State   // want from State afterwards
}

func run(t *testing.T, cb *Breaker, calls []call) {
	t.Helper()
	for i, c := range calls {
		done, ok := cb.Allow()
		if ok != c.wantOK {
			t.Fatalf("call %d: Allow() ok = %v; want %v", i, ok, c.wantOK)
		}
		if ok {
			done.Done(c.o)
		} else if done.b != nil || done.done != nil {
			t.Fatalf("call %d: Allow() = %+v, false; want a zero Ticket", i, done)
		}
		if got := cb.State(); got != c.want {
			t.Fatalf("call %d (%v): State() = %v; want %v", i, c.o, got, c.want)
		}
	}
}

// trip opens cb, which must be closed and have Failures 1.
func trip(t *testing.T, cb *Breaker) {
	t.Helper()
	run(t, cb, []call{{Failure, true, StateOpen}})
}

// allowN takes n calls that must be allowed and returns their done funcs.
func allowN(t *testing.T, cb *Breaker, n int) []Ticket {
	t.Helper()
	dones := make([]Ticket, n)
	for i := range dones {
		done, ok := cb.Allow()
		if !ok {
			t.Fatalf("Allow() #%d in %v = false; want true", i, cb.State())
		}
		dones[i] = done
	}
	return dones
}

func TestTripsAfterFailuresInARow(t *testing.T) {
	cb := New(Settings{Failures: 3})
	run(t, cb, []call{
		{Failure, true, StateClosed},
		{Failure, true, StateClosed},
		{Success, true, StateClosed}, // Failures-1, then a success: starts over
		{Failure, true, StateClosed},
		{Success, true, StateClosed},
		{Failure, true, StateClosed},
		{Failure, true, StateClosed},
		{Failure, true, StateOpen}, // Failures in a row
		{Success, false, StateOpen},
	})
}

func TestDefaults(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		cb := New(Settings{})
		calls := make([]call, 4, 6)
		for i := range calls {
			calls[i] = call{Failure, true, StateClosed}
		}
		calls = append(calls, call{Failure, true, StateOpen}, call{Success, false, StateOpen})
		run(t, cb, calls) // 5 failures

		d := time.Until(cb.OpenUntil())
		if d < time.Second || d >= 1200*time.Millisecond {
			t.Fatalf("open for %v; want [1s, 1.2s)", d)
		}
		time.Sleep(d + 1)
		done := allowN(t, cb, 1)[0] // 1 probe
		run(t, cb, []call{{Success, false, StateHalfOpen}})
		done.Done(Success)
		if got := cb.State(); got != StateClosed {
			t.Fatalf("State() = %v after the probe succeeded; want closed", got)
		}
	})
}

func TestOpenRejectsUntilOpenFor(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		cb := New(Settings{Failures: 1, OpenFor: time.Second, Jitter: -1})
		start := time.Now()
		trip(t, cb)
		if got, want := cb.OpenUntil(), start.Add(time.Second); !got.Equal(want) {
			t.Fatalf("OpenUntil() = %v; want %v", got, want)
		}
		time.Sleep(time.Second - 1)
		run(t, cb, []call{{Success, false, StateOpen}})
		time.Sleep(1) // exactly OpenFor: gobreaker waits until after it
		run(t, cb, []call{{Success, false, StateOpen}})
		time.Sleep(1)
		run(t, cb, []call{{Success, true, StateClosed}})
		if got := cb.OpenUntil(); !got.IsZero() {
			t.Fatalf("OpenUntil() = %v when closed; want zero", got)
		}
	})
}

func TestJitter(t *testing.T) {
	const openFor = time.Second
	for _, tt := range []struct {
		jitter float64
		max    time.Duration // open periods lie in [openFor, max)
	}{
		{0, 1200 * time.Millisecond}, // the default, 0.2
		{0.5, 1500 * time.Millisecond},
		{2, 3 * time.Second},
		{-1, openFor + 1}, // none
	} {
		t.Run(fmt.Sprint(tt.jitter), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				cb := New(Settings{Failures: 1, OpenFor: openFor, Jitter: tt.jitter})
				const trials = 200
				seen := make(map[time.Duration]bool)
				lo, hi := tt.max, time.Duration(0)
				for range trials {
					trip(t, cb)
					d := time.Until(cb.OpenUntil())
					if d < openFor || d >= tt.max {
						t.Fatalf("open for %v; want [%v, %v)", d, openFor, tt.max)
					}
					seen[d] = true
					lo, hi = min(lo, d), max(hi, d)

					// gobreaker's own Timeout has passed here, so an Allow
					// that called into it would move it to half-open.
					time.Sleep(d - 1)
					run(t, cb, []call{{Success, false, StateOpen}})
					time.Sleep(2)
					run(t, cb, []call{{Success, true, StateClosed}})
				}
				if tt.jitter < 0 {
					if len(seen) != 1 {
						t.Fatalf("%d distinct open periods without jitter; want 1", len(seen))
					}
					return
				}
				// With 200 trials each bound misses by chance with
				// probability 0.9^200, about 7e-10.
				if span := tt.max - openFor; lo >= openFor+span/10 || hi < tt.max-span/10 {
					t.Fatalf("open periods in [%v, %v]; want them spread over [%v, %v)", lo, hi, openFor, tt.max)
				}
			})
		})
	}
}

// TestJitterFromRand: the jitter is drawn from Settings.Rand, so that two
// breakers given the same source open for the same periods.
func TestJitterFromRand(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const openFor = time.Second
		a := New(Settings{Failures: 1, OpenFor: openFor, Jitter: 0.5, Rand: rand.NewPCG(1, 2)})
		b := New(Settings{Failures: 1, OpenFor: openFor, Jitter: 0.5, Rand: rand.NewPCG(1, 2)})
		draws := rand.New(rand.NewPCG(1, 2))
		for i := range 5 {
			trip(t, a)
			trip(t, b)
			want := openFor + time.Duration(draws.Int64N(int64(openFor/2)))
			if da, db := time.Until(a.OpenUntil()), time.Until(b.OpenUntil()); da != want || db != want {
				t.Fatalf("trip %d: open for %v and %v; want %v for both", i, da, db, want)
			}
			time.Sleep(want + 1)
			run(t, a, []call{{Success, true, StateClosed}})
			run(t, b, []call{{Success, true, StateClosed}})
		}
	})
}

// TestLateResultKeepsOpen reports a call's result after the breaker opened,
// past gobreaker's Timeout but inside the jitter: it must not end the open
// period early.
func TestLateResultKeepsOpen(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const openFor = time.Second
		// The jitter must leave room after gobreaker's Timeout; it does
		// but for odds of 1e-9 a draw, so draw again then.
		var cb *Breaker
		var late []Ticket
		var d time.Duration
		for range 10 {
			cb = New(Settings{Failures: 1, OpenFor: openFor, Jitter: 1})
			late = allowN(t, cb, 2)
			late[0].Done(Failure)
			if d = time.Until(cb.OpenUntil()); d >= openFor+2 {
				break
			}
		}
		time.Sleep(openFor + (d-openFor)/2)
		late[1].Done(Success)
		run(t, cb, []call{{Success, false, StateOpen}})
		time.Sleep(time.Until(cb.OpenUntil()) + 1)
		run(t, cb, []call{{Success, true, StateClosed}})
	})
}

func TestHalfOpen(t *testing.T) {
	const probes = 3
	// halfOpen returns a breaker that has just moved to half-open, with all
	// probes taken.
	halfOpen := func(t *testing.T) (*Breaker, []Ticket) {
		cb := New(Settings{Failures: 1, OpenFor: time.Second, Jitter: -1, Probes: probes})
		trip(t, cb)
		time.Sleep(time.Second + 1)
		dones := allowN(t, cb, probes)
		run(t, cb, []call{{Success, false, StateHalfOpen}})
		return cb, dones
	}
	t.Run("all succeed", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			cb, dones := halfOpen(t)
			for i, done := range dones {
				done.Done(Success)
				want := StateHalfOpen
				if i == len(dones)-1 {
					want = StateClosed
				}
				if got := cb.State(); got != want {
					t.Fatalf("State() = %v after %d successful probes; want %v", got, i+1, want)
				}
			}
		})
	})
	t.Run("one fails", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			cb, dones := halfOpen(t)
			dones[0].Done(Success)
			dones[1].Done(Failure)
			if got := cb.State(); got != StateOpen {
				t.Fatalf("State() = %v after a failed probe; want open", got)
			}
			if got, want := cb.OpenUntil(), time.Now().Add(time.Second); !got.Equal(want) {
				t.Fatalf("OpenUntil() = %v; want %v", got, want)
			}
			dones[2].Done(Success) // from before the reopening: ignored
			run(t, cb, []call{{Success, false, StateOpen}})
		})
	})
	t.Run("excluded frees its slot", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			cb, dones := halfOpen(t)
			dones[0].Done(Excluded)
			if got := cb.State(); got != StateHalfOpen {
				t.Fatalf("State() = %v after an excluded probe; want half-open", got)
			}
			dones[0] = allowN(t, cb, 1)[0]
			run(t, cb, []call{{Success, false, StateHalfOpen}})
			for _, done := range dones {
				done.Done(Success)
			}
			if got := cb.State(); got != StateClosed {
				t.Fatalf("State() = %v; want closed", got)
			}
		})
	})
}

func TestExcludedNeverOpens(t *testing.T) {
	cb := New(Settings{Failures: 2})
	run(t, cb, []call{{Failure, true, StateClosed}})
	for range 4000 {
		run(t, cb, []call{{Excluded, true, StateClosed}})
	}
	// Excluded results neither count nor end the run of failures.
	run(t, cb, []call{{Failure, true, StateOpen}})
}

// TestOnStateChangeOutsideLocks runs in real time: a hook called with a lock
// held would hang rather than block durably, which synctest cannot report.
func TestOnStateChangeOutsideLocks(t *testing.T) {
	const openFor = 100 * time.Millisecond
	var (
		cb    *Breaker
		got   []transition
		depth int
	)
	cb = New(Settings{
		Name:     "node:6379",
		Failures: 1,
		OpenFor:  openFor,
		Jitter:   -1,
		OnStateChange: func(name string, from, to State) {
			depth++
			defer func() { depth-- }()
			if depth > 1 {
				t.Errorf("OnStateChange(%v, %v) called from inside OnStateChange", from, to)
			}
			if name != "node:6379" {
				t.Errorf("OnStateChange name = %q; want node:6379", name)
			}
			if !cb.mu.TryLock() {
				t.Errorf("OnStateChange(%v, %v) called with the Breaker's mutex held", from, to)
			} else {
				cb.mu.Unlock()
			}
			got = append(got, transition{from, to})
			cb.State()
			cb.OpenUntil()
			// Refused while open or while the one probe is out; once
			// closed, this call fails and opens the breaker again.
			if done, ok := cb.Allow(); ok {
				done.Done(Failure)
			}
		},
	})

	finished := make(chan struct{})
	go func() {
		defer close(finished)
		if done, ok := cb.Allow(); ok {
			done.Done(Failure)
		}
		time.Sleep(openFor + openFor/2)
		if done, ok := cb.Allow(); ok {
			done.Done(Success)
		}
	}()
	select {
	case <-finished:
	case <-time.After(10 * time.Second):
		t.Fatal("deadlock: Allow or done did not return")
	}

	want := []transition{
		{StateClosed, StateOpen},
		{StateOpen, StateHalfOpen},
		{StateHalfOpen, StateClosed},
		{StateClosed, StateOpen}, // by the hook
	}
	if !slices.Equal(got, want) {
		t.Fatalf("OnStateChange calls = %v; want %v", got, want)
	}
	if got := cb.State(); got != StateOpen {
		t.Errorf("State() = %v; want open", got)
	}
}

// TestOnStateChangeInOrder checks, under many goroutines, that the hook is
// called one transition at a time and in order. The hook keeps no lock of
// its own: overlapping calls would be reported by the race detector.
func TestOnStateChangeInOrder(t *testing.T) {
	var got []transition
	cb := New(Settings{
		Failures: 2,
		OpenFor:  100 * time.Microsecond,
		Probes:   2,
		OnStateChange: func(_ string, from, to State) {
			got = append(got, transition{from, to})
			runtime.Gosched() // let other goroutines make transitions meanwhile
		},
	})
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			for i := range 3000 {
				done, ok := cb.Allow()
				if !ok {
					continue
				}
				switch (g + i) % 3 {
				case 0:
					done.Done(Success)
				case 1:
					done.Done(Failure)
				default:
					done.Done(Excluded)
				}
			}
		})
	}
	wg.Wait()

	if len(got) < 3 {
		t.Fatalf("only %d transitions: %v", len(got), got)
	}
	prev := StateClosed
	for i, tr := range got {
		if tr.from != prev || tr.from == tr.to {
			t.Fatalf("transition %d is %v after one to %v", i, tr, prev)
		}
		prev = tr.to
	}
	if s := cb.State(); s != prev {
		t.Fatalf("State() = %v; last transition was to %v", s, prev)
	}
}

func TestOnStateChangePanics(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var calls int
		cb := New(Settings{
			Failures: 1,
			OpenFor:  time.Second,
			OnStateChange: func(_ string, _, to State) {
				calls++
				if to == StateHalfOpen {
					panic("hook")
				}
			},
		})
		trip(t, cb)
		time.Sleep(time.Until(cb.OpenUntil()) + 1)
		func() {
			defer func() {
				if r := recover(); r != "hook" {
					t.Fatalf("recover() = %v; want the hook's panic", r)
				}
			}()
			cb.Allow()
		}()
		// The probe the panic took from the caller was given back, and the
		// hook is called for later transitions.
		run(t, cb, []call{{Success, true, StateClosed}})
		if calls != 3 {
			t.Fatalf("OnStateChange called %d times; want 3", calls)
		}
	})
}

func TestAllowOpenDoesNotAllocate(t *testing.T) {
	cb := New(Settings{Failures: 1, OpenFor: time.Hour})
	trip(t, cb)
	allocs := testing.AllocsPerRun(1000, func() {
		if _, ok := cb.Allow(); ok {
			t.Fatal("Allow() = true while open")
		}
	})
	if allocs != 0 {
		t.Fatalf("Allow() while open: %v allocs; want 0", allocs)
	}
}

func BenchmarkAllowOpen(b *testing.B) {
	cb := New(Settings{Failures: 1, OpenFor: time.Hour})
	if done, ok := cb.Allow(); ok {
		done.Done(Failure)
	}
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if _, ok := cb.Allow(); ok {
				panic("Allow() = true while open")
			}
		}
	})
}

func BenchmarkAllowClosed(b *testing.B) {
	cb := New(Settings{})
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			done, ok := cb.Allow()
			if !ok {
				panic("Allow() = false while closed")
			}
			done.Done(Success)
		}
	})
}
