"""First-order-plus-dead-time (FOPDT) fit by least squares.

    tau * dy/dt = -(y - y0) + gain * (u(t - dead_s) - u0)

sampled with a zero-order hold every `dt_s`, so that for a dead time of d samples
`y[k+1] = a*y[k] + (1 - a)*(y0 + gain*(u[k-d] - u0))` with `a = exp(-dt_s / tau_s)`.
The dead time is searched on the sample grid; for each candidate the three coefficients come
from linear least squares, and the candidate whose simulated output fits best wins.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from borrowd.models.errors import InputError
from borrowd.models.plant.quality import nrmse


@dataclass(frozen=True)
class FopdtFit:
    """A FOPDT model around an operating point (u0, y0), with its simulation fit quality."""

    gain: float
    tau_s: float
    dead_s: float
    u0: float
    y0: float
    dt_s: float
    nrmse: float
    r2: float

    @property
    def dead_steps(self) -> int:
        """Dead time in samples of `dt_s`."""
        return round(self.dead_s / self.dt_s)

    def pole(self) -> float:
        """Discrete pole a = exp(-dt_s / tau_s)."""
        return math.exp(-self.dt_s / self.tau_s)

    def simulate(self, u: np.ndarray, y_init: float | None = None) -> np.ndarray:
        """Output of the model driven by `u` (one sample per `dt_s`) from `y_init` (default y0)."""
        return simulate_fopdt(
            np.asarray(u, dtype=float),
            a=self.pole(),
            gain=self.gain,
            dead_steps=self.dead_steps,
            u0=self.u0,
            y0=self.y0,
            y_init=self.y0 if y_init is None else y_init,
        )


def simulate_fopdt(
    u: np.ndarray, *, a: float, gain: float, dead_steps: int, u0: float, y0: float, y_init: float
) -> np.ndarray:
    """Sampled FOPDT response; inputs before the record are taken equal to u[0]."""
    y = np.empty(len(u))
    if len(u) == 0:
        return y
    y[0] = y_init
    for k in range(len(u) - 1):
        u_delayed = u[k - dead_steps] if k >= dead_steps else u[0]
        y[k + 1] = a * y[k] + (1.0 - a) * (y0 + gain * (u_delayed - u0))
    return y


def fit_fopdt(u: np.ndarray, y: np.ndarray, dt_s: float, max_dead_s: float) -> FopdtFit:
    """Least-squares FOPDT fit of `y` driven by `u`, both sampled every `dt_s`.

    Raises `InputError` when the series are too short or no candidate gives a stable,
    finite first-order model (the caller's `check_usable` judges the quality of a fit).
    """
    u = np.asarray(u, dtype=float)
    y = np.asarray(y, dtype=float)
    if u.shape != y.shape or u.ndim != 1:
        raise InputError(f"u and y must be 1-D series of equal length, got {u.shape} and {y.shape}")
    if dt_s <= 0:
        raise InputError(f"dt_s must be > 0, got {dt_s!r}")
    if not (np.all(np.isfinite(u)) and np.all(np.isfinite(y))):
        raise InputError("u and y must be finite (drop or fill missing samples before fitting)")
    max_dead = max(0, round(max_dead_s / dt_s))
    if len(u) < max_dead + 10:
        raise InputError(f"need at least {max_dead + 10} samples to fit, got {len(u)}")
    u0 = float(u.mean())
    best: FopdtFit | None = None
    for d in range(max_dead + 1):
        k = np.arange(d, len(u) - 1)
        phi = np.column_stack([y[k], u[k - d], np.ones(len(k))])
        theta, *_ = np.linalg.lstsq(phi, y[k + 1], rcond=None)
        a, b, c = (float(v) for v in theta)
        if not (0.0 < a < 1.0):
            continue
        gain = b / (1.0 - a)
        y0 = c / (1.0 - a) + gain * u0
        y_sim = simulate_fopdt(u, a=a, gain=gain, dead_steps=d, u0=u0, y0=y0, y_init=y[0])
        err = nrmse(y, y_sim)
        if not math.isfinite(err):
            continue
        fit = FopdtFit(
            gain=gain,
            tau_s=-dt_s / math.log(a),
            dead_s=d * dt_s,
            u0=u0,
            y0=y0,
            dt_s=dt_s,
            nrmse=err,
            r2=1.0 - err**2,
        )
        if best is None or fit.nrmse < best.nrmse:
            best = fit
    if best is None:
        raise InputError("poor fit: no stable first-order model fits (output not driven by u?)")
    return best
