"""Upstream selection: least outstanding requests, ties broken round robin.

Batch goes only to the upstreams eligible for it (`batch_urls`; all when none are named).
When batch is restricted to some upstreams, interactive requests are ordered by their own
outstanding count alone, so batch on an eligible upstream never steers interactive traffic
onto the others: those keep the interactive load they had before borrowing began.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Upstream:
    """One vLLM server, whether it may take batch, and the requests in flight on it."""

    base_url: str
    batch_eligible: bool = True
    outstanding: int = 0
    batch_outstanding: int = 0


class UpstreamPool:
    """Picks the upstream with the fewest outstanding requests.

    `candidates(batch=...)` orders the upstreams a request of that class may use by
    (outstanding, rotation) so a caller can fall back to the next one when a connection is
    refused.
    """

    def __init__(self, base_urls: tuple[str, ...], batch_urls: tuple[str, ...] = ()) -> None:
        if not base_urls:
            raise ValueError("an upstream pool needs at least one base URL")
        urls = [url.rstrip("/") for url in base_urls]
        eligible = {url.rstrip("/") for url in batch_urls}
        unknown = eligible - set(urls)
        if unknown:
            raise ValueError(f"batch upstreams not among the upstreams: {sorted(unknown)}")
        self.upstreams = [Upstream(url, not eligible or url in eligible) for url in urls]
        self.restricted = not all(u.batch_eligible for u in self.upstreams)
        self._turn = 0

    def candidates(self, *, batch: bool = False) -> list[Upstream]:
        """Upstreams a request of the class may use, least outstanding first (rotating among
        equals); interactive ones ignore batch load when batch is restricted."""
        count = len(self.upstreams)
        self._turn = (self._turn + 1) % count
        order = self.upstreams[self._turn:] + self.upstreams[: self._turn]
        if batch:
            return sorted((u for u in order if u.batch_eligible), key=lambda u: u.outstanding)
        if self.restricted:
            return sorted(order, key=lambda u: u.outstanding - u.batch_outstanding)
        return sorted(order, key=lambda u: u.outstanding)

    @staticmethod
    def acquire(upstream: Upstream, *, batch: bool = False) -> None:
        """Count a request (of the class) as outstanding on `upstream`."""
        upstream.outstanding += 1
        if batch:
            upstream.batch_outstanding += 1

    @staticmethod
    def release(upstream: Upstream, *, batch: bool = False) -> None:
        """A request (of the class) on `upstream` ended."""
        upstream.outstanding -= 1
        if batch:
            upstream.batch_outstanding -= 1
