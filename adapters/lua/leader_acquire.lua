-- Take the leader lease if free (or keep it if already ours); a new holder bumps the epoch.
-- KEYS: leader, epoch
-- ARGV: holder_id, lease_ms
-- Returns the holder's epoch, or 0 when another holder has the lease; an error reply when
-- the epoch counter is malformed (no leader can be fenced correctly until it is fixed).
local lease_ms = arg_int(ARGV[2], 'lease_ms')
local counter = read_counter(KEYS[2])
if counter == nil then error(redis.error_reply('ERR borrowd: the epoch counter is malformed')) end
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], lease_ms)
  return counter
end
if holder then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', lease_ms)
return redis.call('INCR', KEYS[2])
