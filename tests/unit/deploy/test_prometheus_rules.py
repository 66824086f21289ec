"""The shipped Prometheus recording rules and example config, checked by promtool."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from borrowd.controller.config import RULE_WINDOWS, config_from_mapping
from borrowd.controller.prom_source import pool_queries
from borrowd.models.errors import ConfigError

DEPLOY = Path(__file__).resolve().parents[3] / "deploy" / "prometheus"

needs_promtool = pytest.mark.skipif(
    shutil.which("promtool") is None, reason="promtool absent (Debian package prometheus)"
)


@needs_promtool
def test_rules_pass_their_unit_tests() -> None:
    """`promtool test rules` passes on borrowd.rules.test.yml (values of every recorded series)."""
    done = subprocess.run(
        ["promtool", "test", "rules", "borrowd.rules.test.yml"],
        cwd=DEPLOY, capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr


@needs_promtool
def test_rules_file_is_valid() -> None:
    """`promtool check rules` accepts the rules file."""
    done = subprocess.run(
        ["promtool", "check", "rules", str(DEPLOY / "borrowd.rules.yml")],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr


@needs_promtool
def test_example_config_is_valid(tmp_path: Path) -> None:
    """`promtool check config` accepts prometheus.example.yml as shipped, with the rule file
    beside it (the example names it relative to itself)."""
    shutil.copyfile(DEPLOY / "borrowd.rules.yml", tmp_path / "borrowd.rules.yml")
    config = tmp_path / "prometheus.yml"
    shutil.copyfile(DEPLOY / "prometheus.example.yml", config)
    done = subprocess.run(
        ["promtool", "check", "config", str(config)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_query_reads_a_recorded_series() -> None:
    """Each recorded series the daemon queries is defined in the rules file, for both windows."""
    text = (DEPLOY / "borrowd.rules.yml").read_text()
    for window in RULE_WINDOWS:
        for query in pool_queries("chat", window):
            name = query.expr.split("{", 1)[0]
            assert f"record: {name}\n" in text, name


@pytest.mark.parametrize("window", ["30s", "5m", "15m"])
def test_a_window_without_rules_is_refused_naming_them(window: str) -> None:
    """`prometheus.window` other than the rules' windows fails `config check`, naming the rule
    file and a rule, instead of leaving the daemon in failsafe on empty queries."""
    with pytest.raises(ConfigError, match=r"prometheus\.window: bad value .*borrowd\.rules\.yml "
                                          r"records only the windows 15s and 1m: no rule "
                                          r"pool_class:borrowd_proxy_ttft_seconds:p95_rate"):
        config_from_mapping({"prometheus": {"window": window}, "pools": [{"name": "chat"}]})
