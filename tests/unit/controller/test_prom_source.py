"""PrometheusSource: queries per field, NaN and a counted error per failure, staleness age."""

from __future__ import annotations

import math
import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import requests
from borrowd.controller.prom_source import (
    AT_BOUND,
    BATCH_AT_BOUND,
    BATCH_COUNT,
    COUNT,
    EMPTY,
    HTTP,
    IMPOSSIBLE,
    KV_CAPACITY,
    MISSING_BOUND,
    NOT_A_NUMBER,
    SERIES,
    SERIES_AT_BOUND,
    TRANSPORT,
    PrometheusSource,
    bound_queries,
    connect_prometheus,
    identification_history,
    identification_queries,
    identification_series,
    late_waiters_query,
    pool_queries,
    query_range,
    window_seconds,
)
from borrowd.models.errors import InputError
from borrowd.models.signals import Observation, Slo
from prometheus_api_client import PrometheusApiClientException
from prometheus_client import CollectorRegistry

from tests.support.servers import free_port

FIELD_VALUES = {
    "ttft_p95_s": 0.4,
    "itl_p95_s": 0.03,
    "success_rate": 1.0,
    "kv_usage_frac": 0.55,
    "interactive_queue_depth": 2.0,
    "interactive_oldest_wait_s": 0.2,
    "preemptions_per_s": 0.0,
    "interactive_tokens_per_s": 900.0,
    "batch_tokens_per_s": 3000.0,
    "batch_running_seqs": 4.0,
    "interactive_requests": 40.0,
    "itl_over_slo_frac": 0.02,
    "ttft_over_slo_frac": 0.0,
    "itl_samples": 1200.0,
    "ttft_samples": 40.0,
    "itl_over_slo_batch_frac": 0.6,
    "interactive_wait_batch_frac": 0.3,
    "kv_capacity_tokens": 48000.0,
    "interactive_late_waiters": 3.0,
}


def queried_missing(obs: Observation) -> list[str]:
    """The missing fields among those this source queries (other sources fill the rest)."""
    return [name for name in obs.missing() if name in FIELD_VALUES]


def instant(value: str) -> list[dict]:
    """An instant-vector answer with one series."""
    return [{"metric": {"pool": "chat"}, "value": [1700000000.0, value]}]


class FakeClient:
    """Answers instant queries from a table keyed by expression; records what it was asked."""

    def __init__(self, answers: dict[str, object], default: object = None) -> None:
        self.answers = answers
        self.default = default
        self.asked: list[tuple[str, dict, float | None]] = []

    def custom_query(self, query: str, params: dict | None = None, timeout: float | None = None):
        self.asked.append((query, params or {}, timeout))
        answer = self.answers.get(query, self.default)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def custom_query_range(self, query, start_time, end_time, step, params=None, timeout=None):
        answer = self.answers[query]
        if isinstance(answer, Exception):
            raise answer
        return answer


def cache_info(*engines: dict[str, str]) -> list[dict]:
    """A `cache_config_info` answer: one series per engine, its labels as given."""
    return [{"metric": {"pool": "chat", "engine": "0", **labels},
             "value": [1700000000.0, "1"]} for labels in engines]


DEFAULT_SLO = Slo()  # 1 s / 50 ms


def parts(**values: float) -> list[dict]:
    """A `BoundQuery` answer: one series per part (COUNT, AT_BOUND, ...) with its value."""
    return [{"metric": {"pool": "chat", "part": name}, "value": [1700000000.0, repr(value)]}
            for name, value in values.items()]


def histogram(rate: float, at_bound: float, series: int = 1, with_bound: int | None = None,
              **batch: float) -> list[dict]:
    """The parts of a histogram read at a bound: `rate` samples/s, `at_bound` of them at or
    below it, `series` series of which `with_bound` (all by default) have the bound."""
    with_bound = series if with_bound is None else with_bound
    values = {COUNT: rate, SERIES: float(series), **batch}
    if with_bound:
        values.update({AT_BOUND: at_bound, SERIES_AT_BOUND: float(with_bound)})
    return parts(**values)


def bound_expr(field: str, pool: str = "chat", window: str = "15s", slo: Slo = DEFAULT_SLO) -> str:
    """The expression of the `BoundQuery` filling `field`."""
    return next(q.expr for q in bound_queries(pool, window, slo) if q.field == field)


