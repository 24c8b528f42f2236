"""The models a server offers, and their life cycle: load on demand, unload when idle, a memory budget.

One `ServedModel` per offered model holds what the handlers use of it (engine, renderer, its settings) once it
is loaded; `ModelManager` owns them all and is the only code that loads or unloads one. Everything here runs on
the server's event loop; a load builds the engine on the thread that will step it (AsyncEngine), awaited.

A model is `unloaded`, `loading`, `loaded`, `unloading`, or `failed` (with the reason). A request takes a lease
on its model (`acquire` ... `release`, held for the whole HTTP request, stream included):

- an unloaded model is loaded first (--models-autoload), and requests for a model that is loading wait for it,
  up to --model-load-timeout, then get a 503 with Retry-After;
- a model with leases is never evicted; an unload waits for them (up to --model-drain-timeout), then ends what
  is left with a 503 that says the model was unloaded;
- an idle model is unloaded after its keep-alive: the request's `keep_alive`, else the model's, else the
  server's (--keep-alive, 5 minutes). Ollama's values: a duration, 0 (unload once idle), negative (never).

Admission by memory: a model counts its weights, its KV pool and a workspace (an estimate from the checkpoint's
files before its first load; measured after it). A load that would pass --models-memory (or --models-max
loaded models) first unloads the least recently used idle models; if that is not enough the load is refused:
507 when the model could never fit the budget, 503 with Retry-After while other models' requests hold the room.

Models step at the same time, each on its engine's thread; `--models-step-turns` makes them take turns
(`StepTurns`, engine/async_engine.py). Why the default is what it is: docs/guides/several-models.md.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import logging
import math
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from shoal.config import EngineConfig
from shoal.engine.async_engine import AsyncEngine, StepTurns, estimate_bytes, start_engine, within_budget
from shoal.server.errors import APIError, bad_request, unavailable

log = logging.getLogger("shoal.server")

DEFAULT_KEEP_ALIVE_S = 300.0  # Ollama's 5 minutes
RETRY_LOADING_S = 5  # Retry-After (seconds) while a model loads
# Per-model settings a config may give besides the engine's: the ServerSettings fields they replace.
MODEL_SERVER_FIELDS = ("chat_template", "reasoning_parser", "tool_call_parser")
# A model's name in a URL or a body: what a name can be (a Hugging Face id like org/name included), and nothing
# that reads as a path outside it.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+/-]{0,199}")
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_keep_alive(value, where: str = "keep_alive") -> float:
    """Ollama's keep_alive as seconds: a number of seconds or a duration ("30s", "10m", "1h30m"); 0 unloads once
    idle; a negative value keeps the model loaded (math.inf)."""
    if isinstance(value, bool) or value is None:
        raise ValueError(f"{where} must be a number of seconds or a duration such as '5m', not {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        text = str(value).strip()
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("+-")
        try:
            seconds = sign * float(body)
        except ValueError:
            parts = _DURATION.findall(body)
            if not body or "".join(n + u for n, u in parts) != body:
                raise ValueError(f"{where} must be a number of seconds or a duration such as '5m', '1h30m' or '-1', "
                                 f"not {value!r}") from None
            seconds = sign * sum(float(n) * _DURATION_UNITS[u] for n, u in parts)
    if math.isnan(seconds):
        raise ValueError(f"{where} must be a number, not NaN")
    return math.inf if seconds < 0 else seconds


def check_name(name: str, param: str = "model") -> None:
    """A 400 for a model name that is not one (a path, '..', odd characters): it is only ever looked up."""
    if not _NAME.fullmatch(name) or ".." in name or "//" in name or name.endswith("/"):
        raise bad_request(f"{name[:100]!r} is not a model name: names are letters, digits and . _ - : @ + /, "
                          "and a model is never a path taken from a request", param)


@dataclass(frozen=True)
class ModelSpec:
    """One offered model: its API name, its engine settings and its own server settings."""

    name: str
    config: EngineConfig
    overrides: dict = field(default_factory=dict)  # MODEL_SERVER_FIELDS this model sets
    keep_alive: float | None = None  # seconds; None: the server's --keep-alive
    aliases: tuple[str, ...] = ()  # other names that reach it (its file or folder name)

    def __post_init__(self) -> None:
        unknown = set(self.overrides) - set(MODEL_SERVER_FIELDS)
        if unknown:
            raise ValueError(f"model {self.name!r}: unknown settings {', '.join(sorted(unknown))}")


def spec_for(config: EngineConfig, name: str | None = None, **kw) -> ModelSpec:
    """The spec of `config.model`, named `name` (default: the --model value), reachable also by its file's or
    folder's name (as one model always was)."""
    from shoal.model.loader import resolve_model_path

    names = {config.model}
    try:
        path = resolve_model_path(config.model)
    except (ValueError, FileNotFoundError):
        path = None  # a bad path fails when the model loads, and says so there
    if path is not None:
        names |= {str(path), path.name, path.stem}
        if path.is_file():  # a .gguf: its folder names it too
            names.add(str(path.parent))
    name = name or config.model
    return ModelSpec(name, config, aliases=tuple(sorted(names - {name})), **kw)


