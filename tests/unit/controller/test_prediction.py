"""Burn prediction (a Smith predictor): the law sees the burn the budget now will cause."""

from __future__ import annotations

import math
from collections import deque

import pytest
from borrowd.controller.burn import attributed_shares
from borrowd.controller.laws.base import LawTick, Proposal
from borrowd.controller.laws.history import mean_applied
from borrowd.controller.laws.prediction import (
    BurnPredicted,
    PredictConfig,
    predicted_burn,
)
from borrowd.controller.policy import ControllerConfig, build_policy
from borrowd.models.errors import ConfigError
from borrowd.models.signals import Observation

NAN = math.nan


@pytest.mark.parametrize(("burn", "share", "u_now", "u_seen", "expected"), [
    (1.0, 1.0, 60_000.0, 40_000.0, 1.5),  # all caused by batch: scales with the budget
    (1.0, 0.5, 60_000.0, 40_000.0, 1.25),  # half: only that half scales
    (1.0, 1.0, 20_000.0, 40_000.0, 0.5),  # just cut: the old burn is not read again
    (1.0, 1.0, 400_000.0, 10_000.0, 4.0),  # the ratio is bounded (max_ratio)
    (0.0, 1.0, 60_000.0, 40_000.0, 0.0),  # nothing burns: nothing to scale
    (1.0, NAN, 60_000.0, 40_000.0, 1.0),  # batch share unknown: as read
    (1.0, 1.0, 60_000.0, NAN, 1.0),  # budget unknown over the span: as read
    (1.0, 1.0, 60_000.0, 0.0, 1.0),  # read while closed: as read
    (NAN, 1.0, 60_000.0, 40_000.0, NAN),  # no burn: none
], ids=["all-batch", "half-batch", "after-a-cut", "bounded", "no-burn", "share-unknown",
        "budget-unknown", "read-while-closed", "nan-burn"])
def test_the_batch_share_of_a_burn_scales_with_the_budget(
    burn: float, share: float, u_now: float, u_seen: float, expected: float
) -> None:
    got = predicted_burn(burn, share, u_now, u_seen, max_ratio=4.0, unknown_share=0.0)
    assert got == pytest.approx(expected, nan_ok=True)


@pytest.mark.parametrize(("u_now", "unknown_share", "expected"), [
    (60_000.0, 1.0, 1.5),  # the budget rose: the whole burn is assumed batch's
    (60_000.0, 0.5, 1.25),
    (60_000.0, 0.0, 1.0),  # no assumption: as read
    (20_000.0, 1.0, 1.0),  # the budget fell: never predicted lower without a share
], ids=["rose-all", "rose-half", "rose-none", "fell"])
def test_an_unknown_share_only_ever_predicts_more_burn(
    u_now: float, unknown_share: float, expected: float
) -> None:
    """Engines that export no interference series: the assumed share scales a burn up for a
    budget that rose and leaves it as read for one that fell (careful, never bolder)."""
    got = predicted_burn(1.0, NAN, u_now, 40_000.0, max_ratio=4.0, unknown_share=unknown_share)
    assert got == pytest.approx(expected)


def test_an_unknown_share_out_of_range_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"predict\.unknown_share must be in \[0, 1\]"):
        PredictConfig(unknown_share=1.5)


def test_the_budget_a_reading_saw_is_its_time_weighted_mean_over_the_span() -> None:
    history = deque([(0.0, 10_000.0), (10.0, 30_000.0), (20.0, 0.0)])
    assert mean_applied(history, 0.0, 20.0) == pytest.approx(20_000.0)
    assert mean_applied(history, 5.0, 15.0) == pytest.approx(20_000.0)
    assert mean_applied(history, 15.0, 25.0) == pytest.approx(15_000.0)
    assert math.isnan(mean_applied(history, -10.0, -5.0))  # before the history
    assert math.isnan(mean_applied(deque(), 0.0, 10.0))


class Recorder:
    """A law that keeps the burns it was handed and holds the budget."""

    def __init__(self) -> None:
        self.burns: tuple[float, ...] = ()

    def propose(self, tick: LawTick) -> Proposal:
        self.burns = tick.burns
        return Proposal(tick.u_applied_tokens_per_s, tick)

    def applied(self, tick: LawTick, u_tokens_per_s: float) -> None:
        pass

    def state(self) -> dict[str, float]:
        return {}


