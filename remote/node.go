package remote

import (
	"context"
	"crypto/sha1"
	"encoding/hex"
	"errors"
	"log/slog"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/hybridlimit/hybridlimit/lua"
)

// On Redis 7 and later both scripts also run as a function library
// (FUNCTION LOAD, then FCALL): a library is stored with the data set and
// replicated, so a restart from disk or a failover to a replica finds it
// where a script cache would be empty. Redis 6, miniredis and the
// simulator's Redis have no functions, and run the same scripts by EVALSHA.
//
// The library is named by the hash of its code, and so are its functions
// (function names are global to a Redis): two versions of this package in
// a rolling deploy load two libraries side by side, and neither replaces
// the other's code.
var library = newLibrary(lua.TokenBucket, lua.Fleet)

type lib struct {
	name, src   string
	take, fleet string // the functions' names
}

func newLibrary(take, fleet string) lib {
	h := sha1.Sum([]byte(take + "\x00" + fleet))
	name := "hybridlimit_" + hex.EncodeToString(h[:8])
	l := lib{name: name, take: name + "_take", fleet: name + "_fleet"}
	// A script's KEYS and ARGV become the function's parameters; the
	// script's last statement, a return, stays the last of its function.
	l.src = "#!lua name=" + name + "\n" +
		"local function take(KEYS, ARGV)\n" + take + "\nend\n" +
		"local function fleet(KEYS, ARGV)\n" + fleet + "\nend\n" +
		"redis.register_function('" + l.take + "', take)\n" +
		"redis.register_function('" + l.fleet + "', fleet)\n"
	return l
}

// Library returns the name of the function library that FUNCTION LOAD
// loads, and its source.
func Library() (name, src string) { return library.name, library.src }

// FunctionNames returns the names of the library's functions, which FCALL
// calls: the token bucket's and the heartbeat's.
func FunctionNames() (take, fleet string) { return library.take, library.fleet }

// Node is what the remote path has learned of one Redis node: whether it
// runs functions, and whether its scripts may read TIME. Every kind of
// call to the node (decisions, refunds, charges, peeks, resets, probes,
// heartbeats) reads it, to pick the command, and teaches it. Its zero
// value knows nothing yet and sends EVALSHA, which every Redis runs; the
// check for functions is made off the decisions' path (Pipe), so that a
// Redis without them costs nothing to find out. Node is safe for
// concurrent use; its fields must be set before its first use.
type Node struct {
	// Name names the node in logs.
	Name string
	// Log hears, once, that the node refuses TIME in scripts. Nil means
	// no logging.
	Log *slog.Logger
	// Now is the clock that Redis's clock is kept against when scripts
	// may not read it. Nil means time.Now.
	Now func() time.Time

	state atomic.Uint32 // the functions (fnMask) and the noTime bit
	clock atomic.Pointer[sample]
	busy  atomic.Bool // a check or a clock reading is under way
	// detached is set while a heartbeat round trip that outlived its
	// context is still inside a client that bounds no read (Beats).
	detached atomic.Bool
}

// The functions part of a Node's state.
const (
	fnUnknown uint32 = iota // not checked yet, or to be checked again
	fnYes                   // the library is loaded: FCALL
	fnNo                    // no functions: EVALSHA
	fnMask    uint32 = 3
	// noTime is set once the node refused TIME in a script: Redis's
	// clock is then read outside the scripts and passed to them.
	noTime uint32 = 4
)

// verb is how a script call is sent.
type verb uint8

const (
	evalsha verb = iota
	fcall
	eval // with the script's source: loads it into the script cache
)

// setFunctions sets the functions part of n's state to fn.
func (n *Node) setFunctions(fn uint32) {
	for {
		old := n.state.Load()
		if n.state.CompareAndSwap(old, old&^fnMask|fn) {
			return
		}
	}
}

// verb returns the verb of a first try on n.
func (n *Node) verb() verb {
	if n.state.Load()&fnMask == fnYes {
		return fcall
	}
	return evalsha
}

// Functions reports whether calls to n go by FCALL.
func (n *Node) Functions() bool { return n.verb() == fcall }

