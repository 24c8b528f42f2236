"""Hostile and careless input at the HTTP edge: bad Unicode, template-kwarg collisions, unexpected
exceptions (a 500 that leaks nothing, on a connection that stays up), browser origins and Host
headers, and /health staying live while the largest allowed body is processed."""

import http.client
import json
import logging
import threading

import pytest

from server_utils import LiveServer, tiny_engine
from shoal.engine.async_engine import EngineDeadError, RequestFailed
from shoal.server import ServerSettings
from shoal.server.streams import engine_error
from test_server_errors import check

CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def engine(tiny_llama_path):
    return tiny_engine(tiny_llama_path, max_model_len=256)


@pytest.fixture(scope="module")
def srv(engine):
    with LiveServer(engine) as s:
        yield s


@pytest.fixture(scope="module")
def h(srv):
    with srv.http() as client:
        yield client


def error(resp, status, *words, param=None):
    """`check`, with the error type OpenAI gives each status."""
    return check(resp, status, {400: "invalid_request_error", 403: "permission_error"}[status], *words, param=param)


# ---------------------------------------------------------------- Unicode


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/chat/completions", rb'{"messages": [{"role": "user", "content": "a\udfffb"}], "max_tokens": 1}', "messages[0].content"),
        ("/v1/completions", rb'{"prompt": "\ud800", "max_tokens": 1}', "prompt"),
        ("/v1/completions", rb'{"prompt": ["ok", "\ude00\ud83d"], "max_tokens": 1}', "prompt[1]"),  # a pair in the wrong order
        ("/v1/chat/completions", rb'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "\uDFFF"}}]}',
         "tools[0].function.name"),
        ("/v1/chat/completions", rb'{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"\udfff": 1}}',
         "chat_template_kwargs.\\udfff"),
        ("/tokenize", rb'{"prompt": "\udfff"}', "prompt"),
    ],
)
def test_lone_surrogates_are_a_400_naming_the_field(h, path, body, param):
    err = error(h.post(path, content=body), 400, "lone UTF-16 surrogate", param=param)
    assert param in err["message"] and err["type"] == "invalid_request_error"


def test_invalid_utf8_bytes_are_a_400(h):
    # ED A0 80: U+D800 encoded as if it were a character (not UTF-8)
    body = b'{"messages": [{"role": "user", "content": "a\xed\xa0\x80b"}], "max_tokens": 1}'
    error(h.post("/v1/chat/completions", content=body), 400, "not valid UTF-8", "0xed")
    error(h.post("/v1/completions", content=b'{"prompt": "\xff", "max_tokens": 1}'), 400, "not valid UTF-8")


def test_a_surrogate_pair_is_an_emoji_and_works(h):
    escaped = rb'{"prompt": "smile \ud83d\ude00", "max_tokens": 1}'
    assert h.post("/tokenize", content=escaped).json()["prompt"] == "smile \U0001F600"
    assert h.post("/v1/completions", content=escaped).status_code == 200
    literal = '{"messages": [{"role": "user", "content": "smile \U0001F600"}], "max_tokens": 1}'.encode()
    assert h.post("/v1/chat/completions", content=literal).status_code == 200
    # An escaped backslash followed by "udfff" is plain text, not a surrogate.
    assert h.post("/tokenize", content=rb'{"prompt": "C:\\udfff"}').json()["prompt"] == "C:\\udfff"


# ---------------------------------------------------------------- chat_template_kwargs


@pytest.mark.parametrize("key", ["tools", "messages", "tokenize", "chat_template", "conversation"])
def test_template_kwargs_may_not_set_what_the_renderer_passes(h, key):
    body = {"messages": CHAT, "max_tokens": 1, "chat_template_kwargs": {key: []}}
    error(h.post("/v1/chat/completions", json=body), 400, "chat_template_kwargs", repr(key))
    error(h.post("/tokenize", json={"messages": CHAT, "chat_template_kwargs": {key: []}}), 400, repr(key))


def test_add_generation_prompt_is_a_template_variable_clients_may_set(h):
    plain = h.post("/tokenize", json={"messages": CHAT}).json()["prompt"]
    without = h.post("/tokenize", json={"messages": CHAT, "chat_template_kwargs": {"add_generation_prompt": False}}).json()["prompt"]
    assert plain == without + "<|im_start|>assistant\n"


# ---------------------------------------------------------------- unexpected exceptions


