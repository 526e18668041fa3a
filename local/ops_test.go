package local

import (
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hybridlimit/hybridlimit/remote"
)

// TestPeek: Peek reports what the next AllowN would find, from a missing
// key, a live bucket, and what Redis said of the key, and creates nothing.
func TestPeek(t *testing.T) {
	s := New(0)
	if got, reset := s.Peek(t0, "k", 10, 10, 10); got != 10 || reset != 0 {
		t.Errorf("Peek of a missing key = %v, reset in %v; want 10, full", got, reset)
	}
	if got, reset := s.Peek(t0, "k", 10, 10, 2.5); got != 2.5 || reset != 750*ms {
		t.Errorf("Peek of a missing key with capacity 2.5 = %v, reset in %v; want 2.5, full in 750ms", got, reset)
	}
	if s.Len() != 0 {
		t.Fatalf("Peek created %d buckets", s.Len())
	}
	// Redis said 4 of 10 at t0; 100 ms later 1 more has refilled.
	s.Observe(t0, 1, "k", 4, 10, 10)
	if got, reset := s.Peek(t0.Add(100*ms), "k", 10, 10, 10); got != 5 || reset != 500*ms {
		t.Errorf("Peek after Redis said 4 = %v, reset in %v; want 5, full in 500ms", got, reset)
	}
	if res := s.AllowN(t0.Add(100*ms), "k", 10, 10, 10, 2); !res.Allowed || res.Remaining != 3 {
		t.Fatalf("AllowN(2) = %+v; want allowed, 3 left", res)
	}
	for range 100 {
		if got, _ := s.Peek(t0.Add(200*ms), "k", 10, 10, 10); got < 3.999 || got > 4.001 {
			t.Fatalf("Peek of the live bucket = %v; want 4", got)
		}
	}
	if res := s.AllowN(t0.Add(200*ms), "k", 10, 10, 10, 4); !res.Allowed || res.Remaining != 0 {
		t.Errorf("AllowN(4) after the peeks = %+v; want allowed, 0 left", res)
	}
}

// TestAllowAtMost: it takes what the bucket holds, up to n; concurrent
// callers together take exactly the burst.
func TestAllowAtMost(t *testing.T) {
	s := New(0)
	res, got := s.AllowAtMost(t0, "k", 10, 10, 10, 7)
	if got != 7 || res.Remaining != 3 {
		t.Errorf("AllowAtMost(7) on 10 = %+v, %d; want 7 taken, 3 left", res, got)
	}
	res, got = s.AllowAtMost(t0, "k", 10, 10, 10, 7)
	if got != 3 || res.Remaining != 0 {
		t.Errorf("AllowAtMost(7) on 3 = %+v, %d; want 3 taken, 0 left", res, got)
	}
	res, got = s.AllowAtMost(t0.Add(50*ms), "k", 10, 10, 10, 7)
	if got != 0 || res.Allowed || res.RetryAfter != 50*ms {
		t.Errorf("AllowAtMost(7) on half a token = %+v, %d; want none taken, RetryAfter 50ms", res, got)
	}

	var taken atomic.Int64
	var wg sync.WaitGroup
	for range 50 {
		wg.Go(func() {
			_, n := s.AllowAtMost(t0, "many", 1e-6, 100, 100, 7)
			taken.Add(int64(n))
		})
	}
	wg.Wait()
	if taken.Load() != 100 {
		t.Errorf("50 × AllowAtMost(7) on a burst of 100 took %d; want 100", taken.Load())
	}
}

// TestReset: Reset forgets the key's bucket, what Redis said of it, what
// is owed, and its lease.
func TestReset(t *testing.T) {
	s := New(0)
	s.Observe(t0, 1, "k", 0, 10, 10)
	s.AllowN(t0, "k", 10, 10, 10, 0)
	s.Lease(t0, "k", remote.Limit{}, 5, t0.Add(time.Second))
	s.Reset("k")
	if _, _, _, ok := s.Seen("k"); ok {
		t.Errorf("Seen after Reset: ok")
	}
	if got := s.Leased(t0, "k", remote.Limit{}); got != 0 {
		t.Errorf("Leased after Reset = %d; want 0", got)
	}
	if res := s.AllowN(t0, "k", 10, 10, 10, 10); !res.Allowed {
		t.Errorf("AllowN(10) after Reset = %+v; want a full bucket", res)
	}
}

