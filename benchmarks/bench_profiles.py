"""Held-out error of every shipped step-time profile against Vidur's measured operator times.

For each built-in profile: refit it from its recipe (models/sim/profile_builtins.py) with
every 5th measured token count held out, and print the median and worst absolute relative
error of the non-attention step time on those held-out rows (aim: median < 5%, worst <
15%); the shipped file's own error over all measured rows; the check of the per-operator
shape scaling behind the H100 Llama-3-8B profile (A100 Llama-2-7B -> measured A100
Llama-3-8B); and the hand-built profiles these replaced, against the same data. Attention
is not in the measurements (modelled from FLOPs and bandwidth) and is not scored here.

    python3 benchmarks/bench_profiles.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from borrowd.models.sim.profile_builtins import (
    RECIPES,
    RECIPES_BY_NAME,
    build,
    profile_errors,
    scaling_check,
)
from borrowd.models.sim.profiles import PROFILES, StepProfile

# The hand-built profiles the fitted ones replaced (issue #2 figures, linear layers only).
PREVIOUS = (
    StepProfile("a100-llama3-8b (hand-built)",
                ((1, 9.7e-3), (512, 34.6e-3), (2048, 146.0e-3), (4096, 274.0e-3)),
                0.0, 0.0, 1, ""),
    StepProfile("h100-llama3-8b (hand-built)",
                ((1, 5.6e-3), (512, 12.0e-3), (2048, 40.0e-3), (4096, 84.0e-3)),
                0.0, 0.0, 1, ""),
)


def main() -> int:
    """Print the table of errors."""
    print("| profile | measured data | held-out rows | median abs err | worst abs err "
          "(at tokens) | shipped file, all rows: median / worst |")
    print("|---|---|---:|---:|---:|---:|")
    for recipe in RECIPES:
        _, report = build(recipe)
        shipped = profile_errors(PROFILES[recipe.name], recipe)
        data = recipe.measured + (" (rescaled)" if recipe.target else "")
        print(f"| {recipe.name} | {data}, tp {recipe.tp} | {report.held_out_rows} | "
              f"{report.median_abs_err:.1%} | {report.worst_abs_err:.1%} "
              f"({report.worst_at_tokens}) | {np.median(shipped):.1%} / {shipped.max():.1%} |")
    scaling = scaling_check()
    print(f"\nshape scaling check (A100 Llama-2-7B scaled -> measured A100 Llama-3-8B, "
          f"{len(scaling)} token counts): median {np.median(scaling):.1%}, worst "
          f"{scaling.max():.1%}")
    print("\nhand-built profiles replaced, against the same measurements (all rows):")
    for old in PREVIOUS:
        recipe = RECIPES_BY_NAME[old.name.split(" ")[0]]
        errors = profile_errors(old, recipe)
        print(f"  {old.name}: median {np.median(errors):.1%}, worst {errors.max():.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
