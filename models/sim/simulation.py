"""The virtual-time run loop: a fleet fed by trace workloads, batch under a budget, metrics.

Events (a heap, plus a pointer into the sorted interactive arrivals): a replica's step
ends (its result is applied then, and its next step starts at once if it has work), an
interactive arrival (routed, and an idle replica starts a step), a tick of the pool's
control loop, a gate wake-up when the token bucket will hold the next batch request, a once-a-second
housekeeping pass (clients give up on interactive requests with no first token after
`ttft_timeout_s`), and replica failure/recovery.

`Simulation` is a `MetricsSource` (`observe`, as Prometheus is) and owns a budget store and
election (`models.sim.store`, as Redis is), so the daemon's own per-pool loop, built by the
policy's `LoopFactory` at the CLI edge (`controller.loop.PoolLoop`: stop switch, election,
fencing and all), ticks against it every `tick_s` of virtual time. Each record the store
takes is enforced at once: a budget below what is in flight revokes batch requests newest
first (aborted in their engine, their jobs back at the head of the backlog, the tokens they
had computed counted as recomputed work), then batch is admitted within it.
"""

from __future__ import annotations

import bisect
import heapq
import math
import time
from dataclasses import dataclass, field

import numpy as np
from borrowd.models.budget import Budget
from borrowd.models.enforcement import ENGINE, engine_share, step_guard_for
from borrowd.models.errors import InputError
from borrowd.models.protocols import TickLoop
from borrowd.models.signals import Observation
from borrowd.models.sim import metrics
from borrowd.models.sim.cores import DEFAULT_ENGINE, make_engine
from borrowd.models.sim.engine import DecodeSpan, EngineConfig, StepResult
from borrowd.models.sim.fleet import Fleet
from borrowd.models.sim.gate import BatchGate
from borrowd.models.sim.jobs import JobsSource
from borrowd.models.sim.policies import PolicySpec
from borrowd.models.sim.profiles import get_profile
from borrowd.models.sim.request import ABORTED, BATCH, INTERACTIVE, Request
from borrowd.models.sim.scenario import BACKLOG, Scenario
from borrowd.models.sim.store import SimElection, SimStore
from borrowd.models.sim.trace import Lengths, Trace
from borrowd.models.sim.workload import BatchJob, BatchSource, interactive_arrivals

_TICK, _WAKE, _HOUSE, _FAIL, _RECOVER, _BATCH_ARRIVAL, _JOB_ARRIVAL, _SCRAPE = range(8)
INF = math.inf


@dataclass(frozen=True)
class Gauges:
    """The gauges of one moment that the daemon reads through recording rules: the highest
    KV usage, interactive requests queued, the oldest interactive wait for a first token, the
    interactive requests waiting past the TTFT SLO and batch requests in flight. The
    defaults are an idle pool's (before the run)."""

    kv_usage_frac: float = 0.0
    interactive_queue_depth: float = 0.0
    interactive_oldest_wait_s: float = 0.0
    interactive_late_waiters: float = 0.0
    batch_running_seqs: float = 0.0


@dataclass
class RunResult:
    """Everything a run produced, ready to summarise (`summary()`) or plot."""

    scenario: Scenario
    policy: str
    duration_s: float
    seed: int
    rate_scale: float
    wall_s: float
    recorder: metrics.Recorder
    busy_s: float
    batch: dict[str, float]
    interactive_preemptions: int
    budget_timeline: list[dict[str, object]] = field(default_factory=list)
    jobs: dict[str, object] | None = None  # batch jobs' figures (`models.sim.jobs`)
    group_recorders: list[metrics.Recorder] | None = None

    def summary(self) -> dict[str, object]:
        """The run as the JSON document of `borrowd sim` (keys fixed by issue #2)."""
        sc = self.scenario
        rec = self.recorder
        wins = metrics.windows(rec, self.duration_s, sc.window_s, sc.replicas, sc.slo)
        overall = rec.interactive_figures(-1.0, self.duration_s + 1.0)
        inter: dict[str, object] = {k: metrics.json_number(v) for k, v in overall.items()}
        inter["slo_windows_met_frac"] = round(sum(w.slo_met for w in wins) / len(wins), 4)
        inter["preemptions"] = self.interactive_preemptions
        groups = self._group_summaries()
        return {
            "policy": self.policy,
            "scenario": sc.name,
            "enforcement": sc.enforcement,
            "interference_series": sc.interference_series,
            "duration_s": self.duration_s,
            "seed": self.seed,
            "wall_s": round(self.wall_s, 3),
            "speed": round(self.duration_s / self.wall_s, 1) if self.wall_s > 0 else None,
            "interactive_rate_scale": round(self.rate_scale, 6),
            "interactive_load_target": sc.interactive_load,
            "gpu_busy_frac": round(self.busy_s / (sc.replicas * self.duration_s), 4),
            "interactive": inter,
            "batch": {
                k: (round(v, 4) if isinstance(v, float) else v) for k, v in self.batch.items()
            },
            "windows": [w.to_json() for w in wins],
            "budget_timeline": self.budget_timeline,
            **({"jobs": self.jobs} if self.jobs is not None else {}),
            **({"replica_groups": groups} if groups else {}),
        }

    def _group_summaries(self) -> list[dict[str, object]]:
        """Interactive figures of the batch-eligible replicas and of the others (only when
        batch is restricted to some replicas)."""
        if self.group_recorders is None:
            return []
        sc = self.scenario
        eligible = sc.batch_replicas()
        members = (eligible, tuple(r for r in range(sc.replicas) if r not in eligible))
        out: list[dict[str, object]] = []
        for name, replicas, rec in zip(("batch", "other"), members, self.group_recorders,
                                       strict=True):
            fig = rec.interactive_figures(-1.0, self.duration_s + 1.0)
            wins = metrics.windows(rec, self.duration_s, sc.window_s, len(replicas), sc.slo)
            out.append({"group": name, "replicas": list(replicas),
                        **{k: metrics.json_number(v) for k, v in fig.items()},
                        "slo_windows_met_frac": round(sum(w.slo_met for w in wins) / len(wins),
                                                      4)})
        return out


