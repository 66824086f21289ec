"""PI in velocity form, one loop per output, combined by a min-selector.

Each loop i computes an increment from its error e_i = setpoint_i - y_i (room left under the
setpoint, in units of the SLO):

    du_i = scale_i * (kp_i * (e_i[k] - e_i[k-1]) + ki_i * dt * e_i[k])
    u_i  = u_applied[k-1] + du_i + du_ff
    u[k] = clamp(min_i u_i, u_min, u_max)
    u[k] >= min(u_applied[k-1], fall_floor_frac * max(u applied over fall_window_s))

External-reset anti-windup: every loop starts from the input actually applied last tick
(after the min-selector, the clamp and the supervisor), so a loop that is not selected, a
saturated input or a supervisor cut never winds any loop up. Gains come from a FOPDT model by
the SIMC or IMC rules (`pi_gains`). A loop whose burn window had to lengthen to hold enough
samples (a sparse signal: few first tokens a minute) sees the plant that much later; while
its p95 is within a factor 2 of the SLO its gains fall by fast_s / window (`delay_scale`,
as SIMC's kc ~ 1/theta), so it does not chase its own late readings into a limit cycle.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace

from borrowd.controller.burn import NEAR_SLO_NORM, BurnConfig
from borrowd.controller.laws.base import OUTPUTS, LawSettings, LawTick, Proposal, tracked_outputs
from borrowd.models.config_loader import meta
from borrowd.models.enforcement import ENGINE
from borrowd.models.errors import ConfigError
from borrowd.models.plant.fopdt import FopdtFit

METHODS = ("simc", "imc")


@dataclass(frozen=True)
class PiGains:
    """Gains of one loop: kp in tokens/s per unit of normalised error, ki per second more."""

    kp: float
    ki_per_s: float


@dataclass(frozen=True)
class PiLoop:
    """One output's loop: its name, setpoint (normalised, 1.0 = SLO) and gains."""

    name: str
    setpoint: float
    gains: PiGains


@dataclass(frozen=True)
class PiState:
    """Previous error of each loop (NaN before the first measurement)."""

    errors: tuple[float, ...]

    @classmethod
    def initial(cls, n_loops: int) -> PiState:
        """State before any measurement."""
        return cls(errors=(math.nan,) * n_loops)


@dataclass(frozen=True)
class PiResult:
    """The new budget, the next state, and which loop the min-selector picked (-1: none)."""

    u: float
    state: PiState
    selected: int


