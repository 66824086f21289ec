"""`borrowd proxy` and `borrowd emulate`: the vLLM-side servers.

`proxy --config FILE` runs the OpenAI-compatible budget proxy; `emulate --listen HOST:PORT`
runs the simulator's engine in real time behind an OpenAI-compatible server. Both run on
uvloop (about half the per-chunk CPU of the default loop) and stop on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

import uvloop
from borrowd.adapters.emulator.app import EmulatorConfig, EmulatorServer
from borrowd.adapters.emulator.app import serve as serve_emulator
from borrowd.adapters.proxy.app import ProxyServer
from borrowd.adapters.proxy.app import serve as serve_proxy
from borrowd.adapters.proxy.config import describe_fields, load_config
from borrowd.models.errors import InputError
from borrowd.models.sim.engine import POLICIES
from borrowd.models.sim.profiles import DEFAULT_PROFILE, PROFILES, get_profile


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `proxy` and `emulate` subcommands."""
    keys = "\n".join(f"  {key}: {text}" for key, text in describe_fields())
    proxy = subparsers.add_parser(
        "proxy", help="run the OpenAI-compatible budget proxy in front of vLLM",
        description="Run the borrowd proxy. Config keys (TOML):\n" + keys,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    proxy.add_argument("--config", required=True, help="proxy TOML file (examples/proxy.toml)")
    proxy.set_defaults(func=run_proxy)

    emulate = subparsers.add_parser(
        "emulate", help="run the engine simulator in real time as an OpenAI-compatible server",
    )
    emulate.add_argument("--listen", default="127.0.0.1:8100", help="HOST:PORT to listen on")
    emulate.add_argument("--profile", default=DEFAULT_PROFILE,
                         help=f"step-time profile ({', '.join(sorted(PROFILES))})")
    emulate.add_argument("--model-name", default=EmulatorConfig.model_name,
                         help="served model name (vLLM --served-model-name)")
    emulate.add_argument("--engine-index", type=int, default=0, help="`engine` metric label")
    emulate.add_argument("--time-scale", type=float, default=1.0,
                         help="wall seconds per simulated second (0.1 = ten times faster)")
    emulate.add_argument("--max-num-seqs", type=int, default=256, help="vLLM --max-num-seqs")
    emulate.add_argument("--max-num-batched-tokens", type=int, default=8192,
                         help="vLLM --max-num-batched-tokens (tokens per step)")
    emulate.add_argument("--long-prefill-token-threshold", type=int, default=0,
                         help="vLLM --long-prefill-token-threshold (0 = off)")
    emulate.add_argument("--kv-capacity-tokens", type=int, default=None,
                         help="KV cache size in tokens (default: the profile's)")
    emulate.add_argument("--policy", choices=POLICIES, default="priority",
                         help="vLLM --scheduling-policy")
    emulate.add_argument("--max-model-len", type=int, default=131072,
                         help="vLLM --max-model-len, tokens")
    emulate.add_argument("--default-max-tokens", type=int, default=256,
                         help="output tokens of a request without max_tokens")
    emulate.add_argument("--slo-itl-s", type=float, action="append", default=[],
                         metavar="SECONDS",
                         help="the pool's p95 ITL SLO (repeatable): a bound of the interference "
                         "histogram, where the daemon reads the burn (vLLM's hold 50 ms)")
    emulate.set_defaults(func=run_emulate)


def parse_listen(text: str) -> tuple[str, int]:
    """HOST:PORT -> (host, port); `InputError` naming the argument when malformed."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InputError(f"--listen must be HOST:PORT, got {text!r}")
    return host, int(port)


async def _until_signalled() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def run_proxy(args: argparse.Namespace) -> int:
    """`borrowd proxy --config FILE`."""
    from borrowd.adapters.gate import AsyncGate
    from borrowd.adapters.redis_conn import connect_async, redact_url, resolve_redis_url

    config = load_config(args.config)
    url = resolve_redis_url(config.redis_url)

    async def main() -> None:
        client = connect_async(url)
        gate = AsyncGate(client, config.pool, lease_ms=config.admission.lease_ms,
                         batch_priority=config.batch_priority)
        runner = await serve_proxy(ProxyServer(config, gate), config.listen_host,
                                   config.listen_port)
        logging.info("borrowd proxy on %s:%d, pool %s, upstreams %s, budget store %s",
                     config.listen_host, config.listen_port, config.pool,
                     ", ".join(config.upstreams), redact_url(url))
        try:
            await _until_signalled()
        finally:
            await runner.cleanup()
            await client.aclose()

    uvloop.run(main())
    return 0


def run_emulate(args: argparse.Namespace) -> int:
    """`borrowd emulate --listen HOST:PORT --profile NAME ...`."""
    host, port = parse_listen(args.listen)
    get_profile(args.profile)
    config = EmulatorConfig(
        profile=args.profile, model_name=args.model_name, engine_index=args.engine_index,
        time_scale=args.time_scale, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        kv_capacity_tokens=args.kv_capacity_tokens, policy=args.policy,
        max_model_len=args.max_model_len, default_max_tokens=args.default_max_tokens,
        slo_itl_s=tuple(args.slo_itl_s),
    )
    server = EmulatorServer(config)

    async def main() -> None:
        runner = await serve_emulator(server, host, port)
        logging.info("borrowd emulate on %s:%d: model %s, profile %s, time scale %g",
                     host, port, config.model_name, config.profile, config.time_scale)
        try:
            await _until_signalled()
        finally:
            await runner.cleanup()

    uvloop.run(main())
    return 0
