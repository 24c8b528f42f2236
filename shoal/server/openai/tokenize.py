"""vLLM's /tokenize and /detokenize: a prompt or OpenAI chat messages to token ids, rendered as a chat
completion renders them (`chat_prompt`, through the shared renderer in server/chat/render.py), and back."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from shoal.server.chat.render import check_prompt_chars
from shoal.server.errors import bad_request
from shoal.server.openai.chat import chat_prompt, tool_use
from shoal.server.openai.protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse, error_responses

router = APIRouter()


@router.post("/tokenize", responses={200: {"model": TokenizeResponse}, **error_responses(400, 401, 403, 404, 413, 500, 503)})
async def tokenize(body: TokenizeRequest, request: Request) -> JSONResponse:
    """Token ids of a prompt or of a chat conversation rendered by the model's template (vLLM's /tokenize)."""
    served = await request.app.state.shoal.model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt or messages", "prompt")
    if body.messages is not None:
        tools = tool_use(body.tools, None, None)  # checked like chat's; rendered the same way
        shown = [dict(t) for t in tools.tools] if tools is not None else None
        text, ids, _ = await chat_prompt(served, body, shown, encode=False)  # every image counted as its tokens
    else:
        text = body.prompt
        check_prompt_chars(served, len(text), "prompt")
        add = True if body.add_special_tokens is None else body.add_special_tokens
        ids = list(await asyncio.to_thread(served.engine.tokenizer.encode, text, add_special_tokens=add))
    return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": served.engine.max_model_len, "prompt": text})


@router.post("/detokenize", responses={200: {"model": DetokenizeResponse}, **error_responses(400, 401, 403, 404, 413, 500, 503)})
async def detokenize(body: DetokenizeRequest, request: Request) -> JSONResponse:
    """The text of a list of token ids (vLLM's /detokenize)."""
    served = await request.app.state.shoal.model(body.model)
    vocab = served.engine.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"tokens {bad[:5]} are outside the vocabulary [0, {vocab})", "tokens")
    return JSONResponse({"prompt": served.engine.tokenizer.decode(body.tokens)})
