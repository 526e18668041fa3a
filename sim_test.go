package hybridlimit

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"maps"
	"math"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/redis/go-redis/v9/maintnotifications"

	"github.com/hybridlimit/hybridlimit/internal/simnet"
	"github.com/hybridlimit/hybridlimit/internal/simredis"
	"github.com/hybridlimit/hybridlimit/remote"
)

// The simulator runs a fleet of real Limiters, each with its own go-redis
// client, against simredis over simnet, inside a testing/synctest bubble:
// timers, time-outs, the breakers' open periods and the heartbeats run at
// virtual time, so seconds of outage cost milliseconds. A seed draws the
// fleet, the traffic, the limits and the faults (genSchedule); the run
// records every decision and checks the invariants of docs/design.md,
// "Invariants the simulator checks", each under its own name.
var (
	simSeeds = flag.Int("sim.seeds", 100, "simulator: seeds to run (from -sim.first); 2000 is the long run")
	simFirst = flag.Uint64("sim.first", 1, "simulator: first seed")
	simSeed  = flag.Int64("sim.seed", -1, "simulator: replay this one seed, shrink it, print its schedule and decisions")
	simChild = flag.Bool("sim.child", false, "simulator: run the seeds read from stdin, one at a time, and print each one's result (for TestSim's own processes)")
	simDump  = flag.Duration("sim.dump", 0, "simulator: with -sim.seed, print every goroutine's stack at this virtual time of the first run")
	simTrace = flag.Bool("sim.trace", false, "simulator: with -sim.seed, print every breaker change and every change of an instance's mode")
)

// Invariant names, in the order the summary prints them.
var invariants = []string{
	"window-limit", "outage-floor", "redis-error", "short-deadline-failover", "latency",
	"retry-after", "waitn-spin", "recovery", "exact-healthy", "stale-denial",
	"remote-while-down", "reconcile-overcharge", "reconcile-undercharge", "weights-over-one", "goroutine-leak",
	"failover", "schedule",
}

// event is one step of a schedule, At after the start.
type event struct {
	At   time.Duration
	Kind string        // hang, kill, latency, flap, reset, scriptflush, clockback, setlimit, join, leave
	Who  []int         // instance slots; nil: every instance, those joining during it too
	For  time.Duration // how long a hang, kill, latency or flap lasts; the jump of clockback
	Lat  time.Duration // latency's delay
	L    Limit         // setlimit's limit
}

func (e event) String() string {
	who := "all"
	if e.Who != nil {
		who = fmt.Sprint(e.Who)
	}
	switch e.Kind {
	case "setlimit":
		return fmt.Sprintf("%v setlimit %v", e.At, e.L)
	case "join", "leave":
		return fmt.Sprintf("%v %s %s", e.At, e.Kind, who)
	case "latency":
		return fmt.Sprintf("%v latency %v on %s for %v", e.At, e.Lat, who, e.For)
	case "reset", "scriptflush":
		return fmt.Sprintf("%v %s %s", e.At, e.Kind, who)
	}
	return fmt.Sprintf("%v %s %s for %v", e.At, e.Kind, who, e.For)
}

// schedule is everything a seed decides.
type schedule struct {
	Seed      uint64
	Instances int // at the start; joins add slots
	Slots     int // instances ever
	CfgInst   int // Config.Instances
	Policy    FailurePolicy
	Limit     Limit
	Timeout   time.Duration
	Probes    int
	Keys      int
	Shape     string  // even, 80/15/5, sticky
	Offered   float64 // requests per second, fleet-wide
	Deadline  string  // none, short, long
	MaxN      int64   // largest n asked for
	Waiters   int     // WaitN workers on instance 0
	Refunds   float64 // part of admitted decisions refunded
	Duration  time.Duration
	// TLS: the clients cannot ask the kernel about a pooled connection
	// (go-redis checks only a connection that is itself a socket, and a
	// tls.Conn is not), so a connection a reset broke fails the command
	// that next uses it.
	TLS bool
	// CtxTimeout: the clients bound their reads by the caller's deadline
	// (go-redis's ContextTimeoutEnabled), so that a call alone on an idle
	// pipe runs on its caller's goroutine.
	CtxTimeout bool
	// Pool, if not 0, is the clients' PoolSize instead of go-redis's ten
	// per CPU: calls wait for a connection.
	Pool int
	// DialDelay is added to every dial's latency: a TLS handshake, a
	// managed Redis in another zone.
	DialDelay time.Duration
	// Heartbeat is Config.Heartbeat (0: the default).
	Heartbeat time.Duration
	// Shift, if not 0, is when each instance takes over the next one's
	// traffic.
	Shift time.Duration
	// Lease is Config.Lease (0: off): Redis's decisions take up to Lease
	// more tokens, which the instance spends without Redis for LeaseFor.
	Lease int64
	// LeaseFor is Config.LeaseFor, with Lease.
	LeaseFor time.Duration
	// AtMost: calls for more than one token go through AllowAtMost,
	// which grants what the bucket holds, up to n.
	AtMost bool
	// GiveUp is the part of the WaitN workers' calls whose caller hangs
	// up (its context cancelled) within 1.5 s, often while it sleeps on
	// a reservation: WaitN then gives the tokens back.
	GiveUp float64
	Events []event
	// Cluster, if not nil, runs the fleet against a Redis Cluster, with
	// the Cluster's faults instead of Events (sim_cluster_test.go).
	Cluster *clusterPlan
}

func (s schedule) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "seed %d: %d instances (%d slots, Config.Instances %d), %v, limit %v, Timeout %v, Probes %d,\n",
		s.Seed, s.Instances, s.Slots, s.CfgInst, s.Policy, s.Limit, s.Timeout, s.Probes)
	fmt.Fprintf(&b, "  %d keys, %s traffic at %.0f/s, deadlines %s, n up to %d, %d WaitN workers, refunds %.0f%%, TLS %v, ContextTimeoutEnabled %v, PoolSize %d, dials +%v, %v\n",
		s.Keys, s.Shape, s.Offered, s.Deadline, s.MaxN, s.Waiters, s.Refunds*100, s.TLS, s.CtxTimeout, s.Pool, s.DialDelay, s.Duration)
	if s.Lease > 0 || s.AtMost {
		fmt.Fprintf(&b, "  Lease %d for %v, AllowAtMost %v\n", s.Lease, s.LeaseFor, s.AtMost)
	}
	if s.Heartbeat != 0 {
		fmt.Fprintf(&b, "  Heartbeat %v\n", s.Heartbeat)
	}
	if s.Shift != 0 {
		fmt.Fprintf(&b, "  traffic shifts at %v\n", s.Shift)
	}
	if s.GiveUp > 0 && s.Waiters > 0 {
		fmt.Fprintf(&b, "  %.0f%% of the WaitN calls' callers hang up\n", s.GiveUp*100)
	}
	for _, e := range s.Events {
		fmt.Fprintf(&b, "  %v\n", e)
	}
	if s.Cluster != nil {
		b.WriteString(s.Cluster.String())
	}
	return b.String()
}

// healthy reports whether s has no faults, no limit changes, no fleet
// changes and no refunds (a WaitN caller's hang-up gives its tokens back,
// or loses them where a give-back cannot be exact): the exact-count check
// applies.
func (s schedule) healthy() bool {
	return len(s.Events) == 0 && s.Cluster == nil && s.Refunds == 0 && s.MaxN == 1 && (s.GiveUp == 0 || s.Waiters == 0)
}

// features names what s has that a defect may need, for the summary's
// breakdown of failing seeds.
func (s schedule) features() []string {
	var f []string
	if s.Probes >= 2 {
		f = append(f, "probes>=2")
	}
	if s.Deadline == "short" {
		f = append(f, "short-deadlines")
	}
	if s.Waiters > 0 {
		f = append(f, "waitn")
		if s.GiveUp > 0 {
			f = append(f, "waitn-giveup")
		}
	}
	if s.Limit.Burst < int64(s.Slots) || s.CfgInst < s.Slots {
		f = append(f, "burst<fleet-or-Instances<fleet")
	}
	if s.Refunds > 0 {
		f = append(f, "refunds")
	}
	if s.TLS {
		f = append(f, "tls")
	}
	if s.CtxTimeout {
		f = append(f, "ctxtimeout")
	}
	if s.Pool > 0 {
		f = append(f, "smallpool")
	}
	if s.DialDelay > 0 {
		f = append(f, "slowdial")
	}
	if s.Heartbeat > 0 {
		f = append(f, "shortheartbeat")
	}
	if s.Shift > 0 {
		f = append(f, "shift")
	}
	if s.Lease > 0 {
		f = append(f, "lease")
	}
	if s.AtMost {
		f = append(f, "atmost")
	}
	if s.Cluster != nil {
		f = append(f, s.Cluster.features()...)
	}
	kinds := map[string]bool{}
	for _, e := range s.Events {
		kinds[e.Kind] = true
	}
	for _, k := range []string{"setlimit", "clockback", "kill", "hang", "flap", "latency", "join", "leave", "reset", "scriptflush"} {
		if kinds[k] {
			f = append(f, k)
		}
	}
	return f
}

