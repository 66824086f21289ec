"""Server-sent events of OpenAI streaming responses: split, tally, and the resumable end.

The proxy forwards upstream events verbatim and scans each `data:` payload's bytes for what
the per-chunk path needs (does it carry a token, for TTFT/ITL; is it the usage chunk; is it
an error event); the text so far, tool calls, reasoning, logprobs, finish reasons and usage
are parsed from JSON only when asked for.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

from borrowd.adapters.proxy.openai import Endpoint, error_body

DONE = b"[DONE]"
PREEMPTED = "preempted"
"""`finish_reason` of a batch stream the proxy ended on a revocation: resume from its text."""


def take_complete(buffer: bytearray, data: bytes) -> bytes:
    """Append `data` to the partial event in `buffer`; return every complete event (each
    ends in a blank line) and leave the partial tail in `buffer`.

    The usual chunk is whole events with nothing pending: it is returned as it came.
    """
    if not buffer:
        cut = data.rfind(b"\n\n") + 2
        if cut == 1:
            buffer += data
            return b""
        if cut < len(data):
            buffer += data[cut:]
            return data[:cut]
        return data
    buffer += data
    cut = buffer.rfind(b"\n\n") + 2
    if cut == 1:
        return b""
    complete = bytes(buffer[:cut])
    del buffer[:cut]
    return complete


def event_payload(event: bytes) -> bytes | None:
    """The payload of an event's `data:` line (event without its blank line), or None for
    comments and other fields."""
    # Fast path: one `data: ...` line, the only shape vLLM sends.
    if event.startswith(b"data: ") and b"\n" not in event:
        return event[6:]
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            return line[5:].strip()
    return None


_TOKEN_MARKERS = {
    endpoint: tuple((marker, len(marker)) for marker in markers)
    for endpoint, markers in (
        (Endpoint.CHAT, (b'"content":"', b'"content": "', b'"reasoning_content":"',
                         b'"reasoning_content": "', b'"reasoning":"', b'"reasoning": "')),
        (Endpoint.COMPLETIONS, (b'"text":"', b'"text": "')),
    )
}
_QUOTE = ord('"')


def _spaced(compact: bytes) -> tuple[bytes, bytes]:
    """A `"key":value` needle and its `"key": value` form (vLLM writes compact JSON)."""
    return compact, compact.replace(b'":', b'": ', 1)


_USAGE = _spaced(b'"usage":{')
_NO_CHOICES = _spaced(b'"choices":[]')
_LENGTH = _spaced(b'"finish_reason":"length"')
_TOOL_CALL = _spaced(b'"tool_calls":[{')


def _contains(payload: bytes, needles: tuple[bytes, bytes]) -> bool:
    return needles[0] in payload or needles[1] in payload


def _carries_token(payload: bytes, markers: tuple[tuple[bytes, int], ...]) -> bool:
    """True when a chunk has a non-empty content/reasoning/text string or a tool call.

    Byte checks, no JSON parse: a string value's own quotes are escaped in JSON, so a
    marker only matches a real key.
    """
    last = len(payload) - 1
    for marker, size in markers:
        start = payload.find(marker)
        while start >= 0:
            after = start + size
            if after <= last and payload[after] != _QUOTE:
                return True
            start = payload.find(marker, after)
    return _contains(payload, _TOOL_CALL)


_USAGE_FIELD = re.compile(rb',\s*"usage":\s*(?:null|\{(?:[^{}]|\{[^{}]*\})*\})')


def strip_usage(payload: bytes) -> bytes:
    """`payload` without its `"usage"` member (the per-chunk usage the proxy asked vLLM for
    on a client's behalf; vLLM writes it after the choices)."""
    return _USAGE_FIELD.sub(b"", payload, count=1)


def error_event(status: int, message: str, kind: str) -> bytes:
    """An in-stream error, as vLLM ends a stream that failed: an error event, then [DONE]."""
    return b"data: " + error_body(status, message, kind=kind) + b"\n\ndata: [DONE]\n\n"


def _is_error(payload: bytes) -> bool:
    head = payload[:24]
    return head.startswith((b'{"error"', b'{ "error"')) or b'"object":"error"' in head


@dataclass
class _Choice:
    """One choice assembled from its deltas."""

    texts: list[str] = field(default_factory=list)
    reasoning: dict[str, list[str]] = field(default_factory=dict)
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def add_chat(self, choice: dict[str, Any]) -> None:
        """Merge one chat chunk's choice: content, reasoning, tool call pieces, logprobs."""
        delta = choice.get("delta") or {}
        if delta.get("content"):
            self.texts.append(delta["content"])
        for key in ("reasoning_content", "reasoning"):
            if delta.get(key):
                self.reasoning.setdefault(key, []).append(delta[key])
        for call in delta.get("tool_calls") or ():
            merged = self.tool_calls.setdefault(call.get("index", len(self.tool_calls)), {})
            for key in ("id", "type"):
                if call.get(key):
                    merged[key] = call[key]
            function = call.get("function") or {}
            target = merged.setdefault("function", {"name": "", "arguments": ""})
            target["name"] += function.get("name") or ""
            target["arguments"] += function.get("arguments") or ""
        self._add_logprobs(choice.get("logprobs"))

    def add_text(self, choice: dict[str, Any]) -> None:
        """Merge one completions chunk's choice: text and logprobs."""
        if choice.get("text"):
            self.texts.append(choice["text"])
        self._add_logprobs(choice.get("logprobs"))

    def _add_logprobs(self, logprobs: Any) -> None:
        """Concatenate per-token lists (chat `content`/`refusal`, completions `tokens`, ...)."""
        if not isinstance(logprobs, dict):
            return
        if self.logprobs is None:
            self.logprobs = {}
        for key, value in logprobs.items():
            if isinstance(value, list):
                self.logprobs.setdefault(key, []).extend(value)
            elif key not in self.logprobs:
                self.logprobs[key] = value

    def finish(self, choice: dict[str, Any]) -> None:
        """Keep the choice's finish reason (and vLLM's stop_reason) once it has one."""
        reason = choice.get("finish_reason")
        if reason is not None:
            self.finish_reason = reason
            if choice.get("stop_reason") is not None:
                self.extra["stop_reason"] = choice["stop_reason"]

    def message(self) -> dict[str, Any]:
        """The chat message: content, reasoning and tool calls as a non-streaming answer."""
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.texts)}
        if self.tool_calls:
            if not self.texts:
                message["content"] = None
            message["tool_calls"] = [self.tool_calls[i] for i in sorted(self.tool_calls)]
        for key, parts in self.reasoning.items():
            message[key] = "".join(parts)
        return message


