"""Structured output: grammars compiled once, masks in the sampler, matchers that fork and
survive preemption, free requests untouched by constrained ones, and the HTTP surface
(OpenAI's response_format through the `openai` SDK, vLLM's extras, and the 400s)."""

from __future__ import annotations

import json
import re
from typing import Literal

import jsonschema
import pydantic
import pytest
import torch

from server_utils import LiveServer, tiny_engine
from shoal import LLM, SamplingParams
from shoal.engine.structured import GrammarCompiler
from shoal.json_schema import GrammarError, forced_tool_call_schema
from shoal.runner.sampler import SamplerRow, SamplingBatch, process_logits, sample, unpack_token_masks
from shoal.types import FinishReason, StructuredOutput
from test_server_errors import check
from tiny_models import make_tokenizer

# Bounded everywhere, so even random weights finish inside max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}, "verified": {"type": "boolean"}},
            "required": ["zip", "verified"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
# One line: random weights would spend their tokens on the flexible layout's whitespace (bounded, tested below).
JSON_SPEC = StructuredOutput(json_schema=json.dumps(SCHEMA), layout="compact")
TOOLS = [
    {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                                           "unit": {"enum": ["c", "f"]}},
                                           "required": ["city", "unit"], "additionalProperties": False}},
    {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                                                   "b": {"type": "integer", "minimum": 0, "maximum": 99}},
                                   "required": ["a", "b"], "additionalProperties": False}},
]


@pytest.fixture(scope="module")
def model_path(tiny_llama_path):
    return str(tiny_llama_path)


@pytest.fixture(scope="module")
def llm(model_path):
    return LLM(model_path, dtype="float32", num_blocks=256, block_size=4)


@pytest.fixture(scope="module")
def compiler():
    tok = make_tokenizer()
    return GrammarCompiler(tok, (0,), len(tok))


def prompts(n):
    return [[(7 * i + 3 * j) % 390 + 5 for j in range(2 + (i * 13) % 30)] for i in range(n)]


def texts(outs):
    return [c.text for o in outs for c in o.outputs]


def assert_valid_json(outs, schema=SCHEMA):
    for o in outs:
        for c in o.outputs:
            assert c.finish_reason is FinishReason.STOP, (c.finish_reason, c.text)
            jsonschema.validate(json.loads(c.text), schema)


# ---------------------------------------------------------------- compiling


def test_a_constraint_compiles_once_and_equal_constraints_share_it(compiler):
    before = compiler.compiles
    a = compiler.compile(StructuredOutput(regex=r"[a-c]{2,4}"))
    b = compiler.compile(StructuredOutput(regex=r"[a-c]{2,4}"))  # another object, equal value
    assert a is b
    assert compiler.compiles == before + 1
    assert compiler.cache_hits >= 1


@pytest.mark.parametrize(
    "spec, words",
    [
        (StructuredOutput(json_schema=json.dumps({"type": "objekt"})), ["objekt"]),
        (StructuredOutput(json_schema=json.dumps({"$ref": "#/defs/missing"})), ["/defs/missing"]),
        (StructuredOutput(json_schema=json.dumps({"type": "string", "pattern": "[a-"})), ["unclosed character class"]),
        (StructuredOutput(regex="(unclosed"), ["regex"]),
        (StructuredOutput(grammar="start: undefined_rule"), ["undefined_rule"]),
        # catastrophic sizes: a repetition that explodes the lexer, an enum too big to build
        (StructuredOutput(regex="((a{100}){100}){100}"), ["too many expressions"]),
        (StructuredOutput(json_schema=json.dumps({"enum": [f"value{i}" for i in range(20000)]})), ["too big"]),
    ],
)
def test_constraints_that_cannot_compile_say_why(compiler, spec, words):
    with pytest.raises(GrammarError) as e:
        compiler.compile(spec)
    for w in words:
        assert w in str(e.value)
    assert "non-verbose" not in str(e.value)
    with pytest.raises(GrammarError):  # the failure is cached: no second compile
        before = compiler.compiles
        compiler.compile(spec)
    assert compiler.compiles == before


