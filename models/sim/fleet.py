"""A fleet of replica engines behind a router, with replicas that can go down and come back.

Routers: `round-robin` over the replicas that are up, or `least-tokens`: the up replica with
the fewest outstanding tokens (prompt + max output of the requests routed to it and not yet
done). The fleet only routes and counts; the run loop owns time and steps.
"""

from __future__ import annotations

from borrowd.models.errors import InputError
from borrowd.models.sim.cores import EngineCore
from borrowd.models.sim.request import Request
from borrowd.models.sim.scenario import LEAST_TOKENS, ROUND_ROBIN


class Fleet:
    """Replica engines, their up/down state, and the router's outstanding-token counts."""

    def __init__(self, engines: list[EngineCore], router: str) -> None:
        if router not in (ROUND_ROBIN, LEAST_TOKENS):
            raise InputError(f"unknown router {router!r}")
        self.engines = engines
        self.router = router
        self.up = [True] * len(engines)
        self.outstanding_tokens = [0] * len(engines)
        self._rr = 0

    def route(self, req: Request) -> int:
        """Pick the replica for `req` (an up one), record its outstanding tokens, return it."""
        n = len(self.engines)
        up = self.up
        if self.router == ROUND_ROBIN:
            for _ in range(n):
                r = self._rr
                self._rr = (self._rr + 1) % n
                if up[r]:
                    break
            else:
                raise RuntimeError("no replica is up")
        else:
            best = -1
            best_tokens = 0
            for i, tokens in enumerate(self.outstanding_tokens):
                if up[i] and (best < 0 or tokens < best_tokens):
                    best, best_tokens = i, tokens
            if best < 0:
                raise RuntimeError("no replica is up")
            r = best
        req.replica = r
        self.outstanding_tokens[r] += req.prompt_tokens + req.max_output_tokens
        return r

    def done(self, req: Request) -> None:
        """`req` left its replica (finished, aborted or lost)."""
        self.outstanding_tokens[req.replica] -= req.prompt_tokens + req.max_output_tokens

    def any_up(self) -> bool:
        """True while at least one replica is up."""
        return any(self.up)
