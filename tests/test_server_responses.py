"""OpenAI's Responses API (/v1/responses) with the real clients: the official `openai` SDK (create, stream, parse,
a tool round trip, previous_response_id across turns through the prefix cache, an image) and the OpenAI Agents
SDK running an agent with a function tool, on tiny random-weight models. Also the stored responses' bounded
store (exact, as plain Python), the conversion of items and the event stream's order as pure functions, bad input
in OpenAI's format, and the guide's snippets run as written."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from server_utils import Gate, LiveServer, tiny_engine
from shoal.server import ServerSettings
from shoal.server.chat.pipeline import Delta
from shoal.server.chat.tools import ToolCall
from shoal.server.errors import APIError
from shoal.server.responses.create import _Output
from shoal.server.responses.items import conversation, normalize_input, reasoning_options, tool_use
from shoal.server.responses.store import ResponseStore, record
from tiny_models import TOOLS_TEMPLATE, make_tiny_model

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "guides" / "responses.md"
MAX_BODY = 256 * 1024
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER, "strict": True}]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    path = make_tiny_model("llama", tmp_path_factory.mktemp("responses"), chat_template=TOOLS_TEMPLATE, max_position_embeddings=2048)
    settings = ServerSettings(log_requests=False, max_request_bytes=MAX_BODY)
    with LiveServer(tiny_engine(path, max_model_len=2048, num_blocks=2048), settings) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv):
    return srv.openai()


def model(srv) -> str:
    return srv.state.model_name


def sampled(**kw) -> dict:
    return {"temperature": 1.0, "extra_body": {"seed": 7, **kw}}


# ---------------------------------------------------------------- the openai SDK


def test_create_answers_with_a_message_and_usage_as_chat_counts_it(srv, client):
    r = client.responses.create(model=model(srv), input="What is the weather in Paris?", max_output_tokens=16, **sampled())
    assert r.id.startswith("resp_") and r.object == "response" and r.status in ("completed", "incomplete")
    assert [o.type for o in r.output] == ["message"] and r.output[0].role == "assistant"
    assert r.output_text == r.output[0].content[0].text
    u = r.usage
    assert 0 < u.output_tokens <= 16 and u.total_tokens == u.input_tokens + u.output_tokens
    assert u.output_tokens_details.reasoning_tokens == 0
    # the same conversation through chat completions renders to the same prompt
    chat = client.chat.completions.create(model=model(srv), messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                                          max_tokens=1)
    assert chat.usage.prompt_tokens == u.input_tokens
    # instructions are the system turn, as chat's system message
    ri = client.responses.create(model=model(srv), instructions="Be terse.", input="hi", max_output_tokens=1)
    ci = client.chat.completions.create(model=model(srv), max_tokens=1, messages=[{"role": "system", "content": "Be terse."},
                                                                                  {"role": "user", "content": "hi"}])
    assert ri.usage.input_tokens == ci.usage.prompt_tokens and ri.instructions == "Be terse."


def test_max_output_tokens_makes_an_incomplete_response(srv, client):
    r = client.responses.create(model=model(srv), input="Count to ten", max_output_tokens=8, metadata={"run": "a"}, user="u1",
                                **sampled(ignore_eos=True))
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 8 and r.output[0].status == "incomplete"
    assert r.metadata == {"run": "a"} and r.user == "u1" and r.max_output_tokens == 8


def stop_inside(client, srv) -> tuple[str, str]:
    """A stop string from the middle of a sampled reply, so a request with it ends (completed) with text before it."""
    long = client.responses.create(model=model(srv), input="Tell me a story", max_output_tokens=12, **sampled(ignore_eos=True))
    text = long.output_text
    stop = next(text[i : i + 2] for i in range(len(text) // 2, len(text) - 1) if text[i : i + 2].strip())
    return text, stop


def test_stream_sends_openais_events_in_order_and_the_text_create_gives(srv, client):
    text, stop = stop_inside(client, srv)
    kw = dict(model=model(srv), input="Tell me a story", max_output_tokens=12, **sampled(ignore_eos=True, stop=[stop]))
    whole = client.responses.create(**kw)
    assert whole.status == "completed" and whole.output_text == text[: text.index(stop)]
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
                     *["response.output_text.delta"] * deltas, "response.output_text.done", "response.content_part.done",
                     "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    done = events[-4]
    assert done.text == whole.output_text and events[-2].item.content[0].text == whole.output_text
    assert final.output_text == whole.output_text and final.usage.output_tokens == whole.usage.output_tokens
    assert final.id == events[0].response.id
    # at max_output_tokens the stream ends with response.incomplete, and its reason
    with client.responses.stream(model=model(srv), input="Tell me a story", max_output_tokens=5, **sampled(ignore_eos=True)) as stream:
        events = list(stream)
    assert events[-1].type == "response.incomplete" and events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-2].type == "response.output_item.done" and events[-2].item.status == "incomplete"


class Reading(BaseModel):
    n: int = Field(ge=0, le=9)


def test_parse_gives_the_pydantic_model(srv, client):
    r = client.responses.parse(model=model(srv), input="Pick a digit.", text_format=Reading, max_output_tokens=100, **sampled())
    assert isinstance(r.output_parsed, Reading) and 0 <= r.output_parsed.n <= 9
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
              "additionalProperties": False}
    j = client.responses.create(model=model(srv), input="Pick a digit.", max_output_tokens=100,
                                text={"format": {"type": "json_schema", "name": "digit", "schema": schema, "strict": True}}, **sampled())
    jsonschema.validate(json.loads(j.output_text), schema)
    assert j.text.format.type == "json_schema"


def test_a_function_tool_round_trip(srv, client):
    first = client.responses.create(model=model(srv), input="What is the weather in Paris?", tools=TOOLS, tool_choice="required",
                                    max_output_tokens=300, **sampled(seed=4))
    calls = [o for o in first.output if o.type == "function_call"]
    assert calls and first.status == "completed"
    for c in calls:
        assert c.name == "get_weather" and c.call_id.startswith("call_") and c.id.startswith("fc_")
        jsonschema.validate(json.loads(c.arguments), WEATHER)
    results = [{"type": "function_call_output", "call_id": c.call_id, "output": json.dumps({"temp": 21})} for c in calls]
    # the whole conversation sent back, as a client without a store does
    full = client.responses.create(model=model(srv), input=[{"role": "user", "content": "What is the weather in Paris?"},
                                                            *[o.model_dump(exclude_none=True) for o in first.output], *results],
                                   tools=TOOLS, max_output_tokens=4, store=False, **sampled())
    assert full.status in ("completed", "incomplete") and full.output[-1].type in ("message", "function_call")
    # the same continuation from the stored response: the same prompt, most of it from the prefix cache
    cont = client.responses.create(model=model(srv), previous_response_id=first.id, input=results, tools=TOOLS, max_output_tokens=4,
                                   **sampled())
    assert cont.usage.input_tokens == full.usage.input_tokens
    assert cont.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    # a named function: exactly one call to it; streamed, its arguments come as function_call_arguments events
    kw = dict(model=model(srv), input="Weather?", tools=TOOLS, tool_choice={"type": "function", "name": "get_weather"},
              max_output_tokens=300, **sampled(seed=5))
    named = client.responses.create(**kw)
    assert [o.type for o in named.output] == ["function_call"]
    with client.responses.stream(**kw) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added", "response.function_call_arguments.delta",
                     "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert events[4].arguments == named.output[0].arguments and events[4].name == "get_weather"
    # a forced call is the reply, so text.format (an agent's output type) has nothing to hold in that turn
    formatted = client.responses.create(**kw, text={"format": {"type": "json_object"}})
    assert [o.type for o in formatted.output] == ["function_call"] and formatted.output[0].arguments == named.output[0].arguments


def test_previous_response_id_across_three_turns_reuses_the_cache(srv, client):
    turns, previous = [], None
    for text in ("Hello there", "Tell me more", "And then?"):
        r = client.responses.create(model=model(srv), input=text, previous_response_id=previous, max_output_tokens=12,
                                    temperature=0)
        turns.append(r)
        previous = r.id
        assert r.previous_response_id == (turns[-2].id if len(turns) > 1 else None)
    u = [t.usage for t in turns]
    cached = [x.input_tokens_details.cached_tokens for x in u]
    # each turn's prompt holds the previous prompt and reply: their KV is in the prefix cache
    assert cached[0] < cached[1] < cached[2]
    assert cached[1] >= u[0].input_tokens and cached[2] >= u[1].input_tokens
    assert u[1].input_tokens > u[0].input_tokens + u[0].output_tokens - 2 and u[2].input_tokens > u[1].input_tokens
    # the third turn, sent whole, renders to the same prompt as its continuation
    items = [{"role": "user", "content": "Hello there"}, turns[0].output[0].model_dump(exclude_none=True),
             {"role": "user", "content": "Tell me more"}, turns[1].output[0].model_dump(exclude_none=True),
             {"role": "user", "content": "And then?"}]
    whole = client.responses.create(model=model(srv), input=items, max_output_tokens=12, temperature=0, store=False)
    assert whole.usage.input_tokens == u[2].input_tokens and whole.output_text == turns[2].output_text
    # instructions are not carried into a continued turn (OpenAI's rule): the new request's own apply
    with_sys = client.responses.create(model=model(srv), instructions="Be terse.", input="x", previous_response_id=turns[0].id,
                                       max_output_tokens=1)
    assert with_sys.instructions == "Be terse."


def test_truncation_auto_drops_the_oldest_turns_until_the_prompt_fits(srv, client):
    long = "the quick brown fox jumps over the lazy dog " * 60
    n = client.chat.completions.create(model=model(srv), messages=[{"role": "user", "content": long}], max_tokens=1).usage.prompt_tokens
    turns = [{"role": "user", "content": f"{i} {long}"} for i in range(2048 // n + 2)]  # more than the context holds
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model(srv), input=turns, max_output_tokens=2)
    assert e.value.body["param"] == "input"
    r = client.responses.create(model=model(srv), input=turns, truncation="auto", max_output_tokens=2)
    assert r.truncation == "auto" and r.status in ("completed", "incomplete")
    # dropped from the front, a turn at a time, only as many as needed: what is left is as many of the newest turns as fit
    fits = []
    for k in range(1, len(turns) + 1):
        try:
            fits.append(client.responses.create(model=model(srv), input=turns[-k:], max_output_tokens=2, store=False).usage.input_tokens)
        except openai.BadRequestError:
            break
    assert 1 <= len(fits) < len(turns) and r.usage.input_tokens == fits[-1]
    assert len(client.responses.input_items.list(r.id, limit=100).data) == len(turns)  # the input as given


def test_stored_responses_get_list_and_delete(srv, client):
    r = client.responses.create(model=model(srv), input=[{"role": "user", "content": [{"type": "input_text", "text": "one"}]},
                                                         {"role": "user", "content": "two"}], max_output_tokens=3, **sampled())
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.usage == r.usage
    items = client.responses.input_items.list(r.id)
    assert [i.content[0].text for i in items.data] == ["two", "one"]  # newest first, as OpenAI's
    asc = client.responses.input_items.list(r.id, order="asc", limit=1)
    assert [i.content[0].text for i in asc.data] == ["one"] and asc.has_more
    after = client.responses.input_items.list(r.id, order="asc", after=asc.data[0].id)
    assert [i.content[0].text for i in after.data] == ["two"] and not after.has_more
    with srv.http() as h:
        for query, param in (("after=msg_nope", "after"), ("limit=0", "limit"), ("order=up", "order")):
            bad = h.get(f"/v1/responses/{r.id}/input_items?{query}")
            assert bad.status_code == 400 and bad.json()["error"]["param"] == param, query
    with srv.http() as h:
        deleted = h.delete(f"/v1/responses/{r.id}")
        assert deleted.status_code == 200 and deleted.json() == {"id": r.id, "object": "response", "deleted": True}
        for method, path in (("GET", f"/v1/responses/{r.id}"), ("DELETE", f"/v1/responses/{r.id}"),
                             ("GET", f"/v1/responses/{r.id}/input_items")):
            gone = h.request(method, path)
            assert gone.status_code == 404 and gone.json()["error"]["type"] == "not_found_error", (method, path)
            assert r.id in gone.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=model(srv), input="again", previous_response_id=r.id)
    assert e.value.body["param"] == "previous_response_id"
    unstored = client.responses.create(model=model(srv), input="x", store=False, max_output_tokens=1)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_the_servers_store_stays_bounded_under_churn(srv, client):
    real = srv.app.state.responses
    small = srv.app.state.responses = ResponseStore(max_responses=3, max_bytes=1 << 20)
    try:
        ids = [client.responses.create(model=model(srv), input=f"turn {i}", max_output_tokens=2, **sampled()).id for i in range(6)]
        assert small.ids() == ids[3:] and len(small) == 3 and small.evicted == 3
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(ids[0])
        client.responses.retrieve(ids[3])  # read: now the most recent, so the next one evicts ids[4]
        newest = client.responses.create(model=model(srv), input="last", max_output_tokens=2, **sampled()).id
        assert small.ids() == [ids[5], ids[3], newest]
        # a byte bound that holds about two: bytes, not the count, evict
        one = small.get(newest).nbytes
        tight = srv.app.state.responses = ResponseStore(max_responses=100, max_bytes=one * 2 + one // 2)
        for i in range(5):
            client.responses.create(model=model(srv), input=f"turn {i}", max_output_tokens=2, **sampled())
            assert tight.nbytes <= tight.max_bytes
        assert 1 <= len(tight) <= 2 and tight.evicted >= 3
    finally:
        srv.app.state.responses = real


def sse_events(text: str) -> list[dict]:
    """Each SSE event's data, checked against its `event:` line (OpenAI's framing: the name is the data's type)."""
    out = []
    for block in text.strip().split("\n\n"):
        name, data = block.split("\n", 1)
        assert name.startswith("event: ") and data.startswith("data: "), block
        event = json.loads(data.removeprefix("data: "))
        assert event["type"] == name.removeprefix("event: ")
        out.append(event)
    return out


