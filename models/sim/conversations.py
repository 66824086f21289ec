"""A synthetic multi-turn form of a chat trace: each turn's prompt is the conversation so far.

The trace keeps its arrival times and output lengths. Walking its requests in arrival
order, each one either continues an open conversation (probability `1 - 1 / mean_turns`,
one of the `max_open` most recently active ones, uniformly) or opens a new one; its trace
prompt length becomes the new user message, and its prompt is the conversation's history
(every earlier prompt message and answer, in order) plus that message. A conversation whose
next prompt would pass `max_prompt_tokens` is closed and the request opens a new one. The
content segments say which tokens are shared (`models.sim.prefix_cache`): the history's
messages keep their ids and the answers are generated tokens, so a turn finds the earlier
turns in the prefix cache when they are still there. Deterministic for a given `seed`.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from borrowd.models.sim.prefix_cache import OUTPUT_ID
from borrowd.models.sim.trace import Segments, Trace

MEAN_TURNS = 4.0
MAX_OPEN = 64
MAX_PROMPT_TOKENS = 32768


def multi_turn(trace: Trace, *, mean_turns: float = MEAN_TURNS, max_open: int = MAX_OPEN,
               max_prompt_tokens: int = MAX_PROMPT_TOKENS, seed: int = 0) -> Trace:
    """`trace` with every prompt replaced by its conversation so far (see the module)."""
    rng = np.random.default_rng(seed)
    n = len(trace.arrival_s)
    draws = rng.random(n)
    picks = rng.random(n)
    open_histories: list[Segments] = []
    prompts = np.empty(n, dtype=np.int64)
    segments: list[Segments] = []
    message_tokens = trace.prompt_tokens.tolist()
    outputs = trace.output_tokens.tolist()
    for i in range(n):
        message = ((i, message_tokens[i]),)
        history: Segments = ()
        slot = -1
        if open_histories and draws[i] < 1.0 - 1.0 / mean_turns:
            slot = int(picks[i] * len(open_histories))
            history = open_histories.pop(slot)
            if sum(length for _, length in history) + message_tokens[i] > max_prompt_tokens:
                history = ()
        prompt = history + message
        prompts[i] = sum(length for _, length in prompt)
        segments.append(prompt)
        open_histories.append((*prompt, (OUTPUT_ID, outputs[i])))
        if len(open_histories) > max_open:
            open_histories.pop(0)
    return replace(trace, prompt_tokens=prompts, segments=tuple(segments))


def shared_prefix_frac(trace: Trace) -> float:
    """Share of prompt tokens that repeat an earlier turn of their conversation."""
    if trace.segments is None:
        return 0.0
    total = int(trace.prompt_tokens.sum())
    own = sum(segs[-1][1] for segs in trace.segments)
    return (total - own) / total if total else 0.0
