// Package breaker guards the remote decision path of one Redis node with a
// circuit breaker: a thin wrapper over gobreaker's TwoStepCircuitBreaker
// that takes typed outcomes (it knows nothing of Redis's errors: the caller
// classifies them), lengthens each open period by a random jitter, rejects
// calls lock-free while open, and runs the OnStateChange hook outside every
// lock.
//
// A Breaker is safe for concurrent use by multiple goroutines.
package breaker

import (
	"errors"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/sony/gobreaker/v2"
)

// State is a breaker state. It prints as "closed", "half-open" or "open".
type State = gobreaker.State

// The states of a Breaker.
const (
	StateClosed   = gobreaker.StateClosed
	StateHalfOpen = gobreaker.StateHalfOpen
	StateOpen     = gobreaker.StateOpen
)

// Defaults for the zero values of Settings.
const (
	defaultFailures = 5
	defaultOpenFor  = time.Second
	defaultJitter   = 0.2
	defaultProbes   = 1
)

// maxJitter bounds the random lengthening of one open period, so that the
// arithmetic on durations cannot overflow.
const maxJitter = time.Duration(1 << 61)

// Settings configures a Breaker. Zero values mean the defaults named on each field.
type Settings struct {
	// Name is the node address, for logs; it is passed to OnStateChange.
	Name string

	// Failures is the number of consecutive failed remote decisions that
	// opens the breaker. Zero means 5.
	Failures uint32

	// OpenFor is how long the breaker stays open before it lets half-open
	// probes through. Zero or negative means 1s.
	OpenFor time.Duration

	// Jitter lengthens each open period by a random fraction in [0, Jitter)
	// of OpenFor, so that a fleet opened by one outage does not probe in
	// lockstep. Zero means 0.2; negative means none.
	Jitter float64

	// Probes is the number of half-open probes that must all succeed to close
	// the breaker; any failed probe opens it again. Zero means 1.
	Probes uint32

	// Rand, if not nil, is the source of the jitter's draws. It must be
	// safe for concurrent use, and it is called with gobreaker's mutex
	// held, so it must not block. Nil means math/rand/v2's global source. A
	// deterministic simulation sets it, so that a run replays the same
	// open periods.
	Rand rand.Source

	// OnStateChange, if not nil, is called after each transition, never
	// while any lock is held, so it may call the Breaker's methods. Calls
	// are made one at a time and in the order of the transitions, by the
	// goroutine whose Allow or done made the transition or by one that is
	// already delivering an earlier one.
	OnStateChange func(name string, from, to State)
}

// Breaker is a circuit breaker for the remote decisions sent to one Redis node.
// Create it with New.
type Breaker struct {
	cb       *gobreaker.TwoStepCircuitBreaker[struct{}]
	name     string
	openFor  time.Duration
	jitter   time.Duration // the open period is lengthened by a random duration in [0, jitter)
	epoch    time.Time     // origin of openUntil, with a monotonic clock reading
	onChange func(name string, from, to State)
	rand     *rand.Rand // the jitter's draws

	// Written only by record, which gobreaker calls with its mutex held.
	state     atomic.Int32  // the last State gobreaker reported
	openUntil atomic.Int64  // while open: end of the open period, in ns since epoch; else 0
	gen       atomic.Uint64 // number of transitions so far

	hasPending atomic.Bool // len(pending) > 0; written with mu held
	mu         sync.Mutex  // protects pending and delivering
	pending    []transition
	delivering bool // a goroutine is calling onChange
}

type transition struct{ from, to State }

// New returns a closed Breaker configured by s.
func New(s Settings) *Breaker {
	if s.Failures == 0 {
		s.Failures = defaultFailures
	}
	if s.OpenFor <= 0 {
		s.OpenFor = defaultOpenFor
	}
	switch {
	case s.Jitter == 0:
		s.Jitter = defaultJitter
	case !(s.Jitter > 0): // negative or NaN
		s.Jitter = 0
	}
	if s.Probes == 0 {
		s.Probes = defaultProbes
	}
	if s.Rand == nil {
		s.Rand = globalSource{}
	}
	b := &Breaker{
		name:     s.Name,
		openFor:  s.OpenFor,
		jitter:   maxJitter,
		epoch:    time.Now(),
		onChange: s.OnStateChange,
		rand:     rand.New(s.Rand),
	}
	if j := s.Jitter * float64(s.OpenFor); j < float64(maxJitter) {
		b.jitter = time.Duration(j)
	}
	failures := s.Failures
	b.cb = gobreaker.NewTwoStepCircuitBreaker[struct{}](gobreaker.Settings{
		Name:        s.Name,
		MaxRequests: s.Probes,
		// Timeout is the shortest open period: Allow does not call into
		// gobreaker before openUntil, which is later by the jitter, so the
		// move to half-open happens then.
		Timeout: s.OpenFor,
		ReadyToTrip: func(c gobreaker.Counts) bool {
			return c.ConsecutiveFailures >= failures
		},
		OnStateChange: b.record,
		IsSuccessful:  func(err error) bool { return err == nil },
		IsExcluded:    func(err error) bool { return err == errExcluded },
	})
	return b
}

// Outcome is what became of a call that Allow let through.
type Outcome uint8

