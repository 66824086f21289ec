"""Engine enforcement: a closed budget that keeps its caps drains the batch in flight at the
step floor, and batch resumes when the budget reopens."""

from __future__ import annotations

from dataclasses import dataclass

from borrowd.models.budget import Budget, Mode
from borrowd.models.enforcement import ENGINE
from borrowd.models.sim.policies import PolicySpec
from borrowd.models.sim.run import load_inputs
from borrowd.models.sim.scenario import SEED
from borrowd.models.sim.simulation import Simulation


def budget(mode: Mode, rate: float) -> Budget:
    """A budget keeping 8 batch sequences' caps (a closed one lets in-flight work stay)."""
    return Budget(pool="seed", mode=mode, reason="test", batch_tokens_per_s=rate,
                  batch_burst_tokens=100_000 if rate else 0, max_batch_seqs=8,
                  max_batch_kv_tokens=8 * 33_792, max_batch_output_tokens=1024)


@dataclass
class CloseThenReopen:
    """Open, closed from 10 s to 15 s, open again; published into the simulation's store."""

    sim: Simulation | None = None
    tick_s: float = 1.0

    def tick(self, now_s: float) -> Budget:
        """The script's budget at `now_s`, published."""
        assert self.sim is not None
        closed = 10.0 <= now_s < 15.0
        b = budget(Mode.CLOSED, 0.0) if closed else budget(Mode.OPEN, 40_000.0)
        return self.sim.store.publish(b, epoch=1, ttl_ms=5000, now_s=now_s)


def test_batch_drains_under_a_closed_budget_and_resumes_without_interactive_traffic() -> None:
    """With almost no interactive traffic to wake the replicas, batch in flight when the
    budget closed drains at the step floor (nothing new starts, so the rate dies away
    instead of holding KV until a reopen), and batch is computed at the open rate again once
    the budget reopens."""
    scenario = SEED.with_overrides(enforcement=ENGINE, burst=None)
    trace, lengths = load_inputs(scenario)
    loop = CloseThenReopen()
    spec = PolicySpec("scripted", "priority", batch=True,
                      loop=lambda source, store, election: loop)
    sim = Simulation(scenario, spec, duration_s=40.0, seed=3, trace=trace, rate_scale=1e-4,
                     lengths=lengths)
    loop.sim = sim
    sim.run()
    computed = sim.rec.batch_tokens_per_s
    open_rate = sum(computed[0:10]) / 10
    assert 0 < sum(computed[10:15]) < open_rate
    assert computed[14] < 0.05 * open_rate  # the work in flight is done, none started
    assert sum(computed[20:40]) / 20 > 0.5 * open_rate
