package remote

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"
)

// Member is one live instance of a limiter group.
type Member struct {
	ID     string
	Report string // what it reported at its last heartbeat
}

// Fleet records one heartbeat of instance id with its report (a string
// without spaces, opaque to this package) in the fleet hash at key, and
// returns the live members, id included.
// A heartbeat counts for ttl; the hash keeps at most most members. Like
// Take, the call is never retried but for NOSCRIPT. Fleet waits as long as
// the client does: call it from a goroutine that may wait.
func Fleet(ctx context.Context, c redis.UniversalClient, key, id, report string, ttl time.Duration, most int) ([]Member, error) {
	args := func(verb, script string) noRetryCmd {
		return noRetryCmd{redis.NewCmd(ctx, verb, script, 1, key, id, report,
			strconv.FormatInt(ttl.Milliseconds(), 10),
			strconv.Itoa(most))}
	}
	cmd := args("evalsha", fleetScript.sha)
	err := c.Process(ctx, cmd)
	if isNoScript(err) {
		cmd = args("eval", fleetScript.src)
		err = c.Process(ctx, cmd)
	}
	if err != nil {
		return nil, err
	}
	vals, ok := cmd.Val().([]any)
	if !ok || len(vals)%2 != 0 {
		return nil, fmt.Errorf("%w: fleet reply %T", ErrReply, cmd.Val())
	}
	members := make([]Member, 0, len(vals)/2)
	for i := 0; i < len(vals); i += 2 {
		id, ok1 := vals[i].(string)
		r, ok2 := vals[i+1].(string)
		if !ok1 || !ok2 {
			return nil, fmt.Errorf("%w: fleet member %v %v", ErrReply, vals[i], vals[i+1])
		}
		members = append(members, Member{ID: id, Report: r})
	}
	return members, nil
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
