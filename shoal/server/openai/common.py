"""What chat and completions share: sampling-parameter precedence, usage, logprobs, ids.

Precedence for every sampling field, the first that is set wins:

    request field > server settings (flags / YAML) > the model's generation_config > built-in default
"""

from __future__ import annotations

import time
import uuid
from dataclasses import fields
from functools import lru_cache

from shoal.server.errors import bad_request, from_value_error
from shoal.server.openai.protocol import SamplingFields
from shoal.types import FinishReason, RequestOutput, SamplingParams, TokenLogprobs

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
    extra_stop: tuple[str, ...] = (),
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
    ):
        if value is not None:
            kw[name] = value
    if req.logit_bias:
        kw["logit_bias"] = _logit_bias(req.logit_bias)
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


def check_prompt(state, request, prompt_param: str) -> None:
    """The engine's checks (vocabulary, context length, logit_bias ids) as a 400."""
    try:
        state.engine.validate(request)
    except ValueError as e:
        msg = str(e)
        raise bad_request(msg, "logit_bias" if msg.startswith("logit_bias") else prompt_param) from None


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


def completion_logprobs(entries: list[TokenLogprobs], text_of: TokenStrings, offset: int) -> tuple[dict, int]:
    """The completions format ({"tokens", "token_logprobs", "top_logprobs", "text_offset"}) and the next offset."""
    tokens, lps, tops, offsets = [], [], [], []
    for e in entries:
        s = text_of(e.token_id)
        tokens.append(s)
        lps.append(_finite(e.logprob))
        tops.append({text_of(t.token_id): _finite(t.logprob) for t in e.top})
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}, offset


def _finite(x: float) -> float:
    # JSON has no -inf; a banned token's logprob is very negative, not absent.
    return x if x > -1e30 else -9999.0
