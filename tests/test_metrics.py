"""Observability: per-request timing records under a fake clock, the engine's frozen snapshot,
`/metrics` (parsed with prometheus_client's own parser) against a scripted set of requests,
`/stats`, the API key on /metrics, and JSON log lines."""

from __future__ import annotations

import dataclasses
import json
import logging
import os

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_utils import LiveServer, tiny_engine
from shoal.server import ServerSettings
from shoal.logs import JsonFormatter
from shoal.types import GenerationRequest, SamplingParams


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_timing_records_are_exact_under_a_fake_clock(tiny_llama_path):
    engine = tiny_engine(tiny_llama_path, max_num_batched_tokens=8)
    clock = engine.clock = FakeClock()
    prompt = tuple(range(5, 15))  # 10 tokens: two prefill steps of 8 and 2
    engine.add_request(GenerationRequest("r", prompt, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)))
    outs = []
    for t in (1.0, 2.0, 3.5, 5.0):
        clock.t = t
        outs += engine.step()
    final = outs[-1]
    assert final.finished
    m = final.metrics
    assert (m.arrival_time, m.first_scheduled_time, m.first_token_time, m.last_token_time, m.finished_time) == (0.0, 1.0, 2.0, 5.0, 5.0)
    assert (m.queue_time, m.time_to_first_token, m.prefill_time, m.decode_time, m.e2e_latency) == (1.0, 2.0, 1.0, 3.0, 5.0)
    assert m.inter_token_latencies == [1.5, 1.5] and m.time_per_output_token == 1.5
    assert (m.prompt_tokens, m.cached_prompt_tokens, m.generated_tokens, m.preemptions, m.finish_reason) == (10, 0, 3, 0, "length")
    assert m.cache_hit_kind == "miss" and m.prefill_tokens_per_s == 10.0
    snap = engine.snapshot
    assert snap.time == 5.0 and snap.counters.requests_finished == 1 and dict(snap.finished_by_reason) == {"length": 1}
    assert snap.recent_requests[0]["request_id"] == "r" and snap.recent_requests[0]["time_to_first_token"] == 2.0
    assert snap.last_step.batch_size == 1 and snap.last_step.decode_tokens == 1 and snap.last_step.prefill_tokens == 0
    assert snap.computed_prompt_tokens == 10 and snap.counters.generated_tokens == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.running = 5  # exporters cannot change what the engine published


def test_a_step_of_several_tokens_splits_its_gap_over_them(tiny_llama_path):
    """A decode run (or a verified draft) gives a request several tokens in one step: the record keeps one latency per
    token after the first, the step's gap split evenly, so they still sum to the decode time."""
    engine = tiny_engine(tiny_llama_path, max_num_batched_tokens=8, decode_run_ms=15)
    clock = engine.clock = FakeClock()
    engine.timer = lambda: 0.0  # forwards that take no time: the next step of decodes is a run of the most
    engine.add_request(GenerationRequest("r", tuple(range(5, 15)), SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)))
    outs = []
    for t in (1.0, 2.0, 3.5, 5.0):
        clock.t = t
        outs += engine.step()
    m = outs[-1].metrics
    assert [len(o.outputs[0].delta_token_ids) for o in outs] == [1, 1, 4] and outs[-1].finished
    assert m.inter_token_latencies == [1.5, 0.375, 0.375, 0.375, 0.375] and m.decode_time == 3.0 and m.time_per_output_token == 0.6
    assert engine.snapshot.last_step.decode_tokens == 4


def test_a_decoding_engine_publishes_a_snapshot_at_most_every_publish_s_but_after_every_prefill(tiny_llama_path):
    from shoal.engine.stats import PUBLISH_S  # noqa: PLC0415

    engine = tiny_engine(tiny_llama_path, max_num_batched_tokens=8, decode_run_ms=0)
    clock = engine.clock = FakeClock()
    engine.add_request(GenerationRequest("r", tuple(range(5, 15)), SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)))
    published = []
    for i in range(12):
        clock.t = 1.0 + i * PUBLISH_S / 4
        engine.step()
        published.append(engine.snapshot.time == clock.t)
    # two prefill steps (8 + 2 prompt tokens), then decodes: one snapshot every 4 steps of a quarter of PUBLISH_S
    assert published == [True, True, False, False, False, True, False, False, False, True, False, False]
    assert (engine.snapshot.counters.generated_tokens, engine.stats.generated_tokens) == (9, 11)  # step 10's, two steps old


