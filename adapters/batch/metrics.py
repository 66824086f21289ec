"""Prometheus figures of batch jobs and tenants, from the monitor's latest snapshot.

Per job (labels `job`, `tenant`): items by state, items per hour, tokens per second,
redone and generated tokens, revocations, projected lateness, at-risk flag, GPU cost per
completed item. Per tenant: the same counters, its weight and carried items per hour.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

_JOB = (
    ("items_per_hour", "borrowd_batch_job_items_per_hour", "completed items per hour"),
    ("tokens_per_s", "borrowd_batch_job_tokens_per_second", "kept output tokens per second"),
    ("generated_tokens", "borrowd_batch_job_generated_tokens", "output tokens generated"),
    ("redone_tokens", "borrowd_batch_job_redone_tokens", "output tokens generated, not kept"),
    ("reprefill_tokens", "borrowd_batch_job_reprefill_tokens",
     "partial output prefilled again on resume"),
    ("revocations", "borrowd_batch_job_revocations", "attempts ended by a revocation"),
    ("lateness_s", "borrowd_batch_job_lateness_seconds",
     "projected finish minus deadline (> 0: late)"),
    ("at_risk", "borrowd_batch_job_at_risk", "1 when the job is projected to miss its deadline"),
    ("cost_per_item", "borrowd_batch_job_cost_per_item", "GPU cost per completed item"),
)
_TENANT = (
    ("completed", "borrowd_batch_tenant_completed_items", "items completed"),
    ("items_per_hour", "borrowd_batch_tenant_items_per_hour", "carried items per hour"),
    ("generated_tokens", "borrowd_batch_tenant_generated_tokens", "output tokens generated"),
    ("redone_tokens", "borrowd_batch_tenant_redone_tokens", "output tokens generated, not kept"),
    ("revocations", "borrowd_batch_tenant_revocations", "attempts ended by a revocation"),
    ("weight", "borrowd_batch_tenant_weight", "fair-share weight"),
    ("cost_per_item", "borrowd_batch_tenant_cost_per_item", "GPU cost per completed item"),
)


class BatchCollector(Collector):
    """Exports the last snapshot handed to `refresh` (the monitor's pass)."""

    def __init__(self) -> None:
        self._jobs: list[dict] = []
        self._tenants: dict[str, dict] = {}

    def refresh(self, snapshot: tuple[list[dict], dict[str, dict]]) -> None:
        """Replace the exported snapshot (batch objects, tenant figures)."""
        self._jobs, self._tenants = snapshot

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """The gauges of the current snapshot."""
        items = GaugeMetricFamily("borrowd_batch_job_items", "items of a job by state",
                                  labels=["job", "tenant", "state"])
        for job in self._jobs:
            tenant = job["borrowd"]["tenant"] or ""
            counts = job["request_counts"]
            for state in ("total", "completed", "failed"):
                items.add_metric([job["id"], tenant, state], counts[state])
        yield items
        for key, name, text in _JOB:
            family = GaugeMetricFamily(name, text, labels=["job", "tenant"])
            for job in self._jobs:
                value = job["borrowd"].get(key)
                if value is not None:
                    family.add_metric([job["id"], job["borrowd"]["tenant"] or ""], float(value))
            yield family
        for key, name, text in _TENANT:
            family = GaugeMetricFamily(name, text, labels=["tenant"])
            for tenant, figures in self._tenants.items():
                value = figures.get(key)
                if value is not None:
                    family.add_metric([tenant], float(value))
            yield family
