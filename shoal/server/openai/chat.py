"""POST /v1/chat/completions: messages -> template -> GenerationRequest -> chat.completion(.chunk).

Rendering and tokenizing run in a worker thread: a long conversation must not
stall the event loop (and /health with it).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request

from shoal.server.errors import bad_request
from shoal.server.chat.params import clipped_headers, engine_requests, resolve_params
from shoal.server.openai.common import (
    chat_logprobs,
    check_sequences,
    check_unsupported,
    finish_reason,
    new_id,
    now,
    output_constraint,
    usage,
    vllm_prompt_logprobs,
)
from shoal.server.openai.protocol import ChatCompletionRequest, ChatMessage
from shoal.server.chat.pipeline import DeltaPipeline
from shoal.server.chat.images import IMAGE_PART, ImageRef, render_conversation, template_content
from shoal.server.chat.render import ToolUse
from shoal.server.chat.tools import ToolCall, check_function_tools
from shoal.server.sse import DONE, DeltaEncoder, encode_event
from shoal.server.streams import RequestTracker, engine_error, merged, run_to_end, tracked
from shoal.types import GenerationRequest, RequestOutput

_IMAGE_PARTS = {"image_url", "input_image"}
_AUDIO_PARTS = {"input_audio", "audio"}


def message_dicts(messages: list[ChatMessage], images: list[ImageRef]) -> list[dict[str, Any]]:
    """Messages as the template sees them: string content (or text and image parts, where a message has
    images, each listed in `images`), `developer` as `system`."""
    out = []
    for i, m in enumerate(messages):
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": _content(m.content, i, images)}
        for key in ("name", "tool_calls", "tool_call_id", "reasoning_content"):
            value = getattr(m, key)
            if value is not None:
                d[key] = value
        out.append(d)
    return out


def _content(content, i: int, images: list[ImageRef]) -> str | list[dict]:
    """A message's content: its text parts joined, or with images the parts in order."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts: list[dict] = []
    for j, part in enumerate(content):
        kind = part.get("type")
        where = f"messages[{i}].content[{j}]"
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise bad_request(f"{where}.text must be a string", f"{where}.text")
            parts.append({"type": "text", "text": part["text"]})
        elif kind in _IMAGE_PARTS:
            images.append(_image_ref(part, kind, where))
            parts.append(IMAGE_PART)
        elif kind == "image":
            raise bad_request(f"{where}.type 'image' is not an OpenAI content part: send images as 'image_url' parts", f"{where}.type")
        elif kind in _AUDIO_PARTS:
            raise bad_request(f"this model does not accept audio ({where} is an {kind} part)", where)
        else:
            raise bad_request(f"{where}.type {kind!r} is not supported (use 'text' or 'image_url')", f"{where}.type")
    return template_content(parts)


def _image_ref(part: dict, kind: str, where: str) -> ImageRef:
    """{"type": "image_url", "image_url": {"url", "detail"}} (or the url alone, as some clients send it), and the
    Responses API's {"type": "input_image", "image_url": "...", "detail"}."""
    inner = part.get("image_url")
    if kind == "image_url" and isinstance(inner, dict):
        url, detail, field = inner.get("url"), inner.get("detail"), f"{where}.image_url.url"
    else:  # input_image, or image_url given as the url itself
        url, detail, field = inner, part.get("detail"), f"{where}.image_url"
    if not isinstance(url, str) or not url:
        raise bad_request(f"{field} must be a URL string (data:, http(s) or file:)", field)
    return ImageRef(where, f"{kind} part", url=url, detail=detail)


async def chat_prompt(served, body, tools: list[dict] | None, encode: bool = True) -> tuple[str, list[int], tuple]:
    """The chat request's prompt: text, token ids (images' tokens in place) and image spans (encode: run the
    tower on the images now, for a request to generate)."""
    images: list[ImageRef] = []
    messages = message_dicts(body.messages, images)
    return await render_conversation(served, messages, images, tools, body.chat_template_kwargs, body.add_generation_prompt, encode)