// genSchedule draws a schedule from seed. Most fleets are small, for speed.
func genSchedule(seed uint64) schedule {
	r := rand.New(rand.NewPCG(seed, 0x5eed))
	pick := func(xs ...int) int { return xs[r.IntN(len(xs))] }
	dur := func(lo, hi time.Duration) time.Duration {
		return lo + time.Duration(r.Int64N(int64(hi-lo)/int64(time.Millisecond)+1))*time.Millisecond
	}
	s := schedule{Seed: seed, Duration: dur(2500*time.Millisecond, 4500*time.Millisecond)}
	// Drawn from a stream of its own, so that adding it left every
	// seed's other draws as they were.
	s.TLS = rand.New(rand.NewPCG(seed, 0x7150)).IntN(3) == 0
	s.CtxTimeout = rand.New(rand.NewPCG(seed, 0xc7c7)).IntN(3) == 0
	if p := rand.New(rand.NewPCG(seed, 0x9001)); p.IntN(5) == 0 {
		s.Pool = 1 + p.IntN(3)
	}
	if sh := rand.New(rand.NewPCG(seed, 0x5b1f)); sh.IntN(3) == 0 {
		// The traffic moves: each instance takes over the next one's
		// share (and, sticky, its keys), as a deploy that reshapes a
		// consistent-hash ring, or a load balancer rebalancing, does.
		s.Shift = 300*time.Millisecond + time.Duration(sh.Int64N(int64(s.Duration-800*time.Millisecond)))
	}
	if l := rand.New(rand.NewPCG(seed, 0x1ea5)); l.IntN(5) == 0 {
		// Lease mode, for hot keys: tokens taken ahead from Redis's
		// bucket and spent in the instance.
		s.Lease = []int64{1, 3, 10}[l.IntN(3)]
		// Long enough, in some, for the run's sparse traffic to spend
		// what it leased.
		s.LeaseFor = []time.Duration{DefaultLeaseFor, 500 * time.Millisecond, 2 * time.Second}[l.IntN(3)]
	}
	s.AtMost = rand.New(rand.NewPCG(seed, 0xa7a7)).IntN(3) == 0
	if g := rand.New(rand.NewPCG(seed, 0x61e5)); g.IntN(2) == 0 {
		s.GiveUp = []float64{0.2, 0.5}[g.IntN(2)]
	}
	if h := rand.New(rand.NewPCG(seed, 0x4ea7)); h.IntN(3) == 0 {
		// Heartbeats short enough for a run to read tens of windows:
		// the fleet's weights and key shares move within it.
		s.Heartbeat = []time.Duration{50, 100, 200}[h.IntN(3)] * time.Millisecond
	}
	switch x := r.IntN(20); {
	case x < 12:
		s.Instances = 1 + r.IntN(3)
	case x < 18:
		s.Instances = 4 + r.IntN(7)
	default:
		s.Instances = 11 + r.IntN(40)
	}
	s.Slots = s.Instances
	switch r.IntN(3) {
	case 0:
		s.CfgInst = 0 // the default, 1
	case 1:
		s.CfgInst = s.Instances
	default:
		s.CfgInst = max(1, s.Instances+r.IntN(5)-2)
	}
	s.Policy = FailLocal
	if r.IntN(10) == 0 {
		s.Policy = FailurePolicy(1 + r.IntN(2))
	}
	switch r.IntN(6) {
	case 0:
		s.Limit = PerMinute(int64(pick(5, 10, 60, 100, 1000)))
	case 1:
		s.Limit = Limit{Rate: float64(pick(1, 2, 5)) / 3, Burst: int64(pick(1, 3, 7))}
	default:
		n := int64(pick(10, 20, 50, 100, 200))
		s.Limit = Limit{Rate: float64(n), Burst: int64(float64(n) * []float64{0.1, 0.5, 1, 2}[r.IntN(4)])}
		s.Limit.Burst = max(s.Limit.Burst, 1)
	}
	s.Timeout = time.Duration(pick(20, 50, 50, 100)) * time.Millisecond
	if d := rand.New(rand.NewPCG(seed, 0xd1a1)); d.IntN(4) == 0 {
		s.DialDelay = []time.Duration{2 * time.Millisecond, 10 * time.Millisecond, s.Timeout / 2}[d.IntN(3)]
	}
	s.Probes = pick(1, 1, 2, 3)
	s.Keys = pick(1, 1, 2, 3, 5)
	s.Shape = []string{"even", "80/15/5", "sticky"}[r.IntN(3)]
	// Offered: from under the limit to several times it, capped for speed.
	s.Offered = math.Min(200, math.Max(5, s.Limit.Rate*float64(s.Keys)*[]float64{0.5, 1.5, 3, 6}[r.IntN(4)]))
	s.Deadline = []string{"none", "none", "short", "long"}[r.IntN(4)]
	s.MaxN = 1
	if r.IntN(3) == 0 {
		s.MaxN = min(s.Limit.Burst, int64(pick(2, 3, 5)))
	}
	if r.IntN(4) == 0 {
		s.Waiters = 1 + r.IntN(3)
	}
	if s.Waiters > 0 && s.GiveUp > 0 {
		// A queue deep enough for a waiter that hangs up to have others
		// behind it, whose times its give-back must not shorten.
		s.Waiters += rand.New(rand.NewPCG(seed, 0x61e6)).IntN(6)
	}
	if r.IntN(5) == 0 {
		s.Refunds = 0.1
	}
	if s.Cluster = drawCluster(seed, &s); s.Cluster != nil {
		return s
	}
	if r.IntN(5) == 0 {
		return s // healthy: exact counts
	}
	nev := 1 + r.IntN(4)
	for range nev {
		e := event{At: dur(300*time.Millisecond, s.Duration-time.Second)}
		who := func() []int {
			if r.IntN(2) == 0 || s.Slots == 1 {
				return nil
			}
			var w []int
			for i := range s.Slots {
				if r.IntN(2) == 0 {
					w = append(w, i)
				}
			}
			if len(w) == 0 {
				w = []int{r.IntN(s.Slots)}
			}
			return w
		}
		switch x := r.IntN(100); {
		case x < 25:
			e.Kind, e.Who, e.For = "hang", who(), dur(200*time.Millisecond, 2500*time.Millisecond)
		case x < 40:
			e.Kind, e.For = "kill", dur(200*time.Millisecond, 2500*time.Millisecond)
		case x < 50:
			e.Kind, e.Who, e.For = "latency", who(), dur(300*time.Millisecond, 2*time.Second)
			e.Lat = time.Duration(float64(s.Timeout) * []float64{0.3, 0.9, 1.1, 3}[r.IntN(4)])
		case x < 60:
			e.Kind, e.Who, e.For = "flap", who(), dur(500*time.Millisecond, 2500*time.Millisecond)
		case x < 67:
			e.Kind, e.Who = "reset", who()
		case x < 72:
			e.Kind = "scriptflush"
		case x < 79:
			e.Kind, e.For = "clockback", dur(100*time.Millisecond, 3*time.Second)
		case x < 88:
			e.Kind = "setlimit"
			e.L = s.Limit
			switch r.IntN(3) {
			case 0:
				e.L.Burst = e.L.Burst * int64(pick(2, 5, 10))
			case 1:
				e.L.Rate = e.L.Rate * []float64{0.5, 2}[r.IntN(2)]
			default:
				e.L.Burst = max(1, e.L.Burst/2)
			}
			s.MaxN = min(s.MaxN, e.L.Burst)
		case x < 95:
			// Joiners, often during an outage.
			e.Kind = "join"
			k := 1 + r.IntN(3)
			for range k {
				e.Who = append(e.Who, s.Slots)
				s.Slots++
			}
			if r.IntN(2) == 0 {
				s.Events = append(s.Events, event{At: e.At - 100*time.Millisecond, Kind: "hang", For: dur(time.Second, 2500*time.Millisecond)})
			}
		default:
			if s.Slots > 1 {
				e.Kind, e.Who = "leave", []int{r.IntN(s.Slots)}
			} else {
				e.Kind = "reset"
			}
		}
		s.Events = append(s.Events, e)
	}
	sort.SliceStable(s.Events, func(i, j int) bool { return s.Events[i].At < s.Events[j].At })
	return s
}

// record is one call as the simulator saw it.
type record struct {
	inst       int
	key        string
	n          int64
	start, end time.Duration // since the run's start
	deadline   time.Duration // caller's deadline from start; 0: none
	wait       bool          // a WaitN that returned nil (admitted) or an error
	allowed    bool
	refunded   bool
	mode       Mode
	cached     bool // Decision.Cached: a denial from what Redis said less than a second ago
	retry      time.Duration
	err        error
	weight     float64 // the instance's share of the key, for local admissions
	byPart     bool    // weight is a key share (docs/design.md, per-key shares), not the instance's weight
	staleDeny  bool    // a remote denial that Redis's bucket would not give
	atMost     bool    // AllowAtMost: n is what it granted
}

// charge is a charge-mode script call the server ran.
type charge struct {
	inst  int
	key   string
	units int64
	p     int64 // units per token, as the call said: the limit it was sent under
	at    time.Duration
	once  string // its marker (KEYS[2]), "" if none
}

// interval is [from, to) of virtual time since the start.
type interval struct{ from, to time.Duration }

// simRun is one simulation.
type simRun struct {
	s        schedule
	t0       time.Time
	srv      *simredis.Server
	cluster  *simCluster // a Cluster run's (sim_cluster_test.go); nil otherwise
	links    []*simnet.Link
	mu       sync.Mutex                      // protects recs, charges, spins, heard, answered, refunds
	answered map[answeredKey][]time.Duration // when the server ran each slot's script calls, by key
	refunds  map[string][]time.Duration      // when the server ran a refund, by key (WaitN's give-backs too)
	breakers []breakerChange
	recs     []record
	charges  []charge
	spins    []string
	late     []string                // events the simulator applied after their time: the checks assume it
	views    map[int]*fleet          // slot: the last view its heartbeat stored, while it is alive
	viewers  map[int]*simObserver    // slot: the observer of the Limiter whose view views holds
	overOne  []string                // weights held at once that added up to more than 1 (checkWeights)
	heard    map[int][]time.Duration // slot: when Redis ran its heartbeats that read a closed window
	// fault intervals per slot, filled from the schedule before the run
	cut    [][]interval // hang or kill: no answer can come
	killed []interval   // kill intervals (all slots)
	// ahead: when Redis's clock jumped forward, a clockback replacing a
	// longer one (a failover back toward the right time); the bucket
	// refills the jump at once.
	ahead   []time.Duration
	disturb [][]interval // cut, latency, flap: time-outs possible
	// hbDisturb is disturb for a heartbeat, whose round trip has a whole
	// Heartbeat: a latency counts only if a new connection's four round
	// trips would not fit in it.
	hbDisturb [][]interval
	alive     []interval   // per slot: from join to leave
	dials     [][]interval // per slot: its dials, in a run whose dials take time (DialDelay)
	limits    []struct {
		at time.Duration
		l  Limit
	}
}

func (r *simRun) since() time.Duration { return time.Since(r.t0) }

// until sleeps until the schedule's event of kind at at, and records the
// event as late if the simulator reached it after that: the checks take
// the schedule's times for when the faults were.
func (r *simRun) until(at time.Duration, kind string) {
	if d := at - r.since(); d > 0 {
		time.Sleep(d)
	}
	if late := r.since() - at; late > 0 {
		r.mu.Lock()
		r.late = append(r.late, fmt.Sprintf("the %s of %v was applied %v late", kind, at, late))
		r.mu.Unlock()
	}
}

// dialing records a dial of slot i, from now to when the function it
// returns is called, in a run whose dials take time (DialDelay); before
// the run's clock starts (a Cluster client's first Ping), nothing.
func (r *simRun) dialing(i int) func() {
	if r.s.DialDelay == 0 {
		return func() {}
	}
	r.mu.Lock()
	t0 := r.t0
	r.mu.Unlock()
	if t0.IsZero() {
		return func() {}
	}
	from := time.Since(t0)
	return func() {
		r.mu.Lock()
		r.dials[i] = append(r.dials[i], interval{from, time.Since(t0)})
		r.mu.Unlock()
	}
}

