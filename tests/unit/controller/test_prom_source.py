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
    EMPTY,
    HTTP,
    IMPOSSIBLE,
    KV_CAPACITY,
    NOT_A_NUMBER,
    TRANSPORT,
    PrometheusSource,
    connect_prometheus,
    identification_queries,
    identification_series,
    pool_queries,
    query_range,
    window_seconds,
)
from borrowd.models.errors import InputError
from borrowd.models.signals import Observation
from prometheus_api_client import PrometheusApiClientException

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


def healthy_answers(pool: str = "chat", window: str = "15s") -> dict[str, object]:
    """Every query of `pool` answered with FIELD_VALUES (the KV capacity as two engines of
    16000 and 32000 tokens); data 0.5 s old."""
    answers: dict[str, object] = {
        q.expr: instant(repr(FIELD_VALUES[q.field])) for q in pool_queries(pool, window)
    }
    capacity = next(q.expr for q in pool_queries(pool, window) if q.parse == KV_CAPACITY)
    answers[capacity] = cache_info(
        {"instance": "a:8000", "block_size": "16", "num_gpu_blocks": "1000"},
        {"instance": "b:8000", "block_size": "16", "num_gpu_blocks": "1000",
         "kv_cache_size_tokens": "32000"},
    )
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


@pytest.mark.parametrize("window", ["15s", "1m"], ids=["15s", "1m"])
def test_slo_burn_fields_read_the_over_slo_rules(window: str) -> None:
    """The shares above the SLOs come from the interactive over-SLO ratio rules."""
    exprs = {q.field: q.expr for q in pool_queries("chat", window)}
    sel = '{pool="chat",class="interactive"}'
    assert exprs["itl_over_slo_frac"] == (
        f"pool_class:borrowd_proxy_itl_seconds:over_slo_ratio_rate{window}{sel}"
    )
    assert exprs["ttft_over_slo_frac"] == (
        f"pool_class:borrowd_proxy_ttft_seconds:over_slo_ratio_rate{window}{sel}"
    )


def test_queries_are_evaluated_at_prometheus_time_with_the_short_timeout() -> None:
    """Each query is sent once, with the configured timeout and no `time` of the daemon's:
    Prometheus evaluates at its own now, so staleness is measured on its clock."""
    client = FakeClient(healthy_answers(), default=age_default())
    make_source(client, []).observe("chat", 1234.5)
    assert len(client.asked) == len(pool_queries("chat", "15s")) + 1
    assert all("time" not in params for _, params, _ in client.asked)
    assert {timeout for _, _, timeout in client.asked} == {0.25}


@pytest.mark.parametrize(
    ("field", "value"),
    [("ttft_p95_s", "-0.5"), ("itl_p95_s", "-1e-3"), ("kv_usage_frac", "-0.1"),
     ("kv_usage_frac", "1.5"), ("success_rate", "7"), ("interactive_queue_depth", "-3"),
     ("itl_over_slo_frac", "2"), ("ttft_p95_s", "+Inf"), ("batch_tokens_per_s", "-Inf")],
    ids=["negative-ttft", "negative-itl", "negative-kv", "kv-above-1", "success-7",
         "negative-queue", "share-above-1", "inf-ttft", "minus-inf-rate"],
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


@pytest.mark.parametrize("field", ["itl_over_slo_batch_frac", "interactive_wait_batch_frac"])
def test_a_nan_batch_share_is_a_reading_and_an_absent_one_is_missing(field: str) -> None:
    """NaN (no gap above the SLO, no wait: nothing to attribute) reads as NaN without an
    error; no series (no engine exports the interference series) is missing and counted."""
    errors: list = []
    client = FakeClient(_answers_with(field, instant("NaN")), default=age_default())
    obs = make_source(client, errors).observe("chat", 1.0)
    assert math.isnan(getattr(obs, field)) and errors == []
    client = FakeClient(_answers_with(field, []), default=age_default())
    obs = make_source(client, errors).observe("chat", 1.0)
    assert queried_missing(obs) == [field]
    assert [(f, kind) for _, f, kind, _ in errors] == [(field, EMPTY)]


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


@pytest.mark.parametrize(
    ("answer", "message"),
    [([], "no series"), (requests.ConnectionError("refused"), "failed")],
    ids=["empty", "down"],
)
def test_range_query_failure_names_the_expression(answer: object, message: str) -> None:
    """A range query with nothing to fit raises InputError naming the query."""
    with pytest.raises(InputError, match=message):
        query_range(FakeClient({"q": answer}), "q", start_s=0, end_s=10, step_s=1)
