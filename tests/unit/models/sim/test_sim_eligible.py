"""Batch restricted to some replicas in the simulator: the scenario key, the router, engine
enforcement only on eligible replicas, and the replicas without batch left as they were."""

from __future__ import annotations

from pathlib import Path

import pytest
from borrowd.models.enforcement import ENGINE
from borrowd.models.errors import InputError
from borrowd.models.sim.bench import format_group_table, meets_every_window
from borrowd.models.sim.cores import make_engine
from borrowd.models.sim.engine import EngineConfig
from borrowd.models.sim.fleet import Fleet
from borrowd.models.sim.policies import parse_policy
from borrowd.models.sim.profiles import H100_LLAMA3_8B
from borrowd.models.sim.request import BATCH, INTERACTIVE, Request
from borrowd.models.sim.run import load_inputs, run_scenario
from borrowd.models.sim.scenario import (
    LEAST_TOKENS,
    ROUND_ROBIN,
    SEED,
    get_scenario,
    load_scenario_file,
)
from borrowd.models.sim.simulation import Simulation, signal_ends

DURATION_S = 240.0


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("[0, 4]", r"must name distinct replicas below replicas \(4\), got \[0, 4\]"),
        ("[1, 1]", r"batch.replicas must name distinct replicas below replicas \(4\)"),
        ("[]", r"batch.replicas must be a non-empty list of replica indices"),
        ("2", r"batch.replicas must be a non-empty list of replica indices"),
        ('["a"]', r"batch.replicas must be a non-empty list of replica indices"),
    ],
    ids=["out-of-range", "duplicate", "empty", "not-a-list", "not-integers"],
)
def test_bad_batch_replicas_name_the_key(tmp_path: Path, value: str, message: str) -> None:
    """A bad `batch.replicas` is one InputError naming the key and the value."""
    path = tmp_path / "s.toml"
    path.write_text(f"[batch]\nreplicas = {value}\n")
    with pytest.raises(InputError, match=message):
        load_scenario_file(path)


def test_shipped_scenario_restricts_batch_to_two_of_four() -> None:
    """`seed-eligible` is seed with batch on replicas 0 and 1 (and round-robin routing)."""
    sc = get_scenario("seed-eligible")
    assert sc.batch_replicas() == (0, 1) and sc.batch_restricted()
    assert sc.router == ROUND_ROBIN and sc.replicas == SEED.replicas
    assert SEED.batch_replicas() == (0, 1, 2, 3) and not SEED.batch_restricted()


def _fleet(router: str, eligible: tuple[int, ...]) -> Fleet:
    config = EngineConfig.for_profile(H100_LLAMA3_8B)
    return Fleet([make_engine("native", config, H100_LLAMA3_8B) for _ in range(4)], router,
                 eligible)


@pytest.mark.parametrize("router", [ROUND_ROBIN, LEAST_TOKENS])
def test_batch_goes_only_to_eligible_replicas(router: str) -> None:
    """Batch requests land on eligible replicas that are up, interactive on any."""
    fleet = _fleet(router, (1, 2))
    fleet.up[2] = False
    batch = [fleet.route(Request(f"b{i}", BATCH, 1000, 100, 0.0)) for i in range(20)]
    inter = {fleet.route(Request(f"i{i}", INTERACTIVE, 100, 10, 0.0)) for i in range(20)}
    assert set(batch) == {1}
    assert inter == {0, 1, 3}
    assert fleet.batch_up() == 1


@pytest.mark.parametrize("router", [ROUND_ROBIN, LEAST_TOKENS])
def test_interactive_routing_ignores_batch_when_restricted(router: str) -> None:
    """With batch restricted, interleaving batch requests does not move any interactive one."""
    def interactive_replicas(with_batch: bool) -> list[int]:
        fleet = _fleet(router, (0, 1))
        out = []
        for i in range(40):
            if with_batch:
                fleet.route(Request(f"b{i}", BATCH, 20_000, 1000, 0.0))
            out.append(fleet.route(Request(f"i{i}", INTERACTIVE, 100 + 37 * i % 500, 50, 0.0)))
        return out

    assert interactive_replicas(True) == interactive_replicas(False)


def test_unrestricted_fleet_routes_as_before() -> None:
    """With every replica eligible, least-tokens counts batch tokens as it always did."""
    fleet = _fleet(LEAST_TOKENS, ())
    assert fleet.route(Request("b", BATCH, 20_000, 1000, 0.0)) == 0
    assert fleet.route(Request("i", INTERACTIVE, 100, 10, 0.0)) == 1


