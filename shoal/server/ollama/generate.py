"""POST /api/chat and /api/generate: Ollama's conversation or prompt -> GenerationRequest -> Ollama's lines.

Translates straight to the template's message dicts and shoal's `GenerationRequest` through `server/chat/`
(rendering, images, parameters, tools, reasoning), and the engine's output back into Ollama's objects: with
`stream` (Ollama's default) one JSON object per line (NDJSON), the last with `done: true`, the `done_reason`
and the timings; without it one object holding the whole answer and the same fields.

Ollama's habits kept:
  - a request with no messages (chat) or no prompt (generate) loads the model and answers at once with
    `done_reason: "load"`; with `keep_alive: 0` it unloads the model once idle (`"unload"`);
  - a model named with the tag `:latest` is the model of that name;
  - generate's `suffix` asks for the middle between `prompt` and it, in the model's fill-in-the-middle tokens
    (`FIM_MARKERS`, as Ollama's templates for code models write them); a request's own `template` is run over its
    system, prompt and suffix where it keeps to Go's fields, if/else and comments (gotemplate.py), else refused;
  - the timings are nanoseconds: `total_duration` from the request's arrival to its last line, `load_duration`
    the wait for the model (its load, when it was not loaded), `prompt_eval_duration` the prompt's computation
    up to the first token, `eval_duration` the generation after it. The counts are the engine's: the prompt's
    tokens (cached ones included, as Ollama counts them) and the generated tokens.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import replace
from datetime import datetime, timezone
from types import SimpleNamespace

from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import Request

from shoal.server.chat.images import IMAGE_PART, ImageRef, render_conversation, template_content
from shoal.server.chat.params import clipped_headers, constraint, engine_requests, resolve_params
from shoal.server.chat.pipeline import DeltaPipeline
from shoal.server.chat.render import ToolUse, check_prompt_chars
from shoal.server.chat.tools import ToolCall, check_function_tools
from shoal.server.errors import APIError, bad_request, from_value_error
from shoal.server.models import parse_keep_alive
from shoal.server.ollama import gotemplate
from shoal.server.ollama.protocol import ChatRequest, GenerateRequest, Message, Options
from shoal.server.streams import RequestTracker, engine_error, merged, run_to_end, tracked
from shoal.types import FinishReason, GenerationRequest, RequestOutput, StructuredOutput, TokenLogprobs

NDJSON = "application/x-ndjson"
LATEST = ":latest"


def created_at() -> str:
    """RFC 3339 in UTC, as Ollama writes it."""
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def ns(seconds: float | None) -> int:
    """A duration in nanoseconds, at least 1 (a duration Ollama reports is never 0)."""
    return max(1, int((seconds or 0.0) * 1e9))


def line(obj: dict) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


def model_name(state, name: str) -> str:
    """The served name a request means: `name`, or `name` without Ollama's default tag `:latest`."""
    try:
        state.models.find(name)
        return name
    except APIError as e:
        if e.status != 404 or not name.endswith(LATEST):
            raise
        try:
            state.models.find(name[: -len(LATEST)])
        except APIError:
            raise e from None
        return name[: -len(LATEST)]


def keep_alive_seconds(value) -> float | None:
    if value is None:
        return None
    try:
        return parse_keep_alive(value)
    except ValueError as err:
        raise bad_request(str(err), "keep_alive") from None


# ---------------------------------------------------------------- request -> conversation


def conversation(messages: list[Message], images: list[ImageRef]) -> list[dict]:
    """Ollama's messages -> the template's message dicts (OpenAI-style tool calls, `reasoning_content`); each
    image is listed in `images` and goes before its message's text, as Ollama places them."""
    out: list[dict] = []
    pending: list[str] = []  # the last assistant turn's call ids, for tool turns that give none
    for i, m in enumerate(messages):
        d: dict = {"role": m.role, "content": m.content or ""}
        if m.images:
            if m.role != "user":
                raise bad_request(f"messages[{i}].images: only user messages may hold images", f"messages[{i}].images")
            parts = []
            for j, data in enumerate(m.images):
                images.append(ImageRef(f"messages[{i}].images[{j}]", "image", data=data))
                parts.append(IMAGE_PART)
            if m.content:
                parts.append({"type": "text", "text": m.content})
            d["content"] = template_content(parts)
        if m.tool_calls:
            if m.role != "assistant":
                raise bad_request(f"messages[{i}].tool_calls: only assistant messages make tool calls", f"messages[{i}].tool_calls")
            calls = []
            for j, tc in enumerate(m.tool_calls):
                args = tc.function.arguments
                if isinstance(args, str):
                    try:
                        args = json.loads(args) if args.strip() else {}
                    except ValueError:
                        args = None
                    if not isinstance(args, dict):
                        where = f"messages[{i}].tool_calls[{j}].function.arguments"
                        raise bad_request(f"{where} must be an object (or a JSON string of one)", where)
                calls.append({"id": tc.id or f"call_{i}_{j}", "type": "function",
                              "function": {"name": tc.function.name, "arguments": json.dumps(args, ensure_ascii=False)}})
            d["tool_calls"] = calls
            pending = [c["id"] for c in calls]
        if m.thinking and m.role == "assistant":
            d["reasoning_content"] = m.thinking
        if m.role == "tool":
            d["tool_call_id"] = m.tool_call_id or (pending.pop(0) if pending else f"call_{i}")
            if m.tool_name:
                d["name"] = m.tool_name
        out.append(d)
    return out