def specs_in_dir(root: str | Path, template: EngineConfig) -> list[ModelSpec]:
    """--models-dir: every .gguf (mmproj files aside) and Hugging Face folder (config.json) directly in `root`, named
    by file stem or folder name, with `template`'s engine settings. A folder holding one .gguf and an mmproj .gguf
    beside it is a vision model as llama.cpp's router lays one out, named by the folder."""
    root = Path(root).expanduser()
    if not root.is_dir():
        raise ValueError(f"--models-dir {root} is not a directory")
    found = []
    for p in sorted(root.iterdir()):
        if p.is_file() and p.suffix == ".gguf" and not _is_mmproj(p):
            found.append(ModelSpec(p.stem, dataclasses.replace(template, model=str(p)), aliases=(p.name,)))
        elif p.is_dir() and (p / "config.json").is_file():
            found.append(ModelSpec(p.name, dataclasses.replace(template, model=str(p))))
        elif p.is_dir():
            ggufs = sorted(p.glob("*.gguf"))
            models, projs = [f for f in ggufs if not _is_mmproj(f)], [f for f in ggufs if _is_mmproj(f)]
            if len(models) == 1 and len(projs) <= 1:
                mmproj = str(projs[0]) if projs else None
                found.append(ModelSpec(p.name, dataclasses.replace(template, model=str(models[0]), mmproj=mmproj)))
    if not found:
        raise ValueError(f"--models-dir {root} holds no .gguf file and no model folder (one with config.json)")
    return found


def _is_mmproj(path: Path) -> bool:
    return "mmproj" in path.name.lower()


@dataclass
class ServerCounters:
    """Plain counters of the HTTP side; /stats reads them."""

    total_requests: int = 0  # generation requests accepted (chat + completions)
    in_flight: int = 0
    finished_requests: int = 0
    client_disconnects: int = 0  # requests aborted because their client went away
    failed_requests: int = 0  # engine failures (500)
    rejected_overloaded: int = 0  # 503s for --max-waiting


