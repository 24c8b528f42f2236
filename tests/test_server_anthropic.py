"""The Anthropic Messages API with the official `anthropic` SDK as the client, on a tiny
random-weight model whose chat template renders tools: create, stream, count_tokens, stop
sequences and max_tokens, tools (forced calls are certain under the grammar) and a tool round
trip through the prefix cache, each error type in Anthropic's format, x-api-key auth."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest

from server_utils import LiveServer, tiny_engine
from shoal.server import ServerSettings
from tiny_models import TOOLS_TEMPLATE, make_tiny_model

KEY = "sk-test-anthropic"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER},
         {"name": "add", "description": "Add", "input_schema": ADD}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    path = make_tiny_model("llama", tmp_path_factory.mktemp("anthropic"), chat_template=TOOLS_TEMPLATE, max_position_embeddings=2048)
    with LiveServer(tiny_engine(path, max_model_len=2048, num_blocks=2048), ServerSettings(log_requests=False, api_key=KEY)) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv):
    return anthropic.Anthropic(base_url=srv.url, api_key=KEY, max_retries=0)


def model(srv) -> str:
    return srv.state.model_name


def sampled(**kw) -> dict:
    return {"extra_body": {"temperature": 1.0, "seed": 7, **kw}}


def test_create_answers_a_message_with_usage(srv, client):
    r = client.messages.create(model=model(srv), max_tokens=16, messages=ASK, **sampled())
    assert r.id.startswith("msg_") and r.type == "message" and r.role == "assistant"
    assert [b.type for b in r.content] == ["text"]
    assert r.stop_reason in ("end_turn", "max_tokens")
    assert 0 < r.usage.output_tokens <= 16
    counted = client.messages.count_tokens(model=model(srv), messages=ASK)
    assert counted.input_tokens == r.usage.input_tokens


def test_max_tokens_and_stop_sequences(srv, client):
    long = client.messages.create(model=model(srv), max_tokens=12, messages=ASK, **sampled(ignore_eos=True))
    assert long.stop_reason == "max_tokens" and long.usage.output_tokens == 12
    text = long.content[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = client.messages.create(model=model(srv), max_tokens=12, messages=ASK, stop_sequences=[stop], **sampled(ignore_eos=True))
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[: text.index(stop)]


def test_stream_text_equals_the_created_text(srv, client):
    kw = dict(model=model(srv), max_tokens=24, messages=ASK, **sampled(seed=3))
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == whole.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


def test_system_blocks_roles_and_the_billing_header(srv, client):
    base = [{"type": "text", "text": "You are terse."}]
    billing = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=abc123;"}] + base
    plain = client.messages.count_tokens(model=model(srv), system=base, messages=ASK).input_tokens
    assert client.messages.count_tokens(model=model(srv), system=billing, messages=ASK).input_tokens == plain
    odd_role = client.messages.count_tokens(model=model(srv), messages=[{"role": "user", "content": "hi"}])
    with srv.http() as h:  # Claude Code's habits: ?beta=true, an extra conversational role
        r = h.post("/v1/messages/count_tokens?beta=true", headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
                   json={"model": model(srv), "messages": [{"role": "developer", "content": "hi"}]})
    assert r.status_code == 200 and r.json()["input_tokens"] == odd_role.input_tokens


def test_forced_tool_use_is_a_valid_call_and_streams_as_input_json(srv, client):
    for choice in ({"type": "any"}, {"type": "tool", "name": "add"}):
        r = client.messages.create(model=model(srv), max_tokens=300, messages=ASK, tools=TOOLS, tool_choice=choice, **sampled())
        assert r.stop_reason == "tool_use"
        calls = [b for b in r.content if b.type == "tool_use"]
        assert calls and all(c.id.startswith("toolu_") for c in calls)
        for c in calls:
            jsonschema.validate(c.input, SCHEMAS[c.name])
        if choice["type"] == "tool":
            assert [c.name for c in calls] == ["add"]
    kw = dict(model=model(srv), max_tokens=300, messages=ASK, tools=TOOLS, tool_choice={"type": "any"}, **sampled(seed=9))
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [(b.name, b.input) for b in whole.content if b.type == "tool_use"]


def test_a_tool_round_trip_hits_the_prefix_cache(srv, client):
    first = client.messages.create(model=model(srv), max_tokens=300, messages=ASK, tools=TOOLS, tool_choice={"type": "any"}, **sampled(seed=4))
    calls = [b for b in first.content if b.type == "tool_use"]
    convo = ASK + [
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": c.id, "content": json.dumps({"ok": c.name})} for c in calls]},
    ]
    second = client.messages.create(model=model(srv), max_tokens=4, messages=convo, tools=TOOLS, **sampled())
    assert second.usage.cache_read_input_tokens >= first.usage.input_tokens // 2
    with srv.http() as h:  # the result is in the prompt, in the template's format
        prompt = h.post("/tokenize", headers={"x-api-key": KEY}, json={"messages": [
            {"role": "tool", "content": json.dumps({"ok": calls[0].name})}]}).json()["prompt"]
    assert "<tool_response>" in prompt


def test_output_config_format_constrains_to_a_schema(srv, client):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"], "additionalProperties": False}
    r = client.messages.create(model=model(srv), max_tokens=100, messages=ASK, **sampled(output_config={"format": {"type": "json_schema", "schema": schema}}))
    jsonschema.validate(json.loads(r.content[0].text), schema)


@pytest.mark.parametrize(
    "fields, status, kind, words",
    [
        ({"max_tokens": None}, 400, "invalid_request_error", ["max_tokens"]),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]},
         400, "invalid_request_error", ["images", "messages[0].content[0]"]),
        ({"messages": ASK + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}]}]},
         400, "invalid_request_error", ["toolu_nope"]),
        ({"tools": [{"name": "f"}]}, 400, "invalid_request_error", ["input_schema"]),
        ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "launch"}}, 400, "invalid_request_error", ["'launch'"]),
        ({"tool_choice": {"type": "any"}}, 400, "invalid_request_error", ["needs tools"]),
        ({"model": "no-such-model"}, 404, "not_found_error", ["no-such-model"]),
    ],
)
def test_errors_are_in_anthropics_format_and_the_server_goes_on(srv, fields, status, kind, words):
    body = {"model": model(srv), "max_tokens": 8, "messages": ASK, **fields}
    body = {k: v for k, v in body.items() if v is not None}
    with srv.http() as h:
        r = h.post("/v1/messages", headers={"x-api-key": KEY}, json=body)
        assert r.status_code == status, r.text
        err = r.json()
        assert err["type"] == "error" and err["error"]["type"] == kind
        for w in words:
            assert w in err["error"]["message"]
        assert h.post("/v1/messages", headers={"x-api-key": KEY}, json={"model": model(srv), "max_tokens": 2, "messages": ASK}).status_code == 200


def test_the_sdk_raises_each_error_type(srv, client):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=model(srv), max_tokens=8, messages=[{"role": "user", "content": [{"type": "document", "source": {}}]}])
    assert e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-nope", max_tokens=8, messages=ASK)
    wrong = anthropic.Anthropic(base_url=srv.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        wrong.messages.create(model=model(srv), max_tokens=8, messages=ASK)
    assert e.value.body["error"]["type"] == "authentication_error"


def test_a_thinking_budget_caps_the_reasoning(tmp_path_factory):
    path = make_tiny_model("llama", tmp_path_factory.mktemp("thinking"), max_position_embeddings=2048)
    settings = ServerSettings(log_requests=False, reasoning_parser="deepseek_r1")  # replies start inside the reasoning
    with LiveServer(tiny_engine(path, max_model_len=512), settings) as s:
        client = anthropic.Anthropic(base_url=s.url, api_key="unused", max_retries=0)
        kw = dict(model=s.state.model_name, max_tokens=24, messages=ASK, extra_body={"temperature": 1.0, "seed": 1, "ignore_eos": True})
        free = client.messages.create(thinking={"type": "enabled", "budget_tokens": 1024}, **kw)
        assert [b.type for b in free.content] == ["thinking"]  # random weights never close the reasoning themselves
        capped = client.messages.create(thinking={"type": "enabled", "budget_tokens": 4}, **kw)
        assert [b.type for b in capped.content] == ["thinking", "text"]
        assert free.content[0].thinking.startswith(capped.content[0].thinking)
        with s.http() as h:
            bad = h.post("/v1/messages", json={**kw, "extra_body": None, "thinking": {"type": "enabled", "budget_tokens": -1}})
        assert bad.status_code == 400 and "budget_tokens" in bad.json()["error"]["message"]