// TestTakeLeaseUpTo: it takes what the lease holds, up to n, while valid.
func TestTakeLeaseUpTo(t *testing.T) {
	s := New(0)
	s.Lease(t0, "k", remote.Limit{}, 5, t0.Add(100*ms))
	if taken, left := s.TakeLeaseUpTo(t0, "k", remote.Limit{}, 3); taken != 3 || left != 2 {
		t.Errorf("TakeLeaseUpTo(3) of 5 = %d, %d left; want 3, 2", taken, left)
	}
	if taken, left := s.TakeLeaseUpTo(t0, "k", remote.Limit{}, 3); taken != 2 || left != 0 {
		t.Errorf("TakeLeaseUpTo(3) of 2 = %d, %d left; want 2, 0", taken, left)
	}
	s.Lease(t0, "k", remote.Limit{}, 5, t0.Add(100*ms))
	if got := s.Leased(t0.Add(99*ms), "k", remote.Limit{}); got != 5 {
		t.Errorf("Leased = %d; want 5", got)
	}
	if taken, _ := s.TakeLeaseUpTo(t0.Add(100*ms), "k", remote.Limit{}, 3); taken != 0 {
		t.Errorf("TakeLeaseUpTo after the lease's end took %d", taken)
	}
}

// TestLeaseUnderALoweredLimit: tokens leased under a limit are not spent,
// refunded to or counted under a lower one (rate or burst), and a lease
// granted under a lower limit replaces those held under a higher one; a
// raised limit keeps them.
func TestLeaseUnderALoweredLimit(t *testing.T) {
	mk := func(rate float64, burst int64) remote.Limit {
		l, err := remote.NewLimit(rate, burst)
		if err != nil {
			t.Fatal(err)
		}
		return l
	}
	high, low, slow, higher := mk(1000, 1000), mk(1000, 10), mk(1, 1000), mk(2000, 2000)
	s := New(0)
	s.Lease(t0, "k", high, 100, t0.Add(time.Second))
	if left, ok := s.TakeLease(t0, "k", higher, 1); !ok || left != 99 {
		t.Errorf("TakeLease under a raised limit = %d, %v; want 99 left", left, ok)
	}
	for _, lower := range []remote.Limit{low, slow} {
		s.Lease(t0, "k", high, 100, t0.Add(time.Second))
		if got := s.Leased(t0, "k", lower); got != 0 {
			t.Errorf("Leased under %+v = %d; want 0", lower, got)
		}
		if s.RefundLease(t0, "k", lower, 1) {
			t.Errorf("RefundLease under %+v went to a lease of a higher limit", lower)
		}
		if left, ok := s.TakeLease(t0, "k", lower, 1); ok {
			t.Errorf("TakeLease under %+v = %d left; want the lease dropped", lower, left)
		}
		if taken, _ := s.TakeLeaseUpTo(t0, "k", lower, 5); taken != 0 {
			t.Errorf("TakeLeaseUpTo under %+v took %d; want 0", lower, taken)
		}
	}
	s.Lease(t0, "k", high, 100, t0.Add(time.Second))
	s.Lease(t0, "k", low, 3, t0.Add(time.Second))
	if got := s.Leased(t0, "k", low); got != 3 {
		t.Errorf("Leased after a lease under a lowered limit = %d; want its 3 only", got)
	}
}

// TestLeaseKeptUnderRaisedBurst: the same rate with a larger burst lowers
// nothing, so the lease stays; but NewLimit picks another fraction Q/P for
// the larger burst, whose Rate() is below the old one's in its last bits.
func TestLeaseKeptUnderRaisedBurst(t *testing.T) {
	const rate = 163.87541502137225
	from, err := remote.NewLimit(rate, 13)
	if err != nil {
		t.Fatal(err)
	}
	to, err := remote.NewLimit(rate, 5152394)
	if err != nil {
		t.Fatal(err)
	}
	if from.Rate() == to.Rate() {
		t.Fatalf("%+v and %+v have the same Rate(): the test needs two fractions of one rate", from, to)
	}
	s := New(100)
	s.Lease(t0, "k", from, 5, t0.Add(time.Second))
	if _, ok := s.TakeLease(t0.Add(time.Millisecond), "k", to, 1); !ok {
		t.Errorf("the same rate with a raised burst (%v/s, then %v/s) dropped the lease", from.Rate(), to.Rate())
	}
}
