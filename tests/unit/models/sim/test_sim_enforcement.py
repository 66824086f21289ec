"""Tests of engine enforcement in the simulator: the plugin's per-step batch token limit in
the native engine, and the `--enforcement` switch of `borrowd sim`/`bench`."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from borrowd.controller.cli import main
from borrowd.controller.laws.pi import PiLaw
from borrowd.models.budget import Budget, Mode, closed_budget
from borrowd.models.enforcement import StepGuard
from borrowd.models.errors import InputError
from borrowd.models.sim.engine import Engine, EngineConfig
from borrowd.models.sim.policies import static_budget
from borrowd.models.sim.profiles import H100_LLAMA3_8B
from borrowd.models.sim.request import BATCH, INTERACTIVE, Request
from borrowd.models.sim.scenario import SEED


def make_engine() -> Engine:
    """A priority-policy engine on the H100 profile with a small KV pool."""
    return Engine(EngineConfig(num_gpu_blocks=20_000, max_model_len=40_000), H100_LLAMA3_8B)


def feed(engine: Engine, rng: random.Random, n: int, now_s: float, klasses: tuple[str, ...]
         ) -> None:
    """Queue a request of a random class among `klasses` (batch: long prompts)."""
    klass = rng.choice(klasses)
    prompt = rng.randint(2000, 30000) if klass == BATCH else rng.randint(10, 2000)
    engine.add_request(Request(f"r{n}", klass, prompt, rng.randint(1, 200), now_s,
                               priority=1 if klass == BATCH else 0))


def run_mix(engine: Engine, seed: int, klasses: tuple[str, ...], steps: int = 1500
            ) -> list[tuple[int, int, int | None]]:
    """Step a random arrival stream; per step (interactive, batch tokens, allowance before)."""
    rng = random.Random(seed)
    now = 0.0
    seen = []
    for step in range(steps):
        if rng.random() < 0.2:
            feed(engine, rng, step, now, klasses)
        allowance = engine.batch_step_allowance()
        res = engine.step(now)
        if res is None:
            now += 0.01
            continue
        seen.append((res.interactive_tokens, res.batch_tokens, allowance))
        now = res.end_s
    return seen


@pytest.mark.parametrize("rate", [2_000.0, 20_000.0, 80_000.0], ids=["2k", "20k", "80k"])
def test_batch_tokens_never_exceed_the_step_allowance(rate: float) -> None:
    """Every step's batch tokens stay within the allowance computed before it."""
    engine = make_engine()
    engine.set_batch_budget(static_budget(SEED, rate))
    seen = run_mix(engine, 11, (INTERACTIVE, BATCH))
    assert any(b > 0 for _, b, _ in seen)
    assert all(a is not None and b <= a for _, b, a in seen)


@pytest.mark.parametrize("budget", [None, closed_budget("seed", Mode.CLOSED, "test")],
                         ids=["no-record", "closed"])
def test_no_batch_tokens_without_an_open_budget(budget: Budget | None) -> None:
    """A missing or closed budget schedules no batch token; interactive work still runs."""
    engine = make_engine()
    engine.set_batch_budget(budget)
    seen = run_mix(engine, 5, (INTERACTIVE, BATCH))
    assert sum(b for _, b, _ in seen) == 0
    assert sum(i for i, _, _ in seen) > 0


def test_interactive_work_is_never_held_back() -> None:
    """Interactive requests are scheduled the same with a zero batch budget as with none."""
    limited = make_engine()
    limited.set_batch_budget(None)
    free = make_engine()
    assert [s[:2] for s in run_mix(limited, 3, (INTERACTIVE,))] == [
        s[:2] for s in run_mix(free, 3, (INTERACTIVE,))
    ]


