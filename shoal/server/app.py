"""The FastAPI app: `create_app(engine_or_config, settings)`.

Given an `EngineConfig` (or several models' specs), the app loads the default model in a worker thread when it
starts, so `/health` answers (503, "loading") while the weights load; given a
ready `Engine` it serves at once. Other models load on demand (server/models.py). Routes:

    POST /v1/chat/completions, POST /v1/completions,
    POST /tokenize, POST /detokenize                                     (openai/)
    POST /v1/messages, POST /v1/messages/count_tokens                    (anthropic/)
    POST /v1/responses, GET/DELETE /v1/responses/{id}, .../input_items  (responses/)
    Ollama's /api/chat, /api/generate, /api/tags, /api/show, ...         (ollama/)
    /v1/models and its loading, unloading and events; llama.cpp's and Ollama's (lifecycle.py)
    GET /health, GET /stats, GET /v1/cluster, GET /metrics, the dashboard (here)

The docs' HTTP reference is generated from this app's route table and OpenAPI document.
"""

from __future__ import annotations

import asyncio
import importlib.resources
import logging
import time
from functools import lru_cache
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, RedirectResponse, Response

from shoal import __version__
from shoal.config import EngineConfig
from shoal.server.errors import APIError, install_error_handlers
from shoal.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from shoal.server.middleware import LOOPBACK_ORIGIN_REGEX, AccessMiddleware, is_loopback_host
from shoal.server.anthropic import router as anthropic_router
from shoal.server.chat.params import CLIPPED_HEADER
from shoal.server.openai import router as openai_router
from shoal.server.ollama import router as ollama_router
from shoal.server.openai.protocol import HealthResponse, StatsResponse, error_responses
from shoal.server.responses import ResponseStore, router as responses_router
from shoal.server.lifecycle import router as lifecycle_router
from shoal.server.models import RETRY_LOADING_S, Lifecycle
from shoal.server.settings import ServerSettings
from shoal.server.state import ServerState, cluster_down_message

log = logging.getLogger("shoal.server")


def create_app(
    source,
    settings: ServerSettings | None = None,
    *,
    lifecycle: Lifecycle | None = None,
    clock: Callable[[], float] = time.monotonic,
    on_load_error: Callable[[BaseException], None] | None = None,
) -> FastAPI:
    """An app serving `source`: a loaded `Engine`, an `EngineConfig`, or the `ModelSpec`s of several models (the
    first is the default); `lifecycle`: when they load and unload (server/models.py); `clock`: the keep-alive's.

    `on_load_error` is called (from the event loop) if the default model fails to load at start; the
    command line uses it to stop the server. Without it the server stays up and
    says why on /health.
    """
    settings = settings or ServerSettings()
    # None: the default model's config, never loaded unless started (the route table and OpenAPI document: docs, fuzzing)
    state = ServerState(settings, source if source is not None else EngineConfig(), lifecycle, clock)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loading = asyncio.create_task(state.start(on_load_error))
        try:
            yield
        finally:
            if loading is not None and not loading.done():
                loading.cancel()
            state.shutdown()

    app = FastAPI(title="shoal", version=__version__, lifespan=lifespan, docs_url="/docs", redoc_url=None)
    app.state.shoal = state
    # the Responses API's stored responses (server/responses/store.py)
    app.state.responses = ResponseStore(settings.responses_store_max, settings.responses_store_bytes)
    install_error_handlers(app)
    app.include_router(openai_router)
    app.include_router(anthropic_router)
    app.include_router(responses_router)
    app.include_router(ollama_router)
    app.include_router(lifecycle_router)
    _add_service_routes(app)
    _drop_default_422(app)
    # The routes' paths label /metrics' HTTP counter; anything else is "other" (bounded cardinality).
    routes = [*app.routes, *openai_router.routes, *anthropic_router.routes, *responses_router.routes, *ollama_router.routes,
              *lifecycle_router.routes]
    state.routes = frozenset(r.path for r in routes if isinstance(getattr(r, "path", None), str))
    # Added first = innermost: CORS sits outside the key check, so preflights
    # pass and refusals still carry CORS headers.
    app.add_middleware(AccessMiddleware, state=state)
    # The origins AccessMiddleware lets in get CORS headers (loopback ones when bound to loopback).
    loopback_origins = LOOPBACK_ORIGIN_REGEX if is_loopback_host(settings.host) else None
    if settings.allowed_origins or loopback_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.allowed_origins),
            allow_origin_regex=loopback_origins,
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=[CLIPPED_HEADER, "Retry-After"],  # readable by the page's script, not only by the browser
        )
    return app


