"""Several models in one server: load times, a first request that must load its model, two models served at once.

    .venv/bin/python benchmarks/several_models.py [--rounds 2] [--quick]

Models: the default GGUF (SmolLM2-135M-Instruct, Q4_1) and the same model as a Hugging Face folder (float weights:
.peers/smollm2-hf when `make bench-peers` made it, else exported here from the GGUF with transformers).

    cold-load       POST /v1/models for each, unloaded between (median of 3), and the server's own measure
    first-request   TTFT of a streamed chat request whose model is unloaded, against the same request once loaded
    two-at-once     output tok/s of shoal bench's chat workload (8 streams, 64 tokens) on model a alone, on b alone,
                    and on both at once (two bench runs side by side); the GGUF under two names, so a and b are the
                    same work. Twice: steps in turns (the default) and --models-parallel-steps
    cycles          the server's RSS after each of 20 load and unload cycles of the HF folder

One server process at a time. Each throughput row is the round with the median total. Writes
benchmarks/results/several-models-KIND.{md,json} (KIND: publish.cpu_kind).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from compare_peers import HF_EXPORT, free_port  # noqa: E402
from publish import cpu_kind, machine, machine_line, publish, table  # noqa: E402

from shoal.bench import BenchConfig, run  # noqa: E402
from shoal.model.loader import resolve_model_path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SHOAL = ROOT / ".venv" / "bin" / "shoal"
CHAT = [{"role": "user", "content": "Write two sentences about the sea."}]


class ShoalServer:
    """`shoal serve` with a YAML config, on a free port, in its own process group."""

    def __init__(self, config: dict, log_dir: Path, name: str, *flags: str) -> None:
        import yaml

        self.port = free_port()
        path = log_dir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        self.log_path = log_dir / f"{name}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([str(SHOAL), "serve", "--config", str(path), "--port", str(self.port), "--log-requests", "false",
                                      *flags], stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, "HF_HUB_OFFLINE": "1"})
        self.url = f"http://127.0.0.1:{self.port}"
        self.http = httpx.Client(base_url=self.url, timeout=600, trust_env=False)
        deadline = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"shoal exited; see {self.log_path}")
            try:
                if self.http.get("/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"shoal did not start; see {self.log_path}")
            time.sleep(0.2)

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def threads(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/task"))

    def stop(self) -> None:
        self.http.close()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()


def hf_folder(tmp: Path) -> Path:
    if (HF_EXPORT / "config.json").is_file():
        return HF_EXPORT
    import torch
    import transformers

    gguf = resolve_model_path("smollm2")
    out = tmp / "smollm2-hf"
    print(f"exporting {gguf.name} to a Hugging Face folder ({out})", file=sys.stderr)
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    model.save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    return out


def ttft(srv: ShoalServer, model: str) -> float:
    t0 = time.perf_counter()
    body = {"model": model, "messages": CHAT, "max_tokens": 8, "temperature": 0, "stream": True}
    with srv.http.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                first = time.perf_counter() - t0
                for _ in r.iter_lines():
                    pass
                return first
    raise RuntimeError("no token came")


def cold_loads(srv: ShoalServer, names: list[str], repeats: int) -> dict:
    out = {}
    for name in names:
        times, own = [], []
        for _ in range(repeats):
            srv.http.delete(f"/v1/models/{name}").raise_for_status()
            t0 = time.perf_counter()
            srv.http.post("/v1/models", json={"model": name}).raise_for_status()
            times.append(time.perf_counter() - t0)
        out[name] = {"seconds": statistics.median(times), "all": times}
        print(f"  load {name}: {statistics.median(times):.2f} s", file=sys.stderr)
    return out


def first_request(srv: ShoalServer, name: str, repeats: int) -> dict:
    cold, warm = [], []
    for _ in range(repeats):
        srv.http.delete(f"/v1/models/{name}").raise_for_status()
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


def two_at_once(srv: ShoalServer, streams: int, requests: int, seed: int) -> dict:
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
    streams, requests, repeats, cycles = (4, 8, 1, 3) if a.quick else (8, 32, 3, 20)
    gguf = str(resolve_model_path("smollm2"))
    results: dict = {"machine": machine(), "args": vars(a)}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        hf = hf_folder(tmp)
        offered = {"models": [{"model": gguf, "alias": "gguf"}, {"model": str(hf), "alias": "hf"}], "preload": "none"}
        print("cold loads, first requests and load/unload cycles", file=sys.stderr)
        srv = ShoalServer(offered, tmp, "lifecycle")
        try:
            results["cold_load"] = cold_loads(srv, ["gguf", "hf"], repeats)
            results["first_request"] = {n: first_request(srv, n, repeats) for n in ("gguf", "hf")}
            srv.http.delete("/v1/models").raise_for_status()
            rss, threads = [srv.rss_mib()], [srv.threads()]
            for i in range(cycles):
                srv.http.post("/v1/models", json={"model": "hf"}).raise_for_status()
                srv.http.post("/v1/chat/completions", json={"model": "hf", "messages": CHAT, "max_tokens": 4}).raise_for_status()
                srv.http.delete("/v1/models/hf").raise_for_status()
                rss.append(srv.rss_mib())
                threads.append(srv.threads())
                print(f"  cycle {i + 1}/{cycles}: RSS {rss[-1]:.0f} MiB, {threads[-1]} threads", file=sys.stderr)
            results["cycles"] = {"rss_mib": rss, "threads": threads}
        finally:
            srv.stop()
        two = {"models": [{"model": gguf, "alias": "a"}, {"model": gguf, "alias": "b"}], "preload": "all"}
        results["two_at_once"] = {}
        for mode, flags in (("turns", ()), ("parallel", ("--models-parallel-steps",))):
            rounds = []
            for r in range(a.rounds):
                srv = ShoalServer(two, tmp, f"two-{mode}", *flags)
                try:
                    chat_run(srv.url, "a", 2, 2, 999)  # warm-up: first-call allocations are not what we measure
                    chat_run(srv.url, "b", 2, 2, 999)
                    rounds.append(two_at_once(srv, streams, requests, seed=r))
                finally:
                    srv.stop()
                print(f"  {mode} round {r + 1}: {rounds[-1]}", file=sys.stderr)
            results["two_at_once"][mode] = sorted(rounds, key=lambda x: x["together_total"])[len(rounds) // 2]
    kind = cpu_kind()
    c, f, cy = results["cold_load"], results["first_request"], results["cycles"]
    lines = [f"# Several models in one server ({kind})", "", f"Measured on {machine_line(results['machine'])}.",
             "The default GGUF (SmolLM2-135M-Instruct, Q4_1) and the same model as a Hugging Face folder (bfloat16 "
             "safetensors); `benchmarks/several_models.py`.", "", "## Loading", ""]
    lines += table(["model", "cold load (POST /v1/models)", "TTFT, model unloaded", "TTFT, model loaded"],
                   [[n, f"{c[n]['seconds']:.2f} s", f"{f[n]['cold_ttft_s'] * 1000:.0f} ms", f"{f[n]['warm_ttft_s'] * 1000:.0f} ms"]
                    for n in ("gguf", "hf")], "lrrr")
    lines += ["", f"## {len(cy['rss_mib']) - 1} load and unload cycles (the Hugging Face folder)", "",
              f"RSS before the first load {cy['rss_mib'][0]:.0f} MiB; after cycle 1 {cy['rss_mib'][1]:.0f} MiB; "
              f"after the last {cy['rss_mib'][-1]:.0f} MiB (max {max(cy['rss_mib']):.0f}). "
              f"Threads: {cy['threads'][0]} before, {cy['threads'][-1]} after.", "",
              f"## Two models at once (shoal bench chat, {streams} streams each, 64 tokens, greedy)", ""]
    rows = []
    for mode, t in results["two_at_once"].items():
        alone = (t["alone_a"] + t["alone_b"]) / 2
        rows.append([{"turns": "steps in turns (default)", "parallel": "--models-parallel-steps"}[mode], f"{alone:.1f}",
                     f"{t['together_a']:.1f} + {t['together_b']:.1f}", f"{t['together_total']:.1f}", f"{t['together_total'] / alone:.2f}x"])
    lines += table(["mode", "one model alone, tok/s", "both at once, tok/s each", "both, total tok/s", "total / alone"], rows, "lrrrr")
    publish(f"several-models-{kind}", results, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
