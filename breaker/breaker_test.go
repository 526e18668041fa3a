package breaker

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"testing/synctest"
	"time"

	"github.com/redis/go-redis/v9"
)

// errDown is a failure: the node reset the connection.
var errDown = &net.OpError{Op: "read", Net: "tcp", Err: syscall.ECONNRESET}

// errWrongType is a healthy answer: the server replied with an error.
var errWrongType = serverError("WRONGTYPE Operation against a key holding the wrong kind of value")

// serverError is an error the server answered with, as go-redis's redis.Error.
type serverError string

func (e serverError) Error() string { return string(e) }
func (serverError) RedisError()     {}

// call is one step of a run: Allow, then Done(err) if Allow let it through.
type call struct {
	err    error // result of the remote call
	wantOK bool  // want from Allow
	want   State // want from State afterwards
}

func run(t *testing.T, cb *Breaker, calls []call) {
	t.Helper()
	for i, c := range calls {
		done, ok := cb.Allow()
		if ok != c.wantOK {
			t.Fatalf("call %d: Allow() ok = %v; want %v", i, ok, c.wantOK)
		}
		if ok {
			done.Done(c.err)
		} else if done.b != nil || done.done != nil {
			t.Fatalf("call %d: Allow() = %+v, false; want a zero Ticket", i, done)
		}
		if got := cb.State(); got != c.want {
			t.Fatalf("call %d (err %v): State() = %v; want %v", i, c.err, got, c.want)
		}
	}
}

// trip opens cb, which must be closed and have Failures 1.
func trip(t *testing.T, cb *Breaker) {
	t.Helper()
	run(t, cb, []call{{errDown, true, StateOpen}})
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
		{errDown, true, StateClosed},
		{errDown, true, StateClosed},
		{nil, true, StateClosed}, // Failures-1, then a success: starts over
		{errDown, true, StateClosed},
		{errWrongType, true, StateClosed}, // the server answered: a success too
		{errDown, true, StateClosed},
		{errDown, true, StateClosed},
		{errDown, true, StateOpen}, // Failures in a row
		{nil, false, StateOpen},
	})
}

func TestDefaults(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		cb := New(Settings{})
		calls := make([]call, 4, 6)
		for i := range calls {
			calls[i] = call{errDown, true, StateClosed}
		}
		calls = append(calls, call{errDown, true, StateOpen}, call{nil, false, StateOpen})
		run(t, cb, calls) // 5 failures

		d := time.Until(cb.OpenUntil())
		if d < time.Second || d >= 1200*time.Millisecond {
			t.Fatalf("open for %v; want [1s, 1.2s)", d)
		}
		time.Sleep(d + 1)
		done := allowN(t, cb, 1)[0] // 1 probe
		run(t, cb, []call{{nil, false, StateHalfOpen}})
		done.Done(nil)
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
		run(t, cb, []call{{nil, false, StateOpen}})
		time.Sleep(1) // exactly OpenFor: gobreaker waits until after it
		run(t, cb, []call{{nil, false, StateOpen}})
		time.Sleep(1)
		run(t, cb, []call{{nil, true, StateClosed}})
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
					run(t, cb, []call{{nil, false, StateOpen}})
					time.Sleep(2)
					run(t, cb, []call{{nil, true, StateClosed}})
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
			late[0].Done(errDown)
			if d = time.Until(cb.OpenUntil()); d >= openFor+2 {
				break
			}
		}
		time.Sleep(openFor + (d-openFor)/2)
		late[1].Done(nil)
		run(t, cb, []call{{nil, false, StateOpen}})
		time.Sleep(time.Until(cb.OpenUntil()) + 1)
		run(t, cb, []call{{nil, true, StateClosed}})
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
		run(t, cb, []call{{nil, false, StateHalfOpen}})
		return cb, dones
	}
	t.Run("all succeed", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			cb, dones := halfOpen(t)
			for i, done := range dones {
				done.Done(nil)
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
			dones[0].Done(nil)
			dones[1].Done(errDown)
			if got := cb.State(); got != StateOpen {
				t.Fatalf("State() = %v after a failed probe; want open", got)
			}
			if got, want := cb.OpenUntil(), time.Now().Add(time.Second); !got.Equal(want) {
				t.Fatalf("OpenUntil() = %v; want %v", got, want)
			}
			dones[2].Done(nil) // from before the reopening: ignored
			run(t, cb, []call{{nil, false, StateOpen}})
		})
	})
	t.Run("excluded frees its slot", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			cb, dones := halfOpen(t)
			dones[0].Done(ErrCallerCanceled)
			if got := cb.State(); got != StateHalfOpen {
				t.Fatalf("State() = %v after an excluded probe; want half-open", got)
			}
			dones[0] = allowN(t, cb, 1)[0]
			run(t, cb, []call{{nil, false, StateHalfOpen}})
			for _, done := range dones {
				done.Done(nil)
			}
			if got := cb.State(); got != StateClosed {
				t.Fatalf("State() = %v; want closed", got)
			}
		})
	})
}

