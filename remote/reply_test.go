package remote

import (
	"errors"
	"strconv"
	"testing"
	"time"
)

func TestParseReply(t *testing.T) {
	lim := Limit{Q: 1, P: 100000, Burst: 10} // PerSecond(10): capacity 1,000,000 units
	const now = 1764504000000000
	for _, tc := range []struct {
		name  string
		reply []any
		cost  int64
		mode  mode
		want  Result
	}{
		{"allowed", []any{int64(1), int64(250000), int64(now)}, 100000, modeTake,
			Result{Allowed: true, Level: 250000, ResetAfter: 750 * time.Millisecond, Now: now}},
		{"allowed, full", []any{int64(1), int64(1000000), int64(now)}, -100000, modeTake,
			Result{Allowed: true, Level: 1000000, Now: now}},
		{"denied", []any{int64(0), int64(250000), int64(now)}, 300000, modeTake,
			Result{Level: 250000, RetryAfter: 50 * time.Millisecond, ResetAfter: 750 * time.Millisecond, Now: now}},
		{"denied, one unit more", []any{int64(0), int64(250001), int64(now)}, 300000, modeTake,
			Result{Level: 250001, RetryAfter: 49999 * time.Microsecond, ResetAfter: 749999 * time.Microsecond, Now: now}},
		{"denied, never", []any{int64(0), int64(1000000), int64(now)}, 1000001, modeTake,
			Result{Level: 1000000, RetryAfter: -1, Now: now}},
		{"repaired", []any{int64(3), int64(900000), int64(now)}, 100000, modeTake,
			Result{Allowed: true, Level: 900000, ResetAfter: 100 * time.Millisecond, Repaired: true, Now: now}},
		{"charged", []any{int64(1), int64(0), int64(now)}, 5000000, modeCharge,
			Result{Allowed: true, ResetAfter: time.Second, Now: now}},
		{"leased", []any{int64(1), int64(150000), int64(now), int64(700000)}, 100000, modeLease,
			Result{Allowed: true, Level: 150000, ResetAfter: 850 * time.Millisecond, Now: now, Leased: 7}},
		{"lease denied", []any{int64(0), int64(50000), int64(now), int64(0)}, 100000, modeLease,
			Result{Level: 50000, RetryAfter: 50 * time.Millisecond, ResetAfter: 950 * time.Millisecond, Now: now}},
	} {
		got, err := parseReply(tc.reply, lim, tc.cost, tc.mode)
		if err != nil || got != tc.want {
			t.Errorf("%s: parseReply(%v) = %+v, %v; want %+v", tc.name, tc.reply, got, err, tc.want)
		}
	}
	// Rounded up: 3 units a microsecond, 4 missing take 2 µs, not 1.
	odd := Limit{Q: 3, P: 10, Burst: 1}
	if got, err := parseReply([]any{int64(0), int64(6), int64(now)}, odd, 10, modeTake); err != nil ||
		got.RetryAfter != 2*time.Microsecond || got.ResetAfter != 2*time.Microsecond {
		t.Errorf("parseReply with Q=3 = %+v, %v; want RetryAfter and ResetAfter 2µs", got, err)
	}
	for _, bad := range []any{
		nil, "OK", int64(1), []any{}, []any{int64(1)},
		[]any{"1", int64(0), int64(0)},
		[]any{int64(4), int64(0), int64(0)},
		[]any{int64(-1), int64(0), int64(0)},
		[]any{int64(1), int64(-1), int64(0)},
		[]any{int64(1), int64(1000001), int64(0)},
		[]any{int64(0), int64(200000), int64(0)}, // denied with enough tokens
		[]any{int64(1), int64(0), int64(0), int64(0)},
	} {
		if res, err := parseReply(bad, lim, 100000, modeTake); !errors.Is(err, ErrReply) {
			t.Errorf("parseReply(%#v) = %+v, %v; want ErrReply", bad, res, err)
		}
	}
	for _, bad := range []any{
		[]any{int64(1), int64(0), int64(0)},                    // no leased value
		[]any{int64(1), int64(0), int64(0), int64(-100000)},    // negative
		[]any{int64(1), int64(0), int64(0), int64(150000)},     // not whole tokens
		[]any{int64(0), int64(50000), int64(0), int64(100000)}, // leased on a denial
	} {
		if res, err := parseReply(bad, lim, 100000, modeLease); !errors.Is(err, ErrReply) {
			t.Errorf("parseReply(%#v) in lease mode = %+v, %v; want ErrReply", bad, res, err)
		}
	}
	if res, err := parseReply([]any{int64(0), int64(0), int64(0)}, lim, 100000, modeCharge); !errors.Is(err, ErrReply) {
		t.Errorf("parseReply of a refused charge = %+v, %v; want ErrReply", res, err)
	}
	if res, err := parseReply([]any{int64(1), int64(0), int64(0)}, Limit{}, 1, modeTake); !errors.Is(err, ErrReply) {
		t.Errorf("parseReply for a zero Limit = %+v, %v; want ErrReply", res, err)
	}
}

