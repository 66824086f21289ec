"""The simulator's engine stepped in real time on the asyncio loop.

Each step is computed at once (`Engine.step`), then the loop sleeps the step's duration from
the profile, scaled by `time_scale` (wall seconds per simulated second; 0.1 runs ten times
faster), and delivers the step's tokens to the requests' queues. Aborts take effect at once
(the step already finished in the engine), freeing the request's KV blocks. Each step also
counts its interactive gaps and queue wait by whether it carried batch tokens
(`adapters.interference`), in wall seconds as the latency histograms.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from borrowd.adapters.emulator.metrics import VllmMetrics
from borrowd.adapters.interference import InterferenceMetrics
from borrowd.models.sim.engine import Engine
from borrowd.models.sim.request import BATCH, INTERACTIVE, Request

FINISHED = None
"""Queue item that ends a request's token stream (its max_tokens were generated)."""
PRIORITY_RECORD_SIZE = 10_000
"""How many recent (request id -> priority) pairs `priorities_seen` keeps, for tests."""


@dataclass(slots=True)
class Tracked:
    """Wall-clock history and token queue of one request served by the emulator."""

    request: Request
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrived_s: float = 0.0
    scheduled_s: float = -1.0
    first_token_s: float = -1.0
    last_token_s: float = -1.0


class RealTimeEngine:
    """One emulated replica: add, abort, and a `run()` task that steps in real time."""

    def __init__(self, engine: Engine, metrics: VllmMetrics, interference: InterferenceMetrics,
                 *, time_scale: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        if time_scale <= 0:
            raise ValueError(f"time_scale must be > 0, got {time_scale}")
        self.engine = engine
        self.metrics = metrics
        self.interference = interference
        self.time_scale = time_scale
        self.clock = clock
        self.tracked: dict[str, Tracked] = {}
        self.priorities_seen: dict[str, int] = {}
        self._wake = asyncio.Event()

    def add(self, request_id: str, prompt_tokens: int, max_output_tokens: int,
            priority: int) -> Tracked:
        """Queue a request; raises `ValueError` with the engine's reason when refused.

        Priority > 0 counts as batch in the engine's per-class counters (vLLM itself has no
        classes; the proxy sends batch behind interactive).
        """
        now_s = self.clock()
        request = Request(request_id, BATCH if priority > 0 else INTERACTIVE,
                          prompt_tokens, max_output_tokens, arrival_s=now_s, priority=priority)
        if not self.engine.add_request(request):
            raise ValueError(request.error)
        tracked = Tracked(request, arrived_s=now_s)
        self.tracked[request_id] = tracked
        self.priorities_seen[request_id] = priority
        if len(self.priorities_seen) > PRIORITY_RECORD_SIZE:
            del self.priorities_seen[next(iter(self.priorities_seen))]
        self._wake.set()
        self._publish_state()
        return tracked

    def abort(self, request_id: str) -> bool:
        """Drop an unfinished request and free its KV at once; False if it already ended."""
        tracked = self.tracked.pop(request_id, None)
        if tracked is None:
            return False
        self.engine.abort_request(request_id)
        self.metrics.success["abort"].inc()
        self._publish_state()
        self._wake.set()
        return True

    def _publish_state(self) -> None:
        engine = self.engine
        self.metrics.running.set(engine.num_running())
        self.metrics.waiting.set(engine.num_waiting())
        self.metrics.kv_usage.set(engine.kv_usage_frac())

    async def run(self) -> None:
        """Step forever: compute a step, sleep its scaled duration, deliver its tokens."""
        engine = self.engine
        metrics = self.metrics
        tracked = self.tracked
        clock = self.clock
        while True:
            if not engine.has_work():
                self._wake.clear()
                await self._wake.wait()
                continue
            start_s = clock()
            result = engine.step(start_s)
            if result is None:
                # Work that cannot be scheduled yet (KV full): wait for a change.
                self._wake.clear()
                await self._wake.wait()
                continue
            for req in engine.running:
                item = tracked.get(req.request_id)
                if item is not None and item.scheduled_s < 0:
                    item.scheduled_s = start_s
            self._publish_state()
            delay_s = start_s + result.duration_s * self.time_scale - clock()
            if delay_s > 0:
                await asyncio.sleep(delay_s)
            now_s = clock()
            metrics.iteration_tokens.observe(result.scheduled_tokens)
            if result.preempted:
                metrics.preemptions.inc(len(result.preempted))
            emitted = 0
            interactive_gaps_s = []
            for req in result.emitted:
                item = tracked.get(req.request_id)
                if item is None:
                    continue
                emitted += 1
                if item.first_token_s < 0:
                    item.first_token_s = now_s
                    metrics.ttft.observe(now_s - item.arrived_s)
                    metrics.prompt_tokens.inc(req.prompt_tokens)
                else:
                    metrics.itl.observe(now_s - item.last_token_s)
                    if req.klass == INTERACTIVE:
                        interactive_gaps_s.append(now_s - item.last_token_s)
                item.last_token_s = now_s
                item.queue.put_nowait(req.output_tokens)
            metrics.generation_tokens.inc(emitted)
            self.interference.step(
                carried_batch=result.batch_tokens > 0, itl_gaps_s=interactive_gaps_s,
                interactive_waiting=result.interactive_waiting, step_s=now_s - start_s,
            )
            for req in result.finished:
                item = tracked.pop(req.request_id, None)
                if item is None:
                    continue
                item.queue.put_nowait(FINISHED)
                self._finished(item, now_s)
            self._publish_state()

    def _finished(self, item: Tracked, now_s: float) -> None:
        metrics = self.metrics
        req = item.request
        scheduled_s = item.scheduled_s if item.scheduled_s >= 0 else item.arrived_s
        metrics.success["length"].inc()
        metrics.e2e.observe(now_s - item.arrived_s)
        metrics.queue.observe(scheduled_s - item.arrived_s)
        metrics.prefill.observe(item.first_token_s - scheduled_s)
        metrics.decode.observe(now_s - item.first_token_s)
        metrics.inference.observe(now_s - scheduled_s)
        metrics.request_prompt_tokens.observe(req.prompt_tokens)
        metrics.request_generation_tokens.observe(req.output_tokens)
