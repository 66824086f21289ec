"""A load generator for a borrowd proxy: trace-replayed interactive chat plus a batch backlog.

Interactive requests arrive as in a real chat trace (`azure2023_conv.csv`, rate-scaled, with
an optional burst), stream, and have their time to first token measured at the client. Batch
workers keep a backlog: each sends one request after another (lengths from the summarization
pool) and, when the budget refuses it (429), waits as told by Retry-After. Every request
becomes one `RequestRecord`; `summarize` turns them into per-class figures.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
import numpy as np
from borrowd.models.errors import InputError
from borrowd.models.sim.trace import Lengths, Trace
from borrowd.models.sim.workload import interactive_arrivals

INTERACTIVE = "interactive"
BATCH = "batch"


@dataclass(frozen=True)
class LoadgenConfig:
    """What to send, to where, for how long."""

    proxy_url: str
    interactive_key: str
    batch_key: str
    model: str = "emulated-llama-3-8b"
    duration_s: float = 60.0
    rate_scale: float = 0.5
    burst: tuple[float, float, float] | None = None  # (start_s, end_s, rate multiplier)
    interactive_max_output_tokens: int = 64
    batch_workers: int = 8
    batch_prompt_scale: float = 4.0
    batch_max_prompt_tokens: int = 32768
    batch_max_output_tokens: int = 256
    request_timeout_s: float = 120.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("duration_s", "rate_scale", "batch_prompt_scale", "request_timeout_s"):
            if not getattr(self, name) > 0:
                raise InputError(f"loadgen {name} must be > 0, got {getattr(self, name)!r}")
        for name in ("interactive_max_output_tokens", "batch_max_prompt_tokens",
                     "batch_max_output_tokens"):
            if getattr(self, name) < 1:
                raise InputError(f"loadgen {name} must be >= 1, got {getattr(self, name)!r}")
        if self.batch_workers < 0:
            raise InputError(f"loadgen batch_workers must be >= 0, got {self.batch_workers}")
        if self.burst is not None:
            start_s, end_s, multiplier = self.burst
            if not (0 <= start_s < end_s and multiplier > 0):
                raise InputError(f"loadgen burst must be START:END:MULT with START < END, "
                                 f"got {self.burst!r}")


# Outcomes, named as the proxy's `borrowd_proxy_requests_total{outcome}` names them.
SUCCESS = "success"
REJECTED = "rejected"  # 429 / 503: the budget (or a closed gate) said no; retried
REVOKED = "revoked"  # ended resumably (`finish_reason: preempted`)
ERROR = "error"
TRANSPORT = "transport"  # the status key of errors without an HTTP status


@dataclass(frozen=True)
class RequestRecord:
    """One request as the client saw it (times in seconds since the run started)."""

    request_class: str  # interactive | batch (`class` in JSON, as the proxy's label)
    start_s: float
    end_s: float
    status: int  # HTTP status; 0 when no response came (connection or timeout)
    outcome: str  # success | rejected | revoked | error
    prompt_tokens: int
    output_tokens: int
    ttft_s: float | None = None
    finish_reason: str = ""

    def to_json(self) -> str:
        """One strict JSON line (no NaN), `class` for the request class."""
        data = asdict(self)
        data["class"] = data.pop("request_class")
        return json.dumps(data, allow_nan=False)


@dataclass
class _Run:
    config: LoadgenConfig
    session: aiohttp.ClientSession
    clock: Callable[[], float]
    started: float
    records: list[RequestRecord] = field(default_factory=list)

    def now_s(self) -> float:
        return self.clock() - self.started


def parse_burst(text: str) -> tuple[float, float, float]:
    """`START:END:MULT` (seconds, seconds, factor) -> tuple; InputError when malformed."""
    parts = text.split(":")
    try:
        start_s, end_s, multiplier = (float(p) for p in parts)
    except ValueError:
        raise InputError(f"--burst must be START:END:MULT, got {text!r}") from None
    return start_s, end_s, multiplier


def interactive_schedule(trace: Trace, config: LoadgenConfig) -> list[tuple[float, int, int]]:
    """(arrival s, prompt tokens, output tokens) of the run's interactive requests."""
    burst_s = config.burst[:2] if config.burst else None
    multiplier = config.burst[2] if config.burst else 1.0
    arrivals = interactive_arrivals(trace, config.rate_scale, config.duration_s,
                                    burst_s=burst_s, multiplier=multiplier)
    outputs = np.minimum(arrivals.output_tokens, config.interactive_max_output_tokens)
    return [(float(t), int(p), max(1, int(o)))
            for t, p, o in zip(arrivals.arrival_s, arrivals.prompt_tokens, outputs, strict=True)]