// FuzzParseReply feeds replies of any shape built from the fuzzer's numbers,
// for any limit and cost: parseReply returns a Result or ErrReply, never
// panics, and never a negative level, reset or retry other than -1.
func FuzzParseReply(f *testing.F) {
	f.Add(uint8(3), int64(1), int64(250000), int64(1764504000000000), int64(1), int64(100000), int64(10), int64(100000))
	f.Add(uint8(3), int64(0), int64(0), int64(1), int64(1), int64(100000), int64(10), int64(1000001))
	f.Add(uint8(3), int64(3), int64(1), int64(0), int64(0), int64(0), int64(0), int64(0))
	f.Add(uint8(0x83), int64(1), int64(2), int64(3), int64(1), int64(1), int64(1), int64(1))
	f.Add(uint8(6), int64(1), int64(2), int64(3), int64(4), int64(5), int64(6), int64(7))
	f.Add(uint8(0x44), int64(1), int64(0), int64(3), int64(1), int64(1), int64(10), int64(1))
	f.Fuzz(func(t *testing.T, shape uint8, a, b, c, q, p, burst, cost int64) {
		nums := []int64{a, b, c}
		n := int(shape & 7)
		vals := make([]any, 0, n)
		for i := 0; i < n; i++ {
			var v any = nums[i%len(nums)]
			if shape&0x80 != 0 && i == 0 {
				v = "1" // a string where an integer belongs
			}
			vals = append(vals, v)
		}
		// Limits as NewLimit makes them: Q, P, Burst >= 1, Burst*P below 2^53.
		lim := Limit{Q: 1 + abs(q)%(1<<20), P: 1 + abs(p)%(1<<20), Burst: 1 + abs(burst)%(1<<12)}
		res, err := parseReply(vals, lim, cost, mode(shape>>5&3))
		if err != nil {
			if !errors.Is(err, ErrReply) {
				t.Fatalf("parseReply(%v) error %v does not wrap ErrReply", vals, err)
			}
			return
		}
		if res.Level < 0 || res.ResetAfter < 0 || res.RetryAfter < -1 || res.Allowed && res.RetryAfter != 0 || res.Leased < 0 {
			t.Fatalf("parseReply(%v, %+v, %d) = %+v", vals, lim, cost, res)
		}
	})
}

func abs(v int64) int64 {
	if v < 0 {
		return -(v + 1)
	}
	return v
}

