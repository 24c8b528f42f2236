"""AsyncEngine: the one door into a model's engine, with the step loop in a background thread.

The HTTP side never touches the Engine, its runner or its executor: everything the server may do with a
model goes through the methods and properties here (generate, abort, check, tokenizer and sizes, images,
health and cluster state, stats), each plain data or a thread-safe call, so that the engine could live in
another process behind the same interface. A layout test holds the server to it.

Requests are commands (add, abort) put into a thread-safe inbox; the loop applies them between steps and
hands each request's outputs back to the asyncio loop that asked for them. A client that goes away cancels
its iterator, which sends an abort, applied at the next step. A request is checked once: `check` (the
server calls it at the edge, in a worker thread) is the whole of it, and `generate(checked=True)` trusts it.

Given a function that builds the engine instead of an engine, the loop's
thread builds it first: loading and stepping must happen on the same thread.
Every thread that runs a parallel torch op owns an OpenMP (libgomp) pool; once
the pools' threads outnumber the cores, libgomp cuts its spin-wait short and
every parallel region pays a sleep and wake-up. A model loaded on one thread and
stepped on another decoded 1.6x slower on 2 cores (benchmarks/NOTES.md).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from shoal.config import EngineConfig
from shoal.engine.engine import Engine
from shoal.engine.stats import EngineFacts
from shoal.multimodal import pixel_digest
from shoal.runner.kv_sizing import WORKSPACE
from shoal.types import GenerationRequest, Pooling, PoolingParams, RequestOutput, SamplingParams

if TYPE_CHECKING:
    from shoal.model.vision import PreparedImage, VisionSpec

log = logging.getLogger("shoal.engine")
SUMMARY_INTERVAL_S = 10.0
RESTART_BACKOFF_S = 5.0  # between tries to bring lost ranks back (--restart-workers)


class EngineDeadError(RuntimeError):
    """The step itself failed (the model's forward): every request in flight ends with it."""


class EngineUnavailable(EngineDeadError):
    """A process holding part of the model was lost (tensor or pipeline parallel): the request cannot finish,
    and none can run until the ranks are back (503 with Retry-After)."""


class RequestFailed(RuntimeError):
    """This request alone failed; the message is safe to show the client."""


class EngineStopped(EngineDeadError):
    """The engine was shut down (its model unloaded, or the server stopping) with this request still in it; the
    message is safe to show the client."""


class StepTurns:
    """Engines that share one take turns at stepping, first come first served (a ticket lock).

    Several models in one server each have an engine and a thread, and by default they step at the same time:
    on the 2-core hosts measured, one small model's step leaves the cores idle much of the time (Python
    bookkeeping, sampling, single-threaded stretches), and two models at once gave 1.3-1.7x the tokens of one,
    where turns gave 0.9-1.1x (docs/guides/several-models.md). Turns (--models-step-turns) are for models whose
    steps already keep every core busy: each step then has the cores to itself, and a model waits at most one
    step of each other model.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._next = 0  # the next ticket handed out
        self._serving = 0  # the ticket whose step runs now

    @contextmanager
    def turn(self) -> Iterator[None]:
        with self._cond:
            ticket = self._next
            self._next += 1
            while ticket != self._serving:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._serving += 1
                self._cond.notify_all()


@dataclass
class _Sink:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item) -> bool:
        """Hand item to its consumer's event loop; False when that loop is closed (nobody will read it)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # a client that ran its own loop (asyncio.run) and left without closing its stream
            return False
        return True


@dataclass(frozen=True)
class _Model:
    """What the door tells of a model that stays fixed while it is served."""

    tokenizer: object
    max_model_len: int
    vocab_size: int
    facts: EngineFacts
    image_spec: VisionSpec | None
    world_size: int
    restarts_workers: bool
    snapshot: object = None  # the engine's last, once it is gone

    @classmethod
    def of(cls, engine: Engine) -> _Model:
        par = engine.config.parallel
        return cls(engine.tokenizer, engine.max_model_len, engine.vocab_size, engine.facts,
                   engine.vision.spec if engine.vision is not None else None, par.world_size, par.restart_workers)


class AsyncEngine:
    def __init__(self, engine: Engine | Callable[[], Engine], turns: StepTurns | None = None, name: str = "shoal-engine") -> None:
        """`engine`: an Engine, or a function that builds one on the loop's thread (see the module docstring).
        `ready` resolves (to None: it keeps no reference to the engine, which may be unloaded while the future
        lives on) once `self.engine` is there, or to the build's exception. `turns`: shared with the
        other engines of the process, so that their steps take turns (StepTurns)."""
        self._turns = turns
        self._stop_reason = "the server is shutting down"
        self._drained = False  # set once the loop is over and the inbox emptied (_end_remaining)
        self._build = None if isinstance(engine, Engine) else engine
        self.engine: Engine | None = engine if self._build is None else None
        self._model: _Model | None = _Model.of(self.engine) if self.engine is not None else None
        self.ready: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox: queue.Queue = queue.Queue()
        self._sinks: dict[str, _Sink] = {}
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._queued_adds = 0  # submitted, not yet handed to the engine
        self._expected = 0  # requests that finished together in the step that left the engine idle
        self._last_summary = time.monotonic()
        self._next_restart = 0.0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ the door: requests
    async def generate(self, request: GenerationRequest, checked: bool = False) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as they come; the last has finished=True.

        checked: the request has passed `check` (the server's edge), so it is not checked again. Raises
        ValueError (before any output) when the engine rejects the request, RequestFailed when it failed on its
        own (others go on), EngineDeadError when the whole step failed.
        """
        engine = self.engine
        if engine is None:  # shut down (or still building: the server never routes a request here then)
            raise EngineStopped(self._stop_reason)
        if not checked:
            engine.validate(request)  # read-only: safe from this thread
        sink = _Sink(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            if self._drained:  # the loop is over: nothing would ever take this in
                raise EngineStopped(self._stop_reason)
            self._queued_adds += 1
            self._post(("add", request, sink))
        finished = False
        try:
            while True:
                item = await sink.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.error is not None:
                    finished = True  # the engine has already let go of it
                    raise RequestFailed(item.error)
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:  # the consumer went away (the client disconnected)
                self._post(("abort", request.request_id, True))

    def _post(self, command: tuple) -> None:
        """A command for the engine thread: into the inbox, and a decode run under way ends after its current forward
        (Engine.interrupt_run), so an arrival or an abort waits one forward, not the run."""
        self._inbox.put(command)
        engine = self.engine
        if engine is not None:
            engine.interrupt_run()

    def abort(self, request_id: str) -> None:
        self._post(("abort", request_id, False))

    def embedding_request(self, request_id: str, token_ids: list[int], dimensions: int | None = None, priority: int = 0,
                          arrival_time: float | None = None) -> GenerationRequest:
        """A prompt-only request for the pooled vector of `token_ids` (engine/pooled.py), pooled as the model
        embeds (`pooling`), cut to `dimensions` and renormalized where given. Not checked yet: `check` it (in a
        worker thread), then `embed` or `generate(checked=True)` it; its final output's `embedding` is the vector."""
        pooling = self.pooling
        mode, normalize = (pooling.mode, pooling.normalize) if pooling is not None else ("last", True)
        return GenerationRequest(request_id, tuple(token_ids), SamplingParams(max_tokens=None), priority=priority,
                                 arrival_time=arrival_time, pooling=PoolingParams(mode, normalize, dimensions))

    async def embed(self, request: GenerationRequest, checked: bool = False) -> RequestOutput:
        """A pooling request's final output (its `embedding`); raises as `generate` does."""
        final = None
        async for out in self.generate(request, checked=checked):
            final = out
        return final

    def check(self, request: GenerationRequest) -> None:
        """Everything the engine alone knows about a request (its ids within the vocabulary, its length within
        the context, its images' placeholders, its grammar compiled and cached): ValueError with a message for
        the user. Read-only and thread-safe; may take long (a grammar), so the server calls it in a worker
        thread. EngineStopped once the model was unloaded."""
        engine = self.engine
        if engine is None:
            raise EngineStopped(self._stop_reason)
        engine.validate(request)

    # ------------------------------------------------------------ the door: the model
    # What does not change while the model is served, kept when the engine is built, so that a handler still
    # holding its lease can read it after an unload has let the engine go.
    @property
    def tokenizer(self):
        """The model's transformers tokenizer (read-only use: encode, decode, its chat template)."""
        return self._model.tokenizer

    @property
    def max_model_len(self) -> int:
        """The context served, in tokens: a prompt and its output together."""
        return self._model.max_model_len

    @property
    def vocab_size(self) -> int:
        return self._model.vocab_size

    @property
    def pooling(self) -> Pooling | None:
        """How the model embeds (its files' pooling, or --embeddings'), None: it serves no embeddings."""
        return self.facts.pooling

    @property
    def facts(self) -> EngineFacts:
        """What is served, fixed at build time (plain data)."""
        return self._model.facts

    @property
    def snapshot(self):
        """The numbers as of the last step (engine/stats.py, plain data); after the engine is gone, its last."""
        engine = self.engine
        return engine.snapshot if engine is not None else self._model.snapshot

    @property
    def memory_bytes(self) -> int:
        """What the loaded model holds: its weights and KV pool on every rank, and a step's workspace."""
        world = self.world_size
        return self.facts.weight_bytes * world + self.snapshot.kv_total_bytes * world + WORKSPACE

    @property
    def image_spec(self) -> VisionSpec | None:
        """A vision model's image token (id and text); None for a text-only model."""
        return self._model.image_spec

    def prepare_image(self, image, detail: str | None = None, encode: bool = True) -> PreparedImage:
        """A decoded RGB image -> its tokens and tiles (the model's own processor, keyed by its pixels); with
        `encode`, the tower runs on its tiles now, beside the engine's steps, and caches what it gives
        (runner/encoder_cache.py). Thread-safe: the server prepares a request's images in a pool."""
        engine = self.engine
        if engine is None:
            raise EngineStopped(self._stop_reason)
        prepared = engine.vision.prepare(image, pixel_digest(image), detail)
        for tile in prepared.tiles if encode else ():
            engine.runner.encoder.warm(tile)
        return prepared

    @property
    def restarts_workers(self) -> bool:
        """Whether lost ranks are started again (--restart-workers)."""
        return self._model.restarts_workers

    @property
    def world_size(self) -> int:
        """The processes that hold the model (tensor x pipeline parallel)."""
        return self._model.world_size

    # ------------------------------------------------------------ the door: health
    @property
    def failure(self) -> str | None:
        """Why no step can run (a rank of a distributed model is gone), or None."""
        engine = self.engine
        return engine.executor.failure if engine is not None else None

    def down_ranks(self) -> list[int]:
        engine = self.engine
        return engine.executor.down_ranks() if engine is not None else []

    def cluster(self) -> dict:
        """Every rank's place, host and state (GET /cluster)."""
        return self.engine.executor.cluster()

    @property
    def num_waiting(self) -> int:
        """Requests waiting to run: in the engine's queue, or submitted and not yet taken in."""
        engine = self.engine
        return (engine.num_waiting if engine is not None else 0) + self._queued_adds

    def shutdown(self, reason: str | None = None, wait: bool = True) -> None:
        """Stop the loop and release the engine; requests still in it end with EngineStopped(`reason`). `wait`:
        until the loop's thread is gone (up to 10 s)."""
        if reason is not None:
            self._stop_reason = reason
        self._stopped.set()
        self._post(("stop", None, None))
        if wait:
            self._thread.join(timeout=10)

    @property
    def stopped(self) -> bool:
        """The loop has ended (its thread is gone): nothing of the engine is in use any more."""
        return not self._thread.is_alive()

    # ------------------------------------------------------------ engine thread
    def _run(self) -> None:
        if self._build is not None:
            try:
                self.engine = self._build()
                self._model = _Model.of(self.engine)
            except BaseException as exc:  # the server reports it; nothing to loop over
                self.ready.set_exception(exc)
                return
        try:
            self.ready.set_result(None)
        except concurrent.futures.InvalidStateError:  # the load was cancelled (the server stopped): nobody steps it
            self._stopped.set()
        try:
            self._loop()
        finally:
            self._end_remaining()
            self.engine.close()  # stop the other ranks, if any (this thread ran their collectives)
            # Shut down for good: whoever still holds this object (a caller's frame, a thread pool's last work
            # item) does not hold the engine's memory (weights, KV pool) with it.
            self._model = replace(self._model, snapshot=self.engine.snapshot) if self._model is not None else None
            self.engine = None

    def _end_remaining(self) -> None:
        """The loop is over: whoever still waits on a request (in the engine, or still in the inbox) hears why."""
        err = EngineStopped(self._stop_reason)
        with self._lock:
            self._drained = True
        sinks = list(self._sinks.values())
        self._sinks.clear()
        while True:
            try:
                kind, _, sink = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                sinks.append(sink)
        for sink in sinks:
            sink.put(err)

    def _loop(self) -> None:
        while not self._stopped.is_set():
            # Block when idle; otherwise just drain what arrived during the step.
            self._apply(block=not self.engine.has_unfinished())
            if self._stopped.is_set():
                break
            if self.engine.executor.check() is not None:
                self._tend_lost_rank()
                continue
            try:
                with self._turns.turn() if self._turns is not None else nullcontext():
                    outputs = self.engine.step()
            except Exception:  # a model failure must not take the server down
                log.exception("engine step failed; failing the requests in flight")
                self._fail_all()
                continue
            self._maybe_log_summary()
            finished = 0
            for out in outputs:
                sink = self._sinks.get(out.request_id)
                if sink is not None:
                    if not sink.put(out):  # its client's loop is closed: stop the request, free its blocks
                        del self._sinks[out.request_id]
                        if not out.finished:
                            self.engine.abort(out.request_id, client_disconnected=True)
                        continue
                    if out.finished:
                        del self._sinks[out.request_id]
                        finished += 1
            self._expected = finished if finished > 1 and not self.engine.has_unfinished() else 0

    def _tend_lost_rank(self) -> None:
        """A rank is lost: end what is in flight (no step can run), and with --restart-workers bring the ranks back."""
        if self._sinks:
            self._fail_all()
        if not self.engine.config.parallel.restart_workers or time.monotonic() < self._next_restart:
            return
        try:
            self.engine.recover()
        except Exception:
            log.exception("bringing the ranks back failed; trying again in %.0f s", RESTART_BACKOFF_S)
            self._next_restart = time.monotonic() + RESTART_BACKOFF_S

    def _maybe_log_summary(self) -> None:
        """While busy, one line every SUMMARY_INTERVAL_S seconds on what the engine is doing (like vLLM's)."""
        now = time.monotonic()
        if now - self._last_summary < SUMMARY_INTERVAL_S:
            return
        self._last_summary = now
        s = self.engine.snapshot
        window = f"{SUMMARY_INTERVAL_S:g}s"
        line = (
            f"engine: prompt {s.prompt_throughput.get(window, 0.0):.1f} tok/s, generation {s.generation_throughput.get(window, 0.0):.1f} tok/s, "
            f"running {s.running}, waiting {s.waiting}, KV cache {s.kv_usage:.1%} of {s.kv_total_bytes / 2**20:.0f} MiB"
        )
        if s.prefix_cache is not None:
            line += f", prefix cache served {s.prefix_cache['token_hit_rate']:.1%} of prompt tokens"
        log.info(line)

    def _apply(self, block: bool) -> None:
        """Apply what the inbox holds; when `block` (the engine is idle), wait for the first command.

        Follow-ups: when the step that left the engine idle finished k > 1
        requests at once, their clients (agents, a fleet of conversations in
        lockstep) tend to come back together, a few milliseconds apart. The
        first arrival then waits up to `follow_up_window` for k adds in all,
        so their prefills share one step instead of k-1 of them queueing
        behind the first one's step (benchmarks/NOTES.md). A lone request,
        after a step that finished one or none, never waits.
        """
        self.engine.resume_runs()  # (before the inbox is read: a command put after this interrupts the next run)
        try:
            cmd = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        expected, self._expected = (self._expected if block else 0), 0
        deadline = time.monotonic() + self.engine.config.scheduler.follow_up_window
        added = 0
        while True:
            kind, arg, extra = cmd  # add: (request, its sink); abort: (request id, whether its client went away)
            if kind == "add":
                added += 1
                with self._lock:
                    self._queued_adds -= 1
                try:
                    self.engine.add_request(arg, checked=True)  # generate or the server's check did
                    self._sinks[arg.request_id] = extra
                except Exception as exc:
                    extra.put(exc)
            elif kind == "abort":
                self.engine.abort(arg, client_disconnected=extra)
            elif kind == "stop":
                return
            try:
                wait = deadline - time.monotonic() if added < expected else 0.0
                cmd = self._inbox.get(timeout=wait) if wait > 0 else self._inbox.get_nowait()
            except queue.Empty:
                return

    def _fail_all(self) -> None:
        log.error("the failed step ends requests %s", ", ".join(self._sinks) or "(none)")
        if self.engine.executor.failure is not None:
            then = "the server is starting it again" if self.engine.config.parallel.restart_workers else "the server must be restarted"
            err: EngineDeadError = EngineUnavailable(f"a process holding part of the model was lost; {then}")
        else:
            err = EngineDeadError("the engine failed while running this request; the server log has the details")
        for request_id, sink in list(self._sinks.items()):
            self.engine.abort(request_id)
            sink.put(err)
        self._sinks.clear()
        self.engine.discard_pending_outputs()  # their sinks already got the error


# ---------------------------------------------------------------- the door: loading
# The builder imports torch and the model code; the server reaches it only through these, when it loads a model.


def start_engine(config: EngineConfig, turns: StepTurns | None = None, name: str = "shoal-engine") -> AsyncEngine:
    """An AsyncEngine that builds `config`'s engine on its own thread; `ready` resolves once it serves."""
    from shoal.engine.builder import build_engine  # noqa: PLC0415

    return AsyncEngine(lambda: build_engine(config), turns=turns, name=name)


def estimate_bytes(config: EngineConfig) -> int:
    """The memory a load of `config` will take, before it (engine/builder.estimate_bytes)."""
    from shoal.engine.builder import estimate_bytes as estimate  # noqa: PLC0415

    return estimate(config)


def within_budget(config: EngineConfig, budget: int | None) -> EngineConfig:
    """`config` with an auto KV pool capped so the model alone fits `budget` (engine/builder.within_budget)."""
    from shoal.engine.builder import within_budget as capped  # noqa: PLC0415

    return capped(config, budget)
