-- hybridlimit charge: take tokens spent elsewhere from a bucket, never
-- refusing. When Redis comes back after an outage, each instance charges
-- the bucket with what it spent on its local share meanwhile, so that the
-- bucket, which refilled in Redis time all along, does not grant that
-- again.
--
-- KEYS[1]  the bucket key, as in tokenbucket.lua
-- ARGV[1]  q: tokens added per period
-- ARGV[2]  p: period length in microseconds
-- ARGV[3]  burst: capacity in tokens
-- ARGV[4]  units: what to take, in units of 1/p token (integer >= 0)
--
-- The level is refilled as in tokenbucket.lua, then lowered by units but
-- not below zero, and written back. A value that is not a bucket is
-- replaced. Returns {level, now_us}.

local key = KEYS[1]
local q = tonumber(ARGV[1])
local p = tonumber(ARGV[2])
local cap = tonumber(ARGV[3]) * p
local units = tonumber(ARGV[4])

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])

local level = cap
local raw = redis.pcall('GET', key)
if type(raw) == 'table' and raw.err then
  redis.call('DEL', key)
elseif raw then
  local l, s, lp = string.match(raw, '^(%x+) (%x+) (%x+)$')
  if l then
    -- A level written under another limit is converted to this one's
    -- units: the tokens are kept, a fraction of a unit may be lost.
    level = tonumber(l, 16)
    lp = tonumber(lp, 16)
    if lp ~= p then
      level = math.floor(level * p / lp)
    end
    local elapsed = now - tonumber(s, 16)
    if elapsed > 0 then
      if elapsed * q >= cap - level then
        level = cap
      else
        level = level + elapsed * q
      end
    end
    if level > cap then
      level = cap
    end
  end
end

level = level - units
if level < 0 then
  level = 0
end
local ttl = math.ceil((cap - level) / q / 1000) + 1000
redis.call('SET', key, string.format('%x %x %x', level, now, p), 'PX', ttl)
return {level, now}
