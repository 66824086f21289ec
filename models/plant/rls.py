"""Recursive least squares with exponential forgetting, for online re-estimation.

    K[k]     = P[k-1] phi / (lambda + phi' P[k-1] phi)
    theta[k] = theta[k-1] + K[k] (y[k] - phi' theta[k-1])
    P[k]     = (P[k-1] - K[k] phi' P[k-1]) / lambda

`P` is rescaled when its trace passes `max_trace`, so that long quiet stretches (no
excitation) cannot blow the covariance up. `LocalGain` runs it on the FOPDT regression
`y[k] = a*y[k-1] + b*u[k-1-d] + c` and reports the local gain b / (1 - a).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RlsState:
    """Parameter estimate `theta` and its covariance `P` (treat both as read-only)."""

    theta: np.ndarray
    p: np.ndarray

    @classmethod
    def initial(cls, theta0: np.ndarray, p0: float) -> RlsState:
        """Start at `theta0` with covariance p0 * I."""
        theta = np.asarray(theta0, dtype=float).copy()
        return cls(theta=theta, p=np.eye(len(theta)) * p0)


def _dot(a: np.ndarray, b: np.ndarray) -> float:
    """a . b exactly rounded (math.fsum), not through BLAS: a BLAS dot's last bits depend on
    the CPU's kernel, and the loop feeds each estimate back, so runs on two machines drifted
    apart (the MPC's seed figures moved by 3% between CPUs)."""
    return math.fsum(float(x) * float(z) for x, z in zip(a, b, strict=True))


def rls_update(
    state: RlsState, phi: np.ndarray, y: float, forgetting: float, max_trace: float
) -> RlsState:
    """One RLS step with forgetting factor `forgetting` in (0, 1]; returns a new state."""
    phi = np.asarray(phi, dtype=float)
    p_phi = np.array([_dot(row, phi) for row in state.p])
    gain = p_phi / (forgetting + _dot(phi, p_phi))
    theta = state.theta + gain * (y - _dot(phi, state.theta))
    p = (state.p - np.outer(gain, p_phi)) / forgetting
    p = 0.5 * (p + p.T)
    trace = float(np.trace(p))
    if trace > max_trace:
        p = p * (max_trace / trace)
    return RlsState(theta=theta, p=p)


@dataclass(frozen=True)
class LocalGain:
    """Online estimate of the plant's local gain dy/du (FOPDT regression under RLS).

    `u_history` holds the last `dead_steps + 1` inputs (newest last); `y_prev` the last output.
    Inputs enter the regression divided by `u_scale` so that all three parameters are of
    order one and one initial covariance suits them.
    """

    rls: RlsState
    u_history: tuple[float, ...]
    y_prev: float
    u_scale: float
    samples: int

    @classmethod
    def start(
        cls, gain: float, pole: float, y0: float, u0: float, dead_steps: int, u_scale: float
    ) -> LocalGain:
        """An estimator primed with a model (gain, pole a, operating point (u0, y0))."""
        c = (1.0 - pole) * (y0 - gain * u0)
        theta0 = np.array([pole, (1.0 - pole) * gain * u_scale, c])
        return cls(
            rls=RlsState.initial(theta0, p0=1.0),
            u_history=(u0,) * (dead_steps + 1),
            y_prev=y0,
            u_scale=u_scale,
            samples=0,
        )

    def gain(self) -> float:
        """Current local gain b / (1 - a) per unit of u; NaN while the pole is not in (0, 1)."""
        a, b, _ = self.rls.theta
        if not (0.0 < a < 1.0):
            return math.nan
        return float(b / (1.0 - a) / self.u_scale)

    def update(self, u: float, y: float, forgetting: float, max_trace: float) -> LocalGain:
        """Fold in the output `y` measured now and the input `u` applied for the next tick."""
        if not (math.isfinite(u) and math.isfinite(y)):
            return self
        phi = np.array([self.y_prev, self.u_history[0] / self.u_scale, 1.0])
        rls = rls_update(self.rls, phi, y, forgetting, max_trace)
        return LocalGain(
            rls=rls,
            u_history=(*self.u_history[1:], u),
            y_prev=y,
            u_scale=self.u_scale,
            samples=self.samples + 1,
        )
