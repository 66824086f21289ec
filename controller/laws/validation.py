"""A budget that follows use: congestion-window validation, as a wrapper around any law.

As TCP does for an application-limited sender (RFC 7661), the budget does not grow while
batch work does not use what it has, and grows from what was actually carried:

    carried_peak = highest measured batch token rate of the last `window_s`
    u            = min(u_law, max(floor, (1 + headroom) * carried_peak))
    floor        = floor_frac * u_max

so a pool without batch demand keeps a small budget instead of winding up to u_max, and the
first wave of batch work after a quiet spell is admitted at a rate the loop can follow. A
tick whose batch rate is not measured leaves the ceiling where it was.

Batch is application-limited only while it runs fewer sequences than the budget's sequence
cap allows. At the cap it is held by the budget itself (its requests decode longer than the
cap's tokens/s per sequence assumes: long outputs, a slow engine), so that tick counts as
carrying the whole budget applied; otherwise the ceiling and the cap that follows the budget
would hold each other at the floor for good.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace

from borrowd.controller.laws.base import Law, LawTick, Proposal
from borrowd.models.errors import ConfigError


@dataclass(frozen=True)
class ValidationConfig:
    """How far the budget may run ahead of the batch rate actually carried."""

    enabled: bool = field(default=True, metadata={"unit": "bool", "help": "validate growth"})
    headroom: float = field(
        default=0.5,
        metadata={"unit": "1", "help": "budget may exceed the carried peak by this share"},
    )
    window_s: float = field(
        default=30.0, metadata={"unit": "s", "help": "the carried peak is over this window"}
    )
    floor_frac: float = field(
        default=0.05,
        metadata={"unit": "x u_max", "help": "the ceiling never falls below this share of u_max"},
    )

    def __post_init__(self) -> None:
        if self.headroom < 0 or self.window_s <= 0 or not 0 < self.floor_frac <= 1:
            raise ConfigError(
                "validation needs headroom >= 0, window_s > 0 and floor_frac in (0, 1], got "
                f"{self.headroom!r}, {self.window_s!r}, {self.floor_frac!r}"
            )


def cap_limited(tick: LawTick) -> bool:
    """True when the batch sequences in flight fill the sequence cap in force."""
    running = tick.obs.batch_running_seqs
    return math.isfinite(tick.batch_seqs_cap) and running >= max(1.0, tick.batch_seqs_cap)


class UseValidated:
    """A `Law` whose proposals never run ahead of the batch rate carried (module docstring)."""

    def __init__(self, inner: Law, config: ValidationConfig, u_max_tokens_per_s: float) -> None:
        self.inner = inner
        self.config = config
        self.floor_tokens_per_s = config.floor_frac * u_max_tokens_per_s
        self.carried: deque[tuple[float, float]] = deque()
        self.ceiling_tokens_per_s = self.floor_tokens_per_s

    def propose(self, tick: LawTick) -> Proposal:
        """Ask the wrapped law, then hold its proposal under the validated ceiling."""
        proposal = self.inner.propose(tick)
        if not self.config.enabled:
            return proposal
        now_s, rate = tick.obs.now_s, tick.obs.batch_tokens_per_s
        if math.isfinite(rate) and cap_limited(tick):
            rate = max(rate, tick.u_applied_tokens_per_s)
        if math.isfinite(rate):
            self.carried.append((now_s, rate))
            while self.carried and self.carried[0][0] <= now_s - self.config.window_s:
                self.carried.popleft()
            peak = max(r for _, r in self.carried)
            self.ceiling_tokens_per_s = max(
                self.floor_tokens_per_s, (1.0 + self.config.headroom) * peak
            )
        u = min(proposal.u_tokens_per_s, self.ceiling_tokens_per_s)
        return replace(proposal, u_tokens_per_s=u, ceiling_tokens_per_s=min(
            proposal.ceiling_tokens_per_s, self.ceiling_tokens_per_s))

    def applied(self, tick: LawTick, u_tokens_per_s: float) -> None:
        """Pass the applied budget on."""
        self.inner.applied(tick, u_tokens_per_s)

    def state(self) -> dict[str, float]:
        """The validated ceiling beside the wrapped law's state."""
        return {
            "validated_ceiling_tokens_per_s": self.ceiling_tokens_per_s,
            **self.inner.state(),
        }
