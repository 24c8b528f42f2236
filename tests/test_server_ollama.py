"""Ollama's API with the real clients: the official `ollama` Python client and LangChain's `ChatOllama`, on tiny
random-weight models whose chat template renders tools. Chat (whole and streamed), generate (templated, raw,
with a system prompt and a context), list and show, `format` as a JSON schema, a tool call and its round trip
(certain under the schema), thinking, the final line's fields and timings against the engine's own record, bad
input on every route in Ollama's error format with the server going on, and `--ollama-port` on a real second
port with the API key checked there."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import jsonschema
import ollama
import pytest

from server_utils import LiveServer, tiny_engine
from shoal.server import ServerSettings
from tiny_models import TOOLS_TEMPLATE, make_tiny_model

ROOT = Path(__file__).resolve().parents[1]
NAME = "tiny"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}}]
# A reply that is one call in llama3_json's format: the schema makes the random model's call certain.
CALL = {"type": "object", "properties": {"name": {"const": "get_weather"}, "parameters": WEATHER},
        "required": ["name", "parameters"], "additionalProperties": False}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SAMPLED = {"temperature": 1.0, "seed": 7}
FINAL_FIELDS = {"model", "created_at", "done", "done_reason", "total_duration", "load_duration", "prompt_eval_count",
                "prompt_eval_duration", "eval_count", "eval_duration"}
DURATIONS = ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("ollama"), chat_template=TOOLS_TEMPLATE, max_position_embeddings=2048)


@pytest.fixture(scope="module")
def srv(model_path):
    settings = ServerSettings(log_requests=False, served_model_name=NAME, tool_call_parser="llama3_json")
    with LiveServer(tiny_engine(model_path, max_model_len=1024, num_blocks=1024), settings) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv):
    return ollama.Client(host=srv.url)


def newest_record(srv, before: int) -> dict:
    """The engine's own record of the request that just finished (GET /stats' recent requests, newest first)."""
    with srv.http() as h:
        def count():
            return len(h.get("/stats").json()["recent_requests"])
        srv.wait_until(lambda: count() > before, what="the engine's record of the request")
        return h.get("/stats").json()["recent_requests"][0]


def records(srv) -> int:
    with srv.http() as h:
        return len(h.get("/stats").json()["recent_requests"])


def check_final(final: dict, record: dict) -> None:
    assert FINAL_FIELDS <= set(final), sorted(FINAL_FIELDS - set(final))
    assert final["done"] is True and final["done_reason"] in ("stop", "length")
    assert final["prompt_eval_count"] == record["prompt_tokens"]
    assert final["eval_count"] == record["generated_tokens"]
    for d in DURATIONS:
        assert isinstance(final[d], int) and not isinstance(final[d], bool) and final[d] > 0, (d, final[d])
    assert final["total_duration"] >= final["prompt_eval_duration"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z", final["created_at"])


# ---------------------------------------------------------------- chat


def test_chat_whole_and_streamed_say_the_same(srv, client):
    whole = client.chat(model=NAME, messages=ASK, options={**SAMPLED, "num_predict": 12})
    assert whole.message.role == "assistant" and whole.done and whole.model == NAME
    assert 0 < whole.eval_count <= 12
    assert (whole.done_reason == "length") == (whole.eval_count == 12)
    chunks = list(client.chat(model=NAME, messages=ASK, options={**SAMPLED, "num_predict": 12}, stream=True))
    assert len(chunks) >= 2 and all(not c.done for c in chunks[:-1]) and chunks[-1].done
    assert "".join(c.message.content for c in chunks) == whole.message.content
    assert (chunks[-1].eval_count, chunks[-1].prompt_eval_count, chunks[-1].done_reason) == (
        whole.eval_count, whole.prompt_eval_count, whole.done_reason)


def test_the_final_line_has_ollamas_fields_and_the_engines_counts(srv):
    for path, body in (("/api/chat", {"messages": ASK}), ("/api/generate", {"prompt": "Once upon a time"})):
        before = records(srv)
        with srv.http() as h, h.stream("POST", path, json={"model": NAME, **body, "options": {**SAMPLED, "num_predict": 9}}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
            lines = [json.loads(x) for x in r.iter_lines() if x]
        final = lines[-1]
        check_final(final, newest_record(srv, before))
        assert all(x["done"] is False for x in lines[:-1])
        before = records(srv)
        with srv.http() as h:
            whole = h.post(path, json={"model": NAME, **body, "stream": False, "options": {**SAMPLED, "num_predict": 9}}).json()
        check_final(whole, newest_record(srv, before))
        text = "message" if path == "/api/chat" else "response"
        assert (whole[text]["content"] if text == "message" else whole[text]) == "".join(
            x[text]["content"] if text == "message" else x[text] for x in lines)


def test_options_reach_the_sampler(srv, client):
    kw = dict(model=NAME, messages=ASK)
    a = client.chat(**kw, options={"temperature": 1.0, "seed": 3, "num_predict": 10})
    b = client.chat(**kw, options={"temperature": 1.0, "seed": 3, "num_predict": 10, "top_k": 50, "top_p": 0.9, "repeat_penalty": 1.1})
    again = client.chat(**kw, options={"temperature": 1.0, "seed": 3, "num_predict": 10})
    assert a.message.content == again.message.content  # the seed is honoured
    greedy = client.chat(**kw, options={"temperature": 0, "num_predict": 10})
    assert greedy.message.content == client.chat(**kw, options={"temperature": 0, "num_predict": 10, "seed": 99}).message.content
    assert b.eval_count <= 10
    # stop cuts the text where the string starts
    text = client.chat(**kw, options={"temperature": 0, "num_predict": 12}).message.content
    if len(text) > 4:
        stop = text[len(text) // 2: len(text) // 2 + 2]
        cut = client.chat(**kw, options={"temperature": 0, "num_predict": 12, "stop": [stop]})
        assert cut.message.content == text[: text.index(stop)] and cut.done_reason == "stop"
    # num_ctx below the served context bounds prompt and reply together; above it, the served context applies
    short = client.chat(**kw, options={"temperature": 1.0, "seed": 1, "num_ctx": a.prompt_eval_count + 3})
    assert short.eval_count <= 3 and short.done_reason == "length"
    assert client.chat(**kw, options={"temperature": 1.0, "seed": 3, "num_predict": 10, "num_ctx": 1 << 20}).message.content == a.message.content


def test_format_holds_the_reply_to_a_json_schema(srv, client):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
              "additionalProperties": False}
    r = client.chat(model=NAME, messages=ASK, format=schema, options={**SAMPLED, "num_predict": 100})
    jsonschema.validate(json.loads(r.message.content), schema)
    g = client.generate(model=NAME, prompt="A number:", format=schema, options={**SAMPLED, "num_predict": 100})
    jsonschema.validate(json.loads(g.response), schema)
    anything = client.chat(model=NAME, messages=ASK, format="json", options={**SAMPLED, "num_predict": 50})
    assert anything.message.content.lstrip().startswith("{")  # an object (random weights may not finish one in 50 tokens)
    if anything.done_reason == "stop":
        assert isinstance(json.loads(anything.message.content), dict)


def test_a_tool_call_and_its_round_trip(srv, client):
    first = client.chat(model=NAME, messages=ASK, tools=TOOLS, format=CALL, options={**SAMPLED, "num_predict": 200})
    (call,) = first.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(dict(call.function.arguments), WEATHER)
    assert first.message.content == ""
    streamed = [c for c in client.chat(model=NAME, messages=ASK, tools=TOOLS, format=CALL, options={**SAMPLED, "num_predict": 200},
                                       stream=True) if c.message.tool_calls]
    assert [(c.function.name, dict(c.function.arguments)) for s in streamed for c in s.message.tool_calls] == [
        ("get_weather", dict(call.function.arguments))]
    result = json.dumps({"temperature": 21})
    convo = ASK + [first.message, {"role": "tool", "content": result, "tool_name": "get_weather"}]
    assert client.chat(model=NAME, messages=convo, tools=TOOLS, options={**SAMPLED, "num_predict": 4}).done
    # The client sends its own copy of the tools (it drops schema keywords it has no field for): the same turns over
    # HTTP with the tools as given, to compare with what the OpenAI adapter renders.
    with srv.http() as h:
        second = h.post("/api/chat", json={"model": NAME, "stream": False, "tools": TOOLS, "options": {"num_predict": 1}, "messages": [
            *ASK, first.message.model_dump(exclude_none=True), {"role": "tool", "content": result, "tool_name": "get_weather"}]}).json()
    # The conversation rendered as the OpenAI adapter renders the same turns: the call and its result are in the prompt.
    openai_turns = ASK + [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1_0", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps(dict(call.function.arguments))}}]},
        {"role": "tool", "tool_call_id": "call_1_0", "content": result}]
    with srv.http() as h:
        tok = h.post("/tokenize", json={"model": NAME, "messages": openai_turns, "tools": TOOLS}).json()
    assert second["prompt_eval_count"] == tok["count"] and "<tool_response>" in tok["prompt"]


def test_langchains_chat_ollama_calls_a_bound_tool(srv):
    from langchain_core.tools import tool
    from langchain_ollama import ChatOllama

    @tool
    def get_weather(city: str, unit: str) -> str:
        """Weather in a city."""
        return f"21 {unit} in {city}"

    llm = ChatOllama(model=NAME, base_url=srv.url, temperature=1.0, seed=7, num_predict=200, format=CALL)
    reply = llm.bind_tools([get_weather]).invoke("What is the weather in Paris?")
    (call,) = reply.tool_calls
    assert call["name"] == "get_weather"
    jsonschema.validate(call["args"], WEATHER)
    assert reply.usage_metadata["output_tokens"] > 0
    plain = ChatOllama(model=NAME, base_url=srv.url, temperature=0, num_predict=6).invoke("Hello")
    assert isinstance(plain.content, str) and plain.response_metadata["done_reason"] in ("stop", "length")


def test_logprobs_per_generated_token(srv, client):
    r = client.chat(model=NAME, messages=ASK, logprobs=True, top_logprobs=2, options={**SAMPLED, "num_predict": 5})
    assert len(r.logprobs) == r.eval_count and all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in r.logprobs)
    assert "".join(e.token for e in r.logprobs) == r.message.content
    streamed = list(client.chat(model=NAME, messages=ASK, logprobs=True, top_logprobs=2, options={**SAMPLED, "num_predict": 5},
                                stream=True))
    assert [e.token for c in streamed for e in (c.logprobs or [])] == [e.token for e in r.logprobs]


# ---------------------------------------------------------------- generate


def test_generate_templated_raw_system_and_context(srv, client):
    templated = client.generate(model=NAME, prompt="Hello", options={**SAMPLED, "num_predict": 6})
    raw = client.generate(model=NAME, prompt="Hello", raw=True, options={**SAMPLED, "num_predict": 6})
    with srv.http() as h:
        plain_ids = h.post("/tokenize", json={"model": NAME, "prompt": "Hello"}).json()["count"]
        chat_ids = h.post("/tokenize", json={"model": NAME, "messages": [{"role": "user", "content": "Hello"}]}).json()["count"]
        with_system = h.post("/tokenize", json={"model": NAME, "messages": [{"role": "system", "content": "Be terse."},
                                                                              {"role": "user", "content": "Hello"}]}).json()["count"]
    assert raw.prompt_eval_count == plain_ids and templated.prompt_eval_count == chat_ids
    system = client.generate(model=NAME, prompt="Hello", system="Be terse.", options={**SAMPLED, "num_predict": 6})
    assert system.prompt_eval_count == with_system
    # context: the last answer's tokens carried into the next prompt, as Ollama's older clients do
    assert list(templated.context)[: templated.prompt_eval_count] and len(templated.context) == templated.prompt_eval_count + templated.eval_count
    follow = client.generate(model=NAME, prompt="More", raw=True, context=templated.context, options={**SAMPLED, "num_predict": 2})
    with srv.http() as h:
        more = h.post("/tokenize", json={"model": NAME, "prompt": "More"}).json()["count"]
    assert follow.prompt_eval_count == len(templated.context) + more


GO_TEMPLATE = "{{- if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end -}}\n<|im_start|>user\n{{ .Prompt }}<|im_end|>\n"


def test_a_go_template_renders_as_go_would():
    """gotemplate.py against what Go's text/template gives for the same templates (worked by hand from its rules:
    a false `if` writes nothing, `{{-`/`-}}` drop the white space beside them, a missing field is empty)."""
    from shoal.server.ollama import gotemplate

    assert gotemplate.render(GO_TEMPLATE, {"System": "", "Prompt": "hi"}) == "<|im_start|>user\nhi<|im_end|>\n"
    assert gotemplate.render(GO_TEMPLATE, {"System": "Be terse.", "Prompt": "hi"}) == (
        "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n")
    assert gotemplate.render("{{ if .A }}a{{ else if .B }}b{{ else }}c{{ end }}|{{/* note */}}{{ .Missing }}.", {"B": "1"}) == "b|."
    assert gotemplate.render("x  {{- .P -}}  y", {"P": "p"}) == "xpy"
    for bad in ("{{ range .Messages }}{{ end }}", "{{ $x := 1 }}", "{{ else }}", "{{ end }}", "{{ if .A }}", "{{ json .P }}"):
        with pytest.raises(ValueError, match="^template: "):
            gotemplate.render(bad, {})


def test_generate_runs_its_own_go_template(srv, client):
    """A generate request's `template` over its system and prompt: the same prompt as the rendered text sent raw."""
    rendered = "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n"
    templated = client.generate(model=NAME, prompt="Hello", system="Be terse.", template=GO_TEMPLATE, options={**SAMPLED, "num_predict": 6})
    raw = client.generate(model=NAME, prompt=rendered, raw=True, options={**SAMPLED, "num_predict": 6})
    assert templated.prompt_eval_count == raw.prompt_eval_count and templated.response == raw.response
    ignored = client.generate(model=NAME, prompt=rendered, raw=True, template="{{ range .X }}{{ end }}", options={**SAMPLED, "num_predict": 6})
    assert ignored.response == raw.response  # raw: no template is run, as Ollama's rule says


