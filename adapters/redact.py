"""Secrets out of everything borrowd prints: URLs, error messages and log events.

One helper for every output path: `redact` hides the password of any `user:password@`
userinfo and the value of any secret-named query or `key=value` option (`password`,
`sentinel_password`, `token`, `secret`, `api_key`...), in well-formed and malformed text
alike. The CLI's error line and every log line go through it (`redact_event`, a structlog
processor that `controller.cli.logs` runs on structlog events and stdlib records alike).
"""

from __future__ import annotations

import re
from collections.abc import MutableMapping
from typing import Any

MASK = "***"

# `user:password@host` in a URL or a malformed one (`redis//u:pw@h`): keep the user.
_USERINFO = re.compile(r"(?P<user>[^\s/:@'\"]*):(?P<secret>[^\s/@'\"]+)@")
# `password=...` as a query option, a `key=value` pair or a header-like `token: ...`.
_SECRET_NAME = r"[A-Za-z0-9_\-]*(?:password|passwd|secret|token|api_key|apikey|access_key)\b"
_SECRET_OPTION = re.compile(
    rf"(?P<key>{_SECRET_NAME})(?P<sep>\s*[=:]\s*)(?P<secret>[^\s&;,'\"]+)", re.IGNORECASE
)
_SECRET_KEY = re.compile(rf"^{_SECRET_NAME}$", re.IGNORECASE)


def redact(text: str) -> str:
    """`text` with every password, token or secret option replaced by `***`."""
    text = _USERINFO.sub(lambda m: f"{m['user']}:{MASK}@", text)
    return _SECRET_OPTION.sub(lambda m: f"{m['key']}{m['sep']}{MASK}", text)


def redact_url(url: str) -> str:
    """`url` safe to print or log (see `redact`); never raises, even on a malformed URL."""
    return redact(url)


def redact_value(value: Any) -> Any:
    """A log field with its secrets hidden: strings redacted, containers walked."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {k: redact_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(redact_value(v) for v in value)
    if isinstance(value, BaseException):
        return redact(repr(value))
    return value


def redact_event(
    _logger: Any, _method: str, event_dict: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """structlog processor: every field of the event redacted (place it before the renderer)."""
    for key, value in event_dict.items():
        secret_named = isinstance(key, str) and _SECRET_KEY.match(key) and value
        event_dict[key] = MASK if secret_named else redact_value(value)
    return event_dict
