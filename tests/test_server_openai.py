"""The OpenAI API end to end: a real server on a tiny model, driven by the official SDK."""

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from server_utils import LiveServer, tiny_engine

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = dict(temperature=0, max_tokens=12, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def srv(tiny_llama_path):
    with LiveServer(tiny_engine(tiny_llama_path, check_integrity=True)) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv):
    return srv.openai()


@pytest.fixture(scope="module")
def model(srv):
    return srv.state.model_name


def _joined_chat(stream):
    texts, finish, roles, usage = {}, {}, {}, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            if ch.delta.role:
                roles[ch.index] = ch.delta.role
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    return texts, finish, roles, usage


def test_models_list(client, srv, model):
    models = client.models.list().data
    assert [m.id for m in models] == [model]
    assert models[0].owned_by == "shoal"
    assert models[0].model_extra["max_model_len"] == srv.engine.max_model_len


def test_chat_non_streaming_and_streaming_agree(client, model):
    r = client.chat.completions.create(model=model, messages=CHAT, **GREEDY)
    assert r.object == "chat.completion"
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12
    assert r.usage.prompt_tokens_details.cached_tokens >= 0

    stream = client.chat.completions.create(model=model, messages=CHAT, stream=True, **GREEDY)
    texts, finish, roles, usage = _joined_chat(stream)
    assert texts == {0: choice.message.content}
    assert finish == {0: "length"} and roles == {0: "assistant"}
    assert usage is None  # not asked for


def test_streamed_chunks_are_role_first_then_content_then_finish_then_done(srv, model):
    body = {"model": model, "messages": CHAT, "stream": True, "max_tokens": 4, "ignore_eos": True, "temperature": 0,
            "stream_options": {"include_usage": True}}
    with srv.http() as h:
        lines = [ln for ln in h.post("/v1/chat/completions", json=body).text.split("\n\n") if ln]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(ln[len("data: "):]) for ln in lines[:-1]]
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [e["choices"][0]["finish_reason"] for e in events[1:-2]] == [None] * (len(events) - 3)
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 4
    assert len({e["id"] for e in events}) == 1


def test_chat_n2_streams_interleaved_choices_with_their_index(client, model):
    params = dict(model=model, messages=CHAT, n=2, temperature=1.0, seed=7, max_tokens=10, extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**params)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == 20
    texts, finish, roles, usage = _joined_chat(
        client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **params)
    )
    assert texts == {0: r.choices[0].message.content, 1: r.choices[1].message.content}
    assert finish == {0: "length", 1: "length"} and roles == {0: "assistant", 1: "assistant"}
    assert usage.completion_tokens == 20 and usage.prompt_tokens == r.usage.prompt_tokens


def test_seed_gives_the_same_text_streamed_and_not(client, model):
    params = dict(model=model, messages=CHAT, temperature=1.0, top_p=0.95, seed=1234, max_tokens=16, extra_body={"ignore_eos": True})
    once = client.chat.completions.create(**params).choices[0].message.content
    again = client.chat.completions.create(**params).choices[0].message.content
    texts, _, _, _ = _joined_chat(client.chat.completions.create(stream=True, **params))
    assert once == again == texts[0]
    c = client.completions.create(model=model, prompt="Once upon a time", temperature=1.0, seed=99, max_tokens=16)
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model=model, prompt="Once upon a time", temperature=1.0, seed=99, max_tokens=16, stream=True) if ch.choices)
    assert streamed == c.choices[0].text


def test_chat_logprobs_and_top_logprobs(client, model):
    r = client.chat.completions.create(model=model, messages=CHAT, logprobs=True, top_logprobs=3, **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == 12
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob <= 0
        # greedy: the chosen token is the most likely one
        assert entry.token == entry.top_logprobs[0].token
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert bytes(entry.bytes).decode(errors="replace") == entry.token
    stream = client.chat.completions.create(model=model, messages=CHAT, logprobs=True, top_logprobs=3, stream=True, **GREEDY)
    streamed = [e for chunk in stream for ch in chunk.choices if ch.logprobs for e in ch.logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in content]


def test_completions_logprobs_format(client, model):
    r = client.completions.create(model=model, prompt="Hello, world!", logprobs=2, temperature=0, max_tokens=6)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    assert all(1 <= len(t) <= 2 for t in lp.top_logprobs)


def test_stop_string_cuts_the_text_and_reports_it(client, model):
    base = client.completions.create(model=model, prompt="The quick brown fox", temperature=0, max_tokens=24)
    text = base.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), f"pick a visible stop in {text!r}"
    r = client.completions.create(model=model, prompt="The quick brown fox", temperature=0, max_tokens=24, stop=[stop])
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.text == text[: text.index(stop)]
    assert choice.model_extra["stop_reason"] == stop


