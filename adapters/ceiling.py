"""A pool's rollout ceiling in Redis: `borrowd:{POOL}:ceiling`, the most batch tokens per
second its published budgets may carry (`borrowd rollout` writes it; the daemon's store
clamps each budget to it before publishing, `models.rollout.apply_ceiling`). Unset: no
ceiling beyond the controller's own `u_max_tokens_per_s`.
"""

from __future__ import annotations

import json

import redis
from borrowd.adapters.store import PoolKeys
from borrowd.models.rollout import parse_ceiling


def ceiling_key(pool: str) -> str:
    """The ceiling's key (the pool's hash tag, beside its budget record)."""
    return f"borrowd:{{{PoolKeys(pool).pool}}}:ceiling"


def rollout_key(pool: str) -> str:
    """Key of the last rollout's record (JSON): steps, verdicts, accepted ceiling."""
    return f"borrowd:{{{PoolKeys(pool).pool}}}:rollout"


def drill_key(pool: str, kind: str) -> str:
    """Key of the last drill's record (JSON) of `kind` (stop, ...)."""
    return f"borrowd:{{{PoolKeys(pool).pool}}}:drill:{kind}"


def read_ceiling(client: redis.Redis, pool: str) -> float | None:
    """The pool's ceiling in tokens/s, or None when none is set (malformed reads as 0)."""
    raw = client.get(ceiling_key(pool))
    if isinstance(raw, bytes):
        raw = raw.decode(errors="replace")
    return parse_ceiling(None if raw is None else str(raw))


def write_ceiling(client: redis.Redis, pool: str, tokens_per_s: float | None) -> None:
    """Set the ceiling (kept until changed), or remove it with None."""
    if tokens_per_s is None:
        client.delete(ceiling_key(pool))
    else:
        client.set(ceiling_key(pool), f"{tokens_per_s:.6g}")


def write_record(client: redis.Redis, key: str, record: dict) -> None:
    """Keep `record` as JSON at `key` (the last one of its kind)."""
    client.set(key, json.dumps(record, sort_keys=True))
