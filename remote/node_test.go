package remote

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/hybridlimit/hybridlimit/internal/redistest"
)

// eventually waits, in real time (the check runs against a real
// redis-server, in the background), until cond holds.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for end := time.Now().Add(5 * time.Second); !cond(); {
		if time.Now().After(end) {
			t.Fatalf("%s: not within 5s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestFunctions: on redis-server 7 a Pipe checks, after its first answer,
// that the node runs functions, and from then on calls FCALL; after
// FUNCTION FLUSH a call still succeeds (sent again by EVAL) and the
// library is loaded again. Another version's library, as in a rolling
// deploy, is never replaced.
func TestFunctions(t *testing.T) {
	srv := redistest.Start(t)
	c := srv.Client(t)
	ctx := context.Background()
	key := "{" + t.Name() + "}:k"
	lim := mustLimit(t, 1000, 1000)
	p := NewPipe(c, 0, nil)
	defer p.Close()

	other := newLibrary("-- another version\n"+takeScript.src, fleetScript.src)
	if other.name == library.name || other.take == library.take {
		t.Fatalf("two versions share the name %s", other.name)
	}
	if err := c.FunctionLoad(ctx, other.src).Err(); err != nil {
		t.Fatalf("FUNCTION LOAD of another version: %v", err)
	}

	take := func(what string) {
		t.Helper()
		if res, err := p.Take(ctx, key, lim, 1); err != nil || !res.Allowed {
			t.Fatalf("%s: Take = %+v, %v; want allowed", what, res, err)
		}
	}
	take("first")
	eventually(t, "FCALL after the first answer", p.Node().Functions)
	fcalls, evalshas := srv.Calls(t, "fcall"), srv.Calls(t, "evalsha")
	for range 20 {
		take("by FCALL")
	}
	if got := srv.Calls(t, "fcall") - fcalls; got != 20 {
		t.Errorf("FCALL calls = %d; want 20", got)
	}
	if got := srv.Calls(t, "evalsha") - evalshas; got != 0 {
		t.Errorf("EVALSHA calls = %d; want 0", got)
	}

	srv.Do(t, "FUNCTION", "FLUSH")
	take("after FUNCTION FLUSH")
	eventually(t, "FCALL after the library was loaded again", p.Node().Functions)
	take("by FCALL again")
	libs := srv.Do(t, "FUNCTION", "LIST").([]any)
	if len(libs) != 1 || !strings.Contains(listed(libs), library.name) {
		t.Errorf("FUNCTION LIST after FLUSH = %v; want %s", listed(libs), library.name)
	}
	if err := c.FunctionLoad(ctx, other.src).Err(); err != nil {
		t.Fatalf("FUNCTION LOAD of another version: %v", err)
	}
	if err := Load(ctx, c); err != nil {
		t.Fatalf("Load = %v", err)
	}
	if got := listed(srv.Do(t, "FUNCTION", "LIST").([]any)); !strings.Contains(got, library.name) || !strings.Contains(got, other.name) {
		t.Errorf("FUNCTION LIST = %v; want both versions", got)
	}
}

func listed(libs []any) string {
	var b strings.Builder
	for _, l := range libs {
		if m, ok := l.(map[any]any); ok {
			b.WriteString(" " + m["library_name"].(string))
			continue
		}
		if a, ok := l.([]any); ok && len(a) > 1 {
			b.WriteString(" " + a[1].(string))
		}
	}
	return b.String()
}

// TestFunctionsFailover: a library loaded on a master is on its replica,
// which after a failover answers FCALL without being loaded again.
func TestFunctionsFailover(t *testing.T) {
	master, replica := redistest.StartReplicated(t)
	ctx := context.Background()
	key := "{" + t.Name() + "}:k"
	lim := mustLimit(t, 1000, 1000)
	if err := Load(ctx, master.Client(t)); err != nil {
		t.Fatal(err)
	}
	master.Do(t, "WAIT", 1, 5000)
	replica.Do(t, "REPLICAOF", "NO", "ONE")
	var n Node
	n.setFunctions(fnYes) // what a Pipe to the master learned
	p := NewPipe(replica.Client(t), 0, &n)
	defer p.Close()
	if res, err := p.Take(ctx, key, lim, 1); err != nil || !res.Allowed {
		t.Fatalf("Take on the promoted replica = %+v, %v; want allowed", res, err)
	}
	if f, e := replica.Calls(t, "fcall"), replica.Calls(t, "eval"); f != 1 || e != 0 {
		t.Errorf("promoted replica ran %d FCALL, %d EVAL; want 1 and 0", f, e)
	}
}

// TestNoFunctions: miniredis has no functions; its node learns so off the
// decisions' path and stays on EVALSHA, and nothing fails meanwhile.
func TestNoFunctions(t *testing.T) {
	_, p := newMini(t)
	lim := mustLimit(t, 1, 10)
	for i := range 5 {
		if res, err := p.Take(context.Background(), "k", lim, 1); err != nil || !res.Allowed {
			t.Fatalf("Take %d = %+v, %v; want allowed", i, res, err)
		}
	}
	eventually(t, "functions found missing", func() bool { return p.Node().state.Load()&fnMask == fnNo })
}

// TestTimeRefused: a Redis that refuses TIME in scripts (a hook answers
// as ElastiCache Serverless does) gets Redis's clock as an argument from
// the first call on: that call is sent again once, the refusal is logged
// once, every request kind works, and the time the script used is Redis's
// within the round trip, however far the instance's clock is off.
func TestTimeRefused(t *testing.T) {
	srv := redistest.Start(t)
	c := srv.Client(t)
	var hook redistest.NoScriptTime
	c.AddHook(&hook)
	var logs bytes.Buffer
	// The instance's clock is 300 ms ahead: the time passed is Redis's
	// all the same.
	n := &Node{Name: "n", Log: slog.New(slog.NewTextHandler(&logs, nil)),
		Now: func() time.Time { return time.Now().Add(300 * time.Millisecond) }}
	p := NewPipe(c, 0, n)
	defer p.Close()
	ctx := context.Background()
	key := "{" + t.Name() + "}:k"
	lim := mustLimit(t, 10, 10)

	for i, r := range []Request{
		{Key: key, Limit: lim, Units: lim.Units(1)},
		{Key: key, Limit: lim, Units: lim.Units(1), Lease: 2},
		{Key: key, Limit: lim, Units: lim.Units(1), Reserve: lim.Units(5)},
		{Key: key, Limit: lim, Units: lim.Units(1), Charge: true},
		{Key: key, Limit: lim, Units: lim.Units(1), Charge: true, Once: "x"},
		{Key: key, Limit: lim, Peek: true},
		{Key: key, Limit: lim, Reset: true},
		{Key: key, Limit: lim, Units: -lim.Units(1)},
	} {
		res, err := p.Do(ctx, r)
		if err != nil || !res.Allowed {
			t.Fatalf("request %d %+v = %+v, %v; want allowed", i, r, res, err)
		}
		tm, err := c.Time(ctx).Result()
		if err != nil {
			t.Fatal(err)
		}
		// The clock passed may be ahead of Redis's by the error of its
		// reading, half a round trip.
		if d := time.Duration(tm.UnixMicro()-res.Now) * time.Microsecond; d < -n.ClockError()-time.Millisecond || d > 100*time.Millisecond {
			t.Errorf("request %d ran at Redis time %v before TIME; want within [-%v-1ms, 100ms]", i, d, n.ClockError())
		}
	}
	if !n.ClientTime() || n.ClockError() < 0 {
		t.Errorf("node ClientTime %v, ClockError %v; want true and a reading", n.ClientTime(), n.ClockError())
	}
	if got := hook.Refused.Load(); got != 1 {
		t.Errorf("refused %d script calls; want 1, the first", got)
	}
	if got := strings.Count(logs.String(), "refuses TIME"); got != 1 {
		t.Errorf("logged the refusal %d times; want once:\n%s", got, logs.String())
	}

	// The heartbeat too, on a Node of its own.
	hn := &Node{}
	now := time.Now().UnixMilli()
	b := []Beat{{Base: "{" + t.Name() + "}:fleet", Window: now / 1000, Offered: 5, Every: time.Second}}
	Beats(ctx, c, hn, b)
	if b[0].Err != nil || !b[0].Heartbeat.Taken || !hn.ClientTime() {
		t.Errorf("heartbeat = %+v, %v, ClientTime %v; want taken with Redis's clock passed", b[0].Heartbeat, b[0].Err, hn.ClientTime())
	}
}

// TestTimeRefusedBatch: a pipeline of calls refused together is sent
// again together, once.
func TestTimeRefusedBatch(t *testing.T) {
	srv := redistest.Start(t)
	c := redis.NewClient(&redis.Options{Addr: srv.Addr()})
	defer c.Close()
	var hook redistest.NoScriptTime
	c.AddHook(&hook)
	p := NewPipe(c, 1, nil)
	defer p.Close()
	lim := mustLimit(t, 1, 1000)
	ctx := context.Background()
	errs := make(chan error, 50)
	for i := range 50 {
		go func() {
			_, err := p.Take(ctx, "{"+t.Name()+"}:k"+string(rune('a'+i%10)), lim, 1)
			errs <- err
		}()
	}
	for range 50 {
		if err := <-errs; err != nil {
			t.Errorf("Take = %v", err)
		}
	}
	if !p.Node().ClientTime() {
		t.Errorf("ClientTime false after refusals")
	}
}
