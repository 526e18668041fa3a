-- hybridlimit token bucket: refill, check and deduct on one key, in one script.
--
-- KEYS[1]  the bucket key
-- ARGV[1]  q: units added per microsecond (integer >= 1)
-- ARGV[2]  p: units per token, also the period in microseconds in which q
--          tokens are added (integer >= 1)
-- ARGV[3]  cap: capacity in units, burst * p (integer, below 2^53)
-- ARGV[4]  cost: units to take; a negative cost gives units back (a
--          refund), up to cap
-- ARGV[5]  optional mode:
--          "charge": take cost without refusing, down to -cap at most. When
--          Redis comes back after an outage, each instance charges the
--          bucket, which refilled in Redis time all along, with what it
--          spent on its local share meanwhile; a charge of 0 is the
--          breaker's probe, which runs and writes like a decision but takes
--          nothing.
--          With a second key, KEYS[2], the charge is applied at most
--          once: the script sets KEYS[2] (in the bucket's slot) for
--          ARGV[6] milliseconds, and a charge that finds it set takes
--          nothing and answers flags 4. An instance sends an unanswered
--          charge again under the same KEYS[2]: a paused Redis that runs
--          the first one when it resumes, or a reply slower than the
--          budget, then charges the spending once, not twice.
--          "reserve": take cost if the bucket then owes at most ARGV[6]
--          units: the level may go below zero, and the caller waits until
--          the refill has paid it (WaitN).
--          "lease": if cost is allowed, also take up to ARGV[6] more units
--          (a multiple of p), in whole tokens, for the client to spend
--          without asking again (Config.Lease, for keys hotter than one
--          Redis core can serve).
--          "peek": report what the bucket holds, taking nothing and
--          writing nothing: no SET, no PEXPIRE, and a foreign value is
--          reported as the full bucket a decision would replace it with,
--          but left in place. cost is 0; flags says whether the bucket is
--          out of debt.
--          "reset": store a full bucket, whatever the key held (an
--          operator's reset); it expires a second later, when it is the
--          same as no key at all.
--          "unreserve": give back cost units of a reservation whose waiter
--          gave up, only while it is still the bucket's last change: the
--          key holds the debt the reservation left, due at ARGV[6] (its
--          reply's time plus its debt over q, as stored), under the same
--          p. Given back behind later reservations, it would shorten a
--          queue whose waiters keep the times they were told, and the
--          next reservation would fall due among theirs. flags says
--          whether it was given back.
-- ARGV[6]  the mode's argument, "" if it has none
-- ARGV[7]  optional: Redis's clock in microseconds, for a Redis that
--          refuses TIME in scripts (ElastiCache Serverless): the client
--          reads TIME outside the script and passes it, corrected by its
--          monotonic clock since then. ARGV[5] and ARGV[6] are "" where
--          there are none.
--
-- The client does the multiplications (cap and cost in units) and computes
-- RetryAfter and ResetAfter from the reply: this script runs on the one
-- Redis core every instance shares, so it does only what must be atomic.
--
-- Fixed point: the level is kept in units of 1/p token, so one microsecond
-- adds exactly q units and no remainder is ever lost. Every number stays an
-- integer at or below 2^53, which Lua's doubles hold exactly; the client
-- checks cap against that bound.
--
-- The value is 22 bytes: a format byte (1), then the level, the time in
-- microseconds of Redis TIME (or ARGV[7], Redis's clock read outside the script) and p, each a
-- 7-byte big-endian unsigned integer; struct.pack('>BI7I7I7', 1, level,
-- time, p) in Redis's Lua. p is kept so that a changed limit keeps the
-- tokens. Binary because Redis's struct library reads and writes it in one
-- call each, where formatting and matching three numbers as text cost a
-- quarter of the script; 22 bytes also fit Redis's smallest string
-- allocation whatever the limit. A Redis without struct (miniredis, which
-- runs the tests and the demo) gets the same bytes from plain Lua.
--
-- The stored pair (level, time) means: level units at Redis time `time`, and
-- no refill before it. The level the bucket holds now is therefore
--   level + (now - time) * q, at most cap,  when time <= now;
--   level,                                 when time > now and level > 0
--     (Redis's clock went back, as after a failover to a host whose clock
--     is behind: nothing refills until it catches up, and the later time
--     is kept, so that the interval is never refilled twice);
--   -(time - now) * q,                     when time > now and level is 0:
--     a debt. A charge for tokens spent without Redis may take the bucket
--     below zero, down to -cap, so that no spending is lost when several
--     instances charge one after another; the debt is stored as an empty
--     bucket whose refill starts later, and decisions are refused until it
--     is paid.
--
-- A denial writes nothing: the stored state already implies the refilled
-- level. It only sets the TTL again, since a changed limit (a larger burst,
-- a slower rate at the same p) can need a longer one than the last write
-- set, and a key that expired early would come back full. A value that is
-- not ours (another type, or a string of another shape) is replaced by a
-- full bucket and reported.
--
-- Returns {flags, level, now_us}: flags is 1 if allowed, plus 2 if the
-- value was repaired, or 4 alone for a charge applied before; level is what the bucket holds after the call,
-- negative while it is in debt. In lease mode a fourth value is the units
-- leased beyond cost.

local key = KEYS[1]
local q = tonumber(ARGV[1])
local p = tonumber(ARGV[2])
local cap = tonumber(ARGV[3])
local cost = tonumber(ARGV[4])

local now
if ARGV[7] then
  now = tonumber(ARGV[7])
  if not now or now < 0 or now % 1 ~= 0 then
    return redis.error_reply('ERR hybridlimit bucket: bad time')
  end
else
  local t = redis.call('TIME')
  now = t[1] * 1000000 + t[2]
end

-- rawget: Redis 7 and miniredis raise an error on reading a global that
-- does not exist.
local codec = rawget(_G, 'struct')
if not codec then
  -- Plain Lua, for a Redis without the struct library; only this script's
  -- format is supported.
  local function bytes7(v, out, at)
    for i = at + 6, at, -1 do
      out[i] = v % 256
      v = math.floor(v / 256)
    end
  end
  local function int7(s, i)
    local a, b, c, d, e, f, g = string.byte(s, i, i + 6)
    return (((((a * 256 + b) * 256 + c) * 256 + d) * 256 + e) * 256 + f) * 256 + g
  end
  codec = {
    pack = function(_, v, l, s, lp)
      local out = {v}
      bytes7(l, out, 2)
      bytes7(s, out, 9)
      bytes7(lp, out, 16)
      return string.char(unpack(out))
    end,
    unpack = function(_, raw)
      return string.byte(raw), int7(raw, 2), int7(raw, 9), int7(raw, 16)
    end,
  }
end

local level = cap
local last = now -- the time stored with the level
local flags = 0
local write = false
local due -- the time a debt stored as a later time is paid; nil if none
local unreserved -- unreserve's time to store, when a debt is left
local raw = redis.pcall('GET', key)
if raw then
  local _, l, s, lp
  if #raw == 22 and string.byte(raw) == 1 then
    _, l, s, lp = codec.unpack('>BI7I7I7', raw)
  end
  if l and lp > 0 then
    level = l
    if lp ~= p then
      -- A level written under another limit is converted to this one's
      -- units: the tokens are kept, a fraction of a unit may be lost. It
      -- is written back so that its TTL follows the new limit.
      level = math.floor(level * p / lp)
      write = true
    end
    if now >= s then
      -- A sum past 2^53 is rounded, but stays above cap, which it is cut
      -- to.
      level = level + (now - s) * q
    else
      last = s
      if level == 0 then
        -- A debt, as of now: a level given back out of it (a refund)
        -- is stored from now, not from when the debt would be paid.
        level = -(s - now) * q
        last = now
        if lp == p then
          due = s
        end
      end
    end
    if level > cap then
      level = cap
    end
  else
    flags = 2
    write = true
    if type(raw) == 'table' and ARGV[5] ~= 'peek' then
      redis.call('DEL', key)
    end
  end
end

local mode = ARGV[5]
local leased = 0
if mode == 'charge' and KEYS[2] and not redis.call('SET', KEYS[2], '1', 'NX', 'PX', ARGV[6]) then
  -- This charge was applied before: nothing to take, nothing to write.
  return {4, level, now}
elseif mode == 'charge' then
  -- Never below -cap, nor below what reservations already owe.
  flags = flags + 1
  if level - cost < -cap then
    level = math.min(level, -cap)
  else
    level = level - cost
  end
  write = true
elseif mode == 'reserve' then
  -- Take cost if the bucket then owes at most ARGV[6] units: a waiter
  -- that takes its tokens ahead of the refill, and waits, once, until the
  -- debt is paid, rather than asking again and again.
  if level - cost >= -tonumber(ARGV[6]) then
    flags = flags + 1
    level = level - cost
    if level > cap then
      level = cap
    end
    write = true
  end
elseif mode == 'unreserve' then
  if due and due == tonumber(ARGV[6]) then
    flags = flags + 1
    level = level + cost
    if level > cap then
      level = cap
    end
    write = true
    if level < 0 then
      -- The time the debt was due before the reservation: it added
      -- ceil(cost / q) to it, which from the level would round again.
      unreserved = due - math.ceil(cost / q)
    end
  end
elseif mode == 'peek' then
  if cost <= level then
    flags = flags + 1
  end
elseif mode == 'reset' then
  -- Full from now: a debt stored as a later time goes too.
  flags = flags + 1
  level = cap
  last = now
  write = true
elseif cost < 0 or cost <= level then
  -- A refund (a negative cost) is always taken, in debt too.
  flags = flags + 1
  level = level - cost
  if level > cap then
    level = cap
  end
  if mode == 'lease' then
    leased = math.min(tonumber(ARGV[6]), level - level % p)
    level = level - leased
  end
  write = true
end
-- Expire one second after the bucket would be full again.
local ttl = math.ceil((cap - level) / q / 1000) + 1000
if mode == 'peek' then
  -- Reads only.
elseif write then
  local stored = level
  if unreserved then
    stored = 0
    last = unreserved
  elseif level < 0 then
    stored = 0
    last = now + math.ceil(-level / q)
  end
  redis.call('SET', key, codec.pack('>BI7I7I7', 1, stored, last, p), 'PX', ttl)
elseif raw then
  redis.call('PEXPIRE', key, ttl)
end
if mode == 'lease' then
  return {flags, level, now, leased}
end
return {flags, level, now}