def healthy_answers(pool: str = "chat", window: str = "15s", slo: Slo = DEFAULT_SLO
                    ) -> dict[str, object]:
    """Every query of `pool` answered with FIELD_VALUES (the KV capacity as two engines of
    16000 and 32000 tokens; the shares above the SLO from histograms counting them); data
    0.5 s old."""
    answers: dict[str, object] = {
        q.expr: instant(repr(FIELD_VALUES[q.field])) for q in pool_queries(pool, window)
    }
    capacity = next(q.expr for q in pool_queries(pool, window) if q.parse == KV_CAPACITY)
    answers[capacity] = cache_info(
        {"instance": "a:8000", "block_size": "16", "num_gpu_blocks": "1000"},
        {"instance": "b:8000", "block_size": "16", "num_gpu_blocks": "1000",
         "kv_cache_size_tokens": "32000"},
    )
    window_s = window_seconds(window)
    for share, samples in (("itl_over_slo_frac", "itl_samples"),
                           ("ttft_over_slo_frac", "ttft_samples")):
        rate = FIELD_VALUES[samples] / window_s
        answers[bound_expr(share, pool, window, slo)] = histogram(
            rate, rate * (1 - FIELD_VALUES[share]), series=2)
    batch_above = 10.0 * FIELD_VALUES["itl_over_slo_batch_frac"]
    answers[bound_expr("itl_over_slo_batch_frac", pool, window, slo)] = histogram(
        100.0, 90.0, series=4, **{BATCH_COUNT: 50.0, BATCH_AT_BOUND: 50.0 - batch_above})
    answers[late_waiters_query(pool, slo.ttft_p95_s)] = instant(
        repr(FIELD_VALUES["interactive_late_waiters"]))
    return answers


def age_default() -> list[dict]:
    """Answer of the data-age query."""
    return instant("0.5")


def make_source(client: FakeClient, errors: list) -> PrometheusSource:
    """A source over `client` that appends each reported error to `errors`."""
    return PrometheusSource(
        client, window="15s", timeout_s=0.25, on_error=lambda *e: errors.append(e)
    )


def test_every_field_is_read_from_its_query() -> None:
    """A healthy Prometheus fills every observed field and reports the data's age."""
    client = FakeClient(healthy_answers(), default=age_default())
    errors: list = []
    obs = make_source(client, errors).observe("chat", 1000.0)
    assert errors == []
    for name, value in FIELD_VALUES.items():
        assert getattr(obs, name) == pytest.approx(value), name
    assert obs.age_s == pytest.approx(0.5)
    assert queried_missing(obs) == []


@pytest.mark.parametrize(("window", "seconds"), [("15s", 15.0), ("1m", 60.0), ("500ms", 0.5)],
                         ids=["15s", "1m", "500ms"])
def test_observation_carries_its_window(window: str, seconds: float) -> None:
    """Sample counts come with the window they were counted over, in seconds."""
    assert window_seconds(window) == seconds
    client = FakeClient(healthy_answers(), default=age_default())
    source = PrometheusSource(client, window="15s", timeout_s=1.0)
    assert source.observe("chat", 1000.0).window_s == 15.0


def test_queries_are_evaluated_at_prometheus_time_with_the_short_timeout() -> None:
    """Each query is sent once, with the configured timeout and no `time` of the daemon's:
    Prometheus evaluates at its own now, so staleness is measured on its clock."""
    client = FakeClient(healthy_answers(), default=age_default())
    make_source(client, []).observe("chat", 1234.5)
    assert len(client.asked) == len(pool_queries("chat", "15s")) + 3 + 1 + 1
    assert all("time" not in params for _, params, _ in client.asked)
    assert {timeout for _, _, timeout in client.asked} == {0.25}


