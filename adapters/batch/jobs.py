"""The Batch API's logic over Redis and the file directory: upload, create, cancel, view,
and the monitor pass that finalizes, expires and cancels jobs and measures lateness.

A job moves validating -> in_progress when its items are queued; the monitor moves it to
finalizing and completed when every custom_id has its result, to expired when its window
passes (unfinished items get `batch_expired` errors), and from cancelling to cancelled once
no item is in flight or the grace time passed (unfinished items get `batch_cancelled`).
Result files are written (and fsynced) before the job's status says they exist.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from borrowd.adapters.batch.config import BatchConfig
from borrowd.adapters.batch.files import FileDir
from borrowd.adapters.batch.state import COUNTERS, BatchStore
from borrowd.models.batch.figures import (
    carried_rate_per_s,
    per_hour,
    project_lateness,
    verdict_grace_s,
)
from borrowd.models.batch.input import SUPPORTED_URLS, BatchInputError, parse_input
from borrowd.models.batch.openai_format import (
    TERMINAL,
    Status,
    batch_error,
    completion_window_s,
    error_line,
)
from borrowd.models.errors import InputError

log = logging.getLogger(__name__)

JOB_KEY_FIELD = "borrowd_job_key"
"""Metadata key naming a job key: re-submissions under it skip completed custom_ids."""
_TIMES = ("created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at",
          "failed_at", "expired_at", "cancelling_at", "cancelled_at")


class ApiError(InputError):
    """A request the API refuses: HTTP status, OpenAI error type and the field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code


@dataclass
class _Samples:
    """Recent (time, completed) samples of one job or tenant, for the carried rate."""

    points: deque = field(default_factory=lambda: deque(maxlen=2048))


