"""`borrowd sim --config` runs the daemon's own loop: the figures equal those of a `PoolLoop`
that the test wires from the same TOML over the same simulated fleet, and the simulation
behaves as a store (stop switch, fencing) to that loop."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from borrowd.controller.cli import main
from borrowd.controller.closed_loop import QUIET_LOG, SimControllers, example_pool
from borrowd.controller.config import load_config
from borrowd.controller.loop import PoolLoop
from borrowd.controller.loop_metrics import DaemonMetrics
from borrowd.controller.pools import build_pool_policy
from borrowd.controller.prom_source import window_seconds
from borrowd.models.budget import Budget, Mode
from borrowd.models.errors import FencedError
from borrowd.models.protocols import Election, MetricsSource, Store
from borrowd.models.sim.engine import PRIORITY
from borrowd.models.sim.policies import PolicySpec
from borrowd.models.sim.run import load_inputs
from borrowd.models.sim.scenario import get_scenario
from borrowd.models.sim.simulation import Simulation
from borrowd.models.sim.store import SimElection, SimStore

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "borrowd.toml"
RATE_SCALE = 0.2358
DURATION_S = 150.0
SEED = get_scenario("seed")


def daemon_loop_run(config_path: Path) -> dict[str, object]:
    """The summary of `seed` under the daemon's loop for the config's pool, wired here, its
    signals read over the config's Prometheus rules window as the daemon reads them."""
    config = load_config(config_path)
    pool = dataclasses.replace(config.pools[0], name=SEED.pool)
    loops: list[PoolLoop] = []

    def loop(source: MetricsSource, store: Store, election: Election) -> PoolLoop:
        policy = build_pool_policy(pool)
        built = PoolLoop(pool.name, ttl_ms=pool.budget_ttl_ms, source=source, policy=policy,
                         store=store, election=election, metrics=DaemonMetrics(),
                         query_age_s=lambda _pool, _now_s: 0.0,
                         controller_state=policy.state, log=QUIET_LOG)
        loops.append(built)
        return built

    trace, lengths = load_inputs(SEED)
    spec = PolicySpec("pi", PRIORITY, batch=True, loop=loop,
                      observe_window_s=window_seconds(config.prometheus.window))
    sim = Simulation(SEED, spec,
                     duration_s=DURATION_S, seed=0, trace=trace, rate_scale=RATE_SCALE,
                     lengths=lengths)
    summary = sim.run().summary()
    assert len(loops) == 1 and loops[0].epoch == 1
    assert sim.store.seq == DURATION_S / pool.tick_s
    return summary


def comparable(summary: dict[str, object]) -> dict[str, object]:
    """The figures of a run without its wall-clock ones."""
    return {k: v for k, v in summary.items() if k not in ("wall_s", "speed")}


@pytest.mark.slow
def test_sim_with_config_equals_the_daemon_loop_wired_by_hand(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`borrowd sim --config examples/borrowd.toml --policy pi` gives exactly the figures
    of the daemon's `PoolLoop` built from that file and ticked by the simulation."""
    monkeypatch.setattr("borrowd.models.sim.run.calibrate_rate_scale", lambda *a, **k: RATE_SCALE)
    out = tmp_path / "run.json"
    rc = main(["sim", "--config", str(EXAMPLE), "--scenario", "seed", "--policy", "pi",
               "--duration", str(DURATION_S), "--json", str(out)])
    assert rc == 0
    cli = json.loads(out.read_text())
    by_hand = daemon_loop_run(EXAMPLE)
    by_hand = comparable(json.loads(json.dumps(by_hand)))
    assert {key: cli[key] for key in by_hand} == by_hand
    assert cli["batch"]["tokens_per_s"] > 0


def test_without_config_the_defaults_are_the_example_config(tmp_path: Path) -> None:
    """Without --config the simulated pool's controller is the one `borrowd config example`
    prints (on `seed`, whose SLOs and batch sizes are the defaults)."""
    pool = SimControllers().pool_config("pi", SEED)
    assert pool.controller == example_pool().controller
    assert pool.budget_ttl_ms == example_pool().budget_ttl_ms


def open_budget() -> Budget:
    """An open budget of pool `seed`."""
    return Budget(pool=SEED.pool, mode=Mode.OPEN, reason="test", batch_tokens_per_s=1000.0,
                  batch_burst_tokens=40_000, max_batch_seqs=2, max_batch_kv_tokens=80_000,
                  max_batch_output_tokens=1024)


def test_sim_store_applies_the_stop_switch_and_fences_old_epochs() -> None:
    """The simulated store writes a stopped record while stopped and refuses older epochs,
    as the Lua publish script does; a new leader gets a newer epoch."""
    enforced: list[Budget] = []
    store = SimStore(SEED.pool, lambda budget, revoked, now_s: enforced.append(budget))
    election = SimElection(store)
    epoch = election.try_acquire()
    assert epoch == 1 and election.renew()
    stored = store.publish(open_budget(), epoch=1, ttl_ms=5000, now_s=10.0)
    assert (stored.epoch, stored.seq, stored.issued_at_s, stored.ttl_ms) == (1, 1, 10.0, 5000)
    store.stop = "maintenance"
    stopped = store.publish(open_budget(), epoch=1, ttl_ms=5000, now_s=11.0)
    assert stopped.mode == Mode.STOPPED and not stopped.admits_batch
    assert "maintenance" in stopped.reason
    election.release()
    assert election.try_acquire() == 2
    store.publish(open_budget(), epoch=2, ttl_ms=5000, now_s=12.0)
    with pytest.raises(FencedError):
        store.publish(open_budget(), epoch=1, ttl_ms=5000, now_s=13.0)
    assert [b.seq for b in enforced] == [1, 2, 3]


def test_the_stop_switch_reaches_the_simulated_pool() -> None:
    """With the stop switch set in the simulated store, the daemon loop publishes stopped
    records and no batch work is admitted."""
    pool = dataclasses.replace(load_config(EXAMPLE).pools[0], name=SEED.pool)

    def loop(source: MetricsSource, store: Store, election: Election) -> PoolLoop:
        policy = build_pool_policy(pool)
        return PoolLoop(pool.name, ttl_ms=pool.budget_ttl_ms, source=source, policy=policy,
                        store=store, election=election, metrics=DaemonMetrics(),
                        query_age_s=lambda _pool, _now_s: 0.0, log=QUIET_LOG)

    trace, lengths = load_inputs(SEED)
    sim = Simulation(SEED, PolicySpec("pi", PRIORITY, batch=True, loop=loop),
                     duration_s=60.0, seed=0, trace=trace, rate_scale=RATE_SCALE,
                     lengths=lengths)
    sim.store.stop = "maintenance"
    result = sim.run()
    assert {entry["mode"] for entry in result.budget_timeline} == {"stopped"}
    assert result.batch["completed"] == 0 and sim.gate.inflight_seqs == 0
