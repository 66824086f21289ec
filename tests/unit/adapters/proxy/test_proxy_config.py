"""Proxy config loading: valid files parse; every bad key is named in the error."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from borrowd.adapters.proxy.config import (
    AdmissionMode,
    RequestClass,
    describe_fields,
    load_config,
    parse_config,
)
from borrowd.models.errors import ConfigError

EXAMPLE = Path(__file__).resolve().parents[4] / "examples" / "proxy.toml"


def _base() -> dict:
    return {
        "proxy": {"upstreams": ["http://127.0.0.1:8100"]},
        "tenants": {"chat": {"keys": ["k1"], "class": "interactive"},
                    "etl": {"keys": ["k2", "k3"], "class": "batch"}},
    }


def test_example_config_loads() -> None:
    """The shipped example config is valid."""
    config = load_config(EXAMPLE)
    assert config.upstreams
    assert config.tenants_by_key


def test_minimal_config_maps_keys_to_tenants() -> None:
    """Each key maps to its tenant's class; defaults fill the rest."""
    config = parse_config(_base())
    assert config.tenants_by_key["k1"].request_class is RequestClass.INTERACTIVE
    assert config.tenants_by_key["k3"].request_class is RequestClass.BATCH
    assert config.admission.mode is AdmissionMode.REJECT
    assert config.batch_priority > config.interactive_priority


def _with(section: str, key: str, value) -> dict:
    data = _base()
    data.setdefault(section, {})[key] = value
    return data


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        (_with("proxy", "listen_port", "80"), "proxy.listen_port"),
        (_with("proxy", "listen_port", 70000), "proxy.listen_port"),
        (_with("proxy", "upstreams", []), "proxy.upstreams"),
        (_with("proxy", "upstreams", ["ftp://x"]), "proxy.upstreams"),
        (_with("proxy", "max_body_bytes", 0), "proxy.max_body_bytes"),
        (_with("proxy", "pool", "a{b}"), "proxy.pool"),
        (_with("proxy", "inject_priority", "yes"), "proxy.inject_priority"),
        (_with("proxy", "bogus", 1), "proxy.bogus: unknown key"),
        (_with("admission", "mode", "drop"), "admission.mode"),
        (_with("admission", "queue_max_wait_s", -1), "admission.queue_max_wait_s"),
        (_with("tenants", "x", {"keys": ["k9"], "class": "vip"}), "tenants.x.class"),
        (_with("tenants", "x", {"keys": [], "class": "batch"}), "tenants.x.keys"),
        (_with("tenants", "x", {"keys": ["k1"], "class": "batch"}), "tenants.x.keys"),
        ({"proxy": {"upstreams": ["http://h:1"]}}, "tenants"),
        ({**_base(), "extra": {}}, "extra: unknown key"),
        (_with("proxy", "batch_priority", -1), "proxy.batch_priority: -1 must be above"),
        (_with("admission", "gate_timeout_s", float("nan")), "admission.gate_timeout_s: must be"),
        (_with("admission", "queue_max_wait_s", float("inf")), "admission.queue_max_wait_s"),
        (_with("proxy", "upstream_read_timeout_s", 0.0), "proxy.upstream_read_timeout_s: 0.0"),
        (_with("proxy", "batch_upstreams", ["http://127.0.0.1:9"]),
         "proxy.batch_upstreams[0]: 'http://127.0.0.1:9' is not one of proxy.upstreams"),
        (_with("proxy", "batch_upstreams", ["http://127.0.0.1:8100", "http://127.0.0.1:8100/"]),
         "proxy.batch_upstreams: names an upstream more than once"),
        (_with("proxy", "batch_upstreams", "http://127.0.0.1:8100"), "proxy.batch_upstreams"),
    ],
    ids=["port-string", "port-range", "no-upstreams", "bad-scheme", "zero-body", "braces",
         "bool-string", "unknown-proxy-key", "bad-mode", "negative-wait", "bad-class",
         "empty-keys", "duplicate-key", "no-tenants", "unknown-table", "batch-ahead-of-interactive",
         "nan-gate-timeout", "inf-wait", "zero-read-timeout", "unknown-batch-upstream",
         "duplicate-batch-upstream", "batch-upstreams-not-a-list"],
)
def test_bad_config_names_the_key(data: dict, needle: str) -> None:
    """A bad value raises ConfigError naming its key."""
    with pytest.raises(ConfigError, match=re.escape(needle)):
        parse_config(data)


def test_missing_and_malformed_files_are_named(tmp_path: Path) -> None:
    """A missing file or broken TOML names the file."""
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("[proxy\n")
    with pytest.raises(ConfigError, match=r"broken\.toml"):
        load_config(broken)


def test_every_field_has_help() -> None:
    """Every config key carries a help text (docs and --help come from it)."""
    assert all(text for _key, text in describe_fields())
