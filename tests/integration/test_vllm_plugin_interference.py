"""The engine plugin inside vLLM's real V1 scheduler counts interference by batch steps.

Interactive gaps that end in steps carrying batch tokens, and interactive queue wait held in
them, go to `batch_step="true"`; the same stream with batch closed counts only "false". Also
that the plugin serves those series on `BORROWD_METRICS_LISTEN`.
"""

from __future__ import annotations

import socket
import urllib.request

import pytest

pytest.importorskip("vllm", reason="needs the optional vLLM extra (see .ci/run)")

from borrowd.adapters.engine_budget import PluginConfig, StaticBudgetSource
from borrowd.adapters.interference import ITL_METRIC, WAIT_METRIC
from borrowd.adapters.vllm_plugin import BorrowdAsyncScheduler, BorrowdScheduler
from borrowd.models.budget import Budget, Mode
from prometheus_client import CollectorRegistry

from tests.support import vllm_harness as h
from tests.support.servers import free_port

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

POOL = "chat"
READ_S = 0.05  # every reading of the plugin's step clock advances this much


class StepClock:
    """Advances READ_S per reading (the plugin reads it at schedule and at update)."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        self.now_s += READ_S
        return self.now_s


def _open_budget() -> Budget:
    return Budget(pool=POOL, mode=Mode.OPEN, reason="test", batch_tokens_per_s=20_000.0,
                  batch_burst_tokens=0, max_batch_seqs=8, max_batch_kv_tokens=10**7,
                  max_batch_output_tokens=1024)


def _plugin(source: StaticBudgetSource, cls: type = BorrowdScheduler,
            listen: tuple[str, int] | None = None,
            slo_itl_s: tuple[float, ...] = ()) -> BorrowdScheduler:
    config = PluginConfig(pool=POOL, redis_url="redis://127.0.0.1:1/0", metrics_listen=listen,
                          slo_itl_s=slo_itl_s)
    return h.scheduler(h.engine_config(), cls, step_clock=StepClock(), budget_source=source,
                       plugin_config=config)


def _value(registry: CollectorRegistry, name: str, batch_step: str) -> float:
    for metric in registry.collect():
        for sample in metric.samples:
            if sample.name == name and sample.labels["batch_step"] == batch_step:
                return sample.value
    raise AssertionError(f"{name}{{batch_step={batch_step!r}}} not exported")


def _counts(sched: BorrowdScheduler) -> dict[str, float]:
    reg = sched.metrics_registry
    return {
        "gaps_batch": _value(reg, ITL_METRIC + "_count", "true"),
        "gaps_clean": _value(reg, ITL_METRIC + "_count", "false"),
        "wait_batch_s": _value(reg, WAIT_METRIC + "_total", "true"),
        "wait_clean_s": _value(reg, WAIT_METRIC + "_total", "false"),
    }


def _run(sched: BorrowdScheduler, source: StaticBudgetSource) -> None:
    """Two decoding interactive requests; 6 steps with a batch prefill running (budget open
    or closed by the caller), then a long interactive prompt chunked over several steps."""
    h.add(sched, "i0", 100, 40)
    h.add(sched, "i1", 100, 40)
    h.step(sched)  # both prefills and first tokens: no gap yet
    h.add(sched, "b0", 32768, 16, priority=h.BATCH_PRIORITY, arrival_s=0.5)
    for _ in range(6):
        h.step(sched)
    h.add(sched, "i2", 20_000, 4, arrival_s=1.0)  # 8192-token steps: prefill over 3 steps
    for _ in range(3):
        h.step(sched)


@pytest.mark.parametrize("cls", [BorrowdScheduler, BorrowdAsyncScheduler],
                         ids=["scheduler", "async-scheduler"])
def test_gaps_and_wait_in_batch_steps_are_counted_as_batch(cls: type) -> None:
    """With batch running, the decodes' gaps and a chunked interactive prefill's wait count
    as `batch_step="true"`; each gap is the time between the request's tokens."""
    source = StaticBudgetSource(_open_budget())
    sched = _plugin(source, cls)
    _run(sched, source)
    counts = _counts(sched)
    # 9 steps after the first, each ending one gap of i0 and one of i1, all carrying batch.
    assert counts["gaps_batch"] == 18
    assert counts["gaps_clean"] == 0
    assert counts["wait_batch_s"] > 0
    assert counts["wait_clean_s"] == 0
    gap_sum = _value(sched.metrics_registry, ITL_METRIC + "_sum", "true")
    assert gap_sum == pytest.approx(18 * 2 * READ_S)  # two clock readings per step


