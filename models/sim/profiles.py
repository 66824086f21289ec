"""Step-time profiles: how long one engine step of a given shape takes on a given GPU.

    step_s = linear(scheduled_tokens)                     (every non-attention operator)
           + decode_s_per_kv_token * decode_kv_tokens     (decode attention, memory bound)
           + prefill_s_per_pair * prefill_attention_pairs (prefill attention, compute bound)

`linear` is piecewise linear through fitted points and extends past the last point with
the last segment's slope. `decode_kv_tokens` is the sum, over decoding sequences, of the KV
tokens each attends to; a prefill chunk of `c` tokens after `p` computed ones attends to
`c * p + c * (c + 1) / 2` (query, key) pairs.

A profile is data: a TOML file (`models/sim/data/profiles/NAME.toml` for the built-in ones,
fitted from Vidur's measured operator times by `models.sim.profile_builtins`; any other file
by path, e.g. written by `borrowd profile fit`). The linear points are fitted from
measurements; the two attention constants come from FLOPs and memory bandwidth, because
the measurements hold no attention times.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

from borrowd.models.errors import InputError


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


PROFILES_DIR = Path(__file__).resolve().parent / "data" / "profiles"
PROFILE_KEYS = ("name", "source", "decode_s_per_kv_token", "prefill_s_per_pair",
                "kv_capacity_tokens", "linear_points", "fit")


def load_profile(path: str | Path) -> StepProfile:
    """The profile in TOML file `path`; `InputError` naming the key and bad value."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"profile file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"profile file {path} cannot be read: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise InputError(f"profile file {path}: not valid TOML: {exc}") from None
    where = f"profile file {path}"
    unknown = sorted(set(data) - set(PROFILE_KEYS))
    if unknown:
        raise InputError(f"{where}: unknown key {unknown[0]!r}")
    for key in PROFILE_KEYS[:-1]:
        if key not in data:
            raise InputError(f"{where}: missing key {key!r}")
    for key in ("decode_s_per_kv_token", "prefill_s_per_pair"):
        value = data[key]
        if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
            raise InputError(f"{where}: {key} must be a number >= 0, got {value!r}")
    capacity = data["kv_capacity_tokens"]
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
        raise InputError(f"{where}: kv_capacity_tokens must be an integer > 0, got {capacity!r}")
    points = data["linear_points"]
    if not isinstance(points, list) or len(points) < 2:
        raise InputError(f"{where}: linear_points must list at least two [tokens, seconds] "
                         f"pairs, got {points!r}")
    pairs: list[tuple[int, float]] = []
    for point in points:
        if (not isinstance(point, list) or len(point) != 2 or not isinstance(point[0], int)
                or not isinstance(point[1], int | float) or point[1] < 0):
            raise InputError(f"{where}: linear_points entry must be [tokens, seconds >= 0], "
                             f"got {point!r}")
        if pairs and point[0] <= pairs[-1][0]:
            raise InputError(f"{where}: linear_points tokens must ascend, got {point[0]} "
                             f"after {pairs[-1][0]}")
        pairs.append((point[0], float(point[1])))
    return StepProfile(
        name=str(data["name"]),
        linear_points=tuple(pairs),
        decode_s_per_kv_token=float(data["decode_s_per_kv_token"]),
        prefill_s_per_pair=float(data["prefill_s_per_pair"]),
        kv_capacity_tokens=capacity,
        source=str(data["source"]),
    )


def _builtin() -> dict[str, StepProfile]:
    return {p.stem: load_profile(p) for p in sorted(PROFILES_DIR.glob("*.toml"))}


PROFILES: dict[str, StepProfile] = _builtin()
H100_LLAMA3_8B = PROFILES["h100-llama3-8b"]
A100_LLAMA3_8B = PROFILES["a100-llama3-8b"]
DEFAULT_PROFILE = H100_LLAMA3_8B.name
_files: dict[str, StepProfile] = {}


def get_profile(name_or_path: str) -> StepProfile:
    """A built-in profile by name, or a profile TOML file by path; `InputError` naming the
    known ones otherwise."""
    if name_or_path in PROFILES:
        return PROFILES[name_or_path]
    path = Path(name_or_path)
    if name_or_path.endswith(".toml") or path.exists() or len(path.parts) > 1:
        if name_or_path not in _files:
            _files[name_or_path] = load_profile(path)
        return _files[name_or_path]
    known = ", ".join(sorted(PROFILES))
    raise InputError(f"unknown profile {name_or_path!r} (known: {known}; or a profile .toml file)")
