package remote

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// errDown is a failure: the node reset the connection.
var errDown = &net.OpError{Op: "read", Net: "tcp", Err: syscall.ECONNRESET}

// errWrongType is a healthy answer: the server replied with an error.
var errWrongType = serverError("WRONGTYPE Operation against a key holding the wrong kind of value")

// serverError is an error the server answered with, as go-redis's redis.Error.
type serverError string

func (e serverError) Error() string { return string(e) }
func (serverError) RedisError()     {}

func TestIsFailure(t *testing.T) {
	for _, tt := range []struct {
		err     error
		failure bool
	}{
		{nil, false},

		// The server answered: healthy.
		{redis.Nil, false},
		{redis.ErrNoScript, false},
		{errWrongType, false},
		{serverError("ERR wrong number of arguments for 'evalsha' command"), false},
		{serverError("ERR user_script:1: Script attempted to access nonexistent global variable 'x'"), false},
		{serverError("NOSCRIPT No matching script. Please use EVAL."), false},
		{serverError("BUSYKEY Target key name already exists."), false},
		{serverError("BUSYGROUP Consumer Group name already exists"), false},
		{fmt.Errorf("remote: %w", errWrongType), false},

		// The server answered that it cannot decide.
		{serverError("LOADING Redis is loading the dataset in memory"), true},
		{serverError("READONLY You can't write against a read only replica."), true},
		{serverError("ERR Error running script (call to f_0123): @user_script:1: -READONLY You can't write against a read only replica."), true},
		{serverError("MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'."), true},
		{serverError("CLUSTERDOWN The cluster is down"), true},
		{serverError("OOM command not allowed when used memory > 'maxmemory'."), true},
		{serverError("BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE."), true},
		{serverError("TRYAGAIN Multiple keys request during rehashing of slot"), true},
		{serverError("NOREPLICAS Not enough good replicas to write."), true},
		{serverError("MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist to disk."), true},
		{serverError("MOVED 3999 127.0.0.1:6381"), true},
		{serverError("ASK 3999 127.0.0.1:6381"), true},
		{serverError("ERR max number of clients reached"), true},
		{fmt.Errorf("remote: %w", serverError("LOADING Redis is loading the dataset in memory")), true},

		// No answer.
		{&net.OpError{Op: "dial", Net: "tcp", Err: &os.SyscallError{Syscall: "connect", Err: syscall.ECONNREFUSED}}, true},
		{errDown, true},
		{syscall.ECONNRESET, true},
		{syscall.EPIPE, true},
		{&net.OpError{Op: "read", Net: "tcp", Err: os.ErrDeadlineExceeded}, true},
		{&net.DNSError{Err: "no such host", Name: "redis", IsNotFound: true}, true},
		{io.EOF, true},
		{io.ErrUnexpectedEOF, true},
		{fmt.Errorf("remote: %w", io.EOF), true},
		{context.DeadlineExceeded, true}, // our own time budget
		{fmt.Errorf("remote: %w", context.DeadlineExceeded), true},
		{redis.ErrPoolTimeout, true},
		{redis.ErrPoolExhausted, true},
		{redis.ErrClosed, true},
		{errors.New("redis: can't parse \"?\""), true},

		// Only a caller cancels.
		{context.Canceled, false},
		{fmt.Errorf("remote: %w", context.Canceled), false},
	} {
		if got := IsFailure(tt.err); got != tt.failure {
			t.Errorf("IsFailure(%#v) = %v; want %v", tt.err, got, tt.failure)
		}
	}
}

// TestIsKeyError: only what is about one call's key or its script's run
// leaves the node healthy; an error reply about the node or the connection
// (credentials, ACLs, a proxy's own error, an unknown command) does not.
func TestIsKeyError(t *testing.T) {
	for _, tt := range []struct {
		err error
		key bool
	}{
		{errWrongType, true},
		{fmt.Errorf("remote: %w", errWrongType), true},
		{serverError("ERR hybridlimit bucket: bad time"), true},
		{serverError("ERR user_script:1: Script attempted to access nonexistent global variable 'x' script: 1234, on @user_script:1."), true},
		{serverError("ERR user_function:1: attempt to compare nil with number"), true},
		{serverError("ERR Error running script (call to f_0123): @user_script:7: user_script:7: attempt to perform arithmetic on a nil value"), true},
		{serverError("ERR Error running script (call to f_0123): @user_script:1: -OOM command not allowed when used memory > 'maxmemory'."), false},
		{serverError("ERR Error running script (call to f_0123): @user_script:1: -NOPERM this user has no permissions to access one of the keys used as arguments"), false},
		{serverError("WRONGPASS invalid username-password pair or user is disabled."), false},
		{serverError("NOAUTH Authentication required."), false},
		{serverError("NOPERM this user has no permissions to access one of the keys used as arguments"), false},
		{serverError("ERR unknown command 'evalsha', with args beginning with: "), false},
		{serverError("no upstream host"), false},
		{serverError("ERR max number of clients reached"), false},
		{serverError("LOADING Redis is loading the dataset in memory"), false},
		{redis.Nil, false},
		{io.EOF, false},
		{context.DeadlineExceeded, false},
		{nil, false},
	} {
		if got := IsKeyError(tt.err); got != tt.key {
			t.Errorf("IsKeyError(%v) = %v; want %v", tt.err, got, tt.key)
		}
	}
}

