package main

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/hybridlimit/hybridlimit"
	"github.com/hybridlimit/hybridlimit/internal/redistest"
)

// TestRun runs a short demo, Redis cut off from 3s to 4s, and checks that
// Redis decided in the second before the outage and each strategy's
// fallback during it, and that run stopped everything it started.
//
// The measured run uses a real redis-server. The embedded one runs every
// script in a fresh Lua state inside the test process: under -race a
// decision took 4ms on average there, up to 41ms, on a quiet 2-core
// machine, so one stall of the process on a busy one was enough for five
// decisions in a row to miss the 50ms budget and open every breaker for a
// second while Redis was up. That is what a breaker is for, and not what
// this test is about. The default, embedded, path runs first, as a
// warm-up of the same shape: the process's heap grows to its size once,
// so that the measured run does not pay the race detector's first touch of
// every new page of it. Under load its decisions may all go to the
// fallback, so only its shape is checked; TestServe checks that the
// embedded Redis decides.
func TestRun(t *testing.T) {
	srv := redistest.Start(t) // its goroutines end at cleanup, after the leak check
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	warm, err := run(context.Background(), options{duration: 2 * time.Second, outageStart: 2 * time.Second,
		outageEnd: 2 * time.Second, rate: 200, limit: 100, heartbeat: 200 * time.Millisecond}, io.Discard)
	if err != nil {
		t.Fatalf("warm-up run on the embedded Redis: %v", err)
	}
	for i, st := range strategies {
		if len(warm[i]) != 2 {
			t.Fatalf("%s, warm-up run on the embedded Redis: %d seconds; want 2", st.name, len(warm[i]))
		}
		for s, sec := range warm[i] {
			if sec.Total() == 0 || sec.Errors != 0 {
				t.Errorf("%s, warm-up run on the embedded Redis, second %d: %d decisions, %d errors; want some, and no error",
					st.name, s, sec.Total(), sec.Errors)
			}
		}
	}
	var out strings.Builder
	got, err := run(context.Background(), options{
		redis:       srv.Addr(),
		duration:    5 * time.Second,
		outageStart: 3 * time.Second,
		outageEnd:   4 * time.Second,
		rate:        200,
		limit:       100,
		heartbeat:   200 * time.Millisecond,
	}, &out)
	if err != nil {
		t.Fatalf("run: %v", err)
	}
	t.Logf("\n%s", out.String())
	for _, want := range []string{"second  redis  strategy", "max in 3-4"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("output has no %q", want)
		}
	}
	for i, st := range strategies {
		secs := got[i]
		if len(secs) != 5 {
			t.Fatalf("%s: %d seconds; want 5", st.name, len(secs))
		}
		before, during := secs[2], secs[3]
		// A machine busy enough to make a decision overrun 50ms now and
		// then may send a few to the fallback even while Redis is up.
		if before.Total() < 100 || before.Modes["remote"] < before.Total()/2 {
			t.Errorf("%s, second 2-3 (Redis up): %d decisions, modes %v; want 100 or more, mostly remote",
				st.name, before.Total(), before.Modes)
		}
		if during.Total() < 100 || during.Modes[st.mode] < during.Total()*9/10 {
			t.Errorf("%s, second 3-4 (Redis cut off): %d decisions, modes %v; want 100 or more, nearly all %s",
				st.name, during.Total(), during.Modes, st.mode)
		}
		if during.Errors != 0 {
			t.Errorf("%s, second 3-4: %d errors; want none (Redis failures are not errors)", st.name, during.Errors)
		}
		if st.policy == hybridlimit.FailClosed && during.Allowed > 5 {
			t.Errorf("FailClosed allowed %d while Redis was cut off; want (nearly) none", during.Allowed)
		}
	}
}

func TestRunRejectsBadOptions(t *testing.T) {
	for _, o := range []options{
		{duration: 0, rate: 1, limit: 1},
		{duration: time.Second, rate: 0, limit: 1},
		{duration: time.Second, rate: 1, limit: 0},
		{duration: time.Second, rate: 1, limit: 1, outageStart: 2 * time.Second, outageEnd: time.Second},
	} {
		if _, err := run(context.Background(), o, &strings.Builder{}); err == nil {
			t.Errorf("run(%+v) = nil error; want one", o)
		}
	}
}

