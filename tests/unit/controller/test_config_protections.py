"""No config value can disable or invert a protection: each is refused naming key and value."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from borrowd.controller.config import config_from_mapping, load_config
from borrowd.models.errors import ConfigError


def _pool(**controller: object) -> dict:
    return {"pools": [{"name": "a", "controller": controller}]}


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        (_pool(feedforward={"gain": -5.0}), "pools[0].controller.feedforward.gain: -5.0"),
        (_pool(feedforward={"alpha": 7.0}), "pools[0].controller.feedforward.alpha: 7.0"),
        (_pool(feedforward={"alpha": 0.0}), "pools[0].controller.feedforward.alpha: 0.0"),
        (_pool(feedforward={"horizon_s": -100.0}),
         "pools[0].controller.feedforward.horizon_s: -100.0"),
        (_pool(slo_itl_p95_s=math.inf), "pools[0].controller.slo_itl_p95_s: must be finite"),
        (_pool(supervisor={"max_age_s": math.inf}),
         "pools[0].controller.supervisor.max_age_s: must be finite"),
        (_pool(supervisor={"cut_kv_frac": 5.0}),
         "pools[0].controller.supervisor.cut_kv_frac: 5.0"),
        (_pool(tick_s=math.nan), "pools[0].controller.tick_s: must be a number, got nan"),
        ({**_pool(), "daemon": {"metrics_listen": ":9105"}}, "daemon.metrics_listen: bad value"),
        ({**_pool(), "prometheus": {"timeout_s": math.inf}}, "prometheus.timeout_s"),
    ],
    ids=["negative-ff-gain", "alpha-7", "alpha-0", "negative-horizon", "inf-slo",
         "inf-max-age", "kv-frac-5", "nan-tick", "listen-all-implicit", "inf-timeout"],
)
def test_protection_breaking_values_are_refused(data: dict, needle: str) -> None:
    """Each value that would invert or switch off a protection is a ConfigError naming it."""
    with pytest.raises(ConfigError, match=re.escape(needle)):
        config_from_mapping(data)


def test_binding_every_interface_is_allowed_when_written_out() -> None:
    """`0.0.0.0:9105` is accepted: binding every interface is fine when it is explicit."""
    config = config_from_mapping({**_pool(), "daemon": {"metrics_listen": "0.0.0.0:9105"}})
    assert config.daemon.metrics_listen == "0.0.0.0:9105"


def test_file_errors_are_one_line_naming_file_key_and_value(tmp_path: Path) -> None:
    """A bad value in a file gives one line: the file, the key path and the value."""
    path = tmp_path / "borrowd.toml"
    path.write_text('[[pools]]\nname = "a"\n[pools.controller.feedforward]\ngain = -5.0\n')
    with pytest.raises(ConfigError) as caught:
        load_config(path, {})
    message = str(caught.value)
    assert "\n" not in message
    assert str(path) in message and "feedforward.gain: -5.0" in message
