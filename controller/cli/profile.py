"""`borrowd profile fit|list`: step-time profiles of the simulator as data files."""

from __future__ import annotations

import argparse
from pathlib import Path

from borrowd.models.sim.profile_fit import GPUS, fit_file, profile_toml
from borrowd.models.sim.profiles import PROFILES, PROFILES_DIR, get_profile


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `profile` subcommand group."""
    parser = subparsers.add_parser("profile", help="simulator step-time profiles")
    sub = parser.add_subparsers(dest="profile_cmd", required=True)
    fit = sub.add_parser(
        "fit", help="fit a profile from measured operator or step times; print its "
                    "error on held-out rows")
    fit.add_argument("measurements", type=Path,
                     help="Vidur operator CSV (mlp.csv, .gz too) or num_tokens,step_s CSV")
    fit.add_argument("--name", help="profile name (default: the file's stem)")
    fit.add_argument("--gpu", choices=sorted(GPUS), help="GPU of an operator table")
    fit.add_argument("--layers", type=int, help="transformer layers (operator tables)")
    fit.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default 1)")
    fit.add_argument("--all-reduce", type=Path,
                     help="Vidur all_reduce.csv (default: the packaged one of --gpu)")
    fit.add_argument("--like", help="profile whose attention terms a plain step-time fit "
                                    "takes (default h100-llama3-8b)")
    fit.add_argument("--out", type=Path, help="write the profile TOML here (else stdout)")
    fit.set_defaults(func=cmd_fit)
    listing = sub.add_parser("list", help="the built-in profiles")
    listing.set_defaults(func=cmd_list)


def cmd_fit(args: argparse.Namespace) -> int:
    """Fit, print the held-out error, write the profile."""
    name = args.name or args.measurements.name.split(".")[0]
    like = get_profile(args.like or "h100-llama3-8b")
    profile, report = fit_file(args.measurements, name=name, gpu=args.gpu, layers=args.layers,
                               tp=args.tp, all_reduce_path=args.all_reduce, like=like)
    summary = (f"{name}: fitted on {report.train_rows} rows; held-out {report.held_out_rows} "
               f"rows: median abs error {report.median_abs_err:.1%}, worst "
               f"{report.worst_abs_err:.1%} (at {report.worst_at_tokens} tokens)")
    text = profile_toml(profile, report, profile.source)
    if args.out:
        args.out.write_text(text)
        print(f"{summary}; written to {args.out}")
    else:
        print(f"# {summary}")
        print(text, end="")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    """Print the built-in profiles with their step time at 1 and 8192 tokens."""
    for name, prof in sorted(PROFILES.items()):
        print(f"{name}\t{prof.step_s(1, 0, 0) * 1000:.1f} ms at 1 token, "
              f"{prof.step_s(8192, 0, 0) * 1000:.0f} ms at 8192, KV "
              f"{prof.kv_capacity_tokens} tokens\t{PROFILES_DIR / (name + '.toml')}")
    return 0