func TestExcludedNeverOpens(t *testing.T) {
	cb := New(Settings{Failures: 2})
	excluded := []error{
		fmt.Errorf("%w: %w", ErrCallerCanceled, context.DeadlineExceeded),
		fmt.Errorf("%w: %w", ErrCallerCanceled, errDown),
		context.Canceled,
		fmt.Errorf("evalsha: %w", context.Canceled),
	}
	run(t, cb, []call{{errDown, true, StateClosed}})
	for _, err := range excluded {
		for range 1000 {
			run(t, cb, []call{{err, true, StateClosed}})
		}
	}
	// Excluded results neither count nor end the run of failures.
	run(t, cb, []call{{errDown, true, StateOpen}})
}

func TestIsFailure(t *testing.T) {
	for _, tt := range []struct {
		err      error
		failure  bool
		excluded bool
	}{
		{nil, false, false},

		// The server answered: healthy.
		{redis.Nil, false, false},
		{redis.ErrNoScript, false, false},
		{errWrongType, false, false},
		{serverError("ERR wrong number of arguments for 'evalsha' command"), false, false},
		{serverError("ERR user_script:1: Script attempted to access nonexistent global variable 'x'"), false, false},
		{serverError("NOSCRIPT No matching script. Please use EVAL."), false, false},
		{serverError("BUSYKEY Target key name already exists."), false, false},
		{serverError("BUSYGROUP Consumer Group name already exists"), false, false},
		{fmt.Errorf("remote: %w", errWrongType), false, false},

		// The server answered that it cannot decide.
		{serverError("LOADING Redis is loading the dataset in memory"), true, false},
		{serverError("READONLY You can't write against a read only replica."), true, false},
		{serverError("ERR Error running script (call to f_0123): @user_script:1: -READONLY You can't write against a read only replica."), true, false},
		{serverError("MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'."), true, false},
		{serverError("CLUSTERDOWN The cluster is down"), true, false},
		{serverError("OOM command not allowed when used memory > 'maxmemory'."), true, false},
		{serverError("BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE."), true, false},
		{serverError("TRYAGAIN Multiple keys request during rehashing of slot"), true, false},
		{serverError("NOREPLICAS Not enough good replicas to write."), true, false},
		{serverError("MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist to disk."), true, false},
		{serverError("MOVED 3999 127.0.0.1:6381"), true, false},
		{serverError("ASK 3999 127.0.0.1:6381"), true, false},
		{serverError("ERR max number of clients reached"), true, false},
		{fmt.Errorf("remote: %w", serverError("LOADING Redis is loading the dataset in memory")), true, false},

		// No answer.
		{&net.OpError{Op: "dial", Net: "tcp", Err: &os.SyscallError{Syscall: "connect", Err: syscall.ECONNREFUSED}}, true, false},
		{errDown, true, false},
		{syscall.ECONNRESET, true, false},
		{syscall.EPIPE, true, false},
		{&net.OpError{Op: "read", Net: "tcp", Err: os.ErrDeadlineExceeded}, true, false},
		{&net.DNSError{Err: "no such host", Name: "redis", IsNotFound: true}, true, false},
		{io.EOF, true, false},
		{io.ErrUnexpectedEOF, true, false},
		{fmt.Errorf("remote: %w", io.EOF), true, false},
		{context.DeadlineExceeded, true, false}, // our own time budget
		{fmt.Errorf("remote: %w", context.DeadlineExceeded), true, false},
		{redis.ErrPoolTimeout, true, false},
		{redis.ErrPoolExhausted, true, false},
		{redis.ErrClosed, true, false},
		{errors.New("redis: can't parse \"?\""), true, false},

		// The caller's own cancellation: excluded.
		{ErrCallerCanceled, false, true},
		{fmt.Errorf("%w: %w", ErrCallerCanceled, context.DeadlineExceeded), false, true},
		{fmt.Errorf("%w: %w", ErrCallerCanceled, errDown), false, true},
		{context.Canceled, false, true},
		{fmt.Errorf("remote: %w", context.Canceled), false, true},
	} {
		if got := IsFailure(tt.err); got != tt.failure {
			t.Errorf("IsFailure(%#v) = %v; want %v", tt.err, got, tt.failure)
		}
		if got := IsExcluded(tt.err); got != tt.excluded {
			t.Errorf("IsExcluded(%#v) = %v; want %v", tt.err, got, tt.excluded)
		}
	}
}

