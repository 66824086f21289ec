"""A bucket bound at each pool SLO: proxy TTFT/ITL histograms, the engines' interference
histogram, and the settings that carry the SLOs there (proxy config, plugin env, emulator)."""

from __future__ import annotations

import pytest
from borrowd.adapters.emulator.app import EmulatorConfig, EmulatorServer
from borrowd.adapters.engine_budget import PluginConfig
from borrowd.adapters.interference import ITL_METRIC, InterferenceMetrics
from borrowd.adapters.proxy.buckets import ITL_BUCKETS_S, TTFT_BUCKETS_S, with_slo_bounds
from borrowd.adapters.proxy.config import parse_config
from borrowd.adapters.proxy.metrics import ProxyMetrics
from borrowd.models.errors import ConfigError
from prometheus_client import CollectorRegistry


def bounds(registry: CollectorRegistry, metric: str) -> list[str]:
    """The `le` values one child of `metric` exports, in order."""
    family = next(m for m in registry.collect() if m.name == metric)
    first = next(s for s in family.samples if s.name.endswith("_bucket"))
    child = {k: v for k, v in first.labels.items() if k != "le"}
    return [s.labels["le"] for s in family.samples if s.name.endswith("_bucket")
            and {k: v for k, v in s.labels.items() if k != "le"} == child]


@pytest.mark.parametrize(
    ("slos", "added"),
    [((), ()), ((0.0075,), (0.0075,)), ((0.05,), ()), ((0.03, 0.0075, 0.03), (0.0075, 0.03))],
    ids=["none", "below-vllm", "already-a-vllm-bound", "unsorted-duplicated"],
)
def test_slo_bounds_join_vllms_sorted_once(slos: tuple, added: tuple) -> None:
    """The SLOs join vLLM's bounds, sorted, each once (vLLM's own bounds stay)."""
    assert with_slo_bounds(ITL_BUCKETS_S, slos) == tuple(sorted({*ITL_BUCKETS_S, *added}))


@pytest.mark.parametrize("slo", [0.0, -0.05, float("inf"), float("nan")],
                         ids=["zero", "negative", "inf", "nan"])
def test_a_bound_that_is_no_slo_is_refused(slo: float) -> None:
    """Only a finite number of seconds above 0 is a bound."""
    with pytest.raises(ValueError, match="SLO bound"):
        with_slo_bounds(ITL_BUCKETS_S, (slo,))


def test_proxy_histograms_carry_the_pools_slos() -> None:
    """TTFT and ITL have a bucket at the pool's SLOs, written as prometheus_client writes
    `le`, besides every vLLM bound."""
    registry = CollectorRegistry()
    ProxyMetrics("chat", registry, slo_ttft_s=(0.3,), slo_itl_s=(0.0075,))
    itl = bounds(registry, "borrowd_proxy_itl_seconds")
    ttft = bounds(registry, "borrowd_proxy_ttft_seconds")
    assert itl[:3] == ["0.0075", "0.01", "0.025"] and len(itl) == len(ITL_BUCKETS_S) + 2
    assert "0.3" in ttft and "1.0" in ttft and len(ttft) == len(TTFT_BUCKETS_S) + 2
    default = CollectorRegistry()
    ProxyMetrics("chat", default)
    assert "0.0075" not in bounds(default, "borrowd_proxy_itl_seconds")


def test_proxy_config_reads_the_slos() -> None:
    """`proxy.slo_ttft_s` and `proxy.slo_itl_s` are lists of seconds (empty by default)."""
    base = {"proxy": {"upstreams": ["http://127.0.0.1:8100"]},
            "tenants": {"chat": {"keys": ["k"], "class": "interactive"}}}
    assert (parse_config(base).slo_ttft_s, parse_config(base).slo_itl_s) == ((), ())
    base["proxy"] |= {"slo_ttft_s": [0.3], "slo_itl_s": [0.0075, 0.03]}
    config = parse_config(base)
    assert (config.slo_ttft_s, config.slo_itl_s) == ((0.3,), (0.0075, 0.03))


