"""What the HTTP side holds: the engine (once loaded), its names, the chat renderer, counters.

Handlers read the engine only through its public surface: `validate`,
`num_running`/`num_waiting`, `stats`, `pool`, `tokenizer`, `max_model_len`,
`facts` (what is served); requests go through the `AsyncEngine`.

--max-waiting counts a request from the moment it is admitted: `admit` counts
it in `admitted` until `release_admission` (streams.merged, as it hands the
request to the engine, which counts it from then) or the end of the HTTP
request (`serving`), whichever comes first.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

from shoal import __version__
from shoal.config import EngineConfig
from shoal.server.chat.render import TokenStrings
from shoal.server.chat.template import ChatRenderer
from shoal.server.errors import APIError, unavailable
from shoal.server.metrics import ServerMetrics
from shoal.server.settings import ServerSettings

log = logging.getLogger("shoal.server")

# Seconds a client is told to wait (Retry-After) while the model loads / the queue is full.
RETRY_LOADING_S = 5
RETRY_OVERLOADED_S = 1


@dataclass
class ServerCounters:
    """Plain counters of the HTTP side; /stats reads them."""

    total_requests: int = 0  # generation requests accepted (chat + completions)
    in_flight: int = 0
    finished_requests: int = 0
    client_disconnects: int = 0  # requests aborted because their client went away
    failed_requests: int = 0  # engine failures (500)
    rejected_overloaded: int = 0  # 503s for --max-waiting


class _Admission:
    """What one HTTP request holds of `ServerState.admitted`."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.held = 0

    def release(self) -> None:
        self.state.admitted -= self.held
        self.held = 0


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


