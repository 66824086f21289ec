"""Simulation scenarios as frozen dataclasses (`seed` and its variants, DESIGN.md).

A scenario fixes the fleet (replicas, profile, engine settings, router), the interactive
workload (trace, target load, burst), the batch workload (backlog or fixed rate), optional
replica failures, the SLO and how the batch budget is enforced (`enforcement`). Times that
depend on the run length (burst, failure) are given as fractions of the duration so that a
20-minute and a one-hour run both contain them.

Scenarios are TOML files. One table of keys (`KEYS`: where each lives, its type, its bounds,
one line of help) drives the parser, the error messages and `borrowd scenario example`, so
they cannot drift apart. Relative paths (traces, length pools, profile files) resolve
against the scenario file's folder; a bare name that is not a file there is looked up as
before (the packaged traces or $BORROWD_TRACES_DIR, the built-in profiles). A section that
is absent turns its feature off (`[interactive.burst]`, `[failure]`); a key that is absent
keeps `seed`'s value. The built-in scenarios are such files (`models/sim/data/scenarios/`),
and `SEED` is their defaults.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from borrowd.models.enforcement import ADMISSION, DEFAULT_STEP_GUARD_FRAC, ENFORCEMENTS
from borrowd.models.errors import InputError
from borrowd.models.priority import BATCH_PRIORITY
from borrowd.models.signals import Slo
from borrowd.models.sim.jobs_spec import EXAMPLE_LINES as JOBS_EXAMPLE_LINES
from borrowd.models.sim.jobs_spec import JOB_TABLES, JobsSpec, parse_jobs
from borrowd.models.sim.profiles import DEFAULT_PROFILE

ROUND_ROBIN = "round-robin"
LEAST_TOKENS = "least-tokens"
ROUTERS = (ROUND_ROBIN, LEAST_TOKENS)


BACKLOG = "backlog"
RATE = "rate"

TRACE_SHAPE = "trace"  # interactive requests replayed as the trace has them
MULTI_TURN = "multi-turn"  # each turn's prompt is its conversation so far (shared prefixes)
INTERACTIVE_SHAPES = (TRACE_SHAPE, MULTI_TURN)


@dataclass(frozen=True)
class Burst:
    """Interactive rate multiplied by `rate_multiplier` for `duration_s`, centred in the run."""

    duration_s: float = 120.0
    rate_multiplier: float = 2.0
    centre_frac: float = 0.5

    def window_s(self, run_s: float) -> tuple[float, float]:
        """(start, end) of the burst in a run of `run_s` seconds."""
        start = max(0.0, self.centre_frac * run_s - self.duration_s / 2)
        return start, min(run_s, start + self.duration_s)


@dataclass(frozen=True)
class Failure:
    """Replica `replica` is down from `start_frac` of the run for `duration_s` seconds."""

    replica: int = 0
    start_frac: float = 0.25
    duration_s: float = 300.0

    def window_s(self, run_s: float) -> tuple[float, float]:
        """(start, end) of the outage in a run of `run_s` seconds."""
        start = self.start_frac * run_s
        return start, start + self.duration_s


@dataclass(frozen=True)
class BatchWorkload:
    """Batch class: an always-full backlog (or a fixed submission rate) of summarization jobs.

    Prompt tokens = trace prompt x `prompt_scale` clipped to `prompt_clip_tokens`; output
    tokens = trace output clipped to `output_clip_tokens`. The batch client keeps at most
    `client_concurrency` requests in flight over the fleet.
    """

    mode: str = BACKLOG
    lengths_file: str = "arxiv_summarization_lengths.csv"
    prompt_scale: int = 4
    prompt_clip_tokens: int = 32768
    output_clip_tokens: int = 1024
    submit_rate_per_s: float = 0.0
    client_concurrency: int = 256
    priority: int = BATCH_PRIORITY
    replicas: tuple[int, ...] = ()  # replicas eligible for batch (empty: every replica)


@dataclass(frozen=True)
class Scenario:
    """Everything a simulation run needs apart from the policy, duration and seed."""

    name: str
    pool: str = "seed"
    replicas: int = 4
    profile: str = DEFAULT_PROFILE
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    block_size: int = 16
    long_prefill_token_threshold: int = 0
    enable_prefix_caching: bool = True
    router: str = LEAST_TOKENS
    interactive_trace: str = "azure2023_conv.csv"
    interactive_load: float = 0.40
    interactive_priority: int = 0
    interactive_shape: str = TRACE_SHAPE
    burst: Burst | None = field(default_factory=Burst)
    batch: BatchWorkload = field(default_factory=BatchWorkload)
    failure: Failure | None = None
    slo: Slo = field(default_factory=Slo)
    ttft_timeout_s: float = 30.0
    window_s: float = 60.0
    observe_window_s: float = 5.0
    # The monitoring between the fleet and the loop (the shipped prometheus.example.yml's
    # intervals): samples are scraped every `scrape_interval_s`, recording rules evaluated
    # every `evaluation_interval_s`; 0 reads every signal fresh at the tick.
    scrape_interval_s: float = 5.0
    evaluation_interval_s: float = 5.0
    calibration_s: float = 3600.0
    enforcement: str = ADMISSION
    # Under engine enforcement, the plugin's step guard holds steps carrying interactive
    # decodes under this x the ITL SLO (`models.enforcement.StepGuard`; 0: off), as a plugin
    # given BORROWD_SLO_ITL_S and BORROWD_STEP_GUARD_FRAC does.
    step_guard_frac: float = DEFAULT_STEP_GUARD_FRAC
    # The engines export the interference series (`adapters.interference`: the vLLM plugin,
    # enforcing or with BORROWD_ENFORCE=false, or the emulator), so the daemon reads the
    # batch share of the burns; false: bare engines behind the gate and the proxy, no share.
    interference_series: bool = True
    jobs: JobsSpec | None = None  # batch jobs (`models.sim.jobs_spec`): the batch demand

    def __post_init__(self) -> None:
        if self.replicas <= 0:
            raise InputError(f"scenario {self.name}: replicas must be > 0")
        if self.router not in ROUTERS:
            raise InputError(f"scenario {self.name}: router must be one of {ROUTERS}")
        if not 0 < self.interactive_load < 1:
            raise InputError(
                f"interactive load must be in (0, 1), got {self.interactive_load!r}"
            )
        if self.enforcement not in ENFORCEMENTS:
            raise InputError(
                f"enforcement must be one of {', '.join(ENFORCEMENTS)}, got {self.enforcement!r}"
            )
        if not 0 <= self.step_guard_frac <= 1:
            raise InputError(f"step_guard_frac must be in [0, 1], got {self.step_guard_frac!r}")
        if self.failure is not None and not 0 <= self.failure.replica < self.replicas:
            raise InputError(
                f"failure.replica must be < replicas ({self.replicas}), "
                f"got {self.failure.replica}"
            )
        eligible = self.batch.replicas
        if any(not 0 <= r < self.replicas for r in eligible) or len(set(eligible)) < len(
            eligible
        ):
            raise InputError(
                f"batch.replicas must name distinct replicas below replicas ({self.replicas}), "
                f"got {list(eligible)}"
            )
        if self.interactive_shape not in INTERACTIVE_SHAPES:
            raise InputError(
                f"interactive shape must be one of {', '.join(INTERACTIVE_SHAPES)}, "
                f"got {self.interactive_shape!r}"
            )

    def batch_replicas(self) -> tuple[int, ...]:
        """The replicas that may take batch, in order (every replica when unrestricted)."""
        return tuple(sorted(self.batch.replicas)) or tuple(range(self.replicas))

    def batch_restricted(self) -> bool:
        """True when batch may use only some of the replicas."""
        return len(self.batch_replicas()) < self.replicas

    def with_overrides(self, **changes: object) -> Scenario:
        """A copy with some fields replaced (validated again)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


