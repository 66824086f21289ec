"""Tests of scenario files: the built-in ones, the template, validation, paths, SLO flags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from borrowd.controller.cli import main
from borrowd.models.errors import InputError
from borrowd.models.sim.scenario import (
    KEYS,
    SEED,
    SEED_FAILURE,
    example_text,
    get_scenario,
    load_scenario_file,
    with_slo,
)
from borrowd.models.sim.trace import resolve_trace


def test_builtin_names_load_their_files() -> None:
    """`seed` and `seed-failure` are files whose values are the dataclass defaults."""
    assert get_scenario("seed") == SEED
    assert get_scenario("seed-failure") == SEED_FAILURE


def test_template_round_trips(tmp_path: Path) -> None:
    """The printed template is a valid scenario file equal to seed, naming every key."""
    text = example_text()
    path = tmp_path / "mine.toml"
    path.write_text(text)
    assert load_scenario_file(path) == SEED
    for key in KEYS:
        assert f"{key.name.rpartition('.')[2]} = " in text


def test_absent_sections_turn_features_off(tmp_path: Path) -> None:
    """A file without [interactive.burst] has no burst; absent keys keep seed's values."""
    path = tmp_path / "small.toml"
    path.write_text('replicas = 2\n[slo]\nitl_p95_s = 0.1\n')
    sc = load_scenario_file(path)
    assert sc.name == "small"
    assert sc.replicas == 2
    assert sc.burst is None
    assert sc.failure is None
    assert sc.slo.itl_p95_s == 0.1
    assert sc.slo.ttft_p95_s == SEED.slo.ttft_p95_s
    assert sc.batch == SEED.batch


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("replicas = 0", r"replicas must be >= 1, got 0"),
        ("replicas = 2.5", r"replicas must be an integer, got 2\.5"),
        ('router = "random"', r"router must be one of round-robin, least-tokens, got 'random'"),
        ("enable_prefix_caching = 1", r"enable_prefix_caching must be true or false, got 1"),
        ("[slo]\nttft_p95_s = 0", r"slo\.ttft_p95_s must be > 0, got 0"),
        ("[slo]\nsuccess_rate = 1.5", r"slo\.success_rate must be <= 1, got 1\.5"),
        ("[interactive]\nload = 1.0", r"interactive\.load must be <= 0\.999, got 1\.0"),
        ('[interactive]\nshape = "tree"', r"interactive\.shape must be one of"),
        ("[interactive.burst]\nrate_multiplier = -1",
         r"interactive\.burst\.rate_multiplier must be > 0, got -1"),
        ('[batch]\nmode = "sometimes"', r"batch\.mode must be one of backlog, rate"),
        ('[batch]\nprompt_scale = "x"', r"batch\.prompt_scale must be an integer, got 'x'"),
        ("[batch]\nclient_concurrency = 0", r"batch\.client_concurrency must be >= 1, got 0"),
        ("[failure]\nreplica = 9", r"failure\.replica must be < replicas \(4\), got 9"),
        ("[failure]\nstart_frac = 2", r"failure\.start_frac must be <= 1, got 2"),
        ("colour = 1", r"unknown key 'colour'"),
        ("[batch]\nsize = 1", r"unknown key 'batch\.size'"),
        ("[gpu]\nkind = 1", r"unknown section \[gpu\]"),
        ("[failure]", r"\[failure\] is empty"),
        ("replicas = ", r"not valid TOML"),
    ],
    ids=["replicas-zero", "replicas-float", "router", "caching-not-bool", "ttft-zero",
         "success-over-one", "load-one", "shape", "burst-negative", "batch-mode",
         "prompt-scale-text", "concurrency-zero", "failure-replica", "failure-frac",
         "unknown-key", "unknown-batch-key", "unknown-section", "empty-failure", "bad-toml"],
)
def test_bad_values_name_key_and_value(tmp_path: Path, text: str, message: str) -> None:
    """Each bad key raises one InputError naming the file, the key and the bad value."""
    path = tmp_path / "bad.toml"
    path.write_text(text + "\n")
    with pytest.raises(InputError, match=message) as info:
        load_scenario_file(path)
    assert "bad.toml" in str(info.value)


def test_relative_paths_resolve_against_the_file(tmp_path: Path) -> None:
    """A relative trace or lengths path means beside the scenario file; a bare name that is
    not there stays a packaged trace name."""
    folder = tmp_path / "fleet"
    (folder / "traces").mkdir(parents=True)
    (folder / "traces" / "chat.jsonl").write_text(
        '{"timestamp": 0, "input_length": 10, "output_length": 5}\n'
    )
    (folder / "lengths.csv").write_text("num_prefill_tokens,num_decode_tokens\n100,10\n")
    path = folder / "mine.toml"
    path.write_text('[interactive]\ntrace = "traces/chat.jsonl"\n'
                    '[batch]\nlengths_file = "lengths.csv"\n')
    sc = load_scenario_file(path)
    assert Path(sc.interactive_trace) == folder / "traces" / "chat.jsonl"
    assert Path(sc.batch.lengths_file) == folder / "lengths.csv"
    assert resolve_trace(sc.interactive_trace).is_file()
    path.write_text('[interactive]\ntrace = "azure2023_conv.csv"\n')
    assert load_scenario_file(path).interactive_trace == "azure2023_conv.csv"


