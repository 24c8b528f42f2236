"""Every refusal: status code, OpenAI error format, a message naming the field; the server stays up."""

import openai
import pytest

from server_utils import LiveServer, tiny_engine

MAX_LEN = 64
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def srv(tiny_llama_path):
    with LiveServer(tiny_engine(tiny_llama_path, max_model_len=MAX_LEN)) as s:
        yield s


@pytest.fixture(scope="module")
def h(srv):
    with srv.http() as client:
        yield client


def check(resp, status, type_, *words, param=None):
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) >= {"message", "type", "code", "param"}
    assert err["type"] == type_
    for w in words:
        assert w in err["message"], (w, err["message"])
    assert "Traceback" not in err["message"]
    if param is not None:
        assert err["param"] == param
    return err


def chat(h, **fields):
    return h.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, **fields})


def complete(h, **fields):
    return h.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, **fields})


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": -1}, "max_completion_tokens"),
        ({"n": 0}, "n"),
        ({"n": 1000}, "n"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"temperature": "hot"}, "temperature"),
        ({"stop": 5}, "stop"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": []}, "messages"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ],
)
def test_invalid_sampling_values_are_400_naming_the_field(h, fields, param):
    err = check(chat(h, **fields), 400, "invalid_request_error", param.split("[")[0], param=param)
    assert err["code"] is None or isinstance(err["code"], str)


def test_logit_bias_keys_must_be_integer_token_ids_in_the_vocabulary(h, srv):
    check(chat(h, logit_bias={"abc": 1}), 400, "invalid_request_error", "logit_bias", "'abc'", param="logit_bias")
    vocab = srv.engine.vocab_size
    check(chat(h, logit_bias={str(vocab + 5): 1}), 400, "invalid_request_error", "logit_bias", "vocabulary", param="logit_bias")


def test_prompt_token_ids_outside_the_vocabulary(h, srv):
    check(complete(h, prompt=[1, 2, srv.engine.vocab_size + 1]), 400, "invalid_request_error", "prompt", "vocabulary", param="prompt")
    check(complete(h, prompt=[-1]), 400, "invalid_request_error", "vocabulary")


def test_a_prompt_longer_than_the_context_says_both_lengths(h):
    ids = [5] * (MAX_LEN + 10)
    check(complete(h, prompt=ids), 400, "invalid_request_error", str(MAX_LEN + 10), str(MAX_LEN), param="prompt")
    long_chat = [{"role": "user", "content": "word " * 200}]
    check(chat(h, messages=long_chat), 400, "invalid_request_error", "prompt", str(MAX_LEN), param="messages")


def test_bad_prompt_shapes(h):
    check(complete(h, prompt=[]), 400, "invalid_request_error", "prompt", param="prompt")
    check(complete(h, prompt={"a": 1}), 400, "invalid_request_error", "prompt", param="prompt")
    check(complete(h, prompt=[[1, 2], "x", 3]), 400, "invalid_request_error", "prompt", param="prompt")
    check(h.post("/v1/completions", json={"max_tokens": 2}), 400, "invalid_request_error", "prompt is required", param="prompt")


def test_suffix_and_top_logprobs_without_logprobs(h):
    check(complete(h, suffix="end"), 400, "invalid_request_error", "suffix", param="suffix")
    check(chat(h, top_logprobs=2), 400, "invalid_request_error", "top_logprobs", "logprobs", param="top_logprobs")
    check(chat(h, stop=[""]), 400, "invalid_request_error", "stop", param="stop")


