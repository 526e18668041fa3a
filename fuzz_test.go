package hybridlimit

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
)

// FuzzAllowN: any key and n yield a Decision or an error that errors.Is
// one of the sentinels, never a panic. A valid input on a key this limiter
// has never decided is decided by Redis (miniredis) and takes exactly n
// tokens of a fresh bucket. (A key it has decided may be answered from what
// Redis said last, so deleting the key behind its back would not make it
// fresh.)
func FuzzAllowN(f *testing.F) {
	const burst = 100
	m := miniredis.NewMiniRedis()
	if err := m.Start(); err != nil {
		f.Fatal(err)
	}
	f.Cleanup(m.Close)
	c := redis.NewClient(&redis.Options{Addr: m.Addr()})
	f.Cleanup(func() { c.Close() })
	lim, err := New(Config{Redis: c, Limit: PerSecond(burst), Prefix: "fuzz:", Timeout: 5 * time.Second})
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { lim.Close() })

	f.Add([]byte("user:42"), int64(1))
	f.Add([]byte("k"), int64(burst))
	f.Add([]byte("k"), int64(burst+1))
	f.Add([]byte(""), int64(1))
	f.Add([]byte("k"), int64(0))
	f.Add([]byte("k"), int64(-1))
	f.Add([]byte("k"), int64(math.MaxInt64))
	f.Add([]byte("k"), int64(math.MinInt64))
	f.Add([]byte("\x00\xff{tag}\r\n*1\r\n$4\r\nPING\r\n"), int64(3))
	f.Add([]byte(strings.Repeat("k", MaxKeyLen)), int64(7))
	f.Add([]byte(strings.Repeat("k", MaxKeyLen+1)), int64(7))
	f.Add([]byte("ключ 🔑"), int64(50))

	ctx := context.Background()
	seen := map[string]bool{} // keys this limiter has decided
	f.Fuzz(func(t *testing.T, key []byte, n int64) {
		k := string(key)
		valid := len(k) >= 1 && len(k) <= MaxKeyLen && !strings.Contains(k, reservedKeys) && n >= 1 && n <= burst
		fresh := !seen[k]
		if valid {
			seen[k] = true
			if fresh {
				m.Del("fuzz:" + k) // left by an earlier run of the fuzz worker
			}
		}
		d, err := lim.AllowN(ctx, k, n)
		switch {
		case !valid && err == nil:
			t.Fatalf("AllowN(%q, %d) = %+v, nil; want ErrInvalidKey or ErrInvalidN", k, n, d)
		case !valid && !errors.Is(err, ErrInvalidKey) && !errors.Is(err, ErrInvalidN):
			t.Fatalf("AllowN(%q, %d) error = %v; want ErrInvalidKey or ErrInvalidN", k, n, err)
		case !valid && d != (Decision{}):
			t.Fatalf("AllowN(%q, %d) = %+v with error %v; want the zero Decision", k, n, d, err)
		case valid && err != nil:
			t.Fatalf("AllowN(%q, %d) error = %v; want a decision", k, n, err)
		case valid && d.Mode != ModeRemote:
			t.Fatalf("AllowN(%q, %d) = %+v; want decided by Redis", k, n, d)
		case valid && fresh && (!d.Allowed || d.Remaining != burst-n || d.RetryAfter != 0):
			t.Fatalf("AllowN(%q, %d) on a fresh key = %+v; want allowed, Remaining %d", k, n, d, burst-n)
		case valid && !d.Allowed && d.RetryAfter <= 0:
			t.Fatalf("AllowN(%q, %d) = %+v; want RetryAfter > 0 with a denial", k, n, d)
		case valid && (d.Remaining < 0 || d.Remaining > burst):
			t.Fatalf("AllowN(%q, %d) = %+v; want Remaining in [0, %d]", k, n, d, burst)
		}
	})
}

