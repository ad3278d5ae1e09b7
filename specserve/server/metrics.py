"""Prometheus metrics of the HTTP server, in a registry owned by the server (not the library's global one).

Request-level numbers (tokens, TTFT, TPOT, end-to-end latency, finish reasons, errors) are recorded by the
tokenizer manager as requests finish; engine gauges (running/queued requests, KV usage, accept length, the prefix
cache's pages and hit rate) are set from the engine's counter snapshot that comes with every step output.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from specserve.server.messages import EngineInfo, EngineStats

PREFIX = "specserve:"

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                 80.0, 160.0)
_TPOT_BUCKETS = (0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0, 1200.0)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        r = self.registry
        labels = ["model_name"]
        self._requests = Counter(PREFIX + "num_requests", "Finished generation requests", labels + ["finish_reason"],
                                 registry=r)
        self._errors = Counter(PREFIX + "num_request_errors", "Requests answered with an error", labels + ["status"],
                               registry=r)
        self._prompt = Counter(PREFIX + "prompt_tokens", "Prompt tokens of finished requests", labels, registry=r)
        self._cached = Counter(PREFIX + "cached_tokens", "Prompt tokens of finished requests the prefix cache gave",
                               labels, registry=r)
        self._gen = Counter(PREFIX + "generation_tokens", "Generated tokens of finished requests", labels,
                            registry=r)
        self._ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token", labels,
                               buckets=_TTFT_BUCKETS, registry=r)
        self._tpot = Histogram(PREFIX + "time_per_output_token_seconds", "Time per output token after the first",
                               labels, buckets=_TPOT_BUCKETS, registry=r)
        self._e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "End-to-end request latency", labels,
                              buckets=_E2E_BUCKETS, registry=r)
        self._running = Gauge(PREFIX + "num_running_reqs", "Requests running in the engine", labels, registry=r)
        self._queued = Gauge(PREFIX + "num_queue_reqs", "Requests waiting in the engine", labels, registry=r)
        self._kv_used = Gauge(PREFIX + "kv_used_tokens", "KV slots held by requests", labels, registry=r)
        self._kv_usage = Gauge(PREFIX + "token_usage", "Fraction of the KV pool in use", labels, registry=r)
        self._accept = Gauge(PREFIX + "spec_accept_length", "Mean tokens per verify step since start (speculation)",
                             labels, registry=r)
        self._accept_recent = Gauge(PREFIX + "spec_accept_length_recent",
                                    "Mean tokens per verify over the last few hundred verifies", labels, registry=r)
        self._plain_steps = Gauge(PREFIX + "spec_plain_steps",
                                  "Plain steps a speculating engine took since start (adaptive speculation)", labels,
                                  registry=r)
        self._hit_rate = Gauge(PREFIX + "cache_hit_rate",
                               "Prompt tokens the prefix cache gave over those looked up, since start", labels,
                               registry=r)
        self._cached_pages = Gauge(PREFIX + "cached_pages", "KV pages the prefix cache holds (in use or kept)", labels,
                                   registry=r)
        self._evictable_pages = Gauge(PREFIX + "evictable_pages",
                                      "Prefix-cache pages no running request uses (freed under memory pressure)",
                                      labels, registry=r)
        self._snapshots = Gauge(PREFIX + "state_snapshots",
                                "Recurrent-state snapshots the prefix cache holds (models with recurrent state)",
                                labels, registry=r)
        self._healthy = Gauge(PREFIX + "engine_healthy", "1 while the model process is alive", labels, registry=r)
        self.model_name = model_name

    def observe_finished(self, finish_reason: str, prompt_tokens: int, completion_tokens: int, ttft: float | None,
                         e2e: float, cached_tokens: int = 0) -> None:
        m = self.model_name
        self._requests.labels(m, finish_reason).inc()
        self._prompt.labels(m).inc(prompt_tokens)
        self._cached.labels(m).inc(cached_tokens)
        self._gen.labels(m).inc(completion_tokens)
        self._e2e.labels(m).observe(e2e)
        if ttft is not None:
            self._ttft.labels(m).observe(ttft)
            if completion_tokens > 1:
                self._tpot.labels(m).observe((e2e - ttft) / (completion_tokens - 1))

    def observe_error(self, status: int) -> None:
        self._errors.labels(self.model_name, str(status)).inc()

    def set_engine(self, info: EngineInfo, stats: EngineStats, healthy: bool) -> None:
        m = self.model_name
        used = (info.initial_free_pages - stats.free_pages) * info.page_size
        total = info.initial_free_pages * info.page_size
        self._running.labels(m).set(stats.num_running)
        self._queued.labels(m).set(stats.num_waiting)
        self._kv_used.labels(m).set(used)
        self._kv_usage.labels(m).set(used / total if total else 0.0)
        self._accept.labels(m).set(stats.spec_accept_length)
        self._accept_recent.labels(m).set(stats.recent_accept_length)
        self._plain_steps.labels(m).set(stats.spec_plain_steps)
        cache = stats.prefix_cache
        self._hit_rate.labels(m).set(cache.hit_rate)
        self._cached_pages.labels(m).set(cache.cached_pages)
        self._evictable_pages.labels(m).set(cache.evictable_pages)
        self._snapshots.labels(m).set(cache.state_snapshots)
        self._healthy.labels(m).set(1 if healthy else 0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
