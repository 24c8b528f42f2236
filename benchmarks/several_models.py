"""Several models in one server: load times, a first request that must load its model, two models served at once.

    .venv/bin/python benchmarks/several_models.py [--rounds 2] [--quick]

Models: the default GGUF (SmolLM2-135M-Instruct, Q4_1) and the same model as a Hugging Face folder (float32
safetensors, exported from the GGUF with transformers into .peers/smollm2-hf once, as compare_peers does).

    cold-load       POST /models/load (llama.cpp's route, which shoal serves too) until the model is listed as loaded,
                    unloaded between (median of 3)
    first-request   TTFT of a streamed chat request whose model is unloaded, against the same request once loaded
    two-at-once     output tok/s of shoal bench's chat workload (4 and 16 streams, 64 tokens) on model a alone, on b
                    alone, and on both at once (two bench runs side by side); the GGUF under two names, so a and b
                    are the same work. shoal with steps at the same time (the default) and --models-step-turns
    cycles          shoal's RSS and threads after each of 20 load and unload cycles of the HF folder

The peer, where `make bench-peers` built it: llama-server in router mode (--models-dir, a process per model, -np 16),
for the GGUF's cold load and first requests, and two models at once. One server process at a time. Each
throughput row is the upper median round by total. Writes benchmarks/results/several-models-KIND.{md,json}
(KIND: publish.cpu_kind).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from compare_peers import HF_EXPORT, LLAMA_SERVER, THREADS, Peer, Server, export_hf_folder  # noqa: E402
from publish import cpu_kind, machine, machine_line, publish, table  # noqa: E402

from shoal.bench import BenchConfig, run  # noqa: E402
from shoal.model.loader import resolve_model_path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SHOAL = ROOT / ".venv" / "bin" / "shoal"
CHAT = [{"role": "user", "content": "Write two sentences about the sea."}]


class ShoalModels(Peer):
    """`shoal serve` with a YAML config (its `models:` list), as compare_peers' Server runs a peer."""

    def __init__(self, name: str, config: dict, log_dir: Path, *flags: str) -> None:
        import yaml

        super().__init__(name=name, label=f"shoal {' '.join(flags)}".strip(), health_path="/health", available=True)
        self.config_path = log_dir / f"{name}.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.flags = flags

    def command(self, port: int, gguf: Path) -> list[str]:
        return [sys.executable, "-m", "shoal.cli", "serve", "--config", str(self.config_path), "--port", str(port),
                "--no-log-requests", *self.flags]


class LlamaRouter(Peer):
    """llama-server in router mode: every .gguf in a directory, each loaded in a process of its own on demand."""

    def __init__(self, name: str, models: dict[str, str], log_dir: Path, threads: int = THREADS) -> None:
        super().__init__(name=name, label="llama-server router", health_path="/health", available=LLAMA_SERVER.exists())
        self.threads = threads  # each model's process's
        self.dir = log_dir / name
        self.dir.mkdir(exist_ok=True)
        for alias, path in models.items():
            (self.dir / f"{alias}.gguf").symlink_to(path)

    def command(self, port: int, gguf: Path) -> list[str]:
        return [str(LLAMA_SERVER), "--models-dir", str(self.dir), "--models-max", "4", "--host", "127.0.0.1", "--port",
                str(port), "-t", str(self.threads), "-tb", str(self.threads), "-np", "16", "-c", str(16 * 4096), "--log-disable"]


def start(name: str, config: dict, log_dir: Path, *flags: str) -> Server:
    peer = LlamaRouter(name, config, log_dir, *flags) if name.startswith("llama") else ShoalModels(name, config, log_dir, *flags)
    srv = Server(peer, Path(), log_dir)
    srv.wait_ready(300)
    srv.url = srv.base_url.removesuffix("/v1")
    srv.http = httpx.Client(base_url=srv.url, timeout=600, trust_env=False)
    return srv


def rss_mib(srv: Server) -> float:
    for line in Path(f"/proc/{srv.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def threads(srv: Server) -> int:
    return len(os.listdir(f"/proc/{srv.proc.pid}/task"))


def hf_folder() -> Path:
    """The default model as a Hugging Face folder (float32 safetensors), exported once into .peers/."""
    export_hf_folder(resolve_model_path("smollm2"), HF_EXPORT)
    return HF_EXPORT


def ttft(srv: Server, model: str) -> float:
    t0 = time.perf_counter()
    body = {"model": model, "messages": CHAT, "max_tokens": 8, "temperature": 0, "stream": True}
    # A connection of its own: the router closed a kept-alive one between requests ("disconnected without a response").
    with httpx.Client(base_url=srv.url, timeout=600, trust_env=False) as fresh, \
            fresh.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        first = None
        for line in r.iter_lines():  # read to the end: the next request starts on an idle server
            if first is None and line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError("no token came")
    return first


def status(srv: Server, name: str) -> str:
    """A model's status from llama.cpp's router list, which shoal serves too (GET /models)."""
    for m in srv.http.get("/models").json()["data"]:
        if m["id"] == name:
            return m["status"]["value"]
    raise RuntimeError(f"{srv.peer.name} offers no model {name!r}")


def settle(srv: Server, name: str, want: str) -> None:
    deadline = time.monotonic() + 300
    while status(srv, name) != want:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} on {srv.peer.name} is not {want} after 300 s; see {srv.log_path}")
        time.sleep(0.02)


