"""From a protocol's request to the engine's: sampling parameters, output constraints, checks.

Whatever the protocol, the same rules: the precedence chain, a structured-output
constraint compiled off the event loop, the engine's checks as 400s, and max_tokens
clipped to the room the context leaves.

Each sampling field comes from the first level that sets it:

    request field > server settings (flags / YAML) > the model's generation_config
                  > its card's recommendation (models that ship none: loader.CARD_DEFAULTS) > built-in default

One built-in default depends on the request: a reply held to a JSON schema or to `json_object`
(not a forced tool call) takes `frequency_penalty` JSON_FREQUENCY_PENALTY when no level sets one.
Small models otherwise repeat an array's items or a value's digits until `max_tokens`; the penalty
counts the reply's own tokens only, so copying from the prompt is not discouraged
(benchmarks/results/structured_finish.md).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import fields, replace
from typing import Annotated

from pydantic import Strict

from shoal.engine.async_engine import EngineDeadError
from shoal.json_schema import GrammarError
from shoal.server.errors import bad_request, from_value_error
from shoal.server.streams import engine_error
from shoal.types import GenerationRequest, SamplingParams, StructuredOutput

# Request bodies' numbers are strict in every protocol: a JSON boolean is not a number
# (pydantic would read `true` as 1), and an integer field takes no `1.0` or `"1"`.
Int = Annotated[int, Strict()]
Float = Annotated[float, Strict()]  # takes 1 as 1.0, refuses true
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1

_PARAM_FIELDS = frozenset(f.name for f in fields(SamplingParams))
_BUILTIN = SamplingParams()

# Fields that go through the whole chain. The model's generation_config only
# ever suggests sampling shape (temperature, top_p, ...), never lengths or stops.
_CHAINED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
JSON_FREQUENCY_PENALTY = 0.5
# A response whose max_tokens was clipped to the room the context left says so, with the value it ran with.
CLIPPED_HEADER = "X-Shoal-Max-Tokens-Clipped"


def clipped_headers(clipped: list[int | None]) -> dict[str, str]:
    """The header for a response's clipped max_tokens: the smallest, when several prompts were clipped."""
    values = [c for c in clipped if c is not None]
    return {CLIPPED_HEADER: str(min(values))} if values else {}
_MODEL_ONLY = ("typical_p", "no_repeat_ngram_size")


def resolve_params(
    req,
    served,
    *,
    max_tokens: int | None,
    default_max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    extra_stop: tuple[str, ...] = (),
    structured: StructuredOutput | None = None,
    tool_call: bool = False,
) -> SamplingParams:
    """The request's SamplingParams: each field from the first level that sets it.

    `req`: the protocol's request; its sampling fields are read by their common names
    (`temperature`, `top_p`, `top_k`, `stop`, `seed`, ...), None or absent when not given.
    `tool_call`: `structured` is a forced tool call's, not a JSON reply the client asked for.
    """
    settings, model = served.settings, served.generation_defaults
    kw: dict = {}
    for name in _CHAINED:
        for level in (_get(req, name), getattr(settings, name), model.get(name)):
            if level is not None:
                kw[name] = level
                break
    if "frequency_penalty" not in kw and structured is not None and not tool_call and (structured.json_schema or structured.json_object):
        kw["frequency_penalty"] = JSON_FREQUENCY_PENALTY
    for name in _MODEL_ONLY:
        if model.get(name) is not None:
            kw[name] = model[name]
    if max_tokens is None:
        max_tokens = settings.max_tokens if settings.max_tokens is not None else default_max_tokens
    kw["max_tokens"] = max_tokens
    stop = _get(req, "stop")
    stop = stop if stop is not None else (settings.stop or ())
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    if any(s == "" for s in stop):
        raise bad_request("stop strings must not be empty", "stop")
    kw["stop"] = stop + tuple(s for s in extra_stop if s not in stop)
    ignore_eos = _get(req, "ignore_eos")
    ignore_eos = ignore_eos if ignore_eos is not None else settings.ignore_eos
    for name, value in (
        ("n", _get(req, "n")),
        ("seed", _get(req, "seed")),
        ("min_tokens", _get(req, "min_tokens")),
        ("ignore_eos", ignore_eos),
        ("stop_token_ids", _get(req, "stop_token_ids")),
        ("include_stop_str_in_output", _get(req, "include_stop_str_in_output")),
        ("skip_special_tokens", _get(req, "skip_special_tokens")),
        ("logprobs", logprobs),
        ("prompt_logprobs", prompt_logprobs),
    ):
        if value is not None:
            kw[name] = value
    if _get(req, "logit_bias"):
        kw["logit_bias"] = _logit_bias(req.logit_bias)
    kw["structured"] = structured
    try:
        return SamplingParams(**kw)
    except ValueError as e:
        raise from_value_error(e, _PARAM_FIELDS) from None


def _logit_bias(bias: dict[str, float]) -> dict[int, float]:
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise bad_request(f"logit_bias keys must be token ids (integers), got {key!r}", "logit_bias") from None
        if not -100 <= value <= 100:
            raise bad_request(f"logit_bias values must be in [-100, 100], got {value} for token {token}", "logit_bias")
        out[token] = float(value)
    return out


def _get(req, name: str):
    return getattr(req, name, None)


# ---------------------------------------------------------------- output constraints


