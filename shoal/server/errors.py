"""Errors in the protocol's format, never a stack trace.

OpenAI's (the default, and every route outside another protocol's):

    {"error": {"message": "...", "type": "invalid_request_error", "code": null, "param": "temperature"}}

A protocol adapter registers its own body for its routes' path prefix
(`register_error_format`: Anthropic's for /v1/messages), so every refusal, from a
handler, FastAPI's validation or the middleware, answers in the client's format.

Everything a handler refuses is an `APIError`; the handlers below also turn
FastAPI's validation errors (bad types, malformed JSON: 422 there) into 400s
whose message names the field, and Starlette's 404/405 into the same shape.
An unexpected exception is a 500 that says only that the server failed, with a
request id; the traceback goes to the log under that id (`server_failure`).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

# status -> (type, default code)
_KINDS = {
    400: ("invalid_request_error", None),
    401: ("authentication_error", "invalid_api_key"),
    403: ("permission_error", "forbidden"),
    404: ("not_found_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
    500: ("server_error", "internal_error"),
    503: ("service_unavailable_error", "unavailable"),
    507: ("insufficient_storage_error", "insufficient_storage"),  # a model that cannot fit the memory budget
}


class APIError(Exception):
    """A refusal with an HTTP status and an OpenAI-format body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        kind, default_code = _KINDS.get(status, ("invalid_request_error", None))
        self.status = status
        self.message = message
        self.param = param
        self.code = code if code is not None else default_code
        self.type = type or kind
        self.headers = headers

    def body(self, path: str = "") -> dict:
        """The error body in the format of the protocol that serves `path`."""
        for prefix, fmt in _ERROR_FORMATS:
            if path.startswith(prefix):
                return fmt(self)
        return error_body(self.message, self.type, self.code, self.param)

    def response(self, path: str = "") -> JSONResponse:
        return JSONResponse(self.body(path), status_code=self.status, headers=self.headers)


def error_body(message: str, type: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "code": code, "param": param}}


_ERROR_FORMATS: list[tuple[str, Callable[[APIError], dict]]] = []


def register_error_format(path_prefix: str, fmt: Callable[[APIError], dict]) -> None:
    """Routes under `path_prefix` answer errors with `fmt(error)` as the body."""
    if (path_prefix, fmt) not in _ERROR_FORMATS:
        _ERROR_FORMATS.append((path_prefix, fmt))


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def unavailable(message: str, retry_after: int, code: str) -> APIError:
    return APIError(503, message, code=code, headers={"Retry-After": str(retry_after)})


def new_request_id() -> str:
    """An id that ties a failure's 500 to its traceback in the log."""
    return f"req-{uuid.uuid4().hex[:24]}"


def server_failure(request_id: str, code: str | None = None) -> APIError:
    """The 500 for a failure the client cannot act on: what went wrong is in the log, under `request_id`."""
    return APIError(500, f"the server failed while handling this request (request id {request_id}); see the server log", code=code)


# A SamplingParams / engine ValueError starts with the field it is about
# ("temperature must be >= 0, got -1.0"); that word is the error's `param`.
_LEADING_FIELD = re.compile(r"^([a-z_]+)\b")


def from_value_error(exc: ValueError, known_fields: frozenset[str] | None = None) -> APIError:
    message = str(exc)
    m = _LEADING_FIELD.match(message)
    param = m.group(1) if m and (known_fields is None or m.group(1) in known_fields) else None
    if param is None and message.startswith(("the prompt", "prompt")):
        param = "prompt"
    return bad_request(message, param)


# ---------------------------------------------------------------- validation errors


def _field_name(loc: tuple) -> str:
    """("body", "messages", 0, "role") -> "messages[0].role"."""
    parts = [p for p in loc if p not in ("body", "query", "path")]
    name = ""
    for p in parts:
        if isinstance(p, int):
            name += f"[{p}]"
        else:
            # pydantic names the branch of a union it tried ("list[int]"); not a field.
            if "[" in str(p) or str(p) in ("str", "int", "float", "bool", "function-after", "json-or-python"):
                continue
            name += ("." if name else "") + str(p)
    return name


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """FastAPI's error list -> (one readable message naming the fields, the first field)."""
    msgs: list[str] = []
    first_param = None
    for err in errors:
        loc = tuple(err.get("loc", ()))
        if err.get("type") == "json_invalid":
            detail = (err.get("ctx") or {}).get("error", "")
            where = f" at position {loc[1]}" if len(loc) > 1 and isinstance(loc[1], int) else ""
            return f"the request body is not valid JSON ({detail}{where})", None
        field = _field_name(loc)
        msg = str(err.get("msg", "invalid value"))
        if err.get("type") == "missing":
            text = f"{field} is required" if field else "the request body is empty: send a JSON object"
        elif not field:
            text = f"the request body is invalid: {msg}"
            if err.get("type") in ("model_attributes_type", "dict_type"):
                text = "the request body must be a JSON object"
        else:
            got = err.get("input")
            shown = ""
            if got is not None and not isinstance(got, (dict, list)):
                r = json.dumps(got) if isinstance(got, (str, int, float, bool)) else repr(got)
                shown = f" (got {r[:60]})"
            text = f"invalid value for {field}: {msg}{shown}"
        if first_param is None and field:
            first_param = field
        if text not in msgs:
            msgs.append(text)
        if len(msgs) == 3:
            break
    return "; ".join(msgs) or "invalid request", first_param


# ---------------------------------------------------------------- handlers


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(exc.errors()))
        return bad_request(message, param).response(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            err = APIError(404, f"no such endpoint: {request.method} {request.url.path}")
        elif exc.status_code == 405:
            err = APIError(405, f"method {request.method} is not allowed on {request.url.path}")
        else:
            err = APIError(exc.status_code, str(exc.detail))
        err.headers = dict(exc.headers or {}) or None
        return err.response(request.url.path)

    # No handler for Exception: Starlette runs that one in ServerErrorMiddleware,
    # which re-raises after answering, and uvicorn then drops the keep-alive
    # connection. AccessMiddleware answers unexpected exceptions inside it.
