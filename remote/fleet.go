package remote

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// Heartbeat is what one heartbeat learns of the fleet: whether Redis took
// the report, and a window of the group's clock that no report can change
// any more, as Redis holds it. Every instance that reads a window reads
// the same Reporters and Total.
//
// For example, three instances that reported 80, 15 and 5 tokens for the
// window read each get Reporters 3 and Total 100. An instance that was not
// counted in it asks for a ticket: 1 for the first such instance to ask,
// 2 for the next.
type Heartbeat struct {
	Window    int64 // the window read
	Now       int64 // Redis TIME, in milliseconds
	Taken     bool  // the report was counted in its window
	Mark      int64 // if Taken, the mark of the window's hash it went into (see Beat.Mark)
	Reporters int64 // instances that reported for Window; 0: none, or not closed yet
	Total     int64 // tokens they reported, in all
	// Ticket, if Reporters > 0, is its place among those not counted:
	// given if the Beat asked for one, or if its Mark is not the hash's
	// (its report went into a hash Redis lost), and then the instance was
	// not counted in Total.
	Ticket int64
	// Before is window Window-1, if the Beat asked for it and Window was
	// closed: an instance that did not read that window when its turn
	// came reads it with the next.
	Before Reading
}

// Reading is what Redis holds of one more window, read with another.
type Reading struct {
	Read      bool  // Redis read the window (Redis was no more than a window late for it)
	Reporters int64 // instances that reported for it; 0: none
	Total     int64 // tokens they reported, in all
	Ticket    int64 // as Heartbeat.Ticket
}

// A report is packed as tokens<<reporterBits | 1, so that one HINCRBY
// adds both the tokens and the instance to the window's sum. The tokens
// of one report are capped at MaxReport; the sum holds up to 2^43 tokens
// (beyond, HINCRBY fails and nothing is written) from up to 2^20-1
// instances.
const (
	reporterBits = 20
	// MaxReport is the most tokens one report counts.
	MaxReport = 1<<32 - 1
)

// maxMark is the largest mark (Beat.Mark) a window's first report draws.
const maxMark = 1023

// Beat is one heartbeat of Beats, and what came of it. Offered is what
// this instance counted in Window of Redis TIME (windows of Every, whole
// milliseconds, the same for the whole group, and one report per window),
// and Redis takes it while it is in that window or one of the next two.
// The heartbeat reads Window-2, which is closed once Redis is in Window+1,
// the time to send this report when on time; Ticket asks for a ticket,
// for an instance not counted in it. Window w's hash is named
// Base+":"+w; Base must carry a hash tag, so that a call's keys share a
// Cluster slot. Redis's cost and the reply's size do not depend on the
// fleet's size. A heartbeat is never retried but for NOSCRIPT, which
// proves it did not run: a report is never counted twice.
type Beat struct {
	Base    string
	Window  int64
	Offered int64
	Ticket  bool
	Every   time.Duration
	// Before asks for window Window-3 too (Heartbeat.Before), and
	// BeforeTicket for a ticket in it.
	Before, BeforeTicket bool
	// ReportOnly sends the report and reads nothing.
	ReportOnly bool
	// Mark and BeforeMark are the marks (Heartbeat.Mark) this instance's
	// reports in the windows read were taken under, where they were. The
	// first report of a window's hash draws its mark (1 to 1023), which
	// every later report gets back; if Redis lost the hash after this
	// instance's report (a restart without data), the first report after
	// the loss drew another, and the instance, given a ticket, knows it
	// was not counted in the sum it reads. A Beat that leaves them 0 where
	// its report was taken is given a ticket too.
	Mark, BeforeMark int64
	Heartbeat        Heartbeat // set by Beats if Err is nil
	Err              error
}

// Beats sends every heartbeat of beats in one pipeline:
// one round trip for the heartbeats of many Limiters that share c, so
// that what they cost this process and Redis's socket work are paid once
// per batch rather than once per heartbeat. Redis runs each one's script
// on its own; one that met NOSCRIPT is sent again with the source, in a
// second round trip. n is what is known of the node of the first beat's
// key (nil: nothing), which Beats, called off the decisions' path, checks
// and keeps up to date itself.
//
// Beats returns when ctx ends, whatever bounds the client's reads (a
// client without ContextTimeoutEnabled reads for its ReadTimeout, 3 s by
// default, or without end at -1 or -2, and none stops at a cancellation):
// the beats it did not get answers for then fail with ErrUnanswered, and
// the round trip goes on, inside the client, until Redis answers or the
// client gives up; no other round trip of n starts meanwhile. The caller,
// a pacer that counts the windows of many Limiters, is held for ctx at
// most.
func Beats(ctx context.Context, c redis.UniversalClient, n *Node, beats []Beat) {
	if len(beats) == 0 {
		return
	}
	if n == nil {
		n = new(Node)
	}
	// While a round trip that outlived its context is still inside the
	// client, no other is started: each would wait there too.
	if !n.detached.CompareAndSwap(false, true) {
		for i := range beats {
			beats[i].Heartbeat, beats[i].Err = Heartbeat{}, errStuck
		}
		return
	}
	// The round trip works on a copy of beats, which a detached one may
	// still fill after Beats has returned.
	own := slices.Clone(beats)
	ran := false
	if detach(ctx, func() {
		defer n.detached.Store(false)
		beatsNow(ctx, c, n, own)
		ran = true
	}) == nil {
		if !ran { // ctx had ended already: nothing was sent
			n.detached.Store(false)
			for i := range own {
				own[i].Err = ctx.Err()
			}
		}
		copy(beats, own)
		return
	}
	for i := range beats {
		beats[i].Heartbeat = Heartbeat{}
		beats[i].Err = fmt.Errorf("%w: %w", ErrUnanswered, ctx.Err())
	}
}

