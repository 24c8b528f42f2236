"""Ollama's API under /api: chat, generate, the model list and details, the version; errors in Ollama's format.

    POST /api/chat, POST /api/generate       a reply, streamed as NDJSON (Ollama's default) or whole (generate.py)
    GET /api/tags, POST /api/show            the offered models, one model's details (catalog.py)
    GET /api/version
    POST /api/embed, POST /api/embeddings    vectors from a model that embeds (embed.py)
    /api/pull, /api/push, /api/create, /api/copy, /api/delete
                                             a 400: shoal serves the files it is given and downloads nothing
    GET /api/ps                              loaded models (lifecycle.py, with the other life-cycle routes)

`shoal serve --ollama-port 11434` also listens on Ollama's port, for apps that assume it; the routes, the API
key and the Host and Origin checks are the same on both ports.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from shoal.server.errors import APIError, register_error_format
from shoal.server.ollama import catalog, embed
from shoal.server.ollama.generate import NDJSON, chat, generate, model_name
from shoal.server.ollama.protocol import (
    ChatRequest,
    ChatResponse,
    EmbeddingsRequest,
    EmbeddingsResponse,
    EmbedRequest,
    EmbedResponse,
    ErrorResponse,
    GenerateRequest,
    GenerateResponse,
    ShowRequest,
    ShowResponse,
    TagsResponse,
    VersionResponse,
)
from shoal.server.streams import answer

PREFIX = "/api/"


def error_body(err: APIError) -> dict:
    """Ollama's error format: {"error": "message"}."""
    return {"error": err.message}


router = APIRouter()
register_error_format(PREFIX, error_body)

_STATUS = {
    400: "The request is invalid (the message names the field), or asks what shoal does not do (pull, push, create, copy, delete)",
    401: "A missing or wrong API key",
    403: "A refused Origin or Host",
    404: "No such model",
    413: "The body is larger than --max-request-bytes",
    500: "The server failed; details are in its log",
    503: "The model is loading or the server is overloaded (Retry-After)",
    507: "The model cannot fit the server's memory budget (--models-memory)",
}


def _errors(*statuses: int) -> dict:
    return {s: {"model": ErrorResponse, "description": _STATUS[s]} for s in statuses}


_GENERATION_ERRORS = _errors(400, 401, 403, 404, 413, 500, 503, 507)
# With stream (the default): one JSON object per line, the last with "done": true (or an error object).
_LINES = {"application/x-ndjson": {"schema": {"type": "string"}}}


@router.post("/api/chat", responses={200: {"model": ChatResponse, "content": _LINES}, **_GENERATION_ERRORS})
async def ollama_chat(body: ChatRequest, request: Request) -> Response:
    """The assistant's reply to Ollama's chat `messages`, as NDJSON lines or, with stream false, one object; images, tools, `format`, `options`, `think`, `keep_alive`."""
    return await answer(chat(body, request, request.app.state.shoal))


@router.post("/api/generate", responses={200: {"model": GenerateResponse, "content": _LINES}, **_GENERATION_ERRORS})
async def ollama_generate(body: GenerateRequest, request: Request) -> Response:
    """A completion of Ollama's `prompt` (in the chat template, or as given with `raw`), as NDJSON lines or one object."""
    return await answer(generate(body, request, request.app.state.shoal))


@router.get("/api/tags", responses={200: {"model": TagsResponse}, **_errors(401, 403)})
async def ollama_tags(request: Request) -> JSONResponse:
    """Every model this server offers, loaded or not, in Ollama's list format."""
    return JSONResponse(await catalog.tags(request.app.state.shoal))


@router.post("/api/show", responses={200: {"model": ShowResponse}, **_errors(400, 401, 403, 404)})
async def ollama_show(body: ShowRequest, request: Request) -> JSONResponse:
    """One model's details (family, parameter count, quantization, context length once loaded, template, capabilities)."""
    return JSONResponse(await catalog.show(request.app.state.shoal, body.model or body.name))


@router.get("/api/version", responses={200: {"model": VersionResponse}, **_errors(401, 403)})
async def ollama_version() -> JSONResponse:
    """The Ollama API version these routes follow, and shoal's own."""
    return JSONResponse(catalog.version())


@router.post("/api/embed", responses={200: {"model": EmbedResponse}, **_errors(400, 401, 403, 404, 413, 500, 503)})
async def ollama_embed(body: EmbedRequest, request: Request) -> Response:
    """A vector per input (Ollama's embeddings), pooled as the model embeds; a model that does not embed answers 400."""
    return await answer(_json(embed.embed(body, request, request.app.state.shoal)))


@router.post("/api/embeddings", responses={200: {"model": EmbeddingsResponse}, **_errors(400, 401, 403, 404, 413, 500, 503)})
async def ollama_embeddings(body: EmbeddingsRequest, request: Request) -> Response:
    """One prompt's vector (Ollama's older embeddings route)."""
    return await answer(_json(embed.embeddings(body, request, request.app.state.shoal)))


async def _json(work) -> JSONResponse:
    return JSONResponse(await work)


def _refuse(what: str):
    async def refuse() -> JSONResponse:
        raise APIError(400, f"{what} is not supported: shoal serves the model files it is given (--model, --models-dir, "
                            "the config's models) and downloads, builds, copies or deletes none")
    refuse.__doc__ = f"{what.capitalize()} is refused (400), as shoal serves the model files it is given and downloads nothing."
    return refuse


for _method, _path, _what in (("POST", "/api/pull", "pulling a model"), ("POST", "/api/push", "pushing a model"),
                              ("POST", "/api/create", "creating a model"), ("POST", "/api/copy", "copying a model"),
                              ("DELETE", "/api/delete", "deleting a model")):
    router.add_api_route(_path, _refuse(_what), methods=[_method], responses=_errors(400, 401, 403),
                         name=f"ollama_{_path.rsplit('/', 1)[1]}")

__all__ = ["NDJSON", "router"]
