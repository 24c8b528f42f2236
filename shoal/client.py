"""A small client for a running shoal server (what `shoal chat`, `complete` and `models` use).

Plain httpx and the OpenAI wire format, so it works against any compatible
server. Every failure is a `ClientError` whose message is one readable line.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import httpx

DEFAULT_URL = "http://127.0.0.1:8000"


class ClientError(Exception):
    pass


@dataclass
class Delta:
    """One piece of a streamed answer."""

    content: str = ""
    reasoning: str = ""
    finish_reason: str | None = None
    usage: dict | None = None


class ShoalClient:
    def __init__(self, url: str = DEFAULT_URL, api_key: str | None = None, timeout: float = 600.0) -> None:
        self.url = url.rstrip("/")
        if self.url.endswith("/v1"):
            self.url = self.url[: -len("/v1")]
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(
            base_url=self.url, headers=headers, timeout=httpx.Timeout(timeout, connect=10.0), trust_env=False
        )

    def close(self) -> None:
        self._http.close()

    # ------------------------------------------------------------ endpoints
    def models(self) -> list[dict]:
        return self._request("GET", "/v1/models").json()["data"]

    def load(self, model: str) -> dict:
        return self._request("POST", "/v1/models", json={"model": model}).json()

    def unload(self, model: str | None) -> list[dict]:
        """Unload `model`, or every loaded model (None); the cards of those unloaded."""
        if model is None:
            return self._request("DELETE", "/v1/models").json()["data"]
        return [self._request("DELETE", f"/v1/models/{model}").json()]

    def default_model(self) -> str:
        models = self.models()
        if not models:
            raise ClientError(f"the server at {self.url} serves no model")
        return models[0]["id"]

    def chat(self, messages: list[dict], **params) -> Iterator[Delta]:
        body = {"messages": messages, "stream": True, "stream_options": {"include_usage": True}, **params}
        for event in self._stream("/v1/chat/completions", body):
            yield from _deltas(event, chat=True)

    def complete(self, prompt: str, **params) -> Iterator[Delta]:
        body = {"prompt": prompt, "stream": True, "stream_options": {"include_usage": True}, **params}
        for event in self._stream("/v1/completions", body):
            yield from _deltas(event, chat=False)

    # ------------------------------------------------------------ transport
    def _request(self, method: str, path: str, **kw) -> httpx.Response:
        try:
            r = self._http.request(method, path, **kw)
        except httpx.TransportError as e:
            raise ClientError(self._unreachable(e)) from None
        if r.status_code >= 400:
            raise ClientError(_error_line(r.status_code, r.read()))
        return r

    def _stream(self, path: str, body: dict) -> Iterator[dict]:
        try:
            with self._http.stream("POST", path, json=body) as r:
                if r.status_code >= 400:
                    raise ClientError(_error_line(r.status_code, r.read()))
                for line in r.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    event = json.loads(data)
                    if "error" in event:
                        raise ClientError(f"server error: {event['error'].get('message', event['error'])}")
                    yield event
        except httpx.TransportError as e:
            raise ClientError(self._unreachable(e)) from None

    def _unreachable(self, e: Exception) -> str:
        if isinstance(e, httpx.ConnectError):
            return f"server not reachable at {self.url} (is `shoal serve` running?)"
        return f"connection to {self.url} failed: {type(e).__name__}: {e}".rstrip(": ")


def _deltas(event: dict, chat: bool) -> Iterator[Delta]:
    if event.get("usage"):
        yield Delta(usage=event["usage"])
    for choice in event.get("choices", []):
        if chat:
            d = choice.get("delta") or {}
            yield Delta(d.get("content") or "", d.get("reasoning_content") or "", choice.get("finish_reason"))
        else:
            yield Delta(choice.get("text") or "", "", choice.get("finish_reason"))


def _error_line(status: int, body: bytes) -> str:
    try:
        message = json.loads(body)["error"]["message"]
    except Exception:
        message = body.decode(errors="replace").strip()[:200] or "no details"
    return f"the server answered {status}: {message}"