def tick(now_s: float, u: float, burns: tuple[float, float], shares: tuple[float, float]
         ) -> LawTick:
    obs = Observation(now_s=now_s, age_s=5.0, window_s=15.0)
    return LawTick(obs, (0.5, 0.5), u, 1.0, burns=burns, burn_windows_s=(10.0, 10.0),
                   burn_batch_shares=shares)


def test_a_budget_that_doubled_since_the_reading_doubles_the_batch_burn_seen() -> None:
    """Over 40 s at 20k then a rise to 40k: a reading that covers [t-30, t-5] saw 20k, so the
    ITL burn (all batch) reads twice; the TTFT burn (share unknown, none assumed) passes as
    read, and with the default assumption for an unknown share it reads twice too."""
    inner = Recorder()
    law = BurnPredicted(inner, PredictConfig(unknown_share=0.0))
    for t in range(40):
        law.applied(tick(float(t), 20_000.0, (0.2, 0.2), (NAN, 1.0)), 20_000.0)
    law.applied(tick(40.0, 20_000.0, (0.2, 0.2), (NAN, 1.0)), 40_000.0)
    law.propose(tick(41.0, 40_000.0, (0.5, 0.5), (NAN, 1.0)))
    assert inner.burns == pytest.approx((0.5, 1.0))
    assert law.state()["predict_budget_ratio"] == pytest.approx(2.0)
    law.config = PredictConfig()
    law.propose(tick(41.0, 40_000.0, (0.5, 0.5), (NAN, 1.0)))
    assert inner.burns == pytest.approx((1.0, 1.0))


def test_a_cut_budget_is_not_cut_again_for_late_first_tokens_it_no_longer_causes() -> None:
    """Halved from 40k at 85 s: a TTFT burn of 1.3 read at 90 s (5 s old, over [60, 85] s:
    the 40k), with no queue wait to attribute and 60% of the slow steps carrying batch, is
    predicted at 1.3 * (0.4 + 0.6 * 0.5) (the law reads the shares as `attributed_shares`
    gives them); on bare engines (no share at all) it stays as read, as before."""
    inner = Recorder()
    law = BurnPredicted(inner, PredictConfig())
    shares = attributed_shares((NAN, 0.6), True)
    for t in range(85):
        law.applied(tick(float(t), 40_000.0, (0.2, 0.2), shares), 40_000.0)
    law.applied(tick(85.0, 40_000.0, (0.2, 0.2), shares), 20_000.0)
    for t in range(86, 90):
        law.applied(tick(float(t), 20_000.0, (0.2, 0.2), shares), 20_000.0)
    law.propose(tick(90.0, 20_000.0, (1.3, 0.1), shares))
    assert inner.burns[0] == pytest.approx(1.3 * (0.4 + 0.6 * 0.5))
    law.propose(tick(90.0, 20_000.0, (1.3, 0.1), (NAN, NAN)))
    assert inner.burns[0] == pytest.approx(1.3)


def test_disabled_the_burns_pass_as_read() -> None:
    inner = Recorder()
    law = BurnPredicted(inner, PredictConfig(enabled=False))
    law.applied(tick(0.0, 20_000.0, (0.2, 0.2), (1.0, 1.0)), 20_000.0)
    law.propose(tick(30.0, 80_000.0, (0.5, 0.5), (1.0, 1.0)))
    assert inner.burns == (0.5, 0.5)


def test_a_max_ratio_below_one_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"predict\.max_ratio"):
        PredictConfig(max_ratio=0.5)


def test_the_policy_runs_the_predictor_inside_its_wrappers() -> None:
    """The daemon's policy (and so the simulator's) runs the law behind the predictor, and
    exports its ratio as controller state."""
    policy = build_policy(ControllerConfig(), "chat", None)
    obs = Observation(now_s=0.0, age_s=1.0)
    policy.step(obs, 0.0)
    assert "predict_budget_ratio" in policy.state()
