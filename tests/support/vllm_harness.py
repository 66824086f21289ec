"""Drive vLLM's real V1 `Scheduler` on a CPU, and run one request stream through two engines.

Builds a scheduler from a folder holding only a Llama-3-8B `config.json` (no hub, no
weights), feeds it `Request`s, answers each step with a hand-built `ModelRunnerOutput`, and
runs the same stream through the native simulator engine and `VllmEngine` step by step, so
their decisions can be compared request by request (`run_lockstep`, `compare_traces`).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from borrowd.models.sim.engine import Engine, EngineConfig
from borrowd.models.sim.prefix_cache import OUTPUT_ID
from borrowd.models.sim.profiles import H100_LLAMA3_8B, StepProfile
from borrowd.models.sim.request import BATCH, INTERACTIVE, Request
from borrowd.models.sim.vllm_core import (
    VllmEngine,
    build_scheduler,
    default_model_dir,
    make_vllm_request,
    model_runner_output,
)

INTERACTIVE_PRIORITY = 0
BATCH_PRIORITY = 10
CACHED_TOKEN = 7  # the one token id of `add_cacheable` prompts (and of sampled tokens)


def model_dir() -> Path:
    """The Llama-3-8B config folder shared by this process's schedulers."""
    return default_model_dir()


def engine_config(**overrides: Any) -> EngineConfig:
    """A small replica config for tests: 8192-token steps, 16-token blocks, 4096 KV blocks."""
    kw: dict[str, Any] = {"num_gpu_blocks": 4096, "max_model_len": 32768 + 1024}
    kw.update(overrides)
    return EngineConfig(**kw)


def scheduler(config: EngineConfig, scheduler_cls: type | None = None, **kwargs: Any) -> Any:
    """A vLLM scheduler (or `scheduler_cls`) for `config`, on the shared model folder."""
    return build_scheduler(config, model_dir(), scheduler_cls, **kwargs)


def add(sched: Any, request_id: str, prompt_tokens: int, max_output_tokens: int,
        priority: int = INTERACTIVE_PRIORITY, arrival_s: float = 0.0) -> None:
    """Queue one request in a vLLM scheduler."""
    sched.add_request(make_vllm_request(request_id, prompt_tokens, max_output_tokens,
                                        arrival_s, priority))


