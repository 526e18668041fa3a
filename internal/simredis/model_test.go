package simredis

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"reflect"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/hybridlimit/hybridlimit/internal/redistest"
	"github.com/hybridlimit/hybridlimit/lua"
	"github.com/hybridlimit/hybridlimit/remote"
)

// TestModelMatchesRedis runs random calls of lua/tokenbucket.lua on a real
// redis-server and the same calls on the model, at the Redis TIME the real
// script read, and wants the same reply, the same stored bytes and the
// same expiry (to the slack of Redis's clock beside the TIME the script read).
// Values are planted now and then on both: a bucket written in the future
// (a clock that went back), one under another P, one of a foreign shape.
func TestModelMatchesRedis(t *testing.T) {
	srv := redistest.Start(t)
	c := srv.Client(t)
	ctx := context.Background()
	if err := c.ScriptLoad(ctx, lua.TokenBucket).Err(); err != nil {
		t.Fatal(err)
	}
	m := New()
	rng := rand.New(rand.NewPCG(1, 2))
	var limits []remote.Limit
	for _, l := range []struct {
		rate  float64
		burst int64
	}{{1, 1}, {10, 10}, {100, 100}, {5.0 / 60, 5}, {1000.0 / 60, 1000}, {1.0 / 3, 7}, {1e6, 3}, {0.001, 1000}, {250, 17}, {7, 7}, {3, 1}} {
		rl, err := remote.NewLimit(l.rate, l.burst)
		if err != nil {
			t.Fatal(err)
		}
		limits = append(limits, rl)
	}
	keys := []string{"sim:a", "sim:b", "sim:c"}
	for _, k := range keys {
		c.Del(ctx, k)
	}
	for i := range 3000 {
		key := keys[rng.IntN(len(keys))]
		rl := limits[rng.IntN(len(limits))]
		switch rng.IntN(20) {
		case 0: // a bucket written 0-5 s in the future: TIME went back
			us := time.Now().UnixMicro() + rng.Int64N(5e6)
			raw := pack(float64(rng.Int64N(rl.Cap()+1)), float64(us), float64(rl.P))
			plant(t, c, m, key, raw)
		case 3: // an empty bucket stored in the future: a debt, or a clock that went back on one
			us := time.Now().UnixMicro() + rng.Int64N(5e6)
			plant(t, c, m, key, pack(0, float64(us), float64(rl.P)))
		case 1: // a bucket under another limit
			o := limits[rng.IntN(len(limits))]
			raw := pack(float64(rng.Int64N(o.Cap()+1)), float64(time.Now().UnixMicro()-rng.Int64N(2e6)), float64(o.P))
			plant(t, c, m, key, raw)
		case 2: // a foreign value
			plant(t, c, m, key, []byte("not a bucket "+strconv.Itoa(i)))
		}
		cost := rl.Units(rng.Int64N(rl.Burst+2) - 1)
		argv := []any{rl.Q, rl.P, rl.Cap(), cost}
		switch rng.IntN(12) {
		case 9, 10: // a look that must take and write nothing
			argv = append(argv[:3], int64(0), "peek")
		case 11: // an operator's reset
			argv = append(argv[:3], int64(0), "reset")
		case 8: // a reservation, into debt up to three bursts deep
			argv = append(argv, "reserve", rng.Int64N(3*rl.Cap()+1))
		case 0: // a charge, up to two bursts: into debt and past its floor
			argv = append(argv, "charge")
			argv[3] = rng.Int64N(2*rl.Cap() + 1)
		case 1:
			argv = append(argv, "lease", rl.P*rng.Int64N(rl.Burst+1))
		case 2: // a large refund, in debt or not
			argv[3] = -rng.Int64N(rl.Cap() + 1)
		case 4: // a charge applied at most once, sent twice
			once := remote.OnceKey(key, strconv.Itoa(i))
			ch := []any{rl.Q, rl.P, rl.Cap(), rng.Int64N(2*rl.Cap() + 1), "charge", int64(1000 + rng.IntN(1000))}
			call(t, c, m, i, key, once, ch)
			call(t, c, m, i, key, once, ch)
			continue
		case 5, 6: // a reservation given back: while it is the last change, after another, or with a stale due
			res := []any{rl.Q, rl.P, rl.Cap(), rl.Units(1), "reserve", 3 * rl.Cap()}
			call(t, c, m, i, key, "", res)
			due := int64(0)
			if raw, err := c.Get(ctx, key).Bytes(); err == nil {
				if _, l, st, _, ok := unpack(raw); ok && l == 0 {
					due = int64(st)
				}
			}
			switch rng.IntN(4) {
			case 0:
				call(t, c, m, i, key, "", res)
			case 1:
				due--
			}
			argv = []any{rl.Q, rl.P, rl.Cap(), rl.Units(1), "unreserve", due}
		case 3: // a charge, then a denial under a larger burst at the same P: the TTL follows the limit
			ch := []any{rl.Q, rl.P, rl.Cap(), rl.Cap(), "charge"}
			call(t, c, m, i, key, "", ch)
			big := remote.Limit{Q: rl.Q, P: rl.P, Burst: rl.Burst*4 + 1}
			argv = []any{big.Q, big.P, big.Cap(), big.Cap()}
		}
		call(t, c, m, i, key, "", argv)
	}
}