def tool_use(tools: list[dict] | None) -> ToolUse | None:
    """Ollama's tools (OpenAI's function format), checked; the model decides whether to call one."""
    if not tools:
        return None
    check_function_tools(tools, type_required=False)
    return ToolUse(tuple({"type": "function", "function": t["function"]} for t in tools), "auto")


def output_format(fmt) -> StructuredOutput | None:
    """`format`: "json" (a JSON object) or a JSON schema; "" or absent: none."""
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return StructuredOutput(json_object=True)
    if isinstance(fmt, dict):
        return constraint("json", fmt, "format")
    raise bad_request(f"format must be \"json\" or a JSON schema (an object), got {fmt!r}"[:200], "format")


def template_kwargs(served, think) -> dict:
    """`think` -> the template's thinking switch (and a level's name as `reasoning_effort`, which gpt-oss reads)."""
    if think is None:
        return {}
    if think is False:
        return {"enable_thinking": False}
    if served.settings.reasoning_parser is None:
        raise bad_request(f"model {served.name!r} does not support thinking here: the server splits no reasoning out of "
                          "its replies (start it with --reasoning-parser)", "think")
    return {"enable_thinking": True, **({"reasoning_effort": think} if isinstance(think, str) else {})}


def sampling(body, served, structured: StructuredOutput | None, prompt_len: int, templated: bool = True):
    """The request's SamplingParams from its options (each through the server's chain), num_ctx applied. templated:
    the prompt went through the chat template, whose own stop string (the plain fallback's) then applies too."""
    o = body.options or Options()
    if o.num_predict == 0:
        raise bad_request("options.num_predict must be a positive number of tokens, or -1 (no limit) or -2 (fill the context)",
                          "options.num_predict")
    if o.stop is not None and any(s == "" for s in o.stop):
        raise bad_request("options.stop must not hold empty strings", "options.stop")
    req = SimpleNamespace(temperature=o.temperature, top_p=o.top_p, top_k=o.top_k, min_p=o.min_p, repetition_penalty=o.repeat_penalty,
                          presence_penalty=o.presence_penalty, frequency_penalty=o.frequency_penalty, seed=o.seed, stop=o.stop)
    max_tokens = o.num_predict if o.num_predict is not None and o.num_predict > 0 else None
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = resolve_params(req, served, max_tokens=max_tokens, default_max_tokens=None, logprobs=logprobs,
                            extra_stop=served.renderer.default_stop if templated else (), structured=structured, tool_call=False)
    try:
        if o.typical_p is not None:
            params = replace(params, typical_p=o.typical_p)
        if o.num_ctx is not None and o.num_ctx < served.engine.max_model_len:  # larger: the served context applies
            room = o.num_ctx - prompt_len
            if room < 1:
                raise bad_request(f"the prompt has {prompt_len} tokens, which leaves no room in options.num_ctx ({o.num_ctx})", "options.num_ctx")
            params = replace(params, max_tokens=min(params.max_tokens or room, room))
    except ValueError as e:
        raise from_value_error(e) from None
    return params


# ---------------------------------------------------------------- routes


async def chat(body: ChatRequest, http: Request, state) -> Response:
    start = time.monotonic()
    name = model_name(state, body.model)
    if not body.messages:
        return await _load_only(state, name, body, start, {"message": {"role": "assistant", "content": ""}})
    served = await state.admit(name, body.keep_alive)
    loaded = time.monotonic()
    tools = tool_use(body.tools)
    structured = output_format(body.format)
    images: list[ImageRef] = []
    messages = conversation(body.messages, images)
    shown = [dict(t) for t in tools.tools] if tools is not None else None
    text, ids, spans = await render_conversation(served, messages, images, shown, template_kwargs(served, body.think))
    params = sampling(body, served, structured, len(ids))
    rid = f"ollama-chat-{uuid.uuid4().hex[:24]}"
    (req,), (clipped,) = await engine_requests(served, rid, [(text, ids)], params, "format", images=spans)
    job = _Answer(served, body, req, "ollama_chat", tools.parser_name(served) if tools is not None else None, start, loaded - start)
    return await job.respond(http, clipped_headers([clipped]))


