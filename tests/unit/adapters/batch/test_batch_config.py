"""The batch TOML: the example parses; every bad key is named."""

from __future__ import annotations

from pathlib import Path

import pytest
from borrowd.adapters.batch.config import load_batch_config, parse_batch_config
from borrowd.models.errors import ConfigError

EXAMPLE = Path(__file__).resolve().parents[4] / "examples" / "batch.toml"
TENANTS = {"etl": {"keys": ["k"], "weight": 2}}


def test_example_config_parses() -> None:
    """examples/batch.toml is a valid config with two weighted tenants."""
    config = load_batch_config(EXAMPLE)
    assert config.tenants["summaries"].weight == 2.0
    assert config.tenant_of_key("sk-evals").name == "evals"
    assert config.tenant_of_key("nobody") is None


@pytest.mark.parametrize(
    ("data", "named"),
    [
        ({"batch": {"listen_prot": 1}, "tenants": TENANTS}, "batch.listen_prot"),
        ({"worker": {"concurrency": "many"}, "tenants": TENANTS}, "worker.concurrency"),
        ({"worker": {"concurrency": 0}, "tenants": TENANTS}, "concurrency"),
        ({"tenants": {"etl": {"keys": ["k"], "weight": 0}}}, "tenants.etl.weight"),
        ({"tenants": {"a": {"keys": ["k"]}, "b": {"keys": ["k"]}}}, "tenants.b.keys"),
        ({}, "tenants"),
        ({"queue": {}, "tenants": TENANTS}, "queue"),
    ],
    ids=["unknown-key", "wrong-type", "not-positive", "weight", "shared-key", "no-tenants",
         "unknown-table"],
)
def test_bad_config_names_the_key(data: dict, named: str) -> None:
    """A bad value or unknown key gives a ConfigError naming it."""
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        parse_batch_config(data)
