"""The engine's published numbers: a frozen snapshot, after the steps. No torch.

The HTTP side never reads the block pool, the prefix cache or the queues while the
engine thread changes them. After a step the engine builds one `EngineSnapshot`
(plain, frozen data) and swaps it in with a single reference assignment; every
exporter (`/stats`, `/metrics`, the dashboard, the log summary) reads that. It does so
after every step that finished a request, computed prompt tokens (a request's blocks came in, and the next step may
be a long one) or left the engine with nothing to run, and otherwise once every PUBLISH_S: a decoding engine's
snapshot lags its steps by at most that.
Building one every step was about 0.07 ms of a 5.5 ms one-stream step (issue 53), for
readers that poll once a second; at most every 25 ms was still 12 µs a token on the default model (90 µs a
snapshot on the step's cold caches), at most every 100 ms is a quarter of that.

Besides the running counters a snapshot holds the last step's shape (batch size,
tokens, time), throughput over the last 10 and 60 seconds, and the records of the
last 100 finished requests, newest first (`RequestMetrics.to_dict()` plus the id).
"""

from __future__ import annotations

import dataclasses
from collections import Counter, deque
from dataclasses import dataclass, field
from types import MappingProxyType

from shoal.types import Pooling

RECENT_REQUESTS = 100
WINDOWS = (10.0, 60.0)
PUBLISH_S = 0.1  # while busy, the longest between two snapshots (engine clock): readers poll once a second


@dataclass
class EngineStats:
    """Plain running counters; the engine only increments them (a snapshot holds a copy)."""

    requests_added: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    preemptions: int = 0
    images: int = 0  # images in the requests added (a vision model's)


@dataclass(frozen=True)
class EngineFacts:
    """What the engine serves, fixed when it is built: the model, its format and where it runs."""

    model: str = ""  # as configured (a path or a name)
    path: str | None = None  # the checkpoint file or folder that was loaded
    architecture: str = ""
    dtype: str = ""
    device: str = ""
    weight_format: str = "none"  # the projections' format as built (quant.WeightFormat)
    kv_cache_dtype: str = ""  # what the KV cache holds (--kv-cache-dtype as resolved)
    weight_bytes: int = 0  # the model's tensors in this process (a rank's shard under tensor or pipeline parallelism)
    # the checkpoint's own sampling defaults (generation_config.json, GGUF metadata), for the layers above
    generation_defaults: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))
    pooling: Pooling | None = None  # how the model embeds (types.Pooling), None: it serves no embeddings

    @classmethod
    def of(cls, model, runner, **checkpoint) -> EngineFacts:
        """The facts of `runner` (this process's ModelRunner) serving `model`; `checkpoint`: what only the loaded
        checkpoint tells (path, weight_format, generation_defaults)."""
        return cls(model=str(model), architecture=runner.config.architecture, dtype=str(runner.dtype).removeprefix("torch."),
                   device=str(runner.device), kv_cache_dtype=str(runner.kv_dtype).removeprefix("torch."),
                   weight_bytes=runner.weight_bytes, **checkpoint)


@dataclass(frozen=True)
class StepStats:
    batch_size: int  # sequences in the step
    prefill_tokens: int  # prompt tokens computed (chunks)
    decode_tokens: int  # one per decoding sequence
    duration: float  # seconds: the forward, sampling and bookkeeping

    @property
    def num_tokens(self) -> int:
        return self.prefill_tokens + self.decode_tokens


