"""The engine plugin's arithmetic: per-step batch allowance, sequence cap, step timing, config."""

from __future__ import annotations

import math

import pytest
from borrowd.adapters.engine_budget import (
    MAX_STEP_S,
    PluginConfig,
    StaticBudgetSource,
    StepTimer,
    batch_seq_cap,
    batch_tokens_per_step,
    engine_share,
)
from borrowd.models.budget import Budget, Mode, closed_budget
from borrowd.models.enforcement import STEP_GUARD_INCREASE_TOKENS, StepGuard, step_guard_for
from borrowd.models.errors import ConfigError


def _budget(tokens_per_s: float, seqs: int = 4, mode: Mode = Mode.OPEN) -> Budget:
    return Budget(pool="p", mode=mode, reason="test", batch_tokens_per_s=tokens_per_s,
                  batch_burst_tokens=0, max_batch_seqs=seqs, max_batch_kv_tokens=10**6,
                  max_batch_output_tokens=1024)


@pytest.mark.parametrize(("budget", "step_s", "expected"), [
    (None, 0.05, 0),
    (closed_budget("p", Mode.CLOSED, "slo"), 0.05, 0),
    (_budget(20000.0, mode=Mode.STOPPED), 0.05, 0),
    (_budget(0.0), 0.05, 16),
    (_budget(0.0, mode=Mode.CLOSED), 0.05, 16),
    (_budget(20000.0, seqs=0), 0.05, 0),
    (_budget(20000.0), 0.05, 1000),
    (_budget(20000.0, mode=Mode.RAMP), 0.1, 2000),
    (_budget(10.0), 0.05, 16),
], ids=["no-record", "closed", "stopped", "zero-rate-drains", "closed-keeping-caps-drains",
        "zero-seqs", "open", "ramp", "floor"])
def test_batch_tokens_per_step(budget: Budget | None, step_s: float, expected: int) -> None:
    """Rate times step time, floored while open; the floor while a record that admits nothing
    new keeps its caps (in-flight work drains); zero without a record, once revoked (caps
    zero) or stopped by the operator."""
    assert batch_tokens_per_step(budget, step_s, floor_tokens=16) == expected


@pytest.mark.parametrize(("budget", "expected"), [
    (None, 0), (closed_budget("p", Mode.FAILSAFE, "stale"), 0), (_budget(100.0, seqs=3), 3),
    (_budget(0.0, seqs=3, mode=Mode.CLOSED), 3), (_budget(100.0, seqs=3, mode=Mode.STOPPED), 0),
], ids=["no-record", "failsafe", "open", "draining", "stopped"])
def test_batch_seq_cap(budget: Budget | None, expected: int) -> None:
    """The running batch sequence cap is the record's while it admits or drains batch, else
    zero."""
    assert batch_seq_cap(budget) == expected


def test_step_timer_averages_matched_steps_and_clips_stalls() -> None:
    """Steps are matched first in, first out; a stall counts as MAX_STEP_S at most."""
    timer = StepTimer(initial_s=0.05)
    for _ in range(50):
        timer.started(0.0)
        timer.finished(0.02)
    assert timer.recent_s == pytest.approx(0.02, rel=1e-3)
    timer.started(0.0)
    timer.finished(3600.0)
    assert timer.recent_s <= 0.02 + 0.2 * MAX_STEP_S


def test_step_timer_ignores_output_without_schedule() -> None:
    """An output with no matching scheduled step leaves the recent step time alone."""
    timer = StepTimer(initial_s=0.05)
    timer.finished(10.0)
    assert timer.recent_s == 0.05


def test_step_timer_gap_leaves_out_the_step_ahead_in_flight() -> None:
    """With two steps in flight (asynchronous scheduling) a step's gap runs from the previous
    output, not from its own schedule, which fell while the step ahead still ran; a gap is
    handed out once; a step timed elsewhere is its own gap."""
    timer = StepTimer()
    assert math.isnan(timer.take_gap())
    timer.started(0.00)
    timer.started(0.01)  # scheduled while the first step runs
    timer.finished(0.03)
    assert timer.take_gap() == pytest.approx(0.03)
    timer.finished(0.06)
    assert timer.take_gap() == pytest.approx(0.03)  # not 0.05, its schedule-to-output time
    assert math.isnan(timer.take_gap())
    timer.observe(0.02)
    assert timer.take_gap() == pytest.approx(0.02)


