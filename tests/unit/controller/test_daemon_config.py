"""The daemon's config tree: TOML loading, environment overrides, errors naming the key."""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from pathlib import Path

import pytest
from borrowd.controller.config import (
    BorrowdConfig,
    PoolConfig,
    apply_env_overrides,
    config_from_mapping,
    example_config,
    load_config,
)
from borrowd.models.errors import ConfigError

REPO = Path(__file__).resolve().parents[3]
MINIMAL = {"pools": [{"name": "chat"}]}


def pool(**keys: object) -> dict:
    """A config with one pool `a` carrying `keys`."""
    return {"pools": [{"name": "a", **keys}]}


def test_minimal_config_takes_every_default() -> None:
    """One named pool is enough; everything else has a documented default."""
    config = config_from_mapping(MINIMAL)
    assert config.pools[0].name == "chat"
    assert config.pools[0].tick_s == config.pools[0].controller.tick_s
    assert config.redis.url.startswith("redis://")
    assert config.prometheus.window == "15s"


def test_nested_controller_tables_are_loaded() -> None:
    """Keys of the controller's own tree (law, supervisor, caps) reach its dataclasses."""
    data = {"pools": [{"name": "chat", "budget_ttl_ms": 9000, "controller": {
        "law": "slack", "tick_s": 2.0,
        "supervisor": {"quiet_s": 3.0, "required": ["ttft_p95_s"]},
        "caps": {"max_seqs": 8},
    }}]}
    pool = config_from_mapping(data).pools[0]
    assert pool.controller.law == "slack"
    assert pool.tick_s == 2.0
    assert pool.controller.supervisor.quiet_s == 3.0
    assert pool.controller.supervisor.required == ("ttft_p95_s",)
    assert pool.controller.caps.max_seqs == 8


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({}, "pools: at least one"),
        ({"pools": [{}]}, "pools[0].name: required key is missing"),
        ({"pools": [{"name": "chat pool"}]}, "pools[0].name: bad value 'chat pool'"),
        ({"pools": [{"name": "a"}, {"name": "a"}]}, "pool name 'a' appears more than once"),
        ({**MINIMAL, "redis": {"url": "http://x"}}, "redis.url: bad value 'http://x'"),
        ({**MINIMAL, "redis": {"timeout": 1}}, "redis.timeout: unknown key"),
        ({**MINIMAL, "prometheus": {"timeout_s": "x"}}, "prometheus.timeout_s: must be a number"),
        ({**MINIMAL, "prometheus": {"timeout_s": 0}}, "prometheus.timeout_s: 0.0 is below"),
        ({**MINIMAL, "prometheus": {"window": "15"}}, "prometheus.window: bad value '15'"),
        ({**MINIMAL, "daemon": {"log_level": "loud"}}, "daemon.log_level: bad value 'loud'"),
        ({**MINIMAL, "daemon": {"metrics_listen": "9105"}}, "daemon.metrics_listen: bad value"),
        ({**MINIMAL, "daemon": "x"}, "daemon: must be a table"),
        (pool(leader_lease_ms=1.5), "pools[0].leader_lease_ms: must be an integer"),
        (pool(budget_ttl_ms=1000), "pools[0].budget_ttl_ms = 1000: must cover"),
        (pool(controller={"law": "magic"}), "controller.law must be one of"),
        (pool(controller={"caps": {"max_seqs": 0}}), "caps.max_seqs must be >= 1"),
        (pool(controller={"pi": {"bogus": 1}}), "pools[0].controller.pi.bogus: unknown key"),
        (pool(controller={"predict": {"step_share_for_ttft": True}}),
         "pools[0].controller.predict.step_share_for_ttft: this key moved to "
         "burn.step_share_for_ttft"),
        (pool(controller={"enforcement": "plugin"}),
         "controller.enforcement must be one of ('admission', 'engine'), got 'plugin'"),
        (pool(controller={"pi": {"setpoint_itl_burn_engine": 1.5}}),
         "pi.setpoint_itl_burn_engine must be in (0, 1]"),
    ],
    ids=[
        "no-pools", "pool-without-name", "pool-name-space", "duplicate-pool", "redis-scheme",
        "unknown-key", "string-for-number", "below-min", "window-unit", "log-level",
        "listen-no-host", "section-not-table", "float-for-int", "ttl-shorter-than-two-ticks",
        "controller-own-check", "caps-own-check", "nested-unknown-key", "moved-key", "enforcement",
        "engine-setpoint",
    ],
)
def test_bad_config_names_the_key_and_value(data: dict, message: str) -> None:
    """Each bad value raises ConfigError whose text names the key (and the value)."""
    with pytest.raises(ConfigError) as caught:
        config_from_mapping(data)
    assert message in str(caught.value)