def unload(srv: Server, name: str) -> None:
    """llama.cpp's POST /models/unload (shoal's answers once done; the router's may answer first)."""
    if status(srv, name) == "loaded":
        srv.http.post("/models/unload", json={"model": name}).raise_for_status()
    settle(srv, name, "unloaded")


def cold_loads(srv: Server, names: list[str], repeats: int) -> dict:
    """POST /models/load until the model is listed as loaded."""
    out = {}
    for name in names:
        times = []
        for _ in range(repeats):
            unload(srv, name)
            t0 = time.perf_counter()
            srv.http.post("/models/load", json={"model": name}).raise_for_status()
            settle(srv, name, "loaded")
            times.append(time.perf_counter() - t0)
        out[name] = {"seconds": statistics.median(times), "all": times}
        print(f"  {srv.peer.name}: load {name} {statistics.median(times):.2f} s", file=sys.stderr)
    return out


def first_request(srv: Server, name: str, repeats: int) -> dict:
    cold, warm = [], []
    for _ in range(repeats):
        unload(srv, name)
        cold.append(ttft(srv, name))
        warm.append(ttft(srv, name))
    return {"cold_ttft_s": statistics.median(cold), "warm_ttft_s": statistics.median(warm)}


def chat_run(url: str, model: str, streams: int, requests: int, seed: int) -> dict:
    cfg = BenchConfig(base_url=url + "/v1", model=model, workload="chat", concurrency=[streams], num_requests=requests,
                      max_tokens=64, temperature=0.0, seed=seed, progress=False, extra_body={"ignore_eos": True})
    r = run(cfg)["runs"][0]
    if r["failed"]:
        raise RuntimeError(f"{r['failed']} requests failed: {r['errors']}")
    return r


