"""Robustness matrix: the default law against the best hindsight static cap on many shapes.

Every shape of `models.sim.shapes.SHAPES` (transforms of the shared traces: long-context
chat, short prompts at a high rate, heavy bursts, diurnal swings, replica failures, two to
eight replicas; SLO sets seed, relaxed, and "margin": 1.25 x the worst 60 s p95 of the same
traffic without borrowing) is run under admission and engine enforcement:

- `none` (no batch; sets the margin SLOs) and `priority` (free batch; the sweep's ceiling),
- the law (default `pi`, the shipped default policy),
- a hindsight sweep of `static:R:S` over rates (fractions of what `priority` computes) and
  sequence caps, refined by bisection at the best cap; the best is the one carrying the
  most batch tokens/s with every 60 s window met.

Per shape and enforcement it prints the law's batch tokens/s beside the best static cap's,
their ratio, the share of windows met, the recomputed share of batch tokens, revocations
and mode changes per simulated hour after the cold start; tune and held-out shapes are
reported apart (the split is fixed in `shapes.py`: tune on `tune` shapes only). Runs
without a controller (none, priority, static caps) are cached under
~/.cache/borrowd/matrix-runs, keyed by the run and the simulator's source, so a rerun after
a controller change runs only the law.

    python3 benchmarks/bench_matrix.py --quick                 # 600 s runs, small sweep
    python3 benchmarks/bench_matrix.py --quick --seed 0 1 2 3  # per draw, then their sums
    python3 benchmarks/bench_matrix.py --duration 3600 --plot matrix.png --json matrix.json
    python3 benchmarks/bench_matrix.py --quick --explain diurnal:admission   # one row's story

`--explain SHAPE:ENFORCEMENT` runs the law on that one row (its SLO from the cached run without
borrowing, under `--set` and the first `--seed`) and prints each 60 s window (p95 TTFT and ITL
over the SLO, batch tokens/s, misses) and each mode change with its reason: where a row of the
table lost its windows or its throughput.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from functools import partial
from itertools import pairwise
from pathlib import Path

import numpy as np
from borrowd.controller.closed_loop import SimControllers, example_pool
from borrowd.models.config_loader import parse_settings, with_settings
from borrowd.models.enforcement import ADMISSION, DEFAULT_STEP_GUARD_FRAC, ENGINE
from borrowd.models.errors import ConfigError, InputError
from borrowd.models.signals import Slo
from borrowd.models.sim.run import calibrate_rate_scale, run_scenario
from borrowd.models.sim.scenario import Failure, Scenario
from borrowd.models.sim.shapes import (
    HELD_OUT,
    SHAPES,
    SLO_MARGIN,
    SLO_RELAXED,
    SLO_SEED,
    TUNE,
    Shape,
    get_shape,
    margin_slo,
    trace_digest,
    transform_lengths,
    warp_arrivals,
    write_jsonl,
)
from borrowd.models.sim.trace import load_trace, resolve_trace
from borrowd.models.sim.workload import interactive_arrivals

ENFORCEMENTS = (ADMISSION, ENGINE)
FIXED_SLOS = {
    SLO_SEED: Slo(),
    SLO_RELAXED: Slo(ttft_p95_s=2.0, itl_p95_s=0.100),
}


@dataclass(frozen=True)
class Grid:
    """The static sweep: rate fractions of the `priority` ceiling, sequence caps per replica,
    and bisection steps at the best cap."""

    fractions: tuple[float, ...]
    seqs_per_replica: tuple[int, ...]
    refine_steps: int


QUICK_GRID = Grid((0.05, 0.15, 0.3, 0.5, 0.7), (2, 8), 1)
FULL_GRID = Grid((0.03, 0.08, 0.15, 0.25, 0.35, 0.45, 0.55, 0.65, 0.75, 0.9), (1, 2, 4, 8, 16), 2)


@dataclass(frozen=True)
class Cell:
    """One run of the matrix (picklable for the process pool)."""

    shape: str
    scenario: Scenario
    policy: str
    duration_s: float
    seed: int
    trace_path: str


def cache_dir() -> Path:
    """Where shape traces are written: $BORROWD_CACHE_DIR/shapes, else ~/.cache/borrowd/shapes."""
    base = os.environ.get("BORROWD_CACHE_DIR")
    return (Path(base) if base else Path.home() / ".cache" / "borrowd") / "shapes"


def base_scenario(shape: Shape, duration_s: float,
                  step_guard_frac: float = DEFAULT_STEP_GUARD_FRAC) -> Scenario:
    """The shape's scenario without a trace file, SLO or enforcement yet (the engine
    plugin's step guard at `step_guard_frac` x the ITL SLO under engine enforcement)."""
    failure = None
    if shape.failure is not None:
        f = shape.failure
        failure = Failure(f.replica, f.start_frac, f.duration_frac * duration_s)
    return Scenario(
        name=shape.name,
        replicas=shape.replicas,
        burst=None,
        failure=failure,
        interactive_load=shape.interactive_load,
        step_guard_frac=step_guard_frac,
    )


