// Package simnet is an in-memory network for the simulator: connections
// between Redis clients and an in-process server, with faults that a test
// schedules per client (per Link): added latency, a hang (the server stops
// reading and replying, as under SIGSTOP, while writes are still accepted),
// a reset of every connection, and refused dials.
//
// Everything blocks on channels and timers, so inside a testing/synctest
// bubble a goroutine waiting on a Conn is durably blocked and time moves on.
// Writes never block: each direction is an unbounded buffer, like a socket
// whose peer reads eventually, so a pipeline written whole before its
// replies are read cannot deadlock as it would on a net.Pipe.
//
// A server may read its end as a net.Conn from a goroutine of its own, or
// hand it a Handler (ServerEnd.Handle), which answers in the goroutine
// that made the bytes readable: the client's Write, or the Resume that
// ended a hang. The second costs no goroutine per connection and no
// hand-off per command, which under the race detector is most of a
// round trip's cost; what the server sees and when, in virtual time, is
// the same.
package simnet

import (
	"context"
	"errors"
	"io"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// Link is the path from one client (one limiter instance) to the server:
// the faults applied to every connection it dials. Link is safe for
// concurrent use.
type Link struct {
	// Read at every read and reply, so atomic: a lock taken and released
	// is a release that the race detector counts, dear at that rate.
	latency atomic.Int64 // time.Duration
	hung    atomic.Bool

	mu       sync.Mutex // protects the fields below, and orders changes of hung
	refuse   bool
	resetNew bool
	conns    map[*Conn]struct{}
	dials    int
}

// NewLink returns a healthy Link.
func NewLink() *Link { return &Link{conns: map[*Conn]struct{}{}} }

// SetLatency delays every reply written from now on by d.
func (l *Link) SetLatency(d time.Duration) { l.latency.Store(int64(d)) }

// Hang stops the server reading from and replying on this link's
// connections until Resume; writes are still accepted.
func (l *Link) Hang() { l.setHung(true) }

// Resume ends Hang: what was written meanwhile is read and answered.
func (l *Link) Resume() { l.setHung(false) }

func (l *Link) setHung(h bool) {
	l.mu.Lock()
	l.hung.Store(h)
	conns := l.snapshot()
	l.mu.Unlock()
	for _, c := range conns {
		c.up.kick()
		c.down.kick()
		if !h {
			c.pump() // what was written meanwhile
		}
	}
}

// Refuse makes new dials fail with "connection refused" while on is true.
func (l *Link) Refuse(on bool) {
	l.mu.Lock()
	l.refuse = on
	l.mu.Unlock()
}

// ResetNew makes every dial while on is true succeed and its connection
// reset at once, as a proxy or load balancer that accepts and then sends a
// TCP RST does (with Reset, a middlebox that resets everything).
func (l *Link) ResetNew(on bool) {
	l.mu.Lock()
	l.resetNew = on
	l.mu.Unlock()
}

// Reset closes every open connection of the link with ECONNRESET.
func (l *Link) Reset() {
	l.mu.Lock()
	conns := l.snapshot()
	l.mu.Unlock()
	for _, c := range conns {
		c.reset()
	}
}

// Dials returns how many connections the link has made.
func (l *Link) Dials() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.dials
}

// snapshot requires that l.mu is held.
func (l *Link) snapshot() []*Conn {
	out := make([]*Conn, 0, len(l.conns))
	for c := range l.conns {
		out = append(out, c)
	}
	return out
}

func (l *Link) isHung() bool { return l.hung.Load() }

func (l *Link) delay() time.Duration { return time.Duration(l.latency.Load()) }

// Dial returns the client end of a new connection and hands the server end
// to serve, which must read it until it returns an error. It takes the
// link's latency, as a TCP handshake takes a round trip (a hung server's
// kernel still completes it), and fails with a refused-connection error
// while Refuse is on.
func (l *Link) Dial(serve func(net.Conn)) (net.Conn, error) {
	l.mu.Lock()
	if l.refuse {
		l.mu.Unlock()
		return nil, &net.OpError{Op: "dial", Net: "sim", Err: os.NewSyscallError("connect", syscall.ECONNREFUSED)}
	}
	l.dials++
	delay, reset := l.delay(), l.resetNew
	c := &Conn{link: l, up: newStream(), down: newStream()}
	l.conns[c] = struct{}{}
	l.mu.Unlock()
	// The handshake is a round trip: its latency, like a reply's.
	time.Sleep(delay)
	serve(&ServerEnd{c})
	if reset {
		c.reset()
	}
	return c, nil
}

