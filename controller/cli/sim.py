"""`borrowd sim` (one simulated run as JSON) and `borrowd bench` (policies side by side).

Closed-loop policies run the daemon's own per-pool loop against the simulated fleet, from
`--config FILE [--pool P]` (a daemon TOML, as `borrowd run` reads it) or else from the
defaults `borrowd config example` prints.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from borrowd.controller.closed_loop import SimControllers
from borrowd.controller.config import load_config
from borrowd.models.enforcement import ENFORCEMENTS
from borrowd.models.errors import InputError
from borrowd.models.sim.bench import format_group_table, format_table, plot, run_bench
from borrowd.models.sim.cores import DEFAULT_ENGINE, ENGINE_CORES
from borrowd.models.sim.jobs_figures import format_jobs_tables
from borrowd.models.sim.profiles import get_profile
from borrowd.models.sim.run import run_scenario, slo_json
from borrowd.models.sim.scenario import Scenario, get_scenario, with_slo


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `sim` and `bench` subcommands."""
    sim = subparsers.add_parser("sim", help="run the engine simulator on a scenario")
    _common(sim)
    sim.add_argument("--policy", required=True,
                     help="none | unrestricted | priority | static:R[:S] | pi | mpc | slack")
    sim.add_argument("--json", type=Path, help="write the run's figures to this file")
    sim.add_argument("--plant", type=Path, help="identified plant model (pi/mpc/slack)")
    sim.set_defaults(func=cmd_sim)

    bench = subparsers.add_parser("bench", help="compare batch policies on a scenario")
    _common(bench)
    bench.add_argument("--policies", nargs="+",
                       help="policies to compare (default: all available)")
    bench.add_argument("--no-sweep", action="store_true",
                       help="skip the sweep for the best static cap")
    bench.add_argument("--json", type=Path, help="write every run's figures to this file")
    bench.add_argument("--plot", type=Path, help="write a latency/utilization plot (PNG)")
    bench.add_argument("--plant", type=Path, help="identified plant model (pi/mpc/slack)")
    bench.add_argument("--workers", type=int, default=2, help="parallel runs (processes)")
    bench.add_argument("--no-speed", action="store_true",
                       help="leave the wall-clock speed column out of the table (the rest "
                            "is identical on every run and machine)")
    bench.set_defaults(func=cmd_bench)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, metavar="FILE",
                   help="daemon config (TOML): closed-loop policies run its pool as `borrowd "
                        "run` would (default: the `borrowd config example` settings)")
    p.add_argument("--pool", help="pool of --config to run (needed when it has several)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="settings",
                   help="a controller setting over the config's (keys under the pool's "
                        "`controller` table, e.g. pi.kp_tokens_per_s=12000; repeatable)")
    p.add_argument("--scenario", default="seed",
                   help="built-in scenario (seed, seed-failure) or a scenario TOML file "
                        "(`borrowd scenario example` prints a template)")
    p.add_argument("--slo-ttft-p95-s", type=float,
                   help="interactive p95 TTFT SLO in seconds (default: the scenario's)")
    p.add_argument("--slo-itl-p95-s", type=float,
                   help="interactive p95 inter-token latency SLO in seconds "
                        "(default: the scenario's)")
    p.add_argument("--duration", type=float, default=3600.0, help="simulated seconds")
    p.add_argument("--seed", type=int, default=0, help="random seed (batch draws)")
    p.add_argument("--interactive-trace", help="trace file (Azure CSV or JSONL)")
    p.add_argument("--interactive-load", type=float,
                   help="GPU busy fraction of interactive work alone (default 0.40)")
    p.add_argument("--profile", help="step-time profile (h100-llama3-8b, a100-llama3-8b)")
    p.add_argument("--enforcement",
                   help=f"how the batch budget is enforced ({' | '.join(ENFORCEMENTS)}): "
                        "the admission gate, or the gate plus the engine plugin's per-step "
                        "batch token limit (default: the scenario's)")
    p.add_argument("--no-interference-series", action="store_true",
                   help="the engines export no interference series (bare vLLM behind the gate "
                        "and the proxy): the daemon reads no batch share of the burns")
    p.add_argument("--engine", default=DEFAULT_ENGINE,
                   help=f"engine core ({', '.join(sorted(ENGINE_CORES))})")