def prepare_trace(shape: Shape, duration_s: float) -> str:
    """Write the shape's arrivals for a run of `duration_s` (in simulation time, rate scale
    1) and return the file: lengths transformed, rate calibrated to the shape's load, then
    warped by its rate profile. Files are named by content, so reruns reuse them."""
    base = load_trace(resolve_trace(shape.trace))
    key = trace_digest(base, repr((shape.lengths, duration_s)))
    lengths_path = cache_dir() / f"{shape.name}-lengths-{key}.jsonl"
    shaped = transform_lengths(base, shape.lengths, lengths_path)
    if not lengths_path.exists():
        write_jsonl(lengths_path, shaped.arrival_s, shaped.prompt_tokens, shaped.output_tokens)
    shaped = load_trace(lengths_path)
    calib = replace(base_scenario(shape, duration_s), failure=None,
                    interactive_trace=str(lengths_path))
    scale = calibrate_rate_scale(calib, shaped, "native", duration_s)
    arrivals = interactive_arrivals(shaped, scale, duration_s)
    warped = warp_arrivals(arrivals.arrival_s, shape.rate, duration_s)
    final_key = trace_digest(shaped, repr((shape.rate, scale, duration_s)))
    path = cache_dir() / f"{shape.name}-{final_key}.jsonl"
    if not path.exists():
        write_jsonl(path, warped, arrivals.prompt_tokens, arrivals.output_tokens)
    return str(path)


def simulator_digest() -> str:
    """A digest of the simulator's source (models/), so cached runs follow code changes."""
    h = hashlib.sha256()
    root = Path(__file__).resolve().parents[1] / "models"
    for path in sorted(root.rglob("*.py")):
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def run_cell_cached(cell: Cell, settings: tuple[str, ...] = ()) -> dict[str, object]:
    """`run_cell`, with runs that involve no controller (none, priority, static caps) read
    from and written to the cache: they depend on the simulator alone, so a rerun after a
    controller change only runs the law (under `settings`, as `--set` gives them)."""
    if cell.policy in SimControllers().names():
        return run_cell(cell, settings)
    key = hashlib.sha256(repr((cell, simulator_digest())).encode()).hexdigest()[:24]
    path = cache_dir().parent / "matrix-runs" / f"{key}.json"
    try:
        return json.loads(path.read_text())  # type: ignore[no-any-return]
    except (OSError, ValueError):
        pass
    result = run_cell(cell)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(path)
    return result


def matrix_cell(shape: Shape, policy: str, slo: Slo, enforcement: str, *, duration_s: float,
                seed: int, trace_path: str, step_guard_frac: float = DEFAULT_STEP_GUARD_FRAC,
                interference_series: bool = True) -> Cell:
    """The run of `policy` on a shape at `slo` under `enforcement`, as the matrix runs it (the
    table and `--explain` both build their runs here)."""
    scenario = replace(base_scenario(shape, duration_s, step_guard_frac), slo=slo,
                       enforcement=enforcement, interactive_trace=trace_path,
                       interference_series=interference_series)
    return Cell(shape.name, scenario, policy, duration_s, seed, trace_path)


def simulate(cell: Cell, settings: tuple[str, ...] = ()) -> dict[str, object]:
    """Run one cell (a law under controller `settings`); the simulator's whole summary."""
    res = run_scenario(
        cell.scenario,
        cell.policy,
        duration_s=cell.duration_s,
        seed=cell.seed,
        trace_path=cell.trace_path,
        rate_scale=1.0,
        controllers=SimControllers(settings=settings),
    )
    return res.summary()


