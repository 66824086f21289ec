"""One logging setup for every process: JSON lines on stderr, stdout left to results."""

from __future__ import annotations

import io
import json
import logging
import shutil
import subprocess
import time

import pytest
import structlog
from borrowd.adapters.redis_conn import connect
from borrowd.adapters.store import BudgetStore, PoolKeys
from borrowd.controller.cli.logs import configure_logging
from borrowd.models.budget import Budget, Mode

POOL = "p1"


@pytest.fixture
def restore_logging():
    """Put structlog and the root logger back as they were after the test."""
    config = structlog.get_config()
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    structlog.configure(**config)
    root.handlers[:] = handlers
    root.setLevel(level)


def test_structlog_and_stdlib_records_are_json_lines_with_secrets_redacted(
    restore_logging,
) -> None:
    """Both kinds of log line come out as one JSON object each, level-filtered, redacted."""
    stream = io.StringIO()
    configure_logging("info", stream)
    structlog.get_logger("t").warning("store_down", url="redis://u:hunter2@h:6379/0")
    logging.getLogger("borrowd.adapters.proxy.app").info("upstream %s refused", "http://x:pw@up:1")
    structlog.get_logger("t").debug("not_shown")
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [line["event"] for line in lines] == ["store_down", "upstream http://x:***@up:1 refused"]
    assert lines[0]["url"] == "redis://u:***@h:6379/0"
    assert {line["level"] for line in lines} == {"warning", "info"}
    assert all("timestamp" in line for line in lines)


def test_unknown_level_is_refused() -> None:
    """A level outside debug/info/warning/error is a ValueError naming it."""
    with pytest.raises(ValueError, match="loud"):
        configure_logging("loud", io.StringIO())


def test_status_json_prints_only_json_on_stdout_when_the_record_is_malformed(redis_url) -> None:
    """`borrowd status --json` on an unusable record: stdout is one JSON object, the
    warning goes to stderr as a JSON log line."""
    borrowd = shutil.which("borrowd")
    assert borrowd, "the borrowd console script is not installed (pip install -e .)"
    client = connect(redis_url)
    BudgetStore(client, POOL).publish(
        Budget(pool=POOL, mode=Mode.OPEN, reason="law", batch_tokens_per_s=100.0,
               batch_burst_tokens=1000, max_batch_seqs=4, max_batch_kv_tokens=1000,
               max_batch_output_tokens=100),
        epoch=1, ttl_ms=60_000, now_s=time.time())
    client.hset(PoolKeys(POOL).budget, "max_batch_seqs", "nan")
    client.close()
    done = subprocess.run([borrowd, "status", "--pool", POOL, "--redis", redis_url, "--json"],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    status = json.loads(done.stdout)
    assert status["read_status"] == "malformed"
    assert json.loads(done.stderr.splitlines()[0])["event"] == "budget_record_unusable"
