"""The borrowd scheduler plugin inside vLLM's real V1 scheduler, reading a real redis-server."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs the optional vLLM extra (see .ci/run)")

from borrowd.adapters.engine_budget import PluginConfig, StaticBudgetSource
from borrowd.adapters.redis_conn import connect
from borrowd.adapters.store import BudgetStore
from borrowd.adapters.vllm_plugin import BorrowdAsyncScheduler, BorrowdScheduler, check_vllm_hook
from borrowd.models.budget import Budget, Mode, closed_budget

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


@pytest.mark.parametrize(("slo_itl_s", "frac", "guarded"), [
    ("0.04", "", True), ("", "", True), ("", "0", False), ("0.1", "", False),
], ids=["slo-40ms", "default-slo-50ms", "guard-off", "slo-100ms-steps-fast-enough"])
def test_step_guard_cuts_batch_while_interactive_decodes_wait(
    store: BudgetStore, monkeypatch: pytest.MonkeyPatch, slo_itl_s: str, frac: str,
    guarded: bool,
) -> None:
    """Under an ITL SLO of 40 ms (or the default 50 ms) every 50 ms step that carries an
    interactive decode and batch is past the guard's 0.9 x SLO: the batch tokens per step
    fall by 0.7 a step to the one-token floor, and batch still progresses. With the guard
    off, or steps within its target, the rate allowance alone holds."""
    monkeypatch.setenv("BORROWD_SLO_ITL_S", slo_itl_s)
    monkeypatch.setenv("BORROWD_STEP_GUARD_FRAC", frac)
    _publish(store, _budget(20_000.0))
    sched = _plugin()
    assert (sched.step_guard is not None) == (frac != "0")
    h.add(sched, "i0", 200, 400, priority=h.INTERACTIVE_PRIORITY)
    h.add(sched, "b0", 32768, 16, priority=h.BATCH_PRIORITY)
    per_step = [_batch_tokens(h.step(sched)) for _ in range(30)]
    assert all(tokens > 0 for tokens in per_step)
    if guarded:
        assert per_step[-1] == 1
        assert all(b <= a for a, b in itertools.pairwise(per_step[2:]))
    else:
        assert per_step[-1] >= 0.95 * 20_000.0 * STEP_S


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
    """A closed record reaches the plugin by pub/sub (polls are 30 s apart): one that keeps
    its caps lets the batch in flight drain at the step floor (the gate admits nothing new;
    what it admitted before ends); a revoking one (caps zero) stops batch."""
    _publish(store, _budget(20_000.0))
    sched = _plugin()
    h.add(sched, "b0", 32768, 16, priority=h.BATCH_PRIORITY)
    assert _batch_tokens(h.step(sched)) > 16
    _publish(store, _budget(0.0, mode=Mode.CLOSED))
    wait_until(lambda: sched.budget_source.current(time.time()).mode == Mode.CLOSED, 2.0,
               "the pushed cut")
    steps = [h.step(sched) for _ in range(3)]
    assert all(0 < _batch_tokens(step) <= sched.plugin_config.min_batch_tokens_per_step
               for step in steps)
    _publish(store, closed_budget(POOL, Mode.CLOSED, "revoked"))
    wait_until(lambda: sched.budget_source.current(time.time()).max_batch_seqs == 0, 2.0,
               "the pushed revocation")
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


def test_engine_outside_the_batch_set_schedules_no_batch(
    store: BudgetStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With BORROWD_BATCH_ELIGIBLE=false an open budget in Redis gives this engine no batch
    token, and its interactive requests are scheduled step for step as on an engine with no
    batch queued at all (a queued batch request holds no KV and no step budget)."""
    _publish(store, _budget(1_000_000.0))
    monkeypatch.setenv("BORROWD_BATCH_ELIGIBLE", "false")
    stream = [(f"i{i}", 300 + 700 * i, 20) for i in range(8)]
    traces = []
    for with_batch in (False, True):
        sched = h.scheduler(h.engine_config(long_prefill_token_threshold=1024),
                            BorrowdScheduler, step_clock=StepClock())
        _LIVE.append(sched)
        assert not sched.plugin_config.batch_eligible
        if with_batch:
            h.add(sched, "b0", 32768, 16, priority=h.BATCH_PRIORITY)
            h.add(sched, "b1", 4000, 16, priority=h.BATCH_PRIORITY)
        for k, (rid, prompt, out) in enumerate(stream):
            h.add(sched, rid, prompt, out, priority=h.INTERACTIVE_PRIORITY, arrival_s=float(k))
        traces.append([h.step(sched) for _ in range(40)])
        if with_batch:
            assert sched.requests["b0"].num_computed_tokens == 0
            assert sched.requests["b1"].num_computed_tokens == 0
    assert all(_batch_tokens(step) == 0 for step in traces[1])
    assert traces[0] == traces[1]


@pytest.mark.parametrize("name", ["BorrowdScheduler", "BorrowdAsyncScheduler"])
def test_vllm_resolves_the_scheduler_cls_option(name: str) -> None:
    """`--scheduler-cls borrowd.adapters.vllm_plugin.NAME` resolves to the plugin class."""
    import borrowd.adapters.vllm_plugin as vllm_plugin
    from vllm.config import SchedulerConfig

    config = SchedulerConfig(max_model_len=8192, is_encoder_decoder=False,
                             scheduler_cls=f"borrowd.adapters.vllm_plugin.{name}")
    assert config.get_scheduler_cls() is getattr(vllm_plugin, name)


