// Package simredis is the Redis of the simulator: an in-process server that
// speaks RESP2 to go-redis and runs Go models of hybridlimit's two scripts
// (lua/tokenbucket.lua and lua/fleet.lua) under their SHA1s, with EVALSHA,
// EVAL, SCRIPT LOAD and FLUSH, NOSCRIPT, TIME, GET, DEL and PTTL. It has no
// functions: FUNCTION and FCALL are unknown commands, as on Redis 6, so the
// limiter runs the scripts by EVALSHA against it.
//
// It exists because miniredis runs each script call in a fresh gopher-lua
// state, about 0.5 ms under the race detector, which leaves too few calls
// per seed for thousands of seeds a minute; the models run in microseconds.
// TestModelMatchesRedis proves the bucket model equal to the Lua script on
// a real redis-server: the same replies, the same stored bytes, the same TTL.
//
// Time is time.Now (virtual inside a testing/synctest bubble) plus a skew
// that a test sets to model a failover to a host whose clock is behind.
// TIME and key expiry both follow it, as they would on that host.
package simredis

import (
	"bytes"
	"crypto/sha1"
	"encoding/hex"
	"fmt"
	"math"
	"net"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/hybridlimit/hybridlimit/internal/simnet"
	"github.com/hybridlimit/hybridlimit/lua"
)

// The scripts the server knows, by SHA1.
var (
	bucketSHA = sha(lua.TokenBucket)
	fleetSHA  = sha(lua.Fleet)
)

func sha(src string) string {
	h := sha1.Sum([]byte(src))
	return hex.EncodeToString(h[:])
}

// scriptSHA is sha(src), without hashing the two sources the server knows,
// which every instance loads.
func scriptSHA(src string) string {
	switch src {
	case lua.TokenBucket:
		return bucketSHA
	case lua.Fleet:
		return fleetSHA
	}
	return sha(src)
}

type value struct {
	s      []byte   // a string
	fields []string // a hash: field, value, field, value ... in insertion order
	hash   bool
	expire time.Time // zero: none; in the server's clock
}

// Server is an in-process Redis. Server is safe for concurrent use.
type Server struct {
	mu      sync.Mutex // protects every field below
	data    map[string]*value
	scripts map[string]bool
	skew    time.Duration
	calls   int // script calls run
	closed  bool
	conns   map[net.Conn]struct{}

	wg sync.WaitGroup // one per connection served from a goroutine

	// Hook, if not nil, is called with s's lock held after every call of
	// the bucket script, with the tag of the connection it came on and the
	// charge's marker (KEYS[2], "" if none). Set it before serving; it
	// must not call s.
	Hook func(tag int, key, marker string, argv []string, reply any)

	// FleetHook, if not nil, is called like Hook after every call of the
	// fleet script (a heartbeat) that read a closed window: from its
	// answer on, the instance knows its fleet.
	FleetHook func(tag int)

	// Set by a Cluster (cluster.go) before serving; nil on a lone server.
	moved      func(key string) string    // "MOVED slot addr" if the node does not own key's slot
	clusterCmd func(args []string) any    // CLUSTER
	wrote      func(key string, v *value) // after a command wrote key (v nil: deleted), for the replica
}

// New returns an empty Server with an empty script cache.
func New() *Server {
	return &Server{data: map[string]*value{}, scripts: map[string]bool{}, conns: map[net.Conn]struct{}{}}
}

