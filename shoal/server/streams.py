"""Running GenerationRequests for an HTTP request: merged streams, disconnects, the log line.

Protocol-neutral: the adapters build the requests and format what comes back.
A request is aborted in the engine when its consumer goes away: closing or
cancelling `AsyncEngine.generate`'s iterator sends the abort, applied at the
engine's next step. For streaming responses Starlette cancels the body
iterator when the client disconnects; non-streaming handlers watch the
connection themselves (`run_to_end`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing, asynccontextmanager

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from shoal.engine.async_engine import EngineStopped, EngineUnavailable, RequestFailed
from shoal.server.errors import APIError, new_request_id, server_failure, unavailable
from shoal.server.metrics import PROTOCOLS
from shoal.server.sse import DONE, dumps, encode_event
from shoal.server.models import RETRY_LOADING_S
from shoal.server.state import release_admission
from shoal.types import GenerationRequest, RequestOutput

log = logging.getLogger("shoal.server")


class ClientDisconnected(Exception):
    pass


async def merged(engine, requests: Sequence[GenerationRequest]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(index of the request, output) as they come, from one or several requests."""
    if len(requests) == 1:
        release_admission()  # no await until generate counts it
        async with aclosing(engine.generate(requests[0], checked=True)) as gen:
            async for out in gen:
                yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, req: GenerationRequest) -> None:
        try:
            release_admission()  # the first pump to run; no await until generate counts it
            async with aclosing(engine.generate(req, checked=True)) as gen:
                async for out in gen:
                    queue.put_nowait((i, out))
        except BaseException as e:  # handed to the consumer, cancellation included
            queue.put_nowait((i, e))
            if isinstance(e, asyncio.CancelledError):
                raise

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(requests)]
    remaining = len(requests)
    try:
        while remaining:
            i, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            yield i, item
            if item.finished:
                remaining -= 1
    finally:
        # No await here: this may run inside a cancelled scope. Cancelled pumps
        # close their generators, which abort their requests.
        for t in tasks:
            if not t.done():
                t.cancel()


async def wait_for_disconnect(request: Request) -> None:
    """Return when the client closes the connection (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_to_end(engine, requests: Sequence[GenerationRequest], http: Request, tracker: RequestTracker) -> list[RequestOutput]:
    """Every request's final output; aborts them all if the client goes away first."""

    async def consume() -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * len(requests)
        async with aclosing(merged(engine, requests)) as stream:
            async for i, out in stream:
                tracker.observe(i, out)
                if out.finished:
                    finals[i] = out
        return finals  # type: ignore[return-value]

    work = asyncio.create_task(consume())
    watcher = asyncio.create_task(wait_for_disconnect(http))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not work.done():
            work.cancel()  # closes the generators: the engine aborts the requests
        watcher.cancel()
    if not work.done():
        try:
            await work
        except asyncio.CancelledError:
            pass
        raise ClientDisconnected()
    return work.result()


def engine_error(exc: BaseException, request_id: str | None = None) -> APIError:
    """An exception out of the engine as the error the client gets.

    ValueError: the engine refused the request (400). RequestFailed: this request
    alone failed, and the message already says why in words fit for the client.
    EngineUnavailable: a rank was lost (503, try again later). EngineStopped: the model was unloaded under it (503).
    Anything else
    (EngineDeadError included) may hold internal text: the client gets a request
    id, the log the details. An APIError is already the client's error.
    """
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValueError):
        return APIError(400, str(exc))
    if isinstance(exc, EngineUnavailable):
        return unavailable(str(exc), RETRY_LOADING_S, "cluster_unavailable")
    if isinstance(exc, EngineStopped):  # its model was unloaded (or the server is stopping) with it in flight
        return unavailable(str(exc), RETRY_LOADING_S, "model_unloaded")
    if isinstance(exc, RequestFailed):
        return APIError(500, str(exc), code="request_failed")
    request_id = request_id or new_request_id()
    log.error("request %s failed in the engine", request_id, exc_info=exc)
    return server_failure(request_id, code="engine_failure")


KEEPALIVE_S = 5.0  # an SSE comment this often while a streamed request waits for its model to load


