"""OpenAI Batch API shapes: statuses and their transitions, completion windows, and the
lines of output and error files.

Statuses as OpenAI documents them: validating -> in_progress -> finalizing -> completed;
validating -> failed; in_progress -> expired (deadline passed); validating | in_progress
-> cancelling -> cancelled. Output file lines carry 2xx responses; error file lines carry
the other responses (`response.status_code` 4xx/5xx with the error body) and requests that
got no response (`error.code`: batch_expired, batch_cancelled, request_failed).
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Any

from borrowd.models.errors import InputError


class Status(StrEnum):
    """A batch's status."""

    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


TRANSITIONS: dict[Status, tuple[Status, ...]] = {
    Status.VALIDATING: (Status.IN_PROGRESS, Status.FAILED, Status.CANCELLING),
    Status.IN_PROGRESS: (Status.FINALIZING, Status.CANCELLING, Status.EXPIRED),
    Status.FINALIZING: (Status.COMPLETED,),
    Status.CANCELLING: (Status.CANCELLED,),
    Status.FAILED: (),
    Status.COMPLETED: (),
    Status.EXPIRED: (),
    Status.CANCELLED: (),
}
TERMINAL = frozenset(s for s, nxt in TRANSITIONS.items() if not nxt)
STATUS_TIME_FIELD = {
    Status.IN_PROGRESS: "in_progress_at", Status.FINALIZING: "finalizing_at",
    Status.COMPLETED: "completed_at", Status.FAILED: "failed_at",
    Status.EXPIRED: "expired_at", Status.CANCELLING: "cancelling_at",
    Status.CANCELLED: "cancelled_at",
}


def can_move(current: Status, new: Status) -> bool:
    """True when OpenAI's lifecycle allows `current` -> `new`."""
    return new in TRANSITIONS[current]


_WINDOW = re.compile(r"^(\d+)(s|m|h|d)$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def completion_window_s(window: Any) -> int:
    """Seconds of a completion window: OpenAI's "24h", or any N followed by s, m, h or d."""
    match = _WINDOW.match(window) if isinstance(window, str) else None
    if match is None or int(match.group(1)) <= 0:
        raise InputError(f"completion_window: must be like '24h' (N followed by s, m, h or d), "
                         f"got {window!r}")
    return int(match.group(1)) * _UNIT_S[match.group(2)]


def output_line(line_id: str, custom_id: str, status_code: int, request_id: str,
                body: dict[str, Any]) -> dict[str, Any]:
    """A line of the output file (2xx) or of the error file (other status): a response."""
    return {"id": line_id, "custom_id": custom_id,
            "response": {"status_code": status_code, "request_id": request_id, "body": body},
            "error": None}


def error_line(line_id: str, custom_id: str, code: str, message: str) -> dict[str, Any]:
    """A line of the error file: a request that got no response."""
    return {"id": line_id, "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


def batch_error(code: str, message: str, line: int | None, param: str | None) -> dict[str, Any]:
    """One entry of a batch's `errors.data`."""
    return {"code": code, "message": message, "line": line, "param": param}
