"""The controller against the engine simulator: the pools `borrowd sim`/`bench` run, and
identification experiments run on the simulator.

`SimControllers` is the catalog of closed-loop policies the CLI hands to the simulator
(`models.sim.policies.ControllerCatalog`): one per registered law, each run as the daemon runs
a pool, by its own `PoolLoop` (`sim_loop_factory`) over the pool's config: from a daemon TOML
(`borrowd sim --config FILE [--pool P]`), or else the pool of `borrowd config example` with
the scenario's SLOs and batch sizes. `identify_on_simulator` drives the simulator with a
bounded PRBS budget (cut to the low level whenever a signal burns, so the experiment stays
safe) through the same loop and fits a `PlantModel` from what the controller would have
observed (the same smoothing).
"""

from __future__ import annotations

import logging
import math
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import structlog
from borrowd.controller.config import BorrowdConfig, PoolConfig, config_from_mapping, example_config
from borrowd.controller.identify import tracked_series, tracked_signal
from borrowd.controller.loop import Controller, PoolLoop
from borrowd.controller.loop_metrics import DaemonMetrics
from borrowd.controller.policy import (
    LAWS,
    ControllerConfig,
    ControllerPolicy,
    Decision,
    derive_budget,
)
from borrowd.controller.pools import build_pool_policy
from borrowd.controller.prom_source import window_seconds
from borrowd.controller.supervisor import burning
from borrowd.models.budget import Mode
from borrowd.models.config_loader import parse_settings, with_settings
from borrowd.models.errors import InputError
from borrowd.models.plant.excitation import prbs
from borrowd.models.plant.model import FitCriteria, PlantModel, identify_plant
from borrowd.models.protocols import Election, LoopFactory, MetricsSource, Store, TickLoop
from borrowd.models.signals import Observation
from borrowd.models.sim.engine import PRIORITY
from borrowd.models.sim.policies import PolicySpec
from borrowd.models.sim.scenario import Scenario

PLANTS_DIR = Path(__file__).parent / "plants"


# The simulator's loop logs nothing below CRITICAL (it logs nothing critical): a tick per
# simulated second would flood the output.
QUIET_LOG = structlog.wrap_logger(
    None, wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL)
)


def example_config_parsed() -> BorrowdConfig:
    """`borrowd config example` as the daemon reads it: the built-in defaults."""
    return config_from_mapping(tomllib.loads(example_config()), {})


def example_pool() -> PoolConfig:
    """The pool of `borrowd config example`: the daemon's built-in defaults."""
    return example_config_parsed().pools[0]


def controller_config(law: str, scenario: Scenario,
                      base: ControllerConfig | None = None) -> ControllerConfig:
    """The controller settings used on a simulated scenario without a config file: `base`
    (default: the example config's) with law `law`, the scenario's SLOs, batch sizes and
    enforcement (`controller.enforcement`, as the operator of such a fleet sets it)."""
    base = replace(base if base is not None else example_pool().controller, law=law,
                   enforcement=scenario.enforcement)
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


def default_plant(name: str, scenario: Scenario, plant_path: Path | None) -> PlantModel | None:
    """The plant law `name` runs with on `scenario` without a config file: `plant_path`, or
    for MPC the plant shipped for the scenario (PI without one runs the gains tuned in closed
    loop on `seed`, README "Tuning"; slack needs none)."""
    if name == "slack" or (name == "pi" and plant_path is None):
        return None
    path = plant_path if plant_path is not None else default_plant_path(scenario)
    if plant_path is None and not path.exists():
        raise InputError(f"no plant model for scenario {scenario.name!r} at {path}")
    return PlantModel.load(path)


def default_sim_pool(name: str, scenario: Scenario) -> PoolConfig:
    """The pool a scenario runs without a config file (see `controller_config`)."""
    pool = example_pool()
    return scenario_replicas(
        replace(pool, name=scenario.pool,
                controller=controller_config(name, scenario, pool.controller)),
        scenario,
    )


def scenario_replicas(pool: PoolConfig, scenario: Scenario) -> PoolConfig:
    """`pool` with the simulated fleet's replica count, and its batch-eligible count when the
    scenario restricts batch to some replicas (0: all), so its limits are sized to them as
    the daemon's config sizes them for a real fleet (`pools.pool_controller`)."""
    eligible = len(scenario.batch_replicas()) if scenario.batch_restricted() else 0
    return replace(pool, replicas=scenario.replicas, batch_replicas=eligible)


def make_policy(name: str, scenario: Scenario, plant_path: Path | None) -> ControllerPolicy:
    """The closed-loop policy `name` (a registered law) for `scenario` without a config file."""
    return build_pool_policy(default_sim_pool(name, scenario),
                             default_plant(name, scenario, plant_path))


def sim_loop_factory(pool: PoolConfig, make_controller: Callable[[], Controller]) -> LoopFactory:
    """The daemon's `PoolLoop` for `pool` around a controller from `make_controller`, over
    whatever metrics source, store and election the simulation hands it (metrics kept,
    nothing logged)."""

    def build(source: MetricsSource, store: Store, election: Election) -> TickLoop:
        controller = make_controller()
        state: Callable[[], Mapping[str, float]] = (
            controller.state if isinstance(controller, ControllerPolicy) else dict
        )
        return PoolLoop(
            pool.name,
            ttl_ms=pool.budget_ttl_ms,
            source=source,
            policy=controller,
            store=store,
            election=election,
            metrics=DaemonMetrics(),
            query_age_s=lambda _pool, _now_s: 0.0,
            controller_state=state,
            log=QUIET_LOG,
        )

    return build


