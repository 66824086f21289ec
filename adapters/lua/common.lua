-- Helpers shared by every borrowd script; prepended to each script when it is loaded.
--
-- Gate keys (same hash tag as the budget record):
--   leases  ZSET request_id -> lease expiry (ms)
--   order   ZSET request_id -> admission counter (newest has the highest score)
--   reqs    HASH request_id -> "reserved_tokens:clamped_max_output_tokens"
--   state   HASH tokens, ts_ms (token bucket), kv_tokens (sum of reservations), counter

-- Every number a script reads goes through parse_number or parse_int, never tonumber alone:
-- Lua's tonumber takes 'nan', 'inf', hex ('0x10') and 1e300. A number here is plain decimal,
-- finite and at most MAX_NUMBER in size (models/budget.py applies the same rule in Python).
local MAX_NUMBER = 1e15
-- Longest lease a budget record may carry (the stop switch's record).
local MAX_RECORD_TTL_MS = 3600000
-- Furthest a publish may move the epoch counter forward (fencing tokens come from INCR).
local MAX_EPOCH_JUMP = 1000000

local function parse_number(text)
  if type(text) ~= 'string' then return nil end
  if not (string.match(text, '^%-?%d+%.?%d*$') or string.match(text, '^%-?%d+%.?%d*[eE][%+%-]?%d+$'))
  then
    return nil
  end
  local x = tonumber(text)
  if x == nil or x ~= x or x > MAX_NUMBER or x < -MAX_NUMBER then return nil end
  return x
end

local function parse_int(text)
  if type(text) ~= 'string' or not string.match(text, '^%-?%d+$') then return nil end
  return parse_number(text)
end

-- A caller's argument as a number, or an error reply naming it (callers validate first).
local function arg_number(text, name)
  local x = parse_number(text)
  if x == nil then error(redis.error_reply('ERR borrowd: bad argument ' .. name)) end
  return x
end

local function arg_int(text, name)
  local x = parse_int(text)
  if x == nil then error(redis.error_reply('ERR borrowd: bad argument ' .. name)) end
  return x
end

-- The time in ms: the caller's when given, else the Redis server's clock.
local function now_ms_from(arg)
  if arg == nil or arg == '' then
    local t = redis.call('TIME')
    return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  return arg_int(arg, 'now_ms')
end

-- Reserved tokens and clamped output of a reqs entry; nil, nil when it is malformed.
local function parse_entry(entry)
  local reserved, out = string.match(entry or '', '^(%d+):(%d+)$')
  reserved, out = parse_int(reserved), parse_int(out)
  if reserved == nil or out == nil then return nil, nil end
  return reserved, out
end

-- The epoch counter: 0 when absent, nil when malformed.
local function read_counter(k_epoch)
  local text = redis.call('GET', k_epoch)
  if not text then return 0 end
  local counter = parse_int(text)
  if counter == nil or counter < 0 then return nil end
  return counter
end

-- The pool a key belongs to (its hash tag).
local function pool_of(key)
  return string.match(key, '{(.*)}')
end

-- A record's fields, in this order: schema, pool, mode, epoch, seq, issued_at, ttl_ms,
-- batch_tokens_per_s, batch_burst_tokens, max_batch_seqs, max_batch_kv_tokens,
-- max_batch_output_tokens (HMGET order; no tables of names, every call pays for those).
-- Checked and parsed: the record, or nil and why ('no_budget' | 'foreign_schema' |
-- 'malformed'). Budget.from_fields is the same rule.
local function check_record(v, pool, schema)
  if not v[1] then return nil, 'no_budget' end
  if v[1] ~= schema then return nil, 'foreign_schema' end
  local mode = v[3]
  if v[2] ~= pool or not (mode == 'open' or mode == 'ramp' or mode == 'closed'
      or mode == 'stopped' or mode == 'failsafe') then
    return nil, 'malformed'
  end
  local epoch, seq, ttl_ms = parse_int(v[4]), parse_int(v[5]), parse_int(v[7])
  local issued_at, rate = parse_number(v[6]), parse_number(v[8])
  local burst, seqs, kv, out = parse_int(v[9]), parse_int(v[10]), parse_int(v[11]), parse_int(v[12])
  if not (epoch and seq and ttl_ms and issued_at and rate and burst and seqs and kv and out)
      or epoch < 0 or seq < 0 or issued_at < 0 or rate < 0 or burst < 0 or seqs < 0 or kv < 0
      or out < 0 or ttl_ms <= 0 or ttl_ms > MAX_RECORD_TTL_MS then
    return nil, 'malformed'
  end
  return {mode = mode, epoch = epoch, seq = seq, issued_at = issued_at, ttl_ms = ttl_ms,
    batch_tokens_per_s = rate, batch_burst_tokens = burst, max_batch_seqs = seqs,
    max_batch_kv_tokens = kv, max_batch_output_tokens = out}, 'ok'
end

local function read_record(k_budget, schema)
  local v = redis.call('HMGET', k_budget, 'schema', 'pool', 'mode', 'epoch', 'seq', 'issued_at',
    'ttl_ms', 'batch_tokens_per_s', 'batch_burst_tokens', 'max_batch_seqs',
    'max_batch_kv_tokens', 'max_batch_output_tokens')
  return check_record(v, pool_of(k_budget), schema)
end

-- The record's own lease holds at now_ms: issued_at <= now + ttl (not from the future) and
-- now < issued_at + ttl, whatever the key's TTL says (Budget.is_fresh is the same rule).
local function lease_live(r, now_ms)
  local issued_ms = r.issued_at * 1000
  return issued_ms - r.ttl_ms <= now_ms and now_ms < issued_ms + r.ttl_ms
end

-- Sum of the reservations of the in-flight requests (malformed entries count 0).
local function sum_reservations(k_reqs)
  local total = 0
  for _, entry in ipairs(redis.call('HVALS', k_reqs)) do
    local reserved = parse_entry(entry)
    if reserved then total = total + reserved end
  end
  return total
end

-- Reserved KV tokens from their stored sum `text` (read here when not given); recomputed
-- from the reservations when the stored sum is malformed.
local function kv_tokens(k_state, k_reqs, text)
  if text == nil then text = redis.call('HGET', k_state, 'kv_tokens') end
  local kv = parse_int(text or '0')
  if kv == nil or kv < 0 then
    kv = sum_reservations(k_reqs)
    redis.call('HSET', k_state, 'kv_tokens', kv)
  end
  return kv
end

-- Forget in-flight request `ids` (a malformed entry frees nothing but never stops the
-- reaping); keep the KV sum right (recomputed when it or an entry is malformed). Returns
-- the tokens freed.
local function drop_requests(k_leases, k_order, k_reqs, k_state, ids)
  local freed, broken = 0, false
  for _, entry in ipairs(redis.call('HMGET', k_reqs, unpack(ids))) do
    if entry then
      local reserved = parse_entry(entry)
      if reserved then freed = freed + reserved else broken = true end
    end
  end
  redis.call('ZREM', k_leases, unpack(ids))
  redis.call('ZREM', k_order, unpack(ids))
  redis.call('HDEL', k_reqs, unpack(ids))
  local kv = redis.pcall('HINCRBY', k_state, 'kv_tokens', -freed)
  if broken or type(kv) ~= 'number' or kv < 0 or kv > MAX_NUMBER then
    redis.call('HSET', k_state, 'kv_tokens', sum_reservations(k_reqs))
  end
  return freed
end

-- Drop in-flight requests whose lease ended at or before now_ms; return how many.
local function reap(k_leases, k_order, k_reqs, k_state, now_ms, limit)
  local dead = redis.call('ZRANGEBYSCORE', k_leases, '-inf', now_ms, 'LIMIT', 0, limit)
  if #dead == 0 then return 0 end
  drop_requests(k_leases, k_order, k_reqs, k_state, dead)
  return #dead
end

-- Token bucket level at now_ms from its stored level and time (refilled at rate tokens/s,
-- capped at burst; a bucket never written starts full, a malformed one empty), and its time.
local function refill_from(tokens_text, ts_text, now_ms, rate, burst)
  local tokens, ts
  if not tokens_text and not ts_text then
    tokens, ts = burst, now_ms
  else
    tokens, ts = parse_number(tokens_text), parse_number(ts_text)
    if tokens == nil or ts == nil or tokens < 0 then tokens, ts = 0, now_ms end
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
