"""`borrowd identify` and `borrowd tune` on synthetic plants and bad input."""

from __future__ import annotations

import math
import tomllib
from pathlib import Path

import numpy as np
import pytest
from borrowd.controller.cli import main
from borrowd.models.plant.excitation import prbs
from borrowd.models.plant.fopdt import simulate_fopdt
from borrowd.models.plant.model import PlantModel, identify_plant


@pytest.fixture
def plant_file(tmp_path: Path) -> Path:
    """A plant identified from a synthetic FOPDT experiment, saved as JSON."""
    u = prbs(0.0, 40_000.0, 600.0, 1.0, 15.0, seed=3)
    y = simulate_fopdt(u, a=math.exp(-1 / 5.0), gain=1e-5, dead_steps=2, u0=0.0, y0=0.3,
                       y_init=0.3)
    plant = identify_plant(
        u, {"ttft": y, "itl": 0.5 * y + 0.1}, 1.0, interactive_tokens_per_s=1000.0, source="t"
    )
    path = tmp_path / "plant.json"
    plant.save(path)
    return path


def test_tune_prints_gains_margins_and_step_figures(plant_file, tmp_path, capsys):
    """tune prints a row per output with margins and step figures, plots, writes the gains."""
    png, toml = tmp_path / "step.png", tmp_path / "gains.toml"
    rc = main(["tune", "--plant", str(plant_file), "--method", "imc", "--tc", "3",
               "--plot", str(png), "--write-config", str(toml)])
    out = capsys.readouterr().out
    assert rc == 0
    rows = {
        line.split()[0]: line.split()
        for line in out.splitlines()
        if line.startswith(("ttft ", "itl "))
    }
    assert set(rows) == {"ttft", "itl"}
    gain_margin, phase_margin = float(rows["ttft"][3]), float(rows["ttft"][4])
    assert gain_margin > 1.5 and 30.0 < phase_margin < 90.0
    assert png.stat().st_size > 0
    assert "[pools.controller.pi]" in toml.read_text()


def test_written_gains_load_into_borrowd_toml(plant_file, tmp_path, capsys):
    """The --write-config table, appended to a pool's [[pools]] table, is accepted by
    `borrowd config check` and sets that pool's PI gains."""
    table = tmp_path / "gains.toml"
    assert main(["tune", "--plant", str(plant_file), "--write-config", str(table)]) == 0
    written = tomllib.loads(table.read_text())["pools"]["controller"]["pi"]
    config = tmp_path / "borrowd.toml"
    config.write_text('[[pools]]\nname = "chat"\n' + table.read_text())
    capsys.readouterr()
    assert main(["config", "check", str(config)]) == 0, capsys.readouterr().err
    pi = tomllib.loads(config.read_text())["pools"][0]["controller"]["pi"]
    assert pi == written and pi["kp_tokens_per_s"] > 0