def test_suffix_fills_in_the_middle_with_the_models_tokens(tmp_path):
    """A code model's fill-in-the-middle tokens (Qwen2.5-Coder's here) around the prompt and the suffix, as Ollama's
    template for it writes them; no chat template."""
    from transformers import AutoTokenizer

    path = make_tiny_model("qwen2", tmp_path / "coder", vocab_size=416)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.add_tokens(["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"], special_tokens=True) == 3
    tokenizer.save_pretrained(path)
    with LiveServer(tiny_engine(path, max_model_len=256), ServerSettings(log_requests=False, served_model_name=NAME)) as s:
        client = ollama.Client(host=s.url)
        r = client.generate(model=NAME, prompt="def add(a, b):", suffix="    return c", options={**SAMPLED, "num_predict": 5})
        with s.http() as h:
            fim = h.post("/tokenize", json={"model": NAME, "prompt": "<|fim_prefix|>def add(a, b):<|fim_suffix|>    return c<|fim_middle|>"}).json()
        assert r.prompt_eval_count == fim["count"] and r.context[: fim["count"]] == fim["tokens"]
        assert {tokenizer.convert_tokens_to_ids(t) for t in ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")} <= set(fim["tokens"])
        assert r.eval_count > 0


def test_an_empty_request_loads_the_model(srv, client):
    r = client.generate(model=NAME)
    assert r.done and r.done_reason == "load" and r.response == ""
    with srv.http() as h:
        c = h.post("/api/chat", json={"model": NAME, "messages": [], "stream": False}).json()
        assert c["done_reason"] == "load" and c["message"]["content"] == ""
        tagged = h.post("/api/chat", json={"model": NAME + ":latest", "messages": ASK, "stream": False, "options": {"num_predict": 2}})
        assert tagged.status_code == 200 and tagged.json()["model"] == NAME + ":latest"


def test_keep_alive_loads_and_unloads(model_path):
    from server_utils import tiny_engine_config

    with LiveServer(tiny_engine_config(model_path, max_model_len=256), ServerSettings(log_requests=False, served_model_name=NAME)) as s:
        client = ollama.Client(host=s.url)
        m = s.state.models.models[NAME]
        gone = client.generate(model=NAME, keep_alive=0)
        assert gone.done_reason == "unload"
        s.wait_until(lambda: m.status == "unloaded", what="the unload")
        with s.http() as h:
            assert h.get("/api/ps").json()["models"] == []
        assert client.generate(model=NAME, keep_alive=0).done_reason == "unload" and m.status == "unloaded"  # not loaded to unload
        assert client.chat(model=NAME, messages=[], keep_alive="1h").done_reason == "load" and m.loaded
        with s.http() as h:
            (ps,) = h.get("/api/ps").json()["models"]
        assert ps["name"] == NAME and ps["expires_at"] > time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(time.time() + 3000))
        r = client.chat(model=NAME, messages=ASK, keep_alive=0, options={"num_predict": 2})
        assert r.done
        s.wait_until(lambda: m.status == "unloaded", what="the unload after the answer")