@pytest.mark.parametrize(
    ("value", "needle"),
    [([0], r"proxy\.slo_itl_s\[0\]: 0\.0 must be above 0"),
     ([0.01, -1], r"proxy\.slo_itl_s\[1\]"),
     (0.0075, r"proxy\.slo_itl_s: must be an array"),
     (["fast"], r"proxy\.slo_itl_s\[0\]: must be a number")],
    ids=["zero", "negative", "not-a-list", "not-a-number"],
)
def test_a_bad_proxy_slo_names_the_key(value: object, needle: str) -> None:
    """A bad SLO stops the proxy with one line naming the key."""
    base = {"proxy": {"upstreams": ["http://127.0.0.1:8100"], "slo_itl_s": value},
            "tenants": {"chat": {"keys": ["k"], "class": "interactive"}}}
    with pytest.raises(ConfigError, match=needle):
        parse_config(base)


def test_interference_histogram_carries_the_itl_slo() -> None:
    """The engines' gap histogram has a bucket at the pool's ITL SLO, both children."""
    registry = CollectorRegistry()
    InterferenceMetrics(registry, "m", "0", slo_itl_s=(0.0075,))
    assert bounds(registry, ITL_METRIC)[:2] == ["0.0075", "0.01"]


@pytest.mark.parametrize(("text", "slos"),
                         [(None, ()), ("", ()), ("0.0075", (0.0075,)),
                          (" 0.0075, 0.03 ", (0.0075, 0.03))],
                         ids=["unset", "empty", "one", "two"])
def test_plugin_reads_the_itl_slos_from_env(text: str | None, slos: tuple) -> None:
    """BORROWD_SLO_ITL_S lists the pool's ITL SLOs in seconds, comma-separated."""
    env = {"BORROWD_POOL": "chat"} | ({"BORROWD_SLO_ITL_S": text} if text is not None else {})
    assert PluginConfig.from_env(env).slo_itl_s == slos


@pytest.mark.parametrize("text", ["fast", "0.01;0.02", "0", "-0.01", "inf", "nan"],
                         ids=["word", "semicolon", "zero", "negative", "inf", "nan"])
def test_a_bad_plugin_slo_names_the_variable(text: str) -> None:
    """A value that is not a list of seconds above 0 stops the engine naming the variable."""
    with pytest.raises(ConfigError, match=r"^BORROWD_SLO_ITL_S must"):
        PluginConfig.from_env({"BORROWD_POOL": "chat", "BORROWD_SLO_ITL_S": text})


def test_emulator_exports_the_itl_slo_bound() -> None:
    """`borrowd emulate --slo-itl-s` puts the bound on the interference histogram only
    (vLLM's own `vllm:` histograms keep vLLM's bounds); a bad one names the flag."""
    server = EmulatorServer(EmulatorConfig(kv_capacity_tokens=4096, max_model_len=4096,
                                           slo_itl_s=(0.0075,)))
    assert "0.0075" in bounds(server.registry, ITL_METRIC)
    assert "0.0075" not in bounds(server.registry, "vllm:inter_token_latency_seconds")
    with pytest.raises(ConfigError, match="--slo-itl-s"):
        EmulatorConfig(slo_itl_s=(0.0,))


def test_late_waiters_are_counted_at_each_ttft_slo_at_scrape_time() -> None:
    """Per class and bound of the TTFT histogram (SLOs included), the requests waiting
    longer than the bound for their first token, counted when Prometheus scrapes (the
    daemon's oldest-wait cut weighs them as first tokens already late); a settled request
    leaves the count."""
    now = [100.0]
    registry = CollectorRegistry()
    metrics = ProxyMetrics("chat", registry, clock=lambda: now[0], slo_ttft_s=(2.0, 0.5))
    for rid, started in (("a", 90.0), ("b", 98.5), ("c", 99.8)):
        metrics.tracker.waiting("interactive", rid, started)
    metrics.tracker.waiting("batch", "d", 90.0)

    def late(klass: str, slo: str) -> float | None:
        return registry.get_sample_value("borrowd_proxy_late_waiters",
                                         {"pool": "chat", "class": klass, "slo": slo})

    assert (late("interactive", "0.5"), late("interactive", "2.0")) == (2.0, 1.0)
    assert late("batch", "0.5") == 1.0
    metrics.tracker.settled("interactive", "a")
    now[0] = 100.4
    assert (late("interactive", "0.5"), late("interactive", "2.0")) == (2.0, 0.0)
    assert late("interactive", "0.25") == 2.0  # every bound of the TTFT histogram
    bare = CollectorRegistry()
    ProxyMetrics("chat", bare, clock=lambda: 0.0)
    slos = {s.labels["slo"] for m in bare.collect() if m.name == "borrowd_proxy_late_waiters"
            for s in m.samples}
    assert "1.0" in slos and "0.5" in slos  # vLLM's bounds (the default 1 s SLO) without any
