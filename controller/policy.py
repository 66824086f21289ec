"""The control policy: law + supervisor + caps, deciding one pool's `Budget` per tick.

    obs -> forecast (feed-forward) -> gain schedule (RLS) -> law (pi | mpc | slack)
        -> supervisor (modes, cuts, hysteresis, ramp, failsafe) -> caps -> Budget

The PI and slack laws track each output's SLO burn (share of interactive gaps or first tokens
above the SLO over the 5% a p95 allows, smoothed): it rises smoothly with the batch load, where
the short-window p95 ITL jumps from a decode step to a full prefill step.

The policy is a `BudgetPolicy`: `decide(obs, now_s)` is all a loop (the daemon or the
simulator) calls; time is passed in, nothing here reads a clock or does I/O. Each mode
transition is kept as a `ModeEvent` for the caller to log (`drain_events`).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace

import numpy as np

from controller.laws.feedforward import (
    FeedForwardConfig,
    ForecastState,
    forecast,
    forecast_peak,
    forecast_update,
)
from controller.laws.mpc import (
    MpcConfig,
    MpcOutput,
    MpcState,
    mpc_advance,
    mpc_initial_state,
    mpc_outputs,
    mpc_step,
)
from controller.laws.pi import PiConfig, PiGains, PiLoop, PiState, pi_gains, pi_step
from controller.laws.slack import SlackConfig, slack_step
from controller.supervisor import ModeEvent, SupervisorConfig, SupervisorState, supervise
from models.budget import Budget, Mode, closed_budget
from models.errors import ConfigError
from models.plant.model import PlantModel
from models.plant.rls import LocalGain
from models.signals import SLO_QUANTILE, Observation, Slo

LAWS = ("pi", "mpc", "slack")
OUTPUTS = ("ttft", "itl")


@dataclass(frozen=True)
class CapsConfig:
    """How the caps of a budget follow its token rate u (open and ramp modes only)."""

    burst_s: float = field(
        default=2.0, metadata={"unit": "s", "help": "bucket depth as seconds of the rate"}
    )
    min_burst_tokens: int = field(
        default=33792,
        metadata={"unit": "tokens", "help": "least bucket depth: one largest batch request"},
    )
    tokens_per_s_per_seq: float = field(
        default=2000.0,
        metadata={"unit": "tokens/s", "help": "rate that one concurrent batch sequence carries"},
    )
    max_seqs: int = field(
        default=64, metadata={"unit": "sequences", "help": "most concurrent batch sequences"}
    )
    kv_residence_s: float = field(
        default=10.0,
        metadata={"unit": "s", "help": "batch KV tokens = rate x this (Little's law)"},
    )
    max_kv_tokens: int = field(
        default=800_000, metadata={"unit": "tokens", "help": "most batch KV tokens in flight"}
    )
    max_output_tokens: int = field(
        default=1024, metadata={"unit": "tokens", "help": "largest output of one batch request"}
    )
    hold_s: float = field(
        default=60.0,
        metadata={
            "unit": "s",
            "help": "caps follow the highest rate of this long (a lower rate drains, not revokes)",
        },
    )

    def __post_init__(self) -> None:
        if self.hold_s < 0:
            raise ConfigError(f"caps.hold_s must be >= 0, got {self.hold_s!r}")
        for name in ("burst_s", "tokens_per_s_per_seq", "kv_residence_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"caps.{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("min_burst_tokens", "max_seqs", "max_kv_tokens", "max_output_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"caps.{name} must be >= 1, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class ScheduleConfig:
    """Gain scheduling from an RLS estimate of each output's local gain."""

    enabled: bool = field(default=True, metadata={"unit": "bool", "help": "schedule gains"})
    forgetting: float = field(
        default=0.98, metadata={"unit": "1", "help": "RLS forgetting factor in (0, 1]"}
    )
    max_trace: float = field(
        default=100.0, metadata={"unit": "1", "help": "bound on the RLS covariance trace"}
    )
    min_samples: int = field(
        default=30, metadata={"unit": "ticks", "help": "ticks before the estimate is used"}
    )
    min_ratio: float = field(
        default=0.5, metadata={"unit": "1", "help": "least local/nominal gain ratio used"}
    )
    max_ratio: float = field(
        default=4.0, metadata={"unit": "1", "help": "largest local/nominal gain ratio used"}
    )

    def __post_init__(self) -> None:
        if not 0 < self.forgetting <= 1:
            raise ConfigError(f"schedule.forgetting must be in (0, 1], got {self.forgetting!r}")
        if not 0 < self.min_ratio <= 1 <= self.max_ratio:
            raise ConfigError(
                "schedule needs 0 < min_ratio <= 1 <= max_ratio, got "
                f"{self.min_ratio!r}, {self.max_ratio!r}"
            )


