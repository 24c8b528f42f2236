"""The OpenAI-compatible adapter: /v1/chat/completions, /v1/completions, /v1/models."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from shoal.server.openai.chat import create_chat_completion
from shoal.server.openai.completions import create_completion
from shoal.server.openai.protocol import ChatCompletionRequest, CompletionRequest
from shoal.server.streams import ClientDisconnected

router = APIRouter()

# What a request that lost its client answers (nobody reads it; nginx's code for it).
CLIENT_CLOSED = 499


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    try:
        return await create_chat_completion(body, request, request.app.state.shoal)
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    try:
        return await create_completion(body, request, request.app.state.shoal)
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED)


@router.get("/v1/models")
async def models(request: Request) -> dict:
    state = request.app.state.shoal
    state.require_engine()
    info = getattr(state.engine, "checkpoint_info", None)
    return {
        "object": "list",
        "data": [
            {
                "id": state.model_name,
                "object": "model",
                "created": state.created,
                "owned_by": "shoal",
                "root": str(getattr(info, "path", state.engine.config.model)),
                "max_model_len": state.engine.max_model_len,
            }
        ],
    }