func TestParseHeartbeat(t *testing.T) {
	const now = int64(1764504000000)
	sum := func(tokens, reporters int64) string { return strconv.FormatInt(tokens<<20|reporters, 10) }
	for _, tc := range []struct {
		reply any
		want  Heartbeat
	}{
		{[]any{now, int64(0), int64(0), int64(0)}, Heartbeat{Now: now}},
		{[]any{now, int64(1), sum(100, 3), int64(0)}, Heartbeat{Now: now, Taken: true, Reporters: 3, Total: 100}},
		{[]any{now, int64(1), sum(0, 3), int64(0)}, Heartbeat{Now: now, Taken: true, Reporters: 3}},
		{[]any{now, int64(0), sum(100, 3), int64(2)}, Heartbeat{Now: now, Reporters: 3, Total: 100, Ticket: 2}},
		// The report's mark: taken is 1 + the mark.
		{[]any{now, int64(1024), sum(100, 3), int64(0)}, Heartbeat{Now: now, Taken: true, Mark: 1023, Reporters: 3, Total: 100}},
		{[]any{now, int64(8), sum(100, 3), int64(0)}, Heartbeat{Now: now, Taken: true, Mark: 7, Reporters: 3, Total: 100}},
		// With the window before.
		{[]any{now, int64(1), sum(100, 3), int64(0), sum(50, 2), int64(1)},
			Heartbeat{Now: now, Taken: true, Reporters: 3, Total: 100, Before: Reading{Read: true, Reporters: 2, Total: 50, Ticket: 1}}},
		{[]any{now, int64(1), sum(100, 3), int64(0), int64(0), int64(0)},
			Heartbeat{Now: now, Taken: true, Reporters: 3, Total: 100, Before: Reading{Read: true}}},
		{[]any{now, int64(1), int64(0), int64(0), sum(50, 2), int64(0)},
			Heartbeat{Now: now, Taken: true, Before: Reading{Read: true, Reporters: 2, Total: 50}}},
	} {
		if got, err := parseHeartbeat(tc.reply); err != nil || got != tc.want {
			t.Errorf("parseHeartbeat(%v) = %+v, %v; want %+v", tc.reply, got, err, tc.want)
		}
	}
	for _, bad := range []any{
		nil, "OK", int64(1), []any{}, []any{now, int64(0), int64(0)},
		[]any{now, int64(0), int64(0), "0"},
		[]any{"1", int64(0), int64(0), int64(0)},
		[]any{int64(0), int64(0), int64(0), int64(0)},       // no time
		[]any{now, int64(1025), int64(0), int64(0)},         // a mark past 1023
		[]any{now, int64(-1), int64(0), int64(0)},           // taken less than not
		[]any{now, int64(0), "x", int64(0)},                 // not a number
		[]any{now, int64(0), "-5", int64(0)},                // negative
		[]any{now, int64(0), sum(10, 0), int64(0)},          // tokens from nobody
		[]any{now, int64(0), int64(5), int64(0)},            // a sum not as a string
		[]any{now, int64(0), int64(0), int64(1)},            // a ticket for no window
		[]any{now, int64(0), sum(1, 1), int64(-1)},          // a negative ticket
		[]any{now, int64(0), sum(1, 1), int64(0), int64(0)}, // neither 4 nor 6
		[]any{now, int64(0), sum(1, 1), int64(0), int64(0), int64(0), int64(0)},
		[]any{now, int64(0), sum(1, 1), int64(0), int64(0), int64(1)},   // a ticket for no window before
		[]any{now, int64(0), sum(1, 1), int64(0), "x", int64(0)},        // not a number
		[]any{now, int64(0), sum(1, 1), int64(0), sum(1, 1), int64(-1)}, // a negative ticket
	} {
		if h, err := parseHeartbeat(bad); !errors.Is(err, ErrReply) {
			t.Errorf("parseHeartbeat(%#v) = %+v, %v; want ErrReply", bad, h, err)
		}
	}
}

// FuzzParseHeartbeat: any reply of up to six integers or strings yields a
// Heartbeat whose numbers agree, or ErrReply; never a panic.
func FuzzParseHeartbeat(f *testing.F) {
	f.Add(uint8(0x44), int64(1764504000000), int64(1), int64(100<<20|3), int64(0))
	f.Add(uint8(0x44), int64(1764504000000), int64(0), int64(100<<20|3), int64(2))
	f.Add(uint8(0x04), int64(1), int64(0), int64(0), int64(0))
	f.Fuzz(func(t *testing.T, shape uint8, a, b, c, d int64) {
		nums := []int64{a, b, c, d}
		n := int(shape&7) % 7
		vals := make([]any, 0, n)
		for i := 0; i < n; i++ {
			var v any = nums[i%len(nums)]
			if shape&(0x10<<(i%4)) != 0 { // as a string
				v = strconv.FormatInt(nums[i%len(nums)], 10)
			}
			vals = append(vals, v)
		}
		h, err := parseHeartbeat(vals)
		if err != nil {
			if !errors.Is(err, ErrReply) {
				t.Fatalf("parseHeartbeat(%v) error %v does not wrap ErrReply", vals, err)
			}
			return
		}
		if h.Now <= 0 || h.Reporters < 0 || h.Total < 0 || h.Ticket < 0 || h.Reporters == 0 && (h.Total != 0 || h.Ticket != 0) {
			t.Fatalf("parseHeartbeat(%v) = %+v", vals, h)
		}
	})
}
