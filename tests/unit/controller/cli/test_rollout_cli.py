"""`borrowd report`, `drill stop` and `rollout`: operator mistakes are one line and exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest
from borrowd.controller.cli import main
from borrowd.controller.cli.report import window_ends
from borrowd.models.errors import InputError

from tests.support.servers import free_port

DEAD = f"http://127.0.0.1:{free_port()}"


@pytest.mark.parametrize(("argv", "expected"), [
    (["report", "--pool", "chat", "--from", "yesterday", "--to", "2", "--out", "r.html"],
     "--from 'yesterday' is neither unix seconds nor ISO 8601"),
    (["report", "--pool", "chat", "--from", "10", "--to", "5", "--out", "r.html"],
     "--to must be after --from"),
    (["report", "--pool", "chat", "--from", "0", "--to", "600", "--out", "r.html",
      "--window-s", "0"], "--window-s must be > 0"),
    (["report", "--pool", "chat", "--from", "0", "--to", "600", "--out", "r.html",
      "--prometheus", DEAD], "failed"),
    (["report", "--pool", "bad pool", "--from", "0", "--to", "600", "--out", "r.html",
      "--prometheus", DEAD], "pool name 'bad pool'"),
    (["rollout", "--pool", "chat", "--steps", "4000,2000"], "rollout steps must increase"),
    (["rollout", "--pool", "chat", "--steps", "1000,x"], "--steps must be comma-separated"),
    (["rollout", "--pool", "chat", "--quantiles", "0.95,1.5"], "--quantiles must lie in"),
    (["rollout", "--pool", "chat", "--min-hold-s", "60", "--max-hold-s", "10"],
     "--max-hold-s must be >= --min-hold-s"),
    (["rollout", "--pool", "chat", "--growth", "1"], "step schedule needs"),
    (["drill", "stop", "--pool", "chat", "--window", "15"], "window '15'"),
    (["drill", "stop", "--pool", "chat", "--timeout-s", "-1"], "--timeout-s must be > 0"),
], ids=["bad-time", "reversed", "zero-window", "prometheus-down", "bad-pool", "steps-order",
        "steps-junk", "quantile", "holds", "growth", "drill-window", "drill-timeout"])
def test_operator_mistakes_are_one_line_exit_2(argv: list[str], expected: str, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Each mistake names itself on one line of stderr, exit code 2, no traceback."""
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert expected in err and len(err.strip().splitlines()) == 1, err


def test_window_ends_cover_complete_windows_only() -> None:
    """Windows end at start + k * window; a period shorter than one window is refused."""
    assert window_ends(100.0, 350.0, 60.0) == [160.0, 220.0, 280.0, 340.0]
    with pytest.raises(InputError, match="shorter than one window"):
        window_ends(100.0, 130.0, 60.0)
