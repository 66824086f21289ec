"""`--set KEY=VALUE`: controller settings over a config, checked as a file's keys are."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from borrowd.controller.cli import main
from borrowd.controller.closed_loop import SimControllers, example_pool
from borrowd.controller.config import load_config
from borrowd.models.config_loader import parse_settings, with_settings
from borrowd.models.errors import ConfigError
from borrowd.models.sim.scenario import get_scenario

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "borrowd.toml"
SEED = get_scenario("seed")


def test_parse_settings_nests_dotted_keys_and_reads_toml_values() -> None:
    table = parse_settings(["pi.kp_tokens_per_s=12000", "pi.delay_scaling=false",
                            "enforcement=engine", "supervisor.quiet_s = 2.5"])
    assert table == {"pi": {"kp_tokens_per_s": 12000, "delay_scaling": False},
                     "enforcement": "engine", "supervisor": {"quiet_s": 2.5}}


@pytest.mark.parametrize("item", ["pi", "=3", "pi..kp=1", ".x=1"])
def test_parse_settings_names_a_malformed_item(item: str) -> None:
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        parse_settings([item])


def test_a_value_and_a_table_under_one_key_is_refused() -> None:
    with pytest.raises(ConfigError, match="given a value already"):
        parse_settings(["pi=1", "pi.kp_tokens_per_s=2"])


def test_with_settings_changes_only_the_keys_given() -> None:
    base = example_pool().controller
    changed = with_settings(base, parse_settings(["pi.kp_tokens_per_s=12000",
                                                  "caps.max_seqs=8"]), "controller")
    assert changed.pi.kp_tokens_per_s == 12000.0
    assert changed.caps.max_seqs == 8
    assert changed.pi.ki_tokens_per_s2 == base.pi.ki_tokens_per_s2
    assert changed.supervisor == base.supervisor


@pytest.mark.parametrize(("item", "message"), [
    ("pi.kp=1", "controller.pi.kp: unknown key"),
    ("predict.step_share_for_ttft=true",
     "controller.predict.step_share_for_ttft: this key moved to burn.step_share_for_ttft"),
    ("pi.kp_tokens_per_s=abc", "controller.pi.kp_tokens_per_s: must be a number"),
    ("pi.kp_tokens_per_s=-1", "pi.kp_tokens_per_s must be >= 0"),
    ("pi=3", "controller.pi: must be a table"),
    ("law=nope", "controller"),
])
def test_with_settings_names_the_bad_key(item: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        with_settings(example_pool().controller, parse_settings([item]), "controller")


def test_sim_controllers_apply_settings_over_the_defaults_and_a_config() -> None:
    defaults = SimControllers(settings=("pi.fall_floor_frac=0.5",)).pool_config("pi", SEED)
    assert defaults.controller.pi.fall_floor_frac == 0.5
    assert defaults.controller.slo_ttft_p95_s == SEED.slo.ttft_p95_s
    configured = SimControllers(load_config(EXAMPLE), None, ("burn.fast_s=20",))
    assert configured.pool_config("pi", SEED).controller.burn.fast_s == 20.0


def test_sim_set_equals_the_same_key_in_the_config_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`borrowd sim --set K=V` runs exactly as a config file with K = V does."""
    monkeypatch.setattr("borrowd.models.sim.run.calibrate_rate_scale", lambda *a, **k: 0.2358)
    text = EXAMPLE.read_text().replace("kp_tokens_per_s = 20000.0", "kp_tokens_per_s = 9000.0")
    assert "kp_tokens_per_s = 9000.0" in text
    edited = tmp_path / "borrowd.toml"
    edited.write_text(text)
    common = ["sim", "--scenario", "seed", "--policy", "pi", "--duration", "60"]
    assert main([*common, "--config", str(EXAMPLE), "--set", "pi.kp_tokens_per_s=9000",
                 "--json", str(tmp_path / "set.json")]) == 0
    assert main([*common, "--config", str(edited), "--json", str(tmp_path / "file.json")]) == 0
    drop = ("wall_s", "speed")
    by_set = {k: v for k, v in json.loads((tmp_path / "set.json").read_text()).items()
              if k not in drop}
    by_file = {k: v for k, v in json.loads((tmp_path / "file.json").read_text()).items()
               if k not in drop}
    assert by_set == by_file


def test_sim_set_with_a_bad_key_exits_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["sim", "--scenario", "seed", "--policy", "pi", "--duration", "10",
               "--set", "pi.kp=1"])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert err.count("\n") == 0 and "controller.pi.kp: unknown key" in err
