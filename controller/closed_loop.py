"""The controller against the engine simulator: policies for `borrowd sim`/`bench`, and
identification experiments run on the simulator.

`SimControllers` is the catalog of closed-loop policies the CLI hands to the simulator
(`models.sim.policies.ControllerCatalog`): one per control law, built by `make_policy`.
`identify_on_simulator` drives the simulator with a bounded PRBS budget (cut to the low level
whenever a signal burns, so the experiment stays safe) and fits a `PlantModel` from what the
controller would have observed (the same smoothing).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from controller.policy import (
    LAWS,
    ControllerConfig,
    ControllerPolicy,
    build_policy,
    derive_budget,
    smooth_step,
)
from controller.supervisor import burning
from models.budget import Budget, Mode
from models.errors import InputError
from models.plant.excitation import prbs
from models.plant.model import FitCriteria, PlantModel, identify_plant
from models.signals import Observation
from models.sim.engine import PRIORITY
from models.sim.policies import PolicySpec
from models.sim.scenario import ENGINE, Scenario

PLANTS_DIR = Path(__file__).parent / "plants"
# Under engine enforcement the per-step limit keeps batch chunks short, so the fleet runs at
# the ITL edge; the ITL loop then aims at a smaller share of gaps above the SLO (0.8 of the
# 5% a p95 allows, against 0.95 with admission only) to keep a margin for bursts.
ENGINE_ITL_BURN_SETPOINT = 0.8


def controller_config(law: str, scenario: Scenario) -> ControllerConfig:
    """The controller settings used on a simulated scenario (SLOs and caps from it; under
    engine enforcement, the ITL burn setpoint `ENGINE_ITL_BURN_SETPOINT`)."""
    base = ControllerConfig(law=law)
    if scenario.enforcement == ENGINE:
        base = replace(base, pi=replace(base.pi, setpoint_itl_burn=ENGINE_ITL_BURN_SETPOINT))
    largest = scenario.batch.prompt_clip_tokens + scenario.batch.output_clip_tokens
    return replace(
        base,
        slo_ttft_p95_s=scenario.slo.ttft_p95_s,
        slo_itl_p95_s=scenario.slo.itl_p95_s,
        slo_success_rate=scenario.slo.success_rate,
        caps=replace(
            base.caps,
            min_burst_tokens=largest,
            max_output_tokens=scenario.batch.output_clip_tokens,
        ),
    )


def default_plant_path(scenario: Scenario) -> Path:
    """The plant shipped for a scenario: `plants/<name>.json`, else the `seed` one."""
    own = PLANTS_DIR / f"{scenario.name}.json"
    return own if own.exists() else PLANTS_DIR / "seed.json"


def make_policy(name: str, scenario: Scenario, plant_path: Path | None) -> ControllerPolicy:
    """The closed-loop policy `name` (pi | mpc | slack) for `scenario`."""
    config = controller_config(name, scenario)
    path = plant_path if plant_path is not None else default_plant_path(scenario)
    if name == "slack" or (name == "pi" and plant_path is None):
        # PI without a plant runs the gains tuned in closed loop on `seed` (README "Tuning").
        plant = None
    elif plant_path is None and not path.exists():
        raise InputError(f"no plant model for scenario {scenario.name!r} at {path}")
    else:
        plant = PlantModel.load(path)
    return build_policy(config, scenario.pool, plant)


@dataclass(frozen=True)
class SimControllers:
    """The closed-loop policies of `borrowd sim`/`bench`: one per control law (picklable, so
    bench workers build their own)."""

    def names(self) -> tuple[str, ...]:
        """The control laws, as policy names."""
        return LAWS

    def spec(self, name: str, scenario: Scenario, plant_path: Path | None) -> PolicySpec:
        """Policy `name` on `scenario`: engines on the priority policy, batch under the law."""
        return PolicySpec(name, PRIORITY, batch=True,
                          controller=Deciding(make_policy(name, scenario, plant_path)))


@dataclass
class Deciding:
    """A `ControllerPolicy` as the simulator's `BudgetPolicy` (`decide` -> `step`)."""

    policy: ControllerPolicy

    @property
    def tick_s(self) -> float:
        """The policy's control period."""
        return self.policy.tick_s

    def decide(self, obs: Observation, now_s: float) -> Budget:
        """The budget `step` decides."""
        return self.policy.step(obs, now_s).budget


