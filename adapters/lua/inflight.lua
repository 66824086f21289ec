-- Batch work in flight after reaping expired leases.
-- KEYS: leases, order, reqs, state
-- ARGV: now_ms ('' = server clock), reap_limit
-- Returns {seqs, kv_tokens, bucket_tokens (string, '' when the bucket has not started)}.
local k_leases, k_order, k_reqs, k_state = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local now_ms = now_ms_from(ARGV[1])
reap(k_leases, k_order, k_reqs, k_state, now_ms, tonumber(ARGV[2]))
local st = redis.call('HMGET', k_state, 'kv_tokens', 'tokens')
return {redis.call('ZCARD', k_leases), tonumber(st[1] or '0'), st[2] or ''}
