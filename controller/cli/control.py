"""`borrowd identify` and `borrowd tune`: fit the plant, then derive and check PI gains.

    borrowd identify --scenario seed --out plant.json
    borrowd identify --prometheus URL --pool P --start T0 --end T1 [--config borrowd.toml]
                     --out plant.json
    borrowd tune --plant plant.json [--method simc|imc] [--tc S] [--plot step.png]
                 [--write-config FILE]
"""

from __future__ import annotations

import argparse
import math
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from borrowd.adapters.redact import redact_url
from borrowd.controller.laws.registry import law_names
from borrowd.controller.policy import ControllerConfig
from borrowd.models.errors import InputError
from borrowd.models.plant.model import SIGNAL_BURN, FitCriteria, PlantModel, identify_plant

if TYPE_CHECKING:
    from borrowd.controller.tuning import LoopReport


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `identify` and `tune` subcommands."""
    ident = subparsers.add_parser(
        "identify",
        help="fit the plant (batch budget -> interactive p95s) from an experiment or history",
        description="Run a bounded PRBS experiment on the simulator, or fit from a recorded "
        "Prometheus range, and write the plant model as JSON. An unusable fit (wrong sign, "
        "too little excitation, poor fit) is refused with the reason.",
    )
    source = ident.add_mutually_exclusive_group(required=True)
    source.add_argument("--scenario", help="simulator scenario to excite (e.g. seed)")
    source.add_argument("--prometheus", metavar="URL", help="Prometheus base URL")
    ident.add_argument("--pool", help="pool to read from Prometheus")
    ident.add_argument("--start", help="range start: unix seconds or ISO 8601 (Prometheus)")
    ident.add_argument("--end", help="range end: unix seconds or ISO 8601 (Prometheus)")
    ident.add_argument("--step", type=float, default=1.0, help="sample period, s (default 1)")
    ident.add_argument("--config", type=Path, metavar="FILE",
                       help="the daemon's config (TOML): the pool's SLOs, burn settings, law "
                            "and rules window are read from it (Prometheus; default: built-in "
                            "defaults)")
    ident.add_argument("--law", choices=law_names(),
                       help="the law the plant is for, which decides the signal fitted: the "
                            "SLO burn (pi, slack, with control_on_burn) or p95/SLO (mpc) "
                            "(default: the --config pool's law, else pi)")
    ident.add_argument("--window", help="recording-rule window (default: the config's "
                                        "prometheus.window, else 15s)")
    ident.add_argument("--u-low", type=float, default=40_000.0, help="PRBS low budget, tokens/s")
    ident.add_argument("--u-high", type=float, default=80_000.0, help="PRBS high budget, tokens/s")
    ident.add_argument("--duration", type=float, default=900.0, help="experiment length, s")
    ident.add_argument("--hold", type=float, default=30.0, help="least PRBS hold, s")
    ident.add_argument("--seed", type=int, default=1, help="PRBS and simulator seed")
    ident.add_argument("--min-r2", type=float, default=FitCriteria().min_r2, help="least R^2")
    ident.add_argument("--out", type=Path, required=True, help="plant JSON to write")
    ident.set_defaults(func=run_identify)

    tune = subparsers.add_parser(
        "tune",
        help="PI gains from a plant (SIMC/IMC), margins and closed-loop step figures",
        description="Derive PI gains per output from a plant model, print gain and phase "
        "margins (python-control) and the closed-loop step's rise time, overshoot and "
        "settling time; optionally plot the steps and write the gains as a config table.",
    )
    tune.add_argument("--plant", type=Path, required=True, help="plant JSON from identify")
    tune.add_argument("--method", choices=("simc", "imc"), default="simc", help="tuning rule")
    tune.add_argument("--tc", type=float, default=0.0, help="closed-loop time constant, s")
    tune.add_argument("--tick", type=float, default=ControllerConfig().tick_s, help="tick, s")
    tune.add_argument("--plot", type=Path, help="write the closed-loop step plot (PNG)")
    tune.add_argument(
        "--write-config", type=Path, help="write the binding loop's gains as a TOML table"
    )
    tune.set_defaults(func=run_tune)


def parse_time_s(text: str | None, name: str) -> float:
    """Unix seconds from `text` (a number or ISO 8601); InputError naming `name` otherwise."""
    if text is None:
        raise InputError(f"--{name} is required with --prometheus")
    try:
        return float(text)
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise InputError(f"--{name} {text!r} is neither unix seconds nor ISO 8601") from None


def run_identify(args: argparse.Namespace) -> int:
    """Identify from the simulator or from Prometheus; write the plant."""
    criteria = FitCriteria(min_r2=args.min_r2)
    if args.scenario:
        from borrowd.controller.closed_loop import Experiment, identify_on_simulator
        from borrowd.models.sim.scenario import get_scenario

        experiment = Experiment(
            u_low_tokens_per_s=args.u_low,
            u_high_tokens_per_s=args.u_high,
            duration_s=args.duration,
            hold_s=args.hold,
            seed=args.seed,
            law=args.law or "pi",
        )
        plant = identify_on_simulator(get_scenario(args.scenario), experiment, criteria)
    else:
        plant = identify_from_prometheus(args, criteria)
    plant.save(args.out)
    print(f"plant written to {args.out} ({plant.source}; outputs: {plant.signal})")
    print(f"operating point: u0 {plant.u0_tokens_per_s:.0f} tokens/s, "
          f"interactive {plant.interactive_tokens_per_s:.0f} tokens/s")
    for out in plant.outputs:
        print(
            f"  {out.name:5s} gain {out.gain_per_token_s:.3e} per token/s  tau {out.tau_s:.1f} s  "
            f"dead {out.dead_s:.1f} s  y0 {out.y0:.3f}  NRMSE {out.nrmse:.2f}  R^2 {out.r2:.2f}  "
            f"ARX R^2 {out.arx_r2:.2f}"
        )
    for note in plant.unmodelled:
        print(f"  not modelled: {note}")
    return 0


def identify_from_prometheus(args: argparse.Namespace, criteria: FitCriteria) -> PlantModel:
    """Fit from the pool's recorded history, on the signal its law tracks (the SLO burn read
    at the pool's own SLOs, or p95/SLO), computed as the loop computes it (`tracked_series`)."""
    from borrowd.controller.identify import tracked_series, tracked_signal
    from borrowd.controller.prom_source import connect_prometheus, identification_history

    if not args.pool:
        raise InputError("--pool is required with --prometheus")
    start_s, end_s = parse_time_s(args.start, "start"), parse_time_s(args.end, "end")
    config, window = pool_controller(args.config, args.pool)
    if args.law:
        config = replace(config, law=args.law)
    window = args.window or window
    signal = tracked_signal(config)
    client = connect_prometheus(args.prometheus, 10.0)
    history = identification_history(
        client, args.pool, config.slo(), start_s=start_s, end_s=end_s, step_s=args.step,
        window=window, burn=signal == SIGNAL_BURN,
    )
    rates = np.array([o.interactive_tokens_per_s for o in history.observations])
    return identify_plant(
        history.budget_tokens_per_s,
        tracked_series(history.observations, config, args.step),
        args.step,
        interactive_tokens_per_s=float(np.nanmean(rates)),
        source=f"prometheus {redact_url(args.prometheus)} pool {args.pool} "
               f"{start_s:.0f}-{end_s:.0f}",
        criteria=criteria,
        signal=signal,
    )


