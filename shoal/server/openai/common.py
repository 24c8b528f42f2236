"""What chat and completions share: sampling-parameter precedence, request bounds, usage, logprobs, ids.

Precedence for every sampling field, the first that is set wins:

    request field > server settings (flags / YAML) > the model's generation_config
                  > its card's recommendation (models that ship none: loader.CARD_DEFAULTS) > built-in default

Bounds on the work one request may ask for:

- prompts x n may not exceed --max-sequences-per-request (a 400 naming both numbers);
- a text prompt longer than `max_prompt_chars` is refused before it is tokenized
  (it could not fit the context: see there);
- a `max_tokens` larger than what the context leaves after the prompt is clipped
  to that room, and the response says so in the header
  `X-Shoal-Max-Tokens-Clipped: <the max_tokens it ran with>` (the smallest, when
  several prompts were clipped). The choice's finish_reason "length" already says
  the text stopped at the limit; the header says the limit was not the one asked for.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import fields, replace
from functools import lru_cache

from shoal.engine.structured import GrammarError
from shoal.server.errors import bad_request, from_value_error
from shoal.server.openai.protocol import SamplingFields
from shoal.types import FinishReason, GenerationRequest, RequestOutput, SamplingParams, StructuredOutput, TokenLogprobs

CLIPPED_HEADER = "X-Shoal-Max-Tokens-Clipped"
# A token spans at most as many characters as the longest vocabulary entry
# (byte-level BPE spells each byte as one character, so this over-counts);
# normalization can merge a few code points into one (NFC/NFKC composition),
# hence the slack.
NORMALIZATION_SLACK = 4

_PARAM_FIELDS = frozenset(f.name for f in fields(SamplingParams))
_BUILTIN = SamplingParams()

# Fields that go through the whole chain. The model's generation_config only
# ever suggests sampling shape (temperature, top_p, ...), never lengths or stops.
_CHAINED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
_MODEL_ONLY = ("typical_p", "no_repeat_ngram_size")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def resolve_params(
    req: SamplingFields,
    state,
    *,
    max_tokens: int | None,
    default_max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    extra_stop: tuple[str, ...] = (),
    structured: StructuredOutput | None = None,
) -> SamplingParams:
    """The request's SamplingParams: each field from the first level that sets it."""
    settings, model = state.settings, state.generation_defaults
    kw: dict = {}
    for name in _CHAINED:
        for level in (getattr(req, name), getattr(settings, name), model.get(name)):
            if level is not None:
                kw[name] = level
                break
    for name in _MODEL_ONLY:
        if model.get(name) is not None:
            kw[name] = model[name]
    if max_tokens is None:
        max_tokens = settings.max_tokens if settings.max_tokens is not None else default_max_tokens
    kw["max_tokens"] = max_tokens
    stop = req.stop if req.stop is not None else (settings.stop or ())
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    if any(s == "" for s in stop):
        raise bad_request("stop strings must not be empty", "stop")
    kw["stop"] = stop + tuple(s for s in extra_stop if s not in stop)
    ignore_eos = req.ignore_eos if req.ignore_eos is not None else settings.ignore_eos
    for name, value in (
        ("n", req.n),
        ("seed", req.seed),
        ("min_tokens", req.min_tokens),
        ("ignore_eos", ignore_eos),
        ("stop_token_ids", req.stop_token_ids),
        ("include_stop_str_in_output", req.include_stop_str_in_output),
        ("skip_special_tokens", req.skip_special_tokens),
        ("logprobs", logprobs),
        ("prompt_logprobs", prompt_logprobs),
    ):
        if value is not None:
            kw[name] = value
    if req.logit_bias:
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


def check_prompt(state, request: GenerationRequest, prompt_param: str) -> None:
    """The engine's checks (vocabulary, context length, logit_bias ids) and stop_token_ids as a 400."""
    try:
        state.engine.validate(request)
    except ValueError as e:
        msg = str(e)
        raise bad_request(msg, "logit_bias" if msg.startswith("logit_bias") else prompt_param) from None
    vocab = state.engine.vocab_size
    bad = [t for t in request.params.stop_token_ids if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {vocab})", "stop_token_ids")


# ---------------------------------------------------------------- bounds and refusals


def check_unsupported(body: SamplingFields) -> None:
    """Fields OpenAI defines that shoal does not implement: a 400 rather than silence."""
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")


# ---------------------------------------------------------------- structured output