@dataclass(frozen=True)
class ControllerConfig:
    """One pool's controller: law, SLOs, budget range and every sub-block."""

    law: str = field(default="pi", metadata={"unit": "pi|mpc|slack", "help": "control law"})
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
        default=200_000.0, metadata={"unit": "tokens/s", "help": "largest batch budget"}
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
    burn_filter_s: float = field(
        default=10.0,
        metadata={"unit": "s", "help": "smoothing time constant of the SLO burn signals"},
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

    def __post_init__(self) -> None:
        if self.law not in LAWS:
            raise ConfigError(f"controller.law must be one of {LAWS}, got {self.law!r}")
        positive = (
            "tick_s",
            "slo_ttft_p95_s",
            "slo_itl_p95_s",
            "u_max_tokens_per_s",
            "filter_rise_s",
            "filter_fall_s",
            "burn_filter_s",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"controller.{name} must be > 0, got {getattr(self, name)!r}")
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


def derive_budget(
    pool: str,
    mode: Mode,
    reason: str,
    u: float,
    caps: CapsConfig,
    keep: Budget | None = None,
    u_caps: float | None = None,
) -> Budget:
    """The `Budget` for rate `u` in `mode`: caps follow `u_caps` (default u) in open/ramp.

    Otherwise nothing new is admitted; the caps are zero (in-flight batch work is revoked)
    unless `keep` is given, whose caps are kept so that the work in flight drains instead.
    """
    if mode not in (Mode.OPEN, Mode.RAMP) or u <= 0:
        if keep is None:
            return closed_budget(pool, mode, reason)
        return Budget(
            pool=pool,
            mode=mode,
            reason=reason,
            batch_tokens_per_s=0.0,
            batch_burst_tokens=0,
            max_batch_seqs=keep.max_batch_seqs,
            max_batch_kv_tokens=keep.max_batch_kv_tokens,
            max_batch_output_tokens=keep.max_batch_output_tokens,
        )
    cap_rate = max(u, u_caps if u_caps is not None else u)
    return Budget(
        pool=pool,
        mode=mode,
        reason=reason,
        batch_tokens_per_s=u,
        batch_burst_tokens=max(caps.min_burst_tokens, math.ceil(u * caps.burst_s)),
        max_batch_seqs=min(
            caps.max_seqs, max(1, math.ceil(cap_rate / caps.tokens_per_s_per_seq))
        ),
        max_batch_kv_tokens=min(
            caps.max_kv_tokens,
            max(caps.min_burst_tokens, math.ceil(cap_rate * caps.kv_residence_s)),
        ),
        max_batch_output_tokens=caps.max_output_tokens,
    )


def smooth_step(prev: float, raw: float, dt_s: float, rise_s: float, fall_s: float) -> float:
    """One step of asymmetric exponential smoothing (time constant rise_s up, fall_s down).

    A NaN `prev` starts the filter at `raw`; a NaN `raw` holds `prev`.
    """
    if not math.isfinite(raw):
        return prev
    if not math.isfinite(prev):
        return raw
    tau_s = rise_s if raw > prev else fall_s
    return prev + (1.0 - math.exp(-dt_s / tau_s)) * (raw - prev)


@dataclass(frozen=True)
class Decision:
    """One tick's outcome: the budget, the law's proposal and the transitions."""

    budget: Budget
    u_law: float
    events: tuple[ModeEvent, ...]


class ControllerPolicy:
    """A `BudgetPolicy`: law + supervisor + caps for one pool (see the module docstring)."""

    def __init__(self, config: ControllerConfig, pool: str, plant: PlantModel | None) -> None:
        if config.law == "mpc" and plant is None:
            raise ConfigError("controller.law = 'mpc' needs a plant model (borrowd identify)")
        self.config = config
        self.pool = pool
        self.plant = plant
        self.tick_s = config.tick_s
        self.slo = config.slo()
        self.setpoints = (
            {"ttft": config.pi.setpoint_ttft_norm, "itl": config.pi.setpoint_itl_norm}
            if config.law != "mpc"
            else {"ttft": config.mpc.setpoint_ttft_norm, "itl": config.mpc.setpoint_itl_norm}
        )
        self.loops = tuple(
            PiLoop(name, self.setpoints[name], self._gains(name)) for name in OUTPUTS
        )
        self.nominal_gains = tuple(self._nominal_gain(name) for name in OUTPUTS)
        self.u_applied = 0.0
        self.last_now_s = math.nan
        self.pi_state = PiState.initial(len(OUTPUTS))
        self.sup_state = SupervisorState()
        self.forecast_state = ForecastState()
        self.smoothed = (math.nan, math.nan)
        self.burns = (math.nan, math.nan)
        self.burn_setpoints = (config.pi.setpoint_ttft_burn, config.pi.setpoint_itl_burn)
        self.prev_ff_tokens_per_s = math.nan
        self.local_gains = self._start_estimators()
        self.mpc_outs = (
            mpc_outputs(plant, self.tick_s, {n: self.setpoints[n] for n in self._plant_outputs()})
            if config.law == "mpc" and plant is not None
            else ()
        )
        self.mpc_state: MpcState | None = None
        self.events: list[ModeEvent] = []
        self.last_caps: Budget | None = None
        self.recent_u: deque[tuple[float, float]] = deque()
        self.last_success_rate = math.nan

    def _plant_outputs(self) -> tuple[str, ...]:
        names = {o.name for o in self.plant.outputs} if self.plant else set()
        return tuple(n for n in OUTPUTS if n in names)

    def _nominal_gain(self, name: str) -> float:
        if self.plant is None or name not in self._plant_outputs():
            return math.nan
        return self.plant.output(name).gain_per_token_s

    def _gains(self, name: str) -> PiGains:
        pi = self.config.pi
        if self.plant is None or name not in self._plant_outputs():
            return PiGains(kp=pi.kp_tokens_per_s, ki_per_s=pi.ki_tokens_per_s2)
        fit = self.plant.output(name).fopdt(self.plant.dt_s, self.plant.u0_tokens_per_s)
        return pi_gains(fit, pi.method, pi.tc_s, self.tick_s)

    def _start_estimators(self) -> tuple[LocalGain | None, ...]:
        if self.plant is None or not self.config.schedule.enabled:
            return (None,) * len(OUTPUTS)
        out: list[LocalGain | None] = []
        for name in OUTPUTS:
            if name not in self._plant_outputs():
                out.append(None)
                continue
            model = self.plant.output(name)
            out.append(
                LocalGain.start(
                    gain=model.gain_per_token_s,
                    pole=math.exp(-self.tick_s / model.tau_s),
                    y0=model.y0,
                    u0=self.plant.u0_tokens_per_s,
                    dead_steps=round(model.dead_s / self.tick_s),
                    u_scale=max(self.plant.u_high_tokens_per_s, 1.0),
                )
            )
        return tuple(out)

    def gain_ratios(self) -> tuple[float, ...]:
        """Local/nominal gain per output from RLS, clipped to the schedule's range (1: none)."""
        sched = self.config.schedule
        ratios = []
        for est, nominal in zip(self.local_gains, self.nominal_gains, strict=True):
            if est is None or est.samples < sched.min_samples or not nominal > 0:
                ratios.append(1.0)
                continue
            local = est.gain()
            ratio = local / nominal if math.isfinite(local) else 1.0
            ratios.append(min(max(ratio, sched.min_ratio), sched.max_ratio))
        return tuple(ratios)

    def drain_events(self) -> list[ModeEvent]:
        """Transitions since the last call, oldest first."""
        events, self.events = self.events, []
        return events

    def decide(self, obs: Observation, now_s: float) -> Budget:
        """The budget for the next tick (the `BudgetPolicy` entry point)."""
        return self.step(obs, now_s).budget

    def step(self, obs: Observation, now_s: float, *, stopped: bool = False) -> Decision:
        """One tick: law, supervisor and caps; returns the budget, law proposal and events."""
        cfg = self.config
        dt_s = now_s - self.last_now_s if math.isfinite(self.last_now_s) else self.tick_s
        dt_s = min(max(dt_s, 1e-3), 10 * self.tick_s)
        self.last_now_s = now_s
        self._smooth_burns(obs, dt_s)
        obs = self._smooth(obs, dt_s)
        ys = (obs.ttft_norm(self.slo), obs.itl_norm(self.slo))
        self.forecast_state = forecast_update(
            self.forecast_state, obs.interactive_tokens_per_s, cfg.feedforward
        )
        u_law = self._law(ys, dt_s)
        decision = supervise(
            cfg.supervisor, self.sup_state, obs, self.slo, u_law, dt_s, now_s, stopped=stopped
        )
        self.sup_state = decision.state
        if self.mpc_state is not None:
            v_now = decision.u + cfg.feedforward.gain * _finite_or(self.forecast_state.level, 0.0)
            self.mpc_state = mpc_advance(self._scheduled_mpc_outputs(), self.mpc_state, v_now)
        self._estimate(ys, decision.u)
        self.u_applied = decision.u
        self.events.extend(decision.events)
        keep = None if decision.revoke else self.last_caps
        self.recent_u.append((now_s, decision.u))
        while self.recent_u and self.recent_u[0][0] < now_s - cfg.caps.hold_s:
            self.recent_u.popleft()
        u_caps = max(u for _, u in self.recent_u) if not decision.revoke else decision.u
        budget = derive_budget(
            self.pool, decision.mode, decision.reason, decision.u, cfg.caps, keep, u_caps
        )
        self.last_caps = budget if budget.max_batch_seqs > 0 else None
        return Decision(budget=budget, u_law=u_law, events=decision.events)

    def _smooth(self, obs: Observation, dt_s: float) -> Observation:
        """The observation with its p95s replaced by their asymmetric exponential smoothing,
        and its shares above the SLOs by their smoothing (NaN when `control_on_burn` is off).

        A short sliding-window p95 over a few requests is noisy; the smoothing rises faster
        than it falls, so it errs on the safe side. A window without interactive requests
        holds the smoothed value; a p95 missing for any other reason stays NaN (failsafe).
        """
        cfg = self.config
        values = []
        for raw, prev in zip((obs.ttft_p95_s, obs.itl_p95_s), self.smoothed, strict=True):
            if not math.isfinite(raw):
                values.append(prev if obs.interactive_requests == 0 else math.nan)
                continue
            values.append(smooth_step(prev, raw, dt_s, cfg.filter_rise_s, cfg.filter_fall_s))
        self.smoothed = tuple(
            v if math.isfinite(v) else p for v, p in zip(values, self.smoothed, strict=True)
        )
        success = obs.success_rate
        if math.isfinite(success):
            self.last_success_rate = success
        elif math.isfinite(obs.interactive_requests):
            # No request completed in the window: no failure seen; keep the last rate.
            success = self.last_success_rate if math.isfinite(self.last_success_rate) else 1.0
        shares = (
            (b * (1.0 - SLO_QUANTILE) if self.config.control_on_burn else math.nan)
            for b in self.burns
        )
        ttft_share, itl_share = shares
        return replace(
            obs,
            ttft_p95_s=values[0],
            itl_p95_s=values[1],
            success_rate=success,
            ttft_over_slo_frac=ttft_share,
            itl_over_slo_frac=itl_share,
        )

    def _smooth_burns(self, obs: Observation, dt_s: float) -> None:
        """Fold this window's SLO burns into their exponential smoothing (NaN: hold)."""
        tau_s = self.config.burn_filter_s
        raws = (obs.ttft_burn(), obs.itl_burn())
        self.burns = tuple(
            smooth_step(prev, raw, dt_s, tau_s, tau_s)
            for prev, raw in zip(self.burns, raws, strict=True)
        )

    def law_outputs(self, ys: tuple[float, ...]) -> tuple[tuple[float, ...], tuple[PiLoop, ...]]:
        """What the law tracks per output: its smoothed SLO burn against the burn setpoint
        when measured (and `control_on_burn`), else its p95/SLO against the p95 setpoint."""
        if not self.config.control_on_burn:
            return ys, self.loops
        outs, loops = [], []
        for y, burn, loop, sp in zip(ys, self.burns, self.loops, self.burn_setpoints, strict=True):
            if math.isfinite(burn):
                outs.append(burn)
                loops.append(replace(loop, setpoint=sp))
            else:
                outs.append(y)
                loops.append(loop)
        return tuple(outs), tuple(loops)

    def _estimate(self, ys: tuple[float, ...], u: float) -> None:
        sched = self.config.schedule
        self.local_gains = tuple(
            est.update(u, y, sched.forgetting, sched.max_trace) if est is not None else None
            for est, y in zip(self.local_gains, ys, strict=True)
        )

    def _feedforward_tokens_per_s(self) -> float:
        """Budget share the forecast interactive rate takes: gain x peak forecast rate."""
        ff = self.config.feedforward
        peak = forecast_peak(self.forecast_state, round(ff.horizon_s / self.tick_s))
        return ff.gain * peak if math.isfinite(peak) else math.nan

    def _law(self, ys: tuple[float, ...], dt_s: float) -> float:
        cfg = self.config
        u_max = cfg.u_max_tokens_per_s
        if cfg.law == "slack":
            return slack_step(self.law_outputs(ys)[0], self.u_applied, cfg.slack, 0.0, u_max)
        if cfg.law == "mpc":
            return self._mpc(ys, u_max)
        ff_now = self._feedforward_tokens_per_s()
        du_ff = 0.0
        if math.isfinite(ff_now) and math.isfinite(self.prev_ff_tokens_per_s):
            du_ff = -(ff_now - self.prev_ff_tokens_per_s)
        if math.isfinite(ff_now):
            self.prev_ff_tokens_per_s = ff_now
        ratios = self.gain_ratios()
        outs, loops = self.law_outputs(ys)
        result = pi_step(
            loops,
            self.pi_state,
            outs,
            self.u_applied,
            dt_s,
            0.0,
            u_max,
            du_ff=du_ff,
            gain_scales=tuple(1.0 / r for r in ratios),
            decrease_boost=cfg.pi.decrease_boost,
        )
        self.pi_state = result.state
        return result.u

    def _mpc(self, ys: tuple[float, ...], u_max: float) -> float:
        cfg = self.config
        ff = cfg.feedforward
        n = max(1, round(cfg.mpc.horizon_s / self.tick_s))
        level = self.forecast_state.level
        d_forecast = (
            np.concatenate([[level], forecast(self.forecast_state, n - 1)])
            if math.isfinite(level)
            else np.zeros(n)
        )
        names = self._plant_outputs()
        outs = self._scheduled_mpc_outputs()
        if self.mpc_state is None:
            self.mpc_state = mpc_initial_state(outs, self.u_applied + ff.gain * d_forecast[0])
        measured = tuple(ys[OUTPUTS.index(name)] for name in names)
        result = mpc_step(
            outs,
            self.mpc_state,
            measured,
            self.u_applied,
            d_forecast,
            ff.gain,
            cfg.mpc,
            self.tick_s,
            0.0,
            u_max,
        )
        return result.u

    def _scheduled_mpc_outputs(self) -> tuple[MpcOutput, ...]:
        ratios = dict(zip(OUTPUTS, self.gain_ratios(), strict=True))
        return tuple(
            MpcOutput(o.name, o.gain * ratios[o.name], o.pole, o.dead_steps, o.setpoint)
            for o in self.mpc_outs
        )


def _finite_or(value: float, default: float) -> float:
    return value if math.isfinite(value) else default


def build_policy(
    config: ControllerConfig, pool: str, plant: PlantModel | None, *, tick_s: float | None = None
) -> ControllerPolicy:
    """The policy the daemon runs for `pool` (`tick_s` overrides the config's tick)."""
    if tick_s is not None:
        config = replace(config, tick_s=tick_s)
    return ControllerPolicy(config, pool, plant)
