package remote

import (
	"context"
	"sync"
	"time"
)

// deadlineCtx is a call's context when its Request has a Deadline: the
// caller's context, ending at the deadline too, as context.WithDeadline
// makes one. It lives in the call and is reused with it, so that a
// decision does not make a context, a timer, a channel and a cancel
// function each time (a decision allocated 18 times with them, 13
// without: TestRemotePathAllocs). Its timer is made once and reset for
// each use; its channel is made again only after it was closed.
//
// A use begins with start and ends with finish, which only a call's
// release runs: once its answer was received, nothing else refers to it.
// The timer's function and the caller's context's AfterFunc may still run
// late, from a use that ended: each checks that what it reports is true of
// the current use (its deadline passed, its caller's context ended).
type deadlineCtx struct {
	parent context.Context // the caller's, nil between uses

	mu       sync.Mutex
	deadline time.Time
	done     chan struct{} // closed when the use ends, made again after
	err      error         // why done was closed

	timer     *time.Timer
	expire    func()      // d.expired, bound once
	cancelled func()      // d.parentEnded, bound once
	detach    func() bool // stops the caller's AfterFunc, if its context can end
}

// start begins a use: d ends at deadline, or earlier with parent.
func (d *deadlineCtx) start(parent context.Context, deadline time.Time) {
	if pd, ok := parent.Deadline(); ok && pd.Before(deadline) {
		deadline = pd
	}
	// On the monotonic clock, as context.WithDeadline counts: a deadline
	// without a monotonic reading (time.Unix, Round(0)) would otherwise
	// move with the wall clock, and expired would never end the use if it
	// stepped back.
	now := time.Now()
	left := deadline.Sub(now)
	deadline = now.Add(left)
	d.mu.Lock()
	d.parent, d.deadline = parent, deadline
	if d.done == nil {
		d.done = make(chan struct{})
	}
	// Ended already, it is so at once, as context.WithDeadline's is: a
	// call must not go to Redis for a caller that has gone.
	if err := parent.Err(); err != nil {
		d.endLocked(err)
	}
	if left <= 0 {
		d.endLocked(context.DeadlineExceeded)
	}
	ended := d.err != nil
	d.mu.Unlock()
	if ended {
		return
	}
	if d.timer == nil {
		d.expire, d.cancelled = d.expired, d.parentEnded
		d.timer = time.AfterFunc(left, d.expire)
	} else {
		d.timer.Reset(left)
	}
	if parent.Done() != nil {
		d.detach = context.AfterFunc(parent, d.cancelled)
	}
}

// expired ends the current use if its deadline has passed. A firing left
// from an earlier use finds the deadline of this one still ahead.
func (d *deadlineCtx) expired() {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.parent != nil && !time.Now().Before(d.deadline) {
		d.endLocked(context.DeadlineExceeded)
	}
}

// parentEnded ends the current use if its caller's context has ended. One
// left from an earlier use finds this one's caller still there.
func (d *deadlineCtx) parentEnded() {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.parent != nil {
		if err := d.parent.Err(); err != nil {
			d.endLocked(err)
		}
	}
}

// cancel ends the current use, as its cancel function would end a
// context.WithDeadline: for a call nobody will wait for again.
func (d *deadlineCtx) cancel() {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.parent != nil {
		d.endLocked(context.Canceled)
	}
}

// endLocked closes done with err, unless it is closed already.
func (d *deadlineCtx) endLocked(err error) {
	if d.err == nil {
		d.err = err
		close(d.done)
	}
}

// letGo stops following the caller's context: its caller left, and the
// call in flight needs only its deadline. Without it a caller's context
// that lives long (a worker's) would keep every call it gave up on.
func (d *deadlineCtx) letGo() {
	if d.detach != nil {
		d.detach()
		d.detach = nil
	}
}

// finish ends the use: the timer stopped, the caller's context let go, a
// closed channel dropped for the next use to make another.
func (d *deadlineCtx) finish() {
	if d.timer != nil {
		d.timer.Stop()
	}
	d.letGo()
	d.mu.Lock()
	d.parent = nil
	if d.err != nil {
		d.done, d.err = nil, nil
	}
	d.mu.Unlock()
}

// Deadline returns the use's deadline.
func (d *deadlineCtx) Deadline() (time.Time, bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.deadline, true
}

// Done returns a channel closed at the deadline or when the caller's
// context ends.
func (d *deadlineCtx) Done() <-chan struct{} {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.done
}

// Err returns why Done was closed, or nil. A caller's context that has
// ended ends the use here and now, as it ends a context.WithDeadline's in
// its cancel function: the AfterFunc that closes Done runs a goroutine
// later, and a call still queued must not be sent meanwhile.
func (d *deadlineCtx) Err() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.err == nil && d.parent != nil {
		if err := d.parent.Err(); err != nil {
			d.endLocked(err)
		}
	}
	return d.err
}

// Value returns the caller's context's value for key.
func (d *deadlineCtx) Value(key any) any {
	d.mu.Lock()
	p := d.parent
	d.mu.Unlock()
	if p == nil {
		return nil
	}
	return p.Value(key)
}
