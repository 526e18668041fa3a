package simredis

import (
	"context"
	"io"
	"net"
	"testing"
	"testing/synctest"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/hybridlimit/hybridlimit/internal/simnet"
	"github.com/hybridlimit/hybridlimit/lua"
	"github.com/hybridlimit/hybridlimit/remote"
)

// TestServeAnyConn: a conn that is not simnet's is served from a goroutine
// of its own, with commands split across writes and several in one.
func TestServeAnyConn(t *testing.T) {
	s := New()
	client, server := net.Pipe()
	s.Serve(server, 0)
	defer s.Close()
	go func() {
		for _, part := range []string{"*1\r\n$4\r\nPI", "NG\r\n*2\r\n$3\r\nGET\r\n$1\r\nk\r\n"} {
			if _, err := client.Write([]byte(part)); err != nil {
				t.Error(err)
				return
			}
		}
	}()
	want := "+PONG\r\n$-1\r\n"
	got := make([]byte, len(want))
	if _, err := io.ReadFull(client, got); err != nil {
		t.Fatal(err)
	}
	if string(got) != want {
		t.Errorf("replies %q, want %q", got, want)
	}
	client.Close()
}

// TestCommandOfAClosedConnRunsAfterAHang: a script call written while the
// link hangs, whose client gives up and closes the connection, runs when
// the link resumes, as a stopped redis-server runs what its kernel holds
// on SIGCONT: a decision that timed out during a pause may still take its
// tokens.
func TestCommandOfAClosedConnRunsAfterAHang(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s := New()
		defer s.Close()
		link := simnet.NewLink()
		c := redis.NewClient(&redis.Options{Addr: "10.0.0.1:6379", MaxRetries: -1, ReadTimeout: 50 * time.Millisecond,
			Dialer: link.Dialer(func(c net.Conn) { s.Serve(c, 0) })})
		defer c.Close()
		ctx := context.Background()
		if err := c.Ping(ctx).Err(); err != nil {
			t.Fatal(err)
		}
		rl, err := remote.NewLimit(10, 10)
		if err != nil {
			t.Fatal(err)
		}
		before := s.Calls()
		link.Hang()
		if err := c.Eval(ctx, lua.TokenBucket, []string{"k"}, rl.Q, rl.P, rl.Cap(), rl.P).Err(); err == nil {
			t.Fatal("the script answered while the link hangs")
		}
		time.Sleep(time.Second)
		link.Resume()
		time.Sleep(time.Second)
		if got := s.Calls() - before; got != 1 {
			t.Errorf("%d script calls ran after the resume; want the one written during the hang, on a connection its client closed", got)
		}
	})
}