def signal_ends(now_s: float, scrape_interval_s: float,
                evaluation_interval_s: float) -> tuple[float, float, float]:
    """When the data the daemon reads at `now_s` was made, as a Prometheus scraping every
    `scrape_interval_s` (targets half an interval out of phase with the rules) and evaluating
    rules every `evaluation_interval_s` serves it: (the last rule evaluation, the last scrape
    before it: where the recorded series' windows end, the last scrape by `now_s`: where the
    burn shares' windows end; the daemon reads those from raw histograms at the tick). An
    interval of 0 is no delay. Pure, so that every tick between two evaluations reads the
    same recorded values, as the daemon does."""
    evaluated_s = _last_multiple(now_s, evaluation_interval_s, 0.0)
    phase_s = scrape_interval_s / 2.0
    return (evaluated_s, _last_multiple(evaluated_s, scrape_interval_s, phase_s),
            _last_multiple(now_s, scrape_interval_s, phase_s))


def _last_multiple(t_s: float, period_s: float, phase_s: float) -> float:
    """The last time phase + k * period at or before `t_s` (`t_s` itself when period is 0)."""
    if period_s <= 0:
        return t_s
    return phase_s + math.floor((t_s - phase_s) / period_s + 1e-9) * period_s


class Simulation:
    """One run of a scenario under a policy, in virtual time."""

    def __init__(
        self,
        scenario: Scenario,
        policy: PolicySpec,
        *,
        duration_s: float,
        seed: int,
        trace: Trace,
        rate_scale: float,
        lengths: Lengths | None = None,
        engine: str = DEFAULT_ENGINE,
        with_burst: bool = True,
    ) -> None:
        if not duration_s > 0:
            raise InputError(f"duration must be > 0 seconds, got {duration_s!r}")
        if policy.batch and lengths is None:
            raise InputError(f"policy {policy.name!r} runs batch work but no batch lengths given")
        self.scenario = scenario
        self.policy = policy
        self.duration_s = float(duration_s)
        self.seed = seed
        self.rate_scale = rate_scale
        profile = get_profile(scenario.profile)
        config = EngineConfig.for_profile(
            profile,
            max_num_batched_tokens=scenario.max_num_batched_tokens,
            max_num_seqs=scenario.max_num_seqs,
            block_size=scenario.block_size,
            long_prefill_token_threshold=scenario.long_prefill_token_threshold,
            policy=policy.engine_policy,
            enable_prefix_caching=scenario.enable_prefix_caching,
        )
        self.fleet = Fleet(
            [make_engine(engine, config, profile) for _ in range(scenario.replicas)],
            scenario.router,
            scenario.batch.replicas,
        )
        burst = scenario.burst if with_burst else None
        self.arrivals = interactive_arrivals(
            trace,
            rate_scale,
            self.duration_s,
            burst.window_s(self.duration_s) if burst else None,
            burst.rate_multiplier if burst else 1.0,
        )
        rng = np.random.default_rng(seed)
        self._rng = rng
        self.source: BatchSource | JobsSource | None = (
            BatchSource(lengths, scenario.batch, rng) if policy.batch and lengths else None
        )
        # Batch jobs (`models.sim.jobs`), when the scenario has them, are the batch demand.
        self.jobs = (
            JobsSource(scenario.jobs, scenario.batch, lengths, np.random.default_rng([seed, 15]))
            if policy.batch and scenario.jobs is not None else None
        )
        if self.jobs is not None:
            self.source = self.jobs
        self._batch_available = (
            INF if scenario.batch.mode == BACKLOG and self.jobs is None else 0.0
        )
        self.store = SimStore(scenario.pool, self._enforce)
        self.gate = BatchGate(self.store.gate, lease_ms=math.ceil(self.duration_s * 1000) + 1000)
        self.election = SimElection(self.store)
        self.loop: TickLoop | None = (
            policy.loop(self, self.store, self.election) if policy.loop is not None else None
        )
        if scenario.enforcement == ENGINE:
            for e in self.fleet.engines:
                if not hasattr(e, "set_batch_budget"):
                    raise InputError(
                        f"enforcement {ENGINE!r} needs the native engine core, not {engine!r}"
                    )
                e.set_batch_budget(None)
                e.set_step_guard(  # type: ignore[attr-defined]
                    step_guard_for(scenario.slo.itl_p95_s, scenario.step_guard_frac))
        self.rec = metrics.Recorder(self.duration_s)
        # Interactive figures per replica group (batch-eligible, other) when batch is
        # restricted, so a run shows the replicas without batch apart.
        self.group_recs: list[metrics.Recorder] | None = None
        self._group_of: list[int] = []
        if self.fleet.restricted:
            self.group_recs = [metrics.Recorder(self.duration_s) for _ in range(2)]
            self._group_of = [0 if e else 1 for e in self.fleet.batch_eligible]
        self.now_s = 0.0
        self._heap: list[tuple[float, int, int, int]] = []
        self._steps: list[tuple[float, int, int, int]] = []
        self._spans = all(hasattr(e, "plan_decode_span") for e in self.fleet.engines)
        self._plans: list[DecodeSpan | None] = [None] * scenario.replicas
        self._seq = 0
        self._pending: list[StepResult | None] = [None] * scenario.replicas
        self._gen = [0] * scenario.replicas
        self._waiting_first: dict[str, Request] = {}
        # request id -> (request, job, admission id); admission id -> request id
        self._batch_inflight: dict[str, tuple[Request, BatchJob, str]] = {}
        self._admitted: dict[str, str] = {}
        self._wake_s = INF
        self.busy_s = 0.0
        self.batch_computed_tokens = 0
        self.batch_recomputed_tokens = 0
        self.batch_completed = 0
        self.batch_done_prompt_tokens = 0
        self.batch_done_output_tokens = 0
        self.batch_preemptions = 0
        self.interactive_preemptions = 0
        self.revocations = 0
        self.batch_admissions = 0
        self.budget_timeline: list[dict[str, object]] = []
        self.batch_gpu_s = 0.0  # step time x the batch share of the step's tokens
        # Gauges as each scrape read them (scrape times ascending), for `observe`.
        self._scrape_t: list[float] = []
        self._scraped: list[Gauges] = []

    # -- events ----------------------------------------------------------------------------

    def _push(self, t: float, kind: int, arg: int = 0) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, arg))

    def _kick(self, r: int, now: float) -> None:
        """Start a step on replica `r` if it is up, idle and has work."""
        if self._pending[r] is not None or self._plans[r] is not None or not self.fleet.up[r]:
            return
        res = self.fleet.engines[r].step(now)
        if res is not None:
            self._pending[r] = res
            self._seq += 1
            heapq.heappush(self._steps, (res.end_s, self._seq, r, self._gen[r]))

    def _settle(self, r: int, now: float) -> None:
        """Before replica `r`'s engine is touched at `now`: cut its decode span there.

        The span's steps that started before `now` are applied (as a step in flight would
        be); the rest are dropped and the replica's next step follows the last of them.
        """
        plan = self._plans[r]
        if plan is None:
            return
        self._plans[r] = None
        done = plan.steps_started_before(now)
        if done == plan.steps:
            self._pending[r] = self.fleet.engines[r].commit_decode_span(plan, done)  # type: ignore[attr-defined]
            return
        self._gen[r] += 1
        if done == 0:
            return
        res = self.fleet.engines[r].commit_decode_span(plan, done)  # type: ignore[attr-defined]
        self._pending[r] = res
        self._seq += 1
        heapq.heappush(self._steps, (res.end_s, self._seq, r, self._gen[r]))

    def _apply(self, res: StepResult, r: int) -> None:
        """Record a finished step's effects on replica `r` (hot path: keep it lean)."""
        rec = self.rec
        if self.group_recs is not None:
            _record_interactive(self.group_recs[self._group_of[r]], res, self._waiting_first)
        end = res.end_s
        sec = int(end)
        if sec >= len(rec.busy_s_per_s):
            sec = len(rec.busy_s_per_s) - 1
        self.busy_s += res.duration_s
        rec.busy_s_per_s[sec] += res.duration_s
        with_batch = res.batch_tokens > 0
        if with_batch:
            rec.batch_tokens_per_s[sec] += res.batch_tokens
            self.batch_computed_tokens += res.batch_tokens
            self.batch_gpu_s += res.duration_s * res.batch_tokens / res.scheduled_tokens
        if res.interactive_waiting:
            # Attribution: interactive queue wait spent in steps carrying batch tokens.
            waited = res.interactive_waiting * res.duration_s
            rec.interactive_wait_s_per_s[sec] += waited
            if with_batch:
                rec.interactive_wait_batch_s_per_s[sec] += waited
        if res.itl_steady:
            if res.span_steps == 1:
                rec.itl_t.append(end)
                rec.itl_s.append(res.duration_s)
                rec.itl_w.append(res.itl_steady)
                rec.itl_batch.append(with_batch)
            else:
                t = res.start_s
                for d in res.step_durations_s():
                    t += d
                    rec.itl_t.append(t)
                    rec.itl_s.append(d)
                rec.itl_w.extend([res.itl_steady] * res.span_steps)
                rec.itl_batch.extend([with_batch] * res.span_steps)
        for gap in res.itl_other_s:
            rec.itl_t.append(end)
            rec.itl_s.append(gap)
            rec.itl_w.append(1)
            rec.itl_batch.append(with_batch)
        for req in res.first_tokens:
            if (req.klass == INTERACTIVE
                    and self._waiting_first.pop(req.request_id, None) is not None):
                rec.ttft_t.append(end)
                rec.ttft_s.append(end - req.submitted_s)
        if res.preempted:
            rec.preemptions_per_s[sec] += len(res.preempted)
            for req in res.preempted:
                if req.klass == INTERACTIVE:
                    self.interactive_preemptions += 1
                else:
                    self.batch_preemptions += 1
        batch_done = False
        for req in res.finished:
            self.fleet.done(req)
            if req.klass == INTERACTIVE:
                rec.outcome_t.append(end)
                rec.outcome_ok.append(True)
            else:
                self._batch_finished(req, end, sec)
                batch_done = True
        if batch_done:
            self._pump_batch(end)

    def _batch_finished(self, req: Request, now: float, sec: int) -> None:
        entry = self._batch_inflight.pop(req.request_id, None)
        if entry is None:
            return
        _, job, admission = entry
        self._admitted.pop(admission, None)
        self.gate.release(admission, req.output_tokens, now)
        self.batch_recomputed_tokens += req.recomputed_tokens
        job.generated_tokens += req.output_tokens
        if self.jobs is not None:
            self.jobs.attempt_ended(job, req, now)
        if job.remaining_output_tokens > 0:
            # Output cap reached before the job's end: it resumes later from its prompt
            # plus what it generated, and that prefix is computed again.
            job.recomputed_tokens += req.prompt_tokens + req.output_tokens
            self.batch_recomputed_tokens += req.prompt_tokens + req.output_tokens
            self._batch_available += 1
            self.source.push_front(job)  # type: ignore[union-attr]
            return
        self.batch_completed += 1
        self.batch_done_prompt_tokens += job.prompt_tokens
        self.batch_done_output_tokens += job.output_tokens
        self.rec.batch_done_tokens_per_s[sec] += job.prompt_tokens + job.output_tokens

    # -- batch admission and revocation ----------------------------------------------------

    def _pump_batch(self, now: float) -> None:
        """Admit batch requests from the backlog while the gate and the client allow."""
        source = self.source
        if source is None or self.gate.budget is None or not self.fleet.batch_up():
            return
        concurrency = self.scenario.batch.client_concurrency
        gate = self.gate
        while self._batch_available >= 1 and len(self._batch_inflight) < concurrency:
            prompt, remaining = source.peek_cost()
            admission = f"a{self.batch_admissions}"
            wait, out = gate.try_admit(admission, prompt, remaining, now)
            if wait > 0:
                wake = now + max(wait, 1e-3)
                if wait < INF and wake < self._wake_s:
                    self._wake_s = wake
                    self._push(wake, _WAKE)
                return
            self.batch_admissions += 1
            job = source.next_job()
            job.attempts += 1
            self._batch_available -= 1
            req = Request(
                f"b{job.job_id}.{job.attempts}",
                BATCH,
                prompt,
                out,
                now,
                priority=self.scenario.batch.priority,
            )
            r = self.fleet.route(req)
            self._batch_inflight[req.request_id] = (req, job, admission)
            self._admitted[admission] = req.request_id
            self._settle(r, now)
            if not self.fleet.engines[r].add_request(req):
                raise InputError(f"batch request refused by the engine: {req.error}")
            self._kick(r, now)

    def _revoke(self, revoked: tuple[str, ...], now: float) -> None:
        """Abort the batch requests the gate revoked (newest first), as the adapters do."""
        for admission in revoked:
            rid = self._admitted.pop(admission, None)
            if rid is None:
                continue
            req, job, _ = self._batch_inflight[rid]
            engine = self.fleet.engines[req.replica]
            self._settle(req.replica, now)
            if engine.abort_request(rid) is None:
                continue  # it completes in the step now running; the gate freed it already
            del self._batch_inflight[rid]
            self.fleet.done(req)
            self.revocations += 1
            self._requeue_batch(req, job, now)

    def _requeue_batch(self, req: Request, job: BatchJob, now: float) -> None:
        """Put an aborted batch request's job back at the head of the backlog."""
        done_output = min(req.output_tokens, job.remaining_output_tokens)
        job.generated_tokens += done_output
        if self.jobs is not None:
            self.jobs.attempt_ended(job, req, now)
        lost = req.computed_tokens
        job.recomputed_tokens += lost
        self.batch_recomputed_tokens += lost + req.recomputed_tokens
        self._batch_available += 1
        if job.remaining_output_tokens > 0:
            self.source.push_front(job)  # type: ignore[union-attr]
        else:
            self.batch_completed += 1
            self.batch_done_prompt_tokens += job.prompt_tokens
            self.batch_done_output_tokens += job.output_tokens

    # -- enforcement of the stored budget, and the MetricsSource ----------------------------

    def _enforce(self, budget: Budget, revoked: tuple[str, ...], now_s: float) -> None:
        """Enforce the record the store took at `now_s` (the gate holds it already): abort
        what it revoked, admit within it."""
        if self.scenario.enforcement == ENGINE:
            self._share_engine_budget(now_s)
        self.budget_timeline.append(
            {
                "t_s": round(now_s, 3),
                "mode": budget.mode.value,
                "reason": budget.reason,
                "batch_tokens_per_s": round(budget.batch_tokens_per_s, 1),
                "max_batch_seqs": budget.max_batch_seqs,
                "max_batch_kv_tokens": budget.max_batch_kv_tokens,
                "max_batch_output_tokens": budget.max_batch_output_tokens,
            }
        )
        if self.source is None:
            return
        self._revoke(revoked, now_s)
        self._pump_batch(now_s)
        if self.scenario.enforcement == ENGINE:
            # A replica whose batch work was held at a zero step allowance went idle; the
            # new allowance must start it again (an interactive arrival may never come to
            # it: the router steers around its outstanding batch tokens).
            for r in range(len(self.fleet.engines)):
                self._kick(r, now_s)

    def _share_engine_budget(self, now_s: float) -> None:
        """Give each replica's per-step limit its share of the pool's batch rate (the
        budget split over the eligible replicas up), as a plugin configured with that share
        would; a replica not eligible for batch gets none (its plugin schedules no batch)."""
        budget = engine_share(self.gate.budget, self.fleet.batch_up())
        for r, engine in enumerate(self.fleet.engines):
            self._settle(r, now_s)
            engine.set_batch_budget(  # type: ignore[attr-defined]
                budget if self.fleet.batch_eligible[r] else None
            )

    def observe(self, pool: str, now_s: float) -> Observation:
        """Signals over the last `observe_window_s` seconds (the policy's window when it names
        one: the daemon config's rules window, as the daemon reads) as Prometheus would serve
        them at `now_s` (`signal_ends`): the recorded series over the samples scraped by the
        last rule evaluation, aged since it; the burn shares over those scraped by now. The
        gauges (KV usage, queue, oldest wait, batch in flight: `Gauges`) are those of the
        scrape the recording rules last read, as the daemon reads them through the rules too;
        the late waiters, which it reads raw as the burn, those of the last scrape. The batch
        shares of the burns are NaN where the engines export no interference series
        (`Scenario.interference_series` false)."""
        if pool != self.scenario.pool:
            return Observation(now_s=now_s, age_s=math.inf)
        rec = self.rec
        w = self.policy.observe_window_s or self.scenario.observe_window_s
        evaluated_s, rules_end_s, burn_end_s = signal_ends(
            now_s, self.scenario.scrape_interval_s, self.scenario.evaluation_interval_s)
        t0 = rules_end_s - w
        # Latency of the replicas batch may use (all unless restricted), as the daemon's
        # rules read the proxy's histograms; success and the rest stay fleet-wide, as there.
        lat = self.group_recs[0] if self.group_recs is not None else rec
        fig = lat.interactive_figures(t0, rules_end_s)
        success_rate = (fig["success_rate"] if lat is rec
                        else rec.interactive_figures(t0, rules_end_s)["success_rate"])
        lo, hi = max(0, int(t0)), max(0, int(rules_end_s))
        span = max(1, hi - lo)
        gauges = self._gauges_read(now_s, rules_end_s)
        engines = [e for e, up in zip(self.fleet.engines, self.fleet.up, strict=True) if up]
        a, b = rec.window_slice(rec.ttft_t, t0, rules_end_s)  # requests fleet-wide, as success
        itl_over, ttft_over = lat.slo_burn(burn_end_s - w, burn_end_s, self.scenario.slo)
        itl_n, ttft_n, itl_batch = lat.slo_samples(burn_end_s - w, burn_end_s,
                                                   self.scenario.slo)
        waited = sum(rec.interactive_wait_s_per_s[lo:hi])
        waited_batch = sum(rec.interactive_wait_batch_s_per_s[lo:hi])
        series = self.scenario.interference_series  # else bare engines: no batch share
        return Observation(
            now_s=now_s,
            age_s=now_s - evaluated_s,
            ttft_p95_s=fig["ttft_p95_s"],
            itl_p95_s=fig["itl_p95_s"],
            success_rate=success_rate,
            kv_usage_frac=gauges.kv_usage_frac,
            interactive_queue_depth=gauges.interactive_queue_depth,
            interactive_oldest_wait_s=gauges.interactive_oldest_wait_s,
            interactive_late_waiters=self._gauges_read(
                now_s, burn_end_s).interactive_late_waiters,
            preemptions_per_s=sum(rec.preemptions_per_s[lo:hi]) / span,
            interactive_tokens_per_s=sum(rec.interactive_offered_per_s[lo:hi]) / span,
            batch_tokens_per_s=sum(rec.batch_tokens_per_s[lo:hi]) / span,
            batch_running_seqs=gauges.batch_running_seqs,
            interactive_requests=float(b - a),
            itl_over_slo_frac=itl_over,
            ttft_over_slo_frac=ttft_over,
            window_s=w,
            itl_samples=itl_n,
            ttft_samples=ttft_n,
            itl_over_slo_batch_frac=itl_batch if series else math.nan,
            interactive_wait_batch_frac=(waited_batch / waited if waited > 0 and series
                                         else math.nan),
            kv_capacity_tokens=float(sum(
                e.config.num_gpu_blocks * e.config.block_size for e in engines)),
        )

    def gauges(self, now_s: float) -> Gauges:
        """The gauges at `now_s`, as a scrape then reads them (engines that are up)."""
        engines = [e for e, up in zip(self.fleet.engines, self.fleet.up, strict=True) if up]
        waits = [now_s - r.submitted_s for r in self._waiting_first.values()]
        slo_s = self.scenario.slo.ttft_p95_s
        return Gauges(
            kv_usage_frac=max((e.kv_usage_frac() for e in engines), default=0.0),
            interactive_queue_depth=float(sum(e.num_waiting(INTERACTIVE) for e in engines)),
            interactive_oldest_wait_s=max([0.0, *waits]),
            interactive_late_waiters=float(sum(1 for w in waits if w > slo_s)),
            # Admitted and not finished, as the proxy's in-flight gauge counts them.
            batch_running_seqs=float(len(self._batch_inflight)),
        )

    def _gauges_read(self, now_s: float, scraped_by_s: float) -> Gauges:
        """The gauges the daemon reads at `now_s`: those of the last scrape at or before
        `scraped_by_s` (an idle pool's before the first), or of `now_s` itself where the
        scenario scrapes continuously (`scrape_interval_s` 0)."""
        if self.scenario.scrape_interval_s <= 0:
            return self.gauges(now_s)
        i = bisect.bisect_right(self._scrape_t, scraped_by_s + 1e-9)
        return self._scraped[i - 1] if i > 0 else Gauges()

    # -- interactive requests, failures, housekeeping --------------------------------------

    def _submit_interactive(self, req: Request, now: float) -> None:
        if not self.fleet.any_up():
            self.rec.outcome_t.append(now)
            self.rec.outcome_ok.append(False)
            return
        r = self.fleet.route(req)
        self._settle(r, now)
        if not self.fleet.engines[r].add_request(req):
            self.fleet.done(req)
            self.rec.outcome_t.append(now)
            self.rec.outcome_ok.append(False)
            if self.group_recs is not None:
                _record_failure(self.group_recs[self._group_of[r]], now, None)
            return
        if req.first_token_s < 0:
            self._waiting_first[req.request_id] = req
        self._kick(r, now)

    def _housekeeping(self, now: float) -> None:
        timeout = self.scenario.ttft_timeout_s
        expired = [
            r for r in self._waiting_first.values()
            if now - r.submitted_s >= timeout and r.first_token_s < 0
        ]
        for req in expired:
            del self._waiting_first[req.request_id]
            self._settle(req.replica, now)
            if self.fleet.engines[req.replica].abort_request(req.request_id) is not None:
                self.fleet.done(req)
            req.status = ABORTED
            self.rec.ttft_t.append(now)
            self.rec.ttft_s.append(now - req.submitted_s)
            self.rec.outcome_t.append(now)
            self.rec.outcome_ok.append(False)
            if self.group_recs is not None:
                _record_failure(self.group_recs[self._group_of[req.replica]], now,
                                now - req.submitted_s)

    def _fail(self, r: int, now: float) -> None:
        """Replica `r` goes down: its step in flight completes, then every request is lost."""
        self._settle(r, now)
        pending = self._pending[r]
        self._pending[r] = None
        self._gen[r] += 1
        if pending is not None:
            self._apply(pending, r)
        self.fleet.up[r] = False
        if self.scenario.enforcement == ENGINE:
            self._share_engine_budget(now)
        engine = self.fleet.engines[r]
        lost = list(engine.requests.values())
        for req in lost:
            engine.abort_request(req.request_id)
            self.fleet.done(req)
        for req in lost:
            if req.klass == INTERACTIVE:
                self._waiting_first.pop(req.request_id, None)
                self._submit_interactive(_resubmission(req), now)
            else:
                entry = self._batch_inflight.pop(req.request_id, None)
                if entry is not None:
                    self._admitted.pop(entry[2], None)
                    self.gate.release(entry[2], req.output_tokens, now)
                    self._requeue_batch(req, entry[1], now)
        self._pump_batch(now)

    def _recover(self, r: int, now: float) -> None:
        self.fleet.up[r] = True
        if self.scenario.enforcement == ENGINE:
            self._share_engine_budget(now)
        self._pump_batch(now)

    # -- the loop --------------------------------------------------------------------------

    def run(self) -> RunResult:
        """Run to `duration_s` and return the result."""
        wall0 = time.perf_counter()
        sc = self.scenario
        duration = self.duration_s
        loop = self.loop
        if self.policy.batch and self.policy.budget is not None:
            # A constant budget, written once with a lease that outlasts the run.
            self.store.publish(self.policy.budget, epoch=0, now_s=0.0,
                               ttl_ms=math.ceil(duration * 1000) + 1000)
        if loop is not None:
            self._push(0.0, _TICK)
        self._push(1.0, _HOUSE)
        if sc.scrape_interval_s > 0:
            self._push(sc.scrape_interval_s / 2.0, _SCRAPE)  # the phase of `signal_ends`
        if sc.failure is not None:
            f0, f1 = sc.failure.window_s(duration)
            if f0 < duration:
                self._push(f0, _FAIL, sc.failure.replica)
                self._push(f1, _RECOVER, sc.failure.replica)
        if self.source is not None and sc.batch.mode != BACKLOG and sc.batch.submit_rate_per_s > 0:
            self._push(self._rng.exponential(1.0 / sc.batch.submit_rate_per_s), _BATCH_ARRIVAL)
        if self.jobs is not None:
            for arrival_s, index in self.jobs.arrivals():
                self._push(arrival_s, _JOB_ARRIVAL, index)

        arr_t = self.arrivals.arrival_s.tolist()
        arr_p = self.arrivals.prompt_tokens.tolist()
        arr_o = self.arrivals.output_tokens.tolist()
        arr_seg = self.arrivals.segments
        n_arr = len(arr_t)
        idx = 0
        heap = self._heap
        steps = self._steps
        pending = self._pending
        gen = self._gen
        engines = self.fleet.engines
        offered = self.rec.interactive_offered_per_s
        prio = sc.interactive_priority
        last_bin = len(offered) - 1
        spans = self._spans
        plans = self._plans
        while True:
            t_arr = arr_t[idx] if idx < n_arr else INF
            t_ev = heap[0][0] if heap else INF
            t_step = steps[0][0] if steps else INF
            if t_step < t_arr and t_step < t_ev:
                if t_step >= duration:
                    break
                t, _, r, g = heapq.heappop(steps)
                if g != gen[r]:
                    continue
                self.now_s = t
                plan = plans[r]
                if plan is not None:
                    plans[r] = None
                    res = engines[r].commit_decode_span(plan, plan.steps)  # type: ignore[attr-defined]
                else:
                    res = pending[r]
                    pending[r] = None
                self._apply(res, r)
                if pending[r] is None and plans[r] is None:
                    if spans:
                        plan = engines[r].plan_decode_span(t, t_ev if t_ev < duration else duration)  # type: ignore[attr-defined]
                        if plan is not None:
                            plans[r] = plan
                            self._seq += 1
                            heapq.heappush(steps, (plan.end_s(), self._seq, r, g))
                            continue
                    nxt = engines[r].step(t)
                    if nxt is not None:
                        pending[r] = nxt
                        self._seq += 1
                        heapq.heappush(steps, (nxt.end_s, self._seq, r, g))
                continue
            if t_arr <= t_ev:
                if t_arr >= duration:
                    break
                self.now_s = t_arr
                p, o = arr_p[idx], arr_o[idx]
                req = Request(f"i{idx}", INTERACTIVE, p, o, t_arr, priority=prio,
                              segments=arr_seg[idx] if arr_seg is not None else ())
                offered[min(int(t_arr), last_bin)] += p + o
                idx += 1
                self._submit_interactive(req, t_arr)
                continue
            if t_ev >= duration:
                break
            t, _, kind, arg = heapq.heappop(heap)
            self.now_s = t
            if kind == _TICK:
                assert loop is not None
                loop.tick(t)
                self._push(t + loop.tick_s, _TICK)
            elif kind == _WAKE:
                if t >= self._wake_s:
                    self._wake_s = INF
                    self._pump_batch(t)
            elif kind == _HOUSE:
                self._housekeeping(t)
                if self.jobs is not None:
                    self.jobs.sample(t, ((q, j) for q, j, _ in self._batch_inflight.values()))
                self._push(t + 1.0, _HOUSE)
            elif kind == _SCRAPE:
                self._scrape_t.append(t)
                self._scraped.append(self.gauges(t))
                self._push(t + sc.scrape_interval_s, _SCRAPE)
            elif kind == _FAIL:
                self._fail(arg, t)
            elif kind == _RECOVER:
                self._recover(arg, t)
            elif kind == _JOB_ARRIVAL:
                assert self.jobs is not None
                self._batch_available += self.jobs.arrive(arg)
                self._pump_batch(t)
            elif kind == _BATCH_ARRIVAL:
                self._batch_available += 1
                self._pump_batch(t)
                self._push(
                    t + self._rng.exponential(1.0 / sc.batch.submit_rate_per_s), _BATCH_ARRIVAL
                )
        wall = time.perf_counter() - wall0
        return RunResult(
            scenario=sc,
            policy=self.policy.name,
            duration_s=duration,
            seed=self.seed,
            rate_scale=self.rate_scale,
            wall_s=wall,
            recorder=self.rec,
            busy_s=self.busy_s,
            batch=self._batch_figures(),
            interactive_preemptions=self.interactive_preemptions,
            budget_timeline=self.budget_timeline,
            jobs=None if self.jobs is None else self.jobs.report(
                duration,
                ((q, j) for q, j, _ in self._batch_inflight.values()),
                self.batch_gpu_s,
            ).to_json(),
            group_recorders=self.group_recs,
        )

    def _batch_figures(self) -> dict[str, float]:
        d = self.duration_s
        done = self.batch_done_prompt_tokens + self.batch_done_output_tokens
        computed = self.batch_computed_tokens
        return {
            "completed": self.batch_completed,
            "tokens_per_s": done / d,
            "prompt_tokens_per_s": self.batch_done_prompt_tokens / d,
            "output_tokens_per_s": self.batch_done_output_tokens / d,
            "computed_tokens_per_s": computed / d,
            "recomputed_tokens": self.batch_recomputed_tokens,
            "recomputed_tokens_frac": self.batch_recomputed_tokens / computed if computed else 0.0,
            "preemptions": self.batch_preemptions,
            "revocations": self.revocations,
        }


