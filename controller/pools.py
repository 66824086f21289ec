"""From a pool's config to the controller the daemon runs for it (no network): its plant
file, the burn-rule check, the limits sized to the replicas that may take batch, and the
state it exports. Shared by `borrowd run` and the simulator's CLI, so both run a pool's
config the same way."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import structlog
from borrowd.controller.config import BorrowdConfig, PoolConfig
from borrowd.controller.policy import ControllerConfig, ControllerPolicy, build_policy
from borrowd.models.plant.model import PlantModel

# The SLO-burn recording rules (deploy/prometheus/borrowd.rules.yml) count the share of
# interactive samples above these bucket bounds.
RULES_SLO_TTFT_S = 1.0
RULES_SLO_ITL_S = 0.05


def load_plant(pool: PoolConfig) -> PlantModel | None:
    """The pool's identified plant, or None when `plant_file` is empty."""
    return PlantModel.load(Path(pool.plant_file)) if pool.plant_file else None


def burn_matches_rules(controller: ControllerConfig) -> bool:
    """True when the pool's SLOs are the bounds the burn recording rules measure against."""
    return (
        math.isclose(controller.slo_ttft_p95_s, RULES_SLO_TTFT_S)
        and math.isclose(controller.slo_itl_p95_s, RULES_SLO_ITL_S)
    )


def sized_to_eligible(controller: ControllerConfig, share: float) -> ControllerConfig:
    """`controller` with its pool-wide limits scaled to the `share` of the replicas that
    may take batch: u_max (the law's upper limit), the ramp's cap, the sequence cap (at least
    1), and the KV cap's share of the pool's capacity (and its absolute ceiling when set, at
    least 1). A share of 1 leaves it as written."""
    if share >= 1.0:
        return controller
    caps = controller.caps
    supervisor = controller.supervisor
    return dataclasses.replace(
        controller,
        u_max_tokens_per_s=controller.u_max_tokens_per_s * share,
        supervisor=dataclasses.replace(
            supervisor, ramp_cap_tokens_per_s=supervisor.ramp_cap_tokens_per_s * share
        ),
        caps=dataclasses.replace(
            caps,
            max_seqs=max(1, math.ceil(caps.max_seqs * share)),
            max_kv_frac=caps.max_kv_frac * share,
            max_kv_tokens=(None if caps.max_kv_tokens is None
                           else max(1, math.ceil(caps.max_kv_tokens * share))),
        ),
    )


def pool_controller(pool: PoolConfig, *, burn_at_slo: bool = False) -> ControllerConfig:
    """The controller settings the daemon runs for `pool`, its limits sized to the replicas
    that may take batch (`sized_to_eligible`).

    A pool whose SLOs differ from the burn rules' bucket bounds controls on its p95s: the
    burn read from Prometheus would measure a different line than its SLO. A source that
    measures the burn at the pool's own SLOs (`burn_at_slo`: the simulator) keeps it.
    """
    controller = pool.controller
    if controller.control_on_burn and not burn_at_slo and not burn_matches_rules(controller):
        structlog.get_logger("borrowd.daemon").warning(
            "burn_off_for_slo", pool=pool.name, slo_ttft_p95_s=controller.slo_ttft_p95_s,
            slo_itl_p95_s=controller.slo_itl_p95_s, rules_ttft_s=RULES_SLO_TTFT_S,
            rules_itl_s=RULES_SLO_ITL_S,
        )
        controller = dataclasses.replace(controller, control_on_burn=False)
    return sized_to_eligible(controller, pool.batch_share())


def build_pool_policy(
    pool: PoolConfig, plant: PlantModel | None = None, *, burn_at_slo: bool = False
) -> ControllerPolicy:
    """The controller policy of one pool; `plant` (when given) stands in for its plant file;
    `burn_at_slo` when the metrics source measures the burn at the pool's own SLOs."""
    return build_policy(pool_controller(pool, burn_at_slo=burn_at_slo), pool.name,
                        plant if plant is not None else load_plant(pool))


def build_policies(config: BorrowdConfig) -> dict[str, ControllerPolicy]:
    """One controller policy per pool (reads plant files; no network)."""
    return {pool.name: build_pool_policy(pool) for pool in config.pools}
