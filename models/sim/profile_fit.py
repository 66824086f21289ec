"""Fitting step-time profiles from measured operator or step times.

Measurements come in two CSV forms:
- Vidur's operator profile (`mlp.csv`: per transformer layer, per `num_tokens` and
  `num_tensor_parallel_workers`, `time_stats.OP.median` in ms, model shape columns). The
  non-attention step time of the whole model at `tp` is
      emb + layers * (sum of the layer's operators, `add` twice: two residual adds)
          + layers * 2 * all_reduce(num_tokens * n_embd * 2 bytes, tp)   (tp > 1)
  with the all-reduce time interpolated in Vidur's `all_reduce.csv` of the same GPU.
- Plain step times: `num_tokens,step_s` (non-attention step seconds, already whole-model).

The fit is a non-decreasing piecewise-linear curve through fixed knots (`KNOTS`, within the
measured range) by least squares on the training rows, extended to `EXTEND_TO_TOKENS` with
the slope of the upper half of the data when they stop short; every `HOLDOUT_EVERY`-th row
(by token count) is held out and the fit's relative error on those rows is reported.
Attention is not in the measurements: it is modelled from FLOPs and memory bandwidth
(`attention_constants`).
A model without its own measurements on a GPU is derived from a measured model of the same
layer structure on that GPU by scaling each operator by the ratio of its weight (or
activation) size between the two shapes (`reshape`); that scaling is checked where both
models are measured (A100: Llama-2-7B -> Llama-3-8B, `benchmarks/bench_profiles.py`).
"""

from __future__ import annotations

import csv
import gzip
import math
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np
from borrowd.models.errors import InputError
from borrowd.models.sim.profiles import StepProfile
from scipy.optimize import nnls  # type: ignore[import-untyped, unused-ignore]

VIDUR_DIR = Path(__file__).resolve().parent / "data" / "vidur"
LAYER_OPS = (
    "input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj",
    "post_attention_layernorm", "mlp_up_proj", "mlp_act", "mlp_down_proj", "add",
)
OP_COUNT = {"add": 2}  # residual adds per layer; every other operator runs once
SHAPE_COLUMNS = ("n_head", "n_kv_head", "n_embd", "n_expanded_embd", "vocab_size")
# GEMM times step up just past multiples of 64 tokens (tile quantization: 256 -> 264 tokens
# costs 35% more on A100), so up to 2k tokens the knots come in pairs (k, k + 8 or 16) that
# let the curve jump where the measurements do; above, the steps are small against the total.
KNOTS = tuple(sorted(
    {1, 8, 16, 32}
    | {k + d for k in range(64, 1025, 64) for d in (0, 8)}
    | {k + d for k in range(1280, 2049, 256) for d in (0, 16)}
    | {2560, 3072, 3584, 4096, 5120, 6144, 7168, 8192, 10240, 12288, 16384, 20480, 24576,
       28672, 32768}
))
HOLDOUT_EVERY = 5
EXTEND_TO_TOKENS = 32768
BF16_BYTES = 2


@dataclass(frozen=True)
class Gpu:
    """Data-sheet figures of one GPU (NVIDIA A100/H100 SXM 80 GB data sheets)."""

    name: str
    dense_bf16_flops: float
    hbm_bytes_per_s: float
    memory_bytes: float


GPUS = {
    "a100": Gpu("a100", 312e12, 2.039e12, 80e9),
    "h100": Gpu("h100", 989e12, 3.35e12, 80e9),
}
# Attention efficiencies (kept from the hand-built profiles): decode attention reads the KV
# cache at 80% of HBM bandwidth (the A100 8B figure of 2.5 ns per KV token per layer);
# prefill attention runs at 50% of dense bf16 peak (FlashAttention-2/3 forward: 40-75%).
DECODE_BANDWIDTH_EFFICIENCY = 0.8
PREFILL_FLOPS_EFFICIENCY = 0.5
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default
ACTIVATION_RESERVE_BYTES = 4e9  # activations, CUDA graphs, sampler: kept out of the KV pool


