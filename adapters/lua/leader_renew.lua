-- Extend the leader lease only if `holder_id` still holds it.
-- KEYS: leader
-- ARGV: holder_id, lease_ms
-- Returns 1 when renewed, 0 when the lease is gone or someone else's.
local lease_ms = arg_int(ARGV[2], 'lease_ms')
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], lease_ms)
return 1