def test_unknown_scenario_name_lists_the_known() -> None:
    """A name that is neither built in nor a file names the built-in ones."""
    with pytest.raises(InputError, match=r"unknown scenario 'nope' \(known: .*seed"):
        get_scenario("nope")


def test_slo_overrides_are_validated() -> None:
    """SLOs from the command line replace the scenario's; a bad one names the flag."""
    sc = with_slo(SEED, 2.0, None)
    assert (sc.slo.ttft_p95_s, sc.slo.itl_p95_s) == (2.0, SEED.slo.itl_p95_s)
    with pytest.raises(InputError, match=r"--slo-itl-p95-s must be > 0, got -1"):
        with_slo(SEED, None, -1.0)


def test_scenario_example_cli(capsys: pytest.CaptureFixture[str]) -> None:
    """`borrowd scenario example` prints the template; a bad file exits 2 with one line."""
    assert main(["scenario", "example"]) == 0
    assert capsys.readouterr().out == example_text()


def test_scenario_check_cli_bad_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`borrowd scenario check` on a bad file exits 2 with one line naming key and value."""
    path = tmp_path / "bad.toml"
    path.write_text("max_num_seqs = -4\n")
    assert main(["scenario", "check", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "max_num_seqs must be >= 1, got -4" in err[0]


def test_someone_elses_fleet_runs_under_bench(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """A file written from the template (2 replicas, A100 profile, looser SLOs, own JSONL
    trace) runs under `borrowd bench` with its SLOs in the JSON and in every verdict."""
    lines = [
        json.dumps({"timestamp": i * 250, "input_length": 300 + 7 * (i % 50),
                    "output_length": 40 + (i % 30)})
        for i in range(400)
    ]
    (tmp_path / "chat.jsonl").write_text("\n".join(lines) + "\n")
    text = example_text()
    text = text.replace("replicas = 4", "replicas = 2")
    text = text.replace('profile = "h100-llama3-8b"', 'profile = "a100-llama3-8b"')
    text = text.replace("ttft_p95_s = 1.0", "ttft_p95_s = 2.0")
    text = text.replace('trace = "azure2023_conv.csv"', 'trace = "chat.jsonl"')
    text = text.replace('name = "seed"', 'name = "their-fleet"')
    scenario = tmp_path / "their.toml"
    scenario.write_text(text)
    out = tmp_path / "bench.json"
    rc = main(["bench", "--scenario", str(scenario), "--duration", "120", "--workers", "1",
               "--policies", "none", "priority", "static:5000", "--no-sweep",
               "--slo-itl-p95-s", "0.08", "--json", str(out), "--plot",
               str(tmp_path / "bench.png")])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "scenario their-fleet" in printed
    assert "p95 ITL 80 ms" in printed
    report = json.loads(out.read_text())
    assert report["slo"] == {"ttft_p95_s": 2.0, "itl_p95_s": 0.08, "success_rate": 0.99}
    assert [r["policy"] for r in report["rows"]] == ["none", "priority", "static:5000"]
    assert (tmp_path / "bench.png").stat().st_size > 0


def test_profile_file_beside_the_scenario(tmp_path: Path) -> None:
    """`profile` may name a profile file relative to the scenario file."""
    from borrowd.models.sim.profiles import PROFILES_DIR, get_profile

    (tmp_path / "gpu.toml").write_text((PROFILES_DIR / "a100-llama3-8b.toml").read_text())
    path = tmp_path / "fleet.toml"
    path.write_text('profile = "gpu.toml"\n')
    sc = load_scenario_file(path)
    assert Path(sc.profile) == tmp_path / "gpu.toml"
    assert get_profile(sc.profile).name == "a100-llama3-8b"


def test_bare_engines_are_a_scenario_key(tmp_path: Path) -> None:
    """`interference_series = false` runs a fleet whose engines export no batch share (bare
    vLLM behind the gate); the default is engines that do; a non-boolean names the key."""
    path = tmp_path / "bare.toml"
    path.write_text("interference_series = false\n")
    assert load_scenario_file(path).interference_series is False
    path.write_text("replicas = 4\n")
    assert load_scenario_file(path).interference_series is True
    path.write_text('interference_series = "no"\n')
    with pytest.raises(InputError, match=r"interference_series must be true or false"):
        load_scenario_file(path)