SEED = Scenario(name="seed")
SEED_FAILURE = Scenario(name="seed-failure", failure=Failure())


SCENARIOS_DIR = Path(__file__).resolve().parent / "data" / "scenarios"
BATCH_MODES = (BACKLOG, RATE)


@dataclass(frozen=True)
class Key:
    """One scenario key: dotted `name`, Python `kind`, bounds or choices, help, target.

    `target` is where the value goes: `scenario.FIELD`, `slo.FIELD`, `burst.FIELD`,
    `batch.FIELD` or `failure.FIELD`. `path` marks values resolved against the file's folder.
    """

    name: str
    kind: type
    help: str
    target: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    choices: tuple[str, ...] = ()
    path: bool = False

    def check(self, value: object) -> str | None:
        """Why `value` is not acceptable for this key, or None when it is."""
        if self.kind is tuple:
            if not (isinstance(value, list) and value and all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
            )):
                return "must be a non-empty list of replica indices (integers >= 0)"
            return None
        if self.kind is bool:
            ok = isinstance(value, bool)
        elif self.kind is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif self.kind is float:
            ok = isinstance(value, int | float) and not isinstance(value, bool)
        else:
            ok = isinstance(value, str) and bool(value)
        if not ok:
            return f"must be {_KIND_WORDS[self.kind]}"
        if self.choices and value not in self.choices:
            return f"must be one of {', '.join(self.choices)}"
        number = float(value) if isinstance(value, int | float) else None
        if number is not None and self.low is not None:
            if self.low_open and not number > self.low:
                return f"must be > {self.low:g}"
            if not self.low_open and not number >= self.low:
                return f"must be >= {self.low:g}"
        if number is not None and self.high is not None and not number <= self.high:
            return f"must be <= {self.high:g}"
        return None


