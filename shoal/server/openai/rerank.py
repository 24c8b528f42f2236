"""POST /v1/rerank: documents ranked by their relevance to a query, by a cross-encoder (Jina's and Cohere's shape,
as llama.cpp's and vLLM's servers answer it).

Each (query, document) pair is one prompt-only engine request, `[CLS] query [SEP] document [SEP]` as the model's
tokenizer pairs them (runner/encoder_runner.py gives the second segment its segment id), scored by the model's
classifier through the activation sentence-transformers' CrossEncoder.predict applies (model/bert.py). The results
come sorted by score, highest first, cut to `top_n`, each with its document's `index` in the request and, unless
`return_documents` is false, its text. The routes are llama.cpp's (/rerank, /reranking, /v1/rerank, /v1/reranking)
and vLLM's (/rerank, /v1/rerank, /v2/rerank). A model that does not rerank (not a cross-encoder) is a 400 naming
`model`.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from shoal.server.chat.params import Int, pooled_requests
from shoal.server.chat.render import check_prompt_chars
from shoal.server.errors import bad_request
from shoal.server.openai.common import new_id
from shoal.server.openai.protocol import _Request, error_responses
from shoal.server.streams import answer, run_to_end, tracked

router = APIRouter()

MAX_DOCUMENTS = 2048  # as many as /v1/embeddings takes inputs
ROUTES = ("/v1/rerank", "/rerank", "/v2/rerank", "/v1/reranking", "/reranking")


class RerankRequest(_Request):
    model: str | None = None
    query: Any = None  # a string (checked by hand, for a 400 that names it)
    documents: Any = None  # strings, or objects with a "text" string (Jina's)
    top_n: Int | None = None  # None or 0: every document
    return_documents: bool | None = None  # default true: each result carries its document's text
    keep_alive: int | float | str | None = None


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    object: str = "list"
    model: str
    results: list[RerankResult]
    usage: RerankUsage


async def rerank(body: RerankRequest, request: Request) -> Response:
    """Documents ranked by a cross-encoder's relevance score to the query, highest first (Jina's and Cohere's shape)."""
    return await answer(create_rerank(body, request, request.app.state.shoal))


for _path in ROUTES:
    router.add_api_route(_path, rerank, methods=["POST"], include_in_schema=_path == "/v1/rerank",
                         responses={200: {"model": RerankResponse}, **error_responses(400, 401, 403, 404, 413, 500, 503)})


def document_texts(value) -> list[str]:
    """The documents' texts: each a string or an object with a "text" string."""
    if not isinstance(value, list) or not value:
        raise bad_request("documents must be a non-empty list of strings (or of objects with a text string)", "documents")
    if len(value) > MAX_DOCUMENTS:
        raise bad_request(f"at most {MAX_DOCUMENTS} documents per request, got {len(value)}", "documents")
    texts = []
    for i, d in enumerate(value):
        if isinstance(d, dict) and isinstance(d.get("text"), str):
            d = d["text"]
        if not isinstance(d, str):
            raise bad_request(f"documents[{i}] must be a string or an object with a text string", "documents")
        texts.append(d)
    return texts


def tokenize_pairs(served, query: str, texts: list[str]) -> list[list[int]]:
    """Each (query, document) pair's token ids as the tokenizer pairs them (its special tokens, segment 1 after the
    first [SEP]). Blocking work: call it in a worker thread."""
    tokenizer = served.engine.tokenizer
    check_prompt_chars(served, len(query), "query")
    out = []
    for i, text in enumerate(texts):
        check_prompt_chars(served, len(query) + len(text), "documents")
        enc = tokenizer(query, text)
        ids, types = list(enc["input_ids"]), enc.get("token_type_ids")
        sep = tokenizer.sep_token_id
        second = ids.index(sep) + 1 if sep in ids else len(ids)
        if types is not None and list(types) != [0] * second + [1] * (len(ids) - second):
            # the runner starts segment 1 after the first [SEP]: a query holding the separator would shift it
            raise bad_request(f"the query holds the model's separator token {tokenizer.sep_token!r}", "query")
        out.append(ids)
    return out


async def create_rerank(body: RerankRequest, http: Request, state) -> JSONResponse:
    served = await state.admit(body.model, body.keep_alive)
    engine = served.engine
    pooling = engine.pooling
    if pooling is None or pooling.mode != "score":
        raise bad_request(f"model {served.model_name!r} does not rerank: shoal reranks with a cross-encoder "
                          "(sentence-transformers' CrossEncoder layout, a BertForSequenceClassification folder)", "model")
    if pooling.hidden_size != 1:
        raise bad_request(f"model {served.model_name!r} is a classifier of {pooling.hidden_size} labels: reranking takes "
                          "one relevance score per pair (num_labels 1)", "model")
    if not isinstance(body.query, str) or not body.query:
        raise bad_request("query must be a non-empty string", "query")
    texts = document_texts(body.documents)
    if body.top_n is not None and body.top_n < 0:
        raise bad_request(f"top_n must be at least 1 (0 or absent: every document), got {body.top_n}", "top_n")
    ids = await asyncio.to_thread(tokenize_pairs, served, body.query, texts)
    rid = new_id("rerank")
    reqs = await pooled_requests(served, rid, ids, "documents")
    async with tracked(served, rid, reqs, "openai_rerank") as tracker:
        finals = await run_to_end(engine, reqs, http, tracker)
    scores = [out.embedding[0] for out in finals]
    order = sorted(range(len(texts)), key=lambda i: (-scores[i], i))[: body.top_n or None]
    with_text = body.return_documents is not False
    results = [{"index": i, "relevance_score": scores[i], **({"document": {"text": texts[i]}} if with_text else {})}
               for i in order]
    tokens = sum(len(x) for x in ids)
    return JSONResponse({"id": rid, "object": "list", "model": served.model_name, "results": results,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
