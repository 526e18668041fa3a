package remote

import (
	"context"
	"encoding/binary"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/hybridlimit/hybridlimit/internal/redistest"
)

// encode is the bucket value as tokenbucket.lua documents it: a format
// byte, then level, time and p as 7-byte big-endian integers.
func encode(level, now, p int64) string {
	b := []byte{1}
	for _, v := range []int64{level, now, p} {
		var w [8]byte
		binary.BigEndian.PutUint64(w[:], uint64(v))
		b = append(b, w[1:]...)
	}
	return string(b)
}

// TestValueFormat checks that real Redis (struct.pack) and miniredis (the
// script's plain-Lua codec) write the same bytes, the documented ones, and
// read each other's values: the tests and the demo run on the one, users
// on the other.
func TestValueFormat(t *testing.T) {
	srv := redistest.Start(t)
	real := srv.Client(t)
	rp := NewPipe(real, 2, nil)
	defer rp.Close()
	m, mp := newMini(t)
	// miniredis's clock in 2100: a value it writes is in Redis's future,
	// so that Redis, reading it, refills nothing.
	later := time.Date(2100, 1, 1, 0, 0, 0, 0, time.UTC)
	m.SetTime(later)
	mini := redis.NewClient(&redis.Options{Addr: m.Addr()})
	defer mini.Close()
	ctx := context.Background()

	for _, tc := range []struct {
		name  string
		rate  float64
		burst int64
		n     int64
	}{
		{"per second", 100, 100, 3},
		{"one a year", 1.0 / (365 * 24 * 3600), 100, 1}, // p = 31,536,000,000,000: 6 bytes of 7
		{"a million a second", 1e6, 1e9, 999_999_999},
	} {
		lim := mustLimit(t, tc.rate, tc.burst)
		key := "fmt:" + tc.name
		left := (tc.burst - tc.n) * lim.P

		// Both write the documented bytes.
		res, err := rp.Take(ctx, key, lim, tc.n)
		if err != nil || !res.Allowed || res.Level != left {
			t.Fatalf("%s: Take on Redis = %+v, %v; want allowed, level %d", tc.name, res, err, left)
		}
		fromReal, err := real.Get(ctx, key).Result()
		if want := encode(left, res.Now, lim.P); err != nil || fromReal != want {
			t.Errorf("%s: value on Redis = %q, %v; want %q", tc.name, fromReal, err, want)
		}
		res, err = mp.Take(ctx, key, lim, tc.n)
		if err != nil || !res.Allowed || res.Level != left {
			t.Fatalf("%s: Take on miniredis = %+v, %v; want allowed, level %d", tc.name, res, err, left)
		}
		fromMini, err := mini.Get(ctx, key).Result()
		if want := encode(left, later.UnixMicro(), lim.P); err != nil || fromMini != want {
			t.Errorf("%s: value on miniredis = %q, %v; want %q", tc.name, fromMini, err, want)
		}

		// Each reads the other's: a charge of 0 returns the stored level,
		// refilled for the time since it was written (none on Redis, whose
		// clock is before 2100; on miniredis a known 10 ms).
		if err := real.Set(ctx, key, fromMini, time.Minute).Err(); err != nil {
			t.Fatal(err)
		}
		res, err = rp.Charge(ctx, key, lim, 0)
		if err != nil || res.Repaired || res.Level != left {
			t.Errorf("%s: Redis reading miniredis's value = %+v, %v; want level %d", tc.name, res, err, left)
		}
		m.Set(key, encode(left, later.Add(-10*time.Millisecond).UnixMicro(), lim.P))
		want := min(left+10_000*lim.Q, lim.Cap())
		res, err = mp.Charge(ctx, key, lim, 0)
		if err != nil || res.Repaired || res.Level != want {
			t.Errorf("%s: miniredis reading a value 10 ms old = %+v, %v; want level %d", tc.name, res, err, want)
		}
		m.Set(key, fromReal)
		res, err = mp.Charge(ctx, key, lim, 0)
		if want := min(left+(later.UnixMicro()-mustNow(t, fromReal))*lim.Q, lim.Cap()); err != nil || res.Repaired || res.Level != want {
			t.Errorf("%s: miniredis reading Redis's value = %+v, %v; want level %d", tc.name, res, err, want)
		}
	}
}

// mustNow returns the time field of a bucket value.
func mustNow(t *testing.T, v string) int64 {
	t.Helper()
	if len(v) != 22 {
		t.Fatalf("value %q is not 22 bytes", v)
	}
	var w [8]byte
	copy(w[1:], v[8:15])
	return int64(binary.BigEndian.Uint64(w[:]))
}
