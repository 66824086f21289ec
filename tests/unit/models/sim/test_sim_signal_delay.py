"""The simulated loop reads its signals as a Prometheus serves them: late and held."""

from __future__ import annotations

from dataclasses import replace

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


def test_gauges_are_read_from_the_scrape_the_rules_read():
    """KV usage, the queue, the oldest wait and batch in flight reach the daemon through
    recording rules too: a tick reads them as the last scrape before the last evaluation
    took them (the same for every tick between two evaluations), and an idle pool's before
    the first scrape."""
    trace, lengths = load_inputs(SEED)
    sim = Simulation(SEED, parse_policy("priority", SEED), duration_s=60.0, seed=1,
                     trace=trace, rate_scale=0.2672, lengths=lengths)
    sim.run()
    assert sim._scrape_t[:3] == pytest.approx([2.5, 7.5, 12.5])
    first, second = sim.observe(SEED.pool, 55.5), sim.observe(SEED.pool, 57.0)
    at_scrape = sim._scraped[sim._scrape_t.index(pytest.approx(52.5))]
    for obs in (first, second):
        assert obs.kv_usage_frac == at_scrape.kv_usage_frac
        assert obs.batch_running_seqs == at_scrape.batch_running_seqs
        assert obs.interactive_oldest_wait_s == at_scrape.interactive_oldest_wait_s
    assert at_scrape.batch_running_seqs > 0  # priority admits batch freely: a live pool
    start = sim.observe(SEED.pool, 1.0)
    assert (start.kv_usage_frac, start.batch_running_seqs) == (0.0, 0.0)


def test_no_scrape_interval_reads_the_gauges_at_the_tick():
    """A scenario that scrapes continuously reads every gauge as it is at the tick."""
    trace, lengths = load_inputs(SEED)
    fresh = replace(SEED, scrape_interval_s=0.0, evaluation_interval_s=0.0)
    sim = Simulation(fresh, parse_policy("priority", fresh), duration_s=30.0, seed=1,
                     trace=trace, rate_scale=0.2672, lengths=lengths)
    sim.run()
    assert sim._scrape_t == []
    assert sim.observe(fresh.pool, 30.0).batch_running_seqs == sim.gauges(30.0).batch_running_seqs
