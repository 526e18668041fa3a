// Package ctxend tells whether a context has ended, its deadline included:
// the one rule the limiter and its middlewares use to tell a caller that
// gave up from a failure of their own.
package ctxend

import (
	"context"
	"time"
)

// Err returns ctx's error once it is cancelled or its deadline has
// passed, and nil while it lives. A context's Err lags its deadline by a
// timer's firing; Err does not: past the deadline it returns
// context.DeadlineExceeded.
func Err(ctx context.Context) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if dl, ok := ctx.Deadline(); ok && !time.Now().Before(dl) {
		return context.DeadlineExceeded
	}
	return nil
}
