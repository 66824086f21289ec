"""The systemd units under systemd/: valid for systemd-analyze, hardened, restarted, pointing
at the documented install (a virtualenv at /opt/borrowd), and able to read their config as
the dynamic user systemd runs them as."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from borrowd.controller.cli import build_parser

SYSTEMD = Path(__file__).resolve().parents[3] / "systemd"
UNITS = ("borrowd.service", "borrowd-proxy.service", "borrowd-gate.service")
INSTALLED_BINARY = "/opt/borrowd/bin/borrowd"  # README: "Install on a host (systemd)"
README = SYSTEMD.parent / "README.md"
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
    assert f"ExecStart={INSTALLED_BINARY} run --config %d/borrowd.toml" in lines


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
        expanded = expanded.replace("%d", "/run/credentials/borrowd.service")
        for key, value in re.findall(r"^Environment=(\w+)=(.*)$",
                                     (SYSTEMD / unit).read_text(), flags=re.M):
            expanded = expanded.replace(f"${{{key}}}", value)
        argv = shlex.split(expanded)
        assert argv[0] == INSTALLED_BINARY
        assert "${" not in expanded, f"{unit}: unset variable in {command!r}"
        build_parser().parse_args(argv[1:])


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading (lower case, punctuation dropped, - for
    spaces)."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


@pytest.mark.parametrize("unit", UNITS, ids=UNITS)
def test_documentation_points_at_a_readme_heading(unit: str) -> None:
    """Documentation= names an anchor of a README heading that exists."""
    anchors = {github_anchor(line.lstrip("#")) for line in README.read_text().splitlines()
               if line.startswith("#")}
    docs = [line.split("=", 1)[1] for line in directives(unit) if line.startswith("Documentation=")]
    assert docs, f"{unit} has no Documentation="
    for url in docs:
        assert url.partition("#")[2] in anchors, url


# Paths a unit's own sandboxing makes invisible or empty (systemd.exec(5)).
HIDDEN_BY = {"ProtectHome=yes": ("/home/", "/root/", "/run/user/"),
             "PrivateTmp=yes": ("/tmp/", "/var/tmp/")}


@pytest.mark.parametrize("unit", UNITS, ids=UNITS)
def test_installed_binary_is_visible_inside_the_sandbox(unit: str) -> None:
    """Every command runs the /opt virtualenv, which ProtectHome/PrivateTmp do not hide."""
    lines = directives(unit)
    hidden = [prefix for key, prefixes in HIDDEN_BY.items() if key in lines for prefix in prefixes]
    for line in lines:
        if line.startswith(("ExecStart=", "ExecStartPre=")):
            binary = shlex.split(line.split("=", 1)[1])[0]
            assert binary == INSTALLED_BINARY
            assert not binary.startswith(tuple(hidden)), (unit, binary, hidden)
            assert binary.startswith("/opt/")


def values(unit: str, key: str) -> list[str]:
    """The values of every `key=` line of `unit`."""
    return [line.split("=", 1)[1] for line in directives(unit) if line.startswith(f"{key}=")]


SERVICE_UID = 61999  # in systemd's DynamicUser range (61184-65519)


def lay_out_like_systemd(unit: str, root: Path) -> dict[str, Path]:
    """What systemd prepares before a DynamicUser unit's commands run (systemd.exec(5)), with
    `root/etc/borrowd` standing in for /etc/borrowd and files installed as the README says
    (root-owned, 0600): ConfigurationDirectory= root-owned with ConfigurationDirectoryMode=
    (0755 by default); each LoadCredential=ID:PATH copied to the credentials directory as ID,
    owned by the service user, mode 0400, the directory 0500. Returns the path map for the
    commands: "%d" and "/etc/borrowd"."""
    etc = root / "etc" / "borrowd"
    etc.mkdir(parents=True)
    for name, source in (("borrowd.toml", "examples/borrowd.toml"),
                         ("proxy.toml", "examples/proxy.toml"),
                         ("borrowd.env", "systemd/borrowd.env.example")):
        target = etc / name
        shutil.copyfile(SYSTEMD.parent / source, target)
        target.chmod(0o600)
    mode = int((values(unit, "ConfigurationDirectoryMode") or ["0755"])[0], 8)
    etc.chmod(mode)
    credentials = root / "run" / "credentials" / unit
    credentials.mkdir(parents=True)
    for spec in values(unit, "LoadCredential"):
        name, _, source = spec.partition(":")
        copy = credentials / name
        shutil.copyfile(etc / Path(source).relative_to("/etc/borrowd"), copy)
        os.chown(copy, SERVICE_UID, SERVICE_UID)
        copy.chmod(0o400)
    os.chown(credentials, SERVICE_UID, SERVICE_UID)
    credentials.chmod(0o500)
    return {"%d": credentials, "/etc/borrowd": etc}


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root and setpriv to act as systemd's dynamic user")
@pytest.mark.parametrize("unit", ["borrowd.service", "borrowd-proxy.service"])
def test_dynamic_user_can_read_its_config(unit: str) -> None:
    """Laid out as systemd does it, every config file a command names is readable by the
    service's dynamic user (not root), and holds what was installed."""
    root = Path(tempfile.mkdtemp(prefix="borrowd-systemd-"))
    try:
        root.chmod(0o755)
        paths = lay_out_like_systemd(unit, root)
        configs = []
        for line in directives(unit):
            if line.startswith(("ExecStart=", "ExecStartPre=")):
                argv = shlex.split(line.split("=", 1)[1])
                configs += [argv[i + 1] for i, arg in enumerate(argv[:-1])
                            if arg in ("--config", "check")]
        assert configs
        for config in configs:
            for placeholder, real in paths.items():
                config = config.replace(placeholder, str(real))
            read = subprocess.run(
                ["setpriv", f"--reuid={SERVICE_UID}", f"--regid={SERVICE_UID}",
                 "--clear-groups", "cat", config],
                capture_output=True, text=True, timeout=30, check=False)
            assert read.returncode == 0, f"{unit}: the service user cannot read {config}: " \
                                         f"{read.stderr.strip()}"
            shipped = "examples/" + Path(config).name
            assert read.stdout == (SYSTEMD.parent / shipped).read_text()
    finally:
        shutil.rmtree(root, ignore_errors=True)
