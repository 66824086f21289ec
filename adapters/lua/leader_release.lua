-- Give up the leader lease only if `holder_id` still holds it.
-- KEYS: leader
-- ARGV: holder_id
-- Returns 1 when released.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
return redis.call('DEL', KEYS[1])