# ---------------------------------------------------------------- models


def test_list_show_version_and_ps(srv, client, model_path):
    (m,) = client.list().models
    assert m.model == NAME and m.size > 0 and m.details.family == "llama" and m.details.format == "safetensors"
    shown = client.show(NAME)
    assert shown.details.family == "llama" and shown.details.parameter_size
    n = shown.modelinfo["general.parameter_count"]
    assert n > 0 and n == sum(p.numel() for p in __import__("safetensors.torch", fromlist=["load_file"]).load_file(
        str(next(model_path.glob("*.safetensors")))).values())
    assert shown.modelinfo["llama.context_length"] == 1024
    assert shown.template == TOOLS_TEMPLATE
    assert shown.capabilities == ["completion", "tools"]  # no vision, no thinking parser, no embedding
    with srv.http() as h:
        v = h.get("/api/version").json()
        assert re.fullmatch(r"\d+\.\d+\.\d+", v["version"])
        ps = h.get("/api/ps").json()["models"]
        assert [p["name"] for p in ps] == [NAME]


def test_a_ggufs_details_come_from_its_header(default_gguf_path):
    """/api/show's family, parameter count and quantization for a GGUF: its metadata and tensor index, no weights read."""
    import gguf

    from shoal.server.ollama.catalog import _checkpoint, parameter_size

    stat = default_gguf_path.stat()
    info = _checkpoint(str(default_gguf_path), stat.st_size, stat.st_mtime_ns)
    reader = gguf.GGUFReader(default_gguf_path)
    assert info == {"format": "gguf", "family": "llama", "parameters": sum(int(t.n_elements) for t in reader.tensors),
                    "quantization": default_gguf_path.stem.rsplit(".", 1)[1]}  # SmolLM2-135M-Instruct.Q4_1.gguf
    assert parameter_size(info["parameters"]) == "134.5M" and parameter_size(1_700_000_000) == "1.7B" and parameter_size(8e9) == "8B"


