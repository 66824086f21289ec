"""Tests of one simulated replica: vLLM V1 scheduling, KV blocks, preemption, timing."""

from __future__ import annotations

import random

import pytest
from borrowd.models.errors import ConfigError
from borrowd.models.sim.engine import FCFS, PRIORITY, Engine, EngineConfig
from borrowd.models.sim.profiles import H100_LLAMA3_8B
from borrowd.models.sim.request import BATCH, FINISHED, INTERACTIVE, REFUSED, Request


def make_engine(**overrides: object) -> Engine:
    """An engine on the H100 profile with `overrides` on a small default config."""
    kw: dict[str, object] = {"num_gpu_blocks": 10_000, "max_model_len": 131072}
    kw.update(overrides)
    return Engine(EngineConfig(**kw), H100_LLAMA3_8B)  # type: ignore[arg-type]


def run_to_idle(engine: Engine, now_s: float = 0.0, max_steps: int = 100_000) -> float:
    """Step until the engine is idle; return the end time."""
    for _ in range(max_steps):
        res = engine.step(now_s)
        if res is None:
            return now_s
        now_s = res.end_s
    raise AssertionError("engine did not drain")


def check_blocks(engine: Engine) -> None:
    """Free blocks plus blocks held by running requests equal the pool; waiting hold none."""
    held = sum(r.blocks for r in engine.running)
    assert engine.free_blocks + held == engine.config.num_gpu_blocks
    assert all(r.blocks == 0 for r in engine.waiting_requests())
    bs = engine.config.block_size
    for r in engine.running:
        assert r.blocks * bs >= r.computed_tokens


@pytest.mark.parametrize("policy", [FCFS, PRIORITY], ids=["fcfs", "priority"])
@pytest.mark.parametrize("full", [True, False], ids=["full-prompt", "per-chunk"])
def test_kv_blocks_conserved_under_pressure(policy: str, full: bool) -> None:
    """Blocks are never lost or double counted, even with many preemptions and aborts."""
    rng = random.Random(7)
    engine = make_engine(
        num_gpu_blocks=600, max_model_len=9000, policy=policy, admit_full_prompt=full,
        max_num_batched_tokens=2048,
    )
    now = 0.0
    n = 0
    for step in range(3000):
        if rng.random() < 0.3:
            klass = INTERACTIVE if rng.random() < 0.5 else BATCH
            engine.add_request(
                Request(f"r{n}", klass, rng.randint(1, 3000), rng.randint(1, 400), now,
                        priority=0 if klass == INTERACTIVE else 1)
            )
            n += 1
        if step % 97 == 0 and engine.requests:
            engine.abort_request(rng.choice(sorted(engine.requests)))
        res = engine.step(now)
        if res is not None:
            now = res.end_s
        check_blocks(engine)
    assert engine.num_preemptions > 0
    run_to_idle(engine, now)
    assert engine.free_blocks == engine.config.num_gpu_blocks


def test_preempted_request_is_recomputed_and_finishes() -> None:
    """Without prefix caching a preempted request restarts from zero, counts the lost work,
    and still completes."""
    engine = make_engine(num_gpu_blocks=64, max_model_len=1024, policy=FCFS,
                         enable_prefix_caching=False)
    a = Request("a", BATCH, 400, 300, 0.0)
    b = Request("b", BATCH, 400, 300, 1.0)
    engine.add_request(a)
    engine.add_request(b)
    run_to_idle(engine)
    assert a.status == FINISHED and b.status == FINISHED
    assert a.output_tokens == 300 and b.output_tokens == 300
    victim = b  # FCFS preempts the last running request
    assert victim.preemptions >= 1
    assert victim.recomputed_tokens >= 400
    assert a.preemptions == 0


