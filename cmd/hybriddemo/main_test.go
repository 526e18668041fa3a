package main

import (
	"context"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/hybridlimit/hybridlimit"
)

// TestRun runs a short demo, Redis cut off from 1s to 2s, and checks that
// Redis decided before the outage and each policy during it, and that
// run stopped everything it started.
func TestRun(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	var out strings.Builder
	got, err := run(context.Background(), options{
		duration:    3 * time.Second,
		outageStart: time.Second,
		outageEnd:   2 * time.Second,
		rate:        200,
		limit:       100,
	}, &out)
	if err != nil {
		t.Fatalf("run: %v", err)
	}
	t.Logf("\n%s", out.String())
	if !strings.Contains(out.String(), "second  redis  policy") {
		t.Errorf("output has no table header")
	}
	want := map[hybridlimit.FailurePolicy]string{
		hybridlimit.FailLocal:  hybridlimit.ModeLocal.String(),
		hybridlimit.FailOpen:   hybridlimit.ModeFailOpen.String(),
		hybridlimit.FailClosed: hybridlimit.ModeFailClosed.String(),
	}
	for p, mode := range want {
		secs := got[p]
		if len(secs) != 3 {
			t.Fatalf("%v: %d seconds; want 3", p, len(secs))
		}
		before, during := secs[0], secs[1]
		// A machine busy enough to make a decision overrun 50ms now and
		// then may send a few to the policy even while Redis is up.
		if before.Total() < 100 || before.Modes["remote"] < before.Total()/2 {
			t.Errorf("%v, second 0-1 (Redis up): %d decisions, modes %v; want 100 or more, mostly remote",
				p, before.Total(), before.Modes)
		}
		if during.Total() < 100 || during.Modes[mode] < during.Total()*9/10 {
			t.Errorf("%v, second 1-2 (Redis cut off): %d decisions, modes %v; want 100 or more, nearly all %s",
				p, during.Total(), during.Modes, mode)
		}
		if during.Errors != 0 {
			t.Errorf("%v, second 1-2: %d errors; want none (Redis failures are not errors)", p, during.Errors)
		}
	}
	if a := got[hybridlimit.FailClosed][1].Allowed; a > 5 {
		t.Errorf("FailClosed allowed %d while Redis was cut off; want (nearly) none", a)
	}
}

func TestRunRejectsBadOptions(t *testing.T) {
	for _, o := range []options{
		{duration: 0, rate: 1, limit: 1},
		{duration: time.Second, rate: 0, limit: 1},
		{duration: time.Second, rate: 1, limit: 0},
		{duration: time.Second, rate: 1, limit: 1, outageStart: 2 * time.Second, outageEnd: time.Second},
	} {
		if _, err := run(context.Background(), o, &strings.Builder{}); err == nil {
			t.Errorf("run(%+v) = nil error; want one", o)
		}
	}
}