def run_cell(cell: Cell, settings: tuple[str, ...] = ()) -> dict[str, object]:
    """Run one cell (a law under controller `settings`); the figures the matrix needs (and
    each window's p95s)."""
    s = simulate(cell, settings)
    windows = s["windows"]
    timeline = s["budget_timeline"]
    changes = mode_changes_after_start([e["mode"] for e in timeline])  # type: ignore[index]
    batch = s["batch"]
    inter = s["interactive"]
    return {
        "shape": cell.shape,
        "policy": cell.policy,
        "enforcement": cell.scenario.enforcement,
        "batch_tokens_per_s": batch["tokens_per_s"],  # type: ignore[index]
        "computed_tokens_per_s": batch["computed_tokens_per_s"],  # type: ignore[index]
        "recomputed_frac": batch["recomputed_tokens_frac"],  # type: ignore[index]
        "revocations": batch["revocations"],  # type: ignore[index]
        "windows_met_frac": inter["slo_windows_met_frac"],  # type: ignore[index]
        "ttft_p95_s": inter["ttft_p95_s"],  # type: ignore[index]
        "itl_p95_s": inter["itl_p95_s"],  # type: ignore[index]
        "mode_changes_per_h": changes * 3600.0 / cell.duration_s,
        "window_ttft_p95_s": [w["ttft_p95_s"] for w in windows],  # type: ignore[index]
        "window_itl_p95_s": [w["itl_p95_s"] for w in windows],  # type: ignore[index]
        "wall_s": s["wall_s"],
    }


def explain_cell(shape: Shape, enforcement: str, duration_s: float, law: str, seed: int,
                 settings: tuple[str, ...] = (),
                 step_guard_frac: float = DEFAULT_STEP_GUARD_FRAC,
                 interference_series: bool = True) -> list[str]:
    """The lines of `--explain`: the law's run on one row of the matrix (the same run as the
    table's, so the same figures), window by window, and its mode changes with reasons."""
    run = partial(matrix_cell, duration_s=duration_s, seed=seed,
                  trace_path=prepare_trace(shape, duration_s), step_guard_frac=step_guard_frac)
    slo = shape_slo(shape, run_cell_cached(run(shape, "none", Slo(), ADMISSION)))
    law_cell = run(shape, law, slo, enforcement, interference_series=interference_series)
    return explain_lines(simulate(law_cell, settings), slo)


def explain_lines(summary: dict[str, object], slo: Slo) -> list[str]:
    """A run's windows (p95s over the SLO, batch tokens/s, missed) and mode changes."""
    batch = summary["batch"]
    inter = summary["interactive"]
    lines = [f"SLO p95 TTFT {slo.ttft_p95_s:g} s, ITL {1000 * slo.itl_p95_s:g} ms; batch "
             f"{batch['tokens_per_s']:.0f} tokens/s, windows met "  # type: ignore[index]
             f"{inter['slo_windows_met_frac']:.3f}, revocations "  # type: ignore[index]
             f"{batch['revocations']}",  # type: ignore[index]
             "window start s | TTFT/SLO | ITL/SLO | batch tok/s | met"]
    for w in summary["windows"]:  # type: ignore[attr-defined]
        lines.append(f"{w['start_s']:14.0f} | {w['ttft_p95_s'] / slo.ttft_p95_s:8.2f} | "
                     f"{w['itl_p95_s'] / slo.itl_p95_s:7.2f} | "
                     f"{w['batch_tokens_per_s']:11.0f} | {'yes' if w['slo_met'] else 'MISSED'}")
    lines.append("mode changes (t s, mode, budget tokens/s, reason)")
    last = None
    for e in summary["budget_timeline"]:  # type: ignore[attr-defined]
        if e["mode"] != last:
            lines.append(f"{e['t_s']:8.1f} {e['mode']:8s} {e['batch_tokens_per_s']:9.0f} "
                         f"{e['reason']}")
            last = e["mode"]
    return lines


def mode_changes_after_start(modes: Sequence[object]) -> int:
    """Mode changes once the cold start is over (from the first tick in `open`): the start
    (closed, a failsafe while the first scrapes arrive, the ramp) happens once per daemon
    start, not per hour, and a 600 s run would count it six times over. A pool that never
    opens counts every change."""
    start = next((i for i, m in enumerate(modes) if m == "open"), 0)
    return sum(1 for a, b in pairwise(modes[start:]) if a != b)


