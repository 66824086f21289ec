"""The daemon's commands: `borrowd run --config FILE`, `borrowd config check FILE`, and
`borrowd config example` (the documented example config, generated from the fields)."""

from __future__ import annotations

import argparse
import signal
import threading

from controller import daemon
from controller.cli.logs import configure_logging
from controller.config import example_config, load_config
from controller.sdnotify import Notifier


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `run` and `config` subcommands."""
    run = subparsers.add_parser(
        "run", help="run the controller daemon (publishes budgets to Redis)",
        description="Tick every pool: read Prometheus, decide the batch budget, publish it to "
        "Redis while leader. SIGTERM stops cleanly and releases the leader lease.",
    )
    run.add_argument("--config", required=True, metavar="FILE", help="daemon config (TOML)")
    run.set_defaults(func=_run)

    config = subparsers.add_parser("config", help="check or print the daemon's configuration")
    actions = config.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    check = actions.add_parser(
        "check", help="validate a config file (and load its plant files); exit 2 on error"
    )
    check.add_argument("file", metavar="FILE", help="daemon config (TOML)")
    check.set_defaults(func=_check)
    example = actions.add_parser("example", help="print the documented example config")
    example.set_defaults(func=_example)


def _run(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    configure_logging(config.daemon.log_level)
    daemon.build_policies(config)  # plant files and law settings fail here, before Redis
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    daemon.run(config, stop, notifier=Notifier())
    return 0


def _check(args: argparse.Namespace) -> int:
    config = load_config(args.file)
    daemon.build_policies(config)
    pools = ", ".join(
        f"{pool.name} (law {pool.controller.law}, tick {pool.tick_s:g} s)" for pool in config.pools
    )
    print(f"{args.file}: ok; pools: {pools}")
    return 0


def _example(args: argparse.Namespace) -> int:
    print(example_config(), end="")
    return 0
