"""Tests of prefix caching in the native engine (vLLM V1's block hashes, hits, LRU)."""

from __future__ import annotations

import random

import pytest
from borrowd.models.sim.engine import FCFS, PRIORITY, Engine, EngineConfig
from borrowd.models.sim.prefix_cache import BlockPool, block_hash
from borrowd.models.sim.profiles import H100_LLAMA3_8B
from borrowd.models.sim.request import BATCH, FINISHED, INTERACTIVE, Request


def make_engine(**overrides: object) -> Engine:
    """An engine with prefix caching on and a small KV pool."""
    kw: dict[str, object] = {"num_gpu_blocks": 400, "max_model_len": 6000}
    kw.update(overrides)
    return Engine(EngineConfig(**kw), H100_LLAMA3_8B)  # type: ignore[arg-type]


def drain(engine: Engine, now_s: float = 0.0) -> float:
    """Step until idle; return the end time."""
    for _ in range(100_000):
        res = engine.step(now_s)
        if res is None:
            return now_s
        now_s = res.end_s
    raise AssertionError("engine did not drain")


def check_pool(engine: Engine) -> None:
    """The engine's free count is the pool's; references equal the blocks requests hold."""
    pool = engine._pool
    assert pool is not None
    assert engine.free_blocks == pool.num_free
    held: dict[int, int] = {}
    for req in engine.running:
        assert len(req.block_ids) == req.blocks
        for b in req.block_ids:
            held[b] = held.get(b, 0) + 1
    for b, ref in enumerate(pool._ref):
        assert ref == held.get(b, 0)
        assert (ref == 0) == pool.is_free(b)
    assert all(not r.block_ids for r in engine.waiting_requests())


def test_block_hashes_chain_over_content() -> None:
    """Equal content at equal positions hashes equally; a different earlier block changes
    every later hash; generated tokens are content too."""
    a = Request("a", INTERACTIVE, 64, 10, 0.0, segments=((1, 32), (2, 32)))
    b = Request("b", INTERACTIVE, 64, 10, 0.0, segments=((1, 32), (3, 32)))
    c = Request("c", INTERACTIVE, 64, 10, 0.0, segments=((4, 32), (2, 32)))
    assert [block_hash(a, j, 16) for j in range(2)] == [block_hash(b, j, 16) for j in range(2)]
    assert block_hash(a, 2, 16) != block_hash(b, 2, 16)
    assert block_hash(a, 3, 16) != block_hash(c, 3, 16)
    turn2 = Request("t2", INTERACTIVE, 96, 10, 0.0, segments=((1, 32), (2, 32), (-1, 32)))
    assert [block_hash(a, j, 16) for j in range(6)] == [block_hash(turn2, j, 16)
                                                        for j in range(6)]


