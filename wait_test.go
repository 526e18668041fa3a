package hybridlimit

import (
	"context"
	"errors"
	"sort"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/hybridlimit/hybridlimit/internal/simnet"
	"github.com/hybridlimit/hybridlimit/internal/simredis"
)

// waitLimiter returns, inside a bubble, a Limiter of cfg on a fresh
// simulated Redis whose first contact is over, and the Redis.
func waitLimiter(t *testing.T, cfg Config) (*testRedis, *Limiter) {
	t.Helper()
	r := &testRedis{sim: simredis.New(), link: simnet.NewLink()}
	t.Cleanup(r.sim.Close)
	cfg.Redis = r.client(t)
	lim, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { lim.Close() })
	<-lim.warmed
	return r, lim
}

// uses records when admissions happened, relative to a start.
type uses struct {
	mu    sync.Mutex
	start time.Time
	at    []time.Duration
}

func (u *uses) add() {
	u.mu.Lock()
	u.at = append(u.at, time.Since(u.start))
	u.mu.Unlock()
}

// in returns the admissions in [from, to).
func (u *uses) in(from, to time.Duration) int {
	u.mu.Lock()
	defer u.mu.Unlock()
	n := 0
	for _, a := range u.at {
		if a >= from && a < to {
			n++
		}
	}
	return n
}

// busiest returns the most admissions in any window [a, a+w) that starts
// at an admission, and a.
func (u *uses) busiest(w time.Duration) (int, time.Duration) {
	u.mu.Lock()
	defer u.mu.Unlock()
	at := append([]time.Duration(nil), u.at...)
	sort.Slice(at, func(i, j int) bool { return at[i] < at[j] })
	best, from := 0, time.Duration(0)
	for i, a := range at {
		j := sort.Search(len(at), func(k int) bool { return at[k] >= a+w })
		if j-i > best {
			best, from = j-i, a
		}
	}
	return best, from
}

// TestWaitGiveBackHoldsTheLimit: 100 workers queue on a key of 10/s
// (burst 1) with WaitN; half of them give up (their contexts are
// cancelled, as when their clients time out) while they sleep on their
// reservations. Each gives its tokens back to Redis; but the waiters queued
// behind keep the wake-up times they were told, so the give-back does not
// move them up: Redis's bucket now believes the queue is shorter than it
// is, and the next waiters are given wake-up times in the middle of the
// old waiters' schedule. The key then admits far more than its limit in
// every second of the overlap.
func TestWaitGiveBackHoldsTheLimit(t *testing.T) {
	bubble(t, func(t *testing.T) {
		const rate, burst = 10, 1
		_, lim := waitLimiter(t, Config{Limit: Limit{Rate: rate, Burst: burst}, Heartbeat: -1, Instances: 1})
		ctx := context.Background()
		if d, err := lim.Allow(ctx, "k"); err != nil || !d.Allowed {
			t.Fatalf("first token: %+v, %v", d, err)
		}
		u := &uses{start: time.Now()}
		var wg sync.WaitGroup
		var cancels []context.CancelFunc
		var gaveUp atomic.Int64
		for range 100 {
			wctx, cancel := context.WithCancel(ctx)
			cancels = append(cancels, cancel)
			wg.Go(func() {
				if err := lim.Wait(wctx, "k"); err == nil {
					u.add()
				} else if errors.Is(err, context.Canceled) {
					gaveUp.Add(1)
				} else {
					t.Errorf("Wait = %v", err)
				}
			})
			time.Sleep(time.Millisecond) // in order
		}
		time.Sleep(100 * time.Millisecond)
		for i := 1; i < len(cancels); i += 2 {
			cancels[i]() // every other one gives up
		}
		time.Sleep(100 * time.Millisecond) // the give-backs land
		// 50 new workers arrive (they would have found the queue full
		// without the give-backs).
		for range 50 {
			wg.Go(func() {
				if err := lim.Wait(ctx, "k"); err != nil {
					t.Errorf("late Wait = %v", err)
					return
				}
				u.add()
			})
			time.Sleep(time.Millisecond)
		}
		wg.Wait()
		for _, c := range cancels {
			c()
		}
		most, from := u.busiest(time.Second)
		t.Logf("%d admitted (%d gave up); seconds 0-5: %d, seconds 5-10: %d; busiest 1 s window: %d from %v",
			len(u.at), gaveUp.Load(), u.in(0, 5*time.Second), u.in(5*time.Second, 10*time.Second), most, from)
		if bound := rate + burst; most > bound {
			t.Errorf("%d admitted in the 1 s window from %v; want at most Rate×1 s + Burst = %d", most, from, bound)
		}
	})
}