def shape_slo(shape: Shape, none_run: dict[str, object]) -> Slo:
    """The shape's SLO set; margin SLOs from its no-borrowing run's worst windows."""
    if shape.slo_set != SLO_MARGIN:
        return FIXED_SLOS[shape.slo_set]
    return Slo(
        ttft_p95_s=round(margin_slo(none_run["window_ttft_p95_s"]), 4),  # type: ignore[arg-type]
        itl_p95_s=round(margin_slo(none_run["window_itl_p95_s"]), 5),  # type: ignore[arg-type]
    )


def best_static(runs: Iterable[dict[str, object]]) -> dict[str, object] | None:
    """The static run carrying the most batch tokens/s with every window met."""
    passing = [r for r in runs if r["windows_met_frac"] >= 1.0]  # type: ignore[operator]
    return max(passing, key=lambda r: r["batch_tokens_per_s"]) if passing else None  # type: ignore[arg-type, return-value]


def static_name(rate: float, seqs: int) -> str:
    """The policy name of a static cap."""
    return f"static:{rate:g}:{seqs}"


def parse_static(name: str) -> tuple[float, int]:
    """(rate, seqs) of a `static:R:S` policy name."""
    _, rate, seqs = name.split(":")
    return float(rate), int(seqs)


def refine_rates(runs: Sequence[dict[str, object]], seqs: int, ceiling: float) -> list[float]:
    """Two rates between the best passing rate at `seqs` and the next failing one."""
    mine = [(parse_static(str(r["policy"]))[0], r) for r in runs
            if parse_static(str(r["policy"]))[1] == seqs]
    passing = [rate for rate, r in mine if r["windows_met_frac"] >= 1.0]  # type: ignore[operator]
    failing = [rate for rate, r in mine if r["windows_met_frac"] < 1.0]  # type: ignore[operator]
    low = max(passing, default=0.0)
    above = [rate for rate in failing if rate > low]
    high = min(above) if above else ceiling
    done = {rate for rate, _ in mine}
    out = [round(low + (high - low) * f, -1) for f in (1 / 3, 2 / 3)]
    return [r for r in out if r > 0 and r not in done]


def run_matrix(shapes: Sequence[Shape], duration_s: float, grid: Grid, law: str, seed: int,
               workers: int, settings: tuple[str, ...] = (),
               step_guard_frac: float = DEFAULT_STEP_GUARD_FRAC,
               interference_series: bool = True) -> list[dict[str, object]]:
    """Every shape under every enforcement: law (under controller `settings`), best static,
    and the figures (rows); the plugin's step guard at `step_guard_frac` in every run; the
    law's engines without interference series unless `interference_series` (the static caps
    read no signal, so theirs stay as they are and cached)."""
    with ProcessPoolExecutor(max_workers=workers) as pool:
        paths = dict(zip((s.name for s in shapes),
                         pool.map(prepare_trace, shapes, [duration_s] * len(shapes)),
                         strict=True))

        def cell(shape: Shape, policy: str, slo: Slo, enforcement: str) -> Cell:
            return matrix_cell(shape, policy, slo, enforcement, duration_s=duration_s,
                               seed=seed, trace_path=paths[shape.name],
                               step_guard_frac=step_guard_frac,
                               interference_series=interference_series or policy != law)

        first = [cell(s, p, Slo(), ADMISSION) for s in shapes for p in ("none", "priority")]
        done = list(pool.map(run_cell_cached, first))
        slos = {s.name: shape_slo(s, done[2 * i]) for i, s in enumerate(shapes)}
        ceilings = {s.name: float(done[2 * i + 1]["computed_tokens_per_s"])  # type: ignore[arg-type]
                    for i, s in enumerate(shapes)}
        second = []
        for s in shapes:
            for enf in ENFORCEMENTS:
                second.append(cell(s, law, slos[s.name], enf))
                for seqs in grid.seqs_per_replica:
                    for f in grid.fractions:
                        rate = round(f * ceilings[s.name], -2)
                        second.append(cell(s, static_name(rate, seqs * s.replicas),
                                           slos[s.name], enf))
        results = list(pool.map(partial(run_cell_cached, settings=settings), second))
        by_key: dict[tuple[str, str], list[dict[str, object]]] = {}
        for c, r in zip(second, results, strict=True):
            by_key.setdefault((c.shape, c.scenario.enforcement), []).append(r)
        for _ in range(grid.refine_steps):
            more = []
            for s in shapes:
                for enf in ENFORCEMENTS:
                    statics = [r for r in by_key[(s.name, enf)]
                               if str(r["policy"]).startswith("static:")]
                    best = best_static(statics)
                    seqs = (parse_static(str(best["policy"]))[1] if best
                            else min(grid.seqs_per_replica) * s.replicas)
                    for rate in refine_rates(statics, seqs, ceilings[s.name]):
                        more.append(cell(s, static_name(rate, seqs), slos[s.name], enf))
            for c, r in zip(more, pool.map(run_cell_cached, more), strict=True):
                by_key[(c.shape, c.scenario.enforcement)].append(r)
    rows = []
    for s in shapes:
        for enf in ENFORCEMENTS:
            runs = by_key[(s.name, enf)]
            law_run = next(r for r in runs if r["policy"] == law)
            best = best_static([r for r in runs if str(r["policy"]).startswith("static:")])
            rows.append(matrix_row(s, enf, slos[s.name], law_run, best, len(runs) - 1))
    return rows


