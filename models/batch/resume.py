"""Resume, not redo: continue an interrupted generation from its partial output.

An attempt streams chunks; `Segment` is what one attempt produced (text, tokens, finish
reason). A request cut short (`finish_reason: "preempted"`, or a stream that broke) is
sent again as a continuation:

- completions: `prompt + text_so_far`;
- chat: the partial answer appended as a final assistant message with
  `continue_final_message: true, add_generation_prompt: false` (vLLM's continuation);

with `max_tokens` (or `max_completion_tokens`) reduced by the tokens already generated.
The final result is one response: the texts joined, the last finish reason, usage summed
over the attempts.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from borrowd.models.batch.input import CHAT_URL

PREEMPTED = "preempted"
"""The proxy's resumable `finish_reason`."""
FINISHED_REASONS = ("stop", "length", "tool_calls", "content_filter", "function_call")


@dataclass(frozen=True)
class Segment:
    """What one attempt produced: its text, token counts and how it ended (None = broke)."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None
    response_id: str = ""
    model: str = ""
    created: int = 0

    @property
    def finished(self) -> bool:
        """True when the model ended the generation (nothing left to resume)."""
        return self.finish_reason in FINISHED_REASONS


@dataclass
class ChunkAccumulator:
    """Builds a `Segment` from the parsed SSE chunks of one attempt (mutable, per attempt).

    Text comes from `delta.content` (chat) or `text` (completions); a `preempted` chunk's
    `borrowd_text` (the whole text so far) replaces what was gathered, in case chunks were
    missed. Token counts come from the latest `usage`, else from token-carrying chunks.
    """

    chat: bool
    parts: list[str] = field(default_factory=list)
    token_chunks: int = 0
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None
    response_id: str = ""
    model: str = ""
    created: int = 0

    def feed(self, chunk: Mapping[str, Any]) -> None:
        """Take one parsed `data:` payload."""
        if not self.response_id:
            self.response_id = str(chunk.get("id") or "")
            self.model = str(chunk.get("model") or "")
            created = chunk.get("created")
            self.created = created if isinstance(created, int) else 0
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self.usage = usage
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            text = (choice.get("delta") or {}).get("content") if self.chat else choice.get("text")
            if isinstance(text, str) and text:
                self.parts.append(text)
                self.token_chunks += 1
            reason = choice.get("finish_reason")
            if reason is not None:
                self.finish_reason = str(reason)
                if isinstance(choice.get("borrowd_text"), str):
                    self.parts = [choice["borrowd_text"]]

    def segment(self, prompt_tokens_estimate: int) -> Segment:
        """The attempt so far as a segment."""
        usage = self.usage or {}
        completion = usage.get("completion_tokens")
        prompt = usage.get("prompt_tokens")
        return Segment(
            text="".join(self.parts),
            prompt_tokens=prompt if isinstance(prompt, int) else prompt_tokens_estimate,
            completion_tokens=completion if isinstance(completion, int) else self.token_chunks,
            finish_reason=self.finish_reason,
            response_id=self.response_id, model=self.model, created=self.created,
        )


def max_tokens_key(body: Mapping[str, Any]) -> str | None:
    """The body's output-length field (`max_completion_tokens` wins), or None."""
    for key in ("max_completion_tokens", "max_tokens"):
        if body.get(key) is not None:
            return key
    return None


def remaining_tokens(body: Mapping[str, Any], generated_tokens: int) -> int | None:
    """Output tokens still allowed after `generated_tokens` (None = no limit was set)."""
    key = max_tokens_key(body)
    if key is None:
        return None
    return int(body[key]) - generated_tokens


def resumed_max_tokens(max_tokens: int, generated_tokens: int) -> int:
    """The output limit of a continuation: what is left of `max_tokens` (at least 1)."""
    return max(1, max_tokens - generated_tokens)


def continuation_sizes(prompt_tokens: int, max_tokens: int,
                       generated_tokens: int) -> tuple[int, int]:
    """(prompt, max output) tokens of the request that continues one cut after
    `generated_tokens`: the prompt plus the text so far is prefilled again, and the output
    limit shrinks by what was generated (`resume_body`, in tokens; the simulator's
    continuations)."""
    if generated_tokens <= 0:
        return prompt_tokens, max_tokens
    return prompt_tokens + generated_tokens, resumed_max_tokens(max_tokens, generated_tokens)


def resume_body(url: str, body: Mapping[str, Any], text_so_far: str,
                generated_tokens: int) -> dict[str, Any]:
    """The request that continues `body` after `text_so_far` (`generated_tokens` long)."""
    out = copy.deepcopy(dict(body))
    key = max_tokens_key(body)
    if key is not None:
        out[key] = resumed_max_tokens(int(body[key]), generated_tokens)
    if not text_so_far:
        return out
    if url == CHAT_URL:
        messages = list(out["messages"])
        last = messages[-1]
        continuing = (body.get("continue_final_message") is True
                      and last.get("role") == "assistant" and isinstance(last.get("content"), str))
        if continuing:
            messages[-1] = {**last, "content": last["content"] + text_so_far}
        else:
            messages.append({"role": "assistant", "content": text_so_far})
        out["messages"] = messages
        out["continue_final_message"] = True
        out["add_generation_prompt"] = False
    else:
        prompt = out["prompt"]
        out["prompt"] = (prompt[0] if isinstance(prompt, list) else prompt) + text_so_far
    return out


def merge_segments(url: str, segments: Sequence[Segment], fallback_id: str,
                   fallback_model: str, created: int) -> dict[str, Any]:
    """One OpenAI response body from the attempts' segments, usage summed over them."""
    text = "".join(s.text for s in segments)
    last = segments[-1] if segments else None
    first = next((s for s in segments if s.response_id), None)
    reason = last.finish_reason if last is not None else None
    prompt = sum(s.prompt_tokens for s in segments)
    completion = sum(s.completion_tokens for s in segments)
    choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": None}
    chat = url == CHAT_URL
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {
        "id": first.response_id if first else fallback_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": first.created if first and first.created else created,
        "model": first.model if first and first.model else fallback_model,
        "choices": [choice],
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                  "total_tokens": prompt + completion},
    }