// TestIsFailureGoRedis classifies errors as go-redis returns them, from a
// fake server on an in-memory net.Pipe.
func TestIsFailureGoRedis(t *testing.T) {
	for _, tt := range []struct {
		reply   string // RESP reply to every command but HELLO; "" closes, "hang" never replies
		failure bool
	}{
		{"$-1\r\n", false}, // redis.Nil
		{"-WRONGTYPE Operation against a key holding the wrong kind of value\r\n", false},
		{"-ERR unknown command 'x'\r\n", false},
		{"-NOSCRIPT No matching script. Please use EVAL.\r\n", false},
		{"-LOADING Redis is loading the dataset in memory\r\n", true},
		{"-READONLY You can't write against a read only replica.\r\n", true},
		{"-MASTERDOWN Link with MASTER is down\r\n", true},
		{"-CLUSTERDOWN The cluster is down\r\n", true},
		{"-OOM command not allowed when used memory > 'maxmemory'.\r\n", true},
		{"-BUSY Redis is busy running a script.\r\n", true},
		{"-TRYAGAIN Multiple keys request during rehashing of slot\r\n", true},
		{"-NOREPLICAS Not enough good replicas to write.\r\n", true},
		{"-MISCONF Redis is configured to save RDB snapshots\r\n", true},
		{"-MOVED 3999 127.0.0.1:6381\r\n", true},
		{"-ASK 3999 127.0.0.1:6381\r\n", true},
		{"-ERR max number of clients reached\r\n", true},
		{"", true},     // EOF
		{"hang", true}, // read time-out
	} {
		client := redis.NewClient(&redis.Options{
			Addr: "fake:6379",
			Dialer: func(context.Context, string, string) (net.Conn, error) {
				conn, srv := net.Pipe()
				go serve(srv, tt.reply)
				return conn, nil
			},
			Protocol:        2,
			DisableIdentity: true,
			MaxRetries:      -1,
			ReadTimeout:     50 * time.Millisecond,
		})
		err := client.Get(context.Background(), "k").Err()
		client.Close()
		if err == nil {
			t.Errorf("reply %q: Get returned no error", tt.reply)
			continue
		}
		if got := IsFailure(err); got != tt.failure {
			t.Errorf("reply %q: IsFailure(%#v) = %v; want %v", tt.reply, err, got, tt.failure)
		}
	}
}

func TestRedirected(t *testing.T) {
	for _, tt := range []struct {
		err       error
		addr      string
		ask, redi bool
	}{
		{nil, "", false, false},
		{errDown, "", false, false},
		{errWrongType, "", false, false},
		{serverError("MOVED 3999 127.0.0.1:6381"), "127.0.0.1:6381", false, true},
		{serverError("ASK 3999 127.0.0.1:6381"), "127.0.0.1:6381", true, true},
		{fmt.Errorf("wrapped: %w", serverError("MOVED 1 10.0.0.2:6379")), "10.0.0.2:6379", false, true},
	} {
		addr, ask, ok := Redirected(tt.err)
		if addr != tt.addr || ask != tt.ask || ok != tt.redi {
			t.Errorf("Redirected(%v) = %q, %v, %v; want %q, %v, %v", tt.err, addr, ask, ok, tt.addr, tt.ask, tt.redi)
		}
	}
}

// serve answers each command read from conn with reply, and HELLO with an
// error so that go-redis stays on RESP2. It returns when conn is closed.
func serve(conn net.Conn, reply string) {
	defer conn.Close()
	r := bufio.NewReader(conn)
	for {
		name, err := readCommand(r)
		if err != nil {
			return
		}
		switch {
		case strings.EqualFold(name, "HELLO"):
			_, err = io.WriteString(conn, "-ERR unknown command 'HELLO'\r\n")
		case reply == "":
			return
		case reply == "hang":
		default:
			_, err = io.WriteString(conn, reply)
		}
		if err != nil {
			return
		}
	}
}