def test_priority_victim_is_largest_priority_then_newest() -> None:
    """Under the priority policy the victim has the largest (priority, arrival)."""
    engine = make_engine(num_gpu_blocks=96, max_model_len=1536, policy=PRIORITY)
    reqs = [
        Request("hi-old", INTERACTIVE, 300, 400, 0.0, priority=0),
        Request("lo-old", BATCH, 300, 400, 1.0, priority=1),
        Request("lo-new", BATCH, 300, 400, 2.0, priority=1),
        Request("hi-new", INTERACTIVE, 300, 400, 3.0, priority=0),
    ]
    for r in reqs:
        engine.add_request(r)
    first_victims = []
    now = 0.0
    while engine.has_work():
        res = engine.step(now)
        assert res is not None
        now = res.end_s
        first_victims.extend(r.request_id for r in res.preempted)
    assert first_victims[0] == "lo-new"
    assert reqs[0].preemptions == 0


def test_waiting_order_priority_then_arrival() -> None:
    """Waiting requests are admitted by (priority, arrival) under the priority policy."""
    engine = make_engine(max_num_seqs=1, policy=PRIORITY)
    engine.add_request(Request("b1", BATCH, 10, 1, 0.0, priority=1))
    engine.add_request(Request("i2", INTERACTIVE, 10, 1, 2.0, priority=0))
    engine.add_request(Request("i1", INTERACTIVE, 10, 1, 1.0, priority=0))
    order = []
    now = 0.0
    while engine.has_work():
        res = engine.step(now)
        assert res is not None
        now = res.end_s
        order.extend(r.request_id for r in res.finished)
    assert order == ["i1", "i2", "b1"]


def test_fcfs_ignores_priority() -> None:
    """Under FCFS, admission follows arrival order whatever the priority."""
    engine = make_engine(max_num_seqs=1, policy=FCFS)
    engine.add_request(Request("b1", BATCH, 10, 1, 0.0, priority=1))
    engine.add_request(Request("i1", INTERACTIVE, 10, 1, 1.0, priority=0))
    out = engine.schedule()
    assert list(out.num_scheduled_tokens) == ["b1"]


@pytest.mark.parametrize(
    ("prompt", "threshold", "expected"),
    [
        (20000, 0, [8192, 8192, 3616]),
        (5000, 0, [5000]),
        (5000, 2048, [2048, 2048, 904]),
    ],
    ids=["budget-chunks", "fits-one-step", "long-prefill-threshold"],
)
def test_chunked_prefill(prompt: int, threshold: int, expected: list[int]) -> None:
    """A long prompt is prefilled in chunks of the budget or of the long-prefill threshold."""
    engine = make_engine(long_prefill_token_threshold=threshold)
    req = Request("p", INTERACTIVE, prompt, 2, 0.0)
    engine.add_request(req)
    engine.add_request(Request("other", INTERACTIVE, 1, 10_000, 1.0))  # threshold needs two
    chunks = []
    now = 0.0
    while req.first_token_s < 0:
        out = engine.schedule()
        chunks.append(out.num_scheduled_tokens["p"])
        now = engine.update_from_output(out, now).end_s
    assert chunks == expected
    assert req.first_token_s == now


def test_running_decodes_come_before_new_prefill() -> None:
    """Running requests take their tokens first; a new prompt gets what budget is left."""
    engine = make_engine(max_num_batched_tokens=1000)
    for i in range(10):
        engine.add_request(Request(f"d{i}", INTERACTIVE, 50, 100, 0.0))
    engine.step(0.0)
    engine.add_request(Request("long", BATCH, 5000, 10, 1.0, priority=1))
    out = engine.schedule()
    assert all(out.num_scheduled_tokens[f"d{i}"] == 1 for i in range(10))
    assert out.num_scheduled_tokens["long"] == 990


def test_max_num_seqs_caps_running() -> None:
    """No more than max_num_seqs requests run at once."""
    engine = make_engine(max_num_seqs=3)
    for i in range(10):
        engine.add_request(Request(f"r{i}", INTERACTIVE, 10, 5, 0.0))
    engine.step(0.0)
    assert engine.num_running() == 3
    assert engine.num_waiting() == 7


