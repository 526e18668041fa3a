package simredis

import (
	"io"
	"net"
	"testing"
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
