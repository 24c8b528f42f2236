"""What the HTTP side holds: the settings, the offered models (server/models.py), the metrics.

A handler asks for its model once (`admit` for generation, `model` for the rest) and reads everything else from
the `ServedModel` it gets: the engine through its public surface (`validate`, `num_waiting`, `tokenizer`,
`max_model_len`, `facts`, `snapshot`), requests through the `AsyncEngine`, the model's own settings and counters.

--max-waiting counts a request (per model) from the moment it is admitted: `admit` counts
it in its model's `admitted` until `release_admission` (streams.merged, as it hands the
request to the engine, which counts it from then) or the end of the HTTP
request (`serving`), whichever comes first.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from shoal.config import EngineConfig
from shoal.server.errors import unavailable
from shoal.server.metrics import ServerMetrics
from shoal.server.models import RETRY_LOADING_S, Lifecycle, ModelManager, ServedModel, ServerCounters, spec_for
from shoal.server.settings import ServerSettings

log = logging.getLogger("shoal.server")

# Seconds a client is told to wait (Retry-After) while the queue is full (a model loading: models.RETRY_LOADING_S).
RETRY_OVERLOADED_S = 1


class _Admission:
    """What one HTTP request holds: its models' leases (ModelManager.acquire) until it ends, and of each model's
    `admitted` count until it hands its requests to the engine."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.held: list[ServedModel] = []  # counted in their `admitted`
        self.leases: list[ServedModel] = []

    def release(self) -> None:
        for m in self.held:
            m.admitted -= 1
        self.held.clear()

    def end(self) -> None:
        self.release()
        for m in self.leases:
            self.state.models.release(m)
        self.leases.clear()


# The admission of the HTTP request being served: set by `ServerState.serving`
# (AccessMiddleware, around every request); the handler's tasks and threads
# inherit it, so `release_admission` finds it without being handed anything.
_ADMISSION: ContextVar[_Admission | None] = ContextVar("shoal_admission", default=None)


def release_admission() -> None:
    """The request being served is handed to the engine: from now on the engine counts it as waiting.

    Call it with no await between it and the hand-over (AsyncEngine.generate
    counts the request before its first await), so no moment counts it twice
    or not at all."""
    admission = _ADMISSION.get()
    if admission is not None:
        admission.release()


_HEALTH = {"loaded": "ok", "unloaded": "ok", "unloading": "ok", "loading": "loading", "failed": "failed"}