@dataclass(frozen=True)
class SimControllers:
    """The closed-loop policies of `borrowd sim`/`bench`, one per registered law, each run as
    the daemon runs a pool (picklable, so bench workers build their own).

    With `config`, the pool named `pool` (or its only pool) runs exactly as in that file,
    except that the policy name picks the law and the scenario's pool name labels it;
    without, the pool of `borrowd config example` with the scenario's SLOs and batch sizes.
    `settings` (`KEY=VALUE`, keys under the pool's `controller` table, as `--set` gives them)
    go over either.
    """

    config: BorrowdConfig | None = None
    pool: str | None = None
    settings: tuple[str, ...] = ()

    def names(self) -> tuple[str, ...]:
        """The registered laws, as policy names."""
        return LAWS

    def pool_config(self, name: str, scenario: Scenario) -> PoolConfig:
        """The pool settings law `name` runs under on `scenario`."""
        if self.config is None:
            pool = default_sim_pool(name, scenario)
        else:
            chosen = self.config.pool_named(self.pool)
            pool = scenario_replicas(
                replace(chosen, name=scenario.pool,
                        controller=replace(chosen.controller, law=name)),
                scenario,
            )
        if not self.settings:
            return pool
        controller = with_settings(pool.controller, parse_settings(self.settings), "controller")
        return replace(pool, controller=controller)

    def spec(self, name: str, scenario: Scenario, plant_path: Path | None) -> PolicySpec:
        """Policy `name` on `scenario`: engines on the priority policy, batch under the pool's
        loop; `plant_path` stands in for the pool's plant file."""
        pool = self.pool_config(name, scenario)
        if self.config is None:
            plant = default_plant(name, scenario, plant_path)
        else:
            plant = PlantModel.load(plant_path) if plant_path is not None else None
        build_pool_policy(pool, plant)  # a bad setting fails here
        config = self.config if self.config is not None else example_config_parsed()
        return PolicySpec(name, PRIORITY, batch=True, loop=sim_loop_factory(
            pool, lambda: build_pool_policy(pool, plant)),
            observe_window_s=window_seconds(config.prometheus.window))


@dataclass(frozen=True)
class Experiment:
    """A bounded excitation: PRBS between two budgets, each level held `hold_s`."""

    u_low_tokens_per_s: float = 40_000.0
    u_high_tokens_per_s: float = 80_000.0
    duration_s: float = 900.0
    hold_s: float = 30.0
    tick_s: float = 1.0
    seed: int = 1
    # The law the plant is for: it decides the signal fitted (`identify.tracked_signal`).
    law: str = "pi"


@dataclass
class ExcitationPolicy:
    """A controller (for `PoolLoop`) that plays a designed input and records what it observes.

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

    def step(self, obs: Observation, now_s: float, *, stopped: bool = False,
             ceiling_tokens_per_s: float | None = None) -> Decision:
        """The planned budget for this tick, cut to the low level when a signal burns (zero
        while the stop switch is set; the simulated pool's store sets no rollout ceiling, and
        the experiment's plan is its own)."""
        k = min(len(self.applied), len(self.u_plan) - 1)
        u = float(self.u_plan[k])
        reason, severe = burning(obs, self.config.slo(), self.config.supervisor)
        if reason and severe:
            u = min(u, self.u_low)
        if stopped:
            u = 0.0
        self.applied.append(u)
        self.observations.append(obs)
        mode = Mode.STOPPED if stopped else Mode.OPEN
        budget = derive_budget(self.pool, mode, "identification", u, self.config.caps,
                               kv_capacity_tokens=obs.kv_capacity_tokens)
        return Decision(budget=budget, u_law=u, events=())


def experiment_window_s() -> float:
    """The signal window an identification run reads: the daemon's default rules window."""
    return window_seconds(example_config_parsed().prometheus.window)


def run_experiment(scenario: Scenario, experiment: Experiment) -> ExcitationPolicy:
    """Run the excitation on the simulator (interactive load as in the scenario, no burst)."""
    from borrowd.models.sim.run import calibrate_rate_scale, load_inputs
    from borrowd.models.sim.simulation import Simulation

    pool = default_sim_pool(experiment.law, scenario)
    config = pool.controller
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
        PolicySpec("identify", PRIORITY, batch=True,
                   loop=sim_loop_factory(pool, lambda: policy),
                   observe_window_s=experiment_window_s()),
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
    warmup = math.ceil(experiment_window_s() / experiment.tick_s) + 1
    obs = policy.observations[warmup:]
    u = np.asarray(policy.applied[warmup:])
    cfg = policy.config
    outputs = tracked_series(obs, cfg, experiment.tick_s)
    rates = [o.interactive_tokens_per_s for o in obs if math.isfinite(o.interactive_tokens_per_s)]
    return identify_plant(
        u,
        outputs,
        experiment.tick_s,
        interactive_tokens_per_s=float(np.mean(rates)) if rates else math.nan,
        source=f"simulator scenario {scenario.name}, PRBS {experiment.u_low_tokens_per_s:g}-"
        f"{experiment.u_high_tokens_per_s:g} tokens/s, {experiment.duration_s:g} s",
        criteria=criteria,
        signal=tracked_signal(cfg),
    )