def test_a_failure_mid_stream_ends_it_with_response_failed(srv):
    door = srv.state.engine
    real = door.generate

    async def failing(req, checked=False):
        from contextlib import aclosing

        async with aclosing(real(req, checked=checked)) as gen:
            async for out in gen:
                if out.outputs[0].text:
                    yield out
                    raise RuntimeError("the test's failure")
                yield out

    door.generate = failing
    try:
        with srv.http() as h:
            r = h.post("/v1/responses", json={"model": model(srv), "input": "hi", "stream": True, "max_output_tokens": 50,
                                              "temperature": 1.0, "seed": 3, "ignore_eos": True})
    finally:
        del door.generate
    events = sse_events(r.text)
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.failed"
    assert "response.completed" not in kinds and [e["sequence_number"] for e in events] == list(range(len(events)))
    assert kinds[2:-1] == ["response.output_item.added", "response.content_part.added", "response.output_text.delta",
                           "response.output_text.done", "response.content_part.done", "response.output_item.done"]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert "request id" in failed["error"]["message"] and "the test's failure" not in failed["error"]["message"]
    assert events[-2]["item"]["status"] == "incomplete"
    with srv.http() as h:  # not stored, and the server goes on
        assert h.get(f"/v1/responses/{failed['id']}").status_code == 404
        assert h.post("/v1/responses", json={"model": model(srv), "input": "hi", "max_output_tokens": 2}).status_code == 200


