"""POST /api/embed and the older /api/embeddings: Ollama's embeddings through the engine's pooled requests.

Each input is one prompt-only request (`AsyncEngine.embedding_request`, pooled as the model embeds), batched
with everything else the engine runs. A model that does not embed (no pooling in its files, not served with
--embeddings) is a 400, as Ollama answers for a model without the capability. An input longer than the context
is cut to it, its end dropped, as Ollama does by default (`truncate`, default true: apps send long chunks and
expect a vector); with `"truncate": false` it is a 400 naming the input, as Ollama's is.
"""

from __future__ import annotations

import asyncio
import time

from starlette.requests import Request

from shoal.server.chat.params import pooled_requests
from shoal.server.chat.render import check_prompt_chars, max_prompt_chars
from shoal.server.errors import bad_request
from shoal.server.ollama.generate import model_name, ns
from shoal.server.ollama.protocol import EmbeddingsRequest, EmbedRequest
from shoal.server.streams import run_to_end, tracked

MAX_INPUTS = 2048


def _inputs(value) -> list[str]:
    items = [value] if isinstance(value, str) else list(value or [])
    if not items:
        raise bad_request("input must be a string or a non-empty list of strings", "input")
    if len(items) > MAX_INPUTS:
        raise bad_request(f"at most {MAX_INPUTS} inputs per request, got {len(items)}", "input")
    for i, x in enumerate(items):
        if not x:
            raise bad_request(f"input[{i}] is an empty string", "input")
    return items


def _tokenize(served, items: list[str], truncate: bool) -> list[list[int]]:
    """Each input's ids; with `truncate`, cut to the context (the text first to what could fit, so a huge input
    costs no more tokenizing than a full one)."""
    out, most = [], served.engine.max_model_len
    for i, x in enumerate(items):
        if truncate:
            out.append(list(served.engine.tokenizer.encode(x[: max_prompt_chars(served)]))[:most])
        else:
            check_prompt_chars(served, len(x), f"input[{i}]")
            out.append(list(served.engine.tokenizer.encode(x)))
    return out


async def _vectors(http: Request, state, name: str, keep_alive, items: list[str], dimensions: int | None,
                   truncate: bool = True):
    """The served model, each item's vector, the prompt tokens, and the seconds spent getting the model."""
    start = time.monotonic()
    served = await state.admit(model_name(state, name), keep_alive)
    loaded = time.monotonic() - start
    engine = served.engine
    pooling = engine.pooling
    if pooling is None:
        raise bad_request(f"model {served.name!r} does not support embeddings: its files name no pooling and it was not "
                          "served with --embeddings", "model")
    if dimensions is not None:
        try:
            pooling.check_dimensions(dimensions)
        except ValueError as e:
            raise bad_request(str(e), "dimensions") from None
    ids = await asyncio.to_thread(_tokenize, served, items, truncate)
    rid = f"ollama-embed-{time.monotonic_ns():x}"
    reqs = await pooled_requests(served, rid, ids, "input", dimensions)
    async with tracked(served, rid, reqs, "ollama_embed") as tracker:
        finals = await run_to_end(engine, reqs, http, tracker)
    return [list(out.embedding) for out in finals], sum(len(x) for x in ids), loaded


async def embed(body: EmbedRequest, http: Request, state) -> dict:
    start = time.monotonic()
    vectors, tokens, loaded = await _vectors(http, state, body.model, body.keep_alive, _inputs(body.input), body.dimensions,
                                             body.truncate is not False)
    return {"model": body.model, "embeddings": vectors, "total_duration": ns(time.monotonic() - start),
            "load_duration": ns(loaded), "prompt_eval_count": tokens}


async def embeddings(body: EmbeddingsRequest, http: Request, state) -> dict:
    """The older route: one prompt, one vector (an empty prompt: an empty vector, as Ollama answers)."""
    if not body.prompt:
        state.models.find(model_name(state, body.model))
        return {"embedding": []}
    (vector,), _, _ = await _vectors(http, state, body.model, body.keep_alive, [body.prompt], None)
    return {"embedding": vector}
