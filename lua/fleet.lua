-- hybridlimit fleet: one heartbeat of one limiter instance.
--
-- KEYS[1..4]  a ring of four hashes, one per window of the group's clock;
--             the caller gives them one hash tag, so they share a Cluster slot
-- ARGV[1]     this instance's id
-- ARGV[2]     the window it reports for (window j covers [j*w, (j+1)*w) ms
--             of Redis TIME)
-- ARGV[3]     the tokens offered to the limit on this instance in it (a
--             whole number >= 0)
-- ARGV[4]     the window, in milliseconds (the group's Heartbeat)
--
-- Redis is in window r. A report for window j is accepted while r is j,
-- j+1 or j+2 (a heartbeat may come up to a window late), into
-- KEYS[j%4+1]: field <id> holds it, '#t' the sum of the reports, '#n' how
-- many instances reported, '#k' which window the hash holds. Window r-3 is
-- read, which no report can change any more, so every instance that reads
-- a window reads the same numbers: the parts computed from them add up to
-- at most 1. An instance that did not report for the window it reads (it
-- has just started, or its heartbeat was lost) takes a ticket '#c'
-- instead, which gives it a part of a reserve (see fleet.go).
--
-- Every call costs the same whatever the fleet's size: a few hash
-- operations, and a reply of five integers:
--   {now_ms, reporters, total, mine (-1: not among them), ticket (0: none)}
-- A window's hash expires after it has been read; a hash found holding an
-- older window is unlinked (freed off the main thread).

local id = ARGV[1]
local j = tonumber(ARGV[2])
local count = tonumber(ARGV[3])
local w = tonumber(ARGV[4])
if not j or j % 1 ~= 0 or not count or count < 0 or count % 1 ~= 0 or not w or w < 1 or w % 1 ~= 0 then
  return redis.error_reply('ERR hybridlimit fleet: bad report or window')
end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local k = math.floor(now / w)

if j >= k - 2 and j <= k then
  local wkey = KEYS[j % 4 + 1]
  local wtag = string.format('%.0f', j)
  if redis.call('HGET', wkey, '#k') ~= wtag then
    redis.call('UNLINK', wkey)
    redis.call('HSET', wkey, '#k', wtag)
  end
  local c = string.format('%.0f', count)
  local old = redis.call('HGET', wkey, id)
  redis.call('HSET', wkey, id, c)
  if old then
    -- A second report for one window replaces the first.
    redis.call('HINCRBY', wkey, '#t', string.format('%.0f', count - tonumber(old)))
  else
    redis.call('HINCRBY', wkey, '#t', c)
    redis.call('HINCRBY', wkey, '#n', 1)
  end
  -- Read during window j+3.
  redis.call('PEXPIREAT', wkey, string.format('%.0f', (j + 4) * w + math.floor(w / 2)))
end

-- Read window k-3, closed since window k began.
local rkey = KEYS[(k - 3) % 4 + 1]
local v = redis.call('HMGET', rkey, '#k', '#n', '#t', id)
local n, total, mine, ticket = 0, 0, -1, 0
if v[1] == string.format('%.0f', k - 3) then
  n = tonumber(v[2]) or 0
  total = tonumber(v[3]) or 0
  if v[4] then
    mine = tonumber(v[4])
  else
    ticket = redis.call('HINCRBY', rkey, '#c', 1)
  end
end
return {now, n, total, mine, ticket}
