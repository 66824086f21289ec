"""The control policy of one pool: a registered law in its wrappers, the supervisor, the caps.

    obs -> Smoothed( UseValidated( EdgeMemory( FeedForward( GainScheduled( law ) ) ) ) )
                                                                       law: pi | mpc | ...
        -> supervisor (modes, cuts, hysteresis, ramp, failsafe) -> Capped -> Budget

Laws are looked up by name in `controller.laws.registry`; smoothing
(`controller.laws.smoothing`), feed-forward and gain scheduling (`controller.laws.wrappers`),
growth that slows near the last budget cut (`controller.laws.edge`) and use validation
(`controller.laws.validation`) wrap whichever law is configured, and `controller.caps`
derives the budget's caps from the supervised rate. The PI and slack laws track each
output's SLO burn (share of interactive gaps or first tokens above the SLO over the 5% a p95
allows, smoothed): it rises smoothly with the batch load, where the short-window p95 ITL
jumps from a decode step to a full prefill step.

`ControllerPolicy.step(obs, now_s, stopped=...)` is what the daemon's `PoolLoop` calls each
tick, in production and in the simulator alike; time is passed in, nothing here reads a
clock or does I/O. Each mode transition comes back as a `ModeEvent` in the `Decision`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, is_dataclass, replace

from borrowd.controller.burn import BurnConfig
from borrowd.controller.caps import Capped, CapsConfig, derive_budget
from borrowd.controller.laws.base import OUTPUTS, Law, LawSettings, LawTick
from borrowd.controller.laws.edge import EdgeConfig, EdgeMemory
from borrowd.controller.laws.feedforward import FeedForwardConfig
from borrowd.controller.laws.mpc import MpcConfig
from borrowd.controller.laws.pi import PiConfig
from borrowd.controller.laws.prediction import BurnPredicted, PredictConfig
from borrowd.controller.laws.registry import build_law, law_names
from borrowd.controller.laws.slack import SlackConfig
from borrowd.controller.laws.smoothing import Smoothed, SmoothingConfig, smooth_step
from borrowd.controller.laws.validation import UseValidated, ValidationConfig
from borrowd.controller.laws.wrappers import FeedForward, GainScheduled, ScheduleConfig
from borrowd.controller.supervisor import (
    NO_BURNS,
    ModeEvent,
    RampInputs,
    SupervisorConfig,
    SupervisorState,
    supervise,
)
from borrowd.models.budget import Budget
from borrowd.models.config_loader import meta
from borrowd.models.enforcement import ADMISSION, ENFORCEMENTS, ENGINE
from borrowd.models.errors import ConfigError
from borrowd.models.plant.model import PlantModel
from borrowd.models.signals import Observation, Slo

LAWS = law_names()

__all__ = [
    "LAWS",
    "OUTPUTS",
    "CapsConfig",
    "ControllerConfig",
    "ControllerPolicy",
    "Decision",
    "ScheduleConfig",
    "build_policy",
    "derive_budget",
    "smooth_step",
]


@dataclass(frozen=True)
class ControllerConfig:
    """One pool's controller: law, SLOs, budget range and every sub-block."""

    law: str = field(
        default="pi",
        metadata={"unit": "|".join(law_names()), "help": "control law (controller.laws.registry)"},
    )
    tick_s: float = field(default=1.0, metadata={"unit": "s", "help": "control period"})
    slo_ttft_p95_s: float = field(
        default=1.0, metadata={"unit": "s", "help": "interactive p95 TTFT objective"}
    )
    slo_itl_p95_s: float = field(
        default=0.050, metadata={"unit": "s", "help": "interactive p95 ITL objective"}
    )
    slo_success_rate: float = field(
        default=0.99, metadata={"unit": "1", "help": "interactive success-rate objective"}
    )
    u_max_tokens_per_s: float = field(
        default=200_000.0,
        metadata=meta("tokens/s", "largest batch budget", per_pool=True),
    )
    limits_replicas: int = field(
        default=4,
        metadata={
            "unit": "replicas",
            "help": (
                "the pool size the pool-wide rates are written for (u_max_tokens_per_s, "
                "caps.max_seqs, the supervisor's ramp cap and floor, the PI's gains and gain "
                "reference, the MPC's rate limits, slack.grow_step_tokens_per_s): on a pool "
                "whose replicas is set they scale by replicas / limits_replicas (0: as "
                "written at any size)"
            ),
        },
    )
    filter_rise_s: float = field(
        default=5.0,
        metadata={"unit": "s", "help": "smoothing time constant of a rising latency signal"},
    )
    filter_fall_s: float = field(
        default=15.0,
        metadata={"unit": "s", "help": "smoothing time constant of a falling latency signal"},
    )
    control_on_burn: bool = field(
        default=True,
        metadata={
            "unit": "bool",
            "help": (
                "PI and slack track the SLO burn (share above SLO / 0.05) and the supervisor "
                "cuts on it when measured, else p95/SLO (MPC keeps p95/SLO, as its plant)"
            ),
        },
    )
    enforcement: str = field(
        default=ADMISSION,
        metadata={
            "unit": "|".join(ENFORCEMENTS),
            "help": (
                "how the pool's engines enforce the budget: admission (gate and proxy only) or "
                "engine (the vLLM scheduler plugin too: batch chunks stay short, the fleet runs "
                "at the ITL edge, and the PI's ITL burn setpoint is pi.setpoint_itl_burn_engine)"
            ),
        },
    )
    burn: BurnConfig = field(
        default_factory=BurnConfig,
        metadata={"unit": "table", "help": "SLO burn windows, sample counts and bounds"},
    )
    pi: PiConfig = field(default_factory=PiConfig, metadata={"unit": "table", "help": "PI law"})
    mpc: MpcConfig = field(
        default_factory=MpcConfig, metadata={"unit": "table", "help": "MPC law"}
    )
    slack: SlackConfig = field(
        default_factory=SlackConfig, metadata={"unit": "table", "help": "slack-threshold law"}
    )
    feedforward: FeedForwardConfig = field(
        default_factory=FeedForwardConfig,
        metadata={"unit": "table", "help": "feed-forward from the interactive token rate"},
    )
    supervisor: SupervisorConfig = field(
        default_factory=SupervisorConfig, metadata={"unit": "table", "help": "modes and limits"}
    )
    caps: CapsConfig = field(
        default_factory=CapsConfig, metadata={"unit": "table", "help": "caps derived from u"}
    )
    schedule: ScheduleConfig = field(
        default_factory=ScheduleConfig, metadata={"unit": "table", "help": "gain scheduling"}
    )
    validation: ValidationConfig = field(
        default_factory=ValidationConfig,
        metadata={"unit": "table", "help": "budget growth only on batch work actually carried"},
    )
    edge: EdgeConfig = field(
        default_factory=EdgeConfig,
        metadata={"unit": "table", "help": "growth slows near the last budget that was cut"},
    )
    predict: PredictConfig = field(
        default_factory=PredictConfig,
        metadata={"unit": "table", "help": "the law tracks the burns the budget now will cause"},
    )

    def __post_init__(self) -> None:
        if self.law not in law_names():
            raise ConfigError(f"controller.law must be one of {law_names()}, got {self.law!r}")
        if self.enforcement not in ENFORCEMENTS:
            raise ConfigError(f"controller.enforcement must be one of {ENFORCEMENTS}, got "
                              f"{self.enforcement!r}")
        positive = (
            "tick_s",
            "slo_ttft_p95_s",
            "slo_itl_p95_s",
            "u_max_tokens_per_s",
            "filter_rise_s",
            "filter_fall_s",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"controller.{name} must be > 0, got {getattr(self, name)!r}")
        if self.limits_replicas < 0:
            raise ConfigError(
                f"controller.limits_replicas must be >= 0, got {self.limits_replicas!r}"
            )
        if not 0 < self.slo_success_rate <= 1:
            raise ConfigError(
                f"controller.slo_success_rate must be in (0, 1], got {self.slo_success_rate!r}"
            )

    def slo(self) -> Slo:
        """The SLOs as the `Slo` record observations are normalised by."""
        return Slo(
            ttft_p95_s=self.slo_ttft_p95_s,
            itl_p95_s=self.slo_itl_p95_s,
            success_rate=self.slo_success_rate,
        )


    def law_settings(self, plant: PlantModel | None) -> LawSettings:
        """What the law factories are built from: tick, budget range, plant, the tables."""
        tables = {
            f.name: getattr(self, f.name) for f in fields(self)
            if is_dataclass(getattr(self, f.name))
        }
        return LawSettings(self.tick_s, self.u_max_tokens_per_s, plant, tables,
                           enforcement=self.enforcement)

    def smoothing(self) -> SmoothingConfig:
        """The smoothing wrapper's settings."""
        return SmoothingConfig(self.slo(), self.filter_rise_s, self.filter_fall_s,
                               self.burn, self.control_on_burn)


