// Package redistest starts throwaway redis-server processes on loopback for
// tests: single servers, replicated pairs and small clusters.
//
// Every server listens on 127.0.0.1 on a free port below 55000 (so that the
// cluster bus port, port+10000, is valid too), keeps its data and log in a
// directory from t.TempDir, never persists, and is killed by t.Cleanup even if
// the test failed. If redis-server is not installed the test fails; it is
// never skipped.
package redistest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// readyTimeout bounds how long Start and Restart wait for PING, and how long
// Do and NodeForKey wait for a reply.
const readyTimeout = 5 * time.Second

// maxPort is the highest port handed to a server, leaving room for the
// cluster bus port at port+10000.
const maxPort = 55000

// An Option changes how Start runs redis-server.
type Option func(*config)

type config struct {
	args    []string
	cluster bool // add the cluster flags, with nodes.conf in the server's dir
}

// WithArgs appends extra redis-server arguments, such as
// "--maxmemory", "1mb", "--maxmemory-policy", "noeviction".
func WithArgs(args ...string) Option {
	return func(c *config) { c.args = append(c.args, args...) }
}

// Server is a redis-server process started by Start.
type Server struct {
	port int
	dir  string
	log  string
	args []string // complete redis-server command line, without the binary

	mu   sync.Mutex // protects proc
	proc *process   // nil after Kill
}

// process is one run of redis-server; exited is closed once it has been reaped.
type process struct {
	cmd    *exec.Cmd
	exited chan struct{}
}

// Start starts redis-server on a free loopback port and waits until it
// answers PING. t.Cleanup kills the process, paused or not, and waits for it.
func Start(t testing.TB, opts ...Option) *Server {
	t.Helper()
	bin := lookPath(t)
	var c config
	for _, opt := range opts {
		opt(&c)
	}
	s := &Server{dir: t.TempDir()}
	s.log = filepath.Join(s.dir, "redis.log")
	t.Cleanup(s.kill)
	var err error
	for range 5 {
		os.Remove(s.log)
		s.port = freePort(t)
		s.args = []string{
			"--port", strconv.Itoa(s.port),
			"--bind", "127.0.0.1",
			"--dir", s.dir,
			"--logfile", s.log,
			"--save", "",
			"--appendonly", "no",
			"--protected-mode", "no",
			"--daemonize", "no",
		}
		if c.cluster {
			s.args = append(s.args,
				"--cluster-enabled", "yes",
				"--cluster-config-file", filepath.Join(s.dir, "nodes.conf"),
				"--cluster-node-timeout", "2000")
		}
		s.args = append(s.args, c.args...)
		if err = s.run(bin); err == nil {
			return s
		}
		// Another process may have taken the port between freePort and
		// redis-server's bind; try another one.
		if !strings.Contains(s.logTail(), "Address already in use") {
			break
		}
	}
	t.Fatalf("redistest: %v\n%s", err, s.logTail())
	return nil
}

func lookPath(t testing.TB) string {
	t.Helper()
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		t.Fatal("redis-server not found: install it with `apt-get install -y redis-server`")
	}
	return bin
}

// handedOut holds the ports freePort has returned in this process, each
// with its Cluster bus port: a server killed and restarted on its port
// (Kill, Restart) leaves it free meanwhile, and a test running beside it
// must not be given it.
var handedOut = struct {
	sync.Mutex
	ports map[int]bool
}{ports: map[int]bool{}}

// freePort returns a loopback port below maxPort that, with port+10000, was
// free a moment ago and that no earlier call returned, as either.
func freePort(t testing.TB) int {
	t.Helper()
	for range 50 {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatalf("redistest: %v", err)
		}
		port := ln.Addr().(*net.TCPAddr).Port
		ln.Close()
		if port >= maxPort {
			continue
		}
		handedOut.Lock()
		taken := handedOut.ports[port] || handedOut.ports[port+10000]
		if !taken {
			handedOut.ports[port], handedOut.ports[port+10000] = true, true
		}
		handedOut.Unlock()
		if taken {
			continue
		}
		bus, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port+10000)))
		if err != nil {
			continue
		}
		bus.Close()
		return port
	}
	t.Fatal("redistest: no free port below 55000")
	return 0
}

// run starts redis-server with s.args and waits until this process, not some
// other one on the same port, answers.
func (s *Server) run(bin string) error {
	cmd := exec.Command(bin, s.args...)
	cmd.Dir = s.dir
	out, err := os.OpenFile(s.log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	cmd.Stdout, cmd.Stderr = out, out // *os.File: no copying goroutines
	err = cmd.Start()
	out.Close()
	if err != nil {
		return err
	}
	p := &process{cmd: cmd, exited: make(chan struct{})}
	go func() {
		cmd.Wait()
		close(p.exited)
	}()
	s.mu.Lock()
	s.proc = p
	s.mu.Unlock()

	c := probe(s.Addr())
	defer c.Close()
	want := "process_id:" + strconv.Itoa(cmd.Process.Pid) + "\r\n"
	deadline := time.Now().Add(readyTimeout)
	for time.Now().Before(deadline) {
		select {
		case <-p.exited:
			return fmt.Errorf("redis-server on port %d exited: %v", s.port, cmd.ProcessState)
		case <-time.After(10 * time.Millisecond):
		}
		// Dial first: go-redis logs every failed dial.
		nc, err := net.DialTimeout("tcp", s.Addr(), time.Second)
		if err != nil {
			continue
		}
		nc.Close()
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		info, err := c.Info(ctx, "server").Result()
		cancel()
		if err == nil && strings.Contains(info, want) {
			return nil
		}
	}
	s.kill()
	return fmt.Errorf("redis-server on port %d did not answer PING within %v", s.port, readyTimeout)
}

// probe returns a client for setup and polling that tries everything once
// (by default go-redis dials 5 times, 100ms apart, and retries commands 3
// times) and is bounded by the context's deadline alone, so that blocking
// commands such as WAIT work.
func probe(addr string) *redis.Client {
	return redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1, DialerRetries: 1,
		DialTimeout: time.Second, ReadTimeout: -1, WriteTimeout: -1, ContextTimeoutEnabled: true})
}

