"""One proxied generation request as it progresses, and the relay of its upstream stream.

`Relay.on_body` is the proxy's per-chunk path: it runs in the upstream connection's data
callback and writes to the client's transport, with no task switch per chunk.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from borrowd.adapters.proxy.http1 import Responder
from borrowd.adapters.proxy.metrics import ProxyMetrics
from borrowd.adapters.proxy.openai import CompletionRequest
from borrowd.adapters.proxy.sse import StreamTally, event_payload, strip_usage, take_complete


@dataclass(slots=True)
class Exchange:
    """One proxied generation request as it progresses (mutable, per request)."""

    request_id: str
    request_class: str
    arrived_s: float
    request: CompletionRequest
    requested_max_tokens: int | None
    outcome: str = "error"
    output_tokens: int = 0
    prompt_tokens: int = 0
    tally: StreamTally | None = None
    resumable: bool = False
    charged_prompt_tokens: int = 0
    batch_eligible_upstream: bool = True  # whether the upstream serving it may take batch


class Relay:
    """Forwards one upstream SSE stream to its client, chunk by chunk, measuring as it goes.

    `on_body` runs in the upstream connection's data callback: it takes the complete
    events, tallies each payload (token? usage-only?), observes TTFT on the first token and
    ITL between tokens, and writes the events on unchanged in one write, less what the
    client did not ask for: usage-only chunks (`strip_usage`) and the usage inside each
    chunk (`strip_chunk_usage`, a batch stream's forced continuous usage).
    """

    __slots__ = ("_buffer", "_clock", "_ex", "_itl", "_last_token_s", "_metrics", "_out",
                 "_strip_chunk_usage", "_strip_usage", "_tally", "_ttft", "done")

    def __init__(self, ex: Exchange, tally: StreamTally, out: Responder | None,
                 metrics: ProxyMetrics, clock: Callable[[], float], strip_usage: bool,
                 strip_chunk_usage: bool = False) -> None:
        self._ex = ex
        self._tally = tally
        self._out = out
        self._metrics = metrics
        group = (ex.request_class, ex.batch_eligible_upstream)
        self._ttft = metrics.ttft[group]
        self._itl = metrics.itl[group]
        self._clock = clock
        self._strip_usage = strip_usage
        self._strip_chunk_usage = strip_chunk_usage
        self._buffer = bytearray()
        self._last_token_s = -1.0
        self.done: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    def on_body(self, data: bytes) -> None:
        """Take, tally and forward the complete events in `data`."""
        complete = take_complete(self._buffer, data)
        if not complete:
            return
        kept: list[bytes] | None = None
        events = complete.split(b"\n\n")
        for index, event in enumerate(events):
            payload = event_payload(event) if event else None
            if payload is None:
                continue
            has_token, usage_only = self._tally.observe(payload)
            if has_token:
                now_s = self._clock()
                if self._last_token_s < 0:
                    self._ttft.observe(now_s - self._ex.arrived_s)
                    self._metrics.tracker.settled(self._ex.request_class, self._ex.request_id)
                else:
                    self._itl.observe(now_s - self._last_token_s)
                self._last_token_s = now_s
            if usage_only and self._strip_usage:
                if kept is None:
                    kept = [e for e in events[:index] if e]
                continue
            if self._strip_chunk_usage and not usage_only:
                stripped = b"data: " + strip_usage(payload)
                if stripped != event:
                    if kept is None:
                        kept = [e for e in events[:index] if e]
                    kept.append(stripped)
                    continue
            if kept is not None:
                kept.append(event)
        if self._out is not None:
            if kept is None:
                self._out.write(complete)
            elif kept:
                self._out.write(b"\n\n".join(kept) + b"\n\n")

    def on_end(self, failure: str) -> None:
        """The upstream response ended ("" when complete, else why not)."""
        if not self.done.done():
            self.done.set_result(failure)
