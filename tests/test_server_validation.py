"""Hostile and careless inputs: fields shoal does not implement, numbers that are not numbers,
bounds on the work of one request, and prompts too long to tokenize.
"""

import threading

import pytest

from server_utils import LiveServer, tiny_engine
from shoal.server import ServerSettings
from test_server_errors import CHAT, chat, check, complete

MAX_LEN = 64
MAX_SEQS = 6


@pytest.fixture(scope="module")
def srv(tiny_llama_path):
    settings = ServerSettings(log_requests=False, max_sequences_per_request=MAX_SEQS)
    with LiveServer(tiny_engine(tiny_llama_path, max_model_len=MAX_LEN), settings) as s:
        yield s


@pytest.fixture(scope="module")
def h(srv):
    with srv.http() as client:
        yield client


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"max_tokens": True}, "max_tokens"),
        ({"n": True}, "n"),
        ({"seed": False}, "seed"),
        ({"top_k": 1.0}, "top_k"),
        ({"temperature": True}, "temperature"),
        ({"stop_token_ids": [True]}, "stop_token_ids[0]"),
        ({"logprobs": True}, "logprobs"),
        ({"prompt": [True]}, "prompt"),
        ({"prompt": [[1, False]]}, "prompt"),
    ],
)
def test_json_booleans_are_not_numbers(h, fields, param):
    check(complete(h, **fields), 400, "invalid_request_error", param, param=param)


def test_detokenize_refuses_booleans_as_token_ids(h):
    check(h.post("/detokenize", json={"tokens": [1, False]}), 400, "invalid_request_error", "tokens", param="tokens[1]")


def test_seed_is_an_int64(h):
    check(chat(h, seed=1 << 63), 400, "invalid_request_error", "seed", param="seed")
    check(chat(h, seed=-(1 << 63) - 1), 400, "invalid_request_error", "seed", param="seed")
    for seed in ((1 << 63) - 1, -(1 << 63)):
        assert chat(h, seed=seed, temperature=1.0, n=2).status_code == 200


def test_stop_token_ids_inside_the_vocabulary(h, srv):
    vocab = srv.engine.vocab_size
    check(chat(h, stop_token_ids=[3, vocab + 7]), 400, "invalid_request_error", str(vocab + 7), "vocabulary", param="stop_token_ids")
    assert chat(h, stop_token_ids=[vocab - 1]).status_code == 200


def test_response_format_types(h):
    assert chat(h, response_format={"type": "text"}).status_code == 200
    for garbage in ("garbage", {"type": "yaml"}, 3):
        check(chat(h, response_format=garbage), 400, "invalid_request_error", "invalid response_format", param="response_format")
        check(complete(h, response_format=garbage), 400, "invalid_request_error", "invalid response_format", param="response_format")


def test_tool_choice_and_tools_are_checked(h):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}]
    assert chat(h, tools=tools, tool_choice="none").status_code == 200  # hidden from the model
    check(chat(h, tool_choice="required"), 400, "invalid_request_error", "required", "needs tools", param="tool_choice")
    missing = {"type": "function", "function": {"name": "launch"}}
    check(chat(h, tools=tools, tool_choice=missing), 400, "invalid_request_error", "'launch'", "not among the tools", param="tool_choice")
    check(chat(h, tool_choice="sometimes"), 400, "invalid_request_error", "invalid tool_choice", param="tool_choice")
    check(chat(h, tools=[{"type": "function"}]), 400, "invalid_request_error", "tools[0]", param="tools[0]")
    check(chat(h, tools=[{"type": "function", "function": {"name": ""}}]), 400, "invalid_request_error", "name", param="tools[0].function.name")
    bad_params = [{"type": "function", "function": {"name": "f", "parameters": "object"}}]
    check(chat(h, tools=bad_params), 400, "invalid_request_error", "JSON schema", param="tools[0].function.parameters")
    forced_and_format = {"tools": tools, "tool_choice": "required", "response_format": {"type": "json_object"}}
    check(chat(h, **forced_and_format), 400, "invalid_request_error", "forces a tool call", param="tool_choice")


def test_stream_options_need_stream(h, srv):
    check(chat(h, stream_options={"include_usage": True}), 400, "invalid_request_error", "stream", param="stream_options")
    check(complete(h, stream=False, stream_options={"include_usage": True}), 400, "invalid_request_error", "stream", param="stream_options")
    # The SDK sends stream_options only when given, so a plain call is unaffected.
    r = srv.openai().chat.completions.create(model=srv.state.model_name, messages=CHAT, max_tokens=2)
    assert r.usage.completion_tokens <= 2


def test_prompts_times_n_is_bounded(h):
    err = check(complete(h, prompt=["hi"] * 4, n=2), 400, "invalid_request_error", "8 sequences", "4 prompts", "n 2",
                str(MAX_SEQS), "--max-sequences-per-request", param="n")
    assert err["code"] is None
    check(chat(h, n=MAX_SEQS + 1), 400, "invalid_request_error", str(MAX_SEQS + 1), "--max-sequences-per-request", param="n")
    r = complete(h, prompt=["hi"] * 3, n=2, max_tokens=1)
    assert r.status_code == 200 and len(r.json()["choices"]) == MAX_SEQS


