"""Tool-call parsers on real formats of each family: several calls, empty arguments, malformed
JSON (kept as text), text around calls, and every reply fed split at every character boundary
(and in three pieces) giving the text and calls of the reply fed whole."""

from __future__ import annotations

import json

import pytest

from shoal.server.chat.pipeline import DeltaPipeline
from shoal.server.chat.tools import Parsed, forced_calls_schema, make_parser, manual_tool_messages, parser_for_template


def calls(p: Parsed) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in p.calls]


CASES = [
    # (parser, reply, text, calls)
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "Let me check.", [("get_weather", {"city": "Paris"})]),
    ("hermes", '<tool_call>{"name": "now", "arguments": {}}</tool_call>\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>',
     "", [("now", {}), ("add", {"a": 1, "b": 2})]),
    ("hermes", 'Sure <tool_call>{"name": "f", "arguments": {"x": 1</tool_call> done',  # malformed: kept as text
     'Sure<tool_call>{"name": "f", "arguments": {"x": 1</tool_call> done', []),
    ("hermes", "No tools needed: 2 < 3 and <tool is a word.", "No tools needed: 2 < 3 and <tool is a word.", []),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"q": "a</b>"}}</tool_call>\n\nDone.', "Done.", [("f", {"q": "a</b>"})]),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": 2}}', "", [("f", {"x": 2})]),  # the end tag was a stop string
    ("hermes", "Plain answer.  ", "Plain answer.  ", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo"}}', "", [("get_weather", {"city": "Oslo"})]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"n": 1}}', "", [("a", {}), ("b", {"n": 1})]),
    ("llama3_json", "The answer is 4.", "The answer is 4.", []),
    ("llama3_json", '{"not": "a call"}', '{"not": "a call"}', []),
    ("mistral", 'Calling.[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}, {"name": "now", "arguments": {}}]',
     "Calling.", [("add", {"a": 1}), ("now", {})]),
    ("mistral", '[TOOL_CALLS]add[ARGS]{"a": 5}[TOOL_CALLS]now[ARGS]{}', "", [("add", {"a": 5}), ("now", {})]),
    ("mistral", "[TOOL_CALLS]garbage", "[TOOL_CALLS]garbage", []),
    ("pythonic", '[get_weather(city="Paris", days=3), now()]', "", [("get_weather", {"city": "Paris", "days": 3}), ("now", {})]),
    ("pythonic", '```tool_code\nsearch(query="llm servers")\n```', "", [("search", {"query": "llm servers"})]),
    ("pythonic", "[1, 2, 3] is a list.", "[1, 2, 3] is a list.", []),
    ("json", '[{"name": "add", "arguments": {"a": 1, "b": 2}}]', "", [("add", {"a": 1, "b": 2})]),
]


@pytest.mark.parametrize("name, reply, text, want", CASES)
def test_whole_reply(name, reply, text, want):
    got = make_parser(name).parse(reply)
    assert got.text == text
    assert calls(got) == want


@pytest.mark.parametrize("name, reply, text, want", CASES)
def test_every_split_gives_the_whole_replys_text_and_calls(name, reply, text, want):
    for i in range(len(reply) + 1):
        for j in range(i, len(reply) + 1, max(1, len(reply) // 7)):
            p = make_parser(name)
            out = p.feed(reply[:i])
            out += p.feed(reply[i:j])
            out += p.feed(reply[j:])
            out += p.finish()
            assert (out.text, calls(out)) == (text, want), (i, j)


def test_a_call_right_after_think_with_the_tag_split_across_deltas():
    reply = '<think>I should call it.</think>\n<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    for cut in range(len(reply) + 1):
        pipeline = DeltaPipeline("qwen3", "hermes")
        first, last = pipeline.feed(reply[:cut]), pipeline.feed(reply[cut:], final=True)
        assert first.reasoning + last.reasoning == "I should call it."
        assert first.text + last.text == ""
        assert calls(Parsed(calls=first.calls + last.calls)) == [("f", {})], cut
    # a call inside the reasoning is thought, not called
    thought = DeltaPipeline("qwen3", "hermes").feed('<think><tool_call>{"name": "g", "arguments": {}}</tool_call></think>Done.', final=True)
    assert thought.calls == [] and thought.text == "Done." and "<tool_call>" in thought.reasoning


def test_the_parser_follows_the_template():
    assert parser_for_template("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert parser_for_template("{{- '<|python_tag|>' + tool_call.name }}") == "llama3_json"
    assert parser_for_template("<tool_call>\n{{ tool_call | tojson }}\n</tool_call>") == "hermes"
    assert parser_for_template(None) == "hermes"
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        make_parser("nope")


def test_manual_tools_go_into_the_system_prompt_and_calls_into_the_text():
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "1+2?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]},
        {"role": "tool", "content": "3", "tool_call_id": "c1"},
    ]
    out = manual_tool_messages(msgs, tools)
    assert out[0]["content"].startswith("Be brief.\n\n") and '"name": "add"' in out[0]["content"]
    assert make_parser("hermes").parse(out[2]["content"]).calls[0].name == "add"  # the history is in the format the parser reads
    assert out[3]["content"] == "<tool_response>\n3\n</tool_response>"
    assert "tool_calls" not in out[2] and msgs[2]["tool_calls"]  # the caller's messages are untouched


def test_forced_schema_lists_calls_to_the_allowed_tools():
    import jsonschema

    tools = [{"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}},
             {"name": "now", "parameters": None}]
    schema = forced_calls_schema(tools)
    jsonschema.validate([{"name": "add", "arguments": {"a": 1}}, {"name": "now", "arguments": {}}], schema)
    named = forced_calls_schema(tools, name="now")
    jsonschema.validate([{"name": "now", "arguments": {}}], named)
    for bad in ([], [{"name": "add", "arguments": {"a": 1}}], [{"name": "now", "arguments": {}}] * 2):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, named)