// call runs the bucket script with argv at key on the real server and on
// the model, at the TIME the real script read, and fails unless the reply,
// the stored bytes and the TTL are the same.
func call(t *testing.T, c *redis.Client, m *Server, i int, key, once string, argv []any) {
	t.Helper()
	ctx := context.Background()
	{
		keys := []string{key}
		if once != "" {
			keys = append(keys, once)
		}
		got, err := c.EvalSha(ctx, bucketSHA, keys, argv...).Result()
		if err != nil {
			t.Fatalf("call %d: EVALSHA: %v", i, err)
		}
		realVals, ok := got.([]any)
		if !ok || len(realVals) < 3 {
			t.Fatalf("call %d: reply %v", i, got)
		}
		now, _ := realVals[2].(int64)
		sargs := make([]string, len(argv))
		for j, a := range argv {
			switch a := a.(type) {
			case int64:
				sargs[j] = strconv.FormatInt(a, 10)
			case string:
				sargs[j] = a
			}
		}
		at := time.UnixMicro(now)
		m.mu.Lock()
		want := m.bucket(at, key, once, sargs)
		m.mu.Unlock()
		if !reflect.DeepEqual(want, got) {
			t.Fatalf("call %d %s %v: model %v, redis %v", i, key, argv, want, got)
		}
		raw, err := c.Get(ctx, key).Bytes()
		v := m.get(at, key)
		if errors.Is(err, redis.Nil) && v == nil {
			return // a denial on a missing key: nothing stored on either
		}
		if err != nil {
			t.Fatalf("call %d: GET: %v", i, err)
		}
		if v == nil || !bytes.Equal(v.s, raw) {
			t.Fatalf("call %d %s %v: model stored %v, redis %x", i, key, argv, v, raw)
		}
		// The expiry as Redis stored it, absolute: a PTTL is counted from
		// Redis's cached clock when PTTL runs, which lags TIME by as long
		// as the process went unscheduled after it last read the clock (a
		// PTTL 5 ms longer than the model's TTL at the script's TIME, on a
		// busy machine). SET ... PX counts from Redis's clock when the SET
		// runs, which the script's TIME may precede (the script was
		// descheduled between them: 2 ms in a CI run beside other work)
		// or follow (a cached clock): either way by what a busy machine
		// delays a process, which the model, at TIME, cannot know.
		pexp, err := c.Do(ctx, "PEXPIRETIME", key).Int64()
		if err != nil {
			t.Fatalf("call %d: PEXPIRETIME %s: %v", i, key, err)
		}
		if d := v.expire.UnixMilli() - pexp; d < -100 || d > 100 {
			t.Fatalf("call %d %s %v: model expires at %d ms, redis at %d (%d ms apart)", i, key, argv, v.expire.UnixMilli(), pexp, d)
		}
	}
}

// plant stores raw at key on the real server and in the model, with a TTL
// that outlives the test.
func plant(t *testing.T, c *redis.Client, m *Server, key string, raw []byte) {
	t.Helper()
	if err := c.Set(context.Background(), key, raw, time.Hour).Err(); err != nil {
		t.Fatal(err)
	}
	m.mu.Lock()
	m.data[key] = &value{s: raw, expire: time.Now().Add(time.Hour)}
	m.mu.Unlock()
}

