"""`shoal bench` against a fake OpenAI-compatible server whose chunks, delays and usage are known.

The fake server sends an empty role chunk at once, the first content chunk
FIRST_DELAY after the request arrived, the others GAP apart, then a usage chunk
whose completion_tokens (USAGE_OUT) differs from the number of content chunks,
so a bench that counted chunks instead of reading usage would be caught. The
latency checks compare the measurement with these known delays (lower bound:
the delay itself; upper bound: a generous scheduling margin): they are
correctness checks of the timer, not speed claims.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from fake_openai_server import CHUNKS, FIRST_DELAY, GAP, USAGE_IN, USAGE_OUT
from shoal.bench import RequestResult, percentile, run, summarize, tpot

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class FakeServer:
    """tests/fake_openai_server.py in its own process (so its event loop does not share this one's GIL),
    on a free 127.0.0.1 port. `bodies` / `arrivals` read what it received; `reset(fail_every=k)` clears them
    and makes it answer 500 to every k-th request."""

    def __init__(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "tests", "fake_openai_server.py"), str(self.port)],
            env={**os.environ, "PYTHONPATH": ROOT}, cwd=ROOT,
        )
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", trust_env=False, timeout=10)

    def _log(self) -> dict:
        return self.http.get("/_test/log").json()

    @property
    def bodies(self) -> list[dict]:
        return self._log()["bodies"]

    @property
    def arrivals(self) -> list[float]:
        return self._log()["arrivals"]

    @property
    def overlaps(self) -> list[int]:
        """Per request, how many others the server was still answering when it arrived."""
        return self._log()["overlaps"]

    def reset(self, fail_every: int | None = None) -> None:
        self.http.post("/_test/reset", json={"fail_every": fail_every}).raise_for_status()

    def __enter__(self) -> FakeServer:
        deadline = time.monotonic() + 30
        while True:
            assert self.proc.poll() is None, "the fake server exited"
            try:
                self.http.get("/v1/models").raise_for_status()
                return self
            except httpx.TransportError:
                assert time.monotonic() < deadline, "the fake server did not start"
                time.sleep(0.05)

    def __exit__(self, *exc) -> None:
        self.http.close()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module")
def fake():
    with FakeServer() as s:
        yield s


# ---------------------------------------------------------------- pure statistics


def test_percentile_exact():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([4, 1, 3, 2], 50) == 2.5  # unsorted input; between the two middle values
    xs = list(range(11))  # 0..10
    assert percentile(xs, 50) == 5.0
    assert percentile(xs, 90) == 9.0
    assert percentile(xs, 99) == pytest.approx(9.9)
    assert percentile(xs, 0) == 0.0 and percentile(xs, 100) == 10.0
    assert percentile([10, 20], 25) == 12.5


def test_tpot_exact():
    assert tpot(1.0, 0.2, 5) == pytest.approx(0.2)  # (1.0 - 0.2) / 4
    assert tpot(0.5, 0.1, 2) == pytest.approx(0.4)
    assert tpot(0.5, 0.1, 1) is None and tpot(0.5, 0.1, 0) is None


def test_summarize_exact():
    results = [
        RequestResult(ok=True, ttft=0.1, itl=[0.02, 0.04], e2e=0.5, prompt_tokens=10, output_tokens=5, usage_reported=True),
        RequestResult(ok=True, ttft=0.3, itl=[0.06], e2e=0.9, prompt_tokens=20, output_tokens=3, usage_reported=True),
        RequestResult(ok=False, error="HTTP 500: boom"),
        RequestResult(ok=False, error="HTTP 500: boom"),
    ]
    s = summarize(results, duration=2.0)
    assert (s["num_requests"], s["completed"], s["failed"]) == (4, 2, 2)
    assert s["errors"] == {"HTTP 500: boom": 2}
    assert (s["prompt_tokens"], s["output_tokens"]) == (30, 8)
    assert s["request_throughput"] == 1.0
    assert s["output_throughput"] == 4.0
    assert s["total_token_throughput"] == 19.0
    assert s["ttft_ms"]["p50"] == pytest.approx(200.0) and s["ttft_ms"]["mean"] == pytest.approx(200.0)
    # TPOT: (0.5-0.1)/4 = 0.1 and (0.9-0.3)/2 = 0.3
    assert s["tpot_ms"]["p50"] == pytest.approx(200.0) and s["tpot_ms"]["p90"] == pytest.approx(280.0)
    assert s["itl_ms"]["p50"] == pytest.approx(40.0) and s["itl_ms"]["p99"] == pytest.approx(59.6)
    assert s["e2e_ms"]["p50"] == pytest.approx(700.0)


# ---------------------------------------------------------------- against the fake server


def _check_latencies(r: dict) -> None:
    """What the bench measured against what the fake server does, with no upper bound on time: a busy machine
    delays the client, never the server's schedule earlier (a timing bound here failed CI with a build beside it).
    The server sends the first content chunk FIRST_DELAY after a request arrives and the others GAP apart, so no
    client can see them sooner; on the client a chunk can be read late (a longer gap) and the next on time (a
    shorter one), so the gaps' lower bound allows a little. The summaries are the per-request figures'."""
    ok = [q for q in r["requests"] if q["ok"]]
    for name, key, scale in (("ttft_ms", "ttft", 1000), ("e2e_ms", "e2e", 1000)):
        for p in (50, 90):
            assert r[name][f"p{p}"] == pytest.approx(percentile([q[key] for q in ok], p) * scale), name
    assert r["ttft_ms"]["p50"] >= FIRST_DELAY * 1000
    assert r["itl_ms"]["p50"] == pytest.approx(percentile([g for q in ok for g in q["itl"]], 50) * 1000)
    assert r["itl_ms"]["p50"] >= (GAP - 0.005) * 1000, r["itl_ms"]
    for req in ok:
        assert len(req["itl"]) == len(CHUNKS) - 1  # one gap per content chunk after the first
        assert req["ttft"] >= FIRST_DELAY
        assert req["e2e"] >= FIRST_DELAY + GAP * (len(CHUNKS) - 1)
        assert req["e2e"] >= req["ttft"] + sum(req["itl"]) - 1e-9  # the stream ends after its last chunk
        assert tpot(req["e2e"], req["ttft"], req["output_tokens"]) == pytest.approx((req["e2e"] - req["ttft"]) / (USAGE_OUT - 1))
    assert r["tpot_ms"]["p50"] == pytest.approx(
        percentile([(q["e2e"] - q["ttft"]) / (USAGE_OUT - 1) for q in r["requests"] if q["ok"]], 50) * 1000
    )


def test_random_workload_counts_and_latencies(fake):
    fake.reset()
    result = run(base_url=fake.url, workload="random", concurrency=[1, 4], num_requests=8, seed=3,
                 input_len=(5, 9), output_len=(4, 6), progress=False)
    assert result["model"] == "fake-model"
    assert [r["concurrency"] for r in result["runs"]] == [1, 4]
    bodies = fake.bodies
    assert len(bodies) == 16
    for b in bodies:
        assert b["stream"] is True and b["stream_options"] == {"include_usage": True}
        assert b["ignore_eos"] is True and 4 <= b["max_tokens"] <= 6
        assert 5 <= len(b["messages"][0]["content"].split()) <= 9
    # the same seed gives the same prompts in both runs (in any order: 4 in flight arrive in any order)
    bodies = fake.bodies
    assert sorted(json.dumps(b) for b in bodies[:8]) == sorted(json.dumps(b) for b in bodies[8:])
    for r in result["runs"]:
        assert (r["num_requests"], r["completed"], r["failed"]) == (8, 8, 0)
        assert r["output_tokens"] == 8 * USAGE_OUT  # from usage, not the 5 chunks
        assert r["prompt_tokens"] == 8 * USAGE_IN
        assert r["requests_without_usage"] == 0
        assert r["output_throughput"] == pytest.approx(r["output_tokens"] / r["duration_s"])
        assert r["total_token_throughput"] == pytest.approx((r["output_tokens"] + r["prompt_tokens"]) / r["duration_s"])
        assert r["request_throughput"] == pytest.approx(8 / r["duration_s"])
        _check_latencies(r)
    # one at a time takes at least 8 requests' time; concurrency 4 really overlaps them: the server was answering
    # others when some of them arrived (counted by the server, not timed)
    one = FIRST_DELAY + GAP * (len(CHUNKS) - 1)
    assert result["runs"][0]["duration_s"] >= 8 * one
    assert max(fake.overlaps[8:]) >= 1


def test_completions_endpoint_and_request_rate(fake):
    fake.reset()
    result = run(base_url=fake.url, model="m", workload="random", request_rate=40.0, num_requests=10, seed=1,
                 input_len=(3, 3), output_len=(2, 2), endpoint="completions", progress=False)
    (r,) = result["runs"]
    assert r["request_rate"] == 40.0 and r["concurrency"] is None
    assert (r["completed"], r["failed"], r["output_tokens"]) == (10, 0, 10 * USAGE_OUT)
    assert all(b["model"] == "m" and len(b["prompt"].split()) == 3 and b["max_tokens"] == 2 for b in fake.bodies)
    # Poisson arrivals: not all at once (10 arrivals at 40/s span ~0.2 s on average)
    assert fake.arrivals[-1] - fake.arrivals[0] > 0.02
    _check_latencies(r)


def test_failed_requests_are_counted_with_their_error(fake):
    fake.reset(fail_every=3)
    try:
        result = run(base_url=fake.url, workload="chat", concurrency=[3], num_requests=9, max_tokens=16, progress=False)
        bodies = fake.bodies
    finally:
        fake.reset()
    (r,) = result["runs"]
    assert (r["num_requests"], r["completed"], r["failed"]) == (9, 6, 3)
    assert r["errors"] == {"HTTP 500: boom": 3}
    assert r["output_tokens"] == 6 * USAGE_OUT
    assert sum(1 for q in r["requests"] if not q["ok"] and q["error"] == "HTTP 500: boom") == 3
    assert len(bodies) == 9 and all(b["max_tokens"] == 16 and "ignore_eos" not in b for b in bodies)


def test_agentic_turns_append_the_reply_and_wait_for_it(fake):
    fake.reset()
    result = run(base_url=fake.url, workload="agentic", concurrency=[4], num_requests=8, turns=3, max_tokens=8, progress=False)
    (r,) = result["runs"]
    assert (r["completed"], r["failed"]) == (8, 0)
    bodies = fake.bodies
    system = bodies[0]["messages"][0]
    assert system["role"] == "system" and "read_file" in system["content"] and len(system["content"]) > 1000
    reply = "".join(CHUNKS)
    by_conv: dict[str, list[tuple[int, list]]] = {}
    log = fake._log()
    for b, t in zip(log["bodies"], log["arrivals"]):
        msgs = b["messages"]
        assert msgs[0] == system  # every conversation shares the system prompt
        by_conv.setdefault(msgs[1]["content"], []).append((t, msgs))
    assert sorted(len(v) for v in by_conv.values()) == [2, 3, 3]  # 8 turns: ceil(8/3) = 3 conversations
    one = FIRST_DELAY + GAP * (len(CHUNKS) - 1)
    for turns in by_conv.values():
        for k, (t, msgs) in enumerate(turns):
            assert len(msgs) == 2 + 2 * k
            if k:
                prev_t, prev = turns[k - 1]
                assert msgs[: len(prev)] == prev  # the earlier turns, unchanged: a shared prefix
                assert msgs[len(prev)] == {"role": "assistant", "content": reply}
                assert msgs[-1]["role"] == "user"
                assert t - prev_t >= one  # sent only after the previous reply had arrived
    assert r["ttft_ms_turn2_on"]["p50"] >= FIRST_DELAY * 1000
    assert sorted(q["turn"] for q in r["requests"]) == [1, 1, 1, 2, 2, 2, 3, 3]


def test_cli_writes_json(fake, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "one two three"}) + "\n" + json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    out = tmp_path / "results.json"
    env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONIOENCODING": "utf-8"}
    env.pop("SHOAL_API_KEY", None)
    env.pop("OPENAI_API_KEY", None)
    p = subprocess.run(
        [sys.executable, "-m", "shoal.cli", "bench", "--base-url", fake.url, "--workload", "file", "--file", str(data),
         "--concurrency", "1", "2", "--num-requests", "4", "--out", str(out), "--no-progress"],
        capture_output=True, text=True, timeout=60, env=env, cwd=ROOT,
    )
    assert p.returncode == 0, p.stderr
    assert "TTFT p50" in p.stdout and "c=1" in p.stdout and "c=2" in p.stdout
    res = json.loads(out.read_text())
    assert set(res) >= {"machine", "args", "model", "runs"}
    assert set(res["machine"]) >= {"cores", "cpu_model", "python", "shoal"}
    assert res["machine"]["cores"] == os.cpu_count()
    assert res["args"]["workload"] == "file" and res["args"]["concurrency"] == [1, 2] and res["args"]["api_key"] is None
    assert len(res["runs"]) == 2
    for r in res["runs"]:
        for key in ("request_throughput", "output_throughput", "total_token_throughput", "completed", "failed", "errors"):
            assert key in r
        for key in ("ttft_ms", "tpot_ms", "itl_ms"):
            assert set(r[key]) >= {"p50", "p90", "p99"}
        assert (r["completed"], r["failed"], r["output_tokens"]) == (4, 0, 4 * USAGE_OUT)
        assert len(r["requests"]) == 4
        _check_latencies(r)


def test_cli_fails_cleanly_when_no_server():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": ROOT}
    p = subprocess.run([sys.executable, "-m", "shoal.cli", "bench", "--base-url", f"http://127.0.0.1:{port}/v1", "--no-progress"],
                       capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert p.returncode != 0
    assert "not reachable" in p.stderr and "Traceback" not in p.stderr


def test_extra_body_adds_and_removes_fields(fake):
    fake.reset()
    extra = {"ignore_eos": None, "logit_bias": {"2": -100}, "temperature": 0.5}
    result = run(base_url=fake.url, workload="random", concurrency=[2], num_requests=4, input_len=(3, 3),
                 output_len=(5, 5), extra_body=extra, temperature=0.0, progress=False)
    assert result["runs"][0]["completed"] == 4
    for b in fake.bodies:
        assert "ignore_eos" not in b  # removed by the null
        assert b["logit_bias"] == {"2": -100} and b["temperature"] == 0.5  # extra_body wins over --temperature
        assert b["max_tokens"] == 5 and b["stream"] is True


def test_cli_rejects_bad_extra_body(fake):
    env = {**os.environ, "PYTHONPATH": ROOT}
    p = subprocess.run([sys.executable, "-m", "shoal.cli", "bench", "--base-url", fake.url, "--extra-body", "{nope",
                        "--no-progress"], capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert p.returncode == 2
    assert "--extra-body is not valid JSON" in p.stderr and "Traceback" not in p.stderr