def test_an_unexpected_exception_is_a_plain_500_and_the_connection_stays_usable(srv, monkeypatch, caplog):
    def broken(name):
        raise RuntimeError("secret internal detail")

    monkeypatch.setattr(srv.state.models, "find", broken)
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
    body = json.dumps({"messages": CHAT, "max_tokens": 1})
    with caplog.at_level(logging.ERROR, logger="shoal.server"):
        conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        payload = json.loads(r.read())
    sock = conn.sock
    assert r.status == 500 and r.getheader("connection") is None
    err = payload["error"]
    assert err["type"] == "server_error" and "secret" not in err["message"]
    assert err["message"].startswith("the server failed while handling this request (request id req-")
    request_id = err["message"].split("request id ")[1].split(")")[0]
    logged = [rec for rec in caplog.records if request_id in rec.getMessage()]
    assert logged and "secret internal detail" in str(logged[0].exc_info[1])

    monkeypatch.undo()
    conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200 and json.loads(r.read())["object"] == "chat.completion"
    assert conn.sock is sock  # the same keep-alive connection: the server did not drop it
    conn.close()


def test_error_responses_keep_the_connection(srv):
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
    socks = set()
    for method, path, body, headers, status in [
        ("POST", "/v1/chat/completions", b'{"messages": [', {}, 400),
        ("POST", "/v1/completions", rb'{"prompt": "\udfff"}', {}, 400),
        ("GET", "/v1/nothing", None, {}, 404),
        ("GET", "/v1/models", None, {"Origin": "https://evil.example"}, 403),
        ("GET", "/v1/models", None, {}, 200),
    ]:
        conn.request(method, path, body=body, headers=headers)
        r = conn.getresponse()
        r.read()
        assert r.status == status and r.getheader("connection") is None, (path, r.status)
        socks.add(id(conn.sock))
    assert len(socks) == 1  # one keep-alive connection served them all
    conn.close()


def test_engine_errors_tell_the_client_only_what_is_safe():
    err = engine_error(RequestFailed("the request's logits were not finite (NaN) at step 3"), "chatcmpl-1")
    assert (err.status, err.code, err.message) == (500, "request_failed", "the request's logits were not finite (NaN) at step 3")
    for exc in (EngineDeadError("the engine failed: CUDA error 700 at 0xdeadbeef"), KeyError("seq 17")):
        err = engine_error(exc, "chatcmpl-2")
        assert err.status == 500 and err.code == "engine_failure"
        assert "chatcmpl-2" in err.message and "0xdeadbeef" not in err.message and "17" not in err.message
    assert engine_error(ValueError("prompt too long")).status == 400


# ---------------------------------------------------------------- browsers: Origin and Host