def matrix_row(shape: Shape, enforcement: str, slo: Slo, law_run: dict[str, object],
               best: dict[str, object] | None, sweep_runs: int) -> dict[str, object]:
    """One line of the table: the law's figures beside the best static cap's."""
    law_tps = float(law_run["batch_tokens_per_s"])  # type: ignore[arg-type]
    best_tps = float(best["batch_tokens_per_s"]) if best else 0.0  # type: ignore[arg-type]
    ratio = law_tps / best_tps if best_tps > 0 else math.nan
    return {
        "shape": shape.name,
        "split": shape.split,
        "enforcement": enforcement,
        "slo_ttft_p95_s": slo.ttft_p95_s,
        "slo_itl_p95_s": slo.itl_p95_s,
        "law": law_run["policy"],
        "law_tokens_per_s": law_tps,
        "best_static": best["policy"] if best else None,
        "best_static_tokens_per_s": best_tps,
        "ratio": ratio,
        "law_windows_met_frac": law_run["windows_met_frac"],
        "law_windows_missed": windows_missed(law_run),
        "law_recomputed_frac": law_run["recomputed_frac"],
        "law_revocations": law_run["revocations"],
        "law_mode_changes_per_h": law_run["mode_changes_per_h"],
        "law_ttft_p95_s": law_run["ttft_p95_s"],
        "law_itl_p95_s": law_run["itl_p95_s"],
        "sweep_runs": sweep_runs,
    }


def windows_missed(run: dict[str, object]) -> int:
    """How many of a run's 60 s windows missed an SLO."""
    count = len(run["window_ttft_p95_s"])  # type: ignore[arg-type]
    return round((1.0 - float(run["windows_met_frac"])) * count)  # type: ignore[arg-type]


def at_bar(row: dict[str, object]) -> bool:
    """True when the law carried at least the best static cap with every window met (the
    issue's bar)."""
    ratio = row["ratio"]
    return (isinstance(ratio, float) and ratio >= 1.0
            and float(row["law_windows_met_frac"]) >= 1.0)  # type: ignore[arg-type]


def draw_figures(rows: Sequence[dict[str, object]]) -> str:
    """One batch draw's rows in a line: rows at the bar, windows missed, ratios."""
    ratios = finite_ratios(rows)
    bar = sum(1 for r in rows if at_bar(r))
    missed = sum(int(r["law_windows_missed"]) for r in rows)  # type: ignore[call-overload]
    text = f"at the bar {bar}/{len(rows)}, windows missed {missed}"
    if ratios:
        text += f", geometric mean {geometric_mean(ratios):.2f}x, worst {min(ratios):.2f}x"
    return text


def draws_summary(rows_by_seed: dict[int, list[dict[str, object]]], split: str) -> list[str]:
    """Lines summing a split over several batch draws: all draws together, then each
    (one draw moves by a few windows with any change of phase, so compare these sums)."""
    per_seed = {seed: [r for r in rows if r["split"] == split]
                for seed, rows in rows_by_seed.items()}
    every = [r for rows in per_seed.values() for r in rows]
    if not every:
        return []
    seeds = " ".join(str(seed) for seed in per_seed)
    lines = [f"{split} shapes over {len(per_seed)} batch draws (seeds {seeds}): "
             f"{draw_figures(every)}"]
    lines += [f"  seed {seed}: {draw_figures(rows)}" for seed, rows in per_seed.items()]
    return lines


