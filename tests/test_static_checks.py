"""Static checks as tests: mypy over controller/, models/ and adapters/ (settings in
pyproject.toml's [tool.mypy]) and ruff over the whole tree, so the README's test command runs
them. Each skips with a reason when its tool is not installed (pip install -e '.[dev]')."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (pip install -e '.[dev]')")
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, check=False)


def test_mypy_is_clean() -> None:
    """mypy finds no type error in controller/, models/ or adapters/ (every `type: ignore`
    names its error code, and none is unused)."""
    result = _run("mypy")
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


def test_ruff_is_clean() -> None:
    """ruff finds nothing to report anywhere in the tree."""
    result = _run("ruff", "check", ".")
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
