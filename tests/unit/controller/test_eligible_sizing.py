"""A pool whose batch may use only some of its replicas: the config keys, their one-line
errors, and the controller's limits sized to the eligible replicas (daemon and simulator)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from borrowd.controller.cli import main
from borrowd.controller.closed_loop import SimControllers, default_sim_pool
from borrowd.controller.config import PoolConfig, config_from_mapping
from borrowd.controller.pools import build_pool_policy, pool_controller
from borrowd.models.config_loader import PER_POOL, meta
from borrowd.models.errors import ConfigError
from borrowd.models.sim.scenario import SEED, get_scenario


def test_limits_scale_with_the_eligible_share() -> None:
    """Two of four replicas: u_max (the law's upper limit), the ramp cap, the PI's gains and
    the sequence and KV caps are halved; the law is built with the halved u_max."""
    full = config_from_mapping({"pools": [{"name": "chat"}]}).pools[0]
    half = config_from_mapping(
        {"pools": [{"name": "chat", "replicas": 4, "batch_replicas": 2}]}
    ).pools[0]
    a, b = pool_controller(full), pool_controller(half)
    assert b.u_max_tokens_per_s == a.u_max_tokens_per_s / 2
    assert b.supervisor.ramp_cap_tokens_per_s == a.supervisor.ramp_cap_tokens_per_s / 2
    assert b.pi.ki_tokens_per_s2 == a.pi.ki_tokens_per_s2 / 2
    assert b.caps.max_seqs == a.caps.max_seqs // 2
    assert b.caps.max_kv_frac == a.caps.max_kv_frac / 2
    assert build_pool_policy(half).config.u_max_tokens_per_s == b.u_max_tokens_per_s


SCALED_RATES = (
    "u_max_tokens_per_s",
    "pi.kp_tokens_per_s",
    "pi.ki_tokens_per_s2",
    "pi.gain_reference_tokens_per_s",
    "mpc.up_rate_tokens_per_s2",
    "mpc.down_rate_tokens_per_s2",
    "slack.grow_step_tokens_per_s",
    "supervisor.ramp_cap_tokens_per_s",
    "supervisor.floor_tokens_per_s",
)


def _value(config: object, dotted: str) -> float:
    for name in dotted.split("."):
        config = getattr(config, name)
    assert isinstance(config, float)
    return config


def test_every_pool_wide_rate_is_scaled() -> None:
    """Each pool-wide rate, in the controller and in each law's and the supervisor's
    settings, is halved on two of four replicas (a nonzero value of each, so a field the
    sizing skipped shows); the marks are exactly these fields."""
    rates = {name: 1000.0 + i for i, name in enumerate(SCALED_RATES)}
    tables: dict[str, dict[str, float]] = {}
    for dotted, value in rates.items():
        *table, key = dotted.split(".")
        tables.setdefault(table[0] if table else "", {})[key] = value
    controller: dict[str, object] = dict(tables.pop(""))
    controller.update(tables)
    full = config_from_mapping({"pools": [{"name": "chat", "controller": controller}]})
    half = config_from_mapping({"pools": [{"name": "chat", "replicas": 4, "batch_replicas": 2,
                                           "controller": controller}]})
    a, b = pool_controller(full.pools[0]), pool_controller(half.pools[0])
    for dotted in SCALED_RATES:
        assert _value(b, dotted) == _value(a, dotted) / 2, dotted
    marked = {f.name for f in dataclasses.fields(a) if f.metadata.get(PER_POOL)}
    for item in dataclasses.fields(a):
        value = getattr(a, item.name)
        if dataclasses.is_dataclass(value):
            marked |= {f"{item.name}.{f.name}" for f in dataclasses.fields(value)
                       if f.metadata.get(PER_POOL)}
    assert marked == set(SCALED_RATES)


def test_a_misspelt_field_mark_is_refused() -> None:
    """A mark `meta` does not know (a misspelt `per_pool`) fails where it is written."""
    with pytest.raises(TypeError, match="per_pol"):
        meta("tokens/s", "a rate", per_pol=True)


@pytest.mark.parametrize(
    ("keys", "ok"),
    [({}, True), ({"replicas": 4}, True), ({"replicas": 4, "batch_replicas": 4}, True)],
    ids=["unset", "replicas-only", "all-eligible"],
)
def test_unrestricted_pools_keep_their_limits(keys: dict, ok: bool) -> None:
    """Without a batch subset the limits stand as written."""
    pool = config_from_mapping({"pools": [{"name": "chat", **keys}]}).pools[0]
    full = config_from_mapping({"pools": [{"name": "chat"}]}).pools[0]
    assert (pool_controller(pool) == pool_controller(full)) is ok


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"batch_replicas": 2}, r"pools\[0\].batch_replicas = 2: needs pools\[0\].replicas"),
        ({"replicas": 2, "batch_replicas": 3}, r"pools\[0\].batch_replicas = 3: more than the "
                                               r"pool's replicas \(2\)"),
        ({"replicas": -1}, r"pools\[0\].replicas"),
        ({"batch_replicas": "two"}, r"pools\[0\].batch_replicas"),
    ],
    ids=["no-replicas", "more-than-replicas", "negative", "not-a-number"],
)
def test_bad_keys_name_the_key(keys: dict, message: str) -> None:
    """Each bad value is one ConfigError naming the key."""
    with pytest.raises(ConfigError, match=message):
        config_from_mapping({"pools": [{"name": "chat", **keys}]})


def test_bad_key_is_exit_code_2_without_traceback(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """`borrowd config check` on a bad subset: exit code 2 and one line naming the key."""
    path = tmp_path / "borrowd.toml"
    path.write_text('[[pools]]\nname = "chat"\nreplicas = 2\nbatch_replicas = 3\n')
    assert main(["config", "check", str(path)]) == 2
    err = capsys.readouterr().err
    assert "pools[0].batch_replicas = 3" in err and "Traceback" not in err


def test_simulated_pool_takes_the_scenario_subset() -> None:
    """On `seed-eligible` (batch on 2 of 4) the simulated pool is sized to the two, with or
    without a daemon config; on `seed` it is left as written."""
    restricted = get_scenario("seed-eligible")
    pool = default_sim_pool("pi", restricted)
    assert (pool.replicas, pool.batch_replicas) == (4, 2)
    config = config_from_mapping({"pools": [{"name": "chat"}]})
    from_file = SimControllers(config).pool_config("pi", restricted)
    assert (from_file.replicas, from_file.batch_replicas) == (4, 2)
    assert default_sim_pool("pi", SEED).batch_replicas == 0


def test_limits_scale_with_the_pool_size() -> None:
    """The pool-wide rates (u_max, the ramp cap, the floor, the law's gains and rate limits) and
    the sequence cap are written for `limits_replicas` (4): a pool of 8 gets twice them, one
    of 2 half, one of 4 or of unknown size (0) them as written; the KV cap is a share of the
    capacity measured and stays. `limits_replicas = 0` turns it off."""
    def pool(**keys: object) -> PoolConfig:
        return config_from_mapping({"pools": [{"name": "chat", **keys}]}).pools[0]

    written = pool_controller(pool())
    assert pool_controller(pool(replicas=4)) == written
    eight = pool_controller(pool(replicas=8))
    assert eight.u_max_tokens_per_s == 2 * written.u_max_tokens_per_s
    assert eight.supervisor.ramp_cap_tokens_per_s == 2 * written.supervisor.ramp_cap_tokens_per_s
    assert eight.caps.max_seqs == 2 * written.caps.max_seqs
    assert eight.caps.max_kv_frac == written.caps.max_kv_frac
    # Every pool-wide rate, not only the limits: the law's gains act at twice the rate on
    # twice the replicas. The ramp's start (a probe) stays as written.
    assert (eight.supervisor.ramp_min_tokens_per_s, eight.supervisor.ramp_slew_tokens_per_s2
            ) == (written.supervisor.ramp_min_tokens_per_s,
                  written.supervisor.ramp_slew_tokens_per_s2)
    for get in (lambda c: c.pi.kp_tokens_per_s, lambda c: c.pi.ki_tokens_per_s2,
                lambda c: c.pi.gain_reference_tokens_per_s,
                lambda c: c.mpc.up_rate_tokens_per_s2, lambda c: c.mpc.down_rate_tokens_per_s2,
                lambda c: c.slack.grow_step_tokens_per_s):
        assert get(eight) == 2 * get(written)
    floored = pool_controller(pool(replicas=8, controller={"supervisor": {
        "floor_tokens_per_s": 1000.0}}))
    assert floored.supervisor.floor_tokens_per_s == 2000.0
    # Ratios stay: the PI's per-unit-error climb relative to the budget is the same.
    assert (eight.pi.ki_tokens_per_s2 / eight.pi.gain_reference_tokens_per_s
            == written.pi.ki_tokens_per_s2 / written.pi.gain_reference_tokens_per_s)
    two = pool_controller(pool(replicas=2))
    assert two.u_max_tokens_per_s == written.u_max_tokens_per_s / 2
    assert two.caps.max_seqs == written.caps.max_seqs // 2
    off = pool_controller(pool(replicas=8, controller={"limits_replicas": 0}))
    assert off.u_max_tokens_per_s == written.u_max_tokens_per_s
    # Both sizings compose: 8 replicas, batch on 2 of them.
    sub = pool_controller(pool(replicas=8, batch_replicas=2))
    assert sub.u_max_tokens_per_s == written.u_max_tokens_per_s / 2


def test_limits_replicas_must_not_be_negative() -> None:
    """A negative `controller.limits_replicas` is one ConfigError naming the key."""
    with pytest.raises(ConfigError, match=r"limits_replicas"):
        config_from_mapping({"pools": [{"name": "chat", "controller": {"limits_replicas": -1}}]})


def test_simulated_pool_takes_the_fleet_size() -> None:
    """The simulator sizes a pool to its scenario's fleet, as an operator's `replicas` does:
    `seed` (4 replicas) runs the limits as written, a fleet of 8 twice them."""
    assert default_sim_pool("pi", SEED).replicas == 4
    assert pool_controller(default_sim_pool("pi", SEED)) == pool_controller(
        config_from_mapping({"pools": [{"name": SEED.pool}]}).pools[0])
    eight = default_sim_pool("pi", dataclasses.replace(SEED, replicas=8))
    assert pool_controller(eight).caps.max_seqs == 2 * pool_controller(
        default_sim_pool("pi", SEED)).caps.max_seqs