@dataclass(frozen=True)
class PiConfig:
    """PI law settings (per-output setpoints, tuning rule, gains used without a plant)."""

    setpoint_ttft_norm: float = field(
        default=0.6, metadata={"unit": "p95 TTFT / SLO", "help": "TTFT loop setpoint"}
    )
    setpoint_itl_norm: float = field(
        default=0.5, metadata={"unit": "p95 ITL / SLO", "help": "ITL loop setpoint"}
    )
    setpoint_ttft_burn: float = field(
        default=0.5,
        metadata={"unit": "share above SLO / 0.05", "help": "TTFT loop setpoint on the burn"},
    )
    setpoint_itl_burn: float = field(
        default=0.95,
        metadata={"unit": "share above SLO / 0.05", "help": "ITL loop setpoint on the burn"},
    )
    setpoint_itl_burn_engine: float = field(
        default=0.8,
        metadata={"unit": "share above SLO / 0.05",
                  "help": "ITL loop setpoint on the burn when controller.enforcement = engine: "
                          "the plugin keeps batch chunks short and the fleet runs at the ITL "
                          "edge, so the loop keeps a margin for bursts"},
    )
    method: str = field(
        default="simc", metadata={"unit": "simc|imc", "help": "tuning rule from the plant"}
    )
    tc_s: float = field(
        default=0.0,
        metadata={"unit": "s", "help": "closed-loop time constant (0: the plant's dead time)"},
    )
    kp_tokens_per_s: float = field(
        default=20000.0,
        metadata=meta("tokens/s per SLO", "proportional gain when no plant is given",
                      per_pool=True),
    )
    ki_tokens_per_s2: float = field(
        default=4000.0,
        metadata=meta("tokens/s per SLO-s", "integral gain when no plant is given",
                      per_pool=True),
    )
    decrease_boost: float = field(
        default=2.0,
        metadata={"unit": "1", "help": "gain multiplier when a loop asks to cut (convex plant)"},
    )
    gain_reference_tokens_per_s: float = field(
        default=70000.0,
        metadata=meta("tokens/s", "budget the gains are given at; below it they scale with "
                      "the budget (0: fixed gains)", per_pool=True),
    )
    min_gain_scale: float = field(
        default=0.2,
        metadata={"unit": "1", "help": "least scale of the gains below the reference budget"},
    )
    gain_window_s: float = field(
        default=0.0,
        metadata={
            "unit": "s",
            "help": "the gains scale with the highest budget of this long (0: the last one)",
        },
    )
    fall_floor_frac: float = field(
        default=0.7,
        metadata={
            "unit": "1",
            "help": "the law proposes at least this share of its highest budget of fall_window_s",
        },
    )
    fall_window_s: float = field(
        default=10.0,
        metadata={"unit": "s", "help": "window of the fall floor (one decrease per window)"},
    )
    fall_window_follows_burn: bool = field(
        default=False,
        metadata={
            "unit": "bool",
            "help": "the fall floor's window is at least the burn window of the loop that "
            "governs (one decrease per burn window, however long sparse traffic makes it)",
        },
    )
    delay_scaling: bool = field(
        default=True,
        metadata={
            "unit": "bool",
            "help": "a loop whose burn window lengthened past burn.fast_s (sparse samples) "
            "runs its gains slower by that ratio",
        },
    )

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"pi.method must be one of {METHODS}, got {self.method!r}")
        for name in (
            "setpoint_ttft_norm", "setpoint_itl_norm", "setpoint_ttft_burn", "setpoint_itl_burn",
            "setpoint_itl_burn_engine",
        ):
            if not 0 < getattr(self, name) <= 1.0:
                raise ConfigError(f"pi.{name} must be in (0, 1], got {getattr(self, name)!r}")
        for name in ("tc_s", "kp_tokens_per_s", "ki_tokens_per_s2"):
            if getattr(self, name) < 0:
                raise ConfigError(f"pi.{name} must be >= 0, got {getattr(self, name)!r}")
        if self.decrease_boost < 1.0:
            raise ConfigError(f"pi.decrease_boost must be >= 1, got {self.decrease_boost!r}")
        if not 0 <= self.fall_floor_frac < 1 or self.fall_window_s < 0:
            raise ConfigError(
                "pi needs fall_floor_frac in [0, 1) and fall_window_s >= 0, got "
                f"{self.fall_floor_frac!r}, {self.fall_window_s!r}"
            )
        if (self.gain_reference_tokens_per_s < 0 or not 0 < self.min_gain_scale <= 1
                or self.gain_window_s < 0):
            raise ConfigError(
                "pi needs gain_reference_tokens_per_s >= 0, min_gain_scale in (0, 1] and "
                f"gain_window_s >= 0, got {self.gain_reference_tokens_per_s!r}, "
                f"{self.min_gain_scale!r}, {self.gain_window_s!r}"
            )

    def operating_scale(self, u_tokens_per_s: float) -> float:
        """Gain scale at budget u: u / reference, within [min_gain_scale, 1] (1: no reference).

        The burn a batch token adds grows as the room batch has shrinks (a small fleet, a
        tight SLO), so gains fixed in tokens/s that suit 70k tokens/s of room make a loop
        around 15k oscillate; scaled with the budget (its highest of `gain_window_s`, so a
        cut does not slow the way back), the loop gain stays about constant.
        """
        if self.gain_reference_tokens_per_s <= 0:
            return 1.0
        return min(1.0, max(self.min_gain_scale, u_tokens_per_s / self.gain_reference_tokens_per_s))


def pi_gains(fit: FopdtFit, method: str, tc_s: float, tick_s: float) -> PiGains:
    """PI gains for a FOPDT plant sampled every `tick_s`.

    The sample-and-hold adds half a tick to the dead time theta. With tc (default theta):
    SIMC (Skogestad 2003): kc = tau / (K (tc + theta)), Ti = min(tau, 4 (tc + theta));
    IMC (Rivera et al. 1986): kc = (tau + theta/2) / (K (tc + theta/2)), Ti = tau + theta/2.
    """
    if fit.gain <= 0:
        raise ConfigError(f"PI tuning needs a positive plant gain, got {fit.gain!r}")
    if method not in METHODS:
        raise ConfigError(f"tuning method must be one of {METHODS}, got {method!r}")
    theta = fit.dead_s + tick_s / 2.0
    tc = tc_s if tc_s > 0 else theta
    if method == "simc":
        kc = fit.tau_s / (fit.gain * (tc + theta))
        ti = min(fit.tau_s, 4.0 * (tc + theta))
    else:
        kc = (fit.tau_s + theta / 2.0) / (fit.gain * (tc + theta / 2.0))
        ti = fit.tau_s + theta / 2.0
    return PiGains(kp=kc, ki_per_s=kc / ti)


