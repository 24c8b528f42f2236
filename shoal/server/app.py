"""The FastAPI app: `create_app(engine_or_config, settings)`.

Given an `EngineConfig`, the app loads the model in a worker thread when it
starts, so `/health` answers (503, "loading") while the weights load; given a
ready `Engine` it serves at once. Routes:

    POST /v1/chat/completions, POST /v1/completions, GET /v1/models   (openai/)
    GET /health, GET /stats, POST /tokenize, POST /detokenize         (here)
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse

from shoal.config import EngineConfig
from shoal.server.errors import bad_request, install_error_handlers
from shoal.server.middleware import AccessMiddleware
from shoal.server.openai import router as openai_router
from shoal.server.openai.chat import render_chat
from shoal.server.openai.protocol import DetokenizeRequest, TokenizeRequest
from shoal.server.settings import ServerSettings
from shoal.server.state import RETRY_LOADING_S, ServerState

log = logging.getLogger("shoal.server")


def create_app(
    engine_or_config,
    settings: ServerSettings | None = None,
    *,
    on_load_error: Callable[[BaseException], None] | None = None,
) -> FastAPI:
    """An app serving `engine_or_config`: a loaded `Engine`, or an `EngineConfig` to load at start-up.

    `on_load_error` is called (from the event loop) if loading fails; the
    command line uses it to stop the server. Without it the server stays up and
    says why on /health.
    """
    settings = settings or ServerSettings()
    state = ServerState(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loading = None
        if isinstance(engine_or_config, EngineConfig):
            loading = asyncio.create_task(state.load(engine_or_config, on_load_error))
        else:
            state.attach(engine_or_config)
        try:
            yield
        finally:
            if loading is not None and not loading.done():
                loading.cancel()
            state.shutdown()

    app = FastAPI(title="shoal", version=_version(), lifespan=lifespan, docs_url="/docs", redoc_url=None)
    app.state.shoal = state
    install_error_handlers(app)
    app.include_router(openai_router)
    _add_service_routes(app)
    # Added first = innermost: CORS sits outside the key check, so preflights
    # pass and refusals still carry CORS headers.
    app.add_middleware(AccessMiddleware, api_key=settings.api_key, max_request_bytes=settings.max_request_bytes)
    if settings.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.allowed_origins),
            allow_methods=["*"],
            allow_headers=["*"],
        )
    return app


def _version() -> str:
    from shoal import __version__

    return __version__


def _add_service_routes(app: FastAPI) -> None:
    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        state: ServerState = request.app.state.shoal
        if state.status == "ok":
            return JSONResponse({"status": "ok", "model_loaded": True})
        body = {"status": state.status, "model_loaded": False}
        if state.load_error:
            body["error"] = state.load_error
        return JSONResponse(body, status_code=503, headers={"Retry-After": str(RETRY_LOADING_S)})

    @app.get("/stats")
    async def stats(request: Request) -> dict:
        return request.app.state.shoal.stats()

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request) -> dict:
        state: ServerState = request.app.state.shoal
        state.require_engine()
        state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of prompt or messages", "prompt")
        if body.messages is not None:
            text, ids = render_chat(state, body.messages, body.chat_template_kwargs, None, body.add_generation_prompt)
        else:
            text = body.prompt
            add = True if body.add_special_tokens is None else body.add_special_tokens
            ids = list(state.engine.tokenizer.encode(text, add_special_tokens=add))
        return {"tokens": ids, "count": len(ids), "max_model_len": state.engine.max_model_len, "prompt": text}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
        state: ServerState = request.app.state.shoal
        state.require_engine()
        state.check_model(body.model)
        vocab = state.engine.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"tokens {bad[:5]} are outside the vocabulary [0, {vocab})", "tokens")
        return {"prompt": state.engine.tokenizer.decode(body.tokens)}
