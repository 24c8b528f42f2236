"""The Anthropic adapter: POST /v1/messages and /v1/messages/count_tokens, errors in Anthropic's format."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from shoal.server.anthropic.messages import count_tokens, create_message, error_body
from shoal.server.anthropic.protocol import CountTokensRequest, CountTokensResponse, ErrorResponse, MessageResponse, MessagesRequest
from shoal.server.errors import register_error_format
from shoal.server.streams import answer_when_loaded

router = APIRouter()
register_error_format("/v1/messages", error_body)

_ERRORS = {s: {"model": ErrorResponse, "description": d} for s, d in (
    (400, "The request is invalid (invalid_request_error); the message names the field"),
    (401, "A missing or wrong API key (authentication_error)"),
    (403, "A refused Origin or Host (permission_error)"),
    (404, "No such model (not_found_error)"),
    (413, "The body is larger than --max-request-bytes (request_too_large)"),
    (500, "The server failed (api_error); details are in its log"),
    (503, "The model is loading or the server is overloaded (overloaded_error, Retry-After)"),
    (507, "The model cannot fit the server's memory budget (--models-memory)"),
)}


# With stream: Anthropic's named events, each `event: <type>` and `data: <JSON>`.
_EVENT = {"type": "object", "properties": {"event": {"type": "string"}, "data": {"type": "string"}}, "required": ["event", "data"]}


@router.post("/v1/messages", responses={200: {"model": MessageResponse, "content": {"text/event-stream": {"schema": _EVENT}}}, **_ERRORS})
async def messages(body: MessagesRequest, request: Request) -> Response:
    """Anthropic's Messages API: a reply to a conversation, whole or as a stream of Anthropic's events; tools, thinking and `output_config.format`."""
    return await answer_when_loaded(request, body.model, body.stream, lambda: create_message(body, request, request.app.state.shoal))


@router.post("/v1/messages/count_tokens", responses={200: {"model": CountTokensResponse}, **_ERRORS})
async def messages_count_tokens(body: CountTokensRequest, request: Request) -> JSONResponse:
    """The number of input tokens the conversation renders to, as `usage.input_tokens` would count them."""
    return await count_tokens(body, request.app.state.shoal)