// plan fills the fault intervals from the schedule.
func (r *simRun) plan() {
	s := r.s
	r.cut = make([][]interval, s.Slots)
	r.dials = make([][]interval, s.Slots)
	r.disturb = make([][]interval, s.Slots)
	r.hbDisturb = make([][]interval, s.Slots)
	r.alive = make([]interval, s.Slots)
	for i := range s.Slots {
		r.alive[i] = interval{0, s.Duration}
		if i >= s.Instances {
			r.alive[i].from = -1
		}
	}
	r.limits = append(r.limits, struct {
		at time.Duration
		l  Limit
	}{0, s.Limit})
	var skew time.Duration // the server's clock, as the run sets it
	for _, e := range s.Events {
		targets := e.Who
		if targets == nil {
			for i := range s.Slots {
				targets = append(targets, i)
			}
		}
		iv := interval{e.At, e.At + e.For}
		switch e.Kind {
		case "hang", "kill":
			for _, i := range targets {
				r.cut[i] = append(r.cut[i], iv)
				r.disturb[i] = append(r.disturb[i], iv)
				r.hbDisturb[i] = append(r.hbDisturb[i], iv)
			}
			if e.Kind == "kill" {
				r.killed = append(r.killed, iv)
			}
		case "latency", "flap":
			// A decision that needs a new connection pays four round
			// trips (the handshake, HELLO, CLIENT SETINFO, the script):
			// latency is harmless only when those fit in the budget.
			if e.Kind == "flap" || 4*e.Lat >= cmp.Or(r.s.Heartbeat, DefaultHeartbeat) {
				for _, i := range targets {
					r.hbDisturb[i] = append(r.hbDisturb[i], iv)
				}
			}
			if e.Kind == "latency" && 4*e.Lat < r.s.Timeout {
				continue
			}
			for _, i := range targets {
				r.disturb[i] = append(r.disturb[i], iv)
			}
		case "reset":
			for _, i := range targets {
				r.disturb[i] = append(r.disturb[i], interval{e.At, e.At + time.Millisecond})
				r.hbDisturb[i] = append(r.hbDisturb[i], interval{e.At, e.At + time.Millisecond})
			}
		case "join":
			for _, i := range e.Who {
				r.alive[i].from = e.At
			}
		case "leave":
			for _, i := range e.Who {
				if r.alive[i].from >= 0 && e.At < r.alive[i].to {
					r.alive[i].to = e.At
				}
			}
		case "setlimit":
			r.limits = append(r.limits, struct {
				at time.Duration
				l  Limit
			}{e.At, e.L})
		case "clockback":
			// One jump; a later one replaces it: a shorter one moves
			// the clock forward.
			if -e.For > skew {
				r.ahead = append(r.ahead, e.At)
			}
			skew = -e.For
		}
	}
}

// simObserver counts an instance's decisions at one virtual instant: a
// WaitN that spins makes thousands without time moving, and would hang
// the bubble; the observer records it and stops the waiters.
type simObserver struct {
	left  atomic.Bool // its Limiter left the fleet
	r     *simRun
	inst  int
	stop  context.CancelFunc
	mu    sync.Mutex
	at    time.Time
	count int
	fired bool
}

func (o *simObserver) ObserveDecision(e DecisionEvent) {
	if e.Mode == ModeFailOpen {
		// FailOpen grants at once by design: a worker that calls WaitN
		// again and again is granted without time moving, and that is
		// the policy, not WaitN spinning.
		return
	}
	o.mu.Lock()
	now := time.Now()
	if !now.Equal(o.at) {
		o.at, o.count = now, 0
	}
	o.count++
	fire := o.count == 5000 && !o.fired
	if fire {
		o.fired = true
	}
	o.mu.Unlock()
	if fire {
		o.r.mu.Lock()
		o.r.spins = append(o.r.spins, fmt.Sprintf("instance %d made 5000 decisions at %v without time moving", o.inst, o.r.since()))
		o.r.mu.Unlock()
		o.stop()
	}
}

func (o *simObserver) ObserveBreaker(e BreakerEvent) {
	o.r.mu.Lock()
	o.r.breakers = append(o.r.breakers, breakerChange{o.inst, o.r.since(), e.To != "closed"})
	o.r.mu.Unlock()
	if *simTrace {
		fmt.Printf("%12v inst %d breaker %s: %s -> %s\n", o.r.since(), o.inst, e.Node, e.From, e.To)
	}
}

// The clients' options besides their address and dialer are go-redis's
// defaults but for two, chosen for the simulator's speed where they change
// nothing else a seed explores.

// simBuffer is the size of each of the buffers of a connection, instead of
// go-redis's 32 KiB (128 KiB for pipelines): the simulator's commands and
// replies are a few hundred bytes (the scripts' sources, ten thousand, are
// written in parts, at the same instant), and a seed dials up to hundreds
// of connections, whose buffers, cleared and tracked by the race detector,
// were most of what it allocated.
const simBuffer = 4 << 10

// simMaint turns off go-redis's maintenance notifications, which need
// RESP3: simredis speaks RESP2 (it refuses HELLO), on which go-redis's
// default mode turns them off at the first connection anyway, with no
// command sent; setting them up first cost more than the rest of building
// a client under the race detector. Each client has a config of its own:
// go-redis may write to it.
func simMaint() *maintnotifications.Config {
	return &maintnotifications.Config{Mode: maintnotifications.ModeDisabled}
}

// instance is one Limiter of the fleet and its client.
type instance struct {
	lim    *Limiter
	client *redis.Client
	stop   context.CancelFunc // ends its traffic and waiters
	wg     sync.WaitGroup     // its traffic goroutines
	closed atomic.Bool
	obs    *simObserver
}

// startInstance starts slot i's Limiter on client, of the schedule's
// configuration, and its traffic (and, on slot 0, the WaitN workers),
// until ctx ends or the instance is stopped.
func (r *simRun) startInstance(ctx context.Context, i int, client redis.UniversalClient) *instance {
	s := r.s
	ictx, stop := context.WithCancel(ctx)
	obs := &simObserver{r: r, inst: i, stop: stop}
	lim, err := New(Config{
		Redis: client, Limit: r.limitAt(r.since()), Instances: s.CfgInst, Timeout: s.Timeout,
		OnFailure: s.Policy, Breaker: BreakerConfig{Probes: s.Probes}, Observer: obs,
		Heartbeat: s.Heartbeat, Lease: s.Lease, LeaseFor: s.LeaseFor, rand: draws(s.Seed, i), onView: func(v *fleet) { r.viewed(i, obs, v) },
	})
	if err != nil {
		panic(err)
	}
	in := &instance{lim: lim, stop: stop, obs: obs}
	in.wg.Go(func() { r.traffic(ictx, i, in) })
	if i == 0 {
		for w := range s.Waiters {
			in.wg.Go(func() { r.waiter(ictx, i, w, in) })
		}
	}
	return in
}

// draws returns the random source of slot i's Limiter in the run of seed,
// so that a replay draws the same breaker jitter, WaitN jitter, pacer
// phase and Once prefix. The order in which goroutines runnable at one
// virtual instant draw is the scheduler's.
func draws(seed uint64, i int) rand.Source {
	s := new(splitmix)
	s.state.Store(seed*0x9e3779b97f4a7c15 ^ uint64(i+1)*0xbf58476d1ce4e5b9)
	return s
}

// splitmix is SplitMix64 over an atomic counter: a Source safe for
// concurrent use.
type splitmix struct{ state atomic.Uint64 }

func (s *splitmix) Uint64() uint64 {
	z := s.state.Add(0x9e3779b97f4a7c15)
	z = (z ^ z>>30) * 0xbf58476d1ce4e5b9
	z = (z ^ z>>27) * 0x94d049bb133111eb
	return z ^ z>>31
}

// simulate runs s inside a bubble of t (bubble: a replay runs several in
// one process as it shrinks a schedule) and returns the violations found,
// by invariant, and the calls it recorded.
func simulate(t *testing.T, s schedule) (map[string][]string, []record) {
	v := map[string][]string{}
	r := &simRun{s: s}
	func() {
		defer func() {
			if p := recover(); p != nil {
				msg := fmt.Sprint(p)
				if !strings.Contains(msg, "deadlock") {
					panic(p)
				}
				v["goroutine-leak"] = append(v["goroutine-leak"], msg)
			}
		}()
		bubble(t, func(*testing.T) {
			if s.Cluster != nil {
				r.runCluster()
			} else {
				r.run()
			}
			if *simSeed >= 0 {
				// Replaying: name the goroutines left, if any.
				synctest.Wait()
				buf := make([]byte, 1<<20)
				buf = buf[:runtime.Stack(buf, true)]
				for _, g := range strings.Split(string(buf), "\n\n") {
					if strings.Contains(g, "synctest bubble") && !strings.Contains(g, "[running") &&
						!strings.Contains(g, "synctest.Run") && !strings.Contains(g, "testingSynctestTest") {
						v["goroutine-leak"] = append(v["goroutine-leak"], g)
					}
				}
			}
		})
	}()
	r.check(v)
	return v, r.recs
}

func (r *simRun) limitAt(at time.Duration) Limit {
	l := r.limits[0].l
	for _, x := range r.limits {
		if x.at <= at {
			l = x.l
		}
	}
	return l
}

// scriptRan records a call of the bucket script the server ran for slot
// tag: when, and the tokens of a charge.
func (r *simRun) scriptRan(tag int, key, marker string, argv []string, reply any) {
	now := r.since()
	r.mu.Lock()
	defer r.mu.Unlock()
	k := answeredKey{tag, strings.TrimPrefix(key, DefaultPrefix)}
	r.answered[k] = append(r.answered[k], now)
	if again, _ := reply.([]any); len(again) > 0 && again[0] == int64(4) {
		return // a charge applied before: nothing taken
	}
	// A refund: a negative cost, by Refund, or a reservation given back
	// by a WaitN whose caller gave up (the script's unreserve mode; it
	// gave back if the reply says allowed).
	refund := false
	switch {
	case len(argv) <= 4 || argv[4] == "":
		refund = simInt(argv[3]) < 0
	case argv[4] == "unreserve":
		flags, _ := reply.([]any)
		refund = len(flags) > 0 && flags[0] == int64(1)
	}
	if refund {
		if r.refunds == nil {
			r.refunds = map[string][]time.Duration{}
		}
		r.refunds[k.key] = append(r.refunds[k.key], now)
	}
	if len(argv) > 4 && argv[4] == "charge" {
		units, p := simInt(argv[3]), simInt(argv[1])
		if units > 0 && p > 0 {
			r.charges = append(r.charges, charge{tag, k.key, units, p, now, marker})
		}
	}
}

