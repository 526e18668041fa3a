-- hybridlimit fleet: one heartbeat of one limiter instance.
--
-- KEYS[1..3]  a ring of three hashes, one per window of the group's clock;
--             the caller gives them one hash tag, so they share a Cluster slot
-- ARGV[1]     this instance's id
-- ARGV[2]     the tokens the limit admitted on this instance in its last
--             window (a whole number >= 0)
-- ARGV[3]     the window, in milliseconds (the group's Heartbeat)
--
-- Windows are aligned to Redis TIME: window k covers [k*w, (k+1)*w) ms.
-- Each instance calls once per window k and files its report under window
-- k-1, in KEYS[(k-1)%3+1]: field <id> holds its report, '#t' the sum of
-- the reports, '#n' how many instances reported, '#k' which window the
-- hash holds. A report for window k-1 is only accepted during window k,
-- and window k-2 is only read during window k, so every instance that
-- reads a window reads the same numbers: the parts computed from them add
-- up to at most 1. An instance that did not report in the window it reads
-- (it has just started, or missed a heartbeat) takes a ticket '#c' instead,
-- which gives it a part of a reserve (see fleet.go).
--
-- Every call costs the same whatever the fleet's size: a few hash
-- operations, and a reply of five integers:
--   {now_ms, reporters, total, mine (-1: not among them), ticket (0: none)}
-- A window's hash expires before the ring comes back to it; a hash found
-- holding an older window is unlinked (freed off the main thread).

local id = ARGV[1]
local count = tonumber(ARGV[2])
local w = tonumber(ARGV[3])
if not count or count < 0 or count % 1 ~= 0 or not w or w < 1 or w % 1 ~= 0 then
  return redis.error_reply('ERR hybridlimit fleet: bad report or window')
end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local k = math.floor(now / w)

-- Report for window k-1.
local wkey = KEYS[(k - 1) % 3 + 1]
local wtag = string.format('%.0f', k - 1)
if redis.call('HGET', wkey, '#k') ~= wtag then
  redis.call('UNLINK', wkey)
  redis.call('HSET', wkey, '#k', wtag)
end
local c = string.format('%.0f', count)
local old = redis.call('HGET', wkey, id)
redis.call('HSET', wkey, id, c)
if old then
  -- A second call in one window replaces the first: one report each.
  redis.call('HINCRBY', wkey, '#t', string.format('%.0f', count - tonumber(old)))
else
  redis.call('HINCRBY', wkey, '#t', c)
  redis.call('HINCRBY', wkey, '#n', 1)
end
-- Read during window k+1, reused for window k+2 during window k+3.
redis.call('PEXPIREAT', wkey, string.format('%.0f', (k + 2) * w + math.floor(w / 2)))

-- Read window k-2, complete since window k began.
local rkey = KEYS[(k - 2) % 3 + 1]
local v = redis.call('HMGET', rkey, '#k', '#n', '#t', id)
local n, total, mine, ticket = 0, 0, -1, 0
if v[1] == string.format('%.0f', k - 2) then
  n = tonumber(v[2]) or 0
  total = tonumber(v[3]) or 0
  if v[4] then
    mine = tonumber(v[4])
  else
    ticket = redis.call('HINCRBY', rkey, '#c', 1)
  end
end
return {now, n, total, mine, ticket}