def test_request_beyond_max_model_len_is_refused() -> None:
    """A request longer than max_model_len is refused with an error, as vLLM's server does."""
    engine = make_engine()
    req = Request("big", BATCH, 130000, 2000, 0.0)
    assert not engine.add_request(req)
    assert req.status == REFUSED
    assert "131072" in req.error
    assert not engine.has_work()


def test_abort_frees_kv_at_once() -> None:
    """Aborting a running request returns its blocks immediately."""
    engine = make_engine()
    engine.add_request(Request("x", BATCH, 1600, 100, 0.0))
    engine.step(0.0)
    assert engine.free_blocks == engine.config.num_gpu_blocks - 100
    aborted = engine.abort_request("x")
    assert aborted is not None
    assert engine.free_blocks == engine.config.num_gpu_blocks
    assert engine.abort_request("x") is None


def test_step_time_grows_with_tokens_and_context() -> None:
    """Prefill steps take longer than decode steps; decode time grows with KV attended."""
    engine = make_engine()
    engine.add_request(Request("a", INTERACTIVE, 4096, 50, 0.0))
    prefill = engine.step(0.0)
    assert prefill is not None
    decode = engine.step(prefill.end_s)
    assert decode is not None
    assert prefill.duration_s > 0.084
    expected = H100_LLAMA3_8B.linear_s(1) + H100_LLAMA3_8B.decode_s_per_kv_token * 4097
    assert decode.duration_s == pytest.approx(expected)


def test_itl_steady_counts_consecutive_decode_steps() -> None:
    """Interactive tokens decoded in back-to-back steps are counted as steady gaps."""
    engine = make_engine()
    engine.add_request(Request("a", INTERACTIVE, 10, 5, 0.0))
    now = 0.0
    steady = 0
    while engine.has_work():
        res = engine.step(now)
        assert res is not None
        steady += res.itl_steady
        assert res.itl_other_s == []
        now = res.end_s
    assert steady == 4


@pytest.mark.parametrize(
    ("field", "value"),
    [("num_gpu_blocks", 0), ("policy", "lifo"), ("max_model_len", 10**9)],
    ids=["no-blocks", "bad-policy", "model-len-over-kv"],
)
def test_bad_engine_config_is_rejected(field: str, value: object) -> None:
    """A bad engine setting raises ConfigError naming it."""
    kw: dict[str, object] = {"num_gpu_blocks": 10_000, "max_model_len": 131072, field: value}
    with pytest.raises(ConfigError, match=field):
        EngineConfig(**kw)  # type: ignore[arg-type]


def test_decode_span_equals_steps_one_by_one() -> None:
    """A closed-form decode span ends where the same steps run one by one end."""
    engines = [make_engine(), make_engine()]
    for engine in engines:
        for i in range(5):
            engine.add_request(Request(f"r{i}", INTERACTIVE, 100 + 37 * i, 40 + 9 * i, 0.0))
        res = engine.step(0.0)
        assert res is not None
        res = engine.step(res.end_s)  # every request has now decoded in the step before
        assert res is not None
    start = res.end_s
    span = engines[0].decode_span(start, start + 0.2)
    assert span is not None and span.span_steps > 2
    now, durations = start, []
    for _ in range(span.span_steps):
        one = engines[1].step(now)
        assert one is not None
        durations.append(one.duration_s)
        now = one.end_s
    assert span.end_s == pytest.approx(now, rel=1e-12)
    assert span.step_durations_s() == pytest.approx(durations, rel=1e-9)
    for a, b in zip(engines[0].running, engines[1].running, strict=True):
        assert (a.computed_tokens, a.output_tokens, a.blocks) == (
            b.computed_tokens, b.output_tokens, b.blocks)
    assert engines[0].free_blocks == engines[1].free_blocks


def test_decode_span_refuses_when_work_waits() -> None:
    """No span while a request waits (the next step must admit it)."""
    engine = make_engine()
    engine.add_request(Request("a", INTERACTIVE, 100, 50, 0.0))
    res = engine.step(0.0)
    assert res is not None
    engine.add_request(Request("b", INTERACTIVE, 100, 50, 0.0))
    assert engine.decode_span(res.end_s, res.end_s + 1.0) is None