# The dashboard's files, in the package (no CDN: the page works offline). No data is in them:
# the page asks /stats, with the API key when the server has one.
DASHBOARD_ASSETS = {"dashboard.js": "text/javascript; charset=utf-8", "dashboard.css": "text/css; charset=utf-8"}


@lru_cache(maxsize=None)
def _asset(name: str) -> bytes:
    return importlib.resources.files("shoal.server.dashboard").joinpath(name).read_bytes()


def _drop_default_422(app: FastAPI) -> None:
    """Validation errors are 400s here (errors.py): FastAPI's default 422 is not part of the contract."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = build()  # cached by FastAPI: edited in place once
            for operations in schema["paths"].values():
                for op in operations.values():
                    op["responses"].pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
        return app.openapi_schema

    app.openapi = openapi


def _add_service_routes(app: FastAPI) -> None:
    @app.get("/health", responses={200: {"model": HealthResponse}, 503: {"model": HealthResponse, "description": "Loading, or the model failed to load"}})
    async def health(request: Request) -> JSONResponse:
        """200 once the default model is loaded (or may load on demand) and every rank holding part of it answers;
        503 while it loads at start, after a failed load, or while a rank is lost."""
        state: ServerState = request.app.state.shoal
        m = state.default
        if m.engine is not None and m.engine.failure is not None:  # a rank is gone: no step can run until it is back
            return JSONResponse({"status": "failed", "model_loaded": True, "error": cluster_down_message(m)}, status_code=503,
                                headers={"Retry-After": str(RETRY_LOADING_S)})
        if state.status == "ok":
            return JSONResponse({"status": "ok", "model_loaded": m.loaded})
        body = {"status": state.status, "model_loaded": False}
        if state.load_error:
            body["error"] = state.load_error
        return JSONResponse(body, status_code=503, headers={"Retry-After": str(RETRY_LOADING_S)})

    @app.get("/stats", responses={200: {"model": StatsResponse}, **error_responses(401, 403, 500)})
    async def stats(request: Request) -> JSONResponse:
        """The engine's latest snapshot as JSON: throughput, KV and prefix-cache figures, the last step, and the timing records of recent requests."""
        return JSONResponse(request.app.state.shoal.stats())

    @app.get("/v1/cluster", responses={200: {"description": "The ranks that hold the model: each with its rank, host, pid, "
                                             "layer range, heads, memory and state"},
                                       **error_responses(400, 401, 403, 404)})
    async def cluster(request: Request, model: str | None = None) -> JSONResponse:
        """The processes that hold a model (`?model=`, default: the default model; one process without tensor or
        pipeline parallelism; none while it is not loaded), with their state."""
        state: ServerState = request.app.state.shoal
        m = state.models.find(model)
        if not m.loaded:  # no process holds it
            p = m.config.parallel
            return JSONResponse({"model": m.name, "status": m.status, "tensor_parallel_size": p.tensor_parallel_size,
                                 "pipeline_parallel_size": p.pipeline_parallel_size, "backend": None, "wire_dtype": None, "ranks": []})
        return JSONResponse({"model": m.name, "status": m.status, **m.engine.cluster()})

    @app.get("/", include_in_schema=False, description="Redirects to the dashboard; on --ollama-port, Ollama's greeting.")
    async def root(request: Request) -> Response:
        ollama_port = request.app.state.shoal.settings.ollama_port
        if ollama_port is not None and (request.scope.get("server") or (None, None))[1] == ollama_port:
            return PlainTextResponse("Ollama is running")  # what Ollama answers there: apps probe it before they connect
        return RedirectResponse("/dashboard")

    @app.get("/dashboard", include_in_schema=False, description="The live dashboard: a page that polls /stats once a second.")
    async def dashboard(request: Request) -> Response:
        page = _asset("index.html")
        if request.app.state.shoal.settings.api_key:  # the page asks for the key before it asks /stats
            page = page.replace(b"<body>", b'<body data-auth="required">', 1)
        return Response(page, media_type="text/html; charset=utf-8")

    @app.get("/dashboard/{name}", include_in_schema=False, description="The dashboard's script and style sheet.")
    async def dashboard_asset(name: str) -> Response:
        if name not in DASHBOARD_ASSETS:
            raise APIError(404, f"no such dashboard file: {name}")
        return Response(_asset(name), media_type=DASHBOARD_ASSETS[name])

    @app.get("/metrics", responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "Prometheus text format"},
                                    **error_responses(401, 403, 500)})
    async def metrics(request: Request) -> Response:
        """Prometheus metrics in the text format (the metrics reference lists them)."""
        return Response(request.app.state.shoal.metrics.render(), media_type=METRICS_CONTENT_TYPE)