// TestServe runs the -serve mode's handler: past the limit it answers 429
// with Retry-After and the RateLimit fields; with the outage switched on,
// every response is marked degraded and none is a 5xx; switched off, Redis
// decides again.
func TestServe(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	s, err := newService(context.Background(), "", slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatalf("newService: %v", err)
	}
	defer s.Close()
	ts := httptest.NewServer(s.Handler())
	defer ts.Close()

	do := func(method, path string, header ...string) (*http.Response, string) {
		t.Helper()
		req, err := http.NewRequest(method, ts.URL+path, nil)
		if err != nil {
			t.Fatal(err)
		}
		for i := 0; i+1 < len(header); i += 2 {
			req.Header.Set(header[i], header[i+1])
		}
		resp, err := ts.Client().Do(req)
		if err != nil {
			t.Fatalf("%s %s: %v", method, path, err)
		}
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		if err != nil {
			t.Fatalf("%s %s: reading the body: %v", method, path, err)
		}
		if resp.StatusCode >= 500 {
			t.Errorf("%s %s = %d %q; want no 5xx", method, path, resp.StatusCode, body)
		}
		return resp, string(body)
	}
	degraded := func(resp *http.Response) bool {
		return strings.Contains(resp.Header.Get("RateLimit"), ";hl-degraded") &&
			strings.Contains(resp.Header.Get("RateLimit-Policy"), ";hl-degraded")
	}

	// With an API key, both rules decide.
	resp, body := do("GET", "/", "X-API-Key", "secret")
	if resp.StatusCode != 200 || !strings.Contains(body, "hello (mode remote") {
		t.Fatalf("GET / = %d %q; want 200 hello (mode remote...", resp.StatusCode, body)
	}
	for field, want := range map[string]string{
		"RateLimit-Policy":  `"ip";q=5;w=1, "apikey";q=100;w=60`,
		"RateLimit":         `"ip";r=4;t=1, "apikey";r=99;t=1`,
		"X-RateLimit-Limit": "5",
	} {
		if got := resp.Header.Get(field); got != want {
			t.Errorf("GET / with X-API-Key: %s = %q; want %q", field, got, want)
		}
	}

	// Past 5 requests in a second, 429.
	allowed := 1
	for range 20 {
		resp, body = do("GET", "/")
		if resp.StatusCode != 200 {
			break
		}
		allowed++
	}
	if resp.StatusCode != 429 || allowed < 5 {
		t.Fatalf("GET / after %d allowed = %d %q; want 429 after 5 or more", allowed, resp.StatusCode, body)
	}
	if ra, err := strconv.Atoi(resp.Header.Get("Retry-After")); err != nil || ra < 1 {
		t.Errorf("429: Retry-After = %q; want 1 or more seconds", resp.Header.Get("Retry-After"))
	}
	if got := resp.Header.Get("RateLimit"); !strings.HasPrefix(got, `"ip";r=0;t=1`) {
		t.Errorf("429: RateLimit = %q; want \"ip\";r=0;t=1", got)
	}
	if got := resp.Header.Get("RateLimit-Policy"); !strings.HasPrefix(got, `"ip";q=5;w=1`) {
		t.Errorf("429: RateLimit-Policy = %q; want \"ip\";q=5;w=1", got)
	}
	if degraded(resp) {
		t.Errorf("429 while Redis is up: RateLimit = %q; want no hl-degraded", resp.Header.Get("RateLimit"))
	}

	if resp, body := do("POST", "/outage?on=true"); resp.StatusCode != 200 || !strings.HasPrefix(body, "outage on") {
		t.Fatalf("POST /outage?on=true = %d %q; want 200 outage on", resp.StatusCode, body)
	}
	// For up to a fifth of a second after Redis's denial (a token at 5/s),
	// the Limiter may still deny from what Redis said, as Redis would:
	// ModeRemote, not degraded. Wait that out.
	time.Sleep(300 * time.Millisecond)
	denied := 0
	for i := range 10 {
		resp, body := do("GET", "/")
		if !degraded(resp) {
			t.Errorf("GET / %d during the outage = %d, RateLimit %q, RateLimit-Policy %q; want hl-degraded",
				i, resp.StatusCode, resp.Header.Get("RateLimit"), resp.Header.Get("RateLimit-Policy"))
		}
		switch resp.StatusCode {
		case 200:
			if !strings.Contains(body, "hello (mode local") {
				t.Errorf("GET / %d during the outage = %q; want hello (mode local...", i, body)
			}
		case 429:
			denied++
			if resp.Header.Get("Retry-After") == "" {
				t.Errorf("GET / %d during the outage: 429 without Retry-After", i)
			}
		default:
			t.Errorf("GET / %d during the outage = %d %q; want 200 or 429", i, resp.StatusCode, body)
		}
	}
	if denied == 0 {
		t.Errorf("10 requests at once during the outage: none denied; want the local share to deny some")
	}

	if resp, body := do("POST", "/outage/off"); resp.StatusCode != 200 || !strings.HasPrefix(body, "outage off") {
		t.Fatalf("POST /outage/off = %d %q; want 200 outage off", resp.StatusCode, body)
	}
	// The breaker probes Redis every 250ms or so, and closes on an answer.
	deadline := time.Now().Add(5 * time.Second)
	for {
		resp, _ := do("GET", "/")
		if !degraded(resp) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("GET / 5s after the outage: RateLimit %q; want Redis to decide again", resp.Header.Get("RateLimit"))
		}
		time.Sleep(100 * time.Millisecond)
	}

	if resp, _ := do("POST", "/outage?on=maybe"); resp.StatusCode != 400 {
		t.Errorf("POST /outage?on=maybe = %d; want 400", resp.StatusCode)
	}
}
