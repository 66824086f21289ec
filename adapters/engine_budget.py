"""The engine plugin's settings (`PluginConfig`, from environment variables).

The per-step arithmetic it applies (`batch_tokens_per_step`, `engine_share`, `StepTimer`)
is pure and lives in `models.enforcement`, shared with the simulator's engine; it is
re-exported here for the plugin.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

from borrowd.models.enforcement import (
    DEFAULT_MIN_BATCH_TOKENS_PER_STEP,
    DEFAULT_STEP_GUARD_FRAC,
    INITIAL_STEP_S,
    MAX_STEP_S,
    STEP_EMA_WEIGHT,
    BudgetSource,
    StaticBudgetSource,
    StepGuard,
    StepTimer,
    batch_seq_cap,
    batch_tokens_per_step,
    engine_share,
    step_guard_for,
)
from borrowd.models.errors import ConfigError
from borrowd.models.priority import BATCH_PRIORITY
from borrowd.models.signals import Slo

__all__ = [
    "DEFAULT_BATCH_PRIORITY",
    "DEFAULT_MIN_BATCH_TOKENS_PER_STEP",
    "DEFAULT_POLL_S",
    "DEFAULT_STEP_GUARD_FRAC",
    "INITIAL_STEP_S",
    "MAX_STEP_S",
    "STEP_EMA_WEIGHT",
    "BudgetSource",
    "PluginConfig",
    "StaticBudgetSource",
    "StepGuard",
    "StepTimer",
    "batch_seq_cap",
    "batch_tokens_per_step",
    "engine_share",
]

N = TypeVar("N", int, float)

DEFAULT_BATCH_PRIORITY = BATCH_PRIORITY  # what the proxy and the gate tag batch work with
DEFAULT_POLL_S = 1.0


@dataclass(frozen=True)
class PluginConfig:
    """Settings of the engine plugin, from environment variables (see `from_env`)."""

    pool: str
    redis_url: str
    batch_priority: int = DEFAULT_BATCH_PRIORITY
    poll_s: float = DEFAULT_POLL_S
    min_batch_tokens_per_step: int = DEFAULT_MIN_BATCH_TOKENS_PER_STEP
    engines_in_pool: int = 1
    metrics_listen: tuple[str, int] | None = None
    batch_eligible: bool = True
    slo_itl_s: tuple[float, ...] = ()
    step_guard_frac: float = DEFAULT_STEP_GUARD_FRAC
    enforce: bool = True

    def __post_init__(self) -> None:
        for slo_s in self.slo_itl_s:
            if not (math.isfinite(slo_s) and slo_s > 0):
                raise ConfigError(f"BORROWD_SLO_ITL_S must list seconds > 0, got {slo_s!r}")
        if not 0 <= self.step_guard_frac <= 1:
            raise ConfigError(
                f"BORROWD_STEP_GUARD_FRAC must be in [0, 1], got {self.step_guard_frac!r}")
        if not self.pool:
            raise ConfigError("BORROWD_POOL must name the pool whose budget this engine enforces")
        if not self.poll_s > 0:
            raise ConfigError(f"BORROWD_BUDGET_POLL_S must be > 0, got {self.poll_s!r}")
        if self.engines_in_pool < 1:
            raise ConfigError(f"BORROWD_POOL_ENGINES must be >= 1, got {self.engines_in_pool!r}")
        if self.min_batch_tokens_per_step < 1:
            raise ConfigError(
                "BORROWD_MIN_BATCH_TOKENS_PER_STEP must be >= 1, "
                f"got {self.min_batch_tokens_per_step!r}"
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> PluginConfig:
        """Read `BORROWD_POOL` (required), `BORROWD_REDIS_URL`, `BORROWD_BATCH_PRIORITY`,
        `BORROWD_BUDGET_POLL_S`, `BORROWD_MIN_BATCH_TOKENS_PER_STEP`, `BORROWD_POOL_ENGINES`
        (how many engines share the pool's budget, default 1: with batch on some engines
        only, the eligible ones), `BORROWD_METRICS_LISTEN` (HOST:PORT of the plugin's own
        /metrics, default none), `BORROWD_BATCH_ELIGIBLE` (`true`, the default, or `false`:
        this engine may not take batch and schedules none, whatever the budget),
        `BORROWD_SLO_ITL_S` (the pool's p95 ITL SLOs in seconds, comma-separated: bounds of the
        interference histogram, where the daemon reads the burn; default none, vLLM's bounds
        only, which hold the default 50 ms; the smallest is the step guard's SLO),
        `BORROWD_STEP_GUARD_FRAC` (the step guard holds steps carrying interactive decodes
        under this x that SLO, default 0.9; 0: off), `BORROWD_ENFORCE` (`true`, the default,
        or `false`: the engine only counts and serves the interference series, for a pool
        whose budget the admission gate alone enforces; it reads no budget, caps no batch
        token and runs no step guard)."""
        from borrowd.adapters.redis_conn import resolve_redis_url

        env = os.environ if env is None else env
        return cls(
            pool=env.get("BORROWD_POOL", ""),
            redis_url=resolve_redis_url(env.get("BORROWD_REDIS_URL")),
            batch_priority=_env_number(env, "BORROWD_BATCH_PRIORITY", int,
                                       DEFAULT_BATCH_PRIORITY),
            poll_s=_env_number(env, "BORROWD_BUDGET_POLL_S", float, DEFAULT_POLL_S),
            min_batch_tokens_per_step=_env_number(env, "BORROWD_MIN_BATCH_TOKENS_PER_STEP", int,
                                                  DEFAULT_MIN_BATCH_TOKENS_PER_STEP),
            engines_in_pool=_env_number(env, "BORROWD_POOL_ENGINES", int, 1),
            metrics_listen=_env_listen(env, "BORROWD_METRICS_LISTEN"),
            batch_eligible=_env_bool(env, "BORROWD_BATCH_ELIGIBLE", True),
            slo_itl_s=_env_seconds(env, "BORROWD_SLO_ITL_S"),
            step_guard_frac=_env_number(env, "BORROWD_STEP_GUARD_FRAC", float,
                                        DEFAULT_STEP_GUARD_FRAC),
            enforce=_env_bool(env, "BORROWD_ENFORCE", True),
        )

    def step_guard(self) -> StepGuard | None:
        """The step guard this engine runs (`models.enforcement.StepGuard`): at
        `step_guard_frac` x the smallest ITL SLO (the default 50 ms when none is given);
        None when off, or when the plugin does not enforce."""
        if not self.enforce:
            return None
        return step_guard_for(min(self.slo_itl_s, default=Slo().itl_p95_s),
                              self.step_guard_frac)


def _env_seconds(env: Mapping[str, str], name: str) -> tuple[float, ...]:
    text = env.get(name, "")
    try:
        return tuple(float(item) for item in text.split(",") if item.strip())
    except ValueError:
        raise ConfigError(
            f"{name} must be seconds separated by commas (0.03,0.05), got {text!r}") from None


def _env_bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    text = env.get(name)
    if text is None or text == "":
        return default
    value = _BOOLS.get(text.strip().lower())
    if value is None:
        raise ConfigError(f"{name} must be true or false, got {text!r}")
    return value


_BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def _env_listen(env: Mapping[str, str], name: str) -> tuple[str, int] | None:
    text = env.get(name)
    if text is None or text == "":
        return None
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{name} must be HOST:PORT, got {text!r}")
    return host, int(port)


def _env_number(env: Mapping[str, str], name: str, kind: type[N], default: N) -> N:
    text = env.get(name)
    if text is None or text == "":
        return default
    try:
        return kind(text)
    except ValueError:
        raise ConfigError(f"{name} must be a {kind.__name__}, got {text!r}") from None
