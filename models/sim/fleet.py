"""A fleet of replica engines behind a router, with replicas that can go down and come back.

Routers: `round-robin` over the replicas that are up, or `least-tokens`: the up replica with
the fewest outstanding tokens (prompt + max output of the requests routed to it and not yet
done). Batch goes only to the replicas eligible for it (`batch_replicas`; all by default).
When batch is restricted to some replicas, interactive routing ignores batch entirely (its
own round-robin turn, and only interactive outstanding tokens), so interactive requests go
where they would go with no batch at all and the replicas without batch see exactly the
interactive traffic they saw before borrowing. The fleet only routes and counts; the run
loop owns time and steps.
"""

from __future__ import annotations

from collections.abc import Sequence

from borrowd.models.errors import InputError
from borrowd.models.sim.cores import EngineCore
from borrowd.models.sim.request import BATCH, Request
from borrowd.models.sim.scenario import LEAST_TOKENS, ROUND_ROBIN


class Fleet:
    """Replica engines, their up/down state, and the router's outstanding-token counts."""

    def __init__(self, engines: list[EngineCore], router: str,
                 batch_replicas: Sequence[int] = ()) -> None:
        if router not in (ROUND_ROBIN, LEAST_TOKENS):
            raise InputError(f"unknown router {router!r}")
        n = len(engines)
        if any(not 0 <= r < n for r in batch_replicas):
            raise InputError(f"batch replicas {list(batch_replicas)} outside 0..{n - 1}")
        self.engines = engines
        self.router = router
        self.up = [True] * n
        self.outstanding_tokens = [0] * n
        self.batch_eligible = [not batch_replicas or r in batch_replicas for r in range(n)]
        # With batch on only some replicas, interactive routing must not see batch at all.
        self.restricted = not all(self.batch_eligible)
        self.interactive_tokens = [0] * n
        self._rr = 0
        self._rr_batch = 0

    def route(self, req: Request) -> int:
        """Pick the replica for `req` (an up one; for batch an eligible one), record its
        outstanding tokens, return it."""
        batch = req.klass == BATCH
        if batch:
            allowed = [u and e for u, e in zip(self.up, self.batch_eligible, strict=True)]
        else:
            allowed = self.up
        counts = (
            self.interactive_tokens if self.restricted and not batch else self.outstanding_tokens
        )
        if self.router == ROUND_ROBIN:
            r = self._next_turn(allowed, batch and self.restricted)
        else:
            best = -1
            best_tokens = 0
            for i, tokens in enumerate(counts):
                if allowed[i] and (best < 0 or tokens < best_tokens):
                    best, best_tokens = i, tokens
            if best < 0:
                raise RuntimeError("no replica is up")
            r = best
        req.replica = r
        cost = req.prompt_tokens + req.max_output_tokens
        self.outstanding_tokens[r] += cost
        if not batch:
            self.interactive_tokens[r] += cost
        return r

    def _next_turn(self, allowed: list[bool], batch_turn: bool) -> int:
        """The next allowed replica in round-robin order (batch keeps its own turn when it is
        restricted, so it never shifts interactive's)."""
        n = len(self.engines)
        for _ in range(n):
            if batch_turn:
                r = self._rr_batch
                self._rr_batch = (r + 1) % n
            else:
                r = self._rr
                self._rr = (r + 1) % n
            if allowed[r]:
                return r
        raise RuntimeError("no replica is up")

    def done(self, req: Request) -> None:
        """`req` left its replica (finished, aborted or lost)."""
        cost = req.prompt_tokens + req.max_output_tokens
        self.outstanding_tokens[req.replica] -= cost
        if req.klass != BATCH:
            self.interactive_tokens[req.replica] -= cost

    def any_up(self) -> bool:
        """True while at least one replica is up."""
        return any(self.up)

    def batch_up(self) -> int:
        """Replicas that are up and may take batch."""
        return sum(u and e for u, e in zip(self.up, self.batch_eligible, strict=True))
