"""An engine core backed by vLLM's real V1 `Scheduler`, with the native engine's interface.

`VllmEngine` is a drop-in for `models.sim.engine.Engine`: the same `add_request`,
`schedule`, `update_from_output`, `step`, `abort_request` and counters, the same
`SchedulerOutput` and `StepResult` types, so the fleet and `borrowd sim --engine vllm` run
any scenario with vLLM's own scheduling decisions while the step-time profile still
supplies time. vLLM (an optional extra) runs on a CPU without weights: its model config is
a folder holding only an 8B Llama-3 `config.json` (`write_model_dir`), nothing is fetched
from a hub, and the model runner is replaced by one sampled token per request whose prefill
is complete. Prefix caching follows the config's `enable_prefix_caching`: each request's
token ids are built from its content segments (`request_token_ids`: a content id always
gives the same tokens, generated tokens are the one sampled id), and vLLM hashes them.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import random
import tempfile
from pathlib import Path
from typing import Any, Literal, cast

from borrowd.models.errors import ConfigError
from borrowd.models.sim.engine import EngineConfig, SchedulerOutput, StepResult
from borrowd.models.sim.prefix_cache import OUTPUT_ID
from borrowd.models.sim.profiles import StepProfile
from borrowd.models.sim.request import (
    ABORTED,
    BATCH,
    FINISHED,
    INTERACTIVE,
    PREEMPTED,
    REFUSED,
    RUNNING,
    WAITING,
    Request,
)

VLLM_VERSION = "0.33.0"  # the version this module was checked against (see .ci/run)

# Shape of Meta-Llama-3-8B (its config.json on the hub): enough for vLLM's ModelConfig;
# the scheduler never touches weights.
LLAMA3_8B_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}

_SAMPLED_TOKEN = 7  # any id below the vocabulary size; EOS is ignored anyway
_CONTENT_TOKENS = (1000, 120000)  # range of content token ids (never the sampled one)
_content_cache: dict[object, list[int]] = {}


def vllm_available() -> bool:
    """True when vLLM can be imported (the optional `vllm` extra is installed)."""
    return importlib.util.find_spec("vllm") is not None


def require_vllm() -> None:
    """Raise `ConfigError` with the install lines when vLLM is absent."""
    if not vllm_available():
        raise ConfigError(
            f"the vLLM engine core needs vLLM {VLLM_VERSION}: pip install torch==2.13.0 && "
            f"pip install --no-deps vllm=={VLLM_VERSION} && pip install -e '.[vllm]' "
            "(see .ci/run)"
        )


def write_model_dir(path: Path | None = None) -> Path:
    """A folder holding only the 8B Llama-3 `config.json` (a new temp dir when `path` is None)."""
    folder = Path(path) if path is not None else Path(tempfile.mkdtemp(prefix="borrowd-llama3-"))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(LLAMA3_8B_CONFIG, indent=1))
    return folder


_DEFAULT_MODEL_DIR: list[Path] = []


def default_model_dir() -> Path:
    """One model folder shared by every engine of this process (written on first use)."""
    if not _DEFAULT_MODEL_DIR:
        _DEFAULT_MODEL_DIR.append(write_model_dir())
    return _DEFAULT_MODEL_DIR[0]


def build_scheduler(
    config: EngineConfig,
    model_dir: Path | None = None,
    scheduler_cls: type | None = None,
    *,
    speculative_tokens: int = 0,
    prefix_caching: bool = False,
    **scheduler_kwargs: Any,
) -> Any:
    """A vLLM V1 `Scheduler` (or `scheduler_cls`) configured like the native engine `config`.

    vLLM's block pool keeps one null block, so it gets `num_gpu_blocks + 1` blocks to leave
    the same number usable. `speculative_tokens` > 0 turns on n-gram speculative decoding
    (no draft model); `prefix_caching` vLLM's prefix cache. `scheduler_kwargs` go to the
    scheduler's constructor (the plugin's budget source and clocks).
    """
    require_vllm()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        SpeculativeConfig,
        VllmConfig,
    )
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    folder = model_dir if model_dir is not None else default_model_dir()
    model_config = ModelConfig(
        model=str(folder), skip_tokenizer_init=True, max_model_len=config.max_model_len,
        dtype="bfloat16",
    )
    scheduler_config = SchedulerConfig(
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_num_seqs=config.max_num_seqs,
        max_model_len=config.max_model_len,
        is_encoder_decoder=False,
        policy=cast(Literal["fcfs", "priority"], config.policy),
        long_prefill_token_threshold=config.long_prefill_token_threshold,
        enable_chunked_prefill=True,
        async_scheduling=False,
        scheduler_reserve_full_isl=config.admit_full_prompt,
    )
    cache_config = CacheConfig(block_size=config.block_size,
                               enable_prefix_caching=prefix_caching)
    speculative_config = None
    if speculative_tokens > 0:
        speculative_config = SpeculativeConfig(
            method="ngram", num_speculative_tokens=speculative_tokens, prompt_lookup_min=1,
            prompt_lookup_max=3, target_model_config=model_config,
            target_parallel_config=ParallelConfig(),
        )
    vllm_config = VllmConfig(
        model_config=model_config, scheduler_config=scheduler_config,
        cache_config=cache_config, device_config=DeviceConfig("cpu"),
        speculative_config=speculative_config,
    )
    num_blocks = config.num_gpu_blocks + 1
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    spec = FullAttentionSpec(
        block_size=config.block_size,
        num_kv_heads=LLAMA3_8B_CONFIG["num_key_value_heads"],
        head_size=LLAMA3_8B_CONFIG["head_dim"],
        dtype=torch.bfloat16,
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["model.layers"], spec)],
    )
    cls = scheduler_cls or Scheduler
    return cls(
        vllm_config=vllm_config, kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=config.block_size, **scheduler_kwargs,
    )


def content_tokens(content_id: object, length: int) -> list[int]:
    """Token ids of `length` tokens of content `content_id` (`OUTPUT_ID`: sampled tokens)."""
    if content_id == OUTPUT_ID:
        return [_SAMPLED_TOKEN] * length
    tokens = _content_cache.get(content_id)
    if tokens is None or len(tokens) < length:
        rng = random.Random(repr(content_id))
        tokens = [rng.randrange(*_CONTENT_TOKENS) for _ in range(length)]
        _content_cache[content_id] = tokens
    return tokens[:length]


def request_token_ids(req: Request) -> list[int]:
    """Prompt (and already generated) token ids of `req` from its content segments; tokens
    its segments do not cover are its own."""
    ids: list[int] = []
    for content_id, length in req.segments:
        ids += content_tokens(content_id, length)
    if len(ids) < req.prompt_tokens:
        ids += content_tokens(("own", req.request_id), req.prompt_tokens - len(ids))
    return ids[:req.prompt_tokens] + [_SAMPLED_TOKEN] * req.output_tokens


def make_vllm_request(
    request_id: str, prompt_tokens: int, max_output_tokens: int, arrival_s: float,
    priority: int = 0, token_ids: list[int] | None = None, block_size: int = 0,
) -> Any:
    """A vLLM `Request` with `prompt_tokens` placeholder token ids that never stops early."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request as VllmRequest

    hasher: dict[str, Any] = {}
    if block_size > 0:
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        init_none_hash(sha256)
        hasher["block_hasher"] = get_request_block_hasher(block_size, sha256)
    return VllmRequest(
        request_id, token_ids if token_ids is not None else [_SAMPLED_TOKEN] * prompt_tokens,
        SamplingParams(max_tokens=max_output_tokens, ignore_eos=True), None,
        arrival_time=arrival_s, priority=priority, **hasher,
    )


