-- Batch work in flight after reaping expired leases.
-- KEYS: leases, order, reqs, state
-- ARGV: now_ms ('' = server clock), reap_limit
-- Returns {seqs, kv_tokens, bucket_tokens (string, '' when the bucket has not started or its
-- stored level is malformed)}.
local k_leases, k_order, k_reqs, k_state = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local now_ms = now_ms_from(ARGV[1])
reap(k_leases, k_order, k_reqs, k_state, now_ms, arg_int(ARGV[2], 'reap_limit'))
local tokens = redis.call('HGET', k_state, 'tokens')
if not parse_number(tokens) then tokens = '' end
return {redis.call('ZCARD', k_leases), kv_tokens(k_state, k_reqs), tokens}
