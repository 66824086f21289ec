"""`borrowd loadgen`: replay trace-shaped interactive chat and a batch backlog at a proxy."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from borrowd.adapters.loadgen import LoadgenConfig, failures, parse_burst, run_load, summarize
from borrowd.models.errors import InputError
from borrowd.models.sim.trace import load_lengths, load_trace, resolve_trace


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `loadgen` subcommand."""
    parser = subparsers.add_parser(
        "loadgen", help="send trace-replayed interactive chat plus a batch backlog to a proxy",
        description="Interactive arrivals from a chat trace (rate-scaled, optional burst), "
        "streamed with client-side TTFT; batch workers keep a backlog, retrying after 429. "
        "Checks first that the proxy answers, takes both keys and serves --model (exit 2 "
        "naming the flag otherwise). Prints a strict JSON summary with errors counted by "
        "HTTP status; --out writes one JSON line per request. Exit 1 when every request of "
        "a class failed.",
    )
    parser.add_argument("--proxy", required=True, metavar="URL", help="proxy base URL")
    parser.add_argument("--interactive-key", required=True, help="API key of an interactive tenant")
    parser.add_argument("--batch-key", required=True, help="API key of a batch tenant")
    parser.add_argument("--model", default=LoadgenConfig.model, help="model name to request")
    parser.add_argument("--duration-s", type=float, default=LoadgenConfig.duration_s,
                        help="run length, s")
    parser.add_argument("--rate-scale", type=float, default=LoadgenConfig.rate_scale,
                        help="trace seconds per wall second (interactive rate multiplier)")
    parser.add_argument("--burst", type=_burst, default=None, metavar="START:END:MULT",
                        help="interactive rate times MULT between START and END s")
    parser.add_argument("--interactive-max-output-tokens", type=int,
                        default=LoadgenConfig.interactive_max_output_tokens,
                        help="clip of the trace's output lengths")
    parser.add_argument("--batch-workers", type=int, default=LoadgenConfig.batch_workers,
                        help="concurrent batch clients (the backlog)")
    parser.add_argument("--batch-prompt-scale", type=float,
                        default=LoadgenConfig.batch_prompt_scale,
                        help="multiplier of the summarization prompt lengths")
    parser.add_argument("--batch-max-output-tokens", type=int,
                        default=LoadgenConfig.batch_max_output_tokens,
                        help="clip of the batch output lengths")
    parser.add_argument("--trace", default="azure2023_conv.csv", help="interactive trace")
    parser.add_argument("--lengths", default="arxiv_summarization_lengths.csv",
                        help="batch length pool")
    parser.add_argument("--out", type=Path, default=None, help="JSON lines, one per request")
    parser.set_defaults(func=_run)


def _burst(text: str) -> tuple[float, float, float]:
    try:
        return parse_burst(text)
    except InputError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--burst ")) from None


def _run(args: argparse.Namespace) -> int:
    config = LoadgenConfig(
        proxy_url=args.proxy.rstrip("/"), interactive_key=args.interactive_key,
        batch_key=args.batch_key, model=args.model, duration_s=args.duration_s,
        rate_scale=args.rate_scale, burst=args.burst,
        interactive_max_output_tokens=args.interactive_max_output_tokens,
        batch_workers=args.batch_workers, batch_prompt_scale=args.batch_prompt_scale,
        batch_max_output_tokens=args.batch_max_output_tokens,
    )
    trace = load_trace(resolve_trace(args.trace))
    lengths = load_lengths(resolve_trace(args.lengths))
    records = asyncio.run(run_load(config, trace, lengths))
    if args.out is not None:
        args.out.write_text("".join(record.to_json() + "\n" for record in records))
    summary = summarize(records)
    print(json.dumps(summary, sort_keys=True, allow_nan=False))
    problems = failures(summary)
    for problem in problems:
        print(f"borrowd loadgen: {problem}", file=sys.stderr)
    return 1 if problems else 0
