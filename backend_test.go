package hybridlimit

import (
	"context"
	"flag"
	"net"
	"runtime"
	"testing"
	"testing/synctest"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/hybridlimit/hybridlimit/internal/faultproxy"
	"github.com/hybridlimit/hybridlimit/internal/redistest"
	"github.com/hybridlimit/hybridlimit/internal/simnet"
	"github.com/hybridlimit/hybridlimit/internal/simredis"
)

// realtime moves the tests that run through withRedis from the simulated
// Redis at virtual time onto real redis-server processes at wall-clock
// time. What they assert is the same either way: the default run checks
// that the design holds it, the real run that a real server and network do
// not change that (docs/faults.md, "Where the tests run").
var realtime = flag.Bool("realtime", false, "run the tests that use the simulated Redis at virtual time against real redis-server processes at wall-clock time instead")

// testRedis is the Redis such a test runs against: a redis-server
// process, or simredis over one simnet link inside the test's
// testing/synctest bubble, where time is virtual and the seconds of load a
// test offers cost milliseconds.
type testRedis struct {
	srv  *redistest.Server // with -realtime
	px   *faultproxy.Proxy // between srv and its clients, once proxy is called
	sim  *simredis.Server  // otherwise
	link *simnet.Link      // every connection to sim
}

// withRedis runs f against a fresh testRedis: a real one with -realtime,
// else a simulated one, f then running inside a synctest bubble (where
// t.Run and t.Parallel are not allowed).
func withRedis(t *testing.T, f func(t *testing.T, r *testRedis)) {
	t.Helper()
	if *realtime {
		f(t, &testRedis{srv: redistest.Start(t)})
		return
	}
	bubble(t, func(t *testing.T) {
		r := &testRedis{sim: simredis.New(), link: simnet.NewLink()}
		// Registered first, so run last: once the limiters and clients
		// the test registers are closed, the server's connections end.
		t.Cleanup(r.sim.Close)
		f(t, r)
	})
}

// bubble runs f in a synctest bubble with go-redis's package-level pool of
// timers empty on the way in and out: the pool keeps the timers of
// connection waits for reuse, and a timer made in a bubble is fatal to use
// from outside it, in another bubble or in a test on a real server (a
// GC moves a sync.Pool's contents to its victim cache, a second drops
// them).
func bubble(t *testing.T, f func(*testing.T)) {
	runtime.GC()
	runtime.GC()
	defer func() {
		runtime.GC()
		runtime.GC()
	}()
	synctest.Test(t, f)
}

// realRedis returns a testRedis on a fresh redis-server, for benchmarks:
// synctest runs only tests.
func realRedis(tb testing.TB) *testRedis {
	return &testRedis{srv: redistest.Start(tb)}
}

// client returns a new client of default options, closed by tb.Cleanup.
func (r *testRedis) client(tb testing.TB) *redis.Client {
	var c *redis.Client
	switch {
	case r.px != nil:
		c = redis.NewClient(&redis.Options{Addr: r.px.Addr()})
	case r.srv != nil:
		c = redis.NewClient(&redis.Options{Addr: r.srv.Addr()})
	default:
		c = redis.NewClient(&redis.Options{
			Addr:   "10.0.0.1:6379", // an IP: a hostname would be looked up, on the real network
			Dialer: r.link.Dialer(func(c net.Conn) { r.sim.Serve(c, 0) }),
		})
	}
	tb.Cleanup(func() { c.Close() })
	return c
}

// pause stops Redis answering, as SIGSTOP does: connections, new ones
// too, stay open and what is written to them waits.
func (r *testRedis) pause(tb testing.TB) {
	if r.srv != nil {
		r.srv.Pause(tb)
		return
	}
	r.link.Hang()
}

// resume ends pause: what was written meanwhile is read and answered.
func (r *testRedis) resume(tb testing.TB) {
	if r.srv != nil {
		r.srv.Resume(tb)
		return
	}
	r.link.Resume()
}

// simClient returns a client of a fresh simulated Redis, whose bucket is
// lua/tokenbucket.lua's (simredis.TestModelMatchesRedis), for a test
// inside a bubble: time stands still until every goroutine of the bubble
// waits on it, and a test moves it with time.Sleep.
func simClient(t *testing.T) *redis.Client {
	r := &testRedis{sim: simredis.New(), link: simnet.NewLink()}
	t.Cleanup(r.sim.Close) // after the client's Close, registered next
	return r.client(t)
}

// scriptCalls returns how many script calls the server has run.
func (r *testRedis) scriptCalls(tb testing.TB) int64 {
	if r.srv != nil {
		return r.srv.ScriptCalls(tb)
	}
	return int64(r.sim.Calls())
}

// proxy puts a fault proxy between Redis and the clients made from now on,
// for delay and blackhole: on a real server a TCP proxy (faultproxy); in the
// simulation the link every client dials already is one.
func (r *testRedis) proxy(tb testing.TB) {
	if r.srv != nil {
		r.px = faultproxy.Start(tb, r.srv.Addr())
	}
}

// delay delays what goes either way between Redis and its clients by d.
func (r *testRedis) delay(d time.Duration) {
	if r.px != nil {
		r.px.SetDelay(d)
		return
	}
	r.link.SetLatency(2 * d) // a reply's delay: the round trip
}

// blackhole makes the network lose everything between Redis and its
// clients while on; connections stay open. (The simulated link holds what
// is sent instead and delivers it when the hole closes: either way a
// command sent into it is answered, if ever, after its budget, and the
// connection is dropped by go-redis.)
func (r *testRedis) blackhole(on bool) {
	if r.px != nil {
		r.px.Blackhole(on)
		return
	}
	if on {
		r.link.Hang()
	} else {
		r.link.Resume()
	}
}

// resetAll closes every connection between Redis and its clients with a
// reset (a TCP RST on a real server's proxy).
func (r *testRedis) resetAll() {
	if r.px != nil {
		r.px.ResetAll()
		return
	}
	r.link.Reset()
}

// resetting makes every connection, those opened from now on too, reset
// while on: a middlebox that accepts and resets everything.
func (r *testRedis) resetting(on bool) {
	if r.px != nil {
		r.px.SetReset(on)
		if on {
			r.px.ResetAll()
		}
		return
	}
	r.link.ResetNew(on)
	if on {
		r.link.Reset()
	}
}

// clients returns n new clients, as client does.
func (r *testRedis) clients(tb testing.TB, n int) []redis.UniversalClient {
	out := make([]redis.UniversalClient, n)
	for i := range out {
		out[i] = r.client(tb)
	}
	return out
}

// scriptFlush empties Redis's script cache, as SCRIPT FLUSH does.
func (r *testRedis) scriptFlush(tb testing.TB) {
	if r.srv != nil {
		if err := r.srv.Client(tb).ScriptFlush(context.Background()).Err(); err != nil {
			tb.Errorf("SCRIPT FLUSH: %v", err)
		}
		return
	}
	r.sim.FlushScripts()
}
