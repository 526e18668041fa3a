package remote

import (
	"context"
	"errors"
	"testing"
	"testing/synctest"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
)

type valueKey struct{}

// isDone reports whether ctx's Done channel is closed.
func isDone(ctx context.Context) bool {
	select {
	case <-ctx.Done():
		return true
	default:
		return false
	}
}

// TestDeadlineCtxEndsAtItsDeadline: a call's context ends at its
// deadline, or at its caller's if that is sooner, as
// context.WithDeadline's does.
func TestDeadlineCtxEndsAtItsDeadline(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var d deadlineCtx
		d.start(context.Background(), time.Now().Add(50*time.Millisecond))
		if dl, ok := d.Deadline(); !ok || !dl.Equal(time.Now().Add(50*time.Millisecond)) {
			t.Fatalf("Deadline() = %v, %v; want 50ms from now", dl, ok)
		}
		time.Sleep(49 * time.Millisecond)
		synctest.Wait()
		if isDone(&d) || d.Err() != nil {
			t.Fatalf("ended before its deadline: %v", d.Err())
		}
		time.Sleep(time.Millisecond)
		synctest.Wait()
		if !isDone(&d) || !errors.Is(d.Err(), context.DeadlineExceeded) {
			t.Fatalf("at its deadline: done %v, Err %v; want done, DeadlineExceeded", isDone(&d), d.Err())
		}
		d.finish()

		parent, cancel := context.WithTimeout(context.Background(), 10*time.Millisecond)
		defer cancel()
		d.start(parent, time.Now().Add(time.Second))
		if dl, _ := d.Deadline(); !dl.Equal(time.Now().Add(10 * time.Millisecond)) {
			t.Fatalf("Deadline() = %v; want the caller's, 10ms from now", dl)
		}
		time.Sleep(10 * time.Millisecond)
		synctest.Wait()
		if !isDone(&d) || !errors.Is(d.Err(), context.DeadlineExceeded) {
			t.Fatalf("at the caller's deadline: done %v, Err %v", isDone(&d), d.Err())
		}
		d.finish()
	})
}

// TestDeadlineCtxFollowsItsCaller: a caller's cancellation ends the
// call's context; once the caller has left (letGo), it no longer does,
// and the deadline still holds.
func TestDeadlineCtxFollowsItsCaller(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var d deadlineCtx
		parent, cancel := context.WithCancel(context.WithValue(context.Background(), valueKey{}, "v"))
		d.start(parent, time.Now().Add(time.Second))
		if d.Value(valueKey{}) != "v" {
			t.Errorf("Value = %v; want the caller's, v", d.Value(valueKey{}))
		}
		cancel()
		synctest.Wait()
		if !isDone(&d) || !errors.Is(d.Err(), context.Canceled) {
			t.Fatalf("caller cancelled: done %v, Err %v; want done, Canceled", isDone(&d), d.Err())
		}
		d.finish()

		parent, cancel = context.WithCancel(context.Background())
		d.start(parent, time.Now().Add(time.Second))
		d.letGo()
		cancel()
		synctest.Wait()
		if isDone(&d) {
			t.Fatalf("ended by a caller that had left: %v", d.Err())
		}
		time.Sleep(time.Second)
		synctest.Wait()
		if !errors.Is(d.Err(), context.DeadlineExceeded) {
			t.Fatalf("after its deadline: Err %v; want DeadlineExceeded", d.Err())
		}
		d.finish()
	})
}

// TestDeadlineCtxReused: a context that ended is reused with a new channel,
// and what fires late from its earlier use (its timer, its caller's
// cancellation) does not end the new one.
func TestDeadlineCtxReused(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var d deadlineCtx
		parent, cancel := context.WithCancel(context.Background())
		d.start(parent, time.Now().Add(10*time.Millisecond))
		first := d.Done()
		time.Sleep(10 * time.Millisecond)
		synctest.Wait()
		d.finish()
		cancel()

		d.start(context.Background(), time.Now().Add(time.Second))
		if d.Done() == first {
			t.Fatal("a closed channel reused")
		}
		d.expired()     // the earlier use's timer, firing late
		d.parentEnded() // its caller's cancellation, arriving late
		if isDone(&d) || d.Err() != nil {
			t.Fatalf("ended by its earlier use: %v", d.Err())
		}
		// A use that ends before its deadline keeps its channel open,
		// and the next use takes it as it is.
		d.finish()
		open := d.Done()
		d.start(context.Background(), time.Now().Add(20*time.Millisecond))
		if d.Done() != open {
			t.Error("an open channel made again")
		}
		time.Sleep(20 * time.Millisecond)
		synctest.Wait()
		if !isDone(&d) {
			t.Fatal("not ended at its deadline")
		}
		d.finish()
	})
}