class ServedModel:
    """One offered model: what handlers read of it (the same names a single-model server always had), and its
    life-cycle state, which only ModelManager changes."""

    def __init__(self, spec: ModelSpec, server, budget: int | None = None) -> None:
        self.spec = spec
        self.name = spec.name
        self.config = within_budget(spec.config, budget)
        self.names = frozenset({spec.name, *spec.aliases})
        self.settings = dataclasses.replace(server.settings, **spec.overrides)  # this model's server settings
        self.counters = ServerCounters()  # this model's requests
        self.metrics = server.metrics
        self.status = "unloaded"
        self.error: str | None = None
        self.engine = None  # engine/async_engine.AsyncEngine: the one door into the model's engine, once loaded
        self.renderer = None
        self.token_strings = None
        self.generation_defaults: dict = {}
        self.in_use = 0  # leases: HTTP requests using the model
        self.admitted = 0  # of those, not yet handed to the engine (--max-waiting)
        self.waiting_load = 0  # requests waiting for it to load (--max-waiting counts them too)
        self.last_used = 0.0  # the manager's clock
        self.expires = math.inf  # when it unloads if idle (the manager's clock)
        self.ttl = math.inf  # seconds idle before it unloads, as the last request asked (ModelManager._touch)
        self.memory = estimate_bytes(self.config)
        self.measured = False  # memory is measured (after a load), not estimated
        self.loaded_at: float | None = None  # time.time() of the last load
        self.loads = 0  # loads that succeeded
        self.load_seconds: float | None = None
        self._loading: asyncio.Future | None = None  # resolves when a load in progress ends
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def model_name(self) -> str:
        return self.name

    @property
    def loaded(self) -> bool:
        return self.status == "loaded"

    def attach(self, engine) -> None:
        """Serve `engine` (an AsyncEngine, loaded)."""
        from shoal.server.chat.render import TokenStrings
        from shoal.chat_template import ChatRenderer

        self.engine = engine
        self.generation_defaults = dict(engine.facts.generation_defaults)
        self.renderer = ChatRenderer(engine.tokenizer, self.settings.chat_template)
        self.token_strings = TokenStrings(engine.tokenizer)
        self.status = "loaded"
        self.error = None
        self.loaded_at = time.time()
        self.loads += 1
        self.memory = engine.memory_bytes
        self.measured = True
        log.info("model %s: chat template %s", self.name, self.renderer.source)

    def build_info(self) -> tuple[str, str, str, str, str]:
        """(version, model, dtype, quantization, device): what /metrics' build_info says of it."""
        from shoal import __version__

        f = self.engine.facts if self.engine is not None else None
        return (__version__, self.name, *((f.dtype, f.weight_format, f.device) if f is not None else ("", "", "")))

    def detach(self) -> None:
        self.engine = self.renderer = self.token_strings = None
        self.generation_defaults = {}

    @property
    def takes_images(self) -> bool:
        """Whether the model has a vision tower: the loaded engine's answer, or before a load its config's."""
        if self.engine is not None:
            return self.engine.image_spec is not None
        return self.config.mmproj is not None or has_vision_config(self.config.model)

    def card(self) -> dict:
        """What GET /v1/models says of it."""
        out = {
            "id": self.name,
            "object": "model",
            "created": int(self.loaded_at or 0),
            "owned_by": "shoal",
            "root": Path(self.config.model).name,  # the file or folder's name only: never the server's layout
            "status": {"value": self.status, **({"reason": self.error} if self.error else {})},
            "memory_bytes": self.memory,
            "memory_measured": self.measured,
            "modalities": {"input": ["text", "image"] if self.takes_images else ["text"], "output": ["text"]},
            "in_flight": self.in_use,
        }
        if self.engine is not None:
            out["max_model_len"] = self.engine.max_model_len
        return out


@lru_cache(maxsize=64)
def has_vision_config(model: str) -> bool:
    """Whether a Hugging Face folder's config.json describes a vision tower (read once; a GGUF's: no)."""
    try:
        return "vision_config" in json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return False