def _scenario(args: argparse.Namespace) -> Scenario:
    if not args.duration > 0:
        raise InputError(f"--duration must be > 0 seconds, got {args.duration:g}")
    scenario = with_slo(get_scenario(args.scenario), args.slo_ttft_p95_s, args.slo_itl_p95_s)
    changes: dict[str, object] = {}
    if args.enforcement is not None:
        if args.enforcement not in ENFORCEMENTS:
            raise InputError(f"--enforcement must be one of {', '.join(ENFORCEMENTS)}, "
                             f"got {args.enforcement!r}")
        changes["enforcement"] = args.enforcement
    if args.no_interference_series:
        changes["interference_series"] = False
    if args.profile:
        get_profile(args.profile)
        changes["profile"] = args.profile
    if args.interactive_load is not None:
        changes["interactive_load"] = args.interactive_load
    if args.interactive_trace:
        if not Path(args.interactive_trace).is_file():
            raise InputError(f"interactive trace {args.interactive_trace} does not exist")
        changes["interactive_trace"] = args.interactive_trace
    return scenario.with_overrides(**changes) if changes else scenario


def _controllers(args: argparse.Namespace) -> SimControllers:
    """The closed-loop policies: the pool of `--config`, or the built-in defaults."""
    settings = tuple(args.settings)
    if args.config is None:
        if args.pool is not None:
            raise InputError("--pool needs --config (the daemon config the pool is in)")
        controllers = SimControllers(settings=settings)
    else:
        controllers = SimControllers(load_config(args.config), args.pool, settings)
    if settings:  # a bad key or value fails here, before any run
        controllers.pool_config("pi", _scenario(args))
    return controllers


def cmd_sim(args: argparse.Namespace) -> int:
    """Run one scenario under one policy; print a summary, write JSON if asked."""
    scenario = _scenario(args)
    result = run_scenario(
        scenario,
        args.policy,
        duration_s=args.duration,
        seed=args.seed,
        trace_path=args.interactive_trace,
        engine=args.engine,
        plant_path=args.plant,
        controllers=_controllers(args),
    )
    summary = result.summary()
    summary["slo"] = slo_json(scenario)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    print(format_table([summary]))
    _print_jobs([summary])
    _print_groups([summary])
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """Run the policy comparison; print the table, write JSON and a plot if asked."""
    scenario = _scenario(args)
    if args.workers <= 0:
        raise InputError(f"--workers must be > 0, got {args.workers}")
    report = run_bench(
        scenario,
        duration_s=args.duration,
        seed=args.seed,
        policies=args.policies,
        sweep=not args.no_sweep,
        trace_path=args.interactive_trace,
        engine=args.engine,
        plant_path=str(args.plant) if args.plant else None,
        workers=args.workers,
        controllers=_controllers(args),
    )
    print(
        f"scenario {scenario.name}, {args.duration:g} s simulated, interactive rate scale "
        f"{report['interactive_rate_scale']:.6g} (load {scenario.interactive_load:g}), SLO "
        f"p95 TTFT {scenario.slo.ttft_p95_s:g} s, p95 ITL {scenario.slo.itl_p95_s * 1000:g} ms, "
        f"success {scenario.slo.success_rate:g}"
    )
    print(format_table(report["rows"], speed=not args.no_speed))  # type: ignore[arg-type]
    _print_jobs(report["rows"])  # type: ignore[arg-type]
    _print_groups(report["rows"])  # type: ignore[arg-type]
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    if args.plot:
        plot(report["rows"], args.plot, scenario.slo.ttft_p95_s,  # type: ignore[arg-type]
             scenario.slo.itl_p95_s)
    return 0


def _print_groups(rows: list[dict[str, object]]) -> None:
    """Interactive latency per replica group, when the scenario restricts batch."""
    table = format_group_table(rows)
    if table is not None:
        print("\ninteractive latency per replica group (batch-eligible replicas, the others):")
        print(table)


def _print_jobs(rows: list[dict[str, object]]) -> None:
    """Each run's batch jobs and tenants, when the scenario has jobs."""
    for row in rows:
        jobs = row.get("jobs")
        if isinstance(jobs, dict):
            print()
            print(format_jobs_tables(str(row["policy"]), jobs))
