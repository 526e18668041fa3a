package remote

import "math/bits"

// Windows. A part is measured over a span of spanWindows windows: the
// answers that bound a span's start and end count in the spans on both
// sides (see Part), so a longer span loses less to them (two gaps between
// answers in four windows, not in one). partRing bounds the spans a Part
// remembers, partRing-1 (by their last window): the fleet's view is read
// from a window three or four behind Redis's, and a share needs that
// window's span and the one before.
const (
	spanWindows = 4
	partRing    = 8
)

// Part is this instance's part of one key's consumption, over spans of
// Redis TIME (window e covers [e×every, (e+1)×every) microseconds; span e
// the spanWindows windows that end with window e), from the answers to its
// own calls on the key: each says what the bucket held after the call
// (Level) and when (Now), and the instance knows what it took itself.
//
// Between two answers a and b (in Redis's order) the bucket gained at most
// Q units a microsecond and lost what every instance took, so all
// instances together took at most
//
//	g = Level_a + Q×(Now_b − Now_a) − Level_b
//
// in (Now_a, Now_b]: exactly that if the bucket never reached its burst in
// between, more if it did (the refill lost at the cap is counted as taken).
// A span's room is the sum of g over the gaps from the last answer before
// the span to the first one after it, an upper bound of what the whole
// fleet took in the span; own is what this instance took in it (less what
// it refunded). own/room is then at most this instance's true part of the
// span's consumption, however few answers it saw: few only make room
// larger. Every instance's part of span e is at most its true part of the
// same consumption, so the parts of all instances add up to at most 1, by
// construction (docs/design.md, per-key shares).
//
// Three things add tokens other than the refill and break the bound:
// another instance's Refund (by at most the tokens refunded in the span's
// first and last gaps), Reset, and a Redis that lost the key. When an
// answer shows the bucket gained more than the refill allows (g below
// what this instance took), Part starts again: the spans so far have no
// part.
//
// A Part is 144 bytes. Its zero value is an empty Part. It is not safe for
// concurrent use: its owner serializes calls.
type Part struct {
	t, level int64 // the latest answer: Redis TIME (µs) and level (units); t is 0 before any
	q, p     int64 // the limit those units are in
	cur      int64 // the window of the latest answer
	since    int64 // the first window whose start an answer before it bounds
	// own and room are, for windows cur-spanWindows+1..cur at
	// w%spanWindows, the units this instance took in window w and the
	// sum of g over the gaps that end in it.
	own, room [spanWindows]int64
	calls     [spanWindows]uint16 // the answers in window w, at most 65535
	// near has bit w%partRing set when window w had an answer leaving
	// the bucket near empty (less than a window's refill, or half the
	// burst if that is less): a key used near its limit.
	near uint8
	// dense has bit e%partRing set when span e had at least denseCalls
	// answers.
	dense uint8
	parts [partRing]uint16 // spans cur-partRing+1..cur-1 at e%partRing: 0 none, else 1 + part×partScale
}

// denseCalls is how many answers a span needs for its part to be close to
// the true part: the gaps that straddle its ends, counted in the spans on
// both sides, cost about two gaps' consumption of the span's, a tenth with
// 20 answers evenly spread.
const denseCalls = 20

// partScale is the resolution of a stored part: parts are rounded down, so
// a stored part is never more than the part measured.
const partScale = 65534

// Add records the answer to one of this instance's calls on the key, made
// under lim: at Redis time now (µs) the bucket held level units after the
// call, which took took units (negative for a refund, 0 for a denial).
// every is the window's length in microseconds (at least 1).
func (pt *Part) Add(lim Limit, every, now, level, took int64) {
	if pt.t == 0 || lim.Q != pt.q || lim.P != pt.p || now <= 0 {
		pt.restart(lim, every, now, level, took)
		return
	}
	e := now / every
	if now < pt.t {
		// An answer that arrived after a later one: what it took was in
		// the gaps counted already, so it counts if its window still does.
		if e > pt.cur-spanWindows && e <= pt.cur {
			pt.own[e%spanWindows] += took
		}
		return
	}
	g, ok := gain(lim.Q, now-pt.t, pt.level, level)
	if !ok || g < took || e-pt.cur >= partRing {
		// The bucket gained more than its refill (a Reset, a Refund by
		// another instance, a Redis that lost the key), or the answers
		// are too far apart to bound anything: start again.
		pt.restart(lim, every, now, level, took)
		return
	}
	if e != pt.cur {
		// The gap ends the spans of windows cur..e-1 and bounds them; it
		// also ends in window e, so it counts there too.
		pt.finish(e, g)
	}
	i := e % spanWindows
	pt.room[i] = satAdd(pt.room[i], g)
	pt.own[i] += took
	pt.calls[i] = min(pt.calls[i], 65534) + 1
	pt.t, pt.level = now, level
	if level < nearEmpty(lim, every) {
		pt.near |= 1 << (e % partRing)
	}
}

