"""A vLLM V1 scheduler that enforces the pool's batch budget inside the engine.

Load it into vLLM (checked against vLLM 0.33.0 and 0.34.0) with

    BORROWD_POOL=chat BORROWD_REDIS_URL=redis://redis:6379/0 \\
    vllm serve MODEL --scheduling-policy priority \\
        --scheduler-cls adapters.vllm_plugin.BorrowdAsyncScheduler

borrowd must be importable by the Python that runs the engine (install it into vLLM's
virtualenv, or its image): vLLM imports the class named by `--scheduler-cls` in the engine
core process. Name the class that matches vLLM's scheduling mode:
`BorrowdAsyncScheduler` (extends `AsyncScheduler`) for asynchronous scheduling, vLLM's
default and the one to prefer; `BorrowdScheduler` (extends the synchronous `Scheduler`) only
with `--no-async-scheduling`. Naming a subclass of the synchronous scheduler turns vLLM's
asynchronous scheduling off (vllm#43724), costing throughput for nothing.

Requests whose priority is at or past `BORROWD_BATCH_PRIORITY` (default 10, what the proxy
injects for batch) are batch. In each step they get together at most
`max(floor, batch_tokens_per_s * recent step time)` tokens (`adapters.engine_budget`), and
at most `max_batch_seqs` of them run, holding at most `max_batch_kv_tokens` of prompt plus
maximum output; interactive requests are never held back by the plugin. A missing, expired
or closed record means zero batch tokens. The record is read off the scheduling path by
`adapters.store.BudgetWatcher` (a thread: pub/sub push plus a poll every
`BORROWD_BUDGET_POLL_S`); `schedule()` only reads the newest copy in memory.

Environment: `BORROWD_POOL` (required), `BORROWD_REDIS_URL` (default
redis://127.0.0.1:6379/0), `BORROWD_BATCH_PRIORITY` (10), `BORROWD_BUDGET_POLL_S` (1.0),
`BORROWD_MIN_BATCH_TOKENS_PER_STEP` (16, the floor; never below one decode with all its
speculative tokens), `BORROWD_POOL_ENGINES` (1; the engines sharing the pool's budget: the
eligible ones when batch is restricted to some), `BORROWD_METRICS_LISTEN` (HOST:PORT where
the engine core serves the interference series of `adapters.interference`; the port is
offset by the engine's data-parallel rank; unset: not served), `BORROWD_BATCH_ELIGIBLE`
(true; false on an engine outside the pool's batch set: it reads no budget and schedules no
batch token, so its interactive requests are scheduled as if no batch were queued),
`BORROWD_SLO_ITL_S` (the pool's p95 ITL SLOs in seconds, comma-separated, when not the default
50 ms: each is a bound of the interference histogram, where the daemon reads the gaps above
the SLO; the smallest is also the step guard's), `BORROWD_STEP_GUARD_FRAC` (0.9; 0: off),
`BORROWD_ENFORCE` (true; false: observe only, for a pool the admission gate alone enforces:
the engine schedules as vLLM's own scheduler does, reads no budget, and only counts and
serves the interference series, so the daemon reads which share of the burns batch caused).

Step guard (`models.enforcement.StepGuard`; its SLO the smallest of `BORROWD_SLO_ITL_S`, else
50 ms): after a step that carried
interactive decodes and batch tokens and took longer than `BORROWD_STEP_GUARD_FRAC` x the
SLO, the batch tokens per step are capped at 0.7 x what it carried; a step within that
target whose batch used the whole cap grows the cap by 16 tokens. The daemon's budget acts
on signals tens of seconds late; this inner loop acts on the next step.

Each step it counts, by whether the step carried batch tokens, the interactive inter-token
gaps it ended and the interactive queue wait it held (`adapters.interference`): vLLM's own
metrics are exported by the API server process, these by the engine core that schedules.

The cap is applied where vLLM decides each request's chunk, the private
`_reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens)` (vLLM 0.28 to
0.34; called once per request in both the RUNNING and the WAITING pass, just before KV
allocation). The plugin caps first and then lets vLLM reserve its prefill lookahead from
what is left, so a capped chunk still never ends inside the lookahead window; a row set
padded for speculative decoding is granted whole or not at all. Returning 0 makes vLLM skip
the request for this step and go on with the next, so the token budget a batch request
does not get stays available to interactive ones. Without the hook batch could not be
capped at all, so importing this module on a vLLM that lacks it raises `ImportError` and
vLLM refuses to start.
"""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import structlog
from borrowd.adapters.engine_budget import (
    INITIAL_STEP_S,
    BudgetSource,
    PluginConfig,
    StaticBudgetSource,
    StepTimer,
    batch_seq_cap,
    batch_tokens_per_step,
    engine_share,
)
from borrowd.adapters.interference import InterferenceMetrics, StepAttribution, StepRequest
from borrowd.models.budget import Budget
from prometheus_client import CollectorRegistry, start_http_server
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

