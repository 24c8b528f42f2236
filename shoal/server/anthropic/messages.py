"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API -> GenerationRequest.

Translates straight to the template's message dicts and shoal's `GenerationRequest`
(no OpenAI types in between), and the engine's output back into content blocks
(`thinking`, `text`, `tool_use`) or, with `stream`, into Anthropic's event sequence.

Real clients' habits:
  - `?beta=true` on the path is accepted (the query is ignored);
  - a conversational role other than user/assistant counts as the user's;
  - a system block starting with `x-anthropic-billing-header` (Claude Code sends one
    whose `cch=` value changes on every request, at the very front of the system
    prompt) is dropped before rendering, so an agent session's turns hit the prefix
    cache; `--keep-billing-header` keeps it.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import replace
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request

from shoal.server.anthropic.protocol import CountTokensRequest, MessagesRequest
from shoal.server.chat.params import clipped_headers, constraint, engine_requests, resolve_params
from shoal.server.chat.pipeline import DeltaPipeline
from shoal.server.chat.reasoning import thinking_budget as reasoning_budget
from shoal.server.chat.images import IMAGE_PART, ImageRef, render_conversation, template_content
from shoal.server.chat.render import ToolUse
from shoal.server.chat.tools import ToolCall
from shoal.server.errors import APIError, bad_request
from shoal.server.sse import dumps
from shoal.server.streams import RequestTracker, engine_error, merged, run_to_end, tracked
from shoal.types import FinishReason, GenerationRequest, RequestOutput, ThinkingBudget

BILLING_HEADER = "x-anthropic-billing-header"
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def error_body(err: APIError) -> dict:
    """Anthropic's error format: {"type": "error", "error": {"type", "message"}}."""
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(err.status, "api_error"), "message": err.message}}


# ---------------------------------------------------------------- request -> conversation


def _text_of(content, where: str, allowed=("text",), images: list[ImageRef] | None = None) -> str | list[dict]:
    """A string, or text blocks joined; with `images` (where the turn may hold them) image blocks too, listed
    there, and then the template's parts in order. Other block kinds are a 400 naming the block."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content blocks", where)
    parts: list[dict] = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        at = f"{where}[{j}]"
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise bad_request(f"{at}.text must be a string", f"{at}.text")
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and images is not None:
            images.append(_image_ref(block, at))
            parts.append(IMAGE_PART)
        elif kind == "image":
            raise bad_request(f"{at} is an image block, which this field does not take", at)
        elif kind not in allowed:
            raise bad_request(f"{at}.type {kind!r} is not supported here", f"{at}.type")
    return template_content(parts)


def _image_ref(block: dict, at: str) -> ImageRef:
    """{"type": "image", "source": {"type": "base64", "media_type", "data"} | {"type": "url", "url"}}."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        data = source.get("data")
        if not isinstance(data, str) or not data:
            raise bad_request(f"{at}.source.data must be a base64 string", f"{at}.source.data")
        media_type = source.get("media_type")
        if media_type is not None and not isinstance(media_type, str):
            raise bad_request(f"{at}.source.media_type must be a string", f"{at}.source.media_type")
        return ImageRef(at, "image block", data=data, media_type=media_type)
    if kind == "url":
        url = source.get("url")
        if not isinstance(url, str) or not url:
            raise bad_request(f"{at}.source.url must be a URL string", f"{at}.source.url")
        return ImageRef(at, "image block", url=url)
    raise bad_request(f"{at}.source must be {{\"type\": \"base64\", \"media_type\", \"data\"}} or {{\"type\": \"url\", \"url\"}}",
                      f"{at}.source")


def system_text(system, keep_billing_header: bool) -> str | None:
    if system is None:
        return None
    if isinstance(system, list) and not keep_billing_header:
        system = [b for b in system if not (isinstance(b, dict) and str(b.get("text", "")).startswith(BILLING_HEADER))]
    return _text_of(system, "system")


