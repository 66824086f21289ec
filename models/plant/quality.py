"""Fit quality of a model's simulated output against the measured one."""

from __future__ import annotations

import numpy as np


def nrmse(y: np.ndarray, y_hat: np.ndarray) -> float:
    """Normalised root-mean-square error ||y - y_hat|| / ||y - mean(y)|| (0 is perfect).

    A constant measured series carries no information to normalise by: the result is inf.
    """
    y = np.asarray(y, dtype=float)
    y_hat = np.asarray(y_hat, dtype=float)
    spread = float(np.linalg.norm(y - y.mean()))
    if spread == 0.0:
        return float("inf")
    return float(np.linalg.norm(y - y_hat)) / spread


def r_squared(y: np.ndarray, y_hat: np.ndarray) -> float:
    """Coefficient of determination 1 - SSE/SST of a simulated output (1 is perfect)."""
    return 1.0 - nrmse(y, y_hat) ** 2