@pytest.mark.parametrize(
    ("field", "value"),
    [("ttft_p95_s", "-0.5"), ("itl_p95_s", "-1e-3"), ("kv_usage_frac", "-0.1"),
     ("kv_usage_frac", "1.5"), ("success_rate", "7"), ("interactive_queue_depth", "-3"),
     ("ttft_p95_s", "+Inf"), ("batch_tokens_per_s", "-Inf")],
    ids=["negative-ttft", "negative-itl", "negative-kv", "kv-above-1", "success-7",
         "negative-queue", "inf-ttft", "minus-inf-rate"],
)
def test_impossible_values_read_as_missing(field: str, value: str) -> None:
    """A value no healthy fleet reports is not healthy: its field is NaN and it is counted."""
    answers = healthy_answers()
    answers[next(q.expr for q in pool_queries("chat", "15s") if q.field == field)] = (
        instant(value))
    errors: list = []
    obs = make_source(FakeClient(answers, default=age_default()), errors).observe("chat", 1.0)
    assert queried_missing(obs) == [field]
    assert [(f, kind) for _, f, kind, _ in errors] == [(field, IMPOSSIBLE)]


def _answers_with(field: str, answer: object) -> dict[str, object]:
    answers = healthy_answers()
    answers[next(q.expr for q in pool_queries("chat", "15s") if q.field == field)] = answer
    return answers


def test_a_nan_wait_share_is_a_reading_and_an_absent_one_is_missing() -> None:
    """NaN (no wait: nothing to attribute) reads as NaN without an error; no series (no
    engine exports the interference series) is missing and counted."""
    field = "interactive_wait_batch_frac"
    errors: list = []
    client = FakeClient(_answers_with(field, instant("NaN")), default=age_default())
    obs = make_source(client, errors).observe("chat", 1.0)
    assert math.isnan(getattr(obs, field)) and errors == []
    client = FakeClient(_answers_with(field, []), default=age_default())
    obs = make_source(client, errors).observe("chat", 1.0)
    assert queried_missing(obs) == [field]
    assert [(f, kind) for _, f, kind, _ in errors] == [(field, EMPTY)]


def _observe_bound(field: str, answer: object, slo: Slo = DEFAULT_SLO) -> tuple[Observation, list]:
    answers = healthy_answers(slo=slo)
    answers[bound_expr(field, slo=slo)] = answer
    errors: list = []
    source = PrometheusSource(FakeClient(answers, default=age_default()), window="15s",
                              timeout_s=0.25, on_error=lambda *e: errors.append(e),
                              slos={"chat": slo})
    return source.observe("chat", 1.0), errors


@pytest.mark.parametrize(
    ("answer", "share"),
    [(histogram(100.0, 90.0, **{BATCH_COUNT: 40.0, BATCH_AT_BOUND: 32.5}), 0.75),
     (histogram(100.0, 100.0, **{BATCH_COUNT: 40.0, BATCH_AT_BOUND: 40.0}), math.nan),
     (histogram(0.0, 0.0, **{BATCH_COUNT: 0.0, BATCH_AT_BOUND: 0.0}), math.nan)],
    ids=["three-quarters", "none-above", "no-gap"],
)
def test_batch_share_is_batch_steps_share_of_the_gaps_above_the_slo(answer: list,
                                                                     share: float) -> None:
    """Batch's share is (batch gaps above the bound) / (all gaps above it); NaN, without an
    error, when no gap is above (nothing to attribute)."""
    obs, errors = _observe_bound("itl_over_slo_batch_frac", answer)
    assert obs.itl_over_slo_batch_frac == pytest.approx(share, nan_ok=True)
    assert errors == []


@pytest.mark.parametrize(
    ("answer", "kind"),
    [([], EMPTY), (histogram(100.0, 90.0), EMPTY),
     (histogram(100.0, 90.0, series=2, with_bound=1,
                **{BATCH_COUNT: 40.0, BATCH_AT_BOUND: 35.0}), MISSING_BOUND)],
    ids=["no-engine", "no-batch-step-series", "bound-missing-on-one-engine"],
)
def test_an_unread_batch_share_is_missing_and_counted(answer: list, kind: str) -> None:
    """No engine series, or an engine without the bound: the batch share is NaN (the
    supervisor then takes a severe burn as batch's: batch fails closed) and counted."""
    obs, errors = _observe_bound("itl_over_slo_batch_frac", answer)
    assert math.isnan(obs.itl_over_slo_batch_frac)
    assert [(f, k) for _, f, k, _ in errors] == [("itl_over_slo_batch_frac", kind)]