def test_a_streaming_client_that_leaves_is_aborted_and_nothing_is_stored(srv):
    e, stats = srv.engine, srv.engine.stats
    baseline_free, aborted = e.pool.num_free, stats.requests_aborted
    disconnects = srv.state.counters.client_disconnects
    body = {"model": model(srv), "input": "Tell me a long story.", "stream": True, "max_output_tokens": 400, "ignore_eos": True}
    with Gate(e, after_steps=2) as gate, srv.http() as h:
        with h.stream("POST", "/v1/responses", json=body) as r:
            lines = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(json.loads(line.removeprefix("data: ")))
                if len(lines) == 3:
                    break
        srv.wait_until(lambda: srv.state.counters.client_disconnects == disconnects + 1, what="the server to see the disconnect")
        gate.open()
        srv.wait_until(lambda: stats.requests_aborted == aborted + 1, what="the abort")
    srv.wait_until(lambda: e.pool.num_free == baseline_free and e.num_running == 0 and e.num_waiting == 0, what="the blocks to return")
    rid = lines[0]["response"]["id"]
    assert rid not in srv.app.state.responses
    with srv.http() as h:
        assert h.get(f"/v1/responses/{rid}").status_code == 404


def test_metrics_label_the_protocol(srv, client):
    client.responses.create(model=model(srv), input="hi", max_output_tokens=2, **sampled())
    with srv.http() as h:
        text = h.get("/metrics").text
    assert re.search(r'shoal:e2e_request_latency_seconds_count\{[^}]*protocol="openai_responses"[^}]*\} [1-9]', text)