// Serve serves conn until conn fails or Close; tag names the client for
// Hook. The server end of a simnet connection is answered in the client's
// goroutine, as a simnet.Handler; any other conn from a goroutine of its
// own.
func (s *Server) Serve(conn net.Conn, tag int) {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		conn.Close()
		return
	}
	s.conns[conn] = struct{}{}
	s.mu.Unlock()
	forget := func() {
		s.mu.Lock()
		delete(s.conns, conn)
		s.mu.Unlock()
	}
	sess := &session{s: s, tag: tag}
	if end, ok := conn.(*simnet.ServerEnd); ok {
		end.Handle(sess, forget)
		return
	}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		defer func() {
			forget()
			conn.Close()
		}()
		buf := make([]byte, 4096)
		for {
			n, err := conn.Read(buf)
			if err != nil {
				return // a reset or a close: the connection is gone
			}
			reply, ok := sess.Handle(buf[:n])
			if len(reply) > 0 {
				if _, err := conn.Write(reply); err != nil {
					return
				}
			}
			if !ok {
				return
			}
		}
	}()
}

// session is one connection's commands, read as they come.
type session struct {
	s   *Server
	tag int
	buf []byte // what was read of a command not yet whole
}

// Handle runs the commands whole in what was read so far, in order, and
// returns their replies; ok is false after a malformed command, which
// ends the connection.
func (ss *session) Handle(in []byte) (reply []byte, ok bool) {
	data := in
	if len(ss.buf) > 0 {
		ss.buf = append(ss.buf, in...)
		data = ss.buf
	}
	for len(data) > 0 {
		args, n, err := parseCommand(data)
		if err != nil {
			return reply, false
		}
		if n == 0 {
			break // the rest comes later
		}
		data = data[n:]
		reply = ss.s.do(reply, args, ss.tag)
	}
	// Keep what is left of a command: in may be the caller's buffer.
	ss.buf = append(ss.buf[:0], data...)
	return reply, true
}

// Close closes every connection and waits for their goroutines.
func (s *Server) Close() {
	s.mu.Lock()
	s.closed = true
	conns := make([]net.Conn, 0, len(s.conns))
	for c := range s.conns {
		conns = append(conns, c)
	}
	s.mu.Unlock()
	for _, c := range conns {
		c.Close() // a handled one forgets itself, under s.mu
	}
	s.wg.Wait()
}

// FlushAll drops every key, as a restart without persistence does.
func (s *Server) FlushAll() {
	s.mu.Lock()
	s.data = map[string]*value{}
	s.mu.Unlock()
}

// FlushScripts empties the script cache, as a restart or SCRIPT FLUSH does.
func (s *Server) FlushScripts() {
	s.mu.Lock()
	s.scripts = map[string]bool{}
	s.mu.Unlock()
}

// SetSkew sets the server's clock to time.Now() + d.
func (s *Server) SetSkew(d time.Duration) {
	s.mu.Lock()
	s.skew = d
	s.mu.Unlock()
}

// Calls returns how many script calls the server has run.
func (s *Server) Calls() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.calls
}

// Bucket returns the level, time (µs) and P stored at key, and whether a
// well-formed bucket is stored there.
func (s *Server) Bucket(key string) (level, at, p int64, ok bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	v := s.get(s.now(), key)
	if v == nil || v.hash {
		return 0, 0, 0, false
	}
	_, l, t, lp, ok := unpack(v.s)
	return int64(l), int64(t), int64(lp), ok
}

// Level returns the units key's bucket holds now, at the server's clock,
// for a limit of q units a microsecond, p units a token and capacity cap:
// what the script would refill it to before a decision. A missing or
// foreign value is a full bucket; a bucket in debt is negative.
func (s *Server) Level(key string, q, p, capacity int64) int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	v := s.get(now, key)
	if v == nil || v.hash {
		return capacity
	}
	_, l, t, lp, ok := unpack(v.s)
	if !ok || lp <= 0 {
		return capacity
	}
	level := l
	if lp != float64(p) {
		level = math.Floor(level * float64(p) / lp)
	}
	if us := float64(now.UnixMicro()); us >= t {
		level += (us - t) * float64(q)
	} else if level == 0 {
		level = -(t - us) * float64(q) // a debt
	}
	return int64(math.Max(math.Min(level, float64(capacity)), -float64(capacity)))
}

// now requires that s.mu is held.
func (s *Server) now() time.Time { return time.Now().Add(s.skew) }

