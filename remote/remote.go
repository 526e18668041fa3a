// Package remote runs hybridlimit's scripts on Redis: the token bucket,
// the charge for spending made without Redis, and the fleet's heartbeat.
//
// A Pipe serves one Redis node. A decision alone on an idle pipe is sent at
// once as one FCALL, or EVALSHA where the node has no functions (Node);
// decisions that arrive while others are in flight are sent together as
// one pipeline, so concurrent decisions share round trips.
// The caller waits for its answer only until its context ends: a Redis that
// hangs costs the caller its own deadline, never the client's socket
// time-outs, whatever the client's options say. (On a client with
// ContextTimeoutEnabled a lone call runs on its caller's goroutine, where
// a cancellation before the deadline does not stop go-redis's read: see
// Request.Cancelable; except while the pipe opens again connections that
// deadlines cut short: see reconnect.)
package remote

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/hybridlimit/hybridlimit/lua"
)

// Errors returned by Pipe methods.
var (
	// ErrClosed is returned after Close.
	ErrClosed = errors.New("remote: pipe closed")
	// ErrUnanswered is wrapped, together with the context's error, when the
	// context ended after the call was written to Redis: Redis may still run
	// it, and take its tokens, when it gets to it.
	ErrUnanswered = errors.New("remote: sent but unanswered")
)

// script is a Lua script with its SHA1, which EVALSHA sends, and the name
// of its function in the library, which FCALL sends.
type script struct {
	src, sha string
	// The commands' first two arguments by verb, boxed once: converting a
	// string to an interface allocates, and this is done for every
	// decision.
	head [3][2]any
}

func newScript(src, function string) *script {
	sha := redis.NewScript(src).Hash()
	s := &script{src: src, sha: sha}
	s.head[evalsha] = [2]any{"evalsha", sha}
	s.head[fcall] = [2]any{"fcall", function}
	s.head[eval] = [2]any{"eval", src}
	return s
}

// The scripts.
var (
	takeScript  = newScript(lua.TokenBucket, library.take)
	fleetScript = newScript(lua.Fleet, library.fleet)
)

// Hash returns the SHA1 of the token-bucket script, as EVALSHA uses it.
func Hash() string { return takeScript.sha }

// Defaults for NewPipe.
const (
	// DefaultInFlight is how many batches may be in flight at once on one
	// node: enough to overlap a round trip with the next batch's writing.
	DefaultInFlight = 4
	// MaxBatch bounds the decisions sent in one pipeline.
	MaxBatch = 128
)

// Pipe sends token-bucket decisions for one Redis node, coalescing those
// that arrive together into pipelines. Pipe is safe for concurrent use.
type Pipe struct {
	c      redis.UniversalClient
	node   *Node
	inline bool // c bounds reads by the context's deadline: a lone call may run on its caller
	// unbounded: c bounds its reads by nothing (ReadTimeout -1 or -2,
	// without ContextTimeoutEnabled): a call sent to a Redis that hangs
	// returns only when Redis answers or the client is closed.
	unbounded bool
	calls     chan *call
	// lone hands a call sent alone to a sender goroutine parked on it, if
	// one is: waking a goroutine is cheaper than starting one, which also
	// has to grow its stack to go-redis's depth.
	lone   chan *call
	parked atomic.Int32  // sender goroutines parked on lone, or about to be
	slots  chan struct{} // one token per batch in flight that a caller still waits for
	done   chan struct{}
	// ctx is cancelled when Close begins: the background work of tend
	// derives from it, so that Close does not wait out its time-outs.
	ctx    context.Context
	cancel context.CancelFunc
	boxed  atomic.Pointer[boxed]
	// pool holds answered calls for reuse. It is the Pipe's own, not the
	// package's: a call holds a channel, and a channel must not pass
	// between the Pipes of two synctest bubbles (the simulator runs
	// several at once).
	pool sync.Pool

	// reconnecting is set while reconnect opens connections.
	reconnecting atomic.Bool
	// stall is what the calls that leave unsent share until a slot is
	// freed: one wait for a slot (ClaimTrip); nil until one leaves.
	stall atomic.Pointer[trip]

	mu     sync.RWMutex   // protects closed, and wg.Add against Close's wg.Wait
	closed bool           // Close has begun
	wg     sync.WaitGroup // the dispatcher, every batch's goroutine and sender, every inline call
}