def test_throughput_windows_are_exact_over_minutes_of_steps(tiny_llama_path):
    """Tokens a second over the last 10 s and 60 s, from the oldest sample inside each window to the newest, under a
    fake clock that steps 2 s at a time for three minutes (samples leave each window as they age out of it)."""
    engine = tiny_engine(tiny_llama_path)
    clock = engine.clock = FakeClock()
    monitor = engine.monitor
    for step in range(91):  # t = 0, 2, ..., 180; 3 generated tokens a step
        clock.t = 2.0 * step
        engine.stats.generated_tokens = 3 * step
        monitor.publish([])
        rates = dict(engine.snapshot.generation_throughput)
        if step:
            # the oldest sample inside a window of w seconds is w // 2 steps back (or the first): 3 tokens per 2 s
            assert rates == {"10s": 1.5, "60s": 1.5}, (step, rates)
    assert [len(monitor._windows[w]) for w in (10.0, 60.0)] == [6, 31]  # only what each window still sees
    clock.t = 181.0  # a step of nothing new, a second later: 15 tokens over 11 s of the short window, 90 over 61
    monitor.publish([])
    assert dict(engine.snapshot.generation_throughput) == {"10s": 12 / 9, "60s": 87 / 59}


def test_a_cache_hit_is_recorded_with_its_kind(tiny_llama_path):
    engine = tiny_engine(tiny_llama_path)
    prompt = tuple(range(5, 45))
    outs = []
    for rid in ("a", "b"):
        engine.add_request(GenerationRequest(rid, prompt, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)))
        while engine.has_unfinished():
            outs += engine.step()
    b = next(o for o in outs if o.request_id == "b" and o.finished).metrics
    assert b.cache_hit_kind == "supersequence" and b.cached_prompt_tokens == 39 and b.cached_fraction == 39 / 40
    assert [r["request_id"] for r in engine.snapshot.recent_requests] == ["b", "a"]  # newest first


def metrics(h, **kw) -> dict:
    """{(name, labels as a sorted tuple): value} from a /metrics scrape."""
    r = h.get("/metrics", **kw)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            labels = dict(s.labels)
            if s.name.startswith("shoal:") and not s.name.startswith("shoal:http_requests"):
                assert labels.pop("model_name") != "", s.name  # every shoal series names its model (vLLM's label)
            out[(s.name, tuple(sorted(labels.items())))] = s.value
    return out


@pytest.fixture(scope="module")
def srv(tiny_llama_path):
    with LiveServer(tiny_engine(tiny_llama_path, max_model_len=256), ServerSettings(log_requests=False, api_key="k", metrics_public=True)) as s:
        yield s


def test_metrics_count_exactly_what_a_script_of_requests_did(srv):
    auth = {"Authorization": "Bearer k"}
    client = srv.openai(api_key="k")
    name = srv.state.model_name
    convo = [{"role": "user", "content": "The same question asked twice, to hit the prefix cache."}]
    done = [client.chat.completions.create(model=name, messages=convo, max_tokens=4, temperature=0.0, extra_body={"ignore_eos": True})
            for _ in range(2)]
    # a reply ended by a stop string: the regex makes the model write it
    stopped = client.chat.completions.create(model=name, messages=convo, max_tokens=20, stop=["world"],
                                             extra_body={"structured_outputs": {"regex": "hello world and more"}})
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].message.content == "hello "
    done.append(stopped)
    with srv.http() as h:
        assert h.post("/v1/chat/completions", headers=auth, json={"messages": convo, "temperature": -1}).status_code == 400
        # a stream the client walks away from
        with h.stream("POST", "/v1/chat/completions", headers=auth,
                      json={"messages": convo, "max_tokens": 200, "stream": True, "extra_body": None, "ignore_eos": True}) as r:
            next(r.iter_lines())
        srv.wait_until(lambda: srv.state.counters.client_disconnects == 1 and srv.engine.snapshot.counters.requests_aborted == 1,
                       what="the abort to reach the engine")
        m = metrics(h)  # --metrics-public: no key needed
    snap = srv.engine.snapshot
    gone = [r for r in snap.recent_requests if r["finish_reason"] == "abort"]
    assert len(gone) == 1 and gone[0]["client_disconnected"] is True
    assert not any(r["client_disconnected"] for r in snap.recent_requests if r["finish_reason"] != "abort")
    assert m[("shoal:prompt_tokens_total", ())] == snap.counters.prompt_tokens == sum(r.usage.prompt_tokens for r in done) + done[0].usage.prompt_tokens
    assert m[("shoal:prompt_tokens_cached_total", ())] == snap.counters.cached_prompt_tokens
    assert snap.counters.cached_prompt_tokens >= sum(r.usage.prompt_tokens_details.cached_tokens for r in done) > 0
    assert m[("shoal:generation_tokens_total", ())] == snap.counters.generated_tokens
    reasons = {k[1][0][1]: v for k, v in m.items() if k[0] == "shoal:request_success_total"}
    assert reasons == {"stop": 1, "length": 2, "abort": 1, "error": 0}
    assert m[("shoal:request_aborts_total", ())] == 1 and m[("shoal:client_disconnects_total", ())] == 1
    assert m[("shoal:http_requests_total", (("route", "/v1/chat/completions"), ("status", "400")))] == 1
    assert m[("shoal:http_requests_total", (("route", "/v1/chat/completions"), ("status", "200")))] == 4
    # histograms: one observation per finished request, sums equal to what the responses said, by protocol
    chat = (("protocol", "openai_chat"),)
    assert m[("shoal:time_to_first_token_seconds_count", chat)] == 3
    assert m[("shoal:request_generation_tokens_sum", chat)] == sum(r.usage.completion_tokens for r in done)
    assert m[("shoal:request_prompt_tokens_sum", chat)] == sum(r.usage.prompt_tokens for r in done)
    assert m[("shoal:inter_token_latency_seconds_count", chat)] == sum(r.usage.completion_tokens - 1 for r in done)
    assert not any(dict(k[1]).get("protocol") not in (None, "openai_chat") for k in m)  # chat requests only here
    # the three finished requests looked up the cache; the walked-away stream did too unless its abort came first
    # (its first line can arrive before the engine admits it: seen once on a busy machine)
    assert m[("shoal:prefix_cache_queries_total", ())] >= 3
    assert m[("shoal:model_loaded", ())] == 1 and m[("shoal:num_requests_running", ())] == 0
    info = next(k for k in m if k[0] == "shoal:build_info")
    assert dict(info[1])["dtype"] == "float32" and dict(info[1])["device"] == "cpu"
    assert ("process_cpu_seconds_total", ()) in m  # the default collectors stay on


