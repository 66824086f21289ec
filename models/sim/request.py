"""One request's state inside the simulator (engine and fleet), with `__slots__` for speed.

Token counting follows vLLM V1's `Request`: `num_tokens = prompt_tokens + output_tokens`,
and a step schedules `num_tokens - computed_tokens` tokens (capped); a request emits a token
in a step after which `computed_tokens == num_tokens`.
"""

from __future__ import annotations

INTERACTIVE = "interactive"
BATCH = "batch"

WAITING = "waiting"
RUNNING = "running"
PREEMPTED = "preempted"
FINISHED = "finished"
ABORTED = "aborted"
REFUSED = "refused"

NEVER = -1.0  # time stamp of an event that has not happened


class Request:
    """A request: identity, class, sizes, progress and the times of its events.

    `arrival_s` orders requests in the engine (priority ties, FCFS); `submitted_s` is when the
    client sent it, kept across resubmissions so TTFT counts from the client's view.
    `recomputed_tokens` counts tokens computed a second time after a preemption or a
    revocation. `segments` is the prompt's content as `(content_id, tokens)` runs (equal ids:
    equal tokens; see `models.sim.prefix_cache`); empty means content of its own.
    `block_ids`, `block_hashes`, `num_cached_blocks` and `freed_blocks` are the prefix
    cache's bookkeeping.
    """

    __slots__ = (
        "arrival_s",
        "block_hashes",
        "block_ids",
        "blocks",
        "computed_tokens",
        "error",
        "finish_s",
        "first_token_s",
        "freed_blocks",
        "klass",
        "last_token_s",
        "max_output_tokens",
        "num_cached_blocks",
        "output_tokens",
        "preemptions",
        "priority",
        "prompt_tokens",
        "recomputed_tokens",
        "replica",
        "request_id",
        "segment_starts",
        "segments",
        "status",
        "submitted_s",
    )

    def __init__(
        self,
        request_id: str,
        klass: str,
        prompt_tokens: int,
        max_output_tokens: int,
        arrival_s: float,
        priority: int = 0,
        submitted_s: float | None = None,
        segments: tuple[tuple[int, int], ...] = (),
    ) -> None:
        self.request_id = request_id
        self.klass = klass
        self.priority = priority
        self.arrival_s = arrival_s
        self.submitted_s = arrival_s if submitted_s is None else submitted_s
        self.prompt_tokens = prompt_tokens
        self.max_output_tokens = max_output_tokens
        self.computed_tokens = 0
        self.output_tokens = 0
        self.blocks = 0
        self.first_token_s = NEVER
        self.last_token_s = NEVER
        self.finish_s = NEVER
        self.preemptions = 0
        self.recomputed_tokens = 0
        self.status = WAITING
        self.error = ""
        self.replica = -1
        self.block_ids: list[int] = []
        self.block_hashes: list[int] = []
        self.num_cached_blocks = 0
        self.freed_blocks: list[tuple[int, int]] = []
        self.set_segments(segments)

    def set_segments(self, segments: tuple[tuple[int, int], ...]) -> None:
        """Set the prompt's content runs (and their start offsets)."""
        self.segments = segments
        starts = []
        pos = 0
        for _, length in segments:
            starts.append(pos)
            pos += length
        self.segment_starts = starts
        self.block_hashes = []

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens so far (vLLM's `Request.num_tokens`)."""
        return self.prompt_tokens + self.output_tokens

    @property
    def is_interactive(self) -> bool:
        """True for the interactive class."""
        return self.klass == INTERACTIVE

    @property
    def ttft_s(self) -> float:
        """Time from the client's submission to the first token; NaN before it."""
        if self.first_token_s < 0:
            return float("nan")
        return self.first_token_s - self.submitted_s

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.klass}, prio={self.priority}, "
            f"prompt={self.prompt_tokens}, out={self.output_tokens}/{self.max_output_tokens}, "
            f"computed={self.computed_tokens}, {self.status})"
        )
