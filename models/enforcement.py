"""Engine-side enforcement arithmetic, apart from vLLM: per-step batch allowance and step timing.

    batch_tokens_per_step = 0                                   no usable record, or it
                                                                admits no batch work and
                                                                keeps no caps (revoked)
                          = floor                               it admits no new batch work
                                                                but keeps its caps (drain)
                          = max(floor, batch_tokens_per_s * recent_step_s)   otherwise

A running batch request thus always gets at least `floor` tokens while the budget is open
or draining (never starved into holding its KV forever), and none once the record is
revoked, missing or expired. A closed record that keeps its caps asks the work in flight to
drain: given no tokens it would sit in the engine holding its KV and, to a router that
balances outstanding work, making the engine look busy for as long as the pool stays
closed (an operator's stop never drains). `adapters.vllm_plugin` applies it inside vLLM's
scheduler and the simulator's engine applies it per replica.

The budget record is the pool's; each engine enforces its share (`engine_share`: rate and
caps divided by the engines serving the pool). Applying the whole pool rate on every engine
would let the allowance grow until batch fills whole steps.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from typing import Protocol

from borrowd.models.budget import Budget, Mode

# How a pool's budget is enforced: the simulated fleet's (`Scenario.enforcement`) and the
# daemon's setting for a real pool (`controller.enforcement`).
ADMISSION = "admission"  # batch budget enforced by the admission gate only
ENGINE = "engine"  # the gate plus the engine plugin's per-step batch token limit
ENFORCEMENTS = (ADMISSION, ENGINE)

DEFAULT_MIN_BATCH_TOKENS_PER_STEP = 16  # one KV block of the default block size
INITIAL_STEP_S = 0.03  # until a step was timed: a decode step of an 8B model on an H100
MAX_STEP_S = 1.0  # a stall (idle engine, debugger) must not turn into a huge allowance
STEP_EMA_WEIGHT = 0.2  # weight of the newest step in the recent step time


class BudgetSource(Protocol):
    """Where an engine reads the pool's budget (`adapters.store.BudgetWatcher` in production)."""

    def current(self, now_s: float) -> Budget | None:
        """The fresh record at `now_s`, or None."""
        ...


class StaticBudgetSource:
    """A budget set by the caller (simulations and tests); `None` means no record."""

    def __init__(self, budget: Budget | None = None) -> None:
        self.budget = budget

    def current(self, now_s: float) -> Budget | None:
        """The budget last set, whatever `now_s`."""
        return self.budget


def engine_share(budget: Budget | None, engines: int) -> Budget | None:
    """One engine's share of a pool budget enforced by `engines` engines: the rate, the
    burst and the caps divided among them (sequence cap at least 1 while the pool has one)."""
    if budget is None or engines <= 1:
        return budget
    return dataclasses.replace(
        budget,
        batch_tokens_per_s=budget.batch_tokens_per_s / engines,
        batch_burst_tokens=math.ceil(budget.batch_burst_tokens / engines),
        max_batch_seqs=math.ceil(budget.max_batch_seqs / engines),
        max_batch_kv_tokens=math.ceil(budget.max_batch_kv_tokens / engines),
    )


def draining(budget: Budget | None) -> bool:
    """True when `budget` admits no new batch work but keeps its caps: what is in flight
    finishes (a cut that does not revoke). An operator's stop never drains."""
    return (
        budget is not None
        and not budget.admits_batch
        and budget.max_batch_seqs > 0
        and budget.mode != Mode.STOPPED
    )


def batch_tokens_per_step(budget: Budget | None, recent_step_s: float, floor_tokens: int) -> int:
    """Batch tokens one engine step may schedule under `budget` (see the module docstring)."""
    if budget is None:
        return 0
    if not budget.admits_batch:
        return floor_tokens if draining(budget) else 0
    return max(floor_tokens, math.floor(budget.batch_tokens_per_s * recent_step_s))


def batch_seq_cap(budget: Budget | None) -> int:
    """Batch sequences allowed to run at once: the record's cap while it admits batch work
    or drains it, else 0."""
    if budget is None or not (budget.admits_batch or draining(budget)):
        return 0
    return budget.max_batch_seqs