@dataclass(frozen=True)
class Decision:
    """One tick's outcome: the budget, the law's proposal and the transitions."""

    budget: Budget
    u_law: float
    events: tuple[ModeEvent, ...]


def wrapped_law(config: ControllerConfig, plant: PlantModel | None) -> Smoothed:
    """The configured law inside its wrappers: smoothing, use validation, edge memory,
    feed-forward, gain schedule, burn prediction."""
    settings = config.law_settings(plant)
    law: Law = BurnPredicted(build_law(config.law, settings), config.predict)
    law = GainScheduled(law, config.schedule, settings)
    law = FeedForward(law, config.feedforward, config.tick_s)
    law = EdgeMemory(law, config.edge, config.enforcement)
    law = UseValidated(law, config.validation, config.u_max_tokens_per_s)
    return Smoothed(law, config.smoothing())


class ControllerPolicy:
    """One pool's controller: wrapped law -> supervisor -> caps (module docstring)."""

    def __init__(self, config: ControllerConfig, pool: str, plant: PlantModel | None) -> None:
        self.config = config
        self.pool = pool
        self.tick_s = config.tick_s
        self.slo = config.slo()
        self.law = wrapped_law(config, plant)
        self.caps = Capped(pool, config.caps)
        self.sup_state = SupervisorState()
        self.u_applied = 0.0
        self.last_now_s = math.nan

    def step(self, obs: Observation, now_s: float, *, stopped: bool = False,
             ceiling_tokens_per_s: float | None = None) -> Decision:
        """One tick: law, supervisor and caps; returns the budget, law proposal and events.
        The rollout ceiling (None: unset) caps the u applied, which the law is told, so its
        state saturates at the ceiling (anti-windup) and follows a raised one at once."""
        dt_s = now_s - self.last_now_s if math.isfinite(self.last_now_s) else self.tick_s
        dt_s = min(max(dt_s, 1e-3), 10 * self.tick_s)
        self.last_now_s = now_s
        in_force = self.caps.last_caps
        tick = LawTick(obs, (obs.ttft_norm(self.slo), obs.itl_norm(self.slo)), self.u_applied,
                       dt_s, batch_seqs_cap=(in_force.max_batch_seqs if in_force is not None
                                             else math.inf))
        proposal = self.law.propose(tick)
        burns = self.law.readings if self.config.control_on_burn else NO_BURNS
        decision = supervise(
            self.config.supervisor, self.sup_state, proposal.tick.obs, self.slo,
            proposal.u_tokens_per_s, dt_s, now_s, stopped=stopped, burns=burns,
            ceiling=proposal.ceiling_tokens_per_s,
            ramp=RampInputs(step_guarded=self.config.enforcement == ENGINE,
                            forecast_tokens_per_s=proposal.tick.du_forecast_tokens_per_s),
        )
        self.sup_state = decision.state
        if ceiling_tokens_per_s is not None and decision.u > ceiling_tokens_per_s:
            decision = replace(decision, u=max(0.0, ceiling_tokens_per_s), reason=(
                f"{decision.reason}; rollout ceiling {ceiling_tokens_per_s:g}"))
        self.law.applied(proposal.tick, decision.u)
        self.u_applied = decision.u
        budget = self.caps.budget(decision, now_s, obs.kv_capacity_tokens)
        return Decision(budget=budget, u_law=proposal.u_tokens_per_s, events=decision.events)

    def state(self) -> dict[str, float]:
        """Internal state as named numbers, for `borrowd_controller_state` (the PI runs in
        velocity form, so its integral state is the budget it last applied)."""
        return {
            "u_applied_tokens_per_s": self.u_applied,
            "ramp_ceiling_tokens_per_s": self.sup_state.ramp_tokens_per_s,
            **self.law.state(),
        }


def build_policy(
    config: ControllerConfig, pool: str, plant: PlantModel | None, *, tick_s: float | None = None
) -> ControllerPolicy:
    """The policy the daemon runs for `pool` (`tick_s` overrides the config's tick)."""
    if tick_s is not None:
        config = replace(config, tick_s=tick_s)
    return ControllerPolicy(config, pool, plant)
