"""OpenAI's Responses API: POST /v1/responses (whole, or OpenAI's typed event stream), and the stored responses'
GET /v1/responses/{id}, DELETE /v1/responses/{id} and GET /v1/responses/{id}/input_items. Errors in OpenAI's
format (the default for /v1/). The stored responses live in the app's `ResponseStore` (`app.state.responses`)."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response

from shoal.server.errors import APIError
from shoal.server.openai.protocol import error_responses  # OpenAI's error body: the Responses API is OpenAI's too
from shoal.server.responses.create import PROTOCOL, create_response, not_found
from shoal.server.responses.protocol import DeletedResponse, InputItemList, ResponseObject, ResponsesRequest
from shoal.server.responses.store import ResponseStore
from shoal.server.streams import answer_when_loaded

__all__ = ["PROTOCOL", "ResponseStore", "router"]

router = APIRouter()

_NOT_STORED = {404: {**error_responses(404)[404], "description": "No such model, or no stored response with that id"}}
_GENERATION_ERRORS = {**error_responses(400, 401, 403, 413, 500, 503, 507), **_NOT_STORED}
_STORED_ERRORS = {**error_responses(400, 401, 403, 500), **_NOT_STORED}
# With stream: OpenAI's typed events, each `event: <type>` and `data: <JSON with type and sequence_number>`.
_EVENT = {"type": "object", "properties": {"event": {"type": "string"}, "data": {"type": "string"}}, "required": ["event", "data"]}


@router.post("/v1/responses", responses={200: {"model": ResponseObject, "content": {"text/event-stream": {"schema": _EVENT}}},
                                         **_GENERATION_ERRORS})
async def responses(body: ResponsesRequest, request: Request) -> Response:
    """OpenAI's Responses API: a reply to input items, whole or as typed events; function tools, `text.format`,
    `reasoning.effort`, images, stored responses and `previous_response_id` (the prefix cache holds the earlier turns)."""
    return await answer_when_loaded(request, body.model, body.stream, lambda: create_response(body, request, request.app.state.shoal))


def _stored(request: Request, response_id: str):
    rec = request.app.state.responses.get(response_id)
    if rec is None:
        raise not_found(response_id, "response_id")
    return rec


@router.get("/v1/responses/{response_id}", responses={200: {"model": ResponseObject}, **_STORED_ERRORS})
async def get_response(response_id: str, request: Request) -> JSONResponse:
    """A stored response, as it was answered."""
    return JSONResponse(_stored(request, response_id).body)


@router.delete("/v1/responses/{response_id}", responses={200: {"model": DeletedResponse}, **_STORED_ERRORS})
async def delete_response(response_id: str, request: Request) -> JSONResponse:
    """Forget a stored response (a later `previous_response_id` naming it is a 404)."""
    if not request.app.state.responses.delete(response_id):
        raise not_found(response_id, "response_id")
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


@router.get("/v1/responses/{response_id}/input_items", responses={200: {"model": InputItemList}, **_STORED_ERRORS})
async def input_items(response_id: str, request: Request, limit: int = Query(20, ge=1, le=100),
                      order: Literal["asc", "desc"] = "desc", after: str | None = None) -> JSONResponse:
    """A stored response's own input items (not the earlier turns'), newest first unless `order=asc`; `after` an
    item's id pages on."""
    items = list(_stored(request, response_id).input_items)
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [i["id"] for i in items]
        if after not in ids:
            raise APIError(400, f"after: no input item {after!r} in response {response_id!r}", param="after")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})