def test_images_reach_a_vision_model(tmp_path):
    """A base64 image on a user message (and on generate) goes before its text, as the OpenAI adapter places the
    same image part: the same prompt, its tokens then taken from the prefix cache."""
    import base64
    import io

    from PIL import Image

    from test_vision import picture
    from tiny_models import make_tiny_vl_model

    buf = io.BytesIO()
    picture(150, 100, 21).save(buf, format="PNG")
    b64 = base64.b64encode(buf.getvalue()).decode()
    path = make_tiny_vl_model("qwen2_vl", tmp_path / "m")
    engine = tiny_engine(path, attention="invariant", max_model_len=256, num_blocks=128, block_size=4)
    with LiveServer(engine, ServerSettings(log_requests=False, served_model_name=NAME)) as s:
        client = ollama.Client(host=s.url)
        r = client.chat(model=NAME, messages=[{"role": "user", "content": "What is this?", "images": [b64]}],
                        options={"temperature": 0, "num_predict": 4})
        same = s.openai().chat.completions.create(model=NAME, temperature=0, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64}"}}, {"type": "text", "text": "What is this?"}]}])
        assert r.prompt_eval_count == same.usage.prompt_tokens and r.message.content == same.choices[0].message.content
        assert same.usage.prompt_tokens_details.cached_tokens >= same.usage.prompt_tokens - 4
        g = client.generate(model=NAME, prompt="What is this?", images=[b64], options={"temperature": 0, "num_predict": 4})
        assert g.prompt_eval_count == r.prompt_eval_count and g.response == r.message.content
        assert "vision" in client.show(NAME).capabilities
        with s.http() as h:
            bad = h.post("/api/chat", json={"model": NAME, "messages": [{"role": "user", "content": "x", "images": ["bm90IGFuIGltYWdl"]}]})
        assert bad.status_code == 400 and "messages[0].images[0]" in bad.json()["error"]


