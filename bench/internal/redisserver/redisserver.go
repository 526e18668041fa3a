// Package redisserver starts a throwaway redis-server on a free loopback
// port for the benchmarks, like the root module's internal/redistest (which
// this module cannot import) but usable outside tests: no persistence, data
// and log in a directory of its own, killed by Close.
package redisserver

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// readyTimeout bounds how long Start waits for the server to answer.
const readyTimeout = 5 * time.Second

// Server is a redis-server process started by Start.
type Server struct {
	addr   string
	dir    string
	cmd    *exec.Cmd
	exited chan struct{}
}

// Start starts redis-server on a free loopback port, with its data and log
// in a new temporary directory, and waits until it answers. Extra arguments
// are appended to the redis-server command line.
func Start(args ...string) (*Server, error) {
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		return nil, fmt.Errorf("redis-server not found: install it with `apt-get install -y redis-server`")
	}
	dir, err := os.MkdirTemp("", "hybridlimit-bench-redis-")
	if err != nil {
		return nil, err
	}
	log := filepath.Join(dir, "redis.log")
	for range 5 {
		os.Remove(log)
		port, err := freePort()
		if err != nil {
			break
		}
		s := &Server{addr: net.JoinHostPort("127.0.0.1", strconv.Itoa(port)), dir: dir}
		cmdArgs := append([]string{
			"--port", strconv.Itoa(port),
			"--bind", "127.0.0.1",
			"--dir", dir,
			"--logfile", log,
			"--save", "",
			"--appendonly", "no",
			"--protected-mode", "no",
			"--daemonize", "no",
		}, args...)
		if err = s.run(bin, cmdArgs, log); err == nil {
			return s, nil
		}
		b, _ := os.ReadFile(log)
		if !strings.Contains(string(b), "Address already in use") {
			os.RemoveAll(dir)
			return nil, fmt.Errorf("%v\n%s", err, b)
		}
	}
	os.RemoveAll(dir)
	return nil, fmt.Errorf("redisserver: no free port for redis-server")
}

// freePort returns a loopback port that was free a moment ago.
func freePort() (int, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}

// run starts the process and waits until this process, not another one on
// the same port, answers INFO.
func (s *Server) run(bin string, args []string, log string) error {
	s.cmd = exec.Command(bin, args...)
	s.cmd.Dir = s.dir
	out, err := os.OpenFile(log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	s.cmd.Stdout, s.cmd.Stderr = out, out
	err = s.cmd.Start()
	out.Close()
	if err != nil {
		return err
	}
	s.exited = make(chan struct{})
	go func() {
		s.cmd.Wait()
		close(s.exited)
	}()
	c := redis.NewClient(&redis.Options{Addr: s.addr, MaxRetries: -1, DialerRetries: 1})
	defer c.Close()
	want := "process_id:" + strconv.Itoa(s.cmd.Process.Pid) + "\r\n"
	deadline := time.Now().Add(readyTimeout)
	for time.Now().Before(deadline) {
		select {
		case <-s.exited:
			return fmt.Errorf("redis-server on %s exited: %v", s.addr, s.cmd.ProcessState)
		case <-time.After(10 * time.Millisecond):
		}
		nc, err := net.DialTimeout("tcp", s.addr, time.Second)
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
	s.cmd.Process.Kill()
	<-s.exited
	return fmt.Errorf("redis-server on %s did not answer within %v", s.addr, readyTimeout)
}

// Addr returns the server's address, "127.0.0.1:port".
func (s *Server) Addr() string { return s.addr }

// Port returns the server's TCP port.
func (s *Server) Port() int {
	_, p, _ := net.SplitHostPort(s.addr)
	n, _ := strconv.Atoi(p)
	return n
}

// Close kills the server, waits for it to exit and removes its directory.
func (s *Server) Close() error {
	s.cmd.Process.Kill()
	<-s.exited
	return os.RemoveAll(s.dir)
}
