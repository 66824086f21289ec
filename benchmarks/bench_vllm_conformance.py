"""Agreement of the native engine with vLLM's real V1 scheduler, the speed of each engine
core, and the engine plugin's effect on interactive TTFT. Needs the optional vLLM extra.

    python3 benchmarks/bench_vllm_conformance.py [--seeds 1 2 3] [--duration-s 120]

1. Agreement: the same mixed stream through both engines step by step (docs/conformance.md).
2. Speed: one replica (H100 profile) under Poisson interactive load and a backlog of 32k-token
   batch prompts, simulated seconds per wall second and microseconds per step, per core.
3. Plugin: that run with plain vLLM (priority policy) against vLLM with `BorrowdScheduler`
   holding batch to a budget: interactive TTFT percentiles and batch tokens per second.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from borrowd.adapters.engine_budget import PluginConfig, StaticBudgetSource
from borrowd.models.budget import Budget, Mode
from borrowd.models.sim.engine import Engine, EngineConfig
from borrowd.models.sim.profiles import H100_LLAMA3_8B
from borrowd.models.sim.request import BATCH, INTERACTIVE, Request
from borrowd.models.sim.vllm_core import VllmEngine, require_vllm

from tests.support import vllm_harness as h

CASES: dict[str, dict[str, Any]] = {
    "priority-whole": {},
    "fcfs-whole": {"policy": "fcfs"},
    "priority-chunk2048": {"long_prefill_token_threshold": 2048},
    "fcfs-chunk512-kv": {"long_prefill_token_threshold": 512, "policy": "fcfs",
                         "num_gpu_blocks": 2200},
    "priority-chunk1024-kv": {"long_prefill_token_threshold": 1024, "num_gpu_blocks": 2120},
}


def agreement(seeds: list[int]) -> None:
    """Print one row of agreement figures per (case, seed)."""
    print("== agreement: native engine vs vLLM 0.33 Scheduler, same stream, step by step")
    print(f"{'case':24} {'seed':>4} {'steps n/v':>11} {'step=':>6} {'tokens=':>7} "
          f"{'1st diff':>8} {'order':>5} {'preempt n/v':>11} {'victims':>7}")
    exact = total = 0
    for name, overrides in CASES.items():
        config = h.engine_config(**overrides)
        for seed in seeds:
            stream = h.mixed_stream(seed, n_interactive=40, n_batch=8, span_steps=200)
            a = h.compare_traces(h.run_lockstep(h.native_engine(config), stream),
                                 h.run_lockstep(h.vllm_engine(config), stream))
            total += 1
            exact += a.first_divergence is None and a.same_victims and a.same_completion_order
            print(f"{name:24} {seed:>4} {a.steps[0]:>5}/{a.steps[1]:<5} "
                  f"{a.step_match_frac:>6.3f} {a.token_agreement:>7.3f} "
                  f"{a.first_divergence if a.first_divergence is not None else '-':>8} "
                  f"{'same' if a.same_completion_order else 'diff':>5} "
                  f"{a.preemptions[0]:>5}/{a.preemptions[1]:<5} "
                  f"{'same' if a.same_victims else 'diff':>7}")
    print(f"exact agreement in {exact} of {total} cases")


def _interactive_arrivals(seed: int, rate_per_s: float, duration_s: float) -> list[Request]:
    rng = random.Random(seed)
    out, t_s, i = [], 0.0, 0
    while True:
        t_s += rng.expovariate(rate_per_s)
        if t_s >= duration_s:
            return out
        out.append(Request(f"i{i}", INTERACTIVE, rng.randint(200, 3000), rng.randint(50, 300),
                           arrival_s=t_s, priority=h.INTERACTIVE_PRIORITY))
        i += 1


def run_replica(engine: Any, seed: int, duration_s: float, rate_per_s: float,
                batch_in_flight: int, batch_prompt_tokens: int) -> dict[str, float]:
    """Drive one replica for `duration_s` simulated seconds; its TTFT and throughput figures."""
    arrivals = _interactive_arrivals(seed, rate_per_s, duration_s)
    ttfts: list[float] = []
    batch: list[Request] = []
    batch_done_tokens = 0
    t_s, k, steps = 0.0, 0, 0
    wall0 = time.perf_counter()
    while t_s < duration_s:
        while k < len(arrivals) and arrivals[k].arrival_s <= t_s:
            engine.add_request(arrivals[k])
            k += 1
        batch = [r for r in batch if r.request_id in engine.requests]
        while len(batch) < batch_in_flight:
            req = Request(f"b{steps}-{len(batch)}", BATCH, batch_prompt_tokens, 64,
                          arrival_s=t_s, priority=h.BATCH_PRIORITY)
            engine.add_request(req)
            batch.append(req)
        res = engine.step(t_s)
        if res is None:
            t_s = arrivals[k].arrival_s if k < len(arrivals) else duration_s
            continue
        steps += 1
        t_s = res.end_s
        ttfts.extend(r.ttft_s for r in res.first_tokens if r.klass == INTERACTIVE)
        batch_done_tokens += res.batch_tokens
    wall_s = time.perf_counter() - wall0
    ttfts.sort()

    def pct(q: float) -> float:
        return ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))] if ttfts else float("nan")

    return {"steps": steps, "wall_s": wall_s, "sim_per_wall": t_s / wall_s,
            "us_per_step": 1e6 * wall_s / max(steps, 1), "ttft_p50_s": pct(0.50),
            "ttft_p95_s": pct(0.95), "ttft_p99_s": pct(0.99), "interactive": len(ttfts),
            "batch_tokens_per_s": batch_done_tokens / t_s}


def speed_and_plugin(duration_s: float, seed: int) -> None:
    """Print the per-core speed table and the plugin's effect on interactive TTFT."""
    config = EngineConfig.for_profile(H100_LLAMA3_8B)
    run = dict(seed=seed, duration_s=duration_s, rate_per_s=6.0, batch_in_flight=2,
               batch_prompt_tokens=32768)
    rows: dict[str, Any] = {
        "native": Engine(config, H100_LLAMA3_8B),
        "vllm": VllmEngine(config, H100_LLAMA3_8B),
    }
    for tokens_per_s in (20_000.0, 5_000.0):
        budget = Budget(pool="bench", mode=Mode.OPEN, reason="bench",
                        batch_tokens_per_s=tokens_per_s, batch_burst_tokens=0, max_batch_seqs=2,
                        max_batch_kv_tokens=10**7, max_batch_output_tokens=1024)
        rows[f"vllm+plugin {tokens_per_s / 1000:.0f}k tok/s"] = VllmEngine(
            config, H100_LLAMA3_8B, scheduler_cls=_plugin_cls(),
            budget_source=StaticBudgetSource(budget),
            plugin_config=PluginConfig(pool="bench", redis_url="redis://unused"),
            step_clock=None,
        )
    print(f"\n== one replica, {duration_s:.0f} s simulated: Poisson interactive "
          f"{run['rate_per_s']}/s (prompt 200-3000, output 50-300) + 2 batch prompts of "
          "32768 tokens always queued; priority policy, 8192-token steps, no chunk threshold")
    print(f"{'core':24} {'steps':>6} {'wall s':>7} {'sim s/wall s':>12} {'us/step':>8} "
          f"{'TTFT p50':>9} {'p95':>7} {'p99':>7} {'batch tok/s':>11}")
    for name, engine in rows.items():
        r = run_replica(engine, **run)
        print(f"{name:24} {r['steps']:>6} {r['wall_s']:>7.2f} {r['sim_per_wall']:>12.1f} "
              f"{r['us_per_step']:>8.0f} {r['ttft_p50_s']:>9.3f} {r['ttft_p95_s']:>7.3f} "
              f"{r['ttft_p99_s']:>7.3f} {r['batch_tokens_per_s']:>11.0f}")


def _plugin_cls() -> type:
    from borrowd.adapters.vllm_plugin import BorrowdScheduler

    return BorrowdScheduler


def main() -> int:
    """Parse arguments and print every table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--duration-s", type=float, default=120.0)
    args = parser.parse_args()
    require_vllm()
    agreement(args.seeds)
    speed_and_plugin(args.duration_s, args.seeds[0])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
