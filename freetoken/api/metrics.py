"""Prometheus metrics of one server: a private registry, so several apps (tests) never collide.

Counters and histograms are fed by the edge per request (middleware.py, generation.py); the
engine's live numbers (running / waiting requests, KV blocks, prefix-cache queries and hits) are
read from `engine.stats()` at scrape time by a custom collector, so they are never stale.

The same live numbers are also exported under vLLM's metric names (`vllm:num_requests_running`,
`vllm:kv_cache_usage_perc`, ...; labels `model_name` and `engine`), so dashboards, autoscalers and
routers that scrape vLLM work unchanged (docs/scale-out.md).

What it is not: the /metrics route (info.py serves `render()`).
"""

from __future__ import annotations

import logging

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from freetoken.api.engine_client import EngineClient

logger = logging.getLogger("freetoken.metrics")

_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)

# engine.stats() key -> (metric name, help)
_ENGINE_GAUGES = {
    "num_running": ("freetoken_requests_running", "Requests in the engine's running set"),
    "num_waiting": ("freetoken_requests_waiting", "Requests waiting for admission"),
    "kv_blocks_used": ("freetoken_kv_blocks_used", "KV-cache blocks in use"),
    "kv_blocks_total": ("freetoken_kv_blocks_total", "KV-cache blocks in the pool"),
    "num_paused": (
        "freetoken_streams_paused",
        "Requests paused because their stream's client stopped reading",
    ),
}
_ENGINE_COUNTERS = {
    "prefix_queries": (
        "freetoken_prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache",
    ),
    "prefix_hits": ("freetoken_prefix_cache_hits", "Prompt tokens served by the prefix cache"),
    "num_preemptions": ("freetoken_preemptions", "Sequences preempted for KV space"),
    "step_errors_total": ("freetoken_engine_step_errors", "Engine steps that raised"),
}

# engine.stats() key -> (vLLM's name, help); counters without _total (the client library adds it)
_VLLM_REQUEST_GAUGES = {
    "num_running": ("vllm:num_requests_running", "Number of requests in model execution batches."),
    "num_waiting": ("vllm:num_requests_waiting", "Number of requests waiting to be processed."),
}
_VLLM_COUNTERS = {
    "prompt_tokens_total": ("vllm:prompt_tokens", "Number of prefill tokens processed."),
    "generation_tokens_total": ("vllm:generation_tokens", "Number of generation tokens processed."),
    "num_preemptions": (
        "vllm:num_preemptions",
        "Cumulative number of preemptions from the engine.",
    ),
}


def vllm_families(stats: dict, model_name: str):
    """engine.stats() under vLLM's names. Both spellings vLLM has shipped are exported: V1's
    `vllm:kv_cache_usage_perc` / `vllm:prefix_cache_*` and V0's `vllm:gpu_cache_usage_perc` /
    `vllm:gpu_prefix_cache_*` (production-stack's router and many dashboards read the latter).
    Prefix-cache counters count tokens, as vLLM's do."""
    labels = ["model_name", "engine"]
    values = [model_name, "0"]

    def gauge(name, doc, value):
        g = GaugeMetricFamily(name, doc, labels=labels)
        g.add_metric(values, value)
        return g

    def counter(name, doc, value):  # `name` without _total: the client library adds it
        c = CounterMetricFamily(name, doc, labels=labels)
        c.add_metric(values, value)
        return c

    used = float(stats["kv_blocks_used"])
    total = float(stats["kv_blocks_total"])
    usage = used / total if total > 0 else 0.0
    for key, (name, doc) in _VLLM_REQUEST_GAUGES.items():
        yield gauge(name, doc, float(stats[key]))
    yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage)
    yield gauge(
        "vllm:gpu_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage (V0 name).", usage
    )
    queries = float(stats["prefix_queries"])
    hits = float(stats["prefix_hits"])
    for prefix in ("vllm:prefix_cache", "vllm:gpu_prefix_cache"):
        yield counter(f"{prefix}_queries", "Prefix cache queries, in terms of tokens.", queries)
        yield counter(f"{prefix}_hits", "Prefix cache hits, in terms of tokens.", hits)
    for key, (name, doc) in _VLLM_COUNTERS.items():
        yield counter(name, doc, float(stats[key]))


