package hybridlimit

import (
	"testing"
	"time"

	"github.com/hybridlimit/hybridlimit/remote"
)

// TestSimChargesInTheirOwnUnits: a charge sent under one limit and run by
// Redis after a limit change is in units of the limit it was sent under
// (the P it carried), as the script reads it. Read by the new limit's P, a
// charge sent before the rate doubled counted twice its tokens, and the
// checker reported an overcharge that was not one (seed 391).
func TestSimChargesInTheirOwnUnits(t *testing.T) {
	before, after := PerSecond(10), Limit{Rate: 20, Burst: 10}
	rb, err := remote.NewLimit(before.Rate, before.Burst)
	if err != nil {
		t.Fatal(err)
	}
	r := &simRun{s: schedule{Timeout: 50 * time.Millisecond}}
	r.limits = append(r.limits,
		struct {
			at time.Duration
			l  Limit
		}{0, before},
		struct {
			at time.Duration
			l  Limit
		}{time.Second, after})
	// 3 tokens spent locally before the change, charged after it.
	for i := range 3 {
		r.recs = append(r.recs, record{inst: 0, key: "k", n: 1, allowed: true, mode: ModeLocal,
			start: time.Duration(i) * 100 * time.Millisecond, end: time.Duration(i) * 100 * time.Millisecond})
	}
	r.charges = []charge{{inst: 0, key: "k", units: 3 * rb.P, p: rb.P, at: 1500 * time.Millisecond}}
	var got []string
	r.checkCharges(func(name, format string, args ...any) { got = append(got, name) })
	if len(got) != 0 {
		t.Errorf("checkCharges of 3 tokens charged for 3 spent, across a doubling of the rate: %v; want none", got)
	}
}