class BatchService:
    """Upload, create, cancel and view batches; `monitor_once` drives their lifecycle."""

    def __init__(self, store: BatchStore, files: FileDir, config: BatchConfig,
                 clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.files = files
        self.config = config
        self.clock = clock
        self.cost = config.serve.cost_model()
        self._job_samples: dict[str, _Samples] = {}
        self._tenant_samples: dict[str, _Samples] = {}
        self._at_risk: set[str] = set()
        self.holder = uuid.uuid4().hex

    # -- files -----------------------------------------------------------------------

    async def upload(self, tenant: str, filename: str, purpose: str, data: bytes) -> dict:
        """Validate and store an input file; its file object."""
        if purpose != "batch":
            raise ApiError(400, f"purpose must be 'batch', got {purpose!r}", "purpose")
        try:
            items = parse_input(data, self.config.serve.limits())
        except BatchInputError as exc:
            raise ApiError(400, str(exc), exc.field, "invalid_batch_input") from None
        file_id = f"file-{uuid.uuid4().hex}"
        await asyncio.to_thread(self.files.write, file_id, [data])
        record = {"id": file_id, "object": "file", "bytes": len(data),
                  "created_at": int(self.clock()), "filename": filename or "input.jsonl",
                  "purpose": "batch", "status": "processed", "tenant": tenant,
                  "sha256": hashlib.sha256(data).hexdigest(), "lines": len(items)}
        await self.store.put_file(record)
        return file_object(record)

    async def file(self, tenant: str, file_id: str) -> dict[str, str]:
        """A file's record; 404 unless it exists and is the tenant's."""
        record = await self.store.file(file_id)
        if record is None or record.get("tenant") != tenant:
            raise ApiError(404, f"No such File object: {file_id}", "file_id")
        return record

    def content(self, file_id: str) -> bytes:
        """A file's bytes."""
        return self.files.read(file_id)

    # -- batches ---------------------------------------------------------------------

    async def create(self, tenant: str, request: dict[str, Any]) -> dict:
        """Create a batch from an uploaded file (or return the active job of its job key)."""
        input_file_id = request.get("input_file_id")
        if not isinstance(input_file_id, str):
            raise ApiError(400, "input_file_id is required", "input_file_id")
        endpoint = request.get("endpoint")
        if endpoint not in SUPPORTED_URLS:
            raise ApiError(400, f"endpoint {endpoint!r} is not supported (use one of "
                                f"{', '.join(SUPPORTED_URLS)})", "endpoint")
        window = request.get("completion_window")
        try:
            window_s = completion_window_s(window)
        except InputError as exc:
            raise ApiError(400, str(exc), "completion_window") from None
        metadata = request.get("metadata") or {}
        if not isinstance(metadata, dict) or len(metadata) > 16 or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise ApiError(400, "metadata must be at most 16 string pairs", "metadata")
        record = await self.file(tenant, input_file_id)
        if record.get("purpose") != "batch":
            raise ApiError(400, f"file {input_file_id} has purpose {record.get('purpose')!r}, "
                                "not 'batch'", "input_file_id")
        job_key = metadata.get(JOB_KEY_FIELD) or f"{record['sha256'][:32]}:{endpoint}"
        job_id = f"batch_{uuid.uuid4().hex}"
        existing = await self.store.claim_job_key(tenant, job_key, job_id)
        if existing is not None:
            job = await self.store.job(existing)
            if job is not None and Status(job["status"]) not in TERMINAL:
                return self.batch_object(job)
            await self.store.release_job_key(tenant, job_key, existing)
            if await self.store.claim_job_key(tenant, job_key, job_id) is not None:
                raise ApiError(409, f"job key {job_key!r} is being submitted concurrently",
                               "metadata")
        now_s = self.clock()
        await self.store.put_job(job_id, {
            "id": job_id, "object": "batch", "endpoint": endpoint, "input_file_id": input_file_id,
            "completion_window": window, "status": Status.VALIDATING.value,
            "created_at": int(now_s), "expires_at": int(now_s + window_s),
            "metadata": metadata, "tenant": tenant, "job_key": job_key, "total": 0,
            "completed": 0, "failed": 0, "errors": None,
        }, now_s)
        await self._start(job_id, tenant, job_key, input_file_id, endpoint)
        return self.batch_object(await self._job(job_id))

    async def _start(self, job_id: str, tenant: str, job_key: str, file_id: str,
                     endpoint: str) -> None:
        try:
            data = await asyncio.to_thread(self.files.read, file_id)
            items = parse_input(data, self.config.serve.limits())
            wrong = next((i for i in items if i.url != endpoint), None)
            if wrong is not None:
                raise BatchInputError(wrong.line, "url", f"{wrong.url!r} differs from the "
                                                         f"batch endpoint {endpoint!r}")
        except BatchInputError as exc:
            errors = {"object": "list", "data": [batch_error(
                "invalid_request", exc.message, exc.line or None, exc.field)]}
            await self.store.move(job_id, Status.FAILED, self.clock(), {"errors": errors})
            await self.store.release_job_key(tenant, job_key, job_id)
            return
        done = await self.store.done_lines(tenant, job_key, [i.custom_id for i in items])
        await self.store.update_job(job_id, {"total": len(items)})
        todo = []
        for item, line in zip(items, done, strict=True):
            if line is None:
                todo.append((item.custom_id, item.line, item.body))
            else:
                await self.store.complete(job_id, item.custom_id, item.line, "output",
                                          json.loads(line), "")
        await self.store.enqueue(job_id, todo)
        await self.store.set_active(job_id, True)
        await self.store.move(job_id, Status.IN_PROGRESS, self.clock())
        log.info("batch %s of tenant %s: %d items, %d already done under job key %s",
                 job_id, tenant, len(items), len(items) - len(todo), job_key)

    async def _job(self, job_id: str, tenant: str | None = None) -> dict[str, str]:
        job = await self.store.job(job_id)
        if job is None or (tenant is not None and job.get("tenant") != tenant):
            raise ApiError(404, f"No such Batch object: {job_id}", "batch_id")
        return job

    async def get(self, tenant: str, job_id: str) -> dict:
        """A batch object."""
        return self.batch_object(await self._job(job_id, tenant))

    async def page(self, tenant: str, after: str | None, limit: int) -> dict:
        """A page of the tenant's batches, newest first."""
        jobs, more = await self.store.jobs(tenant, after, limit)
        data = [self.batch_object(j) for j in jobs]
        return {"object": "list", "data": data,
                "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": more}

    async def cancel(self, tenant: str, job_id: str) -> dict:
        """Ask a batch to cancel (cancelling now, cancelled once nothing runs)."""
        job = await self._job(job_id, tenant)
        status = Status(job["status"])
        if status in (Status.CANCELLING, Status.CANCELLED):
            return self.batch_object(job)
        if not await self.store.move(job_id, Status.CANCELLING, self.clock()):
            raise ApiError(409, f"Cannot cancel a batch with status {status.value}", "batch_id")
        return self.batch_object(await self._job(job_id))

    def batch_object(self, job: dict[str, str]) -> dict:
        """The OpenAI batch object of a job hash, with borrowd's figures under `borrowd`."""
        obj: dict[str, Any] = {
            "id": job["id"], "object": "batch", "endpoint": job["endpoint"],
            "input_file_id": job["input_file_id"],
            "completion_window": job["completion_window"], "status": job["status"],
            "errors": _json(job.get("errors")), "metadata": _json(job.get("metadata")),
            "output_file_id": job.get("output_file_id") or None,
            "error_file_id": job.get("error_file_id") or None,
            "request_counts": {"total": int(job.get("total", 0)),
                               "completed": int(job.get("completed", 0)),
                               "failed": int(job.get("failed", 0))},
        }
        for name in _TIMES:
            obj[name] = int(job[name]) if job.get(name) else None
        obj["borrowd"] = self.figures(job)
        return obj

    def figures(self, job: dict[str, str]) -> dict[str, Any]:
        """Per-job figures: rates, tokens, revocations, lateness, GPU cost per item."""
        counters = {name: int(job.get(name, 0)) for name in COUNTERS}
        completed = int(job.get("completed", 0))
        start_s = float(job.get("in_progress_at_s") or job.get("created_at") or 0)
        end_s = next((float(job[n]) for n in ("completed_at_s", "expired_at_s",
                                              "cancelled_at_s", "failed_at_s") if job.get(n)),
                     self.clock())
        elapsed_s = max(0.0, end_s - start_s)
        gpu_s = self.cost.gpu_s(counters["prompt_tokens"], counters["generated_tokens"])
        return {
            "tenant": job.get("tenant"), "job_key": job.get("job_key"),
            "elapsed_s": round(elapsed_s, 3),
            "items_per_hour": round(per_hour(completed, elapsed_s), 3),
            "tokens_per_s": round(counters["kept_tokens"] / elapsed_s, 3) if elapsed_s else 0.0,
            **counters,
            "redone_fraction": (round(counters["redone_tokens"] / counters["generated_tokens"], 5)
                                if counters["generated_tokens"] else 0.0),
            # What a dead worker generated after its last checkpoint is seen by no worker;
            # it is under checkpoint_tokens per reclaimed item.
            "redone_tokens_max": counters["redone_tokens"]
            + counters["reclaimed"] * self.config.worker.checkpoint_tokens,
            "lateness_s": _float(job.get("lateness_s")),
            "projected_finish_at": _float(job.get("projected_finish_at")),
            "at_risk": job.get("at_risk") == "1",
            "gpu_s": round(gpu_s, 3),
            "cost_per_item": self.cost.cost_per_item(counters["prompt_tokens"],
                                                     counters["generated_tokens"], completed),
        }

    async def tenant_figures(self) -> dict[str, dict[str, Any]]:
        """Per-tenant figures: counters, carried items per hour, GPU cost per item."""
        out = {}
        now_s = self.clock()
        for name in self.config.tenants:
            raw = await self.store.tenant_counters(name)
            counters = {k: int(raw.get(k, 0)) for k in (*COUNTERS, "completed", "failed")}
            samples = self._tenant_samples.get(name)
            rate = carried_rate_per_s(list(samples.points), now_s,
                                      self.config.serve.rate_window_s) if samples else None
            out[name] = {
                **counters, "weight": self.config.tenants[name].weight,
                "items_per_hour": round(rate * 3600, 3) if rate is not None else None,
                "cost_per_item": self.cost.cost_per_item(counters["prompt_tokens"],
                                                         counters["generated_tokens"],
                                                         counters["completed"]),
            }
        return out

    # -- the monitor -------------------------------------------------------------------

    async def monitor_once(self) -> None:
        """One pass over active jobs: finalize, expire, cancel, measure lateness."""
        now_s = self.clock()
        for name in self.config.tenants:
            raw = await self.store.tenant_counters(name)
            points = self._tenant_samples.setdefault(name, _Samples()).points
            points.append((now_s, int(raw.get("completed", 0))))
        for job_id in await self.store.active_ids():
            job = await self.store.job(job_id)
            if job is None:
                await self.store.set_active(job_id, False)
                continue
            status = Status(job["status"])
            total = int(job.get("total", 0))
            finished = await self.store.result_count(job_id)
            if status is Status.FINALIZING or (status is Status.IN_PROGRESS
                                               and finished >= total):
                await self._finish(job, Status.COMPLETED, "", "")
            elif status is Status.IN_PROGRESS and now_s >= float(job["expires_at"]):
                await self._finish(job, Status.EXPIRED, "batch_expired",
                                   "This request could not be executed before the completion "
                                   "window expired.")
            elif status is Status.CANCELLING and (
                    await self.store.pending_count(job_id) == 0
                    or now_s - float(job["cancelling_at"]) >= self.config.serve.cancel_grace_s):
                await self._finish(job, Status.CANCELLED, "batch_cancelled",
                                   "This request was cancelled with its batch.")
            elif status is Status.IN_PROGRESS:
                await self._measure(job, finished, now_s)

    async def _measure(self, job: dict[str, str], finished: int, now_s: float) -> None:
        samples = self._job_samples.setdefault(job["id"], _Samples()).points
        samples.append((now_s, finished))
        window_s = self.config.serve.rate_window_s
        rate = carried_rate_per_s(list(samples), now_s, window_s)
        started_s = float(job.get("in_progress_at_s") or job.get("created_at") or now_s)
        grace_s = verdict_grace_s(window_s,
                                  float(job["expires_at"]) - float(job.get("created_at") or 0))
        late = project_lateness(now_s, float(job["expires_at"]),
                                int(job.get("total", 0)) - finished, rate, now_s - started_s,
                                grace_s)
        # A stalled job (nothing carried) has no finite projection: only `at_risk` says so.
        fields: dict[str, Any] = {"at_risk": int(late.at_risk), "lateness_s": "",
                                  "projected_finish_at": ""}
        if late.lateness_s is not None and math.isfinite(late.lateness_s):
            fields["lateness_s"] = round(late.lateness_s, 3)
        if late.projected_finish_s is not None:
            fields["projected_finish_at"] = round(late.projected_finish_s, 3)
        await self.store.update_job(job["id"], fields)
        if late.at_risk and job["id"] not in self._at_risk:
            log.warning("batch %s of tenant %s will miss its deadline: projected lateness %s s",
                        job["id"], job.get("tenant"), fields.get("lateness_s", "unknown"))
            self._at_risk.add(job["id"])

    async def _finish(self, job: dict[str, str], final: Status, code: str, message: str) -> None:
        """Fill unfinished items with `code` errors, write the files, set the final status."""
        job_id = job["id"]
        ttl_ms = int(max(10.0, self.config.serve.monitor_interval_s * 20) * 1000)
        if not await self.store.try_lock(job_id, self.holder, ttl_ms):
            return
        if final is Status.COMPLETED:
            await self.store.move(job_id, Status.FINALIZING, self.clock())
        else:
            for custom_id in await self.store.custom_ids(job_id):
                if await self.store.has_result(job_id, custom_id):
                    continue
                spec = await self.store.body(job_id, custom_id)
                line = spec["line"] if spec else 0
                record = error_line(f"batch_req_{uuid.uuid4().hex}", custom_id, code, message)
                await self.store.complete(job_id, custom_id, line, "error", record, "")
        results = await self.store.results(job_id)
        outputs = [r["record"] for r in results if r["kind"] == "output"]
        errors = [r["record"] for r in results if r["kind"] == "error"]
        fields: dict[str, Any] = {"at_risk": 0}
        for kind, records, key in (("output", outputs, "output_file_id"),
                                   ("errors", errors, "error_file_id")):
            if records:
                fields[key] = await self._write_file(job, kind, records)
        await self.store.remember_done(
            job["tenant"], job["job_key"],
            {r["custom_id"]: json.dumps(r) for r in outputs}, self.config.serve.done_ttl_s)
        await self.store.update_job(job_id, fields)
        await self.store.move(job_id, final, self.clock())
        await self.store.set_active(job_id, False)
        await self.store.release_job_key(job["tenant"], job["job_key"], job_id)
        await self.store.drop_work(job_id)
        self._job_samples.pop(job_id, None)
        log.info("batch %s %s: %d output lines, %d error lines", job_id, final.value,
                 len(outputs), len(errors))

    async def _write_file(self, job: dict[str, str], kind: str, records: list[dict]) -> str:
        file_id = f"file-{job['id']}-{kind}"
        lines = [json.dumps(r, separators=(",", ":")).encode() + b"\n" for r in records]
        size = await asyncio.to_thread(self.files.write, file_id, lines)
        await self.store.put_file({
            "id": file_id, "object": "file", "bytes": size, "created_at": int(self.clock()),
            "filename": f"{job['id']}_{kind}.jsonl", "purpose": "batch_output",
            "status": "processed", "tenant": job["tenant"]})
        return file_id


def file_object(record: dict[str, Any]) -> dict:
    """The OpenAI file object of a file record."""
    return {"id": record["id"], "object": "file", "bytes": int(record["bytes"]),
            "created_at": int(record["created_at"]), "filename": record["filename"],
            "purpose": record["purpose"], "status": record.get("status", "processed"),
            "expires_at": None, "status_details": None}


def _json(raw: str | None) -> Any:
    return None if raw in (None, "") else json.loads(raw)


def _float(raw: str | None) -> float | None:
    return None if raw in (None, "") else float(raw)
