"""The borrowd scheduler plugin inside vLLM's real V1 scheduler, reading a real redis-server."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

pytest.importorskip("vllm", reason="needs the optional vLLM extra (see .ci/run)")

from adapters.redis_conn import connect
from adapters.store import BudgetStore
from adapters.vllm_plugin import BorrowdAsyncScheduler, BorrowdScheduler
from models.budget import Budget, Mode
from tests.support import vllm_harness as h
from tests.support.servers import ServerProcess, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

POOL = "chat"
STEP_S = 0.05  # step time seen by the plugin through its fake step clock


class StepClock:
    """Advances STEP_S per reading: every step the plugin times lasts STEP_S."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        self.now_s += STEP_S
        return self.now_s


def _budget(tokens_per_s: float, seqs: int = 8, mode: Mode = Mode.OPEN,
            kv_tokens: int = 10**7) -> Budget:
    return Budget(pool=POOL, mode=mode, reason="test", batch_tokens_per_s=tokens_per_s,
                  batch_burst_tokens=0, max_batch_seqs=seqs, max_batch_kv_tokens=kv_tokens,
                  max_batch_output_tokens=1024)


_LIVE: list[BorrowdScheduler] = []


@pytest.fixture
def store(redis_proc: ServerProcess, monkeypatch: pytest.MonkeyPatch) -> Iterator[BudgetStore]:
    """The pool's budget store on a fresh redis-server, which the plugin reads via env vars."""
    monkeypatch.setenv("BORROWD_REDIS_URL", redis_proc.extra["url"])
    monkeypatch.setenv("BORROWD_POOL", POOL)
    monkeypatch.setenv("BORROWD_BUDGET_POLL_S", "30")  # only pub/sub can be fast
    client = connect(redis_proc.extra["url"])
    yield BudgetStore(client, POOL)
    while _LIVE:  # stop every plugin's watcher thread before redis-server goes away
        _LIVE.pop().shutdown()
    client.close()


def _publish(store: BudgetStore, budget: Budget, ttl_ms: int = 60_000) -> None:
    store.publish(budget, epoch=1, ttl_ms=ttl_ms, now_s=time.time())


def _plugin(cls: type = BorrowdScheduler, **overrides: object) -> BorrowdScheduler:
    sched = h.scheduler(h.engine_config(**overrides), cls, step_clock=StepClock())
    _LIVE.append(sched)
    wait_until(sched.budget_source.ready.is_set, 10.0, "the plugin's budget watcher")
    return sched


def _batch_tokens(scheduled: dict[str, int]) -> int:
    return sum(n for rid, n in scheduled.items() if rid.startswith("b"))


@pytest.mark.parametrize("plugin_cls", [None, BorrowdScheduler, BorrowdAsyncScheduler],
                         ids=["plain-vllm", "borrowd-scheduler", "borrowd-async-scheduler"])
def test_batch_prefill_no_longer_fills_steps_ahead_of_interactive(
    store: BudgetStore, plugin_cls: type | None
) -> None:
    """A running 32k batch prefill delays an interactive prefill 3 steps; not under the plugin."""
    _publish(store, _budget(20_000.0))
    with_plugin = plugin_cls is not None
    sched = _plugin(plugin_cls) if plugin_cls else h.scheduler(h.engine_config())
    h.add(sched, "b0", 32768, 16, priority=h.BATCH_PRIORITY)
    first = h.step(sched)
    h.add(sched, "i0", 2000, 16, priority=h.INTERACTIVE_PRIORITY, arrival_s=1.0)
    ttft_steps = h.first_token_step(sched, "i0")
    if with_plugin:
        assert _batch_tokens(first) == int(20_000.0 * 0.03)  # initial step time 30 ms
        assert ttft_steps == 1
    else:
        assert first == {"b0": 8192}
        assert ttft_steps == 4


def test_plugin_holds_batch_to_rate_times_step_time(store: BudgetStore) -> None:
    """Each step's batch tokens stay within budget rate x recent step time, and batch progresses."""
    _publish(store, _budget(20_000.0))
    sched = _plugin()
    h.add(sched, "b0", 32768, 16, priority=h.BATCH_PRIORITY)
    h.add(sched, "b1", 32768, 16, priority=h.BATCH_PRIORITY, arrival_s=0.1)
    done = 0
    for _ in range(40):
        allowance_before = sched.step_timer.recent_s * 20_000.0
        done += (tokens := _batch_tokens(h.step(sched)))
        assert 0 < tokens <= allowance_before + 1
    assert sched.step_timer.recent_s == pytest.approx(STEP_S, rel=0.01)
    assert done > 35 * 900