@pytest.mark.parametrize(
    ("engines", "tokens"),
    [
        ([{"block_size": "16", "num_gpu_blocks": "24750"}], 396000.0),
        ([{"block_size": "16", "num_gpu_blocks": "100", "kv_cache_size_tokens": "1000"}], 1000.0),
        ([{"block_size": "16", "num_gpu_blocks": "100", "kv_cache_size_tokens": "None"}], 1600.0),
        ([{"instance": "a", "block_size": "16", "num_gpu_blocks": "100"},
          {"instance": "a", "engine": "1", "block_size": "32", "num_gpu_blocks": "100"}], 4800.0),
        ([{"instance": "a", "block_size": "16", "num_gpu_blocks": "100"},
          {"instance": "a", "block_size": "16", "num_gpu_blocks": "50"}], 800.0),
    ],
    ids=["blocks-x-size", "size-label-first", "size-label-none", "two-engines",
         "one-engine-two-sizes"],
)
def test_kv_capacity_sums_the_engines_info_labels(engines: list, tokens: float) -> None:
    """The pool's KV capacity is each engine's kv_cache_size_tokens (else blocks x block
    size), summed over engines; an engine reporting two sizes counts the smaller."""
    errors: list = []
    client = FakeClient(_answers_with("kv_capacity_tokens", cache_info(*engines)),
                        default=age_default())
    obs = make_source(client, errors).observe("chat", 1.0)
    assert obs.kv_capacity_tokens == tokens and errors == []


@pytest.mark.parametrize(
    "labels",
    [{"block_size": "16"}, {"block_size": "0", "num_gpu_blocks": "100"},
     {"block_size": "16", "num_gpu_blocks": "-5"}, {"block_size": "16", "num_gpu_blocks": "1e3"},
     {"block_size": "16", "num_gpu_blocks": "9" * 13}],
    ids=["no-blocks", "zero-block-size", "negative", "not-an-integer", "absurdly-large"],
)
def test_kv_capacity_from_bad_labels_reads_as_missing(labels: dict[str, str]) -> None:
    """Labels that do not size a real cache leave the capacity NaN, counted as impossible."""
    errors: list = []
    client = FakeClient(_answers_with("kv_capacity_tokens", cache_info(labels)),
                        default=age_default())
    obs = make_source(client, errors).observe("chat", 1.0)
    assert math.isnan(obs.kv_capacity_tokens)
    assert [(f, kind) for _, f, kind, _ in errors] == [("kv_capacity_tokens", IMPOSSIBLE)]


@pytest.mark.parametrize(
    ("answer", "kind"),
    [
        (PrometheusApiClientException("HTTP Status Code 400"), HTTP),
        ([], EMPTY),
        (instant("NaN"), NOT_A_NUMBER),
        ([{"metric": {}, "value": [1.0]}], NOT_A_NUMBER),
    ],
    ids=["http-error", "empty", "nan", "malformed"],
)
def test_a_failed_query_leaves_only_its_field_nan(answer: object, kind: str) -> None:
    """One failing query: its field is NaN, its error is counted, the rest is still read."""
    answers = healthy_answers()
    failing = next(q for q in pool_queries("chat", "15s") if q.field == "kv_usage_frac")
    answers[failing.expr] = answer
    errors: list = []
    obs = make_source(FakeClient(answers, default=age_default()), errors).observe("chat", 10.0)
    assert queried_missing(obs) == ["kv_usage_frac"]
    assert [(pool, field, k) for pool, field, k, _ in errors] == [("chat", "kv_usage_frac", kind)]
    assert obs.ttft_p95_s == pytest.approx(FIELD_VALUES["ttft_p95_s"])


def test_a_missing_optional_series_does_not_make_the_data_stale() -> None:
    """No batch series yet: that field is NaN, the age still comes from Prometheus."""
    answers = healthy_answers()
    batch = next(q for q in pool_queries("chat", "15s") if q.field == "batch_tokens_per_s")
    answers[batch.expr] = []
    obs = make_source(FakeClient(answers, default=age_default()), []).observe("chat", 10.0)
    assert queried_missing(obs) == ["batch_tokens_per_s"]
    assert obs.age_s == pytest.approx(0.5)