_KIND_WORDS: dict[type, str] = {
    bool: "true or false", int: "an integer", float: "a number", str: "a non-empty string",
}

KEYS: tuple[Key, ...] = (
    Key("name", str, "scenario name, shown in reports", "scenario.name"),
    Key("pool", str, "pool name the simulated fleet stands for", "scenario.pool"),
    Key("replicas", int, "engine replicas behind the router", "scenario.replicas", low=1),
    Key("profile", str, "step-time profile: a built-in name (`borrowd profile list`) or a "
        "profile TOML file", "scenario.profile", path=True),
    Key("max_num_batched_tokens", int, "vLLM token budget per engine step",
        "scenario.max_num_batched_tokens", low=1),
    Key("max_num_seqs", int, "vLLM cap on running sequences per engine",
        "scenario.max_num_seqs", low=1),
    Key("block_size", int, "KV cache block size in tokens", "scenario.block_size", low=1),
    Key("long_prefill_token_threshold", int, "vLLM chunk cap for long prefills (0 = none)",
        "scenario.long_prefill_token_threshold", low=0),
    Key("enable_prefix_caching", bool, "vLLM automatic prefix caching (on by default in vLLM "
        "V1)", "scenario.enable_prefix_caching"),
    Key("router", str, "how requests are spread over replicas", "scenario.router",
        choices=ROUTERS),
    Key("enforcement", str, "batch budget enforced by the admission gate, or the gate plus "
        "the engine plugin's per-step limit", "scenario.enforcement", choices=ENFORCEMENTS),
    Key("step_guard_frac", float, "under engine enforcement, the plugin's step guard holds "
        "steps carrying interactive decodes under this x the ITL SLO (0: off)",
        "scenario.step_guard_frac", low=0, high=1),
    Key("interference_series", bool, "the engines export the interference series (the vLLM "
        "plugin or the emulator), so the daemon reads which share of the burn batch caused; "
        "false: bare engines, no share", "scenario.interference_series"),
    Key("ttft_timeout_s", float, "an interactive request waiting longer than this for its "
        "first token fails (s)", "scenario.ttft_timeout_s", low=0, low_open=True),
    Key("window_s", float, "length of the SLO verdict windows (s)", "scenario.window_s",
        low=0, low_open=True),
    Key("observe_window_s", float, "sliding window of the signals the policy reads (s)",
        "scenario.observe_window_s", low=0, low_open=True),
    Key("scrape_interval_s", float, "Prometheus scrape interval: the burn shares the daemon "
        "reads end at the last scrape (s; 0: fresh at every tick)",
        "scenario.scrape_interval_s", low=0),
    Key("evaluation_interval_s", float, "Prometheus rule evaluation interval: the recorded "
        "series the daemon reads (p95s, rates, KV, queue) change only then, over the samples "
        "scraped by then (s; 0: at every tick)", "scenario.evaluation_interval_s", low=0),
    Key("calibration_s", float, "longest run used to find the interactive rate scale (s)",
        "scenario.calibration_s", low=0, low_open=True),
    Key("slo.ttft_p95_s", float, "interactive p95 time to first token SLO (s)",
        "slo.ttft_p95_s", low=0, low_open=True),
    Key("slo.itl_p95_s", float, "interactive p95 inter-token latency SLO (s)",
        "slo.itl_p95_s", low=0, low_open=True),
    Key("slo.success_rate", float, "share of interactive requests that must succeed",
        "slo.success_rate", low=0, high=1, low_open=True),
    Key("interactive.trace", str, "interactive trace: Azure CSV or JSONL (Mooncake format "
        "with hash_ids), optionally .gz", "scenario.interactive_trace", path=True),
    Key("interactive.load", float, "GPU busy fraction of interactive work alone (the trace's "
        "rate is scaled to reach it)", "scenario.interactive_load", low=0, high=0.999,
        low_open=True),
    Key("interactive.priority", int, "vLLM priority of interactive requests (lower first)",
        "scenario.interactive_priority"),
    Key("interactive.shape", str, "trace: replay as is; multi-turn: each conversation's turn "
        "prompt is the conversation so far (shared prefixes)", "scenario.interactive_shape",
        choices=INTERACTIVE_SHAPES),
    Key("interactive.burst.duration_s", float, "burst length (s)", "burst.duration_s",
        low=0, low_open=True),
    Key("interactive.burst.rate_multiplier", float, "interactive rate multiplier in the burst",
        "burst.rate_multiplier", low=0, low_open=True),
    Key("interactive.burst.centre_frac", float, "burst centre as a fraction of the run",
        "burst.centre_frac", low=0, high=1),
    Key("batch.mode", str, "backlog: always full; rate: submit_rate_per_s jobs per second",
        "batch.mode", choices=BATCH_MODES),
    Key("batch.lengths_file", str, "batch (prompt, output) length pool CSV "
        "(num_prefill_tokens,num_decode_tokens,...)", "batch.lengths_file", path=True),
    Key("batch.prompt_scale", int, "batch prompt = pool prompt x this", "batch.prompt_scale",
        low=1),
    Key("batch.prompt_clip_tokens", int, "batch prompts clipped to this many tokens",
        "batch.prompt_clip_tokens", low=1),
    Key("batch.output_clip_tokens", int, "batch outputs clipped to this many tokens",
        "batch.output_clip_tokens", low=1),
    Key("batch.submit_rate_per_s", float, "batch jobs per second in rate mode",
        "batch.submit_rate_per_s", low=0),
    Key("batch.client_concurrency", int, "batch requests the client keeps in flight",
        "batch.client_concurrency", low=1),
    Key("batch.priority", int, "vLLM priority of batch requests (lower first)",
        "batch.priority"),
    Key("batch.replicas", tuple, "replicas (indices from 0) that may take batch; interactive "
        "uses every replica and its routing then ignores batch load (default: all)",
        "batch.replicas"),
    Key("failure.replica", int, "replica taken down", "failure.replica", low=0),
    Key("failure.start_frac", float, "outage start as a fraction of the run",
        "failure.start_frac", low=0, high=1),
    Key("failure.duration_s", float, "outage length (s)", "failure.duration_s", low=0,
        low_open=True),
)
KEYS_BY_NAME = {k.name: k for k in KEYS}
_builtin_cache: dict[str, Scenario] = {}
SECTIONS = ("slo", "interactive", "interactive.burst", "batch", "failure")


