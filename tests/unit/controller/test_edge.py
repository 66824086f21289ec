"""Edge memory: growth slows near the last budget that was cut, as CUBIC's near W_max."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import replace

import pytest
from borrowd.controller.burn import BurnConfig
from borrowd.controller.laws.base import LawTick, Proposal
from borrowd.controller.laws.edge import (
    Edge,
    EdgeConfig,
    EdgeMemory,
    batch_burning,
    next_edge,
    shaped_increase,
)
from borrowd.controller.laws.smoothing import Smoothed, SmoothingConfig
from borrowd.models.enforcement import ADMISSION, ENGINE
from borrowd.models.errors import ConfigError
from borrowd.models.signals import Observation, Slo

CONFIG = EdgeConfig(enabled=True, drop_frac=0.8, lookback_s=30.0, near_frac=0.8, slow_frac=0.25,
                    memory_s=300.0)


@pytest.mark.parametrize(("proposed", "applied", "edge", "now_s", "expected"), [
    (12_000.0, 10_000.0, Edge(), 0.0, 12_000.0),  # no edge known: the law's own pace
    (12_000.0, 10_000.0, Edge(20_000.0, 0.0), 10.0, 12_000.0),  # far below the edge
    (18_000.0, 16_000.0, Edge(20_000.0, 0.0), 10.0, 16_500.0),  # near it: a quarter
    (24_000.0, 22_000.0, Edge(20_000.0, 0.0), 10.0, 22_500.0),  # above it: a quarter too
    (14_000.0, 16_000.0, Edge(20_000.0, 0.0), 10.0, 14_000.0),  # a decrease passes whole
    (18_000.0, 16_000.0, Edge(20_000.0, 0.0), 301.0, 18_000.0),  # forgotten
])
def test_increases_slow_near_and_above_a_known_edge(
    proposed: float, applied: float, edge: Edge, now_s: float, expected: float
) -> None:
    assert shaped_increase(proposed, applied, edge, now_s, CONFIG) == pytest.approx(expected)


def test_a_drop_from_the_recent_peak_sets_the_edge_at_that_peak_once_per_lookback() -> None:
    recent = deque([(0.0, 20_000.0), (1.0, 25_000.0), (2.0, 24_000.0)])
    assert next_edge(Edge(), recent, 3.0, 21_000.0, CONFIG) == Edge()  # 0.84 of the peak
    edge = next_edge(Edge(), recent, 3.0, 12_000.0, CONFIG)
    assert edge == Edge(25_000.0, 3.0)
    assert next_edge(edge, deque([(4.0, 12_000.0)]), 5.0, 1_000.0, CONFIG) == edge
    later = next_edge(edge, deque([(40.0, 18_000.0)]), 41.0, 9_000.0, CONFIG)
    assert later == Edge(18_000.0, 41.0)  # burned again lower: the edge moves down


NAN2 = (math.nan, math.nan)


@pytest.mark.parametrize(("burns", "ys", "shares", "unknown_share", "burning"), [
    ((0.2, 0.4), (0.1, 0.1), (0.9, 0.9), 0.0, False),
    ((1.0, 0.4), (0.1, 0.1), (0.9, 0.9), 0.0, True),  # a batch burn at its rate
    ((math.nan, 0.4), (1.2, 0.1), (0.9, 0.9), 0.0, True),  # no burn read: the p95 past
    ((0.2, math.nan), (0.1, 0.9), (0.9, 0.9), 0.0, False),
    ((2.0, 0.4), (0.1, 0.1), (0.1, math.nan), 0.0, False),  # an interactive burst, not batch
    ((2.0, 0.4), (0.1, 0.1), (0.6, math.nan), 0.0, True),  # batch caused most of it
    ((2.0, 0.4), (0.1, 0.1), NAN2, 0.0, False),  # no share exported: the memory stands aside
    ((2.0, 0.4), (0.1, 0.1), NAN2, 1.0, True),  # ... unless told to count it as batch's
], ids=["quiet", "burn-at-rate", "p95-past-slo", "itl-p95-near", "burst-not-batch",
        "batch-burn", "unknown-cause", "unknown-counted"])
def test_batch_burning_reads_the_burn_where_measured_else_the_p95_and_its_cause(
    burns: tuple[float, float], ys: tuple[float, float], shares: tuple[float, float],
    unknown_share: float, burning: bool
) -> None:
    t = LawTick(Observation(now_s=1.0, age_s=0.5), ys, 10_000.0, 1.0, burns=burns,
                burn_batch_shares=shares)
    assert batch_burning(t, 0.5, unknown_share) is burning


def test_a_fall_with_nothing_burning_sets_no_edge() -> None:
    """The ramp handing over to a law that asks less, or a cap, is no evidence of the edge:
    with it counted, a handover at 2k tokens/s slowed growth from 1.6k for 300 s."""
    recent = deque([(0.0, 2_000.0)])
    assert next_edge(Edge(), recent, 1.0, 1_400.0, CONFIG, burning=False) == Edge()
    assert next_edge(Edge(), recent, 1.0, 1_400.0, CONFIG, burning=True) == Edge(2_000.0, 1.0)


class Climber:
    """A law that always asks 2000 tokens/s more than applied."""

    def propose(self, tick: LawTick) -> Proposal:
        return Proposal(tick.u_applied_tokens_per_s + 2_000.0, tick)

    def applied(self, tick: LawTick, u_tokens_per_s: float) -> None:
        pass

    def state(self) -> dict[str, float]:
        return {}


def tick(u: float, now_s: float, ttft_burn: float = math.nan,
         ttft_batch_share: float = 1.0) -> LawTick:
    return LawTick(Observation(now_s=now_s, age_s=0.5), (0.1, 0.1), u, 1.0,
                   burns=(ttft_burn, math.nan), burn_batch_shares=(ttft_batch_share, math.nan))


def test_after_a_cut_the_wrapper_returns_fast_and_plateaus_near_the_old_level() -> None:
    law = EdgeMemory(Climber(), CONFIG)
    u, now = 10_000.0, 0.0
    for _ in range(10):  # climb to 30k at the law's pace
        u = law.propose(tick(u, now)).u_tokens_per_s
        law.applied(tick(u, now), u)
        now += 1.0
    assert u == pytest.approx(30_000.0) and math.isnan(law.edge.tokens_per_s)
    law.applied(tick(u, now, ttft_burn=2.0), 10_000.0)  # a back-off on a burning SLO
    assert law.edge.tokens_per_s == pytest.approx(30_000.0)
    u = 10_000.0
    steps = []
    for _ in range(12):
        now += 1.0
        new = law.propose(tick(u, now)).u_tokens_per_s
        steps.append(new - u)
        law.applied(tick(new, now), new)
        u = new
    assert steps[0] == pytest.approx(2_000.0)  # far below the edge: full pace
    assert steps[-1] == pytest.approx(500.0)  # at 24k and up: a quarter
    assert law.state()["edge_tokens_per_s"] == pytest.approx(30_000.0)


@pytest.mark.parametrize(("unknown_share", "edge_set"), [(0.0, False), (1.0, True)],
                         ids=["stands-aside", "counted"])
def test_on_engines_that_export_no_share_a_cut_sets_the_edge_only_if_told(
    unknown_share: float, edge_set: bool
) -> None:
    """Bare engines (no interference series) cannot tell a burst's burn from batch's: by
    default a cut there sets no edge."""
    law = EdgeMemory(Climber(), replace(CONFIG, unknown_share=unknown_share))
    law.applied(tick(30_000.0, 0.0), 30_000.0)
    law.applied(tick(30_000.0, 1.0, ttft_burn=2.0, ttft_batch_share=math.nan), 10_000.0)
    assert math.isfinite(law.edge.tokens_per_s) is edge_set


@pytest.mark.parametrize(("step_share_for_ttft", "edge_set"), [(True, True), (False, False)],
                         ids=["step-share", "off"])
def test_a_ttft_cut_with_no_queue_wait_to_attribute_reads_the_step_share(
    step_share_for_ttft: bool, edge_set: bool
) -> None:
    """Late first tokens with no interactive queue wait (the engines' wait share is 0/0)
    while 80% of the over-SLO gaps fell in steps carrying batch: as the law reads it behind
    the smoothing wrapper, that TTFT burn is batch's and its cut sets the edge (the prediction
    reads the same share); told not to stand the step share in, the memory stands aside."""
    burn = BurnConfig(fast_s=10.0, slow_s=60.0, min_samples=0.0,
                      step_share_for_ttft=step_share_for_ttft)
    law = Smoothed(EdgeMemory(Climber(), CONFIG),
                   SmoothingConfig(Slo(), 30.0, 30.0, burn, control_on_burn=True))

    def obs(now_s: float, ttft_over: float) -> Observation:
        return Observation(now_s=now_s, age_s=1.0, window_s=5.0, ttft_p95_s=0.5,
                           itl_p95_s=0.02, ttft_over_slo_frac=ttft_over, ttft_samples=100.0,
                           itl_over_slo_frac=0.02, itl_samples=1000.0,
                           interactive_wait_batch_frac=math.nan, itl_over_slo_batch_frac=0.8)

    for now in range(5):
        seen = law.propose(LawTick(obs(float(now), 0.0), (0.5, 0.4), 30_000.0, 1.0)).tick
        law.applied(seen, 30_000.0)
    seen = law.propose(LawTick(obs(5.0, 0.5), (1.5, 0.4), 30_000.0, 1.0)).tick
    expected = 0.8 if step_share_for_ttft else math.nan
    assert seen.burn_batch_shares[0] == pytest.approx(expected, nan_ok=True)
    law.applied(seen, 10_000.0)  # the cut
    assert math.isfinite(law.inner.edge.tokens_per_s) is edge_set  # type: ignore[attr-defined]


def test_disabled_the_wrapper_passes_proposals_through() -> None:
    """Off (on by default), the law's proposals pass unchanged."""
    assert EdgeConfig().enabled
    law = EdgeMemory(Climber(), EdgeConfig(enabled=False))
    law.edge = Edge(10_000.0, 0.0)
    assert law.propose(tick(9_000.0, 1.0)).u_tokens_per_s == 11_000.0