_VLLM_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# vLLM's options that shoal's grammars fix (whitespace) or choose themselves (the backend).
_VLLM_IGNORED = {"disable_any_whitespace", "disable_fallback", "disable_additional_properties", "whitespace_pattern", "backend"}


def output_constraint(body: SamplingFields) -> tuple[StructuredOutput | None, str | None]:
    """The request's structured-output constraint and the field that gave it.

    OpenAI's `response_format` (text, json_object, json_schema) is the documented
    spelling; vLLM's `structured_outputs: {json|regex|choice|grammar|json_object}` and
    its older `guided_json|guided_regex|guided_choice|guided_grammar` are accepted too.
    At most one constraint per request.
    """
    found: list[tuple[StructuredOutput, str]] = []
    if body.response_format is not None:
        spec = _response_format(body.response_format)
        if spec is not None:
            found.append((spec, "response_format.json_schema.schema" if spec.json_schema is not None else "response_format"))
    if body.structured_outputs is not None:
        found.append(_vllm_structured(body.structured_outputs))
    for field_, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        value = getattr(body, field_)
        if value is not None:
            found.append((_constraint(kind, value, field_), field_))
    if len(found) > 1:
        raise bad_request(f"give one output constraint, not several: {', '.join(p for _, p in found)}", found[1][1])
    return found[0] if found else (None, None)


def _response_format(fmt) -> StructuredOutput | None:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(json_object=True)
    if kind != "json_schema":
        raise bad_request("invalid response_format: expected an object with type 'text', 'json_object' or 'json_schema'", "response_format")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request("response_format.json_schema must be an object with the schema under 'schema'", "response_format.json_schema")
    name = spec.get("name")
    if name is not None and not isinstance(name, str):
        raise bad_request("response_format.json_schema.name must be a string", "response_format.json_schema.name")
    if "schema" not in spec:
        return StructuredOutput(json_object=True)  # a name without a schema: any JSON object
    return _constraint("json", spec["schema"], "response_format.json_schema.schema")


def _vllm_structured(opts: dict) -> tuple[StructuredOutput, str]:
    given = [k for k in _VLLM_KINDS if opts.get(k) not in (None, False)]
    unknown = sorted(set(opts) - set(_VLLM_KINDS) - _VLLM_IGNORED)
    if "structural_tag" in unknown:
        raise bad_request("structured_outputs.structural_tag is not supported: use json, regex, choice or grammar", "structured_outputs.structural_tag")
    if unknown:
        raise bad_request(f"structured_outputs has unknown keys {unknown}: expected one of json, regex, choice, grammar, json_object", "structured_outputs")
    if len(given) != 1:
        raise bad_request(
            f"structured_outputs needs exactly one of json, regex, choice, grammar, json_object; got {given or 'none'}", "structured_outputs"
        )
    (kind,) = given
    return _constraint(kind, opts[kind], f"structured_outputs.{kind}"), f"structured_outputs.{kind}"


def _constraint(kind: str, value, param: str) -> StructuredOutput:
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


async def compile_constraint(state, spec: StructuredOutput | None, param: str | None) -> None:
    """Compile the constraint in a worker thread (cached by the engine), so the engine thread
    never compiles and a constraint that cannot be compiled is a 400 naming the problem."""
    if spec is None:
        return
    try:
        await asyncio.to_thread(state.engine.grammars.compile, spec)
    except GrammarError as e:
        raise bad_request(f"{param} cannot be used for structured output: {e}", param) from None


def check_sequences(state, num_prompts: int, n: int | None) -> None:
    """prompts x n within --max-sequences-per-request (counted before any tokenizing)."""
    limit = state.settings.max_sequences_per_request
    n = n or 1
    if num_prompts * n > limit:
        raise bad_request(
            f"this request asks for {num_prompts * n} sequences ({num_prompts} prompt{'s' if num_prompts != 1 else ''} x n {n}) "
            f"but the server allows at most {limit} per request (--max-sequences-per-request)",
            "n",
        )


@lru_cache(maxsize=8)
def _longest_token_chars(tokenizer) -> int:
    return max((len(t) for t in tokenizer.get_vocab()), default=1)


def max_prompt_chars(state) -> int:
    """More characters than this cannot fit the context, whatever they are (see NORMALIZATION_SLACK)."""
    return state.engine.max_model_len * _longest_token_chars(state.engine.tokenizer) * NORMALIZATION_SLACK