def load_scenario_file(path: str | Path) -> Scenario:
    """The scenario in TOML file `path`; `InputError` naming the key and bad value."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"scenario file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"scenario file {path} cannot be read: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise InputError(f"scenario file {path}: not valid TOML: {exc}") from None
    jobs = _pop_jobs(path, data)
    values = _flatten(path, data)
    if jobs is not None and values.get("batch.mode", BACKLOG) != BACKLOG:
        raise InputError(f"scenario file {path}: batch.mode {values['batch.mode']!r} does not "
                         "go with batch.jobs (the jobs are the batch demand)")
    return scenario_from_values(values, base_dir=path.resolve().parent, origin=str(path),
                                default_name=path.stem, jobs=jobs)


def _pop_jobs(path: Path, data: dict[str, object]) -> JobsSpec | None:
    """Take the job tables out of `[batch]` and parse them (`models.sim.jobs_spec`)."""
    batch = data.get("batch")
    if not isinstance(batch, dict):
        return None
    tables = {name: batch.pop(name) for name in JOB_TABLES if name in batch}
    try:
        return parse_jobs(tables)
    except InputError as exc:
        raise InputError(f"scenario file {path}: {exc}") from None


def scenario_from_values(values: dict[str, object], *, base_dir: Path, origin: str,
                         default_name: str, jobs: JobsSpec | None = None) -> Scenario:
    """Build a scenario from flat dotted keys over `seed`'s defaults (see `KEYS`)."""
    for name, value in values.items():
        key = KEYS_BY_NAME.get(name)
        if key is None:
            raise InputError(f"scenario {origin}: unknown key {name!r}")
        why = key.check(value)
        if why is not None:
            raise InputError(f"scenario {origin}: {name} {why}, got {value!r}")
    groups: dict[str, dict[str, object]] = {
        g: {} for g in ("scenario", "slo", "burst", "batch", "failure")
    }
    for name, value in values.items():
        key = KEYS_BY_NAME[name]
        group, field_name = key.target.split(".")
        if key.kind is float:
            value = float(value)  # type: ignore[arg-type]
        if key.kind is tuple:
            value = tuple(value)  # type: ignore[arg-type]
        if key.path:
            value = _resolve(base_dir, str(value))
        groups[group][field_name] = value
    fields = groups["scenario"]
    fields.setdefault("name", default_name)
    fields["jobs"] = jobs
    fields["slo"] = Slo(**groups["slo"])  # type: ignore[arg-type]
    fields["batch"] = BatchWorkload(**groups["batch"])  # type: ignore[arg-type]
    has_burst = any(n.startswith("interactive.burst.") for n in values)
    fields["burst"] = Burst(**groups["burst"]) if has_burst else None  # type: ignore[arg-type]
    has_failure = any(n.startswith("failure.") for n in values)
    fields["failure"] = (
        Failure(**groups["failure"]) if has_failure else None  # type: ignore[arg-type]
    )
    try:
        return Scenario(**fields)  # type: ignore[arg-type]
    except InputError as exc:
        raise InputError(f"scenario {origin}: {exc}") from None


