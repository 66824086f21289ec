"""Batch jobs as the simulator's batch demand, ordered and shared as the workers do it.

`JobsSource` stands where `workload.BatchSource` (the endless backlog) stands: the run asks
it for the next item (`peek_cost`, `next_job`) and gives cut items back (`push_front`).
Which item comes next is the workers' rule (`models.batch.schedule`): `dispatch` picks the
tenant with items waiting and the smallest start tag and charges it its expected cost, the
tenant's earliest-deadline job gives the item, and the item's cost settles the charge when
it completes (`settle`), as `borrowd batch worker` does on the shared state in Redis. A cut
item goes to the head of the queue and resumes as `models.batch.resume.continuation_sizes`
says (the prompt plus the output so far prefilled again, the output limit reduced), as a
worker's slot resumes it. Once a second the source samples each job's progress (projected
lateness, `models.batch.figures`) and each tenant's processed tokens (fair-share error
while tenants contend).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
from borrowd.models.batch.figures import (
    carried_rate_per_s,
    cost_per_item,
    per_hour,
    project_lateness,
    verdict_grace_s,
)
from borrowd.models.batch.resume import continuation_sizes
from borrowd.models.batch.schedule import (
    FairState,
    JobRef,
    dispatch,
    dispatch_cost_tokens,
    edf_order,
    pick_tenant,
    settle,
    settlement,
)
from borrowd.models.errors import InputError
from borrowd.models.sim.jobs_figures import JobFigures, JobsReport, jobs_report
from borrowd.models.sim.jobs_spec import JobSpec, JobsSpec
from borrowd.models.sim.request import Request
from borrowd.models.sim.scenario import BatchWorkload
from borrowd.models.sim.trace import Lengths
from borrowd.models.sim.workload import BatchJob


class JobItem(BatchJob):
    """One item of a job (a `BatchJob` to the run loop): the job it belongs to and what its
    dispatch was charged."""

    __slots__ = ("charged_tokens", "job_index")

    def __init__(self, item_id: int, job_index: int, prompt_tokens: int,
                 output_tokens: int) -> None:
        super().__init__(item_id, prompt_tokens, output_tokens)
        self.job_index = job_index
        self.charged_tokens = 0.0


@dataclass
class _JobState:
    """A job's progress during a run (mutable)."""

    spec: JobSpec
    items: list[JobItem]
    waiting: deque[JobItem] = field(default_factory=deque)
    arrived: bool = False
    completed: int = 0
    completed_on_time: int = 0
    finish_s: float | None = None
    completed_tokens: int = 0
    work_tokens: int = 0
    revocations: int = 0
    resumes: int = 0
    reprefill_tokens: int = 0
    samples: list[tuple[float, int]] = field(default_factory=list)
    late_projected_at_s: float | None = None
    first_late_projection_s: float | None = None
    projected_lateness_s: float | None = None