async def generate(body: GenerateRequest, http: Request, state) -> Response:
    start = time.monotonic()
    name = model_name(state, body.model)
    if not body.prompt and not body.images and not body.suffix:
        return await _load_only(state, name, body, start, {"response": ""})
    templated = bool(body.template) and not body.raw  # raw: the prompt as it is, whatever the template (Ollama's rule)
    if templated and body.images:
        raise bad_request("images need the model's chat template to place them, so they cannot go with a template", "images")
    if body.suffix and not templated and (body.raw or body.images or body.system or body.context):
        raise bad_request("suffix (fill in the middle) goes with a prompt alone: not with raw, images, system or context", "suffix")
    if body.raw and body.images:
        raise bad_request("images need the chat template to place them, so they cannot go with \"raw\": true", "images")
    if body.context and body.images:
        raise bad_request("context and images cannot be given together", "context")
    served = await state.admit(name, body.keep_alive)
    loaded = time.monotonic()
    structured = output_format(body.format)
    prompt = body.prompt or ""
    if templated:  # the request's own Go template over its system, prompt and suffix
        try:
            text = gotemplate.render(body.template, {"System": body.system or "", "Prompt": prompt, "Suffix": body.suffix or ""})
        except ValueError as e:
            raise bad_request(str(e), "template") from None
        text, ids, spans = text, await asyncio.to_thread(_encode_raw, served, text), ()
    elif body.suffix:
        text = fill_in_the_middle(served, prompt, body.suffix)
        text, ids, spans = text, await asyncio.to_thread(_encode_raw, served, text), ()
    elif body.raw:
        text, ids, spans = prompt, await asyncio.to_thread(_encode_raw, served, prompt), ()
    else:
        images = [ImageRef(f"images[{j}]", "image", data=data) for j, data in enumerate(body.images or ())]
        parts = [IMAGE_PART] * len(images) + ([{"type": "text", "text": prompt}] if prompt else [])
        messages = ([{"role": "system", "content": body.system}] if body.system else []) + [{"role": "user", "content": template_content(parts)}]
        text, ids, spans = await render_conversation(served, messages, images, None, template_kwargs(served, body.think))
    if body.context:
        ids = list(body.context) + list(ids)
    params = sampling(body, served, structured, len(ids), templated=not (body.raw or body.suffix or templated))
    rid = f"ollama-generate-{uuid.uuid4().hex[:24]}"
    (req,), (clipped,) = await engine_requests(served, rid, [(text, ids)], params, "format", prompt_param="prompt", images=spans)
    job = _Answer(served, body, req, "ollama_generate", None, start, loaded - start)
    return await job.respond(http, clipped_headers([clipped]))


# Fill-in-the-middle markers as (before the prefix, before the suffix, where the middle goes): the prompt is the
# three around the prefix and the suffix, as Ollama's templates for these models write it.
FIM_MARKERS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder, Qwen3-Coder
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, StarCoder2, Granite code
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # DeepSeek-Coder
)


def _fim_markers(tokenizer) -> tuple[str, str, str] | None:
    """The first set of markers all in the vocabulary (looked up per token: no copy of the vocabulary, and no cache
    holding an unloaded model's tokenizer)."""
    def known(token: str) -> bool:
        i = tokenizer.convert_tokens_to_ids(token)
        return i is not None and i != tokenizer.unk_token_id

    return next((m for m in FIM_MARKERS if all(known(t) for t in m)), None)


def fill_in_the_middle(served, prompt: str, suffix: str) -> str:
    """generate's `suffix`: the prompt text for the middle between `prompt` and `suffix`, in the model's markers."""
    markers = _fim_markers(served.engine.tokenizer)
    if markers is None:
        raise bad_request(f"suffix (fill in the middle) needs a model whose tokenizer has fill-in-the-middle tokens "
                          f"(such as {', '.join(m[0] for m in FIM_MARKERS)}); model {served.name!r} has none", "suffix")
    before, between, middle = markers
    return f"{before}{prompt}{between}{suffix}{middle}"


def _encode_raw(served, prompt: str) -> list[int]:
    """A raw prompt's ids, as the tokenizer adds its special tokens (as /v1/completions encodes a prompt). Blocking."""
    check_prompt_chars(served, len(prompt), "prompt")
    return list(served.engine.tokenizer.encode(prompt))