class ServerState:
    """`source`: an Engine to serve as it is, an EngineConfig, or the ModelSpecs of every offered model (the first
    is the default)."""

    def __init__(self, settings: ServerSettings, source=(), lifecycle: Lifecycle | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.metrics = ServerMetrics(self)  # Prometheus: /metrics (server/metrics.py)
        self.routes: frozenset[str] = frozenset()  # set by create_app
        self._engine = None if isinstance(source, (EngineConfig, list, tuple)) else source  # an Engine built elsewhere
        if self._engine is not None:
            source = self._engine.config
        if isinstance(source, EngineConfig):
            source = [spec_for(source, settings.served_model_name)]
        self.models = ModelManager(self, list(source), lifecycle or Lifecycle(), clock)

    # ------------------------------------------------------------ life cycle
    async def start(self, on_error: Callable[[BaseException], None] | None = None) -> None:
        """Serve the engine handed in, or preload what --preload says (AsyncEngine builds each on the thread that
        will step it, so /health answers meanwhile)."""
        if self._engine is not None:
            self.models.attach(self._engine)
            self._engine = None
        await self.models.start(on_error)

    def shutdown(self) -> None:
        self.models.shutdown()

    # ------------------------------------------------------------ the default model (one-model views)
    @property
    def default(self) -> ServedModel:
        return self.models.default

    @property
    def engine(self):
        """The default model's AsyncEngine (the door), None until it is loaded."""
        return self.default.engine

    @property
    def renderer(self):
        return self.default.renderer

    @property
    def token_strings(self):
        return self.default.token_strings

    @property
    def model_name(self) -> str:
        return self.default.name

    @property
    def status(self) -> str:
        """/health's word for the default model: ok (loaded, or loadable on demand), loading (its load at start
        included, before it began), or failed."""
        m = self.default
        return "loading" if m.status == "unloaded" and m in self.models.to_preload else _HEALTH[m.status]

    @property
    def load_error(self) -> str | None:
        return self.default.error

    @property
    def admitted(self) -> int:
        return sum(m.admitted for m in self.models.models.values())

    @property
    def counters(self) -> ServerCounters:
        """Every model's counters added up."""
        total = ServerCounters()
        for m in self.models.models.values():
            for f in dataclasses.fields(ServerCounters):
                setattr(total, f.name, getattr(total, f.name) + getattr(m.counters, f.name))
        return total

    # ------------------------------------------------------------ checks for handlers
    def require_ranks(self, m: ServedModel) -> None:
        """Generation needs every rank that holds part of the model."""
        if m.engine is not None and m.engine.failure is not None:
            raise unavailable(cluster_down_message(m), RETRY_LOADING_S, "cluster_unavailable")

    @property
    def request_byte_limit(self) -> int:
        """The body size limit now (it fits the largest loaded model's context; settings.py)."""
        loaded = [m.engine for m in self.models.models.values() if m.engine is not None]
        return self.settings.request_byte_limit(max((e.max_model_len for e in loaded), default=None),
                                                images=any(e.image_spec is not None for e in loaded))

    @contextmanager
    def serving(self) -> Iterator[_Admission]:
        """Around one HTTP request: what it was admitted for and did not hand to the engine is released at the end,
        at the latest (the middleware releases it before the response's last byte goes out: a client that has its
        answer never sees its request still counted); its models' leases end with it."""
        admission = _Admission(self)
        token = _ADMISSION.set(admission)
        try:
            yield admission
        finally:
            _ADMISSION.reset(token)
            admission.end()

    def check_capacity(self, m: ServedModel) -> None:
        """Refuse (503) while --max-waiting requests wait for `m`. No await between this
        check and `admit`'s count: simultaneous arrivals see each other."""
        limit = self.settings.max_waiting
        waiting = (m.engine.num_waiting if m.engine is not None else 0) + m.admitted
        if limit is not None and waiting >= limit:
            m.counters.rejected_overloaded += 1
            raise unavailable(
                f"the server is overloaded: {waiting} requests are waiting for model {m.name!r} "
                f"(--max-waiting {limit}); try again shortly",
                RETRY_OVERLOADED_S,
                "server_overloaded",
            )

    async def model(self, name: str | None, keep_alive=None) -> ServedModel:
        """The loaded model a request names, leased for the rest of the HTTP request (loaded first if need be;
        --max-waiting bounds the requests waiting for that)."""
        limit = self.settings.max_waiting
        wanted = self.models.find(name)
        if limit is not None and not wanted.loaded and wanted.waiting_load >= limit:
            wanted.counters.rejected_overloaded += 1
            raise unavailable(f"the server is overloaded: {wanted.waiting_load} requests are waiting for model "
                              f"{wanted.name!r} to load (--max-waiting {limit}); try again shortly", RETRY_LOADING_S,
                              "server_overloaded")
        m = await self.models.acquire(name, keep_alive)
        admission = _ADMISSION.get()
        if admission is not None:
            admission.leases.append(m)
        else:  # outside `serving` nothing would end the lease: the caller does not hold one
            self.models.release(m)
        return m

    async def admit(self, name: str | None, keep_alive=None) -> ServedModel:
        """Everything a generation request is checked for before its body is looked at closely; its model."""
        m = await self.model(name, keep_alive)
        self.require_ranks(m)
        self.check_capacity(m)
        admission = _ADMISSION.get()
        if admission is not None:  # outside `serving` nothing would release it
            admission.held.append(m)
            m.admitted += 1
        return m

    # ------------------------------------------------------------ stats
    def stats(self) -> dict:
        """/stats: the server's counters and the default model's figures at the top (as one model always had them),
        and every model's under "models"."""
        models = {m.name: model_stats(m) for m in self.models.models.values()}
        top = dict(models[self.default.name])
        top.update(status=self.status, model=self.default.name, **dataclasses.asdict(self.counters))
        top["in_flight_requests"] = top.pop("in_flight")
        top["rejected_overloaded"] = top.pop("rejected_overloaded")
        top["models"] = models
        return top


def cluster_down_message(m: ServedModel) -> str:
    then = "it is being started again; try again shortly" if m.engine.restarts_workers else "the server must be restarted"
    what = "a process holding part of the model (tensor or pipeline parallel)"
    down = m.engine.down_ranks()
    if down:
        what = f"rank {', '.join(map(str, down))}, {what},"
    return f"{what} is unreachable: {then}"


def model_stats(m: ServedModel) -> dict:
    """One model's figures: its life cycle and counters, and its engine's latest snapshot once it is loaded."""
    c = m.counters
    out = {
        "status": m.status,
        "model": m.name,
        "memory_bytes": m.memory,
        "total_requests": c.total_requests,
        "in_flight": c.in_flight,
        "finished_requests": c.finished_requests,
        "client_disconnects": c.client_disconnects,
        "failed_requests": c.failed_requests,
        "rejected_overloaded": c.rejected_overloaded,
    }
    if m.error:
        out["error"] = m.error
    e = m.engine
    if e is None:
        return out
    snap = e.snapshot  # frozen after the engine's last step: nothing here reads live engine objects
    out.update(
        active_requests=snap.running,
        waiting_requests=e.num_waiting,
        aborted_requests=snap.counters.requests_aborted,
        cache_usage=round(snap.kv_usage, 4),
        free_blocks=snap.kv_free_blocks,
        total_blocks=snap.kv_blocks,
        kv_used_bytes=snap.kv_used_bytes,
        kv_total_bytes=snap.kv_total_bytes,
        kv_cache_dtype=snap.facts.kv_cache_dtype,
        kv_bytes_per_token=snap.kv_bytes_per_token,
        kv_capacity_tokens=snap.kv_capacity_tokens,
        tokens_generated=snap.counters.generated_tokens,
        prompt_tokens=snap.counters.prompt_tokens,
        cached_prompt_tokens=snap.counters.cached_prompt_tokens,
        max_model_len=e.max_model_len,
        throughput={"prompt_tokens_per_s": dict(snap.prompt_throughput), "generation_tokens_per_s": dict(snap.generation_throughput)},
        last_step=dataclasses.asdict(snap.last_step) if snap.last_step else None,
        finished_by_reason=dict(snap.finished_by_reason),
        recent_requests=list(snap.recent_requests),
        engine={**dataclasses.asdict(snap.counters), "computed_prompt_tokens": snap.computed_prompt_tokens},
    )
    if snap.prefix_cache is not None:
        pc = dict(snap.prefix_cache)
        pc["token_hit_rate"] = round(pc["token_hit_rate"], 4)
        pc["hit_rate"] = round(pc["hits"] / pc["lookups"], 4) if pc["lookups"] else 0.0
        pc["average_match_fraction"] = round(pc["match_fraction_sum"] / pc["recorded_requests"], 4) if pc["recorded_requests"] else 0.0
        out["prefix_cache"] = pc
    if snap.kv_tier is not None:
        out["prefix_cache_tier"] = dict(snap.kv_tier)
    if snap.speculative is not None:
        out["speculative"] = {**snap.speculative, "acceptance_rate": round(snap.speculative["acceptance_rate"], 4)}
    if snap.vision is not None:
        out["vision"] = {**snap.vision, "images": snap.counters.images, "encode_seconds": round(snap.vision["encode_seconds"], 4)}
    return out