def _static_plugin(cls: type, budget: Budget, floor_tokens: int, **config: Any) -> Any:
    """A plugin on a fixed budget whose per-step batch allowance is `floor_tokens`."""
    plugin_config = PluginConfig(pool=POOL, redis_url="redis://127.0.0.1:1/0",
                                 min_batch_tokens_per_step=floor_tokens)
    return h.scheduler(h.engine_config(), cls, budget_source=StaticBudgetSource(budget),
                       plugin_config=plugin_config, step_clock=StepClock(), **config)


@pytest.mark.parametrize("plugin_cls", [BorrowdScheduler, BorrowdAsyncScheduler],
                         ids=["borrowd-scheduler", "borrowd-async-scheduler"])
def test_padded_spec_decode_rows_are_never_trimmed(plugin_cls: type) -> None:
    """With n-gram speculative decoding (3 tokens) and prefix caching, a batch request whose
    prompt is all cached is padded to 1 + 3 rows; with 3 batch tokens left the plugin must
    skip it, not trim it (vLLM asserts `num_new_tokens == 1 + num_spec_tokens`), and run it
    whole once 4 are free (the allowance always holds one decode with its drafts)."""
    sched = _static_plugin(plugin_cls, _budget(1.0), floor_tokens=3, speculative_tokens=3,
                           prefix_caching=True)
    h.add_cacheable(sched, "i0", 64, 2)  # fills the prefix cache
    while "i0" in sched.requests:
        h.step(sched)
    h.add_cacheable(sched, "b1", 20, 20, priority=h.BATCH_PRIORITY)
    while sched.requests["b1"].num_output_tokens == 0:
        h.step(sched)
    h.add_cacheable(sched, "b2", 49, 4, priority=h.BATCH_PRIORITY)  # 48 cached: padded
    scheduled = [h.step(sched) for _ in range(60)]
    assert all(_batch_tokens(s) <= 4 for s in scheduled)
    assert not any("b1" in s and "b2" in s for s in scheduled)
    assert next(s["b2"] for s in scheduled if "b2" in s) == 4


def test_cap_leaves_vllm_its_prefill_lookahead() -> None:
    """The plugin caps a batch prefill first and vLLM then keeps its prefill lookahead
    (4 tokens here): a 100-token prompt under a 98-token allowance runs 96, leaving 4."""
    sched = _static_plugin(BorrowdScheduler, _budget(1.0), floor_tokens=98)
    sched.num_prefill_lookahead = 4  # a multi-module MTP drafter's lookahead
    h.add(sched, "b0", 100, 4, priority=h.BATCH_PRIORITY)
    assert h.step(sched) == {"b0": 96}
    assert h.step(sched) == {"b0": 4}


class _OldScheduler:
    """A vLLM scheduler from before 0.28: no prefill-lookahead hook."""


class _OtherHookScheduler:
    """A scheduler whose hook takes other arguments."""

    def _reserve_prefill_lookahead(self, request: Any) -> int:
        return 0


@pytest.mark.parametrize(("cls", "message"),
                         [(_OldScheduler, "lacks it"), (_OtherHookScheduler, "another signature")],
                         ids=["no-hook", "other-signature"])
def test_hook_check_refuses_a_vllm_without_it(cls: type, message: str) -> None:
    """The plugin names the hook it needs and why it refuses to load without it."""
    with pytest.raises(ImportError, match=f"_reserve_prefill_lookahead.*{message}"):
        check_vllm_hook(cls)


def test_plugin_import_fails_on_a_vllm_without_the_hook() -> None:
    """Importing the plugin where vLLM's Scheduler lacks the hook fails (vLLM will not start),
    instead of running with batch silently uncapped."""
    code = ("from vllm.v1.core.sched.scheduler import Scheduler\n"
            "del Scheduler._reserve_prefill_lookahead\n"
            "import borrowd.adapters.vllm_plugin\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, check=False, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode != 0
    assert "ImportError: borrowd's engine plugin needs vLLM's Scheduler" in result.stderr


@pytest.mark.parametrize("plugin_cls", [BorrowdScheduler, BorrowdAsyncScheduler],
                         ids=["borrowd-scheduler", "borrowd-async-scheduler"])
def test_mixed_load_with_speculative_decoding_and_prefix_caching(plugin_cls: type) -> None:
    """Interactive and batch requests sharing cached prefixes, 3 drafted tokens per decode:
    vLLM never asserts, batch stays within its allowance, and everything finishes."""
    sched = _static_plugin(plugin_cls, _budget(1.0), floor_tokens=24, speculative_tokens=3,
                           prefix_caching=True)
    for k in range(6):
        h.add_cacheable(sched, f"i{k}", 40 + 37 * k, 12)
        h.add_cacheable(sched, f"b{k}", 33 + 16 * k, 10, priority=h.BATCH_PRIORITY)
    steps = 0
    while sched.requests and steps < 400:
        scheduled = h.step(sched, drafts=3)
        assert _batch_tokens(scheduled) <= 24
        steps += 1
    assert not sched.requests