def test_image_parts_are_refused_clearly(h):
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                             {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
    check(chat(h, messages=messages), 400, "invalid_request_error", "this model does not accept images", param="messages[0].content[1]")


def test_malformed_json_and_non_object_bodies(h):
    r = h.post("/v1/chat/completions", content=b'{"messages": [', headers={"content-type": "application/json"})
    check(r, 400, "invalid_request_error", "not valid JSON")
    r = h.post("/v1/chat/completions", content=b"{not json")  # no content type, as curl -d might send
    check(r, 400, "invalid_request_error", "not valid JSON")
    check(h.post("/v1/chat/completions", json=[1, 2]), 400, "invalid_request_error", "JSON object")
    check(h.post("/v1/chat/completions", content=b""), 400, "invalid_request_error", "empty")


def test_unknown_model_is_404(h, srv):
    err = check(chat(h, model="gpt-17"), 404, "not_found_error", "gpt-17", srv.state.model_name, param="model")
    assert err["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError) as e:
        srv.openai().chat.completions.create(model="gpt-17", messages=CHAT)
    assert e.value.status_code == 404 and "gpt-17" in e.value.message


def test_unknown_path_and_wrong_method(h):
    check(h.get("/v1/nothing"), 404, "not_found_error", "/v1/nothing")
    check(h.get("/v1/chat/completions"), 405, "invalid_request_error", "GET", "/v1/chat/completions")
    check(h.put("/v1/models"), 405, "invalid_request_error", "PUT")


def test_the_sdk_sees_a_bad_request_error(srv):
    with pytest.raises(openai.BadRequestError) as e:
        srv.openai().chat.completions.create(model=srv.state.model_name, messages=CHAT, temperature=-1)
    assert e.value.status_code == 400 and "temperature" in e.value.message


def test_an_engine_failure_is_a_500_and_the_server_stays_up(h, srv):
    runner = srv.engine.runner
    real = runner.execute
    calls = []

    def broken(plan):
        calls.append(1)
        runner.execute = real  # only the first step fails
        raise RuntimeError("simulated device failure")

    runner.execute = broken
    try:
        r = chat(h)
        err = check(r, 500, "server_error", "the server failed", "server log")
        assert err["code"] == "engine_failure" and "simulated" not in err["message"]  # internals stay in the log
        assert "request id chatcmpl-" in err["message"]  # the id the engine's log lines name
    finally:
        runner.execute = real
    assert calls
    ok = chat(h, max_tokens=3, ignore_eos=True)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    stats = h.get("/stats").json()
    assert stats["failed_requests"] >= 1 and stats["in_flight_requests"] == 0


def test_an_engine_failure_while_streaming_ends_the_stream_with_an_error_event(h, srv):
    runner = srv.engine.runner
    real = runner.execute

    def broken(plan):
        runner.execute = real
        raise RuntimeError("simulated failure mid-stream")

    runner.execute = broken
    try:
        r = chat(h, stream=True)
    finally:
        runner.execute = real
    assert r.status_code == 200  # the status line was already sent
    events = [e for e in r.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert '"error"' in events[-2] and "request id" in events[-2] and "simulated" not in events[-2]
    assert chat(h).status_code == 200


@pytest.mark.parametrize("path, body, error_type", [
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2}, "service_unavailable_error"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}, "service_unavailable_error"),
    ("/v1/messages", {"messages": CHAT, "max_tokens": 2}, "overloaded_error"),
])
def test_a_client_error_raised_while_a_request_runs_reaches_the_client_as_it_is(h, srv, monkeypatch, path, body, error_type):
    """Every protocol's answer goes through one handler: an APIError out of the engine side (here a 503 while the
    request runs) is the client's error as it stands, in the protocol's format, never turned into a 500."""
    from shoal.server.errors import unavailable

    async def refusing(request, checked=False):
        raise unavailable("the cluster is restarting", 7, "cluster_unavailable")
        yield  # an async generator, as AsyncEngine.generate is

    monkeypatch.setattr(srv.app.state.shoal.engine, "generate", refusing)
    r = h.post(path, json={"model": srv.app.state.shoal.model_name, **body})
    assert r.status_code == 503 and r.headers["retry-after"] == "7", r.text
    err = r.json()["error"]
    assert err["type"] == error_type and "the cluster is restarting" in err["message"]
    assert h.get("/stats").json()["in_flight_requests"] == 0