def _flatten(path: Path, data: dict[str, object], prefix: str = "") -> dict[str, object]:
    """Dotted keys of the leaves of the TOML tables; a table where a value belongs (or the
    reverse) is an error naming the key."""
    out: dict[str, object] = {}
    for name, value in data.items():
        dotted = f"{prefix}{name}"
        if isinstance(value, dict):
            if dotted not in SECTIONS:
                raise InputError(f"scenario file {path}: unknown section [{dotted}]")
            out.update(_flatten(path, value, dotted + "."))
            if dotted in ("interactive.burst", "failure") and not value:
                raise InputError(
                    f"scenario file {path}: [{dotted}] is empty (leave the section out to "
                    "turn it off, or set its keys)"
                )
        else:
            out[dotted] = value
    return out


def _resolve(base_dir: Path, value: str) -> str:
    """`value` against `base_dir` when it has a folder part or names a file there."""
    candidate = Path(value).expanduser()
    if candidate.is_absolute():
        return str(candidate)
    beside = base_dir / candidate
    if len(candidate.parts) > 1 or beside.exists():
        return str(beside)
    return value


def builtin_scenarios() -> dict[str, Path]:
    """Built-in scenario names and their files."""
    return {p.stem: p for p in sorted(SCENARIOS_DIR.glob("*.toml"))}