def test_thinking_goes_into_its_own_field(tmp_path_factory, model_path):
    settings = ServerSettings(log_requests=False, served_model_name=NAME, reasoning_parser="deepseek_r1")  # replies start inside the reasoning
    with LiveServer(tiny_engine(model_path, max_model_len=512), settings) as s:
        client = ollama.Client(host=s.url)
        r = client.chat(model=NAME, messages=ASK, think=True, options={**SAMPLED, "num_predict": 8})
        assert r.message.thinking and r.message.content == ""  # random weights never close the reasoning
        streamed = list(client.chat(model=NAME, messages=ASK, think=True, options={**SAMPLED, "num_predict": 8}, stream=True))
        assert "".join(c.message.thinking or "" for c in streamed) == r.message.thinking
        g = client.generate(model=NAME, prompt="Hi", think=True, options={**SAMPLED, "num_predict": 8})
        assert g.thinking and g.response == ""
        assert "thinking" in client.show(NAME).capabilities


def test_embed_gives_the_engines_vectors(model_path):
    """A model served with --embeddings: Ollama's vectors are /v1/embeddings' own, each input's alone or in a batch."""
    with LiveServer(tiny_engine(model_path, max_model_len=256, embeddings=True), ServerSettings(log_requests=False, served_model_name=NAME)) as s:
        client = ollama.Client(host=s.url)
        texts = ["The sky is blue.", "Paris is in France.", "x"]
        batch = client.embed(model=NAME, input=texts)
        assert len(batch.embeddings) == 3 and batch.prompt_eval_count > 3 and batch.total_duration > 0 and batch.load_duration > 0
        with s.http() as h:
            ref = h.post("/v1/embeddings", json={"model": NAME, "input": texts}).json()["data"]
            bad = h.post("/api/embed", json={"model": NAME, "input": ["ok", ""]})
        assert [list(v) for v in batch.embeddings] == [d["embedding"] for d in ref]
        for text, vector in zip(texts, batch.embeddings):
            assert list(client.embed(model=NAME, input=text).embeddings[0]) == pytest.approx(list(vector), abs=1e-5)
        assert list(client.embeddings(model=NAME, prompt=texts[0]).embedding) == pytest.approx(list(batch.embeddings[0]), abs=1e-5)
        assert "embedding" in client.show(NAME).capabilities
        assert bad.status_code == 400 and "input[1]" in bad.json()["error"]