@pytest.fixture(scope="module")
def thinking_srv(tmp_path_factory):
    path = make_tiny_model("llama", tmp_path_factory.mktemp("thinking"), max_position_embeddings=2048)
    settings = ServerSettings(log_requests=False, reasoning_parser="deepseek_r1")  # replies start inside the reasoning
    with LiveServer(tiny_engine(path, max_model_len=1024), settings) as s:
        yield s


def test_reasoning_is_its_own_item_and_effort_caps_it(thinking_srv):
    client = thinking_srv.openai()
    kw = dict(model=model(thinking_srv), input="Think first.", temperature=1.0, extra_body={"seed": 1, "ignore_eos": True})
    free = client.responses.create(max_output_tokens=24, reasoning={"effort": "high"}, **kw)
    assert [o.type for o in free.output] == ["reasoning"]  # random weights never close the reasoning themselves
    assert free.status == "incomplete" and free.output_text == ""
    thought = free.output[0].content[0].text
    assert thought and free.output[0].content[0].type == "reasoning_text"
    assert free.usage.output_tokens_details.reasoning_tokens == free.usage.output_tokens == 24  # all of it
    capped = client.responses.create(max_output_tokens=300, reasoning={"effort": "minimal"}, **kw)  # at most 256 thinking
    assert [o.type for o in capped.output] == ["reasoning", "message"]
    assert capped.output[0].content[0].text.startswith(thought) and capped.output_text
    assert 256 <= capped.usage.output_tokens_details.reasoning_tokens < capped.usage.output_tokens == 300  # and the end tag
    with client.responses.stream(max_output_tokens=24, reasoning={"effort": "high"}, **kw) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    n = kinds.count("response.reasoning_text.delta")
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
                     *["response.reasoning_text.delta"] * n, "response.reasoning_text.done", "response.content_part.done",
                     "response.output_item.done", "response.incomplete"]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought
    assert events[-1].response.usage.output_tokens_details.reasoning_tokens == 24
    # the reasoning goes back into the conversation with the reply it belongs to
    turn = client.responses.create(previous_response_id=free.id, max_output_tokens=2, **{**kw, "input": "Go on."})
    assert turn.usage.input_tokens_details.cached_tokens >= free.usage.input_tokens


