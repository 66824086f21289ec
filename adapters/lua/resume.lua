-- Clear the stop switch; drop the operator's stopped record so the controller's next record
-- takes over (until then no record means no new batch work).
-- KEYS: budget, stop
-- Returns 1 when the stop switch was set.
local was_set = redis.call('DEL', KEYS[2])
if redis.call('HGET', KEYS[1], 'mode') == 'stopped' then redis.call('DEL', KEYS[1]) end
return was_set