def test_without_batch_nothing_is_attributed_to_batch() -> None:
    """The same stream with no budget record: batch gets no token, every gap and every
    second of wait counts as `batch_step="false"`."""
    source = StaticBudgetSource(None)
    sched = _plugin(source)
    _run(sched, source)
    counts = _counts(sched)
    assert sched.requests["b0"].num_computed_tokens == 0
    assert counts["gaps_batch"] == 0 and counts["wait_batch_s"] == 0
    assert counts["gaps_clean"] == 18
    assert counts["wait_clean_s"] > 0


def _served_after_three_steps(slo_itl_s: tuple[float, ...] = ()) -> str:
    """The /metrics text a plugin serving on a free port (with these ITL SLO bounds) gives
    after three interactive steps."""
    port = free_port()
    sched = _plugin(StaticBudgetSource(_open_budget()), listen=("127.0.0.1", port),
                    slo_itl_s=slo_itl_s)
    h.add(sched, "i0", 100, 4)
    for _ in range(3):
        h.step(sched)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return resp.read().decode()


def test_plugin_serves_its_series_on_metrics_listen() -> None:
    """`BORROWD_METRICS_LISTEN` makes the engine core serve the interference series."""
    text = _served_after_three_steps()
    assert f'{ITL_METRIC}_count{{batch_step="false",engine="0"' in text
    assert f"{WAIT_METRIC}_total" in text


def test_plugin_gap_histogram_has_a_bound_at_the_pools_itl_slo() -> None:
    """With `BORROWD_SLO_ITL_S` the served gap histogram has a bucket at the pool's ITL SLO
    (7.5 ms, below vLLM's smallest ITL bound), where the daemon reads the burn."""
    text = _served_after_three_steps(slo_itl_s=PluginConfig.from_env(
        {"BORROWD_POOL": POOL, "BORROWD_SLO_ITL_S": "0.0075"}).slo_itl_s)
    assert f'{ITL_METRIC}_bucket{{batch_step="false",engine="0",le="0.0075"' in text
    assert f'{ITL_METRIC}_bucket{{batch_step="false",engine="0",le="0.01"' in text


def test_a_taken_metrics_port_does_not_stop_the_engine() -> None:
    """A metrics port already in use leaves the series unserved, never the engine down."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        sched = _plugin(StaticBudgetSource(_open_budget()), listen=("127.0.0.1", port))
        h.add(sched, "i0", 100, 3)
        for _ in range(3):
            h.step(sched)
    assert "i0" not in sched.requests  # finished
    assert _value(sched.metrics_registry, ITL_METRIC + "_count", "false") == 2


def test_observe_only_plugin_schedules_as_vllm_and_counts_interference() -> None:
    """`BORROWD_ENFORCE=false`: with no budget record at all the plugin schedules batch as
    vLLM's own scheduler does (step for step the same tokens) and still counts the gaps that
    ended in steps carrying batch, for a pool the admission gate alone enforces."""
    from vllm.v1.core.sched.scheduler import Scheduler

    config = PluginConfig.from_env({"BORROWD_POOL": POOL, "BORROWD_ENFORCE": "false"})
    assert not config.enforce and config.step_guard() is None
    sched = h.scheduler(h.engine_config(), BorrowdScheduler, step_clock=StepClock(),
                        budget_source=StaticBudgetSource(None), plugin_config=config)
    plain = h.scheduler(h.engine_config(), Scheduler)
    for s in (sched, plain):
        h.add(s, "i0", 100, 40)
        h.add(s, "i1", 100, 40)
        h.add(s, "b0", 32768, 16, priority=h.BATCH_PRIORITY, arrival_s=0.5)
    for _ in range(8):
        assert h.step(sched) == h.step(plain)
    assert sched.requests["b0"].num_computed_tokens > 0  # no record, and batch still ran
    counts = _counts(sched)
    assert counts["gaps_batch"] > 0
    assert counts["gaps_batch"] + counts["gaps_clean"] == 14  # 7 steps after the first x 2
