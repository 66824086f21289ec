-- Extend the lease of a live admitted request.
-- KEYS: leases, order, reqs, state
-- ARGV: request_id, lease_ms, now_ms ('' = server clock), reap_limit
-- Returns 1 when renewed, 0 when the request is unknown (released, revoked or expired).
local k_leases, k_order, k_reqs, k_state = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local now_ms = now_ms_from(ARGV[3])
reap(k_leases, k_order, k_reqs, k_state, now_ms, tonumber(ARGV[4]))
if redis.call('ZSCORE', k_leases, ARGV[1]) == false then return 0 end
redis.call('ZADD', k_leases, now_ms + tonumber(ARGV[2]), ARGV[1])
return 1
