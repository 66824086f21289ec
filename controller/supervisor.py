"""The supervisor: modes, hard limits and hysteresis above any control law.

    open     the law sets the budget
    ramp     reopening: budget = min(law, ramp), ramp += slew * dt, until the cap or the law binds
    closed   budget 0: entered at once when an SLO burns, KV usage passes its limit or the
             oldest interactive wait passes its limit; left only after every signal has stayed
             under its (lower) reopen threshold for `quiet_s`, into ramp
    stopped  budget 0 while the operator's stop switch is set; left into closed
    failsafe budget at the floor (0 by default) while any required signal is missing, NaN or
             stale; left into closed

`supervise` is pure: it takes the state and the time and returns the new state, the budget
and every transition as a `ModeEvent` with its reason, for the caller to log.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from models.budget import Mode
from models.errors import ConfigError
from models.signals import Observation, Slo

REQUIRED_SIGNALS = (
    "ttft_p95_s",
    "itl_p95_s",
    "success_rate",
    "kv_usage_frac",
    "interactive_oldest_wait_s",
)


@dataclass(frozen=True)
class SupervisorConfig:
    """Cut and reopen thresholds (cut > reopen: hysteresis), quiet hold, ramp, staleness."""

    cut_ttft_norm: float = field(
        default=1.0, metadata={"unit": "p95 TTFT / SLO", "help": "cut at or above"}
    )
    reopen_ttft_norm: float = field(
        default=0.8, metadata={"unit": "p95 TTFT / SLO", "help": "quiet below"}
    )
    cut_itl_norm: float = field(
        default=1.0, metadata={"unit": "p95 ITL / SLO", "help": "cut at or above"}
    )
    reopen_itl_norm: float = field(
        default=0.9, metadata={"unit": "p95 ITL / SLO", "help": "quiet below"}
    )
    cut_kv_frac: float = field(
        default=0.97, metadata={"unit": "fraction of KV cache", "help": "cut at or above"}
    )
    reopen_kv_frac: float = field(
        default=0.90, metadata={"unit": "fraction of KV cache", "help": "quiet below"}
    )
    cut_oldest_wait_s: float = field(
        default=2.0, metadata={"unit": "s", "help": "cut when the oldest interactive wait is above"}
    )
    reopen_oldest_wait_s: float = field(
        default=0.5, metadata={"unit": "s", "help": "quiet when the oldest wait is below"}
    )
    quiet_s: float = field(
        default=10.0, metadata={"unit": "s", "help": "quiet this long before reopening"}
    )
    ramp_start_tokens_per_s: float = field(
        default=0.0, metadata={"unit": "tokens/s", "help": "budget at the start of a ramp"}
    )
    ramp_slew_tokens_per_s2: float = field(
        default=2000.0, metadata={"unit": "tokens/s per s", "help": "ramp rise rate"}
    )
    ramp_cap_tokens_per_s: float = field(
        default=60000.0, metadata={"unit": "tokens/s", "help": "ramp ends (open) at this budget"}
    )
    max_age_s: float = field(
        default=5.0, metadata={"unit": "s", "help": "older signals are stale (failsafe)"}
    )
    floor_tokens_per_s: float = field(
        default=0.0, metadata={"unit": "tokens/s", "help": "budget in failsafe"}
    )
    required: tuple[str, ...] = field(
        default=REQUIRED_SIGNALS,
        metadata={"unit": "Observation fields", "help": "signals whose absence means failsafe"},
    )

    def __post_init__(self) -> None:
        pairs = (
            ("cut_ttft_norm", "reopen_ttft_norm"),
            ("cut_itl_norm", "reopen_itl_norm"),
            ("cut_kv_frac", "reopen_kv_frac"),
            ("cut_oldest_wait_s", "reopen_oldest_wait_s"),
        )
        for cut, reopen in pairs:
            if not 0 < getattr(self, reopen) < getattr(self, cut):
                raise ConfigError(
                    f"supervisor.{reopen} ({getattr(self, reopen)!r}) must be > 0 and below "
                    f"supervisor.{cut} ({getattr(self, cut)!r})"
                )
        for name in ("quiet_s", "ramp_start_tokens_per_s", "floor_tokens_per_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"supervisor.{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("ramp_slew_tokens_per_s2", "ramp_cap_tokens_per_s", "max_age_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"supervisor.{name} must be > 0, got {getattr(self, name)!r}")
        known = set(Observation.__dataclass_fields__)
        unknown = [name for name in self.required if name not in known]
        if unknown:
            raise ConfigError(f"supervisor.required names unknown signals {unknown}")


@dataclass(frozen=True)
class ModeEvent:
    """One mode transition, with the time and the reason."""

    now_s: float
    from_mode: Mode
    to_mode: Mode
    reason: str


@dataclass(frozen=True)
class SupervisorState:
    """Current mode, since when quiet (NaN: not quiet), the ramp ceiling, last reason."""

    mode: Mode = Mode.CLOSED
    quiet_since_s: float = math.nan
    ramp_tokens_per_s: float = 0.0
    reason: str = "start: waiting for a quiet interval"


@dataclass(frozen=True)
class SupervisorDecision:
    """Budget after supervision, the mode and reason it carries, the next state, events."""

    u: float
    mode: Mode
    reason: str
    state: SupervisorState
    events: tuple[ModeEvent, ...]


def missing_signals(obs: Observation, config: SupervisorConfig) -> list[str]:
    """Required signals that are NaN, and 'age' when the observation is stale."""
    missing = [name for name in config.required if not math.isfinite(getattr(obs, name))]
    if not math.isfinite(obs.age_s) or obs.age_s > config.max_age_s:
        missing.append(f"age {obs.age_s:.1f}s > {config.max_age_s:.1f}s")
    return missing


def burning(obs: Observation, slo: Slo, config: SupervisorConfig) -> str:
    """Why batch must be cut now ('' when nothing burns). NaN signals do not burn here."""
    checks = (
        (obs.ttft_norm(slo), config.cut_ttft_norm, "p95 TTFT/SLO"),
        (obs.itl_norm(slo), config.cut_itl_norm, "p95 ITL/SLO"),
        (obs.kv_usage_frac, config.cut_kv_frac, "KV usage"),
        (obs.interactive_oldest_wait_s, config.cut_oldest_wait_s, "oldest interactive wait s"),
    )
    for value, limit, label in checks:
        if value >= limit:
            return f"cut: {label} {value:.3g} >= {limit:.3g}"
    if obs.success_rate < slo.success_rate:
        return f"cut: success rate {obs.success_rate:.4f} < {slo.success_rate:.4f}"
    return ""


def is_quiet(obs: Observation, slo: Slo, config: SupervisorConfig) -> bool:
    """True when every signal is under its reopen threshold (the lower side of hysteresis)."""
    return (
        obs.ttft_norm(slo) < config.reopen_ttft_norm
        and obs.itl_norm(slo) < config.reopen_itl_norm
        and obs.kv_usage_frac < config.reopen_kv_frac
        and obs.interactive_oldest_wait_s < config.reopen_oldest_wait_s
        and obs.success_rate >= slo.success_rate
    )


def supervise(
    config: SupervisorConfig,
    state: SupervisorState,
    obs: Observation,
    slo: Slo,
    u_law: float,
    dt_s: float,
    now_s: float,
    *,
    stopped: bool = False,
) -> SupervisorDecision:
    """One tick of supervision over the law's proposal `u_law` (see the module docstring)."""
    new_state, u = _next(config, state, obs, slo, u_law, dt_s, now_s, stopped)
    events = ()
    if new_state.mode != state.mode:
        events = (ModeEvent(now_s, state.mode, new_state.mode, new_state.reason),)
    return SupervisorDecision(
        u=u, mode=new_state.mode, reason=new_state.reason, state=new_state, events=events
    )


