"""OpenAI-compatible request bodies: validation, token estimates, rewriting, error bodies.

Shared by the proxy (which validates and rewrites before forwarding) and the emulator
(which serves them). `prompt_tokens` is the emulator's prompt length: the extension field
`borrowd_prompt_tokens` that load generators set to reproduce a trace's exact lengths, else
whitespace words at ceil(len / 4) tokens each. The proxy charges batch work by its own count
(`adapters.proxy.tokens`), taking the claimed field only as a lower bound.
JSON's non-standard `NaN`/`Infinity` (and numbers that overflow to infinity) are refused
with the field named, never forwarded.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from borrowd.models.errors import InputError

PROMPT_TOKENS_FIELD = "borrowd_prompt_tokens"
"""Extension field: the exact prompt length in tokens, for load generators."""


class Endpoint(StrEnum):
    """The two generation endpoints."""

    CHAT = "chat"
    COMPLETIONS = "completions"

    @property
    def path(self) -> str:
        """URL path of this endpoint."""
        return "/v1/chat/completions" if self is Endpoint.CHAT else "/v1/completions"


class FieldError(InputError):
    """A request body field is missing or malformed; `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class CompletionRequest:
    """A validated generation request; `body` is the client's JSON object, unmodified."""

    endpoint: Endpoint
    body: dict[str, Any]
    model: str
    stream: bool
    n: int
    max_tokens: int | None
    max_tokens_key: str
    prompt_tokens: int
    include_usage: bool
    claimed_prompt_tokens: int | None = None
    """The client's `borrowd_prompt_tokens`, if sent (a lower bound for the proxy)."""
    prompts: int = 1
    """Prompts of a /v1/completions list prompt (each runs as its own sequences)."""
    best_of: int = 1
    """Sequences generated per prompt before the best n are returned (completions)."""

    @property
    def sequences(self) -> int:
        """Sequences the engine runs for this request: prompts x max(n, best_of)."""
        return self.prompts * max(self.n, self.best_of)


def estimate_text_tokens(text: str) -> int:
    """Token estimate of `text`: each whitespace-separated word is ceil(len/4) tokens."""
    return sum((len(word) + 3) // 4 for word in text.split())


class _NonFinite:
    """Stands in for a NaN or infinite number while a body is parsed, to be named after."""

    def __init__(self, text: str) -> None:
        self.text = text


def _load_json(raw: bytes) -> Any:
    """`json.loads` that refuses NaN, Infinity and overflowing numbers, naming their field."""
    found: list[_NonFinite] = []

    def constant(text: str) -> _NonFinite:
        found.append(_NonFinite(text))
        return found[-1]

    def number(text: str) -> float | _NonFinite:
        value = float(text)
        return value if math.isfinite(value) else constant(text)

    try:
        body = json.loads(raw, parse_constant=constant, parse_float=number)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise FieldError("body", f"is not valid JSON ({exc})") from None
    if found:
        path, text = _find_non_finite(body, "") or ("body", found[0].text)
        raise FieldError(path or "body", f"{text} is not a JSON number (finite numbers only)")
    return body


def _find_non_finite(value: Any, path: str) -> tuple[str, str] | None:
    if isinstance(value, _NonFinite):
        return path, value.text
    items: Any = ()
    if isinstance(value, dict):
        items = ((f"{path}.{key}" if path else str(key), item) for key, item in value.items())
    elif isinstance(value, list):
        items = ((f"{path}[{index}]", item) for index, item in enumerate(value))
    for item_path, item in items:
        hit = _find_non_finite(item, item_path)
        if hit is not None:
            return hit
    return None


def parse_completion_request(raw: bytes, endpoint: Endpoint) -> CompletionRequest:
    """Validate a request body; `FieldError` names the first bad field."""
    body = _load_json(raw)
    if not isinstance(body, dict):
        raise FieldError("body", "must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise FieldError("model", "is required and must be a non-empty string")
    stream = _optional(body, "stream", bool, False)
    n = _optional_int(body, "n", 1, minimum=1) or 1
    best_of = 1
    if endpoint is Endpoint.COMPLETIONS:
        best_of = _optional_int(body, "best_of", 1, minimum=1) or 1
    max_tokens_key = "max_tokens"
    if endpoint is Endpoint.CHAT and body.get("max_completion_tokens") is not None:
        max_tokens_key = "max_completion_tokens"
    max_tokens = _optional_int(body, max_tokens_key, None, minimum=1)
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise FieldError("stream_options", "must be an object")
        include_usage = _optional(options, "include_usage", bool, False, "stream_options.")
    explicit = body.get(PROMPT_TOKENS_FIELD)
    if explicit is not None and (
        isinstance(explicit, bool) or not isinstance(explicit, int) or explicit < 0
    ):
        raise FieldError(PROMPT_TOKENS_FIELD, "must be an integer >= 0")
    count = explicit is None
    prompts = 1
    if endpoint is Endpoint.CHAT:
        estimate = _chat_prompt_tokens(body.get("messages"), count)
    else:
        estimate, prompts = _completion_prompt_tokens(body.get("prompt"), count)
    return CompletionRequest(
        endpoint=endpoint,
        body=body,
        model=model,
        stream=stream,
        n=n,
        max_tokens=max_tokens,
        max_tokens_key=max_tokens_key,
        prompt_tokens=explicit if explicit is not None else estimate,
        include_usage=include_usage,
        claimed_prompt_tokens=explicit,
        prompts=prompts,
        best_of=best_of,
    )


def rewrite_body(
    request: CompletionRequest,
    *,
    priority: int | None,
    max_tokens: int | None,
    stream: bool,
    continuous_usage: bool,
) -> bytes:
    """The body to forward: priority injected, max_tokens set, usage reporting switched on,
    `stream_interval` dropped (a client must not thin the stream the ITL signal is read
    from)."""
    body = dict(request.body)
    body.pop("stream_interval", None)
    if priority is None:
        body.pop("priority", None)
    else:
        body["priority"] = priority
    if max_tokens is not None:
        body[request.max_tokens_key] = max_tokens
    body["stream"] = stream
    if stream:
        options = dict(body.get("stream_options") or {})
        options["include_usage"] = True
        if continuous_usage:
            options["continuous_usage_stats"] = True
        body["stream_options"] = options
    else:
        body.pop("stream_options", None)
    return json.dumps(body, separators=(",", ":")).encode()


def error_body(status: int, message: str, *, kind: str, field: str | None = None) -> bytes:
    """An OpenAI-style error object as JSON bytes."""
    return json.dumps(
        {"error": {"message": message, "type": kind, "param": field, "code": status}}
    ).encode()


def _optional(body: dict, key: str, kind: type, default: Any, prefix: str = "") -> Any:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, kind):
        raise FieldError(prefix + key, f"must be a {kind.__name__}, got {value!r}")
    return value


def _optional_int(body: dict, key: str, default: int | None, *, minimum: int) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise FieldError(key, f"must be an integer >= {minimum}, got {value!r}")
    return value


def _chat_prompt_tokens(messages: Any, count: bool) -> int:
    """Validate chat messages; their token estimate when `count` (else 0)."""
    if not isinstance(messages, list) or not messages:
        raise FieldError("messages", "is required and must be a non-empty list")
    total = 0
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise FieldError(f"messages[{i}]", "must be an object")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise FieldError(f"messages[{i}].role", "is required and must be a string")
        content = message.get("content")
        if content is None or isinstance(content, str):
            if count and content:
                total += estimate_text_tokens(content)
        elif isinstance(content, list):
            for j, part in enumerate(content):
                if not isinstance(part, dict):
                    raise FieldError(f"messages[{i}].content[{j}]", "must be an object")
                text = part.get("text")
                if count and isinstance(text, str):
                    total += estimate_text_tokens(text)
        else:
            raise FieldError(f"messages[{i}].content", "must be a string, a list or null")
        # A few tokens of chat template per message (role header and separators).
        total += 4
    return total


def _is_token_ids(value: Any) -> bool:
    return (isinstance(value, list) and bool(value)
            and all(isinstance(p, int) and not isinstance(p, bool) for p in value))


def completion_prompts(prompt: Any) -> list[str | list[int]]:
    """The prompts of a /v1/completions `prompt`: a string, token ids, or a list of either."""
    if isinstance(prompt, str) or _is_token_ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(
            isinstance(p, str) or _is_token_ids(p) for p in prompt):
        return list(prompt)
    raise FieldError("prompt", "is required: a string, token ids, or a non-empty list of "
                               "strings or of token id lists")


def _completion_prompt_tokens(prompt: Any, count: bool) -> tuple[int, int]:
    """Validate a completion prompt; (its token estimate when `count` else 0, prompts)."""
    prompts = completion_prompts(prompt)
    if not count:
        return 0, len(prompts)
    return sum(estimate_text_tokens(p) if isinstance(p, str) else len(p)
               for p in prompts), len(prompts)
