"""The policy comparison on one scenario: runs side by side, a static-cap sweep, table, plot.

Independent runs go to a process pool. The best static cap is the largest `static:R` that
meets every SLO window, found on a grid of fractions of what `priority` computes for batch
and then refined by bisection between the best passing and the first failing rate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from borrowd.models.enforcement import ENGINE
from borrowd.models.errors import InputError
from borrowd.models.sim.policies import ControllerCatalog, parse_policy
from borrowd.models.sim.run import calibrate_rate_scale, load_inputs, run_scenario, slo_json
from borrowd.models.sim.scenario import Scenario

DEFAULT_POLICIES = ("none", "unrestricted", "priority")
SWEEP_FRACTIONS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
REFINE_STEPS = 2


@dataclass(frozen=True)
class RunRequest:
    """One run of the bench (picklable, for the process pool)."""

    scenario: Scenario
    policy: str
    duration_s: float
    seed: int
    rate_scale: float
    trace_path: str | None
    engine: str
    plant_path: str | None
    controllers: ControllerCatalog | None = None


def run_one(req: RunRequest) -> dict[str, object]:
    """Run one policy and return its JSON summary."""
    res = run_scenario(
        req.scenario,
        req.policy,
        duration_s=req.duration_s,
        seed=req.seed,
        trace_path=req.trace_path,
        rate_scale=req.rate_scale,
        engine=req.engine,
        plant_path=Path(req.plant_path) if req.plant_path else None,
        controllers=req.controllers,
    )
    return res.summary()


def meets_every_window(summary: dict[str, object]) -> bool:
    """True when every SLO window of a run was met, fleet-wide and, when batch is restricted
    to some replicas, on those replicas (what the controller is held to)."""
    groups = cast(list[dict[str, object]], summary.get("replica_groups") or [])
    return summary["interactive"]["slo_windows_met_frac"] >= 1.0 and all(  # type: ignore[index]
        cast(float, g["slo_windows_met_frac"]) >= 1.0 for g in groups if g["group"] == "batch"
    )


def run_bench(
    scenario: Scenario,
    *,
    duration_s: float,
    seed: int = 0,
    policies: Sequence[str] | None = None,
    sweep: bool = True,
    trace_path: str | None = None,
    engine: str = "native",
    plant_path: str | None = None,
    workers: int = 2,
    controllers: ControllerCatalog | None = None,
) -> dict[str, object]:
    """Run the policies (and the static sweep) and return {rows, sweep, skipped, ...}.

    With `policies` None: the built-in ones plus each policy of `controllers` that can be
    built (one that cannot, e.g. for want of a plant model, is listed in `skipped` with why).
    """
    trace, _ = load_inputs(scenario, trace_path)
    scale = calibrate_rate_scale(scenario, trace, engine, duration_s)
    plant = Path(plant_path) if plant_path else None
    skipped: dict[str, str] = {}
    if policies is None:
        policies = list(DEFAULT_POLICIES)
        if controllers is not None:
            for name in controllers.names():
                try:
                    parse_policy(name, scenario, plant, controllers)
                except InputError as exc:
                    skipped[name] = str(exc)
                else:
                    policies.append(name)
    for name in policies:
        parse_policy(name, scenario, plant, controllers)

    def req(policy: str) -> RunRequest:
        return RunRequest(scenario, policy, duration_s, seed, scale, trace_path, engine, plant_path,
                          controllers)

    with ProcessPoolExecutor(max_workers=workers) as pool:
        names = list(policies)
        if sweep and "priority" not in names:
            names.insert(0, "priority")
        results = dict(zip(names, pool.map(run_one, [req(p) for p in names]), strict=True))
        sweep_runs: dict[float, dict[str, object]] = {}
        best: dict[str, object] | None = None
        if sweep:
            ceiling = float(results["priority"]["batch"]["computed_tokens_per_s"])  # type: ignore[index]
            rates = [round(f * ceiling, -2) for f in SWEEP_FRACTIONS]
            for rate, summary in zip(
                rates, pool.map(run_one, [req(f"static:{r:g}") for r in rates]), strict=True
            ):
                sweep_runs[rate] = summary
            best = _refine(sweep_runs, req, pool, ceiling)
    rows = [results[p] for p in policies if p in results]
    if best is not None:
        best = dict(best)
        best["policy"] = f"best {best['policy']}"
        rows.insert(min(3, len(rows)), best)
    return {
        "scenario": scenario.name,
        "slo": slo_json(scenario),
        "duration_s": duration_s,
        "seed": seed,
        "interactive_rate_scale": scale,
        "rows": rows,
        "skipped": skipped,
        "sweep": [
            {
                "batch_tokens_per_s_cap": rate,
                "slo_windows_met_frac": s["interactive"]["slo_windows_met_frac"],  # type: ignore[index]
                "batch_tokens_per_s": s["batch"]["tokens_per_s"],  # type: ignore[index]
            }
            for rate, s in sorted(sweep_runs.items())
        ],
    }


def _refine(runs: dict[float, dict[str, object]], req, pool,
            ceiling: float) -> dict[str, object] | None:
    """Narrow in between the best passing rate and the next failing one (or `ceiling`,
    what `priority` computes); return the best passing run."""
    for _ in range(REFINE_STEPS):
        passing = [r for r, s in runs.items() if meets_every_window(s)]
        failing = [r for r, s in runs.items() if not meets_every_window(s)]
        if not passing:
            low, high = 0.0, min(failing)
        else:
            low = max(passing)
            above = [r for r in failing if r > low]
            high = min(above) if above else ceiling
        mids = [round(low + (high - low) * f, -1) for f in (1 / 3, 2 / 3)]
        mids = [m for m in mids if m > 0 and m not in runs]
        for rate, summary in zip(
            mids, pool.map(run_one, [req(f"static:{m:g}") for m in mids]), strict=True
        ):
            runs[rate] = summary
    passing = [r for r, s in runs.items() if meets_every_window(s)]
    return runs[max(passing)] if passing else None


COLUMNS = (
    ("policy", "policy", "{}"),
    ("busy", "gpu_busy_frac", "{:.3f}"),
    ("ttft p95 s", "interactive.ttft_p95_s", "{:.3f}"),
    ("ttft p99 s", "interactive.ttft_p99_s", "{:.3f}"),
    ("itl p95 ms", "interactive.itl_p95_s*1000", "{:.1f}"),
    ("itl p99 ms", "interactive.itl_p99_s*1000", "{:.1f}"),
    ("success", "interactive.success_rate", "{:.4f}"),
    ("slo win", "interactive.slo_windows_met_frac", "{:.3f}"),
    ("batch tok/s", "batch.tokens_per_s", "{:.0f}"),
    ("recomp", "batch.recomputed_tokens_frac", "{:.3f}"),
    ("preempt", "batch.preemptions", "{}"),
    ("x realtime", "speed", "{:.0f}"),
)


def _field(row: dict[str, object], path: str) -> object:
    scale = 1.0
    if "*" in path:
        path, factor = path.split("*")
        scale = float(factor)
    value: object = row
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    if isinstance(value, int | float) and not isinstance(value, bool) and scale != 1.0:
        return value * scale
    return value


def format_table(rows: Sequence[dict[str, object]], *, speed: bool = True) -> str:
    """The rows as a Markdown table (the bench's printout and the README's table); without
    `speed` the wall-clock column is left out, so the table is the same on every run."""
    columns = COLUMNS if speed else tuple(c for c in COLUMNS if c[1] != "speed")
    head = [c[0] for c in columns]
    body = []
    for row in rows:
        cells = []
        for _, path, fmt in columns:
            v = _field(row, path)
            if path == "policy" and row.get("enforcement") == ENGINE:
                v = f"{v} [engine]"
            if v is None or (isinstance(v, float) and math.isnan(v)):
                cells.append("-")
            else:
                cells.append(fmt.format(v))
        body.append(cells)
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(cells) + " |" for cells in body]
    return "\n".join(lines)


GROUP_COLUMNS = (
    ("ttft p95 s", "ttft_p95_s", "{:.3f}", 1.0),
    ("ttft p99 s", "ttft_p99_s", "{:.3f}", 1.0),
    ("itl p95 ms", "itl_p95_s", "{:.1f}", 1000.0),
    ("itl p99 ms", "itl_p99_s", "{:.1f}", 1000.0),
    ("success", "success_rate", "{:.4f}", 1.0),
    ("slo win", "slo_windows_met_frac", "{:.3f}", 1.0),
    ("requests", "requests", "{}", 1.0),
)


def format_group_table(rows: Sequence[dict[str, object]]) -> str | None:
    """Interactive latency per replica group (batch-eligible replicas, the others) of each
    run as a Markdown table; None when no run restricts batch to some replicas."""
    lines = []
    for row in rows:
        for group in cast(list[dict[str, object]], row.get("replica_groups") or []):
            replicas = ",".join(str(r) for r in cast(list[int], group["replicas"]))
            cells = [str(row["policy"]), f"{group['group']} ({replicas})"]
            for _, key, fmt, scale in GROUP_COLUMNS:
                v = group.get(key)
                if not isinstance(v, int | float) or (isinstance(v, float) and math.isnan(v)):
                    cells.append("-")
                else:
                    cells.append(fmt.format(v * scale if scale != 1.0 else v))
            lines.append("| " + " | ".join(cells) + " |")
    if not lines:
        return None
    head = ["policy", "replicas", *(c[0] for c in GROUP_COLUMNS)]
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|",
                      *lines])


def plot(rows: Sequence[dict[str, object]], path: Path, slo_ttft_s: float,
         slo_itl_s: float) -> None:
    """Per-window p95 TTFT, p95 ITL, GPU busy fraction and batch tokens/s of each run, one
    panel each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(10, 11.5), sharex=True)
    for row in rows:
        wins = cast(list[dict[str, float]], row["windows"])
        t = [w["start_s"] / 60 for w in wins]
        label = str(row["policy"])
        axes[0].plot(t, [w["ttft_p95_s"] for w in wins], label=label)
        axes[1].plot(t, [(w["itl_p95_s"] or 0) * 1000 for w in wins], label=label)
        axes[2].plot(t, [w["gpu_busy_frac"] for w in wins], label=label)
        axes[3].plot(t, [w["batch_tokens_per_s"] / 1000 for w in wins], label=label)
    axes[0].axhline(slo_ttft_s, color="k", ls="--", lw=0.8)
    axes[0].set_yscale("log")
    axes[0].set_ylabel("p95 TTFT (s)")
    axes[1].axhline(slo_itl_s * 1000, color="k", ls="--", lw=0.8)
    axes[1].set_ylabel("p95 ITL (ms)")
    axes[2].set_ylabel("GPU busy fraction")
    axes[3].set_ylabel("batch tokens/s (k)")
    axes[3].set_xlabel("time (min), 60 s windows")
    axes[0].legend(fontsize=8, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