@dataclass(frozen=True)
class Shape:
    """Transformer shape (Vidur's columns) and its layer count."""

    n_head: int
    n_kv_head: int
    n_embd: int
    n_expanded_embd: int
    vocab_size: int
    layers: int

    @property
    def head_dim(self) -> int:
        """Per-head dimension."""
        return self.n_embd // self.n_head

    def parameters(self) -> float:
        """Weights: attention, gated MLP, embedding and LM head."""
        attn = self.n_embd * (self.n_head + 2 * self.n_kv_head) * self.head_dim
        attn += self.n_embd * self.n_head * self.head_dim
        mlp = 3 * self.n_embd * self.n_expanded_embd
        return self.layers * (attn + mlp) + 2 * self.vocab_size * self.n_embd

    def op_size(self, op: str) -> float:
        """Weight (GEMM) or activation (elementwise) size one operator works through."""
        hd = self.head_dim
        sizes = {
            "attn_pre_proj": self.n_embd * (self.n_head + 2 * self.n_kv_head) * hd,
            "attn_post_proj": self.n_embd * self.n_head * hd,
            "mlp_up_proj": self.n_embd * 2 * self.n_expanded_embd,
            "mlp_down_proj": self.n_expanded_embd * self.n_embd,
            "mlp_act": self.n_expanded_embd,
            "attn_rope": (self.n_head + self.n_kv_head) * hd,
        }
        return float(sizes.get(op, self.n_embd))


@dataclass(frozen=True)
class OperatorTable:
    """Per-layer operator medians (seconds) by token count at one tensor-parallel degree."""

    path: Path
    shape: Shape
    tp: int
    num_tokens: np.ndarray
    op_s: dict[str, np.ndarray]
    emb_s: np.ndarray


@dataclass(frozen=True)
class FitReport:
    """Held-out relative errors of one fit."""

    train_rows: int
    held_out_rows: int
    median_abs_err: float
    worst_abs_err: float
    worst_at_tokens: int


def _open(path: Path) -> IO[str]:
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8", newline="")
    return path.open("r", encoding="utf-8", newline="")


def _read_rows(path: Path) -> list[dict[str, str]]:
    try:
        with _open(path) as fh:
            return list(csv.DictReader(fh))
    except FileNotFoundError:
        raise InputError(f"measurements file {path} does not exist") from None
    except (OSError, EOFError, UnicodeDecodeError, csv.Error) as exc:
        raise InputError(f"measurements file {path} cannot be read: {exc}") from None