def test_step_plot_shows_the_informative_part(plant_file):
    """The step plot spans 1.5x the slowest settling time, not the 10x-time-constant
    simulation that was mostly a flat line."""
    from borrowd.controller.cli.control import step_plot_span_s
    from borrowd.controller.tuning import analyse_loop

    plant = PlantModel.load(plant_file)
    reports = [analyse_loop(plant, o.name, "simc", 0.0, 1.0) for o in plant.outputs]
    span_s = step_plot_span_s(reports)
    assert span_s == pytest.approx(1.5 * max(r.settling_time_s for r in reports))
    assert span_s < 0.5 * reports[0].step_t_s[-1]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["tune", "--plant", "/nonexistent/plant.json"], "/nonexistent/plant.json"),
        (["identify", "--prometheus", "http://127.0.0.1:1", "--out", "x.json"], "--pool"),
        (["identify", "--prometheus", "http://127.0.0.1:1", "--pool", "p", "--start", "yesterday",
          "--end", "1", "--out", "x.json"], "yesterday"),
    ],
    ids=["missing-plant", "prometheus-needs-pool", "bad-start-time"],
)
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    """Bad arguments give a one-line error naming the problem and exit code 2."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_identify_refuses_a_flat_experiment(tmp_path, capsys):
    """An experiment whose budget never moves is refused with the reason, nothing written."""
    out = tmp_path / "plant.json"
    rc = main(["identify", "--scenario", "seed", "--u-low", "30000", "--u-high", "30001",
               "--duration", "120", "--hold", "20", "--out", str(out)])
    assert rc == 2
    assert "unusable plant fit" in capsys.readouterr().err
    assert not out.exists()


def _recorded_history(slo_itl_s: float, burn_share: bool):
    """A recorded history whose ITL responds to a PRBS budget as a FOPDT: as the p95 (over
    `slo_itl_s`) or as the share of gaps above the SLO (1000 gaps a window)."""
    from borrowd.controller.prom_source import History
    from borrowd.models.signals import Observation

    u = prbs(0.0, 40_000.0, 600.0, 1.0, 15.0, seed=3)
    y = simulate_fopdt(u, a=math.exp(-1 / 5.0), gain=1e-5, dead_steps=2, u0=0.0, y0=0.3,
                       y_init=0.3)
    times = np.arange(u.size, dtype=float)
    observations = tuple(
        Observation(now_s=float(t), age_s=0.0, window_s=15.0, ttft_p95_s=float(v),
                    itl_p95_s=slo_itl_s * (0.5 * float(v) + 0.1),
                    interactive_tokens_per_s=1000.0,
                    itl_over_slo_frac=0.01 + 0.2 * float(v) if burn_share else math.nan,
                    itl_samples=1000.0 if burn_share else math.nan,
                    ttft_over_slo_frac=0.0 if burn_share else math.nan,
                    ttft_samples=100.0 if burn_share else math.nan)
        for t, v in zip(times, y, strict=True))
    return History(times, u, observations)


def test_identify_from_prometheus_keeps_no_password(tmp_path, capsys, monkeypatch):
    """A Prometheus URL with basic auth is neither printed nor written into plant.json."""
    import borrowd.controller.prom_source as prom_source

    history = _recorded_history(0.05, burn_share=True)
    monkeypatch.setattr(prom_source, "connect_prometheus", lambda url, timeout_s: object())
    monkeypatch.setattr(prom_source, "identification_history", lambda *a, **k: history)
    out = tmp_path / "plant.json"
    main(["identify", "--prometheus", "http://ops:hunter2@prom:9090", "--pool", "chat",
          "--start", "0", "--end", "600", "--out", str(out), "--min-r2", "0"])
    captured = capsys.readouterr()
    assert "hunter2" not in captured.out + captured.err + out.read_text()
    assert "ops:***@prom:9090" in out.read_text()


@pytest.mark.parametrize(("on_burn", "law", "signal"),
                         [(True, [], "burn"), (False, [], "p95_over_slo"),
                          (True, ["--law", "mpc"], "p95_over_slo")],
                         ids=["pi-on-burn", "pi-on-p95", "for-mpc"])
def test_identify_from_prometheus_fits_what_the_pools_law_tracks(tmp_path, capsys, monkeypatch,
                                                                  on_burn: bool, law: list,
                                                                  signal: str):
    """With the daemon's config, the history is read at the pool's own SLOs and rules window,
    and the plant is fitted on the signal its law tracks: the burn, or p95/SLO (control_on_burn
    off, or a plant for the MPC, which plans on p95/SLO)."""
    import borrowd.controller.prom_source as prom_source

    asked: dict = {}

    def history(client, pool, slo, **kwargs):
        asked.update(pool=pool, slo=slo, **kwargs)
        return _recorded_history(0.0075, burn_share=on_burn)

    config = tmp_path / "borrowd.toml"
    config.write_text(
        '[prometheus]\nwindow = "1m"\n[[pools]]\nname = "other"\n[[pools]]\nname = "chat"\n'
        "[pools.controller]\nslo_ttft_p95_s = 0.3\nslo_itl_p95_s = 0.0075\n"
        f"control_on_burn = {str(on_burn).lower()}\n")
    monkeypatch.setattr(prom_source, "connect_prometheus", lambda url, timeout_s: object())
    monkeypatch.setattr(prom_source, "identification_history", history)
    out = tmp_path / "plant.json"
    rc = main(["identify", "--prometheus", "http://prom:9090", "--pool", "chat", "--config",
               str(config), "--start", "0", "--end", "600", "--out", str(out), "--min-r2", "0",
               *law])
    assert rc == 0, capsys.readouterr().err
    assert asked["pool"] == "chat" and asked["window"] == "1m"
    assert asked["burn"] is (signal == "burn")
    assert (asked["slo"].itl_p95_s, asked["slo"].ttft_p95_s) == (0.0075, 0.3)
    assert PlantModel.load(out).signal == signal


def test_identify_from_prometheus_names_a_pool_not_in_the_config(tmp_path, capsys):
    """A --pool the config does not hold: one line naming it and the pools there, exit 2."""
    config = tmp_path / "borrowd.toml"
    config.write_text('[[pools]]\nname = "other"\n')
    rc = main(["identify", "--prometheus", "http://prom:9090", "--pool", "chat", "--config",
               str(config), "--start", "0", "--end", "600", "--out", str(tmp_path / "p.json")])
    err = capsys.readouterr().err
    assert rc == 2 and "'chat' is not in" in err and "other" in err
    assert len(err.strip().splitlines()) == 1