// get returns key's live value, dropping it if expired.
// get requires that s.mu is held.
func (s *Server) get(now time.Time, key string) *value {
	v := s.data[key]
	if v != nil && !v.expire.IsZero() && now.After(v.expire) {
		delete(s.data, key)
		return nil
	}
	return v
}

// parseCommand reads one RESP array of bulk strings (what go-redis sends)
// from the start of b. It returns the command and the bytes it took, or
// n == 0 if b holds only part of it.
func parseCommand(b []byte) (args []string, n int, err error) {
	line, rest, ok := cutLine(b)
	if !ok {
		return nil, 0, nil
	}
	if len(line) < 2 || line[0] != '*' {
		return nil, 0, fmt.Errorf("simredis: want an array, got %q", line)
	}
	count, err := strconv.Atoi(string(line[1:]))
	if err != nil || count < 1 {
		return nil, 0, fmt.Errorf("simredis: bad array length %q", line)
	}
	// Where each argument is in b, found before any is copied: a command
	// not yet whole costs no allocation, and a whole one is copied into
	// one string, of which the arguments are parts.
	var buf [16]int
	spans := buf[:0]
	for range count {
		if line, rest, ok = cutLine(rest); !ok {
			return nil, 0, nil
		}
		if len(line) < 2 || line[0] != '$' {
			return nil, 0, fmt.Errorf("simredis: want a bulk string, got %q", line)
		}
		size, err := strconv.Atoi(string(line[1:]))
		if err != nil || size < 0 {
			return nil, 0, fmt.Errorf("simredis: bad bulk length %q", line)
		}
		if len(rest) < size+2 {
			return nil, 0, nil
		}
		from := len(b) - len(rest)
		spans = append(spans, from, from+size)
		rest = rest[size+2:]
	}
	n = len(b) - len(rest)
	all := string(b[:n])
	args = make([]string, count)
	for i := range args {
		args[i] = all[spans[2*i]:spans[2*i+1]]
	}
	return args, n, nil
}

// cutLine returns b's first line without its CRLF, and what follows it;
// ok is false if b holds no whole line.
func cutLine(b []byte) (line, rest []byte, ok bool) {
	i := bytes.IndexByte(b, '\n')
	if i < 0 {
		return nil, b, false
	}
	return bytes.TrimSuffix(b[:i], []byte("\r")), b[i+1:], true
}

// Replies.
type (
	status string
	rerror string
	// encoded is a reply already in RESP2, for the large ones that do
	// not change (COMMAND, a layout's CLUSTER SLOTS): encoded once, not
	// at every call.
	encoded []byte
)

// appendReply appends v in RESP2 to b.
func appendReply(b []byte, v any) []byte {
	switch v := v.(type) {
	case nil:
		return append(b, "$-1\r\n"...)
	case status:
		return append(append(append(b, '+'), v...), "\r\n"...)
	case rerror:
		return append(append(append(b, '-'), v...), "\r\n"...)
	case encoded:
		return append(b, v...)
	case int64:
		return append(strconv.AppendInt(append(b, ':'), v, 10), "\r\n"...)
	case string:
		b = append(strconv.AppendInt(append(b, '$'), int64(len(v)), 10), "\r\n"...)
		return append(append(b, v...), "\r\n"...)
	case []any:
		b = append(strconv.AppendInt(append(b, '*'), int64(len(v)), 10), "\r\n"...)
		for _, x := range v {
			b = appendReply(b, x)
		}
		return b
	}
	panic(fmt.Sprintf("simredis: reply %T", v))
}

// do runs one command and appends its reply to b.
func (s *Server) do(b []byte, args []string, tag int) []byte {
	s.mu.Lock()
	reply := s.command(args, tag)
	s.mu.Unlock()
	return appendReply(b, reply)
}

