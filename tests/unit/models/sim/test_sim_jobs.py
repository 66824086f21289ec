"""Batch jobs in the simulator: scenario keys, fair share under contention, early lateness,
and every item ending exactly once through revocations and a replica failure."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from borrowd.controller.cli import main
from borrowd.models.budget import Budget, Mode, closed_budget
from borrowd.models.errors import InputError
from borrowd.models.sim.jobs import JobItem, JobsSource
from borrowd.models.sim.jobs_spec import EXAMPLE_LINES, JobSpec, JobsSpec
from borrowd.models.sim.policies import PolicySpec, parse_policy
from borrowd.models.sim.run import load_inputs, run_scenario
from borrowd.models.sim.scenario import Failure, Scenario, example_text, load_scenario_file
from borrowd.models.sim.simulation import Simulation
from borrowd.models.sim.store import SimElection, SimStore

# A rate scale near what calibrate_rate_scale finds for `seed` (0.40 busy); fixed so the tests
# do not pay for the calibration runs.
SEED_RATE_SCALE = 0.2672
EXAMPLE = Path(__file__).resolve().parents[4] / "examples" / "scenario-batch-jobs.toml"

TWO_TENANTS = """
[batch.tenants]
gold = 2.0
silver = 1.0

[[batch.jobs]]
id = "gold-pool"
tenant = "gold"
items = 20000
completion_window = "2h"

