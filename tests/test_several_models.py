"""Several models in one server (server/models.py, server/lifecycle.py): routing by `model`, load and unload by
API, keep-alive on a fake clock, the memory budget, drains, names, the API key, leaks, metrics, the CLI."""

from __future__ import annotations

import asyncio
import json
import math
import os
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from server_utils import LiveServer, tiny_engine_config
from shoal.server import ServerSettings
from shoal.server.models import Lifecycle, ModelSpec, parse_keep_alive, spec_for

KEY = "sk-models-0123456789"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def tiny_qwen_path(tmp_path_factory):
    from tiny_models import make_tiny_model

    return make_tiny_model("qwen2", tmp_path_factory.mktemp("tiny-qwen2"), seed=1)


def _specs(tiny_llama_path, tiny_qwen_path, **kw):
    return [ModelSpec("a", tiny_engine_config(tiny_llama_path, **kw)), ModelSpec("b", tiny_engine_config(tiny_qwen_path, **kw))]


def _status(h, name: str) -> str:
    return next(m for m in h.get("/v1/models").json()["data"] if m["id"] == name)["status"]["value"]


def _complete(h, model: str, prompt: str, **kw) -> httpx.Response:
    return h.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0, **kw})


def _used(srv, h, model: str, **kw) -> None:
    """A request to `model`, and its lease over: the server lets go of it just after the answer's last byte, and a
    clock moved before that would count the model's idle time from the wrong moment."""
    assert _complete(h, model, "x", **kw).status_code == 200
    srv.wait_until(lambda: srv.state.models.models[model].in_use == 0, what=f"{model}'s lease to end")


# ---------------------------------------------------------------- keep_alive values


def test_keep_alive_takes_ollamas_values():
    assert parse_keep_alive(300) == 300.0
    assert parse_keep_alive("90") == 90.0
    assert parse_keep_alive("10m") == 600.0
    assert parse_keep_alive("1h30m") == 5400.0
    assert parse_keep_alive("250ms") == 0.25
    assert parse_keep_alive(0) == 0.0
    assert parse_keep_alive(-1) == math.inf and parse_keep_alive("-1m") == math.inf
    for bad in ("soon", "5 minutes", "", "m", True, None, "1x"):
        with pytest.raises(ValueError, match="keep_alive"):
            parse_keep_alive(bad)


# ---------------------------------------------------------------- answers do not depend on the neighbours


def test_each_model_answers_as_it_does_alone_while_the_others_interleave(tiny_llama_path, tiny_qwen_path, default_gguf_path):
    from shoal.config import EngineConfig

    specs = [*_specs(tiny_llama_path, tiny_qwen_path), spec_for(EngineConfig(model=str(default_gguf_path)), "smol")]
    prompts = ["Once upon a time", "The capital of France", "def fib(n):"]
    jobs = [(m, p, seed) for m in ("a", "b", "smol") for p in prompts for seed in (None, 7)]

    def ask(h, job):
        model, prompt, seed = job
        extra = {"temperature": 0.9, "seed": seed} if seed is not None else {}
        r = _complete(h, model, prompt, max_tokens=10, logprobs=1, **extra)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == model
        choice = r.json()["choices"][0]
        return choice["text"], choice["logprobs"]["tokens"]

    with LiveServer(specs[:1]) as srv, srv.http() as h:  # the tiny llama served by itself
        alone_a = {job: ask(h, job) for job in jobs if job[0] == "a"}
    with LiveServer(specs, lifecycle=Lifecycle(preload="all")) as srv, srv.http() as h:
        assert [_status(h, n) for n in ("a", "b", "smol")] == ["loaded"] * 3
        one_at_a_time = {job: ask(h, job) for job in jobs}
        with ThreadPoolExecutor(len(jobs)) as pool:  # every model's requests at once, interleaved in the steps
            together = dict(zip(jobs, pool.map(lambda j: ask(srv.http(), j), jobs)))
        stats = h.get("/stats").json()
    assert together == one_at_a_time
    assert {job: one_at_a_time[job] for job in alone_a} == alone_a
    assert set(stats["models"]) == {"a", "b", "smol"}
    assert all(stats["models"][n]["finished_requests"] == 2 * len(prompts) * 2 for n in ("a", "b", "smol"))
    assert stats["finished_requests"] == 3 * 2 * len(prompts) * 2


