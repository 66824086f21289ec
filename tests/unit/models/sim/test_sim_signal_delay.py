"""The simulated loop reads its signals as a Prometheus serves them: late and held."""

from __future__ import annotations

import pytest
from borrowd.models.sim.policies import parse_policy
from borrowd.models.sim.run import load_inputs
from borrowd.models.sim.scenario import SEED
from borrowd.models.sim.simulation import Simulation, signal_ends


@pytest.mark.parametrize(
    ("now_s", "expected"),
    [(12.3, (10.0, 7.5, 7.5)), (13.0, (10.0, 7.5, 12.5)), (15.0, (15.0, 12.5, 12.5))],
    ids=["before-a-scrape", "after-a-scrape", "at-an-evaluation"],
)
def test_signal_ends_follow_the_scrapes_and_the_rule_evaluations(now_s, expected):
    """Scrapes every 5 s half an interval out of phase with the rules (2.5, 7.5, ...), rules
    every 5 s: the recorded series end at the last scrape before the last evaluation, the
    burn shares at the last scrape."""
    assert signal_ends(now_s, 5.0, 5.0) == pytest.approx(expected)


def test_no_monitoring_delay_reads_at_the_tick():
    """Intervals of 0: every signal is read fresh at the tick (the simulator's old model)."""
    assert signal_ends(12.3, 0.0, 0.0) == (12.3, 12.3, 12.3)


def test_ticks_between_two_evaluations_read_the_same_recorded_values():
    """Two ticks after one rule evaluation and before the next read the same p95s and the
    same burn (no scrape between them), their data a second older each; the next evaluation
    brings new values."""
    trace, lengths = load_inputs(SEED)
    sim = Simulation(SEED, parse_policy("priority", SEED), duration_s=60.0, seed=1,
                     trace=trace, rate_scale=0.2672, lengths=lengths)
    sim.run()
    first, second = sim.observe(SEED.pool, 55.5), sim.observe(SEED.pool, 57.0)
    assert (first.age_s, second.age_s) == pytest.approx((0.5, 2.0))
    assert first.itl_p95_s == second.itl_p95_s and first.ttft_p95_s == second.ttft_p95_s
    assert first.itl_over_slo_frac == second.itl_over_slo_frac
    assert first.itl_samples == second.itl_samples
    later = sim.observe(SEED.pool, 60.0)
    assert later.age_s == 0.0 and later.itl_samples != first.itl_samples
