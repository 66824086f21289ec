"""The supervisor: modes, hard limits and hysteresis above any control law.

    open     the law sets the budget; a burn that is confident but not severe (KV, the
             oldest wait and the success rate under their limits, no burn's lower bound
             `revoke_factor` past its cut, every slow window still within its SLO) first
             backs off: the budget falls at once to
             `ramp_start_frac` of the law's, and further burn readings are left to act on for
             one fast burn window (TCP's one multiplicative decrease per round trip); a burn
             right after that window closes. Back-offs change no mode
    ramp     a cold start (slow start): budget = `ramp_min_tokens_per_s`, then
                 ramp[k+1] = ramp[k] * 2 ** (dt / D) + slew * (ramp_doubling_s / D) * dt
             with D = `ramp_doubling_s`, or longer: the window a burn took to hold its
             least sample count, unless that output's p95 is known to be far under its SLO
             (`ramp_doubling_s`: one doubling per round trip of the sparsest signal)
             until the cap, or until the law, which starts each tick from the ramp applied
             last, asks for less than that (the first sign of congestion, as TCP leaves slow
             start on the first loss), or until a signal leaves its quiet band (the reopen
             thresholds: HyStart's rising delay); the law takes over then. A law at 0 holds the ramp
             where it is instead: a handover never publishes an open budget of nothing.
             After a cut the pool reopens straight into open at a share of the budget before
             the cut (`ramp_start_frac`, at least the ramp's least start), as TCP resumes at
             its slow-start threshold after a loss; the law climbs on from there. A cut
             within a burn window of a back-off is the same event: it reopens where the
             back-off put the budget, not at a share of it (one decrease per round trip). Under
             engine enforcement with `ramp_doubling_engine_s` set, the plugin's step guard
             holds ITL step by step, so the ramp doubles that often whatever the windows,
             holds at what batch uses (RFC 7661) and ends on the law's feedback alone
             (`RampInputs`), which use validation caps too. While no p95 is known near its
             SLO (`controller.burn.known_near`: enough slow-window samples, at least half
             of it) a law capped at that ceiling is read as the ceiling, and the ramp holds
             through ticks where what batch uses stalls (a cold start's carried rate is
             late); with a p95 known near, such a tick ends the ramp (README "Robustness
             matrix": holding on through them everywhere lifted the loose plugin rows and
             missed more windows on margin SLOs, where the step guard keeps the p95 ITL
             near its SLO);
             `ramp_hold_at_use` makes any pool's ramp hold there (off: under admission it
             ran past where the law handed over and overshot, README "Robustness matrix")
    closed   budget 0: entered at once when an SLO burns, KV usage passes its limit or the
             oldest interactive wait passes its limit (a multiple of the TTFT SLO) where
             the requests waiting past the TTFT SLO, counted as late first tokens, tip the
             TTFT burn past its cut, or passes `revoke_factor` times it (one straggler among
             many on-time first tokens is one sample); left only
             after every signal has stayed under its (lower) reopen threshold for `quiet_s`,
             into open after a cut, into ramp on a cold start
    stopped  budget 0 while the operator's stop switch is set; left into closed
    failsafe budget at the floor (0 by default) while any required signal is missing, NaN or
             stale; left into closed. A window without interactive traffic, or with too
             few samples for a p95 (`models.signals.sparse`), is not missing: nothing to
             protect is a safe reading, and the burn reads what few samples there are

Where the policy passes burn readings (`controller.burn`: sample counts, Wilson bounds, fast
and slow windows), a burn cuts as multiwindow burn-rate alerting pages: the fast window must
be past the cut with confidence (its lower bound over the SLO's edge) while the slow window
(the SLO's own 60 s) has spent `cut_slow_burn` of its budget, or the fast lower bound alone
must be severe (`revoke_factor` x the cut). One slow step among a handful of gaps cuts
nothing. A cut stops admission and lets in-flight batch drain; it also revokes (`revoke`)
only when KV is about to run out, or when the burn (or the interactive wait) is severe and
batch caused most of it (`revoke_batch_share` of the gaps above the SLO fell in steps carrying
batch tokens, or of the interactive queue wait passed in them).

`supervise` is pure: it takes the state and the time and returns the new state, the budget
and every transition as a `ModeEvent` with its reason, for the caller to log.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from borrowd.controller.burn import ALLOWED_SHARE, BurnReading, known_far, known_near
from borrowd.models.budget import Mode
from borrowd.models.config_loader import meta
from borrowd.models.errors import ConfigError
from borrowd.models.signals import Observation, Slo

REQUIRED_SIGNALS = (
    "ttft_p95_s",
    "itl_p95_s",
    "success_rate",
    "kv_usage_frac",
    "interactive_oldest_wait_s",
)


@dataclass(frozen=True)
class SupervisorConfig:
    """Cut and reopen thresholds (cut > reopen: hysteresis), quiet hold, ramp, staleness.

    The p95s compared here are the policy's smoothed short-window (a few seconds) p95s; the
    SLO itself is on 60 s windows, so a short excursion past it is not yet a burn. The ITL
    cut sits at 1.5x: the ITL of a fleet lending its steps to batch prefill jumps from a few
    ms to a full prefill step once batch holds most steps, and the law backs off from such
    a jump by itself; the supervisor acts when it does not. Where the observation carries an
    SLO burn (the policy's smoothed share above the SLO over the 5% a p95 allows), the burn
    replaces that output's p95 in the cut and reopen checks: it says how far past the edge
    a window is, where the short-window p95 only says that it is.
    """

    cut_ttft_norm: float = field(
        default=1.0, metadata={"unit": "p95 TTFT / SLO", "help": "cut at or above"}
    )
    reopen_ttft_norm: float = field(
        default=0.8, metadata={"unit": "p95 TTFT / SLO", "help": "quiet below"}
    )
    cut_itl_norm: float = field(
        default=1.5, metadata={"unit": "p95 ITL / SLO", "help": "cut at or above"}
    )
    reopen_itl_norm: float = field(
        default=0.9, metadata={"unit": "p95 ITL / SLO", "help": "quiet below"}
    )
    cut_ttft_burn: float = field(
        default=1.5,
        metadata={"unit": "share above SLO / 0.05", "help": "cut at or above (burn measured)"},
    )
    reopen_ttft_burn: float = field(
        default=0.8,
        metadata={"unit": "share above SLO / 0.05", "help": "quiet below (burn measured)"},
    )
    cut_itl_burn: float = field(
        default=1.5,
        metadata={"unit": "share above SLO / 0.05", "help": "cut at or above (burn measured)"},
    )
    reopen_itl_burn: float = field(
        default=0.8,
        metadata={"unit": "share above SLO / 0.05", "help": "quiet below (burn measured)"},
    )
    cut_kv_frac: float = field(
        default=0.97,
        metadata={"unit": "fraction of KV cache", "help": "cut at or above", "gt": 0.0, "max": 1.0},
    )
    reopen_kv_frac: float = field(
        default=0.90, metadata={"unit": "fraction of KV cache", "help": "quiet below"}
    )
    cut_oldest_wait_ttft_slo: float = field(
        default=2.0,
        metadata={"unit": "x p95 TTFT SLO", "help": "cut when the oldest interactive wait passes"},
    )
    reopen_oldest_wait_ttft_slo: float = field(
        default=0.5,
        metadata={"unit": "x p95 TTFT SLO", "help": "quiet when the oldest wait is below"},
    )
    cut_slow_burn: float = field(
        default=0.5,
        metadata={
            "unit": "share above SLO / 0.05",
            "help": "a fast burn cuts once the slow (SLO) window has burnt this much",
        },
    )
    revoke_batch_share: float = field(
        default=0.5,
        metadata={
            "unit": "1",
            "help": "a severe burn revokes batch when batch caused this share of it",
            "min": 0.0,
            "max": 1.0,
        },
    )
    quiet_s: float = field(
        default=5.0, metadata={"unit": "s", "help": "quiet this long before reopening"}
    )
    backoff: bool = field(
        default=True,
        metadata={"unit": "bool",
                  "help": "a burn that is not severe first halves the budget (ramp_start_frac) "
                          "for one burn window, and closes only if it burns on"},
    )
    revoke_factor: float = field(
        default=2.0,
        metadata={
            "unit": "x cut threshold",
            "help": "a burn this far over cuts at once, and revokes batch when batch caused it",
        },
    )
    ramp_start_frac: float = field(
        default=0.5,
        metadata={"unit": "1", "help": "ramp starts at this fraction of the pre-cut budget"},
    )
    ramp_min_tokens_per_s: float = field(
        default=2000.0,
        metadata={"unit": "tokens/s", "help": "least budget a ramp starts from (a cold start)"},
    )
    ramp_doubling_s: float = field(
        default=15.0,
        metadata={"unit": "s", "help": "the ramp doubles this often (multiplicative rise)"},
    )
    ramp_doubling_engine_s: float = field(
        default=3.0,
        metadata={"unit": "s",
                  "help": "under controller.enforcement = engine, the ramp doubles this often "
                          "whatever the burn windows, holds at what batch uses instead of "
                          "ending there, and ends on the law's feedback, not its forecast "
                          "(0: ramps as an admission pool does)"},
    )
    ramp_hold_at_use: bool = field(
        default=False,
        metadata={"unit": "bool",
                  "help": "a ramp that reaches what batch uses holds there and doubles on once "
                          "batch uses more, instead of handing over to the law (RFC 7661: an "
                          "application-limited sender stays in slow start); a guarded engine "
                          "pool's ramp always holds"},
    )
    ramp_slew_tokens_per_s2: float = field(
        default=500.0,
        metadata={"unit": "tokens/s per s", "help": "ramp rise rate added to the doubling"},
    )
    ramp_cap_tokens_per_s: float = field(
        default=60000.0,
        metadata=meta("tokens/s", "ramp ends (open) at this budget", per_pool=True),
    )
    max_age_s: float = field(
        default=15.0,
        metadata={"unit": "s",
                  "help": "older signals are stale (failsafe). The recorded series are as old "
                          "as Prometheus's last rule evaluation, up to its evaluation interval "
                          "plus the evaluation's own time, so this must be well above that "
                          "interval (the shipped 5 s: 15 s)"},
    )
    floor_tokens_per_s: float = field(
        default=0.0, metadata=meta("tokens/s", "budget in failsafe", per_pool=True)
    )
    required: tuple[str, ...] = field(
        default=REQUIRED_SIGNALS,
        metadata={"unit": "Observation fields", "help": "signals whose absence means failsafe"},
    )

    def __post_init__(self) -> None:
        pairs = (
            ("cut_ttft_norm", "reopen_ttft_norm"),
            ("cut_itl_norm", "reopen_itl_norm"),
            ("cut_ttft_burn", "reopen_ttft_burn"),
            ("cut_itl_burn", "reopen_itl_burn"),
            ("cut_kv_frac", "reopen_kv_frac"),
            ("cut_oldest_wait_ttft_slo", "reopen_oldest_wait_ttft_slo"),
        )
        for cut, reopen in pairs:
            if not 0 < getattr(self, reopen) < getattr(self, cut):
                raise ConfigError(
                    f"supervisor.{reopen} ({getattr(self, reopen)!r}) must be > 0 and below "
                    f"supervisor.{cut} ({getattr(self, cut)!r})"
                )
        if self.revoke_factor < 1.0 or not 0.0 <= self.ramp_start_frac <= 1.0:
            raise ConfigError(
                "supervisor needs revoke_factor >= 1 and ramp_start_frac in [0, 1], got "
                f"{self.revoke_factor!r}, {self.ramp_start_frac!r}"
            )
        for name in ("quiet_s", "floor_tokens_per_s", "cut_slow_burn", "ramp_slew_tokens_per_s2",
                     "ramp_doubling_engine_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"supervisor.{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("ramp_min_tokens_per_s", "ramp_doubling_s", "ramp_cap_tokens_per_s",
                     "max_age_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"supervisor.{name} must be > 0, got {getattr(self, name)!r}")
        known = set(Observation.__dataclass_fields__)
        unknown = [name for name in self.required if name not in known]
        if unknown:
            raise ConfigError(f"supervisor.required names unknown signals {unknown}")


@dataclass(frozen=True)
class RampInputs:
    """What the ramp reads beyond the burns: whether the engines hold every step under the
    ITL SLO (`controller.enforcement = engine`), and the feed-forward forecast's part of the
    law's proposal (tokens/s). With `ramp_doubling_engine_s` set, a guarded pool's ramp ends
    when the law's feedback asks for less than the ramp, not when the forecast moves: a
    forecast a few ticks old is mostly its own noise, and at a 2k tokens/s start it ended
    the ramp within a tick."""

    step_guarded: bool = False
    forecast_tokens_per_s: float = 0.0


@dataclass(frozen=True)
class ModeEvent:
    """One mode transition, with the time and the reason."""

    now_s: float
    from_mode: Mode
    to_mode: Mode
    reason: str


@dataclass(frozen=True)
class SupervisorState:
    """Mode, since when quiet (NaN: not quiet), the ramp ceiling (in closed: where the pool
    reopens), the last reason, whether in-flight batch work is revoked, whether the pool was
    cut (it reopens at the budget kept, open) rather than starting cold (ramp), until
    when the last back-off is left to act (NaN: none) and the budget it fell to."""

    mode: Mode = Mode.CLOSED
    quiet_since_s: float = math.nan
    ramp_tokens_per_s: float = 0.0
    reason: str = "start: waiting for a quiet interval"
    revoke: bool = True
    after_cut: bool = False
    backoff_until_s: float = math.nan
    backoff_tokens_per_s: float = 0.0


@dataclass(frozen=True)
class SupervisorDecision:
    """Budget after supervision, the mode and reason it carries, the next state, events."""

    u: float
    mode: Mode
    reason: str
    state: SupervisorState
    events: tuple[ModeEvent, ...]
    revoke: bool


Burns = tuple[BurnReading | None, BurnReading | None]  # (TTFT, ITL); None: not read
NO_BURNS: Burns = (None, None)


def missing_signals(
    obs: Observation, config: SupervisorConfig, burns: Burns = NO_BURNS
) -> list[str]:
    """Required signals that are NaN, and 'age' when the observation is stale.

    A per-request signal that is NaN because its window held no interactive sample, or too
    few for a p95 (`models.signals.sparse`: first tokens for TTFT, inter-token gaps for
    ITL; no request for the success rate) is not missing: no traffic is a safe reading.
    Nor is a p95 whose burn is read (its histogram's samples above the SLO, counted): the
    cut and reopen checks read the burn in its place. The p95's rules window ends a scrape
    earlier than the counts' window, so the first requests after a quiet spell leave the
    p95 empty while the burn already counts their samples.
    """
    covered = {
        "ttft_p95_s": obs.ttft_idle() or burns[0] is not None,
        "itl_p95_s": obs.itl_idle() or burns[1] is not None,
        "success_rate": obs.interactive_requests == 0 or obs.ttft_idle(),
    }
    missing = [
        name
        for name in config.required
        if not math.isfinite(getattr(obs, name)) and not covered.get(name, False)
    ]
    if not math.isfinite(obs.age_s) or obs.age_s > config.max_age_s:
        missing.append(f"age {obs.age_s:.1f}s > {config.max_age_s:.1f}s")
    return missing


def burning(
    obs: Observation, slo: Slo, config: SupervisorConfig, burns: Burns = NO_BURNS
) -> tuple[str, bool]:
    """Why batch must be cut now ('' when nothing burns), and whether to revoke too.

    NaN signals do not burn here (`missing_signals` handles them).
    """
    severe = config.revoke_factor
    if obs.kv_usage_frac >= config.cut_kv_frac:
        return f"cut: KV usage {obs.kv_usage_frac:.3g} >= {config.cut_kv_frac:.3g}", True
    wait_limit = config.cut_oldest_wait_ttft_slo * slo.ttft_p95_s
    wait_by_batch = _caused(obs.interactive_wait_batch_frac, config)
    if _wait_cuts(obs, wait_limit, config, burns[0]):
        revoke = obs.interactive_oldest_wait_s >= severe * wait_limit and wait_by_batch
        return f"cut: oldest wait {obs.interactive_oldest_wait_s:.3g}s >= {wait_limit:.3g}s", revoke
    for name, reading in zip(("TTFT", "ITL"), burns, strict=True):
        if reading is not None:
            reason, revoke = _burn_cut(name, reading, config, wait_by_batch)
            if reason:
                return reason, revoke
    ttft, itl = latency_checks(obs, slo, config, cut=True, burns=burns)
    for value, limit, label in (ttft, itl):
        if value >= limit:
            return f"cut: {label} {value:.3g} >= {limit:.3g}", False
    if obs.success_rate < slo.success_rate:
        return f"cut: success rate {obs.success_rate:.4f} < {slo.success_rate:.4f}", wait_by_batch
    return "", False


def _wait_cuts(
    obs: Observation, limit_s: float, config: SupervisorConfig, ttft: BurnReading | None
) -> bool:
    """True when the oldest interactive wait cuts: it is past `limit_s` and either severe
    (`revoke_factor` x the limit), or the TTFT burn, counting every request still waiting
    past the TTFT SLO (`interactive_late_waiters`, at least the oldest) as one more first
    token above it, reaches its cut: a stall or a queue does, and so does one waiter where
    few first tokens were read. Where no burn is read or the late waiters are not exported,
    the wait alone decides. One straggler among many first tokens on time (a long prompt in
    its own prefill) is one sample, not a queue."""
    wait_s = obs.interactive_oldest_wait_s
    if not wait_s >= limit_s:
        return False
    late = obs.interactive_late_waiters
    if ttft is None or math.isnan(late) or wait_s >= config.revoke_factor * limit_s:
        return True
    over = ttft.burn * ALLOWED_SHARE * ttft.samples + max(1.0, late)
    samples = ttft.samples + max(1.0, late)
    return over / samples / ALLOWED_SHARE >= config.cut_ttft_burn


def _caused(share: float, config: SupervisorConfig) -> bool:
    """True when batch caused at least `revoke_batch_share` (unknown share: assume it did)."""
    return not share < config.revoke_batch_share


def _burn_cut(
    name: str, reading: BurnReading, config: SupervisorConfig, wait_by_batch: bool
) -> tuple[str, bool]:
    """The multiwindow cut on one output's burn reading (module docstring)."""
    cut = config.cut_ttft_burn if name == "TTFT" else config.cut_itl_burn
    severe = config.revoke_factor * cut
    fast_confident = reading.burn >= cut and reading.lower >= 1.0
    slow_spent = reading.slow_burn >= config.cut_slow_burn
    if not ((fast_confident and slow_spent) or reading.lower >= severe):
        return "", False
    share = reading.batch_share
    by_batch = wait_by_batch if name == "TTFT" and math.isnan(share) else _caused(share, config)
    revoke = reading.lower >= severe and by_batch
    reason = (
        f"cut: {name} burn {reading.burn:.3g} (>= {reading.lower:.3g} over "
        f"{reading.samples:.0f} samples in {reading.window_s:.0f}s; {reading.slow_burn:.3g} over "
        f"60s) >= {cut:.3g}"
    )
    return reason, revoke


def latency_checks(
    obs: Observation, slo: Slo, config: SupervisorConfig, *, cut: bool, burns: Burns = NO_BURNS
) -> tuple[tuple[float, float, str], tuple[float, float, str]]:
    """(value, cut or reopen threshold, label) for TTFT and ITL: the burn reading's fast burn
    where read (NaN at a cut: `burning` judged it by both windows already), else the
    observation's burn where measured, else the p95 over its SLO."""
    out = []
    pairs = (
        ("TTFT", burns[0], obs.ttft_burn(), obs.ttft_norm(slo), config.cut_ttft_burn,
         config.reopen_ttft_burn, config.cut_ttft_norm, config.reopen_ttft_norm),
        ("ITL", burns[1], obs.itl_burn(), obs.itl_norm(slo), config.cut_itl_burn,
         config.reopen_itl_burn, config.cut_itl_norm, config.reopen_itl_norm),
    )
    for label, reading, burn, norm, cut_b, reopen_b, cut_n, reopen_n in pairs:
        if reading is not None:
            value = math.nan if cut else reading.burn
            out.append((value, cut_b if cut else reopen_b, f"{label} burn"))
        elif math.isfinite(burn):
            out.append((burn, cut_b if cut else reopen_b, f"{label} burn"))
        else:
            out.append((norm, cut_n if cut else reopen_n, f"p95 {label}/SLO"))
    return out[0], out[1]


def is_quiet(obs: Observation, slo: Slo, config: SupervisorConfig, burns: Burns = NO_BURNS) -> bool:
    """True when every signal is under its reopen threshold (the lower side of hysteresis).

    A per-request signal that is NaN (no interactive sample in the window) counts as quiet.
    """
    (ttft, ttft_limit, _), (itl, itl_limit, _) = latency_checks(
        obs, slo, config, cut=False, burns=burns
    )
    return (
        not ttft >= ttft_limit
        and not itl >= itl_limit
        and obs.kv_usage_frac < config.reopen_kv_frac
        and obs.interactive_oldest_wait_s < config.reopen_oldest_wait_ttft_slo * slo.ttft_p95_s
        and not obs.success_rate < slo.success_rate
    )


def supervise(
    config: SupervisorConfig,
    state: SupervisorState,
    obs: Observation,
    slo: Slo,
    u_law: float,
    dt_s: float,
    now_s: float,
    *,
    stopped: bool = False,
    burns: Burns = NO_BURNS,
    ceiling: float = math.inf,
    ramp: RampInputs = RampInputs(),
) -> SupervisorDecision:
    """One tick of supervision over the law's proposal `u_law` (see the module docstring);
    `burns` are the (TTFT, ITL) burn readings when the policy keeps them; `ceiling` bounds
    the ramp as it bounds the law (a budget that follows use); `ramp` says how the engines
    enforce and what share of `u_law` is the forecast's."""
    new_state, u = _next(config, state, obs, slo, u_law, dt_s, now_s, stopped, burns, ceiling,
                         ramp)
    events: tuple[ModeEvent, ...] = ()
    if new_state.mode != state.mode:
        events = (ModeEvent(now_s, state.mode, new_state.mode, new_state.reason),)
    return SupervisorDecision(
        u=u,
        mode=new_state.mode,
        reason=new_state.reason,
        state=new_state,
        events=events,
        revoke=new_state.revoke,
    )


def _next(
    config: SupervisorConfig,
    state: SupervisorState,
    obs: Observation,
    slo: Slo,
    u_law: float,
    dt_s: float,
    now_s: float,
    stopped: bool,
    burns: Burns,
    ceiling: float,
    ramp_in: RampInputs,
) -> tuple[SupervisorState, float]:
    closed_since_now = SupervisorState(Mode.CLOSED, math.nan, 0.0, "")
    if stopped:
        return SupervisorState(Mode.STOPPED, math.nan, 0.0, "stopped by operator"), 0.0
    # Where a ramp after a cut from open or ramp starts: a fraction of the budget before it;
    # within a back-off's event, where that back-off put it (one decrease per event, as TCP
    # per round trip), not a share of the law's budget the back-off already halved.
    restart = config.ramp_start_frac * (u_law if state.mode == Mode.OPEN else 0.0)
    if state.mode == Mode.OPEN and _in_backoff_event(state, now_s, burns):
        restart = max(restart, state.backoff_tokens_per_s)
    if state.mode == Mode.RAMP:
        restart = config.ramp_start_frac * state.ramp_tokens_per_s
    if state.mode == Mode.STOPPED:
        return _with_reason(closed_since_now, "resumed by operator: holding closed"), 0.0
    missing = missing_signals(obs, config, burns)
    if missing:
        reason = "failsafe: missing or stale " + ", ".join(missing)
        return SupervisorState(Mode.FAILSAFE, math.nan, 0.0, reason), config.floor_tokens_per_s
    if state.mode == Mode.FAILSAFE:
        return _with_reason(closed_since_now, "signals back: holding closed"), 0.0
    burn, revoke = burning(obs, slo, config, burns)
    if burn:
        if state.mode == Mode.CLOSED:
            revoke = revoke or state.revoke
            return replace(state, quiet_since_s=math.nan, revoke=revoke), 0.0
        if state.mode == Mode.OPEN and config.backoff and _soft(obs, slo, config, burns):
            if now_s < state.backoff_until_s:
                return state, max(0.0, u_law)
            if not _in_backoff_event(state, now_s, burns):
                until = now_s + _window_s(burns)
                reason = "back-off: " + burn.removeprefix("cut: ")
                return SupervisorState(Mode.OPEN, math.nan, 0.0, reason, False,
                                       backoff_until_s=until,
                                       backoff_tokens_per_s=restart), restart
        return SupervisorState(Mode.CLOSED, math.nan, restart, burn, revoke, after_cut=True), 0.0
    if state.mode == Mode.CLOSED:
        if not is_quiet(obs, slo, config, burns):
            return replace(state, quiet_since_s=math.nan), 0.0
        quiet_since = state.quiet_since_s if math.isfinite(state.quiet_since_s) else now_s
        if now_s - quiet_since < config.quiet_s:
            return replace(state, quiet_since_s=quiet_since), 0.0
        # Reopen at the ramp's start, not at the law's proposal: the law moved from the 0
        # applied while closed, and handing over to it would restart the climb from nothing.
        ramp = min(max(state.ramp_tokens_per_s, config.ramp_min_tokens_per_s),
                   config.ramp_cap_tokens_per_s)
        reason = f"reopen: quiet for {now_s - quiet_since:.0f}s"
        if state.after_cut:
            return SupervisorState(Mode.OPEN, math.nan, 0.0, reason + ", at the budget kept",
                                   False), ramp
        return SupervisorState(Mode.RAMP, math.nan, ramp, reason, False), ramp
    if state.mode == Mode.RAMP:
        if not is_quiet(obs, slo, config, burns):
            # A signal left its quiet band: the first sign of congestion ends the blind
            # doubling (as HyStart leaves slow start on a rising delay); the law goes on.
            reason = "ramp ends: a signal above its reopen threshold"
            return SupervisorState(Mode.OPEN, math.nan, 0.0, reason, False), _handover(
                u_law, state.ramp_tokens_per_s)
        guarded = ramp_in.step_guarded and config.ramp_doubling_engine_s > 0
        u_feedback = u_law - ramp_in.forecast_tokens_per_s if guarded else u_law
        return _ramp(config, state, u_law, dt_s, ceiling,
                     ramp_doubling_s(config, obs, slo, burns, guarded=guarded), u_feedback,
                     hold_at_ceiling=guarded or config.ramp_hold_at_use,
                     through_ceiling=guarded and not _any_known_near(obs, slo, burns))
    return replace(state, quiet_since_s=math.nan, revoke=False), max(0.0, u_law)


def _window_s(burns: Burns) -> float:
    """The longest fast burn window read (how long a back-off takes to show)."""
    return max((r.window_s for r in burns if r is not None), default=0.0)


def _in_backoff_event(state: SupervisorState, now_s: float, burns: Burns) -> bool:
    """True from the last back-off until one burn window after its hold ended: a burn then
    is the same congestion event (no second back-off; a cut reopens at the back-off's
    budget). False when there was none."""
    return now_s - state.backoff_until_s < _window_s(burns)


def _soft(obs: Observation, slo: Slo, config: SupervisorConfig, burns: Burns) -> bool:
    """True when only a burn that is not severe cuts: KV, the oldest wait and the success
    rate are under their limits, no burn's lower bound is `revoke_factor` past its cut, and
    no slow (SLO) window is past the SLO yet."""
    cuts = (config.cut_ttft_burn, config.cut_itl_burn)
    return (
        obs.kv_usage_frac < config.cut_kv_frac
        and not _wait_cuts(obs, config.cut_oldest_wait_ttft_slo * slo.ttft_p95_s, config,
                           burns[0])
        and not obs.success_rate < slo.success_rate
        and all(r is not None for r in burns)
        and all(r.lower < config.revoke_factor * cut and r.slow_burn < 1.0
                for r, cut in zip(burns, cuts, strict=True) if r is not None)
    )


def _any_known_near(obs: Observation, slo: Slo, burns: Burns) -> bool:
    """True when some output's p95 is known near its SLO (`controller.burn.known_near`)."""
    return any(r is not None and known_near(r.slow_samples, norm)
               for r, norm in zip(burns, (obs.ttft_norm(slo), obs.itl_norm(slo)), strict=True))


def _handover(u_law: float, ramp_tokens_per_s: float) -> float:
    """The budget when the ramp hands over: the law's, or the ramp's while the law has none."""
    return u_law if u_law > 0 else ramp_tokens_per_s


def ramp_doubling_s(config: SupervisorConfig, obs: Observation, slo: Slo, burns: Burns, *,
                    guarded: bool = False) -> float:
    """How often the ramp doubles: `ramp_doubling_s`, or the window a burn needed to hold
    its least sample count when that is longer and its output's p95 is not known to be
    under half its SLO. Slow start doubles once per round trip; a sparse signal near its SLO
    takes a whole window to confirm a level, and a ramp doubling faster than that outruns
    it (its slew slows by the same ratio). A `guarded` pool (engine enforcement with
    `ramp_doubling_engine_s` set: the step guard holds ITL step by step) doubles every
    `ramp_doubling_engine_s` whatever the windows."""
    if guarded:
        return config.ramp_doubling_engine_s
    doubling = config.ramp_doubling_s
    for reading, norm in zip(burns, (obs.ttft_norm(slo), obs.itl_norm(slo)), strict=True):
        if reading is None:
            continue
        if not known_far(reading.slow_samples, norm):
            doubling = max(doubling, reading.window_s)
    return doubling


def _ramp(
    config: SupervisorConfig, state: SupervisorState, u_law: float, dt_s: float, ceiling: float,
    doubling_s: float,
    u_feedback: float,
    *,
    hold_at_ceiling: bool = False,
    through_ceiling: bool = False,
) -> tuple[SupervisorState, float]:
    """One tick of the slow start (module docstring): `state.ramp_tokens_per_s` is the budget
    applied last tick, which the law's proposal `u_law` started from; the ramp ends when
    `u_feedback` (`u_law`, or `u_law` without its forecast term) is below it. Where
    `hold_at_ceiling`, a ramp that reaches what batch uses holds there (application-limited,
    as RFC 7661 keeps a sender's window) and doubles on once batch uses more; the law's
    proposal is capped by that same ceiling, so a tick where the ceiling does not rise past
    the ramp plus the forecast term reads as the law asking for less and ends the ramp,
    unless `through_ceiling` (a guarded pool, which always holds at the ceiling, with no p95
    known near its SLO): then a law at the ceiling is the ceiling's doing, and the ramp
    holds."""
    applied = state.ramp_tokens_per_s
    capped = through_ceiling and u_law >= ceiling
    if u_law > 0.0 and u_feedback < applied and not capped:
        return SupervisorState(Mode.OPEN, math.nan, 0.0, "law below the ramp", False), u_law
    if u_law <= 0.0:
        return replace(state, reason="ramp held: the law proposes nothing"), applied
    slew = config.ramp_slew_tokens_per_s2 * config.ramp_doubling_s / doubling_s
    ramp = applied * 2.0 ** (dt_s / doubling_s) + slew * dt_s
    if ramp >= ceiling and hold_at_ceiling:
        held = max(applied, ceiling)
        return replace(state, ramp_tokens_per_s=held, reason="ramp held at what batch uses"), held
    if ramp >= ceiling:
        reason = "ramp reached what batch uses"
        return SupervisorState(Mode.OPEN, math.nan, 0.0, reason, False), min(u_law, ceiling)
    if ramp >= config.ramp_cap_tokens_per_s:
        return SupervisorState(Mode.OPEN, math.nan, 0.0, "ramp reached its cap", False), _handover(
            u_law, applied)
    return replace(state, ramp_tokens_per_s=ramp), ramp


def _with_reason(state: SupervisorState, reason: str) -> SupervisorState:
    return replace(state, reason=reason)
