"""Growth that slows near the last budget that burned, as CUBIC's window plateaus near W_max.

The loop's signals come late (the rules window, then scrapes and rule evaluations), so a law
climbing at its usual pace passes the sustainable budget by its climb rate times that delay
before the burn shows; the back-off that follows costs a dip and a long climb back, and a
loop that does this over and over carries less than a constant budget set at the edge.
CUBIC (RFC 9438) spends its time near the window at which it last saw loss: it returns fast,
plateaus near W_max and probes beyond it slowly. As a wrapper around any law:

    drop       the applied budget falls below drop_frac x its highest of the last lookback_s
               (the law's own fall, a back-off, a cut) while batch burns an SLO (a burn
               >= 1 of which batch caused at least batch_share; a p95 past its SLO where no
               burn is read); at most one per lookback_s. A fall with nothing burning (the
               ramp handing over to a law that asks less, a cap) or on a burn that batch did
               not cause (an interactive burst) says nothing about where the edge is. Where
               the engines give no share (no interference series; or 0/0 for first tokens
               in a window with no interactive queue wait and no measured ITL share to stand
               in, `burn.step_share_for_ttft`, as the prediction reads it) it counts as
               unknown_share
               (default 0: the memory stands aside, since there a burst's burn and batch's
               look alike; with it counted the matrix lost rows at the bar on bare engines)
    edge       the highest applied budget of the last lookback_s at the drop: where it burned
    growth     while u_applied >= near_frac x edge, a proposal above u_applied is scaled to
               u_applied + slow_frac x (u - u_applied); decreases pass whole
    forget     memory_s after its drop the edge is forgotten (the load may have moved)

A drop again at a lower level moves the edge down; a level that holds is passed at the slow
pace and then forgotten. Nothing here reads a signal: the wrapped law's own decisions and
the supervisor's, as the applied budget shows them, are the evidence.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, fields, replace

from borrowd.controller.laws.base import Law, LawTick, Proposal
from borrowd.models.config_loader import check
from borrowd.models.enforcement import ADMISSION


@dataclass(frozen=True)
class EdgeConfig:
    """How growth slows near the last budget that was cut (module docstring)."""

    enabled: bool = field(
        default=True,
        metadata={"unit": "bool", "help": "slow growth near the last budget cut on a burn "
                                          "batch caused"},
    )
    admission_only: bool = field(
        default=False,
        metadata={"unit": "bool", "help": "when enabled, only on a pool whose budget the gate "
                                          "alone enforces (controller.enforcement = admission): "
                                          "under the engine plugin its step guard holds the "
                                          "edge step by step"},
    )
    drop_frac: float = field(
        default=0.8,
        metadata={"unit": "1", "help": "a drop: the applied budget under this share of its "
                                       "highest of lookback_s",
                  "gt": 0.0, "max": 1.0},
    )
    lookback_s: float = field(
        default=30.0,
        metadata={"unit": "s", "help": "the edge is the highest budget of this long at a drop "
                                       "(about the signals' delay); one drop per this long",
                  "gt": 0.0},
    )
    near_frac: float = field(
        default=0.8,
        metadata={"unit": "1", "help": "growth slows from this share of the edge",
                  "gt": 0.0, "max": 1.0},
    )
    slow_frac: float = field(
        default=0.25, metadata={"unit": "1", "help": "share of the law's increase kept near "
                                                     "and above the edge",
                  "gt": 0.0, "max": 1.0},
    )
    batch_share: float = field(
        default=0.5,
        metadata={"unit": "1", "help": "a drop sets the edge only on a burn of which batch "
                                       "caused at least this share (where the engines say)",
                  "min": 0.0, "max": 1.0},
    )
    unknown_share: float = field(
        default=0.0,
        metadata={"unit": "1", "help": "the batch share a burn counts as where the engines "
                                       "give none (no interference series, or 0/0; 0: the "
                                       "memory stands aside there)",
                  "min": 0.0, "max": 1.0},
    )
    memory_s: float = field(
        default=300.0, metadata={"unit": "s", "help": "the edge is forgotten this long after "
                                                      "its drop",
                  "gt": 0.0},
    )

    def applies(self, enforcement: str) -> bool:
        """True when the wrapper acts on a pool enforced by `enforcement`."""
        return self.enabled and (not self.admission_only or enforcement == ADMISSION)

    def __post_init__(self) -> None:
        for f in fields(self):  # the bounds in each field's metadata, as the loader checks them
            check(getattr(self, f.name), f.metadata, f"edge.{f.name}")


@dataclass(frozen=True)
class Edge:
    """The budget at the last drop and when it was seen (NaN: none known)."""

    tokens_per_s: float = math.nan
    at_s: float = math.nan

    def known(self, now_s: float, memory_s: float) -> bool:
        """True while the edge is set and younger than `memory_s`."""
        return math.isfinite(self.tokens_per_s) and now_s - self.at_s < memory_s


def shaped_increase(u_proposed: float, u_applied: float, edge: Edge, now_s: float,
                    config: EdgeConfig) -> float:
    """The proposal with its increase scaled by `slow_frac` near and above a known edge."""
    if u_proposed <= u_applied or not edge.known(now_s, config.memory_s):
        return u_proposed
    if u_applied < config.near_frac * edge.tokens_per_s:
        return u_proposed
    return u_applied + config.slow_frac * (u_proposed - u_applied)


def batch_burning(tick: LawTick, batch_share: float, unknown_share: float = 0.0) -> bool:
    """True when batch makes some output spend its SLO faster than its rate: a burn >= 1
    (where measured, else a p95 at or past the SLO) of which batch caused at least
    `batch_share` (a share the engines do not give, NaN, counts as `unknown_share`)."""
    return any(
        (b >= 1.0 if math.isfinite(b) else y >= 1.0)
        and (share if math.isfinite(share) else unknown_share) >= batch_share
        for b, y, share in zip(tick.burns, tick.ys, tick.burn_batch_shares, strict=True)
    )


def next_edge(edge: Edge, recent: deque[tuple[float, float]], now_s: float,
              u_applied: float, config: EdgeConfig, burning: bool = True) -> Edge:
    """The edge after `u_applied` was applied at `now_s`, given the applied budgets of the
    last `lookback_s` in `recent` (a drop while `burning` sets it; one per lookback_s)."""
    peak = max((u for _, u in recent), default=0.0)
    dropped = burning and peak > 0 and u_applied < config.drop_frac * peak
    if not dropped or now_s - edge.at_s < config.lookback_s:
        return edge
    return Edge(peak, now_s)


class EdgeMemory:
    """A `Law` whose increases slow near the last budget that was cut (module docstring), on
    a pool enforced by `enforcement` (`EdgeConfig.applies`)."""

    def __init__(self, inner: Law, config: EdgeConfig, enforcement: str = ADMISSION) -> None:
        self.inner = inner
        self.config = config
        self.active = config.applies(enforcement)
        self.edge = Edge()
        self.recent: deque[tuple[float, float]] = deque()

    def propose(self, tick: LawTick) -> Proposal:
        """Ask the wrapped law, then slow its increase near the edge."""
        proposal = self.inner.propose(tick)
        if not self.active:
            return proposal
        u = shaped_increase(proposal.u_tokens_per_s, tick.u_applied_tokens_per_s, self.edge,
                            tick.obs.now_s, self.config)
        return replace(proposal, u_tokens_per_s=u)

    def applied(self, tick: LawTick, u_tokens_per_s: float) -> None:
        """Pass the applied budget on; a drop from the recent peak sets the edge."""
        self.inner.applied(tick, u_tokens_per_s)
        now_s = tick.obs.now_s
        while self.recent and self.recent[0][0] <= now_s - self.config.lookback_s:
            self.recent.popleft()
        self.edge = next_edge(self.edge, self.recent, now_s, u_tokens_per_s, self.config,
                              batch_burning(tick, self.config.batch_share,
                                            self.config.unknown_share))
        self.recent.append((now_s, u_tokens_per_s))

    def state(self) -> dict[str, float]:
        """The edge beside the wrapped law's state."""
        return {"edge_tokens_per_s": self.edge.tokens_per_s, **self.inner.state()}
