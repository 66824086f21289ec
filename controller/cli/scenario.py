"""`borrowd scenario example|check|list`: the simulator's scenario files."""

from __future__ import annotations

import argparse

from borrowd.models.sim.scenario import builtin_scenarios, example_text, load_scenario_file


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `scenario` subcommand group."""
    parser = subparsers.add_parser("scenario", help="simulator scenario files")
    sub = parser.add_subparsers(dest="scenario_cmd", required=True)
    example = sub.add_parser("example", help="print a commented scenario template (seed)")
    example.set_defaults(func=cmd_example)
    check = sub.add_parser("check", help="validate a scenario file (exit 2 naming the key)")
    check.add_argument("path", help="scenario TOML file")
    check.set_defaults(func=cmd_check)
    listing = sub.add_parser("list", help="the built-in scenarios and their files")
    listing.set_defaults(func=cmd_list)


def cmd_example(args: argparse.Namespace) -> int:
    """Print the commented template."""
    print(example_text(), end="")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    """Load a scenario file; say what it sets up."""
    sc = load_scenario_file(args.path)
    print(f"{args.path}: scenario {sc.name}, {sc.replicas} x {sc.profile}, SLO p95 TTFT "
          f"{sc.slo.ttft_p95_s:g} s, p95 ITL {sc.slo.itl_p95_s * 1000:g} ms, trace "
          f"{sc.interactive_trace} at load {sc.interactive_load:g}")
    if sc.jobs is not None:
        items = sum(job.items for job in sc.jobs.jobs)
        weights = ", ".join(f"{name} {weight:g}" for name, weight in sc.jobs.tenants)
        print(f"batch: {len(sc.jobs.jobs)} jobs, {items} items, tenant weights {weights}")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    """Print each built-in scenario's name and file."""
    for name, path in builtin_scenarios().items():
        print(f"{name}\t{path}")
    return 0