def _next(
    config: SupervisorConfig,
    state: SupervisorState,
    obs: Observation,
    slo: Slo,
    u_law: float,
    dt_s: float,
    now_s: float,
    stopped: bool,
) -> tuple[SupervisorState, float]:
    closed_since_now = SupervisorState(Mode.CLOSED, math.nan, 0.0, "")
    if stopped:
        return SupervisorState(Mode.STOPPED, math.nan, 0.0, "stopped by operator"), 0.0
    if state.mode == Mode.STOPPED:
        return _with_reason(closed_since_now, "resumed by operator: holding closed"), 0.0
    missing = missing_signals(obs, config)
    if missing:
        reason = "failsafe: missing or stale " + ", ".join(missing)
        return SupervisorState(Mode.FAILSAFE, math.nan, 0.0, reason), config.floor_tokens_per_s
    if state.mode == Mode.FAILSAFE:
        return _with_reason(closed_since_now, "signals back: holding closed"), 0.0
    burn = burning(obs, slo, config)
    if burn:
        reason = burn if state.mode != Mode.CLOSED else state.reason
        return SupervisorState(Mode.CLOSED, math.nan, 0.0, reason), 0.0
    if state.mode == Mode.CLOSED:
        if not is_quiet(obs, slo, config):
            return SupervisorState(Mode.CLOSED, math.nan, 0.0, state.reason), 0.0
        quiet_since = state.quiet_since_s if math.isfinite(state.quiet_since_s) else now_s
        if now_s - quiet_since < config.quiet_s:
            return SupervisorState(Mode.CLOSED, quiet_since, 0.0, state.reason), 0.0
        ramp = config.ramp_start_tokens_per_s
        reason = f"reopen: quiet for {now_s - quiet_since:.0f}s"
        return SupervisorState(Mode.RAMP, math.nan, ramp, reason), max(0.0, min(u_law, ramp))
    if state.mode == Mode.RAMP:
        ramp = state.ramp_tokens_per_s + config.ramp_slew_tokens_per_s2 * dt_s
        if ramp >= config.ramp_cap_tokens_per_s:
            return SupervisorState(Mode.OPEN, math.nan, 0.0, "ramp reached its cap"), u_law
        if u_law <= ramp:
            return SupervisorState(Mode.OPEN, math.nan, 0.0, "law below the ramp"), u_law
        return SupervisorState(Mode.RAMP, math.nan, ramp, state.reason), max(0.0, ramp)
    return SupervisorState(Mode.OPEN, math.nan, 0.0, state.reason), max(0.0, u_law)


def _with_reason(state: SupervisorState, reason: str) -> SupervisorState:
    return SupervisorState(state.mode, state.quiet_since_s, state.ramp_tokens_per_s, reason)
