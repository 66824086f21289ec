"""The simulator's observation counts its samples and attributes interference to batch."""

from __future__ import annotations

import math
from dataclasses import replace

from borrowd.models.sim.policies import parse_policy
from borrowd.models.sim.run import load_inputs
from borrowd.models.sim.scenario import SEED
from borrowd.models.sim.simulation import Simulation

SEED_RATE_SCALE = 0.2672


def _observe_after(policy: str, duration_s: float = 60.0, interference_series: bool = True):
    # Read fresh at the run's end (no monitoring delay: this is about what is counted).
    scenario = replace(SEED, scrape_interval_s=0.0, evaluation_interval_s=0.0,
                       interference_series=interference_series)
    trace, lengths = load_inputs(scenario)
    sim = Simulation(scenario, parse_policy(policy, scenario), duration_s=duration_s, seed=1,
                     trace=trace, rate_scale=SEED_RATE_SCALE, lengths=lengths)
    sim.run()
    return sim.observe(scenario.pool, duration_s)


def test_free_batch_interference_is_attributed_to_batch() -> None:
    """Under free batch admission the gaps above the ITL SLO fall in steps carrying batch
    tokens, and the window says how many gaps and first tokens it held."""
    obs = _observe_after("priority")
    assert obs.window_s == SEED.observe_window_s
    assert obs.itl_samples > 100 and obs.ttft_samples > 0
    assert obs.itl_over_slo_frac > 0.05
    assert obs.itl_over_slo_batch_frac > 0.9
    assert 0.0 <= obs.interactive_wait_batch_frac <= 1.0


def test_no_batch_attributes_nothing() -> None:
    """Without batch no gap is above the SLO, so there is no share to attribute (NaN), and
    no interactive wait passes in a step carrying batch tokens."""
    obs = _observe_after("none")
    assert obs.itl_samples > 0
    assert math.isnan(obs.itl_over_slo_batch_frac)
    assert not obs.interactive_wait_batch_frac > 0.0


def test_bare_engines_export_no_share() -> None:
    """Engines without the interference series (bare vLLM behind the gate): the burn is
    still read, its batch shares are not (NaN), as the daemon would read them."""
    obs = _observe_after("priority", interference_series=False)
    assert obs.itl_over_slo_frac > 0.05
    assert math.isnan(obs.itl_over_slo_batch_frac)
    assert math.isnan(obs.interactive_wait_batch_frac)