def test_limit_is_off_by_default_and_a_loose_one_changes_nothing() -> None:
    """No limit unless set; a limit that never binds gives step-for-step the same results."""
    plain = make_engine()
    assert plain.batch_step_allowance() is None
    loose = make_engine()
    loose.set_batch_budget(static_budget(SEED, 1e12))
    assert [s[:2] for s in run_mix(loose, 9, (INTERACTIVE, BATCH))] == [
        s[:2] for s in run_mix(plain, 9, (INTERACTIVE, BATCH))
    ]


def test_scenario_rejects_an_unknown_enforcement() -> None:
    """A scenario names the bad enforcement value."""
    with pytest.raises(InputError, match="enforcement must be one of admission, engine"):
        SEED.with_overrides(enforcement="gpu")


def test_cli_rejects_an_unknown_enforcement(capsys: pytest.CaptureFixture[str]) -> None:
    """`--enforcement` with a bad value is one line naming the option, exit code 2."""
    assert main(["sim", "--policy", "none", "--enforcement", "gpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--enforcement must be one of admission, engine, got 'gpu'" in err
    assert len(err.splitlines()) == 1


def test_sim_under_engine_enforcement_labels_its_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`borrowd sim --enforcement engine` runs, says so in the JSON and in the table."""
    monkeypatch.setattr("borrowd.models.sim.run.calibrate_rate_scale", lambda *a, **k: 0.2672)
    out = tmp_path / "run.json"
    rc = main(["sim", "--scenario", "seed", "--policy", "static:20000", "--duration", "60",
               "--enforcement", "engine", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["enforcement"] == "engine"
    assert data["batch"]["computed_tokens_per_s"] > 0
    assert "| static:20000 [engine] |" in capsys.readouterr().out


@pytest.mark.parametrize(("enforcement", "setpoint"), [("admission", 0.95), ("engine", 0.8)],
                         ids=["admission", "engine"])
def test_controller_itl_burn_setpoint_follows_the_enforcement(enforcement: str,
                                                               setpoint: float) -> None:
    """The simulated pool says how its fleet enforces (`controller.enforcement`), and the PI
    built from it tracks the ITL burn at that enforcement's setpoint (engine: its own)."""
    from borrowd.controller.closed_loop import controller_config

    config = controller_config("pi", SEED.with_overrides(enforcement=enforcement))
    assert config.enforcement == enforcement
    law = PiLaw(config.law_settings(None))
    assert law.burn_setpoints[1] == setpoint


def slow_shared_steps(seen: list[tuple[int, int, int | None, float]], target_s: float) -> int:
    """Steps past `target_s` that carried interactive and batch tokens together."""
    return sum(1 for i, b, _, d in seen if i > 0 and b > 0 and d > target_s)


def run_timed(engine: Engine, seed: int) -> list[tuple[int, int, int | None, float]]:
    """`run_mix` with each step's duration."""
    rng = random.Random(seed)
    now, seen = 0.0, []
    for step in range(1500):
        if rng.random() < 0.2:
            feed(engine, rng, step, now, (INTERACTIVE, BATCH))
        allowance = engine.batch_step_allowance()
        res = engine.step(now)
        if res is None:
            now += 0.01
            continue
        seen.append((res.interactive_tokens, res.batch_tokens, allowance, res.duration_s))
        now = res.end_s
    return seen


def test_step_guard_holds_shared_steps_under_its_target() -> None:
    """With the plugin's step guard, steps that carry interactive decodes and batch pass the
    target far less often than under the rate allowance alone, and batch still runs within
    the (guarded) allowance of every step."""
    target_s = 0.03
    plain, guarded = make_engine(), make_engine()
    for engine in (plain, guarded):
        engine.set_batch_budget(static_budget(SEED, 200_000.0))
    guarded.set_step_guard(StepGuard(target_s))
    free = run_timed(plain, 21)
    held = run_timed(guarded, 21)
    assert slow_shared_steps(free, target_s) > 2 * max(1, slow_shared_steps(held, target_s))
    assert sum(b for _, b, _, _ in held) > 0
    assert all(a is not None and b <= a for _, b, a, _ in held)
