"""The supervisor: modes, hard limits and hysteresis above any control law.

    open     the law sets the budget
    ramp     reopening: budget = min(law, ramp), ramp += slew * dt, until the cap or the law binds
    closed   budget 0: entered at once when an SLO burns, KV usage passes its limit or the
             oldest interactive wait passes its limit; left only after every signal has stayed
             under its (lower) reopen threshold for `quiet_s`, into ramp. A cut on a p95 under
             `revoke_factor` x its cut threshold only stops admission (`revoke` false: the
             in-flight batch work drains); every other cut also revokes in-flight work
    stopped  budget 0 while the operator's stop switch is set; left into closed
    failsafe budget at the floor (0 by default) while any required signal is missing, NaN or
             stale; left into closed

`supervise` is pure: it takes the state and the time and returns the new state, the budget
and every transition as a `ModeEvent` with its reason, for the caller to log.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

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
    """Cut and reopen thresholds (cut > reopen: hysteresis), quiet hold, ramp, staleness.

    The p95s compared here are the policy's smoothed short-window (a few seconds) p95s; the
    SLO itself is on 60 s windows, so a short excursion past it is not yet a burn. The ITL
    cut sits at 1.5x: the ITL of a fleet lending its steps to batch prefill jumps from a few
    ms to a full prefill step once batch holds most steps, and the law backs off from such
    a jump by itself; the supervisor acts when it does not. Where the observation carries an
    SLO burn (the policy's smoothed share above the SLO over the 5% a p95 allows), the burn
    replaces that output's p95 in the cut and reopen checks: it says how far past the edge
    a window is, where the short-window p95 only says that it is.
    """

    cut_ttft_norm: float = field(
        default=1.0, metadata={"unit": "p95 TTFT / SLO", "help": "cut at or above"}
    )
    reopen_ttft_norm: float = field(
        default=0.8, metadata={"unit": "p95 TTFT / SLO", "help": "quiet below"}
    )
    cut_itl_norm: float = field(
        default=1.5, metadata={"unit": "p95 ITL / SLO", "help": "cut at or above"}
    )
    reopen_itl_norm: float = field(
        default=0.9, metadata={"unit": "p95 ITL / SLO", "help": "quiet below"}
    )
    cut_ttft_burn: float = field(
        default=1.5,
        metadata={"unit": "share above SLO / 0.05", "help": "cut at or above (burn measured)"},
    )
    reopen_ttft_burn: float = field(
        default=0.8,
        metadata={"unit": "share above SLO / 0.05", "help": "quiet below (burn measured)"},
    )
    cut_itl_burn: float = field(
        default=1.5,
        metadata={"unit": "share above SLO / 0.05", "help": "cut at or above (burn measured)"},
    )
    reopen_itl_burn: float = field(
        default=0.8,
        metadata={"unit": "share above SLO / 0.05", "help": "quiet below (burn measured)"},
    )
    cut_kv_frac: float = field(
        default=0.97,
        metadata={"unit": "fraction of KV cache", "help": "cut at or above", "gt": 0.0, "max": 1.0},
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
        default=5.0, metadata={"unit": "s", "help": "quiet this long before reopening"}
    )
    revoke_factor: float = field(
        default=2.0,
        metadata={"unit": "x cut threshold", "help": "a p95 this far over also revokes batch"},
    )
    ramp_start_frac: float = field(
        default=0.5,
        metadata={"unit": "1", "help": "ramp starts at this fraction of the pre-cut budget"},
    )
    ramp_slew_tokens_per_s2: float = field(
        default=5000.0, metadata={"unit": "tokens/s per s", "help": "ramp rise rate"}
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
            ("cut_ttft_burn", "reopen_ttft_burn"),
            ("cut_itl_burn", "reopen_itl_burn"),
            ("cut_kv_frac", "reopen_kv_frac"),
            ("cut_oldest_wait_s", "reopen_oldest_wait_s"),
        )
        for cut, reopen in pairs:
            if not 0 < getattr(self, reopen) < getattr(self, cut):
                raise ConfigError(
                    f"supervisor.{reopen} ({getattr(self, reopen)!r}) must be > 0 and below "
                    f"supervisor.{cut} ({getattr(self, cut)!r})"
                )
        if self.revoke_factor < 1.0 or not 0.0 <= self.ramp_start_frac <= 1.0:
            raise ConfigError(
                "supervisor needs revoke_factor >= 1 and ramp_start_frac in [0, 1], got "
                f"{self.revoke_factor!r}, {self.ramp_start_frac!r}"
            )
        for name in ("quiet_s", "floor_tokens_per_s"):
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
    """Mode, since when quiet (NaN: not quiet), the ramp ceiling (in closed: where the next
    ramp starts), the last reason, and whether in-flight batch work is revoked."""

    mode: Mode = Mode.CLOSED
    quiet_since_s: float = math.nan
    ramp_tokens_per_s: float = 0.0
    reason: str = "start: waiting for a quiet interval"
    revoke: bool = True


@dataclass(frozen=True)
class SupervisorDecision:
    """Budget after supervision, the mode and reason it carries, the next state, events."""

    u: float
    mode: Mode
    reason: str
    state: SupervisorState
    events: tuple[ModeEvent, ...]
    revoke: bool


# Quantiles and ratios over interactive requests have no value in a window without any; the
# source says so with `interactive_requests == 0`, which is not a missing metric.
PER_REQUEST_SIGNALS = ("ttft_p95_s", "itl_p95_s", "success_rate")


def missing_signals(obs: Observation, config: SupervisorConfig) -> list[str]:
    """Required signals that are NaN, and 'age' when the observation is stale.

    A per-request signal (p95s, success rate) that is NaN because the window held no
    interactive request (`interactive_requests == 0`) is not missing.
    """
    idle = obs.interactive_requests == 0
    missing = [
        name
        for name in config.required
        if not math.isfinite(getattr(obs, name)) and not (idle and name in PER_REQUEST_SIGNALS)
    ]
    if not math.isfinite(obs.age_s) or obs.age_s > config.max_age_s:
        missing.append(f"age {obs.age_s:.1f}s > {config.max_age_s:.1f}s")
    return missing


def burning(obs: Observation, slo: Slo, config: SupervisorConfig) -> tuple[str, bool]:
    """Why batch must be cut now ('' when nothing burns), and whether to revoke too.

    NaN signals do not burn here (`missing_signals` handles them).
    """
    severe = config.revoke_factor
    ttft, itl = latency_checks(obs, slo, config, cut=True)
    checks = (
        (obs.kv_usage_frac, config.cut_kv_frac, "KV usage", True),
        (obs.interactive_oldest_wait_s, config.cut_oldest_wait_s, "oldest wait s", True),
        (*ttft, False),
        (*itl, False),
    )
    for value, limit, label, always_revoke in checks:
        if value >= limit:
            revoke = always_revoke or value >= severe * limit
            return f"cut: {label} {value:.3g} >= {limit:.3g}", revoke
    if obs.success_rate < slo.success_rate:
        return f"cut: success rate {obs.success_rate:.4f} < {slo.success_rate:.4f}", True
    return "", False


def latency_checks(
    obs: Observation, slo: Slo, config: SupervisorConfig, *, cut: bool
) -> tuple[tuple[float, float, str], tuple[float, float, str]]:
    """(value, cut or reopen threshold, label) for TTFT and ITL: the burn where it is
    measured, else the p95 over its SLO."""
    ttft_burn, itl_burn = obs.ttft_burn(), obs.itl_burn()
    if math.isfinite(ttft_burn):
        ttft = (ttft_burn, config.cut_ttft_burn if cut else config.reopen_ttft_burn, "TTFT burn")
    else:
        ttft = (obs.ttft_norm(slo), config.cut_ttft_norm if cut else config.reopen_ttft_norm,
                "p95 TTFT/SLO")
    if math.isfinite(itl_burn):
        itl = (itl_burn, config.cut_itl_burn if cut else config.reopen_itl_burn, "ITL burn")
    else:
        itl = (obs.itl_norm(slo), config.cut_itl_norm if cut else config.reopen_itl_norm,
               "p95 ITL/SLO")
    return ttft, itl


def is_quiet(obs: Observation, slo: Slo, config: SupervisorConfig) -> bool:
    """True when every signal is under its reopen threshold (the lower side of hysteresis).

    A per-request signal that is NaN (no interactive request in the window) counts as quiet.
    """
    (ttft, ttft_limit, _), (itl, itl_limit, _) = latency_checks(obs, slo, config, cut=False)
    return (
        not ttft >= ttft_limit
        and not itl >= itl_limit
        and obs.kv_usage_frac < config.reopen_kv_frac
        and obs.interactive_oldest_wait_s < config.reopen_oldest_wait_s
        and not obs.success_rate < slo.success_rate
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
        u=u,
        mode=new_state.mode,
        reason=new_state.reason,
        state=new_state,
        events=events,
        revoke=new_state.revoke,
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
    # Where a ramp after a cut from open or ramp starts: a fraction of the budget before it.
    restart = config.ramp_start_frac * (u_law if state.mode == Mode.OPEN else 0.0)
    if state.mode == Mode.RAMP:
        restart = config.ramp_start_frac * state.ramp_tokens_per_s
    if state.mode == Mode.STOPPED:
        return _with_reason(closed_since_now, "resumed by operator: holding closed"), 0.0
    missing = missing_signals(obs, config)
    if missing:
        reason = "failsafe: missing or stale " + ", ".join(missing)
        return SupervisorState(Mode.FAILSAFE, math.nan, 0.0, reason), config.floor_tokens_per_s
    if state.mode == Mode.FAILSAFE:
        return _with_reason(closed_since_now, "signals back: holding closed"), 0.0
    burn, revoke = burning(obs, slo, config)
    if burn:
        if state.mode == Mode.CLOSED:
            revoke = revoke or state.revoke
            return replace(state, quiet_since_s=math.nan, revoke=revoke), 0.0
        return SupervisorState(Mode.CLOSED, math.nan, restart, burn, revoke), 0.0
    if state.mode == Mode.CLOSED:
        if not is_quiet(obs, slo, config):
            return replace(state, quiet_since_s=math.nan), 0.0
        quiet_since = state.quiet_since_s if math.isfinite(state.quiet_since_s) else now_s
        if now_s - quiet_since < config.quiet_s:
            return replace(state, quiet_since_s=quiet_since), 0.0
        ramp = state.ramp_tokens_per_s
        reason = f"reopen: quiet for {now_s - quiet_since:.0f}s"
        return SupervisorState(Mode.RAMP, math.nan, ramp, reason, False), max(
            0.0, min(u_law, ramp)
        )
    if state.mode == Mode.RAMP:
        ramp = state.ramp_tokens_per_s + config.ramp_slew_tokens_per_s2 * dt_s
        if ramp >= config.ramp_cap_tokens_per_s:
            return SupervisorState(Mode.OPEN, math.nan, 0.0, "ramp reached its cap", False), u_law
        if u_law <= ramp:
            return SupervisorState(Mode.OPEN, math.nan, 0.0, "law below the ramp", False), u_law
        return replace(state, ramp_tokens_per_s=ramp), max(0.0, ramp)
    return SupervisorState(Mode.OPEN, math.nan, 0.0, state.reason, False), max(0.0, u_law)


def _with_reason(state: SupervisorState, reason: str) -> SupervisorState:
    return replace(state, reason=reason)