// command runs one command. command requires that s.mu is held.
func (s *Server) command(args []string, tag int) any {
	now := s.now()
	name := upper(args[0])
	if m := s.redirect(name, args); m != "" {
		return rerror(m)
	}
	switch name {
	case "PING":
		return status("PONG")
	case "CLIENT", "SELECT", "READONLY", "READWRITE", "ASKING":
		return status("OK")
	case "COMMAND":
		return commandReply
	case "CLUSTER":
		if s.clusterCmd == nil {
			return rerror("ERR This instance has cluster support disabled")
		}
		return s.clusterCmd(args)
	case "TIME":
		us := now.UnixMicro()
		return []any{strconv.FormatInt(us/1e6, 10), strconv.FormatInt(us%1e6, 10)}
	case "GET":
		if len(args) != 2 {
			return rerror("ERR wrong number of arguments for 'get' command")
		}
		v := s.get(now, args[1])
		if v == nil {
			return nil
		}
		if v.hash {
			return rerror("WRONGTYPE Operation against a key holding the wrong kind of value")
		}
		return string(v.s)
	case "DEL":
		var n int64
		for _, k := range args[1:] {
			if s.get(now, k) != nil {
				delete(s.data, k)
				s.replicate(k)
				n++
			}
		}
		return n
	case "PTTL":
		if len(args) != 2 {
			return rerror("ERR wrong number of arguments for 'pttl' command")
		}
		v := s.get(now, args[1])
		switch {
		case v == nil:
			return int64(-2)
		case v.expire.IsZero():
			return int64(-1)
		}
		return v.expire.Sub(now).Milliseconds()
	case "SCRIPT":
		if len(args) < 2 {
			return rerror("ERR wrong number of arguments for 'script' command")
		}
		switch strings.ToUpper(args[1]) {
		case "LOAD":
			if len(args) != 3 {
				return rerror("ERR wrong number of arguments for 'script|load' command")
			}
			h := scriptSHA(args[2])
			if h != bucketSHA && h != fleetSHA {
				return rerror("ERR simredis runs only hybridlimit's scripts")
			}
			s.scripts[h] = true
			return h
		case "FLUSH":
			s.scripts = map[string]bool{}
			return status("OK")
		}
		return rerror("ERR unknown SCRIPT subcommand")
	case "EVAL", "EVALSHA":
		if len(args) < 3 {
			return rerror("ERR wrong number of arguments for 'eval' command")
		}
		h := strings.ToLower(args[1])
		if name == "EVAL" {
			h = scriptSHA(args[1])
			if h != bucketSHA && h != fleetSHA {
				return rerror("ERR simredis runs only hybridlimit's scripts")
			}
			s.scripts[h] = true
		} else if !s.scripts[h] {
			return rerror("NOSCRIPT No matching script. Please use EVAL.")
		}
		nk, err := strconv.Atoi(args[2])
		if err != nil || nk < 1 || nk > 3 || h == bucketSHA && nk > 2 || h == fleetSHA && nk < 2 || len(args) < 3+nk {
			return rerror("ERR the models take the scripts' keys (the bucket's, and a charge's marker; the fleet's two or three windows)")
		}
		s.calls++
		if h == bucketSHA {
			marker := ""
			if nk == 2 {
				marker = args[4]
			}
			argv := args[3+nk:]
			reply := s.bucket(now, args[3], marker, argv)
			s.replicate(args[3])
			if marker != "" {
				s.replicate(marker)
			}
			if s.Hook != nil {
				s.Hook(tag, args[3], marker, argv, reply)
			}
			return reply
		}
		before := ""
		if nk == 3 {
			before = args[5]
		}
		reply := s.fleet(now, args[3], args[4], before, args[3+nk:])
		if read, ok := reply.([]any); ok && read[2] != int64(0) && s.FleetHook != nil {
			s.FleetHook(tag)
		}
		return reply
	}
	return rerror(fmt.Sprintf("ERR unknown command '%s', with args beginning with: ", args[0]))
}

