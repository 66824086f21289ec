-- Release a finished request: free its seat and KV reservation, refund unused output tokens.
-- KEYS: budget, leases, order, reqs, state
-- ARGV: request_id, output_tokens ('' = unknown: refund nothing), now_ms ('' = server clock),
--       reap_limit
-- Returns {released 0|1, refunded_tokens}.
local k_budget, k_leases, k_order, k_reqs, k_state = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local id = ARGV[1]
local used = nil
if ARGV[2] ~= '' then used = arg_int(ARGV[2], 'output_tokens') end
local now_ms = now_ms_from(ARGV[3])
reap(k_leases, k_order, k_reqs, k_state, now_ms, arg_int(ARGV[4], 'reap_limit'))

local entry = redis.call('HGET', k_reqs, id)
if not entry then return {0, 0} end
local _, out = parse_entry(entry)
drop_requests(k_leases, k_order, k_reqs, k_state, {id})

local refund = 0
if used ~= nil and out ~= nil and used < out then refund = out - used end
if refund > 0 then
  local b = redis.call('HMGET', k_budget, 'batch_tokens_per_s', 'batch_burst_tokens')
  local rate, burst = parse_number(b[1]), parse_int(b[2])
  if rate and burst and rate >= 0 and burst >= 0 then
    local tokens, ts = refill(k_state, now_ms, rate, burst)
    tokens = tokens + refund
    if tokens > burst then tokens = burst end
    redis.call('HSET', k_state, 'tokens', tostring(tokens), 'ts_ms', ts)
  end
end
return {1, refund}