def tool_use(tools: list[dict] | None, choice, parallel: bool | None) -> ToolUse | None:
    """The request's tools and tool_choice, checked; None when the model sees no tools."""
    named = None
    if isinstance(choice, dict):
        fn = choice.get("function")
        named = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(named, str):
            named = None
    if choice not in (None, "none", "auto", "required") and named is None:
        raise bad_request(
            "invalid tool_choice: expected 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}",
            "tool_choice",
        )
    if not tools:
        if choice not in (None, "none", "auto"):
            raise bad_request(f"tool_choice {choice if isinstance(choice, str) else 'naming a function'!r} needs tools", "tool_choice")
        return None
    check_function_tools(tools)
    if choice == "none":
        return None  # the tools are hidden from the model
    parallel = parallel is not False
    if named is not None:
        if named not in {t["function"]["name"] for t in tools}:
            raise bad_request(f"tool_choice names the function {named!r}, which is not among the tools", "tool_choice")
        return ToolUse(tuple(tools), "named", named, parallel=False)
    return ToolUse(tuple(tools), "required" if choice == "required" else "auto", parallel=parallel)


def openai_tool_calls(calls: list[ToolCall], start: int = 0) -> list[dict]:
    return [{"index": start + k, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for k, c in enumerate(calls)]


async def create_chat_completion(body: ChatCompletionRequest, http: Request, state) -> JSONResponse | StreamingResponse:
    served = await state.admit(body.model, body.keep_alive)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    check_unsupported(body)
    structured, structured_param = output_constraint(body)
    tools = tool_use(body.tools, body.tool_choice, body.parallel_tool_calls)
    if tools is not None and tools.forced:
        if structured is not None:
            raise bad_request(f"tool_choice {body.tool_choice!r} forces a tool call, so {structured_param} cannot also be given", "tool_choice")
        structured, structured_param = tools.constraint(served), "tools"
    check_sequences(served, 1, body.n)
    if body.prompt_logprobs is not None and body.stream:
        raise bad_request("prompt_logprobs is not supported with stream yet", "prompt_logprobs")
    shown = [dict(t) for t in tools.tools] if tools is not None else None
    text, ids, images = await chat_prompt(served, body, shown)
    params = resolve_params(
        body,
        served,
        max_tokens=body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens,
        default_max_tokens=None,  # up to the context limit
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        prompt_logprobs=body.prompt_logprobs,
        extra_stop=served.renderer.default_stop,
        structured=structured,
        tool_call=structured_param == "tools",
    )
    rid = new_id("chatcmpl")
    (req,), (clipped,) = await engine_requests(served, rid, [(text, ids)], params, structured_param, priority=body.priority or 0,
                                               images=images)
    chat = _Chat(served, rid, body, req, tools.parser_name(served) if tools is not None else None)
    headers = clipped_headers([clipped])
    if body.stream:
        return StreamingResponse(chat.stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", **headers})
    return await chat.complete(http, headers)


class _Chat:
    def __init__(self, served, rid: str, body: ChatCompletionRequest, req: GenerationRequest, tool_parser: str | None) -> None:
        self.served = served
        self.tool_parser = tool_parser  # None: no tools, the text is all answer
        self.rid = rid
        self.body = body
        self.req = req
        self.created = now()
        self.parser = served.settings.reasoning_parser
        self.text_of = served.token_strings if req.params.logprobs is not None else None

    def _chunk(self, choices: list[dict], **extra) -> dict:
        return {
            "id": self.rid,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.served.model_name,
            "choices": choices,
            **extra,
        }

    # ------------------------------------------------------------ non-streaming
    async def complete(self, http: Request, headers: dict[str, str]) -> JSONResponse:
        async with tracked(self.served, self.rid, [self.req], "openai_chat") as tracker:
            (out,) = await run_to_end(self.served.engine, [self.req], http, tracker)
            return JSONResponse(self._body(out), headers=headers)

    def _body(self, out: RequestOutput) -> dict:
        choices = []
        for c in out.outputs:
            whole = DeltaPipeline(self.parser, self.tool_parser).feed(c.text, final=True)
            message: dict[str, Any] = {"role": "assistant", "content": whole.text}
            if self.parser:
                message["reasoning_content"] = whole.reasoning or None
            reason = finish_reason(c.finish_reason)
            if whole.calls:
                message["content"] = whole.text or None
                message["tool_calls"] = [{k: v for k, v in call.items() if k != "index"} for call in openai_tool_calls(whole.calls)]
                reason = "tool_calls" if reason == "stop" else reason
            choices.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": chat_logprobs(c.logprobs, self.text_of) if c.logprobs is not None and self.text_of else None,
                    "finish_reason": reason,
                    "stop_reason": c.stop_reason,
                }
            )
        body = {
            "id": self.rid,
            "object": "chat.completion",
            "created": self.created,
            "model": self.served.model_name,
            "choices": choices,
            "usage": usage([out]),
        }
        if self.body.prompt_logprobs is not None:
            body["prompt_logprobs"] = vllm_prompt_logprobs(out.prompt_logprobs, self.served.token_strings)
        return body

    # ------------------------------------------------------------ streaming
    async def stream(self) -> AsyncIterator[bytes]:
        tracker = RequestTracker(self.served, self.rid, [self.req], "openai_chat")
        n = self.req.params.n
        fast = DeltaEncoder(
            lambda key, text: self._chunk([{"index": key[0], "delta": {key[1]: text}, "logprobs": None, "finish_reason": None}])
        )
        pipelines = [DeltaPipeline(self.parser, self.tool_parser) for _ in range(n)]
        num_calls = [0] * n
        sent_logprobs = [0] * n
        finished = [False] * n
        last = None
        outcome = "disconnected"  # unless the loop below ends normally
        try:
            for i in range(n):
                yield encode_event(self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]))
            async with aclosing(merged(self.served.engine, [self.req])) as outputs:
                async for _, out in outputs:
                    tracker.observe(0, out)
                    last = out
                    for c in out.outputs:
                        i = c.index
                        if finished[i]:
                            continue
                        split = pipelines[i].feed(c.delta_text, final=c.finished)
                        calls = split.calls
                        new_lps = c.logprobs[sent_logprobs[i] :] if c.logprobs is not None else []
                        sent_logprobs[i] += len(new_lps)
                        if new_lps and self.text_of is not None:
                            delta = {k: v for k, v in (("reasoning_content", split.reasoning), ("content", split.text)) if v}
                            yield encode_event(self._chunk([{"index": i, "delta": delta, "logprobs": chat_logprobs(new_lps, self.text_of), "finish_reason": None}]))
                        else:
                            if split.reasoning:
                                yield fast.encode((i, "reasoning_content"), split.reasoning)
                            if split.text:
                                yield fast.encode((i, "content"), split.text)
                        if calls:
                            delta = {"tool_calls": openai_tool_calls(calls, num_calls[i])}
                            num_calls[i] += len(calls)
                            yield encode_event(self._chunk([{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}]))
                        if c.finished:
                            finished[i] = True
                            reason = finish_reason(c.finish_reason)
                            reason = "tool_calls" if num_calls[i] and reason == "stop" else reason
                            yield encode_event(self._chunk([{"index": i, "delta": {}, "logprobs": None, "finish_reason": reason, "stop_reason": c.stop_reason}]))
            if self.body.stream_options is not None and self.body.stream_options.include_usage and last is not None:
                yield encode_event(self._chunk([], usage=usage([last])))
            outcome = "ok"
            yield DONE
        except Exception as e:
            outcome = "error"
            err = engine_error(e, self.rid)
            yield encode_event(err.body())
            yield DONE
        finally:
            tracker.finish(outcome)
