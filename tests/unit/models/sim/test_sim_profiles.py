"""Tests of step-time profiles as data: the shipped files, loading, and fitting."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from borrowd.models.errors import InputError
from borrowd.models.sim.profile_builtins import RECIPES, write_builtins
from borrowd.models.sim.profile_fit import (
    GPUS,
    VIDUR_DIR,
    attention_constants,
    fit_file,
    holdout_mask,
    load_operator_table,
    profile_toml,
    step_seconds,
)
from borrowd.models.sim.profiles import PROFILES, PROFILES_DIR, get_profile, load_profile


def test_shipped_profiles_are_what_the_recipes_fit(tmp_path: Path) -> None:
    """Every shipped profile file is byte for byte what its recipe fits from the data."""
    for path in write_builtins(tmp_path):
        assert path.read_text() == (PROFILES_DIR / path.name).read_text(), path.name
    assert {r.name for r in RECIPES} <= set(PROFILES)


def test_profiles_never_get_cheaper_with_more_tokens() -> None:
    """Fitted linear points are non-decreasing and reach 32768 tokens."""
    for profile in PROFILES.values():
        seconds = [s for _, s in profile.linear_points]
        assert all(b >= a for a, b in itertools.pairwise(seconds)), profile.name
        assert profile.linear_points[-1][0] == 32768


def test_attention_from_flops_and_bandwidth() -> None:
    """Llama-3-8B on A100: 128 KiB of KV per token read at 80% of 2.039 TB/s (~80 ns), and
    4 x 32 heads x 128 x 32 layers FLOPs per pair at 50% of 312 TFLOP/s."""
    shape = load_operator_table(VIDUR_DIR / "a100-meta-llama-3-8b.csv.gz", 1, 32).shape
    decode, prefill, capacity = attention_constants(shape, GPUS["a100"], 1)
    assert decode == pytest.approx(131072 / (0.8 * 2.039e12))
    assert prefill == pytest.approx(4 * 4096 * 32 / (0.5 * 312e12))
    assert 350_000 < capacity < 450_000
    decode_tp4, _, _ = attention_constants(shape, GPUS["a100"], 4)
    assert decode_tp4 == pytest.approx(decode / 4)


def test_tensor_parallel_adds_all_reduce() -> None:
    """At tp 4 the step time is the sharded operators plus two all-reduces per layer."""
    path = VIDUR_DIR / "a100-meta-llama-3-70b.csv.gz"
    table = load_operator_table(path, 4, 80)
    with pytest.raises(InputError, match="needs all-reduce"):
        step_seconds(table)
    with pytest.raises(InputError, match=r"no rows at tensor parallel 3 \(has 1, 2, 4, 8\)"):
        load_operator_table(path, 3, 80)


def test_fit_plain_step_times_reports_held_out_error(tmp_path: Path) -> None:
    """A plain num_tokens,step_s file is fitted; a linear truth gives ~0 held-out error."""
    tokens = np.arange(1, 4097, 16)
    seconds = 0.005 + 2e-5 * tokens
    path = tmp_path / "steps.csv"
    path.write_text("num_tokens,step_s\n" + "".join(
        f"{t},{s}\n" for t, s in zip(tokens, seconds, strict=True)))
    profile, report = fit_file(path, name="mine", like=PROFILES["h100-llama3-8b"])
    assert report.held_out_rows == int(holdout_mask(len(tokens)).sum())
    assert report.worst_abs_err < 1e-6
    assert profile.linear_s(8192) == pytest.approx(0.005 + 2e-5 * 8192, rel=1e-6)
    out = tmp_path / "mine.toml"
    out.write_text(profile_toml(profile, report, "test"))
    loaded = get_profile(str(out))
    assert loaded == load_profile(out)
    assert loaded.name == "mine"
    for t in (1, 700, 4096, 10000):
        assert loaded.linear_s(t) == pytest.approx(profile.linear_s(t), rel=1e-5)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("num_tokens,step_s\n1,0.1\n", "need at least 10 measured rows"),
        ("tokens,seconds\n1,2\n", "expected columns num_tokens,step_s"),
        ("num_tokens,step_s\n" + "".join(f"{i},x\n" for i in range(1, 12)),
         r"steps\.csv:2: step_s is not a number: 'x'"),
    ],
    ids=["too-few", "bad-header", "bad-number"],
)
def test_bad_measurements_are_named(tmp_path: Path, text: str, message: str) -> None:
    """A bad measurements file raises one InputError naming the file and the problem."""
    path = tmp_path / "steps.csv"
    path.write_text(text)
    with pytest.raises(InputError, match=message):
        fit_file(path, name="x", like=PROFILES["h100-llama3-8b"])


def test_operator_table_needs_layers_and_gpu() -> None:
    """Fitting a Vidur operator table without --layers or --gpu names what is missing."""
    path = VIDUR_DIR / "a100-meta-llama-3-8b.csv.gz"
    with pytest.raises(InputError, match="give --layers"):
        fit_file(path, name="x", gpu="a100")
    with pytest.raises(InputError, match="--gpu must be one of a100, h100, got 'v100'"):
        fit_file(path, name="x", gpu="v100", layers=32)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("kv_capacity_tokens = 396000", "kv_capacity_tokens = 0"),
         r"kv_capacity_tokens must be an integer > 0, got 0"),
        (("decode_s_per_kv_token = ", "decode_s_per_kv_token = -"),
         r"decode_s_per_kv_token must be a number >= 0"),
        (('name = "a100-llama3-8b"', 'name = "a"\ncolour = 1'), r"unknown key 'colour'"),
        (("  [8, ", "  [1, "), r"linear_points tokens must ascend, got 1 after 1"),
    ],
    ids=["capacity", "negative-decode", "unknown-key", "not-ascending"],
)
def test_bad_profile_files_are_named(tmp_path: Path, change: tuple[str, str],
                                     message: str) -> None:
    """A bad profile file raises one InputError naming the key and the bad value."""
    text = (PROFILES_DIR / "a100-llama3-8b.toml").read_text()
    old, new = change
    assert old in text
    path = tmp_path / "bad.toml"
    path.write_text(text.replace(old, new, 1))
    with pytest.raises(InputError, match=message):
        load_profile(path)


def test_unknown_profile_lists_the_known() -> None:
    """A profile that is neither built in nor a file names the built-in ones."""
    with pytest.raises(InputError, match=r"unknown profile 'b200' \(known: a100-llama3-70b-tp4"):
        get_profile("b200")


def test_profile_fit_cli_writes_a_usable_profile(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """`borrowd profile fit` prints the held-out error and writes a profile file that
    `get_profile` loads; a missing --layers is one line and exit 2."""
    from borrowd.controller.cli import main

    out = tmp_path / "mine.toml"
    source = str(VIDUR_DIR / "a100-meta-llama-3-70b.csv.gz")
    assert main(["profile", "fit", source, "--gpu", "a100", "--layers", "80", "--tp", "4",
                 "--name", "mine", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "held-out 91 rows: median abs error" in printed
    assert get_profile(str(out)).linear_s(8192) == pytest.approx(
        PROFILES["a100-llama3-70b-tp4"].linear_s(8192), rel=1e-5)
    assert main(["profile", "fit", source, "--gpu", "a100"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "give --layers" in err[0]
