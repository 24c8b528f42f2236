"""Prometheus metrics for `GET /metrics`, through prometheus_client.

Names start with `shoal:` and follow vLLM's (`vllm:time_to_first_token_seconds` is
`shoal:time_to_first_token_seconds` here), so existing dashboards port with a rename. Every series of shoal's
own families carries `model_name`, as vLLM's do (one server may offer several models: server/models.py);
the HTTP counter and the process collectors' are the server's, without it.
Two sources, so nothing is counted twice and a scrape costs the engine thread nothing:

- per-request histograms, observed once when a request ends, from the `RequestMetrics`
  record the engine filled (`RequestTracker.finish` calls `observe`);
- everything else, read at scrape time from the engine's frozen snapshot
  (`engine/stats.py`) and the HTTP side's counters, by a custom collector.

The process and platform collectors of prometheus_client stay on. Each app has its own
registry, so several servers in one process (the tests) do not share numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client import GCCollector, PlatformCollector, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from shoal.types import RequestMetrics

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# No `*_created` series: a third of a scrape's lines, which nothing here reads (vLLM drops them too).
disable_created_metrics()

# vLLM's buckets (with finer ones below 0.3 s for the latencies), so its dashboards' quantiles read the same here.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
# vLLM starts these at 0.3 s; on a CPU a queue or a prefill often takes milliseconds, so finer buckets come first.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


@dataclass(frozen=True)
class Family:
    """One metric family as `/metrics` serves it: the docs' metrics reference is generated from these."""

    name: str
    type: str  # counter | gauge | histogram | info | summary (prometheus_client's names)
    help: str
    labels: tuple[str, ...] = ()


def _hist(name: str, help: str, buckets: tuple) -> tuple[Family, tuple]:
    return Family(f"shoal:{name}", "histogram", help, ("model_name", "protocol")), buckets


# Observed once per finished request, from its RequestMetrics record (ServerMetrics.observe), by model and by the
# protocol the request came in by (PROTOCOLS).
HISTOGRAMS = {
    "ttft": _hist("time_to_first_token_seconds", "Time from arrival to the first generated token.", TTFT_BUCKETS),
    "itl": _hist("inter_token_latency_seconds", "Time between a request's tokens: the gap between the steps that gave it "
                 "tokens, split evenly over a step's several.", ITL_BUCKETS),
    "tpot": _hist("request_time_per_output_token_seconds", "Decode time per output token after the first, per request.", ITL_BUCKETS),
    "e2e": _hist("e2e_request_latency_seconds", "Time from arrival to the end of the request.", LATENCY_BUCKETS),
    "queue": _hist("request_queue_time_seconds", "Time from arrival to the first step that scheduled the request.", LATENCY_BUCKETS),
    "prefill": _hist("request_prefill_time_seconds", "Time from the first scheduling to the first token.", LATENCY_BUCKETS),
    "decode": _hist("request_decode_time_seconds", "Time from the first token to the last.", LATENCY_BUCKETS),
    "prompt_len": _hist("request_prompt_tokens", "Prompt tokens per request.", TOKEN_BUCKETS),
    "gen_len": _hist("request_generation_tokens", "Generated tokens per request.", TOKEN_BUCKETS),
}
# The `protocol` label of the request histograms: each adapter package passes its own to RequestTracker.
PROTOCOLS = ("openai_chat", "openai_completions", "openai_responses", "openai_embeddings", "openai_rerank", "anthropic_messages",
             "ollama_chat", "ollama_generate", "ollama_embed")
HTTP_REQUESTS = Family("shoal:http_requests", "counter", "HTTP requests answered, by route and status (unknown paths count as `other`).", ("route", "status"))

