package main

import (
	"strings"
	"testing"
	"time"

	"github.com/hybridlimit/hybridlimit"
	"github.com/hybridlimit/hybridlimit/internal/redistest"
)

// tWriter sends what a run prints to the test's log.
type tWriter struct{ t *testing.T }

func (w tWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

// TestRun runs the scenario shortened to 4 s: decisions go degraded while
// Redis is cut off and come back to Redis after, and none is an error.
// The margins (more than half of a second's answers) leave room for a
// busy machine whose healthy Redis misses the 50 ms budget now and then.
func TestRun(t *testing.T) {
	sc := scenario{
		Redis:  redistest.Start(t).Addr(),
		Before: time.Second, Cut: time.Second, After: 2 * time.Second,
		Rate:  60,
		Limit: hybridlimit.Limit{Rate: 50, Burst: 100},
	}
	rows, err := sc.run(t.Context(), tWriter{t})
	if err != nil {
		t.Fatal(err)
	}
	if len(rows) != 4 {
		t.Fatalf("run returned %d seconds; want 4", len(rows))
	}
	for i, r := range rows {
		if r.Errors != 0 || r.answers() < sc.Rate/2 {
			t.Errorf("second %d: %d answers, %d errors; want at least %d answers, no errors", i+1, r.answers(), r.Errors, sc.Rate/2)
		}
	}
	before, cut, after := rows[0], rows[1], rows[3]
	if remote := before.answers() - before.Degraded; remote <= before.answers()/2 || before.Cut {
		t.Errorf("second 1 (Redis up): %d of %d answers from Redis, Cut %v; want more than half, false", remote, before.answers(), before.Cut)
	}
	if cut.Degraded <= cut.answers()/2 || !cut.Cut || cut.Breaker == "closed" {
		t.Errorf("second 2 (cut off): %d of %d answers degraded, Cut %v, breaker %s; want more than half, true, not closed",
			cut.Degraded, cut.answers(), cut.Cut, cut.Breaker)
	}
	if !strings.Contains(cut.RateLimit, ";hl-degraded") {
		t.Errorf("second 2 (cut off): last RateLimit field %q; want it marked hl-degraded", cut.RateLimit)
	}
	if remote := after.answers() - after.Degraded; remote <= after.answers()/2 || after.Breaker != "closed" {
		t.Errorf("second 4 (Redis back): %d of %d answers from Redis, breaker %s; want more than half, closed",
			remote, after.answers(), after.Breaker)
	}
}
