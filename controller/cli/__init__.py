"""The `borrowd` command: one subcommand module per job, each with `register(subparsers)`.

A `BorrowdError` from any subcommand becomes a one-line error and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from models.errors import BorrowdError

# Each module defines `register(subparsers: argparse._SubParsersAction) -> None`, adding one
# or more subcommands whose parsers set `func(args) -> int`.
COMMAND_MODULES: tuple[str, ...] = (
    "controller.cli.sim",
    "controller.cli.ops",
    "controller.cli.daemon",
    "controller.cli.loadgen",
    "controller.cli.serve",
    "controller.cli.control",
)


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="borrowd",
        description="Lend an interactive LLM fleet's idle GPU time to batch work, safely.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `borrowd` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except BorrowdError as exc:
        print(f"borrowd: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
