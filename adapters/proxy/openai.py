"""OpenAI-compatible request bodies: validation, token estimates, rewriting, error bodies.

Shared by the proxy (which validates and rewrites before forwarding) and the emulator
(which serves them). Prompt tokens are estimated without a tokenizer: whitespace-separated
words, each counted as ceil(len / 4) tokens (about 4 characters per token for English BPE
vocabularies), or taken verbatim from the extension field `borrowd_prompt_tokens` that load
generators set to reproduce a trace's exact lengths.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from models.errors import InputError

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


def estimate_text_tokens(text: str) -> int:
    """Token estimate of `text`: each whitespace-separated word is ceil(len/4) tokens."""
    return sum((len(word) + 3) // 4 for word in text.split())


def parse_completion_request(raw: bytes, endpoint: Endpoint) -> CompletionRequest:
    """Validate a request body; `FieldError` names the first bad field."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise FieldError("body", f"is not valid JSON ({exc})") from None
    if not isinstance(body, dict):
        raise FieldError("body", "must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise FieldError("model", "is required and must be a non-empty string")
    stream = _optional(body, "stream", bool, False)
    n = _optional_int(body, "n", 1, minimum=1)
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
    if endpoint is Endpoint.CHAT:
        estimate = _chat_prompt_tokens(body.get("messages"), count)
    else:
        estimate = _completion_prompt_tokens(body.get("prompt"), count)
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
    )


def rewrite_body(
    request: CompletionRequest,
    *,
    priority: int | None,
    max_tokens: int | None,
    stream: bool,
    continuous_usage: bool,
) -> bytes:
    """The body to forward: priority injected, max_tokens set, usage reporting switched on."""
    body = dict(request.body)
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


def _completion_prompt_tokens(prompt: Any, count: bool) -> int:
    """Validate a completion prompt; its token estimate when `count` (else 0)."""
    if isinstance(prompt, str):
        return estimate_text_tokens(prompt) if count else 0
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return sum(estimate_text_tokens(p) for p in prompt) if count else 0
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            return len(prompt)
    raise FieldError("prompt", "is required: a string, a list of strings or a list of token ids")