[[batch.jobs]]
id = "silver-fixed"
tenant = "silver"
items = 20000
completion_window = "2h"
prompt_tokens = 1500
output_tokens = 300
"""


def write(tmp_path: Path, text: str) -> Path:
    """A scenario file with `text`."""
    path = tmp_path / "jobs.toml"
    path.write_text(text)
    return path


def test_the_shipped_example_loads(capsys: pytest.CaptureFixture[str]) -> None:
    """The example scenario carries two tenants 2:1 and three jobs with deadlines, and
    `borrowd scenario check` says so."""
    assert main(["scenario", "check", str(EXAMPLE)]) == 0
    assert "batch: 3 jobs, 19500 items, tenant weights gold 2, silver 1" in capsys.readouterr().out
    sc = load_scenario_file(EXAMPLE)
    assert sc.jobs is not None
    assert sc.jobs.weights == {"gold": 2.0, "silver": 1.0}
    urgent = next(j for j in sc.jobs.jobs if j.job_id == "silver-urgent")
    assert (urgent.arrival_s, urgent.deadline_s, urgent.items) == (300.0, 600.0, 1500)


def test_the_template_shows_jobs_commented_out(tmp_path: Path) -> None:
    """`borrowd scenario example` ends with a jobs section; uncommented, it is valid."""
    text = example_text()
    assert load_scenario_file(write(tmp_path, text)).jobs is None
    head, _, commented = text.partition(EXAMPLE_LINES[0])
    assert all(line in commented for line in EXAMPLE_LINES[1:])
    uncommented = "\n".join(line.removeprefix("# ") for line in EXAMPLE_LINES[3:])
    sc = load_scenario_file(write(tmp_path, head + uncommented + "\n"))
    assert sc.jobs is not None and sc.jobs.jobs[0].job_id == "gold-summaries"


def test_jobs_parse_with_defaults(tmp_path: Path) -> None:
    """Sizes left out draw from the length pool; the window defaults to 24h; figures too."""
    sc = load_scenario_file(write(tmp_path, TWO_TENANTS))
    assert sc.jobs is not None
    gold, silver = sc.jobs.jobs
    assert (gold.prompt_tokens, gold.output_tokens, gold.arrival_s) == (None, None, 0.0)
    assert (silver.prompt_tokens, silver.output_tokens) == (1500, 300)
    assert gold.deadline_s == 7200.0
    assert sc.jobs.price_per_gpu_hour == 2.0 and sc.jobs.rate_window_s == 60.0


MINIMAL = '[batch.tenants]\na = 1.0\n[[batch.jobs]]\nid = "j"\ntenant = "a"\nitems = 5\n'


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (MINIMAL.replace("items = 5", "items = 0"), r"batch\.jobs\[1\]\.items must be >= 1, got 0"),
        (MINIMAL.replace("items = 5", "items = 2.5"),
         r"batch\.jobs\[1\]\.items must be an integer, got 2\.5"),
        (MINIMAL + "colour = 1\n", r"batch\.jobs\[1\]\.colour is not a key here"),
        (MINIMAL.replace('tenant = "a"', 'tenant = "b"'),
         r"batch\.jobs\[1\]\.tenant 'b' is not in batch\.tenants"),
        (MINIMAL.replace("items = 5", ""), r"batch\.jobs\[1\]\.items is required"),
        (MINIMAL + 'completion_window = "soon"\n',
         r"batch\.jobs\[1\]\.completion_window: must be like '24h'"),
        (MINIMAL + "prompt_tokens = 100\n",
         r"batch\.jobs\[1\]: prompt_tokens and output_tokens go together"),
        (MINIMAL + "arrival_s = -1\n", r"batch\.jobs\[1\]\.arrival_s must be >= 0, got -1"),
        (MINIMAL + '[[batch.jobs]]\nid = "j"\ntenant = "a"\nitems = 1\n',
         r"batch\.jobs\[2\]\.id 'j' names another job too"),
        (MINIMAL.replace("a = 1.0", "a = 0"), r"batch\.tenants\.a must be > 0, got 0"),
        ('[batch.tenants]\na = 1.0\n', r"batch\.jobs is required"),
        ('[[batch.jobs]]\nid = "j"\ntenant = "a"\nitems = 5\n', r"batch\.tenants is required"),
        (MINIMAL + "[batch.job_figures]\nprice = 3\n",
         r"batch\.job_figures\.price is not a key here"),
        (MINIMAL + "[batch.job_figures]\nrate_window_s = 0\n",
         r"batch\.job_figures\.rate_window_s must be > 0, got 0"),
        (MINIMAL.replace("[batch.tenants]", '[batch]\nmode = "rate"\n[batch.tenants]'),
         r"batch\.mode 'rate' does not go with batch\.jobs"),
    ],
    ids=["items-zero", "items-float", "unknown-key", "unknown-tenant", "items-missing",
         "bad-window", "prompt-alone", "negative-arrival", "duplicate-id", "zero-weight",
         "no-jobs", "no-tenants", "figures-unknown", "figures-window", "rate-mode"],
)
def test_bad_job_keys_are_named(tmp_path: Path, text: str, message: str) -> None:
    """Each bad job key is refused with an error naming it and the value."""
    with pytest.raises(InputError, match=message):
        load_scenario_file(write(tmp_path, text))


def test_scenario_check_names_a_bad_job_key(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """`borrowd scenario check` exits 2 with one line naming the job key."""
    path = write(tmp_path, MINIMAL.replace("items = 5", "items = -3"))
    assert main(["scenario", "check", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "batch.jobs[1].items must be >= 1, got -3" in err[0]


@pytest.mark.parametrize("policy", ["static:30000", "priority"],
                         ids=["gate-bound", "engine-bound"])
def test_two_tenants_backlogged_split_two_to_one(tmp_path: Path, policy: str) -> None:
    """Full backlogs of different item shapes (gold from the length pool, silver fixed):
    the tokens processed while both wait split within 10% of 2:1, under a static budget
    (the gate binds) and under free admission (the engines bind)."""
    sc = load_scenario_file(write(tmp_path, TWO_TENANTS))
    summary = run_scenario(sc, policy, duration_s=240.0, seed=3,
                           rate_scale=SEED_RATE_SCALE).summary()
    report = summary["jobs"]
    tenants = {t["tenant"]: t for t in report["tenants"]}
    assert report["contended_s"] >= 200
    ratio = tenants["gold"]["contended_tokens"] / tenants["silver"]["contended_tokens"]
    assert abs(ratio / 2.0 - 1.0) < 0.10, ratio
    assert report["fair_share_error_max"] < 0.10
    assert all(t["completed"] > 0 and t["cost_per_item"] > 0 for t in tenants.values())


def test_an_impossible_deadline_is_projected_late_early(tmp_path: Path) -> None:
    """A job far too large for its window is flagged late one rate window after it
    arrives, long before its deadline; the figures count what the service would expire."""
    text = MINIMAL.replace("items = 5", 'items = 50000\ncompletion_window = "5m"\narrival_s = 10.0'
                           '\nprompt_tokens = 2048\noutput_tokens = 256')
    text += "[batch.job_figures]\nrate_window_s = 30.0\n"
    sc = load_scenario_file(write(tmp_path, text))
    summary = run_scenario(sc, "static:30000", duration_s=360.0, seed=1,
                           rate_scale=SEED_RATE_SCALE).summary()
    job = summary["jobs"]["jobs"][0]
    assert job["finish_s"] is None
    assert 40.0 <= job["late_projected_at_s"] <= 45.0  # arrival + one window (+ sampling)
    assert job["first_late_projection_s"] > 1000.0
    assert 40000 < job["items_after_deadline"] <= 50000


@dataclass
class CutTwice:
    """A loop that keeps a static budget open and cuts it to zero twice (at `cuts_s`, for
    `cut_s` each), as the fault tests of the batch service do."""

    store: SimStore
    open_budget: Budget
    cuts_s: tuple[float, ...] = (60.0, 140.0)
    cut_s: float = 5.0
    tick_s: float = 1.0

    def tick(self, now_s: float) -> None:
        """Publish the open budget, or a closed one inside a cut."""
        cut = any(start <= now_s < start + self.cut_s for start in self.cuts_s)
        budget = closed_budget(self.open_budget.pool, Mode.CLOSED, "cut") if cut \
            else self.open_budget
        self.store.publish(budget, epoch=0, ttl_ms=5000, now_s=now_s)


def test_every_item_ends_once_through_revocations_and_a_failure(tmp_path: Path) -> None:
    """Budget cut to zero twice and a replica down for a minute: every item is completed
    once or accounted for (in flight, waiting), revoked items resume from their output, and
    the recomputed work is counted."""
    sc = load_scenario_file(write(tmp_path, TWO_TENANTS.replace("20000", "3000")))
    sc = sc.with_overrides(failure=Failure(replica=1, start_frac=0.4, duration_s=60.0))
    base = parse_policy("static:40000", sc)

    def loop(source: object, store: SimStore, election: SimElection) -> CutTwice:
        assert base.budget is not None
        return CutTwice(store, base.budget)

    policy = PolicySpec("cut-twice", base.engine_policy, batch=True, loop=loop)
    trace, lengths = load_inputs(sc)
    sim = Simulation(sc, policy, duration_s=240.0, seed=2, trace=trace,
                     rate_scale=SEED_RATE_SCALE, lengths=lengths)
    result = sim.run()
    report = result.summary()["jobs"]
    assert sim.revocations > 0
    jobs = sim.jobs
    assert jobs is not None
    held = {item.job_id for _, item, _ in sim._batch_inflight.values()}
    queued = {item.job_id for job in jobs.jobs for item in job.waiting} | {
        item.job_id for item in jobs.front}
    for job, figures in zip(jobs.jobs, report["jobs"], strict=True):
        done = [i for i in job.items if i.remaining_output_tokens == 0]
        assert figures["completed"] == len(done)
        for item in job.items:  # each item in exactly one place
            places = [item.remaining_output_tokens == 0, item.job_id in held,
                      item.job_id in queued]
            assert places.count(True) == 1, item
        assert (figures["completed"] + figures["in_flight"] + figures["waiting"]
                + figures["not_arrived"]) == figures["items"]
        assert figures["completed_tokens"] == sum(i.prompt_tokens + i.output_tokens for i in done)
    assert sum(j["revocations"] for j in report["jobs"]) > 0
    assert sum(j["resumes"] for j in report["jobs"]) > 0
    assert sum(j["recomputed_tokens"] for j in report["jobs"]) > 0


def test_a_cut_item_resumes_with_its_output_as_prompt() -> None:
    """A cut item comes back first, as the worker's continuation: prompt plus the output so
    far, output limit reduced; it is charged to its tenant's share only once."""
    spec = JobsSpec(tenants=(("a", 1.0), ("b", 1.0)),
                    jobs=(JobSpec("ja", "a", 3, prompt_tokens=100, output_tokens=50),
                          JobSpec("jb", "b", 3, prompt_tokens=100, output_tokens=50)))
    source = JobsSource(spec, Scenario(name="t").batch, None, np.random.default_rng(0))
    for index in range(2):
        source.arrive(index)
    first = source.next_job()
    tags = dict(source.fair.finish_tags)
    first.generated_tokens = 20
    source.push_front(first)
    assert source.peek_cost() == (120, 30)
    assert source.next_job() is first
    assert dict(source.fair.finish_tags) == tags
    assert isinstance(first, JobItem)