def test_structured_output_needs_exactly_one_constraint():
    for bad in ({}, {"regex": "a", "choice": ("a",)}, {"choice": ()}, {"choice": ("",)}):
        with pytest.raises(ValueError):
            StructuredOutput(**bad)
    assert StructuredOutput(choice=["a", "b"]).choice == ("a", "b")  # lists become hashable tuples


def test_a_forked_matcher_keeps_its_own_state(compiler):
    tok = make_tokenizer()
    m = compiler.compile(StructuredOutput(choice=("ab", "ac"))).matcher()
    (a,) = tok.encode("a", add_special_tokens=False)
    m.accept(a)
    fork = m.fork()
    fork.accept(tok.encode("b", add_special_tokens=False)[0])
    assert fork.done and not m.done
    with pytest.raises(GrammarError):
        m.accept(tok.encode("z", add_special_tokens=False)[0])


def test_forced_tool_call_schema_accepts_exactly_the_tools_calls():
    schema = forced_tool_call_schema(TOOLS)
    jsonschema.validate({"name": "add", "arguments": {"a": 1, "b": 2}}, schema)
    for bad in ({"name": "add", "arguments": {"city": "x", "unit": "c"}}, {"name": "rm", "arguments": {}}, {"name": "add"}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    with pytest.raises(GrammarError):
        forced_tool_call_schema([])


# ---------------------------------------------------------------- the sampler's mask stage


def _mask(allowed: list[int], V: int) -> bytes:
    bits = bytearray((V + 31) // 32 * 4)
    for t in allowed:
        bits[t // 8] |= 1 << (t % 8)
    return bytes(bits)


def test_unpacked_masks_are_the_bits_in_token_order():
    V = 77
    allowed = [0, 5, 8, 31, 32, 63, 76]
    got = unpack_token_masks([_mask(allowed, V), _mask([], V)], V)
    assert got.shape == (2, V)
    assert got[0].nonzero().flatten().tolist() == allowed
    assert not got[1].any()


def test_the_mask_is_one_more_processor_and_leaves_other_rows_alone():
    torch.manual_seed(0)
    V = 100
    logits = torch.randn(3, V)
    allowed = [3, 50, 97]
    rows = [
        SamplerRow(SamplingParams(temperature=0.0)),
        SamplerRow(SamplingParams(temperature=0.0, logit_bias={97: 50.0}), token_mask=_mask(allowed, V)),
        SamplerRow(SamplingParams(temperature=1.0, seed=1), token_mask=_mask(allowed, V)),
    ]
    batch = SamplingBatch.build(rows, V, "cpu")
    processed = process_logits(logits, batch)
    assert torch.equal(processed[0], logits[0])
    for r in (1, 2):
        finite = processed[r].isfinite().nonzero().flatten().tolist()
        assert finite == allowed
    out = sample(logits, batch)
    assert out.token_ids[0].item() == logits[0].argmax().item()
    assert out.token_ids[1].item() == 97  # the bias still applies inside the mask
    assert out.token_ids[2].item() in allowed
    # logprobs come from the raw distribution, not the masked one
    assert out.logprobs[1].item() == pytest.approx(logits[1].log_softmax(-1)[97].item(), abs=1e-6)


# ---------------------------------------------------------------- the engine (tiny random weights)


def test_twenty_seeded_samples_validate_against_the_schema(llm):
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=200, structured=JSON_SPEC) for s in range(20)]
    assert_valid_json(llm.generate([prompts(1)[0]] * 20, params))


def test_regex_and_choice_replies_match(llm):
    rx = r"[0-9]{3}-[a-z]{2,4}"
    outs = llm.generate(prompts(10), SamplingParams(temperature=1.0, seed=3, max_tokens=40, structured=StructuredOutput(regex=rx)))
    assert all(re.fullmatch(rx, t) for t in texts(outs)), texts(outs)
    choices = ("yes", "no", "it depends")
    outs = llm.generate(prompts(10), [SamplingParams(temperature=1.0, seed=s, max_tokens=40, structured=StructuredOutput(choice=choices)) for s in range(10)])
    assert all(t in choices for t in texts(outs))
    assert len(set(texts(outs))) > 1  # sampled, not one forced answer


def test_lark_and_gbnf_grammars(llm):
    for grammar in ('start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]{1,2}/', 'root ::= "(" num ("," num)* ")"\nnum ::= [0-9] [0-9]?'):
        spec = StructuredOutput(grammar=grammar)
        outs = llm.generate(prompts(6), SamplingParams(temperature=1.0, seed=5, max_tokens=60, structured=spec))
        for o in outs:
            c = o.outputs[0]
            assert re.fullmatch(r"\([0-9]{1,2}(,[0-9]{1,2})*\)", c.text) or c.finish_reason is FinishReason.LENGTH, c.text


def test_forced_tool_call_from_two_tools_is_always_a_valid_call(llm):
    schema = forced_tool_call_schema(TOOLS)
    spec = StructuredOutput(json_schema=json.dumps(schema), layout="compact")
    outs = llm.generate(prompts(12), [SamplingParams(temperature=1.0, seed=s, max_tokens=120, structured=spec) for s in range(12)])
    assert_valid_json(outs, schema)
    names = {json.loads(t)["name"] for t in texts(outs)}
    assert names <= {"get_weather", "add"}


def test_free_requests_in_a_constrained_batch_give_the_tokens_they_give_alone(model_path):
    llm = LLM(model_path, dtype="float32", num_blocks=256, block_size=4, max_num_batched_tokens=32, check_integrity=True)
    free = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), SamplingParams(temperature=1.0, seed=9, max_tokens=12, ignore_eos=True)]
    ps = prompts(6)
    alone = [llm.generate([ps[i]], free[i % 2])[0].outputs[0].token_ids for i in range(2)]
    constrained = SamplingParams(temperature=1.0, seed=1, max_tokens=200, structured=JSON_SPEC)
    outs = llm.generate(ps, [free[0], free[1], constrained, constrained, constrained, constrained])
    assert [o.outputs[0].token_ids for o in outs[:2]] == alone
    assert_valid_json(outs[2:])


