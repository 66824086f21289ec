"""Server-sent events of OpenAI streaming responses: split, tally, and the resumable end.

The proxy forwards upstream events verbatim and reads each `data:` payload once for what it
needs: whether it carries a token (TTFT/ITL), the text so far per choice (for a revoked
stream's final chunk), the finish reasons and the latest usage.
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


def split_events(buffer: bytearray) -> list[bytes]:
    """Remove every complete event (ending in a blank line) from `buffer` and return them."""
    end = buffer.rfind(b"\n\n")
    if end < 0:
        return []
    complete = bytes(buffer[: end + 2])
    del buffer[: end + 2]
    return [event + b"\n\n" for event in complete.split(b"\n\n") if event]


def event_data(event: bytes) -> bytes | None:
    """The payload of an event's `data:` line, or None for comments and other fields."""
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            return line[5:].strip()
    return None


@dataclass
class StreamTally:
    """What a proxied stream has carried so far.

    `output_tokens` is the upstream's own count when it reports usage (vLLM's
    `continuous_usage_stats`), else the number of token-carrying chunks.
    """

    endpoint: Endpoint
    texts: dict[int, list[str]] = field(default_factory=dict)
    finish_reasons: dict[int, str | None] = field(default_factory=dict)
    chunks_with_tokens: int = 0
    usage: dict[str, Any] | None = None
    response_id: str | None = None
    model: str | None = None
    created: int | None = None
    done: bool = False

    def observe(self, payload: bytes) -> tuple[bool, bool]:
        """Tally one `data:` payload; return (carries a token, is a usage-only chunk)."""
        if payload == DONE:
            self.done = True
            return False, False
        try:
            chunk = json.loads(payload)
        except ValueError:
            return False, False
        if not isinstance(chunk, dict):
            return False, False
        if self.response_id is None:
            self.response_id = chunk.get("id")
            self.model = chunk.get("model")
            self.created = chunk.get("created")
        usage = chunk.get("usage")
        if usage:
            self.usage = usage
        choices = chunk.get("choices") or ()
        has_token = False
        chat = self.endpoint is Endpoint.CHAT
        for choice in choices:
            index = choice.get("index", 0)
            if chat:
                delta = choice.get("delta") or {}
                text = delta.get("content")
                if delta.get("tool_calls"):
                    has_token = True
            else:
                text = choice.get("text")
            if text:
                has_token = True
                self.texts.setdefault(index, []).append(text)
            reason = choice.get("finish_reason")
            if reason is not None or index not in self.finish_reasons:
                self.finish_reasons[index] = reason
        if has_token:
            self.chunks_with_tokens += 1
        return has_token, not choices and usage is not None

    @property
    def output_tokens(self) -> int:
        """Output tokens generated so far."""
        if self.usage and isinstance(self.usage.get("completion_tokens"), int):
            return int(self.usage["completion_tokens"])
        return self.chunks_with_tokens

    def text(self, index: int = 0) -> str:
        """The text generated so far for choice `index`."""
        return "".join(self.texts.get(index, ()))

    def usage_so_far(self, prompt_tokens_estimate: int) -> dict[str, int]:
        """Usage object of what was generated so far (upstream's prompt count when known)."""
        prompt = prompt_tokens_estimate
        if self.usage and isinstance(self.usage.get("prompt_tokens"), int):
            prompt = int(self.usage["prompt_tokens"])
        output = self.output_tokens
        return {"prompt_tokens": prompt, "completion_tokens": output,
                "total_tokens": prompt + output}

    def choice_indexes(self) -> list[int]:
        """Every choice index seen, or [0] when none was."""
        return sorted(set(self.texts) | set(self.finish_reasons)) or [0]

    def _envelope(self, request_id: str, model: str) -> dict[str, Any]:
        chat = self.endpoint is Endpoint.CHAT
        return {
            "id": self.response_id or request_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": self.created or int(time.time()),
            "model": self.model or model,
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