def batch_lengths(lengths: Lengths, config: LoadgenConfig, index: int) -> tuple[int, int]:
    """(prompt, output) tokens of the `index`-th batch request (deterministic per seed)."""
    rng = np.random.default_rng(config.seed * 1_000_003 + index)
    pick = int(rng.integers(len(lengths.prompt_tokens)))
    prompt = int(min(lengths.prompt_tokens[pick] * config.batch_prompt_scale,
                     config.batch_max_prompt_tokens))
    output = int(min(lengths.output_tokens[pick], config.batch_max_output_tokens))
    return max(1, prompt), max(1, output)


def _body(config: LoadgenConfig, prompt_tokens: int, max_tokens: int, stream: bool) -> dict:
    return {
        "model": config.model,
        "messages": [{"role": "user", "content": "summarise the attached text"}],
        "max_tokens": max_tokens,
        "stream": stream,
        "borrowd_prompt_tokens": prompt_tokens,
    }


async def _interactive(run: _Run, prompt_tokens: int, max_tokens: int) -> None:
    config = run.config
    start = run.now_s()
    ttft: float | None = None
    tokens = 0
    finish = ""
    status = 0
    try:
        async with run.session.post(
            f"{config.proxy_url}/v1/chat/completions",
            json=_body(config, prompt_tokens, max_tokens, stream=True),
            headers={"Authorization": f"Bearer {config.interactive_key}",
                     "X-Request-Id": uuid.uuid4().hex},
        ) as resp:
            status = resp.status
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                for choice in chunk.get("choices", []):
                    if (choice.get("delta") or {}).get("content"):
                        tokens += 1
                        if ttft is None:
                            ttft = run.now_s() - start
                    finish = choice.get("finish_reason") or finish
    except (TimeoutError, aiohttp.ClientError, ValueError):
        status = 0 if status == 200 else status
    outcome = SUCCESS if status == 200 and tokens > 0 else ERROR
    run.records.append(RequestRecord(INTERACTIVE, start, run.now_s(), status, outcome,
                                     prompt_tokens, tokens, ttft, finish))


async def _batch_worker(run: _Run, lengths: Lengths, worker: int, stop_s: float) -> None:
    config = run.config
    index = worker
    while run.now_s() < stop_s:
        prompt_tokens, max_tokens = batch_lengths(lengths, config, index)
        start = run.now_s()
        status, tokens, finish, retry_s = 0, 0, "", 1.0
        try:
            async with run.session.post(
                f"{config.proxy_url}/v1/chat/completions",
                json=_body(config, prompt_tokens, max_tokens, stream=False),
                headers={"Authorization": f"Bearer {config.batch_key}",
                         "X-Request-Id": uuid.uuid4().hex},
            ) as resp:
                status = resp.status
                if status == 200:
                    body = await resp.json()
                    tokens = int(body.get("usage", {}).get("completion_tokens", 0))
                    finish = body["choices"][0].get("finish_reason") or ""
                else:
                    await resp.read()
                    retry_s = float(resp.headers.get("Retry-After", "1"))
        except (TimeoutError, aiohttp.ClientError, ValueError, KeyError, IndexError):
            status = 0 if status == 200 else status
        if status == 200:
            outcome = REVOKED if finish == "preempted" else SUCCESS
        elif status in (429, 503):
            outcome = REJECTED
        else:
            outcome = ERROR
        run.records.append(RequestRecord(BATCH, start, run.now_s(), status, outcome,
                                         prompt_tokens, tokens, None, finish))
        index += config.batch_workers
        if outcome in (REJECTED, ERROR):
            await asyncio.sleep(min(retry_s, max(0.0, stop_s - run.now_s())))