@dataclass(frozen=True)
class Lifecycle:
    """The manager's knobs (the serve flags of the same names)."""

    autoload: bool = True  # --models-autoload: load a model on its first request
    preload: str = "default"  # --preload: default (the first model) | all | none
    memory: int | None = None  # --models-memory: bytes all loaded models may take; None: no budget
    max_loaded: int | None = None  # --models-max
    keep_alive: float = DEFAULT_KEEP_ALIVE_S  # --keep-alive
    default_fallback: bool = False  # --default-model-fallback: unknown names go to the default model
    load_timeout: float = 120.0  # --model-load-timeout: longest a request waits for its model to load
    drain_timeout: float = 30.0  # --model-drain-timeout: longest an unload waits for requests in flight
    step_turns: bool = False  # --models-step-turns: one model's step at a time instead of all at once

    def __post_init__(self) -> None:
        if self.preload not in ("default", "all", "none"):
            raise ValueError(f"preload must be default, all or none, not {self.preload!r}")
        for name in ("memory", "max_loaded"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} must be positive, got {v}")
        for name in ("load_timeout", "drain_timeout"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


class ModelManager:
    def __init__(self, server, specs: Iterable[ModelSpec], lifecycle: Lifecycle = Lifecycle(),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.server = server
        self.lifecycle = lifecycle
        self.clock = clock
        self.models: dict[str, ServedModel] = {}
        self._by_name: dict[str, ServedModel] = {}
        for spec in specs:
            if spec.name in self.models:
                raise ValueError(f"two models are named {spec.name!r}: give one another name (alias)")
            m = ServedModel(spec, server, lifecycle.memory)
            self.models[spec.name] = m
        for m in self.models.values():  # the names given win over the file names derived from them
            self._by_name[m.name] = m
        for m in self.models.values():
            for alias in m.names:
                self._by_name.setdefault(alias, m)
        if not self.models:
            raise ValueError("a server needs at least one model")
        self.turns = StepTurns() if lifecycle.step_turns else None
        self._subscribers: set[asyncio.Queue] = set()
        self._reaper: asyncio.Task | None = None
        self.loop: asyncio.AbstractEventLoop | None = None  # the server's, once started
        self.preloaded = False  # every --preload model has loaded (or failed)
        # --preload's models not loaded yet: from the start, so that /health says "loading" before their load begins
        self.to_preload = {"default": [self.default], "all": list(self.models.values()), "none": []}[lifecycle.preload]
        self._lock = asyncio.Lock()  # one admission decision (and its evictions) at a time

    # ------------------------------------------------------------ names
    @property
    def default(self) -> ServedModel:
        return next(iter(self.models.values()))

    def find(self, name: str | None) -> ServedModel:
        """The model a request names (none: the default): 404 for an unknown name (or the default, with
        --default-model-fallback), 400 for something that is not a name."""
        if name is None or name == "":
            return self.default
        m = self._by_name.get(name)
        if m is not None:
            return m
        check_name(name)
        if self.lifecycle.default_fallback:
            return self.default
        offered = ", ".join(repr(n) for n in list(self.models)[:20])
        raise APIError(404, f"model {name!r} does not exist: this server offers {offered}", param="model", code="model_not_found")

    # ------------------------------------------------------------ leases
    async def acquire(self, name: str | None, keep_alive=None) -> ServedModel:
        """The loaded model for a request, leased until `release`; loads it first when it is not (and may)."""
        m = self.find(name)
        ttl = None if keep_alive is None else _request_keep_alive(keep_alive)
        await self.ready(m)
        m.in_use += 1
        m._idle.clear()
        self._touch(m, ttl if ttl is not None else self.keep_alive_of(m))
        return m

    def keep_alive_of(self, m: ServedModel) -> float:
        return m.spec.keep_alive if m.spec.keep_alive is not None else self.lifecycle.keep_alive

    def release(self, m: ServedModel) -> None:
        m.in_use -= 1
        self._touch(m, None)
        if m.in_use == 0:
            m._idle.set()
            if m.status in ("unloaded", "failed") and m.engine is not None:  # unloaded under this lease
                _let_go(m)
            if m.expires <= self.clock() and m.loaded:  # keep_alive 0: unload now that it is idle
                asyncio.get_running_loop().create_task(self._unload_quietly(m, "its keep_alive ran out"))

    def _touch(self, m: ServedModel, ttl: float | None) -> None:
        """`m` is used now: it expires `ttl` seconds after (a request's keep_alive; None: the lease's, else the
        model's own, else the server's)."""
        if ttl is not None:
            m.ttl = ttl
        m.last_used = self.clock()
        m.expires = m.last_used + m.ttl

    async def ready(self, m: ServedModel) -> None:
        """Return once `m` is loaded: load it (autoload) or wait for the load in progress, bounded."""
        deadline = self.clock() + self.lifecycle.load_timeout
        m.waiting_load += 1
        try:
            await self._ready(m, deadline)
        finally:
            m.waiting_load -= 1

    async def _ready(self, m: ServedModel, deadline: float) -> None:
        while not m.loaded:
            if m.status == "unloading":  # loaded again once that is over
                if self.clock() > deadline:
                    raise unavailable(f"model {m.name!r} is being unloaded; try again shortly", RETRY_LOADING_S, "model_unloading")
                await asyncio.sleep(0.02)
                continue
            if m.status in ("unloaded", "failed"):
                if not self.lifecycle.autoload:
                    why = f" (its last load failed: {m.error})" if m.status == "failed" else ""
                    raise APIError(503, f"model {m.name!r} is not loaded{why}; load it with POST /v1/models",
                                   code="model_not_loaded")
                self.start_load(m)
            waiting = m._loading
            left = deadline - self.clock()
            if waiting is None or left <= 0:
                raise _still_loading(m)
            try:
                await asyncio.wait_for(asyncio.shield(waiting), timeout=left)
            except TimeoutError:
                raise _still_loading(m) from None
            if m.status == "failed":
                raise _load_failed(m)

    # ------------------------------------------------------------ loading
    def start_load(self, m: ServedModel) -> asyncio.Future:
        """Begin loading `m` (once: a load in progress is joined); the future resolves when the load ends."""
        if m._loading is None or m._loading.done():
            if m.loaded:
                done = asyncio.get_running_loop().create_future()
                done.set_result(None)
                return done
            m._loading = asyncio.ensure_future(self._load(m))
            m._loading.add_done_callback(lambda f: f.cancelled() or f.exception())  # raised to whoever awaits it
        return m._loading

    async def load(self, name: str) -> ServedModel:
        """POST /v1/models: load `name` and wait for it; a failed load is an error here."""
        m = self.find(name)
        await self.start_load(m)
        if m.status == "failed":
            raise _load_failed(m)
        self._touch(m, self.keep_alive_of(m))
        return m

    async def _load(self, m: ServedModel) -> None:
        async with self._lock:
            while m.status == "unloading":  # an unload of it in progress ends first
                await asyncio.sleep(0.01)
            if m.loaded:
                return
            if not m.measured:  # what the machine has changed since the last estimate (other models came and went)
                m.memory = await asyncio.to_thread(estimate_bytes, m.config)
            await self._make_room(m)  # refused: the model stays as it was, and the caller hears why
            m.status, m.error = "loading", None
            self._emit(m)
        log.info("model %s: loading %s (%.0f MiB, %s)", m.name, m.config.model, m.memory / 2**20,
                 "measured at its last load" if m.measured else "estimated from its files")
        t0 = time.perf_counter()
        engine = start_engine(m.config, turns=self.turns, name=f"shoal-engine-{m.name}")
        try:
            await asyncio.wrap_future(engine.ready)
        except Exception as e:  # anything: the server must say so, not die
            m.status = "failed"
            m.error = str(e) if isinstance(e, (ValueError, FileNotFoundError)) else f"{type(e).__name__}: {e}"
            log.error("model %s failed to load: %s", m.name, m.error)
            self._emit(m)
            return
        except asyncio.CancelledError:  # the server stops mid-load: the thread stops once the build is over
            engine.shutdown("the server is shutting down", wait=False)
            raise
        m.attach(engine)
        m.load_seconds = time.perf_counter() - t0
        self._touch(m, self.keep_alive_of(m))
        log.info("model %s ready in %.1f s (%.0f MiB: weights, KV pool and workspace)", m.name, m.load_seconds, m.memory / 2**20)
        self._emit(m)

    async def _make_room(self, m: ServedModel) -> None:
        """Unload least recently used idle models until `m` fits the budget (memory and count); refuse if it cannot."""
        budget, most = self.lifecycle.memory, self.lifecycle.max_loaded
        if budget is not None and m.memory > budget:
            raise APIError(507, f"model {m.name!r} needs {_mib(m.memory)} (weights, KV pool and workspace) and the "
                           f"memory budget is {_mib(budget)} (--models-memory)", code="model_too_large")

        def holders() -> list[ServedModel]:
            return [o for o in self.models.values() if o is not m and o.status in ("loaded", "loading", "unloading")]

        def fits() -> bool:
            held = holders()
            return (budget is None or sum(o.memory for o in held) + m.memory <= budget) and (most is None or len(held) < most)

        while not fits():
            idle = sorted((o for o in holders() if o.loaded and o.in_use == 0), key=lambda o: o.last_used)
            if not idle:
                busy = ", ".join(o.name for o in holders())
                raise unavailable(f"model {m.name!r} does not fit beside the models in use ({busy}) within "
                                  f"{_limits(budget, most)}; try again when they are idle", RETRY_LOADING_S, "models_busy")
            victim = idle[0]
            log.info("model %s: unloading it (least recently used) to make room for %s", victim.name, m.name)
            await self._unload(victim, f"model {victim.name!r} was unloaded to make room for {m.name!r}")

    # ------------------------------------------------------------ unloading
    async def unload(self, name: str) -> ServedModel:
        """DELETE /v1/models/{name}: drain, then unload (a model that is not loaded is left as it is)."""
        m = self.find(name)
        if m._loading is not None and not m._loading.done():
            await asyncio.shield(m._loading)
        if m.loaded:
            await self._unload(m, f"model {m.name!r} was unloaded while this request ran")
        return m

    async def unload_all(self) -> list[ServedModel]:
        loaded = [m for m in self.models.values() if m.loaded or m.status == "loading"]
        await asyncio.gather(*(self.unload(m.name) for m in loaded))
        return loaded

    async def _unload_quietly(self, m: ServedModel, why: str) -> None:
        if m.loaded and m.in_use == 0:
            log.info("model %s: unloading it, idle (%s)", m.name, why)
            await self._unload(m, f"model {m.name!r} was unloaded ({why})")

    async def _unload(self, m: ServedModel, reason: str) -> None:
        if not m.loaded:
            return
        m.status = "unloading"
        self._emit(m)
        if m.in_use:
            log.info("model %s: waiting up to %.0f s for %d requests in flight", m.name, self.lifecycle.drain_timeout, m.in_use)
            try:
                await asyncio.wait_for(m._idle.wait(), timeout=self.lifecycle.drain_timeout)
            except TimeoutError:
                log.warning("model %s: %d requests still in flight after %.0f s end now", m.name, m.in_use, self.lifecycle.drain_timeout)
        # Requests still in the engine end with `reason`; later ones from leases still held get it too.
        await asyncio.to_thread(m.engine.shutdown, reason)
        if m.in_use == 0:  # else the last lease lets go (`release`): its handler may still read the engine
            _let_go(m)
        m.status = "unloaded"
        m.expires = math.inf
        log.info("model %s unloaded", m.name)
        self._emit(m)

    async def expire(self) -> list[str]:
        """Unload every loaded, idle model whose keep-alive has run out; their names. The reaper calls this once
        a second; tests call it with a fake clock."""
        now = self.clock()
        due = [m for m in self.models.values() if m.loaded and m.in_use == 0 and m.expires <= now]
        for m in due:
            await self._unload_quietly(m, "its keep-alive ran out")
        return [m.name for m in due]

    # ------------------------------------------------------------ running
    async def start(self, on_default_error: Callable[[BaseException], None] | None = None) -> None:
        """Preload what --preload says, and start the keep-alive reaper."""
        self.loop = asyncio.get_running_loop()
        self._reaper = asyncio.create_task(self._reap())
        for m in list(self.to_preload):
            try:
                await self.start_load(m)
            except APIError as e:  # refused by the budget: it says why, and the server goes on
                m.status, m.error = "failed", e.message
                log.error("model %s cannot be loaded: %s", m.name, e.message)
            self.to_preload.remove(m)
            if m is self.default and m.status == "failed" and on_default_error is not None:
                on_default_error(RuntimeError(m.error))
        self.preloaded = True

    def attach(self, engine) -> ServedModel:
        """Serve an engine built elsewhere as the default model (tests, `LLM`-style embedding)."""
        m = self.default
        m.attach(AsyncEngine(engine, turns=self.turns))
        if m in self.to_preload:
            self.to_preload.remove(m)
        m.spec = dataclasses.replace(m.spec, keep_alive=math.inf)  # not ours to unload when idle: it was handed in
        self._touch(m, math.inf)
        self._emit(m)
        return m

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            try:
                await self.expire()
            except Exception:  # the reaper must outlive any one failed unload
                log.exception("unloading idle models failed")

    def shutdown(self) -> None:
        """The server is stopping: end every engine (blocking; the event loop is closing)."""
        if self._reaper is not None:
            self._reaper.cancel()
        for m in self.models.values():
            if m._loading is not None and not m._loading.done():
                m._loading.cancel()
            if m.engine is not None:
                m.engine.shutdown("the server is shutting down")

    # ------------------------------------------------------------ events
    def subscribe(self) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue(maxsize=1000)
        self._subscribers.add(q)
        return q

    def unsubscribe(self, q: asyncio.Queue) -> None:
        self._subscribers.discard(q)

    def _emit(self, m: ServedModel) -> None:
        event = {"model": m.name, "status": m.status, **({"reason": m.error} if m.error else {}), "time": time.time()}
        for q in list(self._subscribers):
            try:
                q.put_nowait(event)
            except asyncio.QueueFull:  # a reader that does not read loses events, not the server
                pass


def _still_loading(m: ServedModel) -> APIError:
    return unavailable(f"model {m.name!r} is still loading; try again shortly", RETRY_LOADING_S, "model_loading")


def _load_failed(m: ServedModel) -> APIError:
    return APIError(503, f"model {m.name!r} failed to load: {m.error}", code="model_load_failed")


def _let_go(m: ServedModel) -> None:
    """Drop the engine of an unloaded model, and give its memory back to the system now: a collection frees its
    tensors (weights, KV pool), and glibc's malloc_trim returns the freed heap pages it would otherwise keep for
    later allocations (the weights' tensors are small enough to live in the heap)."""
    import ctypes

    m.detach()
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the memory goes back when the allocator decides
        pass


def _request_keep_alive(value) -> float:
    try:
        return parse_keep_alive(value)
    except ValueError as e:
        raise bad_request(str(e), "keep_alive") from None


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


def _limits(budget: int | None, most: int | None) -> str:
    parts = ([f"the memory budget of {_mib(budget)} (--models-memory)"] if budget is not None else []) + (
        [f"{most} loaded models (--models-max)"] if most is not None else [])
    return " and ".join(parts)
