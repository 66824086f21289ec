"""The identified plant: a frozen `PlantModel`, its JSON form, and the usability check.

Input u is the batch token budget (tokens/s); each output is the signal the law tracks
(`signal`): the SLO burn (share of samples above the SLO over the 5% a p95 allows) or an
interactive p95 divided by its SLO; 1.0 is the SLO line either way. A fit with the wrong sign
(more batch must not lower latency), too little excitation, or a poor fit is refused with
`UnusableFitError` naming the reason.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from borrowd.models.errors import InputError
from borrowd.models.plant.arx import fit_arx
from borrowd.models.plant.fopdt import FopdtFit, fit_fopdt

PLANT_SCHEMA = 1
SIGNAL_BURN = "burn"
SIGNAL_P95 = "p95_over_slo"
SIGNALS = (SIGNAL_BURN, SIGNAL_P95)


class UnusableFitError(InputError):
    """The data do not support a model the controller may use; the message says why."""


@dataclass(frozen=True)
class OutputModel:
    """FOPDT (and ARX) model of one normalised output around the operating point."""

    name: str
    gain_per_token_s: float
    tau_s: float
    dead_s: float
    y0: float
    nrmse: float
    r2: float
    arx_a: tuple[float, ...] = ()
    arx_b: tuple[float, ...] = ()
    arx_nk: int = 0
    arx_r2: float = math.nan

    def fopdt(self, dt_s: float, u0: float) -> FopdtFit:
        """This output's FOPDT model as a `FopdtFit` at input operating point `u0`."""
        return FopdtFit(
            gain=self.gain_per_token_s,
            tau_s=self.tau_s,
            dead_s=self.dead_s,
            u0=u0,
            y0=self.y0,
            dt_s=dt_s,
            nrmse=self.nrmse,
            r2=self.r2,
        )


@dataclass(frozen=True)
class PlantModel:
    """Local model from batch tokens/s to every normalised interactive output."""

    dt_s: float
    u0_tokens_per_s: float
    u_low_tokens_per_s: float
    u_high_tokens_per_s: float
    interactive_tokens_per_s: float
    outputs: tuple[OutputModel, ...]
    source: str
    schema: int = PLANT_SCHEMA
    signal: str = SIGNAL_P95
    unmodelled: tuple[str, ...] = ()

    def output(self, name: str) -> OutputModel:
        """The model of output `name`; `InputError` when the plant lacks it."""
        for out in self.outputs:
            if out.name == name:
                return out
        raise InputError(f"plant has no output {name!r} (has {[o.name for o in self.outputs]})")

    def to_json(self) -> str:
        """The model as indented JSON."""
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> PlantModel:
        """Parse `to_json` output; `InputError` naming the field on malformed input."""
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise InputError(f"plant model is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise InputError("plant model is not a JSON object")
        if data.get("schema") != PLANT_SCHEMA:
            raise InputError(
                f"plant model has schema {data.get('schema')!r}, expected {PLANT_SCHEMA}"
            )
        try:
            outputs = tuple(
                OutputModel(
                    **{
                        **o,
                        "arx_a": tuple(o.get("arx_a", ())),
                        "arx_b": tuple(o.get("arx_b", ())),
                    }
                )
                for o in data["outputs"]
            )
            plant = cls(**{**data, "outputs": outputs,
                           "unmodelled": tuple(data.get("unmodelled", ()))})
        except (KeyError, TypeError) as exc:
            raise InputError(f"plant model is malformed: {exc}") from None
        if plant.signal not in SIGNALS:
            raise InputError(f"plant model signal must be one of {SIGNALS}, got {plant.signal!r}")
        return plant

    def save(self, path: Path) -> None:
        """Write the model to `path` as JSON."""
        path.write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path: Path) -> PlantModel:
        """Read a model written by `save`; `InputError` naming the path when it cannot."""
        try:
            text = path.read_text()
        except OSError as exc:
            raise InputError(f"cannot read plant model {path}: {exc.strerror}") from None
        try:
            return cls.from_json(text)
        except InputError as exc:
            raise InputError(f"{path}: {exc}") from None


