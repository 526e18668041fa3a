// Package faultproxy is a TCP proxy in front of a Redis address that injects
// faults, switched at run time: delay, blackhole and reset.
//
// Each client connection gets its own upstream connection and one goroutine
// per direction. Every chunk read from either side is handled under the modes
// in force when it was read: dropped while blackholed, otherwise delayed and
// forwarded. Proxy methods are safe for concurrent use by multiple goroutines.
package faultproxy

import (
	"context"
	"io"
	"net"
	"sync"
	"testing"
	"time"
)

// Proxy forwards TCP connections from Addr to a target address.
type Proxy struct {
	ln     net.Listener
	ctx    context.Context // cancelled by Close; bounds upstream dials
	cancel context.CancelFunc
	wg     sync.WaitGroup // one for the accept loop, one for each connection

	mu        sync.Mutex // protects the fields below
	target    string
	delay     time.Duration
	blackhole bool
	reset     bool
	closed    bool
	conns     map[*conn]struct{}
}

// conn is one client connection and, once dialled, its upstream connection.
type conn struct {
	client *net.TCPConn
	done   chan struct{} // closed by close

	mu       sync.Mutex // protects upstream and closed
	upstream net.Conn   // nil until attach
	closed   bool
}

func newConn(client *net.TCPConn) *conn {
	return &conn{client: client, done: make(chan struct{})}
}

// attach sets c's upstream connection and reports whether c is still open.
func (c *conn) attach(up net.Conn) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.closed {
		c.upstream = up
	}
	return !c.closed
}

// close closes both sides of c; with rst the client gets a TCP RST instead
// of a FIN. Only the first call does anything.
func (c *conn) close(rst bool) {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return
	}
	c.closed = true
	close(c.done)
	up := c.upstream
	c.mu.Unlock()
	if rst {
		c.client.SetLinger(0)
	}
	c.client.Close()
	if up != nil {
		up.Close()
	}
}

// Start starts a proxy to target on a free loopback port, failing the test on
// error. t.Cleanup closes it.
func Start(t testing.TB, target string) *Proxy {
	t.Helper()
	p, err := New(target)
	if err != nil {
		t.Fatalf("faultproxy: %v", err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

// New starts a proxy to target on a free loopback port. It starts a goroutine
// that accepts connections, and two per connection; Close stops them all and
// waits for them to return.
func New(target string) (*Proxy, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	p := &Proxy{target: target, ln: ln, ctx: ctx, cancel: cancel, conns: map[*conn]struct{}{}}
	p.wg.Add(1)
	go p.accept()
	return p, nil
}

// Addr returns the address clients connect to, "127.0.0.1:port".
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// Close stops accepting, closes every connection, and waits for the proxy's
// goroutines to return. Calling Close again does nothing and returns nil.
func (p *Proxy) Close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	p.closed = true
	p.mu.Unlock()
	p.cancel()
	err := p.ln.Close()
	p.closeAll(false)
	p.wg.Wait()
	return err
}

// SetTarget points the proxy at another address, as a failover points
// clients at a new master: connections accepted from now on are connected to
// addr, while those already open stay connected to the old target until they
// close (ResetAll closes them).
func (p *Proxy) SetTarget(addr string) {
	p.mu.Lock()
	p.target = addr
	p.mu.Unlock()
}

// Target returns the address new connections are connected to.
func (p *Proxy) Target() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.target
}

// SetDelay delays every chunk forwarded in either direction by d, from the
// next chunk on. Zero means no delay. Chunks in one direction stay in order,
// so a delay also limits each connection to one chunk per d per direction.
func (p *Proxy) SetDelay(d time.Duration) {
	p.mu.Lock()
	p.delay = d
	p.mu.Unlock()
}

// Blackhole turns the blackhole on or off. While it is on, connections stay
// open but every byte read from either side is dropped, so no reply ever
// arrives; bytes dropped are never delivered. Connections accepted while it
// is on are never connected upstream: they read and drop until closed, even
// after the blackhole is turned off.
func (p *Proxy) Blackhole(on bool) {
	p.mu.Lock()
	p.blackhole = on
	p.mu.Unlock()
}

// SetReset turns reset mode on or off. While it is on, every new connection
// is accepted and immediately closed with a TCP RST.
func (p *Proxy) SetReset(on bool) {
	p.mu.Lock()
	p.reset = on
	p.mu.Unlock()
}

// ResetAll closes every current connection, sending the client a TCP RST.
func (p *Proxy) ResetAll() { p.closeAll(true) }

// Conns returns the number of open client connections.
func (p *Proxy) Conns() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.conns)
}

// mode returns the delay and blackhole setting in force.
func (p *Proxy) mode() (time.Duration, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.delay, p.blackhole
}

func (p *Proxy) closeAll(rst bool) {
	p.mu.Lock()
	all := make([]*conn, 0, len(p.conns))
	for c := range p.conns {
		all = append(all, c)
		delete(p.conns, c)
	}
	p.mu.Unlock()
	for _, c := range all {
		c.close(rst)
	}
}

func (p *Proxy) accept() {
	defer p.wg.Done()
	for {
		nc, err := p.ln.Accept()
		if err != nil {
			if p.ctx.Err() != nil {
				return
			}
			// Most likely out of file descriptors; back off as net/http does.
			select {
			case <-p.ctx.Done():
				return
			case <-time.After(5 * time.Millisecond):
			}
			continue
		}
		c := newConn(nc.(*net.TCPConn))
		p.mu.Lock()
		closed, reset, blackhole := p.closed, p.reset, p.blackhole
		if !closed && !reset {
			p.conns[c] = struct{}{}
			p.wg.Add(1)
		}
		p.mu.Unlock()
		switch {
		case closed:
			nc.Close()
		case reset:
			c.close(true)
		default:
			go p.serve(c, blackhole)
		}
	}
}

// serve forwards c until either side closes or the proxy closes it.
func (p *Proxy) serve(c *conn, blackhole bool) {
	defer p.wg.Done()
	defer func() {
		p.mu.Lock()
		delete(p.conns, c)
		p.mu.Unlock()
		c.close(false)
	}()
	if blackhole {
		io.Copy(io.Discard, c.client)
		return
	}
	var d net.Dialer
	up, err := d.DialContext(p.ctx, "tcp", p.Target())
	if err != nil {
		return
	}
	if !c.attach(up) { // closed by ResetAll or Close while dialling
		up.Close()
		return
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer c.close(false)
		p.pipe(c, up, c.client)
	}()
	p.pipe(c, c.client, up)
	c.close(false)
	<-done
}

// pipe copies src to dst, both sides of c, chunk by chunk under the modes in
// force, until either fails or c is closed.
func (p *Proxy) pipe(c *conn, dst, src net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			delay, blackhole := p.mode()
			if !blackhole {
				if delay > 0 && !c.sleep(delay) {
					return
				}
				if _, err := dst.Write(buf[:n]); err != nil {
					return
				}
			}
		}
		if err != nil {
			return
		}
	}
}

// sleep waits for d and reports whether c is still open.
func (c *conn) sleep(d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-c.done:
		return false
	}
}