class ServerState:
    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.status = "loading"  # loading | ok | failed
        self.load_error: str | None = None
        self.engine = None
        self.aengine = None
        self.renderer: ChatRenderer | None = None
        self.token_strings: TokenStrings | None = None  # token id -> text, for logprobs
        self.model_name = settings.served_model_name or "shoal"
        self.model_aliases: frozenset[str] = frozenset()
        self.generation_defaults: dict = {}
        self.created = int(time.time())
        self.counters = ServerCounters()
        self.metrics = ServerMetrics(self)  # Prometheus: /metrics (server/metrics.py)
        self.routes: frozenset[str] = frozenset()  # set by create_app
        # Requests admitted (passed --max-waiting) and not yet handed to the
        # engine: between the two a handler awaits (rendering in a thread), and
        # requests arriving together would all see the same engine queue.
        self.admitted = 0

    # ------------------------------------------------------------ life cycle
    async def load(self, config: EngineConfig, on_error: Callable[[BaseException], None] | None = None) -> None:
        """Build the engine on the thread that will step it (see AsyncEngine), so /health answers meanwhile."""
        from shoal.engine import builder
        from shoal.engine.async_engine import AsyncEngine

        if self.settings.served_model_name is None:
            self.model_name = config.model
        t0 = time.perf_counter()
        try:
            aengine = AsyncEngine(lambda: builder.build_engine(config))
            self.attach(await asyncio.wrap_future(aengine.ready), aengine)
        except Exception as e:  # anything: the server must say so, not die silently
            self.status = "failed"
            self.load_error = f"{type(e).__name__}: {e}" if not isinstance(e, (ValueError, FileNotFoundError)) else str(e)
            log.error("the model failed to load: %s", self.load_error)
            if on_error is not None:
                on_error(e)
            return
        log.info("model %s ready in %.1f s; serving as %r", config.model, time.perf_counter() - t0, self.model_name)

    def attach(self, engine, aengine=None) -> None:
        """Serve `engine`, through `aengine` when it already runs one (else a new AsyncEngine)."""
        from shoal.engine.async_engine import AsyncEngine

        self.engine = engine
        facts = engine.facts
        model_arg = engine.config.model
        if self.settings.served_model_name is None:
            self.model_name = model_arg
        names = {self.model_name, model_arg}
        path = facts.path
        if path is not None:
            path = Path(path)
            names |= {str(path), path.name, path.stem}
            if path.is_file():  # a .gguf: its folder names it too
                names.add(str(path.parent))
        self.model_aliases = frozenset(names)
        self.generation_defaults = dict(facts.generation_defaults)
        self.renderer = ChatRenderer(engine.tokenizer, self.settings.chat_template)
        self.token_strings = TokenStrings(engine.tokenizer)
        self.aengine = aengine if aengine is not None else AsyncEngine(engine)
        self.status = "ok"
        log.info("chat template: %s", self.renderer.source)

    def shutdown(self) -> None:
        if self.aengine is not None:
            self.aengine.shutdown()

    def build_info(self) -> tuple[str, str, str, str, str]:
        """(version, model, dtype, quantization, device) of what is served."""
        e = self.engine
        if e is None:
            return (__version__, self.model_name, "", "", "")
        f = e.facts
        return (__version__, self.model_name, f.dtype, f.weight_format, f.device)

    # ------------------------------------------------------------ checks for handlers
    def require_engine(self) -> None:
        if self.status == "loading":
            raise unavailable("the model is still loading; try again shortly", RETRY_LOADING_S, "model_loading")
        if self.status == "failed":
            raise APIError(503, f"the model failed to load: {self.load_error}", code="model_load_failed")

    def require_ranks(self) -> None:
        """Generation needs every rank that holds part of the model."""
        if self.engine is not None and self.engine.executor.failure is not None:
            raise unavailable(self.cluster_down_message, RETRY_LOADING_S, "cluster_unavailable")

    @property
    def cluster_down_message(self) -> str:
        then = "it is being started again; try again shortly" if self.engine.config.parallel.restart_workers else "the server must be restarted"
        what = "a process holding part of the model (tensor or pipeline parallel)"
        down = self.engine.executor.down_ranks()
        if down:
            what = f"rank {', '.join(map(str, down))}, {what},"
        return f"{what} is unreachable: {then}"

    def check_model(self, name: str | None) -> None:
        if name is None or name == "" or name in self.model_aliases:
            return
        raise APIError(
            404,
            f"model {name!r} does not exist: this server serves {self.model_name!r}",
            param="model",
            code="model_not_found",
        )

    @property
    def request_byte_limit(self) -> int:
        """The body size limit now (it fits the model's context once one is loaded; settings.py)."""
        return self.settings.request_byte_limit(self.engine.max_model_len if self.engine is not None else None)

    @contextmanager
    def serving(self) -> Iterator[_Admission]:
        """Around one HTTP request: what it was admitted for and did not hand to the engine is released at the end,
        at the latest (the middleware releases it before the response's last byte goes out: a client that has its
        answer never sees its request still counted)."""
        admission = _Admission(self)
        token = _ADMISSION.set(admission)
        try:
            yield admission
        finally:
            _ADMISSION.reset(token)
            admission.release()

    def check_capacity(self) -> None:
        """Refuse (503) while --max-waiting requests wait. No await between this
        check and `admit`'s count: simultaneous arrivals see each other."""
        limit = self.settings.max_waiting
        waiting = (self.aengine.num_waiting if self.aengine is not None else 0) + self.admitted
        if limit is not None and waiting >= limit:
            self.counters.rejected_overloaded += 1
            raise unavailable(
                f"the server is overloaded: {waiting} requests are waiting "
                f"(--max-waiting {limit}); try again shortly",
                RETRY_OVERLOADED_S,
                "server_overloaded",
            )

    def admit(self, model: str | None) -> None:
        """Everything a generation request is checked for before its body is looked at closely."""
        self.require_engine()
        self.check_model(model)
        self.require_ranks()
        self.check_capacity()
        admission = _ADMISSION.get()
        if admission is not None:  # outside `serving` nothing would release it
            admission.held += 1
            self.admitted += 1

    # ------------------------------------------------------------ stats
    def stats(self) -> dict:
        c = self.counters
        out = {
            "status": self.status,
            "model": self.model_name,
            "total_requests": c.total_requests,
            "in_flight_requests": c.in_flight,
            "finished_requests": c.finished_requests,
            "client_disconnects": c.client_disconnects,
            "failed_requests": c.failed_requests,
            "rejected_overloaded": c.rejected_overloaded,
        }
        e = self.engine
        if e is None:
            return out
        snap = e.snapshot  # frozen after the engine's last step: nothing here reads live engine objects
        out.update(
            active_requests=snap.running,
            waiting_requests=self.aengine.num_waiting if self.aengine is not None else snap.waiting,
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
        return out