// TestFleetModelMatchesRedis runs random heartbeats of lua/fleet.lua on a
// real redis-server and the same on the model, at the time the real script
// read (TIME, or the client's clock passed as ARGV[8]), and wants the same
// reply, the same hashes and the same expiry (to the slack of the real
// clock between the call and PEXPIRETIME's reading).
func TestFleetModelMatchesRedis(t *testing.T) {
	srv := redistest.Start(t)
	c := srv.Client(t)
	ctx := context.Background()
	if err := c.ScriptLoad(ctx, lua.Fleet).Err(); err != nil {
		t.Fatal(err)
	}
	m := New()
	rng := rand.New(rand.NewPCG(3, 4))
	const tag = "{sim:f}:"
	var befores, sums, refused int // replies with window i-1's reading, with its sum; calls refused
	var marked, kept int           // counted instances given a ticket for a sum of another mark; not given one
	var heldAcross int             // calls whose keys expired between the script's start and its TIME
	for i := range 3000 {
		w := []int64{50, 200, 1000}[rng.IntN(3)]
		now := time.Now()
		passed := rng.IntN(4) == 0 // the client's clock, where TIME is refused in scripts
		if passed {
			now = now.Add(time.Duration(rng.Int64N(int64(2*time.Second))) - time.Second)
		}
		r := now.UnixMilli() / w
		j := r + rng.Int64N(6) - 4 // too late, in time, or from a clock ahead
		rd := r - rng.Int64N(6)    // not closed yet, or closed
		report := (rng.Int64N(1000) << 20) + 1
		want := rng.IntN(8) // tickets, and window rd-1 too
		keys := []string{tag + strconv.FormatInt(j, 10), tag + strconv.FormatInt(rd, 10)}
		// Window rd-1's key when asked for (but now and then not: an
		// error, as it is without), and now and then when not.
		if want >= 2 && rng.IntN(10) > 0 || want < 2 && rng.IntN(4) == 0 {
			keys = append(keys, tag+strconv.FormatInt(rd-1, 10))
		}
		// The marks this instance's reports were taken under: random
		// ones mostly differ from the sums', and then get a ticket.
		marks := [2]int64{}
		for k, rw := range []int64{rd, rd - 1} {
			switch rng.IntN(3) {
			case 0:
				marks[k] = rng.Int64N(1024)
			case 1: // the hash's own
				if m, err := c.HGet(ctx, tag+strconv.FormatInt(rw, 10), "#m").Int64(); err == nil {
					marks[k] = m
				}
			}
		}
		if rng.IntN(10) == 0 {
			// A hash begun by a version without marks: no '#m' yet.
			unmark(t, c, m, keys[0])
		}
		argv := []string{strconv.FormatInt(j, 10), strconv.FormatInt(report, 10), strconv.FormatInt(rd, 10), strconv.FormatInt(w, 10), strconv.Itoa(want),
			strconv.FormatInt(marks[0], 10), strconv.FormatInt(marks[1], 10)}
		if passed {
			argv = append(argv, strconv.FormatInt(now.UnixMicro(), 10))
		}
		args := make([]any, len(argv))
		for k, a := range argv {
			args[k] = a
		}
		// TIME beside the script, in one transaction: the server's clock
		// when it ran, for the model's expiries (a script reads the
		// clock once, in milliseconds, and expires keys by it).
		tx := c.TxPipeline()
		clock := tx.Time(ctx)
		eval := tx.EvalSha(ctx, fleetSHA, keys, args...)
		if want >= 2 && len(keys) == 2 {
			_, _ = tx.Exec(ctx)
			m.mu.Lock()
			model := m.fleet(time.Now(), keys[0], keys[1], "", argv)
			m.mu.Unlock()
			if err := eval.Err(); err == nil || fmt.Sprint(model) != err.Error() {
				t.Fatalf("call %d %v %v without window rd-1's key: model %v, redis %v", i, keys, argv, model, err)
			}
			refused++
			continue
		}
		if _, err := tx.Exec(ctx); err != nil {
			t.Fatalf("call %d: EVALSHA: %v", i, err)
		}
		got := eval.Val()
		vals, ok := got.([]any)
		if !ok || len(vals) != 4 && len(vals) != 6 {
			t.Fatalf("call %d: reply %v", i, got)
		}
		if len(vals) == 6 {
			befores++
			if vals[4] != int64(0) {
				sums++
			}
		}
		if want%2 == 0 && vals[2] != int64(0) {
			if vals[3] != int64(0) {
				marked++
			} else {
				kept++
			}
		}
		at := time.UnixMilli(clock.Val().UnixMilli())
		if !passed {
			ms, _ := vals[0].(int64)
			at = time.UnixMilli(ms) // the script's own reading
		}
		before := ""
		if len(keys) == 3 {
			before = keys[2]
		}
		m.mu.Lock()
		saved := saveKeys(m, keys)
		model := m.fleet(at, keys[0], keys[1], before, argv)
		if !passed && !reflect.DeepEqual(model, got) {
			// Redis expires keys by the time the script started, which
			// the transaction's TIME before it and the script's own
			// reading bound: they are a few milliseconds apart when the
			// server was held between them (a loaded machine), and a key
			// whose expiry fell in between was still there for Redis.
			restoreKeys(m, saved)
			model = m.fleetAt(at, time.UnixMilli(clock.Val().UnixMilli()), keys[0], keys[1], before, argv)
			heldAcross++
		}
		m.mu.Unlock()
		if !reflect.DeepEqual(model, got) {
			t.Fatalf("call %d %v %v: model %v, redis %v (TIME before the script %d ms)", i, keys, argv, model, got, clock.Val().UnixMilli())
		}
		for _, k := range keys {
			m.mu.Lock()
			v := m.get(at, k)
			mh := map[string]string{}
			var exp time.Time
			if v != nil {
				for f := 0; f < len(v.fields); f += 2 {
					mh[v.fields[f]] = v.fields[f+1]
				}
				exp = v.expire
			}
			m.mu.Unlock()
			h, err := c.HGetAll(ctx, k).Result()
			if err != nil {
				t.Fatalf("call %d: HGETALL %s: %v", i, k, err)
			}
			if len(h) == 0 && len(mh) > 0 && exp.UnixMilli() < time.Now().UnixMilli() {
				continue // it expired on the real clock since the call
			}
			if !reflect.DeepEqual(mh, h) {
				t.Fatalf("call %d %s: model holds %v, redis %v", i, k, mh, h)
			}
			if len(h) == 0 {
				continue
			}
			pexp, err := c.Do(ctx, "PEXPIRETIME", k).Int64()
			if err != nil {
				t.Fatalf("call %d: PEXPIRETIME %s: %v", i, k, err)
			}
			if pexp == -2 {
				continue // it expired since HGETALL
			}
			if exp.UnixMilli() != pexp {
				t.Fatalf("call %d %s: model expires at %d ms, redis at %d", i, k, exp.UnixMilli(), pexp)
			}
		}
	}
	t.Logf("%d of 3000 calls had a key expire between the script's start and its reading of TIME", heldAcross)
	// The random calls must have met window i-1's reading, with and
	// without a sum, for the comparison to say anything of it.
	if befores < 100 || sums < 50 || refused < 20 {
		t.Errorf("%d replies read window i-1, %d of them with a sum, %d calls refused; want at least 100, 50 and 20", befores, sums, refused)
	}
	if marked < 50 || kept < 50 {
		t.Errorf("of the counted instances' reads, %d got a ticket (a sum of another mark) and %d none; want at least 50 each", marked, kept)
	}
}

