"""Check the default step-time profile (h100-llama3-8b) against one decoder layer timed on a GPU.

The default profile was not measured on Llama-3-8B: it is Vidur's H100 Llama-2-7B operator
times rescaled per operator to Llama-3-8B's shape (models/sim/profile_builtins.py), with
attention terms from FLOPs and data-sheet bandwidth. This script times ONE Llama decoder
layer with random bf16 weights, for both shapes, and compares.

    measure --out FILE.json [--device cuda] [--quick] [--budget-s 300]
        Standalone (torch and the standard library only; borrowd need not be installed).
        Builds a Llama-3-8B layer (hidden 4096, 32 heads, 8 KV heads, MLP 14336) and a
        Llama-2-7B layer (32 KV heads, MLP 11008): RMSNorm, QKV, rotary, attention
        (torch's scaled_dot_product_attention with the fastest backend that agrees with the
        math one, probed per shape), o_proj, residual add, RMSNorm, gate/up, SiLU-mul, down,
        residual add. Each case is captured in a CUDA graph and replayed
        between CUDA events (warm-ups, median of several repeats) and multiplied by 32
        layers. Cases: the non-attention part by scheduled tokens (full and GEMM-only);
        decode steps (seqs x KV context; one query per sequence, all sequences of one
        length, so the batch is a dense padded batch with no padding); fresh prefill chunks
        (causal over the chunk); mixed steps (a chunk plus decodes, two attention calls);
        attention alone for each; the LM head once per row count (excluded from steps: the
        profile has no LM head or sampling either). `--device cpu --quick` runs tiny shapes
        on the CPU to test the script, not to measure anything.

    compare FILE.json [--profile h100-llama3-8b]
        Needs borrowd. Prints measured vs the profile's prediction per case, the measured
        Llama-3-8B / Llama-2-7B ratio against the ratio the shipped recipe's per-operator
        scaling implies (h100-llama3-8b over an H100 Llama-2-7B profile fitted the same way
        from the unscaled operators), and median / worst ratios per part. Exit 2 with a
        one-line error on a missing or malformed file or an unknown profile.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

LAYERS = 32
FORMAT = "borrowd-gpu-step-check/1"
SHAPES: dict[str, dict[str, int]] = {
    "llama3-8b": {"hidden": 4096, "heads": 32, "kv_heads": 8, "mlp": 14336, "vocab": 128256},
    "llama2-7b": {"hidden": 4096, "heads": 32, "kv_heads": 32, "mlp": 11008, "vocab": 32000},
}
QUICK_SHAPES: dict[str, dict[str, int]] = {
    "llama3-8b": {"hidden": 256, "heads": 4, "kv_heads": 1, "mlp": 896, "vocab": 1024},
    "llama2-7b": {"hidden": 256, "heads": 4, "kv_heads": 4, "mlp": 688, "vocab": 512},
}
TARGET_SHAPE, REFERENCE_SHAPE = "llama3-8b", "llama2-7b"
PARTS = ("linear", "decode", "prefill", "mixed", "lm_head")
SCOPES = ("layer", "gemm", "attention", "lm_head")
L2_FLUSH_BYTES = 256 * 2**20  # attention-alone cases rotate KV copies to read past the L2


@dataclass(frozen=True)
class Plan:
    """The case grid of one run."""

    linear_tokens: tuple[int, ...]
    decode_seqs: tuple[int, ...]
    decode_ctx: tuple[int, ...]
    prefill_chunks: tuple[int, ...]
    mixed: tuple[tuple[int, int, int], ...]  # (chunk, seqs, ctx)
    lm_head_rows: tuple[int, ...]
    repeats: int
    target_s: float  # seconds of replays per repeat


FULL_PLAN = Plan(
    linear_tokens=(1, 8, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192),
    decode_seqs=(8, 32, 128),
    decode_ctx=(512, 2048, 8192),
    prefill_chunks=(512, 2048, 8192),
    mixed=((512, 32, 2048), (2048, 64, 2048), (1024, 128, 8192), (4096, 16, 4096)),
    lm_head_rows=(1, 8, 32, 128, 256),
    repeats=9,
    target_s=0.03,
)
QUICK_PLAN = Plan(
    linear_tokens=(1, 8, 64),
    decode_seqs=(2,),
    decode_ctx=(64,),
    prefill_chunks=(64,),
    mixed=((32, 2, 64),),
    lm_head_rows=(1, 8),
    repeats=3,
    target_s=0.002,
)


def prefill_pairs(chunk: int) -> int:
    """(query, key) pairs of a fresh prompt's chunk of `chunk` tokens (causal)."""
    return chunk * (chunk + 1) // 2


# ----------------------------------------------------------------------------- measure


