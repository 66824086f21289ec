"""The budget record round-trips and refuses malformed or foreign records by name."""

from __future__ import annotations

import pytest
from borrowd.models.budget import SCHEMA_VERSION, Budget, Mode, closed_budget
from borrowd.models.errors import BudgetRecordError


def _budget() -> Budget:
    return Budget(
        pool="p1", mode=Mode.OPEN, reason="law", batch_tokens_per_s=1500.0,
        batch_burst_tokens=3000, max_batch_seqs=8, max_batch_kv_tokens=100_000,
        max_batch_output_tokens=1024,
    ).with_envelope(epoch=3, seq=17, issued_at_s=1000.5, ttl_ms=3000)


def test_round_trip_fields_and_json() -> None:
    """A record survives the hash form and the JSON form unchanged."""
    b = _budget()
    assert Budget.from_fields(b.to_fields()) == b
    assert Budget.from_json(b.to_json()) == b
    assert Budget.from_fields({k.encode(): v.encode() for k, v in b.to_fields().items()}) == b


def test_lease_freshness() -> None:
    """A record is fresh until issued_at + ttl."""
    b = _budget()
    assert b.is_fresh(1003.4)
    assert not b.is_fresh(1003.5)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("schema", str(SCHEMA_VERSION + 1), "schema"),
        ("mode", "wide-open", "mode"),
        ("batch_tokens_per_s", "lots", "batch_tokens_per_s"),
        ("batch_tokens_per_s", "-1", "batch_tokens_per_s"),
        ("max_batch_seqs", None, "max_batch_seqs"),
    ],
    ids=["foreign-schema", "unknown-mode", "not-a-number", "negative", "missing"],
)
def test_malformed_records_name_the_field(field: str, value: str | None, message: str) -> None:
    """Each malformed record is refused with the field named."""
    fields = _budget().to_fields()
    if value is None:
        del fields[field]
    else:
        fields[field] = value
    with pytest.raises(BudgetRecordError, match=message):
        Budget.from_fields(fields)


def test_closed_budget_admits_nothing() -> None:
    """Closed, stopped and failsafe records never admit batch work."""
    for mode in (Mode.CLOSED, Mode.STOPPED, Mode.FAILSAFE):
        assert not closed_budget("p", mode, "x").admits_batch
    assert _budget().admits_batch
