"""Prometheus as the daemon's `MetricsSource`: one PromQL query per observed signal.

The queries read the recording rules shipped in `deploy/prometheus/borrowd.rules.yml`
(per-class p95 TTFT and ITL from the proxy's histograms, success ratio, token rates, vLLM KV
usage, queue depth and preemptions; from the engines' interference series, the share of
interactive queue wait that fell in steps carrying batch tokens; the pool's KV capacity from
vLLM's `cache_config_info` labels). The SLO burn is read at the pool's own SLOs, from the raw
histograms (`BoundQuery`): one query per histogram returns, as series told apart by a `part`
label, the sample rate, the rate at or below the bucket bound `le` equal to the SLO, and how
many series exist with and without that bound; hence the share of ITL gaps (first tokens)
above the SLO with its sample count, and the share of the gaps above the ITL SLO that fell in
steps carrying batch tokens. Where some series lack the bound (an old proxy or engine, a
bucket not configured) the share is not read (NaN, counted as `missing_bound`): the pool then
controls on its p95s, and a missing batch share is taken as batch's. Every query is tried
once and bounded as a whole (connect, headers and body within its timeout, so a Prometheus
that answers one byte at a time cannot hold a tick); queries are evaluated at Prometheus's
own time, so the data's age is measured on Prometheus's clock, not the daemon's. A failed,
empty, NaN or impossible answer (a negative latency, a ratio above 1) leaves its field NaN
(the supervisor reads that as not safe) and is counted; a batch share that is NaN (no gap
above the SLO, no wait: nothing to attribute) is a reading, NaN without an error. Also here:
range queries over recorded series, for identification (`identification_history`: the
observations the loop would have read, the burn shares by the same bound queries).
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import math
import re
import socket
import ssl
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Protocol
from urllib.parse import unquote, urlencode, urlsplit

import numpy as np
import requests
from borrowd.models.errors import InputError
from borrowd.models.signals import Observation, Slo
from prometheus_api_client import PrometheusApiClientException
from prometheus_client.utils import floatToGoString

POOL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
WINDOW = re.compile(r"^[1-9][0-9]*(ms|s|m|h)$")

# Kinds of query failure, the `kind` label of the daemon's error counter.
TRANSPORT = "transport"  # connection refused, timeout, DNS: Prometheus unreachable
HTTP = "http"  # Prometheus answered with an error status (bad query, overload)
EMPTY = "empty"  # no series: a scrape target or a recording rule is missing
NOT_A_NUMBER = "nan"  # the series exists but holds NaN or is unparsable
IMPOSSIBLE = "impossible"  # a value no healthy fleet reports (negative latency, ratio > 1)
MISSING_BOUND = "missing_bound"  # samples exist, but no bucket bound at the pool's SLO

# Largest answer body read from Prometheus (a pool's instant queries answer a few kB).
MAX_ANSWER_BYTES = 16 * 1024 * 1024
# The values each observed field can take; anything else (and +-inf) reads as missing.
_FRACTIONS = ("success_rate", "kv_usage_frac", "itl_over_slo_frac", "ttft_over_slo_frac",
              "itl_over_slo_batch_frac", "interactive_wait_batch_frac")
# Largest KV cache a pool can report, in tokens; a larger sum is not a real fleet.
MAX_KV_CAPACITY_TOKENS = 10**12
_POSITIVE_INT = re.compile(r"^[1-9][0-9]{0,12}$")

# How an answer becomes a number (`PromQuery.parse`).
VALUE = "value"  # the largest sample of the series; NaN is a failure
SHARE = "share"  # as VALUE, but NaN in every series is a reading: nothing to share
KV_CAPACITY = "kv_capacity"  # one info series per engine, its KV size in labels, summed

# (pool, field, kind, detail) -> None; the daemon counts and logs these.
ErrorSink = Callable[[str, str, str, str], None]


@dataclass(frozen=True)
class PromQuery:
    """The instant PromQL expression that yields one `Observation` field of one pool, and how
    its answer is read (VALUE, SHARE or KV_CAPACITY)."""

    field: str
    expr: str
    parse: str = VALUE


def check_pool_name(pool: str) -> str:
    """`pool` if it is safe inside a PromQL label matcher and a Redis key, else InputError."""
    if not POOL_NAME.match(pool):
        raise InputError(f"pool name {pool!r} must match {POOL_NAME.pattern}")
    return pool


def check_window(window: str) -> str:
    """`window` if it is a Prometheus duration such as `15s` or `1m`, else InputError."""
    if not WINDOW.match(window):
        raise InputError(f"window {window!r} is not a Prometheus duration like 15s or 1m")
    return window


def pool_queries(pool: str, window: str) -> tuple[PromQuery, ...]:
    """The expressions behind each observed field of `pool` read from the `window` rules (the
    SLO burn fields come from `bound_queries`)."""
    check_pool_name(pool)
    check_window(window)
    inter = f'{{pool="{pool}",class="interactive"}}'
    batch = f'{{pool="{pool}",class="batch"}}'
    only_pool = f'{{pool="{pool}"}}'
    return (
        PromQuery("ttft_p95_s", f"pool_class:borrowd_proxy_ttft_seconds:p95_rate{window}{inter}"),
        PromQuery("itl_p95_s", f"pool_class:borrowd_proxy_itl_seconds:p95_rate{window}{inter}"),
        PromQuery(
            "success_rate", f"pool_class:borrowd_proxy_requests:success_ratio_rate{window}{inter}"
        ),
        PromQuery("kv_usage_frac", f"pool:vllm_kv_cache_usage_perc:max{only_pool}"),
        PromQuery("interactive_queue_depth", f"pool:vllm_num_requests_waiting:sum{only_pool}"),
        PromQuery(
            "interactive_oldest_wait_s", f"pool_class:borrowd_proxy_oldest_wait_seconds:max{inter}"
        ),
        PromQuery("preemptions_per_s", f"pool:vllm_num_preemptions:rate{window}{only_pool}"),
        PromQuery(
            "interactive_tokens_per_s", f"pool_class:borrowd_proxy_tokens:rate{window}{inter}"
        ),
        PromQuery("batch_tokens_per_s", f"pool_class:borrowd_proxy_tokens:rate{window}{batch}"),
        PromQuery("batch_running_seqs", f"pool_class:borrowd_proxy_inflight:sum{batch}"),
        PromQuery(
            "interactive_requests", f"pool_class:borrowd_proxy_requests:increase{window}{inter}"
        ),
        PromQuery(
            "interactive_wait_batch_frac",
            f"pool:borrowd_engine_interactive_wait_seconds:batch_share_rate{window}{only_pool}",
            SHARE,
        ),
        PromQuery("kv_capacity_tokens", f"pool_engine:vllm_cache_config_info:max{only_pool}",
                  KV_CAPACITY),
    )


PROXY_TTFT = "borrowd_proxy_ttft_seconds"
PROXY_ITL = "borrowd_proxy_itl_seconds"
ENGINE_ITL = "borrowd_engine_interactive_itl_seconds"
LATE_WAITERS = "borrowd_proxy_late_waiters"
# The parts of a `BoundQuery` answer, told apart by the `part` label.
COUNT = "count"  # samples per second
AT_BOUND = "at_bound"  # samples per second at or below the bound
SERIES = "series"  # how many histogram series have samples in the window
SERIES_AT_BOUND = "series_at_bound"  # how many of them have a bucket at the bound
BATCH_COUNT = "batch_count"  # as COUNT, in steps carrying batch tokens
BATCH_AT_BOUND = "batch_at_bound"  # as AT_BOUND, in steps carrying batch tokens
# A difference of rates this small relative to the rate is float rounding, not a sample.
_ROUNDING = 1e-9


@dataclass(frozen=True)
class BoundQuery:
    """One histogram read at a bound `bound_s` (the pool's SLO) by one instant query whose
    series carry a `part` label (COUNT, AT_BOUND, SERIES, SERIES_AT_BOUND; the batch share
    also BATCH_COUNT, BATCH_AT_BOUND). `field` gets the share above the bound, `samples_field`
    (when set) the samples in the window; `batch` reads the share of the samples above the
    bound that fell in steps carrying batch tokens instead."""

    field: str
    samples_field: str | None
    metric: str
    bound_s: float
    expr: str
    batch: bool = False


def le_spellings(bound_s: float) -> tuple[str, ...]:
    """The `le` label values that name `bound_s`: as prometheus_client writes it
    (`floatToGoString`: 1.0, 0.05, 0.0075) and, for a whole number, without the `.0` (Go's
    client: 1)."""
    text = floatToGoString(bound_s)
    short = text.removesuffix(".0")
    return (text,) if short == text else (text, short)


def le_matcher(bound_s: float, label: str = "le") -> str:
    """A PromQL label matcher selecting the bucket at `bound_s` (or the series whose `label`
    names it, spelt as `le` is), either spelling."""
    regex = "|".join(re.escape(text) for text in le_spellings(bound_s))
    return label + '=~"' + regex.replace("\\", "\\\\") + '"'


def _parts(parts: Sequence[tuple[str, str]]) -> str:
    """One expression whose series are those of each (name, expr), labelled part=name."""
    return " or ".join(f'label_replace({expr}, "part", "{name}", "", "")' for name, expr in parts)


def _histogram_parts(metric: str, selector: str, bound_s: float, window: str,
                     extra: Sequence[tuple[str, str]] = ()) -> list[tuple[str, str]]:
    at_bound = f"{selector},{le_matcher(bound_s)}"
    count = f"rate({metric}_count{{{selector}}}[{window}])"
    bucket = f"rate({metric}_bucket{{{at_bound}}}[{window}])"
    return [(COUNT, f"sum by (pool) ({count})"), (AT_BOUND, f"sum by (pool) ({bucket})"),
            (SERIES, f"count by (pool) ({count})"),
            (SERIES_AT_BOUND, f"count by (pool) ({bucket})"), *extra]


def over_slo_expr(metric: str, pool: str, window: str, bound_s: float) -> str:
    """The parts of `pool`'s interactive `metric` (a proxy histogram) at `bound_s`, over the
    replicas that may take batch, as the recording rules read them."""
    check_pool_name(pool)
    check_window(window)
    selector = f'pool="{pool}",class="interactive",batch_eligible!="false"'
    return _parts(_histogram_parts(metric, selector, bound_s, window))


def batch_share_expr(pool: str, window: str, bound_s: float) -> str:
    """The parts of `pool`'s engine interference histogram at `bound_s`, with the steps
    carrying batch tokens apart (BATCH_COUNT, BATCH_AT_BOUND)."""
    check_pool_name(pool)
    check_window(window)
    selector = f'pool="{pool}"'
    batch = f'{selector},batch_step="true"'
    count = f"rate({ENGINE_ITL}_count{{{batch}}}[{window}])"
    bucket = f"rate({ENGINE_ITL}_bucket{{{batch},{le_matcher(bound_s)}}}[{window}])"
    extra = [(BATCH_COUNT, f"sum by (pool) ({count})"),
             (BATCH_AT_BOUND, f"sum by (pool) ({bucket})")]
    return _parts(_histogram_parts(ENGINE_ITL, selector, bound_s, window, extra))


def bound_queries(pool: str, window: str, slo: Slo) -> tuple[BoundQuery, ...]:
    """The SLO burn of `pool` at its own SLOs: the shares of interactive ITL gaps and first
    tokens above the SLO with their sample counts, and batch's share of the gaps above it."""
    return (
        BoundQuery("itl_over_slo_frac", "itl_samples", PROXY_ITL, slo.itl_p95_s,
                   over_slo_expr(PROXY_ITL, pool, window, slo.itl_p95_s)),
        BoundQuery("ttft_over_slo_frac", "ttft_samples", PROXY_TTFT, slo.ttft_p95_s,
                   over_slo_expr(PROXY_TTFT, pool, window, slo.ttft_p95_s)),
        BoundQuery("itl_over_slo_batch_frac", None, ENGINE_ITL, slo.itl_p95_s,
                   batch_share_expr(pool, window, slo.itl_p95_s), batch=True),
    )


def late_waiters_query(pool: str, slo_ttft_s: float) -> str:
    """The interactive requests of `pool` waiting longer than its TTFT SLO for a first token,
    summed over the proxies (their `borrowd_proxy_late_waiters` at `slo` = the SLO), read
    raw at the tick as the burn is."""
    check_pool_name(pool)
    selector = f'pool="{pool}",class="interactive",{le_matcher(slo_ttft_s, "slo")}'
    return f"sum by (pool) ({LATE_WAITERS}{{{selector}}})"


def window_seconds(window: str) -> float:
    """A Prometheus duration such as `15s` or `1m` in seconds."""
    check_window(window)
    units = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
    unit = "ms" if window.endswith("ms") else window[-1]
    return float(window[: -len(unit)]) * units[unit]


def data_age_query(pool: str) -> str:
    """Seconds since the stalest of `pool`'s proxy and engine recorded series was evaluated.

    `timestamp()` reads sample times only when applied to a plain selector, hence one
    selector per source (proxy in-flight, engine KV usage), joined by `or`.
    """
    check_pool_name(pool)
    return (
        f'time() - min(timestamp(pool_class:borrowd_proxy_inflight:sum{{pool="{pool}"}}) '
        f'or timestamp(pool:vllm_kv_cache_usage_perc:max{{pool="{pool}"}}))'
    )


class PromClient(Protocol):
    """The two Prometheus HTTP API calls borrowd makes."""

    def custom_query(self, query: str, params: dict | None = None,
                     timeout: float | None = None) -> list: ...

    def custom_query_range(self, query: str, start_time: datetime, end_time: datetime,
                           step: str, params: dict | None = None,
                           timeout: float | None = None) -> list: ...


class BoundedPrometheus:
    """Prometheus's query API over `http.client`, each call bounded as a whole.

    A watchdog shuts the socket at the deadline, so headers or a body trickling in one byte
    at a time end the call after `timeout` seconds (`TimeoutError`) instead of holding it
    for as long as each single read keeps arriving. Tried once, no retries. A refused
    connection raises `ConnectionError`, an error status `PrometheusApiClientException`, a
    body that is not the API's JSON `ValueError`. Basic auth comes from the URL's userinfo.
    """

    def __init__(self, url: str, timeout_s: float) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InputError("Prometheus URL must be http(s)://host[:port][/prefix]")
        self.url = url
        self.timeout_s = timeout_s
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port or (443 if self._https else 80)
        self._prefix = parts.path.rstrip("/")
        self._headers = {"Accept": "application/json"}
        if parts.username is not None:
            pair = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
            token = base64.b64encode(pair.encode()).decode()
            self._headers["Authorization"] = f"Basic {token}"

    def custom_query(self, query: str, params: dict | None = None,
                     timeout: float | None = None) -> list:
        """The `result` of an instant query (at Prometheus's time unless params say)."""
        return self._get("/api/v1/query", {"query": query, **(params or {})}, timeout)

    def custom_query_range(self, query: str, start_time: datetime, end_time: datetime,
                           step: str, params: dict | None = None,
                           timeout: float | None = None) -> list:
        """The `result` of a range query."""
        args = {"query": query, "start": f"{start_time.timestamp():.3f}",
                "end": f"{end_time.timestamp():.3f}", "step": step, **(params or {})}
        return self._get("/api/v1/query_range", args, timeout)

    def _connection(self, timeout_s: float) -> http.client.HTTPConnection:
        if self._https:
            return http.client.HTTPSConnection(self._host, self._port, timeout=timeout_s,
                                               context=ssl.create_default_context())
        return http.client.HTTPConnection(self._host, self._port, timeout=timeout_s)

    def _get(self, path: str, params: dict, timeout: float | None) -> list:
        timeout_s = self.timeout_s if timeout is None else timeout
        started = time.monotonic()
        conn = self._connection(timeout_s)
        try:
            conn.connect()
        except OSError as exc:
            conn.close()
            if isinstance(exc, TimeoutError):
                raise TimeoutError(f"no connection within {timeout_s:g} s") from None
            raise ConnectionError(f"{type(exc).__name__}: {exc}") from None
        expired = threading.Event()

        def cut() -> None:
            expired.set()
            sock = conn.sock
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

        watchdog = threading.Timer(max(0.0, timeout_s - (time.monotonic() - started)), cut)
        watchdog.daemon = True
        watchdog.start()
        try:
            conn.request("GET", f"{self._prefix}{path}?{urlencode(params)}",
                         headers=self._headers)
            response = conn.getresponse()
            body = response.read(MAX_ANSWER_BYTES)
            status = response.status
        except (OSError, http.client.HTTPException) as exc:
            if expired.is_set():
                raise TimeoutError(f"no complete answer within {timeout_s:g} s") from None
            raise ConnectionError(f"{type(exc).__name__}: {exc}") from None
        finally:
            watchdog.cancel()
            conn.close()
        if expired.is_set():
            raise TimeoutError(f"no complete answer within {timeout_s:g} s")
        if status != 200:
            raise PrometheusApiClientException(
                f"HTTP Status Code {status} ({body[:200].decode(errors='replace')})"
            )
        answer = json.loads(body)
        if not isinstance(answer, dict) or answer.get("status") != "success":
            raise ValueError(f"not a successful API answer: {body[:200]!r}")
        return answer["data"]["result"]


def connect_prometheus(url: str, timeout_s: float) -> BoundedPrometheus:
    """A client for `url` that tries each query once and ends it after `timeout_s` in all."""
    return BoundedPrometheus(url, timeout_s)


class _QueryFailed(Exception):
    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind
        self.detail = detail


def parse_instant(result: Sequence[Mapping]) -> float:
    """The value of an instant-vector answer; the largest when several series match.

    Raises `_QueryFailed` (EMPTY or NOT_A_NUMBER) when there is nothing usable.
    """
    if not result:
        raise _QueryFailed(EMPTY, "no series")
    values = []
    for series in result:
        try:
            value = float(series["value"][1])
        except (KeyError, IndexError, TypeError, ValueError):
            raise _QueryFailed(NOT_A_NUMBER, f"unparsable sample {series!r}") from None
        if math.isnan(value):
            raise _QueryFailed(NOT_A_NUMBER, "sample is NaN")
        values.append(value)
    return max(values)


def parse_share(result: Sequence[Mapping]) -> float:
    """As `parse_instant`, except that NaN in every series reads as NaN, not as a failure
    (a share of nothing: no gap above the SLO, no wait in the window)."""
    if result and all(_sample_text(series).lower() == "nan" for series in result):
        return math.nan
    return parse_instant(result)


def _sample_text(series: Mapping) -> str:
    try:
        return str(series["value"][1])
    except (KeyError, IndexError, TypeError):
        return ""


def engine_kv_tokens(labels: Mapping[str, str]) -> int:
    """KV cache tokens of one engine from vLLM's `cache_config_info` labels:
    `kv_cache_size_tokens` where vLLM reports it (group-aware), else num_gpu_blocks x
    block_size. Raises `_QueryFailed` (IMPOSSIBLE) when neither is a positive integer."""
    size = _positive_int(labels.get("kv_cache_size_tokens"))
    if size is not None:
        return size
    blocks = _positive_int(labels.get("num_gpu_blocks"))
    block_size = _positive_int(labels.get("block_size"))
    if blocks is None or block_size is None:
        engine = f"{labels.get('instance', '?')} engine {labels.get('engine', '?')}"
        raise _QueryFailed(IMPOSSIBLE, f"{engine}: no positive num_gpu_blocks and block_size")
    return blocks * block_size


def _positive_int(text: object) -> int | None:
    return int(text) if isinstance(text, str) and _POSITIVE_INT.match(text) else None


def parse_kv_capacity(result: Sequence[Mapping]) -> float:
    """The pool's KV capacity in tokens: `engine_kv_tokens` summed over the engines (one per
    instance and engine index; the smaller where an engine reports two sizes)."""
    if not result:
        raise _QueryFailed(EMPTY, "no series")
    per_engine: dict[tuple[str, str], int] = {}
    for series in result:
        labels = series.get("metric")
        if not isinstance(labels, Mapping):
            raise _QueryFailed(NOT_A_NUMBER, f"series without labels {series!r}")
        key = (str(labels.get("instance", "")), str(labels.get("engine", "")))
        tokens = engine_kv_tokens(labels)
        per_engine[key] = min(tokens, per_engine.get(key, tokens))
    total = sum(per_engine.values())
    if total > MAX_KV_CAPACITY_TOKENS:
        raise _QueryFailed(IMPOSSIBLE, f"KV capacity {total} tokens > {MAX_KV_CAPACITY_TOKENS}")
    return float(total)


def parse_parts(result: Sequence[Mapping]) -> dict[str, float]:
    """The value of each `part` of a `BoundQuery` answer; `_QueryFailed` (NOT_A_NUMBER) when
    a series has no part or no number, or a part comes twice."""
    parts: dict[str, float] = {}
    for series in result:
        labels = series.get("metric")
        part = labels.get("part") if isinstance(labels, Mapping) else None
        try:
            value = float(series["value"][1])
        except (KeyError, IndexError, TypeError, ValueError):
            raise _QueryFailed(NOT_A_NUMBER, f"unparsable sample {series!r}") from None
        if not isinstance(part, str) or part in parts or math.isnan(value):
            raise _QueryFailed(NOT_A_NUMBER, f"not one number per part: {series!r}")
        parts[part] = value
    return parts


@dataclass(frozen=True)
class BoundReading:
    """A `BoundQuery` read: the share above the bound (NaN: not read, or nothing to share),
    the samples in the window (NaN when the query has none), and why the share is not read
    ('' when it is)."""

    share: float
    samples: float
    missing: str = ""


def read_bound(query: BoundQuery, parts: Mapping[str, float], window_s: float) -> BoundReading:
    """The share of `query`'s samples above its bound from the answer's `parts`.

    No COUNT part: no series at all (`_QueryFailed` EMPTY). Fewer series with the bound than
    series (an old proxy or engine, a bucket not configured): the share is NaN with the reason
    in `missing`, whatever the samples (a share read without some series would read a wrong
    line). A share of the samples above the bound: 0 without samples (nothing to protect); a
    batch share: NaN when no sample is above the bound (nothing to attribute).
    """
    if COUNT not in parts:
        raise _QueryFailed(EMPTY, f"no {query.metric} series")
    rate = parts[COUNT]
    samples = rate * window_s if query.samples_field else math.nan
    series = parts.get(SERIES, 0.0)
    with_bound = parts.get(SERIES_AT_BOUND, 0.0)
    if with_bound < series:
        spelled = " or ".join(le_spellings(query.bound_s))
        return BoundReading(math.nan, samples, (
            f"{query.metric}: {series - with_bound:.0f} of {series:.0f} series have no bucket "
            f"le={spelled} (the pool's SLO, {query.bound_s:g} s): its burn is not read, the "
            "pool controls on p95 until every proxy and engine has the bound (proxy "
            "slo_itl_s / slo_ttft_s, engine BORROWD_SLO_ITL_S or --slo-itl-s)"))
    above = _above(rate, parts.get(AT_BOUND, 0.0))
    if not query.batch:
        return BoundReading(above / rate if above > 0 else 0.0, samples)
    if BATCH_COUNT not in parts:
        raise _QueryFailed(EMPTY, f'no {query.metric} series with batch_step="true"')
    batch_above = _above(parts[BATCH_COUNT], parts.get(BATCH_AT_BOUND, 0.0))
    share = min(batch_above / above, 1.0) if above > 0 else math.nan
    return BoundReading(share, samples)


def _above(rate: float, at_bound: float) -> float:
    """Samples per second above the bound; 0 when the difference is float rounding.
    `_QueryFailed` (IMPOSSIBLE) when more samples are at or below the bound than in all."""
    above = rate - at_bound
    if above < -_ROUNDING * rate:
        raise _QueryFailed(IMPOSSIBLE, f"{at_bound!r} samples/s at or below the bound of "
                                       f"{rate!r} in all")
    return above if above > _ROUNDING * rate else 0.0


_PARSERS: dict[str, Callable[[Sequence[Mapping]], float]] = {
    VALUE: parse_instant, SHARE: parse_share, KV_CAPACITY: parse_kv_capacity,
}


def check_possible(field: str, value: float) -> float:
    """`value` if a healthy fleet can report it for `field` (finite; >= 0; a fraction at most
    1), else `_QueryFailed` (IMPOSSIBLE): the field then reads as missing, never as healthy."""
    upper = 1.0 if field in _FRACTIONS else math.inf
    if not (math.isfinite(value) and 0.0 <= value <= upper):
        raise _QueryFailed(IMPOSSIBLE, f"{field} cannot be {value!r}")
    return value


class PrometheusSource:
    """`MetricsSource` reading a pool's signals from Prometheus recording rules.

    `age_s` of an observation is the age of the stalest of the pool's recorded series as
    Prometheus reports it; when Prometheus cannot say (unreachable, or no series at all) it is
    the time since the freshest data it last reported (infinite before the first), so a
    supervisor that bounds staleness goes failsafe. A field whose own query fails is NaN.
    The SLO burn of a pool is read at its SLOs in `slos` (the default `Slo()`, 1 s / 50 ms,
    for a pool not named there).
    """

    def __init__(
        self,
        client: PromClient,
        *,
        window: str,
        timeout_s: float,
        on_error: ErrorSink | None = None,
        slos: Mapping[str, Slo] | None = None,
    ) -> None:
        self._client = client
        self._window = check_window(window)
        self._timeout_s = timeout_s
        self._on_error = on_error
        self._slos = dict(slos or {})
        self._last_success_s: dict[str, float] = {}

    def last_success_age_s(self, pool: str, now_s: float) -> float:
        """Age at `now_s` of the freshest data Prometheus last reported for `pool` (inf: never)."""
        last = self._last_success_s.get(pool)
        return math.inf if last is None else max(0.0, now_s - last)

    def slo(self, pool: str) -> Slo:
        """The SLOs `pool`'s burn is read at."""
        return self._slos.get(pool, Slo())

    def observe(self, pool: str, now_s: float) -> Observation:
        """Signals of `pool` evaluated at `now_s`; NaN (and a counted error) per failed query."""
        values: dict[str, float] = {}
        reachable = True
        for query in pool_queries(pool, self._window):
            try:
                value = _PARSERS[query.parse](self._query(query.expr))
                values[query.field] = value if math.isnan(value) else check_possible(
                    query.field, value)
            except _QueryFailed as exc:
                self._report(pool, query.field, exc)
                if exc.kind == TRANSPORT:
                    reachable = False
                    break  # Prometheus is unreachable: do not wait out every other timeout
        if reachable:
            reachable = self._observe_bounds(pool, values)
        age_s = self.last_success_age_s(pool, now_s)
        if reachable:
            try:
                age_s = max(0.0, parse_instant(self._query(data_age_query(pool))))
                self._last_success_s[pool] = now_s - age_s
            except _QueryFailed as exc:
                self._report(pool, "age_s", exc)
                age_s = self.last_success_age_s(pool, now_s)
        return Observation(now_s=now_s, age_s=age_s, window_s=window_seconds(self._window),
                           **values)

    def _observe_bounds(self, pool: str, values: dict[str, float]) -> bool:
        """Read `pool`'s SLO burn into `values`; False when Prometheus is unreachable."""
        window_s = window_seconds(self._window)
        for query in bound_queries(pool, self._window, self.slo(pool)):
            try:
                reading = read_bound(query, parse_parts(self._query(query.expr)), window_s)
                if query.samples_field is not None:
                    values[query.samples_field] = check_possible(query.samples_field,
                                                                 reading.samples)
                if reading.missing:
                    raise _QueryFailed(MISSING_BOUND, reading.missing)
                values[query.field] = reading.share if math.isnan(reading.share) else (
                    check_possible(query.field, reading.share))
            except _QueryFailed as exc:
                self._report(pool, query.field, exc)
                if exc.kind == TRANSPORT:
                    return False
        late = "interactive_late_waiters"
        try:
            values[late] = check_possible(late, parse_instant(self._query(
                late_waiters_query(pool, self.slo(pool).ttft_p95_s))))
        except _QueryFailed as exc:
            self._report(pool, late, exc)
            if exc.kind == TRANSPORT:
                return False
        return True

    def _query(self, expr: str) -> list[dict]:
        # No `time` parameter: Prometheus evaluates at its own now, so `time()` in the age
        # query and the samples it compares with are on one clock, whatever the daemon's says.
        try:
            return self._client.custom_query(expr, timeout=self._timeout_s)
        except (requests.RequestException, OSError) as exc:
            raise _QueryFailed(TRANSPORT, f"{type(exc).__name__}: {exc}") from None
        except PrometheusApiClientException as exc:
            raise _QueryFailed(HTTP, str(exc)[:300]) from None
        except ValueError as exc:  # a body that is not the API's JSON
            raise _QueryFailed(HTTP, f"bad response: {exc}") from None

    def _report(self, pool: str, field: str, exc: _QueryFailed) -> None:
        if self._on_error is not None:
            self._on_error(pool, field, exc.kind, exc.detail)


@dataclass(frozen=True)
class RangeSeries:
    """One series from a range query: sample times (unix seconds) and values."""

    times_s: np.ndarray
    values: np.ndarray


def query_range(
    client: PromClient,
    expr: str,
    *,
    start_s: float,
    end_s: float,
    step_s: float,
    timeout_s: float = 10.0,
) -> RangeSeries:
    """`expr` over [start_s, end_s] every `step_s`; several series are combined by max.

    Raises InputError naming the expression when Prometheus fails or returns no series.
    """
    result = _range_answer(client, expr, start_s=start_s, end_s=end_s, step_s=step_s,
                           timeout_s=timeout_s)
    by_time: dict[float, float] = {}
    for series in result:
        for stamp, text in series.get("values", []):
            value = float(text)
            if not math.isnan(value):
                by_time[float(stamp)] = max(value, by_time.get(float(stamp), -math.inf))
    times = np.array(sorted(by_time), dtype=float)
    return RangeSeries(times_s=times, values=np.array([by_time[t] for t in times], dtype=float))


def _range_answer(client: PromClient, expr: str, *, start_s: float, end_s: float,
                  step_s: float, timeout_s: float) -> list:
    """The series of a range query; InputError naming the expression when Prometheus fails
    or returns none."""
    if not (end_s > start_s and step_s > 0):
        raise InputError(
            f"range query needs end > start and step > 0, got {start_s}, {end_s}, {step_s}"
        )
    try:
        result = client.custom_query_range(
            expr,
            start_time=datetime.fromtimestamp(start_s, tz=UTC),
            end_time=datetime.fromtimestamp(end_s, tz=UTC),
            step=f"{step_s:g}s",
            timeout=timeout_s,
        )
    except (requests.RequestException, OSError, PrometheusApiClientException,
            ValueError) as exc:
        raise InputError(f"range query {expr!r} failed: {exc}") from None
    if not result:
        raise InputError(f"range query {expr!r} returned no series between {start_s} and {end_s}")
    return list(result)


def range_parts(client: PromClient, expr: str, *, start_s: float, end_s: float,
                step_s: float, timeout_s: float = 10.0) -> dict[float, dict[str, float]]:
    """A `BoundQuery` expression over a range: per sample time, the value of each `part`
    (NaN samples and series without a part left out)."""
    by_time: dict[float, dict[str, float]] = {}
    for series in _range_answer(client, expr, start_s=start_s, end_s=end_s, step_s=step_s,
                                timeout_s=timeout_s):
        labels = series.get("metric")
        part = labels.get("part") if isinstance(labels, Mapping) else None
        if not isinstance(part, str):
            continue
        for stamp, text in series.get("values", []):
            with contextlib.suppress(TypeError, ValueError):
                value = float(text)
                if math.isfinite(value):
                    by_time.setdefault(float(stamp), {})[part] = value
    return by_time


def identification_queries(pool: str, window: str) -> dict[str, str]:
    """Range expressions for identifying `pool`'s plant from recorded history.

    `budget_tokens_per_s` is the budget the leading daemon published (its own /metrics);
    the outputs are the interactive p95s and the offered interactive token rate.
    """
    check_pool_name(pool)
    fields = {query.field: query.expr for query in pool_queries(pool, window)}
    return {
        "budget_tokens_per_s": (
            f'max(borrowd_budget_tokens_per_s{{pool="{pool}"}} '
            f'and on (instance) (borrowd_leader{{pool="{pool}"}} == 1))'
        ),
        "ttft_p95_s": fields["ttft_p95_s"],
        "itl_p95_s": fields["itl_p95_s"],
        "interactive_tokens_per_s": fields["interactive_tokens_per_s"],
    }


def identification_series(
    client: PromClient,
    pool: str,
    *,
    start_s: float,
    end_s: float,
    step_s: float,
    window: str = "15s",
) -> dict[str, np.ndarray]:
    """Aligned arrays (`times_s` plus each identification signal) at the common sample times.

    Raises InputError when a signal is missing or the series share no sample time.
    """
    series = {
        name: query_range(client, expr, start_s=start_s, end_s=end_s, step_s=step_s)
        for name, expr in identification_queries(pool, window).items()
    }
    common = None
    for item in series.values():
        stamps = set(item.times_s.tolist())
        common = stamps if common is None else common & stamps
    times = np.array(sorted(common or ()), dtype=float)
    if times.size == 0:
        raise InputError(f"pool {pool!r}: the identification series share no sample time")
    aligned = {"times_s": times}
    for name, item in series.items():
        index = {t: i for i, t in enumerate(item.times_s.tolist())}
        aligned[name] = np.array([item.values[index[t]] for t in times], dtype=float)
    return aligned


@dataclass(frozen=True)
class History:
    """A pool's recorded history at the sample times its series share: the budget the leader
    published and, at each time, the `Observation` the loop would have read (p95s, the
    interactive token rate and, when read, the SLO burn shares at the pool's own SLOs with
    their sample counts and batch's share)."""

    times_s: np.ndarray
    budget_tokens_per_s: np.ndarray
    observations: tuple[Observation, ...]


def identification_history(
    client: PromClient,
    pool: str,
    slo: Slo,
    *,
    start_s: float,
    end_s: float,
    step_s: float,
    window: str,
    burn: bool,
) -> History:
    """`pool`'s history over [start_s, end_s] as the loop reads it, for identification on
    the signal the law tracks. With `burn`, the SLO burn shares are read at `slo` by the
    daemon's own `bound_queries` and `read_bound`, over a range.

    Raises InputError when a signal is missing, and (with `burn`) when no interactive share
    above an SLO could be read anywhere in the range (every series lacks the SLO's bucket:
    the reason names the metric and the flag that adds it)."""
    series = identification_series(client, pool, start_s=start_s, end_s=end_s, step_s=step_s,
                                   window=window)
    times = series["times_s"]
    window_s = window_seconds(window)
    values: list[dict[str, float]] = [
        {"ttft_p95_s": float(series["ttft_p95_s"][i]),
         "itl_p95_s": float(series["itl_p95_s"][i]),
         "interactive_tokens_per_s": float(series["interactive_tokens_per_s"][i])}
        for i in range(times.size)
    ]
    if burn:
        for query in bound_queries(pool, window, slo):
            _read_bound_history(client, query, times, values, window_s,
                                start_s=start_s, end_s=end_s, step_s=step_s)
    observations = tuple(Observation(now_s=float(t), age_s=0.0, window_s=window_s, **v)
                         for t, v in zip(times, values, strict=True))
    return History(times, series["budget_tokens_per_s"], observations)


def _read_bound_history(client: PromClient, query: BoundQuery, times: np.ndarray,
                        values: list[dict[str, float]], window_s: float, *, start_s: float,
                        end_s: float, step_s: float) -> None:
    """Fill `query`'s share (and sample count) into `values` at each of `times`; a time whose
    parts are missing or unreadable keeps NaN. InputError when an interactive share is read
    nowhere; batch's share is optional (NaN: not attributed)."""
    try:
        by_time = range_parts(client, query.expr, start_s=start_s, end_s=end_s, step_s=step_s)
    except InputError:
        if query.batch:
            return
        raise
    missing = ""
    read = 0
    for t, row in zip(times.tolist(), values, strict=True):
        try:
            reading = read_bound(query, by_time.get(t, {}), window_s)
        except _QueryFailed:
            continue
        if reading.missing:
            missing = missing or reading.missing
            continue
        row[query.field] = reading.share
        if query.samples_field is not None:
            row[query.samples_field] = reading.samples
        read += 1
    if read == 0 and not query.batch:
        raise InputError(missing or f"{query.metric}: no share above {query.bound_s:g} s could "
                                    "be read in the range")
