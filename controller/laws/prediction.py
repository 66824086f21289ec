"""A Smith predictor for the burns: the law tracks the burn that the budget in force now
will cause, not the one that the budget of 15-25 s ago caused.

The burns come late: each observation covers the source's rules window and is as old as the
last scrape and rule evaluation, and the fast burn window adds its own length. A loop that
integrates such a signal climbs past the edge by its climb rate times that delay before the
burn shows, and is then cut for the burn of a budget it no longer has: a limit cycle whose
troughs cost more than its peaks carry. The share of interactive samples over the SLO that
batch causes grows with the batch rate (each batch prefill chunk a step carries is a gap
over the SLO for every interactive decode in it), so, per output, the law sees

    predicted = burn * (1 - s) + burn * s * min(max_ratio, u_now / u_seen)

with s the reading's batch share (the share of its over-SLO samples that fell in steps
carrying batch tokens, or of interactive wait spent behind batch prefill; NaN where the
engines export no interference series: then `unknown_share`, and only for a budget that
rose, so a prediction without attribution never makes the law bolder; a TTFT share that
is unknown only because no interactive request waited in the queue has already taken the
ITL share, `controller.burn.attributed_shares`) and u_seen the mean
budget applied over the span the reading covers, [now - age - observation window - burn
window, now - age]. A budget that rose since its
burn was read is seen to burn more before the burn shows; one that was just cut is not cut
again for the burn of the budget before it. This is Smith's predictor (1957) with a model
that is a proportion, so no identified plant is needed. The supervisor's cuts read the
measured burns, never these.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import ClassVar

from borrowd.controller.laws.base import Law, LawTick, Proposal
from borrowd.controller.laws.history import AppliedHistory
from borrowd.models.errors import ConfigError


@dataclass(frozen=True)
class PredictConfig:
    """Whether the law tracks predicted burns, and how far a prediction may scale one."""

    # Keys that lived here once: where an old config's key went (the loader says so).
    MOVED_KEYS: ClassVar[dict[str, str]] = {"step_share_for_ttft": "burn.step_share_for_ttft"}

    enabled: bool = field(
        default=True,
        metadata={"unit": "bool", "help": "the law tracks each burn scaled, in the share batch "
                                          "caused, by the budget now over the budget it read"},
    )
    max_ratio: float = field(
        default=4.0,
        metadata={"unit": "1", "help": "the most a prediction scales the batch-caused burn"},
    )
    unknown_share: float = field(
        default=1.0,
        metadata={"unit": "1", "help": "the batch share assumed where the engines export no "
                                       "interference series, only ever to predict more burn "
                                       "(a budget that rose); 0: no prediction there"},
    )

    def __post_init__(self) -> None:
        if not self.max_ratio >= 1.0:
            raise ConfigError(f"predict.max_ratio must be >= 1, got {self.max_ratio!r}")
        if not 0.0 <= self.unknown_share <= 1.0:
            raise ConfigError(
                f"predict.unknown_share must be in [0, 1], got {self.unknown_share!r}")


def predicted_burn(burn: float, batch_share: float, u_now_tokens_per_s: float,
                   u_seen_tokens_per_s: float, max_ratio: float,
                   unknown_share: float) -> float:
    """The burn that the budget now will cause, from one read under `u_seen_tokens_per_s`
    (module docstring); the burn as read when the budget it was read under is unknown. An
    unknown batch share (NaN) counts as `unknown_share`, and then only where the budget
    rose: without the engines' attribution a prediction may make the law more careful,
    never bolder."""
    u_seen = u_seen_tokens_per_s
    if not (math.isfinite(burn) and math.isfinite(u_seen)) or u_seen <= 0.0:
        return burn
    ratio = min(max_ratio, max(u_now_tokens_per_s, 0.0) / u_seen)
    if math.isfinite(batch_share):
        share = min(max(batch_share, 0.0), 1.0)
    elif ratio > 1.0:
        share = unknown_share
    else:
        return burn
    return burn * (1.0 - share) + burn * share * ratio


class BurnPredicted:
    """A `Law` that hands the wrapped law predicted burns (module docstring)."""

    def __init__(self, inner: Law, config: PredictConfig) -> None:
        self.inner = inner
        self.config = config
        self.history = AppliedHistory()
        self.last_ratio = math.nan

    def propose(self, tick: LawTick) -> Proposal:
        """Predict each burn from the budget history, then ask the wrapped law."""
        if not self.config.enabled:
            return self.inner.propose(tick)
        obs = tick.obs
        age_s = obs.age_s if math.isfinite(obs.age_s) else 0.0
        rules_s = obs.window_s if math.isfinite(obs.window_s) else 0.0
        end_s = obs.now_s - max(age_s, 0.0)
        burns = []
        for burn, share, window_s in zip(tick.burns, tick.burn_batch_shares, tick.burn_windows_s,
                                         strict=True):
            span_s = rules_s + (window_s if math.isfinite(window_s) else 0.0)
            u_seen = self.history.mean(end_s - span_s, end_s)
            burns.append(predicted_burn(burn, share, tick.u_applied_tokens_per_s, u_seen,
                                        self.config.max_ratio, self.config.unknown_share))
            if math.isfinite(u_seen) and u_seen > 0:
                self.last_ratio = tick.u_applied_tokens_per_s / u_seen
        return self.inner.propose(replace(tick, burns=tuple(burns)))

    def applied(self, tick: LawTick, u_tokens_per_s: float) -> None:
        """Remember the budget applied from this tick on, then pass it on."""
        self.history.record(tick.obs.now_s, u_tokens_per_s)
        self.inner.applied(tick, u_tokens_per_s)

    def state(self) -> dict[str, float]:
        """The last budget ratio (now / as read) beside the wrapped law's state."""
        return {"predict_budget_ratio": self.last_ratio, **self.inner.state()}
