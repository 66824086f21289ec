-- Admit one batch request atomically, or say why not.
-- KEYS: budget, epoch, stop, leases, order, reqs, state
-- ARGV: request_id, prompt_tokens, max_output_tokens, now_ms ('' = server clock), lease_ms,
--       schema, retry_ms (retry hint when no better one is known), reap_limit
-- Returns {admitted 0|1, reason, retry_after_ms, clamped_max_output_tokens, lease_ms}.
local k_budget, k_epoch, k_stop = KEYS[1], KEYS[2], KEYS[3]
local k_leases, k_order, k_reqs, k_state = KEYS[4], KEYS[5], KEYS[6], KEYS[7]
local id = ARGV[1]
local prompt = tonumber(ARGV[2])
local want_out = tonumber(ARGV[3])
local caller_clock = ARGV[4] ~= ''
local now_ms = now_ms_from(ARGV[4])
local lease_ms = tonumber(ARGV[5])
local retry_ms = tonumber(ARGV[7])

reap(k_leases, k_order, k_reqs, k_state, now_ms, tonumber(ARGV[8]))

local function deny(reason, after_ms)
  return {0, reason, math.ceil(after_ms), 0, 0}
end

local existing = redis.call('HGET', k_reqs, id)
if existing then
  -- A retried admission of a live request: keep its reservation, extend its lease.
  local _, out = parse_entry(existing)
  redis.call('ZADD', k_leases, now_ms + lease_ms, id)
  return {1, 'duplicate', 0, out, lease_ms}
end

local f = redis.call('HMGET', k_budget, 'schema', 'epoch', 'mode', 'issued_at', 'ttl_ms',
  'batch_tokens_per_s', 'batch_burst_tokens', 'max_batch_seqs', 'max_batch_kv_tokens',
  'max_batch_output_tokens')
if not f[1] then return deny('no_budget', retry_ms) end
if f[1] ~= ARGV[6] then return deny('foreign_schema', retry_ms) end
local n = {}
for i = 2, 10 do
  if i ~= 3 then
    n[i] = tonumber(f[i])
    if n[i] == nil then return deny('malformed', retry_ms) end
  end
end
local epoch, issued_at, ttl_ms = n[2], n[4], n[5]
local rate, burst, max_seqs, max_kv, max_out = n[6], n[7], n[8], n[9], n[10]
if epoch < tonumber(redis.call('GET', k_epoch) or '0') then return deny('fenced', retry_ms) end
if caller_clock and now_ms >= issued_at * 1000 + ttl_ms then return deny('stale', retry_ms) end
if redis.call('EXISTS', k_stop) == 1 then return deny('stopped', retry_ms) end
if f[3] ~= 'open' and f[3] ~= 'ramp' then return deny('mode_' .. tostring(f[3]), retry_ms) end
if rate <= 0 or max_seqs <= 0 or max_out <= 0 then return deny('closed', retry_ms) end

local out = want_out
if out > max_out then out = max_out end
local cost = prompt + out
if cost > burst or cost > max_kv then return deny('too_large', retry_ms) end

if redis.call('ZCARD', k_leases) >= max_seqs then return deny('seq_cap', retry_ms) end
-- One read and one write of the gate state keep the script short.
local st = redis.call('HMGET', k_state, 'kv_tokens', 'tokens', 'ts_ms', 'counter')
local kv = tonumber(st[1]) or 0
if kv + cost > max_kv then return deny('kv_cap', retry_ms) end

local tokens, ts = refill_from(st[2], st[3], now_ms, rate, burst)
if tokens < cost then return deny('rate', (cost - tokens) * 1000.0 / rate) end
local counter = (tonumber(st[4]) or 0) + 1
redis.call('HSET', k_state, 'tokens', tostring(tokens - cost), 'ts_ms', ts,
  'kv_tokens', kv + cost, 'counter', counter)
redis.call('ZADD', k_leases, now_ms + lease_ms, id)
redis.call('ZADD', k_order, counter, id)
redis.call('HSET', k_reqs, id, cost .. ':' .. out)
return {1, 'admitted', 0, out, lease_ms}