class Layer:
    """One Llama decoder layer with random weights, and the cases timed on it."""

    def __init__(self, dims: dict[str, int], device: str) -> None:
        import torch

        self.torch = torch
        self.device = device
        self.dtype = torch.bfloat16
        self.hidden, self.heads = dims["hidden"], dims["heads"]
        self.kv_heads, self.mlp = dims["kv_heads"], dims["mlp"]
        self.vocab = dims["vocab"]
        self.head_dim = self.hidden // self.heads
        self.group = self.heads // self.kv_heads
        h, d = self.hidden, self.head_dim

        def weight(rows: int, cols: int) -> torch.Tensor:
            return torch.randn(rows, cols, device=device, dtype=self.dtype) * cols**-0.5

        self.ln1 = torch.ones(h, device=device, dtype=self.dtype)
        self.ln2 = torch.ones(h, device=device, dtype=self.dtype)
        self.qkv = weight((self.heads + 2 * self.kv_heads) * d, h)
        self.o = weight(h, self.heads * d)
        self.gate_up = weight(2 * self.mlp, h)
        self.down = weight(h, self.mlp)
        inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, device=device).float() / d))
        self.inv_freq = inv

    def weight_bytes(self) -> int:
        """Bytes of the layer's four GEMM weights."""
        return sum(t.numel() * t.element_size() for t in (self.qkv, self.o, self.gate_up,
                                                           self.down))

    def rotary(self, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape (tokens, 1, head_dim / 2) for the given positions."""
        torch = self.torch
        pos = torch.tensor(positions, device=self.device, dtype=torch.float32)
        angles = pos[:, None] * self.inv_freq[None, :]
        return (angles.cos().to(self.dtype)[:, None, :], angles.sin().to(self.dtype)[:, None, :])

    def norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """RMSNorm (torch's rms_norm)."""
        return self.torch.nn.functional.rms_norm(x, (self.hidden,), w, 1e-5)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotary embedding (neox layout) of x (tokens, heads, head_dim)."""
        half = self.head_dim // 2
        x1, x2 = x[..., :half], x[..., half:]
        return self.torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None
                ) -> torch.Tensor:
        """The layer on x (tokens, hidden); `attend(q, k, v)` -> (tokens, heads * head_dim),
        or None for the non-attention part alone (q passes through)."""
        f = self.torch.nn.functional
        t, d = x.shape[0], self.head_dim
        qkv = f.linear(self.norm(x, self.ln1), self.qkv)
        qk = self.rope(qkv[:, : (self.heads + self.kv_heads) * d].view(t, -1, d), cos, sin)
        q, k = qk[:, : self.heads], qk[:, self.heads :]
        v = qkv[:, (self.heads + self.kv_heads) * d :].view(t, self.kv_heads, d)
        o = q.flatten(1) if attend is None else attend(q, k, v)
        x = x + f.linear(o, self.o)
        gu = f.linear(self.norm(x, self.ln2), self.gate_up)
        a = f.silu(gu[:, : self.mlp]) * gu[:, self.mlp :]
        return x + f.linear(a, self.down)


class Attention:
    """Attention calls through scaled_dot_product_attention with a pinned backend."""

    CANDIDATES = ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION", "MATH")

    def __init__(self, layer: Layer) -> None:
        self.layer = layer
        self.torch = layer.torch
        self.timings_ms: dict[str, dict[str, float]] = {"prefill": {}, "decode": {}}
        self.prefill_backend = "MATH"
        self.decode_backend = "MATH"
        self.prefill_backend = self._pick("prefill")
        self.decode_backend = self._pick("decode")

    def _sdpa(self, backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              causal: bool) -> torch.Tensor:
        torch = self.torch
        from torch.nn.attention import SDPBackend, sdpa_kernel

        gqa = k.shape[1] != q.shape[1]
        with sdpa_kernel([getattr(SDPBackend, backend)]), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "kernel not used because" (probe)
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=causal, enable_gqa=gqa)

    def _inputs(self, kind: str, big: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Inputs laid out as the layer passes them: prefill q (c, H, D), k/v (c, KVH, D)
        views of one projection; decode q (B, H, D) a view of one, cache (B, KVH, ctx, D)."""
        torch, lay = self.torch, self.layer
        h, kvh, d = lay.heads, lay.kv_heads, lay.head_dim
        if kind == "prefill":
            c = 4096 if big else 64
            qkv = torch.randn(c, h + 2 * kvh, d, device=lay.device, dtype=lay.dtype)
            return qkv[:, :h], qkv[:, h : h + kvh], qkv[:, h + kvh :]
        b, ctx = (64, 4096) if big else (4, 256)
        q = torch.randn(b, h + 2 * kvh, d, device=lay.device, dtype=lay.dtype)[:, :h]
        k = torch.randn(b, kvh, ctx, d, device=lay.device, dtype=lay.dtype)
        return q, k, torch.randn_like(k)

    def _call(self, kind: str, backend: str, q: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> torch.Tensor:
        if kind == "prefill":
            self.prefill_backend = backend
            return self.prefill(q, k, v)
        self.decode_backend = backend
        return self.decode(q, k, v)

    def _pick(self, kind: str) -> str:
        """The fastest backend (on a GPU; the first on a CPU) that runs this kind of call on
        the layer's layout and agrees with MATH; the timings kept in `timings_ms`."""
        torch = self.torch
        q, k, v = self._inputs(kind, big=False)
        ref = self._call(kind, "MATH", q.float(), k.float(), v.float())
        working = []
        for name in self.CANDIDATES[:-1]:
            try:
                out = self._call(kind, name, q, k, v)
            except RuntimeError:
                continue
            if (out.float() - ref).abs().max().item() < 0.05:
                working.append(name)
        if not working:
            return "MATH"
        if self.layer.device != "cuda" or len(working) == 1:
            return working[0]
        q, k, v = self._inputs(kind, big=True)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for name in working:
            try:
                for _ in range(2):
                    self._call(kind, name, q, k, v)
                start.record()
                for _ in range(5):
                    self._call(kind, name, q, k, v)
                end.record()
                end.synchronize()
            except RuntimeError:
                continue
            self.timings_ms[kind][name] = start.elapsed_time(end) / 5
        timed = self.timings_ms[kind]
        return min(timed, key=lambda n: timed[n]) if timed else working[0]

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of one fresh chunk: q (c, H, D), k/v (c, KVH, D) -> (c, H*D)."""
        out = self._sdpa(self.prefill_backend, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                         v.transpose(0, 1)[None], True)
        return out[0].transpose(0, 1).reshape(q.shape[0], -1)

    def decode(self, q: torch.Tensor, cache_k: torch.Tensor,
               cache_v: torch.Tensor) -> torch.Tensor:
        """One query per sequence over its KV cache: q (B, H, D), cache (B, KVH, ctx, D).

        The query heads sharing a KV head are folded into the query length (B, KVH, G, D),
        as FlashAttention does for decode, so the cache is read once per KV head.
        """
        lay = self.layer
        b = q.shape[0]
        qf = q.reshape(b, lay.kv_heads, lay.group, lay.head_dim)
        out = self._sdpa(self.decode_backend, qf, cache_k, cache_v, False)
        return out.reshape(b, -1)


class Timer:
    """Median seconds per call of a function: CUDA graph + events on a GPU, wall on a CPU."""

    def __init__(self, torch_mod: Any, device: str, plan: Plan) -> None:
        self.torch = torch_mod
        self.cuda = device == "cuda"
        self.plan = plan

    def __call__(self, fn: Callable[[], object]) -> dict[str, Any]:
        """{'median_s', 'samples_s', 'iters', 'graph'} of fn."""
        torch = self.torch
        if not self.cuda:
            fn()
            t0 = time.perf_counter()
            fn()
            one = max(time.perf_counter() - t0, 1e-6)
            iters = max(1, min(50, int(self.plan.target_s / one)))
            samples = []
            for _ in range(self.plan.repeats):
                t0 = time.perf_counter()
                for _ in range(iters):
                    fn()
                samples.append((time.perf_counter() - t0) / iters)
            return {"median_s": statistics.median(samples), "samples_s": samples,
                    "iters": iters, "graph": False}
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph: Any = torch.cuda.CUDAGraph()
        use_graph = True
        try:
            with torch.cuda.graph(graph):
                fn()
            run: Callable[[], object] = graph.replay
        except RuntimeError as exc:  # pragma: no cover - device only
            print(f"    (CUDA graph capture failed, timing eagerly: {exc})", flush=True)
            torch.cuda.synchronize()
            graph, use_graph, run = None, False, fn
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        run()
        start.record()
        run()
        end.record()
        end.synchronize()
        one = max(start.elapsed_time(end) / 1e3, 1e-6)
        iters = max(2, min(400, math.ceil(self.plan.target_s / one)))
        samples = []
        for _ in range(self.plan.repeats):
            start.record()
            for _ in range(iters):
                run()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3 / iters)
        del graph
        return {"median_s": statistics.median(samples), "samples_s": samples, "iters": iters,
                "graph": use_graph}


def _kv_cache(lay: Layer, seqs: int, ctx: int,
              copies: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    torch = lay.torch
    shape = (seqs, lay.kv_heads, ctx, lay.head_dim)
    return [(torch.randn(shape, device=lay.device, dtype=lay.dtype),
             torch.randn(shape, device=lay.device, dtype=lay.dtype)) for _ in range(copies)]


def _copies(nbytes: int) -> int:
    return max(1, min(32, math.ceil(L2_FLUSH_BYTES / max(nbytes, 1))))


def _hidden(lay: Layer, tokens: int) -> torch.Tensor:
    return lay.torch.randn(tokens, lay.hidden, device=lay.device, dtype=lay.dtype)


def _linear_fn(lay: Layer, tokens: int) -> Callable[[], object]:
    x = _hidden(lay, tokens)
    cos, sin = lay.rotary(list(range(tokens)))
    return lambda: lay.forward(x, cos, sin, None)


def _gemm_fn(lay: Layer, tokens: int) -> Callable[[], object]:
    f = lay.torch.nn.functional
    x = _hidden(lay, tokens)
    a = lay.torch.randn(tokens, lay.mlp, device=lay.device, dtype=lay.dtype)

    def run() -> object:
        f.linear(x, lay.qkv)
        f.linear(x, lay.o)
        f.linear(x, lay.gate_up)
        return f.linear(a, lay.down)

    return run


def _positions(chunk: int, seqs: int, ctx: int) -> list[int]:
    return list(range(chunk)) + [ctx - 1] * seqs


def _step_fn(lay: Layer, att: Attention, chunk: int, seqs: int,
             ctx: int) -> Callable[[], object]:
    """A whole layer step: a fresh prefill chunk of `chunk` tokens plus `seqs` decodes, each
    attending to `ctx` KV tokens (its new one written at position ctx - 1)."""
    x = _hidden(lay, chunk + seqs)
    cos, sin = lay.rotary(_positions(chunk, seqs, ctx))
    cache_k, cache_v = _kv_cache(lay, seqs, ctx)[0] if seqs else (x, x)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        outs = []
        if chunk:
            outs.append(att.prefill(q[:chunk], k[:chunk], v[:chunk]))
        if seqs:
            cache_k[:, :, ctx - 1] = k[chunk:]
            cache_v[:, :, ctx - 1] = v[chunk:]
            outs.append(att.decode(q[chunk:], cache_k, cache_v))
        return outs[0] if len(outs) == 1 else lay.torch.cat(outs)

    return lambda: lay.forward(x, cos, sin, attend)


def _attention_fn(lay: Layer, att: Attention, chunk: int, seqs: int,
                  ctx: int) -> tuple[Callable[[], object], int]:
    """Attention alone for the same step; KV copies rotated so small cases read past L2."""
    torch = lay.torch
    d = lay.head_dim
    kv_bytes = 2 * seqs * lay.kv_heads * ctx * d * 2
    qkv_bytes = chunk * (lay.heads + 2 * lay.kv_heads) * d * 2
    copies = _copies(kv_bytes + qkv_bytes)
    caches = _kv_cache(lay, seqs, ctx, copies) if seqs else []
    fresh = [(torch.randn(chunk, lay.heads, d, device=lay.device, dtype=lay.dtype),
              torch.randn(chunk, lay.kv_heads, d, device=lay.device, dtype=lay.dtype),
              torch.randn(chunk, lay.kv_heads, d, device=lay.device, dtype=lay.dtype))
             for _ in range(copies if chunk else 0)]
    q_dec = torch.randn(seqs, lay.heads, d, device=lay.device, dtype=lay.dtype)

    def run() -> object:
        out: object = None
        for i in range(copies):
            if chunk:
                out = att.prefill(*fresh[i])
            if seqs:
                out = att.decode(q_dec, *caches[i])
        return out

    return run, copies


def lm_head_fn(lay: Layer, rows: int) -> Callable[[], object]:
    """LM head (rows, hidden) x (vocab, hidden)^T; its weight is created here."""
    torch = lay.torch
    w = torch.randn(lay.vocab, lay.hidden, device=lay.device, dtype=lay.dtype) * 0.02
    x = _hidden(lay, rows)
    return lambda: torch.nn.functional.linear(x, w)


def device_info(torch_mod: Any, device: str) -> dict[str, Any]:
    """Names and versions of the device and software."""
    info: dict[str, Any] = {"device": device, "torch": torch_mod.__version__,
                            "cuda": torch_mod.version.cuda, "python": sys.version.split()[0]}
    if device == "cuda":
        props = torch_mod.cuda.get_device_properties(0)
        info.update(gpu=props.name, capability=f"{props.major}.{props.minor}",
                    sm_count=props.multi_processor_count,
                    memory_gib=round(props.total_memory / 2**30, 1),
                    cudnn=torch_mod.backends.cudnn.version())
    else:
        info["gpu"] = "none (CPU)"
    return info


def ceilings(torch_mod: Any) -> dict[str, float]:
    """Measured device-to-device copy TB/s (bytes read + written) and 8192^3 bf16 GEMM
    TFLOP/s on random data: the roofs the cases are read against."""
    torch = torch_mod
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    src = torch.empty(2**30, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    end.synchronize()
    copy = 2 * src.numel() * 4 * 10 / (start.elapsed_time(end) / 1e3) / 1e12
    del src, dst
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start.record()
    for _ in range(10):
        a @ b
    end.record()
    end.synchronize()
    gemm = 2 * 8192**3 * 10 / (start.elapsed_time(end) / 1e3) / 1e12
    return {"copy_tb_s": round(copy, 3), "bf16_gemm_tflop_s": round(gemm, 1)}


def nvidia_smi() -> str:
    """One CSV line of nvidia-smi's clocks and power, or why not."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,"
             "temperature.gpu", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unavailable: {exc}"
    return out.stdout.strip() or out.stderr.strip()


def measure(out: Path, device: str, quick: bool, budget_s: float) -> int:
    """Time every case on `device` and write the JSON file `out` (rewritten as it goes)."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    started = time.monotonic()
    torch.manual_seed(0)
    plan = QUICK_PLAN if quick else FULL_PLAN
    shapes = QUICK_SHAPES if quick else SHAPES
    timer = Timer(torch, device, plan)
    data: dict[str, Any] = {
        "format": FORMAT,
        "info": device_info(torch, device),
        "settings": {
            "quick": quick, "layers": LAYERS, "dtype": "bfloat16", "repeats": plan.repeats,
            "timing": ("CUDA graph of the case, replayed back to back between CUDA events "
                       "after 3 eager warm-ups; median over repeats"
                       if device == "cuda" else "wall clock (CPU test run)"),
        },
        "notes": [
            "step_s = per-layer median x layers; embedding, LM head and sampling excluded "
            "(LM head timed alone: part lm_head, step_s = one call)",
            "decode: one query per sequence, all sequences of one context length (a dense "
            "padded batch with no padding); query heads of one KV head folded into the query "
            "length; the new token's K/V written into the cache at ctx - 1",
            "prefill: a fresh prompt's chunk, causal over the chunk (no earlier KV)",
            "mixed: one GEMM over chunk + seqs tokens, then a prefill and a decode attention "
            "call, outputs concatenated",
            "scope gemm: the four GEMMs alone (qkv, o, gate_up, down); scope layer of part "
            "linear: the layer without attention (norms, rotary, SiLU-mul, adds unfused "
            "torch ops, where vLLM fuses them)",
            "scope attention: scaled_dot_product_attention alone; small cases rotate "
            f"through KV copies (>= {L2_FLUSH_BYTES >> 20} MiB) so reads miss the L2",
        ],
        "shapes": shapes,
        "attention_backend": {},
        "cases": [],
        "skipped": [],
    }

    def save() -> None:
        data["wall_s"] = round(time.monotonic() - started, 1)
        out.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")

    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"device: {data['info']}", flush=True)
    if device == "cuda":
        print(f"nvidia-smi before: {nvidia_smi()}", flush=True)
        data["info"]["ceilings"] = ceilings(torch)
        print(f"ceilings: {data['info']['ceilings']}", flush=True)
        _free(torch, device)
    for shape, dims in shapes.items():
        lay = Layer(dims, device)
        att = Attention(lay)
        data["attention_backend"][shape] = {
            "prefill": att.prefill_backend, "decode": att.decode_backend,
            "probe_ms (prefill 4096 tokens; decode 64 x 4096)": att.timings_ms}
        print(f"[{shape}] weights {lay.weight_bytes() / 2**20:.0f} MiB per layer; attention "
              f"prefill {att.prefill_backend}, decode {att.decode_backend} "
              f"(probe ms {att.timings_ms})", flush=True)
        for desc in grid(plan):
            desc = {"shape": shape, **desc}
            if time.monotonic() - started > budget_s:
                data["skipped"].append({**desc, "error": "time budget spent"})
                continue
            try:
                fn, calls = build_case(lay, att, desc)
                result = timer(fn)
                del fn
            except (RuntimeError, ValueError) as exc:
                print(f"  {_label(desc)}: FAILED {exc}", flush=True)
                data["skipped"].append({**desc, "error": str(exc)[:300]})
                _free(torch, device)
                continue
            per_call = result["median_s"] / calls
            layers = 1 if desc["part"] == "lm_head" else LAYERS
            case = {**desc, "calls_per_sample": calls, "layer_s": per_call,
                    "step_s": per_call * layers,
                    "samples_s": [s / calls for s in result["samples_s"]],
                    "iters": result["iters"], "graph": result["graph"]}
            data["cases"].append(case)
            print(f"  {_label(desc)}: {per_call * 1e6:9.1f} us/layer  "
                  f"{case['step_s'] * 1e3:8.3f} ms/step", flush=True)
            _free(torch, device)
        del lay, att
        _free(torch, device)
        save()
    if device == "cuda":
        data["info"]["nvidia_smi_after"] = nvidia_smi()
        print(f"nvidia-smi after: {data['info']['nvidia_smi_after']}", flush=True)
    save()
    print(f"wrote {out}: {len(data['cases'])} cases, {len(data['skipped'])} skipped, "
          f"{data['wall_s']} s", flush=True)
    return 0


def build_case(lay: Layer, att: Attention, desc: dict[str, Any]) -> tuple[
        Callable[[], object], int]:
    """(function to time, calls of the timed operation per function call) of one case."""
    part, scope, tokens = desc["part"], desc["scope"], desc["tokens"]
    chunk, seqs, ctx = desc["chunk"], desc["seqs"], desc["ctx"]
    if part == "lm_head":
        return lm_head_fn(lay, tokens), 1
    if scope == "gemm":
        return _gemm_fn(lay, tokens), 1
    if scope == "attention":
        return _attention_fn(lay, att, chunk, seqs, ctx)
    if part == "linear":
        return _linear_fn(lay, tokens), 1
    return _step_fn(lay, att, chunk, seqs, ctx), 1


def grid(plan: Plan) -> list[dict[str, Any]]:
    """The description of every case of one shape in `plan`, in run order."""
    out: list[dict[str, Any]] = []
    for tokens in plan.linear_tokens:
        base = {"part": "linear", "tokens": tokens, "chunk": 0, "seqs": 0, "ctx": 0}
        out += [{**base, "scope": "layer"}, {**base, "scope": "gemm"}]
    steps = [("decode", 0, s, c) for s in plan.decode_seqs for c in plan.decode_ctx]
    steps += [("prefill", c, 0, 0) for c in plan.prefill_chunks]
    steps += [("mixed", c, s, x) for c, s, x in plan.mixed]
    for part, chunk, seqs, ctx in steps:
        base = {"part": part, "tokens": chunk + seqs, "chunk": chunk, "seqs": seqs, "ctx": ctx}
        out += [{**base, "scope": "layer"}, {**base, "scope": "attention"}]
    out += [{"part": "lm_head", "scope": "lm_head", "tokens": rows, "chunk": 0, "seqs": rows,
             "ctx": 0} for rows in plan.lm_head_rows]
    return out


def _label(desc: dict[str, Any]) -> str:
    return (f"{desc['part']:7} {desc['scope']:9} tokens {desc['tokens']:5} chunk "
            f"{desc['chunk']:5} decode {desc['seqs']:4}x{desc['ctx']:<5}")


def _free(torch_mod: Any, device: str) -> None:
    if device == "cuda":
        torch_mod.cuda.synchronize()
        torch_mod.cuda.empty_cache()


# ----------------------------------------------------------------------------- compare


class BadFile(Exception):
    """A measurements file that cannot be compared (the message is one line)."""


CASE_KEYS: dict[str, type] = {"shape": str, "part": str, "scope": str, "tokens": int,
                              "chunk": int, "seqs": int, "ctx": int, "step_s": float,
                              "layer_s": float}


def load_measurements(path: Path) -> dict[str, Any]:
    """The measurements file at `path`, checked; `BadFile` saying what is wrong."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BadFile(f"{path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise BadFile(f"{path} cannot be read: {exc}") from None
    except json.JSONDecodeError as exc:
        raise BadFile(f"{path} is not JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise BadFile(f"{path} is not a gpu_step_check measurements file (format {FORMAT!r})")
    cases = data.get("cases")
    if not isinstance(cases, list) or not cases:
        raise BadFile(f"{path} holds no cases")
    for i, case in enumerate(cases):
        if not isinstance(case, dict):
            raise BadFile(f"{path}: case {i} is not an object")
        for key, kind in CASE_KEYS.items():
            value = case.get(key)
            ok = (isinstance(value, str) if kind is str
                  else isinstance(value, int | float) and not isinstance(value, bool)
                  and math.isfinite(value) and value >= 0)
            if kind is int and ok:
                ok = isinstance(value, int)
            if not ok:
                raise BadFile(f"{path}: case {i} has a bad {key}: {value!r}")
        if case["part"] not in PARTS or case["scope"] not in SCOPES:
            raise BadFile(f"{path}: case {i} has an unknown part/scope "
                          f"{case['part']!r}/{case['scope']!r}")
        if case["step_s"] <= 0:
            raise BadFile(f"{path}: case {i} has a step_s of 0")
    shapes = data.get("shapes")
    if not isinstance(shapes, dict) or not all(
            isinstance(d, dict) and {"heads", "kv_heads", "hidden"} <= set(d)
            for d in shapes.values()):
        raise BadFile(f"{path}: no shape dimensions ('shapes')")
    return data


def predict(profile: Any, case: dict[str, Any]) -> float | None:
    """The profile's seconds for what the case timed (None for the LM head: not modelled)."""
    kv, pairs = case["seqs"] * case["ctx"], prefill_pairs(case["chunk"])
    scope = case["scope"]
    if scope == "lm_head":
        return None
    if scope == "attention":
        return float(profile.decode_s_per_kv_token * kv + profile.prefill_s_per_pair * pairs)
    if scope == "gemm" or case["part"] == "linear":
        return float(profile.linear_s(case["tokens"]))
    return float(profile.step_s(case["tokens"], kv, pairs))


@dataclass(frozen=True)
class Row:
    """One case of the target shape against the profile."""

    case: dict[str, Any]
    measured_s: float
    predicted_s: float

    @property
    def ratio(self) -> float:
        """measured / predicted."""
        return self.measured_s / self.predicted_s


@dataclass(frozen=True)
class ShapeRow:
    """One case measured on both shapes: the 8B/7B ratio measured and implied."""

    case: dict[str, Any]
    measured_ratio: float
    implied_ratio: float
    reference_vs_profile: float  # measured 7B / 7B profile

    @property
    def agreement(self) -> float:
        """measured ratio / implied ratio."""
        return self.measured_ratio / self.implied_ratio


def _key(case: dict[str, Any]) -> tuple[str, str, int, int, int, int]:
    return (case["part"], case["scope"], case["tokens"], case["chunk"], case["seqs"],
            case["ctx"])


def group(case: dict[str, Any]) -> str:
    """Summary group of a case: part/scope."""
    return f"{case['part']}/{case['scope']}"


def profile_rows(data: dict[str, Any], profile: Any, shape: str = TARGET_SHAPE) -> list[Row]:
    """Every case of `shape` that the profile predicts, against the prediction."""
    rows = []
    for case in data["cases"]:
        if case["shape"] != shape:
            continue
        predicted = predict(profile, case)
        if predicted:
            rows.append(Row(case, case["step_s"], predicted))
    return rows


def shape_rows(data: dict[str, Any], target: Any, reference: Any) -> list[ShapeRow]:
    """Cases measured on both shapes: measured 8B/7B against target/reference profiles."""
    ref = {_key(c): c for c in data["cases"] if c["shape"] == REFERENCE_SHAPE}
    rows = []
    for case in data["cases"]:
        other = ref.get(_key(case))
        if case["shape"] != TARGET_SHAPE or other is None:
            continue
        p8, p7 = predict(target, case), predict(reference, other)
        if not p8 or not p7:
            continue
        rows.append(ShapeRow(case, case["step_s"] / other["step_s"], p8 / p7,
                             other["step_s"] / p7))
    return rows


def summarize(ratios: list[float]) -> tuple[int, float, float]:
    """(count, median, worst) of ratios; worst is the one furthest from 1 (in log)."""
    worst = max(ratios, key=lambda r: abs(math.log(r)))
    return len(ratios), statistics.median(ratios), worst


def _achieved(data: dict[str, Any], case: dict[str, Any]) -> str:
    """What the timed operation achieved per layer: TB/s of KV or weights, TFLOP/s."""
    dims = data["shapes"].get(case["shape"])
    if not dims:
        return ""
    d = dims["hidden"] // dims["heads"]
    s = case["layer_s"]
    if case["scope"] == "attention":
        kv_bytes = 2 * dims["kv_heads"] * d * 2 * case["seqs"] * case["ctx"]
        flops = 4 * dims["heads"] * d * (prefill_pairs(case["chunk"])
                                         + case["seqs"] * case["ctx"])
        if case["part"] == "decode":
            return f"KV {kv_bytes / s / 1e12:.2f} TB/s"
        if case["part"] == "prefill":
            return f"{flops / s / 1e12:.0f} TFLOP/s"
        return ""
    if case["scope"] == "gemm" and "mlp" in dims:
        params = dims["hidden"] * ((dims["heads"] + 2 * dims["kv_heads"]) * d
                                   + dims["heads"] * d + 3 * dims["mlp"])
        return (f"W {params * 2 / s / 1e12:.2f} TB/s, "
                f"{2 * params * case['tokens'] / s / 1e12:.0f} TFLOP/s")
    return ""


def _case_label(case: dict[str, Any]) -> str:
    parts = []
    if case["chunk"]:
        parts.append(f"chunk {case['chunk']}")
    if case["seqs"] and case["part"] != "lm_head":
        parts.append(f"{case['seqs']}x{case['ctx']} decode")
    if not parts:
        parts.append(f"{case['tokens']} tok" if case["part"] != "lm_head"
                     else f"{case['tokens']} rows")
    return " + ".join(parts)


def reference_profile() -> Any:
    """An H100 Llama-2-7B profile fitted by the shipped method from Vidur's unscaled
    operators (the h100-llama3-8b recipe without its target shape)."""
    from borrowd.models.sim.profile_builtins import Recipe, build

    return build(Recipe("h100-llama2-7b (unscaled)", "h100-llama-2-7b", LAYERS, 1, "h100"))[0]


def compare(path: Path, profile_name: str) -> int:
    """Print the comparison tables of a measurements file (see the module docstring)."""
    from borrowd.models.errors import InputError
    from borrowd.models.sim.profiles import PROFILES, get_profile

    try:
        data = load_measurements(path)
        profile = get_profile(profile_name)
    except (BadFile, InputError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    info = data.get("info", {})
    backends = "; ".join(
        f"{shape} prefill {b.get('prefill')}, decode {b.get('decode')}"
        for shape, b in (data.get("attention_backend") or {}).items() if isinstance(b, dict))
    print(f"measured on {info.get('gpu', '?')} (torch {info.get('torch', '?')}, CUDA "
          f"{info.get('cuda', '?')}); attention: {backends or '?'}")
    if info.get("ceilings"):
        print(f"device roofs measured in the same run: {info['ceilings']}")
    if data.get("settings", {}).get("quick"):
        print("NOTE: --quick measurements (tiny shapes): the ratios below mean nothing")
    print(f"profile {profile.name}; times are whole-model (x{LAYERS} layers) per step, ms\n")
    rows = profile_rows(data, profile)
    print(f"## {TARGET_SHAPE} measured vs {profile.name}")
    print("| part/scope | case | tokens | measured ms | profile ms | meas/prof | achieved |")
    print("|---|---|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {group(r.case)} | {_case_label(r.case)} | {r.case['tokens']} | "
              f"{r.measured_s * 1e3:.3f} | {r.predicted_s * 1e3:.3f} | {r.ratio:.2f} | "
              f"{_achieved(data, r.case)} |")
    heads = [c for c in data["cases"] if c["part"] == "lm_head"]
    if heads:
        print("\nLM head alone (not in the profile; once per step over the sampled rows), ms: "
              + ", ".join(f"{c['shape']} {c['tokens']} rows {c['step_s'] * 1e3:.3f}"
                          for c in heads))
    target = PROFILES.get("h100-llama3-8b", profile)
    reference = reference_profile()
    srows = shape_rows(data, target, reference)
    if srows:
        print(f"\n## shape scaling: measured {TARGET_SHAPE}/{REFERENCE_SHAPE} vs the recipe's "
              f"({target.name} / {reference.name})")
        print("| part/scope | case | measured 8B/7B | implied 8B/7B | measured/implied | "
              "7B meas/7B prof |")
        print("|---|---|---:|---:|---:|---:|")
        for s in srows:
            print(f"| {group(s.case)} | {_case_label(s.case)} | {s.measured_ratio:.3f} | "
                  f"{s.implied_ratio:.3f} | {s.agreement:.3f} | {s.reference_vs_profile:.2f} |")
    print("\n## summary (ratio = measured / predicted; worst = furthest from 1)")
    print(f"| part/scope | cases | {TARGET_SHAPE} vs {profile.name}: median | worst | "
          "8B/7B measured vs implied: median | worst |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in dict.fromkeys(group(r.case) for r in rows):
        n, med, worst = summarize([r.ratio for r in rows if group(r.case) == name])
        shape_part = [s.agreement for s in srows if group(s.case) == name]
        tail = "| - | - |"
        if shape_part:
            _, smed, sworst = summarize(shape_part)
            tail = f"| {smed:.3f} | {sworst:.3f} |"
        print(f"| {name} | {n} | {med:.2f} | {worst:.2f} {tail}")
    skipped = data.get("skipped") or []
    if skipped:
        print(f"\n{len(skipped)} case(s) were not measured (see 'skipped' in {path})")
    return 0


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    """Command line: measure or compare (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure", help="time the cases on a device (torch only)")
    m.add_argument("--out", required=True, type=Path, help="JSON file to write")
    m.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    m.add_argument("--quick", action="store_true", help="tiny shapes and few cases (tests)")
    m.add_argument("--budget-s", type=float, default=300.0,
                   help="skip the remaining cases after this many seconds (default 300)")
    c = sub.add_parser("compare", help="compare a measurements file with a profile")
    c.add_argument("file", type=Path)
    c.add_argument("--profile", default="h100-llama3-8b")
    args = parser.parse_args(argv)
    if args.command == "measure":
        return measure(args.out, args.device, args.quick, args.budget_s)
    return compare(args.file, args.profile)


if __name__ == "__main__":
    raise SystemExit(main())
