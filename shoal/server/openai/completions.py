"""POST /v1/completions: prompt(s) -> GenerationRequests -> text_completion.

`prompt` may be a string, a list of strings, a list of token ids or a list of
token-id lists; each prompt is one engine request, and its `n` choices have
indices `prompt_index * n + choice_index` (as OpenAI numbers them).

`echo` with `logprobs: k` gives the prompt tokens' logprobs before the
generated ones, in one list (the first prompt token's are null: nothing comes
before it), which is what log-likelihood scoring through this API reads.
`max_tokens: 0` is allowed with `echo`: the prompt back (and its logprobs),
nothing generated. vLLM's `prompt_logprobs: k` adds each choice's
`prompt_logprobs` in vLLM's format. Tokenizing runs in a worker thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request

from shoal.server.errors import bad_request
from shoal.server.chat.render import check_prompt_chars
from shoal.server.chat.params import clipped_headers, engine_requests, resolve_params
from shoal.server.openai.common import (
    check_sequences,
    check_unsupported,
    completion_logprobs,
    finish_reason,
    new_id,
    now,
    output_constraint,
    usage,
    vllm_prompt_logprobs,
)
from shoal.server.openai.protocol import CompletionRequest
from shoal.server.sse import DONE, DeltaEncoder, encode_event
from shoal.server.streams import RequestTracker, engine_error, merged, run_to_end, tracked
from shoal.types import FinishReason, GenerationRequest, RequestOutput, TokenLogprobs

# OpenAI's default for /v1/completions when max_tokens is not given.
DEFAULT_MAX_TOKENS = 16
MAX_PROMPTS = 256


def prompt_items(prompt) -> list[str | list[int]]:
    """The prompts, each a string or a list of token ids (shapes only: nothing is tokenized)."""

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
    if any(p == "" for p in items):
        raise bad_request("prompt must not be an empty string", "prompt")
    return items


def tokenize_prompts(served, items: list[str | list[int]]) -> list[tuple[str | None, list[int]]]:
    """(text or None, token ids) per prompt. Blocking work: call it in a worker thread."""
    for p in items:
        if isinstance(p, str):
            check_prompt_chars(served, len(p), "prompt")
    tokenizer = served.engine.tokenizer
    return [(p, list(tokenizer.encode(p))) if isinstance(p, str) else (None, list(p)) for p in items]


async def create_completion(body: CompletionRequest, http: Request, state) -> JSONResponse | StreamingResponse:
    served = await state.admit(body.model, body.keep_alive)
    if body.suffix is not None:
        raise bad_request("suffix is not supported: this server does not do fill-in-the-middle", "suffix")
    if body.best_of is not None and body.best_of != (body.n or 1):
        raise bad_request(f"best_of must equal n when given (best_of {body.best_of}, n {body.n or 1})", "best_of")
    check_unsupported(body)
    structured, structured_param = output_constraint(body)
    echo_logprobs = bool(body.echo) and body.logprobs is not None
    if body.stream and (echo_logprobs or body.prompt_logprobs is not None):
        param = "prompt_logprobs" if body.prompt_logprobs is not None else "echo"
        raise bad_request("prompt logprobs (echo with logprobs, or prompt_logprobs) are not supported with stream yet", param)
    echo_only = body.max_tokens == 0
    if echo_only and not body.echo:
        raise bad_request("max_tokens 0 is only allowed with echo (the prompt back, nothing generated)", "max_tokens")
    items = prompt_items(body.prompt)
    check_sequences(served, len(items), body.n)
    prompts = await asyncio.to_thread(tokenize_prompts, served, items)
    prompt_k = max((k for k in (body.logprobs if echo_logprobs else None, body.prompt_logprobs) if k is not None), default=None)
    params = resolve_params(
        body,
        served,
        # Prompt logprobs come with the first step; the one token it samples is dropped.
        max_tokens=1 if echo_only else body.max_tokens,
        default_max_tokens=DEFAULT_MAX_TOKENS,
        logprobs=body.logprobs,
        prompt_logprobs=prompt_k,
        structured=structured,
    )
    rid = new_id("cmpl")
    reqs, clipped = await engine_requests(served, rid, prompts, params, structured_param, priority=body.priority or 0,
                                          prompt_param="prompt")
    tokenizer = served.engine.tokenizer
    echo = [(text if text is not None else tokenizer.decode(ids)) if body.echo else "" for text, ids in prompts]
    job = _Completion(served, rid, body, reqs, echo, echo_only)
    headers = clipped_headers(clipped)
    if echo_only and prompt_k is None:
        return job.echo_without_engine(headers)
    if body.stream:
        return StreamingResponse(job.stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", **headers})
    return await job.complete(http, headers)


class _Completion:
    def __init__(self, served, rid, body: CompletionRequest, reqs: list[GenerationRequest], echo: list[str], echo_only: bool) -> None:
        self.served = served
        self.rid = rid
        self.body = body
        self.reqs = reqs
        self.echo = echo
        self.echo_only = echo_only  # max_tokens 0: whatever the engine samples is dropped
        self.n = reqs[0].params.n
        self.created = now()
        self.text_of = served.token_strings if body.logprobs is not None else None

    def _chunk(self, choices: list[dict], **extra) -> dict:
        return {
            "id": self.rid,
            "object": "text_completion",
            "created": self.created,
            "model": self.served.model_name,
            "choices": choices,
            **extra,
        }

    async def complete(self, http: Request, headers: dict[str, str]) -> JSONResponse:
        async with tracked(self.served, self.rid, self.reqs, "openai_completions") as tracker:
            finals = await run_to_end(self.served.engine, self.reqs, http, tracker)
            choices = [self._choice(p, out, c) for p, out in enumerate(finals) for c in out.outputs]
            if self.echo_only:
                finals = [_without_output(out) for out in finals]
            return JSONResponse(self._chunk(choices, usage=usage(finals)), headers=headers)

    def _choice(self, p: int, out: RequestOutput, c) -> dict:
        """One finished choice: echo and generated text, logprobs (the prompt's first when echoed)."""
        body, text_of = self.body, self.served.token_strings
        entries = [] if self.echo_only else (c.logprobs or [])
        prompt_ids = None
        if body.echo and body.logprobs is not None:
            k = body.logprobs
            prompt = [None if e is None else TokenLogprobs(e.token_id, e.logprob, e.top[:k]) for e in out.prompt_logprobs]
            entries, prompt_ids = prompt + entries, out.prompt_token_ids
        choice = {
            "index": p * self.n + c.index,
            "text": self.echo[p] + ("" if self.echo_only else c.text),
            "logprobs": completion_logprobs(entries, text_of, 0, prompt_ids)[0] if body.logprobs is not None else None,
            "finish_reason": "length" if self.echo_only else finish_reason(c.finish_reason),
            "stop_reason": None if self.echo_only else c.stop_reason,
        }
        if body.prompt_logprobs is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(out.prompt_logprobs, text_of)
        return choice

    def echo_without_engine(self, headers: dict[str, str]) -> JSONResponse | StreamingResponse:
        """max_tokens 0 without logprobs: the prompts back; the engine has nothing to do."""
        choices = [
            {"index": p * self.n + i, "text": self.echo[p], "logprobs": None, "finish_reason": FinishReason.LENGTH.value, "stop_reason": None}
            for p in range(len(self.reqs))
            for i in range(self.n)
        ]
        outs = [RequestOutput(r.request_id, list(r.prompt_token_ids), [], finished=True) for r in self.reqs]
        if not self.body.stream:
            return JSONResponse(self._chunk(choices, usage=usage(outs)), headers=headers)

        async def events() -> AsyncIterator[bytes]:
            for choice in choices:
                yield encode_event(self._chunk([choice]))
            if self.body.stream_options is not None and self.body.stream_options.include_usage:
                yield encode_event(self._chunk([], usage=usage(outs)))
            yield DONE

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", **headers})

    async def stream(self) -> AsyncIterator[bytes]:
        tracker = RequestTracker(self.served, self.rid, self.reqs, "openai_completions")
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
            async with aclosing(merged(self.served.engine, self.reqs)) as outputs:
                async for p, out in outputs:
                    tracker.observe(p, out)
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
            yield encode_event(engine_error(e, self.rid).body())
            yield DONE
        finally:
            tracker.finish(outcome)


def _without_output(out: RequestOutput) -> RequestOutput:
    """`out` as if nothing had been generated (for usage)."""
    return RequestOutput(out.request_id, out.prompt_token_ids, [], out.finished, out.num_cached_tokens)