// simInt is an integer argument of a script call, as go-redis writes one
// (decimal), 0 if it is not one; strconv rather than fmt.Sscan, which
// costs more than the rest of the hook under the race detector.
func simInt(s string) int64 {
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		return 0
	}
	return n
}

// viewed records the new view v of slot i's Limiter, the one whose
// observer is obs (nil, nil: it left), and checks the
// weights held at that moment: for each window c of v (its view's window,
// or the one before whose part it took the lesser of), the instances that
// hold no more than their part of c -- c is their view's window or the one
// before -- hold at most 1 in all (docs/design.md, the weight rule: the
// parts of one window add up to at most 1). The others are left out, not
// the check: an instance that holds an older window's part (its reads
// failed, its breaker is open) is outside the rule, and must not keep the
// check from the rest of the fleet. A view of no window yet (1/Instances,
// the configured guess) is not counted.
func (r *simRun) viewed(i int, obs *simObserver, v *fleet) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.views == nil {
		r.views, r.viewers = map[int]*fleet{}, map[int]*simObserver{}
	}
	if v == nil {
		delete(r.views, i)
		r.viewers[i] = nil
		return
	}
	if r.viewers[i] != obs {
		// A Limiter that left (its report in flight with others' still
		// stores its view), or one that has not stored a view yet.
		if r.viewers[i] != nil || obs.left.Load() {
			return
		}
		r.viewers[i] = obs
	}
	r.views[i] = v
	for _, c := range [2]int64{v.window, v.prior} {
		if c == 0 {
			continue
		}
		var sum float64
		for _, w := range r.views {
			if w.window != 0 && (w.window == c || w.prior == c) {
				sum += w.weight
			}
		}
		if sum > 1+1e-9 && len(r.overOne) < 5 {
			var b strings.Builder
			for j, w := range r.views {
				fmt.Fprintf(&b, " [%d: %.3f of window %d, prior %d]", j, w.weight, w.window, w.prior)
			}
			r.overOne = append(r.overOne, fmt.Sprintf("at %v after instance %d's heartbeat the weights held of window %d add up to %.4f:%s", r.since(), i, c, sum, b.String()))
			return
		}
	}
}

// heartbeatRan records when slot tag's instance first read its fleet: the
// first heartbeat the server ran that read a closed window.
func (r *simRun) heartbeatRan(tag int) {
	r.mu.Lock()
	r.heard[tag] = append(r.heard[tag], r.since())
	r.mu.Unlock()
}

func (r *simRun) run() {
	s := r.s
	r.t0 = time.Now()
	if *simDump > 0 && *simSeed >= 0 {
		time.AfterFunc(*simDump, func() {
			dumpOnce.Do(func() {
				buf := make([]byte, 8<<20)
				fmt.Printf("goroutines at %v:\n%s\n", *simDump, buf[:runtime.Stack(buf, true)])
			})
		})
	}
	r.plan()
	r.srv = simredis.New()
	r.answered = map[answeredKey][]time.Duration{}
	r.srv.Hook = r.scriptRan
	r.heard = map[int][]time.Duration{}
	r.srv.FleetHook = r.heartbeatRan
	r.links = make([]*simnet.Link, s.Slots)
	for i := range r.links {
		r.links[i] = simnet.NewLink()
	}
	insts := make([]*instance, s.Slots)
	var fmu sync.Mutex // protects the fault counts
	hung := make([]int, s.Slots)
	refused := make([]int, s.Slots)
	setHang := func(i, d int) {
		hung[i] += d
		if hung[i] > 0 {
			r.links[i].Hang()
		} else {
			r.links[i].Resume()
		}
	}
	setRefuse := func(i, d int) {
		refused[i] += d
		r.links[i].Refuse(refused[i] > 0)
		if d > 0 {
			r.links[i].Reset()
		}
	}
	var bg sync.WaitGroup // the schedule's own goroutines
	ctx, cancelAll := context.WithCancel(context.Background())

	// A fault of every instance applies to every slot, those not started
	// yet included: a pod that joins meets the fault its link has.
	start := func(i int) {
		link := r.links[i]
		client := redis.NewClient(&redis.Options{
			Addr:           "10.0.0.1:6379", // an IP: a hostname would be looked up, on the real network
			ReadBufferSize: simBuffer, WriteBufferSize: simBuffer, PipelineReadBufferSize: simBuffer, PipelineWriteBufferSize: simBuffer,
			ContextTimeoutEnabled:    s.CtxTimeout,
			PoolSize:                 s.Pool,
			MaintNotificationsConfig: simMaint(),
			Dialer: func(context.Context, string, string) (net.Conn, error) {
				defer r.dialing(i)()
				time.Sleep(s.DialDelay)
				c, err := link.Dial(func(c net.Conn) { r.srv.Serve(c, i) })
				if err != nil || !s.TLS {
					return c, err
				}
				return struct{ net.Conn }{c}, nil // no SyscallConn, as a tls.Conn
			},
		})
		insts[i] = r.startInstance(ctx, i, client)
		insts[i].client = client
	}
	for i := range s.Instances {
		start(i)
	}
	for _, e := range s.Events {
		r.until(e.At, e.Kind)
		targets := e.Who
		if targets == nil {
			for i := range s.Slots {
				targets = append(targets, i)
			}
		}
		later := func(d time.Duration, f func()) {
			bg.Add(1)
			go func() {
				defer bg.Done()
				time.Sleep(d)
				f()
			}()
		}
		switch e.Kind {
		case "hang":
			fmu.Lock()
			for _, i := range targets {
				setHang(i, 1)
			}
			fmu.Unlock()
			later(e.For, func() {
				fmu.Lock()
				for _, i := range targets {
					setHang(i, -1)
				}
				fmu.Unlock()
			})
		case "kill":
			fmu.Lock()
			for _, i := range targets {
				setRefuse(i, 1)
			}
			fmu.Unlock()
			later(e.For, func() {
				r.srv.FlushAll()
				r.srv.FlushScripts()
				fmu.Lock()
				for _, i := range targets {
					setRefuse(i, -1)
				}
				fmu.Unlock()
			})
		case "latency":
			for _, i := range targets {
				r.links[i].SetLatency(e.Lat)
			}
			later(e.For, func() {
				for _, i := range targets {
					r.links[i].SetLatency(0)
				}
			})
		case "flap":
			bg.Add(1)
			go func() {
				defer bg.Done()
				rng := rand.New(rand.NewPCG(s.Seed, uint64(e.At)))
				end := r.since() + e.For
				for r.since() < end {
					lat := time.Duration(float64(s.Timeout) * (0.5 + rng.Float64()))
					for _, i := range targets {
						r.links[i].SetLatency(lat)
					}
					time.Sleep(time.Duration(50+rng.IntN(100)) * time.Millisecond)
				}
				for _, i := range targets {
					r.links[i].SetLatency(0)
				}
			}()
		case "reset":
			for _, i := range targets {
				r.links[i].Reset()
			}
		case "scriptflush":
			r.srv.FlushScripts()
		case "clockback":
			r.srv.SetSkew(-e.For) // one jump; a later one replaces it
		case "setlimit":
			for _, in := range insts {
				if in != nil && !in.closed.Load() {
					if err := in.lim.SetLimit(e.L); err != nil {
						panic(err)
					}
				}
			}
		case "join":
			for _, i := range e.Who {
				start(i)
			}
		case "leave":
			for _, i := range e.Who {
				if in := insts[i]; in != nil && !in.closed.Load() {
					in.closed.Store(true)
					in.obs.left.Store(true)
					r.viewed(i, nil, nil)
					// In the background: Close waits for the instance's
					// calls, which a hang holds until their budgets end,
					// and the schedule's next events must not wait.
					later(0, func() {
						in.lim.Close()
						in.stop()
					})
				}
			}
		}
	}
	if d := s.Duration - r.since(); d > 0 {
		time.Sleep(d)
	}
	cancelAll()
	bg.Wait()
	fmu.Lock()
	for i := range s.Slots {
		hung[i], refused[i] = 0, 0
		r.links[i].Resume()
		r.links[i].Refuse(false)
	}
	fmu.Unlock()
	for _, in := range insts {
		if in != nil {
			in.wg.Wait()
			in.lim.Close()
			in.client.Close()
		}
	}
	r.srv.Close()
	// go-redis's dial retries and read time-outs may still be sleeping:
	// give them time to end, so that what the bubble then holds is stuck
	// for good.
	time.Sleep(30 * time.Second)
}

// share returns the part of the offered traffic slot i sends.
func (r *simRun) share(i int) float64 {
	n := r.s.Slots
	i = r.shifted(i)
	if r.s.Shape != "80/15/5" || n == 1 {
		return 1 / float64(n)
	}
	switch {
	case i == 0:
		return 0.8
	case n == 2:
		return 0.2
	case i == 1:
		return 0.15
	}
	return 0.05 / float64(n-2)
}

func (r *simRun) key(rng *rand.Rand, i int) string {
	if r.s.Shape == "sticky" {
		return simKey(r.shifted(i) % r.s.Keys)
	}
	if rng.IntN(2) == 0 {
		return simKey(0)
	}
	return simKey(rng.IntN(r.s.Keys))
}

// shifted returns whose traffic slot i serves now: its own, or after the
// schedule's shift the next slot's.
func (r *simRun) shifted(i int) int {
	if r.s.Shift > 0 && r.since() >= r.s.Shift {
		return (i + 1) % r.s.Slots
	}
	return i
}

// simKeys are the traffic's keys' names, made once.
var simKeys = [...]string{"k0", "k1", "k2", "k3", "k4"}

// simKey returns the name of traffic key k.
func simKey(k int) string {
	if k < len(simKeys) {
		return simKeys[k]
	}
	return fmt.Sprintf("k%d", k)
}