// call is one decision in flight. The worker fills res and err, then sends
// on ready (buffered, so it never blocks); a caller that gave up never
// reads it. Take and Charge reuse calls through their Pipe's pool, but only once
// the worker is done with one: after its answer was received.
type call struct {
	ctx context.Context // the caller's, or dl with the Request's Deadline
	// dl is the call's context when its Request has a Deadline, kept
	// across the call's uses; timed says it is in use.
	dl    *deadlineCtx
	timed bool
	key   string
	lim   Limit
	cost  int64  // units (of 1/lim.P token) to take or charge
	mode  mode   // the script's mode
	extra int64  // lease mode: units to lease beyond cost, at most
	once  string // charge mode: the key that makes the charge apply at most once
	// cancelable: never sent from the caller's goroutine (Request.Cancelable)
	cancelable bool
	sent       atomic.Bool
	res        Result
	err        error
	ready      chan struct{}
	// A call sent alone is its own batch, in flight as own; alone points
	// to own then, so that its caller, giving up, lands it.
	one   [1]*call
	own   flight
	alone *flight
	// onCaller: sent from its caller's goroutine, which returns when
	// go-redis does.
	onCaller bool
	// trip is the round trip of the batch the call went out in, set
	// before sent; nil for a call sent alone.
	trip *trip
}

// mode is the script's mode for a call.
type mode uint8

const (
	modeTake      mode = iota // take cost units if the bucket holds them
	modeCharge                // take cost units, never refusing, never below zero
	modeLease                 // take cost units, and up to extra more
	modeReserve               // take cost units if the bucket then owes at most extra
	modePeek                  // report the level; take and write nothing
	modeReset                 // store a full bucket
	modeUnreserve             // give back cost units of a reservation still the bucket's last change
)

// newCall returns a call from p's pool, its ready channel empty.
// With a deadline, the call's context is ctx ending at deadline too.
func (p *Pipe) newCall(ctx context.Context, deadline time.Time, key string, lim Limit, cost int64, m mode) *call {
	c, _ := p.pool.Get().(*call)
	if c == nil {
		c = &call{ready: make(chan struct{}, 1)}
	}
	c.ctx, c.key, c.lim, c.cost, c.mode = ctx, key, lim, cost, m
	if !deadline.IsZero() {
		if c.dl == nil {
			c.dl = new(deadlineCtx)
		}
		c.dl.start(ctx, deadline)
		c.ctx, c.timed = c.dl, true
	}
	return c
}

// release returns c to p's pool. Only for a call whose answer was
// received: nothing else refers to it any more, and ready is empty.
func (p *Pipe) release(c *call) {
	if c.timed {
		c.dl.finish()
	}
	ready, dl := c.ready, c.dl
	*c = call{ready: ready, dl: dl}
	p.pool.Put(c)
}

// leave is what a caller whose context ended does to c: the call may
// still be in flight, and needs its own deadline only.
func (c *call) leave() {
	if c.timed {
		c.dl.letGo()
	}
}

// abandon is what a caller leaving at Close does to c: the call ends, as
// a context's cancel function would end it, so that a call still queued
// or waiting for a connection is not sent.
func (c *call) abandon() {
	if c.timed {
		c.dl.letGo()
		c.dl.cancel()
	}
}

// NewPipe returns a Pipe that runs the script through c on the node n
// (nil means a Node of its own). For a Redis
// Cluster, c is the ClusterClient and every key given to one Pipe should
// live on one master; the client still routes each command and follows
// MOVED and ASK.
//
// A dispatcher goroutine takes the waiting calls as one batch whenever
// fewer than inflight batches (DefaultInFlight if inflight < 1) are in
// flight, and sends each batch from a goroutine of its own. A call alone on
// an idle pipe is sent from its caller's goroutine if c bounds its reads by
// the context's deadline (ContextTimeoutEnabled), the call is not
// Cancelable and the pipe is not opening its connections again
// (reconnect); otherwise it goes to a sender goroutine, which then waits for
// the next such call; at most one sender waits. A batch counts as in flight
// until it is answered or every caller in it has given up: a batch stuck on
// a hung connection, which go-redis may wait on for its whole ReadTimeout,
// does not hold back the next one. Close stops the dispatcher and the
// waiting senders, and waits for them and for every batch's goroutine to
// return.
func NewPipe(c redis.UniversalClient, inflight int, n *Node) *Pipe {
	if inflight < 1 {
		inflight = DefaultInFlight
	}
	if n == nil {
		n = new(Node)
	}
	p := &Pipe{
		c:         c,
		node:      n,
		inline:    boundsReads(c),
		unbounded: readsUnbounded(c),
		calls:     make(chan *call, MaxBatch*inflight),
		lone:      make(chan *call),
		slots:     make(chan struct{}, inflight),
		done:      make(chan struct{}),
	}
	p.ctx, p.cancel = context.WithCancel(context.Background())
	p.wg.Add(1)
	go p.dispatch()
	return p
}

// boundsReads reports whether c stops reading a reply at the context's
// deadline (ContextTimeoutEnabled), so that a caller can wait on it
// directly without risking the client's own, longer, time-outs. A client
// whose ReadTimeout or WriteTimeout is -2 sets no socket deadline at all,
// the context's neither (its options then hold a negative time-out), and
// would hold such a caller for as long as Redis hangs. A client whose
// options are not known (a wrapper that hides them) does not.
func boundsReads(c redis.UniversalClient) bool {
	switch c := c.(type) {
	case interface{ Options() *redis.Options }:
		o := c.Options()
		return o.ContextTimeoutEnabled && o.ReadTimeout >= 0 && o.WriteTimeout >= 0
	case interface{ Options() *redis.ClusterOptions }:
		o := c.Options()
		return o.ContextTimeoutEnabled && o.ReadTimeout >= 0 && o.WriteTimeout >= 0
	}
	return false
}