# ---------------------------------------------------------------- load and unload by API


def test_load_unload_by_api_and_the_compatible_routes(tiny_llama_path, tiny_qwen_path):
    events: list[dict] = []
    with LiveServer(_specs(tiny_llama_path, tiny_qwen_path)) as srv, srv.http() as h:
        def listen():
            with srv.http(timeout=30).stream("GET", "/v1/models/events") as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(json.loads(line[6:]))
                        if len(events) == 6:
                            return

        listener = threading.Thread(target=listen, daemon=True)
        listener.start()
        srv.wait_until(lambda: len(events) >= 2, what="the first events")
        assert events[:2] == [{"model": "a", "status": "loaded"}, {"model": "b", "status": "unloaded"}]  # the default preloads
        card = h.post("/v1/models", json={"model": "b"}).json()
        assert card["id"] == "b" and card["status"] == {"value": "loaded"} and card["memory_measured"] and card["max_model_len"] > 0
        assert h.get("/v1/models/b").json()["status"]["value"] == "loaded"
        ps = h.get("/api/ps").json()["models"]
        assert sorted(m["name"] for m in ps) == ["a", "b"] and all(m["size"] > 0 for m in ps)
        assert h.delete("/v1/models/b").json()["status"] == {"value": "unloaded"}
        assert h.post("/models/unload", json={"model": "a"}).json() == {"success": True}
        assert [_status(h, n) for n in ("a", "b")] == ["unloaded", "unloaded"]
        assert h.get("/health").json() == {"status": "ok", "model_loaded": False}  # the default loads on demand
        listener.join(10)
        assert [(e["model"], e["status"]) for e in events[2:]] == [("b", "loading"), ("b", "loaded"), ("b", "unloading"), ("b", "unloaded")]
        assert h.post("/models/load", json={"model": "a"}).json() == {"success": True}
        assert h.get("/models").json()["data"][0]["status"]["value"] == "loaded"  # llama.cpp's list
        h.post("/v1/models", json={"model": "b"})
        unloaded = h.delete("/v1/models").json()["data"]
        assert sorted(c["id"] for c in unloaded) == ["a", "b"] and all(c["status"]["value"] == "unloaded" for c in unloaded)
        # Autoload: a request brings its model back.
        assert _complete(h, "b", "hello").status_code == 200 and _status(h, "b") == "loaded"
        # Without it, a request for an unloaded model says how to load it.
        srv.state.models.lifecycle = Lifecycle(autoload=False)
        r = _complete(h, "a", "hello")
        assert r.status_code == 503 and "POST /v1/models" in r.json()["error"]["message"]


