-- Extend the lease of a live admitted request.
-- KEYS: leases, order, reqs, state
-- ARGV: request_id, lease_ms, now_ms ('' = server clock), reap_limit
-- Returns 1 when renewed, 0 when the request is unknown (released, revoked or expired).
local k_leases, k_order, k_reqs, k_state = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local lease_ms = arg_int(ARGV[2], 'lease_ms')
local now_ms = now_ms_from(ARGV[3])
reap(k_leases, k_order, k_reqs, k_state, now_ms, arg_int(ARGV[4], 'reap_limit'))
if redis.call('ZSCORE', k_leases, ARGV[1]) == false then return 0 end
redis.call('ZADD', k_leases, now_ms + lease_ms, ARGV[1])
return 1
