"""POST /v1/responses: items -> the shared chat pipeline -> GenerationRequest -> a response object, or OpenAI's
typed event stream.

The request is translated with server/chat/ as chat's is (rendering, parameters, tools, structured output,
reasoning, images), with nothing of its own but the translation. A continued turn (`previous_response_id`)
renders the stored conversation and the new input as one prompt: the previous prompt and reply are its
prefix, so their KV comes from the prefix cache and the engine computes only the new tokens.

The stream's events, in order, each with its `sequence_number`:

    response.created, response.in_progress
    per output item (reasoning, then the message, then each function call):
      response.output_item.added
      reasoning: response.content_part.added, response.reasoning_text.delta..., response.reasoning_text.done,
                 response.content_part.done
      message:   response.content_part.added, response.output_text.delta..., response.output_text.done,
                 response.content_part.done
      call:      response.function_call_arguments.delta, response.function_call_arguments.done
      response.output_item.done
    response.completed | response.incomplete (max_output_tokens) | response.failed (with the error)
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import replace

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request

from shoal.server.chat.images import ImageRef, render_conversation
from shoal.server.chat.params import clipped_headers, engine_requests, resolve_params
from shoal.server.chat.pipeline import Delta, DeltaPipeline
from shoal.server.chat.reasoning import END, START
from shoal.server.chat.render import ToolUse
from shoal.server.chat.tools import ToolCall
from shoal.server.errors import APIError, bad_request
from shoal.server.responses.items import conversation, new_item_id, normalize_input, output_format, reasoning_options, tool_use
from shoal.server.responses.protocol import ResponsesRequest
from shoal.server.responses.store import ResponseStore, record
from shoal.server.sse import dumps
from shoal.server.streams import RequestTracker, engine_error, merged, run_to_end, tracked
from shoal.types import FinishReason, GenerationRequest, RequestOutput

PROTOCOL = "openai_responses"  # the request histograms' label (metrics.PROTOCOLS)
# OpenAI's bounds on metadata: 16 pairs, keys up to 64 characters, values up to 512.
METADATA_PAIRS, METADATA_KEY, METADATA_VALUE = 16, 64, 512


def not_found(rid: str, param: str) -> APIError:
    return APIError(404, f"no stored response with id {rid!r}: it was never stored (store: false), was deleted, or the "
                          "store's bounds evicted it", param=param)


def _refuse_unsupported(body: ResponsesRequest) -> None:
    if body.background:
        raise bad_request("background responses are not supported: this server answers within the request (or streams)", "background")
    if body.conversation is not None:
        raise bad_request("conversation: this server has no Conversations API; continue with previous_response_id", "conversation")
    if body.prompt is not None:
        raise bad_request("prompt (a stored prompt template) is not supported: send instructions and input", "prompt")
    if body.top_logprobs:
        raise bad_request("top_logprobs is not supported by this server's Responses API", "top_logprobs")
    meta = body.metadata or {}
    if len(meta) > METADATA_PAIRS:
        raise bad_request(f"metadata holds {len(meta)} pairs; at most {METADATA_PAIRS}", "metadata")
    for key, value in meta.items():
        if len(key) > METADATA_KEY or len(value) > METADATA_VALUE:
            raise bad_request(f"metadata keys are at most {METADATA_KEY} characters and values at most {METADATA_VALUE} "
                              f"({key[:20]!r} is longer)", "metadata")


async def create_response(body: ResponsesRequest, http: Request, state) -> JSONResponse | StreamingResponse:
    _refuse_unsupported(body)
    store: ResponseStore = http.app.state.responses
    previous = None
    if body.previous_response_id is not None:
        previous = store.get(body.previous_response_id)
        if previous is None:
            raise not_found(body.previous_response_id, "previous_response_id")
    items = normalize_input(body.input)
    if not items and previous is None:
        raise bad_request("input is required (a string or a list of items)", "input")
    served = await state.admit(body.model, body.keep_alive)
    tools = tool_use(body.tools, body.tool_choice, body.parallel_tool_calls)
    structured, param = output_format(body.text)
    if tools is not None and tools.forced:
        # The reply is the call, so text.format has nothing to hold: it is for the turns that answer in text. The
        # Agents SDK sends both (an agent's output_type, and tool_choice "required" until a tool has run).
        structured, param = tools.constraint(served), "tools"
    template_kwargs, budget = reasoning_options(served, body.reasoning)
    earlier = previous.conversation if previous is not None else []
    context, text, ids, images = await _render(served, body, earlier, items, tools, template_kwargs)
    params = resolve_params(body, served, max_tokens=body.max_output_tokens, default_max_tokens=None, logprobs=None,
                            extra_stop=served.renderer.default_stop, structured=structured, tool_call=param == "tools")
    if budget is not None:
        params = replace(params, thinking_budget=budget)
    rid = f"resp_{uuid.uuid4().hex}"
    (req,), (clipped,) = await engine_requests(served, rid, [(text, ids)], params, param, prompt_param="input", images=images)
    job = _Job(served, rid, body, req, tools, store, items, context)
    headers = clipped_headers([clipped])
    if body.stream:
        return StreamingResponse(job.stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", **headers})
    return await job.complete(http, headers)


async def _render(served, body: ResponsesRequest, earlier: list[dict], items: list[dict], tools: ToolUse | None,
                  template_kwargs: dict) -> tuple[list[dict], str, list[int], tuple]:
    """The conversation (the stored one and the new items) as a prompt. With `truncation: "auto"`, a prompt that
    leaves no room in the context loses its oldest turns, a user message at a time, until it fits (or one is left);
    what is left is the context the response is stored with."""
    shown = [dict(t) for t in tools.tools] if tools is not None else None
    context, first = [*earlier, *items], len(earlier)
    while True:
        cut = next((k for k in range(1, len(context)) if context[k]["type"] == "message" and context[k]["role"] == "user"), None)
        truncate = body.truncation == "auto" and cut is not None
        refs: list[ImageRef] = []
        messages = conversation(context, body.instructions, refs, first)
        try:
            text, ids, images = await render_conversation(served, messages, refs, shown, template_kwargs)
        except APIError as e:
            if truncate and "cannot fit" in e.message:  # too many characters to be worth tokenizing
                context, first = context[cut:], max(0, first - cut)
                continue
            if e.param == "messages":  # chat's name for the conversation: here it is the input
                e.param = "input"
            raise
        if not truncate or len(ids) < served.engine.max_model_len:
            return context, text, ids, images  # (too long without truncation: the engine's check says so)
        context, first = context[cut:], max(0, first - cut)


class _Output:
    """The response's output items as the reply's pieces open, fill and close them, and each change as a typed
    event (when streaming). One item is open at a time: reasoning, then the message; a call is whole at once."""

    def __init__(self, streaming: bool) -> None:
        self.streaming = streaming
        self.items: list[dict] = []
        self.open: dict | None = None  # a reasoning or message item being written
        self.seq = 0

    def event(self, kind: str, **data) -> bytes:
        payload = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return f"event: {kind}\ndata: {dumps(payload)}\n\n".encode() if self.streaming else b""

    def _add(self, item: dict) -> list[bytes]:
        self.items.append(item)
        return [self.event("response.output_item.added", output_index=len(self.items) - 1, item=_copy(item))]

    def _where(self) -> dict:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}

    def feed(self, delta: Delta) -> list[bytes]:
        out = self._text("reasoning", delta.reasoning) + self._text("message", delta.text)
        for call in delta.calls:
            out += self.call(call)
        return out

    def _open(self, kind: str) -> list[bytes]:
        out = self.close()
        if kind == "reasoning":
            item = {"id": new_item_id(kind), "type": kind, "summary": [], "content": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {"id": new_item_id(kind), "type": kind, "role": "assistant", "status": "in_progress", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        out += self._add(item)
        self.open = item
        item["content"].append(part)
        out.append(self.event("response.content_part.added", **self._where(), content_index=0, part=dict(part)))
        return out

    def _text(self, kind: str, text: str) -> list[bytes]:
        if not text:
            return []
        out = self._open(kind) if self.open is None or self.open["type"] != kind else []
        self.open["content"][0]["text"] += text
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        out.append(self.event(name, **self._where(), content_index=0, delta=text, **extra))
        return out

    def call(self, call: ToolCall) -> list[bytes]:
        out = self.close()
        item = {"id": new_item_id("function_call"), "type": "function_call", "call_id": call.id, "name": call.name,
                "arguments": "", "status": "in_progress"}
        out += self._add(item)
        out.append(self.event("response.function_call_arguments.delta", **self._where(), delta=call.arguments))
        item["arguments"] = call.arguments
        out.append(self.event("response.function_call_arguments.done", **self._where(), name=call.name, arguments=call.arguments))
        item["status"] = "completed"
        out.append(self.event("response.output_item.done", output_index=len(self.items) - 1, item=_copy(item)))
        return out

    def close(self, status: str = "completed") -> list[bytes]:
        """The open item done (status: "incomplete" when the reply stopped at max_output_tokens)."""
        item, self.open = self.open, None
        if item is None:
            return []
        index = self.items.index(item)
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        part = item["content"][0]
        if item["type"] == "reasoning":
            out = [self.event("response.reasoning_text.done", **where, text=part["text"])]
        else:
            out = [self.event("response.output_text.done", **where, text=part["text"], logprobs=[])]
        out.append(self.event("response.content_part.done", **where, part=dict(part)))
        item["status"] = status
        out.append(self.event("response.output_item.done", output_index=index, item=_copy(item)))
        return out

    def finish(self, status: str) -> list[bytes]:
        """Close what is open; an empty reply still has its (empty) message."""
        out = self._open("message") if not self.items else []
        return out + self.close("incomplete" if status == "incomplete" else "completed")


def _find(ids: list[int], tag: list[int], start: int) -> int | None:
    """Where the token ids `tag` first occur in `ids` from `start` on."""
    n = len(tag)
    return next((k for k in range(start, len(ids) - n + 1) if n and ids[k : k + n] == tag), None)


def _copy(item: dict) -> dict:
    return {**item, **({"content": [dict(p) for p in item["content"]]} if "content" in item else {})}


class _Job:
    def __init__(self, served, rid: str, body: ResponsesRequest, req: GenerationRequest, tools: ToolUse | None,
                 store: ResponseStore, items: list[dict], context: list[dict]) -> None:
        self.served = served
        self.rid = rid
        self.body = body
        self.req = req
        self.store = store
        self.items = items
        self.context = context
        self.reasoning_parser = served.settings.reasoning_parser
        self.tool_parser = tools.parser_name(served) if tools is not None else None
        self.created_at = int(time.time())
        self.keep = body.store is not False

    def response(self, status: str, output: list[dict], out: RequestOutput | None = None, error: dict | None = None) -> dict:
        b, p = self.body, self.req.params
        return {
            "id": self.rid, "object": "response", "created_at": self.created_at, "status": status,
            "model": self.served.model_name, "output": output, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": b.instructions, "previous_response_id": b.previous_response_id, "store": self.keep,
            "usage": self._usage(out, output) if out is not None else None, "metadata": b.metadata or {},
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "tool_choice": b.tool_choice if b.tool_choice is not None else "auto", "tools": b.tools or [],
            "max_output_tokens": b.max_output_tokens, "temperature": p.temperature, "top_p": p.top_p,
            "text": b.text if b.text and b.text.get("format") else {**(b.text or {}), "format": {"type": "text"}},
            "reasoning": {"effort": (b.reasoning or {}).get("effort"), "summary": None},
            "truncation": b.truncation or "disabled", "user": b.user, "background": False,
        }

    def _usage(self, out: RequestOutput, output: list[dict]) -> dict:
        inputs, generated = len(self.req.prompt_token_ids), out.num_generated_tokens
        return {"input_tokens": inputs, "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
                "output_tokens": generated, "output_tokens_details": {"reasoning_tokens": self._reasoning_tokens(out, output)},
                "total_tokens": inputs + generated}

    def _reasoning_tokens(self, out: RequestOutput, output: list[dict]) -> int:
        """The generated tokens from the reasoning's start to its end tag (included); all from the start when the
        reply never closed it. Counted in the tokens generated, not by tokenizing the text again."""
        if not any(i["type"] == "reasoning" for i in output):
            return 0
        ids = list(out.outputs[0].token_ids)
        encode = self.served.engine.tokenizer.encode
        start = 0 if self.reasoning_parser == "deepseek_r1" else _find(ids, encode(START, add_special_tokens=False), 0)
        start = 0 if start is None else start
        end = encode(END, add_special_tokens=False)
        at = _find(ids, end, start)
        return (at + len(end) if at is not None else len(ids)) - start

    @staticmethod
    def status(out: RequestOutput) -> tuple[str, dict | None]:
        c = out.outputs[0]
        if c.finish_reason is FinishReason.ERROR:
            return "failed", {"code": "server_error", "message": out.error or "the request failed in the engine"}
        if c.finish_reason is FinishReason.ABORT:
            return "failed", {"code": "server_error", "message": "the request was aborted"}
        return ("incomplete" if c.finish_reason is FinishReason.LENGTH else "completed"), None

    def keep_final(self, body: dict) -> None:
        if self.keep and body["status"] in ("completed", "incomplete"):
            self.store.put(self.rid, record(body, self.items, self.context, self.body.instructions))

    # ------------------------------------------------------------ whole
    async def complete(self, http: Request, headers: dict[str, str]) -> JSONResponse:
        async with tracked(self.served, self.rid, [self.req], PROTOCOL) as tracker:
            (out,) = await run_to_end(self.served.engine, [self.req], http, tracker)
        output = _Output(streaming=False)
        output.feed(DeltaPipeline(self.reasoning_parser, self.tool_parser).feed(out.outputs[0].text, final=True))
        status, error = self.status(out)
        output.finish(status)
        body = self.response(status, output.items, out, error)
        self.keep_final(body)
        return JSONResponse(body, headers=headers)

    # ------------------------------------------------------------ streamed
    async def stream(self) -> AsyncIterator[bytes]:
        tracker = RequestTracker(self.served, self.rid, [self.req], PROTOCOL)
        output = _Output(streaming=True)
        pipeline = DeltaPipeline(self.reasoning_parser, self.tool_parser)
        outcome, last = "disconnected", None
        try:
            yield output.event("response.created", response=self.response("in_progress", []))
            yield output.event("response.in_progress", response=self.response("in_progress", []))
            async with aclosing(merged(self.served.engine, [self.req])) as outputs:
                async for _, out in outputs:
                    tracker.observe(0, out)
                    last = out
                    c = out.outputs[0]
                    for piece in output.feed(pipeline.feed(c.delta_text, final=c.finished)):
                        yield piece
            status, error = self.status(last)
            for piece in output.finish(status):
                yield piece
            body = self.response(status, output.items, last, error)
            self.keep_final(body)
            kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(status, "response.failed")
            outcome = "ok" if status in ("completed", "incomplete") else "error"
            yield output.event(kind, response=body)
        except Exception as e:
            outcome = "error"
            err = engine_error(e, self.rid)
            code = "server_error" if err.status >= 500 else "invalid_prompt"
            for piece in output.close("incomplete"):
                yield piece
            failed = self.response("failed", output.items, last, {"code": code, "message": err.message})
            yield output.event("response.failed", response=failed)
        finally:
            tracker.finish(outcome)
