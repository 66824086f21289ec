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


def test_batch_only_on_eligible_upstreams() -> None:
    """Batch candidates are the eligible upstreams only; interactive ones are all of them."""
    pool = UpstreamPool(("http://a:1", "http://b:1", "http://c:1"), ("http://b:1/",))
    for _ in range(6):
        assert [u.base_url for u in pool.candidates(batch=True)] == ["http://b:1"]
        assert len(pool.candidates()) == 3


def test_interactive_ignores_batch_load_when_restricted() -> None:
    """Batch in flight on an eligible upstream does not push interactive requests onto the
    others; interactive load still does."""
    pool = UpstreamPool(("http://a:1", "http://b:1"), ("http://a:1",))
    a, b = pool.upstreams
    for _ in range(5):
        UpstreamPool.acquire(a, batch=True)
    UpstreamPool.acquire(b)
    assert pool.candidates()[0] is a
    assert (a.outstanding, a.batch_outstanding) == (5, 5)
    UpstreamPool.release(a, batch=True)
    assert (a.outstanding, a.batch_outstanding) == (4, 4)


def test_unrestricted_pool_counts_batch_for_interactive() -> None:
    """With every upstream eligible, interactive avoids the upstream busy with batch."""
    pool = UpstreamPool(("http://a:1", "http://b:1"))
    a, b = pool.upstreams
    UpstreamPool.acquire(a, batch=True)
    assert pool.candidates()[0] is b


def test_unknown_batch_upstream_is_refused() -> None:
    """A batch upstream that is not an upstream is an error."""
    with pytest.raises(ValueError, match="not among the upstreams"):
        UpstreamPool(("http://a:1",), ("http://z:1",))
