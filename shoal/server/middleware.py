"""Access, size and encoding checks, and the last word on failures, as a plain ASGI middleware.

Plain ASGI (not Starlette's BaseHTTPMiddleware) so streaming responses and
disconnect messages pass through untouched. In order:

- Host: bound to a loopback address, the server answers only requests whose
  `Host` is a loopback name or address (localhost, 127.x.x.x, [::1]): a web
  page that rebinds its own DNS name to 127.0.0.1 sends its own name (DNS
  rebinding). Bound to anything else, the operator chose to be reachable.
- Origin: a browser names the page's origin on cross-site requests. One that is
  present and not allowed is refused (403) before anything runs: a `text/plain`
  POST needs no CORS preflight, so without this any web page could make a
  keyless server on localhost generate. Allowed: `--allowed-origins` ("*": all),
  and, when bound to loopback, the loopback origins (http(s)://localhost:PORT,
  127.x.x.x, [::1]), as Ollama does: a page this machine serves may call it,
  and gets CORS headers for it (app.py).
- API key: `Authorization: Bearer KEY` or Anthropic's `x-api-key: KEY`,
  compared in constant time; every path except the open ones needs it.
- Body size: the limit is read at request time (`ServerState.request_byte_limit`,
  which grows to fit the model's context once it is loaded); a declared
  Content-Length over it is refused before anything is read; a body without
  one (chunked) is read up to the limit, then replayed to the app.
- Encoding: a body must be UTF-8 without lone UTF-16 surrogates; both are a
  400 here, since a lone surrogate reaches the tokenizer as a str it cannot
  encode (see `_encoding_error`).
- Bodies are read as JSON whatever their Content-Type says.
- Unexpected exceptions: a 500 that says only that the server failed, with a
  request id; the traceback is logged under it. Answered here, inside
  Starlette's ServerErrorMiddleware, so the keep-alive connection stays up.
- Admission: each HTTP request is served inside `state.serving()`, so a request
  admitted against --max-waiting is released whichever way it ends.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import re
from urllib.parse import urlsplit

from shoal.server.errors import APIError, new_request_id, server_failure

log = logging.getLogger("shoal.server")

# No key needed: liveness, and the dashboard's page and files (they hold no data; the page asks /stats with the key).
OPEN_PATHS = frozenset({"/health", "/", "/dashboard", "/dashboard/dashboard.js", "/dashboard/dashboard.css"})

# http(s)://localhost, 127.x.x.x or [::1], any port (CORS in app.py uses it too).
LOOPBACK_ORIGIN_REGEX = r"https?://(localhost|127(\.\d{1,3}){3}|\[::1\])(:\d{1,5})?"

# A JSON escape that may spell half of a surrogate pair (\uD800-\uDFFF). An
# escaped backslash before "u" also matches: the walk then finds nothing.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


class AccessMiddleware:
    def __init__(self, app, state) -> None:
        """`state`: the app's ServerState (settings, the body limit, admissions)."""
        self.app = app
        self.state = state
        settings = state.settings
        self._key = settings.api_key.encode() if settings.api_key else None
        self._loopback = is_loopback_host(settings.host)
        self._origins = frozenset(settings.allowed_origins)
        self._open = OPEN_PATHS | ({"/metrics"} if settings.metrics_public else frozenset())

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 0

        async def send_counted(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self._serve(scope, receive, send_counted)
        finally:
            if status:  # HTTP requests by route and status, 4xx and 5xx included (/metrics)
                path = scope["path"]
                self.state.metrics.count_http(path if path in self.state.routes else "other", status)

    async def _serve(self, scope, receive, send) -> None:
        headers = _headers(scope)
        refusal = self._refusal(scope, headers)
        if refusal is not None:
            await _send_error(send, refusal, scope["path"])
            return
        if scope["method"] in ("POST", "PUT", "PATCH"):
            limit = self.state.request_byte_limit
            declared = headers.get(b"content-length")
            if declared is not None and declared.isdigit() and int(declared) > limit:
                await _send_error(send, _too_large(int(declared), limit), scope["path"])
                return
            body = bytearray()
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                body += message.get("body", b"")
                if len(body) > limit:
                    await _send_error(send, _too_large(len(body), limit, at_least=True), scope["path"])
                    return
                if not message.get("more_body", False):
                    break
            body = bytes(body)
            bad = _encoding_error(body)
            if bad is not None:
                await _send_error(send, bad, scope["path"])
                return
            receive = _replay(body, receive)
            # Bodies are JSON whatever the client labels them (curl -d says form data).
            scope = dict(scope)
            scope["headers"] = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-type"]
            scope["headers"].append((b"content-type", b"application/json"))
        started = False
        with self.state.serving() as admission:

            async def send_tracked(message) -> None:
                nonlocal started
                started = started or message["type"] == "http.response.start"
                if message["type"] == "http.response.body" and not message.get("more_body", False):
                    admission.release()  # the answer is complete: nothing of it waits any more
                await send(message)

            try:
                await self.app(scope, receive, send_tracked)
            except Exception as exc:
                if started:  # half a response is out: closing the connection is the only honest end
                    raise
                request_id = new_request_id()
                log.error("request %s (%s %s) failed", request_id, scope["method"], scope["path"], exc_info=exc)
                await _send_error(send_tracked, server_failure(request_id), scope["path"])

    def _refusal(self, scope, headers: dict[bytes, bytes]) -> APIError | None:
        """Why the request is refused before it runs (Host, Origin, API key), or None."""
        host = headers.get(b"host")
        if self._loopback and host is not None and not _is_loopback_authority(host.decode("latin-1")):
            return APIError(
                403,
                f"Host header {host.decode('latin-1')[:200]!r} is not allowed: this server is bound to a loopback address "
                "and answers only localhost, 127.0.0.1 or [::1] (bind another --host to serve other names)",
                code="host_not_allowed",
            )
        origin = headers.get(b"origin")
        if origin is not None and not self._origin_allowed(origin.decode("latin-1")):
            shown = origin.decode("latin-1")[:200]
            return APIError(
                403,
                f"requests from origin {shown} are not allowed; start the server with --allowed-origins {shown} to allow them",
                code="origin_not_allowed",
            )
        if self._key is not None and scope["path"] not in self._open and scope["method"] != "OPTIONS":
            if not self._authorized(headers):
                return APIError(401, "a valid API key is required (Authorization: Bearer KEY or x-api-key: KEY)", headers={"WWW-Authenticate": "Bearer"})
        return None

    def _origin_allowed(self, origin: str) -> bool:
        if "*" in self._origins or origin in self._origins:
            return True
        return self._loopback and re.fullmatch(LOOPBACK_ORIGIN_REGEX, origin) is not None

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        given = headers.get(b"x-api-key")
        auth = headers.get(b"authorization")
        if auth is not None and auth[:7].lower() == b"bearer ":
            given = auth[7:].strip()
        if given is None:
            return False
        return hmac.compare_digest(given, self._key)


def is_loopback_host(name: str) -> bool:
    """localhost, 127.x.x.x, ::1 (an address or name, without port or brackets)."""
    if name.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _is_loopback_authority(authority: str) -> bool:
    """A Host header value (name or address, optional port; IPv6 in brackets) names this machine."""
    try:
        parts = urlsplit("//" + authority)
        parts.port  # noqa: B018 (raises ValueError on a malformed port)
    except ValueError:
        return False
    return parts.hostname is not None and is_loopback_host(parts.hostname)


def _encoding_error(body: bytes) -> APIError | None:
    """Why the body is not UTF-8 text without lone surrogates, or None.

    The cheapest robust place for the check: the raw body is in hand, a strict
    decode is one pass in C, and it catches invalid bytes (ED A0 80 is a
    surrogate encoded as if it were a character) before json.loads would let
    them through. Surrogates written as JSON escapes (\\udfff) only exist after
    parsing, in any field (typed or free-form like tools and
    chat_template_kwargs), so the parsed body is walked, but only when the raw
    bytes hold such an escape: a valid pair (an emoji from an ASCII-only
    encoder) costs a second parse, everything else nothing.
    """
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as e:
        return APIError(
            400,
            f"the request body is not valid UTF-8 (byte 0x{body[e.start]:02x} at offset {e.start}: {e.reason}); "
            "send JSON encoded as UTF-8",
            code="invalid_encoding",
        )
    if _SURROGATE_ESCAPE.search(body) is None:
        return None
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):
        return None  # not JSON: the app says so
    found = _lone_surrogate(parsed)
    if found is None:
        return None
    path, char = found
    path = path.encode("utf-8", "backslashreplace").decode()  # a key may hold the surrogate itself
    where = f" at {path}" if path else ""
    return APIError(
        400,
        f"the request body contains a lone UTF-16 surrogate (\\u{ord(char):04x}){where}: "
        "a surrogate must be half of a pair (\\ud83d\\ude00); send valid Unicode text",
        param=path or None,
        code="invalid_encoding",
    )


def _lone_surrogate(value) -> tuple[str, str] | None:
    """(path like "messages[0].content", the surrogate) of the first string holding one; None if none does.

    Iterative: the body may be nested as deep as json.loads allows."""
    stack = [("", value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            m = _SURROGATE.search(v)
            if m is not None:
                return path, m.group()
        elif isinstance(v, dict):
            for key, item in reversed(v.items()):
                sub = f"{path}.{key}" if path else key
                m = _SURROGATE.search(key)
                if m is not None:
                    return sub, m.group()
                stack.append((sub, item))
        elif isinstance(v, list):
            stack.extend((f"{path}[{i}]", item) for i, item in reversed(list(enumerate(v))))
    return None


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


async def _send_error(send, err: APIError, path: str) -> None:
    payload = json.dumps(err.body(path)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in (err.headers or {}).items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
