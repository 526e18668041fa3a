package bench

import (
	"context"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/go-redis/redis_rate/v10"
	"github.com/redis/go-redis/v9"
)

// RedisRateSHA makes one redis_rate decision through a client of its own
// on addr, which loads redis_rate's GCRA script into the server if it is
// not there yet, and returns the SHA1 that redis_rate sent with EVALSHA, so
// that redis-benchmark can run the script without a copy of its source.
// It also returns the arguments redis_rate sent after the key.
func RedisRateSHA(ctx context.Context, addr string) (sha string, args []string, err error) {
	rdb := redis.NewClient(&redis.Options{Addr: addr})
	defer rdb.Close()
	var h evalHook
	rdb.AddHook(&h)
	lim := OpenRedisRate(rdb, redis_rate.Limit{Rate: Rate, Burst: Burst, Period: time.Second})
	if _, err := lim.Bind("bench:sha")(ctx); err != nil {
		return "", nil, err
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.args == nil {
		return "", nil, fmt.Errorf("bench: redis_rate sent no EVALSHA")
	}
	ok, err := rdb.ScriptExists(ctx, h.sha).Result()
	if err != nil {
		return "", nil, err
	}
	if len(ok) != 1 || !ok[0] {
		return "", nil, fmt.Errorf("bench: redis_rate's script %s is not loaded", h.sha)
	}
	return h.sha, h.args, nil
}

// evalHook records the SHA1 and arguments of the first EVALSHA.
type evalHook struct {
	mu   sync.Mutex
	sha  string
	args []string
}

func (h *evalHook) DialHook(next redis.DialHook) redis.DialHook {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		return next(ctx, network, addr)
	}
}

func (h *evalHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		a := cmd.Args()
		// EVALSHA sha numkeys key arg...
		if len(a) >= 4 && fmt.Sprint(a[0]) == "evalsha" {
			h.mu.Lock()
			if h.args == nil {
				h.sha = fmt.Sprint(a[1])
				for _, x := range a[4:] {
					h.args = append(h.args, fmt.Sprint(x))
				}
			}
			h.mu.Unlock()
		}
		return next(ctx, cmd)
	}
}

func (h *evalHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// ServerCPU returns the CPU time redis-server has used, user and system,
// from INFO cpu.
func ServerCPU(ctx context.Context, rdb redis.UniversalClient) (time.Duration, error) {
	info, err := rdb.Info(ctx, "cpu").Result()
	if err != nil {
		return 0, err
	}
	var total float64
	found := 0
	for _, line := range strings.Split(info, "\r\n") {
		k, v, ok := strings.Cut(line, ":")
		if !ok || (k != "used_cpu_sys" && k != "used_cpu_user") {
			continue
		}
		f, err := strconv.ParseFloat(v, 64)
		if err != nil {
			return 0, fmt.Errorf("bench: INFO cpu %s: %w", k, err)
		}
		total += f
		found++
	}
	if found != 2 {
		return 0, fmt.Errorf("bench: INFO cpu lacks used_cpu_sys or used_cpu_user")
	}
	return time.Duration(total * float64(time.Second)), nil
}
