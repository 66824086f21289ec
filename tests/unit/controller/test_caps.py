"""Budget caps: the KV cap is a share of the pool's KV capacity, never a fixed token count."""

from __future__ import annotations

import math

import pytest
from borrowd.controller.caps import Capped, CapsConfig, derive_budget, kv_ceiling_tokens
from borrowd.controller.closed_loop import SimControllers
from borrowd.controller.config import config_from_mapping
from borrowd.controller.supervisor import SupervisorDecision, SupervisorState
from borrowd.models.budget import Mode
from borrowd.models.errors import ConfigError
from borrowd.models.sim.policies import parse_policy
from borrowd.models.sim.profiles import get_profile
from borrowd.models.sim.run import load_inputs
from borrowd.models.sim.scenario import get_scenario
from borrowd.models.sim.simulation import Simulation

HIGH_RATE = 200_000.0  # x kv_residence_s 10 s = 2M tokens: the ceiling binds


@pytest.mark.parametrize(
    ("capacity", "caps", "ceiling"),
    [
        (1_584_000.0, CapsConfig(), 792_000),  # seed: 4 x 396k tokens
        (48_000.0, CapsConfig(), 24_000),  # one 72B replica on four GPUs
        (1_584_000.0, CapsConfig(max_kv_frac=0.25), 396_000),
        (1_584_000.0, CapsConfig(max_kv_tokens=500_000), 500_000),
        (math.nan, CapsConfig(), 33_792),  # unknown: one largest request
        (math.nan, CapsConfig(max_kv_tokens=500_000), 500_000),
        (0.0, CapsConfig(), 33_792),
    ],
    ids=["seed", "small-cache", "quarter", "absolute-ceiling", "unknown", "unknown-ceiling",
         "no-engine-up"],
)
def test_kv_ceiling_is_a_share_of_the_capacity(capacity: float, caps: CapsConfig,
                                                ceiling: int) -> None:
    """max_kv_frac of the capacity (at most max_kv_tokens); unknown: max_kv_tokens or one
    largest request."""
    assert kv_ceiling_tokens(caps, capacity) == ceiling
    budget = derive_budget("chat", Mode.OPEN, "test", HIGH_RATE, caps,
                           kv_capacity_tokens=capacity)
    assert budget.max_batch_kv_tokens == ceiling


def test_below_the_ceiling_the_kv_cap_follows_the_rate() -> None:
    """A low rate keeps the Little's-law cap (rate x residence), whatever the capacity."""
    budget = derive_budget("chat", Mode.OPEN, "test", 5_000.0, CapsConfig(),
                           kv_capacity_tokens=1_584_000.0)
    assert budget.max_batch_kv_tokens == 50_000


def _decision(u: float, mode: Mode = Mode.OPEN, revoke: bool = False) -> SupervisorDecision:
    return SupervisorDecision(u=u, mode=mode, reason="test", state=SupervisorState(mode),
                              events=(), revoke=revoke)


def test_capped_keeps_the_last_capacity_measured() -> None:
    """A tick without a capacity reading keeps the last one; a new reading (a replica lost)
    moves the ceiling at once."""
    capped = Capped("chat", CapsConfig())
    assert capped.budget(_decision(HIGH_RATE), 0.0).max_batch_kv_tokens == 33_792
    assert capped.budget(_decision(HIGH_RATE), 1.0, 1_584_000.0).max_batch_kv_tokens == 792_000
    assert capped.budget(_decision(HIGH_RATE), 2.0, math.nan).max_batch_kv_tokens == 792_000
    assert capped.budget(_decision(HIGH_RATE), 3.0, 1_188_000.0).max_batch_kv_tokens == 594_000


@pytest.mark.parametrize(
    ("caps", "message"),
    [
        ({"max_kv_frac": 0.0}, r"pools\[0\].controller.caps.max_kv_frac: 0.0 must be above 0.0"),
        ({"max_kv_frac": 1.5}, r"pools\[0\].controller.caps.max_kv_frac: 1.5 is above the max"),
        ({"max_kv_tokens": 0}, r"caps.max_kv_tokens must be >= 1"),
        ({"max_kv_tokens": "lots"}, r"pools\[0\].controller.caps.max_kv_tokens"),
    ],
    ids=["zero-frac", "frac-above-1", "zero-tokens", "not-a-number"],
)
def test_bad_kv_cap_keys_name_the_key(caps: dict, message: str) -> None:
    """A KV cap outside its range fails at start-up naming the key."""
    with pytest.raises(ConfigError, match=message):
        config_from_mapping({"pools": [{"name": "chat", "controller": {"caps": caps}}]})


def test_old_configs_with_max_kv_tokens_still_load() -> None:
    """`caps.max_kv_tokens` (an absolute count, the only KV key before) still loads and now
    bounds the share of the capacity from above."""
    pool = config_from_mapping({"pools": [{"name": "chat", "controller": {
        "caps": {"max_kv_tokens": 800_000}}}]}).pools[0]
    caps = pool.controller.caps
    assert caps.max_kv_tokens == 800_000 and caps.max_kv_frac == 0.5
    assert kv_ceiling_tokens(caps, 4_000_000.0) == 800_000


def test_simulated_pool_reports_its_engines_capacity_and_caps_within_it() -> None:
    """The simulator observes the KV cache of its engines that are up (seed: 4 x 396k
    tokens, one fewer while a replica is down), and the daemon's policy never publishes a
    batch KV cap above max_kv_frac of it."""
    seed = get_scenario("seed")
    trace, lengths = load_inputs(seed)
    sim = Simulation(seed, parse_policy("pi", seed, None, SimControllers()), duration_s=120.0,
                     seed=0, trace=trace, rate_scale=0.2358, lengths=lengths)
    timeline = sim.run().summary()["budget_timeline"]
    per_engine = get_profile(seed.profile).kv_capacity_tokens
    assert sim.observe(seed.pool, 120.0).kv_capacity_tokens == 4 * per_engine
    caps = [entry["max_batch_kv_tokens"] for entry in timeline]  # type: ignore[index]
    assert max(caps) > 0 and max(caps) <= CapsConfig().max_kv_frac * 4 * per_engine
    sim.fleet.up[0] = False
    assert sim.observe(seed.pool, 120.0).kv_capacity_tokens == 3 * per_engine