// logTail returns the last lines of the server's log.
func (s *Server) logTail() string {
	b, _ := os.ReadFile(s.log)
	lines := bytes.Split(bytes.TrimRight(b, "\n"), []byte("\n"))
	if len(lines) > 20 {
		lines = lines[len(lines)-20:]
	}
	return "--- " + s.log + " ---\n" + string(bytes.Join(lines, []byte("\n")))
}

// kill kills the running process, if any, and waits for it to be reaped.
func (s *Server) kill() {
	s.mu.Lock()
	p := s.proc
	s.proc = nil
	s.mu.Unlock()
	if p == nil {
		return
	}
	p.cmd.Process.Signal(syscall.SIGCONT)
	p.cmd.Process.Kill()
	<-p.exited
}

// signal sends sig to the running process, failing the test if there is none.
func (s *Server) signal(t testing.TB, sig syscall.Signal) {
	t.Helper()
	s.mu.Lock()
	p := s.proc
	s.mu.Unlock()
	if p == nil {
		t.Fatalf("redistest: %v to server on port %d: not running", sig, s.port)
	}
	if err := p.cmd.Process.Signal(sig); err != nil {
		t.Fatalf("redistest: %v to server on port %d: %v", sig, s.port, err)
	}
}

// Addr returns the server's address, "127.0.0.1:port".
func (s *Server) Addr() string { return net.JoinHostPort("127.0.0.1", strconv.Itoa(s.port)) }

// Port returns the server's TCP port.
func (s *Server) Port() int { return s.port }

// Client returns a go-redis client for the server, closed by t.Cleanup.
func (s *Server) Client(t testing.TB) *redis.Client {
	c := redis.NewClient(&redis.Options{Addr: s.Addr()})
	t.Cleanup(func() { c.Close() })
	return c
}

// Pause stops the process with SIGSTOP: connections are still accepted by the
// kernel, but nothing is answered until Resume.
func (s *Server) Pause(t testing.TB) {
	t.Helper()
	s.signal(t, syscall.SIGSTOP)
}

// Resume continues a paused process with SIGCONT.
func (s *Server) Resume(t testing.TB) {
	t.Helper()
	s.signal(t, syscall.SIGCONT)
}

// Kill kills the process with SIGKILL and waits for it to exit.
// Killing a server that is not running does nothing.
func (s *Server) Kill(t testing.TB) {
	t.Helper()
	s.kill()
}

// Restart kills the server if it is running and starts it again on the same
// port with the same arguments and no data, then waits until it answers PING.
func (s *Server) Restart(t testing.TB) {
	t.Helper()
	s.kill()
	if err := s.run(lookPath(t)); err != nil {
		t.Fatalf("redistest: restart: %v\n%s", err, s.logTail())
	}
}

// Do runs one command on a short-lived client, for test setup such as
// SCRIPT FLUSH or REPLICAOF, and returns its reply. A nil reply is returned
// as nil; any other error fails the test.
func (s *Server) Do(t testing.TB, args ...any) any {
	t.Helper()
	c := probe(s.Addr())
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), readyTimeout)
	defer cancel()
	v, err := c.Do(ctx, args...).Result()
	if err != nil && !errors.Is(err, redis.Nil) {
		t.Fatalf("redistest: %v on %s: %v", args, s.Addr(), err)
	}
	return v
}

// CPU returns the CPU time the server has used, user and system, in
// seconds (INFO cpu).
func (s *Server) CPU(t testing.TB) float64 {
	t.Helper()
	var sum float64
	for _, line := range strings.Split(s.Do(t, "INFO", "cpu").(string), "\r\n") {
		for _, f := range []string{"used_cpu_user:", "used_cpu_sys:"} {
			if rest, ok := strings.CutPrefix(line, f); ok {
				v, _ := strconv.ParseFloat(rest, 64)
				sum += v
			}
		}
	}
	return sum
}

// Calls returns how many times the server has run command (lower case,
// such as "evalsha"), from INFO commandstats.
func (s *Server) Calls(t testing.TB, command string) int64 {
	t.Helper()
	for _, line := range strings.Split(s.Do(t, "INFO", "commandstats").(string), "\r\n") {
		if rest, ok := strings.CutPrefix(line, "cmdstat_"+command+":calls="); ok {
			n, _ := strconv.ParseInt(rest[:strings.IndexByte(rest, ',')], 10, 64)
			return n
		}
	}
	return 0
}

// ScriptCalls returns how many script calls the server has run by
// EVALSHA or FCALL: hybridlimit calls its scripts one way or the other,
// depending on whether the server has functions.
func (s *Server) ScriptCalls(t testing.TB) int64 {
	t.Helper()
	return s.Calls(t, "evalsha") + s.Calls(t, "fcall")
}