// saveKeys returns copies of m's values at keys (nil where none), for
// restoreKeys. m.mu must be held.
func saveKeys(m *Server, keys []string) map[string]*value {
	saved := map[string]*value{}
	for _, k := range keys {
		if v := m.data[k]; v != nil {
			c := *v
			c.s = slices.Clone(v.s)
			c.fields = slices.Clone(v.fields)
			saved[k] = &c
		} else {
			saved[k] = nil
		}
	}
	return saved
}

// restoreKeys puts back in m what saveKeys saved. m.mu must be held.
func restoreKeys(m *Server, saved map[string]*value) {
	for k, v := range saved {
		if v == nil {
			delete(m.data, k)
		} else {
			m.data[k] = v
		}
	}
}

// unmark deletes the mark of the hash at key, on redis-server and on m.
func unmark(t *testing.T, c *redis.Client, m *Server, key string) {
	t.Helper()
	if err := c.HDel(context.Background(), key, "#m").Err(); err != nil {
		t.Fatal(err)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if v := m.data[key]; v != nil {
		for k := 0; k < len(v.fields); k += 2 {
			if v.fields[k] == "#m" {
				v.fields = append(v.fields[:k], v.fields[k+2:]...)
				break
			}
		}
	}
}

// TestFleetExpiryAtNow: a window's first report whose expiry, (j+6)×w, is
// the server's clock to the millisecond (the window was read by a client
// clock ahead of it) leaves no hash: Redis's PEXPIREAT deletes a key at
// once when its time is not after the clock, where a key that has merely
// reached its time is expired only once the clock is after it.
func TestFleetExpiryAtNow(t *testing.T) {
	m := New()
	const w, j = 50, 100
	at := time.UnixMilli((j + 6) * w) // the server's clock
	client := time.UnixMilli(j * w)   // the client's, passed as ARGV[8]
	argv := []string{"100", strconv.FormatInt(1<<20+1, 10), "90", "50", "0", "0", "0", strconv.FormatInt(client.UnixMicro(), 10)}
	m.mu.Lock()
	reply := m.fleet(at, "{f}:100", "{f}:90", "", argv)
	v := m.get(at, "{f}:100")
	m.mu.Unlock()
	if vals, _ := reply.([]any); len(vals) != 4 || vals[1] == int64(0) {
		t.Fatalf("reply %v; want the report taken", reply)
	}
	if v != nil {
		t.Errorf("the window's hash is there, expiring at %v, the clock; want it deleted", v.expire)
	}
}
