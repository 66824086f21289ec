"""The emulator's OpenAI-compatible HTTP server (`borrowd emulate`).

Serves `/v1/completions` and `/v1/chat/completions` (streaming and not), `/v1/models`,
`/metrics` (vLLM's names, and the interference series of `adapters.interference`, with a
bucket bound at each `--slo-itl-s`) and
`/health`, like `vllm serve`. Semantics:

- Prompt length: `borrowd_prompt_tokens` when given, else the estimate of
  `adapters.proxy.openai` (whitespace words, about 4 characters per token).
- Output length: exactly `max_tokens` (or `max_completion_tokens`) tokens, as with vLLM's
  `ignore_eos=true`: the emulated model never stops early, and finish_reason is `length`.
  Without max_tokens it generates `default_max_tokens` (capped by the context length).
- `priority`: passed to the engine (lower first); rejected unless the policy is `priority`,
  as vLLM rejects it under FCFS. Request id: the `X-Request-Id` header when present.
- `stream_options.include_usage` adds the final usage chunk; `continuous_usage_stats` puts
  usage in every chunk, as vLLM does.
- A client disconnect aborts the request in the engine and frees its KV blocks at once.
- Extension for latency benchmarks: with `"borrowd_timing": true` every token chunk carries
  `borrowd_emitted_s` (CLOCK_MONOTONIC when the chunk was written, comparable across
  processes on one host) and the first one `borrowd_arrived_s` (when the request arrived).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
import uuid
from dataclasses import dataclass

from aiohttp import web
from borrowd.adapters.emulator.metrics import VllmMetrics
from borrowd.adapters.emulator.runtime import FINISHED, RealTimeEngine, Tracked
from borrowd.adapters.interference import InterferenceMetrics
from borrowd.adapters.proxy.openai import (
    CompletionRequest,
    Endpoint,
    FieldError,
    error_body,
    parse_completion_request,
)
from borrowd.models.errors import ConfigError
from borrowd.models.sim.engine import PRIORITY, Engine, EngineConfig
from borrowd.models.sim.profiles import get_profile
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "and", "runs",
         "far", "away", "into", "green", "hills")
"""Emulated output vocabulary: token i is " " + WORDS[i % len(WORDS)] (one token each)."""


@dataclass(frozen=True)
class EmulatorConfig:
    """Settings of one emulated vLLM server (vLLM's flag names where there is one)."""

    profile: str = "h100-llama3-8b"
    model_name: str = "emulated-llama-3-8b"
    engine_index: int = 0
    time_scale: float = 1.0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    long_prefill_token_threshold: int = 0
    kv_capacity_tokens: int | None = None
    block_size: int = 16
    policy: str = PRIORITY
    max_model_len: int = 131072
    default_max_tokens: int = 256
    slo_itl_s: tuple[float, ...] = ()  # the pool's ITL SLOs: bounds of the interference histogram

    def __post_init__(self) -> None:
        for slo_s in self.slo_itl_s:
            if not (math.isfinite(slo_s) and slo_s > 0):
                raise ConfigError(
                    f"emulator slo_itl_s (--slo-itl-s) must be finite and > 0 s, got {slo_s!r}")
        if self.time_scale <= 0:
            raise ConfigError(f"emulator time_scale must be > 0, got {self.time_scale}")
        if self.default_max_tokens <= 0:
            raise ConfigError(
                f"emulator default_max_tokens must be > 0, got {self.default_max_tokens}"
            )
        if self.kv_capacity_tokens is not None and self.kv_capacity_tokens < self.block_size:
            raise ConfigError(
                f"emulator kv_capacity_tokens must be >= block_size, got {self.kv_capacity_tokens}"
            )

    def build_engine(self) -> Engine:
        """The simulator engine these settings describe."""
        profile = get_profile(self.profile)
        kv_tokens = self.kv_capacity_tokens or profile.kv_capacity_tokens
        config = EngineConfig(
            num_gpu_blocks=kv_tokens // self.block_size,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            block_size=self.block_size,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            policy=self.policy,
            max_model_len=min(self.max_model_len, kv_tokens // self.block_size * self.block_size),
        )
        return Engine(config, profile)


class EmulatorServer:
    """One emulated replica behind its HTTP routes."""

    def __init__(self, config: EmulatorConfig) -> None:
        self.config = config
        self.registry = CollectorRegistry()
        engine = config.build_engine()
        engine_label = str(config.engine_index)
        self.metrics = VllmMetrics(self.registry, config.model_name, engine_label,
                                   engine.config.max_model_len, engine.config.block_size,
                                   engine.config.num_gpu_blocks)
        self.interference = InterferenceMetrics(self.registry, config.model_name, engine_label,
                                                config.slo_itl_s)
        self.runtime = RealTimeEngine(engine, self.metrics, self.interference,
                                      time_scale=config.time_scale)
        self._task: asyncio.Task | None = None

    def build_app(self) -> web.Application:
        """The aiohttp application (start it with handler cancellation on)."""
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health", self._health)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _app: web.Application) -> None:
        self._task = asyncio.create_task(self.runtime.run())

    async def _stop(self, _app: web.Application) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _health(self, _request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def _metrics(self, _request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _models(self, _request: web.Request) -> web.Response:
        body = {"object": "list", "data": [{
            "id": self.config.model_name, "object": "model", "created": int(time.time()),
            "owned_by": "borrowd-emulator",
            "max_model_len": self.runtime.engine.config.max_model_len,
        }]}
        return web.json_response(body)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, Endpoint.CHAT)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, Endpoint.COMPLETIONS)

    async def _generate(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        raw = await request.read()
        try:
            req = parse_completion_request(raw, endpoint)
            priority = self._priority(req)
            if req.n != 1:
                raise FieldError("n", "the emulator serves n = 1 only")
        except FieldError as exc:
            return _error(400, str(exc), "BadRequestError", exc.field)
        if req.model != self.config.model_name:
            return _error(404, f"The model `{req.model}` does not exist.", "NotFoundError",
                          "model")
        max_model_len = self.runtime.engine.config.max_model_len
        prompt_tokens = max(1, req.prompt_tokens)
        max_tokens = req.max_tokens or max(
            1, min(self.config.default_max_tokens, max_model_len - prompt_tokens))
        request_id = request.headers.get("X-Request-Id") or f"cmpl-{uuid.uuid4().hex}"
        try:
            tracked = self.runtime.add(request_id, prompt_tokens, max_tokens, priority)
        except ValueError as exc:
            return _error(400, str(exc), "BadRequestError", None)
        finished = False
        try:
            if req.stream:
                response = await self._stream(request, req, tracked, max_tokens)
            else:
                response = await self._whole(req, tracked, max_tokens)
            finished = True
            return response
        finally:
            if not finished:
                self.runtime.abort(request_id)

    def _priority(self, req: CompletionRequest) -> int:
        value = req.body.get("priority", 0)
        if value is None:
            return 0
        if isinstance(value, bool) or not isinstance(value, int):
            raise FieldError("priority", f"must be an integer, got {value!r}")
        if value != 0 and self.config.policy != PRIORITY:
            raise FieldError("priority", "priority scheduling is not enabled")
        return value

    async def _stream(self, request: web.Request, req: CompletionRequest, tracked: Tracked,
                      max_tokens: int) -> web.StreamResponse:
        options = req.body.get("stream_options") or {}
        continuous = bool(options.get("continuous_usage_stats"))
        timing = tracked.arrived_s if req.body.get("borrowd_timing") is True else None
        chunks = _ChunkWriter(req, tracked.request.request_id, tracked.request.prompt_tokens,
                              continuous, timing)
        response = web.StreamResponse(status=200, headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
            "X-Request-Id": tracked.request.request_id,
        })
        await response.prepare(request)
        if req.endpoint is Endpoint.CHAT:
            await response.write(chunks.role())
        queue = tracked.queue
        while True:
            item = await queue.get()
            parts = []
            while True:
                if item is FINISHED:
                    break
                parts.append(chunks.token(item, item >= max_tokens))
                if queue.empty():
                    break
                item = queue.get_nowait()
            if parts:
                await response.write(b"".join(parts))
            if item is FINISHED:
                break
        tail = chunks.usage(max_tokens) if req.include_usage else b""
        await response.write(tail + b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _whole(self, req: CompletionRequest, tracked: Tracked,
                     max_tokens: int) -> web.Response:
        while await tracked.queue.get() is not FINISHED:
            pass
        text = "".join(_word(i) for i in range(1, max_tokens + 1))
        prompt = tracked.request.prompt_tokens
        chat = req.endpoint is Endpoint.CHAT
        choice: dict = {"index": 0, "logprobs": None, "finish_reason": "length"}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        body = {
            "id": tracked.request.request_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": req.model, "choices": [choice],
            "usage": {"prompt_tokens": prompt, "completion_tokens": max_tokens,
                      "total_tokens": prompt + max_tokens},
        }
        return web.json_response(body, headers={"X-Request-Id": tracked.request.request_id})


def _word(index: int) -> str:
    return " " + WORDS[(index - 1) % len(WORDS)]


class _ChunkWriter:
    """Pre-formatted SSE chunks of one stream in vLLM's JSON layout."""

    def __init__(self, req: CompletionRequest, request_id: str, prompt_tokens: int,
                 continuous_usage: bool, timing_arrived_s: float | None) -> None:
        self.chat = req.endpoint is Endpoint.CHAT
        self.prompt_tokens = prompt_tokens
        self.continuous_usage = continuous_usage
        self.timing_arrived_s = timing_arrived_s
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        self.head = (f'data: {{"id":{json.dumps(request_id)},"object":"{kind}",'
                     f'"created":{int(time.time())},"model":{json.dumps(req.model)},')

    def _usage(self, completion_tokens: int) -> str:
        total = self.prompt_tokens + completion_tokens
        return (f'"usage":{{"prompt_tokens":{self.prompt_tokens},'
                f'"completion_tokens":{completion_tokens},"total_tokens":{total}}}')

    def role(self) -> bytes:
        """The first chat chunk: the assistant role and no content."""
        usage = "," + self._usage(0) if self.continuous_usage else ""
        return (self.head + '"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
                '"logprobs":null,"finish_reason":null}]' + usage + "}\n\n").encode()

    def token(self, count: int, last: bool) -> bytes:
        """The chunk of output token number `count` (1-based)."""
        text = _word(count)
        reason = '"length"' if last else "null"
        if self.chat:
            choice = f'{{"index":0,"delta":{{"content":"{text}"}},"logprobs":null,'
        else:
            choice = f'{{"index":0,"text":"{text}","logprobs":null,'
        usage = "," + self._usage(count) if self.continuous_usage else ""
        if self.timing_arrived_s is not None:
            usage += f',"borrowd_emitted_s":{time.monotonic()!r}'
            if count == 1:
                usage += f',"borrowd_arrived_s":{self.timing_arrived_s!r}'
        return (self.head + '"choices":[' + choice + f'"finish_reason":{reason}}}]'
                + usage + "}\n\n").encode()

    def usage(self, completion_tokens: int) -> bytes:
        """The final usage-only chunk (`stream_options.include_usage`)."""
        return (self.head + '"choices":[],' + self._usage(completion_tokens)
                + "}\n\n").encode()


def _error(status: int, message: str, kind: str, field: str | None) -> web.Response:
    return web.Response(status=status, body=error_body(status, message, kind=kind, field=field),
                        content_type="application/json")


async def serve(server: EmulatorServer, host: str, port: int,
                shutdown_timeout_s: float = 5.0) -> web.AppRunner:
    """Start `server` on host:port with handler cancellation (disconnect -> abort)."""
    runner = web.AppRunner(server.build_app(), handler_cancellation=True, access_log=None,
                           shutdown_timeout=shutdown_timeout_s)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=1024)
    await site.start()
    return runner