class _EngineCollector:
    def __init__(self, engine: EngineClient, model_name: str):
        self.engine = engine
        self.model_name = model_name  # labels the vllm:* series

    def collect(self):
        try:
            stats = self.engine.stats()
        except Exception:  # a scrape must never take the server down
            logger.exception("engine.stats() failed during a scrape")
            return
        for key, (name, doc) in _ENGINE_GAUGES.items():
            yield GaugeMetricFamily(name, doc, value=float(stats[key]))
        for key, (name, doc) in _ENGINE_COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=float(stats[key]))
        yield from pressure_families(stats)
        yield from vllm_families(stats, self.model_name)


def pressure_families(stats: dict):
    """Preemptions by cause and queue time by request size (engine/pressure.py)."""
    c = CounterMetricFamily(
        "freetoken_preemptions_by_cause",
        "Sequences preempted, by cause: kv (a running sequence needed blocks), short (room for "
        "short work), priority (room for a better priority), paused (a paused stream's KV)",
        labels=["cause"],
    )
    for cause, n in stats["preemptions_by_cause"].items():
        c.add_metric([cause], float(n))
    yield c
    h = HistogramMetricFamily(
        "freetoken_queue_time_seconds",
        "Time from arrival to first admission, by request size (short: max_tokens <= "
        "--short-max-tokens)",
        labels=["size"],
    )
    for size, (buckets, total) in stats["queue_time"].items():
        h.add_metric([size], buckets, total)
    yield h


class Metrics:
    def __init__(self, engine: EngineClient, model_name: str):
        disable_created_metrics()  # the *_created series only double the scrape
        self.registry = CollectorRegistry()
        r = self.registry
        self.prompt_tokens = Counter(
            "freetoken_prompt_tokens", "Prompt tokens processed", registry=r
        )
        self.generation_tokens = Counter(
            "freetoken_generation_tokens", "Tokens generated", registry=r
        )
        self.cached_tokens = Counter(
            "freetoken_cached_prompt_tokens", "Prompt tokens served by the prefix cache", registry=r
        )
        self.ttft = Histogram(
            "freetoken_time_to_first_token_seconds",
            "Time from request arrival to its first output",
            registry=r,
            buckets=_LATENCY_BUCKETS,
        )
        self.e2e = Histogram(
            "freetoken_e2e_request_latency_seconds",
            "Time from request arrival to its last output",
            registry=r,
            buckets=_LATENCY_BUCKETS,
        )
        self.success = Counter(
            "freetoken_request_success",
            "Finished choices by finish reason",
            ["finish_reason"],
            registry=r,
        )
        self.errors = Counter(
            "freetoken_request_errors", "Failed requests by error type", ["type"], registry=r
        )
        self.scored_items = Counter(
            "freetoken_scored_items", "Items scored by the scoring routes", ["route"], registry=r
        )
        self.scored_labels = Counter(
            "freetoken_scored_labels", "Item x label scores returned by the scoring routes",
            ["route"], registry=r,
        )
        self.send_timeouts = Counter(
            "freetoken_stream_send_timeouts",
            "Streams aborted because their client read nothing for --stream-send-timeout",
            registry=r,
        )
        self.http = Counter(
            "freetoken_http_requests",
            "HTTP requests by route and status",
            ["route", "status"],
            registry=r,
        )
        # NOTE: the served model name labels the vllm:* series, so routers and dashboards that
        # filter on `model_name` match.
        r.register(_EngineCollector(engine, model_name))

    def render(self) -> bytes:
        return generate_latest(self.registry)