def constraint(kind: str, value, param: str) -> StructuredOutput:
    """One constraint from vLLM's spelling of it, with its type checked."""
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise bad_request(f"{param} is a string that is not valid JSON: give the schema as an object", param) from None
        if not isinstance(value, (dict, bool)):
            raise bad_request(f"{param} must be a JSON schema (an object)", param)
        return StructuredOutput(json_schema=json.dumps(value, ensure_ascii=False))
    if kind == "json_object":
        if value is not True:
            raise bad_request(f"{param} must be true", param)
        return StructuredOutput(json_object=True)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise bad_request(f"{param} must be a non-empty list of non-empty strings", param)
        return StructuredOutput(choice=tuple(value))
    if not isinstance(value, str) or not value:
        raise bad_request(f"{param} must be a non-empty string", param)
    return StructuredOutput(regex=value) if kind == "regex" else StructuredOutput(grammar=value)


# ---------------------------------------------------------------- the engine's requests


async def engine_requests(served, rid: str, prompts: list[tuple[str | None, list[int]]], params: SamplingParams,
                          structured_param: str | None, *, priority: int = 0,
                          prompt_param: str = "messages", images: tuple = ()) -> tuple[list[GenerationRequest], list[int | None]]:
    """Every protocol's last steps, once its prompts are rendered and its parameters resolved: per prompt the
    engine's request (ids `rid`, or `rid-i` for several), checked once, here, as the engine alone can (in a
    worker thread: it compiles and caches the constraint, so the engine's thread never does), with max_tokens
    clipped to the room the context leaves. The requests go to the engine as checked (`generate(checked=True)`).
    Returns the requests and the clipped max_tokens (None: unchanged). Any problem is a 400 that names its
    field. images: the one prompt's (multimodal.ImageSpan), for a chat with images."""
    arrival = time.monotonic()
    reqs = [GenerationRequest(rid if len(prompts) == 1 else f"{rid}-{i}", tuple(ids), params, priority=priority, prompt=text,
                              arrival_time=arrival, images=images) for i, (text, ids) in enumerate(prompts)]
    try:
        await asyncio.to_thread(check_requests, served, reqs, prompt_param, structured_param)
    except EngineDeadError as e:  # unloaded under it: the 503 a request in flight would get
        raise engine_error(e, rid) from None
    fitted = [fit_max_tokens(served, req) for req in reqs]
    return [req for req, _ in fitted], [clip for _, clip in fitted]


async def pooled_requests(served, rid: str, inputs: list[list[int]], param: str, dimensions: int | None = None,
                          name_one: bool = True) -> list[GenerationRequest]:
    """engine_requests for prompt-only requests (embeddings, a cross-encoder's scores): per input the engine's
    pooled request (ids `rid`, or `rid-i` for several, one arrival time), checked once, in a worker thread, and
    handed on as checked. A refusal is a 400 naming `param[i]` (only `param` for a single input unless
    `name_one`); a model unloaded under it, the 503 a request in flight gets."""
    arrival = time.monotonic()
    reqs = [served.engine.embedding_request(rid if len(inputs) == 1 else f"{rid}-{i}", ids, dimensions, arrival_time=arrival)
            for i, ids in enumerate(inputs)]
    try:
        await asyncio.to_thread(_check_pooled, served.engine, reqs, param, name_one or len(reqs) > 1)
    except EngineDeadError as e:
        raise engine_error(e, rid) from None
    return reqs


def _check_pooled(engine, reqs: list[GenerationRequest], param: str, indexed: bool) -> None:
    for i, req in enumerate(reqs):
        try:
            engine.check(req)
        except ValueError as e:
            raise bad_request(f"{param}[{i}]: {e}" if indexed else str(e), param) from None


# ---------------------------------------------------------------- the engine's checks


def check_requests(served, requests: list[GenerationRequest], prompt_param: str, structured_param: str | None) -> None:
    """The engine's checks (vocabulary, context length, images, logit_bias ids, the constraint) and
    stop_token_ids, as a 400 naming the field."""
    for request in requests:
        check_request(served, request, prompt_param, structured_param)


def check_request(served, request: GenerationRequest, prompt_param: str, structured_param: str | None) -> None:
    try:
        served.engine.check(request)
    except GrammarError as e:
        raise bad_request(f"{structured_param} cannot be used for structured output: {e}", structured_param) from None
    except ValueError as e:
        msg = str(e)
        raise bad_request(msg, "logit_bias" if msg.startswith("logit_bias") else prompt_param) from None
    vocab = served.engine.vocab_size
    bad = [t for t in request.params.stop_token_ids if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {vocab})", "stop_token_ids")


def fit_max_tokens(served, request: GenerationRequest) -> tuple[GenerationRequest, int | None]:
    """The request with max_tokens clipped to the room the context leaves, and the clipped value (None: unchanged)."""
    p = request.params
    room = served.engine.max_model_len - len(request.prompt_token_ids)
    if p.max_tokens is None or p.max_tokens <= room:
        return request, None
    if p.min_tokens > room:
        raise bad_request(
            f"min_tokens ({p.min_tokens}) cannot be met: the context of {served.engine.max_model_len} tokens "
            f"leaves room for {room} after the prompt",
            "min_tokens",
        )
    return replace(request, params=replace(p, max_tokens=room)), room