def test_n_choices_fork_their_matchers_and_survive_preemption(model_path):
    small = LLM(model_path, dtype="float32", num_blocks=72, block_size=4, max_model_len=256, max_num_batched_tokens=48, check_integrity=True)
    params = SamplingParams(temperature=1.0, seed=11, n=3, max_tokens=200, structured=JSON_SPEC)
    outs = small.generate(prompts(6), params)
    assert small.engine.stats.preemptions > 0  # the pool really was too small
    assert_valid_json(outs)
    assert all(len({c.text for c in o.outputs}) > 1 for o in outs)  # the choices went their own ways
    assert small.engine.pool.num_free == 72


def test_beam_search_under_a_grammar(llm):
    choices = ("alpha", "beta", "gamma delta")
    out = llm.generate([prompts(1)[0]], SamplingParams(num_beams=3, n=3, max_tokens=20, structured=StructuredOutput(choice=choices)))[0]
    assert {c.text for c in out.outputs} <= set(choices)
    assert out.error is None


def test_logprobs_under_a_grammar_are_the_models(llm):
    p = prompts(1)[0]
    free = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=1, logprobs=5))[0].outputs[0]
    spec = StructuredOutput(choice=("zzz",))
    forced = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=1, logprobs=5, structured=spec))[0].outputs[0]
    assert forced.logprobs[0].top == free.logprobs[0].top  # the raw top 5, same as unconstrained
    assert forced.token_ids != free.token_ids or free.logprobs[0].token_id == forced.token_ids[0]


