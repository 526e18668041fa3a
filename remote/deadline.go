package remote

import (
	"context"
	"sync"
	"time"
)

// deadlineCtx is a call's context when its Request has a Deadline: the
// caller's context, ending at the deadline too, as context.WithDeadline
// makes one. It lives in the call and is reused with it, so that a
// decision does not allocate a context, a timer, a channel and a cancel
// function each time (four of a decision's allocations, and a runtime
// timer made and dropped). Its timer is made once and reset for each use;
// its channel is made again only after it was closed.
//
// A use begins with start and ends with finish, which only a call's
// release runs: once its answer was received, nothing else refers to it.
// The timer's function and the caller's context's AfterFunc may still run
// late, from a use that ended: each checks that it belongs to the use it
// would end.
type deadlineCtx struct {
	parent context.Context // the caller's, nil between uses

	mu       sync.Mutex
	deadline time.Time
	gen      uint64        // uses begun, for the caller's AfterFunc
	done     chan struct{} // closed when the use ends, made again after
	err      error         // why done was closed

	timer  *time.Timer
	expire func()      // d.expired, bound once
	detach func() bool // stops the caller's AfterFunc, if its context can end
}

// start begins a use: d ends at deadline, or earlier with parent.
func (d *deadlineCtx) start(parent context.Context, deadline time.Time) {
	if pd, ok := parent.Deadline(); ok && pd.Before(deadline) {
		deadline = pd
	}
	d.mu.Lock()
	d.parent, d.deadline = parent, deadline
	d.gen++
	gen := d.gen
	if d.done == nil {
		d.done = make(chan struct{})
	}
	d.mu.Unlock()
	if d.timer == nil {
		d.expire = d.expired
		d.timer = time.AfterFunc(time.Until(deadline), d.expire)
	} else {
		d.timer.Reset(time.Until(deadline))
	}
	if parent.Done() != nil {
		d.detach = context.AfterFunc(parent, func() { d.end(gen, parent.Err()) })
	}
}

// expired ends the current use if its deadline has passed: a firing left
// from an earlier use finds the deadline of this one still ahead.
func (d *deadlineCtx) expired() {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.parent != nil && d.err == nil && !time.Now().Before(d.deadline) {
		d.err = context.DeadlineExceeded
		close(d.done)
	}
}

// end ends use gen with err, if it is still the current use.
func (d *deadlineCtx) end(gen uint64, err error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.parent != nil && d.gen == gen && d.err == nil {
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
	d.timer.Stop()
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

// Err returns why Done was closed, or nil.
func (d *deadlineCtx) Err() error {
	d.mu.Lock()
	defer d.mu.Unlock()
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
