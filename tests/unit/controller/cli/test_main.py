"""`borrowd` itself: start-up failures and bad flags are one line, exit 2, with no secret."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
from borrowd.controller.cli import main

SECRET = "hunter2"


def _borrowd(*argv: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "borrowd.controller", *argv], capture_output=True,
                          text=True, timeout=timeout_s, check=False)


@pytest.fixture
def busy_port() -> int:
    """A loopback port something else is listening on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.parametrize(
    "argv",
    [["emulate", "--listen", "127.0.0.1:{port}"],
     ["gate", "--pool", "chat", "--listen", "127.0.0.1:{port}",
      "--redis", "redis://127.0.0.1:1/0"]],
    ids=["emulate", "gate"],
)
def test_busy_port_is_one_line_exit_2(busy_port: int, argv: list[str]) -> None:
    """A port in use is one stderr line naming the address, exit 2, no traceback."""
    result = _borrowd(*[a.format(port=busy_port) for a in argv])
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert errors == [
        f"borrowd: error: [Errno 98] error while attempting to bind on address "
        f"('127.0.0.1', {busy_port}): address already in use"], result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("argv", "expected"),
    [(["loadgen", "--proxy", "http://127.0.0.1:1", "--interactive-key", "i",
       "--batch-key", "b", "--burst", "40:65"],
      "borrowd loadgen: error: argument --burst: must be START:END:MULT, got '40:65' "
      "(see borrowd loadgen --help)\n"),
     (["stop", "--pool"], "borrowd stop: error: argument --pool: expected one argument "
                          "(see borrowd stop --help)\n")],
    ids=["malformed-burst", "missing-value"],
)
def test_bad_flag_is_one_line_exit_2(argv: list[str], expected: str,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A malformed flag value is one line naming the flag (not usage plus a traceback)."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == expected


def test_missing_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An OSError with a file name reads `PATH: reason`, on one line and no traceback (lines
    other threads of earlier tests may log meanwhile are not this command's)."""
    assert main(["tune", "--plant", str(tmp_path / "nope.json")]) == 2
    err = capsys.readouterr().err
    ours = [line for line in err.splitlines() if line.startswith("borrowd")]
    assert ours == [f"borrowd: error: cannot read plant model {tmp_path / 'nope.json'}: "
                    "No such file or directory"]
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "url",
    ["redis//borrowd:hunter2@redis.internal:6379/0",
     "rediss:/borrowd:hunter2@redis.internal:6379/0?password=hunter2",
     "ftp://u:hunter2@redis.internal/0"],
    ids=["no-scheme-separator", "one-slash-and-query", "wrong-scheme"],
)
def test_config_check_on_a_malformed_url_shows_no_secret(
    tmp_path: Path, url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`borrowd config check` names the bad URL with its password masked."""
    config = tmp_path / "borrowd.toml"
    config.write_text(f'[redis]\nurl = "{url}"\n[[pools]]\nname = "chat"\n')
    main(["config", "check", str(config)])
    captured = capsys.readouterr()
    assert SECRET not in captured.out + captured.err
    assert "***" in captured.out + captured.err


def test_daemon_metrics_port_busy_is_one_line(busy_port: int, tmp_path: Path) -> None:
    """`borrowd run` whose metrics port is taken names daemon.metrics_listen, exit 2."""
    config = tmp_path / "borrowd.toml"
    config.write_text(f'[daemon]\nmetrics_listen = "127.0.0.1:{busy_port}"\n'
                      '[redis]\nurl = "redis://127.0.0.1:1/0"\n'
                      '[prometheus]\nurl = "http://127.0.0.1:1"\n[[pools]]\nname = "chat"\n')
    result = _borrowd("run", "--config", str(config))
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines()[-1] == (
        f"borrowd: error: daemon.metrics_listen 127.0.0.1:{busy_port}: Address already in use")
    assert "Traceback" not in result.stderr


def test_proxy_port_busy_is_one_line(busy_port: int, tmp_path: Path) -> None:
    """`borrowd proxy` on a taken port: one line naming the address, exit 2."""
    config = tmp_path / "proxy.toml"
    config.write_text(f'[proxy]\nlisten_port = {busy_port}\npool = "chat"\n'
                      'upstreams = ["http://127.0.0.1:1"]\nredis_url = "redis://127.0.0.1:1/0"\n'
                      '[tenants.etl]\nkeys = ["k"]\nclass = "batch"\n')
    result = _borrowd("proxy", "--config", str(config))
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines()[-1] == (
        f"borrowd: error: [Errno 98] error while attempting to bind on address "
        f"('127.0.0.1', {busy_port}): address already in use")