def test_an_uncompilable_constraint_is_refused_before_the_loop(llm):
    with pytest.raises(ValueError, match="objekt"):
        llm.generate([prompts(1)[0]], SamplingParams(structured=StructuredOutput(json_schema='{"type": "objekt"}')))
    assert not llm.engine.has_unfinished()


# ---------------------------------------------------------------- schema keywords, layouts, strict, bounds

# One schema per keyword users rely on, bounded so that random weights finish too.
KEYWORDS = {
    "minItems/maxItems": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 2, "maxItems": 4},
    "minLength/maxLength": {"type": "string", "minLength": 2, "maxLength": 5},
    "pattern": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
    "format date": {"type": "string", "format": "date"},
    "format date-time": {"type": "string", "format": "date-time"},
    "format email": {"type": "string", "format": "email", "maxLength": 24},
    "format uuid": {"type": "string", "format": "uuid"},
    "enum/const": {"type": "object", "properties": {"k": {"const": "x"}, "e": {"enum": [1, "two", None]}}, "required": ["k", "e"]},
    "anyOf": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "boolean"}]},
    "oneOf": {"oneOf": [{"type": "object", "properties": {"t": {"const": "a"}}, "required": ["t"]},
                        {"type": "object", "properties": {"t": {"const": "b"}, "n": {"type": "integer", "minimum": 0, "maximum": 5}}, "required": ["t", "n"]}]},
    "$ref/$defs": {"$defs": {"p": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["x"]}},
                   "type": "array", "items": {"$ref": "#/$defs/p"}, "maxItems": 3},
    "required, in property order": {"type": "object", "properties": {"b": {"type": "boolean"}, "a": {"type": "boolean"}, "c": {"type": "boolean"}},
                                    "required": ["b", "c"]},
    "integer": {"type": "integer"},
    "number": {"type": "number"},
}


def assert_keyword_reply(name, schema, text):
    doc = json.loads(text)
    jsonschema.validate(doc, schema, format_checker=jsonschema.FormatChecker())
    if name == "required, in property order":
        assert list(doc) == [k for k in ("b", "a", "c") if k in doc]
    if name == "integer":
        assert -(2**63) <= doc < 2**63 and len(text.strip()) <= 20
    if name == "number":
        assert re.fullmatch(r"-?[0-9]{1,16}(\.[0-9]{1,10})?", text.strip()), text  # no exponent, digits bounded
        assert abs(doc) <= 1e15, text


@pytest.mark.parametrize("layout", ["compact", "flexible"])
def test_every_keyword_holds_in_seeded_samples(llm, layout):
    specs = [(name, schema, StructuredOutput(json_schema=json.dumps(schema), layout=layout)) for name, schema in KEYWORDS.items()]
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=400, structured=spec) for _, _, spec in specs for seed in range(4)]
    outs = llm.generate(prompts(len(params)), params)
    for (name, schema, _), o in zip([x for x in specs for _ in range(4)], outs, strict=True):
        c = o.outputs[0]
        assert c.finish_reason is FinishReason.STOP, (name, c.text)
        assert_keyword_reply(name, schema, c.text)


def test_the_flexible_layout_bounds_whitespace_so_random_weights_finish(llm):
    """At most one newline and 24 spaces or tabs at each place: a model cannot loop in whitespace."""
    spec = StructuredOutput(json_schema=json.dumps(SCHEMA), layout="flexible")
    outs = llm.generate(prompts(10), [SamplingParams(temperature=1.0, seed=s, max_tokens=1200, structured=spec) for s in range(10)])
    assert_valid_json(outs)
    for t in texts(outs):
        assert not re.search(r"\n[ \t]*\n", t) and not re.search(r"[ \t]{25}", t), t
    assert any("\n" in t for t in texts(outs))  # the model's own layout, not one line


