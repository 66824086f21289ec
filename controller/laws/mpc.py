"""Model predictive control over the identified FOPDT models, as a condensed LP.

Per output i, with effective input v = u + g_ff * d (batch budget plus the feed-forward
share of the interactive rate d) and a = exp(-tick / tau_i), K_i its local gain:

    m_i[k+1] = a_i * m_i[k] + (1 - a_i) * K_i * v[k - dead_i]
    y_i[k+j] = m_i[k+j] + (y_i[k] - m_i[k])          (output-disturbance bias, offset-free)

Decision: moves du_0..du_{M-1} (the last one held to the horizon N). The prediction is
affine in the moves, y = free + S du, so the problem is the LP

    maximise   sum_j u[k+j]  -  rho * eps
    subject to y_i[k+j] - eps <= setpoint_i        (every output, every j past its dead time)
               -down_max <= du_m <= up_max           (input rate limits)
               u_min <= u[k+j] <= u_max,  eps >= 0

solved by HiGHS (scipy.optimize.linprog); only du_0 is applied. The soft constraint keeps
the LP feasible when the free response alone already violates a setpoint: then the budget
falls as fast as the rate limit allows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from borrowd.controller.laws.base import OUTPUTS, LawSettings, LawTick, Proposal
from borrowd.controller.laws.feedforward import forecast
from borrowd.models.config_loader import meta
from borrowd.models.errors import ConfigError
from borrowd.models.plant.model import SIGNAL_P95, PlantModel
from scipy.optimize import linprog


@dataclass(frozen=True)
class MpcConfig:
    """MPC settings: setpoints, horizons, input rate limits, soft-constraint weight."""

    setpoint_ttft_norm: float = field(
        default=0.6, metadata={"unit": "p95 TTFT / SLO", "help": "TTFT ceiling over the horizon"}
    )
    setpoint_itl_norm: float = field(
        default=0.8, metadata={"unit": "p95 ITL / SLO", "help": "ITL ceiling over the horizon"}
    )
    horizon_s: float = field(default=30.0, metadata={"unit": "s", "help": "prediction horizon"})
    moves: int = field(default=3, metadata={"unit": "count", "help": "free input moves"})
    up_rate_tokens_per_s2: float = field(
        default=2000.0,
        metadata=meta("tokens/s per s", "fastest budget rise", per_pool=True),
    )
    down_rate_tokens_per_s2: float = field(
        default=50000.0,
        metadata=meta("tokens/s per s", "fastest budget fall", per_pool=True),
    )
    slack_penalty: float = field(
        default=1e7,
        metadata={"unit": "tokens/s per SLO", "help": "cost of exceeding a setpoint (soft)"},
    )

    def __post_init__(self) -> None:
        if self.moves < 1:
            raise ConfigError(f"mpc.moves must be >= 1, got {self.moves!r}")
        for name in ("horizon_s", "up_rate_tokens_per_s2", "down_rate_tokens_per_s2"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"mpc.{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("setpoint_ttft_norm", "setpoint_itl_norm"):
            if not 0 < getattr(self, name) <= 1.0:
                raise ConfigError(f"mpc.{name} must be in (0, 1], got {getattr(self, name)!r}")


@dataclass(frozen=True)
class MpcOutput:
    """One output's discrete model at the controller tick and its setpoint."""

    name: str
    gain: float
    pole: float
    dead_steps: int
    setpoint: float


@dataclass(frozen=True)
class MpcState:
    """Model outputs m_i[k] and the effective inputs v up to tick k-1 (newest last)."""

    model_outputs: tuple[float, ...]
    v_history: tuple[float, ...]


@dataclass(frozen=True)
class MpcResult:
    """The new budget, the free response per output, and whether a setpoint must be exceeded."""

    u: float
    free: tuple[tuple[float, ...], ...]
    violated: bool


