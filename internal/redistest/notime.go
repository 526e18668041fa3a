package redistest

import (
	"context"
	"crypto/sha1"
	"encoding/hex"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"

	"github.com/redis/go-redis/v9"

	"github.com/hybridlimit/hybridlimit/lua"
)

// NoScriptTime is a go-redis hook (Client.AddHook) that makes a Redis act
// as Amazon ElastiCache Serverless does: it answers "ERR This Redis
// command is not allowed from script" to every call of hybridlimit's
// scripts that would read TIME, those that do not pass Redis's clock as
// their last argument, without sending them. Everything else goes to
// Redis, plain TIME included. Refused counts the calls it answered.
type NoScriptTime struct{ Refused atomic.Int64 }

// refusal is the error reply the hook answers with.
type refusal string

func (e refusal) Error() string { return string(e) }
func (refusal) RedisError()     {}

var bucketSHA = func() string { h := sha1.Sum([]byte(lua.TokenBucket)); return hex.EncodeToString(h[:]) }()

// DialHook passes dialing through.
func (h *NoScriptTime) DialHook(next redis.DialHook) redis.DialHook { return next }

// ProcessHook refuses a script call that would read TIME.
func (h *NoScriptTime) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if h.refuse(cmd) {
			return cmd.Err()
		}
		return next(ctx, cmd)
	}
}

// ProcessPipelineHook refuses the script calls of a pipeline that would
// read TIME and sends the rest.
func (h *NoScriptTime) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		pass := make([]redis.Cmder, 0, len(cmds))
		for _, cmd := range cmds {
			if !h.refuse(cmd) {
				pass = append(pass, cmd)
			}
		}
		if len(pass) == 0 {
			return nil
		}
		return next(ctx, pass)
	}
}

// refuse answers cmd with the refusal if it is a script call that reads
// TIME: the bucket with fewer than 7 arguments, the heartbeat with fewer
// than 8.
func (h *NoScriptTime) refuse(cmd redis.Cmder) bool {
	args := cmd.Args()
	switch strings.ToLower(fmt.Sprint(args[0])) {
	case "eval", "evalsha", "fcall":
	default:
		return false
	}
	if len(args) < 3 {
		return false
	}
	keys, err := strconv.Atoi(fmt.Sprint(args[2]))
	if err != nil {
		return false
	}
	id := fmt.Sprint(args[1])
	need := 8 // the heartbeat
	if id == bucketSHA || id == lua.TokenBucket || strings.HasSuffix(id, "_take") {
		need = 7
	}
	if len(args)-3-keys >= need {
		return false
	}
	h.Refused.Add(1)
	cmd.SetErr(refusal("ERR This Redis command is not allowed from script script: " + id[:min(len(id), 40)]))
	return true
}
