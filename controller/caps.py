"""The caps of a budget, derived from its token rate u after the supervisor.

    batch_burst_tokens  = max(min_burst_tokens, ceil(u * burst_s))
    max_batch_seqs      = min(max_seqs, max(1, ceil(u_caps / tokens_per_s_per_seq)))
    max_batch_kv_tokens = min(kv_ceiling, max(min_burst_tokens, ceil(u_caps * kv_residence_s)))
    kv_ceiling          = floor(max_kv_frac * kv_capacity_tokens)   (and <= max_kv_tokens if set)

with u_caps the highest u of the last `hold_s` (so a lower rate drains in-flight work instead
of revoking it) unless the supervisor revokes, and kv_capacity_tokens the KV cache of the
pool's engines that are up (the observation's; the last one known when it is not measured).
With no capacity ever known the ceiling is `max_kv_tokens` if set, else `min_burst_tokens`:
one largest request, so an unknown cache cannot fill up with batch. `Capped` applies this to
any supervised law.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from borrowd.controller.supervisor import SupervisorDecision
from borrowd.models.budget import Budget, Mode, closed_budget
from borrowd.models.errors import ConfigError


@dataclass(frozen=True)
class CapsConfig:
    """How the caps of a budget follow its token rate u (open and ramp modes only)."""

    burst_s: float = field(
        default=2.0, metadata={"unit": "s", "help": "bucket depth as seconds of the rate"}
    )
    min_burst_tokens: int = field(
        default=33792,
        metadata={"unit": "tokens", "help": "least bucket depth: one largest batch request"},
    )
    tokens_per_s_per_seq: float = field(
        default=2000.0,
        metadata={"unit": "tokens/s", "help": "rate that one concurrent batch sequence carries"},
    )
    max_seqs: int = field(
        default=64, metadata={"unit": "sequences", "help": "most concurrent batch sequences"}
    )
    kv_residence_s: float = field(
        default=10.0,
        metadata={"unit": "s", "help": "batch KV tokens = rate x this (Little's law)"},
    )
    max_kv_frac: float = field(
        default=0.5,
        metadata={
            "unit": "fraction of the pool's KV cache",
            "help": "most batch KV tokens in flight (prompt + max output)",
            "gt": 0.0,
            "max": 1.0,
        },
    )
    max_kv_tokens: int | None = field(
        default=None,
        metadata={
            "unit": "tokens",
            "help": "also at most this many (the cap while the pool's KV cache size is unknown)",
        },
    )
    max_output_tokens: int = field(
        default=1024, metadata={"unit": "tokens", "help": "largest output of one batch request"}
    )
    hold_s: float = field(
        default=60.0,
        metadata={
            "unit": "s",
            "help": "caps follow the highest rate of this long (a lower rate drains, not revokes)",
        },
    )

    def __post_init__(self) -> None:
        if self.hold_s < 0:
            raise ConfigError(f"caps.hold_s must be >= 0, got {self.hold_s!r}")
        for name in ("burst_s", "tokens_per_s_per_seq", "kv_residence_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"caps.{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("min_burst_tokens", "max_seqs", "max_output_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"caps.{name} must be >= 1, got {getattr(self, name)!r}")
        if self.max_kv_tokens is not None and self.max_kv_tokens < 1:
            raise ConfigError(f"caps.max_kv_tokens must be >= 1, got {self.max_kv_tokens!r}")
        if not 0.0 < self.max_kv_frac <= 1.0:
            raise ConfigError(f"caps.max_kv_frac must be in (0, 1], got {self.max_kv_frac!r}")


def kv_ceiling_tokens(caps: CapsConfig, kv_capacity_tokens: float) -> int:
    """Most batch KV tokens the pool may hold: `max_kv_frac` of its KV capacity (at most
    `max_kv_tokens` when set); with the capacity unknown (NaN), `max_kv_tokens` if set, else
    `min_burst_tokens` (one largest request)."""
    if not (math.isfinite(kv_capacity_tokens) and kv_capacity_tokens > 0):
        return caps.max_kv_tokens if caps.max_kv_tokens is not None else caps.min_burst_tokens
    ceiling = math.floor(caps.max_kv_frac * kv_capacity_tokens)
    return ceiling if caps.max_kv_tokens is None else min(ceiling, caps.max_kv_tokens)


def derive_budget(
    pool: str,
    mode: Mode,
    reason: str,
    u: float,
    caps: CapsConfig,
    keep: Budget | None = None,
    u_caps: float | None = None,
    kv_capacity_tokens: float = math.nan,
) -> Budget:
    """The `Budget` for rate `u` in `mode`: caps follow `u_caps` (default u) in open/ramp,
    the KV cap within `kv_ceiling_tokens` of the pool's KV capacity (NaN: unknown).

    Otherwise nothing new is admitted; the caps are zero (in-flight batch work is revoked)
    unless `keep` is given, whose caps are kept so that the work in flight drains instead.
    """
    if mode not in (Mode.OPEN, Mode.RAMP) or u <= 0:
        if keep is None:
            return closed_budget(pool, mode, reason)
        return Budget(
            pool=pool,
            mode=mode,
            reason=reason,
            batch_tokens_per_s=0.0,
            batch_burst_tokens=0,
            max_batch_seqs=keep.max_batch_seqs,
            max_batch_kv_tokens=keep.max_batch_kv_tokens,
            max_batch_output_tokens=keep.max_batch_output_tokens,
        )
    cap_rate = max(u, u_caps if u_caps is not None else u)
    return Budget(
        pool=pool,
        mode=mode,
        reason=reason,
        batch_tokens_per_s=u,
        batch_burst_tokens=max(caps.min_burst_tokens, math.ceil(u * caps.burst_s)),
        max_batch_seqs=min(
            caps.max_seqs, max(1, math.ceil(cap_rate / caps.tokens_per_s_per_seq))
        ),
        max_batch_kv_tokens=min(
            kv_ceiling_tokens(caps, kv_capacity_tokens),
            max(caps.min_burst_tokens, math.ceil(cap_rate * caps.kv_residence_s)),
        ),
        max_batch_output_tokens=caps.max_output_tokens,
    )


class Capped:
    """Turns each supervised decision into a `Budget` whose caps follow the recent rates
    and the pool's KV capacity (module docstring); a revoking decision drops the held caps at
    once."""

    def __init__(self, pool: str, config: CapsConfig) -> None:
        self.pool = pool
        self.config = config
        self.last_caps: Budget | None = None
        self.recent_u: deque[tuple[float, float]] = deque()
        self.kv_capacity_tokens = math.nan  # the last one measured

    def budget(self, decision: SupervisorDecision, now_s: float,
               kv_capacity_tokens: float = math.nan) -> Budget:
        """The budget for `decision` at `now_s`, with the pool's KV capacity as observed (NaN:
        not measured this tick; the last one measured holds)."""
        if math.isfinite(kv_capacity_tokens) and kv_capacity_tokens > 0:
            self.kv_capacity_tokens = kv_capacity_tokens
        keep = None if decision.revoke else self.last_caps
        self.recent_u.append((now_s, decision.u))
        while self.recent_u and self.recent_u[0][0] < now_s - self.config.hold_s:
            self.recent_u.popleft()
        u_caps = max(u for _, u in self.recent_u) if not decision.revoke else decision.u
        budget = derive_budget(
            self.pool, decision.mode, decision.reason, decision.u, self.config, keep, u_caps,
            self.kv_capacity_tokens,
        )
        self.last_caps = budget if budget.max_batch_seqs > 0 else None
        return budget
