"""The `borrowd` command: one subcommand module per job, each with `register(subparsers)`.

A `BorrowdError` from any subcommand, and an `OSError` (a busy port, an unreadable file),
becomes one line naming the problem, with secrets redacted, and exit code 2. Logging (secrets
redacted too) is set up once for every subcommand (`controller.cli.logs`).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import NoReturn

from borrowd.adapters.redact import redact
from borrowd.controller.cli.logs import configure_logging
from borrowd.models.errors import BorrowdError

# Each module defines `register(subparsers: argparse._SubParsersAction) -> None`, adding one
# or more subcommands whose parsers set `func(args) -> int`.
COMMAND_MODULES: tuple[str, ...] = (
    "borrowd.controller.cli.sim",
    "borrowd.controller.cli.scenario",
    "borrowd.controller.cli.profile",
    "borrowd.controller.cli.ops",
    "borrowd.controller.cli.daemon",
    "borrowd.controller.cli.loadgen",
    "borrowd.controller.cli.serve",
    "borrowd.controller.cli.control",
    "borrowd.controller.cli.batch",
    "borrowd.controller.cli.report",
    "borrowd.controller.cli.drill",
    "borrowd.controller.cli.rollout",
)


class OneLineParser(argparse.ArgumentParser):
    """argparse, with a bad flag reported on one line (exit 2) instead of usage + error."""

    def error(self, message: str) -> NoReturn:
        """Print `PROG: error: MESSAGE (see PROG --help)` and exit 2."""
        self.exit(2, f"{self.prog}: error: {redact(message)} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand registered."""
    parser = OneLineParser(
        prog="borrowd",
        description="Lend an interactive LLM fleet's idle GPU time to batch work, safely.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `borrowd` console script."""
    configure_logging()
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except BorrowdError as exc:
        return _fail(str(exc))
    except OSError as exc:  # start-up failures of the operator's making: busy port, bad path
        return _fail(_os_error_line(exc))
    except KeyboardInterrupt:
        return 130


def _os_error_line(exc: OSError) -> str:
    if exc.filename is not None:
        return f"{exc.filename}: {exc.strerror or exc}"
    return str(exc)


def _fail(message: str) -> int:
    print(f"borrowd: error: {redact(message)}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