// ClientTime reports whether n refused TIME in scripts, so that Redis's
// clock is read outside them and passed as an argument.
func (n *Node) ClientTime() bool { return n.state.Load()&noTime != 0 }

// refuseTime records that n refused TIME in a script, and logs it the
// first time.
func (n *Node) refuseTime() {
	for {
		old := n.state.Load()
		if old&noTime != 0 {
			return
		}
		if n.state.CompareAndSwap(old, old|noTime) {
			break
		}
	}
	if n.Log != nil {
		n.Log.Warn("hybridlimit: Redis refuses TIME in scripts; its clock is read outside them and passed in",
			"node", n.Name)
	}
}

// check records whether the node runs functions, through c, the node's
// own client: a library listed under its name says so, and one missing is
// loaded (a reply that it exists, from a loader that came first, says so
// as well as an OK). Any other error reply says that the node has no
// functions (an unknown command, an ACL that forbids them). A network
// error leaves it unknown, to be checked again.
func (n *Node) check(ctx context.Context, c redis.Cmdable) {
	libs, err := c.FunctionList(ctx, redis.FunctionListQuery{LibraryNamePattern: library.name}).Result()
	if err == nil && len(libs) == 0 {
		err = c.FunctionLoad(ctx, library.src).Err()
		if err != nil && strings.Contains(err.Error(), "already exists") {
			err = nil
		}
	}
	var rerr redis.Error
	switch {
	case err == nil:
		n.setFunctions(fnYes)
	case errors.As(err, &rerr) && !IsFailure(err):
		n.setFunctions(fnNo)
	}
}

// missing reports whether err says that the script or function called is
// not on the node: the script cache or the functions were flushed, the
// node restarted without its data, or it has no functions at all. The
// call did not run.
func missing(err error) bool {
	if err == nil {
		return false
	}
	if isNoScript(err) {
		return true
	}
	var rerr redis.Error
	if !errors.As(err, &rerr) {
		return false
	}
	s := rerr.Error()
	return strings.HasPrefix(s, "ERR Function not found") || strings.HasPrefix(s, "ERR Library not found") ||
		strings.HasPrefix(s, "ERR unknown command")
}

// refusedTime reports whether err is a script's refusal to run a command
// (only TIME is in question: ElastiCache Serverless answers so to it).
func refusedTime(err error) bool {
	if err == nil {
		return false
	}
	var rerr redis.Error
	return errors.As(err, &rerr) && strings.Contains(rerr.Error(), "not allowed from script")
}

// clockEvery is how often Redis's clock is read again while a node's
// scripts may not read it: the local clock drifts from it by parts per
// million, microseconds in a few seconds.
const clockEvery = 5 * time.Second

// sample is one reading of a node's clock.
type sample struct {
	at    time.Time     // Node.Now midway through the round trip
	redis int64         // Redis TIME in microseconds, at at
	err   time.Duration // half the round trip: how far at may be off
}

func (n *Node) now() time.Time {
	if n.Now != nil {
		return n.Now()
	}
	return time.Now()
}

// readClock reads the node's clock through c with a plain TIME command,
// twice if the first round trip took over a millisecond (a connection
// dialed for it, a busy client), and keeps the reading of the shorter one.
func (n *Node) readClock(ctx context.Context, c redis.Cmdable) (*sample, error) {
	var best *sample
	for range 2 {
		sent := n.now()
		t, err := c.Time(ctx).Result()
		if err != nil {
			if best != nil {
				break
			}
			return nil, err
		}
		half := n.now().Sub(sent) / 2
		if best == nil || half < best.err {
			best = &sample{at: sent.Add(half), redis: t.UnixMicro(), err: half}
		}
		if half <= clockGood {
			break
		}
	}
	n.clock.Store(best)
	return best, nil
}

// clockGood is a round trip's half that needs no second reading.
const clockGood = 500 * time.Microsecond

// redisNow returns what the node's clock reads now, in microseconds,
// reading it through c if it never was; stale reports that the last
// reading is older than clockEvery.
func (n *Node) redisNow(ctx context.Context, c redis.Cmdable) (now int64, stale bool, err error) {
	s := n.clock.Load()
	if s == nil {
		if s, err = n.readClock(ctx, c); err != nil {
			return 0, false, err
		}
	}
	t := n.now()
	return s.redis + t.Sub(s.at).Microseconds(), t.Sub(s.at) > clockEvery, nil
}

