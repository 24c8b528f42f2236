"""Access and size limits as a plain ASGI middleware.

Plain ASGI (not Starlette's BaseHTTPMiddleware) so streaming responses and
disconnect messages pass through untouched.

- API key: `Authorization: Bearer KEY` or Anthropic's `x-api-key: KEY`,
  compared in constant time; every path except the open ones needs it.
- Request bodies are read as JSON whatever their Content-Type says.
- Body size: a declared Content-Length over the limit is refused before
  anything is read; a body without one (chunked) is read up to the limit, then
  replayed to the app.
"""

from __future__ import annotations

import hmac
import json

from shoal.server.errors import APIError

OPEN_PATHS = frozenset({"/health"})


class AccessMiddleware:
    def __init__(self, app, api_key: str | None, max_request_bytes: int) -> None:
        self.app = app
        self._key = api_key.encode() if api_key else None
        self.max_request_bytes = max_request_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        if self._key is not None and scope["path"] not in OPEN_PATHS and scope["method"] != "OPTIONS":
            if not self._authorized(headers):
                await _send_error(send, APIError(401, "a valid API key is required (Authorization: Bearer KEY or x-api-key: KEY)", headers={"WWW-Authenticate": "Bearer"}))
                return
        if scope["method"] in ("POST", "PUT", "PATCH"):
            limit = self.max_request_bytes
            declared = headers.get(b"content-length")
            if declared is not None and declared.isdigit() and int(declared) > limit:
                await _send_error(send, _too_large(int(declared), limit))
                return
            body = bytearray()
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                body += message.get("body", b"")
                if len(body) > limit:
                    await _send_error(send, _too_large(len(body), limit, at_least=True))
                    return
                if not message.get("more_body", False):
                    break
            receive = _replay(bytes(body), receive)
            # Bodies are JSON whatever the client labels them (curl -d says form data).
            scope = dict(scope)
            scope["headers"] = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-type"]
            scope["headers"].append((b"content-type", b"application/json"))
        await self.app(scope, receive, send)

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        given = headers.get(b"x-api-key")
        auth = headers.get(b"authorization")
        if auth is not None and auth[:7].lower() == b"bearer ":
            given = auth[7:].strip()
        if given is None:
            return False
        return hmac.compare_digest(given, self._key)


def _headers(scope) -> dict[bytes, bytes]:
    return {k.lower(): v for k, v in scope.get("headers", [])}


def _too_large(size: int, limit: int, at_least: bool = False) -> APIError:
    more = "more than " if at_least else ""
    return APIError(413, f"the request body is {more}{size} bytes, over the limit of {limit} bytes (--max-request-bytes)")


def _replay(body: bytes, receive):
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # later calls: the disconnect, when it comes

    return replay


async def _send_error(send, err: APIError) -> None:
    payload = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in (err.headers or {}).items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