def test_a_custom_whitespace_pattern_is_the_only_whitespace(llm):
    spec = StructuredOutput(json_schema=json.dumps(SCHEMA), whitespace_pattern="[ ]{0,1}")
    outs = llm.generate(prompts(6), [SamplingParams(temperature=1.0, seed=s, max_tokens=300, structured=spec) for s in range(6)])
    assert_valid_json(outs)
    for t in texts(outs):
        outside = re.sub(r'"(?:[^"\\]|\\.)*"', '""', t)  # whitespace inside strings is the string's
        assert not re.search(r"[\n\t]|  ", outside), t


def test_integers_at_the_int64_edges(llm):
    for schema in ({"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1},  # compiles (it did not before)
                   {"type": "integer", "minimum": 2**63 - 2000},
                   {"type": "integer", "maximum": -(2**63) + 2000}):
        spec = StructuredOutput(json_schema=json.dumps(schema))
        outs = llm.generate(prompts(6), [SamplingParams(temperature=1.0, seed=s, max_tokens=40, structured=spec) for s in range(6)])
        for t in texts(outs):
            value = json.loads(t)
            assert -(2**63) <= value <= 2**63 - 1, t
            jsonschema.validate(value, schema)


def test_strict_means_every_property_and_no_other(llm):
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"enum": ["x", "y"]}, "c": {"type": "boolean"}},
              "required": ["a"], "additionalProperties": True}
    strict = StructuredOutput(json_schema=json.dumps(schema), strict=True, layout="compact")
    outs = llm.generate(prompts(8), [SamplingParams(temperature=1.0, seed=s, max_tokens=80, structured=strict) for s in range(8)])
    for t in texts(outs):
        assert list(json.loads(t)) == ["a", "b", "c"], t
    # Without strict, the optional ones may be left out, and no unnamed property is written either
    # unless the request asks for JSON Schema's own default.
    unsaid = {k: v for k, v in schema.items() if k != "additionalProperties"}
    loose = StructuredOutput(json_schema=json.dumps(unsaid), layout="compact")
    outs = llm.generate(prompts(8), [SamplingParams(temperature=1.0, seed=s, max_tokens=80, structured=loose) for s in range(8)])
    keys = [list(json.loads(t)) for t in texts(outs)]
    assert all(set(k) <= {"a", "b", "c"} and k[0] == "a" for k in keys), keys
    assert any(k != ["a", "b", "c"] for k in keys), keys  # some reply used the freedom


@pytest.mark.parametrize("schema, words", [
    ({"type": "array", "uniqueItems": True}, ["uniqueItems"]),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "dependentRequired": {"a": ["b"]}}, ["dependentRequired"]),
    ({"type": "array", "contains": {"const": 1}}, ["contains"]),
    ({"type": "string", "format": "ssn"}, ["format", "ssn"]),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, ["oneOf", "anyOf"]),
])
def test_unsupported_keywords_are_refused_by_name(compiler, schema, words):
    with pytest.raises(GrammarError) as e:
        compiler.compile(StructuredOutput(json_schema=json.dumps(schema)))
    for w in words:
        assert w in str(e.value)
    assert "coerce_one_of" not in str(e.value)  # llguidance's option, not the user's


def grammar_takes(compiler, spec, text) -> bool:
    """Whether the compiled grammar lets a reply begin with `text`, one token at a time."""
    m = compiler.compile(spec).matcher()
    try:
        for token in make_tokenizer().encode(text, add_special_tokens=False):
            m.accept(token)
    except GrammarError:
        return False
    return True


@pytest.mark.parametrize("spec", [StructuredOutput(json_object=True, layout="compact"),
                                  StructuredOutput(json_schema=json.dumps({"type": "object", "properties": {"a": {}}}), layout="compact")],
                         ids=["json_object", "a schema's any-value"])