// chunk is bytes written at once, readable from at.
type chunk struct {
	b  []byte
	at time.Time
}

// stream is one direction of a connection: an unbounded queue of chunks.
type stream struct {
	mu       sync.Mutex // protects every field
	chunks   []chunk
	err      error // set when closed: what reads return once drained (io.EOF) or at once (reset)
	hard     bool  // err is returned before buffered data
	deadline time.Time
	wake     chan struct{} // closed and replaced on a change while waiters > 0
	waiters  int           // readers waiting on wake
}

func newStream() *stream { return &stream{wake: make(chan struct{})} }

// kick wakes the readers of s. kick requires that s.mu is not held.
func (s *stream) kick() {
	s.mu.Lock()
	s.kickLocked()
	s.mu.Unlock()
}

func (s *stream) kickLocked() {
	if s.waiters == 0 {
		return // nobody to wake: a reader looks again before it waits
	}
	close(s.wake)
	s.wake = make(chan struct{})
}

func (s *stream) write(b []byte, at time.Time) (int, error) {
	return s.put(append([]byte(nil), b...), at)
}

var errWriteTimeout = &net.OpError{Op: "write", Net: "sim", Err: os.ErrDeadlineExceeded}

// send is a client's write of b at now: it fails once the deadline passed.
func (s *stream) send(b []byte, now time.Time) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.deadline.IsZero() && !now.Before(s.deadline) {
		return 0, errWriteTimeout
	}
	return s.putLocked(append([]byte(nil), b...), now)
}

// put is write of b, which s keeps: the caller must not touch it again.
func (s *stream) put(b []byte, at time.Time) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.putLocked(b, at)
}

// putLocked is put. It requires that s.mu is held.
func (s *stream) putLocked(b []byte, at time.Time) (int, error) {
	if s.err != nil {
		if s.hard {
			if errors.Is(s.err, syscall.ECONNRESET) {
				return 0, errResetWrite
			}
			return 0, s.err
		}
		return 0, io.ErrClosedPipe
	}
	if n := len(s.chunks); n > 0 && s.chunks[n-1].at.After(at) {
		at = s.chunks[n-1].at // bytes keep their order
	}
	s.chunks = append(s.chunks, chunk{b, at})
	s.kickLocked()
	return len(b), nil
}

func (s *stream) close(err error, hard bool) {
	s.mu.Lock()
	if s.err == nil {
		s.err, s.hard = err, hard
	}
	s.kickLocked()
	s.mu.Unlock()
}

func (s *stream) setDeadline(t time.Time) {
	s.mu.Lock()
	s.deadline = t
	s.kickLocked()
	s.mu.Unlock()
}

var errTimeout = &net.OpError{Op: "read", Net: "sim", Err: os.ErrDeadlineExceeded}

// read reads what is due, waiting while paused() is true, until the
// deadline (if useDeadline) or close.
func (s *stream) read(b []byte, paused func() bool, useDeadline bool) (int, error) {
	var timer *time.Timer
	defer func() {
		if timer != nil {
			timer.Stop()
		}
	}()
	for {
		s.mu.Lock()
		now := time.Now()
		if s.err != nil && s.hard {
			s.mu.Unlock()
			return 0, s.err
		}
		if useDeadline && !s.deadline.IsZero() && !now.Before(s.deadline) {
			s.mu.Unlock()
			return 0, errTimeout
		}
		var wakeAt time.Time
		if !paused() {
			if len(s.chunks) > 0 {
				c := &s.chunks[0]
				if !now.Before(c.at) {
					n := copy(b, c.b)
					c.b = c.b[n:]
					if len(c.b) == 0 {
						s.chunks = s.chunks[1:]
					}
					s.mu.Unlock()
					return n, nil
				}
				wakeAt = c.at
			} else if s.err != nil {
				s.mu.Unlock()
				return 0, s.err
			}
		}
		if useDeadline && !s.deadline.IsZero() && (wakeAt.IsZero() || s.deadline.Before(wakeAt)) {
			wakeAt = s.deadline
		}
		wake := s.wake
		s.waiters++
		s.mu.Unlock()
		var tc <-chan time.Time
		if !wakeAt.IsZero() {
			if timer == nil {
				timer = time.NewTimer(wakeAt.Sub(now))
			} else {
				timer.Reset(wakeAt.Sub(now))
			}
			tc = timer.C
		}
		select {
		case <-wake:
		case <-tc:
		}
		s.mu.Lock()
		s.waiters--
		s.mu.Unlock()
	}
}

