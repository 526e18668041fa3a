package hybridlimit

import (
	"context"
	"crypto/sha1"
	"errors"
	"fmt"
	"hash/maphash"
	"log/slog"
	"math"
	"math/rand/v2"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/hybridlimit/hybridlimit/internal/redistest"
	"github.com/hybridlimit/hybridlimit/internal/simnet"
	"github.com/hybridlimit/hybridlimit/internal/simredis"
	"github.com/hybridlimit/hybridlimit/lua"
	"github.com/hybridlimit/hybridlimit/remote"
	"github.com/redis/go-redis/v9"
)

// TestDemandTally: tokens offered to a key count until they reach its
// limit for the window, or what Redis admitted if more; keys far from
// their limit count without an entry; a new window starts again; beyond
// demandKeys keys in a shard, denials of further keys do not count.
func TestDemandTally(t *testing.T) {
	d := newDemand()
	type step struct {
		key     string
		n       int64
		allowed bool
		left    int64 // tokens the bucket held after
		want    int64
	}
	run := func(steps []step) {
		t.Helper()
		for i, s := range steps {
			if got := d.tally(s.key, s.n, s.allowed, s.left, 10); got != s.want {
				t.Errorf("step %d: tally(%q, %d, %v, %d, 10) = %d; want %d", i, s.key, s.n, s.allowed, s.left, got, s.want)
			}
		}
	}
	run([]step{
		{"a", 3, true, 50, 3}, // far from the limit: counted, no entry
		{"a", 3, true, 9, 3},  // near it: counted, entry at 3
		{"a", 4, false, 0, 4}, // denied: 7 of 10 since
		{"a", 4, false, 0, 3}, // 10
		{"a", 1, false, 0, 0},
		{"a", 5, true, 0, 0}, // within the 10 counted already
		{"a", 3, true, 0, 1}, // admitted 11: more than the limit counts
		{"a", 3, false, 0, 0},
		{"b", 9, false, 0, 9},
		{"b", 9, false, 0, 1},
	})
	d.window.Add(1)
	run([]step{{"a", 4, false, 0, 4}, {"b", 20, false, 0, 10}})
	// Fill one shard with denied keys: the next new key of that shard
	// is not counted, one already there still is.
	d.window.Add(1)
	shard := func(key string) uint64 { return maphash.String(d.seed, key) % demandShards }
	var first, extra string
	for i, n := 0, 0; n <= demandKeys; i++ {
		key := strconv.Itoa(i)
		if shard(key) != 0 {
			continue
		}
		if n == 0 {
			first = key
		}
		if n == demandKeys {
			extra = key
			break
		}
		d.tally(key, 1, false, 0, 10)
		n++
	}
	run([]step{{extra, 1, false, 0, 0}, {first, 1, false, 0, 1}, {extra, 1, true, 0, 1}})
}

// TestFleetAbuse: one instance flooded with 100 times the limit of key X,
// all of it denied, takes no more of the limit while Redis is away than
// if it used X to its limit; the other two instances, serving key Y,
// keep their shares. Counting decisions instead (every decision, denials
// and cached denials included) left each of them 0.044 of the limit,
// where they hold 0.255. On the simulated Redis at virtual time by
// default, where the flood costs no wall-clock time and the weights do not
// depend on the machine's load (on real servers, with -realtime, a busy
// machine once left an instance serving Y at 0.210 against 0.217).
func TestFleetAbuse(t *testing.T) {
	const limit = 20 // per second, per key
	run := func(t *testing.T, flood int) (w []float64) {
		withRedis(t, func(t *testing.T, r *testRedis) { w = abuse(t, r, limit, flood) })
		return w
	}
	var fair, flooded []float64
	t.Run("fair", func(t *testing.T) { fair = run(t, 1) })
	t.Run("flooded", func(t *testing.T) { flooded = run(t, 100) })
	t.Logf("weights with X used to its limit %.3f, flooded 100x %.3f", fair, flooded)
	if len(fair) != 3 || len(flooded) != 3 {
		t.Fatal("a run ended early")
	}
	for i := 1; i < 3; i++ {
		if flooded[i] < 0.85*fair[i] {
			t.Errorf("instance %d serving Y: weight %.3f with X flooded; want at least 85%% of %.3f", i, flooded[i], fair[i])
		}
	}
}

