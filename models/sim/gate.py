"""Fleet admission of batch work under a `Budget`, as the router-side gate enforces it.

A batch request of cost `prompt + max_output` tokens is admitted when the budget's mode is
open or ramp, the in-flight batch sequences stay within `max_batch_seqs`, the in-flight
batch KV tokens (prompt + max output) within `max_batch_kv_tokens`, and the token bucket
(rate `batch_tokens_per_s`, depth `batch_burst_tokens`) holds `min(cost, depth)` tokens;
the cost is then taken from the bucket (it may go negative, so the long-run rate holds for
requests larger than the depth). `max_batch_output_tokens` clamps each admitted request.
"""

from __future__ import annotations

import math

from models.budget import Budget, Mode

ADMITTING_MODES = (Mode.OPEN, Mode.RAMP)


class BatchGate:
    """Token bucket plus sequence and KV caps over the fleet's in-flight batch requests."""

    def __init__(self) -> None:
        self.budget: Budget | None = None
        self.level_tokens = 0.0
        self.last_s = 0.0
        self.inflight_seqs = 0
        self.inflight_kv_tokens = 0

    def set_budget(self, budget: Budget, now_s: float) -> None:
        """Enforce `budget` from `now_s`; the bucket starts full on the first budget."""
        if self.budget is None:
            self.level_tokens = float(budget.batch_burst_tokens)
        else:
            self._refill(now_s)
            self.level_tokens = min(self.level_tokens, float(budget.batch_burst_tokens))
        self.budget = budget
        self.last_s = now_s

    def _refill(self, now_s: float) -> None:
        b = self.budget
        if b is not None and now_s > self.last_s:
            self.level_tokens = min(
                float(b.batch_burst_tokens),
                self.level_tokens + b.batch_tokens_per_s * (now_s - self.last_s),
            )
        self.last_s = max(self.last_s, now_s)

    def clamp_output(self, max_output_tokens: int) -> int:
        """Max output tokens of a request admitted now (the budget's output cap applied)."""
        b = self.budget
        if b is None:
            return max_output_tokens
        return min(max_output_tokens, b.max_batch_output_tokens)

    def try_admit(self, prompt_tokens: int, max_output_tokens: int, now_s: float) -> float:
        """Admit one request if the budget allows: 0.0 when admitted, else seconds to wait.

        The wait is `inf` when only a completion (or a new budget) can make room.
        """
        b = self.budget
        if b is None or b.mode not in ADMITTING_MODES or max_output_tokens <= 0:
            return math.inf
        cost = prompt_tokens + max_output_tokens
        if (
            self.inflight_seqs + 1 > b.max_batch_seqs
            or self.inflight_kv_tokens + cost > b.max_batch_kv_tokens
        ):
            return math.inf
        self._refill(now_s)
        need = min(float(cost), float(b.batch_burst_tokens))
        if self.level_tokens < need - 1e-6:
            if b.batch_tokens_per_s <= 0:
                return math.inf
            return (need - self.level_tokens) / b.batch_tokens_per_s
        self.level_tokens -= cost
        self.inflight_seqs += 1
        self.inflight_kv_tokens += cost
        return 0.0

    def release(self, kv_tokens: int) -> None:
        """A batch request of KV cost `kv_tokens` left the fleet (done, revoked or lost)."""
        self.inflight_seqs -= 1
        self.inflight_kv_tokens -= kv_tokens

    def over_caps(self) -> bool:
        """True while in-flight batch work exceeds the current budget's caps."""
        b = self.budget
        if b is None:
            return self.inflight_seqs > 0
        return (
            self.inflight_seqs > b.max_batch_seqs
            or self.inflight_kv_tokens > b.max_batch_kv_tokens
        )