def test_missing_record_means_zero_batch_tokens(store: BudgetStore) -> None:
    """With no record in Redis no batch token is scheduled, and interactive work finishes."""
    sched = _plugin()
    h.add(sched, "b0", 4000, 16, priority=h.BATCH_PRIORITY)
    h.add(sched, "i0", 500, 8, priority=h.INTERACTIVE_PRIORITY)
    steps = [h.step(sched) for _ in range(12)]
    assert all(_batch_tokens(s) == 0 for s in steps)
    assert "i0" not in sched.requests  # finished
    assert sched.requests["b0"].num_computed_tokens == 0


def test_expired_record_means_zero_batch_tokens(store: BudgetStore) -> None:
    """Batch runs under a fresh lease and stops once the lease has expired."""
    _publish(store, _budget(20_000.0), ttl_ms=1500)
    sched = _plugin()
    h.add(sched, "b0", 32768, 16, priority=h.BATCH_PRIORITY)
    assert _batch_tokens(h.step(sched)) > 0
    wait_until(lambda: sched.budget_source.current(time.time()) is None, 5.0, "lease expiry")
    assert all(_batch_tokens(h.step(sched)) == 0 for _ in range(5))


def test_cut_is_pushed_within_a_step(store: BudgetStore) -> None:
    """A closed record reaches the plugin by pub/sub (polls are 30 s apart) and stops batch."""
    _publish(store, _budget(20_000.0))
    sched = _plugin()
    h.add(sched, "b0", 32768, 16, priority=h.BATCH_PRIORITY)
    assert _batch_tokens(h.step(sched)) > 0
    _publish(store, _budget(0.0, mode=Mode.CLOSED))
    wait_until(lambda: sched.budget_source.current(time.time()).mode == Mode.CLOSED, 2.0,
               "the pushed cut")
    assert _batch_tokens(h.step(sched)) == 0


def test_batch_sequence_cap(store: BudgetStore) -> None:
    """No more than max_batch_seqs batch requests get tokens in any step."""
    _publish(store, _budget(1_000_000.0, seqs=2))
    sched = _plugin()
    for i in range(5):
        h.add(sched, f"b{i}", 3000, 10, priority=h.BATCH_PRIORITY, arrival_s=float(i))
    seen = set()
    for _ in range(30):
        scheduled = h.step(sched)
        batch = {rid for rid in scheduled if rid.startswith("b")}
        assert len(batch) <= 2
        seen |= batch
    assert len(seen) >= 3  # finished ones make room for the next


def test_batch_kv_token_cap(store: BudgetStore) -> None:
    """A batch request is admitted only while prompt + max output of running batch fits the cap."""
    _publish(store, _budget(1_000_000.0, kv_tokens=10_000))
    sched = _plugin()
    for i in range(3):
        h.add(sched, f"b{i}", 4000, 10, priority=h.BATCH_PRIORITY, arrival_s=float(i))
    assert set(h.step(sched)) == {"b0", "b1"}  # 2 x 4010 fit in 10000, a third does not
    while "b0" in sched.requests or "b1" in sched.requests:
        assert "b2" not in h.step(sched)
    assert "b2" in h.step(sched)


@pytest.mark.parametrize("budget", [None, _budget(0.0, mode=Mode.CLOSED), _budget(5_000.0)],
                         ids=["no-record", "closed", "open"])
def test_interactive_never_held_back(store: BudgetStore, budget: Budget | None) -> None:
    """Interactive requests are scheduled exactly as by plain vLLM, whatever the budget."""
    if budget is not None:
        _publish(store, budget)
    stream = [(f"i{i}", 300 + 700 * i, 20) for i in range(8)]
    traces = []
    for sched in (h.scheduler(h.engine_config(long_prefill_token_threshold=1024)),
                  _plugin(long_prefill_token_threshold=1024)):
        for k, (rid, prompt, out) in enumerate(stream):
            h.add(sched, rid, prompt, out, priority=h.INTERACTIVE_PRIORITY, arrival_s=float(k))
        traces.append([h.step(sched) for _ in range(40)])
    assert traces[0] == traces[1]


@pytest.mark.parametrize("name", ["BorrowdScheduler", "BorrowdAsyncScheduler"])
def test_vllm_resolves_the_scheduler_cls_option(name: str) -> None:
    """`--scheduler-cls adapters.vllm_plugin.NAME` resolves to the plugin class."""
    from vllm.config import SchedulerConfig

    import adapters.vllm_plugin

    config = SchedulerConfig(max_model_len=8192, is_encoder_decoder=False,
                             scheduler_cls=f"adapters.vllm_plugin.{name}")
    assert config.get_scheduler_cls() is getattr(adapters.vllm_plugin, name)
