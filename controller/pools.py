"""From a pool's config to the controller the daemon runs for it (no network): its plant
file, the limits sized to the replicas that may take batch, and the state it exports. Shared
by `borrowd run` and the simulator's CLI, so both run a pool's config the same way.

Both sources read the SLO burn at the pool's own SLOs (the simulator counts it exactly;
`PrometheusSource` reads each histogram at the bucket bound equal to the SLO), so burn control
stays as configured at any SLO. Where Prometheus holds no bucket at the pool's SLO (an old
proxy or engine), the source leaves the share unread and counts `missing_bound`, and the law
and the supervisor control that output on its p95 (`tracked_outputs`, `latency_checks`)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import TypeVar

from borrowd.controller.config import BorrowdConfig, PoolConfig
from borrowd.controller.policy import ControllerConfig, ControllerPolicy, build_policy
from borrowd.models.config_loader import PER_POOL
from borrowd.models.plant.model import PlantModel

T = TypeVar("T")


def load_plant(pool: PoolConfig) -> PlantModel | None:
    """The pool's identified plant, or None when `plant_file` is empty."""
    return PlantModel.load(Path(pool.plant_file)) if pool.plant_file else None


def scaled_limits(controller: ControllerConfig, scale: float, kv: bool) -> ControllerConfig:
    """`controller` with every pool-wide rate times `scale` (each field whose metadata marks
    it `per_pool`: u_max, the ramp's cap, the failsafe floor, the PI's gains without a plant
    and the budget they are given at, the MPC's rate limits, the slack law's step) and the
    sequence cap (at least 1); with `kv` also the KV cap's share of the pool's capacity and
    its absolute ceiling (at least 1). A pool `scale` times as large carries `scale` times
    the batch at the same load a replica, so a latency moves by 1/`scale` as much per
    token/s of budget: gains written for one size act on another at the same speed only
    scaled. The ramp's start and slew are not marked: they are a probe, the least budget
    whose effect a burn can show, and a halved start on two replicas cost the matrix's
    `chat-2x-failure` its cold start (README)."""
    caps = controller.caps
    caps = dataclasses.replace(caps, max_seqs=max(1, math.ceil(caps.max_seqs * scale)))
    if kv:
        caps = dataclasses.replace(
            caps,
            max_kv_frac=caps.max_kv_frac * scale,
            max_kv_tokens=(None if caps.max_kv_tokens is None
                           else max(1, math.ceil(caps.max_kv_tokens * scale))),
        )
    return dataclasses.replace(_rates_times(controller, scale), caps=caps)


def _rates_times(config: T, scale: float) -> T:
    """`config` (a config dataclass) with each `per_pool` field, in it and in the config
    dataclasses it holds, times `scale`."""
    changes: dict[str, object] = {}
    for item in dataclasses.fields(config):  # type: ignore[arg-type]
        value = getattr(config, item.name)
        if item.metadata.get(PER_POOL):
            changes[item.name] = value * scale
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            changes[item.name] = _rates_times(value, scale)
    return dataclasses.replace(config, **changes)  # type: ignore[type-var]


def sized_to_fleet(controller: ControllerConfig, replicas: int) -> ControllerConfig:
    """`controller` with the rates written for `limits_replicas` replicas scaled to a pool
    of `replicas` (`scaled_limits`). The KV cap is a share of the capacity measured and
    needs no scaling. Unchanged when either count is 0."""
    if replicas <= 0 or controller.limits_replicas <= 0 or replicas == controller.limits_replicas:
        return controller
    return scaled_limits(controller, replicas / controller.limits_replicas, kv=False)


def sized_to_eligible(controller: ControllerConfig, share: float) -> ControllerConfig:
    """`controller` with its pool-wide rates scaled to the `share` of the replicas that
    may take batch (`scaled_limits`), and the KV cap's share of the pool's capacity (and
    its absolute ceiling when set). A share of 1 leaves it as written."""
    if share >= 1.0:
        return controller
    return scaled_limits(controller, share, kv=True)


def pool_controller(pool: PoolConfig) -> ControllerConfig:
    """The controller settings the daemon runs for `pool`, its limits sized to its replicas
    (`sized_to_fleet`) and to the share of them that may take batch (`sized_to_eligible`);
    burn control as configured, at any SLO."""
    return sized_to_eligible(sized_to_fleet(pool.controller, pool.replicas),
                             pool.batch_share())


def build_pool_policy(pool: PoolConfig, plant: PlantModel | None = None) -> ControllerPolicy:
    """The controller policy of one pool; `plant` (when given) stands in for its plant file."""
    return build_policy(pool_controller(pool), pool.name,
                        plant if plant is not None else load_plant(pool))


def build_policies(config: BorrowdConfig) -> dict[str, ControllerPolicy]:
    """One controller policy per pool (reads plant files; no network)."""
    return {pool.name: build_pool_policy(pool) for pool in config.pools}