// readsUnbounded reports whether c may set no deadline of its own on a
// read, and none of the context's either: its ReadTimeout is -1 (none) or
// -2 (no socket deadline at all), without ContextTimeoutEnabled, or its
// options are not known (a wrapper that hides them: what it does cannot
// be told). (After go-redis's defaults, a Client's options hold 0 and -1
// for those, a ClusterClient's 0 and -2.)
func readsUnbounded(c redis.UniversalClient) bool {
	if boundsReads(c) {
		return false
	}
	switch c := c.(type) {
	case interface{ Options() *redis.Options }:
		return c.Options().ReadTimeout <= 0
	case interface{ Options() *redis.ClusterOptions }:
		return c.Options().ReadTimeout <= 0
	}
	return true
}

// Detach runs f and returns once f has returned, or, if c bounds its
// reads by nothing (ReadTimeout -1 without ContextTimeoutEnabled, or -2),
// once ctx ends, whichever is first: a call into a Redis that hangs would
// otherwise hold its caller, whatever ctx says, until Redis answers or the
// client is closed. It returns nil if f returned (or, ctx having ended
// already, was not run); otherwise f goes on in the background, inside
// the client, and the channel returned is closed when it returns. f must
// touch nothing that its caller uses meanwhile.
func Detach(ctx context.Context, c redis.UniversalClient, f func()) <-chan struct{} {
	if !readsUnbounded(c) {
		f()
		return nil
	}
	return detach(ctx, f)
}

// detach is Detach for any client: f runs on a goroutine of its own, and
// detach returns when f has returned or ctx ends. For a call whose budget
// is longer than a client's reads are bounded by go-redis (a client
// without ContextTimeoutEnabled reads for ReadTimeout, 3 s by default,
// whatever ctx says), or whose caller must leave when ctx is cancelled
// (go-redis stops no read at a cancellation).
func detach(ctx context.Context, f func()) <-chan struct{} {
	if ctx.Err() != nil {
		return nil
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		f()
	}()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return done
	}
}

// Request is one run of the token-bucket script on Key's bucket.
type Request struct {
	Key   string
	Limit Limit
	// Units is what to take, in units of 1/Limit.P token (Limit.Units
	// converts tokens); a negative Units gives -Units back, up to the
	// capacity.
	Units int64
	// Charge takes Units without refusing, down to a debt of one burst:
	// the charge for tokens spent without Redis (the script's charge mode).
	// The Result then has Allowed true and the Level left.
	Charge bool
	// Once, with Charge, names the charge so that Redis applies it at
	// most once, however often it is sent: a charge that was sent and not
	// answered is sent again with the same Once, and the same Units or
	// fewer (what is still owed, if part was refunded since). The
	// Result of one applied before has Allowed true and Again true. Once
	// is kept by Redis for OnceFor, in a key beside Key's (OnceKey).
	Once string
	// Lease, above zero, also takes up to Lease more whole tokens if Units
	// are taken, as many as the bucket holds, for the caller to spend
	// without asking Redis again; Result.Leased says how many.
	Lease int64
	// Reserve, above zero, takes Units if the bucket then owes at most
	// Reserve units: Result.Level is then negative by what the caller must
	// wait for, at Limit.Q units a microsecond.
	Reserve int64
	// Peek reports what the bucket holds (Result.Level) without taking
	// anything or writing to Redis, not even a TTL; Units must be 0.
	// Result.Allowed then says whether the bucket is out of debt.
	Peek bool
	// Reset stores a full bucket, whatever the key held; Units must be 0.
	Reset bool
	// Unreserve, above zero, gives back Units of a reservation (Reserve)
	// whose waiter gave up, if it is still the bucket's last change:
	// Unreserve is when its debt is paid, in Redis's microseconds (its
	// Result's Now plus the debt over Limit.Q, rounded up: Due). Behind
	// later reservations it gives nothing back (their waiters keep the
	// times they were told, and a shorter queue would let the next one
	// fall due among theirs). Result.Allowed says whether it gave back.
	// Limit must be the reservation's: the script checks its P, and under
	// another Q (another rate of the same P) the debt it removes is not
	// the one the reservation added.
	Unreserve int64
	// Deadline, if not zero, ends the call there if ctx has not ended it
	// before: Do then behaves as if given context.WithDeadline(ctx,
	// Deadline), without making one (a context, a timer, a channel and a
	// cancel function for every decision).
	Deadline time.Time
	// Cancelable says that ctx may be cancelled before its deadline, or
	// the Pipe closed, and that Do must return then. Without it, a call
	// alone on an idle pipe whose client bounds its reads by the context's
	// deadline (ContextTimeoutEnabled) is sent from the caller's goroutine,
	// which saves a hand-off to another, and once it is written returns at
	// the deadline rather than at a cancellation or Close: go-redis sets a
	// read's deadline when the read begins and does not watch the context
	// (it does while the call waits for a connection).
	Cancelable bool
}