def pool_controller(path: Path | None, pool: str) -> tuple[ControllerConfig, str]:
    """The controller config of `pool` in the daemon config at `path` and its rules window
    (no path: the defaults); InputError when the pool is not in the file."""
    from borrowd.controller.config import PrometheusConfig, load_config

    if path is None:
        return ControllerConfig(), PrometheusConfig().window
    loaded = load_config(path)
    return loaded.pool_named(pool).controller, loaded.prometheus.window


def run_tune(args: argparse.Namespace) -> int:
    """Print gains, margins and step figures per output; plot and write config on request."""
    from borrowd.controller.tuning import analyse_loop

    plant = PlantModel.load(args.plant)
    if args.tc < 0 or args.tick <= 0:
        raise InputError(f"--tc must be >= 0 and --tick > 0, got {args.tc}, {args.tick}")
    reports = [analyse_loop(plant, o.name, args.method, args.tc, args.tick) for o in plant.outputs]
    print(f"plant {args.plant}  method {args.method}  tc {args.tc or 'dead time'}  "
          f"tick {args.tick} s")
    header = (
        f"{'output':6s} {'kp tok/s/SLO':>13s} {'ki tok/s2/SLO':>14s} {'GM':>6s} {'PM deg':>7s} "
        f"{'rise s':>7s} {'overshoot %':>11s} {'settle s':>8s}"
    )
    print(header)
    for r in reports:
        print(
            f"{r.output:6s} {r.gains.kp:13.4g} {r.gains.ki_per_s:14.4g} {r.gain_margin:6.2f} "
            f"{r.phase_margin_deg:7.1f} {r.rise_time_s:7.2f} {r.overshoot_pct:11.1f} "
            f"{r.settling_time_s:8.1f}"
        )
    if args.plot:
        plot_steps(reports, args.plot)
        print(f"step plot written to {args.plot}")
    if args.write_config:
        binding = min(reports, key=lambda r: r.gains.kp)
        args.write_config.write_text(pi_table(binding, args.method, float(args.tc), args.plant))
        print(f"gains written to {args.write_config} (append it to the pool's [[pools]] "
              "table in borrowd.toml)")
    return 0


def pi_table(binding: LoopReport, method: str, tc_s: float, plant: Path) -> str:
    """The `[pools.controller.pi]` table borrowd.toml takes, for the pool whose [[pools]]
    entry it is appended to (TOML gives a sub-table to the array entry above it)."""
    return (
        f"# PI gains from `borrowd tune --plant {plant}` (the most cautious loop: "
        f"{binding.output}).\n"
        "# Append under the pool's [[pools]] table in borrowd.toml.\n"
        "[pools.controller.pi]\n"
        f'method = "{method}"\n'
        f"tc_s = {tc_s!r}\n"
        f"kp_tokens_per_s = {binding.gains.kp!r}\n"
        f"ki_tokens_per_s2 = {binding.gains.ki_per_s!r}\n"
    )


def step_plot_span_s(reports: list[LoopReport]) -> float:
    """Time shown by the step plot: 1.5 x the slowest loop's settling time (the rest is the
    settled line), or the whole simulated response when a loop does not settle in it."""
    end_s = max(float(r.step_t_s[-1]) for r in reports)
    settle_s = [r.settling_time_s for r in reports]
    if not all(math.isfinite(t) and t > 0 for t in settle_s):
        return end_s
    return min(end_s, 1.5 * max(settle_s))


def plot_steps(reports: list[LoopReport], path: Path) -> None:
    """Closed-loop unit steps of every output in one PNG, cut to `step_plot_span_s`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    span_s = step_plot_span_s(reports)
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in reports:
        shown = r.step_t_s <= span_s
        ax.plot(r.step_t_s[shown], r.step_y[shown],
                label=f"{r.output} (kp {r.gains.kp:.3g}, settles {r.settling_time_s:.0f} s)")
    ax.set_xlim(0.0, span_s)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("output / setpoint step")
    ax.set_title("closed-loop step response")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
