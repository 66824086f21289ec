"""Registry of engine cores the simulator can run a replica on (`--engine NAME`).

A core is a class built as `Core(config: EngineConfig, profile: StepProfile)` offering the
`EngineCore` protocol below (the native `models.sim.engine.Engine` is the reference). Cores
are imported lazily, so an optional one (vLLM's own scheduler) costs nothing when unused.
"""

from __future__ import annotations

import importlib
from typing import Protocol

from borrowd.models.errors import InputError
from borrowd.models.sim.engine import EngineConfig, StepResult
from borrowd.models.sim.profiles import StepProfile
from borrowd.models.sim.request import Request

ENGINE_CORES: dict[str, str] = {
    "native": "borrowd.models.sim.engine:Engine",
    "vllm": "borrowd.models.sim.vllm_core:VllmEngine",
}
DEFAULT_ENGINE = "native"


class EngineCore(Protocol):
    """What the fleet needs from one replica's engine."""

    config: EngineConfig
    running: list[Request]
    requests: dict[str, Request]
    num_preemptions: int

    def add_request(self, req: Request) -> bool:
        """Queue a request; False (req.status REFUSED, req.error) when refused."""
        ...

    def abort_request(self, request_id: str) -> Request | None:
        """Drop a request and free its KV; None when unknown."""
        ...

    def step(self, start_s: float) -> StepResult | None:
        """Run one step from `start_s`; None when idle."""
        ...

    def has_work(self) -> bool:
        """True while a request is running or waiting."""
        ...

    def kv_usage_frac(self) -> float:
        """Fraction of KV blocks in use."""
        ...

    def num_running(self, klass: str | None = None) -> int:
        """Running requests of one class or all."""
        ...

    def num_waiting(self, klass: str | None = None) -> int:
        """Waiting requests of one class or all."""
        ...


def make_engine(name: str, config: EngineConfig, profile: StepProfile) -> EngineCore:
    """Build a replica engine of core `name`; `InputError` when unknown or not installed."""
    target = ENGINE_CORES.get(name)
    if target is None:
        known = ", ".join(sorted(ENGINE_CORES))
        raise InputError(f"unknown engine core {name!r} (known: {known})")
    module_name, cls_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise InputError(f"engine core {name!r} is not available: {exc}") from None
    return getattr(module, cls_name)(config, profile)