async def check_target(session: aiohttp.ClientSession, config: LoadgenConfig) -> None:
    """Raise InputError naming the flag at fault when the proxy cannot be reached, refuses an
    API key, or does not serve the model (`GET /v1/models` with each key)."""
    url = f"{config.proxy_url}/v1/models"
    for flag, key in (("--interactive-key", config.interactive_key),
                      ("--batch-key", config.batch_key)):
        try:
            async with session.get(url, headers={"Authorization": f"Bearer {key}"},
                                   timeout=aiohttp.ClientTimeout(total=10.0)) as resp:
                status, text = resp.status, await resp.text()
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise InputError(f"--proxy {config.proxy_url} cannot be reached: "
                             f"{exc or type(exc).__name__}") from None
        if status in (401, 403):
            raise InputError(f"{flag} is refused by the proxy at {config.proxy_url} "
                             f"(HTTP {status})")
        if status != 200:
            raise InputError(f"--proxy {url} answered HTTP {status}: {text[:200]}")
        try:
            served = sorted(str(m.get("id")) for m in json.loads(text).get("data", []))
        except (ValueError, AttributeError):
            raise InputError(f"--proxy {url} did not answer an OpenAI model list") from None
        if config.model not in served:
            raise InputError(f"--model {config.model!r} is not served at {config.proxy_url} "
                             f"(models: {', '.join(served) or 'none'})")


async def run_load(
    config: LoadgenConfig,
    trace: Trace,
    lengths: Lengths,
    *,
    clock: Callable[[], float] = time.monotonic,
) -> list[RequestRecord]:
    """Check the target (`check_target`), send the whole run and return every request's
    record (in completion order)."""
    schedule = interactive_schedule(trace, config)
    timeout = aiohttp.ClientTimeout(total=config.request_timeout_s)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        await check_target(session, config)
        run = _Run(config, session, clock, clock())
        tasks = [asyncio.create_task(_batch_worker(run, lengths, w, config.duration_s))
                 for w in range(config.batch_workers)]
        for arrival_s, prompt_tokens, output_tokens in schedule:
            delay = arrival_s - run.now_s()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_interactive(run, prompt_tokens, output_tokens)))
        await asyncio.gather(*tasks)
    return run.records


def summarize(records: list[RequestRecord], start_s: float = 0.0,
              end_s: float = math.inf) -> dict[str, Any]:
    """Per-class figures over requests that started in [start_s, end_s): strict JSON
    (None where there is nothing to measure), errors counted by HTTP status."""
    chosen = [r for r in records if start_s <= r.start_s < end_s]
    inter = [r for r in chosen if r.request_class == INTERACTIVE]
    batch = [r for r in chosen if r.request_class == BATCH]
    ttfts = np.array([r.ttft_s for r in inter if r.outcome == SUCCESS and r.ttft_s is not None],
                     dtype=float)
    done = [r for r in batch if r.outcome in (SUCCESS, REVOKED)]
    return {
        "interactive_requests": len(inter),
        "interactive_success_rate": (
            sum(r.outcome == SUCCESS for r in inter) / len(inter) if inter else None
        ),
        "interactive_ttft_p50_s": float(np.percentile(ttfts, 50)) if ttfts.size else None,
        "interactive_ttft_p95_s": float(np.percentile(ttfts, 95)) if ttfts.size else None,
        "interactive_errors_by_status": errors_by_status(inter),
        "batch_requests": len(batch),
        "batch_completed": len(done),
        "batch_revoked": sum(r.outcome == REVOKED for r in batch),
        "batch_rejected": sum(r.outcome == REJECTED for r in batch),
        "batch_errors_by_status": errors_by_status(batch),
        "batch_output_tokens": sum(r.output_tokens for r in done),
        "batch_prompt_tokens": sum(r.prompt_tokens for r in done),
    }


def errors_by_status(records: list[RequestRecord]) -> dict[str, int]:
    """How many of `records` failed, by HTTP status (`transport` when none came back)."""
    counts: dict[str, int] = {}
    for record in records:
        if record.outcome == ERROR:
            key = str(record.status) if record.status else TRANSPORT
            counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


def failures(summary: dict[str, Any]) -> list[str]:
    """What makes a run a failure: a class whose every request failed (not merely refused by
    the budget), each as `CLASS: N errors (STATUS: COUNT, ...)`."""
    out = []
    for name, sent, ok in (
        (INTERACTIVE, summary["interactive_requests"],
         round((summary["interactive_success_rate"] or 0.0) * summary["interactive_requests"])),
        (BATCH, summary["batch_requests"],
         summary["batch_completed"] + summary["batch_rejected"]),
    ):
        errors = summary[f"{name}_errors_by_status"]
        if sent and not ok and errors:
            detail = ", ".join(f"{status}: {count}" for status, count in errors.items())
            out.append(f"every {name} request failed ({detail})")
    return out