def pi_step(
    loops: tuple[PiLoop, ...],
    state: PiState,
    outputs: tuple[float, ...],
    u_applied: float,
    dt_s: float,
    u_min: float,
    u_max: float,
    *,
    du_ff: float = 0.0,
    gain_scales: tuple[float, ...] | None = None,
    decrease_boost: float = 1.0,
) -> PiResult:
    """One tick of the min-selected velocity PI (see the module docstring).

    `outputs[i]` is loop i's normalised measurement (NaN: that loop sits this tick out);
    `u_applied` is the input applied last tick (external reset); `gain_scales[i]` multiplies
    loop i's gains (gain scheduling; default 1); a loop whose increment is negative is multiplied by
    `decrease_boost` too, since latency rises faster above the setpoint than it falls below.
    """
    candidates: list[float] = []
    errors = []
    scales = gain_scales if gain_scales is not None else (1.0,) * len(loops)
    for loop, y, e_prev, scale in zip(loops, outputs, state.errors, scales, strict=True):
        if not math.isfinite(y):
            errors.append(math.nan)
            candidates.append(math.inf)
            continue
        e = loop.setpoint - y
        de = e - e_prev if math.isfinite(e_prev) else 0.0
        du = scale * (loop.gains.kp * de + loop.gains.ki_per_s * dt_s * e)
        if du < 0:
            du *= decrease_boost
        errors.append(e)
        candidates.append(u_applied + du + du_ff)
    best = min(candidates, default=math.inf)
    if math.isinf(best):
        u, selected = u_applied, -1
    else:
        u, selected = best, candidates.index(best)
    return PiResult(
        u=min(max(u, u_min), u_max), state=PiState(errors=tuple(errors)), selected=selected
    )


def delay_scale(window_s: float, fast_s: float, enabled: bool) -> float:
    """How much slower a loop runs when its burn window had to lengthen to `window_s` to
    hold enough samples: the window is the loop's dead time, and SIMC's gain falls with it
    (kc ~ 1/theta), so this is fast_s / window_s (<= 1), multiplying both gains. 1 when the
    window is unknown or no longer than `fast_s`."""
    if not enabled or not math.isfinite(window_s) or window_s <= fast_s or fast_s <= 0:
        return 1.0
    return fast_s / window_s


def fall_floor(recent_applied_tokens_per_s: list[float], floor_frac: float) -> float:
    """The least budget the law proposes: `floor_frac` of its highest recent one.

    The burn is a hockey stick measured over seconds: one jump past the setpoint makes the
    P term (boosted on the way down) ask for a fall far beyond what the load needs, and an
    unbounded fall leaves the budget near 0 until the window forgets the jump. As TCP halves
    its window at most once per round trip (CUBIC: to 0.7), the law's own fall is bounded to
    one multiplicative decrease per `fall_window_s`; a burning SLO is the supervisor's cut.
    """
    return floor_frac * max(recent_applied_tokens_per_s, default=0.0)


def floor_window_s(cfg: PiConfig, burn_windows_s: tuple[float, ...], selected: int) -> float:
    """How far back the fall floor looks: `fall_window_s`, or with `fall_window_follows_burn`
    at least the burn window of the selected loop (itself at most `burn.slow_s`).

    A burn computed from sparse samples holds one burst of late first tokens for as long as
    its window (40-60 s on a quiet pool); with a fixed 10 s fall window the law cut 0.7x once
    per 10 s for the whole of that, five or six times for one event.
    """
    if cfg.fall_window_follows_burn and 0 <= selected < len(burn_windows_s):
        burn_window_s = burn_windows_s[selected]
        if math.isfinite(burn_window_s):
            return max(cfg.fall_window_s, burn_window_s)
    return cfg.fall_window_s