# ---------------------------------------------------------------- bad input, in OpenAI's format


@pytest.mark.parametrize(
    "fields, status, param, words",
    [
        ({"input": 3}, 400, "input", ["input"]),
        ({"input": None}, 400, "input", ["input is required"]),
        ({"input": [{"type": "message", "role": "robot", "content": "hi"}]}, 400, "input[0].role", ["role"]),
        ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, 400, "input[0].type", ["web_search_call"]),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, 400, "input[0].content[0].type", ["input_file"]),
        ({"input": [{"type": "function_call_output", "call_id": "call_nope", "output": "x"}]}, 400, "input[0].call_id", ["call_nope"]),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, 400, "input[0].type", ["item_reference"]),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, 400, "input[0].call_id", ["call_id"]),
        ({"input": [{"role": "user", "content": 5}]}, 400, "input[0].content", ["content"]),
        # kinds that are not strings (JSON lists and objects are no dictionary keys)
        ({"input": [{"role": ["user"], "content": "x"}]}, 400, "input[0].role", ["role"]),
        ({"input": [{"role": "user", "content": [{"type": {"a": 1}}]}]}, 400, "input[0].content[0].type", ["not supported"]),
        ({"tools": [{"type": ["web_search"]}]}, 400, "tools[0].type", ["only function tools"]),
        ({"tools": TOOLS, "tool_choice": {"type": ["function"]}}, 400, "tool_choice", ["tool_choice"]),
        ({"reasoning": {"effort": ["low"]}}, 400, "reasoning.effort", ["string"]),
        ({"tools": [{"type": "web_search"}]}, 400, "tools[0].type", ["'web_search'", "built-in"]),
        ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, 400, "tools[0].type", ["'file_search'"]),
        ({"tools": [{"type": "computer_use_preview"}]}, 400, "tools[0].type", ["'computer_use_preview'"]),
        ({"tools": [{"type": "code_interpreter"}]}, 400, "tools[0].type", ["'code_interpreter'"]),
        ({"tools": [{"type": "image_generation"}]}, 400, "tools[0].type", ["'image_generation'"]),
        ({"tools": [{"type": "mcp", "server_label": "x"}]}, 400, "tools[0].type", ["'mcp'"]),
        ({"tools": [{"type": "function"}]}, 400, "tools[0].name", ["name"]),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "launch"}}, 400, "tool_choice.name", ["'launch'"]),
        ({"tool_choice": "required"}, 400, "tool_choice", ["no tools"]),
        ({"text": {"format": {"type": "yaml"}}}, 400, "text.format", ["json_schema"]),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": 5}}}, 400, "text.format.schema", ["schema"]),
        ({"reasoning": {"effort": "extreme"}}, 400, "reasoning.effort", ["minimal"]),
        ({"temperature": "hot"}, 400, "temperature", ["temperature"]),
        ({"temperature": 3}, 400, "temperature", ["temperature"]),
        ({"max_output_tokens": 0}, 400, "max_output_tokens", ["max_output_tokens"]),
        ({"truncation": "sometimes"}, 400, "truncation", ["truncation"]),
        ({"background": True}, 400, "background", ["background"]),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, 400, "metadata", ["16"]),
        ({"input": "word " * 20000}, 400, "input", ["context"]),
        ({"previous_response_id": "resp_nope"}, 404, "previous_response_id", ["resp_nope"]),
        ({"model": "no-such-model"}, 404, None, ["no-such-model"]),
    ],
)
def test_bad_input_is_a_4xx_in_openais_format_and_the_server_goes_on(srv, fields, status, param, words):
    body = {"model": model(srv), "input": "hi", "max_output_tokens": 2, **fields}
    with srv.http() as h:
        r = h.post("/v1/responses", json={k: v for k, v in body.items()})
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "code", "param"}
        assert err["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
        if param is not None:
            assert err["param"] == param, err
        for w in words:
            assert w in err["message"], err
        ok = h.post("/v1/responses", json={"model": model(srv), "input": "hi", "max_output_tokens": 2})
        assert ok.status_code == 200 and ok.json()["status"] in ("completed", "incomplete")


def test_an_oversized_body_is_a_413_in_openais_format(srv):
    with srv.http() as h:
        r = h.post("/v1/responses", json={"model": model(srv), "input": "x" * (MAX_BODY + 1)})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        assert h.post("/v1/responses", json={"model": model(srv), "input": "hi", "max_output_tokens": 2}).status_code == 200


# ---------------------------------------------------------------- the OpenAI Agents SDK


class Total(BaseModel):
    total: int = Field(ge=0, le=99)


def test_an_agent_calls_its_tool_and_answers_to_completion(srv):
    """The whole loop: a call to the tool (forced: a random-weight model calls none of its own accord), the tool's
    result sent back, and a final answer held to the agent's output type."""
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    calls: list[tuple[int, int]] = []

    @agents.function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        calls.append((a, b))
        return a + b

    def agent(**kw):
        client = AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        return agents.Agent(
            name="calculator", instructions="Use the add tool.", tools=[add],
            model=agents.OpenAIResponsesModel(model=model(srv), openai_client=client),
            # after the tool has run the SDK resets tool_choice, and the model answers in the output type's schema
            model_settings=agents.ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=300, temperature=1.0,
                                                extra_body={"seed": 1}), **kw)

    result = asyncio.run(agents.Runner.run(agent(output_type=Total), "What is 2 + 3?", max_turns=4))
    assert len(calls) == 1
    a, b = calls[0]
    assert isinstance(a, int) and isinstance(b, int)
    assert [type(i).__name__ for i in result.new_items] == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"]
    assert isinstance(result.final_output, Total) and 0 <= result.final_output.total <= 99
    first, second = result.raw_responses
    (call,) = [o for o in first.output if o.type == "function_call"]
    assert call.name == "add" and json.loads(call.arguments) == {"a": a, "b": b}
    # the SDK sends the whole conversation again: the first turn's prompt and call come from the prefix cache
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    # stop_on_first_tool: the tool's result is the run's answer
    calls.clear()
    stopped = asyncio.run(agents.Runner.run(agent(tool_use_behavior="stop_on_first_tool"), "What is 2 + 3?", max_turns=3))
    assert len(calls) == 1 and stopped.final_output == str(sum(calls[0]))