@dataclass(frozen=True)
class FitCriteria:
    """What a fit must show before the controller may use it."""

    min_r2: float = field(default=0.4, metadata={"unit": "1", "help": "least simulation R^2"})
    min_u_span_frac: float = field(
        default=0.2,
        metadata={"unit": "1", "help": "least input span (max-min) as a fraction of its max"},
    )
    min_steps: int = field(
        default=4, metadata={"unit": "count", "help": "least number of input level changes"}
    )
    max_dead_s: float = field(
        default=20.0, metadata={"unit": "s", "help": "longest dead time searched"}
    )


def excitation_problems(u: np.ndarray, criteria: FitCriteria) -> list[str]:
    """Reasons why the input series `u` does not excite the plant enough (empty when fine)."""
    u = np.asarray(u, dtype=float)
    problems = []
    u_max = float(np.max(np.abs(u))) if len(u) else 0.0
    span = float(np.ptp(u)) if len(u) else 0.0
    if u_max == 0.0 or span < criteria.min_u_span_frac * u_max:
        problems.append(
            f"too little excitation: input span {span:.0f} tokens/s is under "
            f"{criteria.min_u_span_frac:.0%} of its max {u_max:.0f}"
        )
    changes = int(np.count_nonzero(np.abs(np.diff(u)) > 1e-9 * max(u_max, 1.0)))
    if changes < criteria.min_steps:
        problems.append(
            f"too little excitation: input changes level {changes} times, need {criteria.min_steps}"
        )
    return problems


def fit_problems(name: str, fit: FopdtFit, criteria: FitCriteria) -> list[str]:
    """Reasons why one output's fit is unusable (empty when fine)."""
    problems = []
    if fit.gain <= 0:
        problems.append(
            f"{name}: wrong sign: gain {fit.gain:.3g} per token/s (more batch must raise latency)"
        )
    if fit.r2 < criteria.min_r2:
        problems.append(f"{name}: poor fit: R^2 {fit.r2:.2f} < {criteria.min_r2:.2f}")
    return problems


def identify_plant(
    u: np.ndarray,
    outputs: dict[str, np.ndarray],
    dt_s: float,
    *,
    interactive_tokens_per_s: float,
    source: str,
    criteria: FitCriteria | None = None,
    signal: str = SIGNAL_P95,
) -> PlantModel:
    """Fit FOPDT and ARX(2, 2, dead+1) models of every output (each the tracked `signal`);
    refuse an unusable result."""
    criteria = criteria or FitCriteria()
    u = np.asarray(u, dtype=float)
    problems = excitation_problems(u, criteria)
    models = []
    idle = []
    for name, y in outputs.items():
        if signal == SIGNAL_BURN and not np.any(np.asarray(y, dtype=float) > 0):
            # Never above its SLO over the whole experiment: the budget does not move this
            # burn in the range tried; its loop keeps the default gains.
            idle.append(f"{name}: burn stayed 0 (never above its SLO in the experiment)")
            continue
        try:
            fit = fit_fopdt(u, np.asarray(y, dtype=float), dt_s, criteria.max_dead_s)
        except InputError as exc:
            problems.append(f"{name}: {exc}")
            continue
        problems.extend(fit_problems(name, fit, criteria))
        arx = fit_arx(u, np.asarray(y, dtype=float), dt_s, na=2, nb=2, nk=fit.dead_steps + 1)
        models.append(
            OutputModel(
                name=name,
                gain_per_token_s=fit.gain,
                tau_s=fit.tau_s,
                dead_s=fit.dead_s,
                y0=fit.y0,
                nrmse=fit.nrmse,
                r2=fit.r2,
                arx_a=arx.a,
                arx_b=arx.b,
                arx_nk=arx.nk,
                arx_r2=arx.r2,
            )
        )
    if not models and not problems:
        problems.extend(idle)
    if problems:
        raise UnusableFitError("unusable plant fit: " + "; ".join(problems))
    return PlantModel(
        dt_s=dt_s,
        u0_tokens_per_s=float(u.mean()),
        u_low_tokens_per_s=float(u.min()),
        u_high_tokens_per_s=float(u.max()),
        interactive_tokens_per_s=interactive_tokens_per_s,
        outputs=tuple(models),
        source=source,
        signal=signal,
        unmodelled=tuple(idle),
    )
