"""Step-time profiles: how long one engine step of a given shape takes on a given GPU.

    step_s = linear(scheduled_tokens)                     (GEMMs of the linear layers)
           + decode_s_per_kv_token * decode_kv_tokens     (decode attention, memory bound)
           + prefill_s_per_pair * prefill_attention_pairs (prefill attention, compute bound)

`linear` is piecewise linear through measured forward-pass times of the linear layers and
extends past the last point with the last segment's slope. `decode_kv_tokens` is the sum,
over decoding sequences, of the KV tokens each attends to; a prefill chunk of `c` tokens
after `p` computed ones attends to `c * p + c * (c + 1) / 2` (query, key) pairs.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

from models.errors import InputError

# Llama-3-8B in bf16: 32 layers x 8 KV heads x 128 head dim x 2 (K and V) x 2 bytes
# = 131072 bytes = 128 KiB of KV cache per token (model card shape, config.json of
# meta-llama/Meta-Llama-3-8B).
KV_BYTES_PER_TOKEN = 128 * 1024

# Attention FLOPs per (query, key) pair over the whole model: QK^T and PV, 2 FLOPs each per
# element of the 32 heads x 128 dims, in 32 layers: 2 * 2 * 4096 * 32.
ATTENTION_FLOPS_PER_PAIR = 4 * 4096 * 32


@dataclass(frozen=True)
class StepProfile:
    """Calibrated step-time model of one model on one GPU (see the module docstring)."""

    name: str
    linear_points: tuple[tuple[int, float], ...]  # (scheduled tokens, seconds), ascending
    decode_s_per_kv_token: float
    prefill_s_per_pair: float
    kv_capacity_tokens: int
    source: str

    def linear_s(self, tokens: int) -> float:
        """Time of the linear layers for a step of `tokens` scheduled tokens (0 -> 0)."""
        if tokens <= 0:
            return 0.0
        pts = self.linear_points
        for (t0, s0), (t1, s1) in pairwise(pts):
            if tokens <= t1:
                return s0 + (s1 - s0) * (tokens - t0) / (t1 - t0)
        (t0, s0), (t1, s1) = pts[-2], pts[-1]
        return s1 + (s1 - s0) * (tokens - t1) / (t1 - t0)

    def step_s(self, tokens: int, decode_kv_tokens: int, prefill_pairs: int) -> float:
        """Duration of one step (see the module docstring)."""
        return (
            self.linear_s(tokens)
            + self.decode_s_per_kv_token * decode_kv_tokens
            + self.prefill_s_per_pair * prefill_pairs
        )

    def linear_coefficients(self) -> tuple[tuple[int, float, float], ...]:
        """Segments as (upper token bound, intercept s, slope s per token) for fast lookup.

        The last segment has an upper bound of 2**62 (extrapolation with the last slope).
        """
        pts = self.linear_points
        out = []
        for i, ((t0, s0), (t1, s1)) in enumerate(pairwise(pts)):
            slope = (s1 - s0) / (t1 - t0)
            upper = t1 if i < len(pts) - 2 else 2**62
            out.append((upper, s0 - slope * t0, slope))
        return tuple(out)


# H100 SXM 80 GB, Llama-3-8B bf16.
# - Linear layers: public per-forward-pass figures for a 7-8B model on H100 (issue #2):
#   5.6 ms at 1 token, 12 ms at 512, 40 ms at 2048, 84 ms at 4096.
# - Decode attention: the A100 figure of 2.5 ns per KV token per layer (32 layers, below)
#   scaled by HBM bandwidth, A100 80GB SXM 2.039 TB/s vs H100 SXM 3.35 TB/s (NVIDIA data
#   sheets): 2.5e-9 * 32 * 2.039 / 3.35 = 48.7 ns per KV token.
# - Prefill attention: ATTENTION_FLOPS_PER_PAIR at 50% of H100 SXM dense bf16 989 TFLOP/s
#   (FlashAttention-2/3 forward efficiency is 40-75% on H100): 1.06 ns per pair.
# - KV capacity: (80 GB x 0.92 gpu_memory_utilization - 16 GB weights - activations and
#   CUDA graphs) / 128 KiB per token, about 400k tokens (issue #2).
H100_LLAMA3_8B = StepProfile(
    name="h100-llama3-8b",
    linear_points=((1, 5.6e-3), (512, 12.0e-3), (2048, 40.0e-3), (4096, 84.0e-3)),
    decode_s_per_kv_token=2.5e-9 * 32 * 2.039 / 3.35,
    prefill_s_per_pair=ATTENTION_FLOPS_PER_PAIR / (0.5 * 989e12),
    kv_capacity_tokens=400_000,
    source="issue #2 public figures; NVIDIA H100/A100 data sheets; Llama-3-8B config",
)

# A100 SXM 80 GB, Llama-3-8B bf16.
# - Linear layers: public figures for Llama-3-8B on A100 (issue #2): 9.7 ms at 1 token,
#   34.6 ms at 512, 146 ms at 2048, 274 ms at 4096.
# - Decode attention: 2.5 ns per KV token per layer x 32 layers = 80 ns per KV token
#   (issue #2).
# - Prefill attention: ATTENTION_FLOPS_PER_PAIR at 50% of A100 dense bf16 312 TFLOP/s:
#   3.36 ns per pair.
# - KV capacity: same 80 GB of memory and the same model as the H100 profile: 400k tokens.
A100_LLAMA3_8B = StepProfile(
    name="a100-llama3-8b",
    linear_points=((1, 9.7e-3), (512, 34.6e-3), (2048, 146.0e-3), (4096, 274.0e-3)),
    decode_s_per_kv_token=2.5e-9 * 32,
    prefill_s_per_pair=ATTENTION_FLOPS_PER_PAIR / (0.5 * 312e12),
    kv_capacity_tokens=400_000,
    source="issue #2 public figures; NVIDIA A100 data sheet; Llama-3-8B config",
)

PROFILES: dict[str, StepProfile] = {p.name: p for p in (H100_LLAMA3_8B, A100_LLAMA3_8B)}
DEFAULT_PROFILE = H100_LLAMA3_8B.name


def get_profile(name: str) -> StepProfile:
    """The profile called `name`; `InputError` naming the known ones otherwise."""
    try:
        return PROFILES[name]
    except KeyError:
        known = ", ".join(sorted(PROFILES))
        raise InputError(f"unknown profile {name!r} (known: {known})") from None