@dataclass(frozen=True)
class Experiment:
    """A bounded excitation: PRBS between two budgets, each level held `hold_s`."""

    u_low_tokens_per_s: float = 40_000.0
    u_high_tokens_per_s: float = 80_000.0
    duration_s: float = 900.0
    hold_s: float = 30.0
    tick_s: float = 1.0
    seed: int = 1


@dataclass
class ExcitationPolicy:
    """A `BudgetPolicy` that plays a designed input and records what it observes.

    Safety net: while a signal burns badly enough for the supervisor to revoke, the budget
    drops to the experiment's low level; the record shows the input actually applied.
    """

    config: ControllerConfig
    pool: str
    u_plan: np.ndarray
    u_low: float
    tick_s: float

    def __post_init__(self) -> None:
        self.applied: list[float] = []
        self.observations: list[Observation] = []

    def decide(self, obs: Observation, now_s: float) -> Budget:
        """The planned budget for this tick, cut to the low level when a signal burns."""
        k = min(len(self.applied), len(self.u_plan) - 1)
        u = float(self.u_plan[k])
        reason, severe = burning(obs, self.config.slo(), self.config.supervisor)
        if reason and severe:
            u = min(u, self.u_low)
        self.applied.append(u)
        self.observations.append(obs)
        return derive_budget(self.pool, Mode.OPEN, "identification", u, self.config.caps)


def run_experiment(scenario: Scenario, experiment: Experiment) -> ExcitationPolicy:
    """Run the excitation on the simulator (interactive load as in the scenario, no burst)."""
    from models.sim.run import calibrate_rate_scale, load_inputs
    from models.sim.simulation import Simulation

    config = controller_config("pi", scenario)
    u_plan = prbs(
        experiment.u_low_tokens_per_s,
        experiment.u_high_tokens_per_s,
        experiment.duration_s,
        experiment.tick_s,
        experiment.hold_s,
        experiment.seed,
    )
    policy = ExcitationPolicy(
        config, scenario.pool, u_plan, experiment.u_low_tokens_per_s, experiment.tick_s
    )
    trace, lengths = load_inputs(scenario)
    sim = Simulation(
        scenario,
        PolicySpec("identify", PRIORITY, batch=True, controller=policy),
        duration_s=experiment.duration_s,
        seed=experiment.seed,
        trace=trace,
        rate_scale=calibrate_rate_scale(scenario, trace),
        lengths=lengths,
        with_burst=False,
    )
    sim.run()
    return policy


def identify_on_simulator(
    scenario: Scenario, experiment: Experiment, criteria: FitCriteria | None = None
) -> PlantModel:
    """Excite the simulated fleet and fit its plant; `UnusableFitError` when it cannot."""
    policy = run_experiment(scenario, experiment)
    slo = policy.config.slo()
    warmup = math.ceil(scenario.observe_window_s / experiment.tick_s) + 1
    obs = policy.observations[warmup:]
    u = np.asarray(policy.applied[warmup:])
    cfg = policy.config
    outputs = {
        name: _smoothed(_fill(np.array([norm(o, slo) for o in obs])), experiment.tick_s, cfg)
        for name, norm in (("ttft", Observation.ttft_norm), ("itl", Observation.itl_norm))
    }
    rates = [o.interactive_tokens_per_s for o in obs if math.isfinite(o.interactive_tokens_per_s)]
    return identify_plant(
        u,
        outputs,
        experiment.tick_s,
        interactive_tokens_per_s=float(np.mean(rates)) if rates else math.nan,
        source=f"simulator scenario {scenario.name}, PRBS {experiment.u_low_tokens_per_s:g}-"
        f"{experiment.u_high_tokens_per_s:g} tokens/s, {experiment.duration_s:g} s",
        criteria=criteria,
    )


def _smoothed(y: np.ndarray, dt_s: float, config: ControllerConfig) -> np.ndarray:
    """The series as the policy sees it: through the same asymmetric smoothing."""
    out = np.empty(len(y))
    prev = math.nan
    for k, raw in enumerate(y):
        prev = smooth_step(prev, float(raw), dt_s, config.filter_rise_s, config.filter_fall_s)
        out[k] = prev
    return out


def _fill(y: np.ndarray) -> np.ndarray:
    """Carry the last measured value over NaN gaps (none before the first: its value)."""
    y = y.copy()
    finite = np.flatnonzero(np.isfinite(y))
    if len(finite) == 0:
        raise InputError("the experiment measured no interactive latency at all")
    y[: finite[0]] = y[finite[0]]
    for k in range(finite[0] + 1, len(y)):
        if not math.isfinite(y[k]):
            y[k] = y[k - 1]
    return y