def check_prompt_chars(state, num_chars: int, param: str) -> None:
    """Refuse a text that cannot fit the context before spending time tokenizing it."""
    limit = max_prompt_chars(state)
    if num_chars > limit:
        raise bad_request(
            f"the prompt has {num_chars} characters: more than {limit}, so it cannot fit "
            f"the context of {state.engine.max_model_len} tokens",
            param,
        )


def fit_max_tokens(state, request: GenerationRequest) -> tuple[GenerationRequest, int | None]:
    """The request with max_tokens clipped to the room the context leaves, and the clipped value (None: unchanged)."""
    p = request.params
    room = state.engine.max_model_len - len(request.prompt_token_ids)
    if p.max_tokens is None or p.max_tokens <= room:
        return request, None
    if p.min_tokens > room:
        raise bad_request(
            f"min_tokens ({p.min_tokens}) cannot be met: the context of {state.engine.max_model_len} tokens "
            f"leaves room for {room} after the prompt",
            "min_tokens",
        )
    return replace(request, params=replace(p, max_tokens=room)), room


def clipped_headers(clipped: list[int | None]) -> dict[str, str]:
    values = [c for c in clipped if c is not None]
    return {CLIPPED_HEADER: str(min(values))} if values else {}


def finish_reason(reason: FinishReason | None) -> str | None:
    return None if reason is None else reason.value


def usage(outputs: list[RequestOutput]) -> dict:
    prompt = sum(o.num_prompt_tokens for o in outputs)
    completion = sum(o.num_generated_tokens for o in outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in outputs)},
    }


# ---------------------------------------------------------------- logprobs


class TokenStrings:
    """A token id's text as logprobs show it (the decoded piece, special tokens included)."""

    def __init__(self, tokenizer) -> None:
        self._decode = lru_cache(maxsize=65536)(lambda t: tokenizer.decode([t], skip_special_tokens=False))

    def __call__(self, token_id: int) -> str:
        return self._decode(token_id)


def chat_logprobs(entries: list[TokenLogprobs], text_of: TokenStrings) -> dict:
    """The chat format: {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}."""

    def item(token_id: int, logprob: float) -> dict:
        s = text_of(token_id)
        return {"token": s, "logprob": _finite(logprob), "bytes": list(s.encode())}

    return {
        "content": [
            {**item(e.token_id, e.logprob), "top_logprobs": [item(t.token_id, t.logprob) for t in e.top]}
            for e in entries
        ]
    }


def completion_logprobs(
    entries: list[TokenLogprobs | None], text_of: TokenStrings, offset: int, prompt_ids: list[int] | None = None
) -> tuple[dict, int]:
    """The completions format ({"tokens", "token_logprobs", "top_logprobs", "text_offset"}) and the next offset.

    Each top_logprobs holds the top k and the chosen token (so k + 1 entries at
    most; k = 0 gives the chosen token's alone), as OpenAI and vLLM do. An echoed
    prompt's entries come first; its first token has nothing before it, so its
    logprob and top_logprobs are null (`None` in `entries`, with `prompt_ids`
    giving the token).
    """
    tokens, lps, tops, offsets = [], [], [], []
    for i, e in enumerate(entries):
        s = text_of(e.token_id if e is not None else prompt_ids[i])
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
        if e is None:
            lps.append(None)
            tops.append(None)
            continue
        lps.append(_finite(e.logprob))
        top = {text_of(t.token_id): _finite(t.logprob) for t in e.top}
        top.setdefault(s, _finite(e.logprob))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}, offset


def vllm_prompt_logprobs(entries: list[TokenLogprobs | None], text_of: TokenStrings) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token, {token id: {logprob, rank, decoded_token}} for it and the top k."""
    out: list[dict | None] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        ranked = {t.token_id: (r, t.logprob) for r, t in enumerate(e.top, 1)}
        entry = {str(e.token_id): {"logprob": _finite(e.logprob), "rank": ranked.get(e.token_id, (None,))[0], "decoded_token": text_of(e.token_id)}}
        for tid, (r, lp) in ranked.items():
            entry.setdefault(str(tid), {"logprob": _finite(lp), "rank": r, "decoded_token": text_of(tid)})
        out.append(entry)
    return out


def _finite(x: float) -> float:
    # JSON has no -inf; a banned token's logprob is very negative, not absent.
    return x if x > -1e30 else -9999.0