// take appends to into the chunks readable now, in order, and returns
// them, unless paused() is true; err is what reads return once the stream
// is drained (nil while open). After a hard close it takes nothing and
// returns the error.
func (s *stream) take(into [][]byte, paused func() bool) (_ [][]byte, drained error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.err != nil && s.hard {
		return into, s.err
	}
	if paused() {
		return into, nil
	}
	now := time.Now()
	for len(s.chunks) > 0 && !now.Before(s.chunks[0].at) {
		into = append(into, s.chunks[0].b)
		s.chunks[0] = chunk{}
		s.chunks = s.chunks[1:]
	}
	if len(s.chunks) == 0 {
		return into, s.err
	}
	return into, nil
}

// Conn is the client end of a connection.
type Conn struct {
	link *Link
	up   *stream // client to server
	down *stream // server to client
	once sync.Once

	serving sync.Mutex // held while a Handler is given bytes: one at a time, in order
	handler Handler    // nil: the server reads its end itself
	done    func()     // called once when a handled connection ends
	ended   bool       // the handled connection ended; protected by serving
}

var (
	errReset      = &net.OpError{Op: "read", Net: "sim", Err: os.NewSyscallError("read", syscall.ECONNRESET)}
	errResetWrite = &net.OpError{Op: "write", Net: "sim", Err: os.NewSyscallError("write", syscall.ECONNRESET)}
)

// ErrReset reports whether err is a reset made by Link.Reset.
func ErrReset(err error) bool { return errors.Is(err, syscall.ECONNRESET) }

func (c *Conn) reset() {
	c.up.close(errReset, true)
	c.down.close(errReset, true)
	c.forget()
	c.pump()
}

func (c *Conn) forget() {
	c.once.Do(func() {
		c.link.mu.Lock()
		delete(c.link.conns, c)
		c.link.mu.Unlock()
	})
}

// Read reads the server's replies, which arrive after the link's latency
// and not while the link hangs.
func (c *Conn) Read(b []byte) (int, error) { return c.down.read(b, c.link.isHung, true) }

// Write sends b to the server. It never blocks; a Handler answers it
// before Write returns, unless the link hangs.
func (c *Conn) Write(b []byte) (int, error) {
	n, err := c.up.send(b, time.Now())
	if err == nil {
		c.pump()
	}
	return n, err
}

// Handler is a server's side of one connection, answering in the caller's
// goroutine. Handle is given the bytes the client wrote, in order and one
// call at a time, when the server would have read them (not while the
// link hangs); it returns the bytes of its replies, which it must not
// touch again, and false to close the connection after them.
type Handler interface {
	Handle(in []byte) (reply []byte, ok bool)
}

// pump hands what the server can read now to c's Handler, and ends the
// connection as a server reading it would: at a reset, at the end of what
// the client wrote before it closed, or when a reply cannot be sent.
func (c *Conn) pump() {
	c.serving.Lock()
	defer c.serving.Unlock()
	if c.handler == nil || c.ended {
		return
	}
	// What a client writes meanwhile, its own pump hands over after this.
	var buf [4][]byte
	ins, err := c.up.take(buf[:0], c.link.isHung)
	for _, in := range ins {
		reply, ok := c.handler.Handle(in)
		if len(reply) > 0 {
			if _, werr := c.down.put(reply, time.Now().Add(c.link.delay())); werr != nil {
				ok = false
			}
		}
		if !ok {
			c.endLocked()
			return
		}
	}
	if err != nil {
		c.endLocked()
	}
}

// endLocked closes the server's end of a handled connection. It requires
// that c.serving is held.
func (c *Conn) endLocked() {
	c.ended = true
	c.forget()
	(&ServerEnd{c}).closeStreams()
	if c.done != nil {
		c.done()
	}
}

// Close closes the connection; the server reads what was written, then EOF,
// as a stopped server's kernel keeps it for the process: a close during a
// hang leaves the connection to the link until the server has read it,
// after Resume, and run what it held.
func (c *Conn) Close() error {
	c.up.close(io.EOF, false)
	c.down.close(net.ErrClosed, true)
	c.serving.Lock()
	handled := c.handler != nil && !c.ended
	c.serving.Unlock()
	if !handled {
		c.forget()
	}
	c.pump()
	return nil
}