// Do runs the script for r. It returns when Redis answers or ctx ends,
// whichever is first (for a cancellation before ctx's deadline, see
// Request.Cancelable); after ctx ends the call may still reach Redis and
// take tokens there (the error then wraps ErrUnanswered), unless it was
// still queued, in which case it is dropped unsent.
//
// Do never retries: neither here nor, whatever its options, in go-redis,
// because a decision that reached Redis must not be charged twice. The one
// exception is NOSCRIPT, which proves the script did not run: the call is
// sent again once with the script's source.
func (p *Pipe) Do(ctx context.Context, r Request) (Result, error) {
	m := modeTake
	switch {
	case r.Peek:
		m = modePeek
	case r.Reset:
		m = modeReset
	case r.Charge:
		m = modeCharge
	case r.Unreserve > 0:
		m = modeUnreserve
	case r.Reserve > 0:
		m = modeReserve
	case r.Lease > 0:
		m = modeLease
	}
	c := p.newCall(ctx, r.Deadline, r.Key, r.Limit, r.Units, m)
	c.cancelable = r.Cancelable
	if m == modeCharge && r.Once != "" {
		c.once = OnceKey(r.Key, r.Once) // "" for a key that cannot have one
	}
	switch m {
	case modeLease:
		c.extra = r.Limit.Units(r.Lease)
	case modeReserve:
		c.extra = r.Reserve
	case modeUnreserve:
		c.extra = r.Unreserve
	}
	return p.do(c)
}

// Take is Do of n tokens: it takes n tokens if the bucket holds them
// (n > lim.Burst never can: RetryAfter is -1); a negative n gives -n tokens
// back, up to lim.Burst.
func (p *Pipe) Take(ctx context.Context, key string, lim Limit, n int64) (Result, error) {
	return p.Do(ctx, Request{Key: key, Limit: lim, Units: lim.Units(n)})
}

// Lease is Take, and if the n tokens are taken, also takes up to extra
// more whole tokens (Request.Lease).
func (p *Pipe) Lease(ctx context.Context, key string, lim Limit, n, extra int64) (Result, error) {
	return p.Do(ctx, Request{Key: key, Limit: lim, Units: lim.Units(n), Lease: max(extra, 0)})
}

// Charge is Do in charge mode (Request.Charge) of units.
func (p *Pipe) Charge(ctx context.Context, key string, lim Limit, units int64) (Result, error) {
	return p.Do(ctx, Request{Key: key, Limit: lim, Units: units, Charge: true})
}

// do sends c, waits for its answer, and releases c if the answer came.
func (p *Pipe) do(c *call) (Result, error) {
	res, answered, err := p.doCall(c)
	if answered {
		p.release(c)
	}
	return res, err
}

// doCall sends c and waits; answered reports that c's answer was received,
// so that nothing refers to c any more.
func (p *Pipe) doCall(c *call) (res Result, answered bool, err error) {
	ctx := c.ctx
	// Alone on an idle pipe, a call is sent at once: on the caller's own
	// goroutine if the client bounds its reads by the caller's deadline and
	// the call is not Cancelable, else from a goroutine of its own.
	// Otherwise the dispatcher batches it with the others waiting.
	if len(p.calls) == 0 {
		select {
		case p.slots <- struct{}{}:
			if !p.enter() {
				<-p.slots
				return Result{}, true, ErrClosed
			}
			c.one[0] = c
			if p.inline && !c.cancelable && !p.reconnecting.Load() {
				c.onCaller = true
				p.send(c.one[:], &c.own)
				<-c.ready
				return c.res, true, c.err
			}
			c.alone = &c.own
			select {
			case p.lone <- c:
			default:
				// Every sender is busy, or none was started yet: the
				// call's count in p.wg keeps Close waiting, so the
				// sender's own can be added.
				p.wg.Add(1)
				go p.sender(c)
			}
			return p.await(c)
		default:
		}
	}
	select {
	case p.calls <- c:
	case <-ctx.Done():
		return Result{}, true, p.stalled().wrap(ctx.Err())
	case <-p.done:
		return Result{}, true, ErrClosed
	}
	return p.await(c)
}