// FuzzNew: any numbers in a Config yield a Limiter or an error wrapping
// ErrInvalidConfig, never a panic; a Limiter then decides one event with
// a nil error, by Redis or by its failure policy.
func FuzzNew(f *testing.F) {
	m := miniredis.NewMiniRedis()
	if err := m.Start(); err != nil {
		f.Fatal(err)
	}
	f.Cleanup(m.Close)
	c := redis.NewClient(&redis.Options{Addr: m.Addr(), MaxRetries: -1, DialerRetries: 1})
	f.Cleanup(func() { c.Close() })

	// rate, burst, instances, timeout, failures, openFor, jitter, probes, maxLocalKeys, onFailure
	f.Add(100.0, int64(100), 3, int64(50*time.Millisecond), 5, int64(time.Second), 0.2, 1, 0, 0)
	f.Add(0.0, int64(0), 0, int64(0), 0, int64(0), 0.0, 0, 0, 0)
	f.Add(1e-3, int64(1000), 1, int64(time.Nanosecond), 1, int64(1), -1.0, 3, 1, 1)
	f.Add(math.Inf(1), int64(1), 1, int64(-1), -1, int64(-1), math.NaN(), -1, -1, 2)
	f.Add(math.NaN(), int64(-1), -1, int64(math.MaxInt64), math.MaxInt32, int64(math.MaxInt64), 10.0, math.MaxInt32, math.MaxInt32, 3)
	f.Add(1.0/(365*86400), int64(1e9), 1<<30, int64(1), 1, int64(1), 11.0, 1, 1, -1)
	f.Add(5e-324, int64(math.MaxInt64), 1, int64(time.Second), 1, int64(time.Hour), 1e-300, 1, 64, 0)
	f.Add(1.7976931348623157e308, int64(1<<53), 7, int64(time.Millisecond), 2, int64(time.Minute), 0.5, 2, 65, 0)

	ctx := context.Background()
	f.Fuzz(func(t *testing.T, rate float64, burst int64, instances int, timeout int64,
		failures int, openFor int64, jitter float64, probes int, maxLocalKeys int, onFailure int) {
		cfg := Config{
			Redis:     c,
			Limit:     Limit{Rate: rate, Burst: burst},
			Instances: instances,
			Prefix:    "fuzz:",
			Timeout:   time.Duration(timeout),
			OnFailure: FailurePolicy(onFailure),
			Breaker: BreakerConfig{Failures: failures, OpenFor: time.Duration(openFor),
				Jitter: jitter, Probes: probes},
			MaxLocalKeys: maxLocalKeys,
		}
		lim, err := New(cfg)
		if err != nil {
			if lim != nil || !errors.Is(err, ErrInvalidConfig) {
				t.Fatalf("New(%+v) = %v, %v; want nil and an error wrapping ErrInvalidConfig", cfg, lim, err)
			}
			return
		}
		defer lim.Close()
		if lim == nil {
			t.Fatalf("New(%+v) = nil, nil", cfg)
		}
		if maxLocalKeys > 1<<20 {
			return // a decision would be fine, but this config is not worth the time
		}
		policy := map[FailurePolicy]Mode{FailLocal: ModeLocal, FailOpen: ModeFailOpen, FailClosed: ModeFailClosed}[cfg.OnFailure]
		// Each call on its own key: a limiter may answer a key it has
		// decided from what Redis said last.
		for i, n := range []int64{1, burst} {
			key := fmt.Sprintf("k%d", i)
			m.Del("fuzz:" + key)
			d, err := lim.AllowN(ctx, key, n)
			if err != nil {
				t.Fatalf("New(%+v).AllowN(%s, %d) error = %v; want a decision", cfg, key, n, err)
			}
			if d.Mode != ModeRemote && d.Mode != policy {
				t.Fatalf("New(%+v).AllowN(%s, %d) = %+v; want mode remote or %v", cfg, key, n, d, policy)
			}
			if d.Mode == ModeRemote && (!d.Allowed || d.Remaining != burst-n) {
				t.Fatalf("New(%+v).AllowN(%s, %d) on a fresh key = %+v; want allowed, Remaining %d", cfg, key, n, d, burst-n)
			}
		}
	})
}