// The outcomes of a call.
const (
	// Success: the node answered.
	Success Outcome = iota
	// Failure: the node failed to answer; consecutive failures open the
	// breaker.
	Failure
	// Excluded: the call says nothing of the node (its caller gave up
	// first); it counts as neither success nor failure.
	Excluded
)

// String returns the outcome's name, such as "failure".
func (o Outcome) String() string {
	switch o {
	case Success:
		return "success"
	case Failure:
		return "failure"
	}
	return "excluded"
}

// The errors gobreaker is given for each Outcome.
var (
	errFailure  = errors.New("breaker: failure")
	errExcluded = errors.New("breaker: excluded")
)

// Ticket is a call that Allow let through. Its Done must be called exactly
// once with the call's error. A Ticket is a value, so letting a call
// through allocates only what gobreaker does.
type Ticket struct {
	b    *Breaker
	done func(error)
	gen  uint64
}

// Done reports the call's outcome.
func (t Ticket) Done(o Outcome) {
	// After a transition gobreaker ignores the results of earlier calls,
	// but its bookkeeping could still move it from open to half-open
	// before openUntil; skip the call instead.
	if t.b.gen.Load() == t.gen {
		var err error
		switch o {
		case Failure:
			err = errFailure
		case Excluded:
			err = errExcluded
		}
		t.done(err)
	}
	t.b.notify()
}

// Allow reports whether a remote call may proceed. If it may, the Ticket's
// Done must be called exactly once with the call's error. If it may not,
// because the breaker is open or all half-open probes are taken, Allow
// returns false and a zero Ticket, which must not be used.
//
// While the open period has not elapsed Allow does not lock anything and
// does not allocate.
func (b *Breaker) Allow() (Ticket, bool) {
	if u := b.openUntil.Load(); u != 0 && int64(time.Since(b.epoch)) < u {
		return Ticket{}, false
	}
	cbDone, err := b.cb.Allow()
	if err != nil {
		b.notify()
		return Ticket{}, false
	}
	gen := b.gen.Load()
	if b.hasPending.Load() {
		// If OnStateChange panics, the caller never gets its Ticket: give
		// the call back, or a half-open probe slot would stay taken for
		// good.
		delivered := false
		defer func() {
			if !delivered {
				cbDone(errExcluded)
			}
		}()
		b.notify()
		delivered = true
	}
	return Ticket{b: b, done: cbDone, gen: gen}, true
}

// State returns the last state the breaker reported. It reads an atomic and
// never calls into gobreaker, so it may be called anywhere, OnStateChange
// included. An open breaker reports StateOpen until a call to Allow after
// OpenUntil moves it to half-open.
func (b *Breaker) State() State {
	return State(b.state.Load())
}

// OpenUntil returns when the current open period ends, jitter included, or
// the zero Time if the breaker is not open. The time may be in the past if
// no call to Allow has moved the breaker to half-open since.
func (b *Breaker) OpenUntil() time.Time {
	if b.State() != StateOpen {
		return time.Time{}
	}
	u := b.openUntil.Load()
	if u == 0 {
		return time.Time{}
	}
	return b.epoch.Add(time.Duration(u))
}

// record is gobreaker's OnStateChange. gobreaker calls it with its mutex
// held, so it only records the transition: it must not call into gobreaker
// or run the user's hook (notify does that later).
func (b *Breaker) record(_ string, from, to State) {
	var until int64
	if to == StateOpen {
		d := b.openFor
		if b.jitter > 0 {
			d += time.Duration(b.rand.Int64N(int64(b.jitter)))
		}
		until = addSat(int64(time.Since(b.epoch)), int64(d))
	}
	b.openUntil.Store(until) // before state, so OpenUntil never sees a stale period
	b.state.Store(int32(to))
	b.gen.Add(1)
	if b.onChange == nil {
		return
	}
	b.mu.Lock()
	b.pending = append(b.pending, transition{from, to})
	b.hasPending.Store(true)
	b.mu.Unlock()
}

// notify calls the user's OnStateChange for each recorded transition, in
// order, with no lock held. If another goroutine is already delivering, it
// leaves the transitions to that goroutine, which delivers until none is
// left; so a hook that calls Allow, and thereby notify, does not recurse.
// notify must be called with no lock held, after a call into gobreaker.
func (b *Breaker) notify() {
	if !b.hasPending.Load() {
		return
	}
	b.mu.Lock()
	if b.delivering {
		b.mu.Unlock()
		return
	}
	b.delivering = true
	locked := true
	defer func() { // also when the hook panics
		if !locked {
			b.mu.Lock()
		}
		b.delivering = false
		b.mu.Unlock()
	}()
	for len(b.pending) > 0 {
		batch := b.pending
		b.pending = nil
		b.hasPending.Store(false)
		b.mu.Unlock()
		locked = false
		for _, t := range batch {
			b.onChange(b.name, t.from, t.to)
		}
		b.mu.Lock()
		locked = true
	}
}

// globalSource is math/rand/v2's global source, as a Source.
type globalSource struct{}

func (globalSource) Uint64() uint64 { return rand.Uint64() }

// addSat returns a+b for b >= 0, saturating at the largest int64.
func addSat(a, b int64) int64 {
	if s := a + b; s >= a {
		return s
	}
	return 1<<63 - 1
}
