"""The policy's law inputs: the smoothed SLO burn when it is measured, p95/SLO otherwise."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from borrowd.controller.laws.base import LawTick
from borrowd.controller.laws.pi import PiLaw
from borrowd.controller.policy import ControllerConfig, ControllerPolicy, build_policy
from borrowd.models.signals import Observation


def observation(now_s: float, **over: float) -> Observation:
    """A healthy observation at `now_s` with fields overridden."""
    base = dict(
        age_s=0.5,
        ttft_p95_s=0.3,
        itl_p95_s=0.2,
        success_rate=1.0,
        kv_usage_frac=0.5,
        interactive_queue_depth=0.0,
        interactive_oldest_wait_s=0.1,
        interactive_tokens_per_s=1000.0,
        interactive_requests=20.0,
    )
    base.update(over)
    return Observation(now_s=now_s, **base)


def law_tick(policy: ControllerPolicy, obs: Observation) -> LawTick:
    """The first tick's input to the policy's wrapped law."""
    return LawTick(obs, (obs.ttft_norm(policy.slo), obs.itl_norm(policy.slo)), 0.0,
                   policy.tick_s)


def proposal_law(policy: ControllerPolicy) -> PiLaw:
    """The PI law inside the policy's wrappers."""
    law = policy.law
    while not isinstance(law, PiLaw):
        law = law.inner  # type: ignore[attr-defined]
    return law


@pytest.mark.parametrize(
    ("over", "on_burn", "expected_itl", "expected_setpoint"),
    [
        ({"itl_over_slo_frac": 0.02, "ttft_over_slo_frac": 0.0}, True, 0.4, 0.95),
        ({}, True, 4.0, 0.5),
        ({"itl_over_slo_frac": 0.02, "ttft_over_slo_frac": 0.0}, False, 4.0, 0.5),
    ],
    ids=["burn-measured", "burn-unmeasured-falls-back-to-p95", "burn-switched-off"],
)
def test_law_tracks_the_burn_when_measured(over, on_burn, expected_itl, expected_setpoint):
    """The ITL loop sees share-above-SLO / 0.05 against its burn setpoint, else p95/SLO."""
    policy = build_policy(replace(ControllerConfig(), control_on_burn=on_burn), "p", None)
    proposal = policy.law.propose(law_tick(policy, observation(0.0, **over)))
    pi = proposal_law(policy)
    outs, loops = pi.law_outputs(replace(proposal.tick, ys=(0.3, 4.0)))
    assert outs[1] == pytest.approx(expected_itl)
    assert loops[1].setpoint == pytest.approx(expected_setpoint)


def test_burn_is_counted_and_dropped_for_an_unmeasured_window():
    """The law's burn is the fast window's share above the SLO weighted by sample counts; a
    share missing while samples were counted gives no reading (the checks fall back to the
    p95), never the last one held; no samples read as 0."""
    policy = build_policy(ControllerConfig(), "p", None)
    for t in range(12):
        policy.step(observation(float(t), itl_over_slo_frac=0.05 if t % 2 else 0.0,
                                ttft_over_slo_frac=0.0, window_s=5.0, itl_samples=1000.0,
                                ttft_samples=50.0), float(t))
    assert policy.law.burns[1] == pytest.approx(0.5)
    policy.step(observation(12.0, ttft_over_slo_frac=0.0, itl_samples=1000.0,
                            ttft_samples=50.0, window_s=5.0), 12.0)
    assert policy.law.readings[1] is None
    assert policy.law.readings[0] is not None
    idle = build_policy(ControllerConfig(), "p", None)
    idle.step(observation(0.0, itl_p95_s=math.nan, itl_samples=0.0, window_s=5.0), 0.0)
    assert idle.law.burns[1] == 0.0