def mpc_outputs(
    plant: PlantModel, tick_s: float, setpoints: dict[str, float]
) -> tuple[MpcOutput, ...]:
    """Discrete per-output models at `tick_s` for the outputs named in `setpoints`."""
    outs = []
    for name, setpoint in setpoints.items():
        model = plant.output(name)
        outs.append(
            MpcOutput(
                name=name,
                gain=model.gain_per_token_s,
                pole=math.exp(-tick_s / model.tau_s),
                dead_steps=round(model.dead_s / tick_s),
                setpoint=setpoint,
            )
        )
    return tuple(outs)


def mpc_initial_state(outputs: tuple[MpcOutput, ...], v0: float) -> MpcState:
    """Model at rest at effective input v0."""
    depth = max(o.dead_steps for o in outputs) + 1
    return MpcState(
        model_outputs=tuple(o.gain * v0 for o in outputs), v_history=(v0,) * depth
    )


def mpc_advance(outputs: tuple[MpcOutput, ...], state: MpcState, v_now: float) -> MpcState:
    """Model state one tick on, `v_now` the effective input actually applied this tick."""
    hist = (*state.v_history[1:], v_now)
    m = tuple(
        o.pole * m_i + (1 - o.pole) * o.gain * hist[len(hist) - 1 - o.dead_steps]
        for o, m_i in zip(outputs, state.model_outputs, strict=True)
    )
    return MpcState(model_outputs=m, v_history=hist)


def mpc_step(
    outputs: tuple[MpcOutput, ...],
    state: MpcState,
    measured: tuple[float, ...],
    u_applied: float,
    d_forecast: np.ndarray,
    ff_gain: float,
    config: MpcConfig,
    tick_s: float,
    u_min: float,
    u_max: float,
) -> MpcResult:
    """One receding-horizon step.

    `state` is the model after the input applied last tick (`u_applied`, already in
    `v_history`); `measured[i]` is output i now (NaN: no bias update, the model is trusted);
    `d_forecast[j]` is the interactive rate forecast for tick k+j, j = 0..N-1.
    The caller advances the model with the input it actually applied (`mpc_advance`),
    which the supervisor may have cut below the one returned here.
    """
    n = max(1, round(config.horizon_s / tick_s))
    moves = min(config.moves, n)
    d = np.resize(np.asarray(d_forecast, dtype=float), n) if len(d_forecast) else np.zeros(n)
    biases = [
        (y - m) if math.isfinite(y) else 0.0
        for y, m in zip(measured, state.model_outputs, strict=True)
    ]
    hist = np.asarray(state.v_history)
    depth = len(hist)
    up = config.up_rate_tokens_per_s2 * tick_s
    down = config.down_rate_tokens_per_s2 * tick_s
    # Variables: du_0..du_{M-1}, eps.  linprog minimises c @ x.
    # u[k+j] = u_applied + sum_{m <= min(j, M-1)} du_m, for j = 0..N-1.
    blocks = np.tril(np.ones((n, moves)))
    blocks[moves:, :] = 1.0
    c = np.concatenate([-blocks.sum(axis=0), [config.slack_penalty]])
    rows, rhs = [], []
    free_all = []
    for o, m0, bias in zip(outputs, state.model_outputs, biases, strict=True):
        # Free response with u held at u_applied, d following its forecast.
        v_free = u_applied + ff_gain * d
        v_seq = np.concatenate([hist, v_free])  # v_seq[depth + j] is v at tick k+j
        free = np.empty(n)  # free[j] is the output at tick k+j+1
        m = m0
        for j in range(n):
            m = o.pole * m + (1 - o.pole) * o.gain * v_seq[depth + j - o.dead_steps]
            free[j] = m + bias
        free_all.append(free)
        # Step response: a unit move at tick k+mv shows at k+j (j = 1..N) with weight
        # gain * (1 - pole^(j - mv - dead)) once j - mv - dead >= 1.
        steps = np.arange(1, n + 1)[:, None] - np.arange(moves)[None, :] - o.dead_steps
        s = np.where(steps >= 1, o.gain * (1 - o.pole ** np.maximum(steps, 0)), 0.0)
        active = steps[:, 0] >= 1
        for j in np.nonzero(active)[0].tolist():
            rows.append(np.concatenate([s[j], [-1.0]]))
            rhs.append(o.setpoint - free[j])
    zero = np.zeros(1)
    rows.extend(np.concatenate([blocks[j], zero]) for j in range(n))
    rhs.extend([u_max - u_applied] * n)
    rows.extend(np.concatenate([-blocks[j], zero]) for j in range(n))
    rhs.extend([u_applied - u_min] * n)
    bounds = [(-down, up)] * moves + [(0.0, None)]
    res = linprog(c, A_ub=np.array(rows), b_ub=np.array(rhs), bounds=bounds, method="highs")
    if res.status != 0:
        du0, eps = -down, math.inf
    else:
        du0, eps = float(res.x[0]), float(res.x[-1])
    return MpcResult(
        u=min(max(u_applied + du0, u_min), u_max),
        free=tuple(tuple(float(v) for v in f) for f in free_all),
        violated=eps > 1e-6,
    )


