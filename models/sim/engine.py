"""One simulated vLLM V1 engine replica: the scheduler, the KV block pool and step timing.

The scheduler mirrors vLLM V1's `Scheduler.schedule()` (vllm/v1/core/sched/scheduler.py):

1. Token budget `max_num_batched_tokens` per step.
2. RUNNING requests first, in list order. Each gets `num_tokens - computed_tokens` tokens,
   capped by `long_prefill_token_threshold` (when > 0), by the budget left and by
   `max_model_len - 1 - computed_tokens`. Its KV slots are allocated; when the pool is
   short, a victim is preempted and the allocation retried: under the priority policy the
   running request with the largest (priority, arrival_s) (if it was already scheduled this
   step its tokens go back to the budget), under FCFS the last running request. A preempted
   request frees all its blocks, restarts from `computed_tokens = 0` (recompute) and goes
   back to the front of the waiting queue. If the victim is the request being scheduled,
   the RUNNING pass stops.
3. WAITING requests next, only when nothing was preempted in this step, while budget is
   left and fewer than `max_num_seqs` run: the head of the queue (FCFS order, or the lowest
   (priority, arrival_s, request_id) under the priority policy) gets its first chunk. It is
   admitted only if the KV pool holds free blocks for its whole prompt
   (`admit_full_prompt`, vLLM's `scheduler_reserve_full_isl`, default) and for its first
   chunk; only the chunk's blocks are allocated. Otherwise the WAITING pass stops.
   The long-prefill threshold applies only when more than one request is running or
   waiting; under the priority policy a request that is its own preemption victim lets
   the RUNNING pass go on (FCFS stops there). See docs/conformance.md.
4. After the step, `computed_tokens` of every scheduled request has advanced; each request
   whose `computed_tokens == num_tokens` emits one token; a request finishes when its output
   reaches `max_output_tokens`, and its blocks are freed.

Per-step batch limit (optional, off by default): `set_batch_budget(budget)` models the
engine plugin (`adapters.vllm_plugin`): each step, batch-class requests (running and
waiting) together get at most `models.enforcement.batch_tokens_per_step(budget,
recent step time, floor)` tokens; a batch request left without tokens is skipped for the
step (a waiting one ends the WAITING pass: under the priority policy every request behind
it is batch too). Interactive requests are never held back. The recent step time is the
plugin's `StepTimer` average of this replica's step durations.

Prefix caching (`enable_prefix_caching`, on by default as in vLLM V1): the KV pool is a
`prefix_cache.BlockPool`; a WAITING request's admission first takes its longest cached
prefix of full blocks (at most `num_tokens - 1` tokens), so only the rest is computed and
needs new blocks (the whole-prompt check counts the hit, plus hit blocks that were free and
leave the free queue); blocks are cached as they are allocated for known tokens, and freed
blocks stay cached until handed out again (least recently freed first). A preempted
request re-admitted finds what is left of its own blocks. Off, the pool is a count.

API (all times are in the caller's clock, seconds; the engine keeps no clock of its own):

    engine = Engine(EngineConfig.for_profile(profile), profile)
    engine.add_request(req) -> bool           # False: refused (req.status REFUSED, req.error)
    out = engine.schedule()                   # SchedulerOutput (frozen), advances progress
    res = engine.update_from_output(out, start_s)  # StepResult: duration from the profile
    res = engine.step(start_s)                # schedule + update; None when idle
    engine.abort_request(request_id) -> Request | None  # frees its KV at once
    engine.has_work(), engine.kv_usage_frac(), engine.free_blocks
    span = engine.plan_decode_span(start_s, until_s)   # optional speed-up, see below
    res = engine.commit_decode_span(span, steps)       # apply its first `steps` steps
    engine.num_running(klass), engine.num_waiting(klass), engine.running, engine.requests

`StepResult` says how long the step took (`duration_s`, `end_s`), which requests emitted a
token (`emitted`; `first_tokens` for first ones), which finished and which were preempted,
and aggregates interactive inter-token gaps: `itl_steady` tokens whose gap was exactly this
step, `itl_other_s` the other gaps (after a stall or a preemption).

Decode spans: when nothing but decoding can happen (no request waiting, every running
request one token behind), the next k steps are known in closed form; a run loop may plan
them at once and commit them at their end, or commit only the steps begun when it must add
or abort a request earlier. The result equals running those steps one by one.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left
from collections import deque
from dataclasses import dataclass, field

from borrowd.models.budget import Budget
from borrowd.models.enforcement import (
    DEFAULT_MIN_BATCH_TOKENS_PER_STEP,
    StepGuard,
    StepTimer,
    batch_tokens_per_step,
)
from borrowd.models.errors import ConfigError
from borrowd.models.sim.prefix_cache import BlockPool
from borrowd.models.sim.profiles import StepProfile
from borrowd.models.sim.request import (
    ABORTED,
    BATCH,
    FINISHED,
    INTERACTIVE,
    PREEMPTED,
    REFUSED,
    RUNNING,
    WAITING,
    Request,
)

# A decode span times only its last steps into the recent step time: the average forgets
# older ones by then (0.8 ** 32 < 0.1%).
SPAN_TIMED_STEPS = 32
FCFS = "fcfs"
PRIORITY = "priority"
POLICIES = (FCFS, PRIORITY)


@dataclass(frozen=True)
class EngineConfig:
    """Scheduler and cache settings of one replica (vLLM's names and defaults where any)."""

    num_gpu_blocks: int
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    block_size: int = 16
    long_prefill_token_threshold: int = 0
    policy: str = PRIORITY
    max_model_len: int = 131072
    admit_full_prompt: bool = True
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        for name in ("num_gpu_blocks", "max_num_batched_tokens", "max_num_seqs", "block_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"engine {name} must be > 0, got {getattr(self, name)!r}")
        if self.long_prefill_token_threshold < 0:
            raise ConfigError(
                "engine long_prefill_token_threshold must be >= 0, "
                f"got {self.long_prefill_token_threshold!r}"
            )
        if self.policy not in POLICIES:
            raise ConfigError(f"engine policy must be one of {POLICIES}, got {self.policy!r}")
        if not 0 < self.max_model_len <= self.num_gpu_blocks * self.block_size:
            raise ConfigError(
                f"engine max_model_len {self.max_model_len} must be > 0 and fit in the KV "
                f"cache of {self.num_gpu_blocks * self.block_size} tokens"
            )

    @classmethod
    def for_profile(cls, profile: StepProfile, **overrides: object) -> EngineConfig:
        """Config whose KV pool holds the profile's KV capacity, with `overrides` applied."""
        block_size = overrides.get("block_size", 16)
        if not isinstance(block_size, int) or block_size <= 0:
            raise ConfigError(f"engine block_size must be an integer > 0, got {block_size!r}")
        kw: dict[str, object] = {"num_gpu_blocks": profile.kv_capacity_tokens // block_size}
        kw.update(overrides)
        return cls(**kw)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """What one step computes: tokens per request id, and who was preempted to make room."""

    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    preempted_req_ids: tuple[str, ...]
    decode_kv_tokens: int
    prefill_pairs: int
    scheduled: tuple[tuple[Request, int], ...] = field(repr=False, compare=False)
    preempted: tuple[Request, ...] = field(repr=False, compare=False)


@dataclass(frozen=True, slots=True)
class StepResult:
    """Outcome of one step: timing, token emissions, finishes, preemptions, ITL aggregate."""

    start_s: float
    duration_s: float
    end_s: float
    scheduled_tokens: int
    interactive_tokens: int
    batch_tokens: int
    emitted: list[Request]
    first_tokens: list[Request]
    finished: list[Request]
    preempted: list[Request]
    itl_steady: int
    itl_other_s: list[float]
    running_interactive: int
    running_batch: int
    span_steps: int = 1
    span_step_growth_s: float = 0.0
    interactive_waiting: int = 0  # interactive requests queued or mid-prefill in this step

    def step_durations_s(self) -> list[float]:
        """Duration of each step this result covers (one, or a decode span's steps)."""
        k = self.span_steps
        if k == 1:
            return [self.duration_s]
        growth = self.span_step_growth_s
        first = (self.duration_s - growth * k * (k - 1) / 2) / k
        return [first + growth * j for j in range(k)]


@dataclass(frozen=True, slots=True)
class DecodeSpan:
    """A planned run of `steps` pure-decode steps from `start_s`; step j lasts
    `first_step_s + growth_s * j`."""

    start_s: float
    steps: int
    first_step_s: float
    growth_s: float

    def end_s(self) -> float:
        """When the last step ends."""
        k = self.steps
        return self.start_s + self.first_step_s * k + self.growth_s * k * (k - 1) / 2

    def steps_started_before(self, t_s: float) -> int:
        """How many of the steps start before `t_s` (those must run to their end)."""
        first, growth = self.first_step_s, self.growth_s
        lo, hi = 0, self.steps
        while lo < hi:
            mid = (lo + hi) // 2
            if self.start_s + first * mid + growth * mid * (mid - 1) / 2 < t_s:
                lo = mid + 1
            else:
                hi = mid
        return lo


class Engine:
    """One replica: vLLM V1 scheduling over a fixed KV block pool, timed by a profile."""

    def __init__(self, config: EngineConfig, profile: StepProfile) -> None:
        self.config = config
        self.profile = profile
        self.free_blocks = config.num_gpu_blocks
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._priority = config.policy == PRIORITY
        self._fifo: deque[Request] = deque()
        self._heap: list[tuple[int, float, str, Request]] = []
        self._waiting_count = {INTERACTIVE: 0, BATCH: 0}
        self._running_count = {INTERACTIVE: 0, BATCH: 0}
        self.num_preemptions = 0
        segments = profile.linear_coefficients()
        self._segment_uppers = [upper for upper, _, _ in segments]
        self._segment_lines = [(intercept, slope) for _, intercept, slope in segments]
        self._last_output: SchedulerOutput | None = None
        self._batch_limited = False
        self._batch_budget: Budget | None = None
        self._step_timer = StepTimer()
        self._guard: StepGuard | None = None
        self.min_batch_tokens_per_step = DEFAULT_MIN_BATCH_TOKENS_PER_STEP
        self._pool: BlockPool | None = (
            BlockPool(config.num_gpu_blocks, config.block_size)
            if config.enable_prefix_caching else None
        )
        self._next_content_id = -2  # fresh content of requests that bring none

    # -- queue helpers ---------------------------------------------------------------------

    def _push_waiting(self, req: Request, front: bool) -> None:
        if self._priority:
            heapq.heappush(self._heap, (req.priority, req.arrival_s, req.request_id, req))
        elif front:
            self._fifo.appendleft(req)
        else:
            self._fifo.append(req)
        self._waiting_count[req.klass] += 1

    def _peek_waiting(self) -> Request | None:
        if self._priority:
            heap = self._heap
            while heap and heap[0][3].status not in (WAITING, PREEMPTED):
                heapq.heappop(heap)
            return heap[0][3] if heap else None
        return self._fifo[0] if self._fifo else None

    def _pop_waiting(self) -> None:
        req = heapq.heappop(self._heap)[3] if self._priority else self._fifo.popleft()
        self._waiting_count[req.klass] -= 1

    # -- public API ------------------------------------------------------------------------

    def add_request(self, req: Request) -> bool:
        """Queue `req`; refuse it (status REFUSED, `error` set) if it cannot ever fit."""
        cfg = self.config
        if req.prompt_tokens <= 0 or req.max_output_tokens <= 0:
            req.status = REFUSED
            req.error = "prompt and max output tokens must be > 0"
            return False
        if req.prompt_tokens + req.max_output_tokens > cfg.max_model_len:
            req.status = REFUSED
            req.error = (
                f"This model's maximum context length is {cfg.max_model_len} tokens; the "
                f"request asks for {req.prompt_tokens + req.max_output_tokens}"
            )
            return False
        if req.request_id in self.requests:
            req.status = REFUSED
            req.error = f"duplicate request id {req.request_id!r}"
            return False
        req.status = WAITING
        self.requests[req.request_id] = req
        if self._pool is not None:
            covered = sum(length for _, length in req.segments)
            if covered < req.prompt_tokens:
                rest = ((self._next_content_id, req.prompt_tokens - covered),)
                self._next_content_id -= 1
                req.set_segments(req.segments + rest)
        self._push_waiting(req, front=False)
        return True

    @property
    def prefix_cache_hit_tokens(self) -> int:
        """Prompt tokens served from the prefix cache so far (0 with caching off)."""
        return self._pool.hit_tokens if self._pool is not None else 0

    def abort_request(self, request_id: str) -> Request | None:
        """Remove a waiting or running request and free its KV blocks; None if unknown."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.status == RUNNING:
            self.running.remove(req)
            self._running_count[req.klass] -= 1
        else:
            self._waiting_count[req.klass] -= 1
            if not self._priority:
                self._fifo.remove(req)
        self.free_blocks += req.blocks
        req.blocks = 0
        if self._pool is not None:
            self._pool.release(req)
            self.free_blocks = self._pool.num_free
        req.status = ABORTED
        return req

    def set_batch_budget(self, budget: Budget | None) -> None:
        """Hold batch requests to `budget` in every step from now on (the engine plugin's
        per-step limit; None: no record, so no batch tokens). Never called: no limit."""
        self._batch_limited = True
        self._batch_budget = budget

    def batch_step_allowance(self) -> int | None:
        """Batch tokens the next step may schedule; None when no per-step limit is set."""
        if not self._batch_limited:
            return None
        return self._allowance(self._step_timer.recent_s)

    def set_step_guard(self, guard: StepGuard | None) -> None:
        """Hold batch to the plugin's step guard as well (`models.enforcement.StepGuard`;
        None: no guard), under the per-step limit."""
        self._guard = guard

    def _allowance(self, recent_s: float) -> int:
        allowance = batch_tokens_per_step(
            self._batch_budget, recent_s, self.min_batch_tokens_per_step
        )
        return allowance if self._guard is None else self._guard.limit(allowance)

    def has_work(self) -> bool:
        """True while any request is running or waiting."""
        waiting = self._waiting_count
        return bool(self.running) or waiting[INTERACTIVE] + waiting[BATCH] > 0

    def kv_usage_frac(self) -> float:
        """Fraction of KV blocks in use (vLLM's `kv_cache_usage_perc`, 0..1)."""
        return 1.0 - self.free_blocks / self.config.num_gpu_blocks

    def num_running(self, klass: str | None = None) -> int:
        """Running requests, of one class or all."""
        if klass is None:
            return len(self.running)
        return self._running_count[klass]

    def num_waiting(self, klass: str | None = None) -> int:
        """Waiting (queued or preempted) requests, of one class or all."""
        if klass is None:
            return self._waiting_count[INTERACTIVE] + self._waiting_count[BATCH]
        return self._waiting_count[klass]

    def waiting_requests(self) -> list[Request]:
        """The waiting requests (in no particular order)."""
        if self._priority:
            return [e[3] for e in self._heap if e[3].status in (WAITING, PREEMPTED)]
        return list(self._fifo)

    # -- one step --------------------------------------------------------------------------

    def _preempt(self, victim: Request) -> None:
        self.free_blocks += victim.blocks
        victim.blocks = 0
        if self._pool is not None:
            self._pool.release(victim, preempted=True)
            self.free_blocks = self._pool.num_free
        victim.recomputed_tokens += victim.computed_tokens
        victim.computed_tokens = 0
        victim.preemptions += 1
        victim.status = PREEMPTED
        self.num_preemptions += 1
        self._running_count[victim.klass] -= 1
        self._push_waiting(victim, front=True)

    def schedule(self) -> SchedulerOutput:
        """Choose this step's tokens per request (vLLM V1 order) and advance their progress.

        Progress (`computed_tokens`), the decode KV tokens and the prefill attention pairs
        are accounted as each request is scheduled, and undone for a request that a later
        preemption takes back out of this step.
        """
        cfg = self.config
        bs = cfg.block_size
        bs_1 = bs - 1
        waiting = self._waiting_count
        running = self.running
        n_run = len(running)
        # vLLM applies the long-prefill threshold only when another request could starve.
        thr = cfg.long_prefill_token_threshold
        if n_run + waiting[INTERACTIVE] + waiting[BATCH] <= 1:
            thr = 0
        limit = cfg.max_model_len - 1
        budget = cfg.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        append = scheduled.append
        preempted: list[Request] = []
        free = self.free_blocks
        decode_kv = 0
        pairs = 0
        limited = self._batch_limited
        allowance = self.batch_step_allowance()
        batch_left = allowance if allowance is not None else 0
        pool = self._pool
        i = 0
        while i < n_run and budget > 0:
            req = running[i]
            c = req.computed_tokens
            n = req.prompt_tokens + req.output_tokens - c
            if n != 1:
                if 0 < thr < n:
                    n = thr
                if n > budget:
                    n = budget
            if n > limit - c:
                n = limit - c
                if n <= 0:
                    i += 1
                    continue
            if limited and req.klass == BATCH:
                if n > batch_left:
                    n = batch_left
                    if n <= 0:
                        i += 1
                        continue
                batch_left -= n
            need = (c + n + bs_1) // bs - req.blocks
            if need > free:
                victim_is_req = False
                while need > free:
                    if self._priority:
                        victim = max(running, key=_preempt_key)
                        running.remove(victim)
                        for j, (sreq, sn) in enumerate(scheduled):
                            if sreq is victim:
                                del scheduled[j]
                                budget += sn
                                if limited and sreq.klass == BATCH:
                                    batch_left += sn
                                before = sreq.computed_tokens - sn
                                sreq.computed_tokens = before
                                if sn == 1:
                                    decode_kv -= before + 1
                                else:
                                    pairs -= sn * before + sn * (sn + 1) // 2
                                i -= 1
                                break
                    else:
                        victim = running.pop()
                    self.free_blocks = free
                    self._preempt(victim)
                    free = self.free_blocks
                    preempted.append(victim)
                    if victim is req:
                        victim_is_req = True
                        break
                n_run = len(running)
                if victim_is_req:
                    if limited and req.klass == BATCH:
                        batch_left += n
                    if self._priority:
                        # vLLM: higher-priority running requests may fit in what it freed.
                        continue
                    break
            if need > 0:
                free -= need
                req.blocks += need
                if pool is not None:
                    pool.allocate(req, need)
            if pool is not None and (c + n) // bs > req.num_cached_blocks:
                pool.cache(req, c + n)
            req.computed_tokens = c + n
            if n == 1:
                decode_kv += c + 1
            else:
                pairs += n * c + n * (n + 1) // 2
            append((req, n))
            budget -= n
            i += 1

        if not preempted:
            max_seqs = cfg.max_num_seqs
            full = cfg.admit_full_prompt
            while budget > 0 and len(running) < max_seqs:
                head = self._peek_waiting()
                if head is None:
                    break
                req = head
                total = req.prompt_tokens + req.output_tokens
                hits = pool.find_hits(req, total - 1) if pool is not None else []
                cached = len(hits) * bs
                n = total - cached
                if 0 < thr < n:
                    n = thr
                if n > budget:
                    n = budget
                if limited and req.klass == BATCH:
                    if n > batch_left:
                        n = batch_left
                        if n <= 0:
                            break
                    batch_left -= n
                evictable = pool.num_evictable(hits) if pool is not None and hits else 0
                if full and (total + bs_1) // bs - len(hits) + evictable > free:
                    break
                need = (cached + n + bs_1) // bs - len(hits)
                if need + evictable > free:
                    break
                self._pop_waiting()
                if pool is not None:
                    if hits:
                        pool.touch(req, hits)
                        free -= evictable
                        if req.preemptions:
                            req.recomputed_tokens -= min(cached, req.recomputed_tokens)
                    pool.allocate(req, need)
                    pool.cache(req, cached + n)
                free -= need
                req.blocks = len(hits) + need
                req.status = RUNNING
                self._running_count[req.klass] += 1
                running.append(req)
                req.computed_tokens = cached + n
                if n == 1:
                    decode_kv += cached + 1
                else:
                    pairs += n * cached + n * (n + 1) // 2
                append((req, n))
                budget -= n
        self.free_blocks = free

        out = SchedulerOutput(
            num_scheduled_tokens={r.request_id: n for r, n in scheduled},
            total_num_scheduled_tokens=cfg.max_num_batched_tokens - budget,
            preempted_req_ids=tuple(r.request_id for r in preempted),
            decode_kv_tokens=decode_kv,
            prefill_pairs=pairs,
            scheduled=tuple(scheduled),
            preempted=tuple(preempted),
        )
        self._last_output = out
        return out

    def step_duration_s(self, out: SchedulerOutput) -> float:
        """Duration of the step `out` under this replica's profile."""
        tokens = out.total_num_scheduled_tokens
        if tokens <= 0:
            return 0.0
        intercept, slope = self._segment_lines[bisect_left(self._segment_uppers, tokens)]
        linear = intercept + slope * tokens
        prof = self.profile
        return (
            linear
            + prof.decode_s_per_kv_token * out.decode_kv_tokens
            + prof.prefill_s_per_pair * out.prefill_pairs
        )

    def update_from_output(self, out: SchedulerOutput, start_s: float) -> StepResult:
        """Finish the step `out` begun at `start_s`: emit tokens, finish and free requests."""
        if out is not self._last_output:
            raise RuntimeError("update_from_output must follow the matching schedule()")
        self._last_output = None
        duration = self.step_duration_s(out)
        end = start_s + duration
        if self._batch_limited:
            self._step_timer.observe(duration)
        emitted: list[Request] = []
        emit = emitted.append
        first: list[Request] = []
        finished: list[Request] = []
        itl_other: list[float] = []
        steady = 0
        btok = 0
        prefilling = 0
        for req, n in out.scheduled:
            interactive = req.klass is INTERACTIVE or req.klass == INTERACTIVE
            if not interactive:
                btok += n
            out_tokens = req.output_tokens
            if req.computed_tokens != req.prompt_tokens + out_tokens:
                prefilling += interactive
                continue
            out_tokens += 1
            req.output_tokens = out_tokens
            emit(req)
            last = req.last_token_s
            if req.first_token_s < 0:
                req.first_token_s = end
                first.append(req)
            elif interactive:
                if last == start_s:
                    steady += 1
                else:
                    itl_other.append(end - last)
            req.last_token_s = end
            if out_tokens >= req.max_output_tokens:
                finished.append(req)
        itok = out.total_num_scheduled_tokens - btok
        if self._guard is not None:
            self._guard.observe(duration, btok, steady + len(itl_other))
        if finished:
            pool = self._pool
            for req in finished:
                req.status = FINISHED
                req.finish_s = end
                self.free_blocks += req.blocks
                req.blocks = 0
                if pool is not None:
                    pool.release(req)
                    self.free_blocks = pool.num_free
                self._running_count[req.klass] -= 1
                del self.requests[req.request_id]
            self.running = [r for r in self.running if r.status == RUNNING]
        return StepResult(
            start_s=start_s,
            duration_s=duration,
            end_s=end,
            scheduled_tokens=out.total_num_scheduled_tokens,
            interactive_tokens=itok,
            batch_tokens=btok,
            emitted=emitted,
            first_tokens=first,
            finished=finished,
            preempted=list(out.preempted),
            itl_steady=steady,
            itl_other_s=itl_other,
            running_interactive=self._running_count[INTERACTIVE],
            running_batch=self._running_count[BATCH],
            interactive_waiting=self._waiting_count[INTERACTIVE] + prefilling,
        )

    def step(self, start_s: float) -> StepResult | None:
        """Run one step starting at `start_s`; None when there is nothing to schedule.

        A schedule that only preempted (no tokens) is retried at once, as vLLM's next
        `schedule()` would admit from the waiting queue without a model step between.
        """
        while self.has_work():
            out = self.schedule()
            if out.total_num_scheduled_tokens > 0:
                return self.update_from_output(out, start_s)
            self._last_output = None
            if not out.preempted:
                return None
        return None

    def plan_decode_span(self, start_s: float, until_s: float) -> DecodeSpan | None:
        """Plan, in closed form, the pure-decode steps that end by `until_s`.

        Applies only when nothing can change between those steps: no request waiting,
        every running request decoding (one token a step) and decoded in the step before,
        no finish before the span's last step, enough free KV blocks. Step j then lasts
        `first + growth * j` with `growth = decode_s_per_kv_token * running` (each request
        attends one more KV token a step). None when it does not apply or fewer than two
        steps fit. The plan changes nothing: `commit_decode_span` applies it (or its first
        steps, when something must happen before its end).
        """
        waiting = self._waiting_count
        if waiting[INTERACTIVE] or waiting[BATCH]:
            return None
        running = self.running
        n_run = len(running)
        cfg = self.config
        if n_run == 0 or n_run > cfg.max_num_batched_tokens:
            return None
        limit = cfg.max_model_len - 1
        kv = 0
        max_k = limit
        for req in running:
            c = req.computed_tokens
            out_tokens = req.output_tokens
            if c != req.prompt_tokens + out_tokens - 1 or req.last_token_s != start_s:
                return None
            kv += c + 1
            rem = req.max_output_tokens - out_tokens
            if rem < max_k:
                max_k = rem
            if limit - c < max_k:
                max_k = limit - c
        if max_k < 2:
            return None
        intercept, slope = self._segment_lines[bisect_left(self._segment_uppers, n_run)]
        linear = intercept + slope * n_run
        d = self.profile.decode_s_per_kv_token
        first = linear + d * kv
        growth = d * n_run
        n_batch = self._running_count[BATCH]
        if self._batch_limited and n_batch:
            # The recent step time only moves towards the span's steps (>= `first`), so
            # this allowance holds for every step of the span.
            recent_s = min(self._step_timer.recent_s, first)
            if n_batch > self._allowance(recent_s):
                return None
        horizon = until_s - start_s
        # The first k steps end at first*k + growth*k*(k-1)/2 <= horizon, so an observer at
        # `until_s` sees them all done, as it would have step by step.
        if growth > 0:
            b = first - growth / 2
            k = int((-b + (b * b + 2 * growth * horizon) ** 0.5) / growth)
        else:
            k = int(horizon / first)
        while k > 0 and first * k + growth * k * (k - 1) / 2 > horizon:
            k -= 1
        k = min(max_k, k)
        guard = self._guard
        if guard is not None and n_batch and self._running_count[INTERACTIVE]:
            # The step guard would cut after a step past its target: plan only the steps
            # within it (step by step from there).
            if first > guard.target_s:
                return None
            if growth > 0:
                k = min(k, int((guard.target_s - first) / growth) + 1)
        if k < 2:
            return None
        bs = cfg.block_size
        bs_1 = bs - 1
        need = 0
        for req in running:
            extra = (req.computed_tokens + k + bs_1) // bs - req.blocks
            if extra > 0:
                need += extra
        if need > self.free_blocks:
            return None
        return DecodeSpan(start_s, k, first, growth)

    def commit_decode_span(self, span: DecodeSpan, steps: int) -> StepResult:
        """Apply the first `steps` (>= 1) steps of `span`, planned on the current state."""
        k = steps
        first, growth = span.first_step_s, span.growth_s
        duration = first * k + growth * k * (k - 1) / 2
        end = span.start_s + duration
        if self._batch_limited:
            timer = self._step_timer
            for j in range(min(k, SPAN_TIMED_STEPS)):
                timer.observe(first + growth * (k - min(k, SPAN_TIMED_STEPS) + j))
            guard = self._guard
            if guard is not None:
                # Every step of the span is within the target (`plan_decode_span`) and
                # carries the same tokens: the cap grows at most once.
                n_batch_span = self._running_count[BATCH]
                n_inter_span = self._running_count[INTERACTIVE]
                for j in range(min(k, 2)):
                    guard.observe(first + growth * j, n_batch_span, n_inter_span)
        bs = self.config.block_size
        bs_1 = bs - 1
        running = self.running
        n_run = len(running)
        finished: list[Request] = []
        n_inter = 0
        pool = self._pool
        for req in running:
            c = req.computed_tokens + k
            req.computed_tokens = c
            blocks = (c + bs_1) // bs
            if blocks > req.blocks:
                self.free_blocks -= blocks - req.blocks
                if pool is not None:
                    pool.allocate(req, blocks - req.blocks)
                req.blocks = blocks
            if pool is not None and c // bs > req.num_cached_blocks:
                pool.cache(req, c)
            req.output_tokens += k
            req.last_token_s = end
            if req.klass == INTERACTIVE:
                n_inter += 1
            if req.output_tokens >= req.max_output_tokens:
                finished.append(req)
        emitted = list(running)
        if finished:
            pool = self._pool
            for req in finished:
                req.status = FINISHED
                req.finish_s = end
                self.free_blocks += req.blocks
                req.blocks = 0
                if pool is not None:
                    pool.release(req)
                    self.free_blocks = pool.num_free
                self._running_count[req.klass] -= 1
                del self.requests[req.request_id]
            self.running = [r for r in running if r.status == RUNNING]
        return StepResult(
            start_s=span.start_s,
            duration_s=duration,
            end_s=end,
            scheduled_tokens=k * n_run,
            interactive_tokens=k * n_inter,
            batch_tokens=k * (n_run - n_inter),
            emitted=emitted,
            first_tokens=[],
            finished=finished,
            preempted=[],
            itl_steady=n_inter,
            itl_other_s=[],
            running_interactive=self._running_count[INTERACTIVE],
            running_batch=self._running_count[BATCH],
            span_steps=k,
            span_step_growth_s=growth,
        )

    def decode_span(self, start_s: float, until_s: float) -> StepResult | None:
        """Plan and apply a whole decode span (see `plan_decode_span`); None if none."""
        span = self.plan_decode_span(start_s, until_s)
        return None if span is None else self.commit_decode_span(span, span.steps)


def _preempt_key(req: Request) -> tuple[int, float]:
    return (req.priority, req.arrival_s)
