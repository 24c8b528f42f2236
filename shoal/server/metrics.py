"""Prometheus metrics for `GET /metrics`, through prometheus_client.

Names start with `shoal:` and follow vLLM's (`vllm:time_to_first_token_seconds` is
`shoal:time_to_first_token_seconds` here), so existing dashboards port with a rename.
Two sources, so nothing is counted twice and a scrape costs the engine thread nothing:

- per-request histograms, observed once when a request ends, from the `RequestMetrics`
  record the engine filled (`RequestTracker.finish` calls `observe`);
- everything else, read at scrape time from the engine's frozen snapshot
  (`engine/stats.py`) and the HTTP side's counters, by a custom collector.

The process and platform collectors of prometheus_client stay on. Each app has its own
registry, so several servers in one process (the tests) do not share numbers.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client import GCCollector, PlatformCollector, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from shoal.types import RequestMetrics

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# No `*_created` series: a third of a scrape's lines, which nothing here reads (vLLM drops them too).
disable_created_metrics()

# vLLM's buckets, so its dashboards' quantiles mean the same here.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class ServerMetrics:
    def __init__(self, state) -> None:
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)

        def hist(name: str, doc: str, buckets) -> Histogram:
            return Histogram(f"shoal:{name}", doc, buckets=buckets, registry=r)

        self.ttft = hist("time_to_first_token_seconds", "Time from arrival to the first generated token.", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between the steps that gave a request tokens.", ITL_BUCKETS)
        self.tpot = hist("request_time_per_output_token_seconds", "Decode time per output token after the first, per request.", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Time from arrival to the end of the request.", LATENCY_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Time from arrival to the first step that scheduled the request.", LATENCY_BUCKETS)
        self.prefill = hist("request_prefill_time_seconds", "Time from the first scheduling to the first token.", LATENCY_BUCKETS)
        self.decode = hist("request_decode_time_seconds", "Time from the first token to the last.", LATENCY_BUCKETS)
        self.prompt_len = hist("request_prompt_tokens", "Prompt tokens per request.", TOKEN_BUCKETS)
        self.gen_len = hist("request_generation_tokens", "Generated tokens per request.", TOKEN_BUCKETS)
        self.http = Counter("shoal:http_requests", "HTTP requests answered, by route and status.", ["route", "status"], registry=r)
        r.register(_SnapshotCollector(state))

    def observe(self, m: RequestMetrics) -> None:
        """A finished request's record into the histograms."""
        for hist, value in ((self.ttft, m.time_to_first_token), (self.tpot, m.time_per_output_token), (self.e2e, m.e2e_latency),
                            (self.queue, m.queue_time), (self.prefill, m.prefill_time), (self.decode, m.decode_time)):
            if value is not None:
                hist.observe(value)
        for gap in m.inter_token_latencies:
            self.itl.observe(gap)
        self.prompt_len.observe(m.prompt_tokens)
        self.gen_len.observe(m.generated_tokens)

    def count_http(self, route: str, status: int) -> None:
        self.http.labels(route, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _SnapshotCollector:
    """Counters and gauges read at scrape time from the engine's snapshot and the server's counters."""

    def __init__(self, state) -> None:
        self.state = state

    def describe(self):
        return []  # collected fresh at each scrape; nothing to check at registration

    def collect(self):
        state = self.state
        c = state.counters
        yield _counter("client_disconnects", "Requests aborted because their client went away.", c.client_disconnects)
        yield _counter("requests_rejected_overloaded", "Requests refused with 503 for --max-waiting.", c.rejected_overloaded)
        yield _gauge("model_loaded", "1 once the model is loaded and serving.", 1 if state.status == "ok" else 0)
        info = GaugeMetricFamily("shoal:build_info", "Version, model and how it runs.", labels=["version", "model", "dtype", "quantization", "device"])
        info.add_metric(list(state.build_info()), 1)
        yield info
        engine = state.engine
        if engine is None:
            return
        s = engine.snapshot
        n = s.counters
        yield _counter("prompt_tokens", "Prompt tokens of requests admitted.", n.prompt_tokens)
        yield _counter("prompt_tokens_cached", "Prompt tokens served from the prefix cache (or a fork's shared prompt).", n.cached_prompt_tokens)
        yield _counter("prompt_tokens_computed", "Prompt tokens the model computed.", s.computed_prompt_tokens)
        yield _counter("generation_tokens", "Tokens generated.", n.generated_tokens)
        done = CounterMetricFamily("shoal:request_success", "Requests finished, by finish reason.", labels=["finished_reason"])
        for reason in ("stop", "length", "abort", "error"):
            done.add_metric([reason], s.finished_by_reason.get(reason, 0))
        yield done
        yield _counter("request_aborts", "Requests aborted (client gone or abort()).", n.requests_aborted)
        yield _counter("num_preemptions", "Sequences preempted for lack of KV blocks (recomputed later).", n.preemptions)
        yield _counter("engine_steps", "Engine steps run.", n.steps)
        yield _gauge("num_requests_running", "Sequences in the running queue.", s.running)
        yield _gauge("num_requests_waiting", "Sequences waiting to be scheduled.", s.waiting)
        yield _gauge("kv_cache_usage_perc", "Fraction of KV blocks held by requests (cached, unreferenced blocks count as free).", s.kv_usage)
        yield _gauge("kv_cache_used_bytes", "KV cache bytes held by requests.", s.kv_used_bytes)
        yield _gauge("kv_cache_total_bytes", "KV cache bytes in the pool.", s.kv_total_bytes)
        if s.last_step is not None:
            yield _gauge("step_batch_size", "Sequences in the last engine step.", s.last_step.batch_size)
            yield _gauge("step_tokens", "Tokens computed in the last engine step.", s.last_step.num_tokens)
            yield _gauge("step_duration_seconds", "Duration of the last engine step.", s.last_step.duration)
        pc = s.prefix_cache
        if pc is not None:
            yield _counter("prefix_cache_queries", "Prefix-cache lookups.", pc["lookups"])
            hits = CounterMetricFamily("shoal:prefix_cache_hits", "Prefix-cache hits by kind.", labels=["kind"])
            for kind in ("extension", "supersequence", "divergence"):
                hits.add_metric([kind], pc[f"hits_{kind}"])
            yield hits
            yield _counter("prefix_cache_hit_tokens", "Prompt tokens the prefix cache served.", pc["hit_tokens"])
            yield _counter("prefix_cache_evictions", "Cached blocks evicted.", pc["evictions"])
            yield _gauge("prefix_cache_cached_blocks", "Blocks the prefix cache holds.", pc["cached_blocks"])
            yield _gauge("prefix_cache_cached_bytes", "KV bytes the prefix cache holds.", pc["cached_bytes"])


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(f"shoal:{name}", doc, value=value)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"shoal:{name}", doc, value=value)