def _record_interactive(rec: metrics.Recorder, res: StepResult,
                        waiting_first: dict[str, Request]) -> None:
    """The interactive samples of one step (token gaps, first tokens, finishes) into `rec`,
    as `Simulation._apply` records them for the whole fleet (call before it does)."""
    with_batch = res.batch_tokens > 0
    if res.itl_steady:
        t = res.start_s
        for d in res.step_durations_s():
            t += d
            rec.itl_t.append(t if res.span_steps > 1 else res.end_s)
            rec.itl_s.append(d)
            rec.itl_w.append(res.itl_steady)
            rec.itl_batch.append(with_batch)
    for gap in res.itl_other_s:
        rec.itl_t.append(res.end_s)
        rec.itl_s.append(gap)
        rec.itl_w.append(1)
        rec.itl_batch.append(with_batch)
    for req in res.first_tokens:
        if req.klass == INTERACTIVE and req.request_id in waiting_first:
            rec.ttft_t.append(res.end_s)
            rec.ttft_s.append(res.end_s - req.submitted_s)
    for req in res.finished:
        if req.klass == INTERACTIVE:
            rec.outcome_t.append(res.end_s)
            rec.outcome_ok.append(True)


def _record_failure(rec: metrics.Recorder, now_s: float, ttft_s: float | None) -> None:
    """An interactive request failed at `now_s` (with its wait as TTFT when it timed out)."""
    if ttft_s is not None:
        rec.ttft_t.append(now_s)
        rec.ttft_s.append(ttft_s)
    rec.outcome_t.append(now_s)
    rec.outcome_ok.append(False)


def _resubmission(req: Request) -> Request:
    """A lost interactive request sent again: same client times, continuing its output."""
    new = Request(
        _next_attempt_id(req.request_id),
        req.klass,
        req.prompt_tokens + req.output_tokens,
        req.max_output_tokens - req.output_tokens,
        req.arrival_s,
        priority=req.priority,
        submitted_s=req.submitted_s,
    )
    new.first_token_s = req.first_token_s
    new.last_token_s = req.last_token_s
    new.recomputed_tokens = req.recomputed_tokens + req.computed_tokens
    return new


def _next_attempt_id(request_id: str) -> str:
    base, _, attempt = request_id.partition("#")
    return f"{base}#{int(attempt or 1) + 1}"