HOOK = "_reserve_prefill_lookahead"
HOOK_PARAMETERS = ("self", "request", "num_computed_tokens", "num_new_tokens")


def check_vllm_hook(scheduler_cls: type) -> None:
    """Raise ImportError unless `scheduler_cls` has the hook the plugin caps batch in."""
    hook = getattr(scheduler_cls, HOOK, None)
    parameters = tuple(inspect.signature(hook).parameters) if callable(hook) else ()
    if parameters != HOOK_PARAMETERS:
        import vllm

        raise ImportError(
            f"borrowd's engine plugin needs vLLM's {scheduler_cls.__name__}.{HOOK}"
            f"{HOOK_PARAMETERS[1:]} (vLLM 0.28 to 0.34); vLLM {vllm.__version__} "
            f"{'has another signature' if parameters else 'lacks it'}, so batch could not be "
            "capped: refusing to load"
        )


check_vllm_hook(Scheduler)
check_vllm_hook(AsyncScheduler)

if TYPE_CHECKING:
    from borrowd.adapters.store import BudgetWatcher

    # To the type checker the mixin is a Scheduler (its attributes and the methods it
    # extends); at run time it precedes the real scheduler class in the MRO.
    _SchedulerBase = Scheduler
else:
    _SchedulerBase = object