def test_unreachable_prometheus_stops_after_the_first_timeout() -> None:
    """A transport failure ends the tick's queries: one error, every field NaN, age grows."""
    client = FakeClient({}, default=requests.ConnectionError("refused"))
    errors: list = []
    source = make_source(client, errors)
    obs = source.observe("chat", 50.0)
    assert len(client.asked) == 1
    assert [e[2] for e in errors] == [TRANSPORT]
    assert len(queried_missing(obs)) == len(FIELD_VALUES)
    assert math.isinf(obs.age_s)


def test_age_is_time_since_the_freshest_data_after_a_failure() -> None:
    """Data 0.5 s old at t=100, Prometheus gone at t=107: the observation is 7.5 s old."""
    answers = healthy_answers()
    client = FakeClient(answers, default=age_default())
    source = make_source(client, [])
    source.observe("chat", 100.0)
    client.answers = {}
    client.default = requests.Timeout("slow")
    obs = source.observe("chat", 107.0)
    assert obs.age_s == pytest.approx(7.5)
    assert source.last_success_age_s("chat", 107.0) == pytest.approx(7.5)
    assert math.isinf(source.last_success_age_s("other", 107.0))


def test_several_series_read_the_largest() -> None:
    """Two answering series (e.g. two rule evaluators) read conservatively: the max."""
    answers = healthy_answers()
    ttft = next(q for q in pool_queries("chat", "15s") if q.field == "ttft_p95_s")
    answers[ttft.expr] = instant("0.2") + instant("0.9")
    obs = make_source(FakeClient(answers, default=age_default()), []).observe("chat", 1.0)
    assert obs.ttft_p95_s == pytest.approx(0.9)


@pytest.mark.parametrize(
    ("pool", "window"),
    [("chat pool", "15s"), ('x"}', "15s"), ("chat", "15"), ("chat", "0s")],
    ids=["space", "quote", "no-unit", "zero"],
)
def test_bad_pool_or_window_is_refused(pool: str, window: str) -> None:
    """Pool names and windows that could break a PromQL selector raise InputError."""
    with pytest.raises(InputError):
        pool_queries(pool, window)


def test_client_tries_each_query_once() -> None:
    """The production client makes one attempt: a refused connection fails at once."""
    client = connect_prometheus(f"http://127.0.0.1:{free_port()}", 0.3)
    start = time.monotonic()
    with pytest.raises(ConnectionError):
        client.custom_query("up")
    assert time.monotonic() - start < 0.3