// abuse runs TestFleetAbuse's fleet on r for 2 s, instance 0 offering
// flood times the limit of key X, instances 1 and 2 half the limit of key
// Y each, and returns their weights.
func abuse(t *testing.T, r *testRedis, limit, flood int) []float64 {
	var lims []*Limiter
	for range 3 {
		lims = append(lims, newLimiter(t, Config{Redis: r.client(t), Limit: PerSecond(int64(limit)),
			Instances: 3, Heartbeat: 100 * time.Millisecond}))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	offer := func(lim *Limiter, key string, perSecond int) {
		defer wg.Done()
		tick := time.NewTicker(time.Second / time.Duration(perSecond))
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
				// The run's own deadline may end the last decisions.
				if _, err := lim.Allow(ctx, key); err != nil && !errors.Is(err, context.DeadlineExceeded) {
					t.Error(err)
				}
			}
		}
	}
	wg.Add(3)
	go offer(lims[0], "X", flood*limit)
	go offer(lims[1], "Y", limit/2) // Y's limit, spread over two instances
	go offer(lims[2], "Y", limit/2)
	wg.Wait()
	w := make([]float64, 3)
	for i, lim := range lims {
		w[i] = lim.Stats().Weight
	}
	return w
}

var fleetSHA = fmt.Sprintf("%x", sha1.Sum([]byte(lua.Fleet)))

// beatCounter is a go-redis hook that counts the fleet script's calls
// and the round trips that carried them.
type beatCounter struct{ beats, trips atomic.Int64 }

func (*beatCounter) DialHook(next redis.DialHook) redis.DialHook { return next }

func isBeat(cmd redis.Cmder) bool {
	args := cmd.Args()
	if len(args) < 2 {
		return false
	}
	s, _ := args[1].(string)
	_, fleetFunction := remote.FunctionNames()
	return s == fleetSHA || s == lua.Fleet || s == fleetFunction
}

func (b *beatCounter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if isBeat(cmd) {
			b.beats.Add(1)
			b.trips.Add(1)
		}
		return next(ctx, cmd)
	}
}

func (b *beatCounter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		n := 0
		for _, cmd := range cmds {
			if isBeat(cmd) {
				n++
			}
		}
		if n > 0 {
			b.beats.Add(int64(n))
			b.trips.Add(1)
		}
		return next(ctx, cmds)
	}
}

// TestPacerSharesRoundTrips: the heartbeats of Limiters that share a
// client go out together, a few round trips per window rather than one
// per Limiter, every Limiter still learns the fleet from them, and the
// one goroutine that sends them stops when the last of them closes.
func TestPacerSharesRoundTrips(t *testing.T) {
	leakCheck(t)
	const n, every = 24, 100 * time.Millisecond
	srv := redistest.Start(t)
	c := srv.Client(t)
	var hooks beatCounter
	c.AddHook(&hooks)
	var lims []*Limiter
	for range n {
		lim, err := New(Config{Redis: c, Limit: PerSecond(100), Prefix: t.Name() + ":", Heartbeat: every})
		if err != nil {
			t.Fatal(err)
		}
		lims = append(lims, lim)
	}
	// A window's sum is read three windows after it: wait for every
	// Limiter to have read one that counted all of them, within 3 s.
	deadline := time.Now().Add(3 * time.Second)
	for {
		all := true
		for _, lim := range lims {
			all = all && lim.Stats().Fleet == n
		}
		if all {
			break
		}
		if time.Now().After(deadline) {
			for i, lim := range lims {
				if s := lim.Stats(); s.Fleet != n {
					t.Errorf("Limiter %d: Stats().Fleet = %d; want %d", i, s.Fleet, n)
				}
			}
			break
		}
		time.Sleep(every)
	}
	beats, trips := hooks.beats.Load(), hooks.trips.Load()
	t.Logf("%d heartbeats in %d round trips", beats, trips)
	// pacerSlots round trips per window at most, for n heartbeats, and a
	// few more for the first windows (NOSCRIPT, a late timer).
	if beats < n || trips*n > beats*(pacerSlots+2) {
		t.Errorf("%d heartbeats in %d round trips; want at most %d round trips per %d heartbeats", beats, trips, pacerSlots+2, n)
	}
	p := lims[0].pacer
	for _, lim := range lims[1:] {
		if lim.pacer != p {
			t.Fatal("Limiters sharing a client have different pacers")
		}
	}
	for _, lim := range lims[:n-1] {
		lim.Close()
	}
	select {
	case <-p.done:
		t.Fatal("the pacer stopped while a Limiter still uses it")
	default:
	}
	lims[n-1].Close()
	select {
	case <-p.done:
	default:
		t.Fatal("the pacer still runs after its last Limiter closed")
	}
	pacers.mu.Lock()
	_, still := pacers.by[c]
	pacers.mu.Unlock()
	if still {
		t.Error("the closed pacer is still registered for its client")
	}
}

