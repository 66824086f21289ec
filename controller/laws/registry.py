"""Every control law by name. A new law is one module in `controller/laws/` with a class
that implements `controller.laws.base.Law` and takes `LawSettings`, plus one line here."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from borrowd.controller.laws.base import Law, LawFactory, LawSettings
from borrowd.controller.laws.mpc import MpcLaw
from borrowd.controller.laws.pi import PiLaw
from borrowd.controller.laws.slack import SlackLaw
from borrowd.models.errors import ConfigError

LAWS: Mapping[str, LawFactory] = MappingProxyType({
    "pi": PiLaw,
    "mpc": MpcLaw,
    "slack": SlackLaw,
})


def law_names() -> tuple[str, ...]:
    """The registered laws' names, in registration order."""
    return tuple(LAWS)


def _factory(name: str) -> LawFactory:
    """The factory of law `name`; `ConfigError` when no such law is registered."""
    factory = LAWS.get(name)
    if factory is None:
        raise ConfigError(f"controller.law must be one of {law_names()}, got {name!r}")
    return factory


def law_tracks_burn(name: str) -> bool:
    """Whether law `name` tracks the SLO burn when `control_on_burn` is on (its class's
    `tracks_burn`; the MPC keeps p95/SLO); `ConfigError` when no such law is registered."""
    return bool(getattr(_factory(name), "tracks_burn", True))


def build_law(name: str, settings: LawSettings) -> Law:
    """A new instance of law `name`; `ConfigError` when no such law is registered."""
    return _factory(name)(settings)
