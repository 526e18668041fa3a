package faultproxy

import (
	"context"
	"errors"
	"io"
	"net"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/hybridlimit/hybridlimit/internal/redistest"
	"github.com/redis/go-redis/v9"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// setup starts a redis-server and a proxy in front of it. The goroutine leak
// check is registered first so that it runs last, after every other cleanup.
func setup(t *testing.T) *Proxy {
	t.Cleanup(func() { goleak.VerifyNone(t) })
	s := redistest.Start(t)
	return Start(t, s.Addr())
}

// client returns a go-redis client through p that tries everything once and
// gives up on a reply after timeout.
func client(t *testing.T, p *Proxy, timeout time.Duration) *redis.Client {
	c := redis.NewClient(&redis.Options{
		Addr:          p.Addr(),
		ReadTimeout:   timeout,
		WriteTimeout:  timeout,
		MaxRetries:    -1,
		DialerRetries: 1,
	})
	t.Cleanup(func() { c.Close() })
	return c
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// waitConns waits until p.Conns() is want.
func waitConns(t *testing.T, p *Proxy, want int) {
	t.Helper()
	deadline := time.Now().Add(2 * time.Second)
	for p.Conns() != want {
		if time.Now().After(deadline) {
			t.Fatalf("Conns() = %d; want %d", p.Conns(), want)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestPassThrough(t *testing.T) {
	p := setup(t)
	ctx := context.Background()
	c := client(t, p, time.Second)
	big := strings.Repeat("x", 1<<20) // many chunks each way
	if err := c.Set(ctx, "k", big, 0).Err(); err != nil {
		t.Fatalf("SET: %v", err)
	}
	if got, err := c.Get(ctx, "k").Result(); got != big || err != nil {
		t.Fatalf("GET = %d bytes, %v; want %d bytes", len(got), err, len(big))
	}
	waitConns(t, p, 1)
	c.Close()
	waitConns(t, p, 0)
}

func TestDelay(t *testing.T) {
	p := setup(t)
	ctx := context.Background()
	c := client(t, p, time.Second)
	if err := c.Ping(ctx).Err(); err != nil { // dial and handshake undelayed
		t.Fatalf("PING: %v", err)
	}

	p.SetDelay(50 * time.Millisecond)
	start := time.Now()
	if err := c.Ping(ctx).Err(); err != nil {
		t.Fatalf("PING with delay: %v", err)
	}
	// The request and the reply are each delayed.
	if d := time.Since(start); d < 100*time.Millisecond {
		t.Errorf("PING with 50ms delay took %v; want >= 100ms", d)
	}

	p.SetDelay(0)
	start = time.Now()
	if err := c.Ping(ctx).Err(); err != nil {
		t.Fatalf("PING without delay: %v", err)
	}
	if d := time.Since(start); d >= 100*time.Millisecond {
		t.Errorf("PING without delay took %v; want < 100ms", d)
	}
}

func TestBlackhole(t *testing.T) {
	p := setup(t)
	ctx := context.Background()
	c := client(t, p, 100*time.Millisecond)
	if err := c.Ping(ctx).Err(); err != nil {
		t.Fatalf("PING: %v", err)
	}
	waitConns(t, p, 1)

	p.Blackhole(true)
	raw, err := net.Dial("tcp", p.Addr()) // accepted, never connected upstream
	if err != nil {
		t.Fatalf("dial while blackholed: %v", err)
	}
	defer raw.Close()
	waitConns(t, p, 2) // Dial returns before the proxy accepts.
	raw.Write([]byte("PING\r\n"))
	if err := c.Ping(ctx).Err(); !isTimeout(err) {
		t.Errorf("PING on existing connection while blackholed: %v; want a timeout", err)
	}
	if err := client(t, p, 100*time.Millisecond).Ping(ctx).Err(); !isTimeout(err) {
		t.Errorf("PING on new connection while blackholed: %v; want a timeout", err)
	}

	p.Blackhole(false)
	if err := client(t, p, time.Second).Ping(ctx).Err(); err != nil {
		t.Errorf("PING on new connection after blackhole: %v", err)
	}
	if err := c.Ping(ctx).Err(); err != nil {
		t.Errorf("PING on old client after blackhole: %v", err)
	}
	// A connection accepted while blackholed stays dead.
	raw.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
	if n, err := raw.Read(make([]byte, 16)); !isTimeout(err) {
		t.Errorf("read on connection accepted while blackholed = %d, %v; want a timeout", n, err)
	}
}

func TestResetAll(t *testing.T) {
	p := setup(t)
	ctx := context.Background()
	raw, err := net.Dial("tcp", p.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer raw.Close()
	ping(t, raw)
	idle := client(t, p, time.Second)
	if err := idle.Ping(ctx).Err(); err != nil {
		t.Fatalf("PING: %v", err)
	}
	busy := client(t, p, 3*time.Second)
	if err := busy.Ping(ctx).Err(); err != nil {
		t.Fatalf("PING: %v", err)
	}
	waitConns(t, p, 3)

	// Hold busy's next reply so that its command is in flight at the reset.
	p.SetDelay(time.Second)
	errc := make(chan error)
	go func() { errc <- busy.Ping(ctx).Err() }()
	time.Sleep(50 * time.Millisecond)
	p.ResetAll()
	p.SetDelay(0)
	if got := p.Conns(); got != 0 {
		t.Errorf("Conns() after ResetAll = %d; want 0", got)
	}
	if _, err := raw.Read(make([]byte, 16)); !errors.Is(err, syscall.ECONNRESET) {
		t.Errorf("read after ResetAll: %v; want ECONNRESET", err)
	}
	// go-redis reports the in-flight reset as EOF or ECONNRESET.
	if err := <-errc; !errors.Is(err, io.EOF) && !errors.Is(err, syscall.ECONNRESET) {
		t.Errorf("go-redis PING in flight at ResetAll: %v; want EOF or ECONNRESET", err)
	}
	// go-redis checks idle connections before use and redials dead ones, so
	// a reset between commands goes unnoticed.
	if err := idle.Ping(ctx).Err(); err != nil {
		t.Errorf("go-redis PING on idle connection after ResetAll: %v; want nil", err)
	}
}

func TestSetReset(t *testing.T) {
	p := setup(t)
	ctx := context.Background()
	p.SetReset(true)
	// The RST may arrive before the dial returns, or on the first read.
	raw, err := net.Dial("tcp", p.Addr())
	if err == nil {
		defer raw.Close()
		_, err = raw.Read(make([]byte, 16))
	}
	if !errors.Is(err, syscall.ECONNRESET) {
		t.Errorf("dial and read with SetReset(true): %v; want ECONNRESET", err)
	}
	if err := client(t, p, 100*time.Millisecond).Ping(ctx).Err(); err == nil {
		t.Errorf("go-redis PING with SetReset(true) succeeded; want an error")
	}
	if got := p.Conns(); got != 0 {
		t.Errorf("Conns() with SetReset(true) = %d; want 0", got)
	}
	p.SetReset(false)
	if err := client(t, p, time.Second).Ping(ctx).Err(); err != nil {
		t.Errorf("PING after SetReset(false): %v", err)
	}
}

// TestFlip switches modes while clients keep sending, then checks that the
// proxy still works and closes without leaking goroutines.
func TestFlip(t *testing.T) {
	p := setup(t)
	ctx := context.Background()
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for range 4 {
		c := client(t, p, 100*time.Millisecond)
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
					c.Incr(ctx, "n")
				}
			}
		})
	}
	for i := range 30 {
		switch i % 5 {
		case 0:
			p.SetDelay(time.Duration(i%3) * time.Millisecond)
		case 1:
			p.Blackhole(i%2 == 1)
		case 2:
			p.ResetAll()
		case 3:
			p.SetReset(i%2 == 0)
		case 4:
			p.Blackhole(false)
			p.SetReset(false)
		}
		time.Sleep(10 * time.Millisecond)
	}
	close(stop)
	wg.Wait()
	p.SetDelay(0)
	p.Blackhole(false)
	p.SetReset(false)
	if err := client(t, p, time.Second).Ping(ctx).Err(); err != nil {
		t.Errorf("PING after flipping: %v", err)
	}
}

func TestNewClose(t *testing.T) {
	// Not defer: deferred calls run before t.Cleanup stops redis-server.
	t.Cleanup(func() { goleak.VerifyNone(t) })
	s := redistest.Start(t)
	p, err := New(s.Addr())
	if err != nil {
		t.Fatal(err)
	}
	raw, err := net.Dial("tcp", p.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer raw.Close()
	ping(t, raw)
	p.Blackhole(true)
	raw.Write([]byte("PING\r\n")) // in flight when the proxy closes

	if err := p.Close(); err != nil {
		t.Errorf("Close: %v", err)
	}
	if err := p.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	// EOF, or ECONNRESET if the proxy had not yet read the PING.
	raw.SetReadDeadline(time.Now().Add(time.Second))
	if _, err := raw.Read(make([]byte, 16)); err != io.EOF && !errors.Is(err, syscall.ECONNRESET) {
		t.Errorf("read after Close: %v; want EOF or ECONNRESET", err)
	}
	if c, err := net.Dial("tcp", p.Addr()); err == nil {
		c.Close()
		t.Errorf("dial after Close succeeded")
	}
}

// ping sends PING on conn and expects PONG.
func ping(t *testing.T, conn net.Conn) {
	t.Helper()
	conn.SetDeadline(time.Now().Add(time.Second))
	defer conn.SetDeadline(time.Time{})
	if _, err := conn.Write([]byte("PING\r\n")); err != nil {
		t.Fatalf("write PING: %v", err)
	}
	buf := make([]byte, 7)
	if _, err := io.ReadFull(conn, buf); err != nil || string(buf) != "+PONG\r\n" {
		t.Fatalf("PING reply = %q, %v; want +PONG", buf, err)
	}
}