@pytest.fixture
def drip_server() -> Iterator[int]:
    """An HTTP server that answers every request one byte each 50 ms (slowloris upstream)."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    stop = threading.Event()
    answer = (b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 63\r\n'
              b'\r\n{"status":"success","data":{"resultType":"vector","result":[]}}')

    def drip(conn: socket.socket) -> None:
        with conn:
            conn.recv(65536)
            for byte in answer:
                if stop.wait(0.05):
                    return
                try:
                    conn.sendall(bytes([byte]))
                except OSError:
                    return

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=drip, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield port
    finally:
        stop.set()
        listener.close()


def test_a_prometheus_answering_byte_by_byte_cannot_hold_the_tick(drip_server: int) -> None:
    """Every read arrives well within the timeout, but the whole answer would take ~10 s:
    the query ends at its 0.3 s deadline and the tick goes on with NaN and a stale age."""
    client = connect_prometheus(f"http://127.0.0.1:{drip_server}", 0.3)
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        client.custom_query("up")
    assert time.monotonic() - start < 0.6
    errors: list = []
    source = PrometheusSource(client, window="15s", timeout_s=0.3,
                              on_error=lambda *e: errors.append(e))
    start = time.monotonic()
    obs = source.observe("chat", 1.0)
    assert time.monotonic() - start < 0.6
    assert [kind for _, _, kind, _ in errors] == [TRANSPORT]
    assert len(queried_missing(obs)) == len(FIELD_VALUES) and math.isinf(obs.age_s)


def test_range_query_merges_series_by_max_and_drops_nan() -> None:
    """Range answers become sorted times and values; NaN samples are dropped."""
    answer = [
        {"metric": {"instance": "a"}, "values": [[10, "1"], [11, "NaN"], [12, "3"]]},
        {"metric": {"instance": "b"}, "values": [[10, "2"], [12, "1"]]},
    ]
    series = query_range(FakeClient({"q": answer}), "q", start_s=10, end_s=12, step_s=1)
    np.testing.assert_allclose(series.times_s, [10, 12])
    np.testing.assert_allclose(series.values, [2, 3])


def test_identification_series_are_aligned_on_common_times() -> None:
    """Budget and outputs come back on the sample times they share."""
    exprs = identification_queries("chat", "15s")
    answers = {
        expr: [{"metric": {}, "values": [[t, str(i + t)] for t in (1, 2, 3) if i == 0 or t > 1]}]
        for i, expr in enumerate(exprs.values())
    }
    got = identification_series(FakeClient(answers), "chat", start_s=1, end_s=3, step_s=1)
    np.testing.assert_allclose(got["times_s"], [2, 3])
    np.testing.assert_allclose(got["budget_tokens_per_s"], [2, 3])
    np.testing.assert_allclose(got["ttft_p95_s"], [3, 4])


def _parts_range(times: list[float], **parts: list[float]) -> list[dict]:
    """A `BoundQuery` range answer: one series per part, a value at each time."""
    return [{"metric": {"pool": "chat", "part": part},
             "values": [[t, str(v)] for t, v in zip(times, values, strict=True)]}
            for part, values in parts.items()]


def _history_answers(slo: Slo, itl: list[dict], ttft: list[dict]) -> dict[str, object]:
    times = [1.0, 2.0, 3.0]
    answers: dict[str, object] = {
        expr: [{"metric": {}, "values": [[t, "100"] for t in times]}]
        for expr in identification_queries("chat", "15s").values()
    }
    itl_query, ttft_query, batch_query = bound_queries("chat", "15s", slo)
    answers.update({itl_query.expr: itl, ttft_query.expr: ttft, batch_query.expr: []})
    return answers


def test_identification_history_reads_the_burn_at_the_pools_slo() -> None:
    """Over a range, the daemon's own bound queries give each time's share above the pool's
    SLO and its sample count; a time without parts keeps NaN; no batch series: NaN."""
    slo = Slo(ttft_p95_s=0.3, itl_p95_s=0.0075)
    times = [1.0, 2.0, 3.0]
    itl = _parts_range(times, count=[10, 10, 10], at_bound=[9, 9.5, 10], series=[1, 1, 1],
                       series_at_bound=[1, 1, 1])
    ttft = _parts_range(times[:2], count=[2, 2], at_bound=[2, 1], series=[1, 1],
                        series_at_bound=[1, 1])
    history = identification_history(
        FakeClient(_history_answers(slo, itl, ttft)), "chat", slo, start_s=1, end_s=3,
        step_s=1, window="15s", burn=True)
    obs = history.observations
    np.testing.assert_allclose(history.times_s, times)
    np.testing.assert_allclose([o.itl_over_slo_frac for o in obs], [0.1, 0.05, 0.0])
    np.testing.assert_allclose([o.itl_samples for o in obs], [150.0] * 3)
    np.testing.assert_allclose([o.ttft_over_slo_frac for o in obs], [0.0, 0.5, math.nan])
    assert all(math.isnan(o.itl_over_slo_batch_frac) for o in obs)
    assert all(o.window_s == 15.0 and o.itl_p95_s == 100.0 for o in obs)


def test_identification_history_without_the_slo_bucket_names_it() -> None:
    """Every series lacks the SLO's bucket: the burn cannot be fitted, and the error says
    which metric and bound, and how to add it."""
    slo = Slo(ttft_p95_s=0.3, itl_p95_s=0.0075)
    times = [1.0, 2.0, 3.0]
    lacking = _parts_range(times, count=[10, 10, 10], series=[1, 1, 1])
    with pytest.raises(InputError, match=r"borrowd_proxy_itl_seconds: 1 of 1 series have no "
                                         r"bucket le=0\.0075.*slo_itl_s"):
        identification_history(FakeClient(_history_answers(slo, lacking, lacking)), "chat",
                                slo, start_s=1, end_s=3, step_s=1, window="15s", burn=True)


def test_identification_history_on_p95_asks_no_bound() -> None:
    """A law on p95/SLO needs no burn: no bound query is asked, the shares stay NaN."""
    client = FakeClient({expr: [{"metric": {}, "values": [[1.0, "1"], [2.0, "2"]]}]
                         for expr in identification_queries("chat", "15s").values()})
    history = identification_history(client, "chat", Slo(), start_s=1, end_s=2, step_s=1,
                                     window="15s", burn=False)
    assert all(math.isnan(o.itl_over_slo_frac) for o in history.observations)
    np.testing.assert_allclose(history.budget_tokens_per_s, [1.0, 2.0])


@pytest.mark.parametrize(
    ("answer", "message"),
    [([], "no series"), (requests.ConnectionError("refused"), "failed")],
    ids=["empty", "down"],
)
def test_range_query_failure_names_the_expression(answer: object, message: str) -> None:
    """A range query with nothing to fit raises InputError naming the query."""
    with pytest.raises(InputError, match=message):
        query_range(FakeClient({"q": answer}), "q", start_s=0, end_s=10, step_s=1)


@pytest.mark.parametrize(
    ("bound_s", "spellings", "matcher"),
    [(0.05, ("0.05",), r'le=~"0\\.05"'),
     (1.0, ("1.0", "1"), r'le=~"1\\.0|1"'),
     (0.0075, ("0.0075",), r'le=~"0\\.0075"'),
     (0.12, ("0.12",), r'le=~"0\\.12"'),
     (2560.0, ("2560.0", "2560"), r'le=~"2560\\.0|2560"'),
     (1e-05, ("1e-05",), r'le=~"1e\\-05"')],
    ids=["50ms", "1s", "7.5ms", "120ms", "2560s", "10us"],
)
def test_bound_is_spelled_as_prometheus_client_writes_le(bound_s: float, spellings: tuple,
                                                         matcher: str) -> None:
    """The bound is matched as prometheus_client writes `le` (floatToGoString) and, for a
    whole number, as Go's client does (1 besides 1.0), dots escaped in the PromQL regex."""
    from borrowd.controller.prom_source import le_matcher, le_spellings
    from prometheus_client import Histogram

    assert le_spellings(bound_s) == spellings
    assert le_matcher(bound_s) == matcher
    registry = CollectorRegistry()
    Histogram("h_seconds", "h", registry=registry, buckets=(bound_s,)).observe(0.0)
    written = {s.labels["le"] for m in registry.collect() for s in m.samples if "le" in s.labels}
    assert spellings[0] in written


