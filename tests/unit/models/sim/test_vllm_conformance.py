"""The native engine against vLLM's real V1 scheduler on the same request stream, step by step.

The native engine follows vLLM's rules D1-D3 of docs/conformance.md, so every case agrees.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs the optional vLLM extra (see .ci/run)")

from borrowd.models.sim.engine import Engine
from borrowd.models.sim.profiles import H100_LLAMA3_8B
from borrowd.models.sim.request import BATCH, FINISHED, INTERACTIVE, REFUSED, Request
from borrowd.models.sim.vllm_core import VllmEngine

from tests.support import vllm_harness as h

pytestmark = pytest.mark.vllm

CASES = [
    pytest.param(dict(), 1, id="priority-whole-prefills"),
    pytest.param(dict(policy="fcfs"), 1, id="fcfs-whole-prefills"),
    pytest.param(dict(long_prefill_token_threshold=2048), 1, id="priority-chunked"),
    pytest.param(dict(long_prefill_token_threshold=512, policy="fcfs", num_gpu_blocks=2200), 1,
                 id="fcfs-chunked-kv-pressure"),
    pytest.param(dict(long_prefill_token_threshold=1024, num_gpu_blocks=2120), 2,
                 id="priority-chunked-kv-pressure"),
]


@pytest.mark.parametrize(("overrides", "seed"), CASES)
def test_native_engine_schedules_like_vllm(overrides: dict, seed: int) -> None:
    """Same tokens per request per step, finish order and preemption victims as vLLM."""
    config = h.engine_config(**overrides)
    stream = h.mixed_stream(seed, n_interactive=40, n_batch=8, span_steps=200)
    native = h.run_lockstep(h.native_engine(config), stream)
    vllm = h.run_lockstep(h.vllm_engine(config), stream)
    agreement = h.compare_traces(native, vllm)
    assert agreement.first_divergence is None, agreement
    assert agreement.same_completion_order
    assert agreement.same_victims


PREFIX_CASES = [
    pytest.param(dict(), 1, id="priority-whole-prefills"),
    pytest.param(dict(policy="fcfs"), 2, id="fcfs-whole-prefills"),
    pytest.param(dict(long_prefill_token_threshold=1024), 3, id="priority-chunked"),
    pytest.param(dict(long_prefill_token_threshold=512, policy="fcfs", num_gpu_blocks=1500), 4,
                 id="fcfs-chunked-kv-pressure"),
    pytest.param(dict(long_prefill_token_threshold=1024, num_gpu_blocks=1400), 5,
                 id="priority-chunked-kv-pressure"),
    pytest.param(dict(num_gpu_blocks=1800, max_num_seqs=12), 6, id="priority-few-seqs-evicting"),
]


@pytest.mark.parametrize(("overrides", "seed"), PREFIX_CASES)
def test_prefix_caching_schedules_like_vllm(overrides: dict, seed: int) -> None:
    """With prefix caching on and prompts sharing prefixes (multi-turn chat over shared
    system prompts, batch questions over shared documents), the native engine schedules
    every step, finish and victim as vLLM does, and both serve cached tokens."""
    config = h.engine_config(enable_prefix_caching=True, max_model_len=17408, **overrides)
    stream = h.shared_prefix_stream(seed, conversations=12, turns=4, n_batch=10,
                                    span_steps=150)
    native_engine = Engine(config, H100_LLAMA3_8B)
    native = h.run_lockstep(lambda: native_engine, stream)
    vllm_engine = VllmEngine(config, H100_LLAMA3_8B, model_dir=h.model_dir())
    vllm = h.run_lockstep(lambda: vllm_engine, stream)
    agreement = h.compare_traces(native, vllm)
    assert agreement.first_divergence is None, agreement
    assert agreement.same_completion_order
    assert agreement.same_victims
    assert native_engine.prefix_cache_hit_tokens > 0


def test_kv_pressure_stream_preempts_in_vllm() -> None:
    """The KV-pressure stream really makes vLLM preempt (so the cases above test victims)."""
    config = h.engine_config(long_prefill_token_threshold=1024, num_gpu_blocks=2120)
    trace = h.run_lockstep(h.vllm_engine(config), h.mixed_stream(2, 40, 8, 200))
    assert len(trace.preempted) >= 5
    assert {rid[0] for _, rid in trace.preempted} <= {"b", "i"}


def test_vllm_engine_finishes_every_request_and_frees_kv() -> None:
    """Every request ends with exactly its output tokens and the KV pool is whole again."""
    config = h.engine_config(long_prefill_token_threshold=1024, num_gpu_blocks=2120)
    engine = VllmEngine(config, H100_LLAMA3_8B, model_dir=h.model_dir())
    reqs = [Request(a.request_id, a.klass, a.prompt_tokens, a.max_output_tokens,
                    arrival_s=float(a.step), priority=a.priority)
            for a in h.mixed_stream(3, 20, 4, 1)]
    for req in reqs:
        assert engine.add_request(req)
    t_s = 0.0
    while (res := engine.step(t_s)) is not None:
        t_s = res.end_s
    assert all(r.status == FINISHED and r.output_tokens == r.max_output_tokens for r in reqs)
    assert engine.free_blocks == config.num_gpu_blocks
    assert engine.num_preemptions == sum(r.preemptions for r in reqs)
    assert all(r.recomputed_tokens > 0 for r in reqs if r.preemptions)


def test_vllm_engine_times_steps_like_native() -> None:
    """On a stream both schedule alike, both engines end at the same simulated time."""
    config = h.engine_config()
    stream = h.mixed_stream(1, 10, 2, 20)
    native = h.run_lockstep(lambda: Engine(config, H100_LLAMA3_8B), stream)
    vllm = h.run_lockstep(h.vllm_engine(config), stream)
    assert vllm.sim_s == pytest.approx(native.sim_s, rel=1e-12)


@pytest.mark.parametrize(("prompt", "output", "error"), [
    (0, 10, "must be > 0"),
    (40000, 10, "maximum context length"),
], ids=["empty-prompt", "too-long"])
def test_vllm_engine_refuses_like_native(prompt: int, output: int, error: str) -> None:
    """Requests vLLM's server would refuse are refused with the native engine's message."""
    engine = VllmEngine(h.engine_config(), H100_LLAMA3_8B, model_dir=h.model_dir())
    req = Request("r", INTERACTIVE, prompt, output, arrival_s=0.0)
    assert not engine.add_request(req)
    assert req.status == REFUSED and error in req.error


def test_vllm_engine_abort_frees_kv() -> None:
    """Aborting a running request returns its blocks to the pool."""
    config = h.engine_config()
    engine = VllmEngine(config, H100_LLAMA3_8B, model_dir=h.model_dir())
    engine.add_request(Request("b", BATCH, 5000, 100, arrival_s=0.0, priority=10))
    engine.step(0.0)
    assert engine.free_blocks < config.num_gpu_blocks
    assert engine.abort_request("b") is not None
    assert engine.free_blocks == config.num_gpu_blocks and not engine.has_work()


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["priority", "unrestricted"])
def test_seed_scenario_runs_alike_on_both_cores(policy: str) -> None:
    """A short `seed` run gives the same figures on the native core and on vLLM's scheduler."""
    from borrowd.models.sim.run import run_scenario
    from borrowd.models.sim.scenario import get_scenario

    scenario = get_scenario("seed")
    figures = {}
    for engine in ("native", "vllm"):
        summary = run_scenario(scenario, policy, duration_s=60.0, seed=1, rate_scale=0.27,
                               engine=engine).summary()
        for key in ("wall_s", "speed"):
            summary.pop(key)
        figures[engine] = summary
    assert figures["vllm"]["interactive"]["requests"] > 0
    assert figures["vllm"] == figures["native"]
