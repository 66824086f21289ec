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

from borrowd.controller.config import BorrowdConfig, PoolConfig
from borrowd.controller.policy import ControllerConfig, ControllerPolicy, build_policy
from borrowd.models.plant.model import PlantModel


def load_plant(pool: PoolConfig) -> PlantModel | None:
    """The pool's identified plant, or None when `plant_file` is empty."""
    return PlantModel.load(Path(pool.plant_file)) if pool.plant_file else None


def scaled_limits(controller: ControllerConfig, scale: float, kv: bool) -> ControllerConfig:
    """`controller` with every pool-wide rate times `scale`: u_max, the ramp's cap, the
    failsafe floor, the PI's gains without a plant and the budget they are given at, the
    MPC's rate limits, the slack law's step, and the sequence cap (at least 1); with `kv`
    also the KV cap's share of the pool's capacity and its absolute ceiling (at least 1). A
    pool `scale` times as large carries `scale` times the batch at the same load a replica,
    so a latency moves by 1/`scale` as much per token/s of budget: gains written for one
    size act on another at the same speed only scaled. The ramp's start and slew stay as
    written: they are a probe, the least budget whose effect a burn can show, and a halved
    start on two replicas cost the matrix's `chat-2x-failure` its cold start (README)."""
    caps = controller.caps
    caps = dataclasses.replace(caps, max_seqs=max(1, math.ceil(caps.max_seqs * scale)))
    if kv:
        caps = dataclasses.replace(
            caps,
            max_kv_frac=caps.max_kv_frac * scale,
            max_kv_tokens=(None if caps.max_kv_tokens is None
                           else max(1, math.ceil(caps.max_kv_tokens * scale))),
        )
    supervisor = controller.supervisor
    pi, mpc = controller.pi, controller.mpc
    return dataclasses.replace(
        controller,
        u_max_tokens_per_s=controller.u_max_tokens_per_s * scale,
        supervisor=dataclasses.replace(
            supervisor,
            ramp_cap_tokens_per_s=supervisor.ramp_cap_tokens_per_s * scale,
            floor_tokens_per_s=supervisor.floor_tokens_per_s * scale,
        ),
        pi=dataclasses.replace(
            pi,
            kp_tokens_per_s=pi.kp_tokens_per_s * scale,
            ki_tokens_per_s2=pi.ki_tokens_per_s2 * scale,
            gain_reference_tokens_per_s=pi.gain_reference_tokens_per_s * scale,
        ),
        mpc=dataclasses.replace(
            mpc,
            up_rate_tokens_per_s2=mpc.up_rate_tokens_per_s2 * scale,
            down_rate_tokens_per_s2=mpc.down_rate_tokens_per_s2 * scale,
        ),
        slack=dataclasses.replace(
            controller.slack,
            grow_step_tokens_per_s=controller.slack.grow_step_tokens_per_s * scale,
        ),
        caps=caps,
    )


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