// TestIsFailureGoRedis classifies errors as go-redis returns them, from a
// fake server on an in-memory net.Pipe.
func TestIsFailureGoRedis(t *testing.T) {
	for _, tt := range []struct {
		reply   string // RESP reply to every command but HELLO; "" closes, "hang" never replies
		failure bool
	}{
		{"$-1\r\n", false}, // redis.Nil
		{"-WRONGTYPE Operation against a key holding the wrong kind of value\r\n", false},
		{"-ERR unknown command 'x'\r\n", false},
		{"-NOSCRIPT No matching script. Please use EVAL.\r\n", false},
		{"-LOADING Redis is loading the dataset in memory\r\n", true},
		{"-READONLY You can't write against a read only replica.\r\n", true},
		{"-MASTERDOWN Link with MASTER is down\r\n", true},
		{"-CLUSTERDOWN The cluster is down\r\n", true},
		{"-OOM command not allowed when used memory > 'maxmemory'.\r\n", true},
		{"-BUSY Redis is busy running a script.\r\n", true},
		{"-TRYAGAIN Multiple keys request during rehashing of slot\r\n", true},
		{"-NOREPLICAS Not enough good replicas to write.\r\n", true},
		{"-MISCONF Redis is configured to save RDB snapshots\r\n", true},
		{"-MOVED 3999 127.0.0.1:6381\r\n", true},
		{"-ASK 3999 127.0.0.1:6381\r\n", true},
		{"-ERR max number of clients reached\r\n", true},
		{"", true},     // EOF
		{"hang", true}, // read time-out
	} {
		client := redis.NewClient(&redis.Options{
			Addr: "fake:6379",
			Dialer: func(context.Context, string, string) (net.Conn, error) {
				conn, srv := net.Pipe()
				go serve(srv, tt.reply)
				return conn, nil
			},
			Protocol:        2,
			DisableIdentity: true,
			MaxRetries:      -1,
			ReadTimeout:     50 * time.Millisecond,
		})
		err := client.Get(context.Background(), "k").Err()
		client.Close()
		if err == nil {
			t.Errorf("reply %q: Get returned no error", tt.reply)
			continue
		}
		if got := IsFailure(err); got != tt.failure {
			t.Errorf("reply %q: IsFailure(%#v) = %v; want %v", tt.reply, err, got, tt.failure)
		}
	}
}

// serve answers each command read from conn with reply, and HELLO with an
// error so that go-redis stays on RESP2. It returns when conn is closed.
func serve(conn net.Conn, reply string) {
	defer conn.Close()
	r := bufio.NewReader(conn)
	for {
		name, err := readCommand(r)
		if err != nil {
			return
		}
		switch {
		case strings.EqualFold(name, "HELLO"):
			_, err = io.WriteString(conn, "-ERR unknown command 'HELLO'\r\n")
		case reply == "":
			return
		case reply == "hang":
		default:
			_, err = io.WriteString(conn, reply)
		}
		if err != nil {
			return
		}
	}
}

// readCommand reads one RESP array of bulk strings and returns its first element.
func readCommand(r *bufio.Reader) (string, error) {
	line := func(prefix byte) (int, error) {
		s, err := r.ReadString('\n')
		if err != nil {
			return 0, err
		}
		if len(s) < 3 || s[0] != prefix {
			return 0, fmt.Errorf("unexpected line %q", s)
		}
		return strconv.Atoi(strings.TrimSuffix(s[1:], "\r\n"))
	}
	n, err := line('*')
	if err != nil {
		return "", err
	}
	var name string
	for i := range n {
		size, err := line('$')
		if err != nil {
			return "", err
		}
		buf := make([]byte, size+2)
		if _, err := io.ReadFull(r, buf); err != nil {
			return "", err
		}
		if i == 0 {
			name = string(buf[:size])
		}
	}
	return name, nil
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
				done.Done(errDown)
			}
		},
	})

	finished := make(chan struct{})
	go func() {
		defer close(finished)
		if done, ok := cb.Allow(); ok {
			done.Done(errDown)
		}
		time.Sleep(openFor + openFor/2)
		if done, ok := cb.Allow(); ok {
			done.Done(nil)
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
					done.Done(nil)
				case 1:
					done.Done(errDown)
				default:
					done.Done(ErrCallerCanceled)
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
		run(t, cb, []call{{nil, true, StateClosed}})
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
		done.Done(errDown)
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
			done.Done(nil)
		}
	})
}