def _run(policy: str, enforcement: str | None = None) -> Simulation:
    sc = get_scenario("seed-eligible")
    if enforcement is not None:
        sc = sc.with_overrides(enforcement=enforcement)
    trace, lengths = load_inputs(sc)
    sim = Simulation(sc, parse_policy(policy, sc), duration_s=DURATION_S, seed=0, trace=trace,
                     rate_scale=0.31, lengths=lengths)
    return sim


@pytest.mark.parametrize("enforcement", ["admission", ENGINE])
def test_batch_runs_only_on_eligible_replicas(enforcement: str) -> None:
    """No batch token is ever computed on replicas 2 and 3; under engine enforcement their
    plugins allow no batch token per step while the eligible ones allow some."""
    sim = _run("static:30000", enforcement)
    seen: set[int] = set()
    route = sim.fleet.route

    def spy(req: Request) -> int:
        r = route(req)
        if req.klass == BATCH:
            seen.add(r)
        return r

    sim.fleet.route = spy  # type: ignore[method-assign]
    res = sim.run()
    assert seen == {0, 1}
    assert res.batch["computed_tokens_per_s"] > 10_000
    if enforcement == ENGINE:
        allowances = [e.batch_step_allowance() for e in sim.fleet.engines]  # type: ignore[attr-defined]
        assert allowances[2] == 0 and allowances[3] == 0
        assert allowances[0] > 0 and allowances[1] > 0


def test_replicas_without_batch_see_what_they_see_without_borrowing() -> None:
    """Interactive figures of replicas 2 and 3 under borrowing equal those with no batch at
    all (same requests, same routing), while the batch replicas' figures move."""
    none = _run("none").run().summary()
    borrowing = _run("static:40000").run().summary()
    groups_none = {g["group"]: g for g in none["replica_groups"]}  # type: ignore[union-attr]
    groups_b = {g["group"]: g for g in borrowing["replica_groups"]}  # type: ignore[union-attr]
    assert groups_b["other"] == groups_none["other"]
    assert groups_b["other"]["requests"] > 100
    assert groups_b["batch"]["ttft_p95_s"] > groups_none["batch"]["ttft_p95_s"]
    table = format_group_table([none, borrowing])
    assert table is not None and "| static:40000 | other (2,3) |" in table


def test_unrestricted_runs_report_no_groups() -> None:
    """Seed's summary keeps its keys: no replica groups when every replica takes batch."""
    summary = run_scenario(SEED, "none", duration_s=60.0, rate_scale=0.31).summary()
    assert "replica_groups" not in summary
    assert format_group_table([summary]) is None


def test_the_policy_observes_the_batch_replicas_latency() -> None:
    """With batch restricted, the observation's latency, burn and sample counts are those of
    the batch-eligible replicas (as the daemon's rules read the proxy's batch_eligible
    histograms); success stays fleet-wide."""
    sim = _run("static:40000")
    sim.run()
    assert sim.group_recs is not None
    window = sim.scenario.observe_window_s
    _, end, burn_end = signal_ends(DURATION_S - 1.0, sim.scenario.scrape_interval_s,
                                   sim.scenario.evaluation_interval_s)
    obs = sim.observe(sim.scenario.pool, DURATION_S - 1.0)
    group = sim.group_recs[0].interactive_figures(end - window, end)
    fleet = sim.rec.interactive_figures(end - window, end)
    assert obs.itl_p95_s == group["itl_p95_s"] != fleet["itl_p95_s"]
    itl_n, ttft_n, _ = sim.group_recs[0].slo_samples(burn_end - window, burn_end,
                                                     sim.scenario.slo)
    assert (obs.itl_samples, obs.ttft_samples) == (itl_n, ttft_n)
    assert obs.success_rate == fleet["success_rate"]


def test_the_sweep_holds_static_caps_to_the_batch_replicas_windows() -> None:
    """A run whose fleet-wide windows pass but whose batch replicas miss one does not count
    as meeting every window."""
    passing = {"interactive": {"slo_windows_met_frac": 1.0}}
    assert meets_every_window(passing)
    groups = [{"group": "batch", "slo_windows_met_frac": 0.9},
              {"group": "other", "slo_windows_met_frac": 1.0}]
    assert not meets_every_window({**passing, "replica_groups": groups})
    groups[0]["slo_windows_met_frac"] = 1.0
    assert meets_every_window({**passing, "replica_groups": groups})