def test_json_object_mode_and_open_values_have_the_same_bounds(compiler, spec):
    assert grammar_takes(compiler, spec, '{"a": 123456789012345')  # 15 digits
    assert grammar_takes(compiler, spec, '{"a": 1000000000000000')  # 10^15 itself
    assert not grammar_takes(compiler, spec, '{"a": 1234567890123456')  # past 10^15
    assert grammar_takes(compiler, spec, '{"a": [0.1234567891, -2')  # 10 decimals
    assert not grammar_takes(compiler, spec, '{"a": 0.12345678912')  # 11
    assert not grammar_takes(compiler, spec, '{"a": 1e5')  # no exponent


def test_an_unbounded_integer_fits_an_int64(compiler):
    spec = StructuredOutput(json_schema=json.dumps({"type": "integer"}))
    assert grammar_takes(compiler, spec, "9223372036854774784") and grammar_takes(compiler, spec, "-9223372036854774784")
    assert not grammar_takes(compiler, spec, "9223372036854775807") and not grammar_takes(compiler, spec, "92233720368547747840")


def test_json_object_replies_from_random_weights_are_objects(llm):
    spec = StructuredOutput(json_object=True, layout="compact")
    outs = llm.generate(prompts(8), [SamplingParams(temperature=1.0, seed=s, max_tokens=300, structured=spec) for s in range(8)])
    for c in (c for o in outs for c in o.outputs):
        assert c.text.startswith("{")
        if c.finish_reason is FinishReason.STOP:
            assert isinstance(json.loads(c.text), dict), c.text


# ---------------------------------------------------------------- HTTP


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=6)
    age: int = pydantic.Field(ge=0, le=120)
    role: Literal["admin", "user", "guest"]


@pytest.fixture(scope="module")
def srv(model_path):
    with LiveServer(tiny_engine(model_path, max_model_len=256)) as s:
        yield s


CHAT = [{"role": "user", "content": "Make up a person."}]


def test_openai_sdk_parses_a_json_schema_reply(srv):
    client = srv.openai()
    for seed in range(3):
        r = client.chat.completions.parse(model=srv.state.model_name, messages=CHAT, response_format=Person, temperature=1.0, seed=seed, max_tokens=120)
        msg = r.choices[0].message
        assert isinstance(msg.parsed, Person), msg.content
        assert r.choices[0].finish_reason == "stop"


def test_streamed_constrained_reply_is_the_same_document(srv):
    client = srv.openai()
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    whole = client.chat.completions.create(model=srv.state.model_name, messages=CHAT, response_format=fmt, temperature=1.0, seed=7, max_tokens=200)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
        model=srv.state.model_name, messages=CHAT, response_format=fmt, temperature=1.0, seed=7, max_tokens=200, stream=True) if ch.choices)
    assert streamed == whole.choices[0].message.content
    jsonschema.validate(json.loads(streamed), SCHEMA)


