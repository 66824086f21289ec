"""`borrowd batch worker`: runs batch items through the proxy, resuming what is revoked.

Each of `concurrency` slots picks the next item: the backlogged tenant with the smallest
fair-share start tag, charged its expected cost in the same Redis script
(`schedule.dispatch`), then that tenant's earliest-deadline job, an item another worker
left silent past `claim_idle_s` (XAUTOCLAIM) or else a new one (XREADGROUP). The item runs
attempt after attempt until it finishes: a revoked or broken stream resumes from its text
so far, a 429/503 waits its Retry-After, a 4xx ends it in the error file. When a run of an
item ends, what it cost settles the charge (`schedule.settle`, in Redis for every worker).
Progress is checkpointed to Redis every `checkpoint_tokens`, so an item taken over from a
dead worker resumes too. The result is recorded once (HSETNX) and the entry acknowledged in
one script. A heartbeat keeps this worker's entries from being reclaimed while it lives; an
entry another worker took over is dropped here.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import redis
from borrowd.adapters.batch.config import BatchConfig
from borrowd.adapters.batch.proxy_client import Attempt, attempt, prompt_estimate
from borrowd.adapters.batch.state import BatchStore
from borrowd.models.batch.openai_format import Status, error_line, output_line
from borrowd.models.batch.resume import (
    ChunkAccumulator,
    Segment,
    merge_segments,
    remaining_tokens,
    resume_body,
)
from borrowd.models.batch.schedule import JobRef, dispatch_cost_tokens, edf_order, settlement

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class JobInfo:
    """What a worker needs of a job."""

    job_id: str
    tenant: str
    endpoint: str
    status: str
    expires_s: float
    created_s: float


@dataclass
class _Item:
    """An item this worker holds (mutable while it runs)."""

    job: JobInfo
    entry_id: str
    custom_id: str
    task: asyncio.Task | None = None
    drop_reason: str = ""
    charged_tokens: float = 0.0


@dataclass
class _Progress:
    """An unfinished item's state, as checkpointed in Redis."""

    segments: list[Segment] = field(default_factory=list)
    failures: int = 0

    def to_json(self) -> dict[str, Any]:
        """The checkpoint's JSON."""
        return {"segments": [dataclasses.asdict(s) for s in self.segments],
                "failures": self.failures}

    @classmethod
    def from_json(cls, raw: dict[str, Any] | None) -> _Progress:
        """A checkpoint read back (empty when there is none)."""
        if not raw:
            return cls()
        return cls([Segment(**s) for s in raw.get("segments", [])], int(raw.get("failures", 0)))

    @property
    def text(self) -> str:
        """The text generated so far."""
        return "".join(s.text for s in self.segments)

    @property
    def tokens(self) -> int:
        """Output tokens generated so far."""
        return sum(s.completion_tokens for s in self.segments)