def test_requests_from_other_origins_are_refused_before_they_run(srv, h):
    added = srv.engine.stats.requests_added
    # A page's text/plain POST needs no CORS preflight: the browser sends it as is.
    body = json.dumps({"messages": CHAT, "max_tokens": 1})
    r = h.post("/v1/chat/completions", content=body, headers={"Origin": "https://evil.example", "Content-Type": "text/plain"})
    err = error(r, 403, "https://evil.example", "--allowed-origins")
    assert err["type"] == "permission_error" and err["code"] == "origin_not_allowed"
    error(h.get("/v1/models", headers={"Origin": "null"}), 403, "origin null")
    pre = h.options("/v1/chat/completions", headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert pre.status_code >= 400 and "access-control-allow-origin" not in pre.headers  # CORS refuses the preflight
    assert srv.engine.stats.requests_added == added
    assert h.post("/v1/chat/completions", content=body).status_code == 200  # no Origin: not a browser page


def test_loopback_origins_are_allowed_when_bound_to_loopback(h):
    for origin in ("http://localhost:5173", "http://127.0.0.1:8080", "https://[::1]:3000", "http://localhost"):
        r = h.get("/v1/models", headers={"Origin": origin})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
    error(h.get("/v1/models", headers={"Origin": "http://localhost.evil.example"}), 403)


def test_allowed_origins_and_their_preflight(engine):
    settings = ServerSettings(allowed_origins=("https://ui.example",), log_requests=False)
    with LiveServer(engine, settings) as srv, srv.http() as h:
        pre = h.options("/v1/chat/completions", headers={"Origin": "https://ui.example", "Access-Control-Request-Method": "POST",
                                                         "Access-Control-Request-Headers": "content-type"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "https://ui.example"
        r = h.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1}, headers={"Origin": "https://ui.example"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://ui.example"
        # the page's script may read the headers shoal answers with, not only the browser
        exposed = {v.strip().lower() for v in r.headers["access-control-expose-headers"].split(",")}
        assert {"x-shoal-max-tokens-clipped", "retry-after"} <= exposed
        error(h.get("/v1/models", headers={"Origin": "https://other.example"}), 403, "https://other.example")
    with LiveServer(engine, ServerSettings(allowed_origins=("*",), log_requests=False)) as srv, srv.http() as h:
        assert h.get("/v1/models", headers={"Origin": "https://anyone.example"}).status_code == 200


def test_bound_to_loopback_only_loopback_host_headers_are_answered(h):
    for host in ("evil.example", "evil.example:8000", "192.168.1.20", "127.0.0.1.evil.example", "localhost:notaport"):
        err = error(h.get("/v1/models", headers={"Host": host}), 403, "Host header", host)
        assert err["code"] == "host_not_allowed"
    error(h.get("/health", headers={"Host": "evil.example"}), 403)
    for host in ("localhost", "localhost:8000", "127.0.0.1", "127.8.9.10:1", "[::1]:8000", "LOCALHOST"):
        assert h.get("/v1/models", headers={"Host": host}).status_code == 200, host


def test_bound_elsewhere_any_host_is_answered_and_loopback_origins_are_not_special(engine):
    # LiveServer listens on 127.0.0.1 whatever the settings say; the checks follow settings.host.
    with LiveServer(engine, ServerSettings(host="0.0.0.0", log_requests=False)) as srv, srv.http() as h:
        assert h.get("/v1/models", headers={"Host": "shoal.lan:8000"}).status_code == 200
        error(h.get("/v1/models", headers={"Origin": "http://localhost:5173"}), 403, "http://localhost:5173")


# ---------------------------------------------------------------- the event loop stays free


def test_health_answers_while_the_largest_allowed_body_is_processed(engine, monkeypatch):
    """The largest body the server takes is read and parsed, and its rendering (off the event loop: the prompt's
    size check, the template, the encoding) cannot finish until /health has answered. An order of events, not a
    time, so a busy machine cannot fail it; the rendering gives up waiting after a minute, as a deadlock guard."""
    from shoal.server.chat import images

    with LiveServer(engine) as srv, srv.http() as h:
        limit = srv.state.request_byte_limit
        envelope = len(json.dumps({"messages": [{"role": "user", "content": ""}], "max_tokens": 1}))
        text = ("word " * limit)[: limit - envelope]
        body = json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": 1}).encode()
        assert len(body) == limit
        real, started, answered, done = images.render_messages, threading.Event(), threading.Event(), threading.Event()

        def held_render(*a, **kw):
            started.set()
            answered.wait(60)
            done.set()
            return real(*a, **kw)

        monkeypatch.setattr(images, "render_messages", held_render)
        result = {}
        sender = threading.Thread(target=lambda: result.update(r=srv.http(timeout=120).post("/v1/chat/completions", content=body)))
        h.get("/health")  # the polling connection is open before the big body goes
        sender.start()
        assert started.wait(60)  # the body has been read and parsed, and its prompt rendered
        assert h.get("/health").status_code == 200
        assert not done.is_set()  # answered while the rendering still waited: it never held the event loop
        answered.set()
        sender.join(120)
        assert result["r"].status_code == 400 and "prompt" in result["r"].json()["error"]["message"]  # it cannot fit 256 tokens


# ---------------------------------------------------------------- one request cannot fail the others


def test_poison_parameters_beside_four_streams_harm_none(srv):
    """The values that once failed every request in flight (top_p 1e-46 indexed -1 in the
    sampler) or silently returned garbage (NaN logits from temperature 1e-40, repetition
    penalty 1e-45) arrive while four streams decode: all seven finish normally."""
    client = srv.openai()
    stream_args = dict(model=srv.state.model_name, messages=CHAT, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    alone = client.chat.completions.create(**stream_args).choices[0].message.content
    greedy = client.chat.completions.create(model=srv.state.model_name, messages=CHAT, max_tokens=8, temperature=0).choices[0].message.content
    started = threading.Barrier(5, timeout=30)
    texts, finishes, errors = [None] * 4, [None] * 4, []

    def stream(i):
        try:
            parts = []
            for chunk in client.chat.completions.create(stream=True, **stream_args):
                if not chunk.choices:
                    continue
                c = chunk.choices[0]
                if c.delta.content and not "".join(parts):
                    started.wait()  # every stream is decoding before the poison arrives
                parts.append(c.delta.content or "")
                finishes[i] = c.finish_reason or finishes[i]
            texts[i] = "".join(parts)
        except Exception as e:  # reported below: the assertion names it
            errors.append(repr(e))

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    started.wait()
    poison = [
        dict(temperature=1.0, top_p=1e-46),  # keeps the top token only: greedy
        dict(temperature=1e-40),  # below 1e-5: greedy
        dict(temperature=0, extra_body={"repetition_penalty": 1e-45}),
    ]
    answers = [client.chat.completions.create(model=srv.state.model_name, messages=CHAT, max_tokens=8, **p).choices[0] for p in poison]
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert texts == [alone] * 4 and finishes == ["length"] * 4
    assert [a.message.content for a in answers[:2]] == [greedy, greedy]
    assert all(a.finish_reason in ("stop", "length") and a.message.content for a in answers)
