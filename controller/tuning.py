"""Loop analysis of a PI on an identified FOPDT plant, with python-control as the reference.

    P(s) = K exp(-theta s) / (tau s + 1)    (dead time by a 5th-order Pade approximation,
                                             plus half a tick for the sample and hold)
    C(s) = kp (1 + 1 / (Ti s)),  Ti = kp / ki
    L = C P;  T = L / (1 + L)

`analyse_loop` returns the gains, the gain and phase margins of L and the step response of
T (rise time, overshoot, settling time), for `borrowd tune`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import control
import numpy as np
from borrowd.controller.laws.pi import PiGains, pi_gains
from borrowd.models.plant.model import PlantModel

PADE_ORDER = 5


@dataclass(frozen=True)
class LoopReport:
    """Gains and closed-loop figures of one output's PI loop."""

    output: str
    gains: PiGains
    gain_margin: float
    phase_margin_deg: float
    crossover_rad_per_s: float
    rise_time_s: float
    overshoot_pct: float
    settling_time_s: float
    step_t_s: np.ndarray
    step_y: np.ndarray


def loop_transfer(plant: PlantModel, output: str, gains: PiGains, tick_s: float):
    """Open-loop L(s) = C(s) P(s) of `output` with `gains` (python-control TransferFunction)."""
    model = plant.output(output)
    theta = model.dead_s + tick_s / 2.0
    num, den = control.pade(theta, PADE_ORDER)
    delay = control.tf(num, den)
    p = control.tf([model.gain_per_token_s], [model.tau_s, 1.0]) * delay
    c = control.tf([gains.kp, gains.ki_per_s], [1.0, 0.0])
    return c * p


def analyse_loop(
    plant: PlantModel, output: str, method: str, tc_s: float, tick_s: float
) -> LoopReport:
    """Gains from the tuning rule, margins and the closed-loop unit step of `output`."""
    model = plant.output(output)
    gains = pi_gains(model.fopdt(plant.dt_s, plant.u0_tokens_per_s), method, tc_s, tick_s)
    loop = loop_transfer(plant, output, gains, tick_s)
    gm, pm, _, wc = control.margin(loop)
    closed = control.feedback(loop, 1)
    horizon_s = 10.0 * (model.tau_s + model.dead_s + tick_s)
    t = np.linspace(0.0, horizon_s, 2000)
    response = control.step_response(closed, t)
    y = np.asarray(response.outputs).reshape(-1)
    info = control.step_info(closed, T=t)
    return LoopReport(
        output=output,
        gains=gains,
        gain_margin=float(gm) if gm is not None else math.inf,
        phase_margin_deg=float(pm) if pm is not None else math.inf,
        crossover_rad_per_s=float(wc) if wc is not None else math.nan,
        rise_time_s=float(info["RiseTime"]),
        overshoot_pct=float(info["Overshoot"]),
        settling_time_s=float(info["SettlingTime"]),
        step_t_s=t,
        step_y=y,
    )