def model_runner_output(scheduler: Any, scheduler_output: Any) -> Any:
    """The model's answer to one step: one token per request whose prefill is complete.

    vLLM 0.34 dropped `req_id_to_index` (0.33 requires it); it is passed only where it exists.
    """
    from vllm.v1.outputs import ModelRunnerOutput

    ids = list(scheduler_output.num_scheduled_tokens)
    requests = scheduler.requests
    sampled = [
        [_SAMPLED_TOKEN] if requests[rid].num_computed_tokens >= requests[rid].num_tokens else []
        for rid in ids
    ]
    index: dict[str, Any] = {}
    if "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}:
        index["req_id_to_index"] = {rid: i for i, rid in enumerate(ids)}
    return ModelRunnerOutput(req_ids=ids, sampled_token_ids=sampled, **index)


class VllmEngine:
    """One replica whose scheduling is vLLM's own `Scheduler`, timed by a step profile.

    The simulator's `Request` objects mirror the vLLM requests after every step
    (`computed_tokens`, `output_tokens`, `blocks`, status, preemptions, recomputed tokens),
    so the fleet's metrics read them exactly as with the native engine.
    """

    def __init__(
        self, config: EngineConfig, profile: StepProfile, *, model_dir: Path | None = None,
        scheduler_cls: type | None = None, **scheduler_kwargs: Any,
    ) -> None:
        self.config = config
        self.profile = profile
        scheduler_kwargs.setdefault("prefix_caching", config.enable_prefix_caching)
        self._hashed = bool(scheduler_kwargs["prefix_caching"])
        self.scheduler = build_scheduler(config, model_dir, scheduler_cls, **scheduler_kwargs)
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._block_pool = self.scheduler.kv_cache_manager.block_pool
        self._last: tuple[SchedulerOutput, Any] | None = None

    # -- state read back from vLLM -------------------------------------------------------

    @property
    def free_blocks(self) -> int:
        """Free KV blocks (vLLM's null block excluded)."""
        return int(self._block_pool.get_num_free_blocks())

    @property
    def running(self) -> list[Request]:
        """Running requests in vLLM's running order."""
        return [self.requests[r.request_id] for r in self.scheduler.running]

    def has_work(self) -> bool:
        """True while any request is running or waiting."""
        return self.scheduler.get_num_unfinished_requests() > 0

    def kv_usage_frac(self) -> float:
        """Fraction of KV blocks in use (vLLM's `kv_cache_usage_perc`, 0..1)."""
        return 1.0 - self.free_blocks / self.config.num_gpu_blocks

    def num_running(self, klass: str | None = None) -> int:
        """Running requests, of one class or all."""
        if klass is None:
            return len(self.scheduler.running)
        return sum(1 for r in self.running if r.klass == klass)

    def waiting_requests(self) -> list[Request]:
        """The waiting requests (in no particular order)."""
        return [r for r in self.requests.values() if r.status in (WAITING, PREEMPTED)]

    def num_waiting(self, klass: str | None = None) -> int:
        """Waiting (queued or preempted) requests, of one class or all."""
        return sum(1 for r in self.waiting_requests() if klass is None or r.klass == klass)

    # -- requests ------------------------------------------------------------------------

    def add_request(self, req: Request) -> bool:
        """Queue `req`; refuse it (status REFUSED, `error` set) if it cannot ever fit."""
        cfg = self.config
        error = ""
        if req.prompt_tokens <= 0 or req.max_output_tokens <= 0:
            error = "prompt and max output tokens must be > 0"
        elif req.prompt_tokens + req.max_output_tokens > cfg.max_model_len:
            error = (
                f"This model's maximum context length is {cfg.max_model_len} tokens; the "
                f"request asks for {req.prompt_tokens + req.max_output_tokens}"
            )
        elif req.request_id in self.requests:
            error = f"duplicate request id {req.request_id!r}"
        if error:
            req.status = REFUSED
            req.error = error
            return False
        req.status = WAITING
        self.requests[req.request_id] = req
        self.scheduler.add_request(make_vllm_request(
            req.request_id, req.prompt_tokens + req.output_tokens,
            req.max_output_tokens - req.output_tokens, req.arrival_s, req.priority,
            token_ids=request_token_ids(req) if self._hashed else None,
            block_size=cfg.block_size if self._hashed else 0,
        ))
        return True

    def abort_request(self, request_id: str) -> Request | None:
        """Remove a waiting or running request and free its KV blocks; None if unknown."""
        from vllm.v1.request import RequestStatus

        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)
        req.blocks = 0
        req.status = ABORTED
        return req

    # -- one step ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """vLLM's `schedule()`, translated into the native engine's `SchedulerOutput`."""
        sched = self.scheduler
        vout = sched.schedule()
        vreqs = sched.requests
        preempted: list[Request] = []
        for rid in sorted(vout.preempted_req_ids or ()):
            req = self.requests[rid]
            req.recomputed_tokens += req.computed_tokens
            req.computed_tokens = 0
            req.preemptions += 1
            req.blocks = 0
            req.status = PREEMPTED
            preempted.append(req)
        self.num_preemptions += len(preempted)
        bs = self.config.block_size
        scheduled: list[tuple[Request, int]] = []
        decode_kv = 0
        pairs = 0
        for rid, n in vout.num_scheduled_tokens.items():
            req = self.requests[rid]
            computed = vreqs[rid].num_computed_tokens
            before = computed - n
            if n == 1:
                decode_kv += before + 1
            else:
                pairs += n * before + n * (n + 1) // 2
            if req.status != RUNNING and req.preemptions and before > 0:
                # Re-admitted with a prefix cache hit: that much is not computed again.
                req.recomputed_tokens -= min(before, req.recomputed_tokens)
            req.computed_tokens = computed
            req.blocks = -(-computed // bs)
            req.status = RUNNING
            scheduled.append((req, n))
        out = SchedulerOutput(
            num_scheduled_tokens=dict(vout.num_scheduled_tokens),
            total_num_scheduled_tokens=vout.total_num_scheduled_tokens,
            preempted_req_ids=tuple(r.request_id for r in preempted),
            decode_kv_tokens=decode_kv,
            prefill_pairs=pairs,
            scheduled=tuple(scheduled),
            preempted=tuple(preempted),
        )
        self._last = (out, vout)
        return out

    def step_duration_s(self, out: SchedulerOutput) -> float:
        """Duration of the step `out` under this replica's profile."""
        if out.total_num_scheduled_tokens <= 0:
            return 0.0
        return self.profile.step_s(
            out.total_num_scheduled_tokens, out.decode_kv_tokens, out.prefill_pairs
        )

    def update_from_output(self, out: SchedulerOutput, start_s: float) -> StepResult:
        """Finish the step `out` begun at `start_s` in vLLM and in the mirrored requests."""
        if self._last is None or self._last[0] is not out:
            raise RuntimeError("update_from_output must follow the matching schedule()")
        vout = self._last[1]
        self._last = None
        sched = self.scheduler
        duration = self.step_duration_s(out)
        observe_step_s = getattr(sched, "observe_step_s", None)
        if observe_step_s is not None and duration > 0:
            # A budget-enforcing scheduler (the borrowd plugin) times steps in profile time.
            observe_step_s(duration)
        sched.update_from_output(vout, model_runner_output(sched, vout))
        end = start_s + duration
        emitted: list[Request] = []
        first: list[Request] = []
        finished: list[Request] = []
        itl_other: list[float] = []
        steady = itok = btok = 0
        for req, n in out.scheduled:
            interactive = req.klass == INTERACTIVE
            if interactive:
                itok += n
            else:
                btok += n
            if req.computed_tokens < req.prompt_tokens + req.output_tokens:
                continue
            req.output_tokens += 1
            emitted.append(req)
            if req.first_token_s < 0:
                req.first_token_s = end
                first.append(req)
            elif interactive:
                if req.last_token_s == start_s:
                    steady += 1
                else:
                    itl_other.append(end - req.last_token_s)
            req.last_token_s = end
            if req.request_id not in sched.requests:
                finished.append(req)
        for req in finished:
            req.status = FINISHED
            req.finish_s = end
            req.blocks = 0
            del self.requests[req.request_id]
        running = self.running
        return StepResult(
            start_s=start_s,
            duration_s=duration,
            end_s=end,
            scheduled_tokens=out.total_num_scheduled_tokens,
            interactive_tokens=itok,
            batch_tokens=btok,
            emitted=emitted,
            first_tokens=first,
            finished=finished,
            preempted=list(out.preempted),
            itl_steady=steady,
            itl_other_s=itl_other,
            running_interactive=sum(1 for r in running if r.klass == INTERACTIVE),
            running_batch=sum(1 for r in running if r.klass == BATCH),
        )

    def step(self, start_s: float) -> StepResult | None:
        """Run one step starting at `start_s`; None when there is nothing to schedule.

        A schedule that only preempted (no tokens) is retried at once, as the native engine
        does.
        """
        while self.has_work():
            out = self.schedule()
            if out.total_num_scheduled_tokens > 0:
                return self.update_from_output(out, start_s)
            vout = self._last[1] if self._last is not None else None
            self._last = None
            if vout is not None:
                self.scheduler.update_from_output(vout, model_runner_output(self.scheduler, vout))
            if not out.preempted:
                return None
        return None