// TestWaitNReservedReturnsAtClose: a worker granted a reservation of a
// slow limit (PerHour(60): the queue is a burst, an hour, deep) must not
// sleep through Close until its tokens are due: a service that closes its
// limiter on shutdown would keep that worker blocked for half an hour.
func TestWaitNReservedReturnsAtClose(t *testing.T) {
	bubble(t, func(t *testing.T) {
		_, lim := waitLimiter(t, Config{Limit: Limit{Rate: 60.0 / 3600, Burst: 60}, Heartbeat: -1, Instances: 1})
		ctx := context.Background()
		if d, err := lim.AllowN(ctx, "k", 60); err != nil || !d.Allowed {
			t.Fatalf("AllowN(60) = %+v, %v", d, err)
		}
		done := make(chan time.Duration, 1)
		start := time.Now()
		go func() {
			_ = lim.WaitN(ctx, "k", 30) // due in 30 minutes
			done <- time.Since(start)
		}()
		time.Sleep(time.Second)
		lim.Close()
		took := <-done
		if took > 2*time.Second {
			t.Errorf("WaitN returned %v after it began, Close came at 1 s; want it to return at Close", took)
		}
	})
}

// TestWaitFullQueueServesLateWaiters: 10 workers loop on Wait on a key of
// 1/s (burst 1: the queue is 10 s of refill deep and they keep it full);
// 6 callers arrive together with a deadline of a minute. Served in the
// order they reached Redis, the last of them is granted within about 16 s
// (16 ahead of it or with it, one a second). Refused, a late waiter used
// to sleep until the bucket would hold its token (the whole queue
// drained) and find the queue full again, the workers taking every place
// the moment it opened: one late waiter alone got DeadlineExceeded after
// 55 s while they took 57 tokens. A looping worker is refused for a full
// queue too, each time it re-queues: allowed only a fixed place deeper
// once refused, it took that place as well, the late waiters got in one
// every 11 s, and the sixth missed its minute. The longer a waiter has
// been refused, the deeper it may queue.
func TestWaitFullQueueServesLateWaiters(t *testing.T) {
	bubble(t, func(t *testing.T) {
		_, lim := waitLimiter(t, Config{Limit: Limit{Rate: 1, Burst: 1}, Heartbeat: -1, Instances: 1})
		loop, stop := context.WithCancel(context.Background())
		var wg sync.WaitGroup
		var looped atomic.Int64
		for range 10 {
			wg.Go(func() {
				for lim.Wait(loop, "k") == nil {
					looped.Add(1)
				}
			})
			time.Sleep(time.Millisecond)
		}
		time.Sleep(time.Second)
		const late = 6
		var lw sync.WaitGroup
		took := make([]time.Duration, late)
		errs := make([]error, late)
		for i := range late {
			lw.Go(func() {
				ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
				defer cancel()
				start := time.Now()
				errs[i] = lim.Wait(ctx, "k")
				took[i] = time.Since(start)
			})
			time.Sleep(time.Millisecond)
		}
		lw.Wait()
		before := looped.Load()
		stop()
		wg.Wait()
		for i := range late {
			t.Logf("late waiter %d: %v after %v", i, errs[i], took[i])
			if errs[i] != nil || took[i] > 20*time.Second {
				t.Errorf("late waiter %d: Wait = %v after %v; want granted within about 16 s (at most 16 waiters ahead of it at 1/s)", i, errs[i], took[i])
			}
		}
		t.Logf("the 10 looping workers were granted %d tokens meanwhile", before)
	})
}

// TestWaitGiveBacksInReverseOrder: PerSecond(7), burst 1, the bucket
// empty. Three waiters queue (due at 1/7, 2/7 and 3/7 s); the last one
// gives up, then the middle one: each is the bucket's last change when it
// gives up, so both are given back, and a new waiter is due right after
// the first, at 2/7 s. With 7 units a microsecond and 10^6 units a token,
// the due time stored after the first give-back was rounded again, a
// microsecond past the middle waiter's, whose give-back was then refused.
func TestWaitGiveBacksInReverseOrder(t *testing.T) {
	bubble(t, func(t *testing.T) {
		_, lim := waitLimiter(t, Config{Limit: Limit{Rate: 7, Burst: 1}, Heartbeat: -1, Instances: 1})
		ctx := context.Background()
		if d, err := lim.Allow(ctx, "k"); err != nil || !d.Allowed {
			t.Fatalf("Allow = %+v, %v", d, err)
		}
		start := time.Now()
		var wg sync.WaitGroup
		first := make(chan time.Duration, 1)
		wg.Go(func() {
			if err := lim.Wait(ctx, "k"); err != nil {
				t.Errorf("first Wait = %v", err)
			}
			first <- time.Since(start)
		})
		synctest.Wait()
		var cancels []context.CancelFunc
		for range 2 {
			wctx, cancel := context.WithCancel(ctx)
			cancels = append(cancels, cancel)
			wg.Go(func() { _ = lim.Wait(wctx, "k") })
			synctest.Wait()
		}
		cancels[1]() // the last one gives up
		synctest.Wait()
		cancels[0]() // then the middle one: the last change again
		synctest.Wait()
		var newcomer time.Duration
		wg.Go(func() {
			if err := lim.Wait(ctx, "k"); err != nil {
				t.Errorf("new Wait = %v", err)
			}
			newcomer = time.Since(start)
		})
		wg.Wait()
		t.Logf("first waiter served at %v, the newcomer at %v", <-first, newcomer)
		if want := 2 * time.Second / 7; newcomer > want+time.Millisecond {
			t.Errorf("newcomer served at %v; want at %v (both give-backs taken: only the first waiter ahead of it)", newcomer, want)
		}
	})
}

