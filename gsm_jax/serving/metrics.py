"""Prometheus metrics of the server: vLLM's names with a `gsm_jax:` prefix.

Latency histograms (TTFT, inter-token latency, e2e, queue time) carry the GSM
arm, and the request / token counters the GSM version and arm, so a canary's
latency and finish reasons can be compared live (`rate(...{gsm_arm="gsm"}[5m])`
against `{gsm_arm="control"}`). Bucket edges are vLLM's.

Two counters are read when scraped from `compile_events` (JAX's own compilation events,
process-wide): `gsm_jax_compilations_total`, the XLA programs this process built
(compiled or loaded from the persistent cache), and
`gsm_jax_compilations_after_ready_total`, those built after the server said ready
(issue 42: zero under any workload).
"""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from gsm_jax.serving import compile_events
from gsm_jax.serving.engine import RequestRecord

__all__ = ["CONTENT_TYPE_LATEST", "ServerMetrics"]

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class ServerMetrics:
    """One registry per server (tests start several in one process)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        r = self.registry = CollectorRegistry()
        arm = ["model_name", "gsm_arm"]
        self.ttft = Histogram("gsm_jax:time_to_first_token_seconds",
                              "Time to first token (arrival to first token).", arm,
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("gsm_jax:inter_token_latency_seconds",
                             "Time between consecutive output tokens of a request.", arm,
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("gsm_jax:e2e_request_latency_seconds",
                             "End-to-end request latency (arrival to last token).", arm,
                             buckets=E2E_BUCKETS, registry=r)
        self.queue = Histogram("gsm_jax:request_queue_time_seconds",
                               "Time a request waited before its prefill started.", arm,
                               buckets=E2E_BUCKETS, registry=r)
        self.running = Gauge("gsm_jax:num_requests_running", "Requests decoding.",
                             ["model_name"], registry=r)
        self.waiting = Gauge("gsm_jax:num_requests_waiting",
                             "Requests waiting (queued or prefilling).", ["model_name"],
                             registry=r)
        self.kv_usage = Gauge("gsm_jax:kv_cache_usage_perc",
                              "Fraction of KV-cache slots holding running requests' tokens.",
                              ["model_name"], registry=r)
        # vLLM's prefix-cache counters, in prompt tokens: hits / queries is the hit rate
        self.prefix_queries = Counter("gsm_jax:prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache.",
                                      ["model_name"], registry=r)
        self.prefix_hits = Counter("gsm_jax:prefix_cache_hits",
                                   "Prompt tokens restored from the prefix cache instead of "
                                   "prefilled.", ["model_name"], registry=r)
        self.prefix_bytes = Gauge("gsm_jax:prefix_cache_bytes",
                                  "Bytes the prefix cache holds.", ["model_name"], registry=r)
        self._prefix_seen = (0, 0)
        self.gsm_version = Gauge("gsm_jax:gsm_config_version",
                                 "The GSM config version in force.", ["model_name"], registry=r)
        self.gsm_fraction = Gauge("gsm_jax:gsm_rollout_fraction",
                                  "Fraction of requests the version in force smooths.",
                                  ["model_name"], registry=r)
        ver = ["model_name", "gsm_version", "gsm_arm"]
        self.prompt_tokens = Counter("gsm_jax:prompt_tokens", "Prefilled prompt tokens.", ver,
                                     registry=r)
        self.generation_tokens = Counter("gsm_jax:generation_tokens", "Generated tokens.", ver,
                                         registry=r)
        self.requests = Counter("gsm_jax:request_success", "Finished requests.",
                                ver + ["finished_reason"], registry=r)
        self.rejections = Counter("gsm_jax:admission_rejections",
                                  "Requests refused at admission (full queue or draining).",
                                  ["model_name", "reason"], registry=r)
        self.refusals = Counter("gsm_jax:unsupported_field_refusals",
                                "Requests refused (400) for a field the server does not "
                                "implement.", ["model_name", "field"], registry=r)
        compile_events.install()
        self.compiles_at_ready: int | None = None  # the count when the server said ready
        r.register(_Compilations(self))

    def mark_ready(self) -> None:
        """From now on a program built counts in `compilations_after_ready`."""
        self.compiles_at_ready = compile_events.count()

    @property
    def compilations_after_ready(self) -> int:
        at = self.compiles_at_ready
        return 0 if at is None else compile_events.count() - at

    def observe_token(self, rec: RequestRecord, arm: str) -> None:
        if rec.n_tokens >= 2:
            self.itl.labels(self.model_name, arm).observe(
                rec.token_times[-1] - rec.token_times[-2])

    def observe_finish(self, rec: RequestRecord, version: int, arm: str) -> None:
        m, v = self.model_name, str(version)
        if not math.isnan(rec.first_token):
            self.ttft.labels(m, arm).observe(rec.ttft)
        if not math.isnan(rec.admitted):
            self.queue.labels(m, arm).observe(rec.queue)
            self.prompt_tokens.labels(m, v, arm).inc(rec.prompt_len)
        if rec.n_tokens:
            self.e2e.labels(m, arm).observe(rec.e2e)
            self.generation_tokens.labels(m, v, arm).inc(rec.n_tokens)
        self.requests.labels(m, v, arm, rec.finish_reason or "unknown").inc()

    def observe_engine(self, running: int, waiting: int, kv_usage: float,
                       prefix: dict | None = None) -> None:
        m = self.model_name
        self.running.labels(m).set(running)
        self.waiting.labels(m).set(waiting)
        self.kv_usage.labels(m).set(kv_usage)
        if prefix is not None:  # the engine's running totals: add what is new since
            queries, hits = prefix["queries_tokens"], prefix["hits_tokens"]
            self.prefix_queries.labels(m).inc(queries - self._prefix_seen[0])
            self.prefix_hits.labels(m).inc(hits - self._prefix_seen[1])
            self._prefix_seen = (queries, hits)
            self.prefix_bytes.labels(m).set(prefix["bytes"])

    def observe_gsm(self, version: int, fraction: float) -> None:
        self.gsm_version.labels(self.model_name).set(version)
        self.gsm_fraction.labels(self.model_name).set(fraction)

    def reject(self, reason: str) -> None:
        self.rejections.labels(self.model_name, reason).inc()

    def refuse(self, field: str) -> None:
        self.refusals.labels(self.model_name, field).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Compilations:
    """The process's compilation counts, read when scraped (a custom collector: the count
    lives in `compile_events`, process-wide, not in this registry)."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def collect(self):
        m = self.metrics
        total = CounterMetricFamily(
            "gsm_jax_compilations", "XLA programs this process built (compiled, or loaded "
            "from the persistent compilation cache); JAX's backend_compile events.",
            labels=["model_name"])
        total.add_metric([m.model_name], compile_events.count())
        after = CounterMetricFamily(
            "gsm_jax_compilations_after_ready", "Of those, the programs built after the "
            "server said ready (0 while starting).", labels=["model_name"])
        after.add_metric([m.model_name], m.compilations_after_ready)
        yield total
        yield after