// TestPacerOffsets: a process with one Limiter reports anywhere from 5%
// to 85% into the window, so that a fleet of such processes spreads its
// heartbeats over the window; the Limiters of one client spread over the
// pacer's slots.
func TestPacerOffsets(t *testing.T) {
	const every, n = time.Second, 200
	newLim := func(c *redis.Client) *Limiter {
		lim := &Limiter{cfg: Config{Redis: c, Heartbeat: every}, rand: rand.New(globalSource{})}
		lim.ctx, lim.cancel = context.WithCancel(context.Background())
		return lim
	}
	var low, high int
	for range n {
		c := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"}) // never dialed: no step is due
		lim := newLim(c)
		h := newHeart(lim)
		p := join(h)
		off := h.offset
		p.leave(h)
		lim.cancel()
		c.Close()
		if off < every/20 || off >= every*17/20 {
			t.Fatalf("offset %v; want within [%v, %v)", off, every/20, every*17/20)
		}
		if off < every*9/20 {
			low++
		} else {
			high++
		}
	}
	if low < n/4 || high < n/4 {
		t.Errorf("offsets of single-Limiter processes: %d in the window's 5-45%%, %d in 45-85%%; want at least %d each", low, high, n/4)
	}
	c := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
	defer c.Close()
	slots := make(map[time.Duration]int)
	var hearts []*heart
	var p *pacer
	for range 2 * pacerSlots {
		lim := newLim(c)
		defer lim.cancel()
		h := newHeart(lim)
		p = join(h)
		hearts = append(hearts, h)
		slots[h.offset]++
	}
	for _, h := range hearts {
		p.leave(h)
	}
	if len(slots) != pacerSlots {
		t.Errorf("%d Limiters of one client report at %d offsets; want %d: %v", 2*pacerSlots, len(slots), pacerSlots, slots)
	}
}

// handHeart is a heart driven by hand against miniredis, through the
// pacer's own heart.beat, remote.Beats and heart.answer.
type handHeart struct {
	h *heart
}

func newHandHeart() *handHeart {
	lim := &Limiter{}
	lim.view.Store(initialView(3))
	return &handHeart{h: &heart{lim: lim, every: time.Second, prev: math.MinInt64, at: -1}}
}

// beat reports offered for window j and reads j-2, as the pacer does:
// sent at sent, run by Redis at exec (its clock; this machine's is the
// same), answered at got.
func (r *handHeart) beat(t *testing.T, m *miniredis.Miniredis, c redis.UniversalClient, j, offered int64, sent, exec, got time.Time) remote.Beat {
	t.Helper()
	m.SetTime(exec)
	h := r.h
	h.k, h.offered = j, offered
	b := []remote.Beat{h.beat()}
	remote.Beats(context.Background(), c, nil, b)
	if b[0].Err != nil {
		t.Fatalf("beat %d: %v", j, b[0].Err)
	}
	h.answer(&b[0], sent, got)
	return b[0]
}