// errStuck is the error of a heartbeat not sent because an earlier round
// trip to its node, which outlived its context, is still unanswered.
var errStuck = errors.New("remote: an earlier heartbeat is still unanswered")

// beatsNow is Beats, waiting as long as the client does.
func beatsNow(ctx context.Context, c redis.UniversalClient, n *Node, beats []Beat) {
	if n.needsTending() && n.busy.CompareAndSwap(false, true) {
		n.tendNow(ctx, nodeClient(ctx, c, beats[0].Base))
		n.busy.Store(false)
	}
	cmds := make([]noRetryCmd, len(beats))
	all := make([]int, len(beats))
	for i := range all {
		all[i] = i
	}
	n.exchange(ctx, c, beats[0].Base, cmds, all, func(i int, v verb, now int64) noRetryCmd {
		return beatCmd(ctx, &beats[i], v, now)
	})
	for i, cmd := range cmds {
		b := &beats[i]
		if b.Err = cmd.Err(); b.Err != nil {
			b.Heartbeat = Heartbeat{}
			continue
		}
		b.Heartbeat, b.Err = parseHeartbeat(cmd.Val())
		b.Heartbeat.Window = b.Window - 2
		if b.ReportOnly {
			b.Heartbeat.Window = 0 // not read
		}
	}
}

// beatCmd returns the call of b by v; unless now is 0, it passes now
// (Redis's clock, in microseconds) as ARGV[8].
func beatCmd(ctx context.Context, b *Beat, v verb, now int64) noRetryCmd {
	read := b.Window - 2
	if b.ReportOnly {
		// A window no Redis clock reaches: the script reads a window only
		// once Redis is three past it, and the report of a heart behind
		// Redis's clock by four would make Window+1 one.
		read = math.MaxInt64 / 2
	}
	report := min(max(b.Offered, 0), MaxReport)<<reporterBits | 1
	want := 0
	if b.Ticket {
		want |= 1
	}
	keys := 2
	if b.Before {
		want |= 2
		keys = 3
		if b.BeforeTicket {
			want |= 4
		}
	}
	args := make([]any, 0, 12)
	args = append(args, fleetScript.head[v][0], fleetScript.head[v][1], keys,
		b.Base+":"+strconv.FormatInt(b.Window, 10), b.Base+":"+strconv.FormatInt(read, 10))
	if b.Before {
		args = append(args, b.Base+":"+strconv.FormatInt(read-1, 10))
	}
	args = append(args, strconv.FormatInt(b.Window, 10), strconv.FormatInt(report, 10),
		strconv.FormatInt(read, 10), strconv.FormatInt(b.Every.Milliseconds(), 10), strconv.Itoa(want),
		strconv.FormatInt(b.Mark, 10), strconv.FormatInt(b.BeforeMark, 10))
	if now != 0 {
		args = append(args, formatMicros(now))
	}
	return noRetryCmd{redis.NewCmd(ctx, args...)}
}

// parseHeartbeat turns the script's reply into a Heartbeat, or ErrReply if
// it is not what the script returns.
func parseHeartbeat(reply any) (Heartbeat, error) {
	vals, ok := reply.([]any)
	if !ok || len(vals) != 4 && len(vals) != 6 {
		return Heartbeat{}, fmt.Errorf("%w: fleet reply %T of %d", ErrReply, reply, len(vals))
	}
	now, ok1 := vals[0].(int64)
	taken, ok2 := vals[1].(int64)
	r, ok3 := parseReading(vals[2], vals[3])
	if !ok1 || !ok2 || !ok3 || now <= 0 || taken < 0 || taken > maxMark+1 {
		return Heartbeat{}, fmt.Errorf("%w: fleet reply %v", ErrReply, vals)
	}
	h := Heartbeat{Now: now, Taken: taken > 0, Mark: max(taken-1, 0),
		Reporters: r.Reporters, Total: r.Total, Ticket: r.Ticket}
	if len(vals) == 6 {
		if h.Before, ok = parseReading(vals[4], vals[5]); !ok {
			return Heartbeat{}, fmt.Errorf("%w: fleet reply %v", ErrReply, vals)
		}
	}
	return h, nil
}