@dataclass(frozen=True)
class EngineSnapshot:
    time: float
    facts: EngineFacts = field(default_factory=EngineFacts)
    counters: EngineStats = field(default_factory=EngineStats)  # a copy, never the engine's own
    computed_prompt_tokens: int = 0
    running: int = 0
    waiting: int = 0
    finished_by_reason: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))
    kv_blocks: int = 0
    kv_free_blocks: int = 0
    kv_block_bytes: int = 0
    kv_block_tokens: int = 0  # tokens a block holds
    cached_blocks: int = 0
    prefix_cache: MappingProxyType | None = None  # PrefixCacheStats' fields and its derived figures
    kv_tier: MappingProxyType | None = None  # the second tier's TierStats (engine/kv_tier.py); None: no tier
    speculative: MappingProxyType | None = None  # speculative decoding's counters (engine/speculative.py); None: off
    vision: MappingProxyType | None = None  # a vision model's encoder cache (runner/encoder_cache.py); None: text only
    experts: MappingProxyType | None = None  # tokens each expert took, per sparse layer (_experts_view); None: no experts
    last_step: StepStats | None = None
    prompt_throughput: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))  # window -> computed prompt tok/s
    generation_throughput: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))  # window -> tok/s
    recent_requests: tuple[dict, ...] = ()

    @property
    def kv_used_blocks(self) -> int:
        return self.kv_blocks - self.kv_free_blocks

    @property
    def kv_usage(self) -> float:
        """Blocks held by running and waiting sequences, as a fraction of the pool (cached, unreferenced ones count as free)."""
        return self.kv_used_blocks / self.kv_blocks if self.kv_blocks else 0.0

    @property
    def kv_used_bytes(self) -> int:
        return self.kv_used_blocks * self.kv_block_bytes

    @property
    def kv_total_bytes(self) -> int:
        return self.kv_blocks * self.kv_block_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """One token's keys and values over every layer, in the cache's dtype (an int8 cache's scales included)."""
        return self.kv_block_bytes // self.kv_block_tokens if self.kv_block_tokens else 0

    @property
    def kv_capacity_tokens(self) -> int:
        return self.kv_blocks * self.kv_block_tokens

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["counters"] = dataclasses.asdict(self.counters)
        d["facts"] = {**vars(self.facts), "generation_defaults": dict(self.facts.generation_defaults)}
        for k in ("finished_by_reason", "prefix_cache", "kv_tier", "speculative", "vision", "experts", "prompt_throughput",
                  "generation_throughput"):
            d[k] = dict(d[k]) if d[k] is not None else None
        d["last_step"] = dataclasses.asdict(self.last_step) if self.last_step else None
        d["recent_requests"] = list(self.recent_requests)
        d.update(kv_usage=self.kv_usage, kv_used_bytes=self.kv_used_bytes, kv_total_bytes=self.kv_total_bytes,
                 kv_bytes_per_token=self.kv_bytes_per_token, kv_capacity_tokens=self.kv_capacity_tokens)
        return d