class StepTimer:
    """Recent engine step time: an exponential average of (output time - schedule time).

    Steps are matched first in, first out, so it also holds with two steps in flight
    (asynchronous scheduling). Each step counts at most `MAX_STEP_S`.

    It also keeps the last step's gap (`take_gap`): the time from the previous step's output
    (or this step's schedule, if later) to this one's, which is what the step's interactive
    decodes waited between two tokens. With two steps in flight the schedule-to-output time
    also holds the previous step's run; the gap does not.
    """

    def __init__(self, initial_s: float = INITIAL_STEP_S) -> None:
        self.recent_s = initial_s
        self._started: deque[float] = deque()
        self._last_output_s = -math.inf
        self._gap_s = math.nan

    def started(self, now_s: float) -> None:
        """A step was scheduled at `now_s`."""
        self._started.append(now_s)

    def finished(self, now_s: float) -> None:
        """The oldest scheduled step's output arrived at `now_s`."""
        if self._started:
            start_s = self._started.popleft()
            self._fold(now_s - start_s)
            self._gap_s = now_s - max(start_s, self._last_output_s)
        self._last_output_s = now_s

    def observe(self, step_s: float) -> None:
        """One step timed elsewhere (the simulator's profile time): its duration, which is
        also its gap."""
        self._fold(step_s)
        self._gap_s = step_s

    def _fold(self, step_s: float) -> None:
        """Fold one step's duration into the recent step time."""
        step_s = min(max(step_s, 0.0), MAX_STEP_S)
        self.recent_s += STEP_EMA_WEIGHT * (step_s - self.recent_s)

    def take_gap(self) -> float:
        """The last step's gap (class docstring), once: NaN until another step is timed."""
        gap_s, self._gap_s = self._gap_s, math.nan
        return gap_s


DEFAULT_STEP_GUARD_FRAC = 0.9  # steps carrying interactive decodes held under this x ITL SLO
STEP_GUARD_DECREASE = 0.7  # the cap after a slow step: this share of the batch tokens carried
STEP_GUARD_INCREASE_TOKENS = 16  # the cap's growth after a fast step that used all of it


class StepGuard:
    """A per-step batch token cap that keeps the steps interactive decodes wait on under
    `target_s`: the engine's own inner loop, with no delay.

    The daemon's budget acts on signals scraped, evaluated and windowed tens of seconds
    late; the engine times every step itself, and a step that carries interactive decodes is
    one inter-token gap of each of them. After such a step that took longer than `target_s`
    while it carried batch tokens, the cap falls to `decrease` x the batch tokens it
    carried; after one within the target whose batch used the whole cap, it grows by
    `increase_tokens` (additive increase, multiplicative decrease, as TCP per round trip; the
    round trip here is one step). A decode of a long batch context costs step time at one
    token, so the cap prices it as measured. Steps without interactive decodes teach it
    nothing. It starts unbounded (the rate allowance alone holds until a step is slow) and
    never falls below one token a step, so batch work in flight always progresses.
    """

    def __init__(self, target_s: float, *, decrease: float = STEP_GUARD_DECREASE,
                 increase_tokens: int = STEP_GUARD_INCREASE_TOKENS) -> None:
        if not (math.isfinite(target_s) and target_s > 0):
            raise ValueError(f"step guard target must be > 0 s, got {target_s!r}")
        if not 0 < decrease < 1 or increase_tokens < 1:
            raise ValueError("step guard needs decrease in (0, 1) and increase_tokens >= 1, "
                             f"got {decrease!r}, {increase_tokens!r}")
        self.target_s = target_s
        self.decrease = decrease
        self.increase_tokens = increase_tokens
        self.cap_tokens = math.inf

    def limit(self, allowance_tokens: int) -> int:
        """`allowance_tokens` (the rate's allowance for the step) within the cap; an
        allowance of 0 (no record, revoked) stays 0."""
        if allowance_tokens <= 0 or math.isinf(self.cap_tokens):
            return allowance_tokens
        return min(allowance_tokens, max(1, math.floor(self.cap_tokens)))

    def observe(self, step_s: float, batch_tokens: int, interactive_gaps: int) -> None:
        """Learn from one finished step: its duration, the batch tokens it carried and how
        many interactive decode tokens (inter-token gaps) waited on it."""
        if interactive_gaps <= 0 or batch_tokens <= 0:
            return
        if step_s > self.target_s:
            self.cap_tokens = max(1.0, self.decrease * batch_tokens)
        elif batch_tokens > self.cap_tokens - 1:  # it used the whole (floored) cap
            self.cap_tokens += self.increase_tokens


def step_guard_for(slo_itl_s: float, frac: float) -> StepGuard | None:
    """The guard holding steps to `frac` x the ITL SLO; None when `frac` is 0 (off) or no
    SLO is known."""
    if frac <= 0 or not (math.isfinite(slo_itl_s) and slo_itl_s > 0):
        return None
    return StepGuard(frac * slo_itl_s)