// traffic sends slot i's AllowN calls, each from a goroutine of its own,
// at exponential gaps, until ctx ends. The goroutines are reused: a call
// goes to one whose call ended, if any waits, or to a new one, so that a
// seed does not pay, for every call, a goroutine's start and the growth
// of its stack to go-redis's depth, which the race detector makes dear.
func (r *simRun) traffic(ctx context.Context, i int, in *instance) {
	s := r.s
	rng := rand.New(rand.NewPCG(s.Seed, uint64(i)+1))
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	type job struct {
		key    string
		n      int64
		dl     time.Duration
		refund bool
	}
	idle := make(chan job) // to a goroutine whose call ended
	var calls sync.WaitGroup
	defer calls.Wait()
	for {
		rate := s.Offered * r.share(i)
		gap := time.Duration(rng.ExpFloat64() / rate * float64(time.Second))
		// A gap drawn before the shift that ends after it is drawn again
		// at the shift, from the new share (the gaps are memoryless):
		// else a slot whose share grows (the next one's 80%) would keep
		// the long gap of its old 5%, often past the run's end.
		if now := r.since(); s.Shift > 0 && now < s.Shift && now+gap > s.Shift {
			timer.Reset(s.Shift - now)
			select {
			case <-timer.C:
				continue
			case <-ctx.Done():
				return
			}
		}
		timer.Reset(gap)
		select {
		case <-timer.C:
		case <-ctx.Done():
			return
		}
		key := r.key(rng, i)
		n := int64(1)
		if s.MaxN > 1 && rng.IntN(3) == 0 {
			n = 1 + rng.Int64N(s.MaxN)
		}
		var dl time.Duration
		switch s.Deadline {
		case "short":
			dl = time.Duration(float64(s.Timeout) * (0.3 + 0.6*rng.Float64()))
		case "long":
			dl = time.Duration(float64(s.Timeout) * (1.5 + 1.5*rng.Float64()))
		}
		refund := s.Refunds > 0 && rng.Float64() < s.Refunds
		j := job{key, n, dl, refund}
		select {
		case idle <- j:
			continue
		default:
		}
		calls.Go(func() {
			for {
				r.call(in, i, j.key, j.n, j.dl, j.refund)
				select {
				case j = <-idle:
				case <-ctx.Done():
					return
				}
			}
		})
	}
}

func (r *simRun) call(in *instance, i int, key string, n int64, dl time.Duration, refund bool) {
	ctx := context.Background()
	if dl > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, dl)
		defer cancel()
	}
	rec := record{inst: i, key: key, n: n, start: r.since(), deadline: dl, atMost: r.s.AtMost && n > 1}
	var d Decision
	var err error
	need := n // tokens a denial says the bucket does not hold
	if rec.atMost {
		d, err = in.lim.AllowAtMost(ctx, key, n)
		need = 1
		if err == nil && d.Allowed {
			rec.n = d.Granted
		}
	} else {
		d, err = in.lim.AllowN(ctx, key, n)
	}
	rec.end = r.since()
	rec.err, rec.allowed, rec.mode, rec.retry, rec.cached = err, d.Allowed, d.Mode, d.RetryAfter, d.Cached
	if err == nil && d.Allowed && d.Mode == ModeLocal {
		rec.weight, rec.byPart = in.lim.simShare(key)
	}
	// A denial made at once (from what Redis said, or by a Redis with no
	// latency) must be one that Redis's bucket would give now; a denial
	// that took time may have been right when Redis gave it.
	if err == nil && !d.Allowed && d.Mode == ModeRemote && rec.end == rec.start && !r.changes() {
		l := r.limitAt(rec.end)
		if rl, lerr := remote.NewLimit(l.Rate, l.Burst); lerr == nil {
			if r.level(DefaultPrefix+key, rl.Q, rl.P, rl.Cap()) >= need*rl.P {
				rec.staleDeny = true
			}
		}
	}
	if err == nil && d.Allowed && refund {
		_ = in.lim.Refund(context.Background(), key, d, rec.n)
		rec.refunded = true
	}
	r.mu.Lock()
	r.recs = append(r.recs, rec)
	r.mu.Unlock()
}

// changes reports whether the schedule refunds or changes limits: either
// lets a bucket hold more than a cached denial assumed (documented).
func (r *simRun) changes() bool {
	if r.s.Refunds > 0 {
		return true
	}
	for _, e := range r.s.Events {
		if e.Kind == "setlimit" {
			return true
		}
	}
	return false
}

// waiter calls WaitN on k0 until ctx ends.
func (r *simRun) waiter(ctx context.Context, i, w int, in *instance) {
	rng := rand.New(rand.NewPCG(r.s.Seed, 1000+uint64(w)))
	// The hang-ups from a stream of their own: adding them left the
	// other draws as they were.
	hang := rand.New(rand.NewPCG(r.s.Seed, 3000+uint64(w)))
	for ctx.Err() == nil {
		n := int64(1)
		if r.s.MaxN > 1 && rng.IntN(2) == 0 {
			n = r.s.MaxN
		}
		wctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		if r.s.GiveUp > 0 && hang.Float64() < r.s.GiveUp {
			stop := time.AfterFunc(time.Duration(hang.Int64N(int64(1500*time.Millisecond))), cancel)
			defer stop.Stop()
		}
		rec := record{inst: i, key: "k0", n: n, start: r.since(), wait: true}
		err := in.lim.WaitN(wctx, "k0", n)
		cancel()
		rec.end, rec.err, rec.allowed = r.since(), err, err == nil
		rec.weight, rec.byPart = in.lim.simShare("k0")
		r.mu.Lock()
		r.recs = append(r.recs, rec)
		r.mu.Unlock()
		if errors.Is(err, ErrClosed) {
			return
		}
		if err == nil {
			// A worker works between grants: under FailOpen WaitN grants
			// at once, and a loop that never blocks would stop virtual
			// time.
			select {
			case <-time.After(time.Millisecond):
			case <-ctx.Done():
			}
		}
		if err != nil {
			// WaitN may give up at once when the deadline is too near.
			select {
			case <-time.After(10 * time.Millisecond):
			case <-ctx.Done():
			}
		}
	}
}

// Bounds of the invariants, from docs/design.md.
const (
	simEps       = time.Millisecond // virtual time: a decision's own work takes none
	simProbeWait = 20 * time.Millisecond
	simOpenFor   = DefaultBreakerOpenFor
)

func within(t time.Duration, ivs []interval) (interval, bool) {
	for _, iv := range ivs {
		if t >= iv.from && t < iv.to {
			return iv, true
		}
	}
	return interval{}, false
}

// settled returns when slot i's breaker must be open in cut interval c:
// the end of the Failures-th call it started in c; ok is false if it
// started fewer.
func settled(recs []record, i int, c interval) (time.Duration, bool) {
	k := 0
	for _, rec := range recs {
		if rec.inst == i && !rec.wait && rec.start >= c.from && rec.start < c.to {
			if k++; k == DefaultBreakerFailures {
				return rec.end, true
			}
		}
	}
	return 0, false
}

func (r *simRun) check(v map[string][]string) {
	s := r.s
	recs := r.recs
	sort.SliceStable(recs, func(i, j int) bool { return recs[i].start < recs[j].start })
	add := func(name, format string, args ...any) {
		v[name] = append(v[name], fmt.Sprintf(format, args...))
	}
	for _, msg := range r.spins {
		add("waitn-spin", "%s", msg)
	}
	for _, msg := range r.late {
		add("schedule", "%s", msg)
	}
	for _, msg := range r.overOne {
		add("weights-over-one", "%s", msg)
	}
	// Per call.
	for _, rec := range recs {
		if rec.wait {
			continue
		}
		if err := rec.err; err != nil {
			switch {
			case errors.Is(err, ErrClosed) && r.alive[rec.inst].to < s.Duration:
			case (errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled)) &&
				rec.deadline > 0 && rec.end >= rec.start+rec.deadline:
			default:
				add("redis-error", "instance %d AllowN(%s, %d) at %v (deadline %v) returned %v",
					rec.inst, rec.key, rec.n, rec.start, rec.deadline, err)
			}
		}
		budget := s.Timeout
		if rec.deadline > 0 {
			budget = min(budget, rec.deadline)
		}
		if d := rec.end - rec.start; d > budget+simEps {
			add("latency", "instance %d AllowN(%s) at %v took %v, budget %v", rec.inst, rec.key, rec.start, d, budget)
		}
		if rec.err == nil && !rec.allowed && (rec.retry < 0 || rec.retry > time.Hour) {
			add("retry-after", "instance %d AllowN(%s, %d) at %v: %v denial with RetryAfter %v",
				rec.inst, rec.key, rec.n, rec.start, rec.mode, rec.retry)
		}
		if rec.err == nil && rec.mode == ModeRemote {
			// A cached denial answers from what Redis said less than
			// cachedFor ago, which may be before the cut: no reply comes
			// during one, so the cut must have begun less than cachedFor
			// before the decision.
			c, ok := within(rec.start, r.cut[rec.inst])
			if ok && rec.cached && !rec.allowed {
				if obs, seen := r.observed(rec.inst, rec.key, c.from); seen && rec.start-obs < cachedFor {
					ok = false
				}
			}
			if ok && rec.end < c.to {
				add("remote-while-down", "instance %d AllowN(%s) at %v-%v: ModeRemote (allowed %v, cached %v) while Redis was cut off %v-%v",
					rec.inst, rec.key, rec.start, rec.end, rec.allowed, rec.cached, c.from, c.to)
			}
		}
		// What Redis lost, a cached denial cannot know until the instance
		// next hears from it: a denial answered from before a kill, less
		// than cachedFor after it began, is the design's allowance.
		lost := false
		for _, k := range r.killed {
			lost = lost || rec.cached && k.from <= rec.start && rec.start-k.from < cachedFor
		}
		// Nor can it know of what gave the bucket tokens since it last
		// heard from Redis: a refund (a WaitN giving back its
		// reservation is one, in runs without refunds too), or Redis's
		// clock jumping forward, which refills the jump at once (the
		// design trusts Redis's clock). What Redis said less than
		// cachedFor ago may predate either.
		after := func(at time.Duration) bool {
			return rec.cached && at <= rec.start && rec.start-at < cachedFor
		}
		for _, at := range r.ahead {
			lost = lost || after(at)
		}
		for _, at := range r.refunds[rec.key] {
			lost = lost || after(at)
		}
		if rec.staleDeny && !lost {
			add("stale-denial", "instance %d AllowN(%s, %d) at %v: remote denial while Redis's bucket held %d tokens or more",
				rec.inst, rec.key, rec.n, rec.start, rec.n)
		}
	}
	// A caller whose deadline ran out while Redis hung still opens the
	// breaker; after Failures such calls, decisions come with a nil error.
	for i := range s.Slots {
		for _, c := range r.cut[i] {
			at, ok := settled(recs, i, c)
			if !ok {
				continue
			}
			for _, rec := range recs {
				if rec.inst == i && !rec.wait && rec.start > at && rec.end < c.to && rec.err != nil && !errors.Is(rec.err, ErrClosed) {
					add("short-deadline-failover", "instance %d AllowN(%s) at %v (deadline %v): %v, though Redis was cut off from %v and %d calls had failed by %v",
						i, rec.key, rec.start, rec.deadline, rec.err, c.from, DefaultBreakerFailures, at)
					break
				}
			}
		}
	}
	// Back on the shared bucket once Redis is.
	reopen := time.Duration(float64(simOpenFor)*(1+DefaultBreakerJitter)) + simProbeWait + s.Timeout
	for i := range s.Slots {
		// Each fault's end bounds it, a kill's a second later (go-redis
		// dials once a second after failed dials) even when another
		// fault ends after it, within that second. A dial that takes
		// time (DialDelay) is a fault too while it lasts, as a latency
		// of Timeout/4 is: a decision that waits for a new connection
		// pays the dial on top of the round trips (in a Cluster, maybe
		// two: the layout's node and the key's new master), and one
		// whose budget is shorter times out, which the breaker counts.
		var healed, bound, dialed time.Duration
		for _, c := range r.disturb[i] {
			end := c.to
			if _, killed := within(c.from, r.killed); killed {
				end += time.Second
			}
			healed, bound = max(healed, c.to), max(bound, end+2*reopen)
		}
		for _, d := range r.dials[i] {
			dialed, bound = max(dialed, d.to), max(bound, d.to+2*reopen)
		}
		for _, rec := range recs {
			if rec.inst == i && !rec.wait && rec.err == nil && rec.start > bound && rec.mode != ModeRemote && rec.mode != ModeLease {
				add("recovery", "instance %d AllowN(%s) at %v decided %v; Redis was back at %v, its last slow dial ended at %v, bound %v",
					i, rec.key, rec.start, rec.mode, healed, dialed, bound)
				break
			}
		}
	}
	r.checkWindows(add)
	r.checkFloor(add)
	r.checkExact(add)
	r.checkCharges(add)
	r.checkFailover(add)
}