async def _load_only(state, name: str, body, start: float, empty: dict) -> Response:
    """No messages or prompt: load the model (Ollama's way to warm one), or with keep_alive 0 let it unload."""
    unload = keep_alive_seconds(body.keep_alive) == 0
    m = state.models.find(name)
    if not (unload and not m.loaded):  # never load a model only to unload it
        await state.model(name, body.keep_alive)  # leased until the response: keep_alive 0 unloads it after
    out = {"model": body.model, "created_at": created_at(), **empty, "done": True, "done_reason": "unload" if unload else "load"}
    if body.stream:
        return Response(line(out), media_type=NDJSON)
    return JSONResponse(out)


# ---------------------------------------------------------------- responses


class _Answer:
    """One request's answer: Ollama's lines (streamed) or its one object (not)."""

    def __init__(self, served, body, req: GenerationRequest, protocol: str, tool_parser: str | None, start: float, load_s: float) -> None:
        self.served = served
        self.body = body
        self.req = req
        self.protocol = protocol
        self.chat = protocol == "ollama_chat"
        self.tool_parser = tool_parser
        self.start = start
        self.load_s = load_s
        self.text_of = served.token_strings if req.params.logprobs is not None else None

    async def respond(self, http: Request, headers: dict[str, str]) -> Response:
        if self.body.stream:
            return StreamingResponse(self.stream(), media_type=NDJSON, headers=headers)
        async with tracked(self.served, self.req.request_id, [self.req], self.protocol) as tracker:
            (out,) = await run_to_end(self.served.engine, [self.req], http, tracker)
        c = out.outputs[0]
        whole = DeltaPipeline(self.served.settings.reasoning_parser, self.tool_parser).feed(c.text, final=True)
        body = self._piece(whole.text, whole.reasoning, whole.calls, c.logprobs or [])
        return JSONResponse({**body, **self._final(out)}, headers=headers)

    def _piece(self, text: str, reasoning: str, calls: list[ToolCall], logprobs: list[TokenLogprobs]) -> dict:
        """An object of the answer: its text (and thinking, tool calls, logprobs) so far or in whole."""
        out: dict = {"model": self.body.model, "created_at": created_at()}
        if self.chat:
            message: dict = {"role": "assistant", "content": text}
            if reasoning:
                message["thinking"] = reasoning
            if calls:
                message["tool_calls"] = [{"function": {"index": k, "name": c.name, "arguments": c.input}} for k, c in enumerate(calls)]
            out["message"] = message
        else:
            out["response"] = text
            if reasoning:
                out["thinking"] = reasoning
        if self.text_of is not None and logprobs:
            out["logprobs"] = [self._logprob(e) for e in logprobs]
        out["done"] = False
        return out

    def _logprob(self, e: TokenLogprobs) -> dict:
        def item(token_id: int, lp: float) -> dict:
            s = self.text_of(token_id)
            return {"token": s, "logprob": lp if lp > -1e30 else -9999.0, "bytes": list(s.encode())}

        return {**item(e.token_id, e.logprob), "top_logprobs": [item(t.token_id, t.logprob) for t in e.top]}

    def _final(self, out: RequestOutput) -> dict:
        """The last object's fields: done, why, and the timings in nanoseconds."""
        c = out.outputs[0]
        m = out.metrics
        final = {
            "done": True,
            "done_reason": "length" if c.finish_reason is FinishReason.LENGTH else "stop",
            "total_duration": ns(time.monotonic() - self.start),
            "load_duration": ns(self.load_s),
            "prompt_eval_count": out.num_prompt_tokens,
            "prompt_eval_duration": ns(m.prefill_time if m is not None else None),
            "eval_count": out.num_generated_tokens,
            "eval_duration": ns(m.decode_time if m is not None else None),
        }
        if not self.chat:
            final["context"] = [*out.prompt_token_ids, *c.token_ids]
        return final

    async def stream(self) -> AsyncIterator[bytes]:
        tracker = RequestTracker(self.served, self.req.request_id, [self.req], self.protocol)
        pipeline = DeltaPipeline(self.served.settings.reasoning_parser, self.tool_parser)
        sent_logprobs = 0
        outcome = "disconnected"
        try:
            async with aclosing(merged(self.served.engine, [self.req])) as outputs:
                async for _, out in outputs:
                    tracker.observe(0, out)
                    c = out.outputs[0]
                    delta = pipeline.feed(c.delta_text, final=c.finished)
                    new = (c.logprobs or [])[sent_logprobs:]
                    sent_logprobs += len(new)
                    if delta.text or delta.reasoning or delta.calls or (new and self.text_of is not None):
                        yield line(self._piece(delta.text, delta.reasoning, delta.calls, new))
                    if out.finished:
                        yield line({**self._piece("", "", [], []), **self._final(out)})
            outcome = "ok"
        except Exception as e:
            outcome = "error"
            yield line({"error": engine_error(e, self.req.request_id).message})
        finally:
            tracker.finish(outcome)
