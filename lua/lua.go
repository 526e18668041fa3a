// Package lua holds the Redis scripts of hybridlimit, embedded from .lua files
// so that they can be read, diffed and tested as Lua.
package lua

import _ "embed"

// TokenBucket is the source of the token-bucket script: refill, check and
// deduct on one key, reading the clock with Redis TIME; it also charges a
// bucket with tokens spent without Redis. See tokenbucket.lua for its
// arguments and reply.
//
//go:embed tokenbucket.lua
var TokenBucket string

// Fleet is the source of the heartbeat script: it adds one instance's
// report to its window's sum and returns the sum of a window that no
// report can change any more, at a cost that does not depend on the
// fleet's size. See fleet.lua for its arguments and reply.
//
//go:embed fleet.lua
var Fleet string
