"""Validation of an OpenAI Batch input file (JSONL), line by line.

Each line is `{"custom_id": str, "method": "POST", "url": "/v1/chat/completions" |
"/v1/completions", "body": {...}}`. Errors name the 1-based line and the field
(`line 3: body.messages: ...`), as OpenAI's batch errors carry `line` and `param`.
Batch items take `n = 1` and no streaming (the worker streams them itself, to resume).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from borrowd.models.errors import InputError

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
SUPPORTED_URLS = (CHAT_URL, COMPLETIONS_URL)


class BatchInputError(InputError):
    """A line of a batch input file is malformed; `line` (1-based, 0 = whole file) and
    `field` name where."""

    def __init__(self, line: int, field: str, message: str) -> None:
        where = f"line {line}: " if line else ""
        super().__init__(f"{where}{field}: {message}")
        self.line = line
        self.field = field
        self.message = message


@dataclass(frozen=True)
class InputLimits:
    """Size limits of one input file (OpenAI's: 200 MB and 50,000 requests)."""

    max_file_bytes: int = 200 * 1024 * 1024
    max_lines: int = 50_000
    max_line_bytes: int = 4 * 1024 * 1024


@dataclass(frozen=True)
class BatchItem:
    """One validated request of a batch: where it was, its id, endpoint and body."""

    line: int
    custom_id: str
    url: str
    body: dict[str, Any]


def parse_input(data: bytes, limits: InputLimits) -> tuple[BatchItem, ...]:
    """Validate a whole input file; `BatchInputError` names the first bad line and field."""
    if len(data) > limits.max_file_bytes:
        raise BatchInputError(0, "file", f"is {len(data)} bytes, over the limit of "
                                         f"{limits.max_file_bytes} bytes")
    items: list[BatchItem] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        if len(items) >= limits.max_lines:
            raise BatchInputError(number, "file", f"has more than {limits.max_lines} requests")
        item = parse_line(raw, number, limits)
        if item.custom_id in seen:
            raise BatchInputError(number, "custom_id", f"{item.custom_id!r} duplicates line "
                                                       f"{seen[item.custom_id]}")
        seen[item.custom_id] = number
        items.append(item)
    if not items:
        raise BatchInputError(0, "file", "has no requests")
    return tuple(items)


def parse_line(raw: bytes, line: int, limits: InputLimits) -> BatchItem:
    """Validate one JSONL line of an input file."""
    if len(raw) > limits.max_line_bytes:
        raise BatchInputError(line, "line", f"is {len(raw)} bytes, over the limit of "
                                            f"{limits.max_line_bytes} bytes")
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BatchInputError(line, "line", f"is not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise BatchInputError(line, "line", "must be a JSON object")
    for key in obj:
        if key not in ("custom_id", "method", "url", "body"):
            raise BatchInputError(line, key, "is not a batch request field "
                                             "(custom_id, method, url, body)")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > 512:
        raise BatchInputError(line, "custom_id", "is required: a string of 1-512 characters")
    if obj.get("method") != "POST":
        raise BatchInputError(line, "method", f"must be POST, got {obj.get('method')!r}")
    url = obj.get("url")
    if url not in SUPPORTED_URLS:
        raise BatchInputError(line, "url", f"{url!r} is not supported (use one of "
                                           f"{', '.join(SUPPORTED_URLS)})")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise BatchInputError(line, "body", "is required and must be an object")
    _check_body(body, url, line)
    return BatchItem(line=line, custom_id=custom_id, url=url, body=body)


def _check_body(body: dict[str, Any], url: str, line: int) -> None:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BatchInputError(line, "body.model", "is required and must be a non-empty string")
    if body.get("stream") not in (None, False):
        raise BatchInputError(line, "body.stream", "batch requests are not streamed")
    if body.get("n") not in (None, 1):
        raise BatchInputError(line, "body.n", "batch requests take n = 1")
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise BatchInputError(line, f"body.{key}", f"must be an integer >= 1, got {value!r}")
    if url == CHAT_URL:
        _check_messages(body.get("messages"), line)
    else:
        prompt = body.get("prompt")
        single = isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str)
        if not isinstance(prompt, str) and not single:
            raise BatchInputError(line, "body.prompt",
                                  "must be a string (one prompt per batch request)")


def _check_messages(messages: Any, line: int) -> None:
    if not isinstance(messages, list) or not messages:
        raise BatchInputError(line, "body.messages", "is required and must be a non-empty list")
    for index, message in enumerate(messages):
        where = f"body.messages[{index}]"
        if not isinstance(message, dict):
            raise BatchInputError(line, where, "must be an object")
        if not isinstance(message.get("role"), str) or not message["role"]:
            raise BatchInputError(line, f"{where}.role", "is required and must be a string")
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise BatchInputError(line, f"{where}.content", "must be a string, a list or null")