@pytest.mark.parametrize(
    "extra, ok",
    [
        ({"structured_outputs": {"regex": r"[0-9]{4}"}}, lambda t: re.fullmatch(r"[0-9]{4}", t)),
        ({"structured_outputs": {"choice": ["red", "green"]}}, lambda t: t in ("red", "green")),
        ({"guided_regex": r"x[ab]{3}"}, lambda t: re.fullmatch(r"x[ab]{3}", t)),
        ({"guided_choice": ["up", "down"]}, lambda t: t in ("up", "down")),
        ({"guided_json": json.dumps(SCHEMA)}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
        ({"structured_outputs": {"grammar": 'root ::= "a" | "b" "c"'}}, lambda t: t in ("a", "bc")),
    ],
)
def test_vllm_spellings_on_chat_and_completions(srv, extra, ok):
    client = srv.openai()
    r = client.chat.completions.create(model=srv.state.model_name, messages=CHAT, temperature=1.0, seed=2, max_tokens=200, extra_body=extra)
    assert ok(r.choices[0].message.content), r.choices[0].message.content
    r = client.completions.create(model=srv.state.model_name, prompt="Answer:", temperature=1.0, seed=2, max_tokens=200, extra_body=extra)
    assert ok(r.choices[0].text), r.choices[0].text


def test_vllms_layout_options_mean_what_they_say(srv):
    client = srv.openai()

    def reply(**opts):
        r = client.chat.completions.create(model=srv.state.model_name, messages=CHAT, temperature=1.0, seed=3, max_tokens=600,
                                           extra_body={"structured_outputs": {"json": SCHEMA, **opts}})
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
        return re.sub(r'"(?:[^"\\]|\\.)*"', '""', r.choices[0].message.content)  # strings' own whitespace aside

    compact = reply(disable_any_whitespace=True)
    assert "\n" not in compact and re.fullmatch(r'\{"": .*\}', compact) and ", " in compact  # one line, as json.dumps writes it
    assert re.search(r"[\n\t]|  ", reply(whitespace_pattern="[ ]{0,1}")) is None
    assert reply(disable_any_whitespace=False, disable_additional_properties=True)


def test_strict_response_format_writes_every_property(srv):
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"enum": ["x", "y"]}}, "required": ["a"]}
    client = srv.openai()
    for seed in range(4):
        fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}}
        r = client.chat.completions.create(model=srv.state.model_name, messages=CHAT, response_format=fmt, temperature=1.0, seed=seed, max_tokens=200)
        assert list(json.loads(r.choices[0].message.content)) == ["a", "b"]


def test_json_object_reply_is_an_object_or_was_cut(srv):
    client = srv.openai()
    r = client.chat.completions.create(model=srv.state.model_name, messages=CHAT, response_format={"type": "json_object"}, temperature=0.0, max_tokens=200)
    text, reason = r.choices[0].message.content, r.choices[0].finish_reason
    assert text.startswith("{")
    if reason == "stop":
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize(
    "fields, param, words",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
         "response_format.json_schema.schema", ["objekt"]),
        ({"response_format": {"type": "json_schema", "json_schema": "nope"}}, "response_format.json_schema", ["object"]),
        ({"response_format": {"type": "yaml"}}, "response_format", ["'text', 'json_object' or 'json_schema'"]),
        ({"structured_outputs": {"regex": "((a{100}){100}){100}"}}, "structured_outputs.regex", ["too many expressions"]),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex", ["regex"]),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag", ["not supported"]),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", ["exactly one"]),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", ["non-empty list"]),
        ({"guided_json": "{not json"}, "guided_json", ["not valid JSON"]),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", ["one output constraint"]),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}}}},
         "response_format.json_schema.schema", ["uniqueItems", "not support"]),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": "yes"}}},
         "response_format.json_schema.strict", ["true or false"]),
        ({"structured_outputs": {"json": {"type": "object"}, "disable_any_whitespace": "no"}}, "structured_outputs.disable_any_whitespace", ["true or false"]),
        ({"structured_outputs": {"json": {"type": "object"}, "whitespace_pattern": "[ "}}, "structured_outputs.json", ["unclosed"]),
    ],
)
def test_bad_constraints_are_a_400_naming_the_problem_and_the_server_goes_on(srv, fields, param, words):
    with srv.http() as h:
        resp = h.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4, **fields})
        check(resp, 400, "invalid_request_error", *words, param=param)
        assert h.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4}).status_code == 200


# ---------------------------------------------------------------- the real default model


@pytest.fixture(scope="module")
def real(default_gguf_path):
    return LLM("smollm2", max_model_len=1024)  # the default dtype: bfloat16 where the CPU has it


@pytest.mark.slow
def test_real_model_twenty_seeded_json_schema_samples_validate(real):
    msgs = [{"role": "user", "content": "Describe a user of our web site as JSON with name, age, role, tags and address."}]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=256, structured=JSON_SPEC) for s in range(20)]
    outs = real.chat([msgs] * 20, params)
    assert_valid_json(outs)
    assert len(set(texts(outs))) > 10  # twenty draws, not one answer


