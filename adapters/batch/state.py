"""Batch state in Redis: files, jobs, item streams, results, progress and counters.

Keys (one job's keys share the hash tag `{JOB}`, so its Lua scripts work on a cluster):

- `borrowd:batch:file:ID` (hash): an uploaded or produced file's record.
- `borrowd:batch:jobs` and `borrowd:batch:jobs:TENANT` (zsets, by creation time) and
  `borrowd:batch:active` (set): job ids.
- `borrowd:batch:{JOB}:job` (hash): the job's fields, `completed`/`failed` counts, figures.
- `borrowd:batch:{JOB}:items` (stream, consumer group `workers`): one entry per item to run.
- `borrowd:batch:{JOB}:bodies` (hash): custom_id -> {"line", "body"} of each request.
- `borrowd:batch:{JOB}:progress` (hash): custom_id -> checkpoint of an unfinished item.
- `borrowd:batch:{JOB}:results` (hash): custom_id -> its output or error line, set once
  (HSETNX): this is what makes every custom_id appear exactly once.
- `borrowd:batch:done:TENANT:KEY` (hash): output lines of completed custom_ids per job key
  (idempotent re-submission); `borrowd:batch:jobkey:TENANT:KEY`: the active job of a key.
- `borrowd:batch:tenant:NAME` (hash): the tenant's counters; `borrowd:batch:fair` (hash):
  fair-share finish tags (`t:NAME`), virtual time (`v`) and expected costs (`c:NAME`),
  shared by every worker (`models.batch.schedule`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

import redis.asyncio
from borrowd.models.batch.openai_format import STATUS_TIME_FIELD, TRANSITIONS, Status
from borrowd.models.batch.schedule import (
    COST_SMOOTHING,
    DEFAULT_COST_TOKENS,
    FairState,
    Settlement,
)

PREFIX = "borrowd:batch"
GROUP = "workers"
COUNTERS = ("attempts", "revocations", "resumes", "rate_limited", "reclaimed",
            "generated_tokens", "prompt_tokens", "kept_tokens", "reprefill_tokens",
            "redone_tokens")
"""Figures counted per job and per tenant (tokens: generated = every output token the
engines produced for the job; kept = those in final results; reprefill = partial output
prefilled again on resume; redone = output generated but not kept)."""

_COMPLETE = """
local status = redis.call('HGET', KEYS[2], 'status')
if status ~= 'validating' and status ~= 'in_progress' and status ~= 'cancelling' then
  return -1
end
local new = redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2])
if new == 1 then redis.call('HINCRBY', KEYS[2], ARGV[3], 1) end
redis.call('HDEL', KEYS[4], ARGV[1])
if ARGV[4] ~= '' then redis.call('XACK', KEYS[3], ARGV[5], ARGV[4]) end
return new
"""
_MOVE = """
local current = redis.call('HGET', KEYS[1], 'status')
for i = 5, #ARGV do
  if current == ARGV[i] then
    redis.call('HSET', KEYS[1], 'status', ARGV[1], ARGV[2], ARGV[3], ARGV[2] .. '_s', ARGV[4])
    return 1
  end
end
return 0
"""
_DISPATCH = """
local v = tonumber(redis.call('HGET', KEYS[1], 'v') or '0')
local best, best_s, best_w
for i = 2, #ARGV, 2 do
  local f = tonumber(redis.call('HGET', KEYS[1], 't:' .. ARGV[i]) or '0')
  local s = math.max(f, v)
  if best == nil or s < best_s or (s == best_s and ARGV[i] < best) then
    best, best_s, best_w = ARGV[i], s, tonumber(ARGV[i + 1])
  end
