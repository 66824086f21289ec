"""The budgets a wrapper applied, by time: what a late reading was read under.

A signal read now covers a span that ended `age_s` ago (the rules window, and a burn's own
window before that), so the wrappers that judge a late signal against the budget in force
when it was read (the burn prediction, use validation) keep the budgets applied, each
entry (t_s, u_tokens_per_s) holding from t_s to the next, for `KEEP_S`.
"""

from __future__ import annotations

import math
from collections import deque
from itertools import pairwise

# What the longest span can reach: a minute of burn window, the rules window and the
# signals' age, with room to spare.
KEEP_S = 300.0


def mean_applied(history: deque[tuple[float, float]], start_s: float, end_s: float) -> float:
    """Time-weighted mean of the budget applied (tokens/s) over [start_s, end_s]; each entry
    (t_s, u_tokens_per_s) holds from t_s to the next entry. NaN when the history does not
    reach into the span."""
    if not history or end_s <= start_s:
        return math.nan
    total = weight = 0.0
    for (t, u), (t_next, _) in pairwise([*history, (math.inf, 0.0)]):
        lo, hi = max(t, start_s), min(t_next, end_s)
        if hi > lo:
            total += u * (hi - lo)
            weight += hi - lo
    return total / weight if weight > 0 else math.nan


class AppliedHistory:
    """The budgets applied over the last `KEEP_S` (module docstring)."""

    def __init__(self) -> None:
        self.entries: deque[tuple[float, float]] = deque()

    def record(self, now_s: float, u_tokens_per_s: float) -> None:
        """The budget applied from `now_s` on; entries past `KEEP_S` are forgotten (the one
        in force at the horizon is kept)."""
        self.entries.append((now_s, u_tokens_per_s))
        while len(self.entries) > 1 and self.entries[1][0] < now_s - KEEP_S:
            self.entries.popleft()

    def mean(self, start_s: float, end_s: float) -> float:
        """Time-weighted mean budget over [start_s, end_s] (`mean_applied`)."""
        return mean_applied(self.entries, start_s, end_s)

    def least_since(self, start_s: float) -> float:
        """The least budget in force at any time from `start_s` on (the one in force at
        `start_s` included, as `mean` counts it), 0 before any was applied."""
        least = math.inf
        for t, u in reversed(self.entries):
            least = min(least, u)
            if t <= start_s:
                break
        return least if math.isfinite(least) else 0.0
