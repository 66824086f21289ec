"""vLLM's own Prometheus metrics for the emulator: names, labels and buckets as vLLM V1.

Mirrors `vllm/v1/metrics/loggers.py` (`PrometheusStatLogger`): labels `model_name` and
`engine`, `vllm:request_success_total` with `finished_reason` (stop | length | abort), and
the TTFT, inter-token and request latency buckets of `adapters.proxy.buckets`, and
`vllm:cache_config_info` (an info gauge at 1 whose labels `block_size`, `num_gpu_blocks` and
`kv_cache_size_tokens` give the engine's KV capacity, labels as vLLM's: no `model_name`).
"""

from __future__ import annotations

from borrowd.adapters.proxy.buckets import (
    ITL_BUCKETS_S,
    REQUEST_LATENCY_BUCKETS_S,
    TTFT_BUCKETS_S,
    build_1_2_5_buckets,
)
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

FINISH_REASONS = ("stop", "length", "abort")
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class VllmMetrics:
    """The `vllm:*` series of one engine, children bound to (model_name, engine)."""

    def __init__(self, registry: CollectorRegistry, model_name: str, engine: str,
                 max_model_len: int, block_size: int, num_gpu_blocks: int) -> None:
        labels = ["model_name", "engine"]
        values = (model_name, engine)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=registry).labels(*values)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=registry).labels(*values)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, labels, registry=registry,
                             buckets=buckets).labels(*values)

        self.running = gauge("vllm:num_requests_running",
                             "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting",
                             "Number of requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc",
                              "KV-cache usage. 1 means 100 percent usage.")
        self.preemptions = counter("vllm:num_preemptions",
                                   "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens",
                                         "Number of generation tokens processed.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          [*labels, "finished_reason"], registry=registry)
        self.success = {r: success.labels(*values, r) for r in FINISH_REASONS}
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens",
                                               "Number of prefill tokens processed.",
                                               token_buckets)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                   "Number of generation tokens processed.",
                                                   token_buckets)
        self.iteration_tokens = histogram("vllm:iteration_tokens_total",
                                          "Histogram of number of tokens per engine_step.",
                                          ITERATION_TOKEN_BUCKETS)
        self.ttft = histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", TTFT_BUCKETS_S)
        self.itl = histogram("vllm:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", ITL_BUCKETS_S)
        self.e2e = histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS_S)
        self.queue = histogram("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.",
                               REQUEST_LATENCY_BUCKETS_S)
        self.inference = histogram("vllm:request_inference_time_seconds",
                                   "Histogram of time spent in RUNNING phase for request.",
                                   REQUEST_LATENCY_BUCKETS_S)
        self.prefill = histogram("vllm:request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request.",
                                 REQUEST_LATENCY_BUCKETS_S)
        self.decode = histogram("vllm:request_decode_time_seconds",
                                "Histogram of time spent in DECODE phase for request.",
                                REQUEST_LATENCY_BUCKETS_S)
        cache_info = {"block_size": str(block_size), "num_gpu_blocks": str(num_gpu_blocks),
                      "kv_cache_size_tokens": str(block_size * num_gpu_blocks), "engine": engine}
        Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
              list(cache_info), registry=registry).labels(**cache_info).set(1)