def get_scenario(name_or_path: str | Path) -> Scenario:
    """A built-in scenario by name, or the scenario file at a path (`.toml`)."""
    text = str(name_or_path)
    builtin = builtin_scenarios()
    if text in builtin:
        if text not in _builtin_cache:
            _builtin_cache[text] = load_scenario_file(builtin[text])
        return _builtin_cache[text]
    if text.endswith(".toml") or Path(text).exists() or len(Path(text).parts) > 1:
        return load_scenario_file(Path(text))
    known = ", ".join(builtin)
    raise InputError(f"unknown scenario {text!r} (known: {known}; or a scenario .toml file)")


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, tuple):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return str(value)


def _current(scenario: Scenario, key: Key) -> object:
    group, field_name = key.target.split(".")
    holder: object = {
        "scenario": scenario, "slo": scenario.slo, "batch": scenario.batch,
        "burst": scenario.burst or Burst(), "failure": scenario.failure or Failure(),
    }[group]
    return getattr(holder, field_name)


def example_text(scenario: Scenario | None = None) -> str:
    """A commented scenario file with every key at `scenario`'s (default `seed`'s) value;
    a section the scenario does not use is written commented out."""
    sc = scenario or get_scenario("seed")
    off = {"interactive.burst": sc.burst is None, "failure": sc.failure is None}
    lines = [
        "# borrowd simulator scenario (`borrowd sim|bench --scenario THIS.toml`).",
        "# Every key is optional: an absent key keeps seed's value. Relative paths resolve",
        "# against this file's folder; a bare trace name is a packaged trace (or a file in",
        "# $BORROWD_TRACES_DIR). Without [interactive.burst] or [failure] there is no burst",
        "# or no failure.",
    ]
    section = ""
    for key in KEYS:
        head, _, leaf = key.name.rpartition(".")
        hidden = "# " if off.get(head) else ""
        if head != section:
            section = head
            lines.append("")
            lines.append(f"{hidden}[{head}]")
        choices = f" ({' | '.join(key.choices)})" if key.choices else ""
        lines.append(f"# {key.help}{choices}")
        value = _current(sc, key)
        if value == ():
            lines.append(f"# {leaf} = [0, 1]")  # unset: every replica
        else:
            lines.append(f"{hidden}{leaf} = {_toml_value(value)}")
    lines.append("")
    lines.extend(JOBS_EXAMPLE_LINES)
    return "\n".join(lines) + "\n"


def with_slo(scenario: Scenario, ttft_p95_s: float | None, itl_p95_s: float | None,
             success_rate: float | None = None) -> Scenario:
    """`scenario` with the SLOs given replaced (validated like the file's keys)."""
    changes: dict[str, float] = {}
    for name, value in (("ttft_p95_s", ttft_p95_s), ("itl_p95_s", itl_p95_s),
                        ("success_rate", success_rate)):
        if value is None:
            continue
        why = KEYS_BY_NAME[f"slo.{name}"].check(value)
        if why is not None:
            raise InputError(f"--slo-{name.replace('_', '-')} {why}, got {value!r}")
        changes[name] = float(value)
    if not changes:
        return scenario
    return scenario.with_overrides(slo=dataclasses.replace(scenario.slo, **changes))

