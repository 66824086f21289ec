"""A pool at non-default SLOs keeps burn control; where the source could not read the burn
at the SLO (no bucket at that bound: NaN share, samples counted) it controls on p95."""

from __future__ import annotations

import math

import pytest
from borrowd.controller.config import config_from_mapping
from borrowd.controller.pools import build_pool_policy
from borrowd.controller.supervisor import is_quiet, latency_checks
from borrowd.models.signals import Observation

SLO_ITL_S = 0.0076
SLO_TTFT_S = 0.12


def _policy():
    pool = config_from_mapping({"pools": [{"name": "chat", "controller": {
        "slo_itl_p95_s": SLO_ITL_S, "slo_ttft_p95_s": SLO_TTFT_S}}]}).pools[0]
    return build_pool_policy(pool)


def _obs(now_s: float, itl_p95_s: float, itl_share: float) -> Observation:
    return Observation(
        now_s=now_s, age_s=0.5, window_s=15.0, ttft_p95_s=0.05, itl_p95_s=itl_p95_s,
        success_rate=1.0, kv_usage_frac=0.2, interactive_queue_depth=0.0,
        interactive_oldest_wait_s=0.0, preemptions_per_s=0.0, interactive_tokens_per_s=900.0,
        batch_tokens_per_s=0.0, batch_running_seqs=0.0, interactive_requests=40.0,
        itl_over_slo_frac=itl_share, ttft_over_slo_frac=0.0, itl_samples=1500.0,
        ttft_samples=40.0, itl_over_slo_batch_frac=math.nan, interactive_wait_batch_frac=0.0,
        kv_capacity_tokens=100_000.0,
    )


def test_burn_control_stays_on_at_non_default_slos() -> None:
    """SLOs of 7.6 ms / 0.12 s (not vLLM bucket bounds) keep burn control on."""
    assert _policy().config.control_on_burn


@pytest.mark.parametrize(
    ("itl_p95_s", "itl_share", "label", "quiet"),
    [(0.9 * SLO_ITL_S, 0.2, "ITL burn", False), (3 * SLO_ITL_S, 0.0, "ITL burn", True),
     (3 * SLO_ITL_S, math.nan, "p95 ITL/SLO", False),
     (0.9 * SLO_ITL_S, math.nan, "p95 ITL/SLO", True)],
    ids=["burn-over-p95-under", "burn-under-p95-over", "unread-p95-over", "unread-p95-under"],
)
def test_the_burn_decides_where_read_else_the_p95(
    itl_p95_s: float, itl_share: float, label: str, quiet: bool
) -> None:
    """A read share decides (a burn of 4 is not quiet although p95 < SLO; a share of 0 is
    quiet with p95 at 3x the SLO); an unread share with samples leaves no burn reading and
    the check falls back to p95/SLO: a missing share never reads as safe by itself."""
    policy = _policy()
    for tick in range(40):  # long enough for the burn windows to hold their samples
        obs = _obs(float(tick), itl_p95_s, itl_share)
        policy.step(obs, float(tick))
    burns = policy.law.readings
    assert (burns[1] is None) is math.isnan(itl_share)
    if burns[1] is not None:
        assert burns[1].burn == pytest.approx(itl_share / 0.05)
    supervisor = policy.config.supervisor
    _, (_, _, itl_label) = latency_checks(obs, policy.slo, supervisor, cut=False, burns=burns)
    assert itl_label == label
    assert is_quiet(obs, policy.slo, supervisor, burns) is quiet


def test_a_share_lost_mid_run_falls_back_to_the_p95() -> None:
    """Shares read (0, quiet) and then no longer read while the p95 is 3x the SLO: the
    check must move to p95/SLO (not quiet), not keep the last burn of 0."""
    policy = _policy()
    for tick in range(40):
        policy.step(_obs(float(tick), 0.9 * SLO_ITL_S, 0.0), float(tick))
    for tick in range(40, 100):
        obs = _obs(float(tick), 3 * SLO_ITL_S, math.nan)
        policy.step(obs, float(tick))
    assert not is_quiet(obs, policy.slo, policy.config.supervisor, policy.law.readings)