@pytest.mark.slow
def test_real_model_json_object_and_forced_tool_calls(real):
    ask = [{"role": "user", "content": "Give me a JSON object describing a cat."}]
    outs = real.chat([ask] * 10, [SamplingParams(temperature=1.0, seed=s, max_tokens=256, structured=StructuredOutput(json_object=True)) for s in range(10)])
    done = [c.text for o in outs for c in o.outputs if c.finish_reason is FinishReason.STOP]
    # A 135M model can ramble inside a string until max_tokens (finish "length", as OpenAI
    # documents); every reply the grammar let finish is an object.
    assert len(done) >= 3
    for t in done:
        assert isinstance(json.loads(t), dict), t
    for o in outs:
        assert o.outputs[0].text.startswith("{")
    call = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
    schema = forced_tool_call_schema(TOOLS)
    spec = StructuredOutput(json_schema=json.dumps(schema))
    outs = real.chat([call] * 5, [SamplingParams(temperature=1.0, seed=s, max_tokens=128, structured=spec) for s in range(5)])
    assert_valid_json(outs, schema)


@pytest.mark.slow
def test_real_model_every_keyword_holds_in_seeded_samples(real):
    ask = [{"role": "user", "content": "Answer with JSON."}]
    cases = [(name, schema) for name, schema in KEYWORDS.items() for _ in range(3)]
    params = [SamplingParams(temperature=0.7, seed=i, max_tokens=200, frequency_penalty=0.5, structured=StructuredOutput(json_schema=json.dumps(schema)))
              for i, (_, schema) in enumerate(cases)]
    outs = real.chat([ask] * len(cases), params)
    for (name, schema), o in zip(cases, outs, strict=True):
        c = o.outputs[0]
        assert c.finish_reason is FinishReason.STOP, (name, c.text)
        assert_keyword_reply(name, schema, c.text)


# ---------------------------------------------------------------- thinking budgets


def test_budget_matcher_forces_the_end_tag_after_the_budget():
    from shoal.engine.structured import BudgetMatcher
    from shoal.types import ThinkingBudget

    def allowed(m):
        return None if m.mask is None else unpack_token_masks([m.mask], 16)[0].nonzero().flatten().tolist()

    m = BudgetMatcher(ThinkingBudget(3, end_ids=(3, 4), start_ids=(1, 2)), 16)
    for t in (9, 1, 2):  # outside, then the start tag
        m.accept(t)
    fork = m.fork()
    for t in (5, 6):  # two tokens of reasoning
        m.accept(t)
        assert allowed(m) is None
    m.accept(7)  # the third: the budget is spent
    assert allowed(m) == [3]
    m.accept(3)
    assert allowed(m) == [4]
    m.accept(4)
    assert allowed(m) is None and m.finished
    fork.accept(3), fork.accept(4)  # the fork ended its reasoning itself, inside the budget
    assert fork.finished and allowed(fork) is None
    fork.accept(8)
    assert allowed(fork) is None


def test_a_thinking_budget_ends_the_reasoning_and_changes_nothing_before(llm):
    from shoal.types import ThinkingBudget

    end = tuple(llm.tokenizer.encode("</think>", add_special_tokens=False))
    p = prompts(1)[0]
    free = llm.generate([p], SamplingParams(temperature=1.0, seed=2, max_tokens=20, ignore_eos=True))[0].outputs[0].token_ids
    capped = llm.generate([p], SamplingParams(temperature=1.0, seed=2, max_tokens=20, ignore_eos=True,
                                              thinking_budget=ThinkingBudget(5, end)))[0].outputs[0].token_ids
    assert capped[:5] == free[:5]
    assert tuple(capped[5 : 5 + len(end)]) == end