# Read at scrape time from each model's engine snapshot and counters (_SnapshotCollector); each gets model_name first.
SNAPSHOT = {f.name.removeprefix("shoal:"): replace(f, labels=("model_name", *f.labels)) for f in (
    Family("shoal:client_disconnects", "counter", "Requests aborted because their client went away."),
    Family("shoal:requests_rejected_overloaded", "counter", "Requests refused with 503 for --max-waiting."),
    Family("shoal:model_loaded", "gauge", "1 while the model is loaded and serving: 0 while it is not (unloaded, loading, failed), "
           "and while a rank holding part of it is lost."),
    Family("shoal:model_memory_bytes", "gauge", "Memory the model takes when loaded (weights, KV pool and workspace): "
           "measured once loaded, estimated before (the --models-memory budget counts it)."),
    Family("shoal:model_loads", "counter", "Times the model was loaded."),
    Family("shoal:build_info", "gauge", "Version, model and how it runs (always 1).", ("version", "model", "dtype", "quantization", "device")),
    Family("shoal:prompt_tokens", "counter", "Prompt tokens of requests admitted."),
    Family("shoal:prompt_tokens_cached", "counter", "Prompt tokens served from the prefix cache (or a fork's shared prompt)."),
    Family("shoal:prompt_tokens_computed", "counter", "Prompt tokens the model computed."),
    Family("shoal:generation_tokens", "counter", "Tokens generated."),
    Family("shoal:request_success", "counter", "Requests finished, by finish reason.", ("finished_reason",)),
    Family("shoal:request_aborts", "counter", "Requests aborted (client gone or abort())."),
    Family("shoal:num_preemptions", "counter", "Sequences preempted for lack of KV blocks (recomputed later)."),
    Family("shoal:engine_steps", "counter", "Engine steps run."),
    Family("shoal:num_requests_running", "gauge", "Sequences in the running queue."),
    Family("shoal:num_requests_waiting", "gauge", "Sequences waiting to be scheduled."),
    Family("shoal:kv_cache_usage_perc", "gauge", "Fraction of KV blocks held by requests (cached, unreferenced blocks count as free)."),
    Family("shoal:kv_cache_used_bytes", "gauge", "KV cache bytes held by requests."),
    Family("shoal:kv_cache_total_bytes", "gauge", "KV cache bytes in the pool."),
    Family("shoal:kv_cache_bytes_per_token", "gauge", "KV cache bytes one token takes over every layer, in the cache's dtype "
           "(--kv-cache-dtype; int8's scales included)."),
    Family("shoal:kv_cache_capacity_tokens", "gauge", "Tokens the KV pool holds."),
    Family("shoal:step_batch_size", "gauge", "Sequences in the last engine step."),
    Family("shoal:step_tokens", "gauge", "Tokens computed in the last engine step."),
    Family("shoal:step_duration_seconds", "gauge", "Duration of the last engine step."),
    Family("shoal:prefix_cache_queries", "counter", "Prefix-cache lookups."),
    Family("shoal:prefix_cache_hits", "counter", "Prefix-cache hits by kind.", ("kind",)),
    Family("shoal:prefix_cache_hit_tokens", "counter", "Prompt tokens the prefix cache served."),
    Family("shoal:prefix_cache_evictions", "counter", "Cached blocks evicted."),
    Family("shoal:prefix_cache_cached_blocks", "gauge", "Blocks the prefix cache holds."),
    Family("shoal:prefix_cache_cached_bytes", "gauge", "KV bytes the prefix cache holds."),
    Family("shoal:prefix_cache_tier_enabled", "gauge", "1 while the prefix cache's second tier (--prefix-cache-dir or "
           "--prefix-cache-host-bytes) takes blocks; 0 after it turned itself off (the disk filled up)."),
    Family("shoal:prefix_cache_tier_bytes", "gauge", "Bytes the second tier holds."),
    Family("shoal:prefix_cache_tier_capacity_bytes", "gauge", "Bytes the second tier may hold."),
    Family("shoal:prefix_cache_tier_spilled_blocks", "counter", "Evicted blocks written to the second tier."),
    Family("shoal:prefix_cache_tier_hits", "counter", "Admissions that restored blocks from the second tier."),
    Family("shoal:prefix_cache_tier_restored_blocks", "counter", "Blocks restored from the second tier instead of computed."),
    Family("shoal:prefix_cache_tier_restored_bytes", "counter", "Bytes restored from the second tier."),
    Family("shoal:prefix_cache_tier_recomputed_blocks", "counter", "Blocks found in the second tier but computed, "
           "because computing measured cheaper than reading them."),
    Family("shoal:prefix_cache_tier_evictions", "counter", "Entries the second tier dropped for room (W-TinyLFU)."),
    Family("shoal:prefix_cache_tier_rejected_entries", "counter", "Tier entries ignored: truncated, corrupted, or written by "
           "another configuration."),
    Family("shoal:spec_decode_num_drafts", "counter", "Drafts verified by speculative decoding, by proposer (ngram | draft).",
           ("proposer",)),
    Family("shoal:spec_decode_num_draft_tokens", "counter", "Drafted tokens verified, by proposer.", ("proposer",)),
    Family("shoal:spec_decode_num_accepted_tokens", "counter", "Drafted tokens the target agreed with (kept), by proposer.",
           ("proposer",)),
    Family("shoal:spec_decode_acceptance_rate", "gauge", "Accepted over drafted tokens since the start, by proposer.",
           ("proposer",)),
    Family("shoal:spec_decode_steps_off", "counter", "Steps with too many decoding sequences to draft in (compute-bound: "
           "--speculative-max-batch)."),
    Family("shoal:request_images", "counter", "Images in the requests added (zero for a text-only model, as the encoder's are)."),
    Family("shoal:encoder_runs", "counter", "Images the vision tower encoded."),
    Family("shoal:encoder_cache_hits", "counter", "Image embeddings found in the encoder cache instead of encoded again."),
    Family("shoal:encoder_seconds", "counter", "Time in the vision tower."),
    Family("shoal:encoder_cache_bytes", "gauge", "Bytes of image embeddings the encoder cache holds (--encoder-cache-memory)."),
    Family("shoal:moe_expert_tokens", "counter", "Tokens routed to each expert of each sparse layer (a mixture-of-experts "
           "model's; on this process's layers).", ("layer", "expert")),
)}

