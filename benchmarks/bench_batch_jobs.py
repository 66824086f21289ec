"""Batch jobs under faults, and fair shares: prints the figures the issue is judged by.

Part 1: a chat-completions job (default 1,000 items) submitted with the unmodified openai
SDK to `borrowd batch serve`, run by two `borrowd batch worker` processes through
`borrowd proxy` in front of two `borrowd emulate` replicas, while the budget is cut to zero
twice (the stop switch, then an open budget again) and one worker is SIGKILLed. Printed:
custom_ids seen once / missing / duplicated, generated tokens as the engines counted them
(`vllm:generation_tokens_total`) against the tokens in the results (the difference is
redone work), revocations, resumes, reclaimed items, wall time, items per hour, cost per item.

Part 2: two tenants with weights 2:1, items of different sizes and full backlogs through
three workers (picking and charging in one Redis script, `schedule.dispatch`); the ratio of
the tokens carried for each (prompt as the engines counted it + output kept) while both are
backlogged.

Every process is real, on free loopback ports; nothing here needs a GPU.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import openai

from tests.support.batch_stack import (
    BatchStack,
    batch_stack,
    chat_lines,
    result_ids,
    wait_terminal,
)

_GENERATED = re.compile(r"^vllm:generation_tokens_total\{[^}]*\} ([0-9.e+]+)$", re.M)


def _engine_generated(stack: BatchStack) -> int:
    total = 0.0
    for emulator in stack.emulators:
        with urllib.request.urlopen(f"http://127.0.0.1:{emulator.port}/metrics") as resp:
            total += sum(float(v) for v in _GENERATED.findall(resp.read().decode()))
    return int(total)


def _submit(client: openai.OpenAI, data: bytes) -> str:
    uploaded = client.files.create(file=("input.jsonl", data), purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                 completion_window="24h").id


def _completed(client: openai.OpenAI, batch_id: str) -> int:
    return client.batches.retrieve(batch_id).request_counts.completed


def _wait_completed(client: openai.OpenAI, batch_id: str, count: int) -> None:
    while _completed(client, batch_id) < count:
        time.sleep(0.1)


def _lines(client: openai.OpenAI, file_id: str | None) -> list[str]:
    if not file_id:
        return []
    return [x for x in client.files.content(file_id).text.split("\n") if x.strip()]


def faults(workdir: Path, items: int, max_tokens: int, concurrency: int,
           time_scale: float) -> None:
    """Part 1: one job, two workers, two budget cuts, one worker SIGKILLed."""
    with batch_stack(workdir, replicas=2, time_scale=time_scale,
                     worker_overrides={"checkpoint_tokens": 16, "claim_idle_s": 3.0,
                                       "heartbeat_s": 1.0}) as stack:
        client = openai.OpenAI(base_url=stack.api_url, api_key="sk-etl", max_retries=2)
        workers = [stack.start_worker(f"w{i}", concurrency) for i in range(2)]
        started_s = time.monotonic()
        batch_id = _submit(client, chat_lines(items, max_tokens))
        events = []
        for fraction, action in ((0.2, "cut"), (0.45, "kill"), (0.6, "cut")):
            _wait_completed(client, batch_id, int(items * fraction))
            at_s = time.monotonic() - started_s
            if action == "cut":
                stack.cut_budget()
                time.sleep(1.5)
                stack.restore_budget()
                events.append(f"budget cut to zero for 1.5 s at {at_s:.1f} s")
            else:
                workers[0].kill()
                events.append(f"worker w0 SIGKILLed at {at_s:.1f} s")
        batch = wait_terminal(client, batch_id, 1800)
        wall_s = time.monotonic() - started_s
        outputs = [json.loads(x) for x in _lines(client, batch.output_file_id)]
        errors = [json.loads(x) for x in _lines(client, batch.error_file_id)]
        ids = result_ids([json.dumps(x) for x in outputs + errors])
        expected = {f"item-{i}" for i in range(items)}
        kept = sum(x["response"]["body"]["usage"]["completion_tokens"] for x in outputs)
        whole = sum(x["response"]["body"]["usage"]["completion_tokens"] == max_tokens
                    for x in outputs)
        generated = _engine_generated(stack)
        figures = batch.model_extra["borrowd"]
    print(f"## Part 1: {items} chat items x {max_tokens} tokens, 2 workers x {concurrency} "
          f"slots, proxy + 2 emulated replicas (time scale {time_scale})")
    for event in events:
        print(f"- {event}")
    print(f"status {batch.status}: {len(outputs)} output lines, {len(errors)} error lines; "
          f"custom_ids once {len(set(ids) & expected)}/{items}, missing "
          f"{len(expected - set(ids))}, duplicated {len(ids) - len(set(ids))}; "
          f"responses of exactly max_tokens: {whole}/{len(outputs)}")
    print(f"engine-generated tokens {generated}, tokens in results {kept}, redone "
          f"{generated - kept} ({100 * (generated - kept) / max(1, generated):.2f}% of "
          f"generated); redone as the job's figures bound it: "
          f"{figures['redone_tokens']}..{figures['redone_tokens_max']}")
    print(f"revocations {figures['revocations']}, resumes {figures['resumes']} (re-prefilled "
          f"{figures['reprefill_tokens']} tokens), reclaimed {figures['reclaimed']}, 429s "
          f"{figures['rate_limited']}")
    print(f"wall {wall_s:.1f} s, {figures['items_per_hour']:.0f} items/h, "
          f"{figures['tokens_per_s']:.0f} tokens/s, cost per item "
          f"{figures['cost_per_item']:.3g} (price per GPU-hour 2.0, GPU-s {figures['gpu_s']})")


def fair_share(workdir: Path, items: int, concurrency: int, time_scale: float) -> None:
    """Part 2: tenants gold (weight 2, items of 64 output tokens) and silver (weight 1, 128),
    full backlogs, three workers."""
    tenants = {"gold": ("sk-gold", 2.0), "silver": ("sk-silver", 1.0)}
    sizes = {"gold": 64, "silver": 128}
    with batch_stack(workdir, replicas=2, time_scale=time_scale, tenants=tenants) as stack:
        clients = {name: openai.OpenAI(base_url=stack.api_url, api_key=key, max_retries=2)
                   for name, (key, _w) in tenants.items()}
        jobs = {name: _submit(clients[name], chat_lines(items, sizes[name], name))
                for name in tenants}
        for index in range(3):
            stack.start_worker(f"fair{index}", concurrency)
        redis_client = stack.redis_client()

        def counter(field: str) -> dict[str, int]:
            return {n: int(redis_client.hget(f"borrowd:batch:tenant:{n}", field) or 0)
                    for n in tenants}

        def carried() -> dict[str, int]:
            prompts, kept = counter("prompt_tokens"), counter("kept_tokens")
            return {n: prompts[n] + kept[n] for n in tenants}

        def done(name: str) -> int:
            return _completed(clients[name], jobs[name])

        while min(done("gold"), done("silver")) < items * 0.1:
            time.sleep(0.1)
        start, start_s = carried(), time.monotonic()
        while max(done("gold"), done("silver")) < items * 0.9:
            time.sleep(0.1)
        end, end_s = carried(), time.monotonic()
        redis_client.close()
    gained = {n: end[n] - start[n] for n in tenants}
    ratio = gained["gold"] / max(1, gained["silver"])
    print(f"## Part 2: tenants gold (weight 2, {items} items x {sizes['gold']} tokens) and "
          f"silver (weight 1, {items} items x {sizes['silver']} tokens), full backlogs, three "
          f"workers x {concurrency} slots")
    print(f"while both backlogged ({end_s - start_s:.1f} s): tokens carried (engine-counted "
          f"prompt + output kept) gold {gained['gold']}, silver {gained['silver']}; ratio "
          f"{ratio:.3f} (target 2.000, error {100 * abs(ratio / 2 - 1):.1f}%)")


def main() -> None:
    """Run both parts and print their figures."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--fair-items", type=int, default=600)
    parser.add_argument("--skip-faults", action="store_true")
    parser.add_argument("--skip-fair", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-batch-") as tmp:
        if not args.skip_faults:
            faults(Path(tmp) / "faults", args.items, args.max_tokens, args.concurrency,
                   args.time_scale)
        if not args.skip_fair:
            fair_share(Path(tmp) / "fair", args.fair_items, 8, args.time_scale)


if __name__ == "__main__":
    main()