def test_max_tokens_beyond_the_context_is_clipped_and_reported(h):
    r = complete(h, prompt=[5, 6, 7, 8], max_tokens=43_000_000, ignore_eos=True)
    assert r.status_code == 200, r.text
    room = MAX_LEN - 4
    assert r.headers["x-shoal-max-tokens-clipped"] == str(room)
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == room
    # Several prompts: the smallest max_tokens any of them runs with.
    r = complete(h, prompt=[[5] * 10, [5] * 20], max_tokens=1000, ignore_eos=True)
    assert r.headers["x-shoal-max-tokens-clipped"] == str(MAX_LEN - 20)
    r = chat(h, max_tokens=1000, stream=True, ignore_eos=True)
    assert int(r.headers["x-shoal-max-tokens-clipped"]) < MAX_LEN
    assert "x-shoal-max-tokens-clipped" not in complete(h, max_tokens=3).headers
    check(complete(h, prompt=[5] * 60, max_tokens=100, min_tokens=10), 400, "invalid_request_error", "min_tokens", "room for 4",
          param="min_tokens")


def test_anthropic_messages_report_a_clipped_max_tokens_too(srv):
    import anthropic

    client = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0)
    msgs = [{"role": "user", "content": "hi"}]
    for stream in (False, True):
        raw = client.messages.with_raw_response.create(model=srv.state.model_name, max_tokens=43_000_000, messages=msgs,
                                                      stream=stream, extra_body={"ignore_eos": True}, timeout=60)
        assert 0 < int(raw.headers["x-shoal-max-tokens-clipped"]) < MAX_LEN
        if not stream:
            assert raw.parse().stop_reason == "max_tokens"
    raw = client.messages.with_raw_response.create(model=srv.state.model_name, max_tokens=3, messages=msgs)
    assert "x-shoal-max-tokens-clipped" not in raw.headers


def test_logprobs_0_gives_the_sampled_tokens_entry(h, srv):
    body = complete(h, logprobs=0, temperature=0, max_tokens=3, ignore_eos=True).json()
    lp = body["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 3
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert top == {token: pytest.approx(logprob)}
        assert logprob <= 0


def test_echo_with_max_tokens_0_returns_the_prompt_without_the_engine(h, srv, monkeypatch):
    def no_engine(*a, **kw):
        raise AssertionError("the engine was asked to generate")

    monkeypatch.setattr(srv.state.engine, "generate", no_engine)
    body = complete(h, prompt=["Once upon a time", [5, 6, 7]], echo=True, max_tokens=0, n=2).json()
    texts = [c["text"] for c in body["choices"]]
    decoded = srv.engine.tokenizer.decode([5, 6, 7])
    assert texts == ["Once upon a time", "Once upon a time", decoded, decoded]
    assert {c["finish_reason"] for c in body["choices"]} == {"length"}
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] > 3
    stream = complete(h, echo=True, max_tokens=0, stream=True, stream_options={"include_usage": True})
    assert stream.status_code == 200 and '"text":"hi"' in stream.text and stream.text.endswith("data: [DONE]\n\n")
    check(complete(h, max_tokens=0), 400, "invalid_request_error", "max_tokens 0", "echo", param="max_tokens")


def test_a_text_far_over_the_context_is_refused_before_tokenizing(h, srv, monkeypatch):
    def must_not_run(*a, **kw):
        raise AssertionError("tokenized a prompt that cannot fit")

    monkeypatch.setattr(srv.engine.tokenizer, "encode", must_not_run)
    monkeypatch.setattr(srv.state.renderer, "render", must_not_run)
    huge = "a" * 400_000  # every character would need to share a token with 100 others
    check(complete(h, prompt=huge), 400, "invalid_request_error", "400000 characters", f"context of {MAX_LEN} tokens", param="prompt")
    check(complete(h, prompt=["hi", huge]), 400, "invalid_request_error", f"context of {MAX_LEN} tokens", param="prompt")
    check(chat(h, messages=[{"role": "user", "content": huge}]), 400, "invalid_request_error", f"context of {MAX_LEN} tokens", param="messages")
    check(h.post("/tokenize", json={"prompt": huge}), 400, "invalid_request_error", f"context of {MAX_LEN} tokens", param="prompt")


def test_health_answers_while_a_prompt_is_being_tokenized(h, srv, monkeypatch):
    """Tokenizing runs off the event loop: one that cannot finish until /health has answered does not stall
    /health. An order of events, not a time: the encode waits for the answer (up to a minute, as a deadlock guard)."""
    real = srv.engine.tokenizer.encode
    started, answered, done = threading.Event(), threading.Event(), threading.Event()

    def slow_encode(*a, **kw):
        started.set()
        answered.wait(60)
        done.set()
        return real(*a, **kw)

    monkeypatch.setattr(srv.engine.tokenizer, "encode", slow_encode)
    result = {}

    def slow_request():
        with srv.http() as other:
            result["r"] = complete(other, prompt="slow prompt")

    worker = threading.Thread(target=slow_request)
    worker.start()
    assert started.wait(60)
    assert h.get("/health").status_code == 200
    assert not done.is_set()  # answered while the encode still waited: it never held the event loop
    answered.set()
    worker.join(60)
    assert result["r"].status_code == 200


def test_models_names_the_file_not_its_absolute_path(h, srv, tiny_llama_path):
    (model,) = h.get("/v1/models").json()["data"]
    assert model["root"] == tiny_llama_path.name
    assert "/" not in model["root"]
