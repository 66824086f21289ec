"""Batch jobs in the simulator on held-out shapes: fair-share error and lateness per run.

None of these shapes is the shipped example (`examples/scenario-batch-jobs.toml`) nor a
test's: tenants of 3:2:1, items drawn from the length pool against fixed ones, a tenant that
arrives late, a replica failure, and a job that cannot meet its deadline. Each runs on
seed's fleet and interactive load under a static budget, free admission (`priority`) and
PI, and prints per run: the seconds tenants contended, each tenant's fair-share error (the
tokens it processed while contending over those its weight entitled it to among the tenants
contending each second, minus 1), and per job with a deadline its lateness, when the
projection first called it late and the items the service would have expired.

    python3 benchmarks/bench_sim_jobs.py [--duration 1200] [--policies static:30000 priority pi]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from borrowd.controller.closed_loop import SimControllers
from borrowd.models.sim.run import run_scenario
from borrowd.models.sim.scenario import load_scenario_file

SHAPES = {
    "3:2:1 pool vs fixed": """
[batch.tenants]
a = 3.0
b = 2.0
c = 1.0
[[batch.jobs]]
id = "a-pool"
tenant = "a"
items = 30000
[[batch.jobs]]
id = "b-short"
tenant = "b"
items = 30000
prompt_tokens = 600
output_tokens = 400
[[batch.jobs]]
id = "c-long-prompt"
tenant = "c"
items = 30000
prompt_tokens = 12000
output_tokens = 64
""",
    "late arrival 2:1": """
[batch.tenants]
gold = 2.0
silver = 1.0
[[batch.jobs]]
id = "gold"
tenant = "gold"
items = 30000
prompt_tokens = 3000
output_tokens = 300
[[batch.jobs]]
id = "silver"
tenant = "silver"
items = 30000
arrival_s = 120.0
""",
    "failure + hopeless deadline 1:1": """
[failure]
replica = 2
start_frac = 0.3
duration_s = 120.0
[batch.tenants]
x = 1.0
y = 1.0
[[batch.jobs]]
id = "x-hopeless"
tenant = "x"
items = 40000
completion_window = "10m"
prompt_tokens = 2048
output_tokens = 256
[[batch.jobs]]
id = "y-pool"
tenant = "y"
items = 30000
""",
}


def main() -> None:
    """Run every shape under every policy and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=1200.0)
    parser.add_argument("--policies", nargs="+", default=["static:30000", "priority", "pi"])
    args = parser.parse_args()
    print("| shape | policy | contended s | fair-share error per tenant | deadlines |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="bench-sim-jobs-") as tmp:
        for name, text in SHAPES.items():
            path = Path(tmp) / f"{len(name)}.toml"
            path.write_text(text)
            scenario = load_scenario_file(path)
            assert scenario.jobs is not None
            weights = scenario.jobs.weights
            for policy in args.policies:
                summary = run_scenario(scenario, policy, duration_s=args.duration,
                                       controllers=SimControllers()).summary()
                report = summary["jobs"]
                errors = ", ".join(
                    f"{t['tenant']} (w {weights[t['tenant']]:g}) {t['fair_share_error']:+.4f}"
                    for t in report["tenants"] if t["fair_share_error"] is not None)
                deadlines = "; ".join(
                    f"{j['job']}: late {_cell(j['lateness_s'])} s, projected late at "
                    f"{_cell(j['late_projected_at_s'])} s, {j['items_after_deadline']} expired"
                    for j in report["jobs"] if j["deadline_s"] < args.duration)
                print(f"| {name} | {policy} | {report['contended_s']} | {errors} | "
                      f"{deadlines or '-'} |")


def _cell(value: object, fmt: str = "{:.0f}") -> str:
    return "-" if value is None else fmt.format(value)


if __name__ == "__main__":
    main()