@pytest.mark.parametrize("window", ["15s", "1m"], ids=["15s", "1m"])
def test_burn_is_queried_at_the_pools_own_slo_for_each_window(window: str) -> None:
    """ITL and TTFT shares read the proxy histograms of the replicas that may take batch at
    `le` equal to the pool's SLOs, the batch share the engines' at the ITL SLO, in the
    source's window; one query per histogram, every part labelled."""
    queries = {q.field: q for q in bound_queries("chat", window, Slo(0.12, 0.0076))}
    assert set(queries) == {"itl_over_slo_frac", "ttft_over_slo_frac", "itl_over_slo_batch_frac"}
    itl = queries["itl_over_slo_frac"]
    assert (itl.samples_field, itl.bound_s) == ("itl_samples", 0.0076)
    sel = 'pool="chat",class="interactive",batch_eligible!="false"'
    assert (f'rate(borrowd_proxy_itl_seconds_bucket{{{sel},le=~"0\\\\.0076"}}[{window}])'
            in itl.expr)
    assert f"rate(borrowd_proxy_itl_seconds_count{{{sel}}}[{window}])" in itl.expr
    assert 'le=~"0\\\\.12"' in queries["ttft_over_slo_frac"].expr
    batch = queries["itl_over_slo_batch_frac"]
    assert batch.batch and batch.samples_field is None
    assert ('borrowd_engine_interactive_itl_seconds_bucket{pool="chat",batch_step="true",'
            'le=~"0\\\\.0076"}' in batch.expr)
    for query in queries.values():
        assert f'"part", "{COUNT}"' in query.expr and f'"part", "{SERIES_AT_BOUND}"' in query.expr
        assert "over_slo" not in query.expr  # not the default-SLO recording rules