DEFAULT_COLLECTORS = (ProcessCollector, PlatformCollector, GCCollector)


def catalog() -> list[Family]:
    """Every family `/metrics` can serve, shoal's own and prometheus_client's collectors'."""
    families = [f for f, _ in HISTOGRAMS.values()] + [HTTP_REQUESTS] + list(SNAPSHOT.values())
    scratch = CollectorRegistry()
    for make in DEFAULT_COLLECTORS:
        for m in make(registry=scratch).collect():
            labels = tuple(dict.fromkeys(k for s in m.samples for k in s.labels))
            families.append(Family(m.name, m.type, m.documentation, labels))
    return families


class ServerMetrics:
    def __init__(self, state) -> None:
        self.registry = r = CollectorRegistry()
        for make in DEFAULT_COLLECTORS:
            make(registry=r)
        for attr, (family, buckets) in HISTOGRAMS.items():
            setattr(self, attr, Histogram(family.name, family.help, list(family.labels), buckets=buckets, registry=r))
        self.http = Counter(HTTP_REQUESTS.name, HTTP_REQUESTS.help, list(HTTP_REQUESTS.labels), registry=r)
        r.register(_SnapshotCollector(state))

    def observe(self, m: RequestMetrics, model_name: str, protocol: str) -> None:
        """A finished request's record into the histograms. protocol: one of PROTOCOLS."""
        labels = (model_name, protocol)
        for hist, value in ((self.ttft, m.time_to_first_token), (self.tpot, m.time_per_output_token), (self.e2e, m.e2e_latency),
                            (self.queue, m.queue_time), (self.prefill, m.prefill_time), (self.decode, m.decode_time)):
            if value is not None:
                hist.labels(*labels).observe(value)
        itl = self.itl.labels(*labels)
        for gap in m.inter_token_latencies:
            itl.observe(gap)
        self.prompt_len.labels(*labels).observe(m.prompt_tokens)
        self.gen_len.labels(*labels).observe(m.generated_tokens)

    def count_http(self, route: str, status: int) -> None:
        self.http.labels(route, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _SnapshotCollector:
    """Counters and gauges read at scrape time from every model's engine snapshot and counters."""

    def __init__(self, state) -> None:
        self.state = state

    def describe(self):
        return []  # collected fresh at each scrape; nothing to check at registration

    def collect(self):
        samples: dict[str, dict[tuple, float]] = {}
        for m in self.state.models.models.values():
            for key, value in _model_samples(m):
                labels = value if isinstance(value, dict) else {(): value}
                into = samples.setdefault(key, {})
                for k, v in labels.items():
                    into[(m.name, *k)] = v
        for key, values in samples.items():  # one family per name, every model's series in it
            f = SNAPSHOT[key]
            family = (CounterMetricFamily if f.type == "counter" else GaugeMetricFamily)(f.name, f.help, labels=list(f.labels))
            for labels, v in values.items():
                family.add_metric(list(labels), v)
            yield family


def _model_samples(m):
    """(family key, value or {label values: value}) of one model."""
    c = m.counters
    yield "client_disconnects", c.client_disconnects
    yield "requests_rejected_overloaded", c.rejected_overloaded
    engine = m.engine
    serving = m.loaded and engine is not None and engine.failure is None  # a lost rank: /health says 503 too
    yield "model_loaded", 1 if serving else 0
    yield "model_memory_bytes", m.memory
    yield "model_loads", m.loads
    yield "build_info", {m.build_info(): 1}
    if engine is None:
        return
    s = engine.snapshot
    n = s.counters
    yield "prompt_tokens", n.prompt_tokens
    yield "prompt_tokens_cached", n.cached_prompt_tokens
    yield "prompt_tokens_computed", s.computed_prompt_tokens
    yield "generation_tokens", n.generated_tokens
    yield "request_success", {(r,): s.finished_by_reason.get(r, 0) for r in ("stop", "length", "abort", "error")}
    yield "request_aborts", n.requests_aborted
    yield "num_preemptions", n.preemptions
    yield "engine_steps", n.steps
    yield "num_requests_running", s.running
    yield "num_requests_waiting", s.waiting
    yield "kv_cache_usage_perc", s.kv_usage
    yield "kv_cache_used_bytes", s.kv_used_bytes
    yield "kv_cache_total_bytes", s.kv_total_bytes
    yield "kv_cache_bytes_per_token", s.kv_bytes_per_token
    yield "kv_cache_capacity_tokens", s.kv_capacity_tokens
    if s.last_step is not None:
        yield "step_batch_size", s.last_step.batch_size
        yield "step_tokens", s.last_step.num_tokens
        yield "step_duration_seconds", s.last_step.duration
    pc = s.prefix_cache
    if pc is not None:
        yield "prefix_cache_queries", pc["lookups"]
        yield "prefix_cache_hits", {(k,): pc[f"hits_{k}"] for k in ("extension", "supersequence", "divergence")}
        yield "prefix_cache_hit_tokens", pc["hit_tokens"]
        yield "prefix_cache_evictions", pc["evictions"]
        yield "prefix_cache_cached_blocks", pc["cached_blocks"]
        yield "prefix_cache_cached_bytes", pc["cached_bytes"]
    tier = s.kv_tier
    if tier is not None:
        yield "prefix_cache_tier_enabled", int(tier["enabled"])
        for key in ("bytes", "capacity_bytes", "spilled_blocks", "hits", "restored_blocks", "restored_bytes",
                    "recomputed_blocks", "evictions", "rejected_entries"):
            yield f"prefix_cache_tier_{key}", tier[key]
    spec = s.speculative
    if spec is not None:
        label = (spec["proposer"],)
        yield "spec_decode_num_drafts", {label: spec["drafts"]}
        yield "spec_decode_num_draft_tokens", {label: spec["drafted_tokens"]}
        yield "spec_decode_num_accepted_tokens", {label: spec["accepted_tokens"]}
        yield "spec_decode_acceptance_rate", {label: spec["acceptance_rate"]}
        yield "spec_decode_steps_off", spec["steps_off"]
    vision = s.vision or {}  # a text-only model's stay at zero
    yield "request_images", s.counters.images
    yield "encoder_runs", vision.get("images_encoded", 0)
    yield "encoder_cache_hits", vision.get("cache_hits", 0)
    yield "encoder_seconds", vision.get("encode_seconds", 0.0)
    yield "encoder_cache_bytes", vision.get("cached_bytes", 0)
    experts = s.experts or {"layers": (), "tokens": ()}  # a model without experts: the family, with no series
    yield "moe_expert_tokens", {(str(layer), str(e)): n for layer, row in zip(experts["layers"], experts["tokens"])
                                for e, n in enumerate(row)}