@dataclass
class StreamTally:
    """What a proxied stream has carried so far.

    The per-chunk path (`observe`) only scans bytes; JSON is parsed lazily: the latest usage
    chunk when the token count is asked for, and every kept payload (batch streams keep
    them) when the text so far is needed for a resumable ending or an assembled response.
    `output_tokens` is the upstream's own count when it reports usage (vLLM's
    `continuous_usage_stats`), else the number of token-carrying chunks. An error event
    (vLLM's `data: {"error": ...}` mid-stream) is kept in `error`.
    """

    endpoint: Endpoint
    keep_payloads: bool = False
    payloads: list[bytes] = field(default_factory=list)
    chunks_with_tokens: int = 0
    saw_length: bool = False
    done: bool = False
    error: bytes | None = None
    _usage_payload: bytes | None = None
    _usage: dict[str, Any] | None = None
    _parsed: tuple[dict[int, _Choice], dict[str, Any]] | None = None

    def observe(self, payload: bytes) -> tuple[bool, bool]:
        """Tally one `data:` payload; return (carries a token, is a usage-only chunk)."""
        if payload == DONE:
            self.done = True
            return False, False
        if _is_error(payload):
            self.error = payload
            return False, False
        if self.keep_payloads:
            self.payloads.append(payload)
            self._parsed = None
        has_token = _carries_token(payload, _TOKEN_MARKERS[self.endpoint])
        if has_token:
            self.chunks_with_tokens += 1
        usage_only = False
        if _contains(payload, _USAGE):
            self._usage_payload = payload
            self._usage = None
            usage_only = _contains(payload, _NO_CHOICES)
        if _contains(payload, _LENGTH):
            self.saw_length = True
        return has_token, usage_only

    def error_detail(self) -> tuple[int, dict[str, Any]]:
        """(HTTP status, error object) of the error event the upstream sent mid-stream."""
        try:
            parsed = json.loads(self.error or b"{}")
        except ValueError:
            parsed = {}
        inner = parsed.get("error") if isinstance(parsed, dict) else None
        detail = inner if isinstance(inner, dict) else parsed if isinstance(parsed, dict) else {}
        code = detail.get("code")
        status = code if isinstance(code, int) and 400 <= code < 600 else 500
        return status, detail

    @property
    def usage(self) -> dict[str, Any] | None:
        """The latest usage object the upstream sent, if any."""
        if self._usage is None and self._usage_payload is not None:
            try:
                usage = json.loads(self._usage_payload).get("usage")
            except (ValueError, AttributeError):
                usage = None
            self._usage = usage if isinstance(usage, dict) else None
            self._usage_payload = None
        return self._usage

    @property
    def reported_prompt_tokens(self) -> int | None:
        """The upstream's own prompt token count, once it reported usage."""
        usage = self.usage
        value = usage.get("prompt_tokens") if usage else None
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    @property
    def output_tokens(self) -> int:
        """Output tokens generated so far."""
        usage = self.usage
        if usage and isinstance(usage.get("completion_tokens"), int):
            return int(usage["completion_tokens"])
        return self.chunks_with_tokens

    def _parse(self) -> tuple[dict[int, _Choice], dict[str, Any]]:
        if self._parsed is not None:
            return self._parsed
        choices: dict[int, _Choice] = {}
        envelope: dict[str, Any] = {}
        chat = self.endpoint is Endpoint.CHAT
        for payload in self.payloads:
            try:
                chunk = json.loads(payload)
            except ValueError:
                continue
            if not isinstance(chunk, dict):
                continue
            if not envelope:
                envelope = {k: chunk.get(k) for k in ("id", "model", "created")}
            for raw in chunk.get("choices") or ():
                if not isinstance(raw, dict):
                    continue
                choice = choices.setdefault(raw.get("index", 0), _Choice())
                if chat:
                    choice.add_chat(raw)
                else:
                    choice.add_text(raw)
                choice.finish(raw)
        self._parsed = (choices, envelope)
        return self._parsed

    @property
    def finish_reasons(self) -> dict[int, str | None]:
        """Finish reason per choice index (None while unfinished); needs kept payloads."""
        return {index: c.finish_reason for index, c in self._parse()[0].items()}

    def text(self, index: int = 0) -> str:
        """The text generated so far for choice `index`; needs kept payloads."""
        choice = self._parse()[0].get(index)
        return "".join(choice.texts) if choice else ""

    def usage_so_far(self, prompt_tokens_estimate: int) -> dict[str, int]:
        """Usage object of what was generated so far (upstream's prompt count when known)."""
        prompt = self.reported_prompt_tokens
        if prompt is None:
            prompt = prompt_tokens_estimate
        output = self.output_tokens
        return {"prompt_tokens": prompt, "completion_tokens": output,
                "total_tokens": prompt + output}

    def choice_indexes(self) -> list[int]:
        """Every choice index seen, or [0] when none was."""
        return sorted(self._parse()[0]) or [0]

    def _envelope(self, request_id: str, model: str) -> dict[str, Any]:
        chat = self.endpoint is Endpoint.CHAT
        seen = self._parse()[1]
        return {
            "id": seen.get("id") or request_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": seen.get("created") or int(time.time()),
            "model": seen.get("model") or model,
        }

    def preempted_chunk(self, request_id: str, model: str, prompt_tokens: int,
                        reason: str) -> bytes:
        """The final SSE event of a revoked stream: finish_reason `preempted`, usage so far.

        It also repeats the whole text so far per choice in `borrowd_text` (and why, in
        `borrowd_reason`), so a client that kept nothing can still resume.
        """
        chat = self.endpoint is Endpoint.CHAT
        choices = []
        for index in self.choice_indexes():
            choice: dict[str, Any] = {"index": index, "finish_reason": PREEMPTED,
                                      "logprobs": None, "borrowd_text": self.text(index),
                                      "borrowd_reason": reason}
            if chat:
                choice["delta"] = {}
            else:
                choice["text"] = ""
            choices.append(choice)
        chunk = self._envelope(request_id, model)
        chunk["choices"] = choices
        chunk["usage"] = self.usage_so_far(prompt_tokens)
        return b"data: " + json.dumps(chunk).encode() + b"\n\ndata: [DONE]\n\n"

    def partial(self, prompt_tokens: int) -> dict[str, Any]:
        """The text so far per choice and the usage, for an error body of a cut request."""
        return {"texts": [self.text(index) for index in self.choice_indexes()],
                "usage": self.usage_so_far(prompt_tokens)}

    def completion_body(
        self, request_id: str, model: str, prompt_tokens: int, *, preempted_reason: str
    ) -> bytes:
        """A non-streaming response assembled from the stream (text, reasoning, tool calls,
        logprobs); with a `preempted_reason`, every unfinished choice ends with finish_reason
        `preempted` and that reason."""
        chat = self.endpoint is Endpoint.CHAT
        parsed = self._parse()[0]
        choices = []
        for index in self.choice_indexes():
            assembled = parsed.get(index) or _Choice()
            reason = assembled.finish_reason
            choice: dict[str, Any] = {"index": index, "finish_reason": reason,
                                      "logprobs": assembled.logprobs, **assembled.extra}
            if preempted_reason and reason is None:
                choice["finish_reason"] = PREEMPTED
                choice["borrowd_reason"] = preempted_reason
            if chat:
                choice["message"] = assembled.message()
            else:
                choice["text"] = "".join(assembled.texts)
            choices.append(choice)
        body = self._envelope(request_id, model)
        body["object"] = "chat.completion" if chat else "text_completion"
        body["choices"] = choices
        body["usage"] = self.usage_so_far(prompt_tokens)
        return json.dumps(body).encode()
