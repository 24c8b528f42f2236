"""Access and limits: API keys, CORS, body size (413), loading and overload (503 + Retry-After)."""

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from server_utils import Gate, LiveServer, tiny_engine, tiny_engine_config
from shoal.server import ServerSettings

KEY = "sk-test-0123456789"


def _error(resp, status, type_, *words):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["type"] == type_
    for w in words:
        assert w in err["message"], (w, err["message"])
    return err


@pytest.fixture(scope="module")
def engine(tiny_llama_path):
    return tiny_engine(tiny_llama_path, max_num_seqs=1)


def test_api_key_is_required_everywhere_but_health(engine):
    with LiveServer(engine, ServerSettings(api_key=KEY, log_requests=False)) as srv, srv.http() as h:
        assert h.get("/health").status_code == 200
        for method, path in [("GET", "/v1/models"), ("GET", "/stats"), ("POST", "/v1/chat/completions"), ("POST", "/tokenize")]:
            err = _error(h.request(method, path, json={}), 401, "authentication_error", "API key")
            assert err["code"] == "invalid_api_key"
        _error(h.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401, "authentication_error")
        _error(h.get("/v1/models", headers={"Authorization": KEY}), 401, "authentication_error")  # no "Bearer"
        assert h.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        assert h.get("/v1/models", headers={"x-api-key": KEY}).status_code == 200
        assert srv.openai(api_key=KEY).models.list().data
        with pytest.raises(openai.AuthenticationError):
            srv.openai(api_key="nope").models.list()


