"""The systemd units under systemd/: valid for systemd-analyze, hardened, restarted."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from controller.cli import build_parser

SYSTEMD = Path(__file__).resolve().parents[3] / "systemd"
UNITS = ("borrowd.service", "borrowd-proxy.service", "borrowd-gate.service")
INSTALLED_BINARY = "/usr/local/bin/borrowd"
HARDENING = (
    "DynamicUser=yes",
    "NoNewPrivileges=yes",
    "CapabilityBoundingSet=",
    "ProtectSystem=strict",
    "ProtectHome=yes",
    "PrivateTmp=yes",
    "PrivateDevices=yes",
    "RestrictAddressFamilies=AF_INET AF_INET6 AF_UNIX",
    "SystemCallFilter=@system-service",
    "EnvironmentFile=/etc/borrowd/borrowd.env",
    "Restart=always",
)


def directives(unit: str) -> set[str]:
    """Every `Key=value` line of `unit`, stripped."""
    lines = (SYSTEMD / unit).read_text().splitlines()
    return {line.strip() for line in lines if "=" in line and not line.startswith("#")}


@pytest.mark.skipif(
    shutil.which("systemd-analyze") is None,
    reason="systemd-analyze absent (Debian package systemd)",
)
@pytest.mark.parametrize("unit", UNITS, ids=UNITS)
def test_unit_passes_systemd_analyze_verify(unit: str, tmp_path: Path) -> None:
    """`systemd-analyze verify` reports nothing (ExecStart pointed at this borrowd)."""
    borrowd = shutil.which("borrowd")
    assert borrowd, "the borrowd console script is not installed (pip install -e .)"
    text = (SYSTEMD / unit).read_text()
    assert INSTALLED_BINARY in text
    (tmp_path / unit).write_text(text.replace(INSTALLED_BINARY, borrowd))
    done = subprocess.run(
        ["systemd-analyze", "verify", str(tmp_path / unit)],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip() == "", done.stderr


@pytest.mark.parametrize("unit", UNITS, ids=UNITS)
def test_unit_is_hardened_and_restarts(unit: str) -> None:
    """Every unit runs as a dynamic user with the filesystem/privilege hardening set."""
    missing = [line for line in HARDENING if line not in directives(unit)]
    assert missing == []


def test_daemon_unit_uses_readiness_and_watchdog() -> None:
    """The daemon tells systemd it is ready and alive: Type=notify with a watchdog."""
    lines = directives("borrowd.service")
    assert "Type=notify" in lines
    assert any(line.startswith("WatchdogSec=") for line in lines)
    assert "ExecStart=/usr/local/bin/borrowd run --config /etc/borrowd/borrowd.toml" in lines


def _env_example() -> dict[str, str]:
    lines = (SYSTEMD / "borrowd.env.example").read_text().splitlines()
    pairs = (line.split("=", 1) for line in lines if "=" in line and not line.startswith("#"))
    return {key.strip(): value.strip() for key, value in pairs}


@pytest.mark.parametrize("unit", UNITS, ids=UNITS)
def test_exec_start_parses_with_the_cli(unit: str) -> None:
    """Each ExecStart, with the env example's values, is a valid borrowd command line."""
    env = _env_example()
    for line in directives(unit):
        if not line.startswith(("ExecStart=", "ExecStartPre=")):
            continue
        command = line.split("=", 1)[1]
        expanded = re.sub(r"\$\{(\w+)\}", lambda m: env.get(m.group(1), "") or "", command)
        for key, value in re.findall(r"^Environment=(\w+)=(.*)$",
                                     (SYSTEMD / unit).read_text(), flags=re.M):
            expanded = expanded.replace(f"${{{key}}}", value)
        argv = shlex.split(expanded)
        assert argv[0] == INSTALLED_BINARY
        assert "${" not in expanded, f"{unit}: unset variable in {command!r}"
        build_parser().parse_args(argv[1:])