# ---------------------------------------------------------------- an image


@pytest.fixture(scope="module")
def vl_srv(tmp_path_factory):
    from tiny_models import make_tiny_vl_model

    path = make_tiny_vl_model("qwen2_vl", tmp_path_factory.mktemp("vl_responses"))
    engine = tiny_engine(path, attention="invariant", max_model_len=256, num_blocks=128, block_size=4)
    with LiveServer(engine, ServerSettings(log_requests=False)) as s:
        yield s


def test_an_input_image_reaches_the_model_as_chats_image_url_does(vl_srv):
    from test_server_vision import PNG, data_uri

    client = vl_srv.openai()
    url = data_uri(PNG)
    r = client.responses.create(model=vl_srv.state.model_name, temperature=0, max_output_tokens=6, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "What is this?"}, {"type": "input_image", "image_url": url}]}])
    chat = client.chat.completions.create(model=vl_srv.state.model_name, temperature=0, max_tokens=6, messages=[
        {"role": "user", "content": [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": url}}]}])
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.output_text == chat.choices[0].message.content
    # a continued turn renders the image again from the stored conversation: its tokens come from the prefix cache,
    # and the tower does not run again
    encoded = vl_srv.engine.runner.encoder.stats.images_encoded
    more = client.responses.create(model=vl_srv.state.model_name, temperature=0, max_output_tokens=2, previous_response_id=r.id,
                                   input="And now?")
    assert more.usage.input_tokens_details.cached_tokens >= r.usage.input_tokens
    assert vl_srv.engine.runner.encoder.stats.images_encoded == encoded
    text_only = client.responses.create(model=vl_srv.state.model_name, max_output_tokens=1, input="What is this?")
    assert r.usage.input_tokens > text_only.usage.input_tokens + 4  # the image's tokens are in the prompt
    with vl_srv.http() as h:
        bad = h.post("/v1/responses", json={"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA=="}]}]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "input[0].content[0]"
        nofile = h.post("/v1/responses", json={"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file_1"}]}]})
        assert nofile.status_code == 400 and nofile.json()["error"]["param"] == "input[0].content[0].file_id"


