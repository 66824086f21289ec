-- Helpers shared by every borrowd script; prepended to each script when it is loaded.
--
-- Gate keys (same hash tag as the budget record):
--   leases  ZSET request_id -> lease expiry (ms)
--   order   ZSET request_id -> admission counter (newest has the highest score)
--   reqs    HASH request_id -> "reserved_tokens:clamped_max_output_tokens"
--   state   HASH tokens, ts_ms (token bucket), kv_tokens (sum of reservations), counter

-- The time in ms: the caller's when given, else the Redis server's clock.
local function now_ms_from(arg)
  if arg == nil or arg == '' then
    local t = redis.call('TIME')
    return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  return tonumber(arg)
end

local function parse_entry(entry)
  local reserved, out = string.match(entry, '^(%d+):(%d+)$')
  return tonumber(reserved), tonumber(out)
end

-- Drop in-flight requests whose lease ended at or before now_ms; return how many.
local function reap(k_leases, k_order, k_reqs, k_state, now_ms, limit)
  local dead = redis.call('ZRANGEBYSCORE', k_leases, '-inf', now_ms, 'LIMIT', 0, limit)
  if #dead == 0 then return 0 end
  local freed = 0
  for _, id in ipairs(dead) do
    local entry = redis.call('HGET', k_reqs, id)
    if entry then freed = freed + parse_entry(entry) end
  end
  redis.call('ZREM', k_leases, unpack(dead))
  redis.call('ZREM', k_order, unpack(dead))
  redis.call('HDEL', k_reqs, unpack(dead))
  redis.call('HINCRBY', k_state, 'kv_tokens', -freed)
  return #dead
end

-- Token bucket level at now_ms from its stored level and time (refilled at rate tokens/s,
-- capped at burst; a bucket never written starts full), and its new time.
local function refill_from(tokens, ts, now_ms, rate, burst)
  tokens = tonumber(tokens)
  ts = tonumber(ts)
  if tokens == nil or ts == nil then
    tokens = burst
    ts = now_ms
  end
  if now_ms > ts then
    tokens = tokens + rate * (now_ms - ts) / 1000.0
    ts = now_ms
  end
  if tokens > burst then tokens = burst end
  return tokens, ts
end

local function refill(k_state, now_ms, rate, burst)
  local st = redis.call('HMGET', k_state, 'tokens', 'ts_ms')
  return refill_from(st[1], st[2], now_ms, rate, burst)
end
