-- hybridlimit fleet: one heartbeat of one limiter instance.
--
-- KEYS[1]  the hash of window j, which this instance reports for
-- KEYS[2]  the hash of window i, which it reads
-- KEYS[3]  the hash of window i-1, read too if ARGV[5] asks for it
--          (the caller gives every key of a group one hash tag, so that
--          they share a Cluster slot)
-- ARGV[1]  j: window j covers [j*w, (j+1)*w) ms of Redis TIME
-- ARGV[2]  its report, packed: tokens * 2^20 + 1
-- ARGV[3]  i
-- ARGV[4]  w, the window in milliseconds (the group's Heartbeat)
-- ARGV[5]  what it asks for, the sum of: 1 a ticket for window i; 2 window
--          i-1's sum too; 4 a ticket for window i-1 (with 2)
-- ARGV[6]  the mark its report in window i was taken under (0 if none)
-- ARGV[7]  the same for window i-1
-- ARGV[8]  optional: Redis's clock in microseconds, read by the client
--          outside the script, for a Redis that refuses TIME in scripts
--
-- Redis is in window r. A report for window j is taken while r is j, j+1
-- or j+2 (a heartbeat may come up to a window late), and added to '#t',
-- which packs the tokens reported and, in its low 20 bits, the instances
-- that reported. Each instance sends one report per window and remembers
-- the ones taken, and the mark '#m' of the hash each went into. Window i
-- is read only once no report can change it (i <= r-3), so every instance
-- that reads a window reads the same sum: the parts computed from it add
-- up to at most 1. An instance that was not counted in the window it
-- reads (it has just started, or its report was lost) takes a ticket '#c'
-- instead, which gives it a part of a reserve (see fleet.go). An instance
-- that did not read window i-1 (its heartbeat failed, or came late) asks
-- for that window too: each instance holds the lesser of its
-- parts in two windows read in a row, so that the parts held while some
-- have read window i and others only i-1 add up to at most 1 (see weigh
-- in fleet.go).
--
-- The mark tells a report lost from a report counted. The first report
-- of a hash draws it (1 to 1023, from the clock's milliseconds); later
-- reports read it. If Redis loses the hash (a restart without data) while
-- the window is reported for, the first report after the loss draws
-- another: an instance whose report went into the lost hash then reads a
-- mark other than its own when it reads the window, and takes a ticket,
-- as one never counted, instead of its part of a sum without its report.
--
-- The script runs on the one shard every instance of the group shares, so
-- it does as little as it can: TIME, one HINCRBY, one HGET of the mark and
-- one HMGET whatever the fleet's size (and an HSET of the mark and a
-- PEXPIREAT for a hash's first report), the packed numbers passed through
-- as strings. Its reply:
--   {now_ms, taken (0, or 1 + the mark it was taken under),
--    sum ('#t' of window i, or 0), ticket (or 0)}
-- and, if window i-1 was asked for, window i is closed and window i-1's
-- hash cannot have expired (i >= r-4), two more:
--   {..., sum of window i-1 (or 0: nobody reported for it), its ticket}
-- sum is 0 if window i is not closed yet, or nobody reported for it. A
-- window's hash expires once it can no longer be read, as window i or as
-- window i-1. A ticket is given to an instance that asks for one or whose
-- mark is not the hash's: an instance that got one unasked was not
-- counted in the sum it read.

-- The report is checked by HINCRBY (an integer, or an error before any
-- write); the windows here.
local j, i, w = tonumber(ARGV[1]), tonumber(ARGV[3]), tonumber(ARGV[4])
local want, mi, mb = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
if not (j and i and w and want and mi and mb) or j % 1 ~= 0 or i % 1 ~= 0 or w < 1 or w % 1 ~= 0
    or want % 1 ~= 0 or want < 0 or want > 7 or (want >= 2 and not KEYS[3]) then
  return redis.error_reply('ERR hybridlimit fleet: bad arguments')
end

local now
if ARGV[8] then
  local us = tonumber(ARGV[8])
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
  local first = sum == tonumber(ARGV[2])
  local m = not first and redis.call('HGET', KEYS[1], '#m')
  if not m then
    -- The first report, or the first of this version in a hash begun by
    -- one without marks.
    m = string.format('%d', now % 1023 + 1)
    redis.call('HSET', KEYS[1], '#m', m)
  end
  if first then
    -- Window j is read, as window i or i-1, until window j+5 ends (last:
    -- an expiry at or before now deletes the hash at once).
    redis.call('PEXPIREAT', KEYS[1], string.format('%.0f', (j + 6) * w))
  end
  taken = 1 + tonumber(m)
end

if i <= r - 3 then
  local read = redis.call('HMGET', KEYS[2], '#t', '#m')
  local sum = read[1]
  local ticket = 0
  if sum and (want % 2 == 1 or tonumber(read[2] or 0) ~= mi) then
    ticket = redis.call('HINCRBY', KEYS[2], '#c', 1)
  end
  if want % 4 >= 2 and i >= r - 4 then
    local b = redis.call('HMGET', KEYS[3], '#t', '#m')
    local before = b[1]
    local bticket = 0
    if before and (want >= 4 or tonumber(b[2] or 0) ~= mb) then
      bticket = redis.call('HINCRBY', KEYS[3], '#c', 1)
    end
    return {now, taken, sum or 0, ticket, before or 0, bticket}
  end
  if sum then
    return {now, taken, sum, ticket}
  end
end
return {now, taken, 0, 0}
