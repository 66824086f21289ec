-- Write a pool's budget record (fenced), push it, and revoke in-flight work above it.
-- KEYS: budget, epoch, stop, seq, leases, order, reqs, state, revoke
-- ARGV: action ('publish' | 'stop'), channel, schema, epoch, ttl_ms, issued_at, now_ms,
--       stop_reason, reap_limit, revoke_maxlen, then the record's body as field, value pairs
-- 'publish' refuses an epoch older than the newest (the epoch counter, or a live stored
-- record's epoch) and one more than MAX_EPOCH_JUMP past the counter, so no record can carry
-- an epoch that fences the elected leaders out; 'stop' sets the stop switch and writes at
-- the newest epoch. While the stop switch is set, the record written is a `stopped` one,
-- whatever the body says.
-- Returns {1, record_json, revoked_count}, {0, 'fenced', newest_epoch} or
-- {0, 'epoch_jump', epoch_counter}.
local k_budget, k_epoch, k_stop, k_seq = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local k_leases, k_order, k_reqs, k_state, k_revoke = KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9]
local action, channel, schema = ARGV[1], ARGV[2], ARGV[3]
local ttl_ms = arg_int(ARGV[5], 'ttl_ms')
if ttl_ms <= 0 or ttl_ms > MAX_RECORD_TTL_MS then
  error(redis.error_reply('ERR borrowd: bad argument ttl_ms'))
end
arg_number(ARGV[6], 'issued_at')
local redis_now_ms = now_ms_from('')
-- Reap with the earlier of the writer's clock and Redis's: a writer whose clock runs ahead
-- must never expire a lease that the gates (on Redis's clock) still count as live.
local now_ms = math.min(arg_int(ARGV[7], 'now_ms'), redis_now_ms)

local counter = read_counter(k_epoch)
if counter == nil then
  -- The stop switch works whatever else is broken; the controller's writes wait for a fix.
  if action ~= 'stop' then
    error(redis.error_reply('ERR borrowd: the epoch counter is malformed'))
  end
  counter = 0
end
local newest = counter
local stored = read_record(k_budget, schema)
if stored and lease_live(stored, redis_now_ms) and stored.epoch <= counter + MAX_EPOCH_JUMP
  and stored.epoch > newest then
  newest = stored.epoch
end
local epoch
if action == 'stop' then
  redis.call('SET', k_stop, ARGV[8])
  epoch = newest
else
  epoch = arg_int(ARGV[4], 'epoch')
  if epoch < newest then return {0, 'fenced', newest} end
  if epoch > counter + MAX_EPOCH_JUMP then return {0, 'epoch_jump', counter} end
  if epoch > counter then redis.call('SET', k_epoch, epoch) end
end

local rec = {}
for i = 11, #ARGV, 2 do rec[ARGV[i]] = ARGV[i + 1] end
local stop_reason = redis.call('GET', k_stop)
if stop_reason then
  rec.mode = 'stopped'
  rec.reason = 'stopped by operator: ' .. stop_reason
  rec.batch_tokens_per_s = '0.0'
  rec.batch_burst_tokens = '0'
  rec.max_batch_seqs = '0'
  rec.max_batch_kv_tokens = '0'
  rec.max_batch_output_tokens = '0'
end
rec.schema = schema
rec.epoch = tostring(epoch)
rec.seq = tostring(redis.call('INCR', k_seq))
rec.issued_at = ARGV[6]
rec.ttl_ms = tostring(ttl_ms)
local caps = check_record({rec.schema, rec.pool, rec.mode, rec.epoch, rec.seq, rec.issued_at,
  rec.ttl_ms, rec.batch_tokens_per_s, rec.batch_burst_tokens, rec.max_batch_seqs,
  rec.max_batch_kv_tokens, rec.max_batch_output_tokens}, pool_of(k_budget), schema)
if caps == nil then error(redis.error_reply('ERR borrowd: the record to publish is malformed')) end

local flat = {}
for k, v in pairs(rec) do
  flat[#flat + 1] = k
  flat[#flat + 1] = v
end
local old = redis.call('HMGET', k_budget, 'batch_tokens_per_s', 'batch_burst_tokens')
redis.call('DEL', k_budget)
redis.call('HSET', k_budget, unpack(flat))
redis.call('PEXPIRE', k_budget, ttl_ms)
local payload = cjson.encode(rec)
redis.call('PUBLISH', channel, payload)

-- Reconcile: what is in flight must fit under the new caps; revoke the newest until it does.
reap(k_leases, k_order, k_reqs, k_state, now_ms, arg_int(ARGV[9], 'reap_limit'))
local max_seqs, max_kv = caps.max_batch_seqs, caps.max_batch_kv_tokens
local seqs = redis.call('ZCARD', k_leases)
local kv = kv_tokens(k_state, k_reqs)
local revoked, broken = 0, false
while seqs > max_seqs or kv > max_kv do
  local newest_ids = redis.call('ZREVRANGE', k_order, 0, 63)
  if #newest_ids == 0 then break end
  for _, id in ipairs(newest_ids) do
    if seqs <= max_seqs and kv <= max_kv then break end
    local why = 'kv_cap'
    if stop_reason then why = 'stopped' elseif seqs > max_seqs then why = 'seq_cap' end
    local entry = redis.call('HGET', k_reqs, id)
    local reserved = 0
    if entry then
      reserved = parse_entry(entry)
      if reserved == nil then reserved, broken = 0, true end
    end
    redis.call('ZREM', k_leases, id)
    redis.call('ZREM', k_order, id)
    redis.call('HDEL', k_reqs, id)
    seqs = seqs - 1
    kv = kv - reserved
    redis.call('XADD', k_revoke, 'MAXLEN', '~', ARGV[10], '*', 'request_id', id,
      'reason', why, 'epoch', rec.epoch, 'seq', rec.seq)
    revoked = revoked + 1
  end
end
if broken or kv < 0 then kv = sum_reservations(k_reqs) end
if revoked > 0 then redis.call('HSET', k_state, 'kv_tokens', kv) end

-- A cut burst takes effect at once: bring the bucket to now under the old record's rate,
-- then hold it to the new burst (without an old record it only shrinks to the new burst).
local st = redis.call('HMGET', k_state, 'tokens', 'ts_ms')
if st[1] then
  local old_rate = parse_number(old[1]) or 0
  local old_burst = parse_int(old[2]) or parse_number(st[1]) or 0
  local tokens, ts = refill_from(st[1], st[2], now_ms, old_rate, old_burst)
  if tokens > caps.batch_burst_tokens then tokens = caps.batch_burst_tokens end
  redis.call('HSET', k_state, 'tokens', tostring(tokens), 'ts_ms', ts)
end
return {1, payload, revoked}
