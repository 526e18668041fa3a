package ctxend

import (
	"context"
	"errors"
	"testing"
	"testing/synctest"
	"time"
)

func TestErr(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		if err := Err(context.Background()); err != nil {
			t.Errorf("Err(Background) = %v; want nil", err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		if err := Err(ctx); !errors.Is(err, context.Canceled) {
			t.Errorf("Err(cancelled) = %v; want Canceled", err)
		}
		// A deadline in the past whose timer has not fired: the context
		// lives, its deadline has passed.
		past := &deadlineOnly{Context: context.Background(), dl: time.Now().Add(-time.Millisecond)}
		if err := Err(past); !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("Err(deadline passed) = %v; want DeadlineExceeded", err)
		}
		future := &deadlineOnly{Context: context.Background(), dl: time.Now().Add(time.Second)}
		if err := Err(future); err != nil {
			t.Errorf("Err(deadline ahead) = %v; want nil", err)
		}
	})
}

// deadlineOnly has a deadline whose passing nothing signals.
type deadlineOnly struct {
	context.Context
	dl time.Time
}

func (c *deadlineOnly) Deadline() (time.Time, bool) { return c.dl, true }