def test_static_source_returns_what_was_set() -> None:
    """The static source (simulator, tests) hands back its budget whatever the time."""
    source = StaticBudgetSource()
    assert source.current(0.0) is None
    source.budget = _budget(5.0)
    assert source.current(1e9) == _budget(5.0)


def test_plugin_config_from_env() -> None:
    """Every setting is read from its environment variable."""
    cfg = PluginConfig.from_env({
        "BORROWD_POOL": "chat", "BORROWD_REDIS_URL": "redis://r:1/2",
        "BORROWD_BATCH_PRIORITY": "5", "BORROWD_BUDGET_POLL_S": "0.5",
        "BORROWD_MIN_BATCH_TOKENS_PER_STEP": "32",
    })
    assert cfg == PluginConfig(pool="chat", redis_url="redis://r:1/2", batch_priority=5,
                               poll_s=0.5, min_batch_tokens_per_step=32)


@pytest.mark.parametrize(("env", "message"), [
    ({}, "BORROWD_POOL"),
    ({"BORROWD_POOL": "p", "BORROWD_BATCH_PRIORITY": "low"}, "BORROWD_BATCH_PRIORITY"),
    ({"BORROWD_POOL": "p", "BORROWD_BUDGET_POLL_S": "0"}, "BORROWD_BUDGET_POLL_S"),
    ({"BORROWD_POOL": "p", "BORROWD_MIN_BATCH_TOKENS_PER_STEP": "0"},
     "BORROWD_MIN_BATCH_TOKENS_PER_STEP"),
], ids=["no-pool", "bad-priority", "zero-poll", "zero-floor"])
def test_plugin_config_rejects_bad_env(env: dict[str, str], message: str) -> None:
    """A missing pool or a malformed value stops start-up naming the variable."""
    with pytest.raises(ConfigError, match=message):
        PluginConfig.from_env(env)


def test_engine_share_divides_the_pool_budget() -> None:
    """Each of N engines enforces 1/N of the pool's rate and caps (a seat at least)."""
    pool = Budget(pool="chat", mode=Mode.OPEN, reason="r", batch_tokens_per_s=80_000.0,
                  batch_burst_tokens=10_000, max_batch_seqs=6, max_batch_kv_tokens=100_001,
                  max_batch_output_tokens=1024)
    share = engine_share(pool, 4)
    assert share is not None
    assert share.batch_tokens_per_s == 20_000.0
    assert (share.batch_burst_tokens, share.max_batch_seqs, share.max_batch_kv_tokens) == (
        2_500, 2, 25_001)
    assert share.max_batch_output_tokens == 1024
    assert engine_share(pool, 1) is pool
    assert engine_share(None, 4) is None


@pytest.mark.parametrize(("text", "message"), [("0", ">= 1"), ("two", "int")], ids=["zero", "nan"])
def test_pool_engines_from_env_is_validated(text: str, message: str) -> None:
    """BORROWD_POOL_ENGINES must be a whole number >= 1, named in the error."""
    with pytest.raises(ConfigError, match=f"BORROWD_POOL_ENGINES must be .*{message}"):
        PluginConfig.from_env({"BORROWD_POOL": "chat", "BORROWD_POOL_ENGINES": text})


@pytest.mark.parametrize(("text", "eligible"),
                         [(None, True), ("true", True), ("1", True), ("false", False),
                          ("NO", False), ("0", False)],
                         ids=["unset", "true", "one", "false", "no", "zero"])
def test_batch_eligible_from_env(text: str | None, eligible: bool) -> None:
    """BORROWD_BATCH_ELIGIBLE says whether this engine may take batch (default: yes)."""
    env = {"BORROWD_POOL": "chat"} | ({"BORROWD_BATCH_ELIGIBLE": text} if text else {})
    assert PluginConfig.from_env(env).batch_eligible is eligible


def test_batch_eligible_must_be_a_boolean() -> None:
    """A value that is not true or false stops start-up naming the variable."""
    with pytest.raises(ConfigError, match="BORROWD_BATCH_ELIGIBLE must be true or false, got"):
        PluginConfig.from_env({"BORROWD_POOL": "chat", "BORROWD_BATCH_ELIGIBLE": "maybe"})


def test_enforce_from_env_turns_the_plugin_into_an_observer() -> None:
    """BORROWD_ENFORCE defaults to true; false keeps the interference series but runs no step
    guard (it enforces nothing); a value that is not a boolean names the variable."""
    assert PluginConfig.from_env({"BORROWD_POOL": "chat"}).enforce
    observer = PluginConfig.from_env({"BORROWD_POOL": "chat", "BORROWD_ENFORCE": "false"})
    assert not observer.enforce and observer.step_guard() is None
    with pytest.raises(ConfigError, match="BORROWD_ENFORCE must be true or false, got"):
        PluginConfig.from_env({"BORROWD_POOL": "chat", "BORROWD_ENFORCE": "sometimes"})


