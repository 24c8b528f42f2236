"""What chat and completions share: request bounds, structured output, usage, logprobs, ids.
(Sampling-parameter precedence is protocol-neutral: `server/chat/params.py`.)

Bounds on the work one request may ask for:

- prompts x n may not exceed --max-sequences-per-request (a 400 naming both numbers);
- a text prompt longer than `chat.render.max_prompt_chars` is refused before it is tokenized
  (it could not fit the context: see there);
- a `max_tokens` larger than what the context leaves after the prompt is clipped
  to that room, and the response says so in the header
  `X-Shoal-Max-Tokens-Clipped: <the max_tokens it ran with>` (`chat.params.clipped_headers`:
  the smallest, when several prompts were clipped; the Anthropic adapter sends it too). The choice's finish_reason "length" already says
  the text stopped at the limit; the header says the limit was not the one asked for.
"""

from __future__ import annotations

import dataclasses
import time
import uuid

from shoal.server.chat.params import constraint
from shoal.server.chat.render import TokenStrings
from shoal.server.errors import bad_request
from shoal.server.openai.protocol import SamplingFields
from shoal.types import FinishReason, RequestOutput, StructuredOutput, TokenLogprobs


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


# ---------------------------------------------------------------- bounds and refusals


def check_unsupported(body: SamplingFields) -> None:
    """Fields OpenAI defines that shoal does not implement: a 400 rather than silence."""
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")


# ---------------------------------------------------------------- structured output

_VLLM_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# vLLM's options of a JSON constraint's layout, as its own fields mean them (json_schema.py).
_VLLM_LAYOUT = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern")
# vLLM's options about its grammar backends: shoal has one.
_VLLM_IGNORED = {"disable_fallback", "backend"}


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
            found.append((constraint(kind, value, field_), field_))
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
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request("response_format.json_schema.strict must be true or false", "response_format.json_schema.strict")
    return dataclasses.replace(constraint("json", spec["schema"], "response_format.json_schema.schema"), strict=bool(strict))


def _vllm_structured(opts: dict) -> tuple[StructuredOutput, str]:
    given = [k for k in _VLLM_KINDS if opts.get(k) not in (None, False)]
    unknown = sorted(set(opts) - set(_VLLM_KINDS) - set(_VLLM_LAYOUT) - _VLLM_IGNORED)
    if "structural_tag" in unknown:
        raise bad_request("structured_outputs.structural_tag is not supported: use json, regex, choice or grammar", "structured_outputs.structural_tag")
    if unknown:
        raise bad_request(f"structured_outputs has unknown keys {unknown}: expected one of json, regex, choice, grammar, json_object", "structured_outputs")
    if len(given) != 1:
        raise bad_request(
            f"structured_outputs needs exactly one of json, regex, choice, grammar, json_object; got {given or 'none'}", "structured_outputs"
        )
    (kind,) = given
    spec = constraint(kind, opts[kind], f"structured_outputs.{kind}")
    if spec.json_schema is not None or spec.json_object:
        spec = dataclasses.replace(spec, **_vllm_layout(opts))
    return spec, f"structured_outputs.{kind}"


def _vllm_layout(opts: dict) -> dict:
    """vLLM's layout options: `disable_any_whitespace` (one line), `whitespace_pattern` (a regex for the
    whitespace at each place), `disable_additional_properties` (no property a schema does not name)."""
    out = {}
    for key in _VLLM_LAYOUT:
        value = opts.get(key)
        if value is None:
            continue
        if key == "whitespace_pattern":
            if not isinstance(value, str) or not value:
                raise bad_request("structured_outputs.whitespace_pattern must be a non-empty regex", "structured_outputs.whitespace_pattern")
            out["whitespace_pattern"] = value
        elif not isinstance(value, bool):
            raise bad_request(f"structured_outputs.{key} must be true or false", f"structured_outputs.{key}")
        elif key == "disable_any_whitespace":
            out["layout"] = "compact" if value else "flexible"
        else:
            out["extra_properties"] = not value
    return out


def check_sequences(served, num_prompts: int, n: int | None) -> None:
    """prompts x n within --max-sequences-per-request (counted before any tokenizing)."""
    limit = served.settings.max_sequences_per_request
    n = n or 1
    if num_prompts * n > limit:
        raise bad_request(
            f"this request asks for {num_prompts * n} sequences ({num_prompts} prompt{'s' if num_prompts != 1 else ''} x n {n}) "
            f"but the server allows at most {limit} per request (--max-sequences-per-request)",
            "n",
        )


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