class Worker:
    """One worker process's slots, view of the jobs and heartbeat."""

    def __init__(self, store: BatchStore, config: BatchConfig, consumer: str | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.config = config
        self.cfg = config.worker
        self.consumer = consumer or f"worker-{uuid.uuid4().hex[:12]}"
        self.clock = clock
        self.jobs: dict[str, JobInfo] = {}
        self._drained_until: dict[str, float] = {}
        self._reclaim_at: dict[str, float] = {}
        self._held: dict[str, _Item] = {}
        self._session: aiohttp.ClientSession | None = None
        self._pick_lock = asyncio.Lock()

    async def run(self, stop: asyncio.Event) -> None:
        """Work until `stop` is set; items in flight are handed over to other workers."""
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=5.0,
                                        sock_read=self.cfg.request_timeout_s)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            self._session = session
            await self._refresh()
            tasks = [asyncio.create_task(self._slot(stop)) for _ in range(self.cfg.concurrency)]
            tasks.append(asyncio.create_task(self._housekeeping(stop)))
            await stop.wait()
            held = list(self._held.values())
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._hand_over(held)

    async def _hand_over(self, items: list[_Item]) -> None:
        """Leave unfinished items to other workers now, not after `claim_idle_s`."""
        by_job: dict[str, list[str]] = {}
        for item in items:
            by_job.setdefault(item.job.job_id, []).append(item.entry_id)
        idle_ms = int(self.cfg.claim_idle_s * 1000)
        for job_id, entries in by_job.items():
            try:
                await self.store.hand_over(job_id, self.consumer, entries, idle_ms)
            except redis.RedisError as exc:  # they are reclaimed after claim_idle_s instead
                log.warning("could not hand over %d items of %s: %r", len(entries), job_id,
                            exc)
        if items:
            log.info("handed over %d unfinished items", len(items))

    # -- the view of jobs and the heartbeat ---------------------------------------------

    async def _housekeeping(self, stop: asyncio.Event) -> None:
        next_beat_s = 0.0
        while not stop.is_set():
            try:
                await self._refresh()
                if self.clock() >= next_beat_s:
                    await self._heartbeat()
                    next_beat_s = self.clock() + self.cfg.heartbeat_s
            except asyncio.CancelledError:
                raise
            except Exception:  # Redis away: keep going; items are reclaimable anyway
                log.exception("worker housekeeping failed")
            await asyncio.sleep(min(0.5, self.cfg.heartbeat_s))

    async def _refresh(self) -> None:
        jobs = {}
        for job_id in await self.store.active_ids():
            raw = await self.store.job(job_id)
            if raw is None:
                continue
            jobs[job_id] = JobInfo(job_id, raw["tenant"], raw["endpoint"], raw["status"],
                                   float(raw["expires_at"]), float(raw["created_at"]))
        for info in jobs.values():
            if info.tenant not in self.config.tenants and info.job_id not in self.jobs:
                log.warning("job %s belongs to tenant %s, unknown to this worker's config: "
                            "skipped", info.job_id, info.tenant)
        self.jobs = jobs
        for item in list(self._held.values()):
            job = jobs.get(item.job.job_id)
            if job is None or job.status != Status.IN_PROGRESS.value:
                self._drop(item, "cancelled" if job is not None else "gone")

    async def _heartbeat(self) -> None:
        by_job: dict[str, list[str]] = {}
        for item in self._held.values():
            by_job.setdefault(item.job.job_id, []).append(item.entry_id)
        for job_id, entries in by_job.items():
            for lost in await self.store.heartbeat(job_id, self.consumer, entries):
                taken = self._held.get(lost)
                if taken is not None:
                    log.info("item %s of %s was taken over by another worker",
                             taken.custom_id, job_id)
                    self._drop(taken, "lost")

    def _drop(self, item: _Item, reason: str) -> None:
        if item.task is not None and not item.drop_reason:
            item.drop_reason = reason
            item.task.cancel()

    # -- picking work -------------------------------------------------------------------

    async def _slot(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            item: _Item | None = None
            try:
                item = await self._next_item()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("picking an item failed")
            if item is None:
                await asyncio.sleep(self.cfg.poll_s)
                continue
            item.task = asyncio.create_task(self._run_item(item))
            self._held[item.entry_id] = item
            try:
                await item.task
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise
            except Exception:
                log.exception("item %s of %s failed in the worker", item.custom_id,
                              item.job.job_id)
            finally:
                self._held.pop(item.entry_id, None)
            if item.drop_reason == "cancelled":
                with contextlib.suppress(Exception):
                    await self.store.ack(item.job.job_id, item.entry_id)

    async def _next_item(self) -> _Item | None:
        async with self._pick_lock:
            now_s = self.clock()
            open_jobs = [j for j in self.jobs.values() if j.status == Status.IN_PROGRESS.value
                         and j.tenant in self.config.tenants
                         and self._drained_until.get(j.job_id, 0.0) <= now_s]
            while open_jobs:
                weights = {j.tenant: self.config.tenants[j.tenant].weight for j in open_jobs}
                picked = await self.store.dispatch(weights)
                if picked is None:
                    return None
                tenant, charged = picked
                ref = edf_order([JobRef(j.job_id, j.expires_s, j.created_s)
                                 for j in open_jobs if j.tenant == tenant])[0]
                job = self.jobs[ref.job_id]
                taken = await self._take(job, now_s)
                if taken is not None:
                    taken.charged_tokens = charged
                    return taken
                # Nothing there after all: the charge goes back (nothing ran).
                await self.store.settle(tenant, settlement(charged, 0, weights[tenant], False))
                self._drained_until[job.job_id] = now_s + max(0.5, self.cfg.poll_s)
                open_jobs = [j for j in open_jobs if j.job_id != job.job_id]
            return None

    async def _take(self, job: JobInfo, now_s: float) -> _Item | None:
        if now_s >= self._reclaim_at.get(job.job_id, 0.0):
            self._reclaim_at[job.job_id] = now_s + self.cfg.claim_idle_s / 4
            got = await self.store.reclaim(job.job_id, self.consumer,
                                           int(self.cfg.claim_idle_s * 1000))
            if got is not None:
                log.info("reclaimed item %s of %s from a silent worker", got[1], job.job_id)
                await self.store.count(job.job_id, job.tenant, {"reclaimed": 1})
                self._reclaim_at[job.job_id] = 0.0
                return _Item(job, got[0], got[1])
        got = await self.store.read_new(job.job_id, self.consumer)
        return None if got is None else _Item(job, got[0], got[1])

    # -- running one item ---------------------------------------------------------------

    async def _run_item(self, item: _Item) -> None:
        job = item.job
        weight = self.config.tenants[job.tenant].weight
        spec = await self.store.body(job.job_id, item.custom_id)
        if spec is None or await self.store.has_result(job.job_id, item.custom_id):
            await self.store.ack(job.job_id, item.entry_id)
            # Nothing runs: the dispatch's charge goes back.
            await self.store.settle(job.tenant, settlement(item.charged_tokens, 0, weight, False))
            return
        body, line = spec["body"], int(spec["line"])
        prompt = prompt_estimate(job.endpoint, body)
        progress = _Progress.from_json(await self.store.progress(job.job_id, item.custom_id))
        before, first_segment = progress.tokens, len(progress.segments)
        finished = False
        try:
            finished = await self._attempts(item, body, line, progress)
        finally:
            # What this run cost (the prompt as the engine counted it, the output it
            # generated) settles its dispatch's charge (`schedule.settle`); only an item
            # run whole from its start tells the tenant's expected cost.
            reported = next((s.prompt_tokens for s in progress.segments[first_segment:]
                             if s.prompt_tokens), prompt)
            actual = dispatch_cost_tokens(reported, progress.tokens - before)
            settled = settlement(item.charged_tokens, actual, weight, finished and before == 0)
            try:
                await self.store.settle(job.tenant, settled)
            except redis.RedisError as exc:  # the estimate stands as the charge
                log.warning("could not settle the fair share of %s: %r", item.custom_id, exc)

    async def _attempts(self, item: _Item, body: dict[str, Any], line: int,
                        progress: _Progress) -> bool:
        """Run an item attempt after attempt until it has its result; True when that is
        an output (a response), False for an error."""
        job = item.job
        key = self.config.tenants[job.tenant].keys[0]
        assert self._session is not None
        while True:
            left = remaining_tokens(body, progress.tokens)
            if progress.segments and left is not None and left <= 0:
                await self._finish_output(item, line, body, progress, "")
                return True
            request = resume_body(job.endpoint, body, progress.text, progress.tokens)
            resumed = progress.tokens if progress.text else 0
            tracker = _Tracker(self, item, progress)
            result = await attempt(self._session, self.cfg.proxy_url, key, job.endpoint,
                                   request, tracker.on_chunk)
            await tracker.flush(result.segment)
            counters = {"attempts": 1, "rate_limited": int(result.kind == "retry"),
                        "revocations": int(result.preempted)}
            if result.segment is not None and resumed:
                counters.update(resumes=1, reprefill_tokens=resumed)
            await self.store.count(job.job_id, job.tenant, counters)
            if result.kind == "retry":
                await asyncio.sleep(min(result.retry_after_s, self.cfg.retry_after_max_s))
            elif result.kind == "done":
                assert result.segment is not None
                progress.segments.append(result.segment)
                await self._finish_output(item, line, body, progress, result.request_id)
                return True
            elif result.kind == "cut":
                assert result.segment is not None
                if result.segment.completion_tokens or result.segment.text:
                    progress.segments.append(result.segment)
                else:  # revoked before its first token: do not spin on a flapping budget
                    await asyncio.sleep(self.cfg.poll_s)
                await self.store.save_progress(job.job_id, item.custom_id, progress.to_json())
            elif result.kind == "http_error":
                await self._finish_error(item, line, progress, result)
                return False
            else:
                progress.failures += 1
                await self.store.save_progress(job.job_id, item.custom_id, progress.to_json())
                if progress.failures >= self.cfg.max_failures:
                    await self._finish_error(item, line, progress, result)
                    return False
                await asyncio.sleep(min(5.0, 0.1 * 2 ** progress.failures))

    async def _finish_output(self, item: _Item, line: int, body: dict[str, Any],
                             progress: _Progress, request_id: str) -> None:
        job = item.job
        merged = merge_segments(job.endpoint, progress.segments,
                                f"borrowd-{uuid.uuid4().hex}", str(body.get("model", "")),
                                int(self.clock()))
        record = output_line(f"batch_req_{uuid.uuid4().hex}", item.custom_id, 200,
                             request_id or merged["id"], merged)
        self._held.pop(item.entry_id, None)  # acknowledged below: no longer to heartbeat
        if await self.store.complete(job.job_id, item.custom_id, line, "output", record,
                                     item.entry_id):
            await self.store.count(job.job_id, job.tenant,
                                   {"kept_tokens": merged["usage"]["completion_tokens"]})
            await self.store.count_tenant(job.tenant, {"completed": 1})

    async def _finish_error(self, item: _Item, line: int, progress: _Progress,
                            result: Attempt) -> None:
        job = item.job
        line_id = f"batch_req_{uuid.uuid4().hex}"
        if result.kind == "http_error":
            record = output_line(line_id, item.custom_id, result.status, result.request_id,
                                 result.error_body or {})
        else:
            record = error_line(line_id, item.custom_id, "request_failed",
                                f"{progress.failures} attempts failed; last: {result.detail}")
        self._held.pop(item.entry_id, None)
        if await self.store.complete(job.job_id, item.custom_id, line, "error", record,
                                     item.entry_id):
            await self.store.count(job.job_id, job.tenant, {"redone_tokens": progress.tokens})
            await self.store.count_tenant(job.tenant, {"failed": 1})


class _Tracker:
    """Counts an attempt's tokens as they stream and checkpoints every `checkpoint_tokens`.

    Generated tokens are counted at each checkpoint, so what a dead worker generated after
    its last checkpoint is the only output nobody counts (the engines' own counters show it).
    """

    def __init__(self, worker: Worker, item: _Item, progress: _Progress) -> None:
        self.worker = worker
        self.item = item
        self.progress = progress
        self.counted_tokens = 0
        self.prompt_counted = False
        self._pending: asyncio.Task | None = None

    def on_chunk(self, acc: ChunkAccumulator) -> None:
        """Called per chunk; starts a checkpoint when enough new tokens arrived."""
        tokens = acc.usage.get("completion_tokens", 0) if acc.usage else acc.token_chunks
        if tokens - self.counted_tokens < self.worker.cfg.checkpoint_tokens:
            return
        if self._pending is not None and not self._pending.done():
            return
        self._pending = asyncio.create_task(self._checkpoint(acc.segment(0)))

    async def _checkpoint(self, segment: Segment) -> None:
        job = self.item.job
        state = _Progress([*self.progress.segments, segment], self.progress.failures)
        try:
            await self.worker.store.save_progress(job.job_id, self.item.custom_id,
                                                  state.to_json())
            await self._count(segment)
        except redis.RedisError as exc:  # the previous checkpoint stands; the next may land
            log.warning("checkpoint of %s failed: %r", self.item.custom_id, exc)

    async def _count(self, segment: Segment) -> None:
        job = self.item.job
        counters = {"generated_tokens": segment.completion_tokens - self.counted_tokens}
        self.counted_tokens = segment.completion_tokens
        if not self.prompt_counted and segment.prompt_tokens:
            counters["prompt_tokens"] = segment.prompt_tokens
            self.prompt_counted = True
        await self.worker.store.count(job.job_id, job.tenant, counters)

    async def flush(self, final: Segment | None) -> None:
        """Wait for a checkpoint in progress; count what the attempt generated since."""
        if self._pending is not None:
            with contextlib.suppress(Exception):
                await self._pending
        if final is not None:
            await self._count(final)
