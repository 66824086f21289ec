-- Admit one batch request atomically, or say why not.
-- KEYS: budget, epoch, stop, leases, order, reqs, state
-- ARGV: request_id, prompt_tokens, max_output_tokens, now_ms ('' = server clock), lease_ms,
--       schema, retry_ms (retry hint when no better one is known), reap_limit
-- Returns {admitted 0|1, reason, retry_after_ms, clamped_max_output_tokens, lease_ms}.
local k_budget, k_epoch, k_stop = KEYS[1], KEYS[2], KEYS[3]
local k_leases, k_order, k_reqs, k_state = KEYS[4], KEYS[5], KEYS[6], KEYS[7]
local id = ARGV[1]
local prompt = arg_int(ARGV[2], 'prompt_tokens')
local want_out = arg_int(ARGV[3], 'max_output_tokens')
local now_ms = now_ms_from(ARGV[4])
local lease_ms = arg_int(ARGV[5], 'lease_ms')
local retry_ms = arg_number(ARGV[7], 'retry_ms')

reap(k_leases, k_order, k_reqs, k_state, now_ms, arg_int(ARGV[8], 'reap_limit'))

local function deny(reason, after_ms)
  return {0, reason, math.ceil(after_ms), 0, 0}
end

local existing = redis.call('HGET', k_reqs, id)
if existing then
  -- A retried admission of a live request keeps its reservation and extends its lease; the
  -- same id with another prompt is a different request and is refused (it was never charged).
  local reserved, out = parse_entry(existing)
  if reserved == nil then return deny('malformed', retry_ms) end
  if prompt ~= reserved - out then return deny('duplicate_mismatch', retry_ms) end
  redis.call('ZADD', k_leases, now_ms + lease_ms, id)
  return {1, 'duplicate', 0, out, lease_ms}
end

local rec, why = read_record(k_budget, ARGV[6])
if rec == nil then return deny(why, retry_ms) end
local counter = read_counter(k_epoch)
if counter == nil or rec.epoch > counter + MAX_EPOCH_JUMP then return deny('malformed', retry_ms) end
if rec.epoch < counter then return deny('fenced', retry_ms) end
if not lease_live(rec, now_ms) then return deny('stale', retry_ms) end
if redis.call('EXISTS', k_stop) == 1 then return deny('stopped', retry_ms) end
if rec.mode ~= 'open' and rec.mode ~= 'ramp' then return deny('mode_' .. rec.mode, retry_ms) end
local rate, burst, max_seqs = rec.batch_tokens_per_s, rec.batch_burst_tokens, rec.max_batch_seqs
local max_kv, max_out = rec.max_batch_kv_tokens, rec.max_batch_output_tokens
if rate <= 0 or max_seqs <= 0 or max_out <= 0 then return deny('closed', retry_ms) end

local out = want_out
if out > max_out then out = max_out end
local cost = prompt + out
if cost > burst or cost > max_kv then return deny('too_large', retry_ms) end

if redis.call('ZCARD', k_leases) >= max_seqs then return deny('seq_cap', retry_ms) end
-- One read and one write of the gate state keep the script short.
local st = redis.call('HMGET', k_state, 'tokens', 'ts_ms', 'counter', 'kv_tokens')
local kv = kv_tokens(k_state, k_reqs, st[4])
if kv + cost > max_kv then return deny('kv_cap', retry_ms) end

local tokens, ts = refill_from(st[1], st[2], now_ms, rate, burst)
if tokens < cost then return deny('rate', (cost - tokens) * 1000.0 / rate) end
local counter_n = (parse_int(st[3] or '0') or 0) + 1
redis.call('HSET', k_state, 'tokens', tostring(tokens - cost), 'ts_ms', ts,
  'kv_tokens', kv + cost, 'counter', counter_n)
redis.call('ZADD', k_leases, now_ms + lease_ms, id)
redis.call('ZADD', k_order, counter_n, id)
redis.call('HSET', k_reqs, id, cost .. ':' .. out)
return {1, 'admitted', 0, out, lease_ms}
