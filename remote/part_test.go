package remote

import (
	"math/rand/v2"
	"testing"
)

// fleetBucket is the script's bucket, exactly: level units at Redis time t
// (µs), refilled Q units a microsecond up to its capacity.
type fleetBucket struct {
	lim      Limit
	level, t int64
}

func (b *fleetBucket) at(now int64) {
	b.level = min(b.level+b.lim.Q*(now-b.t), b.lim.Burst*b.lim.P)
	b.t = now
}

// take takes n tokens at now if the bucket holds them (or gives -n back),
// and returns the answer: the level after and the units taken.
func (b *fleetBucket) take(now, n int64) (level, took int64) {
	b.at(now)
	u := n * b.lim.P
	if n < 0 {
		b.level = min(b.level-u, b.lim.Burst*b.lim.P)
		return b.level, u
	}
	if b.level < u {
		return b.level, 0
	}
	b.level -= u
	return b.level, u
}

// TestPartsSumToAtMostOne runs random fleets on one bucket: instances
// whose traffic is sticky, even, bursty, sparse or switching between
// them, answers delivered out of order, and checks
// that in every window the parts of all instances add up to at most 1,
// whatever each saw. (Refunds are left out: another instance's refund
// adds tokens that look like less consumption; docs/design.md bounds
// that.) Estimating each part as this instance's tokens over
// the fleet's consumption between its own answers, with the refill lost at
// the cap left out, goes far over (two instances alternating in bursts
// each see most of the consumption between their own answers as theirs).
func TestPartsSumToAtMostOne(t *testing.T) {
	const every = 200_000 // µs: windows of 200 ms
	worst := 0.0
	for seed := range uint64(300) {
		rng := rand.New(rand.NewPCG(seed, 7))
		lim, err := NewLimit(float64(1+rng.IntN(500)), int64(1+rng.IntN(200)))
		if err != nil {
			t.Fatal(err)
		}
		b := &fleetBucket{lim: lim, level: lim.Burst * lim.P, t: 1_000_000_000}
		n := 1 + rng.IntN(6)
		parts := make([]Part, n)
		rate := make([]float64, n) // calls per ms
		held := make([][]answer, n)
		got := map[int64][]float64{} // window → each instance's part
		record := func(i int) {
			for e := parts[i].cur - partRing; e < parts[i].cur; e++ {
				if p, _, ok := parts[i].At(e); ok {
					if got[e] == nil {
						got[e] = make([]float64, n)
					}
					got[e][i] = p
				}
			}
		}
		now := b.t
		for step := range 20_000 {
			if step%500 == 0 { // traffic moves
				for i := range rate {
					rate[i] = []float64{0, 0.01, 0.2, 1, 3}[rng.IntN(5)]
				}
			}
			now += 1 + rng.Int64N(3000)
			i := rng.IntN(n)
			if rng.Float64() > rate[i] {
				continue
			}
			k := 1 + rng.Int64N(min(lim.Burst, 5))
			level, took := b.take(now, k)
			held[i] = append(held[i], answer{now, level, took})
			// Answers come back late and out of order.
			for len(held[i]) > 0 && rng.IntN(3) > 0 {
				j := rng.IntN(len(held[i]))
				a := held[i][j]
				held[i] = append(held[i][:j], held[i][j+1:]...)
				parts[i].Add(lim, every, a.now, a.level, a.took)
				record(i)
			}
		}
		for e, ps := range got {
			sum := 0.0
			for _, p := range ps {
				sum += p
			}
			worst = max(worst, sum)
			if sum > 1+1e-9 {
				t.Fatalf("seed %d: window %d: parts %v add up to %.4f; want at most 1", seed, e, ps, sum)
			}
		}
	}
	t.Logf("largest sum of parts in a window: %.4f", worst)
}

type answer struct{ now, level, took int64 }

// TestPartOfStickyKey: an instance that takes every token of a key used
// past its limit holds nearly all of it; one that shares the key evenly
// with two others holds about a third; a Reset that refills the bucket
// drops what was measured.
func TestPartOfStickyKey(t *testing.T) {
	const every = 200_000
	lim, _ := NewLimit(1000, 100)
	b := &fleetBucket{lim: lim, level: 0, t: 1_000_000_000}
	var sticky, even [3]Part
	now := b.t
	for range 30_000 { // 3 s: a call every 100 µs, 10 times the limit
		now += 100
		level, took := b.take(now, 1)
		sticky[0].Add(lim, every, now, level, took)
	}
	e := now/every - 2
	if p, near, ok := sticky[0].At(e); !ok || !near || p < 0.95 {
		t.Errorf("sticky key: At(%d) = %.3f, near %v, ok %v; want at least 0.95, near", e, p, near, ok)
	}
	b = &fleetBucket{lim: lim, level: 0, t: now}
	for k := range 30_000 {
		now += 100
		level, took := b.take(now, 1)
		even[k%3].Add(lim, every, now, level, took)
	}
	e = now/every - 2
	for i := range even {
		if p, _, ok := even[i].At(e); !ok || p < 0.32 || p > 0.34 {
			t.Errorf("even key, instance %d: At(%d) = %.3f, ok %v; want 0.32-0.34", i, e, p, ok)
		}
	}
	// A Reset: the bucket is full again, more than the refill allows.
	b.level = lim.Burst * lim.P
	now += 1000
	level, took := b.take(now, 1)
	even[0].Add(lim, every, now, level, took)
	if _, _, ok := even[0].At(e); ok {
		t.Errorf("after a Reset: a part of window %d is still held", e)
	}
}