def test_completions_variants_prompts_ids_echo_n(client, srv, model):
    tok = srv.engine.tokenizer
    ids = tok.encode("Once upon a time")
    r = client.completions.create(model=model, prompt=["Once upon a time", ids], temperature=0, max_tokens=5, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    # A string prompt and its token ids give the same greedy text; n choices of a greedy request agree.
    assert len({c.text for c in r.choices}) == 1
    assert r.usage.prompt_tokens == 2 * len(ids) and r.usage.completion_tokens == 20
    e = client.completions.create(model=model, prompt="Once upon a time", temperature=0, max_tokens=5, echo=True)
    assert e.choices[0].text == "Once upon a time" + r.choices[0].text
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model=model, prompt="Once upon a time", temperature=0, max_tokens=5, echo=True, stream=True) if ch.choices)
    assert streamed == e.choices[0].text


def test_completions_streaming_with_usage_and_several_prompts(client, model):
    chunks = list(client.completions.create(model=model, prompt=["a b c", "one two"], temperature=0, max_tokens=4,
                                           stream=True, stream_options={"include_usage": True}))
    texts, finish = {}, {}
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert sorted(finish) == [0, 1]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    ref = client.completions.create(model=model, prompt=["a b c", "one two"], temperature=0, max_tokens=4)
    assert texts == {c.index: c.text for c in ref.choices}


def test_max_completion_tokens_and_message_parts(client, model):
    messages = [{"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "the capital?"}]}]
    r = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=3, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3


def test_tokenize_and_detokenize(srv, model):
    with srv.http() as h:
        t = h.post("/tokenize", json={"model": model, "prompt": "Hello, world!"}).json()
        assert t["count"] == len(t["tokens"]) and t["max_model_len"] == srv.engine.max_model_len
        d = h.post("/detokenize", json={"tokens": t["tokens"]}).json()
        assert d["prompt"] == "Hello, world!"
        chat = h.post("/tokenize", json={"messages": CHAT}).json()
        assert chat["prompt"] == "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


def test_health_and_stats(srv):
    with srv.http() as h:
        assert h.get("/health").json() == {"status": "ok", "model_loaded": True}
        s = h.get("/stats").json()
    for key in ("active_requests", "waiting_requests", "total_requests", "cache_usage", "tokens_generated",
                "prompt_tokens", "cached_prompt_tokens", "aborted_requests", "client_disconnects"):
        assert key in s, key
    assert s["total_requests"] >= 1 and s["tokens_generated"] >= 1
    pc = s["prefix_cache"]
    assert pc["lookups"] == pc["misses"] + pc["hits"] >= 1
    assert pc["pool_bytes"] == srv.engine.pool.num_blocks * srv.engine.runner.bytes_per_block > 0
    assert pc["cached_bytes"] == pc["cached_blocks"] * srv.engine.runner.bytes_per_block


def test_16_concurrent_streaming_clients_get_what_they_get_alone(client, model):
    prompts = [f"Story number {i}: once upon a time" for i in range(16)]

    def run(p):
        stream = client.completions.create(model=model, prompt=p, temperature=0, max_tokens=12, stream=True,
                                           extra_body={"ignore_eos": True})
        return "".join(ch.choices[0].text for ch in stream if ch.choices)

    alone = [run(p) for p in prompts]
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(run, prompts))
    assert together == alone
    assert all(alone)


def test_unknown_fields_are_ignored(srv, model):
    with srv.http() as h:
        r = h.post("/v1/chat/completions", json={"model": model, "messages": CHAT, "max_tokens": 2,
                                                 "frobnicate": True, "response_format": {"type": "text"}, "parallel_tool_calls": False})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 2