@pytest.mark.parametrize(("admission_only", "enforcement", "slowed"), [
    (False, ADMISSION, True), (False, ENGINE, True), (True, ADMISSION, True),
    (True, ENGINE, False),
], ids=["both-admission", "both-engine", "admission-only-on-admission",
        "admission-only-under-the-plugin"])
def test_admission_only_leaves_a_plugin_pool_to_its_step_guard(
    admission_only: bool, enforcement: str, slowed: bool
) -> None:
    """With `admission_only`, growth near the edge slows on a pool enforced by the gate alone
    and passes whole under the engine plugin."""
    law = EdgeMemory(Climber(), replace(CONFIG, admission_only=admission_only), enforcement)
    law.edge = Edge(10_000.0, 0.0)
    u = law.propose(tick(9_000.0, 1.0)).u_tokens_per_s
    assert u == pytest.approx(9_500.0 if slowed else 11_000.0)


@pytest.mark.parametrize("kwargs", [{"drop_frac": 0.0}, {"slow_frac": 1.5},
                                    {"lookback_s": 0.0}, {"memory_s": -1.0},
                                    {"batch_share": 1.5}, {"unknown_share": -0.1}])
def test_bad_settings_are_refused_by_name(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError, match="edge." + next(iter(kwargs))):
        EdgeConfig(**kwargs)