// TestEarlyReadIsNotEmpty: a heartbeat that reaches Redis before
// the window it reads is closed (this machine's idea of Redis's clock is
// ahead of Redis's by more than the heartbeat's offset: the previous
// heartbeat met Redis stalled, which inflates the skew by half the stall;
// a failover to a host whose clock is behind; a clock step) gets the reply
// {now, taken, 0, 0}, the same as a closed window nobody reported for.
// weigh takes it for the latter and marks the window known, so the next
// heartbeat does not ask for it with Before: the instance then holds the
// lesser of its parts in m-1 and m+1, while the others hold m-1 and m, or
// m and m+1 -- no window in common, and the weights add up to more than 1.
func TestEarlyReadIsNotEmpty(t *testing.T) {
	m := miniredis.RunT(t)
	c := redis.NewClient(&redis.Options{Addr: m.Addr()})
	defer c.Close()
	const w = 1000
	base := time.Date(2026, 11, 30, 12, 0, 0, 0, time.UTC).UnixMilli() / w
	at := func(window int64, ms int64) time.Time { return time.UnixMilli(window*w + ms) }
	mw := base + 10 // window m
	// Tokens offered per window by X, Y and Z: traffic moving around, as
	// in TestWeighSumsToAtMostOne's example.
	tokens := map[int64][3]int64{}
	for j := base; j < mw-1; j++ {
		tokens[j] = [3]int64{33, 33, 34}
	}
	tokens[mw-1] = [3]int64{45, 45, 10}
	tokens[mw] = [3]int64{10, 45, 45}
	tokens[mw+1] = [3]int64{45, 10, 45}
	tokens[mw+2] = [3]int64{45, 10, 45}
	tokens[mw+3] = [3]int64{45, 10, 45}
	hearts := [3]*handHeart{newHandHeart(), newHandHeart(), newHandHeart()}
	slot := [3]int64{50, 850, 100} // X, Y, Z: ms into the window they send in
	hearts[0].h.offset = 50 * time.Millisecond
	var xEarly remote.Beat
	// Every instance reports window j during window j+1 and reads j-2.
	// X's report of window m+1 meets Redis stalled for 200 ms (a fork, a
	// slow command): TIME is read 200 ms after it arrived, the answer comes
	// at once, and rtt/2 makes X's skew 100 ms too large. So its report of
	// window m+2, due 50 ms into window m+3 by its idea of Redis's clock,
	// reaches Redis 50 ms before window m+3, when window m is not closed.
	for j := base; j <= mw+2; j++ {
		for i, hr := range hearts {
			switch {
			case i == 0 && j == mw+1:
				hr.beat(t, m, c, j, tokens[j][i], at(j+1, 50), at(j+1, 250), at(j+1, 250))
			case i == 0 && j == mw+2:
				if hr.h.k != j {
					t.Fatalf("X's next window is %d; want m+2", hr.h.k-mw)
				}
				send := hr.h.end.Add(hr.h.offset)
				t.Logf("X's skew %v; it sends its report of m+2 at %d ms into window m+3", hr.h.skew, send.UnixMilli()-(mw+3)*w)
				xEarly = hr.beat(t, m, c, j, tokens[j][i], send, send, send)
			default:
				hr.beat(t, m, c, j, tokens[j][i], at(j+1, slot[i]), at(j+1, slot[i]), at(j+1, slot[i]))
			}
		}
	}
	t.Logf("X's read of window m, before it closed: %+v", xEarly.Heartbeat)
	// Window m+4: X (50 ms) and Z (100 ms) read m+1, Y (850 ms) has not yet.
	var xb remote.Beat
	for i, hr := range hearts {
		if i == 1 {
			continue
		}
		b := hr.beat(t, m, c, mw+3, tokens[mw+3][i], at(mw+4, slot[i]), at(mw+4, slot[i]), at(mw+4, slot[i]))
		if i == 0 {
			xb = b
		}
	}
	var sum float64
	for i, hr := range hearts {
		v := hr.h.lim.view.Load()
		t.Logf("instance %d: window %d, prior %d, weight %.3f", i, v.window-mw, v.prior-mw, v.weight)
		sum += v.weight
	}
	if !xb.Before {
		t.Errorf("X's heartbeat after its early read did not ask for window m with m+1")
	}
	if sum > 1+1e-9 {
		t.Errorf("at window m+4, 300 ms in, the weights add up to %.3f; want at most 1", sum)
	}
}

