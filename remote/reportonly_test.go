package remote

import (
	"context"
	"testing"
	"time"
)

// TestReportOnlyReadsNothing: a ReportOnly beat whose window is four or
// more behind Redis's clock (a pacer held between a count and its report,
// a skew off) must not read a window and take a ticket there: read as
// Window+1, it did.
func TestReportOnlyReadsNothing(t *testing.T) {
	m, c := newMiniClient(t)
	ctx := context.Background()
	const every = time.Second
	k := t0.UnixMilli() / 1000
	// Another instance reports for window k+1 on time.
	m.SetTime(time.UnixMilli((k + 1) * 1000).Add(500 * time.Millisecond))
	other := []Beat{{Base: "{f}", Window: k + 1, Offered: 100, Every: every}}
	Beats(ctx, c, nil, other)
	if other[0].Err != nil || !other[0].Heartbeat.Taken {
		t.Fatalf("other: %+v", other[0])
	}
	// This instance, breaker open, sends its ReportOnly beat for window k
	// while Redis is in window k+5.
	m.SetTime(time.UnixMilli((k + 5) * 1000).Add(100 * time.Millisecond))
	b := []Beat{{Base: "{f}", Window: k, Offered: 7, Every: every, ReportOnly: true}}
	Beats(ctx, c, nil, b)
	h := b[0].Heartbeat
	r := h.Now / every.Milliseconds()
	t.Logf("err %v; heartbeat %+v; r=%d: answer() weighs it: %v", b[0].Err, h, r-k, h.Window <= r-3 && h.Window >= r-5)
	if h.Reporters > 0 || h.Ticket > 0 {
		t.Errorf("a ReportOnly beat read window %d (Reporters %d, Ticket %d)", h.Window-k, h.Reporters, h.Ticket)
	}
}