// observed returns when the server last ran a script call of slot i on
// key by time t: the latest moment at which the instance can have learnt
// the key's state from Redis (it records the time it sent the call, which
// is no later). Decisions, WaitN reservations, refunds and charges alike.
func (r *simRun) observed(i int, key string, t time.Duration) (time.Duration, bool) {
	times := r.answered[answeredKey{i, key}]
	j, _ := slices.BinarySearch(times, t+1)
	if j == 0 {
		return 0, false
	}
	return times[j-1], true
}

// dumpOnce makes -sim.dump print the first run only, not the shrinking's.
var dumpOnce sync.Once

// answeredKey names the script calls of one slot on one key.
type answeredKey struct {
	inst int
	key  string
}

// admission is tokens admitted at a time, by whom.
type admission struct {
	at     time.Duration
	n      int64
	inst   int
	local  bool
	weight float64
	byPart bool
	// granted is the earliest the tokens can have been taken from a
	// bucket: a WaitN's reservation ran at its start or later and it
	// returns when the refill has paid it, up to its deadline later; any
	// other call's, when it returned.
	granted time.Duration
}

// simShare returns lim's share of key while Redis is away, and whether it
// is a key share rather than the instance's weight.
func (lim *Limiter) simShare(key string) (float64, bool) {
	v := lim.view.Load()
	w := lim.keyWeight(key, v, lim.route(lim.cfg.Prefix+key))
	return w, w != v.weight
}

func (r *simRun) admissions(key string) []admission {
	var out []admission
	for _, rec := range r.recs {
		// FailOpen's admissions are unlimited by design; a WaitN does not
		// say which path granted it, so under FailOpen its admissions are
		// left out too (AllowN's, whose mode is known, are kept).
		if rec.key != key || !rec.allowed || rec.refunded || rec.err != nil ||
			!rec.wait && rec.mode == ModeFailOpen || rec.wait && r.s.Policy == FailOpen {
			continue
		}
		local := rec.mode == ModeLocal
		if rec.wait {
			// WaitN does not say which path granted it: one that
			// overlapped a fault or an unclosed breaker may have been
			// granted by the local share.
			local = r.mayBeLocal(rec)
		}
		granted := rec.end
		if rec.wait {
			granted = rec.start
		}
		out = append(out, admission{rec.end, rec.n, rec.inst, local, rec.weight, rec.byPart, granted})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].at < out[j].at })
	return out
}

// dialed reports whether rec overlapped a dial of its instance that took
// time (DialDelay).
func (r *simRun) dialed(rec record) bool {
	for _, d := range r.dials[rec.inst] {
		if d.from <= rec.end && rec.start < d.to {
			return true
		}
	}
	return false
}

// mayBeLocal reports whether rec, a WaitN, overlapped a fault of its
// instance or a time its breaker was not closed.
func (r *simRun) mayBeLocal(rec record) bool {
	// A slow dial too: a WaitN that waits for a new connection may
	// time out on it (see recovery) and take from the local share.
	if r.dialed(rec) {
		return true
	}
	for _, c := range r.disturb[rec.inst] {
		if c.from <= rec.end && rec.start < c.to {
			return true
		}
	}
	open := false // the breaker's state at rec.start
	for _, b := range r.breakers {
		if b.inst != rec.inst || b.at > rec.end {
			continue
		}
		if b.at < rec.start {
			open = b.open
			continue
		}
		if b.open {
			return true
		}
	}
	return open
}

// breakerChange is an instance's breaker leaving (open) or reaching the
// closed state.
type breakerChange struct {
	inst int
	at   time.Duration
	open bool
}

// checkWindows checks that the fleet admits no more on a key in any
// window [a, a+W) than Rate×W + Burst, plus the outage allowance: the
// local shares' part of the limit, their weights summed but at most one
// limit, one burst per hand-off back to Redis and one per data loss.
func (r *simRun) checkWindows(add func(string, string, ...any)) {
	s := r.s
	var rmax float64
	var bmax int64
	for _, l := range r.limits {
		rmax, bmax = math.Max(rmax, l.l.Rate), max(bmax, l.l.Burst)
	}
	var heals, losses []time.Duration
	for i := range s.Slots {
		for _, c := range r.disturb[i] {
			heals = append(heals, c.to)
		}
	}
	for _, k := range r.killed {
		losses = append(losses, k.to)
	}
	slices.Sort(heals)
	heals = slices.Compact(heals)
	count := func(ts []time.Duration, a, b time.Duration) int {
		n := 0
		for _, t := range ts {
			if t >= a && t < b {
				n++
			}
		}
		return n
	}
	for k := range s.Keys {
		key := fmt.Sprintf("k%d", k)
		adm := r.admissions(key)
		if *simTrace && *simSeed >= 0 {
			for _, x := range adm {
				fmt.Printf("%12v inst %d %s: admitted %d (local %v, weight %.3f)\n", x.at, x.inst, key, x.n, x.local, x.weight)
			}
		}
		leased := r.leasedBefore(key)
		// By slot, the largest weight and key share of a window's local
		// admissions.
		weights, parts := make([]float64, s.Slots), make([]float64, s.Slots)
		check := func(a, b time.Duration) bool {
			w := (b - a).Seconds()
			base := rmax*w + float64(bmax)
			var got int64
			clear(weights)
			clear(parts)
			// adm is in time order: the window's admissions are a run of it.
			lo := sort.Search(len(adm), func(i int) bool { return adm[i].at >= a })
			granted := a // the earliest grant of the window's admissions
			for _, x := range adm[lo:] {
				if x.at >= b {
					break
				}
				got += x.n
				granted = min(granted, x.granted)
				switch {
				case x.local && x.byPart:
					parts[x.inst] = math.Max(parts[x.inst], x.weight)
				case x.local:
					weights[x.inst] = math.Max(weights[x.inst], x.weight)
				}
			}
			sum, keyShares := 0.0, 0.0
			for i := range weights {
				sum += weights[i]
				keyShares += parts[i]
			}
			// The weights add up to at most the limit when Instances
			// counts the fleet (a pod told fewer than there are holds
			// 1/Instances before it hears from the fleet, and so may
			// every other such pod), and the key shares to at most the
			// limit whatever it says.
			allow := (sum + math.Min(1, keyShares)) * base
			if s.CfgInst >= s.Slots {
				allow = (math.Min(1, sum) + math.Min(1, keyShares)) * base
			}
			sum += keyShares
			allow += float64(bmax) * float64(count(heals, a-time.Second, b))
			// A data loss (a restart, a takeover) is one Burst more for a
			// window that holds admissions from both sides of it: one
			// within a second before or in the window, or one the window's
			// WaitN admissions were granted before (a reservation taken
			// from the old bucket is admitted when the refill has paid it,
			// up to the waiter's deadline later).
			allow += float64(bmax) * float64(count(losses, min(granted, a-time.Second), b))
			// Tokens leased before the window and spent in it: taken from
			// the bucket before a, which refilled below its cap meanwhile.
			allow += float64(leased(a))
			if float64(got) > base+allow+1e-9 {
				add("window-limit", "key %s admitted %d in [%v, %v); bound %.1f (%.1f + outage allowance %.1f, local shares %.2f)",
					key, got, a, b, base+allow, base, allow, sum)
				return false
			}
			return true
		}
		if !check(0, s.Duration+time.Second) {
			continue
		}
		for _, x := range adm {
			if !check(x.at, x.at+time.Second) {
				break
			}
		}
	}
}

// leasedBefore returns, for key, a function bounding the tokens held in
// leases at a: per instance, Lease for each grant of the lease that is
// still valid at a. Lease keeps a lease valid until the latest of its
// grants' ends when a grant is sent while it is valid (the tokens add up),
// so a grant counts while such a chain of grants reaches a.
func (r *simRun) leasedBefore(key string) func(a time.Duration) int64 {
	if r.s.Lease == 0 {
		return func(time.Duration) int64 { return 0 }
	}
	leaseFor := r.s.LeaseFor
	type grant struct{ sent, got time.Duration }
	grants := make([][]grant, r.s.Slots)
	for _, rec := range r.recs {
		// A decision Redis allowed leases; AllowAtMost and WaitN do not.
		if rec.key == key && !rec.wait && !rec.atMost && rec.err == nil && rec.allowed && rec.mode == ModeRemote && !rec.cached {
			grants[rec.inst] = append(grants[rec.inst], grant{rec.start, rec.end})
		}
	}
	for _, g := range grants {
		sort.Slice(g, func(i, j int) bool { return g[i].got < g[j].got })
	}
	return func(a time.Duration) int64 {
		var held int64
		for _, g := range grants {
			var chain int64
			var until time.Duration
			for _, x := range g {
				if x.got >= a {
					break
				}
				// Lease takes the grant's send as its now: a grant sent
				// while the lease was valid adds to it, however late its
				// answer came. The send is after the call's start (the
				// node found, a settling waited for) and before its end:
				// a chain is cut only when even the start is past the
				// lease, and a lease lasts from the latest send it can have.
				if x.sent >= until {
					chain = 0
				}
				chain++
				until = max(until, x.got+leaseFor)
			}
			if until > a {
				held += chain * r.s.Lease
			}
		}
		return held
	}
}