def test_stats_reports_the_snapshot_and_recent_requests(srv):
    client = srv.openai(api_key="k")
    client.chat.completions.create(model=srv.state.model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    with srv.http() as h:
        stats = h.get("/stats", headers={"x-api-key": "k"}).json()
    assert set(stats["throughput"]) == {"prompt_tokens_per_s", "generation_tokens_per_s"}
    assert set(stats["throughput"]["generation_tokens_per_s"]) == {"10s", "60s"}
    newest = stats["recent_requests"][0]
    assert newest["generated_tokens"] == 3 and newest["time_to_first_token"] > 0 and len(newest["inter_token_latencies"]) == 2
    pc = stats["prefix_cache"]
    assert 0 <= pc["hit_rate"] <= 1 and 0 <= pc["average_match_fraction"] <= 1 and "hits_extension" in pc
    assert stats["kv_total_bytes"] > 0 and stats["last_step"]["batch_size"] >= 1


def test_every_family_is_there_from_the_start_and_a_lost_rank_is_not_loaded(tiny_llama_path):
    with LiveServer(tiny_engine(tiny_llama_path, max_model_len=64)) as s:
        families = {f.name: f for f in text_string_to_metric_families(httpx.get(s.url + "/metrics").text)}
        assert families["shoal:prefix_cache_queries"].samples[0].value == 0  # before any request: rate() sees the first
        assert families["shoal:model_loaded"].samples[0].value == 1
        s.engine.executor.failure = "rank 1 is unreachable"  # what a lost rank leaves on the executor
        try:
            families = {f.name: f for f in text_string_to_metric_families(httpx.get(s.url + "/metrics").text)}
            assert families["shoal:model_loaded"].samples[0].value == 0  # a real lost rank: test_tensor_parallel.py
        finally:
            del s.engine.executor.failure


def test_metrics_need_the_key_unless_public(tiny_llama_path):
    with LiveServer(tiny_engine(tiny_llama_path, max_model_len=64), ServerSettings(log_requests=False, api_key="k")) as s:
        assert httpx.get(s.url + "/metrics").status_code == 401
        assert httpx.get(s.url + "/metrics", headers={"x-api-key": "k"}).status_code == 200


def test_json_log_lines():
    record = logging.LogRecord("shoal.engine", logging.INFO, __file__, 1, "prompt %d tok/s", (12,), None)
    entry = json.loads(JsonFormatter().format(record))
    assert entry["message"] == "prompt 12 tok/s" and entry["level"] == "info" and entry["logger"] == "shoal.engine"
    assert entry["time"].endswith("+00:00")


def test_started_worker_processes_log_as_the_server_does(monkeypatch, capsys):
    """`shoal serve --log-format json` starts its tensor- or pipeline-parallel ranks as processes;
    they read the format and level from the environment the CLI set, and add their rank."""
    from shoal.cli import _setup_logging
    from shoal.executor import worker

    root = logging.getLogger()
    saved = root.handlers[:], root.level
    monkeypatch.setenv("SHOAL_LOG_FORMAT", "text")
    monkeypatch.setenv("SHOAL_LOG_LEVEL", "info")
    try:
        _setup_logging("debug", "json")  # what `shoal serve` does before it starts any rank
        assert (os.environ["SHOAL_LOG_FORMAT"], os.environ["SHOAL_LOG_LEVEL"]) == ("json", "debug")
        worker.setup_logging(3)  # what a started rank does
        logging.getLogger("shoal.worker").debug("loaded %d layers", 5)
    finally:
        for h in root.handlers[:]:
            root.removeHandler(h)
        for h in saved[0]:
            root.addHandler(h)
        root.setLevel(saved[1])
    entry = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert entry["rank"] == 3 and entry["message"] == "loaded 5 layers" and entry["level"] == "debug"
    assert entry["logger"] == "shoal.worker"
