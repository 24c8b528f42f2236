"""The model life-cycle API: which models a server offers, and loading and unloading them (server/models.py).

    GET /v1/models, GET /v1/models/{id}        OpenAI's list and retrieve, with each model's status and memory
    POST /v1/models {"model": id}               load (and wait for it)
    DELETE /v1/models/{id}, DELETE /v1/models   unload one (drained first), or every loaded model
    GET /v1/models/events                       server-sent events: one per status change
    GET /models, POST /models/load|unload       llama.cpp's router mode
    GET /api/ps                                 Ollama's loaded models

Every route needs the API key like the rest (AccessMiddleware). A model is only ever looked up by name: a name
that reads as a path is a 400, an unknown one a 404.

A streamed generation request for a model that must load first gets SSE comments while it waits
(`streams.answer_when_loaded`).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from datetime import datetime, timezone

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict

from shoal.server.openai.protocol import ModelCard, ModelList, error_responses
from shoal.server.sse import encode_event

router = APIRouter()
EVENTS_KEEPALIVE_S = 15.0  # and on the events stream while nothing changes


class LoadRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str


def _manager(request: Request):
    return request.app.state.shoal.models


@router.get("/v1/models", responses={200: {"model": ModelList}, **error_responses(401, 403, 500)})
async def list_models(request: Request) -> JSONResponse:
    """Every model this server offers (OpenAI's list format), with its status (`loaded`, `loading`, `unloaded`,
    `unloading`, `failed` with a reason), memory and input modalities."""
    return JSONResponse({"object": "list", "data": [m.card() for m in _manager(request).models.values()]})


@router.get("/models", include_in_schema=False, description="llama.cpp's router-mode list: the same as GET /v1/models.")
async def list_models_llamacpp(request: Request) -> JSONResponse:
    return await list_models(request)


_EVENT = {"type": "object", "properties": {"data": {"type": "string"}}, "required": ["data"]}


@router.get("/v1/models/events", responses={200: {"content": {"text/event-stream": {"schema": _EVENT}},
                                                  "description": "One event per status change"}, **error_responses(401, 403)})
async def model_events(request: Request) -> StreamingResponse:
    """Server-sent events: first every model's status, then one `{"model", "status", "reason"?, "time"}` per change."""
    manager = _manager(request)
    queue = manager.subscribe()

    async def events() -> AsyncIterator[bytes]:
        try:
            for m in manager.models.values():
                yield encode_event({"model": m.name, "status": m.status, **({"reason": m.error} if m.error else {})})
            while True:
                try:
                    event = await asyncio.wait_for(queue.get(), timeout=EVENTS_KEEPALIVE_S)
                except TimeoutError:
                    yield b": keep-alive\n\n"
                    continue
                yield encode_event(event)
        finally:
            manager.unsubscribe(queue)

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


@router.get("/v1/models/{name:path}", responses={200: {"model": ModelCard}, **error_responses(400, 401, 403, 404)})
async def get_model(name: str, request: Request) -> JSONResponse:
    """One model's card (OpenAI's retrieve), with its status."""
    return JSONResponse(_manager(request).find(name).card())


@router.post("/v1/models", responses={200: {"model": ModelCard}, **error_responses(400, 401, 403, 404, 503, 507)})
async def load_model(body: LoadRequest, request: Request) -> JSONResponse:
    """Load a model the server offers and answer once it is loaded. 507: it cannot fit the memory budget; 503:
    other models' requests hold the room (Retry-After), or the load failed."""
    return JSONResponse((await _manager(request).load(body.model)).card())


@router.delete("/v1/models/{name:path}", responses={200: {"model": ModelCard}, **error_responses(400, 401, 403, 404)})
async def unload_model(name: str, request: Request) -> JSONResponse:
    """Unload a model: new requests for it wait (or load it again), those in flight finish first, up to
    --model-drain-timeout, then end with a 503 that says so. Its weights, KV pool and thread are released."""
    return JSONResponse((await _manager(request).unload(name)).card())


@router.delete("/v1/models", responses={200: {"model": ModelList}, **error_responses(401, 403)})
async def unload_all(request: Request) -> JSONResponse:
    """Unload every loaded model; the list of those unloaded."""
    return JSONResponse({"object": "list", "data": [m.card() for m in await _manager(request).unload_all()]})


@router.post("/models/load", include_in_schema=False, description="llama.cpp's router mode: load {\"model\": id}.")
async def load_llamacpp(body: LoadRequest, request: Request) -> JSONResponse:
    await _manager(request).load(body.model)
    return JSONResponse({"success": True})


@router.post("/models/unload", include_in_schema=False, description="llama.cpp's router mode: unload {\"model\": id}.")
async def unload_llamacpp(body: LoadRequest, request: Request) -> JSONResponse:
    await _manager(request).unload(body.model)
    return JSONResponse({"success": True})


@router.get("/api/ps", include_in_schema=False, description="Ollama's list of loaded models.")
async def ollama_ps(request: Request) -> JSONResponse:
    manager = _manager(request)
    now, wall = manager.clock(), datetime.now(timezone.utc)
    out = []
    for m in manager.models.values():
        if not m.loaded:
            continue
        left = m.expires - now
        expires = None if math.isinf(left) else datetime.fromtimestamp(wall.timestamp() + max(0.0, left), timezone.utc)
        f = m.engine.facts
        out.append({
            "name": m.name, "model": m.name, "size": m.memory, "size_vram": 0 if f.device == "cpu" else m.memory,
            "digest": "", "context_length": m.engine.max_model_len,
            "details": {"format": "gguf" if str(f.path or "").endswith(".gguf") else "safetensors", "family": f.architecture,
                        "quantization_level": f.weight_format},
            # Ollama's "forever" is a date far ahead; a model that never expires says so plainly here.
            "expires_at": expires.isoformat() if expires is not None else "9999-12-31T23:59:59Z",
        })
    return JSONResponse({"models": out})
