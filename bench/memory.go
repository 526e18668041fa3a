package bench

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/go-redis/redis_rate/v10"
	"github.com/redis/go-redis/v9"

	"github.com/hybridlimit/hybridlimit"
)

// MemoryLimitText names the limit of the memory measurement: 100 per hour, burst
// 100, for both limiters. The refill is slow so that no key expires while
// the keys are written (redis_rate's TTL is the time to refill what was
// spent, 36 s here).
const MemoryLimitText = "100 per hour, burst 100"

// MemoryContenders are the limiters whose keys Memory measures.
var MemoryContenders = []string{"hybridlimit", "redis_rate"}

// Memory is what one limiter's keys cost in Redis.
type Memory struct {
	Contender string
	Keys      int     // keys written
	Delta     int64   // used_memory after writing them less before
	Key       string  // a sample key
	Usage     int64   // MEMORY USAGE of the sample key, SAMPLES 0
	Encoding  string  // OBJECT ENCODING of the sample key
	Value     string  // its value
	TTL       float64 // its TTL in seconds
}

// PerKey returns the used_memory growth per key.
func (m Memory) PerKey() float64 { return float64(m.Delta) / float64(m.Keys) }

// MeasureMemory flushes every database of the server at addr, which must be
// one the caller started for this, then has the named limiter decide once
// on each of n keys "rate:mem:<i>" (hybridlimit with Prefix "rate:", so
// that the names match redis_rate's), and reports the growth of used_memory
// and the cost of one key. used_memory is read with every client of the
// limiter closed, so that their buffers do not count.
func MeasureMemory(ctx context.Context, addr, name string, n int) (Memory, error) {
	probe := redis.NewClient(&redis.Options{Addr: addr})
	defer probe.Close()
	if err := probe.FlushAll(ctx).Err(); err != nil {
		return Memory{}, err
	}
	// Load the limiter's script (SCRIPT FLUSH is not part of FLUSHALL, but
	// a first run could be) before the baseline.
	if err := decideKeys(ctx, addr, name, []string{"mem:warm"}); err != nil {
		return Memory{}, err
	}
	if err := probe.FlushAll(ctx).Err(); err != nil {
		return Memory{}, err
	}
	if err := waitAlone(ctx, probe); err != nil {
		return Memory{}, err
	}
	before, err := usedMemory(ctx, probe)
	if err != nil {
		return Memory{}, err
	}
	keys := make([]string, n)
	for i := range keys {
		keys[i] = "mem:" + strconv.Itoa(i)
	}
	if err := decideKeys(ctx, addr, name, keys); err != nil {
		return Memory{}, err
	}
	if err := waitAlone(ctx, probe); err != nil {
		return Memory{}, err
	}
	after, err := usedMemory(ctx, probe)
	if err != nil {
		return Memory{}, err
	}
	m := Memory{Contender: name, Keys: n, Delta: after - before, Key: "rate:mem:0"}
	if got, err := probe.DBSize(ctx).Result(); err != nil || got != int64(n) {
		return Memory{}, fmt.Errorf("bench: %s left %d keys of %d (%v)", name, got, n, err)
	}
	if m.Usage, err = probe.MemoryUsage(ctx, m.Key, 0).Result(); err != nil {
		return Memory{}, err
	}
	if m.Encoding, err = probe.ObjectEncoding(ctx, m.Key).Result(); err != nil {
		return Memory{}, err
	}
	if m.Value, err = probe.Get(ctx, m.Key).Result(); err != nil {
		return Memory{}, err
	}
	ttl, err := probe.PTTL(ctx, m.Key).Result()
	if err != nil {
		return Memory{}, err
	}
	m.TTL = ttl.Seconds()
	return m, nil
}

// decideKeys has the named limiter, on a client of its own, decide once on
// each key, from 64 goroutines, and closes the client.
func decideKeys(ctx context.Context, addr, name string, keys []string) error {
	rdb := redis.NewClient(&redis.Options{Addr: addr})
	defer rdb.Close()
	var inst Instance
	switch name {
	case "hybridlimit":
		var err error
		inst, err = OpenHybrid(rdb, "rate:", hybridlimit.Limit{Rate: 100.0 / 3600, Burst: 100})
		if err != nil {
			return err
		}
	case "redis_rate":
		inst = OpenRedisRate(rdb, redis_rate.Limit{Rate: 100, Burst: 100, Period: time.Hour})
	default:
		return fmt.Errorf("bench: no memory measurement for %q", name)
	}
	defer inst.Close()
	const workers = 64
	errs := make([]error, workers)
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for i := w; i < len(keys); i += workers {
				ok, err := inst.Bind(keys[i])(ctx)
				if err == nil && !ok {
					err = fmt.Errorf("bench: %s denied the first decision on %s", name, keys[i])
				}
				if err != nil {
					errs[w] = err
					return
				}
			}
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

// usedMemory returns INFO memory's used_memory.
func usedMemory(ctx context.Context, rdb *redis.Client) (int64, error) {
	info, err := rdb.Info(ctx, "memory").Result()
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(info, "\r\n") {
		if v, ok := strings.CutPrefix(line, "used_memory:"); ok {
			return strconv.ParseInt(v, 10, 64)
		}
	}
	return 0, fmt.Errorf("bench: no used_memory in INFO memory")
}

// waitAlone waits until rdb's connection is the server's only client, so
// that no other client's buffers count in used_memory.
func waitAlone(ctx context.Context, rdb *redis.Client) error {
	deadline := time.Now().Add(5 * time.Second)
	for {
		info, err := rdb.Info(ctx, "clients").Result()
		if err != nil {
			return err
		}
		if strings.Contains(info, "connected_clients:1\r\n") {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("bench: other clients still connected: %s", info)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