// TestWaitGiveBackAfterLoweredLimit: a key of PerSecond(9) burst 9 is
// spent; a WaitN for 9 tokens reserves them (due in 1 s); the operator
// lowers the limit to PerSecond(1) (same burst) and the waiter gives up.
// Sent under the key's limit now, its give-back passed the script's check
// of the same P (both limits have P = 10^6) and gave back 9 tokens at 1/s
// where the reservation had added 1 s of debt: the key, empty before the
// reservation, admitted 8 at once. A give-back under another limit is not
// sent.
func TestWaitGiveBackAfterLoweredLimit(t *testing.T) {
	bubble(t, func(t *testing.T) {
		_, lim := waitLimiter(t, Config{Limit: Limit{Rate: 9, Burst: 9}, Heartbeat: -1, Instances: 1})
		ctx := context.Background()
		if d, err := lim.AllowN(ctx, "k", 9); err != nil || !d.Allowed {
			t.Fatalf("AllowN(9) = %+v, %v", d, err)
		}
		wctx, cancel := context.WithCancel(ctx)
		var wg sync.WaitGroup
		wg.Go(func() { _ = lim.WaitN(wctx, "k", 9) })
		synctest.Wait() // reserved, sleeping on it
		if err := lim.SetLimit(Limit{Rate: 1, Burst: 9}); err != nil {
			t.Fatal(err)
		}
		cancel()
		wg.Wait()
		synctest.Wait() // the give-back has run
		admitted := 0
		for range 9 {
			if d, err := lim.Allow(ctx, "k"); err == nil && d.Allowed {
				admitted++
			}
		}
		if admitted > 0 {
			t.Errorf("a key spent at this instant admitted %d tokens after a reservation was given back under a lowered limit; want 0", admitted)
		}
	})
}

// TestWaitQueueThroughAnOutage: 60 workers queue on a key of 10/s (burst
// 10) with WaitN, the last of them due 5 s on, and then Redis hangs for
// 3 s while callers of Allow keep coming on the same key. The waiters are
// admitted on their schedule, Redis or not: the tokens are theirs. Their
// admissions must come out of the local share, or it admits its rate on
// top of them (63 in the 3 s, 33 of them local).
func TestWaitQueueThroughAnOutage(t *testing.T) {
	bubble(t, func(t *testing.T) {
		const rate, burst = 10, 10
		r, lim := waitLimiter(t, Config{Limit: Limit{Rate: rate, Burst: burst}, Heartbeat: -1, Instances: 1})
		ctx := context.Background()
		u := &uses{start: time.Now()}
		var wg sync.WaitGroup
		for range 60 {
			wg.Go(func() {
				if err := lim.Wait(ctx, "k"); err != nil {
					t.Errorf("Wait = %v", err)
					return
				}
				u.add()
			})
			time.Sleep(time.Millisecond) // in order
		}
		time.Sleep(400 * time.Millisecond)
		r.link.Hang()
		hungAt := time.Since(u.start)
		stop := make(chan struct{})
		var local atomic.Int64
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				case <-time.After(20 * time.Millisecond):
				}
				if d, err := lim.Allow(ctx, "k"); err != nil {
					t.Errorf("Allow = %v", err)
				} else if d.Allowed {
					if d.Mode == ModeLocal {
						local.Add(1)
					}
					u.add()
				}
			}
		})
		time.Sleep(3 * time.Second)
		close(stop)
		r.link.Resume()
		wg.Wait()
		// The 3 s of the hang, from its start: the bucket was empty, and
		// refills 30 tokens in them.
		got := u.in(hungAt, hungAt+3*time.Second)
		t.Logf("admitted in the 3 s of the hang: %d (%d of them locally by Allow)", got, local.Load())
		if bound := rate*3 + 1; got > bound {
			t.Errorf("%d admitted in the 3 s of the hang, the waiters' and the local share's; want at most the refill of 3 s (%d)", got, bound)
		}
	})
}
