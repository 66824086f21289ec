"""`borrowd drill failure` in the emulated fleet: one of two engines frozen (SIGSTOP) while
batch runs, then thawed (SIGCONT).

The frozen engine stalls the streams routed to it and its metrics; the daemon cuts batch;
after the restore the recorded p95s are within SLO. The drill reports those times (and when
batch is admitted again, if within its limit) and keeps them in Redis and a JSON file.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from borrowd.adapters.ceiling import drill_key
from borrowd.adapters.store import BudgetStore
from borrowd.models.errors import InputError
from borrowd.models.sim.trace import traces_dir

from tests.support.daemon_harness import REAL_PROMETHEUS_AND_REDIS, borrowd_command
from tests.support.rollout_fleet import POOL, SLO_ITL_S, SLO_TTFT_S, start_fleet
from tests.support.servers import wait_until

pytestmark = REAL_PROMETHEUS_AND_REDIS
DOWN_S = 8.0


def test_drill_failure_times_the_reaction_and_the_recovery(tmp_path: Path) -> None:
    """A frozen engine: batch cut while it is down, SLOs back after the restore."""
    try:
        traces_dir()
    except InputError as exc:
        pytest.skip(str(exc))
    fleet = start_fleet(tmp_path)
    engine = next(s for s in fleet.servers if s.name == "emulator-0")
    try:
        fleet.loadgen(100.0, batch_workers=8)
        store = BudgetStore(fleet.client, POOL)
        wait_until(lambda: (b := store.read(time.time())) and b.admits_batch, 30,
                   "batch admitted", 0.1)
        out = tmp_path / "failure.json"
        run = subprocess.run(
            [borrowd_command(), "drill", "failure", "--pool", POOL, "--redis", fleet.redis_url,
             "--prometheus", fleet.prometheus_url,
             "--fail-command", f"kill -STOP {engine.pid}",
             "--restore-command", f"kill -CONT {engine.pid}", "--down-s", str(DOWN_S),
             "--slo-ttft-s", str(SLO_TTFT_S), "--slo-itl-s", str(SLO_ITL_S),
             "--timeout-s", "30", "--out", str(out)],
            capture_output=True, text=True, timeout=120)
        stored = json.loads(fleet.client.get(drill_key(POOL, "failure")) or "{}")
    finally:
        if engine.proc.poll() is None:
            os.kill(engine.pid, signal.SIGCONT)
        fleet.stop()
    print(run.stdout)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    drill = json.loads(out.read_text())
    assert drill == stored and drill["passed"]
    assert drill["no_admission_s"] is not None and drill["no_admission_s"] < DOWN_S
    assert drill["slo_restored_after_restore_s"] >= 0.0
    assert drill["oldest_wait_peak_s"] > 1.0