def test_embed_cuts_an_input_to_the_context_unless_truncate_is_false(model_path):
    """Ollama's `truncate` (default true): an input over the context is cut, its end dropped, and embeds as its first
    max_model_len tokens do; with false it is a 400 naming the input."""
    with LiveServer(tiny_engine(model_path, max_model_len=256, embeddings=True), ServerSettings(log_requests=False, served_model_name=NAME)) as s:
        long = " ".join(f"word{i}" for i in range(400))
        ids = s.engine.tokenizer.encode(long)
        assert len(ids) > 256
        with s.http() as h:
            cut = h.post("/api/embed", json={"model": NAME, "input": long})
            want = h.post("/v1/embeddings", json={"model": NAME, "input": ids[:256]}).json()["data"][0]["embedding"]
            refused = h.post("/api/embed", json={"model": NAME, "input": ["short", long], "truncate": False})
            older = h.post("/api/embeddings", json={"model": NAME, "prompt": long})
        assert cut.status_code == 200 and cut.json()["prompt_eval_count"] == 256 and cut.json()["embeddings"][0] == want
        assert refused.status_code == 400 and "input[1]" in refused.json()["error"]
        assert older.status_code == 200 and older.json()["embedding"] == want


def test_langchain_ollama_embeddings(model_path):
    """LangChain's OllamaEmbeddings, unmodified: documents in one batch and a query, the vectors /v1/embeddings gives."""
    from langchain_ollama import OllamaEmbeddings

    with LiveServer(tiny_engine(model_path, max_model_len=256, embeddings=True), ServerSettings(log_requests=False, served_model_name=NAME)) as s:
        texts = ["a tide pool", "a shoal of fish"]
        embedder = OllamaEmbeddings(model=NAME, base_url=s.url)
        documents, query = embedder.embed_documents(texts), embedder.embed_query("a shoal of fish")
        with s.http() as h:
            ref = [d["embedding"] for d in h.post("/v1/embeddings", json={"model": NAME, "input": texts}).json()["data"]]
    assert len(documents) == 2 and all(len(v) == len(ref[0]) > 0 for v in documents)
    assert documents == ref  # the same batch, so the same vectors
    assert query == pytest.approx(ref[1], abs=1e-5)  # alone: within float64 pooling's rounding of the batch's


# ---------------------------------------------------------------- bad input


def _chat(**kw) -> dict:
    return {"model": NAME, "messages": ASK, "stream": False, "options": {"num_predict": 2}, **kw}


def _gen(**kw) -> dict:
    return {"model": NAME, "prompt": "Hi", "stream": False, "options": {"num_predict": 2}, **kw}


