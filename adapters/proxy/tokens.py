"""Prompt tokens a batch request costs the budget, counted by the proxy, not claimed.

With the model's tokenizer (`proxy.tokenizer_path`, a Hugging Face `tokenizer.json` read by
the `tokenizers` library) text is counted exactly; without one, by its UTF-8 bytes: a
byte-level BPE token covers at least one byte, so the bytes never under-count (CJK
included), at the price of over-charging English about 4x until the release trues the
charge up from the engine's reported usage. Every part of a request counts: message text,
roles and names, tool calls, the `tools`/`functions` definitions, `tool_choice`,
`response_format`, and each image, audio or video part at a fixed `media_part_tokens`,
plus `MESSAGE_OVERHEAD_TOKENS` of chat template per message. A client's
`borrowd_prompt_tokens` is only a lower bound.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from borrowd.adapters.proxy.openai import CompletionRequest, Endpoint, completion_prompts
from borrowd.models.errors import ConfigError

MESSAGE_OVERHEAD_TOKENS = 4
"""Chat template tokens per message (role header and separators)."""
REQUEST_PARTS = ("tools", "functions", "tool_choice", "response_format")
"""Top-level fields a chat template renders into the prompt."""
TEXT_PART_TYPES = ("text", "input_text")

TextCounter = Callable[[str], int]


def utf8_bytes(text: str) -> int:
    """The byte bound: tokens of `text` under any byte-level BPE are at most its bytes."""
    return len(text.encode("utf-8", errors="surrogatepass"))


def load_tokenizer(path: str) -> TextCounter:
    """A counter of tokens under the `tokenizer.json` at `path` (special tokens not added);
    `ConfigError` naming `proxy.tokenizer_path` when it cannot be read."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError("proxy.tokenizer_path needs the tokenizers package "
                          "(pip install tokenizers)") from None
    if not Path(path).is_file():
        raise ConfigError(f"proxy.tokenizer_path: {path} is not a file")
    try:
        tokenizer = Tokenizer.from_file(path)
    except Exception as exc:  # the library raises a bare Exception on a bad file
        raise ConfigError(f"proxy.tokenizer_path: {path} is not a tokenizer.json ({exc})"
                          ) from None

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False).ids)

    return count


@dataclass(frozen=True)
class PromptCounter:
    """Counts what a request's prompt costs: every text part, every tool, every medium."""

    count_text: TextCounter = utf8_bytes
    media_part_tokens: int = 2048

    def _json(self, value: Any) -> int:
        return self.count_text(value if isinstance(value, str) else
                               json.dumps(value, separators=(",", ":"), ensure_ascii=False))

    def _content(self, content: Any) -> int:
        if isinstance(content, str):
            return self.count_text(content)
        if not isinstance(content, list):
            return 0
        total = 0
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in TEXT_PART_TYPES and isinstance(part.get("text"), str):
                total += self.count_text(part["text"])
            elif isinstance(kind, str) and kind.endswith(("image", "image_url", "audio",
                                                          "input_audio", "video", "video_url")):
                total += self.media_part_tokens
            else:
                total += self._json(part)
        return total

    def _chat(self, body: dict[str, Any]) -> int:
        total = 0
        for message in body.get("messages") or ():
            total += MESSAGE_OVERHEAD_TOKENS + self._content(message.get("content"))
            total += sum(self._json(value) for key, value in message.items()
                         if key != "content" and value is not None)
        return total

    def prompt_tokens(self, request: CompletionRequest) -> int:
        """Prompt tokens of every prompt of `request` (one sequence each), never fewer than
        the client claimed."""
        body = request.body
        if request.endpoint is Endpoint.CHAT:
            counted = self._chat(body)
        else:
            counted = sum(self.count_text(p) if isinstance(p, str) else len(p)
                          for p in completion_prompts(body.get("prompt")))
        counted += sum(self._json(body[key]) for key in REQUEST_PARTS
                       if body.get(key) is not None)
        return max(counted, request.claimed_prompt_tokens or 0)


def trued_up_output_tokens(output_tokens: int, charged_prompt_tokens: int,
                           reported_prompt_tokens: int | None) -> int:
    """What to report as used at release so the bucket ends up charged the engine's own
    prompt count: the gate refunds (reserved output - used), so a prompt over-charged by D
    tokens is reported as D fewer output tokens (clamped at 0), an under-charge as D more.

    used = max(0, output + reported_prompt - charged_prompt)
    """
    if reported_prompt_tokens is None:
        return output_tokens
    return max(0, output_tokens + reported_prompt_tokens - charged_prompt_tokens)