// checkFloor checks that, under FailLocal through an outage of every
// instance, each key is still admitted at least the smallest share the
// design gives an instance: Rate × min(evenPart/N, 1/Instances) a second.
func (r *simRun) checkFloor(add func(string, string, ...any)) {
	s := r.s
	if s.Policy != FailLocal {
		return
	}
	for _, c := range r.killedOrHungAll() {
		ws := c.from
		live := 0
		for i := range s.Slots {
			if r.alive[i].from < 0 || r.alive[i].from > c.from || r.alive[i].to <= c.from {
				continue
			}
			live++
			if at, ok := settled(r.recs, i, c); ok {
				ws = max(ws, at)
			} else {
				ws = max(ws, c.from+500*time.Millisecond)
			}
		}
		if live == 0 || ws+time.Second > c.to {
			continue
		}
		l := r.limitAt(ws)
		if r.limitAt(ws+time.Second) != l {
			continue
		}
		// The even part is split among the instances counted in the
		// windows an instance last read: up to four Heartbeats old at
		// the outage (the window read is the one before the heartbeat's,
		// and its part is the lesser of it and the one before), so an
		// instance that left that recently still counts.
		hb := cmp.Or(s.Heartbeat, DefaultHeartbeat)
		counted := live
		if recent := r.aliveWithin(c.from-4*hb, c.from); recent > counted {
			counted = recent
		}
		wmin := math.Min(evenPart/float64(counted), 1/float64(max(s.CfgInst, 1)))
		if s.CfgInst == 0 {
			// A pod not told Instances holds nothing until a heartbeat
			// has read a closed window of its fleet (docs/design.md):
			// one that had not when Redis went away has a share of 0,
			// and so has the floor.
			for i := range s.Slots {
				if r.alive[i].from < 0 || r.alive[i].from > c.from || r.alive[i].to <= c.from {
					continue
				}
				// Its answer is read within the heartbeat's budget, a
				// whole Heartbeat (the pacer's), or not at all: one that
				// Redis ran while the link was too slow for that, hung or
				// down may have come too late to be read.
				var disturbed []interval
				if i < len(r.hbDisturb) {
					disturbed = r.hbDisturb[i]
				}
				read := false
				for _, at := range r.heard[i] {
					if _, slow := within(at, disturbed); at < c.from-hb && !slow {
						read = true
						break
					}
				}
				if !read {
					wmin = 0
				}
			}
		}
		want := math.Floor(l.Rate * wmin)
		for k := range s.Keys {
			key := fmt.Sprintf("k%d", k)
			var got, offered int64
			waited := false
			for _, rec := range r.recs {
				if rec.key != key || rec.end < ws || rec.end >= ws+time.Second {
					continue
				}
				// A call to an instance that left (its Limiter closed:
				// ErrClosed, which redis-error allows only then) was
				// offered to no Limiter of the fleet, and waits for
				// nothing: the caller's own instance is gone.
				if errors.Is(rec.err, ErrClosed) {
					continue
				}
				// Nor is one to an instance that joined during the
				// outage and was not told Instances: it holds nothing. One
				// told holds 1/Instances, no less than the floor's share,
				// once its own breaker must be open (its own first
				// Failures calls into the outage have ended, as for the
				// others at ws); its calls before that are left out.
				if a := r.alive[rec.inst]; a.from > c.from {
					if s.CfgInst == 0 {
						continue
					}
					if at, ok := settled(r.recs, rec.inst, c); !ok || rec.start < at {
						continue
					}
				}
				if rec.wait {
					waited = true
				} else {
					offered += rec.n
				}
				if rec.allowed && rec.err == nil {
					got += rec.n
				}
			}
			floor := want
			if !waited {
				floor = math.Min(floor, float64(offered))
			}
			if float64(got) < floor-1 {
				add("outage-floor", "key %s admitted %d in [%v, %v) of an outage of every instance (offered %d); floor %.0f",
					key, got, ws, ws+time.Second, offered, floor-1)
			}
		}
	}
}

// aliveWithin returns how many slots had a live instance at some time in
// [from, to].
func (r *simRun) aliveWithin(from, to time.Duration) int {
	n := 0
	for _, a := range r.alive {
		if a.from >= 0 && a.from <= to && a.to > from {
			n++
		}
	}
	return n
}

// killedOrHungAll returns the intervals in which every instance was cut off.
func (r *simRun) killedOrHungAll() []interval {
	out := slices.Clone(r.killed)
	for _, e := range r.s.Events {
		if e.Kind == "hang" && e.Who == nil {
			out = append(out, interval{e.At, e.At + e.For})
		}
	}
	return out
}

// checkExact checks, on a healthy run with n = 1, that the fleet admitted
// exactly what one token bucket, fed every call in order, admits.
//
// Not with leases: a lease's tokens are out of the bucket, which refills
// below its cap while they are held (more than one bucket admits), and
// tokens not spent within LeaseFor are lost (fewer); checkWindows bounds
// them.
func (r *simRun) checkExact(add func(string, string, ...any)) {
	s := r.s
	if !s.healthy() || s.Lease > 0 {
		return
	}
	rl, err := remote.NewLimit(s.Limit.Rate, s.Limit.Burst)
	if err != nil {
		panic(err)
	}
	for k := range s.Keys {
		key := fmt.Sprintf("k%d", k)
		type req struct {
			at   time.Duration
			wait bool
		}
		var reqs []req
		got, policy := 0, 0
		for _, rec := range r.recs {
			if rec.key != key {
				continue
			}
			if rec.allowed && rec.err == nil {
				got++
			}
			// The failure policy's decisions (in a run without faults,
			// those whose budget ran out while their connection was
			// being dialed: see recovery) were not run by Redis. A denial
			// took nothing there; an admission is charged to it later
			// (reconcileAfter, in full), or never (FailOpen); one that
			// was sent may have run late as well. Each moves the shared
			// bucket by at most a token from the one fed the call at its
			// end, and with n = 1 a bucket a token off admits at most one
			// call more or less: each may cost one either way.
			if rec.err == nil && (!rec.wait && rec.mode != ModeRemote || rec.wait && rec.allowed && r.mayBeLocal(rec)) {
				policy++
				if !rec.allowed {
					continue
				}
			}
			switch {
			case rec.wait && rec.allowed:
				reqs = append(reqs, req{rec.end, true})
			case !rec.wait:
				reqs = append(reqs, req{rec.end, false})
			}
		}
		sort.SliceStable(reqs, func(i, j int) bool { return reqs[i].at < reqs[j].at })
		level, last := rl.Cap(), r.t0.UnixMicro()
		want := 0
		for _, q := range reqs {
			us := r.t0.Add(q.at).UnixMicro()
			level = min(rl.Cap(), level+(us-last)*rl.Q)
			last = us
			if level >= rl.P {
				level -= rl.P
				want++
			}
		}
		if got < want-policy || got > want+policy {
			add("exact-healthy", "key %s: the fleet admitted %d, one bucket fed the same calls admits %d (%d decisions by the failure policy)", key, got, want, policy)
		}
	}
}

// checkCharges checks that each instance charges Redis, for a key, with
// no more than it spent itself on its local share of that key, and each
// charge with at most a burst (docs/design.md). Counted over the run,
// since a charge that failed is owed to a later one: by every charge, the
// instance's charges so far add up to at most its local admissions so far
// (a WaitN's admissions too, whose mode is not reported), plus the tokens
// of its decisions that timed out, which it decided locally while Redis
// may have run them late: the design errs on the side of refusing there.
// Half a token of rounding aside; sums are in tokens, as limits change.
func (r *simRun) checkCharges(add func(string, string, ...any)) {
	type ik struct {
		inst int
		key  string
	}
	charged := map[ik]float64{}
	// A charge applied again under its marker is one whose marker a data
	// loss (a kill, a takeover) forgot, with the bucket it was applied
	// to: sent again, it puts back on the new bucket the debt the loss
	// erased, as the design means it to. It is counted once.
	applied := map[string]bool{}
	cs := slices.Clone(r.charges)
	sort.SliceStable(cs, func(i, j int) bool { return cs[i].at < cs[j].at })
	for _, c := range cs {
		// Units are tokens of the limit the charge was sent under (its
		// P), which a limit change may have replaced by the time Redis
		// ran it.
		k := ik{c.inst, c.key}
		if c.once != "" {
			if applied[c.once] {
				continue
			}
			applied[c.once] = true
		}
		charged[k] += float64(c.units) / float64(c.p)
		if *simTrace && *simSeed >= 0 {
			fmt.Printf("%12v inst %d %s: charge of %.2f applied (%.2f in all)\n", c.at, c.inst, c.key, float64(c.units)/float64(c.p), charged[k])
		}
		var local, timedOut int64
		for _, rec := range r.recs {
			if rec.inst != c.inst || rec.key != c.key || rec.end > c.at || rec.err != nil {
				continue
			}
			if rec.allowed && (rec.wait || rec.mode == ModeLocal) {
				local += rec.n
			}
			budget := r.s.Timeout
			if rec.deadline > 0 {
				budget = min(budget, rec.deadline)
			}
			if !rec.wait && rec.mode == ModeLocal && rec.end-rec.start >= budget*9/10-simEps {
				timedOut += rec.n
			}
		}
		var bmax int64
		for _, x := range r.limits {
			bmax = max(bmax, x.l.Burst)
		}
		switch {
		case c.units > bmax*c.p+c.p/2+1:
			add("reconcile-overcharge", "instance %d charged key %s %.2f tokens at %v, more than a burst (%d)",
				c.inst, c.key, float64(c.units)/float64(c.p), c.at, bmax)
		case charged[k] > float64(local+timedOut)+0.5:
			add("reconcile-overcharge", "instance %d charged key %s %.2f tokens by %v; it spent %d locally (%d more timed out)",
				c.inst, c.key, charged[k], c.at, local, timedOut)
		}
	}
	// And no less where the design charges in full: in a run without
	// faults, under FailLocal, an instance whose breaker never opened
	// admitted locally only on time-outs, each owed in full when made and
	// charged reconcileAfter later, by the run's end all but the last.
	if !r.s.healthy() || r.s.Policy != FailLocal {
		return
	}
	opened := map[int]bool{}
	for _, b := range r.breakers {
		opened[b.inst] = opened[b.inst] || b.open
	}
	owed := map[ik]int64{}
	for _, rec := range r.recs {
		if rec.err != nil || !rec.allowed || rec.wait || rec.mode != ModeLocal || opened[rec.inst] ||
			rec.end > r.alive[rec.inst].to-reconcileAfter-2*r.s.Timeout {
			continue
		}
		owed[ik{rec.inst, rec.key}] += rec.n
	}
	for k, n := range owed {
		if charged[k] < float64(n)-0.5 {
			add("reconcile-undercharge", "instance %d admitted %d on key %s locally while its breaker stayed closed; it charged %.2f tokens",
				k.inst, n, k.key, charged[k])
		}
	}
}