// await waits for c's answer, its context's end, or Close.
func (p *Pipe) await(c *call) (res Result, answered bool, err error) {
	select {
	case <-c.ready:
		return c.res, true, c.err
	case <-c.ctx.Done():
		c.leave()
		if c.alone != nil {
			// Nobody else waits for this batch: free its slot for the
			// next, as a batch's timer does at its last deadline.
			p.land(c.alone)
		}
		if c.sent.Load() {
			return Result{}, false, c.trip.wrap(fmt.Errorf("%w: %w", ErrUnanswered, c.ctx.Err()))
		}
		return Result{}, false, p.stalled().wrap(c.ctx.Err())
	case <-p.done:
		c.abandon()
		if c.alone != nil {
			p.land(c.alone) // nobody waits for it any more: Close may
		}
		return Result{}, false, ErrClosed
	}
}

// enter counts one more batch in p.wg, unless Close has begun.
func (p *Pipe) enter() bool {
	p.mu.RLock()
	defer p.mu.RUnlock()
	if p.closed {
		return false
	}
	p.wg.Add(1)
	return true
}

// Close stops the dispatcher and waits for it and for every batch in
// flight: the client's own time-outs bound them, or for a client that
// bounds its reads by the context, the calls' deadlines (connectFor later
// while reconnect runs, see linger). Calls still queued get ErrClosed.
// Close is idempotent.
//
// A client that bounds its reads by nothing (see readsUnbounded) would
// hold Close for as long as Redis hangs: Close then waits only until no
// caller waits for a batch any more (each has its deadline), and a batch
// still in go-redis returns when Redis answers or the client is closed.
func (p *Pipe) Close() {
	p.mu.Lock()
	if !p.closed {
		p.closed = true
		close(p.done)
		p.cancel()
	}
	p.mu.Unlock()
	if !p.unbounded {
		p.wg.Wait()
		return
	}
	gone := make(chan struct{})
	go func() {
		p.wg.Wait()
		close(gone)
	}()
	// Every slot is freed once its batch is answered or nobody waits for
	// it: holding them all, Close knows no caller waits on the pipe.
	for range cap(p.slots) {
		select {
		case p.slots <- struct{}{}:
		case <-gone:
			return
		}
	}
	for range cap(p.slots) {
		<-p.slots
	}
}

// dispatch forms batches and starts a goroutine for each, until Close.
func (p *Pipe) dispatch() {
	defer p.wg.Done()
	for {
		var first *call
		select {
		case first = <-p.calls:
		case <-p.done:
			return
		}
		// Wait for a slot; calls arriving meanwhile join this batch.
		select {
		case p.slots <- struct{}{}:
		case <-p.done:
			return
		}
		batch := make([]*call, 1, 8)
		batch[0] = first
	fill:
		for len(batch) < MaxBatch {
			select {
			case c := <-p.calls:
				batch = append(batch, c)
			default:
				break fill
			}
		}
		if !p.enter() {
			<-p.slots
			return
		}
		go p.send(batch, nil)
	}
}

// flight is a batch in flight. It holds one of the pipe's slots until
// land is called, once: when the batch is answered, or when nobody waits
// for it any more.
type flight struct {
	landed atomic.Bool
	trip   trip // of a batch of several calls
}

// land frees f's slot, unless it was freed already. The calls that leave
// unsent from then on wait for another slot: a stall of their own.
func (p *Pipe) land(f *flight) {
	if f.landed.CompareAndSwap(false, true) {
		p.stall.Store(nil)
		<-p.slots
	}
}

// trip is one piece of evidence of a node's health that several calls
// share: a round trip that carried them, or a wait for a slot that none of
// them outlived.
type trip struct{ counted atomic.Bool }

// tripError is the failure of a call that shares its trip with others.
type tripError struct {
	err  error
	trip *trip
}

func (e *tripError) Error() string { return e.err.Error() }
func (e *tripError) Unwrap() error { return e.err }

// wrap returns err, a call's failure, tied to t; err itself if t is nil.
func (t *trip) wrap(err error) error {
	if t == nil {
		return err
	}
	return &tripError{err, t}
}

// stalled returns the stall the calls leaving unsent now share.
func (p *Pipe) stalled() *trip {
	for {
		if t := p.stall.Load(); t != nil {
			return t
		}
		if t := new(trip); p.stall.CompareAndSwap(nil, t) {
			return t
		}
	}
}

// ClaimTrip reports whether err, the failure of a call returned by a
// Pipe, is the first of its trip to be counted against the node, and
// counts it. A round trip that carried several calls and failed (not
// answered, its connection lost) is one piece of evidence of the node's
// health, however many calls it carried, and so is one wait for a slot
// that several calls left unsent: counted per call, one answer 30 ms
// late to a pipeline of five, or five calls queued behind it, would open a
// breaker that five calls sent one by one must each fail to open. A call
// sent alone is its own trip: always true. Claim only a failure that
// counts (not a caller's own cancellation): the first claim takes the
// trip's one count.
func ClaimTrip(err error) bool {
	var te *tripError
	if !errors.As(err, &te) {
		return true
	}
	return te.trip.counted.CompareAndSwap(false, true)
}

