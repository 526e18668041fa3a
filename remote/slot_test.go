package remote

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// swallower is a server that answers every command with an error except
// EVALSHA, which it counts and never answers: a Redis that hangs on the
// script, after go-redis's handshake went through.
type swallower struct {
	ln      net.Listener
	evalsha atomic.Int64
	wg      sync.WaitGroup
	mu      sync.Mutex
	conns   []net.Conn
}

func newSwallower(t *testing.T) *swallower {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &swallower{ln: ln}
	s.wg.Add(1)
	go s.accept()
	t.Cleanup(func() {
		ln.Close()
		s.mu.Lock()
		for _, c := range s.conns {
			c.Close()
		}
		s.mu.Unlock()
		s.wg.Wait()
	})
	return s
}

func (s *swallower) accept() {
	defer s.wg.Done()
	for {
		c, err := s.ln.Accept()
		if err != nil {
			return
		}
		s.mu.Lock()
		s.conns = append(s.conns, c)
		s.mu.Unlock()
		s.wg.Add(1)
		go s.serve(c)
	}
}

// serve reads RESP arrays of bulk strings, the only form clients send.
func (s *swallower) serve(c net.Conn) {
	defer s.wg.Done()
	r := bufio.NewReader(c)
	for {
		line, err := r.ReadString('\n')
		if err != nil || !strings.HasPrefix(line, "*") {
			return
		}
		n, _ := strconv.Atoi(strings.TrimSpace(line[1:]))
		var name string
		for i := range n {
			hdr, err := r.ReadString('\n')
			if err != nil {
				return
			}
			size, _ := strconv.Atoi(strings.TrimSpace(hdr[1:]))
			buf := make([]byte, size+2)
			if _, err := io.ReadFull(r, buf); err != nil {
				return
			}
			if i == 0 {
				name = strings.ToLower(string(buf[:size]))
			}
		}
		if name == "evalsha" {
			s.evalsha.Add(1)
			continue
		}
		if _, err := c.Write([]byte("-ERR unknown command\r\n")); err != nil {
			return
		}
	}
}

// TestHungCallFreesItsSlot: with one batch allowed in flight and a Redis
// that never answers the script, each decision is still sent and ends at
// its caller's deadline. A call sent alone holds the pipe's one slot until
// its caller gives up; if it held it until go-redis's ReadTimeout, the
// next calls would wait in the queue and end unsent.
func TestHungCallFreesItsSlot(t *testing.T) {
	srv := newSwallower(t)
	// Reads not bounded by the context (the default), and bounded by a
	// ReadTimeout longer than the callers' deadline, shorter than the
	// default 3 s so that Close, which waits for the hung sends, is quick.
	c := redis.NewClient(&redis.Options{Addr: srv.ln.Addr().String(), ReadTimeout: 400 * time.Millisecond})
	defer c.Close()
	p := NewPipe(c, 1, nil)
	defer p.Close()
	lim := mustLimit(t, 10, 10)
	for i := range 3 {
		ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
		start := time.Now()
		_, err := p.Take(ctx, "k", lim, 1)
		took := time.Since(start)
		cancel()
		if !errors.Is(err, context.DeadlineExceeded) || took > time.Second {
			t.Fatalf("call %d = %v after %v; want the deadline after 100ms", i, err, took)
		}
		if !errors.Is(err, ErrUnanswered) {
			t.Errorf("call %d = %v; want ErrUnanswered: sent, not left in the queue", i, err)
		}
	}
	deadline := time.Now().Add(time.Second)
	for srv.evalsha.Load() < 3 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	if got := srv.evalsha.Load(); got != 3 {
		t.Errorf("Redis saw %d EVALSHA; want 3", got)
	}
}