class JobsSource:
    """The jobs of a scenario as a source of batch items (see the module docstring)."""

    def __init__(self, spec: JobsSpec, batch: BatchWorkload, lengths: Lengths | None,
                 rng: np.random.Generator) -> None:
        self.spec = spec
        self.weights = spec.weights
        self.fair = FairState({})
        self.front: deque[JobItem] = deque()
        self.jobs: list[_JobState] = []
        self._tenant_work: dict[str, int] = dict.fromkeys(self.weights, 0)
        self._last_work: dict[str, int] | None = None
        self._last_contending: frozenset[str] = frozenset()
        self.intervals: list[tuple[dict[str, float], frozenset[str]]] = []
        next_id = 0
        for index, job in enumerate(spec.jobs):
            prompts, outputs = _item_sizes(job, batch, lengths, rng)
            items = [JobItem(next_id + i, index, p, o)
                     for i, (p, o) in enumerate(zip(prompts, outputs, strict=True))]
            next_id += job.items
            self.jobs.append(_JobState(job, items))
        self._by_id = {job.spec.job_id: job for job in self.jobs}

    # -- the source the run loop pulls from ------------------------------------------------

    def arrivals(self) -> list[tuple[float, int]]:
        """(time, index of its first job) of each instant when jobs are submitted."""
        first: dict[float, int] = {}
        for index, job in enumerate(self.jobs):
            first.setdefault(job.spec.arrival_s, index)
        return sorted((t, index) for t, index in first.items())

    def arrive(self, index: int) -> int:
        """Job `index` and every job submitted at the same instant arrive together (so the
        first does not take the client's slots before the others are seen): their items
        wait; returns how many."""
        arrival_s = self.jobs[index].spec.arrival_s
        count = 0
        for job in self.jobs:
            if job.spec.arrival_s == arrival_s and not job.arrived:
                job.arrived = True
                job.waiting.extend(job.items)
                count += len(job.items)
        return count

    def _backlogged(self) -> dict[str, float]:
        """Tenants with items waiting, and their weights."""
        return {job.spec.tenant: self.weights[job.spec.tenant]
                for job in self.jobs if job.waiting}

    def _first_item(self, tenant: str) -> JobItem:
        """The next item of `tenant`: from its earliest-deadline job with items waiting."""
        refs = [JobRef(job.spec.job_id, job.spec.deadline_s, job.spec.arrival_s)
                for job in self.jobs if job.waiting and job.spec.tenant == tenant]
        return self._by_id[edf_order(refs)[0].job_id].waiting[0]

    def _peek(self) -> JobItem:
        """The item `next_job` would take (without charging anything)."""
        if self.front:
            return self.front[0]
        tenant = pick_tenant(self.fair, self._backlogged())
        if tenant is None:
            raise InputError("the batch client asked for a job item while none was waiting")
        return self._first_item(tenant)

    def peek_cost(self) -> tuple[int, int]:
        """(prompt, max output) tokens of the request `next_job()` would send."""
        item = self._peek()
        return continuation_sizes(item.prompt_tokens, item.output_tokens, item.generated_tokens)

    def next_job(self) -> JobItem:
        """Take the next item: a cut one first, else by fair share (the tenant charged its
        expected cost, `schedule.dispatch`) and deadline."""
        if self.front:
            item = self.front.popleft()
            job = self.jobs[item.job_index]
            if item.generated_tokens:
                job.resumes += 1
                job.reprefill_tokens += item.generated_tokens
            return item
        picked = dispatch(self.fair, self._backlogged())
        if picked is None:
            raise InputError("the batch client asked for a job item while none was waiting")
        self.fair = picked.state
        item = self._first_item(picked.tenant)
        self.jobs[item.job_index].waiting.popleft()
        item.charged_tokens = picked.charged_tokens
        return item

    def push_front(self, item: BatchJob) -> None:
        """A cut item waits at the head of the queue, to resume first."""
        if not isinstance(item, JobItem):
            raise InputError(f"batch item {item.job_id} is not a job's item")
        self.front.appendleft(item)

    def attempt_ended(self, item: BatchJob, req: Request, now_s: float) -> None:
        """An attempt of `item` ended (the run has added its output to the item): count its
        work; the item is complete when no output remains, else it was cut."""
        if not isinstance(item, JobItem):
            raise InputError(f"batch item {item.job_id} is not a job's item")
        job = self.jobs[item.job_index]
        work = req.computed_tokens + req.recomputed_tokens
        job.work_tokens += work
        self._tenant_work[job.spec.tenant] += work
        if item.remaining_output_tokens > 0:
            job.revocations += 1
            return
        tenant = job.spec.tenant
        self.fair = settle(self.fair, tenant, settlement(
            item.charged_tokens, dispatch_cost_tokens(item.prompt_tokens, item.output_tokens),
            self.weights[tenant], finished=True))
        job.completed += 1
        if now_s <= job.spec.deadline_s:
            job.completed_on_time += 1
        job.completed_tokens += item.prompt_tokens + item.output_tokens
        if job.completed == len(job.items):
            job.finish_s = now_s

    # -- once a second: lateness and fair share -------------------------------------------

    def sample(self, now_s: float, inflight: Iterable[tuple[Request, BatchJob]]) -> None:
        """Measure each open job's projected lateness and each tenant's processed tokens."""
        window_s = self.spec.rate_window_s
        for job in self.jobs:
            if not job.arrived or job.finish_s is not None:
                continue
            job.samples.append((now_s, job.completed))
            while job.samples and job.samples[0][0] < now_s - window_s - 1.0:
                job.samples.pop(0)
            rate = carried_rate_per_s(job.samples, now_s, window_s)
            late = project_lateness(now_s, job.spec.deadline_s, len(job.items) - job.completed,
                                    rate, now_s - job.spec.arrival_s,
                                    verdict_grace_s(window_s, job.spec.completion_window_s))
            job.projected_lateness_s = late.lateness_s
            if late.at_risk and late.lateness_s is not None and job.late_projected_at_s is None:
                job.late_projected_at_s = now_s
                job.first_late_projection_s = late.lateness_s
        work = self._work_now(inflight)
        contending = frozenset(self.jobs[i.job_index].spec.tenant for i in self.front) | {
            job.spec.tenant for job in self.jobs if job.waiting}
        if self._last_work is not None:
            both = contending & self._last_contending
            self.intervals.append(({t: float(work[t] - self._last_work[t]) for t in both},
                                   both))
        self._last_work = work
        self._last_contending = contending

    def _work_now(self, inflight: Iterable[tuple[Request, BatchJob]]) -> dict[str, int]:
        """Tokens processed per tenant so far: ended attempts plus those in flight."""
        work = dict(self._tenant_work)
        for req, item in inflight:
            if isinstance(item, JobItem):
                work[self.jobs[item.job_index].spec.tenant] += (req.computed_tokens
                                                                + req.recomputed_tokens)
        return work

    # -- the figures ----------------------------------------------------------------------

    def report(self, end_s: float, inflight: Iterable[tuple[Request, BatchJob]],
               batch_gpu_s: float) -> JobsReport:
        """Per job and per tenant: items, completion, lateness, fair share, tokens, cost.

        The GPU time batch occupied (`batch_gpu_s`: step time x the batch share of its
        tokens) is spread over the jobs by the tokens each processed."""
        running: dict[int, int] = {}
        held: set[int] = set()
        for req, item in inflight:
            if isinstance(item, JobItem):
                held.add(item.job_id)
                running[item.job_index] = running.get(item.job_index, 0) + (
                    req.computed_tokens + req.recomputed_tokens)
        work = [job.work_tokens + running.get(i, 0) for i, job in enumerate(self.jobs)]
        total_work = sum(work)
        price = self.spec.price_per_gpu_hour
        jobs = []
        for index, job in enumerate(self.jobs):
            gpu_s = batch_gpu_s * work[index] / total_work if total_work else 0.0
            queued = len(job.waiting) + sum(1 for i in self.front if i.job_index == index)
            jobs.append(_job_figures(job, end_s, held, queued, work[index], gpu_s, price))
        return jobs_report(jobs, self.weights, self.intervals, price, batch_gpu_s)


