"""Batch jobs in a scenario file: tenants with fair-share weights, jobs, and the prices of
their figures (`[batch.tenants]`, `[[batch.jobs]]`, `[batch.job_figures]`).

```toml
[batch.tenants]              # tenant = fair-share weight
gold = 2.0
silver = 1.0

[[batch.jobs]]
id = "gold-summaries"
tenant = "gold"
items = 4000
arrival_s = 0.0              # seconds from the start of the run
completion_window = "20m"    # deadline = arrival + window (OpenAI's "24h", or N s|m|h|d)
prompt_tokens = 2048         # item shape; leave both sizes out to draw each item from
output_tokens = 256          # the batch length pool (batch.lengths_file, scaled, clipped)

[batch.job_figures]
price_per_gpu_hour = 2.0     # cost per completed item = price x batch GPU hours / items
rate_window_s = 60.0         # carried rate behind projected lateness (s)
```

Jobs replace the backlog as the batch demand. Every key is checked; an error names it
(`batch.jobs[2].items must be an integer >= 1, got 0`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from borrowd.models.batch.openai_format import completion_window_s
from borrowd.models.errors import InputError

EXAMPLE_LINES = (
    "# Batch jobs (they replace the backlog as the batch demand): tenants and weights, one",
    "# table of batch.jobs per job (leave prompt_tokens and output_tokens out to draw items",
    "# from the batch length pool), and the settings of the job figures.",
    "# [batch.tenants]",
    "# gold = 2.0",
    "# silver = 1.0",
    "# [[batch.jobs]]",
    '# id = "gold-summaries"',
    '# tenant = "gold"',
    "# items = 4000",
    "# arrival_s = 0.0",
    '# completion_window = "20m"',
    "# prompt_tokens = 2048",
    "# output_tokens = 256",
    "# [batch.job_figures]",
    f"# price_per_gpu_hour = {2.0!r}",
    f"# rate_window_s = {60.0!r}",
)
"""The jobs section of `borrowd scenario example` (commented out: seed has no jobs)."""
JOB_TABLES = ("tenants", "jobs", "job_figures")
"""The keys of `[batch]` that describe jobs (the rest are the backlog's)."""
DEFAULT_PRICE_PER_GPU_HOUR = 2.0
DEFAULT_RATE_WINDOW_S = 60.0


@dataclass(frozen=True)
class JobSpec:
    """One batch job: its tenant, item count and shape, arrival and deadline (seconds from
    the start of the run). Sizes None: items drawn from the batch length pool."""

    job_id: str
    tenant: str
    items: int
    arrival_s: float = 0.0
    completion_window_s: float = 86400.0
    prompt_tokens: int | None = None
    output_tokens: int | None = None

    @property
    def deadline_s(self) -> float:
        """When the job is due: arrival plus its completion window."""
        return self.arrival_s + self.completion_window_s


@dataclass(frozen=True)
class JobsSpec:
    """The batch tenants (name, weight), their jobs, and the settings of the job figures."""

    tenants: tuple[tuple[str, float], ...]
    jobs: tuple[JobSpec, ...]
    price_per_gpu_hour: float = DEFAULT_PRICE_PER_GPU_HOUR
    rate_window_s: float = DEFAULT_RATE_WINDOW_S

    @property
    def weights(self) -> dict[str, float]:
        """Tenant -> fair-share weight."""
        return dict(self.tenants)


@dataclass(frozen=True)
class _Field:
    """A key of a job (or of `job_figures`): its kind, lower bound and one line of help."""

    name: str
    kind: type
    help: str
    low: float | None = None
    low_open: bool = False
    required: bool = False


JOB_FIELDS = (
    _Field("id", str, "job name, unique in the scenario", required=True),
    _Field("tenant", str, "tenant the job belongs to (one of [batch.tenants])", required=True),
    _Field("items", int, "requests in the job", low=1, required=True),
    _Field("arrival_s", float, "when the job is submitted (s from the start)", low=0),
    _Field("completion_window", str, "deadline after arrival: N followed by s, m, h or d"),
    _Field("prompt_tokens", int, "prompt tokens of every item", low=1),
    _Field("output_tokens", int, "output tokens of every item", low=1),
)
FIGURE_FIELDS = (
    _Field("price_per_gpu_hour", float, "price of a GPU-hour (any currency)", low=0),
    _Field("rate_window_s", float, "window of the carried rate behind projected lateness (s)",
           low=0, low_open=True),
)
_WORDS = {int: "an integer", float: "a number", str: "a non-empty string"}


def _check(where: str, spec: _Field, value: object) -> object:
    """`value` as `spec` wants it, or `InputError` naming `where`."""
    if spec.kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif spec.kind is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    else:
        ok = isinstance(value, str) and bool(value)
    if not ok:
        raise InputError(f"{where} must be {_WORDS[spec.kind]}, got {value!r}")
    if spec.low is not None and isinstance(value, int | float):
        if spec.low_open and not value > spec.low:
            raise InputError(f"{where} must be > {spec.low:g}, got {value!r}")
        if not spec.low_open and not value >= spec.low:
            raise InputError(f"{where} must be >= {spec.low:g}, got {value!r}")
    return float(value) if spec.kind is float else value  # type: ignore[arg-type]


def _table(where: str, raw: object, fields: tuple[_Field, ...]) -> dict[str, Any]:
    """The checked keys of one table (unknown or missing required keys are errors)."""
    if not isinstance(raw, dict):
        raise InputError(f"{where} must be a table")
    by_name = {f.name: f for f in fields}
    out: dict[str, Any] = {}
    for name, value in raw.items():
        spec = by_name.get(name)
        if spec is None:
            raise InputError(f"{where}.{name} is not a key here (keys: "
                             f"{', '.join(by_name)})")
        out[name] = _check(f"{where}.{name}", spec, value)
    for spec in fields:
        if spec.required and spec.name not in out:
            raise InputError(f"{where}.{spec.name} is required ({spec.help})")
    return out


def parse_jobs(batch: Mapping[str, object]) -> JobsSpec | None:
    """The jobs of a scenario's `[batch]` table (None when it has none); `InputError`
    naming the key at fault."""
    tenants_raw = batch.get("tenants")
    jobs_raw = batch.get("jobs")
    figures_raw = batch.get("job_figures")
    if tenants_raw is None and jobs_raw is None and figures_raw is None:
        return None
    if not isinstance(jobs_raw, list) or not jobs_raw:
        raise InputError("batch.jobs is required with batch.tenants or batch.job_figures: "
                         "one [[batch.jobs]] table per job")
    if not isinstance(tenants_raw, dict) or not tenants_raw:
        raise InputError("batch.tenants is required with batch.jobs: tenant = weight, one "
                         "line per tenant")
    weight = _Field("weight", float, "fair-share weight", low=0, low_open=True)
    tenants = tuple((str(name), float(_check(f"batch.tenants.{name}", weight, value)))  # type: ignore[arg-type]
                    for name, value in tenants_raw.items())
    jobs: list[JobSpec] = []
    seen: set[str] = set()
    for index, raw in enumerate(jobs_raw, start=1):
        where = f"batch.jobs[{index}]"
        fields = _table(where, raw, JOB_FIELDS)
        if fields["id"] in seen:
            raise InputError(f"{where}.id {fields['id']!r} names another job too")
        seen.add(fields["id"])
        if fields["tenant"] not in tenants_raw:
            raise InputError(f"{where}.tenant {fields['tenant']!r} is not in batch.tenants "
                             f"({', '.join(tenants_raw)})")
        if ("prompt_tokens" in fields) != ("output_tokens" in fields):
            raise InputError(f"{where}: prompt_tokens and output_tokens go together (leave "
                             "both out to draw items from the batch length pool)")
        window = fields.pop("completion_window", "24h")
        try:
            window_s = float(completion_window_s(window))
        except InputError as exc:
            raise InputError(f"{where}.{exc}") from None
        jobs.append(JobSpec(job_id=fields["id"], tenant=fields["tenant"], items=fields["items"],
                            arrival_s=fields.get("arrival_s", 0.0), completion_window_s=window_s,
                            prompt_tokens=fields.get("prompt_tokens"),
                            output_tokens=fields.get("output_tokens")))
    figures = _table("batch.job_figures", figures_raw if figures_raw is not None else {},
                     FIGURE_FIELDS)
    return JobsSpec(tenants=tenants, jobs=tuple(jobs), **figures)