// TestCloseDuringHeartbeatWithUnboundedReadTimeout: a client whose
// ReadTimeout is -1, and a Redis that hangs while a heartbeat is in
// flight: the pacer waits in go-redis's read, which only Redis's answer
// ends. Close of the pacer's last Limiter must return all the same.
func TestCloseDuringHeartbeatWithUnboundedReadTimeout(t *testing.T) {
	bubble(t, func(t *testing.T) {
		c, link := unboundedClient(t)
		lim, err := New(Config{Redis: c, Limit: PerSecond(10), Instances: 1, Heartbeat: 100 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		time.Sleep(2 * time.Second) // the first contact is over, heartbeats run
		link.Hang()
		t.Cleanup(link.Resume)
		time.Sleep(time.Second) // a heartbeat is in flight, unanswered
		closesWithinAMinute(t, lim, "Redis hung during a heartbeat", link.Resume)
	})
}

// TestHeartFollowsALateAnswer: a report answered after the window that
// follows it ended (Redis slower than what was left of that window) is
// followed by that window's count and report, which Redis still takes; it
// skipped to the window the answer came in (as it still does after a
// report that went unanswered: heart.nextWindow says why), and the instance, left out of
// the window skipped, held a ticket's part when its sum was read (0.005
// of the limit where it served 60% of the traffic,
// TestSimSlowRedisKeepsWeights). After a longer gap the windows skipped
// count nothing: their places in the report's ring held what they counted
// four windows before.
func TestHeartFollowsALateAnswer(t *testing.T) {
	at := func(window int64, ms int64) time.Time { return time.UnixMilli(window*1000 + ms) }
	h := newHandHeart().h
	h.nextWindow(at(100, 0), false)
	if h.k != 100 {
		t.Fatalf("first window %d; want 100", h.k)
	}
	h.counts = [reportWindows]int64{9, 9, 9, 9}
	h.nextWindow(at(102, 300), true) // window 100's report, answered in window 102
	if h.k != 101 {
		t.Errorf("after a report of window 100 answered in window 102, the next window counted is %d; want 101", h.k)
	}
	if !h.end.Before(at(102, 300)) {
		t.Errorf("window 101's count is due at %v; want at once (it ended at %v)", h.end, at(102, 0))
	}
	h.lim.count.Add(90) // offered during a stall of eight windows
	h.nextWindow(at(110, 0), true)
	if h.k != 110 {
		t.Errorf("after a stall to window 110, the next window counted is %d; want 110", h.k)
	}
	for w := int64(107); w < 110; w++ {
		if c := h.counts[w%reportWindows]; c != 0 {
			t.Errorf("after a stall, window %d counts %d; want nothing (the windows skipped)", w, c)
		}
	}
	h.lim.count.Add(10) // offered in window 110
	h.count()
	if h.offered != 10 {
		t.Errorf("the report after a stall of eight windows holds %d tokens; want the 10 of the window counted (a report spans 4 windows at most)", h.offered)
	}
	h.lim.count.Add(7)                // offered in window 111, which is skipped
	h.nextWindow(at(112, 300), false) // window 110's report went unanswered
	if h.k != 112 {
		t.Errorf("after a report of window 110 that went unanswered in window 112, the next window counted is %d; want 112", h.k)
	}
	h.count()
	if h.offered != 17 {
		t.Errorf("the report of window 112 after window 111 was skipped holds %d tokens; want 17 (window 110's 10, and 111's 7 counted in 112)", h.offered)
	}
}

// TestHeartbeatsReturnWithinTheirBudget: a heartbeat round trip into a
// Redis that hangs returns when its context ends, deadline or
// cancellation, whatever bounds the client's reads: go-redis reads for
// ReadTimeout (3 s by default) without ContextTimeoutEnabled, and stops no
// read at a cancellation. The pacer that sends it counts the windows of
// every Limiter of the client, and Close cancels it: with the heartbeats
// sent while the breakers are open, a pacer held for ReadTimeout waited 5 s
// a heartbeat through a hang, and Close waited for the heartbeat in flight.
func TestHeartbeatsReturnWithinTheirBudget(t *testing.T) {
	for _, ctxTimeout := range []bool{false, true} {
		for _, cancelled := range []bool{false, true} {
			name := fmt.Sprintf("ContextTimeoutEnabled=%v/cancelled=%v", ctxTimeout, cancelled)
			t.Run(name, func(t *testing.T) {
				bubble(t, func(t *testing.T) {
					sim, link := simredis.New(), simnet.NewLink()
					t.Cleanup(sim.Close)
					c := redis.NewClient(&redis.Options{Addr: "10.0.0.1:6379", ContextTimeoutEnabled: ctxTimeout,
						Dialer: link.Dialer(func(c net.Conn) { sim.Serve(c, 0) })})
					t.Cleanup(func() { c.Close() })
					beat := func() remote.Beat {
						return remote.Beat{Base: "hl:{fleet:t}", Window: time.Now().Unix(), Every: time.Second}
					}
					ctx, cancel := context.WithTimeout(context.Background(), time.Second)
					first := []remote.Beat{beat()}
					remote.Beats(ctx, c, nil, first)
					cancel()
					if first[0].Err != nil {
						t.Fatalf("a heartbeat to a healthy Redis: %v", first[0].Err)
					}
					link.Hang()
					const budget = 200 * time.Millisecond
					if cancelled {
						ctx, cancel = context.WithCancel(context.Background())
						time.AfterFunc(budget, cancel)
					} else {
						ctx, cancel = context.WithTimeout(context.Background(), budget)
					}
					start := time.Now()
					hung := []remote.Beat{beat()}
					remote.Beats(ctx, c, nil, hung)
					took := time.Since(start)
					cancel()
					if took > budget {
						t.Errorf("a heartbeat into a hung Redis returned after %v; want its budget, %v", took, budget)
					}
					if !errors.Is(hung[0].Err, remote.ErrUnanswered) {
						t.Errorf("a heartbeat into a hung Redis: error %v; want ErrUnanswered", hung[0].Err)
					}
					link.Resume() // the round trip left inside the client ends
					time.Sleep(10 * time.Second)
				})
			})
		}
	}
}

// TestHeartReadsNoWindowItsReportMayBeIn: a report that went unanswered
// may have been counted (Redis ran it; the answer came too late). Reading
// its window, the instance would take a ticket, a few thousandths of the
// limit, and hold it through an outage starting then: simulator seed
// 1173, one instance, held 0.005 of its limit in 2 of 30 replays. The
// heartbeat that reads that window sends its report alone; a report that
// never left (a dial refused) leaves the instance out of its window for
// sure, and the window is read.
func TestHeartReadsNoWindowItsReportMayBeIn(t *testing.T) {
	at := func(window int64, ms int64) time.Time { return time.UnixMilli(window*1000 + ms) }
	for _, tt := range []struct {
		name   string
		err    error
		unsure bool
	}{
		{"unanswered", fmt.Errorf("%w: %w", remote.ErrUnanswered, context.DeadlineExceeded), true},
		{"read time-out", &net.OpError{Op: "read", Net: "tcp", Err: errors.New("i/o timeout")}, true},
		{"dial refused", &net.OpError{Op: "dial", Net: "tcp", Err: errors.New("connection refused")}, false},
		{"error reply", replyError("ERR hybridlimit fleet: bad arguments"), false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			h := newHandHeart().h
			h.lim.cfg.Logger = slog.New(slog.DiscardHandler)
			h.nextWindow(at(100, 0), false)
			step := func(err error) remote.Beat {
				h.count()
				b := h.beat()
				if err != nil {
					b.Err = err
				} else {
					b.Heartbeat = remote.Heartbeat{Window: b.Window - 2, Now: at(h.k+1, 500).UnixMilli(), Taken: true, Mark: 1}
				}
				h.answer(&b, at(h.k+1, 500), at(h.k+1, 600))
				return b
			}
			step(tt.err) // window 100's report
			step(nil)    // 101's, reading 99
			if b := step(nil); b.ReportOnly != tt.unsure {
				t.Errorf("the heartbeat of window 102, reading window 100 whose report failed with %v: ReportOnly %v; want %v", tt.err, b.ReportOnly, tt.unsure)
			}
			if b := step(nil); b.ReportOnly || b.Before == tt.unsure && tt.unsure {
				t.Errorf("the heartbeat of window 103, reading window 101: ReportOnly %v, Before %v; want a read, and not of window 100 if its report may be in it", b.ReportOnly, b.Before)
			}
		})
	}
}

// replyError is an error reply of Redis's, as go-redis returns it.
type replyError string

func (e replyError) Error() string { return string(e) }
func (replyError) RedisError()     {}