// send runs one batch and frees its slot when it is answered or when its
// callers have given up, whichever is first. For a call sent alone, f is
// the call's own flight, which its caller lands on giving up; for a
// dispatcher's batch f is nil, and a timer lands the batch at its last
// caller's deadline. It requires a slot taken and p.wg counted for it.
func (p *Pipe) send(batch []*call, f *flight) {
	defer p.wg.Done()
	if f == nil {
		f = new(flight)
		if deadline, ok := lastDeadline(batch); ok {
			t := time.AfterFunc(time.Until(deadline), func() { p.land(f) })
			defer t.Stop()
		}
	}
	p.run(batch, f)
}

// sender sends c, a call alone, then parks on p.lone for the next one,
// unless another sender is parked already, until Close: one is enough for
// a caller that decides one key after another, and a parked goroutine
// keeps its stack, which a process of thousands of idle Limiters would
// multiply. A sender stuck on a hung connection keeps its call's slot
// only until the caller gives up; the next lone call then starts a sender
// of its own. It requires a slot taken and p.wg counted for c, and p.wg
// counted for the sender.
func (p *Pipe) sender(c *call) {
	defer p.wg.Done()
	for {
		p.send(c.one[:], &c.own)
		if p.parked.Add(1) > 1 {
			p.parked.Add(-1)
			return
		}
		select {
		case c = <-p.lone:
			p.parked.Add(-1)
		case <-p.done:
			p.parked.Add(-1)
			return
		}
	}
}

// lastDeadline returns the latest deadline of the calls in batch; ok is
// false if one of them has none.
func lastDeadline(batch []*call) (deadline time.Time, ok bool) {
	for _, c := range batch {
		d, has := c.ctx.Deadline()
		if !has {
			return time.Time{}, false
		}
		if d.After(deadline) {
			deadline = d
		}
	}
	return deadline, true
}

// run sends one batch, lands f, then answers every call in it. Landing
// comes first: once answered, a call (and the flight in it) may be reused.
func (p *Pipe) run(batch []*call, f *flight) {
	answered, cut := false, false
	key := batch[0].key
	defer func() {
		p.land(f)
		for _, c := range batch {
			c.ready <- struct{}{}
		}
		if answered {
			p.tend(key)
		}
		if cut && p.inline {
			p.reconnect(key)
		}
	}()
	// Drop what nobody waits for any more: sending it would spend tokens
	// for a decision already given up.
	live := 0
	for _, c := range batch {
		if err := c.ctx.Err(); err != nil {
			c.res, c.err = Result{}, p.stalled().wrap(err) // left unsent, as in await
			continue
		}
		if len(batch) > 1 {
			c.trip = &f.trip
		}
		c.sent.Store(true)
		live++
	}
	switch {
	case live == 0:
		return
	case len(batch) == 1:
		// The caller's own context: a client with ContextTimeoutEnabled
		// stops reading at its deadline.
		c := batch[0]
		// Assigned once, so that the closure below copies it rather than
		// moving it to the heap.
		ctx, stop := p.wire(c)
		defer stop()
		var cmds [1]noRetryCmd
		p.node.exchange(ctx, p.c, c.key, cmds[:], zero[:], func(_ int, v verb, now int64) noRetryCmd {
			return p.evalCmd(ctx, v, now, c)
		})
		c.result(cmds[0], cmds[0].Err())
		answered, cut = c.err == nil, isTimeout(cmds[0].Err())
		return
	}

	// One context for the round trip, ending with the last caller's
	// deadline.
	ctx := context.Background()
	if deadline, ok := lastDeadline(batch); ok {
		if p.inline && p.reconnecting.Load() {
			// As linger: the callers leave at their deadlines.
			ctx, deadline = p.ctx, deadline.Add(connectFor)
		}
		var cancel context.CancelFunc
		ctx, cancel = context.WithDeadline(ctx, deadline)
		defer cancel()
	}

	cmds := make([]noRetryCmd, len(batch))
	which := make([]int, 0, live)
	for i, c := range batch {
		if c.sent.Load() {
			which = append(which, i)
		}
	}
	p.node.exchange(ctx, p.c, key, cmds, which, func(i int, v verb, now int64) noRetryCmd {
		return p.evalCmd(ctx, v, now, batch[i])
	})
	for i, c := range batch {
		if cmds[i].Cmd != nil {
			err := cmds[i].Err()
			if live > 1 && IsUnsent(err) {
				// A pipeline takes several writes; Redis may have run the
				// commands of the first before a later one failed, and
				// go-redis gives every command the same error. Only a
				// command written alone is known not to have run.
				err = fmt.Errorf("%w: %v", ErrUnanswered, err)
			}
			c.result(cmds[i], err)
			if err != nil && !isReply(err) {
				c.err = c.trip.wrap(c.err)
			}
			cut = cut || isTimeout(err)
			answered = answered || c.err == nil
		}
	}
}

// zero is the calls to send of a batch of one.
var zero = [1]int{0}

// checkFor bounds the background work of tend.
const checkFor = time.Second

