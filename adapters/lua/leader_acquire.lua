-- Take the leader lease if free (or keep it if already ours); a new holder bumps the epoch.
-- KEYS: leader, epoch
-- ARGV: holder_id, lease_ms
-- Returns the holder's epoch, or 0 when another holder has the lease.
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return tonumber(redis.call('GET', KEYS[2]) or '0')
end
if holder then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return redis.call('INCR', KEYS[2])
