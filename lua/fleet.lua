-- hybridlimit fleet: one heartbeat of one limiter instance.
--
-- KEYS[1]  the hash of window j, which this instance reports for
-- KEYS[2]  the hash of window i, which it reads
--          (the caller gives every key of a group one hash tag, so that
--          they share a Cluster slot)
-- ARGV[1]  j: window j covers [j*w, (j+1)*w) ms of Redis TIME
-- ARGV[2]  its report, packed: tokens * 2^20 + 1
-- ARGV[3]  i
-- ARGV[4]  w, the window in milliseconds (the group's Heartbeat)
-- ARGV[5]  '1' if it wants a ticket for window i, else '0'
-- ARGV[6]  optional: Redis's clock in microseconds, read by the client
--          outside the script, for a Redis that refuses TIME in scripts
--
-- Redis is in window r. A report for window j is taken while r is j, j+1
-- or j+2 (a heartbeat may come up to a window late), and added to '#t',
-- which packs the tokens reported and, in its low 20 bits, the instances
-- that reported. Each instance sends one report per window and remembers
-- the ones taken. Window i is read only once no report can change it
-- (i <= r-3), so every instance that reads a window reads the same sum:
-- the parts computed from it add up to at most 1. An instance that was
-- not counted in the window it reads (it has just started, or its report
-- was lost) takes a ticket '#c' instead, which gives it a part of a
-- reserve (see fleet.go).
--
-- The script runs on the one shard every instance of the group shares, so
-- it does as little as it can: TIME, one HINCRBY and one HGET whatever the
-- fleet's size, the packed numbers passed through as strings. Its reply:
--   {now_ms, taken (1 or 0), sum ('#t' of window i, or 0), ticket (or 0)}
-- sum is 0 if window i is not closed yet, or nobody reported for it. A
-- window's hash expires once it can no longer be read.

-- The report is checked by HINCRBY (an integer, or an error before any
-- write); the windows here.
local j, i, w = tonumber(ARGV[1]), tonumber(ARGV[3]), tonumber(ARGV[4])
if not (j and i and w) or j % 1 ~= 0 or i % 1 ~= 0 or w < 1 or w % 1 ~= 0 then
  return redis.error_reply('ERR hybridlimit fleet: bad arguments')
end

local now
if ARGV[6] then
  local us = tonumber(ARGV[6])
  if not us or us < 0 then
    return redis.error_reply('ERR hybridlimit fleet: bad time')
  end
  now = math.floor(us / 1000)
else
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local r = math.floor(now / w)

local taken = 0
if j >= r - 2 and j <= r then
  -- An overflow (2^43 tokens) is an error, and nothing is written.
  local sum = redis.call('HINCRBY', KEYS[1], '#t', ARGV[2])
  taken = 1
  if sum == tonumber(ARGV[2]) then
    -- The first report: window j is read until window j+4 ends.
    redis.call('PEXPIREAT', KEYS[1], string.format('%.0f', (j + 5) * w))
  end
end

if i <= r - 3 then
  local sum = redis.call('HGET', KEYS[2], '#t')
  if sum then
    if ARGV[5] == '1' then
      return {now, taken, sum, redis.call('HINCRBY', KEYS[2], '#c', 1)}
    end
    return {now, taken, sum, 0}
  end
end
return {now, taken, 0, 0}