def test_a_streamed_request_waits_for_its_model_with_keep_alive_comments(tiny_llama_path, tiny_qwen_path, tmp_path, monkeypatch):
    from shoal.engine import builder
    from shoal.server import streams

    monkeypatch.setattr(streams, "KEEPALIVE_S", 0.05)
    release = threading.Event()
    real = builder.build_engine

    def slow(config):
        if "qwen" in config.model:
            assert release.wait(30)
        return real(config)

    monkeypatch.setattr(builder, "build_engine", slow)
    from shoal.config import EngineConfig

    specs = [*_specs(tiny_llama_path, tiny_qwen_path), ModelSpec("broken", EngineConfig(model=str(tmp_path / "missing.gguf")))]
    with LiveServer(specs) as srv, srv.http() as h:
        # A load that fails after the stream began: the protocol's own error event ends it.
        r = h.post("/v1/completions", json={"model": "broken", "prompt": "hi", "stream": True})
        assert r.status_code == 200
        events = [ln for ln in r.text.splitlines() if ln.startswith("data: ")]
        assert json.loads(events[0][6:])["error"]["code"] == "model_load_failed" and events[-1] == "data: [DONE]"
        r = h.post("/v1/messages", json={"model": "broken", "max_tokens": 2, "stream": True, "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 200 and "event: error" in r.text and "failed to load" in r.text
        lines = []
        with h.stream("POST", "/v1/completions", json={"model": "b", "prompt": "hi", "max_tokens": 3, "temperature": 0, "stream": True}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                lines.append(line)
                if line.startswith(":") and not release.is_set():
                    assert _status(h, "b") == "loading"
                    release.set()
        assert lines[0] == ": loading the model"
        data = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: {")]
        assert data and all(d["model"] == "b" for d in data) and [ln for ln in lines if ln][-1] == "data: [DONE]"
        assert "".join(d["choices"][0]["text"] for d in data) == _complete(h, "b", "hi", max_tokens=3, temperature=0).json()["choices"][0]["text"]


# ---------------------------------------------------------------- keep-alive on a fake clock


def test_idle_models_unload_after_their_keep_alive(tiny_llama_path, tiny_qwen_path):
    clock = FakeClock()
    specs = _specs(tiny_llama_path, tiny_qwen_path)
    specs[1] = ModelSpec("b", specs[1].config, keep_alive=60.0)  # its own keep-alive
    with LiveServer(specs, lifecycle=Lifecycle(keep_alive=600.0), clock=clock) as srv, srv.http() as h:
        manager = srv.state.models
        _used(srv, h, "b")
        clock.now += 59
        assert _status(h, "b") == "loaded" and _status(h, "a") == "loaded"
        clock.now += 2  # past b's 60 s, not a's 600 s: the reaper (once a second) unloads b only
        srv.wait_until(lambda: _status(h, "b") == "unloaded", what="b to expire")
        assert _status(h, "a") == "loaded"
        # keep_alive 0: unloaded as soon as the request is over; on the Anthropic API too.
        assert _complete(h, "b", "x", keep_alive=0).status_code == 200
        srv.wait_until(lambda: _status(h, "b") == "unloaded", what="b to unload at once")
        r = h.post("/v1/messages", json={"model": "b", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "keep_alive": "0s"})
        assert r.status_code == 200 and r.json()["model"] == "b"
        srv.wait_until(lambda: _status(h, "b") == "unloaded", what="b to unload at once")
        # keep_alive -1: never, however long it idles; "10m": ten minutes from its last use.
        _used(srv, h, "b", keep_alive=-1)
        _used(srv, h, "a", keep_alive="10m")
        def expire() -> list[str]:
            return asyncio.run_coroutine_threadsafe(manager.expire(), manager.loop).result(10)

        clock.now += 599
        assert expire() == [] and _status(h, "a") == "loaded"
        clock.now += 2
        expire()  # or the reaper did, just before
        assert _status(h, "a") == "unloaded"
        clock.now += 10**9
        assert expire() == [] and _status(h, "b") == "loaded"
        r = _complete(h, "b", "x", keep_alive="later")
        assert r.status_code == 400 and r.json()["error"]["param"] == "keep_alive"


# ---------------------------------------------------------------- the memory budget


def test_the_budget_evicts_the_least_recently_used_idle_model_and_never_a_busy_one(tiny_llama_path, tiny_qwen_path):
    from tiny_models import make_tiny_model

    specs = _specs(tiny_llama_path, tiny_qwen_path)
    specs.append(ModelSpec("c", tiny_engine_config(make_tiny_model("mistral", tiny_qwen_path.parent / "tiny-mistral", seed=2))))
    with LiveServer(specs, lifecycle=Lifecycle(preload="all")) as srv, srv.http() as h:
        sizes = {m["id"]: m["memory_bytes"] for m in h.get("/v1/models").json()["data"]}
    budget = sizes["a"] + sizes["b"] + min(sizes.values()) // 2  # two fit, three do not
    with LiveServer(specs, lifecycle=Lifecycle(memory=budget, preload="none")) as srv, srv.http() as h:
        manager = srv.state.models
        for m in manager.models.values():  # as measured: the same checkpoints
            m.memory = sizes[m.name]
        _used(srv, h, "b")
        _used(srv, h, "a")  # a is now the most recently used
        _used(srv, h, "c")  # b, the least recently used idle one, made room
        assert [_status(h, n) for n in ("a", "b", "c")] == ["loaded", "unloaded", "loaded"]
        # With requests in flight on both a and c, b cannot come in: a 503 with Retry-After, and nothing unloads.
        manager.models["a"].in_use += 1
        manager.models["c"].in_use += 1
        r = _complete(h, "b", "x")
        assert r.status_code == 503 and r.json()["error"]["code"] == "models_busy" and int(r.headers["retry-after"]) > 0
        assert [_status(h, n) for n in ("a", "b", "c")] == ["loaded", "unloaded", "loaded"]
        manager.models["a"].in_use -= 1
        manager.models["c"].in_use -= 1
        # A model larger than the whole budget: 507, whatever is idle.
        manager.models["b"].memory = budget + 1
        r = h.post("/v1/models", json={"model": "b"})
        assert r.status_code == 507 and "--models-memory" in r.json()["error"]["message"]
        r = h.post("/v1/messages", json={"model": "b", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 507 and r.json()["type"] == "error"
    with LiveServer(specs, lifecycle=Lifecycle(max_loaded=1)) as srv, srv.http() as h:  # --models-max
        assert _complete(h, "b", "x").status_code == 200
        assert [_status(h, n) for n in ("a", "b", "c")] == ["unloaded", "loaded", "unloaded"]


# ---------------------------------------------------------------- unloading with requests in flight


def _slow_steps(srv, name: str, seconds: float) -> None:
    runner = srv.state.models.models[name].engine.engine.runner
    real = runner.execute
    runner.execute = lambda plan: (time.sleep(seconds), real(plan))[1]


def test_an_unload_drains_requests_in_flight_then_ends_the_rest(tiny_llama_path, tiny_qwen_path):
    with LiveServer(_specs(tiny_llama_path, tiny_qwen_path), lifecycle=Lifecycle(preload="all", drain_timeout=10.0)) as srv, \
            srv.http() as h:
        _slow_steps(srv, "b", 0.02)
        with ThreadPoolExecutor(2) as pool:
            short = pool.submit(lambda: _complete(srv.http(), "b", "x", max_tokens=20, ignore_eos=True))
            srv.wait_until(lambda: srv.state.models.models["b"].in_use == 1, what="the request to start")
            assert h.delete("/v1/models/b").json()["status"]["value"] == "unloaded"  # after the request ended
            r = short.result(30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 20
        assert _complete(h, "a", "x").status_code == 200  # the other model never noticed
    with LiveServer(_specs(tiny_llama_path, tiny_qwen_path), lifecycle=Lifecycle(preload="all", drain_timeout=0.3)) as srv, \
            srv.http() as h:
        _slow_steps(srv, "b", 0.02)
        with ThreadPoolExecutor(3) as pool:
            whole = pool.submit(lambda: _complete(srv.http(), "b", "x", max_tokens=2000, ignore_eos=True))
            streamed = pool.submit(lambda: srv.http().post("/v1/chat/completions", json={
                "model": "b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2000, "ignore_eos": True, "stream": True}))
            other = pool.submit(lambda: _complete(srv.http(), "a", "y", max_tokens=30, ignore_eos=True))
            srv.wait_until(lambda: srv.state.models.models["b"].in_use == 2, what="both requests to start")
            assert h.delete("/v1/models/b").json()["status"]["value"] == "unloaded"  # after 0.3 s, not the requests' 40 s
            r, s, o = whole.result(30), streamed.result(30), other.result(30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_unloaded" and "unloaded" in r.json()["error"]["message"]
        events = [json.loads(ln[6:]) for ln in s.text.splitlines() if ln.startswith("data: {")]
        assert events[-1]["error"]["code"] == "model_unloaded"
        assert o.status_code == 200 and o.json()["usage"]["completion_tokens"] == 30
        srv.wait_until(lambda: srv.state.models.models["b"].engine is None, what="the last lease to let the engine go")


# ---------------------------------------------------------------- names and keys


def test_unknown_models_are_404_and_path_like_names_400(tiny_llama_path, tiny_qwen_path):
    with LiveServer(_specs(tiny_llama_path, tiny_qwen_path)) as srv, srv.http() as h:
        r = _complete(h, "nope", "x")
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found" and "'a'" in r.json()["error"]["message"]
        for bad in ("../../etc/passwd", "/etc/passwd", "a/../b", "~/model.gguf", "x y"):
            r = _complete(h, bad, "x")
            assert r.status_code == 400 and r.json()["error"]["param"] == "model", bad
            assert h.post("/v1/models", json={"model": bad}).status_code == 400
        assert h.delete("/v1/models/..%2F..%2Fetc").status_code in (400, 404)
        assert h.delete("/v1/models/nope").status_code == 404
        assert h.get("/v1/models/nope").status_code == 404
        assert h.post("/v1/messages", json={"model": "nope", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}).status_code == 404
        assert _status(h, "b") == "unloaded"  # nothing was loaded by any of that
    specs = _specs(tiny_llama_path, tiny_qwen_path)
    with LiveServer(specs, lifecycle=Lifecycle(default_fallback=True)) as srv, srv.http() as h:
        r = _complete(h, "gpt-4o", "x")
        assert r.status_code == 200 and r.json()["model"] == "a"
        assert _complete(h, "../x", "x").status_code == 400  # a fallback never takes a path


def test_every_lifecycle_route_needs_the_api_key(tiny_llama_path, tiny_qwen_path):
    settings = ServerSettings(api_key=KEY, log_requests=False)
    with LiveServer(_specs(tiny_llama_path, tiny_qwen_path), settings) as srv, srv.http() as h:
        routes = [("GET", "/v1/models", None), ("GET", "/v1/models/b", None), ("POST", "/v1/models", {"model": "b"}),
                  ("DELETE", "/v1/models/a", None), ("DELETE", "/v1/models", None), ("GET", "/v1/models/events", None),
                  ("GET", "/models", None), ("POST", "/models/load", {"model": "b"}), ("POST", "/models/unload", {"model": "a"}),
                  ("GET", "/api/ps", None)]
        for method, path, body in routes:
            r = h.request(method, path, json=body)
            assert r.status_code == 401, (method, path)
        assert [_status(srv.http(headers={"Authorization": f"Bearer {KEY}"}), n) for n in ("a", "b")] == ["loaded", "unloaded"]
        ok = srv.http(headers={"Authorization": f"Bearer {KEY}"})
        assert ok.post("/v1/models", json={"model": "b"}).status_code == 200


# ---------------------------------------------------------------- nothing leaks


CYCLES = 8


def test_load_and_unload_cycles_leak_no_engine_thread_or_block(tiny_llama_path, tiny_qwen_path):
    """Each cycle's engine is freed by the time its unload answers, so a few cycles show what many would
    (benchmarks/several_models.py runs twenty and watches the RSS)."""
    with LiveServer(_specs(tiny_llama_path, tiny_qwen_path)) as srv, srv.http() as h:
        def engine_threads():
            return sorted(t.name for t in threading.enumerate() if t.name.startswith("shoal-engine"))

        baseline = engine_threads()
        assert baseline == ["shoal-engine-a"]
        gone = []
        for _ in range(CYCLES):
            h.post("/v1/models", json={"model": "b"})
            assert _complete(h, "b", "x", max_tokens=3).status_code == 200
            engine = srv.state.models.models["b"].engine.engine  # the Engine behind the door
            gone.append(weakref.ref(engine))
            del engine
            h.delete("/v1/models/b")
            assert gone[-1]() is None  # freed by the time the unload answers (weights, KV pool), not at some later collection
        assert engine_threads() == baseline
        assert srv.state.models.models["b"].loads == CYCLES
        metrics = h.get("/metrics").text
        assert f'shoal:model_loads_total{{model_name="b"}} {CYCLES}.0' in metrics


# ---------------------------------------------------------------- metrics and /stats per model


def test_metrics_and_stats_carry_the_model(tiny_llama_path, tiny_qwen_path):
    with LiveServer(_specs(tiny_llama_path, tiny_qwen_path), lifecycle=Lifecycle(preload="all")) as srv, srv.http() as h:
        assert _complete(h, "a", "x", max_tokens=4, ignore_eos=True).status_code == 200
        assert _complete(h, "b", "x", max_tokens=6, ignore_eos=True).status_code == 200
        assert _complete(h, "b", "y", max_tokens=6, ignore_eos=True).status_code == 200
        text = h.get("/metrics").text
        assert 'shoal:generation_tokens_total{model_name="a"} 4.0' in text
        assert 'shoal:generation_tokens_total{model_name="b"} 12.0' in text
        assert 'shoal:request_generation_tokens_count{model_name="b",protocol="openai_completions"} 2.0' in text
        assert 'shoal:model_loaded{model_name="a"} 1.0' in text
        assert text.count("# TYPE shoal:generation_tokens_total counter") == 1  # one family, a series per model
        stats = h.get("/stats").json()
        assert stats["models"]["b"]["tokens_generated"] == 12 and stats["models"]["a"]["tokens_generated"] == 4
        assert stats["tokens_generated"] == 4  # the top level is the default model's, as with one model
        assert stats["total_requests"] == 3


# ---------------------------------------------------------------- the CLI and the YAML config


def test_ps_load_and_unload_against_a_running_server(tiny_llama_path, tiny_qwen_path, capsys):
    from shoal.cli import main

    with LiveServer(_specs(tiny_llama_path, tiny_qwen_path)) as srv:
        assert main(["load", "b", "--url", srv.url]) == 0
        assert capsys.readouterr().out.startswith("b loaded (")
        assert main(["ps", "--url", srv.url]) == 0
        rows = capsys.readouterr().out.splitlines()
        assert rows[0].split()[:2] == ["NAME", "STATUS"] and [r.split()[:2] for r in rows[1:]] == [["a", "loaded"], ["b", "loaded"]]
        assert main(["unload", "b", "--url", srv.url]) == 0 and capsys.readouterr().out == "b unloaded\n"
        assert main(["unload", "--all", "--url", srv.url]) == 0 and capsys.readouterr().out == "a unloaded\n"
        assert main(["unload", "--url", srv.url]) == 2
        assert main(["load", "nope", "--url", srv.url]) == 1 and "does not exist" in capsys.readouterr().err


def test_the_yaml_config_lists_models_with_their_own_settings(tmp_path, tiny_llama_path, tiny_qwen_path):
    from shoal.cli import build_parser, lifecycle, load_config_file, model_specs, serve_values

    config = tmp_path / "shoal.yaml"
    config.write_text(f"""
models:
  - model: {tiny_llama_path}
    alias: chat
    dtype: float32
    max-model-len: 256
    kv_cache_dtype: int8
    keep_alive: 10m
    reasoning_parser: qwen3
  - model: {tiny_qwen_path}
    alias: coder
    quantization: int8
    tool_call_parser: hermes
keep-alive: 30s
models-memory: 2GiB
models-max: 2
""")
    v = serve_values(build_parser().parse_args(["serve", "--config", str(config), "--model", "smollm2"]))
    specs = model_specs(v)
    assert [s.name for s in specs] == ["chat", "coder", "smollm2"]
    chat, coder, smol = specs
    assert (chat.config.dtype, chat.config.max_model_len, chat.config.cache.kv_cache_dtype, chat.keep_alive) == ("float32", 256, "int8", 600.0)
    assert chat.overrides == {"reasoning_parser": "qwen3"} and coder.overrides == {"tool_call_parser": "hermes"}
    assert coder.config.quantization == "int8" and smol.config.quantization == "auto" and smol.keep_alive is None
    life = lifecycle(v)
    assert (life.keep_alive, life.memory, life.max_loaded, life.preload) == (30.0, 2 << 30, 2, "default")
    config.write_text("models:\n  - model: x\n    colour: red\n")
    with pytest.raises(ValueError, match="unknown key 'colour' in models\\[0\\]"):
        load_config_file(config)
    config.write_text("models:\n  - alias: x\n")
    with pytest.raises(ValueError, match="at least `model`"):
        load_config_file(config)


def test_models_dir_offers_every_checkpoint_in_it(tmp_path, tiny_llama_path, default_gguf_path):
    from shoal.cli import build_parser, model_specs, serve_values

    (tmp_path / "small.gguf").symlink_to(default_gguf_path)
    (tmp_path / "mmproj-small.gguf").symlink_to(default_gguf_path)  # a vision projector: not a model
    (tmp_path / "tiny").symlink_to(tiny_llama_path)
    (tmp_path / "notes").mkdir()
    v = serve_values(build_parser().parse_args(["serve", "--models-dir", str(tmp_path)]))
    assert [s.name for s in model_specs(v)] == ["small", "tiny"]
    v = serve_values(build_parser().parse_args(["serve", "--model", "smollm2", "--models-dir", str(tmp_path)]))
    assert [s.name for s in model_specs(v)] == ["smollm2", "small", "tiny"]


# ---------------------------------------------------------------- steps take turns


def test_engines_take_turns_at_stepping_first_come_first_served():
    from shoal.engine.async_engine import StepTurns

    turns = StepTurns()
    order: list[str] = []
    inside = threading.Event()
    go = threading.Event()

    def step(name: str, hold: bool = False) -> None:
        with turns.turn():
            order.append(name)
            if hold:
                inside.set()
                assert go.wait(10)

    first = threading.Thread(target=step, args=("a1", True))
    first.start()
    assert inside.wait(10)
    waiting = []
    for name in ("b1", "a2", "b2"):  # queued in this order while a1 holds the turn
        t = threading.Thread(target=step, args=(name,))
        t.start()
        waiting.append(t)
        deadline = time.monotonic() + 10
        while turns._next != len(waiting) + 1 and time.monotonic() < deadline:
            time.sleep(0.001)
    assert order == ["a1"]  # nobody stepped beside it
    go.set()
    for t in [first, *waiting]:
        t.join(10)
    assert order == ["a1", "b1", "a2", "b2"]


def _alive(pid: int) -> bool:
    """pid is a live process (a zombie counts as gone)."""
    from pathlib import Path

    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_tensor_parallel_model_loads_beside_another_and_unloads_its_ranks(tiny_llama_path, tiny_qwen_path):
    from shoal.config import ParallelConfig

    specs = [ModelSpec("a", tiny_engine_config(tiny_llama_path)),
             ModelSpec("tp", tiny_engine_config(tiny_qwen_path, parallel=ParallelConfig(tensor_parallel_size=2, timeout=60)))]
    with LiveServer(specs, lifecycle=Lifecycle(load_timeout=180)) as srv, srv.http() as h:
        alone = _complete(h, "a", "x").json()["choices"][0]["text"]
        r = _complete(h, "tp", "x")
        assert r.status_code == 200 and r.json()["model"] == "tp"
        ranks = h.get("/v1/cluster", params={"model": "tp"}).json()
        assert ranks["model"] == "tp" and len(ranks["ranks"]) == 2
        worker = ranks["ranks"][1]["pid"]
        assert worker != os.getpid() and _alive(worker)  # the second rank is a process of its own
        assert _complete(h, "a", "x").json()["choices"][0]["text"] == alone
        h.delete("/v1/models/tp")
        srv.wait_until(lambda: not _alive(worker), timeout=30, what="the ranks to exit")
        assert h.get("/v1/cluster", params={"model": "tp"}).json()["ranks"] == []