// tend does, off the decisions' path and one at a time, what p's node
// needs after a call answered: a check whether it runs functions, until
// known, and a fresh reading of its clock while its scripts may not read
// TIME. key names the node for a Cluster.
func (p *Pipe) tend(key string) {
	n := p.node
	if !n.needsTending() {
		return
	}
	p.background(&n.busy, checkFor, func(ctx context.Context) {
		n.tendNow(ctx, nodeClient(ctx, p.c, key))
	})
}

// background runs f on a goroutine of its own, with a context that Close
// cancels and that ends within bound, unless busy says one like it runs
// already or Close has begun; busy is set while f runs, and Close waits
// for it.
func (p *Pipe) background(busy *atomic.Bool, bound time.Duration, f func(context.Context)) {
	if !busy.CompareAndSwap(false, true) {
		return
	}
	if !p.enter() {
		busy.Store(false)
		return
	}
	go func() {
		defer p.wg.Done()
		defer busy.Store(false)
		ctx, cancel := context.WithTimeout(p.ctx, bound)
		defer cancel()
		f(ctx)
	}()
}

// connectFor bounds reconnect's work.
const connectFor = time.Second

// reconnect opens again, in the background and one round at a time, the
// connections that a call to key's node may just have lost. A client that
// bounds its reads by the context closes a connection whose read the
// deadline cut short, and the next call on the node that finds no idle one
// dials its own inside its budget: the dial, go-redis's handshake (HELLO,
// and TLS's) and the call are three round trips or more. A budget shorter
// than that (a Redis far away, a caller's short deadline) loses that
// connection too, and the next, call after call: the node answers every
// PING and never a call in time, and its breaker, once open, never closes,
// as each probe dials too. Off the calls' path, the connections get the
// time they take, and the calls find them in the pool. Any deadline of a
// call that was sent starts a round: go-redis tells a handshake cut short
// by the context's error, as it tells a wait for a pool turn that lost
// nothing (the round then only pings).
func (p *Pipe) reconnect(key string) {
	p.background(&p.reconnecting, connectFor, func(ctx context.Context) {
		var c redis.Cmdable = p.c
		if cc, ok := p.c.(*redis.ClusterClient); ok {
			// The key's master, not any node the client would pick.
			m, err := cc.MasterForKey(ctx, key)
			if err != nil {
				return
			}
			c = m
		}
		// As many PINGs at once as the pipe keeps calls busy, each on a
		// connection of the pool's (idle, or dialed for it), which goes
		// back to the pool at its answer: the calls need them. Not
		// through connections of their own (c.Conn(), as Ping does): a
		// handshake refused there records what go-redis learned under
		// another lock than the one a decision's handshake takes.
		var wg sync.WaitGroup
		for range cap(p.slots) {
			wg.Go(func() { _ = c.Ping(ctx).Err() })
		}
		wg.Wait()
	})
}

// result records cmd's outcome, err, as c's answer, for run to deliver.
func (c *call) result(cmd noRetryCmd, err error) {
	switch {
	case err != nil && isTimeout(err):
		// The deadline passed with the command written: Redis may still
		// run it. Reported as the deadline, like a caller that gave up.
		c.res, c.err = Result{}, fmt.Errorf("%w: %w: %w", ErrUnanswered, context.DeadlineExceeded, err)
	case err != nil:
		c.res, c.err = Result{}, err
	default:
		c.res, c.err = parseReply(cmd.Val(), c.lim, c.cost, c.mode)
	}
}

// wire returns the context c, a call sent alone, goes out with: its own,
// or linger's while reconnect runs and c was not sent from its caller's
// goroutine. stop releases it.
func (p *Pipe) wire(c *call) (_ context.Context, stop func()) {
	if p.inline && !c.onCaller && p.reconnecting.Load() {
		if deadline, ok := c.ctx.Deadline(); ok {
			return p.linger(c.ctx, deadline)
		}
	}
	return c.ctx, nothing
}

// nothing is a stop function with nothing to stop.
func nothing() {}

// linger returns the context a call sent from one of p's goroutines goes
// out with while reconnect runs: ctx's values, and ctx's cancellation by
// its caller or by Close, but a deadline connectFor later than ctx's own.
// The call's caller still leaves at its deadline (await); the connection
// the call may be opening finishes its handshake meanwhile, rather than
// being closed half-way by the deadline, and goes back to the pool for
// the next call. stop releases what linger made.
func (p *Pipe) linger(ctx context.Context, deadline time.Time) (_ context.Context, stop func()) {
	wire, cancel := context.WithDeadline(context.WithoutCancel(ctx), deadline.Add(connectFor))
	byCaller := context.AfterFunc(ctx, func() {
		if errors.Is(ctx.Err(), context.Canceled) {
			cancel()
		}
	})
	byClose := context.AfterFunc(p.ctx, cancel)
	return wire, func() {
		byCaller()
		byClose()
		cancel()
	}
}

