"""Server-sent events of OpenAI streaming responses: split, tally, and the resumable end.

The proxy forwards upstream events verbatim and scans each `data:` payload's bytes for what
the per-chunk path needs (does it carry a token, for TTFT/ITL; is it the usage chunk); the
text so far, finish reasons and usage are parsed from JSON only when asked for.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from adapters.proxy.openai import Endpoint

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


@dataclass
class StreamTally:
    """What a proxied stream has carried so far.

    The per-chunk path (`observe`) only scans bytes; JSON is parsed lazily: the latest usage
    chunk when the token count is asked for, and every kept payload (batch streams keep
    them) when the text so far is needed for a resumable ending or an assembled response.
    `output_tokens` is the upstream's own count when it reports usage (vLLM's
    `continuous_usage_stats`), else the number of token-carrying chunks.
    """

    endpoint: Endpoint
    keep_payloads: bool = False
    payloads: list[bytes] = field(default_factory=list)
    chunks_with_tokens: int = 0
    saw_length: bool = False
    done: bool = False
    _usage_payload: bytes | None = None
    _usage: dict[str, Any] | None = None
    _parsed: tuple[dict[int, str], dict[int, str | None], dict[str, Any]] | None = None

    def observe(self, payload: bytes) -> tuple[bool, bool]:
        """Tally one `data:` payload; return (carries a token, is a usage-only chunk)."""
        if payload == DONE:
            self.done = True
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
    def output_tokens(self) -> int:
        """Output tokens generated so far."""
        usage = self.usage
        if usage and isinstance(usage.get("completion_tokens"), int):
            return int(usage["completion_tokens"])
        return self.chunks_with_tokens

    def _parse(self) -> tuple[dict[int, str], dict[int, str | None], dict[str, Any]]:
        if self._parsed is not None:
            return self._parsed
        texts: dict[int, list[str]] = {}
        reasons: dict[int, str | None] = {}
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
            for choice in chunk.get("choices") or ():
                index = choice.get("index", 0)
                text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                if text:
                    texts.setdefault(index, []).append(text)
                reason = choice.get("finish_reason")
                if reason is not None or index not in reasons:
                    reasons[index] = reason
        self._parsed = ({i: "".join(t) for i, t in texts.items()}, reasons, envelope)
        return self._parsed

    @property
    def finish_reasons(self) -> dict[int, str | None]:
        """Finish reason per choice index (None while unfinished); needs kept payloads."""
        return self._parse()[1]

    def text(self, index: int = 0) -> str:
        """The text generated so far for choice `index`; needs kept payloads."""
        return self._parse()[0].get(index, "")

    def usage_so_far(self, prompt_tokens_estimate: int) -> dict[str, int]:
        """Usage object of what was generated so far (upstream's prompt count when known)."""
        prompt = prompt_tokens_estimate
        usage = self.usage
        if usage and isinstance(usage.get("prompt_tokens"), int):
            prompt = int(usage["prompt_tokens"])
        output = self.output_tokens
        return {"prompt_tokens": prompt, "completion_tokens": output,
                "total_tokens": prompt + output}

    def choice_indexes(self) -> list[int]:
        """Every choice index seen, or [0] when none was."""
        texts, reasons, _envelope = self._parse()
        return sorted(set(texts) | set(reasons)) or [0]

    def _envelope(self, request_id: str, model: str) -> dict[str, Any]:
        chat = self.endpoint is Endpoint.CHAT
        seen = self._parse()[2]
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

    def completion_body(
        self, request_id: str, model: str, prompt_tokens: int, *, preempted_reason: str
    ) -> bytes:
        """A non-streaming response assembled from the stream; with a `preempted_reason`,
        every unfinished choice ends with finish_reason `preempted` and that reason."""
        chat = self.endpoint is Endpoint.CHAT
        choices = []
        for index in self.choice_indexes():
            reason = self.finish_reasons.get(index)
            choice: dict[str, Any] = {"index": index, "finish_reason": reason, "logprobs": None}
            if preempted_reason and reason is None:
                choice["finish_reason"] = PREEMPTED
                choice["borrowd_reason"] = preempted_reason
            if chat:
                choice["message"] = {"role": "assistant", "content": self.text(index)}
            else:
                choice["text"] = self.text(index)
            choices.append(choice)
        body = self._envelope(request_id, model)
        body["object"] = "chat.completion" if chat else "text_completion"
        body["choices"] = choices
        body["usage"] = self.usage_so_far(prompt_tokens)
        return json.dumps(body).encode()