def _number(path: Path, lineno: int, column: str, text: str | None) -> float:
    try:
        value = float(text)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise InputError(f"{path}:{lineno}: {column} is not a number: {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise InputError(f"{path}:{lineno}: {column} must be a finite number >= 0, got {text}")
    return value


def is_operator_csv(path: Path) -> bool:
    """True when `path` holds Vidur operator columns (`time_stats.OP.median`)."""
    with _open(path) as fh:
        header = fh.readline()
    return "time_stats." in header


def load_operator_table(path: str | Path, tp: int, layers: int) -> OperatorTable:
    """Operator medians of a Vidur `mlp.csv` at tensor-parallel degree `tp` (ms -> s)."""
    path = Path(path)
    rows = _read_rows(path)
    needed = ["num_tokens", "num_tensor_parallel_workers", *SHAPE_COLUMNS]
    needed += [f"time_stats.{op}.median" for op in (*LAYER_OPS, "emb")]
    missing = [c for c in needed if rows and c not in rows[0]]
    if not rows or missing:
        raise InputError(f"{path}: not a Vidur operator profile (missing {missing or 'rows'})")
    picked = [(i + 2, r) for i, r in enumerate(rows) if r["num_tensor_parallel_workers"] == str(tp)]
    if not picked:
        degrees = sorted({r["num_tensor_parallel_workers"] for r in rows}, key=int)
        raise InputError(f"{path}: no rows at tensor parallel {tp} (has {', '.join(degrees)})")
    picked.sort(key=lambda item: float(item[1]["num_tokens"]))
    first = picked[0][1]
    shape = Shape(**{c: int(first[c]) for c in SHAPE_COLUMNS}, layers=layers)
    tokens = np.array([_number(path, n, "num_tokens", r["num_tokens"]) for n, r in picked])
    op_s = {
        op: np.array([_number(path, n, op, r[f"time_stats.{op}.median"]) for n, r in picked])
        / 1000.0
        for op in (*LAYER_OPS, "emb")
    }
    emb = op_s.pop("emb")
    return OperatorTable(path, shape, tp, tokens.astype(np.int64), op_s, emb)


def load_all_reduce(path: str | Path, workers: int) -> tuple[np.ndarray, np.ndarray]:
    """(message bytes, seconds) of all-reduce among `workers` GPUs of one node."""
    path = Path(path)
    rows = [
        r for r in _read_rows(path)
        if r.get("num_workers") == str(workers) and r.get("devices_per_node") == str(workers)
    ]
    if not rows:
        raise InputError(f"{path}: no all-reduce rows for {workers} workers in one node")
    size = np.array([float(r["size"]) for r in rows])
    seconds = np.array([float(r["time_stats.all_reduce.median"]) for r in rows]) / 1000.0
    order = np.argsort(size)
    return size[order], seconds[order]


def all_reduce_s(table: tuple[np.ndarray, np.ndarray], size_bytes: np.ndarray) -> np.ndarray:
    """All-reduce time of each message size: interpolated, extrapolated by the last slope."""
    size, seconds = table
    inside = np.interp(size_bytes, size, seconds)
    slope = (seconds[-1] - seconds[-2]) / (size[-1] - size[-2])
    return np.where(size_bytes > size[-1], seconds[-1] + slope * (size_bytes - size[-1]), inside)


def reshape(table: OperatorTable, target: Shape) -> OperatorTable:
    """Operator times of `target` on the same GPU, scaled per operator by size ratio."""
    src = table.shape
    op_s = {op: s * target.op_size(op) / src.op_size(op) for op, s in table.op_s.items()}
    emb = table.emb_s * target.op_size("emb") / src.op_size("emb")
    return OperatorTable(table.path, target, table.tp, table.num_tokens, op_s, emb)


def step_seconds(table: OperatorTable,
                 all_reduce: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """Non-attention step time of the whole model at each measured token count."""
    layer = sum(OP_COUNT.get(op, 1) * s for op, s in table.op_s.items())
    total = table.emb_s + table.shape.layers * np.asarray(layer)
    if table.tp > 1:
        if all_reduce is None:
            raise InputError(f"tensor parallel {table.tp} needs all-reduce measurements")
        message = table.num_tokens * table.shape.n_embd * BF16_BYTES
        total = total + table.shape.layers * 2 * all_reduce_s(all_reduce, message)
    return np.asarray(total, dtype=float)


def load_step_csv(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, seconds) of a plain `num_tokens,step_s` measurements CSV."""
    path = Path(path)
    rows = _read_rows(path)
    if not rows or not {"num_tokens", "step_s"} <= set(rows[0]):
        raise InputError(
            f"{path}: expected columns num_tokens,step_s (or a Vidur operator profile)"
        )
    tokens = np.array([_number(path, i + 2, "num_tokens", r["num_tokens"])
                       for i, r in enumerate(rows)])
    seconds = np.array([_number(path, i + 2, "step_s", r["step_s"]) for i, r in enumerate(rows)])
    order = np.argsort(tokens, kind="stable")
    return tokens[order].astype(np.int64), seconds[order]


def holdout_mask(n: int) -> np.ndarray:
    """True for held-out rows: every `HOLDOUT_EVERY`-th, from the third (never the ends)."""
    mask = np.arange(n) % HOLDOUT_EVERY == 2
    mask[0] = mask[-1] = False
    return mask


def fit_points(tokens: np.ndarray, seconds: np.ndarray) -> tuple[tuple[int, float], ...]:
    """Non-decreasing piecewise-linear knots fitted by least squares on relative error, plus
    one extrapolated knot at `EXTEND_TO_TOKENS` when the data stop short of it."""
    lo, hi = int(tokens.min()), int(tokens.max())
    knots = sorted({k for k in KNOTS if lo <= k <= hi} | {lo, hi})
    if len(knots) < 2:
        raise InputError("measurements span a single token count; need at least two")
    x = tokens.astype(float)
    basis = np.zeros((len(x), len(knots)))
    for j, k in enumerate(knots):
        hat = np.zeros_like(x)
        if j > 0:
            left = knots[j - 1]
            m = (x >= left) & (x <= k)
            hat[m] = (x[m] - left) / (k - left)
        if j < len(knots) - 1:
            right = knots[j + 1]
            m = (x >= k) & (x <= right)
            hat[m] = (right - x[m]) / (right - k)
        basis[:, j] = hat
    # Knot values as cumulative sums of non-negative increments: a step never gets cheaper
    # with more tokens, whatever the noise of single measurements.
    cumulative = basis @ np.tril(np.ones((len(knots), len(knots))))
    weights = 1.0 / np.maximum(seconds, 1e-9)  # least squares on relative error
    increments, _ = nnls(cumulative * weights[:, None], seconds * weights)
    values = np.cumsum(increments)
    points = [(int(k), float(v)) for k, v in zip(knots, values, strict=True)]
    if hi < EXTEND_TO_TOKENS:
        # Past the data, GEMMs are compute bound: time grows with tokens at the slope of the
        # upper half of the measured range (one short last segment would be noise).
        half = min(knots, key=lambda k: abs(k - hi / 2))
        v_half = float(values[knots.index(half)])
        slope = (points[-1][1] - v_half) / (hi - half)
        points.append((EXTEND_TO_TOKENS, points[-1][1] + slope * (EXTEND_TO_TOKENS - hi)))
    return tuple(points)


def relative_errors(points: tuple[tuple[int, float], ...], tokens: np.ndarray,
                    seconds: np.ndarray) -> np.ndarray:
    """|predicted / measured - 1| of a linear-points curve at each row."""
    probe = StepProfile("probe", points, 0.0, 0.0, 1, "")
    predicted = np.array([probe.linear_s(int(t)) for t in tokens])
    return np.abs(predicted / seconds - 1.0)


def fit_with_holdout(tokens: np.ndarray,
                     seconds: np.ndarray) -> tuple[tuple[tuple[int, float], ...], FitReport]:
    """Fit on the training rows; report the errors on the held-out ones."""
    if len(tokens) < 2 * HOLDOUT_EVERY:
        raise InputError(f"need at least {2 * HOLDOUT_EVERY} measured rows, got {len(tokens)}")
    held = holdout_mask(len(tokens))
    points = fit_points(tokens[~held], seconds[~held])
    errors = relative_errors(points, tokens[held], seconds[held])
    worst = int(np.argmax(errors))
    report = FitReport(
        train_rows=int((~held).sum()),
        held_out_rows=int(held.sum()),
        median_abs_err=float(np.median(errors)),
        worst_abs_err=float(errors[worst]),
        worst_at_tokens=int(tokens[held][worst]),
    )
    return points, report


def attention_constants(shape: Shape, gpu: Gpu, tp: int) -> tuple[float, float, int]:
    """(decode s per KV token, prefill s per (query, key) pair, KV capacity tokens) per GPU
    of a `tp`-way shard, from FLOPs, HBM bandwidth and memory (not from measurements)."""
    kv_bytes_per_token = 2 * shape.layers * shape.n_kv_head * shape.head_dim * BF16_BYTES / tp
    decode = kv_bytes_per_token / (DECODE_BANDWIDTH_EFFICIENCY * gpu.hbm_bytes_per_s)
    flops_per_pair = 4 * shape.n_head * shape.head_dim * shape.layers / tp
    prefill = flops_per_pair / (PREFILL_FLOPS_EFFICIENCY * gpu.dense_bf16_flops)
    free = (gpu.memory_bytes * GPU_MEMORY_UTILIZATION
            - shape.parameters() * BF16_BYTES / tp - ACTIVATION_RESERVE_BYTES)
    if free <= 0:
        raise InputError(f"the model's weights do not fit on {tp} x {gpu.name}")
    capacity = int(free / kv_bytes_per_token) // 1000 * 1000
    return decode, prefill, capacity


def profile_toml(profile: StepProfile, report: FitReport, notes: str) -> str:
    """The profile as a data file (`models/sim/data/profiles/*.toml`)."""
    points = ",\n".join(f"  [{t}, {s:.6e}]" for t, s in profile.linear_points)
    comment = "".join(f"# {line}\n" for line in textwrap.wrap(
        f"Step-time profile (models/sim/profiles.py). {notes}", 90))
    return (
        f"{comment}"
        f'name = "{profile.name}"\n'
        f'source = "{profile.source}"\n'
        f"decode_s_per_kv_token = {profile.decode_s_per_kv_token:.6e}\n"
        f"prefill_s_per_pair = {profile.prefill_s_per_pair:.6e}\n"
        f"kv_capacity_tokens = {profile.kv_capacity_tokens}\n"
        f"# non-attention step time: (scheduled tokens, seconds), fitted\n"
        f"linear_points = [\n{points},\n]\n\n"
        f"[fit]\n"
        f"train_rows = {report.train_rows}\n"
        f"held_out_rows = {report.held_out_rows}\n"
        f"held_out_median_abs_err = {report.median_abs_err:.4f}\n"
        f"held_out_worst_abs_err = {report.worst_abs_err:.4f}\n"
        f"worst_at_tokens = {report.worst_at_tokens}\n"
    )


def fit_file(path: str | Path, *, name: str, gpu: str | None = None, layers: int | None = None,
             tp: int = 1, all_reduce_path: str | Path | None = None,
             like: StepProfile | None = None) -> tuple[StepProfile, FitReport]:
    """Fit a profile from a measurements file (either form, see the module docstring).

    Operator tables need `layers` and `gpu` (attention from the table's shape and the GPU's
    data sheet); plain step times take the attention constants and KV capacity of `like`.
    """
    path = Path(path)
    if not path.is_file():
        raise InputError(f"measurements file {path} does not exist")
    if tp < 1:
        raise InputError(f"--tp must be >= 1, got {tp}")
    if is_operator_csv(path):
        if layers is None or layers < 1:
            raise InputError(f"{path} holds per-layer operator times: give --layers (>= 1)")
        if gpu not in GPUS:
            raise InputError(f"--gpu must be one of {', '.join(GPUS)}, got {gpu!r}")
        table = load_operator_table(path, tp, layers)
        all_reduce = None
        if tp > 1:
            ar_path = Path(all_reduce_path or VIDUR_DIR / f"{gpu}-all-reduce.csv.gz")
            all_reduce = load_all_reduce(ar_path, tp)
        tokens, seconds = table.num_tokens, step_seconds(table, all_reduce)
        decode, prefill, capacity = attention_constants(table.shape, GPUS[gpu], tp)
        source = (f"fitted from {path.name} (operator times, tp {tp}, {layers} layers); "
                  f"attention from FLOPs and HBM bandwidth ({gpu} data sheet)")
    else:
        if like is None:
            raise InputError("plain step times need --like PROFILE for the attention terms")
        tokens, seconds = load_step_csv(path)
        decode, prefill = like.decode_s_per_kv_token, like.prefill_s_per_pair
        capacity = like.kv_capacity_tokens
        source = (f"fitted from {path.name} (step times); attention terms and KV capacity of "
                  f"{like.name}")
    points, report = fit_with_holdout(tokens, seconds)
    return StepProfile(name, points, decode, prefill, capacity, source), report