def test_no_cors_headers_unless_origins_are_allowed(engine):
    with LiveServer(engine) as srv, srv.http() as h:
        r = h.get("/health", headers={"Origin": "http://ui.example"})
        assert "access-control-allow-origin" not in r.headers
    settings = ServerSettings(allowed_origins=("http://ui.example",), api_key=KEY, log_requests=False)
    with LiveServer(engine, settings) as srv, srv.http() as h:
        pre = h.options("/v1/chat/completions", headers={
            "Origin": "http://ui.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})
        assert pre.status_code == 200
        assert pre.headers["access-control-allow-origin"] == "http://ui.example"
        r = h.get("/v1/models", headers={"Origin": "http://ui.example", "Authorization": f"Bearer {KEY}"})
        assert r.headers["access-control-allow-origin"] == "http://ui.example"
        other = h.get("/health", headers={"Origin": "http://evil.example"})
        assert "access-control-allow-origin" not in other.headers


def test_bodies_over_the_limit_are_413(engine):
    with LiveServer(engine, ServerSettings(max_request_bytes=2000, log_requests=False)) as srv, srv.http() as h:
        big = {"messages": [{"role": "user", "content": "x" * 5000}]}
        _error(h.post("/v1/chat/completions", json=big), 413, "invalid_request_error", "2000", "--max-request-bytes")

        def chunked():  # no Content-Length: the server counts what arrives
            yield b'{"messages": [{"role": "user", "content": "'
            for _ in range(10):
                yield b"y" * 500
            yield b'"}]}'

        _error(h.post("/v1/chat/completions", content=chunked(), headers={"content-type": "application/json"}),
               413, "invalid_request_error", "2000")
        ok = h.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
        assert ok.status_code == 200


def test_requests_wait_while_the_model_loads_then_succeed(tiny_llama_path, monkeypatch):
    from shoal.engine import builder
    from shoal.server.models import Lifecycle

    release = threading.Event()
    real = builder.build_engine

    def slow(config):
        assert release.wait(30)
        return real(config)

    monkeypatch.setattr(builder, "build_engine", slow)
    with LiveServer(tiny_engine_config(tiny_llama_path), wait_ready=False, lifecycle=Lifecycle(load_timeout=0.3)) as srv, \
            srv.http() as h:
        r = h.get("/health")
        assert r.status_code == 503 and r.json() == {"status": "loading", "model_loaded": False}
        assert int(r.headers["retry-after"]) > 0
        # A wait longer than --model-load-timeout is a 503 with Retry-After.
        r = h.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        err = _error(r, 503, "service_unavailable_error", "loading")
        assert err["code"] == "model_loading" and int(r.headers["retry-after"]) > 0
        assert h.get("/v1/models").json()["data"][0]["status"] == {"value": "loading"}
    release.clear()
    with LiveServer(tiny_engine_config(tiny_llama_path), wait_ready=False) as srv, srv.http() as h:
        got = {}
        waiter = threading.Thread(target=lambda: got.update(r=srv.http().post(
            "/v1/completions", json={"prompt": "hi", "max_tokens": 2})))
        waiter.start()
        srv.wait_until(lambda: srv.state.default._loading is not None, what="the load to start")
        time.sleep(0.3)
        assert waiter.is_alive()  # it waits for the model (up to --model-load-timeout)
        release.set()
        waiter.join(30)
        assert got["r"].status_code == 200 and got["r"].json()["usage"]["completion_tokens"] == 2
        assert h.get("/health").json() == {"status": "ok", "model_loaded": True}


def test_a_model_that_fails_to_load_is_reported(tmp_path):
    from shoal.config import EngineConfig

    with LiveServer(EngineConfig(model=str(tmp_path / "missing.gguf")), wait_ready=False) as srv, srv.http() as h:
        srv.wait_until(lambda: srv.state.status != "loading", what="the load to fail")
        r = h.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "failed" and "missing.gguf" in r.json()["error"]
        _error(h.post("/v1/completions", json={"prompt": "x"}), 503, "service_unavailable_error", "failed to load")


def test_503_with_retry_after_when_too_many_wait(engine):
    # max_num_seqs=1: A runs, B waits; with --max-waiting 1 a third request is refused.
    settings = ServerSettings(max_waiting=1, log_requests=False)
    with LiveServer(engine, settings) as srv, srv.http() as h:
        with Gate(engine, when=lambda: engine.num_waiting >= 1) as gate:
            a = {"prompt": "A", "max_tokens": 400, "ignore_eos": True, "stream": True}
            with h.stream("POST", "/v1/completions", json=a) as stream_a:
                lines_a = stream_a.iter_lines()  # kept: a dropped iterator closes the connection
                next(ln for ln in lines_a if ln.startswith("data: "))
                result_b = {}
                b = threading.Thread(target=lambda: result_b.update(r=srv.http().post(
                    "/v1/completions", json={"prompt": "B", "max_tokens": 2})))
                b.start()
                assert gate.blocked.wait(30)  # B is in the waiting queue and the engine is held
                r = h.post("/v1/completions", json={"prompt": "C", "max_tokens": 2})
                err = _error(r, 503, "service_unavailable_error", "overloaded", "--max-waiting")
                assert err["code"] == "server_overloaded" and int(r.headers["retry-after"]) >= 1
                gate.open()
            # A's stream is closed (aborted); B runs to the end.
            b.join(30)
        assert result_b["r"].status_code == 200
        assert h.get("/stats").json()["rejected_overloaded"] == 1
        assert h.post("/v1/completions", json={"prompt": "D", "max_tokens": 1}).status_code == 200


def test_max_waiting_holds_when_requests_arrive_together(engine):
    # max_num_seqs=1: A runs and the engine is held in its step; 40 requests then arrive at
    # once. A request counts as waiting from its admission, so exactly 4 get in.
    limit, burst = 4, 40
    settings = ServerSettings(max_waiting=limit, log_requests=False)
    with LiveServer(engine, settings) as srv, srv.http() as h:
        state = srv.state
        # Requests refused after their admission (a prompt outside the vocabulary) hold nothing afterwards.
        for _ in range(3):
            assert h.post("/v1/completions", json={"prompt": [engine.vocab_size + 1]}).status_code == 400
        assert state.admitted == 0
        with Gate(engine, when=lambda: engine.num_running >= 1) as gate:
            a = {"prompt": "A", "max_tokens": 400, "ignore_eos": True, "stream": True}
            with h.stream("POST", "/v1/completions", json=a):
                assert gate.blocked.wait(30)  # A runs, held in its first step
                clients = [srv.http() for _ in range(burst)]
                start = threading.Barrier(burst)

                def send(client):
                    start.wait()
                    return client.post("/v1/completions", json={"prompt": "B", "max_tokens": 2})

                with ThreadPoolExecutor(burst) as pool:
                    futures = [pool.submit(send, c) for c in clients]
                    srv.wait_until(lambda: sum(f.done() for f in futures) >= burst - limit, what="the refusals")
                    assert state.admitted + state.engine.num_waiting == limit
                    gate.open()
                    responses = [f.result(timeout=60) for f in futures]
        for c in clients:
            c.close()
        accepted = [r for r in responses if r.status_code == 200]
        refused = [r for r in responses if r.status_code == 503]
        assert len(accepted) == limit and len(refused) == burst - limit, sorted(r.status_code for r in responses)
        for r in refused:
            err = _error(r, 503, "service_unavailable_error", "overloaded", f"--max-waiting {limit}")
            assert err["code"] == "server_overloaded" and int(r.headers["retry-after"]) >= 1
        assert all(r.json()["usage"]["completion_tokens"] >= 1 for r in accepted)
        assert state.admitted == 0 and state.engine.num_waiting == 0
        assert h.get("/stats").json()["rejected_overloaded"] == burst - limit


def test_an_admission_is_released_once_whichever_way_the_request_ends(engine):
    from shoal.server.state import ServerState, release_admission

    async def run():
        state = ServerState(ServerSettings(max_waiting=2), engine)
        await state.start()
        m = state.default
        with state.serving():
            await state.admit(None)
            assert state.admitted == 1 and m.in_use == 1
            release_admission()  # handed to the engine
            release_admission()
            assert state.admitted == 0 and m.in_use == 1  # the lease lasts as long as the HTTP request
        assert m.in_use == 0
        with pytest.raises(RuntimeError), state.serving():  # fails before the engine sees it
            await state.admit(None)
            raise RuntimeError
        assert state.admitted == 0 and m.in_use == 0
        with state.serving():
            await state.admit(None)
            with state.serving():  # another request, served meanwhile
                await state.admit(None)
                with pytest.raises(Exception, match="--max-waiting 2"):
                    await state.admit(None)
            assert state.admitted == 1
        assert state.admitted == 0 and m.in_use == 0
        state.shutdown()

    asyncio.run(run())


def test_the_default_body_limit_fits_the_context(engine):
    assert ServerSettings().max_request_bytes is None  # auto
    s = ServerSettings()
    assert s.request_byte_limit(None) == 1 << 20  # no model yet: the floor
    assert s.request_byte_limit(8192) == 1 << 20  # 16 x 8192 + 64 KiB is under the floor
    assert s.request_byte_limit(131072) == 16 * 131072 + (64 << 10)
    assert ServerSettings(max_request_bytes=5000).request_byte_limit(131072) == 5000  # an explicit limit wins
    with LiveServer(engine) as srv, srv.http() as h:
        limit = srv.state.request_byte_limit
        assert limit == 1 << 20
        big = {"messages": [{"role": "user", "content": "x" * limit}]}
        _error(h.post("/v1/chat/completions", json=big), 413, "invalid_request_error", str(limit), "--max-request-bytes")


def test_server_binds_loopback_by_default():
    assert ServerSettings().host == "127.0.0.1"
    with pytest.raises(ValueError, match="reasoning_parser"):
        ServerSettings(reasoning_parser="nope")
