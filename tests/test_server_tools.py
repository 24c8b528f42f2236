"""Tool calling over OpenAI's API with the `openai` SDK, on tiny random-weight models: one whose
chat template renders tools (template native) and one whose does not (shoal's manual format).
Forced calls are certain even with random weights (the grammar); auto calls are parsed from
text the test makes the model write (a regex constraint spelling a call)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from server_utils import LiveServer, tiny_engine
from tiny_models import TOOLS_TEMPLATE, make_tiny_model

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": ADD}},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# A regex that makes the model write one Hermes-format call: the auto path's parser must find it.
HERMES_CALL = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "Paris", "unit": "c"\}\}</tool_call>'


@pytest.fixture(scope="module", params=["native", "manual"])
def srv(request, tmp_path_factory):
    template = TOOLS_TEMPLATE if request.param == "native" else None
    path = make_tiny_model("llama", tmp_path_factory.mktemp(f"tools-{request.param}"), chat_template=template, max_position_embeddings=2048)
    with LiveServer(tiny_engine(path, max_model_len=2048, num_blocks=2048)) as s:
        assert s.state.renderer.supports_tools == (request.param == "native")
        yield s


def valid_calls(message) -> list[tuple[str, dict]]:
    out = []
    for call in message.tool_calls:
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        assert call.id and call.type == "function"
        out.append((call.function.name, args))
    return out


def test_required_tool_choice_always_gives_valid_calls(srv):
    client = srv.openai()
    for seed in range(5):
        r = client.chat.completions.create(model=srv.state.model_name, messages=ASK, tools=TOOLS, tool_choice="required",
                                           temperature=1.0, seed=seed, max_tokens=300)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        assert len(valid_calls(choice.message)) >= 1


def test_named_tool_choice_calls_that_tool_once(srv):
    client = srv.openai()
    named = {"type": "function", "function": {"name": "add"}}
    r = client.chat.completions.create(model=srv.state.model_name, messages=ASK, tools=TOOLS, tool_choice=named, temperature=1.0, seed=3, max_tokens=200)
    calls = valid_calls(r.choices[0].message)
    assert [name for name, _ in calls] == ["add"]


def test_streamed_forced_call_equals_the_whole_one(srv):
    client = srv.openai()
    kw = dict(model=srv.state.model_name, messages=ASK, tools=TOOLS, tool_choice="required", temperature=1.0, seed=11, max_tokens=300)
    whole = client.chat.completions.create(**kw).choices[0]
    streamed, reasons = {}, []
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            for tc in ch.delta.tool_calls or []:
                entry = streamed.setdefault(tc.index, {"name": "", "arguments": ""})
                entry["name"] += tc.function.name or ""
                entry["arguments"] += tc.function.arguments or ""
            if ch.finish_reason:
                reasons.append(ch.finish_reason)
    assert reasons == ["tool_calls"]
    assert [(e["name"], json.loads(e["arguments"])) for _, e in sorted(streamed.items())] == valid_calls(whole.message)


def test_auto_calls_are_parsed_from_the_text(srv):
    client = srv.openai()
    kw = dict(model=srv.state.model_name, messages=ASK, tools=TOOLS, temperature=0.0, max_tokens=200,
              extra_body={"structured_outputs": {"regex": r"It is sunny\. " + HERMES_CALL}})
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert msg.content == "It is sunny."
    assert valid_calls(msg) == [("get_weather", {"city": "Paris", "unit": "c"})]
    text, calls = "", {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            text += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                calls[tc.index] = (tc.function.name, json.loads(tc.function.arguments))
    assert text == "It is sunny."
    assert list(calls.values()) == [("get_weather", {"city": "Paris", "unit": "c"})]


def test_tool_none_hides_the_tools_and_parses_nothing(srv):
    client = srv.openai()
    r = client.chat.completions.create(model=srv.state.model_name, messages=ASK, tools=TOOLS, tool_choice="none", temperature=0.0, max_tokens=200,
                                       extra_body={"structured_outputs": {"regex": HERMES_CALL}})
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content.startswith("<tool_call>")
    with_tools = client.chat.completions.create(model=srv.state.model_name, messages=ASK, tools=TOOLS, max_tokens=1)
    without = client.chat.completions.create(model=srv.state.model_name, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=1)
    assert without.usage.prompt_tokens < with_tools.usage.prompt_tokens


def test_a_tool_round_trip_renders_the_call_and_result_and_hits_the_cache(srv):
    client = srv.openai()
    name = srv.state.model_name
    first = client.chat.completions.create(model=name, messages=ASK, tools=TOOLS, tool_choice="required", temperature=1.0, seed=5, max_tokens=300)
    msg = first.choices[0].message
    call = msg.tool_calls[0]
    convo = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in msg.tool_calls]},
        *({"role": "tool", "tool_call_id": c.id, "content": json.dumps({"ok": True, "for": c.function.name})} for c in msg.tool_calls),
    ]
    second = client.chat.completions.create(model=name, messages=convo, tools=TOOLS, temperature=0.0, max_tokens=4)
    with srv.http() as h:
        rendered = h.post("/tokenize", json={"messages": convo, "tools": TOOLS}).json()["prompt"]
    arguments = json.loads(call.function.arguments)
    # the call as the template writes it: the name, then the arguments as JSON
    assert f'"name": "{call.function.name}", "arguments": {json.dumps(arguments, ensure_ascii=False)}' in rendered
    assert '{"ok": true, "for": "%s"}' % call.function.name in rendered
    assert "<tool_response>" in rendered  # the result in the model's (or shoal's) format
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens // 2
