"""The budget record: the one contract between the controller and the adapters.

The controller decides a `Budget` per pool each tick; the budget store (adapters) writes it
to Redis as a hash at `borrowd:{POOL}:budget` with a TTL lease; gates, the proxy and the
engine plugin read it and enforce it. Neither side knows the other's internals.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from enum import StrEnum

from borrowd.models.errors import BudgetRecordError

SCHEMA_VERSION = 1
# A stored number is plain decimal (no nan, inf, hex, spaces or underscores), finite and at
# most this in size; the Lua scripts (adapters/lua/common.lua) read records by the same rule,
# so `borrowd status`, the watchers and the gate agree on what is malformed.
MAX_RECORD_NUMBER = 1e15
# Longest lease a stored record may carry (the stop switch's record).
MAX_RECORD_TTL_MS = 3_600_000
_INT = re.compile(r"-?[0-9]+")
_NUMBER = re.compile(r"-?[0-9]+\.?[0-9]*([eE][+-]?[0-9]+)?")


class Mode(StrEnum):
    """Supervisor mode carried by each record."""

    OPEN = "open"
    RAMP = "ramp"
    CLOSED = "closed"
    STOPPED = "stopped"
    FAILSAFE = "failsafe"


@dataclass(frozen=True)
class Budget:
    """Batch budget of one pool.

    The envelope (`epoch`, `seq`, `issued_at_s`, `ttl_ms`) is filled by the budget store when
    it publishes; the controller leaves it at zero.
    """

    pool: str
    mode: Mode
    reason: str
    batch_tokens_per_s: float
    batch_burst_tokens: int
    max_batch_seqs: int
    max_batch_kv_tokens: int
    max_batch_output_tokens: int
    epoch: int = 0
    seq: int = 0
    issued_at_s: float = 0.0
    ttl_ms: int = 0
    schema: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        for name in ("batch_tokens_per_s",):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise BudgetRecordError(
                    f"budget field {name} must be finite and >= 0, got {value!r}"
                )
        for name in (
            "batch_burst_tokens",
            "max_batch_seqs",
            "max_batch_kv_tokens",
            "max_batch_output_tokens",
        ):
            if getattr(self, name) < 0:
                raise BudgetRecordError(
                    f"budget field {name} must be >= 0, got {getattr(self, name)!r}"
                )

    @property
    def admits_batch(self) -> bool:
        """True when this record lets any new batch work in."""
        return (
            self.mode in (Mode.OPEN, Mode.RAMP)
            and self.batch_tokens_per_s > 0
            and self.max_batch_seqs > 0
        )

    def expires_at_s(self) -> float:
        """Wall-clock second at which this record's lease ends."""
        return self.issued_at_s + self.ttl_ms / 1000.0

    def is_fresh(self, now_s: float) -> bool:
        """True while the record's own lease holds at `now_s`: issued at most one lease
        ahead of `now_s` (a clock far ahead cannot make it live for long) and not expired.
        The gate's scripts apply the same rule on Redis's clock."""
        ttl_s = self.ttl_ms / 1000.0
        return self.issued_at_s - ttl_s <= now_s < self.issued_at_s + ttl_s

    def with_envelope(self, *, epoch: int, seq: int, issued_at_s: float, ttl_ms: int) -> Budget:
        """Copy with the store's envelope filled in."""
        return dataclasses.replace(
            self, epoch=epoch, seq=seq, issued_at_s=issued_at_s, ttl_ms=ttl_ms
        )

    def to_fields(self) -> dict[str, str]:
        """Flat string fields as stored in the Redis hash (and sent on the pub/sub channel)."""
        return {
            "schema": str(self.schema),
            "pool": self.pool,
            "epoch": str(self.epoch),
            "seq": str(self.seq),
            "issued_at": repr(float(self.issued_at_s)),
            "ttl_ms": str(self.ttl_ms),
            "mode": self.mode.value,
            "reason": self.reason,
            "batch_tokens_per_s": repr(float(self.batch_tokens_per_s)),
            "batch_burst_tokens": str(self.batch_burst_tokens),
            "max_batch_seqs": str(self.max_batch_seqs),
            "max_batch_kv_tokens": str(self.max_batch_kv_tokens),
            "max_batch_output_tokens": str(self.max_batch_output_tokens),
        }

    def to_json(self) -> str:
        """The record as one JSON object (the pub/sub payload)."""
        return json.dumps(self.to_fields(), sort_keys=True)

    @classmethod
    def from_fields(cls, fields: dict[str, str] | dict[bytes, bytes]) -> Budget:
        """Parse a stored record; raise `BudgetRecordError` naming the bad field."""
        f = {
            (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in fields.items()
        }
        if not f:
            raise BudgetRecordError("budget record is empty")
        schema = _parse(f, "schema", int)
        if schema != SCHEMA_VERSION:
            raise BudgetRecordError(
                f"budget record has schema {schema}, this borrowd reads schema {SCHEMA_VERSION}"
            )
        mode_text = _parse(f, "mode", str)
        try:
            mode = Mode(mode_text)
        except ValueError:
            raise BudgetRecordError(f"budget field mode has unknown value {mode_text!r}") from None
        budget = cls(
            pool=_parse(f, "pool", str),
            mode=mode,
            reason=f.get("reason", ""),
            batch_tokens_per_s=_parse(f, "batch_tokens_per_s", float),
            batch_burst_tokens=_parse(f, "batch_burst_tokens", int),
            max_batch_seqs=_parse(f, "max_batch_seqs", int),
            max_batch_kv_tokens=_parse(f, "max_batch_kv_tokens", int),
            max_batch_output_tokens=_parse(f, "max_batch_output_tokens", int),
            epoch=_parse(f, "epoch", int),
            seq=_parse(f, "seq", int),
            issued_at_s=_parse(f, "issued_at", float),
            ttl_ms=_parse(f, "ttl_ms", int),
            schema=schema,
        )
        if budget.epoch < 0 or budget.seq < 0 or budget.issued_at_s < 0:
            raise BudgetRecordError("budget record has a negative epoch, seq or issued_at")
        if not 0 < budget.ttl_ms <= MAX_RECORD_TTL_MS:
            raise BudgetRecordError(
                f"budget field ttl_ms must be in 1..{MAX_RECORD_TTL_MS}, got {budget.ttl_ms}"
            )
        return budget

    @classmethod
    def from_json(cls, text: str | bytes) -> Budget:
        """Parse the pub/sub payload."""
        try:
            data = json.loads(text)
        except (ValueError, TypeError) as exc:
            raise BudgetRecordError(f"budget message is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise BudgetRecordError("budget message is not a JSON object")
        return cls.from_fields({str(k): str(v) for k, v in data.items()})


def closed_budget(pool: str, mode: Mode, reason: str) -> Budget:
    """A budget that admits no batch work (closed, stopped or failsafe)."""
    return Budget(
        pool=pool,
        mode=mode,
        reason=reason,
        batch_tokens_per_s=0.0,
        batch_burst_tokens=0,
        max_batch_seqs=0,
        max_batch_kv_tokens=0,
        max_batch_output_tokens=0,
    )


def _parse(fields: dict[str, str], name: str, kind: type):
    if name not in fields:
        raise BudgetRecordError(f"budget record lacks field {name}")
    text = fields[name]
    if kind is str:
        return text
    pattern = _INT if kind is int else _NUMBER
    if not pattern.fullmatch(text) or abs(float(text)) > MAX_RECORD_NUMBER:
        raise BudgetRecordError(f"budget field {name} has bad value {text!r}")
    return kind(text)