def add_cacheable(sched: Any, request_id: str, prompt_tokens: int, max_output_tokens: int,
                  priority: int = INTERACTIVE_PRIORITY) -> None:
    """Queue a request whose prompt blocks are hashed, so vLLM's prefix cache can serve them
    (every prompt is one repeated token, so prompts share their leading blocks)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request as VllmRequest

    init_none_hash(sha256)
    sched.add_request(VllmRequest(
        request_id, [CACHED_TOKEN] * prompt_tokens,
        SamplingParams(max_tokens=max_output_tokens, ignore_eos=True), None,
        arrival_time=0.0, priority=priority,
        block_hasher=get_request_block_hasher(sched.block_size, sha256),
    ))


def step(sched: Any, drafts: int = 0) -> dict[str, int]:
    """One vLLM step (schedule, then the model's answer); the tokens scheduled per request.

    `drafts` > 0: the drafter proposes that many tokens for every request past its prefill,
    as an n-gram drafter on a repetitive prompt would (the verifier then rejects them all).
    """
    out = sched.schedule()
    sched.update_from_output(out, model_runner_output(sched, out))
    if drafts > 0:
        from vllm.v1.outputs import DraftTokenIds

        decoding = [rid for rid, req in sched.requests.items()
                    if req.num_output_tokens > 0 and not req.is_finished()]
        sched.update_draft_token_ids(
            DraftTokenIds(decoding, [[CACHED_TOKEN] * drafts for _ in decoding]))
    return dict(out.num_scheduled_tokens)


def first_token_step(sched: Any, request_id: str, max_steps: int = 500) -> int:
    """Steps until `request_id` has emitted its first token (its prefill completed)."""
    for k in range(1, max_steps + 1):
        step(sched)
        req = sched.requests.get(request_id)
        if req is None or req.num_output_tokens > 0:
            return k
    raise AssertionError(f"{request_id} had no first token within {max_steps} steps")


# -- the same stream through two engines -------------------------------------------------


@dataclass(frozen=True)
class Arrival:
    """A request joining the engine before step `step`."""

    step: int
    request_id: str
    klass: str
    prompt_tokens: int
    max_output_tokens: int
    priority: int
    segments: tuple[tuple[int, int], ...] = ()


@dataclass
class Trace:
    """What an engine decided: tokens per request per step, preemptions, finish order."""

    steps: list[dict[str, int]] = field(default_factory=list)
    preempted: list[tuple[int, str]] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    sim_s: float = 0.0


@dataclass(frozen=True)
class Agreement:
    """How far two traces agree (1.0 is identical)."""

    steps: tuple[int, int]
    step_match_frac: float
    token_agreement: float
    first_divergence: int | None
    same_completion_order: bool
    completion_pair_agreement: float
    preemptions: tuple[int, int]
    same_victims: bool


def mixed_stream(seed: int, n_interactive: int, n_batch: int, span_steps: int,
                 batch_prompt_max: int = 32768) -> list[Arrival]:
    """A seeded stream of chat-sized interactive and long-prompt batch requests."""
    rng = random.Random(seed)
    out = []
    for i in range(n_interactive):
        out.append(Arrival(rng.randrange(span_steps), f"i{i:03d}", INTERACTIVE,
                           rng.randint(20, 3000), rng.randint(5, 200), INTERACTIVE_PRIORITY))
    for i in range(n_batch):
        out.append(Arrival(rng.randrange(span_steps), f"b{i:03d}", BATCH,
                           rng.randint(1000, batch_prompt_max), rng.randint(10, 300),
                           BATCH_PRIORITY))
    return sorted(out, key=lambda a: (a.step, a.request_id))


def shared_prefix_stream(seed: int, conversations: int, turns: int, n_batch: int,
                         span_steps: int, batch_prompt_max: int = 16384) -> list[Arrival]:
    """A seeded stream whose prompts share prefixes: multi-turn conversations over three
    system prompts (turn k's prompt = turn k-1's prompt + its output + a new message) and
    batch questions over two long documents, with some unique batch prompts between."""
    rng = random.Random(seed)
    systems = [(1 + i, rng.randint(100, 2500)) for i in range(3)]
    documents = [(10 + i, rng.randint(2000, batch_prompt_max - 512)) for i in range(2)]
    next_id = 100
    out = []
    for c in range(conversations):
        segments: tuple[tuple[int, int], ...] = (rng.choice(systems),)
        step = rng.randrange(span_steps)
        for t in range(turns):
            segments += ((next_id, rng.randint(5, 600)),)
            next_id += 1
            output = rng.randint(5, 120)
            prompt = sum(length for _, length in segments)
            out.append(Arrival(step, f"c{c:02d}t{t}", INTERACTIVE, prompt, output,
                               INTERACTIVE_PRIORITY, segments))
            segments += ((OUTPUT_ID, output),)
            step += rng.randint(10, 120)
    for i in range(n_batch):
        step = rng.randrange(span_steps)
        if rng.random() < 0.7:
            doc = rng.choice(documents)
            segments = (doc, (next_id, rng.randint(20, 400)))
            next_id += 1
            prompt = sum(length for _, length in segments)
        else:
            segments = ()
            prompt = rng.randint(1000, batch_prompt_max)
        out.append(Arrival(step, f"b{i:03d}", BATCH, prompt, rng.randint(10, 300),
                           BATCH_PRIORITY, segments))
    return sorted(out, key=lambda a: (a.step, a.request_id))


def run_lockstep(make_engine: Callable[[], Any], stream: Sequence[Arrival],
                 max_steps: int = 20000) -> Trace:
    """Feed `stream` to a fresh engine step by step and record every decision."""
    engine = make_engine()
    trace = Trace()
    pending = list(stream)
    t_s = 0.0
    k = 0
    while k < max_steps and (pending or engine.has_work()):
        while pending and pending[0].step <= k:
            a = pending.pop(0)
            engine.add_request(Request(a.request_id, a.klass, a.prompt_tokens,
                                       a.max_output_tokens, arrival_s=float(a.step),
                                       priority=a.priority, segments=a.segments))
        out = engine.schedule()
        trace.steps.append(dict(out.num_scheduled_tokens))
        trace.preempted.extend((k, rid) for rid in sorted(out.preempted_req_ids))
        res = engine.update_from_output(out, t_s)
        trace.finished.extend(sorted(r.request_id for r in res.finished))
        t_s = res.end_s
        k += 1
    trace.sim_s = t_s
    return trace


def native_engine(
    config: EngineConfig, profile: StepProfile = H100_LLAMA3_8B
) -> Callable[[], Engine]:
    """Factory of the native engine for `run_lockstep`."""
    return lambda: Engine(config, profile)


def vllm_engine(
    config: EngineConfig, profile: StepProfile = H100_LLAMA3_8B
) -> Callable[[], VllmEngine]:
    """Factory of the vLLM-backed engine for `run_lockstep`."""
    return lambda: VllmEngine(config, profile, model_dir=model_dir())


def compare_traces(a: Trace, b: Trace) -> Agreement:
    """Agreement of two traces of the same stream (see `Agreement`)."""
    n = max(len(a.steps), len(b.steps))
    match = 0
    diff_tokens = 0
    all_tokens = 0
    first: int | None = None
    for k in range(n):
        sa = a.steps[k] if k < len(a.steps) else {}
        sb = b.steps[k] if k < len(b.steps) else {}
        if sa == sb:
            match += 1
        elif first is None:
            first = k
        for rid in sa.keys() | sb.keys():
            x, y = sa.get(rid, 0), sb.get(rid, 0)
            diff_tokens += abs(x - y)
            all_tokens += x + y
    pos_b = {rid: i for i, rid in enumerate(b.finished)}
    common = [rid for rid in a.finished if rid in pos_b]
    pairs = agree = 0
    for i, r1 in enumerate(common):
        for r2 in common[i + 1:]:
            pairs += 1
            agree += pos_b[r1] < pos_b[r2]
    return Agreement(
        steps=(len(a.steps), len(b.steps)),
        step_match_frac=match / n if n else 1.0,
        token_agreement=1.0 - diff_tokens / all_tokens if all_tokens else 1.0,
        first_divergence=first,
        same_completion_order=a.finished == b.finished,
        completion_pair_agreement=agree / pairs if pairs else 1.0,
        preemptions=(len(a.preempted), len(b.preempted)),
        same_victims=a.preempted == b.preempted,
    )