// TestSim runs the simulator over -sim.seeds seeds from -sim.first, or
// replays -sim.seed, and fails on any invariant violated. The log ends
// with how many seeds failed each invariant.
//
// The seeds run one bubble at a time in each of GOMAXPROCS processes (this
// test binary, run again, handed one seed after another): go-redis keeps
// timers in a package-level sync.Pool, and a timer made in one synctest
// bubble is fatal to use in another, so bubbles in one process cannot
// overlap, and the pool is emptied between them.
func TestSim(t *testing.T) {
	if *simSeed >= 0 {
		replay(t, uint64(*simSeed))
		return
	}
	start := time.Now()
	if *simCost != "" && !*simChild {
		if err := startSimCost(); err != nil {
			t.Fatalf("-sim.cost: %v", err)
		}
	}
	var results []seedResult
	switch procs := runtime.GOMAXPROCS(0); {
	case *simChild:
		// The two GCs before each seed leave a heap of a few MB, whose
		// goal the runtime then returns the seed's pages to the OS by, for
		// the next seed to fault in again: most of the process's system
		// time, and a share of its own. A ballast, never touched and so
		// never resident, keeps the goal above what a seed allocates.
		ballast := make([]byte, 256<<20)
		defer runtime.KeepAlive(ballast)
		// One seed a line, each result printed before the next is read.
		in := bufio.NewScanner(os.Stdin)
		for in.Scan() {
			seed, err := strconv.ParseUint(strings.TrimSpace(in.Text()), 10, 64)
			if err != nil {
				t.Fatalf("simulator process: seed %q: %v", in.Text(), err)
			}
			b, _ := json.Marshal(runSeed(t, seed))
			fmt.Printf("%s%s\n", simResultPrefix, b)
		}
		return
	case procs == 1 || *simSeeds < 2*procs:
		for seed := *simFirst; seed < *simFirst+uint64(*simSeeds); seed++ {
			results = append(results, runSeed(t, seed))
		}
	default:
		results = runChildren(t, procs)
	}
	elapsed := time.Since(start)
	failed := map[string][]uint64{}
	feats := map[string]map[string]int{} // invariant, feature: failing seeds
	for _, r := range results {
		for _, name := range r.Failed {
			failed[name] = append(failed[name], r.Seed)
			if feats[name] == nil {
				feats[name] = map[string]int{}
			}
			for _, f := range r.Features {
				feats[name][f]++
			}
		}
	}
	var b strings.Builder
	fmt.Fprintf(&b, "%d seeds in %v (%.0f seeds/s)", len(results), elapsed.Round(time.Millisecond), float64(len(results))/elapsed.Seconds())
	slow := slices.SortedFunc(slices.Values(results), func(a, b seedResult) int { return cmp.Compare(b.Took, a.Took) })
	for i, r := range slow[:min(3, len(slow))] {
		fmt.Fprintf(&b, "%s seed %d %v", []string{"; slowest:", ","}[min(i, 1)], r.Seed, r.Took.Round(time.Millisecond))
	}
	b.WriteString("\n")
	any := false
	for _, name := range invariants {
		seeds := failed[name]
		slices.Sort(seeds)
		fmt.Fprintf(&b, "  %-24s %5d seeds", name, len(seeds))
		if len(seeds) > 0 {
			any = true
			fmt.Fprintf(&b, "  e.g. %v\n   ", seeds[:min(5, len(seeds))])
			var fs []string
			for f, n := range feats[name] {
				fs = append(fs, fmt.Sprintf("%s %d", f, n))
			}
			slices.Sort(fs)
			fmt.Fprintf(&b, "  with: %s", strings.Join(fs, ", "))
		}
		b.WriteString("\n")
	}
	t.Log(b.String())
	for name, seeds := range failed {
		if !slices.Contains(invariants, name) {
			t.Errorf("invariant %s, failed on %d seeds, is not in invariants: TestSim neither counts nor reports it", name, len(seeds))
		}
	}
	if len(results) != *simSeeds {
		t.Errorf("%d seeds run, want %d", len(results), *simSeeds)
	}
	if any {
		for _, name := range invariants {
			if seeds := failed[name]; len(seeds) > 0 {
				t.Errorf("invariant %s failed on %d seeds; replay one: go test -run 'TestSim$'%s -sim.seed=%d -v .", name, len(seeds), replayFlags(), seeds[0])
			}
		}
	}
}

// seedResult is what one seed's run found: the invariants it failed.
type seedResult struct {
	Seed     uint64
	Failed   []string
	Features []string
	Took     time.Duration // wall time, its share of the pool's emptying too
}

// simResultPrefix starts the lines in which a child process reports a
// seed's result.
const simResultPrefix = "SIMRESULT "

// runSeed simulates seed in a bubble of its own.
func runSeed(t *testing.T, seed uint64) seedResult {
	start, cpu0 := time.Now(), processCPU()
	sched := genSchedule(seed)
	v, recs := simulate(t, sched)
	r := seedResult{Seed: seed, Features: sched.features()}
	for name := range v {
		r.Failed = append(r.Failed, name)
	}
	slices.Sort(r.Failed)
	r.Took = time.Since(start)
	if *simCost != "" {
		if err := writeSimCost(sched, cpu0, len(recs)); err != nil {
			t.Errorf("-sim.cost: %v", err)
		}
	}
	return r
}

// runChildren runs the seeds in procs processes and gathers their
// results. Each process is handed its next seed when it reports one, so
// that they finish together however the seeds' costs fall.
func runChildren(t *testing.T, procs int) []seedResult {
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	var (
		wg      sync.WaitGroup
		mu      sync.Mutex // protects results
		results []seedResult
		next    atomic.Uint64 // seeds handed out
	)
	end := uint64(*simSeeds)
	take := func() (uint64, bool) {
		n := next.Add(1) - 1
		return *simFirst + n, n < end
	}
	for range procs {
		wg.Go(func() {
			cmd := exec.Command(exe, "-test.run=^TestSim$", "-test.count=1", "-test.timeout=0",
				"-sim.child", fmt.Sprintf("-sim.cluster=%v", *simClusterShare), "-sim.cost="+*simCost)
			cmd.Env = append(os.Environ(), "GOMAXPROCS=1")
			var stderr bytes.Buffer
			cmd.Stderr = &stderr
			stdin, err := cmd.StdinPipe()
			if err != nil {
				t.Error(err)
				return
			}
			stdout, err := cmd.StdoutPipe()
			if err != nil {
				t.Error(err)
				return
			}
			if err := cmd.Start(); err != nil {
				t.Error(err)
				return
			}
			var tail []string // its output besides the results, for an error
			handed := map[uint64]bool{}
			hand := func() {
				if seed, ok := take(); ok {
					handed[seed] = true
					fmt.Fprintf(stdin, "%d\n", seed)
				} else {
					stdin.Close()
				}
			}
			hand()
			out := bufio.NewScanner(stdout)
			out.Buffer(nil, 1<<20)
			for out.Scan() {
				line := out.Text()
				rest, ok := strings.CutPrefix(strings.TrimSpace(line), simResultPrefix)
				var r seedResult
				if !ok || json.Unmarshal([]byte(rest), &r) != nil || !handed[r.Seed] {
					tail = append(tail[max(0, len(tail)-40):], line)
					continue
				}
				delete(handed, r.Seed)
				mu.Lock()
				results = append(results, r)
				mu.Unlock()
				hand()
			}
			stdin.Close()
			err = cmd.Wait()
			if err != nil || len(handed) > 0 {
				lost := slices.Sorted(maps.Keys(handed))
				t.Errorf("simulator process: %v, no result for seeds %v; its output ends:\n%s\n%s",
					err, lost, strings.Join(tail, "\n"), stderr.Bytes()[max(0, stderr.Len()-4000):])
			}
		})
	}
	wg.Wait()
	return results
}

// replay runs one seed, prints its schedule and violations, and shrinks
// the schedule by dropping events one at a time while it still fails an
// invariant the whole schedule failed.
func replay(t *testing.T, seed uint64) {
	s := genSchedule(seed)
	t.Logf("replay: go test -run 'TestSim$'%s -sim.seed=%d -v .\n%v", replayFlags(), seed, s)
	v, recs := simulate(t, s)
	if *simTrace {
		last := map[[2]any]Mode{}
		for _, rec := range recs {
			k := [2]any{rec.inst, rec.key}
			if m, ok := last[k]; !ok || m != rec.mode {
				fmt.Printf("%12v inst %d %s: %v (allowed %v, cached %v, err %v)\n", rec.start, rec.inst, rec.key, rec.mode, rec.allowed, rec.cached, rec.err)
				last[k] = rec.mode
			}
		}
	}
	if len(v) == 0 {
		t.Log("no invariant failed")
		return
	}
	report := func(v map[string][]string) {
		for _, name := range invariants {
			if msgs := v[name]; len(msgs) > 0 {
				t.Errorf("%s (%d): %s", name, len(msgs), strings.Join(msgs[:min(3, len(msgs))], "\n\t"))
			}
		}
	}
	report(v)
	failsSame := func(w map[string][]string) bool {
		for name := range v {
			if len(w[name]) > 0 {
				return true
			}
		}
		return false
	}
	small := s
	for changed := true; changed; {
		changed = false
		for i := range small.Events {
			try := small
			try.Events = slices.Delete(slices.Clone(small.Events), i, i+1)
			if w, _ := simulate(t, try); failsSame(w) {
				small, changed = try, true
				break
			}
		}
	}
	if len(small.Events) < len(s.Events) {
		w, _ := simulate(t, small)
		t.Logf("shrunk to %d of %d events (the generator's seed no longer reproduces it; this schedule does):\n%v", len(small.Events), len(s.Events), small)
		t.Log("the shrunk schedule fails:")
		report(w)
	}
}

// replayFlags returns the flags besides the seed that a replay needs: a
// seed draws a Cluster run or not by the share of Cluster runs.
func replayFlags() string {
	if *simClusterShare == 0 {
		return ""
	}
	return fmt.Sprintf(" -sim.cluster=%v", *simClusterShare)
}
