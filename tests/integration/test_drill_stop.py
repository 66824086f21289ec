"""`borrowd drill stop` in the emulated fleet: real Redis, Prometheus, proxy, daemon, engines.

While batch work streams, the drill sets the stop switch and reports, in order, when the gate
stopped admitting, when the batch work in flight was gone (gate, then Prometheus) and when
the interactive p95s recorded after that were within SLO; it resumes the pool and keeps the
times in Redis and a JSON file.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from borrowd.adapters.ceiling import drill_key
from borrowd.adapters.gate import Gate
from borrowd.adapters.store import BudgetStore
from borrowd.models.errors import InputError
from borrowd.models.sim.trace import traces_dir

from tests.support.daemon_harness import REAL_PROMETHEUS_AND_REDIS, borrowd_command
from tests.support.rollout_fleet import POOL, SLO_ITL_S, SLO_TTFT_S, start_fleet
from tests.support.servers import wait_until

pytestmark = REAL_PROMETHEUS_AND_REDIS


def test_drill_stop_reports_the_three_times(tmp_path: Path) -> None:
    """Stop with batch in flight: no admission, drained, SLO back, in that order; resumed."""
    try:
        traces_dir()
    except InputError as exc:
        pytest.skip(str(exc))
    fleet = start_fleet(tmp_path)
    try:
        fleet.loadgen(40.0, batch_workers=8)
        gate = Gate(fleet.client, POOL)
        wait_until(lambda: gate.inflight().seqs > 0, 30, "batch work in flight", 0.1)
        out = tmp_path / "drill.json"
        run = subprocess.run(
            [borrowd_command(), "drill", "stop", "--pool", POOL, "--redis", fleet.redis_url,
             "--prometheus", fleet.prometheus_url, "--slo-ttft-s", str(SLO_TTFT_S),
             "--slo-itl-s", str(SLO_ITL_S), "--timeout-s", "15", "--out", str(out)],
            capture_output=True, text=True, timeout=60)
        stored = json.loads(fleet.client.get(drill_key(POOL, "stop")) or "{}")
        stop_reason = BudgetStore(fleet.client, POOL).stop_reason()
        reopened = wait_until(lambda: (b := BudgetStore(fleet.client, POOL).read(time.time()))
                              and b.admits_batch, 20, "the budget to reopen after the drill",
                              0.1)
    finally:
        fleet.stop()
    print(run.stdout)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    drill = json.loads(out.read_text())
    assert drill == stored
    assert drill["passed"] and drill["resumed"] and stop_reason is None and reopened
    assert drill["batch_inflight_at_stop"] > 0
    assert drill["stop_written_s"] <= drill["no_admission_s"] <= drill["drained_gate_s"]
    assert drill["drained_gate_s"] <= drill["drained_prometheus_s"]
    assert drill["drained_gate_s"] <= drill["slo_restored_s"]
    assert drill["no_admission_s"] < 0.5 and drill["drained_gate_s"] < 5.0
    assert drill["ttft_p95_restored_s"] <= SLO_TTFT_S and drill["itl_p95_restored_s"] <= SLO_ITL_S
