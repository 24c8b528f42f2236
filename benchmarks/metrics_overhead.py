"""What observability costs: the engine's per-step snapshot at 32 streams, and a /metrics scrape under load.

    .venv/bin/python benchmarks/metrics_overhead.py [--rounds 3]

1. Offline, default model and configuration, 32 prompts x 128 output tokens (ignore_eos):
   the engine as it is (timing records, a frozen snapshot after every step) against the
   same engine with its stats monitor switched off, taking turns for ROUNDS rounds.
   Output tokens/s, median round.
2. `shoal serve` (default configuration) under 32 concurrent streams, with /metrics
   scraped every 0.5 s meanwhile: the scrape's latency, median and max.

Writes benchmarks/results/metrics_overhead.{md,json}.
"""

from __future__ import annotations

import argparse
import json
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

from shoal import LLM, SamplingParams

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
STREAMS = 32
OUTPUT = 128
SCRAPE_PATH = os.environ.get("SHOAL_SCRAPE_PATH", "/metrics")  # /health: the same wait for a trivial route
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
        times = []
        while any(t.is_alive() for t in load):
            t0 = time.perf_counter()
            r = httpx.get(url + SCRAPE_PATH, timeout=30)
            times.append(time.perf_counter() - t0)
            assert r.status_code == 200
            time.sleep(0.5)
        for t in load:
            t.join()
        load_tok_s = STREAMS * OUTPUT / (time.perf_counter() - started)
        return {"scrapes": len(times), "median_ms": statistics.median(times) * 1e3, "max_ms": max(times) * 1e3, "load_tok_s": load_tok_s}
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--scrape-only", action="store_true", help="measure the scrape under load only (keep the offline figures)")
    args = ap.parse_args()
    if args.scrape_only:
        result = json.loads((RESULTS / "metrics_overhead.json").read_text())
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
           "ratio": statistics.median(on) / statistics.median(off), "scrape": scrape})


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write(result: dict) -> None:
    on, off, scrape = result["tok_s_with_stats"], result["tok_s_without"], result["scrape"]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "metrics_overhead.json").write_text(json.dumps(result, indent=2))
    lines = [f"# Observability cost: {STREAMS} streams x {OUTPUT} tokens, default model and configuration",
             "",
             "| | output tok/s (median of rounds) |", "|---|---|",
             f"| engine with timing records and per-step snapshot | {statistics.median(on):.1f} |",
             f"| same engine, stats monitor off | {statistics.median(off):.1f} |",
             f"| ratio | {result['ratio']:.3f} |",
             "",
             f"`/metrics` scraped every 0.5 s under {STREAMS} streams on `shoal serve`: median {scrape['median_ms']:.1f} ms, "
             f"max {scrape['max_ms']:.1f} ms over {scrape['scrapes']} scrapes."]
    if "health_same_load" in result:  # SHOAL_SCRAPE_PATH=/health ... --scrape-only, recorded by hand
        h = result["health_same_load"]
        lines.append(f"`/health`, which does nothing, under the same load: median {h['median_ms']:.1f} ms, max {h['max_ms']:.1f} ms.")
    (RESULTS / "metrics_overhead.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