class BudgetEnforcement(_SchedulerBase):
    """Batch requests held to the pool's budget inside a vLLM V1 scheduler (module docstring).

    Mixed in ahead of vLLM's `Scheduler` or `AsyncScheduler`. vLLM builds it with the usual
    scheduler arguments; tests and the simulator may also pass
    `budget_source` (instead of Redis), `plugin_config`, `clock` (wall seconds, for record
    freshness) and `step_clock` (seconds, for step timing; None: steps are timed only by
    `observe_step_s`).
    """

    def __init__(
        self, *args: Any, budget_source: BudgetSource | None = None,
        plugin_config: PluginConfig | None = None, clock: Callable[[], float] = time.time,
        step_clock: Callable[[], float] | None = time.monotonic, **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.plugin_config = plugin_config or PluginConfig.from_env()
        self.batch_priority = self.plugin_config.batch_priority
        self._clock = clock
        self._step_clock = step_clock
        self._watcher: BudgetWatcher | None = None
        if budget_source is None:
            budget_source = (self._start_watcher()
                             if self.plugin_config.batch_eligible and self.plugin_config.enforce
                             else StaticBudgetSource())
        self.budget_source = budget_source
        self.step_timer = StepTimer()
        self.step_guard = self.plugin_config.step_guard()
        self.budget: Budget | None = None
        self.batch_allowance = 0
        self.batch_seq_cap = 0
        self.batch_kv_cap = 0
        self._granted: dict[str, int] = {}  # batch tokens granted per request this step
        self._batch_running = 0  # batch requests running when this step began
        self._batch_admitted = 0  # waiting batch requests granted tokens this step
        self._batch_kv_tokens = 0  # prompt + max output of running and admitted batch
        self.metrics_registry = CollectorRegistry()
        self.attribution: StepAttribution | None = None
        if step_clock is not None:  # interference is timed on the wall clock
            self.attribution = self._start_attribution()

    def _start_watcher(self) -> BudgetSource:
        from borrowd.adapters.redis_conn import connect
        from borrowd.adapters.store import BudgetWatcher

        cfg = self.plugin_config
        watcher = BudgetWatcher(connect(cfg.redis_url), cfg.pool, poll_s=cfg.poll_s,
                                clock=self._clock).start()
        self._watcher = watcher
        return watcher

    def _start_attribution(self) -> StepAttribution:
        served = self.vllm_config.model_config.served_model_name
        model_name = str(served[0] if isinstance(served, list) and served else served)
        rank = self.vllm_config.parallel_config.data_parallel_rank
        metrics = InterferenceMetrics(self.metrics_registry, model_name, str(rank),
                                      self.plugin_config.slo_itl_s)
        listen = self.plugin_config.metrics_listen
        if listen is not None:
            host, port = listen
            try:
                start_http_server(port + rank, host, registry=self.metrics_registry)
            except OSError as exc:
                # The engine serves on without them: the daemon reads the shares as missing.
                structlog.get_logger(__name__).warning(
                    "plugin_metrics_not_served", listen=f"{host}:{port + rank}", error=str(exc))
        return StepAttribution(metrics, INITIAL_STEP_S)

    def is_batch(self, request: Request) -> bool:
        """True for a batch request (priority at or past the configured batch priority)."""
        return request.priority >= self.batch_priority

    def observe_step_s(self, step_s: float) -> None:
        """Count one step of `step_s` seconds (the simulator's profile time) as recent; the
        next `update_from_output` without a step clock teaches it to the step guard."""
        self.step_timer.observe(step_s)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM's schedule with this step's batch allowance and sequence cap in force (none
        when the plugin only observes)."""
        if self.plugin_config.enforce:
            self._limit_step()
        out = super().schedule(*args, **kwargs)
        if self._step_clock is not None and out.total_num_scheduled_tokens > 0:
            self.step_timer.started(self._step_clock())
        return out

    def _limit_step(self) -> None:
        """Set this step's batch allowance, sequence cap and KV cap from the budget."""
        current = (self.budget_source.current(self._clock())
                   if self.plugin_config.batch_eligible else None)
        self.budget = engine_share(current, self.plugin_config.engines_in_pool)
        self.batch_allowance = batch_tokens_per_step(
            self.budget, self.step_timer.recent_s, self.plugin_config.min_batch_tokens_per_step
        )
        if self.step_guard is not None:
            self.batch_allowance = self.step_guard.limit(self.batch_allowance)
        if self.batch_allowance > 0:  # room for one decode with all its speculative rows
            self.batch_allowance = max(self.batch_allowance, 1 + self.num_spec_tokens)
        self.batch_seq_cap = batch_seq_cap(self.budget)
        self.batch_kv_cap = self.budget.max_batch_kv_tokens if self.budget is not None else 0
        self._granted = {}
        running_batch = [r for r in self.running if self.is_batch(r)]
        self._batch_running = len(running_batch)
        self._batch_kv_tokens = sum(_kv_tokens(r) for r in running_batch)
        self._batch_admitted = 0

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        """vLLM's update, timing the step that just ended and counting its interference."""
        if scheduler_output.total_num_scheduled_tokens == 0:
            return super().update_from_output(scheduler_output, model_runner_output)
        now_s = math.nan
        if self._step_clock is not None:
            now_s = self._step_clock()
            self.step_timer.finished(now_s)
        gap_s = self.step_timer.take_gap()  # or the profile time `observe_step_s` was given
        scheduled = [
            (req, req.num_output_tokens, n)
            for rid, n in scheduler_output.num_scheduled_tokens.items()
            if (req := self.requests.get(rid)) is not None
        ]
        out = super().update_from_output(scheduler_output, model_runner_output)
        if self.step_guard is not None and math.isfinite(gap_s):
            self.step_guard.observe(
                gap_s,
                sum(n for req, _, n in scheduled if self.is_batch(req)),
                sum(1 for req, before, _ in scheduled
                    if not self.is_batch(req) and 0 < before < req.num_output_tokens),
            )
        if self._step_clock is None:
            return out
        if self.attribution is not None:
            self.attribution.finished(
                now_s,
                [StepRequest(req.request_id, self.is_batch(req), req.num_output_tokens > before,
                             req.num_output_tokens == 0) for req, before, _ in scheduled],
                sum(1 for req in self.waiting if not self.is_batch(req)),
                self.requests,
            )
        return out

    def _reserve_prefill_lookahead(
        self, request: Request, num_computed_tokens: int, num_new_tokens: int
    ) -> int:
        """vLLM's chunk for `request` this step, batch capped first, then vLLM's lookahead."""
        if not self.plugin_config.enforce:
            return super()._reserve_prefill_lookahead(request, num_computed_tokens,
                                                      num_new_tokens)
        if num_new_tokens > 0 and self.is_batch(request):
            num_new_tokens = self._batch_cap(request, num_computed_tokens, num_new_tokens)
            if num_new_tokens == 0:
                return 0
        num_new_tokens = super()._reserve_prefill_lookahead(
            request, num_computed_tokens, num_new_tokens
        )
        if num_new_tokens > 0 and self.is_batch(request):
            self._granted[request.request_id] = num_new_tokens
            if request.status != RequestStatus.RUNNING:
                self._batch_admitted += 1
                self._batch_kv_tokens += _kv_tokens(request)
        return num_new_tokens

    def _batch_cap(self, request: Request, num_computed_tokens: int, num_new_tokens: int) -> int:
        """`num_new_tokens` cut to the batch tokens left this step. Rows beyond the request's
        unscheduled tokens (speculative-decoding padding or drafts) go whole or not at all:
        vLLM asserts a padded row set keeps its `1 + num_spec_tokens` rows."""
        left = self._batch_tokens_left(request)
        if num_new_tokens <= left:
            return num_new_tokens
        if num_new_tokens > request.num_tokens - num_computed_tokens:
            return 0
        return left

    def _batch_tokens_left(self, request: Request) -> int:
        """Batch tokens `request` may still get in this step (0: skip it this step).

        Grants to requests preempted later in the same step are given back. A waiting
        request is admitted only below the sequence cap; the WAITING pass runs only in
        steps without preemption, so the running count from the step's start holds.
        """
        seqs = used = 0
        for rid, n in self._granted.items():
            if self.requests[rid].status != RequestStatus.PREEMPTED:
                seqs += 1
                used += n
        if seqs >= self.batch_seq_cap:
            return 0
        if request.status != RequestStatus.RUNNING:
            if self._batch_running + self._batch_admitted >= self.batch_seq_cap:
                return 0
            if self._batch_kv_tokens + _kv_tokens(request) > self.batch_kv_cap:
                return 0
        return max(0, self.batch_allowance - used)

    def shutdown(self) -> None:
        """Stop the budget watcher, then vLLM's own shutdown."""
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
        super().shutdown()


def _kv_tokens(request: Request) -> int:
    """KV tokens a request may come to hold: prompt plus maximum output (the gate's measure)."""
    return request.num_prompt_tokens + request.max_tokens


class BorrowdScheduler(BudgetEnforcement, Scheduler):
    """vLLM's synchronous V1 `Scheduler` with the borrowd budget enforced."""


class BorrowdAsyncScheduler(BudgetEnforcement, AsyncScheduler):
    """vLLM's `AsyncScheduler` (asynchronous scheduling) with the borrowd budget enforced."""