def conversation(body: CountTokensRequest, keep_billing_header: bool, images: list[ImageRef]) -> list[dict]:
    """Anthropic messages -> the template's message dicts (OpenAI-style tool calls and tool turns); the image
    blocks of user turns and tool results are listed in `images`, in order."""
    out: list[dict] = []
    system = system_text(body.system, keep_billing_header)
    if system:
        out.append({"role": "system", "content": system})
    tool_ids: set[str] = set()
    for i, m in enumerate(body.messages):
        where = f"messages[{i}].content"
        role = "assistant" if m.role == "assistant" else "user"
        if isinstance(m.content, str):
            out.append({"role": role, "content": m.content})
            continue
        texts, calls, thinking, results = [], [], [], []  # texts: the turn's text and image parts
        for j, block in enumerate(m.content):
            kind = block.get("type") if isinstance(block, dict) else None
            at = f"{where}[{j}]"
            if kind == "text":
                texts.append({"type": "text", "text": _text_of([block], where)})
            elif kind == "image" and role == "user":
                images.append(_image_ref(block, at))
                texts.append(IMAGE_PART)
            elif kind == "tool_use" and role == "assistant":
                name, tid, args = block.get("name"), block.get("id"), block.get("input", {})
                if not isinstance(name, str) or not isinstance(tid, str) or not isinstance(args, dict):
                    raise bad_request(f"{at} must have a string id and name and an object input", at)
                tool_ids.add(tid)
                calls.append({"id": tid, "type": "function", "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}})
            elif kind == "tool_result" and role == "user":
                tid = block.get("tool_use_id")
                if tid not in tool_ids:
                    raise bad_request(f"{at}.tool_use_id {tid!r} answers no tool_use block of an earlier assistant turn", f"{at}.tool_use_id")
                content = _text_of(block.get("content", ""), f"{at}.content", images=images)
                if block.get("is_error"):
                    content = f"Error: {content}" if isinstance(content, str) else [{"type": "text", "text": "Error:"}, *content]
                results.append({"role": "tool", "tool_call_id": tid, "content": content})
            elif kind == "thinking" and role == "assistant":
                thinking.append(str(block.get("thinking", "")))
            elif kind == "redacted_thinking" and role == "assistant":
                continue  # nothing a local model can read
            else:
                raise bad_request(f"{at}.type {kind!r} is not supported in a{'n' if role == 'assistant' else ''} {role} turn", f"{at}.type")
        out.extend(results)  # tool results first: they answer the previous turn's calls
        if texts or calls or thinking or not results:
            msg: dict[str, Any] = {"role": role, "content": template_content(texts)}
            if calls:
                msg["tool_calls"] = calls
            if thinking:
                msg["reasoning_content"] = "\n".join(thinking)
            out.append(msg)
    return out


def tool_use(body: CountTokensRequest) -> ToolUse | None:
    """Anthropic tools and tool_choice -> what the model sees and how its reply is read."""
    choice = body.tool_choice or {"type": "auto"}
    kind = choice.get("type")
    if kind not in ("auto", "any", "tool", "none"):
        raise bad_request("tool_choice.type must be one of 'auto', 'any', 'tool', 'none'", "tool_choice.type")
    if not body.tools:
        if kind in ("any", "tool"):
            raise bad_request(f"tool_choice {kind!r} needs tools", "tool_choice")
        return None
    tools = []
    for i, t in enumerate(body.tools):
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise bad_request(f"tools[{i}].name must be a non-empty string", f"tools[{i}].name")
        if t.get("type") not in (None, "custom"):
            raise bad_request(f"tools[{i}] is a server tool ({t['type']!r}), which this server does not run", f"tools[{i}].type")
        schema = t.get("input_schema")
        if not isinstance(schema, dict):
            raise bad_request(f"tools[{i}].input_schema must be a JSON schema (an object)", f"tools[{i}].input_schema")
        tools.append({"type": "function", "function": {"name": t["name"], "description": t.get("description", ""), "parameters": schema}})
    if kind == "none":
        return None
    parallel = not choice.get("disable_parallel_tool_use", False)
    if kind == "tool":
        name = choice.get("name")
        if name not in {t["function"]["name"] for t in tools}:
            raise bad_request(f"tool_choice names the tool {name!r}, which is not among the tools", "tool_choice.name")
        return ToolUse(tuple(tools), "named", name, parallel=False)
    return ToolUse(tuple(tools), "required" if kind == "any" else "auto", parallel=parallel)


def template_kwargs(body: CountTokensRequest) -> dict:
    """`thinking` and `output_config.effort` -> the template's thinking switch."""
    kw = {}
    thinking = body.thinking or {}
    if thinking.get("type") == "enabled":
        kw["enable_thinking"] = True
    elif thinking.get("type") == "disabled":
        kw["enable_thinking"] = False
    elif thinking and thinking.get("type") != "adaptive":
        raise bad_request("thinking.type must be 'enabled', 'disabled' or 'adaptive'", "thinking.type")
    effort = (body.output_config or {}).get("effort")
    if effort is not None and "enable_thinking" not in kw:
        kw["enable_thinking"] = effort != "low"
    return kw


def thinking_budget(served, body: MessagesRequest) -> ThinkingBudget | None:
    """`thinking: {"type": "enabled", "budget_tokens": N}` caps the reasoning at N tokens, for a
    model whose reasoning the server knows how to find (--reasoning-parser)."""
    thinking = body.thinking or {}
    if thinking.get("type") != "enabled" or "budget_tokens" not in thinking:
        return None
    n = thinking["budget_tokens"]
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise bad_request("thinking.budget_tokens must be a non-negative integer", "thinking.budget_tokens")
    return reasoning_budget(served, n)


async def render(served, body: CountTokensRequest, tools: ToolUse | None, encode: bool = True) -> tuple[str, list[int], tuple]:
    """The prompt: text, token ids (images' tokens in place) and image spans (encode: as chat_prompt's)."""
    images: list[ImageRef] = []
    messages = conversation(body, served.settings.keep_billing_header, images)
    shown = [dict(t) for t in tools.tools] if tools is not None else None
    return await render_conversation(served, messages, images, shown, template_kwargs(body), encode=encode)


# ---------------------------------------------------------------- routes


async def count_tokens(body: CountTokensRequest, state) -> JSONResponse:
    served = await state.model(body.model, body.keep_alive)
    tools = tool_use(body)
    _, ids, _ = await render(served, body, tools, encode=False)  # every image counted as its tokens
    return JSONResponse({"input_tokens": len(ids)})


async def create_message(body: MessagesRequest, http: Request, state) -> JSONResponse | StreamingResponse:
    served = await state.admit(body.model, body.keep_alive)
    tools = tool_use(body)
    structured = param = None
    fmt = (body.output_config or {}).get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
            raise bad_request("output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}", "output_config.format")
        param = "output_config.format.schema"
        structured = constraint("json", fmt.get("schema"), param)
    if tools is not None and tools.forced:
        if structured is not None:
            raise bad_request("a forced tool_choice and output_config.format cannot both constrain the reply", "tool_choice")
        structured, param = tools.constraint(served), "tools"
    if body.stop_sequences is not None and any(s == "" for s in body.stop_sequences):
        raise bad_request("stop_sequences must not hold empty strings", "stop_sequences")
    text, ids, images = await render(served, body, tools)
    params = resolve_params(body, served, max_tokens=body.max_tokens, default_max_tokens=None, logprobs=None,
                            extra_stop=served.renderer.default_stop, structured=structured, tool_call=param == "tools")
    budget = thinking_budget(served, body)
    if budget is not None:
        params = replace(params, thinking_budget=budget)
    rid = f"msg_{uuid.uuid4().hex[:24]}"
    (req,), (clipped,) = await engine_requests(served, rid, [(text, ids)], params, param, images=images)
    headers = clipped_headers([clipped])
    job = _Message(served, rid, body, req, tools.parser_name(served) if tools is not None else None)
    if body.stream:
        return StreamingResponse(job.stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", **headers})
    return await job.complete(http, headers)


# ---------------------------------------------------------------- responses


def _event(name: str, data: dict) -> bytes:
    return f"event: {name}\ndata: {dumps(data)}\n\n".encode()


class _Message:
    def __init__(self, served, rid: str, body: MessagesRequest, req: GenerationRequest, tool_parser: str | None) -> None:
        self.served = served
        self.rid = rid
        self.body = body
        self.req = req
        self.reasoning = served.settings.reasoning_parser
        self.tool_parser = tool_parser
        self.stops = set(body.stop_sequences or ())

    def _stop(self, out: RequestOutput, called: bool) -> tuple[str, str | None]:
        c = out.outputs[0]
        if c.finish_reason is FinishReason.LENGTH:
            return "max_tokens", None
        if called:
            return "tool_use", None
        if isinstance(c.stop_reason, str) and c.stop_reason in self.stops:
            return "stop_sequence", c.stop_reason
        return "end_turn", None

    def _usage(self, out: RequestOutput | None) -> dict:
        return {
            "input_tokens": len(self.req.prompt_token_ids),
            "output_tokens": out.num_generated_tokens if out is not None else 0,
            "cache_read_input_tokens": out.num_cached_tokens if out is not None else 0,
            "cache_creation_input_tokens": 0,
        }

    def _shell(self) -> dict:
        return {"id": self.rid, "type": "message", "role": "assistant", "model": self.served.model_name}

    async def complete(self, http: Request, headers: dict[str, str]) -> JSONResponse:
        async with tracked(self.served, self.rid, [self.req], "anthropic_messages") as tracker:
            (out,) = await run_to_end(self.served.engine, [self.req], http, tracker)
            return JSONResponse(self._body(out), headers=headers)

    def _body(self, out: RequestOutput) -> dict:
        whole = DeltaPipeline(self.reasoning, self.tool_parser).feed(out.outputs[0].text, final=True)
        content: list[dict] = []
        if whole.reasoning:
            content.append({"type": "thinking", "thinking": whole.reasoning, "signature": ""})
        if whole.text or not (whole.calls or whole.reasoning):  # never an empty content list
            content.append({"type": "text", "text": whole.text})
        content.extend(_tool_use_block(call) for call in whole.calls)
        stop_reason, stop_sequence = self._stop(out, bool(whole.calls))
        return {**self._shell(), "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": self._usage(out)}

    async def stream(self) -> AsyncIterator[bytes]:
        tracker = RequestTracker(self.served, self.rid, [self.req], "anthropic_messages")
        blocks = _Blocks()
        pipeline = DeltaPipeline(self.reasoning, self.tool_parser)
        called, last, outcome = False, None, "disconnected"
        try:
            yield _event("message_start", {"type": "message_start", "message": {
                **self._shell(), "content": [], "stop_reason": None, "stop_sequence": None, "usage": self._usage(None)}})
            yield _event("ping", {"type": "ping"})
            async with aclosing(merged(self.served.engine, [self.req])) as outputs:
                async for _, out in outputs:
                    tracker.observe(0, out)
                    last = out
                    c = out.outputs[0]
                    delta = pipeline.feed(c.delta_text, final=c.finished)
                    for piece in blocks.thinking(delta.reasoning):
                        yield piece
                    for piece in blocks.text(delta.text):
                        yield piece
                    for call in delta.calls:
                        called = True
                        for piece in blocks.tool_use(call):
                            yield piece
            for piece in blocks.close():
                yield piece
            stop_reason, stop_sequence = self._stop(last, called)
            yield _event("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                           "usage": self._usage(last)})
            yield _event("message_stop", {"type": "message_stop"})
            outcome = "ok"
        except Exception as e:
            outcome = "error"
            yield _event("error", error_body(engine_error(e, self.rid)))
        finally:
            tracker.finish(outcome)


def _tool_use_block(call: ToolCall) -> dict:
    return {"type": "tool_use", "id": call.id.replace("call_", "toolu_", 1), "name": call.name, "input": call.input}


class _Blocks:
    """The stream's content blocks: one open at a time, each started, filled with deltas and stopped."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None

    def _switch(self, kind: str, start: dict) -> list[bytes]:
        out = self.close()
        self.index += 1
        self.open = kind
        out.append(_event("content_block_start", {"type": "content_block_start", "index": self.index, "content_block": start}))
        return out

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def thinking(self, text: str) -> list[bytes]:
        if not text:
            return []
        out = self._switch("thinking", {"type": "thinking", "thinking": "", "signature": ""}) if self.open != "thinking" else []
        out.append(_event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": {"type": "thinking_delta", "thinking": text}}))
        return out

    def text(self, text: str) -> list[bytes]:
        if not text:
            return []
        out = self._switch("text", {"type": "text", "text": ""}) if self.open != "text" else []
        out.append(_event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": {"type": "text_delta", "text": text}}))
        return out

    def tool_use(self, call: ToolCall) -> list[bytes]:
        block = _tool_use_block(call)
        out = self._switch("tool_use", {**block, "input": {}})
        out.append(_event("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                  "delta": {"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}}))
        out.extend(self.close())
        return out
