-- Write a pool's budget record (fenced), push it, and revoke in-flight work above it.
-- KEYS: budget, epoch, stop, seq, leases, order, reqs, state, revoke
-- ARGV: action ('publish' | 'stop'), channel, schema, epoch, ttl_ms, issued_at, now_ms,
--       stop_reason, reap_limit, revoke_maxlen, then the record's body as field, value pairs
-- 'publish' refuses an epoch older than the epoch counter or the stored record; 'stop' sets
-- the stop switch and writes at the newest epoch. While the stop switch is set, the record
-- written is a `stopped` one, whatever the body says.
-- Returns {1, record_json, revoked_count} or {0, 'fenced', newest_epoch}.
local k_budget, k_epoch, k_stop, k_seq = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local k_leases, k_order, k_reqs, k_state, k_revoke = KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9]
local action, channel, schema = ARGV[1], ARGV[2], ARGV[3]
local ttl_ms = tonumber(ARGV[5])
-- Reap with the earlier of the writer's clock and Redis's: a writer whose clock runs ahead
-- must never expire a lease that the gates (on Redis's clock) still count as live.
local now_ms = math.min(tonumber(ARGV[7]), now_ms_from(''))

local counter = tonumber(redis.call('GET', k_epoch) or '0') or 0
local stored = tonumber(redis.call('HGET', k_budget, 'epoch') or '0') or 0
local newest = math.max(counter, stored)
local epoch
if action == 'stop' then
  redis.call('SET', k_stop, ARGV[8])
  epoch = newest
else
  epoch = tonumber(ARGV[4])
  if epoch < newest then return {0, 'fenced', newest} end
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
reap(k_leases, k_order, k_reqs, k_state, now_ms, tonumber(ARGV[9]))
local max_seqs = tonumber(rec.max_batch_seqs) or 0
local max_kv = tonumber(rec.max_batch_kv_tokens) or 0
local seqs = redis.call('ZCARD', k_leases)
local kv = tonumber(redis.call('HGET', k_state, 'kv_tokens') or '0')
local revoked = 0
while seqs > max_seqs or kv > max_kv do
  local newest_ids = redis.call('ZREVRANGE', k_order, 0, 63)
  if #newest_ids == 0 then break end
  for _, id in ipairs(newest_ids) do
    if seqs <= max_seqs and kv <= max_kv then break end
    local why = 'kv_cap'
    if stop_reason then why = 'stopped' elseif seqs > max_seqs then why = 'seq_cap' end
    local entry = redis.call('HGET', k_reqs, id)
    local reserved = 0
    if entry then reserved = parse_entry(entry) end
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
if revoked > 0 then redis.call('HSET', k_state, 'kv_tokens', kv) end

-- A cut burst takes effect at once: bring the bucket to now under the old record's rate,
-- then hold it to the new burst (without an old record it only shrinks to the new burst).
local st = redis.call('HMGET', k_state, 'tokens', 'ts_ms')
if st[1] then
  local old_rate = tonumber(old[1]) or 0
  local old_burst = tonumber(old[2]) or tonumber(st[1])
  local tokens, ts = refill_from(st[1], st[2], now_ms, old_rate, old_burst)
  local burst = tonumber(rec.batch_burst_tokens) or 0
  if tokens > burst then tokens = burst end
  redis.call('HSET', k_state, 'tokens', tostring(tokens), 'ts_ms', ts)
end
return {1, payload, revoked}