// upper is strings.ToUpper, without its copy for the names go-redis sends
// (in lower case), which would be one allocation per command.
func upper(name string) string {
	switch name {
	case "evalsha":
		return "EVALSHA"
	case "eval":
		return "EVAL"
	case "ping":
		return "PING"
	case "client":
		return "CLIENT"
	case "cluster":
		return "CLUSTER"
	case "script":
		return "SCRIPT"
	case "hello":
		return "HELLO"
	case "time":
		return "TIME"
	case "get":
		return "GET"
	case "del":
		return "DEL"
	case "pttl":
		return "PTTL"
	case "command":
		return "COMMAND"
	case "readonly":
		return "READONLY"
	}
	return strings.ToUpper(name)
}

// commandTable is COMMAND's reply for the commands the server knows, in
// Redis 5's shape (name, arity, flags, first key, last key, step), which
// go-redis's ClusterClient reads to find a command's key.
var commandTable = func() []any {
	var t []any
	for _, c := range []struct {
		name        string
		arity       int64
		flag        string
		first, last int64
	}{
		{"get", 2, "readonly", 1, 1}, {"del", -2, "write", 1, -1}, {"pttl", 2, "readonly", 1, 1},
		{"eval", -3, "movablekeys", 0, 0}, {"evalsha", -3, "movablekeys", 0, 0},
		{"script", -2, "noscript", 0, 0}, {"cluster", -2, "stale", 0, 0}, {"ping", -1, "fast", 0, 0},
		{"time", 1, "fast", 0, 0}, {"client", -2, "noscript", 0, 0}, {"hello", -1, "fast", 0, 0},
		{"command", -1, "loading", 0, 0}, {"readonly", 1, "fast", 0, 0}, {"asking", 1, "fast", 0, 0},
		{"select", 2, "fast", 0, 0},
	} {
		step := int64(0)
		if c.first > 0 {
			step = 1
		}
		t = append(t, []any{c.name, c.arity, []any{status(c.flag)}, c.first, c.last, step})
	}
	return t
}()

// commandReply is commandTable in RESP2.
var commandReply = encoded(appendReply(nil, commandTable))

// number is Lua's tonumber on a string: nil (ok false) when it is not one.
func number(s string) (float64, bool) {
	f, err := strconv.ParseFloat(strings.TrimSpace(s), 64)
	return f, err == nil
}

