package remote

import (
	"context"
	"errors"
	"io"
	"net"
	"strings"
	"syscall"

	"github.com/redis/go-redis/v9"
)

// IsFailure reports whether err means that the Redis node is unhealthy.
//
// Errors the server answered with (they implement redis.Error) are failures
// only if they name a server state in which the node cannot decide: LOADING,
// READONLY, MASTERDOWN, CLUSTERDOWN, OOM, BUSY, TRYAGAIN, NOREPLICAS,
// MISCONF, a MOVED or ASK that reached the caller, and "max number of
// clients reached", also when Redis 6 wraps one of these in a script's
// error. Any other server error (WRONGTYPE, ERR ..., NOSCRIPT, redis.Nil)
// means the node is healthy. (Over a Cluster, a MOVED or ASK
// means a healthy node that refused the call: ask Redirected first.)
//
// Errors the server did not answer with are failures: network errors
// (net.Error, time-outs included; io.EOF, io.ErrUnexpectedEOF; refused or
// reset connections and other syscall errors), context.DeadlineExceeded
// (our own time budget ran out), and go-redis's pool errors
// (redis.ErrPoolTimeout, redis.ErrPoolExhausted, redis.ErrClosed). So is
// any other client-side error, such as an unparsable reply, since it too
// means the remote path does not work.
//
// context.Canceled is never a failure: only a caller cancels.
//
// A call of the limiter's scripts asks more of an error reply: unless it
// is about the call's key (IsKeyError), the node cannot decide for it.
func IsFailure(err error) bool {
	if err == nil || errors.Is(err, context.Canceled) {
		return false
	}
	var rerr redis.Error
	if !errors.As(err, &rerr) {
		return true
	}
	// go-redis's helpers look for typed errors and fall back to the message
	// prefix; give them the server's error itself, whatever wraps it.
	if _, ok := redis.IsMovedError(rerr); ok {
		return true
	}
	if _, ok := redis.IsAskError(rerr); ok {
		return true
	}
	return redis.IsLoadingError(rerr) ||
		redis.IsReadOnlyError(rerr) ||
		redis.IsMasterDownError(rerr) ||
		redis.IsClusterDownError(rerr) ||
		redis.IsOOMError(rerr) ||
		redis.IsTryAgainError(rerr) ||
		redis.IsNoReplicasError(rerr) ||
		redis.IsMaxClientsError(rerr) ||
		// No helpers exist for these two. The space keeps BUSYKEY and
		// BUSYGROUP out; they are answers, not states.
		redis.HasErrorPrefix(rerr, "BUSY ") ||
		redis.HasErrorPrefix(rerr, "MISCONF ") ||
		scriptRefused(rerr.Error())
}

// IsKeyError reports whether err is Redis's answer about one call's key or
// the script's run on it rather than about the node: WRONGTYPE, one of the
// scripts' own error replies (ERR hybridlimit ...), or an error the script
// met running (Redis 7: ERR user_script:... or user_function:...; Redis 6:
// ERR Error running script ...) that does not wrap a refusal of the node
// (OOM, READONLY, NOPERM, ...). A node that answers so is healthy, and a
// call on another key may well succeed. Any other error reply means the
// node cannot decide for the limiter: a handshake refused (WRONGPASS,
// NOAUTH: rotated credentials), an ACL (NOPERM), a command the server does
// not run, or a proxy's own error when its backend is away ("no upstream
// host"); so do the states IsFailure lists.
func IsKeyError(err error) bool {
	var rerr redis.Error
	if !errors.As(err, &rerr) {
		return false
	}
	if redis.HasErrorPrefix(rerr, "WRONGTYPE") {
		return true
	}
	msg := rerr.Error()
	if !strings.HasPrefix(msg, "ERR ") || scriptRefused(msg) {
		return false
	}
	for _, wrapped := range [...]string{"-NOPERM ", "-NOAUTH ", "-WRONGPASS ", "-BUSY ", "-LOADING ", "-MASTERDOWN ", "-CLUSTERDOWN ", "-TRYAGAIN "} {
		if strings.Contains(msg, wrapped) {
			return false
		}
	}
	return strings.HasPrefix(msg, "ERR hybridlimit ") || strings.Contains(msg, "user_script") ||
		strings.Contains(msg, "user_function") || strings.Contains(msg, "Error running script")
}

// scriptRefused reports whether msg is Redis 6's report of a write that a
// script's redis.call met on a node that cannot decide: before Redis 7 the
// refusal's code comes wrapped, as "ERR Error running script (call to
// f_...): @user_script:N: -OOM ...". (go-redis recognizes READONLY so.)
func scriptRefused(msg string) bool {
	if !strings.Contains(msg, "Error running script") {
		return false
	}
	for _, code := range [...]string{"-OOM ", "-MISCONF ", "-NOREPLICAS ", "-READONLY "} {
		if strings.Contains(msg, code) {
			return true
		}
	}
	return false
}

// Redirected reports whether err is a Cluster node's MOVED or ASK reply,
// and the address it names: the node did not run the command, since the
// key's slot is served at addr, for good (MOVED) or, while the slot
// migrates, for this key after an ASKING (ask).
func Redirected(err error) (addr string, ask, ok bool) {
	if err == nil {
		return "", false, false // before rerr, which escapes: every answered call asks
	}
	var rerr redis.Error
	if !errors.As(err, &rerr) {
		return "", false, false
	}
	if addr, ok := redis.IsMovedError(rerr); ok {
		return addr, false, true
	}
	if addr, ok := redis.IsAskError(rerr); ok {
		return addr, true, true
	}
	return "", false, false
}

// IsBrokenConn reports whether err says that the connection a command went
// out on was already closed or reset by the other end: what a client
// meets on the connections it pooled before a restart, a failover or a
// proxy's reset, one connection after another. A time-out is not one.
func IsBrokenConn(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE) ||
		errors.Is(err, net.ErrClosed)
}

// IsUnsent reports whether err says that a command never left: writing it
// failed on a connection already closed or reset (a kernel that received
// the peer's reset refuses the write). Such a command did not run, so it
// may be sent again on another connection.
func IsUnsent(err error) bool {
	if err == nil || !IsBrokenConn(err) {
		return false // before op, which escapes: every answered call asks
	}
	var op *net.OpError
	return errors.As(err, &op) && op.Op == "write"
}

// MayHaveRun reports whether a call that failed with err may have run in
// Redis although no answer said so: it was sent and its answer did not
// come (a time-out, a connection lost after the write). An error reply is
// an answer; a call that never left (IsUnsent, a dial that failed, a
// heartbeat held back behind an unanswered one) did not run.
func MayHaveRun(err error) bool {
	if err == nil || errors.Is(err, errStuck) || IsUnsent(err) {
		return false
	}
	var rerr redis.Error
	if errors.As(err, &rerr) {
		return false
	}
	var op *net.OpError
	return !errors.As(err, &op) || op.Op != "dial"
}

// isReply reports whether err is an error the server answered with.
func isReply(err error) bool {
	var rerr redis.Error
	return errors.As(err, &rerr)
}
