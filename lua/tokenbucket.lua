-- hybridlimit token bucket: refill, check and deduct on one key, in one script.
--
-- KEYS[1]  the bucket key
-- ARGV[1]  q: tokens added per period (integer >= 1)
-- ARGV[2]  p: period length in microseconds (integer >= 1)
-- ARGV[3]  burst: capacity in tokens (integer >= 1)
-- ARGV[4]  n: tokens to take (integer >= 1); a negative n gives -n tokens
--          back (a refund), up to burst
-- ARGV[5]  optional, "charge": take n units of 1/p token (not tokens)
--          without refusing, never below zero. When Redis comes back after
--          an outage, each instance charges the bucket, which refilled in
--          Redis time all along, with what it spent on its local share
--          meanwhile; a charge of 0 is the breaker's probe, which runs and
--          writes like a decision but takes nothing.
--
-- Fixed point: the level is kept in units of 1/p token, so one microsecond
-- adds exactly q units and no remainder is ever lost. Every number stays an
-- integer below 2^53, which Lua's doubles hold exactly; the client checks
-- burst * p against that bound before it calls.
--
-- The value is the string "<level> <time> <p>" in hexadecimal (short
-- enough for Redis's smallest string encoding: PerSecond(100) takes 24
-- bytes), time in microseconds of Redis TIME (client clocks are never
-- read), and p the units per token the level was written in, so that a
-- changed limit keeps the tokens. A denial
-- writes nothing: the stored state already implies the refilled level, so
-- the TTL set by the last write stays right. A value that is not ours
-- (another type, or a string we cannot read) is replaced by a full bucket
-- and reported.
--
-- Returns {allowed, level, retry_after_us, reset_after_us, repaired, now_us}.

local key = KEYS[1]
local q = tonumber(ARGV[1])
local p = tonumber(ARGV[2])
local cap = tonumber(ARGV[3]) * p
local charge = ARGV[5] == 'charge'
local cost = tonumber(ARGV[4])
if not charge then
  cost = cost * p
end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])

local level = cap
local repaired = 0
local converted = false
local raw = redis.pcall('GET', key)
if type(raw) == 'table' and raw.err then
  repaired = 1
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
      converted = true
    end
    local elapsed = now - tonumber(s, 16)
    -- A clock that went back (failover to a replica) refills nothing.
    if elapsed > 0 then
      local missing = cap - level
      if elapsed * q >= missing then
        level = cap
      else
        level = level + elapsed * q
      end
    end
    -- A smaller burst than last time caps the level.
    if level > cap then
      level = cap
    end
  else
    repaired = 1
  end
end

local allowed = 0
local retry = 0
if charge then
  allowed = 1
  level = math.max(level - cost, 0)
elseif cost <= level then
  allowed = 1
  level = level - cost
  if level > cap then
    level = cap
  end
end
if allowed == 1 or repaired == 1 or converted then
  -- Expire one second after the bucket would be full again (a converted
  -- level is written back so that its TTL follows the new limit).
  local ttl = math.ceil((cap - level) / q / 1000) + 1000
  redis.call('SET', key, string.format('%x %x %x', level, now, p), 'PX', ttl)
end
if allowed == 0 then
  if cost > cap then
    retry = -1
  else
    retry = math.ceil((cost - level) / q)
  end
end
local reset = math.ceil((cap - level) / q)
return {allowed, level, retry, reset, repaired, now}