def test_step_guard_is_unbounded_until_a_slow_step_carries_batch() -> None:
    """The guard leaves the rate's allowance alone until a step past its target that carried
    both interactive decodes and batch tokens; 0 stays 0 (no record, revoked)."""
    guard = StepGuard(0.01)
    assert guard.limit(5000) == 5000
    guard.observe(0.05, batch_tokens=0, interactive_gaps=8)  # nothing batch could give back
    guard.observe(0.05, batch_tokens=400, interactive_gaps=0)  # nobody waited on it
    assert guard.limit(5000) == 5000
    guard.observe(0.012, batch_tokens=400, interactive_gaps=8)
    assert guard.limit(5000) == 280  # 0.7 x the 400 carried
    assert guard.limit(100) == 100
    assert guard.limit(0) == 0


def test_step_guard_grows_only_on_fast_steps_that_used_the_whole_cap() -> None:
    """Additive increase after a step within the target whose batch used the whole cap;
    a step that left part of the cap unused grows nothing (use validation)."""
    guard = StepGuard(0.01)
    guard.observe(0.02, batch_tokens=100, interactive_gaps=3)
    assert guard.limit(10**6) == 70
    guard.observe(0.008, batch_tokens=70, interactive_gaps=3)
    assert guard.limit(10**6) == 70 + STEP_GUARD_INCREASE_TOKENS
    guard.observe(0.008, batch_tokens=20, interactive_gaps=3)
    assert guard.limit(10**6) == 70 + STEP_GUARD_INCREASE_TOKENS


def test_step_guard_keeps_one_token_a_step() -> None:
    """However slow the steps, batch in flight keeps at least one token a step."""
    guard = StepGuard(0.001)
    for _ in range(20):
        guard.observe(0.5, batch_tokens=1, interactive_gaps=1)
    assert guard.limit(5000) == 1


def assert_guard_target(guard: StepGuard | None, target_s: float | None) -> None:
    """`guard` is None when `target_s` is, else a guard at `target_s`."""
    if target_s is None:
        assert guard is None
    else:
        assert guard is not None and guard.target_s == pytest.approx(target_s)


@pytest.mark.parametrize(("slo_s", "frac", "target_s"), [
    (0.05, 0.9, 0.045), (0.05, 0.0, None), (math.nan, 0.9, None), (0.0, 0.9, None),
], ids=["on", "off", "no-slo", "zero-slo"])
def test_step_guard_for(slo_s: float, frac: float, target_s: float | None) -> None:
    """A guard at frac x the ITL SLO; none when switched off or without an SLO."""
    assert_guard_target(step_guard_for(slo_s, frac), target_s)


def test_step_guard_rejects_bad_settings() -> None:
    """A target that is not a positive duration is refused with its value."""
    with pytest.raises(ValueError, match="step guard target"):
        StepGuard(0.0)


@pytest.mark.parametrize(("env", "target_s"), [
    ({}, 0.045), ({"BORROWD_SLO_ITL_S": "0.05,0.02"}, 0.018),
    ({"BORROWD_SLO_ITL_S": "0.03", "BORROWD_STEP_GUARD_FRAC": "0.5"}, 0.015),
    ({"BORROWD_STEP_GUARD_FRAC": "0"}, None),
], ids=["default-slo", "smallest-slo", "frac", "off"])
def test_plugin_step_guard_from_env(env: dict[str, str], target_s: float | None) -> None:
    """The plugin guards steps at BORROWD_STEP_GUARD_FRAC (0.9) x its smallest ITL SLO (50 ms
    unless BORROWD_SLO_ITL_S says); 0 switches it off."""
    assert_guard_target(PluginConfig.from_env({"BORROWD_POOL": "p", **env}).step_guard(),
                        target_s)


def test_plugin_rejects_a_step_guard_frac_out_of_range() -> None:
    """BORROWD_STEP_GUARD_FRAC outside [0, 1] is one error naming the variable."""
    with pytest.raises(ConfigError, match="BORROWD_STEP_GUARD_FRAC must be in"):
        PluginConfig.from_env({"BORROWD_POOL": "p", "BORROWD_STEP_GUARD_FRAC": "1.5"})
