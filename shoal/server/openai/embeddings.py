"""POST /v1/embeddings: OpenAI's embeddings, each input a prompt-only request through the engine (engine/pooled.py).

`input` is a string, a list of strings, a list of token ids, or a list of token-id lists (OpenAI's four shapes);
each item is one engine request, batched with everything else the engine runs. `encoding_format` "float" gives
lists of numbers, "base64" each vector's little-endian float32 bytes (what the openai SDK asks for by default,
and decodes). `dimensions` keeps a vector's first values and renormalizes it (Matryoshka), within the model's
hidden size (and its listed lengths, where its config lists them). A model that does not embed (no pooling in
its files, no --embeddings) is a 400 naming `model`.
"""

from __future__ import annotations

import asyncio
import base64
import struct

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field

from shoal.server.chat.params import Int, pooled_requests
from shoal.server.chat.render import check_prompt_chars
from shoal.server.errors import bad_request
from shoal.server.openai.common import new_id
from shoal.server.openai.protocol import _Request, error_responses
from shoal.server.streams import answer, run_to_end, tracked

router = APIRouter()

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request


class EmbeddingRequest(_Request):
    model: str | None = None
    input: str | list[str] | list[Int] | list[list[Int]]
    encoding_format: str | None = None  # "float" (default) | "base64"
    dimensions: Int | None = None
    user: str | None = None
    keep_alive: int | float | str | None = None


class _Response(BaseModel):
    pass


class Embedding(_Response):
    object: str = "embedding"
    index: int
    embedding: list[float] | str  # numbers, or base64 of little-endian float32


class EmbeddingUsage(_Response):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(_Response):
    object: str = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
    id: str | None = Field(None, description="shoal's id for the request (in its log)")


@router.post("/v1/embeddings", responses={200: {"model": EmbeddingResponse}, **error_responses(400, 401, 403, 404, 413, 500, 503)})
async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
    """OpenAI's embeddings: a vector per input (string, token ids, or a list of either), pooled as the model embeds."""
    return await answer(create_embeddings(body, request, request.app.state.shoal))


def input_items(value) -> list[str | list[int]]:
    """The inputs, each a string or a list of token ids (shapes only: nothing is tokenized)."""

    def is_ids(x) -> bool:
        return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if isinstance(value, str):
        items = [value]
    elif isinstance(value, list) and not value:
        raise bad_request("input must not be empty", "input")
    elif is_ids(value):
        items = [value]
    elif isinstance(value, list) and all(isinstance(x, str) or is_ids(x) for x in value):
        items = list(value)
    else:
        raise bad_request("input must be a string, a list of strings, a list of token ids or a list of token-id lists", "input")
    if len(items) > MAX_INPUTS:
        raise bad_request(f"at most {MAX_INPUTS} inputs per request, got {len(items)}", "input")
    for i, x in enumerate(items):
        if isinstance(x, str) and not x:
            raise bad_request(f"input[{i}] is an empty string", "input")
        if isinstance(x, list) and not x:
            raise bad_request(f"input[{i}] is an empty list of token ids", "input")
    return items


def tokenize_inputs(served, items: list[str | list[int]]) -> list[list[int]]:
    """Token ids per input (the tokenizer's special tokens added, as the model's own tokenizer and sentence-transformers
    add them). Blocking work: call it in a worker thread."""
    tokenizer = served.engine.tokenizer
    out = []
    for x in items:
        if isinstance(x, str):
            check_prompt_chars(served, len(x), "input")
            out.append(list(tokenizer.encode(x)))
        else:
            out.append(list(x))
    return out


def encode_vector(vec: list[float], encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode("ascii")
    return vec


async def create_embeddings(body: EmbeddingRequest, http: Request, state) -> JSONResponse:
    served = await state.admit(body.model, body.keep_alive)
    engine = served.engine
    encoding = body.encoding_format or "float"
    if encoding not in ("float", "base64"):
        raise bad_request(f"encoding_format must be float or base64, got {encoding!r}", "encoding_format")
    pooling = engine.pooling
    if pooling is None:
        raise bad_request(f"model {served.model_name!r} does not serve embeddings: its files name no pooling "
                          "(sentence-transformers' modules.json, a GGUF's pooling_type), and it was not served with "
                          "--embeddings", "model")
    if pooling.mode == "score":
        raise bad_request(f"model {served.model_name!r} is a cross-encoder: it scores (query, document) pairs on "
                          "/v1/rerank and gives no embeddings", "model")
    if body.dimensions is not None:
        try:
            pooling.check_dimensions(body.dimensions)
        except ValueError as e:
            raise bad_request(str(e), "dimensions") from None
    items = input_items(body.input)
    ids = await asyncio.to_thread(tokenize_inputs, served, items)
    rid = new_id("embd")
    reqs = await pooled_requests(served, rid, ids, "input", body.dimensions, name_one=False)
    async with tracked(served, rid, reqs, "openai_embeddings") as tracker:
        finals = await run_to_end(engine, reqs, http, tracker)
    tokens = sum(len(x) for x in ids)
    data = [{"object": "embedding", "index": i, "embedding": encode_vector(out.embedding, encoding)} for i, out in enumerate(finals)]
    return JSONResponse({"object": "list", "data": data, "model": served.model_name,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}, "id": rid})