class MpcLaw:
    """The MPC as a `Law` over the plant's FOPDT outputs (p95/SLO against the MPC
    setpoints), planning on v = u + g * d with the forecast the feed-forward wrapper gives
    and the gains scaled by the gain schedule's ratios."""

    # It plans on p95/SLO whatever `control_on_burn` says (its plant is identified on it).
    tracks_burn = False

    def __init__(self, settings: LawSettings) -> None:
        if settings.plant is None:
            raise ConfigError("controller.law = 'mpc' needs a plant model (borrowd identify)")
        if settings.plant.signal != SIGNAL_P95:
            raise ConfigError(
                "controller.law = 'mpc' keeps p95/SLO: its plant must be identified on "
                f"{SIGNAL_P95} (control_on_burn = false), not {settings.plant.signal}"
            )
        self.config = settings.table("mpc", MpcConfig)
        self.tick_s = settings.tick_s
        self.u_max_tokens_per_s = settings.u_max_tokens_per_s
        self.names = settings.plant_outputs()
        setpoints = {"ttft": self.config.setpoint_ttft_norm, "itl": self.config.setpoint_itl_norm}
        self.outputs = mpc_outputs(
            settings.plant, self.tick_s, {n: setpoints[n] for n in self.names}
        )
        self.mpc_state: MpcState | None = None

    def _scheduled(self, tick: LawTick) -> tuple[MpcOutput, ...]:
        ratios = dict(zip(OUTPUTS, tick.gain_ratios, strict=True))
        return tuple(
            MpcOutput(o.name, o.gain * ratios[o.name], o.pole, o.dead_steps, o.setpoint)
            for o in self.outputs
        )

    def propose(self, tick: LawTick) -> Proposal:
        """Solve the LP over the horizon; the first move's budget."""
        n = max(1, round(self.config.horizon_s / self.tick_s))
        level = tick.forecast.level
        d_forecast = (
            np.concatenate([[level], forecast(tick.forecast, n - 1)])
            if math.isfinite(level)
            else np.zeros(n)
        )
        outs = self._scheduled(tick)
        if self.mpc_state is None:
            self.mpc_state = mpc_initial_state(
                outs, tick.u_applied_tokens_per_s + tick.ff_gain * d_forecast[0]
            )
        measured = tuple(tick.ys[OUTPUTS.index(name)] for name in self.names)
        result = mpc_step(
            outs,
            self.mpc_state,
            measured,
            tick.u_applied_tokens_per_s,
            d_forecast,
            tick.ff_gain,
            self.config,
            self.tick_s,
            0.0,
            self.u_max_tokens_per_s,
        )
        return Proposal(result.u, tick)

    def applied(self, tick: LawTick, u_tokens_per_s: float) -> None:
        """Advance the internal model by the effective input actually applied."""
        if self.mpc_state is None:
            return
        level = tick.forecast.level
        v_now = u_tokens_per_s + tick.ff_gain * (level if math.isfinite(level) else 0.0)
        self.mpc_state = mpc_advance(self._scheduled(tick), self.mpc_state, v_now)

    def state(self) -> dict[str, float]:
        """The internal model's output per modelled output."""
        if self.mpc_state is None:
            return {}
        return {f"mpc_model_{o.name}": m
                for o, m in zip(self.outputs, self.mpc_state.model_outputs, strict=True)}
