"""The OpenAI-compatible adapter: /v1/chat/completions, /v1/completions, /v1/models, and vLLM's /tokenize, /detokenize."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from shoal.server.openai.chat import create_chat_completion
from shoal.server.openai.completions import create_completion
from shoal.server.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelList,
    error_responses,
)
from shoal.server.openai.tokenize import router as tokenize_router
from shoal.server.streams import answer

router = APIRouter()
router.include_router(tokenize_router)

_GENERATION_ERRORS = error_responses(400, 401, 403, 404, 413, 500, 503)


def _generated(model) -> dict:
    """A 200 that is JSON (`model`) or, with stream, server-sent events."""
    return {200: {"model": model, "content": {"text/event-stream": {"schema": {"type": "string"}}}}, **_GENERATION_ERRORS}


@router.post("/v1/chat/completions", responses=_generated(ChatCompletionResponse))
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    """OpenAI's chat completions: a reply to a conversation, whole or streamed (SSE); tools, `response_format`, logprobs, `n`."""
    return await answer(create_chat_completion(body, request, request.app.state.shoal))


@router.post("/v1/completions", responses=_generated(CompletionResponse))
async def completions(body: CompletionRequest, request: Request) -> Response:
    """OpenAI's (legacy) completions: a continuation of a text or token-id prompt, whole or streamed; `echo` and logprobs score prompts."""
    return await answer(create_completion(body, request, request.app.state.shoal))


@router.get("/v1/models", responses={200: {"model": ModelList}, **error_responses(401, 403, 500, 503)})
async def models(request: Request) -> JSONResponse:
    """The served model, in OpenAI's list format."""
    state = request.app.state.shoal
    state.require_engine()
    # The file or folder's name only: an absolute path tells any client the server's layout.
    root = Path(state.engine.facts.path or state.engine.config.model).name
    return JSONResponse({
        "object": "list",
        "data": [
            {
                "id": state.model_name,
                "object": "model",
                "created": state.created,
                "owned_by": "shoal",
                "root": root,
                "max_model_len": state.engine.max_model_len,
            }
        ],
    })