class PiLaw:
    """The PI law as a `Law`: one velocity-form loop per output on its SLO burn when
    measured (against the burn setpoint), else on p95/SLO; gains from the plant by `method`
    when it models the output, else the configured ones. Its own fall is bounded to one
    multiplicative decrease per window (`fall_floor`)."""

    tracks_burn = True  # with `control_on_burn`, wherever the burn is measured

    def __init__(self, settings: LawSettings) -> None:
        self.config = settings.table("pi", PiConfig)
        self.u_max_tokens_per_s = settings.u_max_tokens_per_s
        cfg = self.config
        setpoints = {"ttft": cfg.setpoint_ttft_norm, "itl": cfg.setpoint_itl_norm}
        modelled = settings.plant_outputs()
        plant = settings.plant
        loops = []
        # Configured gains scale with the budget (`operating_scale`); identified ones are
        # scheduled by the gain schedule's RLS instead.
        self.scaled = tuple(plant is None or name not in modelled for name in OUTPUTS)
        for name in OUTPUTS:
            if plant is None or name not in modelled:
                gains = PiGains(kp=cfg.kp_tokens_per_s, ki_per_s=cfg.ki_tokens_per_s2)
            else:
                fit = plant.output(name).fopdt(plant.dt_s, plant.u0_tokens_per_s)
                gains = pi_gains(fit, cfg.method, cfg.tc_s, settings.tick_s)
            loops.append(PiLoop(name, setpoints[name], gains))
        self.loops = tuple(loops)
        itl_burn = (cfg.setpoint_itl_burn_engine if settings.enforcement == ENGINE
                    else cfg.setpoint_itl_burn)
        self.burn_setpoints = (cfg.setpoint_ttft_burn, itl_burn)
        burn = settings.table("burn", BurnConfig)
        self.fast_s = burn.fast_s
        # The budgets the gain scale and the fall floor look back over (`floor_window_s`).
        self.history_s = max(cfg.gain_window_s, cfg.fall_window_s,
                             burn.slow_s if cfg.fall_window_follows_burn else 0.0)
        self.pi_state = PiState.initial(len(OUTPUTS))
        self.recent_u: deque[tuple[float, float]] = deque()

    def law_outputs(self, tick: LawTick) -> tuple[tuple[float, ...], tuple[PiLoop, ...]]:
        """What each loop tracks: its SLO burn against the burn setpoint when measured, else
        its p95/SLO against the p95 setpoint."""
        loops = tuple(
            replace(loop, setpoint=sp) if math.isfinite(burn) else loop
            for loop, burn, sp in zip(self.loops, tick.burns, self.burn_setpoints, strict=True)
        )
        return tracked_outputs(tick), loops

    def propose(self, tick: LawTick) -> Proposal:
        """One PI step from the budget applied last tick (external-reset anti-windup)."""
        outs, loops = self.law_outputs(tick)
        now_s = tick.obs.now_s
        cfg = self.config
        u_applied = tick.u_applied_tokens_per_s
        self.recent_u.append((now_s, u_applied))
        while self.recent_u and self.recent_u[0][0] < now_s - self.history_s:
            self.recent_u.popleft()
        u_recent = max(u for t, u in self.recent_u if t >= now_s - cfg.gain_window_s)
        lateness = tuple(delay_scale(w, self.fast_s, cfg.delay_scaling and y >= NEAR_SLO_NORM)
                         for w, y in zip(tick.burn_windows_s, tick.ys, strict=True))
        result = pi_step(
            loops,
            self.pi_state,
            outs,
            tick.u_applied_tokens_per_s,
            tick.dt_s,
            0.0,
            self.u_max_tokens_per_s,
            du_ff=tick.du_ff_tokens_per_s,
            gain_scales=tuple(
                (self.config.operating_scale(u_recent) if scaled else 1.0) * late / r
                for r, scaled, late in zip(tick.gain_ratios, self.scaled, lateness, strict=True)
            ),
            decrease_boost=self.config.decrease_boost,
        )
        self.pi_state = result.state
        # The floor bounds the reaction to the feedback only; a measured disturbance (the
        # feed-forward's step: an interactive burst, a replica lost) passes through whole.
        window_s = floor_window_s(cfg, tick.burn_windows_s, result.selected)
        recent = [u for t, u in self.recent_u if t >= now_s - window_s]
        du_ff = tick.du_ff_tokens_per_s
        floor = min(u_applied, fall_floor(recent, cfg.fall_floor_frac))
        u = max(result.u - du_ff, floor) + du_ff
        return Proposal(min(max(u, 0.0), self.u_max_tokens_per_s), tick)

    def applied(self, tick: LawTick, u_tokens_per_s: float) -> None:
        """Nothing to do: the next step starts from the applied budget it is given."""

    def state(self) -> dict[str, float]:
        """Each loop's last error (room under its setpoint)."""
        return {f"pi_error_{name}": e for name, e in zip(OUTPUTS, self.pi_state.errors,
                                                         strict=True)}
