"""`borrowd drill burst` in the emulated fleet: real Redis, Prometheus, proxy, daemon, engines.

While batch is admitted, the drill sends an interactive burst through the proxy; the daemon
cuts batch, the in-flight batch goes, and after the burst the recorded interactive p95s come
back within SLO. The drill reports those times and keeps them in Redis and a JSON file.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from borrowd.adapters.ceiling import drill_key
from borrowd.adapters.store import BudgetStore
from borrowd.models.errors import InputError
from borrowd.models.sim.trace import traces_dir

from tests.support.daemon_harness import REAL_PROMETHEUS_AND_REDIS, borrowd_command
from tests.support.rollout_fleet import (
    INTERACTIVE_KEY,
    POOL,
    SLO_ITL_S,
    SLO_TTFT_S,
    start_fleet,
)
from tests.support.servers import wait_until

pytestmark = REAL_PROMETHEUS_AND_REDIS
BURST_S = 10.0
# 8x the trace: a burst the SLOs need cut for. At 4x they held (p95 TTFT 0.65 s against
# 2 s); at 6x the peak was near the SLO (once on CI 1.9 s against 2 s), so whether the law
# went all the way to 0 within the drill's timeout was up to the machine's speed, and the
# drill, which times a cut, once found none. At 8x, three runs here: no batch 5.6-7.8 s into
# the burst, p95 TTFT peak 6.3-7.0 s, SLO restored about 20-21 s after it.
RATE_SCALE = 8


def test_drill_burst_times_the_cut_and_the_recovery(tmp_path: Path) -> None:
    """A burst while batch runs: batch cut and drained during it, SLOs back after it."""
    try:
        traces_dir()
    except InputError as exc:
        pytest.skip(str(exc))
    fleet = start_fleet(tmp_path)
    try:
        fleet.loadgen(70.0, batch_workers=8)
        store = BudgetStore(fleet.client, POOL)
        wait_until(lambda: (b := store.read(time.time())) and b.admits_batch, 30,
                   "batch admitted", 0.1)
        out = tmp_path / "burst.json"
        run = subprocess.run(
            [borrowd_command(), "drill", "burst", "--pool", POOL, "--redis", fleet.redis_url,
             "--prometheus", fleet.prometheus_url, "--proxy", fleet.proxy_url,
             "--interactive-key", INTERACTIVE_KEY, "--rate-scale", str(RATE_SCALE),
             "--duration-s", str(BURST_S), "--max-output-tokens", "32",
             "--slo-ttft-s", str(SLO_TTFT_S), "--slo-itl-s", str(SLO_ITL_S),
             "--timeout-s", "30", "--out", str(out)],
            capture_output=True, text=True, timeout=120)
        stored = json.loads(fleet.client.get(drill_key(POOL, "burst")) or "{}")
    finally:
        fleet.stop()
    print(run.stdout)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    drill = json.loads(out.read_text())
    assert drill == stored and drill["passed"]
    assert drill["no_admission_s"] <= drill["drained_gate_s"]
    assert drill["no_admission_s"] < BURST_S + 5.0
    assert drill["slo_restored_after_end_s"] >= 0.0
    assert drill["burst_requests"] > 0 and drill["burst_success_rate"] >= 0.99