# ---------------------------------------------------------------- the store, exactly


def rec(n: int):
    """A record of a known size: its body's output holds n characters."""
    return record({"output": [{"text": "x" * n}]}, [], [])


def test_store_keeps_the_most_recent_within_its_count():
    s = ResponseStore(max_responses=2, max_bytes=10_000)
    for rid in ("a", "b", "c"):
        assert s.put(rid, rec(1))
    assert s.ids() == ["b", "c"] and s.evicted == 1 and "a" not in s
    assert s.get("b") is not None and s.ids() == ["c", "b"]  # read: most recent
    s.put("d", rec(1))
    assert s.ids() == ["b", "d"]
    assert s.get("zzz") is None and s.ids() == ["b", "d"]


def test_store_counts_bytes_and_evicts_least_recent_first():
    overhead = rec(0).nbytes  # the JSON around the text: rec(n) is overhead + n bytes
    assert rec(100).nbytes == overhead + 100
    size = overhead + 100
    s = ResponseStore(max_responses=100, max_bytes=3 * size)
    for rid in "abc":
        s.put(rid, rec(100))
    assert s.nbytes == 3 * size and len(s) == 3
    s.get("a")
    s.put("d", rec(100))  # one over: the least recently used (b) goes
    assert s.ids() == ["c", "a", "d"] and s.nbytes == 3 * size
    s.put("e", rec(2 * size - overhead))  # two records' worth: c and a go, and the bound is met exactly
    assert s.ids() == ["d", "e"] and s.nbytes == 3 * size == s.max_bytes
    assert not s.put("huge", rec(3 * size)) and s.ids() == ["d", "e"]  # larger than the bound alone: not kept
    assert s.delete("d") and not s.delete("d") and s.ids() == ["e"] and s.nbytes == 2 * size
    s.put("e", rec(1))  # replacing a record counts its new size only
    assert s.ids() == ["e"] and s.nbytes == overhead + 1


def test_store_under_churn_never_exceeds_its_bounds():
    s = ResponseStore(max_responses=7, max_bytes=5000)
    for i in range(500):
        s.put(f"r{i}", rec(i * 37 % 900))
        if i % 3 == 0:
            s.get(f"r{i - 2}")
        assert len(s) <= 7 and s.nbytes <= 5000
        assert s.nbytes == sum(s.get(r).nbytes for r in list(s.ids()))
    assert "r499" in s


def test_the_store_bounds_come_from_the_command_line():
    from shoal import cli
    from shoal.server import create_app

    v = cli.serve_values(cli.build_parser().parse_args(["serve", "--responses-store-max", "3", "--responses-store-bytes", "2MiB"]))
    store = create_app(None, cli.server_settings(v)).state.responses
    assert (store.max_responses, store.max_bytes) == (3, 2 << 20)
    default = create_app(None, ServerSettings()).state.responses
    assert (default.max_responses, default.max_bytes) == (1024, 64 << 20)
    with pytest.raises(ValueError, match="responses_store_max"):
        ServerSettings(responses_store_max=0)


