// Package lua holds the Redis scripts of hybridlimit, embedded from .lua files
// so that they can be read, diffed and tested as Lua.
package lua

import _ "embed"

// TokenBucket is the source of the token-bucket script: refill, check and
// deduct on one key, reading the clock with Redis TIME. See tokenbucket.lua
// for its arguments and reply.
//
//go:embed tokenbucket.lua
var TokenBucket string
