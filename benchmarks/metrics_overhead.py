"""What observability costs: the engine's per-step snapshot at 32 streams, and a /metrics scrape under load.

    .venv/bin/python benchmarks/metrics_overhead.py [--rounds 3]

1. Offline, default model and configuration, 32 prompts x 128 output tokens (ignore_eos):
   the engine as it is (timing records, a frozen snapshot after every step) against the
   same engine with its stats monitor switched off, taking turns for ROUNDS rounds.
   Output tokens/s, median round.
2. `shoal serve` (default configuration) under 32 concurrent streams, with /metrics
   scraped every 0.5 s meanwhile: the scrape's latency, median and max, two ways.
   Prometheus keeps its connection to a target open, so the main figure reuses one
   connection; the second opens a new TCP connection for every scrape (http.client,
   nothing else). `/health`, a route that does nothing, is timed the same way beside them.
   The client is built once: `httpx.get` builds a new client, TLS context included, on
   every call, which costs ~40 ms of the client's own CPU even for plain HTTP. That
   cost was in the first version of this benchmark (a 64 ms median).

Writes benchmarks/results/metrics_overhead.{md,json}.
"""

from __future__ import annotations

import argparse
import http.client
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from tqdm import tqdm

from publish import load, machine, machine_line, publish, table
from shoal import LLM, SamplingParams

ROOT = Path(__file__).resolve().parent.parent
STREAMS = 32
OUTPUT = 128
PROMPTS = [f"Write a short story about a {w} who learns to sail." for w in
           ("cat", "dog", "fox", "owl", "bee", "eel", "yak", "ant", "bat", "cod", "elk", "emu", "gnu", "hen", "jay", "koi",
            "ram", "rat", "ape", "asp", "boa", "cow", "doe", "ewe", "hog", "kid", "pig", "sow", "tit", "wren", "crow", "mole")]


def offline_round(llm: LLM, monitor_on: bool) -> float:
    engine = llm.engine
    monitor = engine.monitor
    saved = monitor.step_done, monitor.publish
    if not monitor_on:
        monitor.step_done = lambda *a: None
        monitor.publish = lambda *a: None
    try:
        t = time.perf_counter()
        outs = llm.generate(PROMPTS[:STREAMS], SamplingParams(temperature=0.0, max_tokens=OUTPUT, ignore_eos=True))
        wall = time.perf_counter() - t
    finally:
        monitor.step_done, monitor.publish = saved
    return sum(o.num_generated_tokens for o in outs) / wall


def scrape_under_load(port: int) -> dict:
    url = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile("w", prefix="shoal-metrics-bench-", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", "shoal.cli", "serve", "--port", str(port)], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"shoal serve did not start; see {log.name}")
            time.sleep(0.5)

        def stream(prompt: str) -> None:
            body = {"model": "smollm2", "prompt": prompt, "max_tokens": OUTPUT, "temperature": 0, "ignore_eos": True}
            httpx.post(url + "/v1/completions", json=body, timeout=600)

        load = [threading.Thread(target=stream, args=(p,)) for p in PROMPTS[:STREAMS]]
        started = time.perf_counter()
        for t in load:
            t.start()
        times: dict[str, list[float]] = {"metrics": [], "metrics_new_connection": [], "health": []}
        with httpx.Client(base_url=url, timeout=30) as client:
            while any(t.is_alive() for t in load):
                times["metrics"].append(_timed(lambda: client.get("/metrics").status_code))
                times["metrics_new_connection"].append(_timed(lambda: _status_on_new_connection(port, "/metrics")))
                times["health"].append(_timed(lambda: client.get("/health").status_code))
                time.sleep(0.5)
        for t in load:
            t.join()
        load_tok_s = STREAMS * OUTPUT / (time.perf_counter() - started)
        return {"scrapes": len(times["metrics"]), "load_tok_s": load_tok_s,
                **{k: {"median_ms": statistics.median(v) * 1e3, "max_ms": max(v) * 1e3} for k, v in times.items()}}
    finally:
        proc.terminate()
        proc.wait(30)


def _timed(get_status) -> float:
    t0 = time.perf_counter()
    status = get_status()
    assert status == 200, status
    return time.perf_counter() - t0


def _status_on_new_connection(port: int, path: str) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--scrape-only", action="store_true", help="measure the scrape under load only (keep the offline figures)")
    ap.add_argument("--report-only", action="store_true", help="write the report again from results/metrics_overhead.json")
    args = ap.parse_args()
    if args.report_only:
        write(load("metrics_overhead"))
        return
    if args.scrape_only:  # the offline figures, and the machine they were measured on, stay as saved
        result = load("metrics_overhead")
        result["scrape"] = scrape_under_load(_free_port())
        write(result)
        return
    llm = LLM()
    llm.generate(PROMPTS[:4], SamplingParams(max_tokens=8))  # warm-up
    on, off = [], []
    with tqdm(total=2 * args.rounds, desc="metrics overhead (offline)", file=sys.stderr) as bar:
        for _ in range(args.rounds):
            on.append(offline_round(llm, True))
            bar.update()
            off.append(offline_round(llm, False))
            bar.update()
    del llm
    scrape = scrape_under_load(_free_port())
    write({"streams": STREAMS, "output_tokens": OUTPUT, "rounds": args.rounds, "tok_s_with_stats": on, "tok_s_without": off,
           "ratio": statistics.median(on) / statistics.median(off), "scrape": scrape, "machine": machine()})


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write(result: dict) -> None:
    on, off, scrape = result["tok_s_with_stats"], result["tok_s_without"], result["scrape"]
    lines = [f"# Observability cost: {STREAMS} streams x {OUTPUT} tokens, default model and configuration", ""]
    if "machine" in result:  # results saved before the machine was recorded have none
        lines += [f"On {machine_line(result['machine'])}.", ""]
    lines += [*table(["", "output tok/s (median of rounds)"],
                     [["engine with timing records and per-step snapshot", f"{statistics.median(on):.1f}"],
                      ["same engine, stats monitor off", f"{statistics.median(off):.1f}"],
                      ["ratio", f"{result['ratio']:.3f}"]]),
              "",
              f"Scraped every 0.5 s under {STREAMS} streams on `shoal serve` ({scrape['load_tok_s']:.0f} output tok/s meanwhile), "
              f"{scrape['scrapes']} scrapes:",
              "",
              *table(["request", "median ms", "max ms"],
                     [[label, f"{scrape[key]['median_ms']:.1f}", f"{scrape[key]['max_ms']:.1f}"]
                      for key, label in (("metrics", "`/metrics`, one kept-open connection (as Prometheus scrapes)"),
                                         ("metrics_new_connection", "`/metrics`, a new TCP connection each time"),
                                         ("health", "`/health` (does nothing), kept-open connection"))])]
    publish("metrics_overhead", result, lines)


if __name__ == "__main__":
    main()