// restart forgets every span and starts counting at the answer's window.
func (pt *Part) restart(lim Limit, every, now, level, took int64) {
	e := now / max(every, 1)
	*pt = Part{t: now, level: level, q: lim.Q, p: lim.P, cur: e, since: e + 1}
	pt.own[e%spanWindows] = took
	pt.calls[e%spanWindows] = 1
	if level < nearEmpty(lim, every) {
		pt.near = 1 << (e % partRing)
	}
}

// finish stores the parts of the spans of windows cur..e-1, which the gap
// g ending in window e > cur closes, and moves on to window e.
func (pt *Part) finish(e, g int64) {
	for w := pt.cur; w < e; w++ {
		if w > pt.cur { // no answer in w: its slots held window w-spanWindows
			pt.own[w%spanWindows], pt.room[w%spanWindows], pt.calls[w%spanWindows] = 0, 0, 0
			pt.near &^= 1 << (w % partRing)
		}
		var own, room int64
		calls := 0
		for j, o := range pt.own {
			own += o
			calls += int(pt.calls[j])
		}
		pt.dense &^= 1 << (w % partRing)
		if calls >= denseCalls {
			pt.dense |= 1 << (w % partRing)
		}
		for _, r := range pt.room {
			room = satAdd(room, r)
		}
		room = satAdd(room, g)
		pt.parts[w%partRing] = 0
		if w-spanWindows+1 >= pt.since && room > 0 {
			part := min(float64(max(own, 0))/float64(room), 1)
			pt.parts[w%partRing] = 1 + uint16(part*partScale)
		}
	}
	i := e % spanWindows
	pt.own[i], pt.room[i], pt.calls[i] = 0, 0, 0
	pt.near &^= 1 << (e % partRing)
	pt.cur = e
}

// At returns this instance's part of the key's consumption in span e (the
// spanWindows windows that end with window e), and whether the bucket was
// near empty in window e and the span had at least denseCalls answers
// (near is false otherwise: a part from few answers is well below the
// true one, and a key share should not replace a weight with it). ok is
// false if there is no part for e: the span
// has not ended, was not bounded by answers on both sides, or is older
// than the Part remembers.
func (pt *Part) At(e int64) (part float64, near, ok bool) {
	if e >= pt.cur || e <= pt.cur-partRing || e < 0 {
		return 0, false, false
	}
	v := pt.parts[e%partRing]
	if v == 0 {
		return 0, false, false
	}
	bit := uint8(1) << (e % partRing)
	return float64(v-1) / partScale, pt.near&pt.dense&bit != 0, true
}

// Last returns the last span that has a part to ask At for, if any: the
// span of the windows that end with the one before the latest answer's.
func (pt *Part) Last() int64 { return pt.cur - 1 }

// nearEmpty returns the level under which the bucket counts as near empty:
// less than a window's refill, or half the burst if that is less.
func nearEmpty(lim Limit, every int64) int64 {
	half := lim.Burst * lim.P / 2
	hi, lo := bits.Mul64(uint64(lim.Q), uint64(every))
	if hi != 0 || lo >= uint64(half) {
		return half
	}
	return int64(lo)
}

// gain returns a + q×d − b, and false if it does not fit in an int64.
func gain(q, d, a, b int64) (int64, bool) {
	hi, lo := bits.Mul64(uint64(q), uint64(d))
	if hi != 0 || lo > 1<<61 {
		return 0, false
	}
	return a + int64(lo) - b, true // |a|, |b| < 2^54
}

// satAdd returns a+b, at most 1<<62; a and b are at most 1<<62.
func satAdd(a, b int64) int64 {
	return min(a+b, 1<<62)
}
