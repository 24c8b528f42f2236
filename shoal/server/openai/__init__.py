"""The OpenAI-compatible adapter: /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/rerank (Jina's and Cohere's
shape, as llama.cpp and vLLM serve it), and vLLM's /tokenize, /detokenize (/v1/models
is the life-cycle API's: server/lifecycle.py)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from shoal.server.openai.chat import create_chat_completion
from shoal.server.openai.completions import create_completion
from shoal.server.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    error_responses,
)
from shoal.server.openai.embeddings import router as embeddings_router
from shoal.server.openai.rerank import router as rerank_router
from shoal.server.openai.tokenize import router as tokenize_router
from shoal.server.streams import answer_when_loaded

router = APIRouter()
router.include_router(tokenize_router)
router.include_router(embeddings_router)
router.include_router(rerank_router)

_GENERATION_ERRORS = error_responses(400, 401, 403, 404, 413, 500, 503, 507)


def _generated(model) -> dict:
    """A 200 that is JSON (`model`) or, with stream, server-sent events."""
    return {200: {"model": model, "content": {"text/event-stream": {"schema": {"type": "string"}}}}, **_GENERATION_ERRORS}


@router.post("/v1/chat/completions", responses=_generated(ChatCompletionResponse))
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    """OpenAI's chat completions: a reply to a conversation, whole or streamed (SSE); tools, `response_format`, logprobs, `n`."""
    return await answer_when_loaded(request, body.model, body.stream, lambda: create_chat_completion(body, request, request.app.state.shoal))


@router.post("/v1/completions", responses=_generated(CompletionResponse))
async def completions(body: CompletionRequest, request: Request) -> Response:
    """OpenAI's (legacy) completions: a continuation of a text or token-id prompt, whole or streamed; `echo` and logprobs score prompts."""
    return await answer_when_loaded(request, body.model, body.stream, lambda: create_completion(body, request, request.app.state.shoal))