// SyscallConn lets a client ask the kernel, as go-redis does of every
// pooled connection it takes, whether the peer closed the connection or
// sent something unasked, without reading. A Conn has no socket: the
// RawConn answers with one of three sockets kept for the purpose, one
// whose peer closed (a reset or closed Conn), one holding a byte (replies
// waiting) and one idle (healthy), so that a client drops the connections
// a reset broke before using them, as it would over TCP.
func (c *Conn) SyscallConn() (syscall.RawConn, error) { return rawConn{c}, nil }

type rawConn struct{ c *Conn }

func (r rawConn) Control(f func(fd uintptr)) error { f(uintptr(r.fd())); return nil }

func (r rawConn) Read(f func(fd uintptr) bool) error {
	f(uintptr(r.fd()))
	return nil
}

func (r rawConn) Write(f func(fd uintptr) bool) error {
	f(uintptr(r.fd()))
	return nil
}

// fd returns the socket that stands for the state of r's Conn.
func (r rawConn) fd() int {
	probes.once.Do(probes.open)
	d := r.c.down
	d.mu.Lock()
	defer d.mu.Unlock()
	switch {
	case d.err != nil && (d.hard || len(d.chunks) == 0):
		return probes.closed
	case len(d.chunks) > 0 && !time.Now().Before(d.chunks[0].at):
		return probes.data
	}
	return probes.idle
}

// probes are the sockets a RawConn answers with, made once per process
// and never closed.
var probes probeSockets

type probeSockets struct {
	once               sync.Once
	idle, data, closed int
}

func (p *probeSockets) open() {
	pair := func() [2]int {
		fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM, 0)
		if err != nil {
			panic("simnet: socketpair: " + err.Error())
		}
		return fds
	}
	idle, data, closed := pair(), pair(), pair()
	if _, err := syscall.Write(data[1], []byte{'+'}); err != nil {
		panic("simnet: write: " + err.Error())
	}
	syscall.Close(closed[1])
	p.idle, p.data, p.closed = idle[0], data[0], closed[0]
}

// LocalAddr returns a placeholder address.
func (c *Conn) LocalAddr() net.Addr { return addr("client") }

// RemoteAddr returns a placeholder address.
func (c *Conn) RemoteAddr() net.Addr { return addr("server") }

// SetDeadline sets the read and write deadlines.
func (c *Conn) SetDeadline(t time.Time) error {
	c.down.setDeadline(t)
	c.up.setDeadline(t)
	return nil
}

// SetReadDeadline sets the read deadline.
func (c *Conn) SetReadDeadline(t time.Time) error { c.down.setDeadline(t); return nil }

// SetWriteDeadline sets the write deadline.
func (c *Conn) SetWriteDeadline(t time.Time) error { c.up.setDeadline(t); return nil }

// ServerEnd is the server's end of a Conn, as Dial hands it to serve.
type ServerEnd struct{ c *Conn }

// Handle serves the connection with h from now on instead of reads of s:
// see Handler. done, if not nil, is called once when the connection ends
// (a reset, the client's close, h's refusal or s.Close). Handle must be
// called at most once, before anything reads s.
func (s *ServerEnd) Handle(h Handler, done func()) {
	s.c.serving.Lock()
	s.c.handler, s.c.done = h, done
	s.c.serving.Unlock()
	s.c.pump()
}

func (s *ServerEnd) Read(b []byte) (int, error) {
	return s.c.up.read(b, s.c.link.isHung, false)
}

func (s *ServerEnd) Write(b []byte) (int, error) {
	return s.c.down.write(b, time.Now().Add(s.c.link.delay()))
}

func (s *ServerEnd) Close() error {
	s.closeStreams()
	s.c.pump() // a Handler's connection ends
	return nil
}

func (s *ServerEnd) closeStreams() {
	s.c.down.close(io.EOF, false)
	s.c.up.close(net.ErrClosed, true)
	s.c.forget()
}

func (s *ServerEnd) LocalAddr() net.Addr              { return addr("server") }
func (s *ServerEnd) RemoteAddr() net.Addr             { return addr("client") }
func (s *ServerEnd) SetDeadline(time.Time) error      { return nil }
func (s *ServerEnd) SetReadDeadline(time.Time) error  { return nil }
func (s *ServerEnd) SetWriteDeadline(time.Time) error { return nil }

type addr string

func (a addr) Network() string { return "sim" }
func (a addr) String() string  { return string(a) }

// Dialer returns a go-redis Options.Dialer that dials l, handing each
// connection's server end to serve.
func (l *Link) Dialer(serve func(net.Conn)) func(context.Context, string, string) (net.Conn, error) {
	return func(context.Context, string, string) (net.Conn, error) { return l.Dial(serve) }
}