def two_at_once(srv: Server, streams: int, requests: int, seed: int) -> dict:
    alone = {m: chat_run(srv.url, m, streams, requests, seed)["output_throughput"] for m in ("a", "b")}
    both: dict[str, dict] = {}
    threads = [threading.Thread(target=lambda m=m: both.update({m: chat_run(srv.url, m, streams, requests, seed + 1)}))
               for m in ("a", "b")]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    together = sum(r["output_tokens"] for r in both.values()) / wall
    return {"alone_a": alone["a"], "alone_b": alone["b"], "together_a": both["a"]["output_throughput"],
            "together_b": both["b"]["output_throughput"], "together_total": together,
            "together_ttft_p50_ms": {m: both[m]["ttft_ms"]["p50"] for m in both}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="fewer requests and cycles (a smoke run)")
    a = ap.parse_args()
    levels, repeats, cycles = ((4,), 1, 3) if a.quick else ((4, 16), 3, 20)
    gguf = str(resolve_model_path("smollm2"))
    results: dict = {"machine": machine(), "args": vars(a)}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        hf = hf_folder()
        offered = {"models": [{"model": gguf, "alias": "gguf"}, {"model": str(hf), "alias": "hf"}], "preload": "none"}
        print("cold loads, first requests and load/unload cycles", file=sys.stderr)
        srv = start("lifecycle", offered, tmp)
        try:
            results["cold_load"] = cold_loads(srv, ["gguf", "hf"], repeats)
            results["first_request"] = {n: first_request(srv, n, repeats) for n in ("gguf", "hf")}
            srv.http.delete("/v1/models").raise_for_status()
            results["cold_load_rss_mib"] = rss_mib(srv)
            srv.http.delete("/v1/models").raise_for_status()
            rss, counts = [rss_mib(srv)], [threads(srv)]
            for i in range(cycles):
                srv.http.post("/v1/models", json={"model": "hf"}).raise_for_status()
                srv.http.post("/v1/chat/completions", json={"model": "hf", "messages": CHAT, "max_tokens": 4}).raise_for_status()
                srv.http.delete("/v1/models/hf").raise_for_status()
                rss.append(rss_mib(srv))
                counts.append(threads(srv))
                print(f"  cycle {i + 1}/{cycles}: RSS {rss[-1]:.0f} MiB, {counts[-1]} threads", file=sys.stderr)
            results["cycles"] = {"rss_mib": rss, "threads": counts}
        finally:
            srv.http.close()
            srv.stop()
        if LLAMA_SERVER.exists():
            srv = start("llama-lifecycle", {"gguf": gguf}, tmp)
            try:
                results["llama"] = {"cold_load": cold_loads(srv, ["gguf"], repeats), "first_request": first_request(srv, "gguf", repeats)}
            finally:
                srv.http.close()
                srv.stop()
        two = {"models": [{"model": gguf, "alias": "a"}, {"model": gguf, "alias": "b"}], "preload": "all"}
        # The router as it starts (every model's process takes -t all cores), and with one thread per model's process
        # (two models on 2 cores: what its threads' spinning needs).
        llama = [("llama", (THREADS,)), ("llama-t1", (1,))] if LLAMA_SERVER.exists() else []
        modes = [("parallel", ()), ("turns", ("--models-step-turns",)), *llama]
        rounds: dict = {}
        for r in range(a.rounds):
            for mode, flags in modes:
                if mode == "llama" and r:  # its two processes crawl (see below): one round, 4 streams, is enough to show it
                    continue
                if mode.startswith("llama"):  # a directory of its own each time: the router offers what it holds
                    srv = start(f"{mode}-two-{r}", {"a": gguf, "b": gguf}, tmp, *flags)
                else:
                    srv = start(f"two-{mode}", two, tmp, *flags)
                try:
                    for m in ("a", "b"):  # loaded, then warm: first-call allocations are not what we measure
                        srv.http.post("/models/load", json={"model": m}).raise_for_status()
                        settle(srv, m, "loaded")
                        chat_run(srv.url, m, 2, 2, 999)
                    for streams in levels[:1] if mode == "llama" else levels:
                        requests = streams if mode == "llama" else 3 * streams
                        rounds.setdefault((mode, streams), []).append(two_at_once(srv, streams, requests, seed=r))
                        print(f"  {mode}, {streams} streams, round {r + 1}: {rounds[mode, streams][-1]}", file=sys.stderr)
                finally:
                    srv.http.close()
                    srv.stop()
        results["two_at_once"] = [{"mode": mode, "streams": streams, **sorted(runs, key=lambda x: x["together_total"])[len(runs) // 2]}
                                  for (mode, streams), runs in rounds.items()]
    kind = cpu_kind()
    c, f, cy = results["cold_load"], results["first_request"], results["cycles"]
    lines = [f"# Several models in one server ({kind})", "", f"Measured on {machine_line(results['machine'])}.",
             "The default GGUF (SmolLM2-135M-Instruct, Q4_1) and the same model as a Hugging Face folder (float32 "
             "safetensors, served in the default dtype); `benchmarks/several_models.py`.", "", "## Loading", ""]
    rows = [[f"shoal, {n}", f"{c[n]['seconds']:.2f} s", f"{f[n]['cold_ttft_s'] * 1000:.0f} ms", f"{f[n]['warm_ttft_s'] * 1000:.0f} ms"]
            for n in ("gguf", "hf")]
    if "llama" in results:
        lc, lf = results["llama"]["cold_load"]["gguf"], results["llama"]["first_request"]
        rows.append(["llama-server router, gguf", f"{lc['seconds']:.2f} s", f"{lf['cold_ttft_s'] * 1000:.0f} ms",
                     f"{lf['warm_ttft_s'] * 1000:.0f} ms"])
    lines += table(["server, model", "cold load (POST /models/load until loaded)", "TTFT, model unloaded",
                    "TTFT, model loaded"], rows, "lrrr")
    lines += ["", f"## {len(cy['rss_mib']) - 1} load and unload cycles (the Hugging Face folder)", "",
              f"RSS before the first load {cy['rss_mib'][0]:.0f} MiB; after cycle 1 {cy['rss_mib'][1]:.0f} MiB; "
              f"after the last {cy['rss_mib'][-1]:.0f} MiB (max {max(cy['rss_mib']):.0f}). "
              f"Threads: {cy['threads'][0]} before, {cy['threads'][-1]} after.", "",
              f"## Two models at once (shoal bench chat, 64 tokens, greedy; of {a.rounds} rounds, the upper median by total)", ""]
    rows = []
    for t in results["two_at_once"]:
        alone = (t["alone_a"] + t["alone_b"]) / 2
        rows.append([{"parallel": "shoal, steps at once (default)", "turns": "shoal --models-step-turns",
                      "llama": f"llama-server router, -t {THREADS} a model (its default: all cores)",
                      "llama-t1": "llama-server router, -t 1 a model"}[t["mode"]], t["streams"], f"{alone:.1f}",
                     f"{t['together_a']:.1f} + {t['together_b']:.1f}", f"{t['together_total']:.1f}", f"{t['together_total'] / alone:.2f}x"])
    lines += table(["mode", "streams per model", "one model alone, tok/s", "both at once, tok/s each", "both, total tok/s",
                    "total / alone"], rows, "lrrrrr")
    publish(f"several-models-{kind}", results, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
