"""Upstream selection: least outstanding requests, ties broken round robin."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Upstream:
    """One vLLM server and the requests the proxy has in flight on it."""

    base_url: str
    outstanding: int = 0


class UpstreamPool:
    """Picks the upstream with the fewest outstanding requests.

    `candidates()` orders every upstream by (outstanding, rotation) so a caller can fall
    back to the next one when a connection is refused.
    """

    def __init__(self, base_urls: tuple[str, ...]) -> None:
        if not base_urls:
            raise ValueError("an upstream pool needs at least one base URL")
        self.upstreams = [Upstream(url.rstrip("/")) for url in base_urls]
        self._turn = 0

    def candidates(self) -> list[Upstream]:
        """Upstreams, least outstanding first (rotating among equals)."""
        count = len(self.upstreams)
        if count == 1:
            return self.upstreams
        self._turn = (self._turn + 1) % count
        order = self.upstreams[self._turn:] + self.upstreams[: self._turn]
        return sorted(order, key=lambda u: u.outstanding)

    @staticmethod
    def acquire(upstream: Upstream) -> None:
        """Count a request as outstanding on `upstream`."""
        upstream.outstanding += 1

    @staticmethod
    def release(upstream: Upstream) -> None:
        """A request on `upstream` ended."""
        upstream.outstanding -= 1
