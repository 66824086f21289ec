"""Secrets never reach a log line or an error: URLs (well-formed or not), options, log events."""

from __future__ import annotations

import io
import json

import pytest
import structlog
from borrowd.adapters.redact import redact, redact_event, redact_url

SECRET = "hunter2"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("redis://u:hunter2@h:1/0", "redis://u:***@h:1/0"),
        ("redis://h:1/0?password=hunter2&db=1", "redis://h:1/0?password=***&db=1"),
        ("redis+sentinel://:hunter2@a:1,b:2/m/0?sentinel_password=hunter2",
         "redis+sentinel://:***@a:1,b:2/m/0?sentinel_password=***"),
        ("http://admin:hunter2@prom:9090", "http://admin:***@prom:9090"),
        ("bad value 'redis//u:hunter2@host' (must match ^redis://)",
         "bad value 'redis//u:***@host' (must match ^redis://)"),
        ("unix:///run/redis.sock?password=hunter2", "unix:///run/redis.sock?password=***"),
        ("api_key=hunter2 auth_token: hunter2", "api_key=*** auth_token: ***"),
        ("redis://h:1/0 max_tokens=100 batch_tokens_per_s=5.0",
         "redis://h:1/0 max_tokens=100 batch_tokens_per_s=5.0"),
    ],
    ids=["userinfo", "query-password", "sentinel-password", "prometheus-basic-auth",
         "malformed-url", "unix-socket", "options", "nothing-secret"],
)
def test_redact(text: str, expected: str) -> None:
    """Passwords, tokens and keys become ***; everything else, token counts included, stays."""
    assert redact(text) == expected
    assert redact_url(text) == expected


def test_structlog_events_are_redacted() -> None:
    """Every field of a structlog event, nested or secret-named, is redacted before rendering."""
    out = io.StringIO()
    structlog.configure(
        processors=[redact_event, structlog.processors.JSONRenderer()],
        logger_factory=structlog.PrintLoggerFactory(out),
    )
    try:
        structlog.get_logger().info(
            "daemon_started", redis="redis://h:6379/0?password=hunter2",
            prometheus="http://u:hunter2@prom:9090", upstream_api_key="hunter2",
            pools=[{"url": "redis://:hunter2@h/0"}], error=ValueError("password=hunter2"))
    finally:
        structlog.reset_defaults()
    line = out.getvalue()
    assert SECRET not in line
    assert json.loads(line)["upstream_api_key"] == "***"