// TestDeadlineCtxErrFollowsItsCallerAtOnce: once the caller's context is
// cancelled, the call's Err says so at once, as context.WithDeadline's
// does inside the cancel function; its Done follows a goroutine later. A
// queued call is dropped by its Err, and must not be sent meanwhile.
func TestDeadlineCtxErrFollowsItsCallerAtOnce(t *testing.T) {
	var d deadlineCtx
	for range 100 {
		parent, cancel := context.WithCancel(context.Background())
		d.start(parent, time.Now().Add(time.Second))
		cancel()
		if err := d.Err(); !errors.Is(err, context.Canceled) {
			t.Fatalf("Err() = %v just after the caller's cancel; want Canceled", err)
		}
		<-d.Done()
		d.finish()
	}
}

// TestDeadlineCtxEndedAtStart: a caller's context that has ended, or a
// deadline that has passed, ends the call's context at once, not a
// goroutine later: a call must not reach Redis for a caller that has gone.
// Cancelled (as at Close), it ends too.
func TestDeadlineCtxEndedAtStart(t *testing.T) {
	var d deadlineCtx
	parent, cancel := context.WithCancel(context.Background())
	cancel()
	d.start(parent, time.Now().Add(time.Second))
	if !isDone(&d) || !errors.Is(d.Err(), context.Canceled) {
		t.Errorf("caller gone at start: done %v, Err %v; want done, Canceled", isDone(&d), d.Err())
	}
	d.finish()
	d.start(context.Background(), time.Now().Add(-time.Millisecond))
	if !isDone(&d) || !errors.Is(d.Err(), context.DeadlineExceeded) {
		t.Errorf("deadline passed at start: done %v, Err %v; want done, DeadlineExceeded", isDone(&d), d.Err())
	}
	d.finish()
	d.start(context.Background(), time.Now().Add(time.Second))
	d.cancel()
	if !isDone(&d) || !errors.Is(d.Err(), context.Canceled) {
		t.Errorf("cancelled: done %v, Err %v; want done, Canceled", isDone(&d), d.Err())
	}
	d.finish()
}

// TestCloseCancelsAWaitingCall: a call whose caller leaves at Close is
// cancelled, as a context's cancel function would cancel it: one waiting
// for a connection (the client's only one is taken) is not sent once the
// connection frees. Left to its deadline, it took a token after Close.
func TestCloseCancelsAWaitingCall(t *testing.T) {
	m := miniredis.RunT(t)
	m.SetTime(t0)
	c := redis.NewClient(&redis.Options{Addr: m.Addr(), PoolSize: 1})
	defer c.Close()
	ctx := context.Background()
	held := c.Conn()
	if err := held.Ping(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	p := NewPipe(c, 2, nil)
	lim := mustLimit(t, 1e-3, 10)
	done := make(chan error, 1)
	go func() {
		_, err := p.Do(ctx, Request{Key: "k", Limit: lim, Units: lim.Units(1), Deadline: time.Now().Add(5 * time.Second)})
		done <- err
	}()
	time.Sleep(50 * time.Millisecond) // the call waits for the connection
	go func() {
		time.Sleep(100 * time.Millisecond)
		held.Close() // frees the connection, after Close has begun
	}()
	p.Close()
	if err := <-done; !errors.Is(err, ErrClosed) {
		t.Fatalf("Do = %v; want ErrClosed", err)
	}
	time.Sleep(50 * time.Millisecond)
	if m.Exists("k") {
		t.Error("a call left at Close was sent once the connection freed")
	}
}
