-- hybridlimit fleet: one heartbeat of one limiter instance.
--
-- KEYS[1]  the fleet hash of a limiter group: one field per live instance
-- ARGV[1]  this instance's id
-- ARGV[2]  this instance's report: a string without spaces, opaque here
-- ARGV[3]  how long a heartbeat counts, in milliseconds
-- ARGV[4]  the most instances kept (a bound on the hash's size)
--
-- Each field is "<report> <expiry_ms>" in Redis TIME. The script writes
-- this instance's field, drops expired ones, and returns the live fleet as
-- {id1, report1, id2, report2, ...}. The hash expires with its last
-- heartbeat.

local key = KEYS[1]
local ttl = tonumber(ARGV[3])
local most = tonumber(ARGV[4])

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

redis.call('HSET', key, ARGV[1], ARGV[2] .. ' ' .. string.format('%.0f', now + ttl))
local all = redis.call('HGETALL', key)
local live = {}
for i = 1, #all, 2 do
  local r, exp = string.match(all[i + 1], '^(%S+) (%d+)$')
  if not exp or tonumber(exp) < now or (#live >= 2 * most and all[i] ~= ARGV[1]) then
    redis.call('HDEL', key, all[i])
  else
    live[#live + 1] = all[i]
    live[#live + 1] = r
  end
end
redis.call('PEXPIRE', key, ttl)
return live