// parseReading parses one window's sum ('#t' as a string, or 0 for none)
// and ticket, as the script returns them.
func parseReading(s, t any) (Reading, bool) {
	ticket, ok := t.(int64)
	var sum int64
	switch x := s.(type) {
	case int64: // none
		ok = ok && x == 0
	case string:
		p, err := strconv.ParseInt(x, 10, 64)
		sum = p
		ok = ok && err == nil && p > 0 && p&(1<<reporterBits-1) > 0
	default:
		ok = false
	}
	if !ok || ticket < 0 || sum == 0 && ticket != 0 {
		return Reading{}, false
	}
	return Reading{Read: true, Reporters: sum & (1<<reporterBits - 1), Total: sum >> reporterBits, Ticket: ticket}, true
}

// Load loads every script of this package into the script cache of c's
// node, and on Redis 7 and later the function library too, so that the
// first decisions need not send the source after a NOSCRIPT. For a
// Cluster, call it with each master's client (ClusterClient.ForEachMaster):
// every node has its own cache and its own functions, which its replicas
// receive. A Redis without functions is no error.
//
// Load returns when ctx ends even if the client bounds its reads by
// nothing (ReadTimeout -1 or -2); the pipeline then goes on, inside the
// client, until Redis answers or the client is closed.
func Load(ctx context.Context, c redis.Cmdable) error {
	u, _ := c.(redis.UniversalClient)
	var err error
	ran := false
	if Detach(ctx, u, func() { err, ran = load(ctx, c), true }) != nil {
		return fmt.Errorf("%w: %w", ErrUnanswered, ctx.Err())
	}
	if !ran {
		return ctx.Err()
	}
	return err
}

// load is Load, waiting as long as the client does.
func load(ctx context.Context, c redis.Cmdable) error {
	pl := c.Pipeline()
	scripts := []*redis.StringCmd{pl.ScriptLoad(ctx, takeScript.src), pl.ScriptLoad(ctx, fleetScript.src)}
	_ = pl.FunctionLoad(ctx, library.src) // fails where there are no functions, or the library is there
	_, _ = pl.Exec(ctx)
	for _, s := range scripts {
		if err := s.Err(); err != nil {
			return err
		}
	}
	return nil
}

// Ping sends n PINGs through c at once, none retried, and returns once
// all are answered or have failed; ctx bounds them as it bounds any
// command of c. On a *redis.Client one PING goes first through c itself
// (see below), then each of the n goes out on a connection of its own
// (c.Conn), the first of them alone; n is capped at the pool's size, so
// that Ping opens up to n connections to c's node: an answered PING keeps
// its connection until every PING is answered, or for hold at most,
// rather than hand it to one still waiting for a connection. hold bounds how long a PING that
// cannot get a connection (the pool is busy: other Pings on the same
// client, or the application's own commands) keeps others out of the pool.
// go-redis keeps the connections of pipelines in a pool of their own,
// which Ping does not open. For a Cluster, call it with each master's
// client.
//
// Ping returns when ctx ends even if the client bounds its reads by
// nothing (ReadTimeout -1 or -2); the PINGs then go on, inside the client,
// until Redis answers or the client is closed.
func Ping(ctx context.Context, c redis.UniversalClient, n int, hold time.Duration) {
	Detach(ctx, c, func() { ping(ctx, c, n, hold) })
}

// ping is Ping, waiting as long as the client does.
func ping(ctx context.Context, c redis.UniversalClient, n int, hold time.Duration) {
	one, _ := c.(*redis.Client)
	if one != nil {
		o := one.Options()
		n = min(n, o.PoolSize)
		if o.MaxActiveConns > 0 {
			n = min(n, o.MaxActiveConns)
		}
	}
	if one != nil && n > 0 {
		// First through the client itself: on the first connection
		// go-redis records in the client's options whether the server
		// takes its maintenance-notifications handshake, under the
		// client's lock, which the connections of c.Conn() do not take.
		// A decision dialing its first connection meanwhile takes that
		// lock too; a PING through c.Conn() would be a data race with it.
		_ = c.Process(ctx, noRetryCmd{redis.NewCmd(ctx, "ping")})
	}
	var wg, pinged sync.WaitGroup
	pinged.Add(min(n, 1))
	all := make(chan struct{})
	for i := range n {
		if i == 1 {
			// The first PING's connection is set up before the others
			// start: on it go-redis learns whether the server takes its
			// maintenance-notifications handshake and records that in
			// the client's options, which the connections of c.Conn() share
			// under locks of their own (a data race under -race when they
			// are set up at once against a server that refuses it).
			pinged.Wait()
			pinged.Add(n - 1)
		}
		wg.Go(func() {
			cmd := noRetryCmd{redis.NewCmd(ctx, "ping")}
			if one == nil {
				_ = c.Process(ctx, cmd)
				pinged.Done()
				return
			}
			conn := one.Conn()
			_ = conn.Process(ctx, cmd)
			pinged.Done()
			t := time.NewTimer(hold)
			select {
			case <-all:
			case <-t.C:
			}
			t.Stop()
			_ = conn.Close() // back to the pool, unless go-redis found it broken
		})
	}
	pinged.Wait()
	close(all)
	wg.Wait()
}