class StatsMonitor:
    """Kept by the engine; only the engine thread calls it."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.snapshot = EngineSnapshot(time=engine.clock(), facts=engine.facts, kv_blocks=engine.pool.num_blocks, kv_free_blocks=engine.pool.num_free,
                                       kv_block_bytes=engine.runner.bytes_per_block, kv_block_tokens=engine.runner.block_size, prefix_cache=_cache_view(engine.prefix_cache),
                                       kv_tier=_tier_view(engine.tier), speculative=_spec_view(engine.speculator),
                                       vision=_vision_view(engine.runner), experts=_experts_view(engine.runner))
        self._last_step: StepStats | None = None
        self._computed_prompt_tokens = 0
        # per window: the samples (time, computed prompt tokens, generated tokens) no older than it, oldest first. One
        # deque a window, trimmed as time goes on, so a rate is its first and last sample: a scan of one deque over
        # a minute of samples for the shorter window was 0.25 ms a step after a minute of 5 ms steps
        self._windows: dict[float, deque[tuple[float, int, int]]] = {w: deque() for w in WINDOWS}
        self._recent: deque[dict] = deque(maxlen=RECENT_REQUESTS)
        self._recent_view: tuple[dict, ...] = ()
        self._reasons: Counter[str] = Counter()

    def step_done(self, sched, started: float) -> None:
        prefill = decode = 0
        for seq, n in sched.scheduled:
            # a step's tokens are prompt tokens while they are inside the prompt
            in_prompt = max(0, min(seq.prompt_len, seq.num_computed_tokens) - (seq.num_computed_tokens - n))
            prefill += in_prompt
            decode += n - in_prompt
        self._computed_prompt_tokens += prefill
        self._last_step = StepStats(len(sched.scheduled), prefill, decode, self.engine.clock() - started)

    def publish(self, outputs) -> None:
        e = self.engine
        now = e.clock()
        finished = False
        for out in outputs:
            if out.finished and out.metrics is not None:
                finished = True
                self._reasons[out.metrics.finish_reason or "unknown"] += 1
                self._recent.appendleft({"request_id": out.request_id, **out.metrics.to_dict()})
                self._recent_view = ()
        s = e.stats
        sample = (now, self._computed_prompt_tokens, s.generated_tokens)
        for w, samples in self._windows.items():
            samples.append(sample)
            while now - samples[0][0] > w:  # the newest, of age 0, always stays
                samples.popleft()
        last = self._last_step
        if not finished and not (last is not None and last.prefill_tokens) and now - self.snapshot.time < PUBLISH_S and e.has_unfinished():
            return  # busy decoding, and the snapshot is recent: the next one will have this step's numbers too
        if not self._recent_view and self._recent:
            self._recent_view = tuple(self._recent)
        cache = e.prefix_cache
        self.snapshot = EngineSnapshot(
            time=now,
            facts=e.facts,
            counters=dataclasses.replace(s),
            computed_prompt_tokens=self._computed_prompt_tokens,
            running=e.num_running,
            waiting=e.num_waiting,
            finished_by_reason=MappingProxyType(dict(self._reasons)),
            kv_blocks=e.pool.num_blocks,
            kv_free_blocks=e.pool.num_free,
            kv_block_bytes=e.runner.bytes_per_block,
            kv_block_tokens=e.runner.block_size,
            cached_blocks=cache.stats.cached_blocks if cache is not None else 0,
            prefix_cache=_cache_view(cache),
            kv_tier=_tier_view(e.tier),
            speculative=_spec_view(e.speculator),
            vision=_vision_view(e.runner),
            experts=_experts_view(e.runner),
            last_step=self._last_step,
            prompt_throughput=self._rates(now, 1),
            generation_throughput=self._rates(now, 2),
            recent_requests=self._recent_view,
        )

    def _rates(self, now: float, column: int) -> MappingProxyType:
        """Tokens per second over each window: from the oldest sample inside it to now."""
        out = {}
        for w, samples in self._windows.items():
            base, latest = samples[0], samples[-1]
            span = now - base[0]
            out[f"{w:g}s"] = (latest[column] - base[column]) / span if span > 0 else 0.0
        return MappingProxyType(out)


def _fields(stats) -> dict:
    """A counters dataclass's fields, numbers and names: a shallow copy. (dataclasses.asdict deep-copies each
    value, which made the snapshot of every step, taken after each one, 0.09 ms of a 5 ms one-stream step.)"""
    return dict(vars(stats))


def _cache_view(cache) -> MappingProxyType | None:
    """The prefix cache's figures as the snapshot holds them (None without a cache)."""
    if cache is None:
        return None
    pc = cache.stats
    return MappingProxyType({**_fields(pc), "hits": pc.hits, "token_hit_rate": pc.token_hit_rate,
                             "cached_bytes": pc.cached_bytes, "pool_bytes": pc.pool_bytes})


def _tier_view(tier) -> MappingProxyType | None:
    """The second tier's figures as the snapshot holds them (None without a tier)."""
    if tier is None:
        return None
    return MappingProxyType({**_fields(tier.stats), "bytes": tier.stats.bytes})


def _spec_view(speculator) -> MappingProxyType | None:
    """Speculative decoding's counters as the snapshot holds them (None when it is off)."""
    if speculator is None:
        return None
    st = speculator.stats
    return MappingProxyType({"proposer": speculator.name, "max_draft_tokens": speculator.max_tokens,
                             "max_batch": speculator.max_batch, "draft_cost": speculator.draft_cost, **_fields(st),
                             "acceptance_rate": st.acceptance_rate, "steps_off": speculator.steps_off})


def _vision_view(runner) -> MappingProxyType | None:
    """The vision tower's encoder-cache counters (None for a text-only model)."""
    encoder = getattr(runner, "encoder", None)
    if encoder is None:
        return None
    return MappingProxyType({**_fields(encoder.stats), "capacity_bytes": encoder.capacity})


def _experts_view(runner) -> MappingProxyType | None:
    """A mixture-of-experts model's routing counts (runner.expert_tokens, layers.ExpertCounts): the sparse layers'
    indices and, per layer, the tokens each expert took; None for a model without experts."""
    counts = getattr(runner, "expert_tokens", None)
    if counts is None:
        return None
    return MappingProxyType({"layers": counts.layers, "tokens": tuple(map(tuple, counts.read()))})
