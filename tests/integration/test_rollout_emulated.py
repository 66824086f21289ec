"""`borrowd rollout` in the emulated fleet: real Redis, Prometheus, proxy, daemon, engines.

After an interactive-only baseline the rollout raises the ceiling step by step while the
daemon's published budgets stay under it; an interactive burst (6x the trace's rate) that
begins during the rollout makes a step burn, and the rollout stops itself there and keeps
the last good step as the pool's ceiling.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path

import pytest
from borrowd.adapters.ceiling import read_ceiling, rollout_key
from borrowd.adapters.store import BudgetStore
from borrowd.models.errors import InputError
from borrowd.models.sim.trace import traces_dir

from tests.support.daemon_harness import REAL_PROMETHEUS_AND_REDIS, borrowd_command
from tests.support.rollout_fleet import POOL, SLO_ITL_S, SLO_TTFT_S, start_fleet

pytestmark = REAL_PROMETHEUS_AND_REDIS
STEPS = (400.0, 800.0, 1600.0, 3200.0)
ROLLOUT_AT_S = 12.0
BURST = (ROLLOUT_AT_S + 14.0, 60.0, 6.0)


def test_rollout_climbs_then_stops_at_a_burst_keeping_the_last_good_step(
        tmp_path: Path) -> None:
    """Steps climb, published budgets stay under the ceiling, the burst's step burns, the
    last good step is kept."""
    try:
        traces_dir()
    except InputError as exc:
        pytest.skip(str(exc))
    fleet = start_fleet(tmp_path)
    samples: list[tuple[float, float | None, float]] = []
    done = threading.Event()

    def watch() -> None:
        store = BudgetStore(fleet.client, POOL)
        while not done.wait(0.1):
            budget = store.read(time.time())
            samples.append((time.monotonic(), read_ceiling(fleet.client, POOL),
                            budget.batch_tokens_per_s if budget else 0.0))

    watcher = threading.Thread(target=watch, daemon=True)
    try:
        loadgen_started = time.monotonic()
        fleet.loadgen(ROLLOUT_AT_S + 40.0, burst=BURST)
        time.sleep(max(0.0, ROLLOUT_AT_S - (time.monotonic() - loadgen_started)))
        watcher.start()
        out = tmp_path / "rollout.json"
        run = subprocess.run(
            [borrowd_command(), "rollout", "--pool", POOL, "--redis", fleet.redis_url,
             "--prometheus", fleet.prometheus_url, "--steps", ",".join(f"{s:g}" for s in STEPS),
             "--min-hold-s", "4", "--max-hold-s", "4", "--settle-s", "1", "--poll-s", "1",
             "--tail-error", "0.5", "--tolerance", "20", "--tail-tolerance", "20",
             "--slo-ttft-s", str(SLO_TTFT_S), "--slo-itl-s", str(SLO_ITL_S), "--out", str(out)],
            capture_output=True, text=True, timeout=90)
        done.set()
        watcher.join(timeout=5)
        stored = json.loads(fleet.client.get(rollout_key(POOL)) or "{}")
        ceiling = read_ceiling(fleet.client, POOL)
    finally:
        done.set()
        fleet.stop()
    print(run.stdout)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record == stored
    steps = record["steps"]
    good = [s for s in steps if not s["burning"]]
    assert good and steps[-1]["burning"], "climbed at least one step, then a step burned"
    assert [s["ceiling_tokens_per_s"] for s in steps] == list(STEPS[:len(steps)])
    assert record["accepted_ceiling_tokens_per_s"] == good[-1]["ceiling_tokens_per_s"]
    assert ceiling == good[-1]["ceiling_tokens_per_s"]
    assert record["baseline"]["figures"]["batch_tokens_per_s"] < 50.0
    burned = steps[-1]
    # The burn is a latency one, seen during the hold ("recorded p95 TTFT ... during the
    # hold") or in the step's verdict at its end ("ttft_p95_s ... > SLO 2"), by timing.
    assert any(word in reason.lower() for reason in burned["burning"]
               for word in ("ttft", "itl")), burned["burning"]
    assert "holding 4.0 s" in run.stdout and "samples" in run.stdout
    # The daemon honours the ceiling: once a ceiling has stood for two ticks, every
    # published budget is under it.
    for index, (at, ceiling_now, rate) in enumerate(samples):
        standing = [c for t, c, _ in samples[:index + 1] if t >= at - 1.2]
        if ceiling_now is not None and len(set(standing)) == 1 and at - samples[0][0] > 1.2:
            assert rate <= ceiling_now + 1e-6, (at, ceiling_now, rate)
