"""The pure admission model: the decisions the Lua gate makes, table by table."""

from __future__ import annotations

import pytest
from borrowd.models.admission import PoolGate, lua_stored
from borrowd.models.budget import Budget, Mode
from borrowd.models.errors import FencedError

POOL = "p"
LEASE_MS = 10_000
T0_S = 1000.0
T0_MS = 1_000_000


def budget(**over: object) -> Budget:
    """An open budget: 1000 tokens/s, bucket 4000, 3 sequences, 3000 KV tokens, output 500."""
    fields: dict[str, object] = dict(
        pool=POOL, mode=Mode.OPEN, reason="t", batch_tokens_per_s=1000.0,
        batch_burst_tokens=4000, max_batch_seqs=3, max_batch_kv_tokens=3000,
        max_batch_output_tokens=500)
    fields.update(over)
    return Budget(**fields)  # type: ignore[arg-type]


def gate(**over: object) -> PoolGate:
    """A pool with `budget(**over)` published at T0 under epoch 1."""
    g = PoolGate(POOL)
    g.publish(budget(**over), epoch=1, ttl_ms=5000, now_s=T0_S)
    return g


def admit(g: PoolGate, rid: str, prompt: int, out: int, now_ms: int = T0_MS) -> tuple:
    """(admitted, reason, retry ms, clamped output) of one admission."""
    a = g.admit(rid, prompt, out, now_ms, lease_ms=LEASE_MS, retry_ms=1000)
    return a.admitted, a.reason, a.retry_after_ms, a.max_output_tokens


@pytest.mark.parametrize(
    ("over", "prompt", "out", "expected"),
    [
        ({}, 100, 1000, (True, "admitted", 0, 500)),
        ({"mode": Mode.CLOSED}, 100, 10, (False, "mode_closed", 1000, 0)),
        ({"batch_tokens_per_s": 0.0}, 100, 10, (False, "closed", 1000, 0)),
        ({"batch_burst_tokens": 500}, 400, 200, (False, "too_large", 1000, 0)),
        ({"max_batch_kv_tokens": 500}, 400, 200, (False, "too_large", 1000, 0)),
    ],
    ids=["admits-and-clamps", "closed-mode", "zero-rate", "over-the-bucket", "over-kv"],
)
def test_single_decisions(over: dict, prompt: int, out: int, expected: tuple) -> None:
    """Record checks, output clamp and the too-large rule (larger than the bucket: denied)."""
    assert admit(gate(**over), "a", prompt, out) == expected


def test_bucket_caps_and_retry_time() -> None:
    """The bucket drains by each cost, a short bucket says when it holds the next request,
    and the sequence and KV caps deny with the default retry."""
    g = gate(batch_burst_tokens=1500, max_batch_kv_tokens=10_000)
    assert admit(g, "a", 900, 100)[0]
    assert admit(g, "b", 900, 100) == (False, "rate", 500, 0)
    assert admit(g, "b", 900, 100, T0_MS + 500)[0]
    assert g.tokens == 0.0
    g2 = gate(max_batch_seqs=1)
    assert admit(g2, "a", 10, 10)[0]
    assert admit(g2, "b", 10, 10)[1] == "seq_cap"
    g3 = gate(max_batch_kv_tokens=1000)
    assert admit(g3, "a", 500, 100)[0]
    assert admit(g3, "b", 500, 100)[1] == "kv_cap"


def test_release_refunds_renew_extends_and_leases_expire() -> None:
    """Release frees the seat and refunds unused output; a renewed lease outlives the first
    one; an expired admission is reaped and its release finds nothing."""
    g = gate()
    admit(g, "a", 1000, 500)
    assert g.release("a", 100, T0_MS) == 400
    assert g.tokens == lua_stored(4000 - 1500 + 400)
    assert g.release("a", 0, T0_MS) == -1
    admit(g, "b", 10, 10)
    assert g.renew("b", T0_MS + 9000, lease_ms=LEASE_MS)
    assert g.inflight(T0_MS + 15_000)[0] == 1
    assert g.inflight(T0_MS + 19_000) == (0, 0, g.tokens)
    assert not g.renew("b", T0_MS + 19_000, lease_ms=LEASE_MS)


def test_duplicates_fencing_staleness_and_stop() -> None:
    """A retried admission keeps its reservation; a changed one is refused; an older epoch
    is fenced; a new leader's counter fences the record; a record past its lease is stale;
    the stop switch denies and makes the next record a stopped one."""
    g = gate()
    assert admit(g, "a", 100, 10)[1] == "admitted"
    assert admit(g, "a", 100, 10)[1] == "duplicate"
    assert admit(g, "a", 101, 10)[1] == "duplicate_mismatch"
    g.epoch_counter = 2
    assert admit(g, "b", 1, 1)[1] == "fenced"
    with pytest.raises(FencedError):
        g.publish(budget(), epoch=1, ttl_ms=5000, now_s=T0_S)
    g.publish(budget(), epoch=2, ttl_ms=5000, now_s=T0_S)
    assert admit(g, "b", 1, 1, T0_MS + 5000)[1] == "stale"
    g.stop_reason = "drill"
    assert admit(g, "b", 1, 1)[1] == "stopped"
    stopped = g.publish(budget(), epoch=2, ttl_ms=5000, now_s=T0_S + 1)
    assert stopped.record.mode == Mode.STOPPED and stopped.revoked == ("a",)


def test_publish_revokes_newest_first_and_clamps_the_bucket() -> None:
    """A cut revokes the newest admissions until the caps hold, and holds the bucket to the
    new burst after refilling it under the old rate."""
    g = gate(max_batch_kv_tokens=100_000, batch_burst_tokens=10_000, max_batch_seqs=8)
    for rid in ("a", "b", "c", "d"):
        admit(g, rid, 100, 100)
    cut = g.publish(budget(max_batch_seqs=2, batch_burst_tokens=1000), epoch=1, ttl_ms=5000,
                    now_s=T0_S + 1)
    assert cut.revoked == ("d", "c")
    assert g.tokens == 1000.0
    assert g.inflight(T0_MS + 1000)[:2] == (2, 400)
