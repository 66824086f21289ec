"""How each shipped step-time profile is derived from Vidur's measurements (MIT).

Each recipe names the measured operator table (`models/sim/data/vidur/`), the layer count,
the tensor-parallel degree, the GPU, and optionally a target shape the measured operators
are rescaled to (`profile_fit.reshape`). `build(recipe)` fits it the same way `borrowd
profile fit` does; `benchmarks/bench_profiles.py` prints every profile's held-out errors
and `tests/unit/models/sim/test_sim_profiles.py` checks the shipped files are what the
recipes give.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from borrowd.models.sim.profile_fit import (
    GPUS,
    VIDUR_DIR,
    FitReport,
    OperatorTable,
    Shape,
    attention_constants,
    fit_with_holdout,
    load_all_reduce,
    load_operator_table,
    profile_toml,
    relative_errors,
    reshape,
    step_seconds,
)
from borrowd.models.sim.profiles import PROFILES_DIR, StepProfile

VIDUR_SOURCE = "microsoft/vidur data/profiling (MIT), commit 7d47513"
# Llama-3-8B (meta-llama/Meta-Llama-3-8B config.json), the target of the H100 scaling.
LLAMA3_8B = Shape(n_head=32, n_kv_head=8, n_embd=4096, n_expanded_embd=14336,
                  vocab_size=128256, layers=32)


@dataclass(frozen=True)
class Recipe:
    """One shipped profile: measured table, layers, TP degree, GPU, optional target shape."""

    name: str
    measured: str
    layers: int
    tp: int
    gpu: str
    target: Shape | None = None
    note: str = ""


RECIPES: tuple[Recipe, ...] = (
    Recipe("a100-llama3-8b", "a100-meta-llama-3-8b", 32, 1, "a100",
           note="Llama-3-8B measured on A100."),
    Recipe("h100-llama3-8b", "h100-llama-2-7b", 32, 1, "h100", target=LLAMA3_8B,
           note="No H100 Llama-3-8B measurements: H100 Llama-2-7B operators scaled to "
                "Llama-3-8B's shape per operator by weight size (QKV x0.5, MLP x1.30, "
                "rope x0.625); the same scaling predicts measured A100 Llama-3-8B from A100 "
                "Llama-2-7B (errors in benchmarks/bench_profiles.py)."),
    Recipe("a100-llama3-70b-tp4", "a100-meta-llama-3-70b", 80, 4, "a100",
           note="Llama-3-70B measured on A100, tensor parallel 4, plus two all-reduces per "
                "layer measured on an A100 DGX node."),
    Recipe("h100-qwen-72b-tp4", "h100-qwen-72b", 80, 4, "h100",
           note="Qwen-72B measured on H100, tensor parallel 4, plus two all-reduces per layer "
                "measured on an H100 DGX node."),
)
RECIPES_BY_NAME = {r.name: r for r in RECIPES}


def measured_table(recipe: Recipe) -> OperatorTable:
    """The recipe's measured operator table (before any rescaling)."""
    path = VIDUR_DIR / f"{recipe.measured}.csv.gz"
    return load_operator_table(path, recipe.tp, recipe.layers)


def measured_steps(recipe: Recipe) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, non-attention step seconds) the recipe fits."""
    table = measured_table(recipe)
    if recipe.target is not None:
        table = reshape(table, recipe.target)
    all_reduce = None
    if recipe.tp > 1:
        all_reduce = load_all_reduce(VIDUR_DIR / f"{recipe.gpu}-all-reduce.csv.gz", recipe.tp)
    return table.num_tokens, step_seconds(table, all_reduce)


def build(recipe: Recipe) -> tuple[StepProfile, FitReport]:
    """The fitted profile of `recipe` and its held-out errors."""
    tokens, seconds = measured_steps(recipe)
    points, report = fit_with_holdout(tokens, seconds)
    shape = recipe.target or measured_table(recipe).shape
    decode, prefill, capacity = attention_constants(shape, GPUS[recipe.gpu], recipe.tp)
    source = (f"{VIDUR_SOURCE}: {recipe.measured} operators, tp {recipe.tp}; attention from "
              f"FLOPs and HBM bandwidth (NVIDIA {recipe.gpu.upper()} data sheet)")
    return StepProfile(recipe.name, points, decode, prefill, capacity, source), report


def scaling_check() -> np.ndarray:
    """Relative errors of predicting measured A100 Llama-3-8B from A100 Llama-2-7B by the
    per-operator size scaling used for the H100 Llama-3-8B profile (token counts both have)."""
    src = load_operator_table(VIDUR_DIR / "a100-llama-2-7b.csv.gz", 1, 32)
    dst = load_operator_table(VIDUR_DIR / "a100-meta-llama-3-8b.csv.gz", 1, 32)
    predicted = step_seconds(reshape(src, dst.shape))
    measured = dict(zip(dst.num_tokens.tolist(), step_seconds(dst).tolist(), strict=True))
    pairs = [(p, measured[t]) for t, p in zip(src.num_tokens.tolist(), predicted, strict=True)
             if t in measured]
    return np.array([abs(p / m - 1.0) for p, m in pairs])


def write_builtins(folder: Path = PROFILES_DIR) -> list[Path]:
    """Fit every recipe and write its profile file into `folder`; the paths written."""
    written = []
    for recipe in RECIPES:
        profile, report = build(recipe)
        path = folder / f"{recipe.name}.toml"
        path.write_text(profile_toml(profile, report, recipe.note))
        written.append(path)
    return written


def profile_errors(profile: StepProfile, recipe: Recipe) -> np.ndarray:
    """Relative errors of `profile`'s non-attention time on every row of the recipe's data."""
    tokens, seconds = measured_steps(recipe)
    return relative_errors(profile.linear_points, tokens, seconds)