def test_each_pool_reads_its_burn_at_its_own_slo() -> None:
    """A source with per-pool SLOs asks each pool at its bounds; an unnamed pool at 1 s /
    50 ms; three burn queries per pool, one fewer than the fields they fill, and the late
    waiters at its TTFT SLO."""
    slo = Slo(ttft_p95_s=0.3, itl_p95_s=0.0075)
    answers = {**healthy_answers("chat", slo=slo), **healthy_answers("other")}
    client = FakeClient(answers, default=age_default())
    errors: list = []
    source = PrometheusSource(client, window="15s", timeout_s=0.25,
                              on_error=lambda *e: errors.append(e), slos={"chat": slo})
    for pool in ("chat", "other"):
        client.asked.clear()
        obs = source.observe(pool, 1.0)
        assert errors == [] and queried_missing(obs) == []
        assert obs.itl_over_slo_frac == pytest.approx(FIELD_VALUES["itl_over_slo_frac"])
        assert obs.itl_samples == pytest.approx(FIELD_VALUES["itl_samples"])
        asked = " ".join(query for query, _, _ in client.asked)
        bounds = ('0\\\\.0075', '0\\\\.3') if pool == "chat" else ('0\\\\.05', '1\\\\.0|1')
        assert all(f'le=~"{b}"' in asked for b in bounds)
        assert f'slo=~"{bounds[1]}"' in asked  # the late waiters at the TTFT SLO
        assert obs.interactive_late_waiters == FIELD_VALUES["interactive_late_waiters"]
        assert len(client.asked) == len(pool_queries(pool, "15s")) + 3 + 1 + 1
    assert source.slo("other") == Slo()


@pytest.mark.parametrize(
    ("answer", "share", "samples"),
    [(histogram(80.0, 72.0), 0.1, 1200.0), (histogram(80.0, 80.0), 0.0, 1200.0),
     (histogram(0.0, 0.0), 0.0, 0.0), (histogram(80.0, 80.0 * (1 + 1e-12)), 0.0, 1200.0)],
    ids=["tenth-above", "none-above", "no-sample", "rounding-above-count"],
)
def test_share_above_the_slo_and_its_samples(answer: list, share: float, samples: float) -> None:
    """share = 1 - rate at or below the bound / rate; samples = rate x window (0 and 0 when
    the window held no sample: nothing to protect, a safe reading)."""
    obs, errors = _observe_bound("itl_over_slo_frac", answer)
    assert (obs.itl_over_slo_frac, obs.itl_samples) == (pytest.approx(share),
                                                        pytest.approx(samples))
    assert errors == []


@pytest.mark.parametrize(
    ("answer", "kind", "samples"),
    [([], EMPTY, math.nan),
     (histogram(80.0, 0.0, series=1, with_bound=0), MISSING_BOUND, 1200.0),
     (histogram(80.0, 40.0, series=3, with_bound=2), MISSING_BOUND, 1200.0),
     (histogram(0.0, 0.0, series=1, with_bound=0), MISSING_BOUND, 0.0),
     (histogram(80.0, 81.0), IMPOSSIBLE, math.nan),
     (parts(**{COUNT: 80.0}) + parts(**{COUNT: 70.0}), NOT_A_NUMBER, math.nan)],
    ids=["no-series", "no-series-has-the-bound", "one-of-three-lacks-it", "idle-without-bound",
         "more-at-bound-than-all", "part-twice"],
)
def test_an_unread_share_is_missing_never_safe(answer: list, kind: str, samples: float) -> None:
    """No bucket at the pool's SLO on some series (an old proxy), or an answer that is not a
    histogram: the share is NaN (the pool controls on p95), the samples of a histogram
    without the bound are still read, and the error is counted; the missing-bound detail
    names the metric, the bound and the way out."""
    obs, errors = _observe_bound("ttft_over_slo_frac", answer, Slo(ttft_p95_s=0.3))
    assert math.isnan(obs.ttft_over_slo_frac)
    assert obs.ttft_samples == pytest.approx(samples, nan_ok=True)
    assert [(pool, f, k) for pool, f, k, _ in errors] == [("chat", "ttft_over_slo_frac", kind)]
    if kind == MISSING_BOUND:
        detail = errors[0][3]
        assert "borrowd_proxy_ttft_seconds" in detail and "le=0.3" in detail
        assert "slo_ttft_s" in detail and "p95" in detail
