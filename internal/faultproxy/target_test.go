package faultproxy

import (
	"context"
	"testing"
	"time"

	"github.com/hybridlimit/hybridlimit/internal/redistest"
)

// TestSetTarget: after SetTarget and ResetAll, a client of the proxy talks
// to the new target, as after a failover.
func TestSetTarget(t *testing.T) {
	p := setup(t)
	other := redistest.Start(t)
	other.Do(t, "SET", "who", "other")
	ctx := context.Background()
	c := client(t, p, time.Second)
	if got, err := c.Get(ctx, "who").Result(); err == nil {
		t.Fatalf("GET who on the first target = %q; want redis.Nil", got)
	}
	p.SetTarget(other.Addr())
	if got := p.Target(); got != other.Addr() {
		t.Errorf("Target() = %q; want %q", got, other.Addr())
	}
	p.ResetAll()
	var got string
	var err error
	for range 3 { // the first call may still find the reset connection
		if got, err = c.Get(ctx, "who").Result(); err == nil {
			break
		}
	}
	if got != "other" || err != nil {
		t.Errorf("GET who after SetTarget = %q, %v; want other", got, err)
	}
}