def _job_figures(job: _JobState, end_s: float, held: set[int], waiting: int,
                 work_tokens: int, gpu_s: float, price: float) -> JobFigures:
    """One job's figures at the end of the run."""
    spec = job.spec
    finish = job.finish_s
    elapsed_s = (finish if finish is not None else end_s) - spec.arrival_s
    return JobFigures(
        job=spec.job_id,
        tenant=spec.tenant,
        items=len(job.items),
        completed=job.completed,
        in_flight=sum(1 for item in job.items if item.job_id in held),
        waiting=waiting,
        not_arrived=0 if job.arrived else len(job.items),
        arrival_s=spec.arrival_s,
        deadline_s=spec.deadline_s,
        finish_s=finish,
        completion_time_s=None if finish is None else finish - spec.arrival_s,
        lateness_s=None if finish is None else finish - spec.deadline_s,
        late_projected_at_s=job.late_projected_at_s,
        first_late_projection_s=job.first_late_projection_s,
        projected_lateness_s=job.projected_lateness_s if finish is None else None,
        items_after_deadline=(len(job.items) - job.completed_on_time
                              if end_s > spec.deadline_s else 0),
        items_per_hour=per_hour(job.completed, max(0.0, elapsed_s)) if job.arrived else 0.0,
        completed_tokens=job.completed_tokens,
        processed_tokens=work_tokens,
        recomputed_tokens=sum(item.recomputed_tokens for item in job.items),
        reprefill_tokens=job.reprefill_tokens,
        revocations=job.revocations,
        resumes=job.resumes,
        gpu_s=gpu_s,
        cost_per_item=cost_per_item(price, gpu_s, job.completed),
    )


def _item_sizes(job: JobSpec, batch: BatchWorkload, lengths: Lengths | None,
                rng: np.random.Generator) -> tuple[list[int], list[int]]:
    """Each item's (prompt, output) tokens: the job's sizes, or draws from the batch length
    pool scaled and clipped as the backlog's are."""
    if job.prompt_tokens is not None and job.output_tokens is not None:
        return [job.prompt_tokens] * job.items, [job.output_tokens] * job.items
    if lengths is None:
        raise InputError(f"batch job {job.job_id!r} draws its items from the batch length "
                         "pool, but none was loaded")
    picks = rng.integers(0, len(lengths.prompt_tokens), size=job.items)
    prompts = np.minimum(lengths.prompt_tokens[picks] * batch.prompt_scale,
                         batch.prompt_clip_tokens)
    outputs = np.minimum(lengths.output_tokens[picks], batch.output_clip_tokens)
    return [int(p) for p in prompts], [int(o) for o in outputs]
