"""One batch priority end to end: a request admitted by `borrowd gate` behind real nginx, or
tagged by the proxy, at their defaults, is counted as batch by the engine plugin at its
defaults inside vLLM's real V1 scheduler (so the per-step batch cap is on), and an
interactive request through the same nginx is not."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm", reason="needs the optional vLLM extra (see .ci/run)")

from borrowd.adapters.engine_budget import PluginConfig, StaticBudgetSource
from borrowd.adapters.proxy.config import ProxyConfig
from borrowd.adapters.vllm_plugin import BorrowdScheduler
from borrowd.models.budget import Budget, Mode
from borrowd.models.priority import BATCH_PRIORITY

from tests.integration.test_gate_nginx import CHAT, Stack, _batch, _publish, stack  # noqa: F401
from tests.support import vllm_harness as h

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

RATE_TOKENS_PER_S = 20_000.0
# The plugin's first allowance: rate x its initial step time (30 ms) tokens.
FIRST_ALLOWANCE = int(RATE_TOKENS_PER_S * 0.03)


def injected_priority(body: str) -> int:
    """The priority nginx injected, from the echoing upstream's answer."""
    fields = dict(part.split("=", 1) for part in body.split() if "=" in part)
    return int(fields["priority"])


def plugin_at_defaults() -> BorrowdScheduler:
    """The engine plugin with its default settings (only the pool named) and an open budget."""
    budget = Budget(pool="chat-8b", mode=Mode.OPEN, reason="test",
                    batch_tokens_per_s=RATE_TOKENS_PER_S, batch_burst_tokens=0,
                    max_batch_seqs=8, max_batch_kv_tokens=10**7, max_batch_output_tokens=1024,
                    issued_at_s=time.time(), ttl_ms=60_000)
    config = PluginConfig.from_env({"BORROWD_POOL": "chat-8b"})
    return h.scheduler(h.engine_config(), BorrowdScheduler,
                       budget_source=StaticBudgetSource(budget), plugin_config=config,
                       step_clock=None)


def test_gate_behind_nginx_tags_batch_as_the_plugin_counts_it(stack: Stack) -> None:  # noqa: F811
    """nginx + `borrowd gate` inject priority 10 for batch and 0 for chat; inside vLLM the
    plugin counts the first as batch (its prefill capped to the step allowance) and leaves
    the second alone."""
    _publish(stack.redis.extra["url"], ttl_ms=60_000)
    status, _, body = stack.request(_batch())
    assert status == 200
    batch_priority = injected_priority(body)
    status, _, body = stack.request(CHAT)
    assert status == 200
    chat_priority = injected_priority(body)
    assert (batch_priority, chat_priority) == (BATCH_PRIORITY, 0)

    sched = plugin_at_defaults()
    h.add(sched, "b0", 32768, 16, priority=batch_priority)
    h.add(sched, "i0", 4000, 16, priority=chat_priority)
    scheduled = h.step(sched)
    assert sched.is_batch(sched.requests["b0"]) and not sched.is_batch(sched.requests["i0"])
    assert scheduled["i0"] == 4000
    assert scheduled["b0"] == FIRST_ALLOWANCE


def test_proxy_default_batch_priority_is_batch_to_the_plugin() -> None:
    """The proxy's default batch priority is the one the plugin treats as batch."""
    proxy = ProxyConfig(pool="chat-8b", upstreams=("http://127.0.0.1:8100",))
    sched = plugin_at_defaults()
    h.add(sched, "b0", 32768, 16, priority=proxy.batch_priority)
    h.add(sched, "i0", 2000, 16, priority=proxy.interactive_priority)
    scheduled = h.step(sched)
    assert scheduled["b0"] == FIRST_ALLOWANCE and scheduled["i0"] == 2000