end
if best == nil then return false end
local c = tonumber(redis.call('HGET', KEYS[1], 'c:' .. best) or ARGV[1])
redis.call('HSET', KEYS[1], 't:' .. best, tostring(best_s + c / best_w))
if best_s > v then redis.call('HSET', KEYS[1], 'v', tostring(best_s)) end
return {best, tostring(c)}
"""
_SETTLE = """
local f = tonumber(redis.call('HGET', KEYS[1], 't:' .. ARGV[1]) or '0')
redis.call('HSET', KEYS[1], 't:' .. ARGV[1], tostring(f + tonumber(ARGV[2])))
if ARGV[3] ~= '' then
  local c = tonumber(redis.call('HGET', KEYS[1], 'c:' .. ARGV[1]) or ARGV[5])
  local a = tonumber(ARGV[4])
  redis.call('HSET', KEYS[1], 'c:' .. ARGV[1], tostring(c + a * (tonumber(ARGV[3]) - c)))
end
return 1
"""


def file_key(file_id: str) -> str:
    """Hash of a file's record."""
    return f"{PREFIX}:file:{file_id}"


def job_key(job_id: str, suffix: str = "job") -> str:
    """One of a job's keys: job, items, bodies, progress, results, lock."""
    return f"{PREFIX}:{{{job_id}}}:{suffix}"


JOBS = f"{PREFIX}:jobs"
ACTIVE = f"{PREFIX}:active"
FAIR = f"{PREFIX}:fair"


def done_key(tenant: str, key: str) -> str:
    """Output lines of completed custom_ids of one job key of one tenant."""
    return f"{PREFIX}:done:{tenant}:{key}"


def jobkey_key(tenant: str, key: str) -> str:
    """The active job id of one job key of one tenant."""
    return f"{PREFIX}:jobkey:{tenant}:{key}"


def tenant_jobs_key(tenant: str) -> str:
    """A tenant's job ids by creation time."""
    return f"{PREFIX}:jobs:{tenant}"


def tenant_key(tenant: str) -> str:
    """A tenant's counters."""
    return f"{PREFIX}:tenant:{tenant}"


