"""Fair shares at the pool: three `borrowd batch worker` processes share two tenants' jobs
through the fair-share state in a real redis-server, through the real proxy in front of two
emulated replicas, and the tokens carried while both tenants have work split by weight."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from borrowd.models.batch.schedule import FairState

from tests.support.batch_stack import MODEL, batch_stack
from tests.support.servers import wait_until

openai = pytest.importorskip("openai", reason="the openai SDK is part of the vllm extra")

pytestmark = pytest.mark.integration

TENANTS = {"gold": ("sk-gold", 2.0), "silver": ("sk-silver", 1.0)}
# Different item sizes per tenant: a fair share of items would not be a fair share of tokens.
ITEMS = {"gold": (300, 200), "silver": (200, 400)}


def _lines(tenant: str, count: int, max_tokens: int) -> bytes:
    """`count` chat requests of `max_tokens` output each."""
    return "\n".join(json.dumps({
        "custom_id": f"{tenant}-{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": MODEL, "max_tokens": max_tokens,
                 "messages": [{"role": "user", "content": f"{tenant} document {i}"}]},
    }) for i in range(count)).encode()


def test_three_workers_split_the_pool_by_weight(tmp_path: Path) -> None:
    """Weights 2:1, full backlogs, three workers x 6 slots: the tokens carried (prompt plus
    output kept) while both tenants had work split within 10% of 2:1, and the shared state
    carries both tenants' tags and expected costs."""
    with batch_stack(tmp_path, replicas=2, tenants=TENANTS) as stack:
        clients = {name: openai.OpenAI(base_url=stack.api_url, api_key=key, max_retries=2)
                   for name, (key, _w) in TENANTS.items()}
        jobs = {}
        for name, (count, max_tokens) in ITEMS.items():
            uploaded = clients[name].files.create(
                file=("in.jsonl", _lines(name, count, max_tokens)), purpose="batch")
            jobs[name] = clients[name].batches.create(
                input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                completion_window="24h").id
        for index in range(3):
            stack.start_worker(f"w{index}", 6)
        redis_client = stack.redis_client()

        def counter(name: str) -> dict[str, int]:
            return {n: int(redis_client.hget(f"borrowd:batch:tenant:{n}", name) or 0)
                    for n in TENANTS}

        def kept() -> dict[str, int]:
            """Tokens carried: prompts as the engines counted them, and outputs kept."""
            prompts, outputs = counter("prompt_tokens"), counter("kept_tokens")
            return {n: prompts[n] + outputs[n] for n in TENANTS}

        def done_frac() -> dict[str, float]:
            return {n: done / ITEMS[n][0] for n, done in counter("completed").items()}

        wait_until(lambda: min(done_frac().values()) >= 0.05, 120, "both tenants under way",
                   interval_s=0.05)
        start = kept()
        wait_until(lambda: max(done_frac().values()) >= 0.8, 180, "one tenant near its end",
                   interval_s=0.05)
        end = kept()
        raw = redis_client.hgetall("borrowd:batch:fair")
        redis_client.close()
    gained = {n: end[n] - start[n] for n in TENANTS}
    ratio = gained["gold"] / max(1, gained["silver"])
    assert abs(ratio / 2.0 - 1.0) < 0.10, (ratio, gained)
    state = FairState({k[2:]: float(v) for k, v in raw.items() if k.startswith("t:")},
                      float(raw["v"]),
                      {k[2:]: float(v) for k, v in raw.items() if k.startswith("c:")})
    assert set(state.finish_tags) == set(TENANTS)
    # Each tenant's expected cost has learnt its items' size: prompt plus max_tokens.
    for name, (_count, max_tokens) in ITEMS.items():
        assert max_tokens < state.expected_cost(name) < max_tokens + 64
