"""Excitation signals for identification experiments: steps and PRBS within bounds.

Every sample lies in [u_low, u_high]; a level is held at least `hold_s` so that the plant's
dead time and time constant show in the response.
"""

from __future__ import annotations

import numpy as np
from borrowd.models.errors import InputError


def _validate(u_low: float, u_high: float, duration_s: float, dt_s: float, hold_s: float) -> int:
    if not (0.0 <= u_low < u_high):
        raise InputError(f"excitation bounds need 0 <= u_low < u_high, got {u_low!r}, {u_high!r}")
    if dt_s <= 0 or hold_s < dt_s:
        raise InputError(f"excitation needs dt_s > 0 and hold_s >= dt_s, got {dt_s!r}, {hold_s!r}")
    n = round(duration_s / dt_s)
    if n < 2 * round(hold_s / dt_s):
        raise InputError(f"excitation of {duration_s} s is shorter than two holds of {hold_s} s")
    return n


def step_sequence(
    u_low: float, u_high: float, duration_s: float, dt_s: float, hold_s: float
) -> np.ndarray:
    """Square wave between u_low and u_high, each level held `hold_s`, starting low."""
    n = _validate(u_low, u_high, duration_s, dt_s, hold_s)
    hold = max(1, round(hold_s / dt_s))
    level = (np.arange(n) // hold) % 2
    return np.where(level == 0, u_low, u_high).astype(float)


def prbs(
    u_low: float, u_high: float, duration_s: float, dt_s: float, hold_s: float, seed: int
) -> np.ndarray:
    """Pseudo-random binary sequence: a random level (low/high) per hold of `hold_s`.

    The first two holds are low then high, so every sequence contains at least one step.
    """
    n = _validate(u_low, u_high, duration_s, dt_s, hold_s)
    hold = max(1, round(hold_s / dt_s))
    rng = np.random.default_rng(seed)
    n_holds = -(-n // hold)
    bits = rng.integers(0, 2, size=n_holds)
    bits[:2] = (0, 1)
    return np.where(np.repeat(bits, hold)[:n] == 0, u_low, u_high).astype(float)