@pytest.mark.parametrize(
    ("env", "check"),
    [
        ({"BORROWD_REDIS_URL": "redis://:secret@db:6380/1"},
         lambda c: c.redis.url == "redis://:secret@db:6380/1"),
        ({"BORROWD_PROMETHEUS_TIMEOUT_S": "0.25"}, lambda c: c.prometheus.timeout_s == 0.25),
        ({"BORROWD_DAEMON_HOLDER_ID": "ctl-2"}, lambda c: c.daemon.holder_id == "ctl-2"),
        ({"BORROWD_TRACES_DIR": "/elsewhere"}, lambda c: c == config_from_mapping(MINIMAL)),
    ],
    ids=["redis-url", "number", "string", "unrelated-variable"],
)
def test_environment_overrides_section_keys(env: dict, check) -> None:
    """BORROWD_<SECTION>_<KEY> replaces that key; other BORROWD_ variables are ignored."""
    assert check(config_from_mapping(MINIMAL, env))


def test_bad_environment_value_names_the_variable() -> None:
    """An override that does not parse as the field's type names the variable."""
    with pytest.raises(ConfigError, match="BORROWD_PROMETHEUS_TIMEOUT_S"):
        apply_env_overrides(MINIMAL, {"BORROWD_PROMETHEUS_TIMEOUT_S": "soon"})


def test_environment_wins_over_file(tmp_path: Path) -> None:
    """A value from the environment replaces the file's value."""
    path = tmp_path / "borrowd.toml"
    path.write_text('[redis]\nurl = "redis://file:6379/0"\n[[pools]]\nname = "chat"\n')
    config = load_config(path, {"BORROWD_REDIS_URL": "redis://env:6379/0"})
    assert config.redis.url == "redis://env:6379/0"


@pytest.mark.parametrize(
    ("text", "message"),
    [(None, "does not exist"), ("[[pools]\n", "is not valid TOML")],
    ids=["missing-file", "bad-toml"],
)
def test_unreadable_file_is_a_config_error(tmp_path: Path, text: str | None, message: str) -> None:
    """A missing file or broken TOML raises ConfigError naming the file."""
    path = tmp_path / "borrowd.toml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(path, {})


def _key_paths(table: dict, prefix: str = "") -> set[str]:
    paths = set()
    for key, value in table.items():
        tables = isinstance(value, list) and value and isinstance(value[0], dict)
        items = value if tables else [value]
        for item in items:
            if isinstance(item, dict):
                paths |= _key_paths(item, f"{prefix}{key}.")
            else:
                paths.add(f"{prefix}{key}")
    return paths


def test_example_is_valid_and_the_shipped_file_has_every_key() -> None:
    """`borrowd config example` loads to the defaults; examples/borrowd.toml loads and sets
    every key the example has (regenerate it with `borrowd config example`)."""
    generated = tomllib.loads(example_config())
    assert config_from_mapping(generated) == config_from_mapping(MINIMAL)
    shipped = tomllib.loads((REPO / "examples" / "borrowd.toml").read_text())
    config_from_mapping(shipped)
    assert _key_paths(shipped) == _key_paths(generated)


def _all_fields(cls: type, path: str = ""):
    hints = typing.get_type_hints(cls)
    for item in dataclasses.fields(cls):
        yield f"{path}{item.name}", item
        if dataclasses.is_dataclass(hints[item.name]):
            yield from _all_fields(hints[item.name], f"{path}{item.name}.")


@pytest.mark.parametrize("cls", [BorrowdConfig, PoolConfig], ids=["root", "pool"])
def test_every_field_is_documented(cls: type) -> None:
    """Every field of the tree carries a unit and a help text, shown in the example."""
    text = example_config()
    for path, item in _all_fields(cls):
        assert item.metadata.get("unit") and item.metadata.get("help"), path
        assert item.metadata["help"] in text or _capitalised(item.metadata["help"]) in text, path


def _capitalised(text: str) -> str:
    return text[0].upper() + text[1:]


@pytest.mark.parametrize(
    ("slos", "burn"),
    [({}, True), ({"slo_itl_p95_s": 0.0076, "slo_ttft_p95_s": 0.12}, True),
     ({"slo_itl_p95_s": 0.0076, "control_on_burn": False}, False)],
    ids=["default-slos", "other-slos-keep-burn", "burn-off-as-configured"],
)
def test_burn_control_is_as_configured_at_any_slo(slos: dict, burn: bool) -> None:
    """The source reads the burn at each pool's own SLOs, so burn control stays as the
    config says whatever the SLOs (a missing bound falls back to p95 at run time)."""
    from borrowd.controller.pools import build_policies

    config = config_from_mapping(pool(controller=slos))
    assert build_policies(config)["a"].config.control_on_burn is burn