// bucket is lua/tokenbucket.lua. Numbers are float64, as Lua's are, so
// that rounding happens where the script's does.
// bucket requires that s.mu is held.
func (s *Server) bucket(at time.Time, key, marker string, argv []string) any {
	if len(argv) < 4 {
		return rerror("ERR Error running script: ARGV missing")
	}
	q, ok1 := number(argv[0])
	p, ok2 := number(argv[1])
	capacity, ok3 := number(argv[2])
	cost, ok4 := number(argv[3])
	if !ok1 || !ok2 || !ok3 || !ok4 {
		return rerror("ERR Error running script: attempt to perform arithmetic on a nil value")
	}
	us := at.UnixMicro()
	now := float64(us/1e6)*1e6 + float64(us%1e6)

	level := capacity
	last := now     // the time stored with the level
	var due float64 // the time a debt stored as a later time is paid, if hasDue
	hasDue := false
	var unreserved float64 // unreserve's time to store, if hasUnreserved: a debt is left
	hasUnreserved := false
	flags := 0.0
	dirty := false
	mode := ""
	if len(argv) > 4 {
		mode = argv[4]
	}
	v := s.get(at, key)
	if v != nil {
		var l, st, lp float64
		good := false
		if !v.hash {
			_, l, st, lp, good = unpack(v.s)
		}
		if good && lp > 0 {
			level = l
			if lp != p {
				level = math.Floor(level * p / lp)
				dirty = true
			}
			if now >= st {
				level = level + (now-st)*q
			} else {
				last = st
				if level == 0 {
					level = -(st - now) * q
					last = now
					if lp == p {
						due, hasDue = st, true
					}
				}
			}
			if level > capacity {
				level = capacity
			}
		} else {
			flags = 2
			dirty = true
			if v.hash && mode != "peek" {
				delete(s.data, key)
			}
		}
	}
	leased := 0.0
	if mode == "charge" && marker != "" {
		if s.get(at, marker) != nil {
			return []any{int64(4), int64(level), int64(now)}
		}
		ttl := 0.0
		if len(argv) > 5 {
			ttl, _ = number(argv[5])
		}
		s.data[marker] = &value{s: []byte("1"), expire: at.Add(time.Duration(ttl) * time.Millisecond)}
	}
	if mode == "charge" {
		flags++
		if level-cost < -capacity {
			level = math.Min(level, -capacity)
		} else {
			level -= cost
		}
		dirty = true
	} else if mode == "reserve" {
		depth := 0.0
		if len(argv) > 5 {
			depth, _ = number(argv[5])
		}
		if level-cost >= -depth {
			flags++
			level -= cost
			if level > capacity {
				level = capacity
			}
			dirty = true
		}
	} else if mode == "unreserve" {
		want, ok := 0.0, false
		if len(argv) > 5 {
			want, ok = number(argv[5])
		}
		if hasDue && ok && due == want {
			flags++
			level += cost
			if level > capacity {
				level = capacity
			}
			dirty = true
			if level < 0 {
				unreserved, hasUnreserved = due-math.Ceil(cost/q), true
			}
		}
	} else if mode == "peek" {
		if cost <= level {
			flags++
		}
	} else if mode == "reset" {
		flags++
		level = capacity
		last = now
		dirty = true
	} else if cost < 0 || cost <= level {
		// A refund (a negative cost) is always taken, in debt too.
		flags++
		level -= cost
		if level > capacity {
			level = capacity
		}
		if mode == "lease" {
			extra := 0.0
			if len(argv) > 5 {
				extra, _ = number(argv[5])
			}
			leased = math.Min(extra, level-luaMod(level, p))
			level -= leased
		}
		dirty = true
	}
	// Expire one second after the bucket would be full again.
	px := math.Ceil((capacity-level)/q/1000) + 1000
	expire := at.Add(time.Duration(px) * time.Millisecond)
	if mode == "peek" {
		// Reads only.
	} else if dirty {
		stored := level
		if hasUnreserved {
			stored, last = 0, unreserved
		} else if level < 0 {
			stored = 0
			last = now + math.Ceil(-level/q)
		}
		s.data[key] = &value{s: pack(stored, last, p), expire: expire}
	} else if v != nil && !v.hash {
		// A denial writes nothing but sets the TTL for the current limit.
		v.expire = expire
	}
	if mode == "lease" {
		return []any{int64(flags), int64(level), int64(now), int64(leased)}
	}
	return []any{int64(flags), int64(level), int64(now)}
}

// luaMod is Lua's a % b: a - floor(a/b)*b.
func luaMod(a, b float64) float64 { return a - math.Floor(a/b)*b }

// pack is struct.pack('>BI7I7I7', 1, level, now, p).
func pack(level, now, p float64) []byte {
	out := make([]byte, 22)
	out[0] = 1
	put7(out[1:8], uint64(level))
	put7(out[8:15], uint64(now))
	put7(out[15:22], uint64(p))
	return out
}

func put7(b []byte, v uint64) {
	for i := 6; i >= 0; i-- {
		b[i] = byte(v)
		v >>= 8
	}
}

func get7(b []byte) float64 {
	var v uint64
	for _, c := range b[:7] {
		v = v<<8 | uint64(c)
	}
	return float64(v)
}

// unpack reads a value that pack wrote; ok is false for any other shape.
func unpack(raw []byte) (format byte, level, at, p float64, ok bool) {
	if len(raw) != 22 || raw[0] != 1 {
		return 0, 0, 0, 0, false
	}
	return 1, get7(raw[1:8]), get7(raw[8:15]), get7(raw[15:22]), true
}
