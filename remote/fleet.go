package remote

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"
)

// Heartbeat is what one heartbeat learns of the fleet: the last window of
// the group's clock that every instance has had time to report, as Redis
// holds it. Every instance that reads a window reads the same Reporters,
// Total and, for itself, Mine.
//
// For example, three instances that reported 80, 15 and 5 admitted tokens
// for the window read each get Reporters 3 and Total 100; the first gets
// Mine 80. An instance that did not report for it gets Mine -1 and a
// Ticket: 1 for the first such instance to ask, 2 for the next.
type Heartbeat struct {
	Now       int64 // Redis TIME, in milliseconds
	Reporters int64 // instances that reported for the window; 0: no window yet
	Total     int64 // tokens they reported admitted, in all
	Mine      int64 // this instance's report in Total; -1 if not among them
	Ticket    int64 // when Mine is -1 and Reporters > 0: its place among those not counted
}

// Window returns the index of the window h describes, for a window of
// every: Redis TIME's window, less the three in which reports for it are
// accepted.
func (h Heartbeat) Window(every time.Duration) int64 {
	return h.Now/every.Milliseconds() - 3
}

// Fleet sends one heartbeat of instance id: offered is what it counted in
// window of Redis TIME (of length every: whole milliseconds, the same for
// the whole group). Redis takes the report while it is in that window or
// one of the next two. The group's windows live in four hashes named
// base+":0" to ":3"; base must carry a hash tag so that they share a
// Cluster slot. Redis's cost and the reply's size do not depend on
// the fleet's size. Like Take, the call is never retried but for NOSCRIPT.
// Fleet waits as long as the client does: call it from a goroutine that
// may wait.
func Fleet(ctx context.Context, c redis.UniversalClient, base, id string, window, offered int64, every time.Duration) (Heartbeat, error) {
	args := func(verb, script string) noRetryCmd {
		return noRetryCmd{redis.NewCmd(ctx, verb, script, 4, base+":0", base+":1", base+":2", base+":3", id,
			strconv.FormatInt(window, 10), strconv.FormatInt(offered, 10), strconv.FormatInt(every.Milliseconds(), 10))}
	}
	cmd := args("evalsha", fleetScript.sha)
	err := c.Process(ctx, cmd)
	if isNoScript(err) {
		cmd = args("eval", fleetScript.src)
		err = c.Process(ctx, cmd)
	}
	if err != nil {
		return Heartbeat{}, err
	}
	return parseHeartbeat(cmd.Val())
}

// parseHeartbeat turns the script's reply into a Heartbeat, or ErrReply if
// it is not five integers that agree with each other.
func parseHeartbeat(reply any) (Heartbeat, error) {
	vals, ok := reply.([]any)
	if !ok || len(vals) != 5 {
		return Heartbeat{}, fmt.Errorf("%w: fleet reply %T of %d", ErrReply, reply, len(vals))
	}
	var n [5]int64
	for i, v := range vals {
		x, ok := v.(int64)
		if !ok {
			return Heartbeat{}, fmt.Errorf("%w: fleet reply element %d is %T", ErrReply, i, v)
		}
		n[i] = x
	}
	h := Heartbeat{Now: n[0], Reporters: n[1], Total: n[2], Mine: n[3], Ticket: n[4]}
	counted := h.Mine >= 0
	switch {
	case h.Now <= 0, h.Reporters < 0, h.Total < 0, h.Mine < -1, h.Mine > h.Total, h.Ticket < 0,
		h.Reporters == 0 && (h.Total != 0 || counted || h.Ticket != 0),
		h.Reporters > 0 && counted == (h.Ticket > 0):
		return Heartbeat{}, fmt.Errorf("%w: fleet reply %v", ErrReply, vals)
	}
	return h, nil
}

// Load loads every script of this package into the script cache of every
// node c reaches (every master of a Cluster), so that the first decisions
// need not send the source after a NOSCRIPT.
func Load(ctx context.Context, c redis.UniversalClient) error {
	for _, s := range []*script{takeScript, fleetScript} {
		if err := c.ScriptLoad(ctx, s.src).Err(); err != nil {
			return err
		}
	}
	return nil
}
