"""One attempt of one batch item through the borrowd proxy, streamed.

The request carries the tenant's key, `X-Borrowd-Resumable: 1` (the opt-in to the proxy's
resumable `preempted` ending) and `stream: true` with usage in every chunk, so the worker
holds the text and token count so far whatever way the stream ends. Outcomes:

- `done`: the model finished (`stop`, `length`, ...);
- `cut`: the stream ended early (`preempted`, an error event, a broken connection): resume;
- `retry`: 429 or 503, wait `Retry-After`;
- `failed`: no answer or a 5xx before any output (counted towards the item's failures);
- `http_error`: a 4xx other than 429: the request itself is at fault.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from borrowd.adapters.proxy.openai import estimate_text_tokens
from borrowd.models.batch.input import CHAT_URL
from borrowd.models.batch.resume import PREEMPTED, ChunkAccumulator, Segment

RESUMABLE_HEADER = "X-Borrowd-Resumable"
"""Request header opting in to the proxy's resumable `preempted` ending."""
DEFAULT_RETRY_AFTER_S = 1.0


@dataclass(frozen=True)
class Attempt:
    """How one attempt ended and what it produced."""

    kind: str
    segment: Segment | None = None
    preempted: bool = False
    retry_after_s: float = 0.0
    status: int = 0
    error_body: dict[str, Any] | None = None
    request_id: str = ""
    detail: str = ""


def prompt_estimate(url: str, body: dict[str, Any]) -> int:
    """Token estimate of a request's prompt (when the upstream reports no usage)."""
    if url == CHAT_URL:
        return sum(estimate_text_tokens(m["content"]) + 4 for m in body["messages"]
                   if isinstance(m.get("content"), str))
    prompt = body["prompt"]
    return estimate_text_tokens(prompt if isinstance(prompt, str) else prompt[0])


async def attempt(session: aiohttp.ClientSession, proxy_url: str, api_key: str, url: str,
                  body: dict[str, Any], on_chunk: Callable[[ChunkAccumulator], None]) -> Attempt:
    """Send `body` (made streaming) to the proxy and follow the stream to its end."""
    request = dict(body)
    request["stream"] = True
    request["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json",
               RESUMABLE_HEADER: "1"}
    acc = ChunkAccumulator(chat=url == CHAT_URL)
    estimate = prompt_estimate(url, body)
    try:
        async with session.post(proxy_url.rstrip("/") + url, data=json.dumps(request),
                                headers=headers) as resp:
            request_id = resp.headers.get("X-Request-Id", "")
            if resp.status != 200:
                return await _refused(resp, request_id)
            done = await _follow(resp, acc, on_chunk)
    except (TimeoutError, aiohttp.ClientError) as exc:
        if not acc.parts:
            return Attempt("failed", detail=f"proxy unreachable or silent: {exc!r}")
        return Attempt("cut", acc.segment(estimate), detail=f"stream broke: {exc!r}")
    segment = acc.segment(estimate)
    if done and segment.finished:
        return Attempt("done", segment, request_id=request_id)
    if not acc.parts and acc.finish_reason != PREEMPTED:
        return Attempt("failed", detail="stream ended before any output")
    return Attempt("cut", segment, preempted=acc.finish_reason == PREEMPTED,
                   request_id=request_id, detail="stream ended early")


async def _follow(resp: aiohttp.ClientResponse, acc: ChunkAccumulator,
                  on_chunk: Callable[[ChunkAccumulator], None]) -> bool:
    """Feed every `data:` payload to `acc`; True when `[DONE]` arrived cleanly."""
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            return True
        try:
            chunk = json.loads(payload)
        except ValueError:
            continue
        if not isinstance(chunk, dict):
            continue
        if "error" in chunk:
            return False
        acc.feed(chunk)
        on_chunk(acc)
    return False


async def _refused(resp: aiohttp.ClientResponse, request_id: str) -> Attempt:
    try:
        body = await resp.json(content_type=None)
    except (ValueError, aiohttp.ClientError):
        body = {"error": {"message": (await resp.text())[:300], "type": "upstream_error"}}
    if not isinstance(body, dict):
        body = {"error": {"message": str(body)[:300], "type": "upstream_error"}}
    if resp.status in (429, 503):
        try:
            retry_after_s = float(resp.headers.get("Retry-After", DEFAULT_RETRY_AFTER_S))
        except ValueError:
            retry_after_s = DEFAULT_RETRY_AFTER_S
        return Attempt("retry", retry_after_s=max(0.0, retry_after_s), status=resp.status,
                       error_body=body, request_id=request_id)
    if resp.status >= 500:
        return Attempt("failed", status=resp.status, error_body=body, request_id=request_id,
                       detail=f"proxy answered {resp.status}")
    return Attempt("http_error", status=resp.status, error_body=body, request_id=request_id)