BAD = [
    ("/api/chat", _chat(messages="hello"), 400, "messages"),
    ("/api/chat", _chat(messages=[{"role": "robot", "content": "x"}]), 400, "messages[0].role"),
    ("/api/chat", _chat(messages=[{"role": "user", "content": 5}]), 400, "messages[0].content"),
    ("/api/chat", _chat(temperature=0.5), 400, "temperature"),  # an option given at the top level
    ("/api/chat", _chat(options={"num_predicts": 4}), 400, "options.num_predicts"),
    ("/api/chat", _chat(options={"temperature": "hot"}), 400, "options.temperature"),
    ("/api/chat", _chat(options={"num_predict": True}), 400, "options.num_predict"),
    ("/api/chat", _chat(options={"num_predict": 0}), 400, "num_predict"),
    ("/api/chat", _chat(stream="no"), 400, "stream"),
    ("/api/chat", _chat(options={"num_ctx": 3}), 400, "num_ctx"),
    ("/api/chat", _chat(messages=[{"role": "user", "content": "x", "name": "bob"}]), 400, "messages[0].name"),
    ("/api/chat", _chat(top_logprobs=50), 400, "top_logprobs"),
    ("/api/chat", _chat(options={"mirostat": 2}), 400, "options.mirostat"),
    ("/api/chat", _chat(model="no-such-model"), 404, "no-such-model"),
    ("/api/chat", _chat(model=""), 400, "model"),
    ("/api/chat", _chat(format="yaml"), 400, "format"),
    ("/api/chat", _chat(format={"type": "nonsense"}), 400, "format"),
    ("/api/chat", _chat(think=True), 400, "thinking"),
    ("/api/chat", _chat(keep_alive="soon"), 400, "keep_alive"),
    ("/api/chat", _chat(tools=[{"type": "function", "function": {"name": ""}}]), 400, "tools[0].function.name"),
    ("/api/chat", _chat(messages=[{"role": "user", "content": "x", "images": ["AAAA"]}]), 400, "images"),
    ("/api/chat", _chat(messages=[{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}]),
     400, "arguments"),
    ("/api/generate", _gen(template="{{ range .Messages }}{{ .Content }}{{ end }}"), 400, "template"),
    ("/api/generate", _gen(template="{{ .Prompt | upper }}"), 400, "template"),
    ("/api/generate", _gen(template="{{ if .System }}x"), 400, "template"),
    ("/api/generate", _gen(suffix="end"), 400, "fill-in-the-middle tokens"),  # this tokenizer has none
    ("/api/generate", _gen(suffix="end", raw=True), 400, "suffix"),
    ("/api/generate", _gen(prompt=["a"]), 400, "prompt"),
    ("/api/generate", _gen(context=[1, "x"]), 400, "context"),
    ("/api/generate", _gen(raw=True, context=[10 ** 9]), 400, "vocabulary"),
    ("/api/generate", _gen(model="gone:latest"), 404, "gone"),
    ("/api/generate", _gen(images=["AAAA"], raw=True), 400, "raw"),
    ("/api/generate", _gen(unknown_field=1), 400, "unknown_field"),
    ("/api/show", {"model": "no-such-model"}, 404, "no-such-model"),
    ("/api/show", {}, 400, "model"),
    ("/api/show", {"model": NAME, "extra": 1}, 400, "extra"),
    ("/api/embed", {"model": NAME, "input": "hello"}, 400, "does not support embeddings"),  # a generation model
    ("/api/embed", {"model": NAME, "input": 5}, 400, "input"),
    ("/api/embed", {"model": NAME, "input": "x", "truncate": "yes"}, 400, "truncate"),
    ("/api/embed", {"model": NAME, "input": "x", "encoding_format": "float"}, 400, "encoding_format"),
    ("/api/embed", {"model": "no-such-model", "input": "x"}, 404, "no-such-model"),
    ("/api/embeddings", {"model": NAME, "prompt": "hello"}, 400, "does not support embeddings"),
    ("/api/embeddings", {"model": NAME, "prompt": ["hello"]}, 400, "prompt"),
    ("/api/pull", {"model": "llama3"}, 400, "downloads"),
    ("/api/push", {"model": "llama3"}, 400, "downloads"),
    ("/api/create", {"model": "x", "from": NAME}, 400, "downloads"),
    ("/api/copy", {"source": NAME, "destination": "y"}, 400, "downloads"),
    ("/api/nope", {}, 404, "/api/nope"),
]