class BatchStore:
    """Async access to the batch keys (the client must decode responses to str)."""

    def __init__(self, client: redis.asyncio.Redis) -> None:
        # Any: redis-py's stubs type replies as bytes | str whatever decode_responses says.
        self.client: Any = client
        self._complete = client.register_script(_COMPLETE)
        self._move = client.register_script(_MOVE)
        self._dispatch = client.register_script(_DISPATCH)
        self._settle = client.register_script(_SETTLE)

    # -- files -----------------------------------------------------------------------

    async def put_file(self, record: Mapping[str, Any]) -> None:
        """Store a file record (its `id` names it)."""
        await self.client.hset(file_key(record["id"]), mapping=_flat(record))

    async def file(self, file_id: str) -> dict[str, str] | None:
        """A file record, or None."""
        fields = await self.client.hgetall(file_key(file_id))
        return fields or None

    # -- jobs ------------------------------------------------------------------------

    async def put_job(self, job_id: str, fields: Mapping[str, Any], created_s: float) -> None:
        """Create a job's hash and index it (all jobs, and the tenant's)."""
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.hset(job_key(job_id), mapping=_flat(fields))
            pipe.zadd(JOBS, {job_id: created_s})
            pipe.zadd(tenant_jobs_key(str(fields["tenant"])), {job_id: created_s})
            await pipe.execute()

    async def job(self, job_id: str) -> dict[str, str] | None:
        """A job's hash, or None."""
        fields = await self.client.hgetall(job_key(job_id))
        return fields or None

    async def jobs(self, tenant: str | None, after: str | None,
                   limit: int) -> tuple[list[dict[str, str]], bool]:
        """Jobs newest first (all, or the tenant's), after job id `after`; and whether more
        remain."""
        index = JOBS if tenant is None else tenant_jobs_key(tenant)
        top = "+inf"
        if after is not None:
            score = await self.client.zscore(index, after)
            if score is None:
                return [], False
            top = f"({score!r}"
        ids = await self.client.zrevrangebyscore(index, top, "-inf", start=0, num=limit + 1)
        jobs = [j for j in [await self.job(i) for i in ids[:limit]] if j]
        return jobs, len(ids) > limit

    async def update_job(self, job_id: str, fields: Mapping[str, Any]) -> None:
        """Set fields of a job's hash."""
        await self.client.hset(job_key(job_id), mapping=_flat(fields))

    async def move(self, job_id: str, new: Status, now_s: float,
                   extra: Mapping[str, Any] | None = None) -> bool:
        """Move a job to `new` if its lifecycle allows from where it is; True if moved.

        The time is kept twice: OpenAI's integer field (`in_progress_at`) and a precise one
        (`in_progress_at_s`) for the figures."""
        allowed = [s.value for s, nxt in TRANSITIONS.items() if new in nxt]
        time_field = STATUS_TIME_FIELD[new]
        moved = bool(await self._move(keys=[job_key(job_id)],
                                      args=[new.value, time_field, int(now_s), repr(now_s),
                                            *allowed]))
        if moved and extra:
            await self.update_job(job_id, extra)
        return moved

    async def active_ids(self) -> list[str]:
        """Ids of jobs in progress or cancelling."""
        return sorted(await self.client.smembers(ACTIVE))

    async def set_active(self, job_id: str, active: bool) -> None:
        """Add or remove a job from the active set."""
        if active:
            await self.client.sadd(ACTIVE, job_id)
        else:
            await self.client.srem(ACTIVE, job_id)

    # -- items -----------------------------------------------------------------------

    async def enqueue(self, job_id: str, items: Iterable[tuple[str, int, dict]]) -> int:
        """Store bodies and add one stream entry per (custom_id, line, body); the count."""
        stream = job_key(job_id, "items")
        try:
            await self.client.xgroup_create(stream, GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        count = 0
        async with self.client.pipeline(transaction=False) as pipe:
            for custom_id, line, body in items:
                pipe.hset(job_key(job_id, "bodies"), custom_id,
                          json.dumps({"line": line, "body": body}, separators=(",", ":")))
                pipe.xadd(stream, {"cid": custom_id})
                count += 1
                if count % 500 == 0:
                    await pipe.execute()
            await pipe.execute()
        return count

    async def body(self, job_id: str, custom_id: str) -> dict[str, Any] | None:
        """{"line", "body"} of one item."""
        raw = await self.client.hget(job_key(job_id, "bodies"), custom_id)
        return None if raw is None else json.loads(raw)

    async def custom_ids(self, job_id: str) -> list[str]:
        """Every custom_id of a job."""
        return list(await self.client.hkeys(job_key(job_id, "bodies")))

    async def read_new(self, job_id: str, consumer: str) -> tuple[str, str] | None:
        """Take one undelivered item (entry id, custom_id) for `consumer`, or None."""
        reply = await self.client.xreadgroup(GROUP, consumer, {job_key(job_id, "items"): ">"},
                                             count=1)
        for _stream, entries in reply or ():
            for entry_id, fields in entries:
                return entry_id, fields["cid"]
        return None

    async def reclaim(self, job_id: str, consumer: str, min_idle_ms: int) -> tuple[str, str] | None:
        """Take over one item another consumer has held silent for `min_idle_ms`, or None."""
        reply = await self.client.xautoclaim(job_key(job_id, "items"), GROUP, consumer,
                                             min_idle_ms, start_id="0-0", count=1)
        for entry_id, fields in reply[1]:
            if fields:
                return entry_id, fields["cid"]
        return None

    async def heartbeat(self, job_id: str, consumer: str, entry_ids: list[str]) -> list[str]:
        """Reset the idle time of `consumer`'s entries; return those it no longer holds."""
        stream = job_key(job_id, "items")
        pending = await self.client.xpending_range(stream, GROUP, "-", "+", 10_000,
                                                   consumername=consumer)
        held = {p["message_id"] for p in pending}
        mine = [e for e in entry_ids if e in held]
        if mine:
            await self.client.xclaim(stream, GROUP, consumer, 0, mine, justid=True)
        return [e for e in entry_ids if e not in held]

    async def hand_over(self, job_id: str, consumer: str, entry_ids: list[str],
                        idle_ms: int) -> None:
        """Mark `consumer`'s entries as silent for `idle_ms`, so another worker reclaims
        them at once (a worker that stops hands its items over)."""
        stream = job_key(job_id, "items")
        pending = await self.client.xpending_range(stream, GROUP, "-", "+", 10_000,
                                                   consumername=consumer)
        held = {p["message_id"] for p in pending}
        mine = [e for e in entry_ids if e in held]
        if mine:
            await self.client.xclaim(stream, GROUP, consumer, 0, mine, idle=idle_ms,
                                     justid=True)

    async def ack(self, job_id: str, entry_id: str) -> None:
        """Acknowledge an entry without a result (cancelled items)."""
        await self.client.xack(job_key(job_id, "items"), GROUP, entry_id)

    async def pending_count(self, job_id: str) -> int:
        """Entries delivered but not acknowledged."""
        info = await self.client.xpending(job_key(job_id, "items"), GROUP)
        return int(info["pending"])

    # -- progress and results ----------------------------------------------------------

    async def progress(self, job_id: str, custom_id: str) -> dict[str, Any] | None:
        """The checkpoint of an unfinished item."""
        raw = await self.client.hget(job_key(job_id, "progress"), custom_id)
        return None if raw is None else json.loads(raw)

    async def save_progress(self, job_id: str, custom_id: str, state: Mapping[str, Any]) -> None:
        """Checkpoint an unfinished item."""
        await self.client.hset(job_key(job_id, "progress"), custom_id,
                               json.dumps(state, separators=(",", ":")))

    async def has_result(self, job_id: str, custom_id: str) -> bool:
        """True when the item already has its output or error line."""
        return bool(await self.client.hexists(job_key(job_id, "results"), custom_id))

    async def complete(self, job_id: str, custom_id: str, line: int, kind: str,
                       record: Mapping[str, Any], entry_id: str) -> bool:
        """Record an item's result once (first writer wins) and ack its entry; True if new.

        `kind` is "output" or "error". Nothing is recorded once the job has finished (its
        files are written), so a straggler cannot change its counts."""
        value = json.dumps({"line": line, "kind": kind, "record": record},
                           separators=(",", ":"))
        counter = "completed" if kind == "output" else "failed"
        new = await self._complete(
            keys=[job_key(job_id, "results"), job_key(job_id), job_key(job_id, "items"),
                  job_key(job_id, "progress")],
            args=[custom_id, value, counter, entry_id, GROUP])
        return new == 1

    async def results(self, job_id: str) -> list[dict[str, Any]]:
        """Every result of a job, in input line order."""
        values = []
        async for _cid, raw in self.client.hscan_iter(job_key(job_id, "results"), count=1000):
            values.append(json.loads(raw))
        return sorted(values, key=lambda v: v["line"])

    async def result_count(self, job_id: str) -> int:
        """How many items have their result."""
        return int(await self.client.hlen(job_key(job_id, "results")))

    async def drop_work(self, job_id: str) -> None:
        """Delete a finished job's stream, bodies, progress and results."""
        await self.client.delete(*(job_key(job_id, s) for s in
                                   ("items", "bodies", "progress", "results")))

    # -- counters, idempotency, fairness --------------------------------------------------

    async def count(self, job_id: str, tenant: str, counters: Mapping[str, int]) -> None:
        """Add to a job's and its tenant's counters."""
        nonzero = {k: v for k, v in counters.items() if v}
        if not nonzero:
            return
        async with self.client.pipeline(transaction=False) as pipe:
            for name, value in nonzero.items():
                pipe.hincrby(job_key(job_id), name, value)
                pipe.hincrby(tenant_key(tenant), name, value)
            await pipe.execute()

    async def count_tenant(self, tenant: str, counters: Mapping[str, int]) -> None:
        """Add to a tenant's counters only (its completed and failed items)."""
        async with self.client.pipeline(transaction=False) as pipe:
            for name, value in counters.items():
                pipe.hincrby(tenant_key(tenant), name, value)
            await pipe.execute()

    async def tenant_counters(self, tenant: str) -> dict[str, str]:
        """A tenant's counters."""
        return dict(await self.client.hgetall(tenant_key(tenant)))

    async def done_lines(self, tenant: str, key: str, custom_ids: list[str]) -> list[str | None]:
        """Output lines already completed under job key `key` (None where not)."""
        if not custom_ids:
            return []
        return list(await self.client.hmget(done_key(tenant, key), custom_ids))

    async def remember_done(self, tenant: str, key: str, lines: Mapping[str, str],
                            ttl_s: int) -> None:
        """Remember completed output lines under a job key."""
        if lines:
            async with self.client.pipeline(transaction=False) as pipe:
                pipe.hset(done_key(tenant, key), mapping=dict(lines))
                pipe.expire(done_key(tenant, key), ttl_s)
                await pipe.execute()

    async def claim_job_key(self, tenant: str, key: str, job_id: str) -> str | None:
        """Make `job_id` the active job of a job key; the other active job's id if one is."""
        name = jobkey_key(tenant, key)
        if await self.client.set(name, job_id, nx=True):
            return None
        return await self.client.get(name)

    async def release_job_key(self, tenant: str, key: str, job_id: str) -> None:
        """Forget the active job of a job key if it is `job_id`."""
        name = jobkey_key(tenant, key)
        if await self.client.get(name) == job_id:
            await self.client.delete(name)

    async def fair_state(self) -> FairState:
        """Fair-share finish tags, virtual time and expected costs."""
        raw = await self.client.hgetall(FAIR)
        tags = {k[2:]: float(v) for k, v in raw.items() if k.startswith("t:")}
        costs = {k[2:]: float(v) for k, v in raw.items() if k.startswith("c:")}
        return FairState(tags, float(raw.get("v", 0.0)), costs)

    async def dispatch(self, weights: Mapping[str, float]) -> tuple[str, float] | None:
        """Pick a backlogged tenant (tenant -> weight) and charge it its expected cost, in
        one script (`schedule.dispatch`); (tenant, tokens charged), or None."""
        args: list[str] = [repr(DEFAULT_COST_TOKENS)]
        for tenant, weight in sorted(weights.items()):
            args += [tenant, repr(float(weight))]
        reply = await self._dispatch(keys=[FAIR], args=args)
        if not reply:
            return None
        return str(reply[0]), float(reply[1])

    async def settle(self, tenant: str, settled: Settlement,
                     smoothing: float = COST_SMOOTHING) -> None:
        """Settle an ended dispatch of a tenant (`schedule.settle`, atomically)."""
        cost = "" if settled.cost_tokens is None else repr(settled.cost_tokens)
        await self._settle(keys=[FAIR], args=[tenant, repr(float(settled.tag_delta)), cost,
                                              repr(float(smoothing)), repr(DEFAULT_COST_TOKENS)])

    async def try_lock(self, job_id: str, holder: str, ttl_ms: int) -> bool:
        """Take a job's finalization lock."""
        return bool(await self.client.set(job_key(job_id, "lock"), holder, nx=True, px=ttl_ms))


def _flat(fields: Mapping[str, Any]) -> dict[str, str]:
    """Hash-safe values: JSON for containers and None, str for the rest."""
    out = {}
    for key, value in fields.items():
        if isinstance(value, dict | list) or value is None:
            out[key] = json.dumps(value)
        else:
            out[key] = str(value)
    return out