def test_a_record_continues_with_its_context_and_output():
    r = record({"output": [{"type": "message", "role": "assistant", "content": []}]}, [{"id": "i"}], [{"id": "c"}, {"id": "i"}])
    assert r.conversation == [{"id": "c"}, {"id": "i"}, {"type": "message", "role": "assistant", "content": []}]


# ---------------------------------------------------------------- items -> the template's messages


def test_items_become_one_assistant_turn_per_reply_and_tool_turns():
    items = normalize_input([
        {"role": "developer", "content": "rules"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "let me look"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{\"x\": 1}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c2", "output": "two"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
    ])
    assert all(i["id"] for i in items) and items[2]["id"] == "rs_1"
    refs = []
    messages = conversation(items, "sys", refs)
    assert messages == [
        {"role": "system", "content": "sys"},
        {"role": "system", "content": "rules"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "let me look", "reasoning_content": "think", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
    ]
    assert refs == []
    with pytest.raises(APIError) as e:  # an output whose call came in an earlier response's items: index from the input's start
        conversation(normalize_input([{"type": "function_call_output", "call_id": "c9", "output": "x"}]), None, [], 0)
    assert e.value.param == "input[0].call_id"


def test_tools_and_effort_map_onto_chats():
    use = tool_use(TOOLS, "auto", None)
    assert use.mode == "auto" and use.tools[0]["function"]["name"] == "get_weather" and use.parallel
    assert tool_use(TOOLS, "none", None) is None
    named = tool_use(TOOLS, {"type": "function", "name": "get_weather"}, True)
    assert named.mode == "named" and named.name == "get_weather" and not named.parallel
    assert tool_use(TOOLS, "required", False).parallel is False

    class Served:
        class settings:  # noqa: N801
            reasoning_parser = "qwen3"

        class engine:  # noqa: N801
            class tokenizer:  # noqa: N801
                @staticmethod
                def encode(text, add_special_tokens=False):
                    return {"<think>": [5], "</think>": [6]}[text]

    assert reasoning_options(Served, None) == ({}, None)
    assert reasoning_options(Served, {"effort": "none"}) == ({"enable_thinking": False}, None)
    kwargs, budget = reasoning_options(Served, {"effort": "low"})
    assert kwargs == {"enable_thinking": True, "reasoning_effort": "low"}
    assert (budget.max_tokens, budget.end_ids, budget.start_ids) == (1024, (6,), (5,))
    assert reasoning_options(Served, {"effort": "high"})[1] is None  # no cap beyond max_output_tokens


def events_of(chunks: list[bytes]) -> list[dict]:
    return [json.loads(c.decode().split("data: ", 1)[1]) for c in chunks if c]


def test_reasoning_then_text_then_a_call_stream_as_three_items():
    out = _Output(streaming=True)
    chunks = out.feed(Delta(reasoning="hm"))
    chunks += out.feed(Delta(reasoning="m", text="Hi"))
    chunks += out.feed(Delta(calls=[ToolCall("f", "{}", id="call_1")]))
    chunks += out.finish("completed")
    events = events_of(chunks)
    assert [e["type"] for e in events] == [
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.done"] == [0, 1, 2]
    assert events[4]["text"] == "hmm" and events[10]["text"] == "Hi"
    assert [i["type"] for i in out.items] == ["reasoning", "message", "function_call"]
    assert out.items[0]["content"] == [{"type": "reasoning_text", "text": "hmm"}]
    assert out.items[2]["call_id"] == "call_1" and all(i["status"] == "completed" for i in out.items)
    empty = _Output(streaming=True)
    assert [e["type"] for e in events_of(empty.finish("incomplete"))] == [
        "response.output_item.added", "response.content_part.added", "response.output_text.done", "response.content_part.done",
        "response.output_item.done"]
    assert empty.items[0]["status"] == "incomplete" and empty.items[0]["content"][0]["text"] == ""


# ---------------------------------------------------------------- the guide's snippets


def guide_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S)


def test_the_guides_snippets_run_against_a_live_server(srv, tmp_path):
    blocks = guide_blocks()
    assert len(blocks) == 2  # the openai SDK, the Agents SDK
    for code in blocks:
        code = code.replace("http://127.0.0.1:8000", srv.url).replace('"smollm2"', repr(model(srv)))
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert run.returncode == 0, (code, run.stderr[-3000:])
        assert run.stdout.strip(), code
