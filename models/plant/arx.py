"""ARX(na, nb, nk) fit by least squares.

    y[k] + a1*y[k-1] + ... + a_na*y[k-na] = b1*u[k-nk] + ... + b_nb*u[k-nk-nb+1] + c

`nk` is the input delay in samples (>= 1 for a sampled plant without direct feed-through);
`c` absorbs the operating point. Fit quality is that of the free-run simulation.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from borrowd.models.errors import InputError
from borrowd.models.plant.quality import nrmse


@dataclass(frozen=True)
class ArxFit:
    """ARX coefficients (a: na, b: nb, intercept c), delay nk and simulation fit quality."""

    a: tuple[float, ...]
    b: tuple[float, ...]
    c: float
    nk: int
    dt_s: float
    nrmse: float
    r2: float

    def static_gain(self) -> float:
        """Steady-state dy/du = sum(b) / (1 + sum(a))."""
        return sum(self.b) / (1.0 + sum(self.a))

    def is_stable(self) -> bool:
        """True when every pole of 1 + a1 z^-1 + ... lies strictly inside the unit circle."""
        if not self.a:
            return True
        return bool(np.all(np.abs(np.roots([1.0, *self.a])) < 1.0))

    def simulate(self, u: np.ndarray, y_init: np.ndarray) -> np.ndarray:
        """Free-run output driven by `u`; the first max(na, nk+nb-1) samples are `y_init`."""
        u = np.asarray(u, dtype=float)
        start = _start(len(self.a), len(self.b), self.nk)
        y = np.empty(len(u))
        y[:start] = np.asarray(y_init, dtype=float)[:start]
        for k in range(start, len(u)):
            past_y = sum(ai * y[k - i - 1] for i, ai in enumerate(self.a))
            past_u = sum(bj * u[k - self.nk - j] for j, bj in enumerate(self.b))
            y[k] = -past_y + past_u + self.c
        return y


def _start(na: int, nb: int, nk: int) -> int:
    return max(na, nk + nb - 1, 1)


def fit_arx(u: np.ndarray, y: np.ndarray, dt_s: float, na: int, nb: int, nk: int) -> ArxFit:
    """Least-squares ARX(na, nb, nk) fit of `y` driven by `u`, both sampled every `dt_s`."""
    u = np.asarray(u, dtype=float)
    y = np.asarray(y, dtype=float)
    if u.shape != y.shape or u.ndim != 1:
        raise InputError(f"u and y must be 1-D series of equal length, got {u.shape} and {y.shape}")
    if na < 0 or nb < 1 or nk < 0:
        raise InputError(f"ARX orders need na >= 0, nb >= 1, nk >= 0; got ({na}, {nb}, {nk})")
    if not (np.all(np.isfinite(u)) and np.all(np.isfinite(y))):
        raise InputError("u and y must be finite (drop or fill missing samples before fitting)")
    start = _start(na, nb, nk)
    n_params = na + nb + 1
    if len(u) - start < 3 * n_params:
        raise InputError(f"need at least {start + 3 * n_params} samples for ARX({na},{nb},{nk})")
    k = np.arange(start, len(u))
    columns = [-y[k - i - 1] for i in range(na)]
    columns += [u[k - nk - j] for j in range(nb)]
    columns.append(np.ones(len(k)))
    theta, *_ = np.linalg.lstsq(np.column_stack(columns), y[k], rcond=None)
    provisional = ArxFit(
        a=tuple(float(v) for v in theta[:na]),
        b=tuple(float(v) for v in theta[na : na + nb]),
        c=float(theta[-1]),
        nk=nk,
        dt_s=dt_s,
        nrmse=0.0,
        r2=1.0,
    )
    err = nrmse(y, provisional.simulate(u, y)) if provisional.is_stable() else float("inf")
    return ArxFit(
        a=provisional.a,
        b=provisional.b,
        c=provisional.c,
        nk=nk,
        dt_s=dt_s,
        nrmse=err,
        r2=1.0 - err**2,
    )