// isTimeout reports whether err is a deadline: the context's, or a socket's.
func isTimeout(err error) bool {
	if err == nil {
		return false // before ne, which escapes: every answered call asks
	}
	var ne net.Error
	return errors.Is(err, context.DeadlineExceeded) || errors.Is(err, os.ErrDeadlineExceeded) ||
		errors.As(err, &ne) && ne.Timeout()
}

// noRetryCmd is a script call that go-redis must never retry: the script
// may have run before the error, and a retry would take the tokens twice.
type noRetryCmd struct{ *redis.Cmd }

// NoRetry tells go-redis not to retry the command, whatever MaxRetries says.
func (noRetryCmd) NoRetry() bool { return true }

// evalCmd returns the call of c by v. Unless now is 0, when the script
// reads TIME itself, it passes now (Redis's clock, in microseconds) as
// ARGV[7], after the mode and its argument, "" where there are none.
func (p *Pipe) evalCmd(ctx context.Context, v verb, now int64, c *call) noRetryCmd {
	head := &takeScript.head[v]
	b := p.box(c.lim)
	var cost any = c.cost
	if c.cost == c.lim.P {
		cost = b.p // one token, the common case: boxed already
	}
	keys, extra := 1, 0 // keys, and the mode's arguments
	switch c.mode {
	case modeCharge:
		extra = 1
		if c.once != "" {
			keys, extra = 2, 2
		}
	case modeLease, modeReserve, modeUnreserve:
		extra = 2
	case modePeek, modeReset:
		extra = 1
	}
	size := 3 + keys + 4 + extra
	if now != 0 {
		size = 3 + keys + 7
	}
	// One allocation, of the size the call needs: NewCmd keeps the slice.
	args := make([]any, 0, size)
	args = append(args, head[0], head[1], keys, c.key)
	if keys == 2 {
		args = append(args, c.once)
	}
	args = append(args, b.q, b.p, b.cap, cost)
	switch c.mode {
	case modeCharge:
		args = append(args, "charge")
		if keys == 2 {
			args = append(args, onceForMillis)
		}
	case modeLease:
		args = append(args, "lease", c.extra)
	case modeReserve:
		args = append(args, "reserve", c.extra)
	case modeUnreserve:
		args = append(args, "unreserve", c.extra)
	case modePeek:
		args = append(args, "peek")
	case modeReset:
		args = append(args, "reset")
	}
	if now != 0 {
		for len(args) < 3+keys+6 {
			args = append(args, "")
		}
		args = append(args, formatMicros(now))
	}
	return noRetryCmd{redis.NewCmd(ctx, args...)}
}

// boxed is a Limit's numbers as the interface values a command's
// arguments hold, kept so that a decision does not box them again.
type boxed struct {
	lim       Limit
	q, p, cap any
}

// box returns lim's numbers boxed, from the last limit boxed if it is the
// same (one limit for every key is the common case).
func (p *Pipe) box(lim Limit) *boxed {
	if b := p.boxed.Load(); b != nil && b.lim == lim {
		return b
	}
	b := &boxed{lim: lim, q: lim.Q, p: lim.P, cap: lim.Cap()}
	p.boxed.Store(b)
	return b
}

func isNoScript(err error) bool {
	return err != nil && redis.HasErrorPrefix(err, "NOSCRIPT")
}

// OnceFor is how long Redis remembers a charge's Once: a charge sent again
// later than that after the first one ran is applied again. An instance
// sends an unanswered charge again at its next reconciliation, within a
// second of Redis answering it again; ten minutes cover an outage that
// began right after Redis ran the charge, and bound the keys kept, one
// small key per charge.
const OnceFor = 10 * time.Minute

var onceForMillis = OnceFor.Milliseconds()

// Due returns when the debt a reservation answered by res leaves is paid,
// in Redis's microseconds: what Request.Unreserve names.
func Due(res Result, lim Limit) int64 {
	if res.Level >= 0 {
		return 0
	}
	return res.Now + ceilDiv(-res.Level, lim.Q)
}

// OnceKey returns the key under which Redis remembers charge once of key,
// in key's Cluster slot so that one script may touch both: key's hash tag
// kept, or key made the tag. It starts with key where it can, so that a
// Redis ACL that lets the limiter's user touch only keys under its Prefix
// (~prefix*) lets it write the charge's name too. It returns "" for the
// rare key that cannot have one in its slot (a '}' without a tag before
// it): its charges are sent without a Once, and one sent again may be
// applied twice.
func OnceKey(key, once string) string {
	slot := Slot(key)
	for _, k := range []string{key + ":once:" + once, key + ":once{" + key + "}:" + once, "{" + key + "}:once:" + once} {
		if Slot(k) == slot {
			return k
		}
	}
	return ""
}

// Node returns what p knows of its node, to share with another Pipe to
// the same node.
func (p *Pipe) Node() *Node { return p.node }