async def answer_when_loaded(request: Request, model: str | None, stream: bool | None,
                             handler: Callable[[], Awaitable[Response]]) -> Response:
    """Run a generation handler; a streamed one whose model must load first starts its SSE response at once and
    sends comments while it waits, then the handler's own stream (or its error, as an SSE event in the route's
    protocol's format)."""
    manager = request.app.state.shoal.models
    try:
        m = manager.find(model)
    except APIError:
        m = None  # the handler refuses it in its own words
    if not stream or m is None or m.loaded or not manager.lifecycle.autoload:
        return await answer(handler())
    path = request.url.path

    async def body() -> AsyncIterator[bytes]:
        waiting = asyncio.ensure_future(manager.ready(m))
        try:
            while not waiting.done():
                await asyncio.wait({waiting}, timeout=KEEPALIVE_S)
                if not waiting.done():
                    yield b": loading the model\n\n"
            if waiting.exception() is not None:
                raise waiting.exception()
            response = await handler()
        except APIError as e:
            yield _error_event(e, path)
            return
        finally:
            waiting.cancel()
        if isinstance(response, StreamingResponse):
            async for chunk in response.body_iterator:
                yield chunk if isinstance(chunk, bytes) else chunk.encode()
        else:  # not a stream after all (an error response): its body as one event
            yield b"data: " + bytes(response.body) + b"\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _error_event(e: APIError, path: str) -> bytes:
    """The error as the route's own streams end with one: Anthropic's named event, or OpenAI's chunk and [DONE]."""
    body = e.body(path)
    if body.get("type") == "error":
        return f"event: error\ndata: {dumps(body)}\n\n".encode()
    return encode_event(body) + DONE


# What a request that lost its client answers (nobody reads it; nginx's code for it).
CLIENT_CLOSED = 499


async def answer(handler: Awaitable[Response]) -> Response:
    """The handler's response, or 499 when its client went away first: every route that runs requests answers through this."""
    try:
        return await handler
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED)


@asynccontextmanager
async def tracked(served, request_id: str, requests: Sequence[GenerationRequest], protocol: str):
    """A RequestTracker for a non-streamed answer, finished with the outcome of the block: ok, disconnected
    (re-raised), or error, re-raised as the error the client gets (engine_error)."""
    tracker = RequestTracker(served, request_id, requests, protocol)
    outcome = "error"
    try:
        yield tracker
        outcome = "ok"
    except ClientDisconnected:
        outcome = "disconnected"
        raise
    except Exception as e:
        raise engine_error(e, request_id) from None
    finally:
        tracker.finish(outcome)


class RequestTracker:
    """One HTTP request's timings and token counts, logged as one line when it ends. protocol: the adapter's name
    for the request histograms' `protocol` label (metrics.PROTOCOLS)."""

    def __init__(self, served, request_id: str, requests: Sequence[GenerationRequest], protocol: str) -> None:
        if protocol not in PROTOCOLS:  # a new adapter names its label there, so dashboards know every value
            raise ValueError(f"protocol {protocol!r} is not in metrics.PROTOCOLS")
        self.served = served
        self.request_id = request_id
        self.protocol = protocol
        self.start = time.monotonic()
        self.first_token: float | None = None
        self.prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
        self.last: list[RequestOutput | None] = [None] * len(requests)
        self.done = False
        served.counters.total_requests += 1
        served.counters.in_flight += 1
        if log.isEnabledFor(logging.DEBUG):
            for r in requests:
                log.debug("%s prompt token ids (%d): %s", r.request_id, len(r.prompt_token_ids), list(r.prompt_token_ids))
                if r.prompt is not None:
                    log.debug("%s rendered prompt: %r", r.request_id, r.prompt)

    def observe(self, i: int, out: RequestOutput) -> None:
        if self.first_token is None and any(o.token_ids for o in out.outputs):
            self.first_token = time.monotonic()
        self.last[i] = out

    @property
    def cached_tokens(self) -> int:
        return sum(o.num_cached_tokens for o in self.last if o is not None)

    @property
    def completion_tokens(self) -> int:
        return sum(o.num_generated_tokens for o in self.last if o is not None)

    def finish(self, outcome: str) -> None:
        """outcome: "ok", "disconnected" or "error"."""
        if self.done:
            return
        self.done = True
        for out in self.last:
            if out is not None and out.finished and out.metrics is not None:
                self.served.metrics.observe(out.metrics, self.served.name, self.protocol)
        c = self.served.counters
        c.in_flight -= 1
        if outcome == "ok":
            c.finished_requests += 1
        elif outcome == "disconnected":
            c.client_disconnects += 1
        else:
            c.failed_requests += 1
        if not self.served.settings.log_requests:
            return
        elapsed = time.monotonic() - self.start
        reasons = sorted({str(o.finish_reason.value) for r in self.last if r is not None for o in r.outputs if o.finish_reason})
        finish = {"ok": ",".join(reasons) or "none", "disconnected": "client_disconnected"}.get(outcome, "error")
        ttft = f"{self.first_token - self.start:.3f}s" if self.first_token is not None else "-"
        n = self.completion_tokens
        log.info(
            "%s model=%s prompt=%d cached=%d completion=%d ttft=%s total=%.3fs %.1f tok/s finish=%s",
            self.request_id, self.served.model_name, self.prompt_tokens, self.cached_tokens, n, ttft, elapsed,
            n / elapsed if elapsed > 0 else 0.0, finish,
        )