// readCommand reads one RESP array of bulk strings and returns its first element.
func readCommand(r *bufio.Reader) (string, error) {
	line := func(prefix byte) (int, error) {
		s, err := r.ReadString('\n')
		if err != nil {
			return 0, err
		}
		if len(s) < 3 || s[0] != prefix {
			return 0, fmt.Errorf("unexpected line %q", s)
		}
		return strconv.Atoi(strings.TrimSuffix(s[1:], "\r\n"))
	}
	n, err := line('*')
	if err != nil {
		return "", err
	}
	var name string
	for i := range n {
		size, err := line('$')
		if err != nil {
			return "", err
		}
		buf := make([]byte, size+2)
		if _, err := io.ReadFull(r, buf); err != nil {
			return "", err
		}
		if i == 0 {
			name = string(buf[:size])
		}
	}
	return name, nil
}

func TestBrokenAndUnsent(t *testing.T) {
	reset := func(op string) error {
		return &net.OpError{Op: op, Net: "tcp", Err: os.NewSyscallError(op, syscall.ECONNRESET)}
	}
	for _, c := range []struct {
		err            error
		broken, unsent bool
	}{
		{reset("write"), true, true},
		{fmt.Errorf("wrapped: %w", reset("write")), true, true},
		{reset("read"), true, false},
		{&net.OpError{Op: "write", Net: "tcp", Err: os.NewSyscallError("write", syscall.EPIPE)}, true, true},
		{io.EOF, true, false},
		{net.ErrClosed, true, false},
		{&net.OpError{Op: "write", Net: "tcp", Err: os.ErrDeadlineExceeded}, false, false},
		{&net.OpError{Op: "dial", Net: "tcp", Err: os.NewSyscallError("connect", syscall.ECONNREFUSED)}, false, false},
		{context.DeadlineExceeded, false, false},
		{nil, false, false},
	} {
		if got := IsBrokenConn(c.err); got != c.broken {
			t.Errorf("IsBrokenConn(%v) = %v, want %v", c.err, got, c.broken)
		}
		if got := IsUnsent(c.err); got != c.unsent {
			t.Errorf("IsUnsent(%v) = %v, want %v", c.err, got, c.unsent)
		}
	}
}

// TestIsUnsentAllocs: asked of every answered call, IsUnsent allocates
// nothing when there is no error, nor for an error that is not a broken
// connection.
func TestIsUnsentAllocs(t *testing.T) {
	other := errors.New("ERR something")
	for _, err := range []error{nil, other} {
		if n := testing.AllocsPerRun(100, func() { IsUnsent(err) }); n != 0 {
			t.Errorf("IsUnsent(%v) allocates %v times; want 0", err, n)
		}
	}
}

// TestAnsweredCallClassifiedWithoutAllocs: what the limiter asks of every
// answered call's nil error allocates nothing.
func TestAnsweredCallClassifiedWithoutAllocs(t *testing.T) {
	for name, f := range map[string]func(){
		"Redirected": func() { Redirected(nil) },
		"IsUnsent":   func() { IsUnsent(nil) },
	} {
		if n := testing.AllocsPerRun(100, f); n != 0 {
			t.Errorf("%s(nil) allocates %v times; want 0", name, n)
		}
	}
}

// TestIsFailureScriptWrapped: Redis 6 (ElastiCache and Memorystore still
// run 6.x) reports a refusal met by redis.call inside a script not under
// its own code but wrapped in "ERR Error running script": a node out of
// memory (noeviction), one that cannot persist (stop-writes-on-bgsave-error)
// or without enough replicas (min-replicas-to-write) cannot decide, as
// much as the unwrapped codes Redis 7 returns.
func TestIsFailureScriptWrapped(t *testing.T) {
	for _, msg := range []string{
		"ERR Error running script (call to f_0123): @user_script:57: @user_script: 57: -OOM command not allowed when used memory > 'maxmemory'.",
		"ERR Error running script (call to f_0123): @user_script:57: @user_script: 57: -MISCONF Redis is configured to save RDB snapshots, but it is currently not able to persist on disk. Commands that may modify the data set are disabled, because this instance is configured to report errors during writes if RDB snapshotting fails (stop-writes-on-bgsave-error option). Please check the Redis logs for details about the RDB error.",
		"ERR Error running script (call to f_0123): @user_script:57: @user_script: 57: -NOREPLICAS Not enough good replicas to write.",
	} {
		if !IsFailure(serverError(msg)) {
			t.Errorf("IsFailure(%q) = false; want true", msg)
		}
	}
	// A script's own error stays an answer.
	if msg := "ERR Error running script (call to f_0123): @user_script:3: user_script:3: attempt to compare nil with number"; IsFailure(serverError(msg)) {
		t.Errorf("IsFailure(%q) = true; want false", msg)
	}
}
