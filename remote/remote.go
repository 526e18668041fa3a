// Package remote runs hybridlimit's token-bucket script on Redis.
//
// A Pipe serves one Redis node. Callers hand it decisions; a few worker
// goroutines send them, one EVALSHA when a decision is alone and one
// pipeline when several are waiting, so concurrent decisions share round
// trips. The caller waits for its answer only until its context ends: a
// Redis that hangs costs the caller its own deadline, never the client's
// socket time-outs, whatever the client's options say.
package remote

import (
	"context"
	"errors"
	"strconv"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/hybridlimit/hybridlimit/lua"
)

// ErrClosed is returned by Take after Close.
var ErrClosed = errors.New("remote: pipe closed")

// script is the token-bucket script; its Hash is what EVALSHA sends.
var script = redis.NewScript(lua.TokenBucket)

// Hash returns the SHA1 of the token-bucket script, as EVALSHA uses it.
func Hash() string { return script.Hash() }

// Defaults for NewPipe.
const (
	// DefaultWorkers is how many batches may be in flight at once on one
	// node: enough to overlap a round trip with the next batch's writing.
	DefaultWorkers = 4
	// MaxBatch bounds the decisions sent in one pipeline.
	MaxBatch = 128
)

// Pipe sends token-bucket decisions for one Redis node, coalescing those
// that arrive together into pipelines. Pipe is safe for concurrent use.
type Pipe struct {
	c     redis.UniversalClient
	calls chan *call
	done  chan struct{}
	wg    sync.WaitGroup
	once  sync.Once
}

// call is one decision in flight. The worker fills res and err, then sends
// on ready (buffered, so it never blocks); a caller that gave up never
// reads it.
type call struct {
	ctx   context.Context
	key   string
	lim   Limit
	n     int64
	res   Result
	err   error
	ready chan struct{}
}

// NewPipe returns a Pipe that runs the script through c. For a Redis
// Cluster, c is the ClusterClient and every key given to one Pipe should
// live on one master; the client still routes each command and follows
// MOVED and ASK. NewPipe starts workers goroutines (DefaultWorkers if
// workers < 1); Close stops them and waits for them to return.
func NewPipe(c redis.UniversalClient, workers int) *Pipe {
	if workers < 1 {
		workers = DefaultWorkers
	}
	p := &Pipe{
		c:     c,
		calls: make(chan *call, MaxBatch*workers),
		done:  make(chan struct{}),
	}
	p.wg.Add(workers)
	for range workers {
		go p.work()
	}
	return p
}

// Take runs the script for key: it takes n tokens if the bucket holds them.
// It returns when Redis answers or ctx ends, whichever is first; after ctx
// ends the decision may still reach Redis and take tokens there, unless it
// was still queued, in which case it is dropped unsent.
//
// Take never retries: neither here nor, whatever its options, in go-redis,
// because a decision that reached Redis must not be charged twice. The one
// exception is NOSCRIPT, which proves the script did not run: the decision
// is sent again once with the script's source.
func (p *Pipe) Take(ctx context.Context, key string, lim Limit, n int64) (Result, error) {
	c := &call{ctx: ctx, key: key, lim: lim, n: n, ready: make(chan struct{}, 1)}
	select {
	case p.calls <- c:
	case <-ctx.Done():
		return Result{}, ctx.Err()
	case <-p.done:
		return Result{}, ErrClosed
	}
	select {
	case <-c.ready:
		return c.res, c.err
	case <-ctx.Done():
		return Result{}, ctx.Err()
	case <-p.done:
		return Result{}, ErrClosed
	}
}

// Close stops the workers and waits for them to return. A batch in flight
// is waited for: the client's own time-outs bound it. Close is idempotent.
func (p *Pipe) Close() {
	p.once.Do(func() { close(p.done) })
	p.wg.Wait()
}

func (p *Pipe) work() {
	defer p.wg.Done()
	batch := make([]*call, 0, MaxBatch)
	pl := p.c.Pipeline()
	for {
		batch = batch[:0]
		select {
		case c := <-p.calls:
			batch = append(batch, c)
		case <-p.done:
			return
		}
	fill:
		for len(batch) < MaxBatch {
			select {
			case c := <-p.calls:
				batch = append(batch, c)
			default:
				break fill
			}
		}
		p.run(pl, batch)
	}
}

// run sends one batch and answers every call in it.
func (p *Pipe) run(pl redis.Pipeliner, batch []*call) {
	// Drop what nobody waits for any more: sending it would spend tokens
	// for a decision already given up.
	live := batch[:0]
	var deadline time.Time
	unbounded := false
	for _, c := range batch {
		if err := c.ctx.Err(); err != nil {
			c.finish(Result{}, err)
			continue
		}
		if d, ok := c.ctx.Deadline(); !ok {
			unbounded = true
		} else if d.After(deadline) {
			deadline = d
		}
		live = append(live, c)
	}
	if len(live) == 0 {
		return
	}
	// One context for the round trip, ending with the last caller's
	// deadline: a client with ContextTimeoutEnabled stops reading then.
	ctx := context.Background()
	if !unbounded {
		var cancel context.CancelFunc
		ctx, cancel = context.WithDeadline(ctx, deadline)
		defer cancel()
	}

	if len(live) == 1 {
		c := live[0]
		cmd := evalCmd(ctx, "evalsha", script.Hash(), c)
		err := p.c.Process(ctx, cmd)
		if isNoScript(err) {
			cmd = evalCmd(ctx, "eval", lua.TokenBucket, c)
			err = p.c.Process(ctx, cmd)
		}
		c.finishCmd(cmd, err)
		return
	}

	cmds := make([]noRetryCmd, len(live))
	for i, c := range live {
		cmds[i] = evalCmd(ctx, "evalsha", script.Hash(), c)
		_ = pl.Process(ctx, cmds[i])
	}
	_, _ = pl.Exec(ctx)
	var again []int
	for i, cmd := range cmds {
		if isNoScript(cmd.Err()) {
			again = append(again, i)
		}
	}
	if len(again) > 0 {
		// The node lost its script cache (restart, failover, SCRIPT FLUSH):
		// EVAL carries the source and loads it again.
		for _, i := range again {
			cmds[i] = evalCmd(ctx, "eval", lua.TokenBucket, live[i])
			_ = pl.Process(ctx, cmds[i])
		}
		_, _ = pl.Exec(ctx)
	}
	for i, c := range live {
		c.finishCmd(cmds[i], cmds[i].Err())
	}
}

func (c *call) finishCmd(cmd noRetryCmd, err error) {
	if err != nil {
		c.finish(Result{}, err)
		return
	}
	c.finish(parseReply(cmd.Val()))
}

func (c *call) finish(res Result, err error) {
	c.res, c.err = res, err
	c.ready <- struct{}{}
}

// noRetryCmd is a script call that go-redis must never retry: the script
// may have run before the error, and a retry would take the tokens twice.
type noRetryCmd struct{ *redis.Cmd }

// NoRetry tells go-redis not to retry the command, whatever MaxRetries says.
func (noRetryCmd) NoRetry() bool { return true }

func evalCmd(ctx context.Context, verb, script string, c *call) noRetryCmd {
	return noRetryCmd{redis.NewCmd(ctx, verb, script, 1, c.key,
		strconv.FormatInt(c.lim.Q, 10),
		strconv.FormatInt(c.lim.P, 10),
		strconv.FormatInt(c.lim.Burst, 10),
		strconv.FormatInt(c.n, 10),
	)}
}

func isNoScript(err error) bool {
	return err != nil && redis.HasErrorPrefix(err, "NOSCRIPT")
}