def format_rows(rows: Sequence[dict[str, object]]) -> str:
    """The rows as a Markdown table."""
    head = ("shape", "enforcement", "SLO ttft/itl", "law tok/s", "best static", "static tok/s",
            "law/static", "win met", "recomp", "revoked", "modes/h")
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        ratio = r["ratio"]
        cells = (
            str(r["shape"]),
            str(r["enforcement"]),
            f"{r['slo_ttft_p95_s']:.3g} s / {1000 * float(r['slo_itl_p95_s']):.3g} ms",  # type: ignore[arg-type]
            f"{r['law_tokens_per_s']:.0f}",
            str(r["best_static"] or "none met"),
            f"{r['best_static_tokens_per_s']:.0f}",
            "-" if not isinstance(ratio, float) or math.isnan(ratio) else f"{ratio:.2f}x",
            f"{r['law_windows_met_frac']:.3f}",
            f"{r['law_recomputed_frac']:.3f}",
            str(r["law_revocations"]),
            f"{r['law_mode_changes_per_h']:.0f}",
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def finite_ratios(rows: Sequence[dict[str, object]]) -> list[float]:
    """The rows' law/static ratios where a static cap met every window."""
    return [float(r["ratio"]) for r in rows  # type: ignore[arg-type]
            if isinstance(r["ratio"], float) and math.isfinite(r["ratio"])]


def geometric_mean(ratios: Sequence[float]) -> float:
    """Geometric mean of positive ratios (a 0 counts as 1e-9)."""
    return float(np.exp(np.mean(np.log(np.maximum(ratios, 1e-9)))))


def summary_line(rows: Sequence[dict[str, object]]) -> str:
    """Worst and geometric-mean ratio, and how many rows meet every window."""
    ratios = finite_ratios(rows)
    met = sum(1 for r in rows if float(r["law_windows_met_frac"]) >= 1.0)  # type: ignore[arg-type]
    if not ratios:
        return f"no static cap met every window; law met every window in {met}/{len(rows)} rows"
    gmean = geometric_mean(ratios)
    return (f"law/static: worst {min(ratios):.2f}x, geometric mean {gmean:.2f}x over "
            f"{len(ratios)} rows; law met every window in {met}/{len(rows)} rows")


def plot_rows(rows: Sequence[dict[str, object]], path: Path) -> None:
    """Bars of law/static per shape and enforcement (tune and held out), and windows met."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['shape']}\n{r['enforcement']}" for r in rows]
    ratios = [float(r["ratio"]) if isinstance(r["ratio"], float) and math.isfinite(r["ratio"])  # type: ignore[arg-type]
              else 0.0 for r in rows]
    colors = ["tab:blue" if r["split"] == TUNE else "tab:orange" for r in rows]
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 0.7 * len(rows)), 7), sharex=True)
    x = np.arange(len(rows))
    axes[0].bar(x, ratios, color=colors)
    axes[0].axhline(1.0, color="k", lw=0.8, ls="--")
    axes[0].set_ylabel("law / best static cap")
    axes[0].set_title("batch tokens/s (blue: tune shapes, orange: held out; 0: no ratio)")
    axes[1].bar(x, [float(r["law_windows_met_frac"]) for r in rows], color=colors)  # type: ignore[arg-type]
    axes[1].set_ylim(0.0, 1.05)
    axes[1].set_ylabel("share of 60 s windows met (law)")
    axes[1].set_xticks(x)
    axes[1].set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments, run the matrix, print the tables (tune, then held out)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="600 s runs and a small sweep (minutes on two idle cores)")
    p.add_argument("--duration", type=float, help="simulated seconds per run (default 1800)")
    p.add_argument("--shapes", nargs="+", help="shape names (default: all)")
    p.add_argument("--split", choices=(TUNE, HELD_OUT), help="only shapes of this split")
    p.add_argument("--law", default="pi", help="controller policy to compare (default pi)")
    p.add_argument("--seed", type=int, nargs="+", default=[0],
                   help="random seed of the batch draws; several: the matrix per draw, then "
                        "their sums per split")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="settings",
                   help="a controller setting for the law (keys under the pool's `controller` "
                        "table, e.g. pi.kp_tokens_per_s=12000; repeatable)")
    p.add_argument("--step-guard-frac", type=float, default=DEFAULT_STEP_GUARD_FRAC,
                   help="the engine plugin's step guard under engine enforcement, in every "
                        f"run (x the ITL SLO; 0: off; default {DEFAULT_STEP_GUARD_FRAC})")
    p.add_argument("--no-interference-series", action="store_true",
                   help="the law's engines export no interference series (bare vLLM behind "
                        "the gate and the proxy): the daemon reads no batch share")
    p.add_argument("--workers", type=int, default=2, help="parallel runs (processes)")
    p.add_argument("--explain", metavar="SHAPE:ENFORCEMENT",
                   help="run the law on this one row and print its windows and mode changes")
    p.add_argument("--json", type=Path, help="write the rows to this file")
    p.add_argument("--plot", type=Path, help="write the bar plot (PNG)")
    args = p.parse_args(argv)
    try:
        shapes = [get_shape(n) for n in args.shapes] if args.shapes else list(SHAPES)
    except InputError as exc:
        print(f"bench_matrix: {exc}", file=sys.stderr)
        return 2
    if args.split:
        shapes = [s for s in shapes if s.split == args.split]
    duration_s = args.duration or (600.0 if args.quick else 1800.0)
    if not duration_s > 0 or args.workers < 1:
        print("bench_matrix: --duration and --workers must be > 0", file=sys.stderr)
        return 2
    if not 0 <= args.step_guard_frac <= 1:
        print(f"bench_matrix: --step-guard-frac must be in [0, 1], got {args.step_guard_frac!r}",
              file=sys.stderr)
        return 2
    grid = QUICK_GRID if args.quick else FULL_GRID
    settings = tuple(args.settings)
    try:
        with_settings(example_pool().controller, parse_settings(settings), "controller")
    except ConfigError as exc:
        print(f"bench_matrix: --set: {exc}", file=sys.stderr)
        return 2
    seeds = list(dict.fromkeys(args.seed))
    if args.explain:
        name, _, enforcement = args.explain.partition(":")
        if enforcement not in ENFORCEMENTS:
            print(f"bench_matrix: --explain needs SHAPE:ENFORCEMENT with enforcement one of "
                  f"{', '.join(ENFORCEMENTS)}, got {args.explain!r}", file=sys.stderr)
            return 2
        try:
            shape = get_shape(name)
        except InputError as exc:
            print(f"bench_matrix: --explain: {exc}", file=sys.stderr)
            return 2
        print("\n".join(explain_cell(shape, enforcement, duration_s, args.law, seeds[0],
                                     settings, args.step_guard_frac,
                                     not args.no_interference_series)))
        return 0
    wall0 = time.perf_counter()
    rows_by_seed = {
        seed: [{**r, "seed": seed} for r in run_matrix(
            shapes, duration_s, grid, args.law, seed, args.workers, settings,
            args.step_guard_frac, not args.no_interference_series)]
        for seed in seeds
    }
    shown = f" ({', '.join(settings)})" if settings else ""
    if args.step_guard_frac != DEFAULT_STEP_GUARD_FRAC:
        shown += f" (step guard {args.step_guard_frac:g})"
    if args.no_interference_series:
        shown += " (no interference series)"
    print(f"robustness matrix: law {args.law}{shown}, {duration_s:g} s per run, "
          f"{'quick' if args.quick else 'full'} sweep, {time.perf_counter() - wall0:.0f} s wall")
    for seed, rows in rows_by_seed.items():
        draw = f", batch draw seed {seed}" if len(seeds) > 1 else ""
        for split in (TUNE, HELD_OUT):
            part = [r for r in rows if r["split"] == split]
            if part:
                print(f"\n{split} shapes{draw}")
                print(format_rows(part))
                print(summary_line(part))
    if len(seeds) > 1:
        print()
        for split in (TUNE, HELD_OUT):
            for line in draws_summary(rows_by_seed, split):
                print(line)
    every = [r for rows in rows_by_seed.values() for r in rows]
    if args.json:
        args.json.write_text(json.dumps(every, indent=1) + "\n")
    if args.plot:
        plot_rows(rows_by_seed[seeds[0]], args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
