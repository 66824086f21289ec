"""Upstream choice: least outstanding requests, rotating among equals."""

from __future__ import annotations

import pytest
from borrowd.adapters.proxy.upstreams import UpstreamPool


def test_least_outstanding_first() -> None:
    """The upstream with the fewest requests in flight comes first."""
    pool = UpstreamPool(("http://a:1", "http://b:1/", "http://c:1"))
    a, b, c = pool.upstreams
    for _ in range(2):
        UpstreamPool.acquire(a)
    UpstreamPool.acquire(c)
    assert pool.candidates()[0] is b
    assert b.base_url == "http://b:1"
    UpstreamPool.release(a)
    UpstreamPool.release(a)
    assert pool.candidates()[-1] is c


def test_ties_rotate() -> None:
    """Idle upstreams take turns."""
    pool = UpstreamPool(("http://a:1", "http://b:1"))
    firsts = {pool.candidates()[0].base_url for _ in range(4)}
    assert firsts == {"http://a:1", "http://b:1"}


def test_empty_pool_is_refused() -> None:
    """A pool needs at least one upstream."""
    with pytest.raises(ValueError, match="at least one"):
        UpstreamPool(())