// ClockError returns the error of the node's last clock reading, half its
// round trip, or -1 if its clock was never read.
func (n *Node) ClockError() time.Duration {
	if s := n.clock.Load(); s != nil {
		return s.err
	}
	return -1
}

// nodeClient returns the client of the node that owns key: c itself, or
// for a Cluster the client of key's master, which go-redis finds without
// network I/O once its layout is loaded.
func nodeClient(ctx context.Context, c redis.UniversalClient, key string) redis.Cmdable {
	if cc, ok := c.(*redis.ClusterClient); ok {
		if m, err := cc.MasterForKey(ctx, key); err == nil {
			return m
		}
	}
	return c
}

// exchange sends cmds[i] = build(i, v, now) for each i of live through c,
// and answers, once each, what proves that a call did not run: a missing
// script or function is sent again with the script's source, and a
// refused TIME again with Redis's clock as an argument. It first sends by
// FCALL if n has functions, else EVALSHA; with Redis's clock if n refused
// TIME before. key is one of the calls' keys, naming the node for a
// Cluster. It is the one way every request kind reaches Redis.
func (n *Node) exchange(ctx context.Context, c redis.UniversalClient, key string, cmds []noRetryCmd, live []int,
	build func(i int, v verb, now int64) noRetryCmd) {
	v := n.verb()
	var now int64
	if n.ClientTime() {
		var err error
		if now, _, err = n.redisNow(ctx, nodeClient(ctx, c, key)); err != nil {
			for _, i := range live {
				cmds[i] = noRetryCmd{redis.NewCmd(ctx)}
				cmds[i].SetErr(err)
			}
			return
		}
	}
	send := func(which []int, verbs func(int) verb) {
		if len(which) == 1 {
			// No pipeline for one: a Cluster client routes it by itself.
			i := which[0]
			cmds[i] = build(i, verbs(i), now)
			_ = c.Process(ctx, cmds[i])
			return
		}
		pl := c.Pipeline()
		for _, i := range which {
			cmds[i] = build(i, verbs(i), now)
			_ = pl.Process(ctx, cmds[i])
		}
		_, _ = pl.Exec(ctx)
	}
	send(live, func(int) verb { return v })
	// At most two more rounds: a call may find its script missing, then
	// TIME refused, each once.
	var source map[int]bool
	for round := 0; round < 2; round++ {
		var again []int
		refused := false
		for _, i := range live {
			err := cmds[i].Err()
			switch {
			case missing(err):
				if source == nil {
					source = map[int]bool{}
				}
				if !source[i] {
					source[i] = true
					again = append(again, i)
				}
			case now == 0 && refusedTime(err):
				refused = true
				again = append(again, i)
			}
		}
		if len(again) == 0 {
			return
		}
		if v == fcall && len(source) > 0 {
			// The library is gone (flushed, or a restart without data):
			// EVAL meanwhile, and the next check loads it again.
			n.setFunctions(fnUnknown)
		}
		if refused {
			n.refuseTime()
			var err error
			if now, _, err = n.redisNow(ctx, nodeClient(ctx, c, key)); err != nil {
				return // the calls keep their refusal
			}
		}
		send(again, func(i int) verb {
			if source[i] {
				return eval
			}
			return v
		})
	}
}

// formatMicros is a Redis time in microseconds as a script argument.
func formatMicros(us int64) string { return strconv.FormatInt(us, 10) }

// needsTending reports whether n is to be checked for functions, or its
// clock read again.
func (n *Node) needsTending() bool {
	st := n.state.Load()
	if st&fnMask == fnUnknown {
		return true
	}
	if st&noTime == 0 {
		return false
	}
	s := n.clock.Load()
	return s == nil || n.now().Sub(s.at) > clockEvery
}

// tendNow does what needsTending asks for, through c, the node's client.
func (n *Node) tendNow(ctx context.Context, c redis.Cmdable) {
	if n.state.Load()&fnMask == fnUnknown {
		n.check(ctx, c)
	}
	if n.needsTending() && n.ClientTime() {
		_, _ = n.readClock(ctx, c)
	}
}