def test_shared_prefix_is_computed_once() -> None:
    """A second request with the same 1000-token prefix computes only its own tail, and the
    first's blocks are shared while both run."""
    engine = make_engine()
    a = Request("a", INTERACTIVE, 1100, 50, 0.0, segments=((10, 1000), (11, 100)))
    b = Request("b", INTERACTIVE, 1200, 50, 0.0, segments=((10, 1000), (12, 200)))
    engine.add_request(a)
    first = engine.schedule()
    engine.update_from_output(first, 0.0)
    engine.add_request(b)
    out = engine.schedule()
    assert out.num_scheduled_tokens["b"] == 1200 - (1000 // 16) * 16
    assert engine.prefix_cache_hit_tokens == (1000 // 16) * 16
    assert set(a.block_ids[:62]) == set(b.block_ids[:62])
    engine.update_from_output(out, 1.0)
    check_pool(engine)
    drain(engine, 2.0)
    assert a.status == b.status == FINISHED
    assert engine.free_blocks == engine.config.num_gpu_blocks


def test_whole_prompt_hit_still_computes_the_last_token() -> None:
    """A prompt cached in full is admitted with its last block recomputed (at most
    num_tokens - 1 tokens come from the cache), as vLLM does."""
    engine = make_engine()
    a = Request("a", INTERACTIVE, 320, 5, 0.0, segments=((5, 320),))
    engine.add_request(a)
    drain(engine)
    b = Request("b", INTERACTIVE, 320, 5, 10.0, segments=((5, 320),))
    engine.add_request(b)
    out = engine.schedule()
    assert out.num_scheduled_tokens["b"] == 16


def test_lru_evicts_least_recently_freed_first() -> None:
    """When the pool is short, blocks freed longest ago go first, a request's tail first:
    a 25-block filler takes the 20 never-used blocks and old's last 5; new's re-run then
    takes old's block 4 for its recomputed last block, so old keeps 4 cached blocks."""
    engine = make_engine(num_gpu_blocks=40, max_model_len=600)
    old = Request("old", INTERACTIVE, 160, 1, 0.0, segments=((1, 160),))
    new = Request("new", INTERACTIVE, 160, 1, 1.0, segments=((2, 160),))
    filler = Request("fill", INTERACTIVE, 400, 1, 2.0, segments=((3, 400),))
    for req in (old, new, filler):
        engine.add_request(req)
        drain(engine)
    again_new = Request("n2", INTERACTIVE, 160, 1, 3.0, segments=((2, 160),))
    engine.add_request(again_new)
    out = engine.schedule()
    assert out.num_scheduled_tokens["n2"] == 16  # 9 of its 10 blocks hit
    engine.update_from_output(out, 4.0)
    drain(engine, 4.0)
    again_old = Request("o2", INTERACTIVE, 160, 1, 5.0, segments=((1, 160),))
    engine.add_request(again_old)
    out = engine.schedule()
    assert out.num_scheduled_tokens["o2"] == 160 - 4 * 16


def test_preempted_request_finds_its_own_blocks() -> None:
    """With caching on, a preempted request re-admitted recomputes only what was evicted."""
    engine = make_engine(num_gpu_blocks=64, max_model_len=1024, policy=FCFS)
    a = Request("a", BATCH, 400, 300, 0.0)
    b = Request("b", BATCH, 400, 300, 1.0)
    engine.add_request(a)
    engine.add_request(b)
    drain(engine)
    assert a.status == b.status == FINISHED
    assert b.preemptions >= 1
    assert b.recomputed_tokens < 400 * b.preemptions
    assert engine.prefix_cache_hit_tokens > 0


@pytest.mark.parametrize("policy", [FCFS, PRIORITY], ids=["fcfs", "priority"])
def test_pool_conserved_with_shared_prefixes(policy: str) -> None:
    """Under KV pressure, preemptions and aborts, with prompts sharing prefixes, references
    and free blocks stay exact and everything is free at the end."""
    rng = random.Random(5)
    engine = make_engine(num_gpu_blocks=500, max_model_len=5000, policy=policy,
                         max_num_batched_tokens=1024, long_prefill_token_threshold=256)
    now = 0.0
    for step in range(2500):
        if rng.random() < 0.3:
            shared = rng.randrange(4)
            segments = ((100 + shared, rng.choice((64, 512, 1000))), (1000 + step, 40))
            prompt = sum(length for _, length in segments)
            klass = INTERACTIVE if rng.random() < 0.5 else BATCH
            engine.add_request(Request(f"r{step}", klass, prompt, rng.randint(1, 300), now,
                                       priority=0 if klass == INTERACTIVE else 1,
                                       segments=segments))
        if step % 89 == 0 and engine.requests:
            engine.abort_request(rng.choice(sorted(engine.requests)))
        res = engine.step(now)
        if res is not None:
            now = res.end_s
        check_pool(engine)
    assert engine.num_preemptions > 0
    assert engine.prefix_cache_hit_tokens > 0
    drain(engine, now)
    assert engine.free_blocks == engine.config.num_gpu_blocks


def test_free_queue_order_matches_vllm() -> None:
    """Freed hashed blocks go to the back tail-first; unhashed ones to the front."""
    pool = BlockPool(8, 4)
    req = Request("a", INTERACTIVE, 10, 1, 0.0, segments=((1, 10),))
    pool.allocate(req, 3)
    pool.cache(req, 10)  # blocks 0 and 1 are full, block 2 is partial
    assert pool.free_order() == [3, 4, 5, 6, 7]
    pool.release(req)
    assert pool.free_order() == [2, 3, 4, 5, 6, 7, 1, 0]
    assert pool.num_free == 8


def test_mooncake_trace_with_shared_prefixes_costs_less_prefill(tmp_path) -> None:
    """A Mooncake trace whose prompts share a 4k-token system prompt keeps the replica less
    busy with prefix caching on than off, at the same arrivals and the same figures else."""
    import json

    from borrowd.models.sim.run import run_scenario
    from borrowd.models.sim.scenario import SEED

    lines = [
        json.dumps({"timestamp": 300 * i, "input_length": 4096 + 300, "output_length": 30,
                    "hash_ids": [*range(8), 100 + i]})
        for i in range(400)
    ]
    path = tmp_path / "mooncake.jsonl"
    path.write_text("\n".join(lines) + "\n")
    busy = {}
    for caching in (True, False):
        scenario = SEED.with_overrides(replicas=1, interactive_trace=str(path), burst=None,
                                       enable_prefix_caching=caching)
        summary = run_scenario(scenario, "none", duration_s=100.0, rate_scale=1.0).summary()
        assert summary["interactive"]["requests"] > 300
        busy[caching] = summary["gpu_busy_frac"]
    assert busy[True] < 0.8 * busy[False]


def test_multi_turn_scenario_runs() -> None:
    """The multi-turn shape of the chat trace runs, and its turns hit the prefix cache."""
    from borrowd.models.sim.policies import parse_policy
    from borrowd.models.sim.run import load_inputs
    from borrowd.models.sim.scenario import SEED
    from borrowd.models.sim.simulation import Simulation

    scenario = SEED.with_overrides(interactive_shape="multi-turn", replicas=1, burst=None)
    trace, _ = load_inputs(scenario)
    sim = Simulation(scenario, parse_policy("none", scenario), duration_s=120.0, seed=0,
                     trace=trace, rate_scale=0.05)
    sim.run()
    assert sum(e.prefix_cache_hit_tokens for e in sim.fleet.engines) > 0