@pytest.mark.parametrize("path, body, status, words", BAD, ids=[f"{p}-{i}" for i, (p, *_) in enumerate(BAD)])
def test_bad_input_gets_ollamas_error_and_the_server_goes_on(srv, path, body, status, words):
    with srv.http() as h:
        r = h.post(path, json=body)
        assert r.status_code == status, r.text
        err = r.json()
        assert set(err) == {"error"} and isinstance(err["error"], str) and words in err["error"], err
        ok = h.post("/api/chat", json=_chat())
        assert ok.status_code == 200 and ok.json()["done"] is True


def test_bad_bodies_and_methods_everywhere(srv):
    with srv.http() as h:
        for path in ("/api/chat", "/api/generate", "/api/show", "/api/embed"):
            r = h.post(path, content=b"{not json", headers={"content-type": "application/json"})
            assert r.status_code == 400 and "not valid JSON" in r.json()["error"]
            r = h.post(path, json=[1, 2])
            assert r.status_code == 400 and set(r.json()) == {"error"}
        r = h.request("DELETE", "/api/delete", json={"model": NAME})
        assert r.status_code == 400 and "downloads" in r.json()["error"]
        assert h.get("/api/chat").status_code == 405
        assert h.get("/api/tags").status_code == 200


def test_the_client_raises_on_errors(srv, client):
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="no-such-model", messages=ASK)
    assert e.value.status_code == 404 and "no-such-model" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.pull("llama3")
    assert e.value.status_code == 400 and "downloads" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.embed(model=NAME, input="hello")
    assert e.value.status_code == 400 and "does not support embeddings" in e.value.error


def test_the_metrics_count_ollamas_requests_by_protocol(srv, client):
    client.chat(model=NAME, messages=ASK, options={"num_predict": 2})
    client.generate(model=NAME, prompt="Hi", options={"num_predict": 2})
    with srv.http() as h:
        text = h.get("/metrics").text
    for protocol in ("ollama_chat", "ollama_generate"):
        assert re.search(rf'shoal:e2e_request_latency_seconds_count\{{[^}}]*protocol="{protocol}"[^}}]*\}} [1-9]', text), protocol


# ---------------------------------------------------------------- the docs' snippets


def guide_snippets() -> list[str]:
    text = (ROOT / "docs" / "guides" / "ollama.md").read_text()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_the_guides_snippets_run(srv, capsys):
    """Every Python snippet of docs/guides/ollama.md, as written but for the port, against a live server."""
    snippets = guide_snippets()
    assert len(snippets) >= 2
    for code in snippets:
        code = code.replace("127.0.0.1:11434", srv.url.removeprefix("http://")).replace('"smollm2"', f'"{NAME}"')
        exec(compile(code, "ollama.md", "exec"), {})
    assert capsys.readouterr().out.strip()


# ---------------------------------------------------------------- the second port


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_listens_on_the_ollama_port_too_with_the_same_checks(model_path, tmp_path):
    port, ollama_port = free_port(), free_port()
    cmd = [str(Path(sys.executable).parent / "shoal"), "serve", "--model", str(model_path), "--port", str(port), "--ollama-port",
           str(ollama_port), "--api-key", "k3y", "--served-model-name", NAME, "--max-model-len", "256", "--dtype", "float32"]
    log = tmp_path / "serve.log"
    server = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the server did not become ready"
            try:
                if httpx.get(f"http://127.0.0.1:{ollama_port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        url = f"http://127.0.0.1:{ollama_port}"
        assert httpx.get(url + "/").text == "Ollama is running"  # Ollama's greeting, which apps probe, with no key
        assert httpx.get(f"http://127.0.0.1:{port}/").status_code == 307  # the main port's root is the dashboard's
        refused = httpx.get(url + "/api/tags")
        assert refused.status_code == 401 and set(refused.json()) == {"error"}
        foreign = httpx.get(url + "/api/tags", headers={"Authorization": "Bearer k3y", "Origin": "https://evil.example"})
        assert foreign.status_code == 403
        client = ollama.Client(host=url, headers={"Authorization": "Bearer k3y"})
        assert [m.model for m in client.list().models] == [NAME]
        r = client.chat(model=NAME, messages=ASK, options={"num_predict": 3})
        assert r.done and r.eval_count > 0
        # the same app on the main port
        assert httpx.get(f"http://127.0.0.1:{port}/api/version", headers={"Authorization": "Bearer k3y"}).status_code == 200
    finally:
        server.terminate()
        server.wait(timeout=30)
