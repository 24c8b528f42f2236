"""POST /v1/completions: prompt(s) -> GenerationRequests -> text_completion.

`prompt` may be a string, a list of strings, a list of token ids or a list of
token-id lists; each prompt is one engine request, and its `n` choices have
indices `prompt_index * n + choice_index` (as OpenAI numbers them).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request

from shoal.server.errors import APIError, bad_request
from shoal.server.openai.common import (
    check_prompt,
    completion_logprobs,
    finish_reason,
    new_id,
    now,
    resolve_params,
    usage,
)
from shoal.server.openai.protocol import CompletionRequest
from shoal.server.sse import DONE, DeltaEncoder, encode_event
from shoal.server.streams import ClientDisconnected, RequestTracker, engine_error, merged, run_to_end
from shoal.types import GenerationRequest

# OpenAI's default for /v1/completions when max_tokens is not given.
DEFAULT_MAX_TOKENS = 16
MAX_PROMPTS = 256


def parse_prompts(prompt, tokenizer) -> list[tuple[str | None, list[int]]]:
    """(text or None, token ids) per prompt."""

    def is_ids(x) -> bool:
        return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if isinstance(prompt, str):
        items = [prompt]
    elif is_ids(prompt) and prompt:
        items = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or (is_ids(p) and p) for p in prompt):
        items = list(prompt)
    elif isinstance(prompt, list) and not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    else:
        raise bad_request(
            "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists",
            "prompt",
        )
    if len(items) > MAX_PROMPTS:
        raise bad_request(f"at most {MAX_PROMPTS} prompts per request, got {len(items)}", "prompt")
    out = []
    for p in items:
        if isinstance(p, str):
            if not p:
                raise bad_request("prompt must not be an empty string", "prompt")
            out.append((p, list(tokenizer.encode(p))))
        else:
            out.append((None, list(p)))
    return out


async def create_completion(body: CompletionRequest, http: Request, state) -> JSONResponse | StreamingResponse:
    state.admit(body.model)
    if body.suffix is not None:
        raise bad_request("suffix is not supported: this server does not do fill-in-the-middle", "suffix")
    if body.echo and body.logprobs is not None:
        raise bad_request("echo with logprobs is not supported: prompt logprobs are not computed", "echo")
    if body.best_of is not None and body.best_of != (body.n or 1):
        raise bad_request(f"best_of must equal n when given (best_of {body.best_of}, n {body.n or 1})", "best_of")
    tokenizer = state.engine.tokenizer
    prompts = parse_prompts(body.prompt, tokenizer)
    params = resolve_params(
        body, state, max_tokens=body.max_tokens, default_max_tokens=DEFAULT_MAX_TOKENS, logprobs=body.logprobs
    )
    rid = new_id("cmpl")
    arrival = time.monotonic()
    reqs = []
    for i, (text, ids) in enumerate(prompts):
        req = GenerationRequest(
            rid if len(prompts) == 1 else f"{rid}-{i}", tuple(ids), params, priority=body.priority or 0, prompt=text, arrival_time=arrival
        )
        check_prompt(state, req, "prompt")
        reqs.append(req)
    echo = [(text if text is not None else tokenizer.decode(ids)) if body.echo else "" for text, ids in prompts]
    job = _Completion(state, rid, body, reqs, echo)
    if body.stream:
        return StreamingResponse(job.stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    return await job.complete(http)


class _Completion:
    def __init__(self, state, rid, body: CompletionRequest, reqs: list[GenerationRequest], echo: list[str]) -> None:
        self.state = state
        self.rid = rid
        self.body = body
        self.reqs = reqs
        self.echo = echo
        self.tracker: RequestTracker | None = None  # made when the work starts (a stream may never start)
        self.n = reqs[0].params.n
        self.created = now()
        self.text_of = state.token_strings if body.logprobs is not None else None

    def _chunk(self, choices: list[dict], **extra) -> dict:
        return {
            "id": self.rid,
            "object": "text_completion",
            "created": self.created,
            "model": self.state.model_name,
            "choices": choices,
            **extra,
        }

    async def complete(self, http: Request) -> JSONResponse:
        self.tracker = RequestTracker(self.state, self.rid, self.reqs)
        try:
            finals = await run_to_end(self.state.aengine, self.reqs, http, self.tracker)
        except ClientDisconnected:
            self.tracker.finish("disconnected")
            raise
        except APIError:
            self.tracker.finish("error")
            raise
        except Exception as e:
            self.tracker.finish("error")
            raise engine_error(e) from None
        choices = []
        for p, out in enumerate(finals):
            for c in out.outputs:
                lps = None
                if c.logprobs is not None and self.text_of is not None:
                    lps, _ = completion_logprobs(c.logprobs, self.text_of, 0)
                choices.append(
                    {
                        "index": p * self.n + c.index,
                        "text": self.echo[p] + c.text,
                        "logprobs": lps,
                        "finish_reason": finish_reason(c.finish_reason),
                        "stop_reason": c.stop_reason,
                    }
                )
        self.tracker.finish("ok")
        return JSONResponse(
            {
                "id": self.rid,
                "object": "text_completion",
                "created": self.created,
                "model": self.state.model_name,
                "choices": choices,
                "usage": usage(finals),
            }
        )

    async def stream(self) -> AsyncIterator[bytes]:
        self.tracker = RequestTracker(self.state, self.rid, self.reqs)
        fast = DeltaEncoder(lambda index, text: self._chunk([{"index": index, "text": text, "logprobs": None, "finish_reason": None}]))
        total = len(self.reqs) * self.n
        sent_logprobs = [0] * total
        offsets = [0] * total
        finished = [False] * total
        finals = [None] * len(self.reqs)
        outcome = "disconnected"
        try:
            if any(self.echo):
                for index in range(total):
                    if self.echo[index // self.n]:
                        yield fast.encode(index, self.echo[index // self.n])
            async with aclosing(merged(self.state.aengine, self.reqs)) as outputs:
                async for p, out in outputs:
                    self.tracker.observe(p, out)
                    finals[p] = out
                    for c in out.outputs:
                        index = p * self.n + c.index
                        if finished[index]:
                            continue
                        new_lps = c.logprobs[sent_logprobs[index] :] if c.logprobs is not None else []
                        sent_logprobs[index] += len(new_lps)
                        if new_lps and self.text_of is not None:
                            lps, offsets[index] = completion_logprobs(new_lps, self.text_of, offsets[index])
                            yield encode_event(self._chunk([{"index": index, "text": c.delta_text, "logprobs": lps, "finish_reason": None}]))
                        elif c.delta_text:
                            yield fast.encode(index, c.delta_text)
                        if c.finished:
                            finished[index] = True
                            yield encode_event(
                                self._chunk([{"index": index, "text": "", "logprobs": None, "finish_reason": finish_reason(c.finish_reason), "stop_reason": c.stop_reason}])
                            )
            opts = self.body.stream_options
            if opts is not None and opts.include_usage:
                yield encode_event(self._chunk([], usage=usage([f for f in finals if f is not None])))
            outcome = "ok"
            yield DONE
        except Exception as e:
            outcome = "error"
            yield encode_event(engine_error(e).body())
            yield DONE
        finally:
            self.tracker.finish(outcome)
