"""A budget that follows use: congestion-window validation, as a wrapper around any law.

As TCP does for an application-limited sender (RFC 7661), the budget does not grow while
batch work does not use what it has, and grows from what was actually carried:

    carried_peak = highest measured batch token rate of the last `window_s`
    u            = min(u_law, max(floor, (1 + headroom) * carried_peak))
    floor        = floor_frac * u_max

so a pool without batch demand keeps a small budget instead of winding up to u_max, and the
first wave of batch work after a quiet spell is admitted at a rate the loop can follow. A
tick whose batch rate is not measured leaves the ceiling where it was.

The carried rate is late: it is a rate over the rules' window, `age_s` old, of tokens
produced over each request's life after its admission. Held against the budget applied now,
a budget that batch fills is judged by what a smaller budget carried seconds ago, and a
climb could never outrun `ln(1 + headroom)` per measurement lag (on `seed`, two minutes
from the cold start's 10k to the 70k batch carries at the SLO, at ~2.6%/s). So the carried
rate is held against the budget in force when it was carried (the least budget applied over
the observation's span, `age_s + window_s`): batch that carried a share of that budget is
taken to carry the same share of the budget applied last, and the ceiling is the headroom
above that too,

    ceiling = max(floor, (1 + headroom) * max(carried_peak, carried * u_last / u_in_force))

Batch that fills its budget grows it as fast as the law and the ramp ask (RFC 7661's
validated phase); batch that uses a steady share of a steady budget is held as before
(u_last = u_in_force), and a budget that rose past what batch wants overshoots by at most
one measurement lag's rise before the ceiling pulls it back.

A budget run ahead of its reading is load the latency signals have not seen yet either, so
it runs ahead only while every output's p95 is known far under its SLO (`latency_far`: under
`NEAR_SLO_NORM`, from `KNOWN_SAMPLES` of the slow window), as the cold start's doubling
does; near an SLO the ceiling is the carried peak's alone. On the three-draw 600 s matrix
the ungated rule lifted the cold starts but doubled the held-out windows missed (margin
SLOs: the climb after a reopen outran a sparse TTFT burn).

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

from borrowd.controller.burn import known_far
from borrowd.controller.laws.base import Law, LawTick, Proposal
from borrowd.controller.laws.history import AppliedHistory
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


def latency_far(tick: LawTick) -> bool:
    """True when every output's p95 is known far under its SLO (`controller.burn.known_far`,
    on the burns' slow-window sample counts): room the budget may run into ahead of its late
    carried rate. False where a burn is not read. (Under the engine plugin the p95 ITL sits
    near its SLO by design once batch runs, so there this holds mostly in a cold start: on
    `seed`, from 40 s until the ITL p95 passed half its SLO at ~105 s.)"""
    return all(known_far(n, y) for n, y in zip(tick.burn_slow_samples, tick.ys, strict=True))


class UseValidated:
    """A `Law` whose proposals never run ahead of the batch rate carried (module docstring)."""

    def __init__(self, inner: Law, config: ValidationConfig, u_max_tokens_per_s: float) -> None:
        self.inner = inner
        self.config = config
        self.floor_tokens_per_s = config.floor_frac * u_max_tokens_per_s
        self.carried: deque[tuple[float, float]] = deque()
        self.history = AppliedHistory()
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
            in_force = self._budget_in_force(tick)
            risen = (tick.u_applied_tokens_per_s / in_force
                     if in_force > 0 and latency_far(tick) else 1.0)
            self.ceiling_tokens_per_s = max(
                self.floor_tokens_per_s, (1.0 + self.config.headroom) * max(peak, rate * risen)
            )
        u = min(proposal.u_tokens_per_s, self.ceiling_tokens_per_s)
        return replace(proposal, u_tokens_per_s=u, ceiling_tokens_per_s=min(
            proposal.ceiling_tokens_per_s, self.ceiling_tokens_per_s))

    def _budget_in_force(self, tick: LawTick) -> float:
        """The least budget applied over the span the carried rate was measured on (its age
        and window; the validation window where the observation does not say), 0 before any."""
        obs = tick.obs
        span_s = obs.age_s + obs.window_s
        if not math.isfinite(span_s):
            span_s = self.config.window_s
        return self.history.least_since(obs.now_s - span_s)

    def applied(self, tick: LawTick, u_tokens_per_s: float) -> None:
        """Remember the applied budget (what later carried rates are held against) and pass
        it on."""
        self.history.record(tick.obs.now_s, u_tokens_per_s)
        self.inner.applied(tick, u_tokens_per_s)

    def state(self) -> dict[str, float]:
        """The validated ceiling beside the wrapped law's state."""
        return {
            "validated_ceiling_tokens_per_s": self.ceiling_tokens_per_s,
            **self.inner.state(),
        }
