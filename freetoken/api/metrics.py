"""Prometheus metrics of one server: a private registry, so several apps (tests) never collide.

Counters and histograms are fed by server.py per request; the engine's live numbers (running /
waiting requests, KV blocks, prefix-cache queries and hits) are read from `engine.stats()` at
scrape time by a custom collector, so they are never stale.

The same live numbers are also exported under vLLM's metric names (`vllm:num_requests_running`,
`vllm:kv_cache_usage_perc`, ...; labels `model_name` and `engine`), so dashboards, autoscalers and
routers that scrape vLLM work unchanged (docs/scale-out.md).
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
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

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

# engine.stats() key -> (metric name, help, kind). Several spellings are accepted so the
# collector survives small renames in the engine; a missing key is simply not exported.
_ENGINE_GAUGES = {
    "running": ("freetoken_requests_running", "Requests in the engine's running set"),
    "num_running": ("freetoken_requests_running", "Requests in the engine's running set"),
    "waiting": ("freetoken_requests_waiting", "Requests waiting for admission"),
    "num_waiting": ("freetoken_requests_waiting", "Requests waiting for admission"),
    "kv_blocks_used": ("freetoken_kv_blocks_used", "KV-cache blocks in use"),
    "num_used_blocks": ("freetoken_kv_blocks_used", "KV-cache blocks in use"),
    "kv_blocks_total": ("freetoken_kv_blocks_total", "KV-cache blocks in the pool"),
    "num_blocks": ("freetoken_kv_blocks_total", "KV-cache blocks in the pool"),
}
_ENGINE_COUNTERS = {
    "prefix_queries": (
        "freetoken_prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache",
    ),
    "prefix_cache_queries": (
        "freetoken_prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache",
    ),
    "prefix_hits": ("freetoken_prefix_cache_hits", "Prompt tokens served by the prefix cache"),
    "prefix_cache_hits": (
        "freetoken_prefix_cache_hits",
        "Prompt tokens served by the prefix cache",
    ),
    "num_preemptions": ("freetoken_preemptions", "Sequences preempted for KV space"),
    "step_errors_total": ("freetoken_engine_step_errors", "Engine steps that raised"),
}


def _first(stats: dict, *keys: str, default: float = 0.0) -> float:
    for key in keys:
        if key in stats:
            return float(stats[key])
    return default


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

    used = _first(stats, "kv_blocks_used", "num_used_blocks")
    total = _first(stats, "kv_blocks_total", "num_blocks")
    usage = used / total if total > 0 else 0.0
    yield gauge(
        "vllm:num_requests_running",
        "Number of requests in model execution batches.",
        _first(stats, "num_running", "running"),
    )
    yield gauge(
        "vllm:num_requests_waiting",
        "Number of requests waiting to be processed.",
        _first(stats, "num_waiting", "waiting"),
    )
    yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage)
    yield gauge(
        "vllm:gpu_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage (V0 name).", usage
    )
    queries = _first(stats, "prefix_queries", "prefix_cache_queries")
    hits = _first(stats, "prefix_hits", "prefix_cache_hits")
    for prefix in ("vllm:prefix_cache", "vllm:gpu_prefix_cache"):
        yield counter(f"{prefix}_queries", "Prefix cache queries, in terms of tokens.", queries)
        yield counter(f"{prefix}_hits", "Prefix cache hits, in terms of tokens.", hits)
    yield counter(
        "vllm:prompt_tokens",
        "Number of prefill tokens processed.",
        _first(stats, "prompt_tokens_total"),
    )
    yield counter(
        "vllm:generation_tokens",
        "Number of generation tokens processed.",
        _first(stats, "generation_tokens_total"),
    )
    yield counter(
        "vllm:num_preemptions",
        "Cumulative number of preemptions from the engine.",
        _first(stats, "num_preemptions"),
    )


class _EngineCollector:
    def __init__(self, engine, owner=None):
        self.engine = engine
        self.owner = owner  # the Metrics: its model_name labels the vllm:* series

    def collect(self):
        try:
            stats = dict(self.engine.stats() or {})
        except Exception:  # a scrape must never take the server down
            logger.exception("engine.stats() failed during a scrape")
            return
        seen: set[str] = set()
        for key, (name, doc) in _ENGINE_GAUGES.items():
            if key in stats and name not in seen:
                seen.add(name)
                yield GaugeMetricFamily(name, doc, value=float(stats[key]))
        for key, (name, doc) in _ENGINE_COUNTERS.items():
            if key in stats and name not in seen:
                seen.add(name)
                yield CounterMetricFamily(name, doc, value=float(stats[key]))
        for name, doc in (
            ("freetoken_requests_running", "Requests in the engine's running set"),
            ("freetoken_requests_waiting", "Requests waiting for admission"),
            ("freetoken_kv_blocks_used", "KV-cache blocks in use"),
            ("freetoken_kv_blocks_total", "KV-cache blocks in the pool"),
        ):
            if name not in seen:  # always present, even if the engine does not report it
                yield GaugeMetricFamily(name, doc, value=0.0)
        for name, doc in (
            ("freetoken_prefix_cache_queries", "Prompt tokens looked up"),
            ("freetoken_prefix_cache_hits", "Prompt tokens served by the cache"),
        ):
            if name not in seen:
                yield CounterMetricFamily(name, doc, value=0.0)
        model_name = getattr(self.owner, "model_name", None) or "freetoken"
        yield from vllm_families(stats, model_name)


class Metrics:
    def __init__(self, engine):
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
        self.http = Counter(
            "freetoken_http_requests",
            "HTTP requests by route and status",
            ["route", "status"],
            registry=r,
        )
        # The `model_name` label of the vllm:* series; the app sets the served model name.
        self.model_name = "freetoken"
        r.register(_EngineCollector(engine, self))

    def render(self) -> bytes:
        return generate_latest(self.registry)
