"""Long prompts: time to first token at 0.5k to 8k tokens, shoal against llama.cpp's llama-server.

    make peers                                   # builds .peers/llama-server once
    .venv/bin/python benchmarks/long_prompts.py [--rounds 2]

Measured as a user would: `shoal serve` in its default configuration (only
--max-model-len raised to fit 8k) and llama-server on the same GGUF with one
slot of the same context (-t = the cores), each alone on the machine, taking
turns for ROUNDS rounds. Every prompt is unique (random words, new ones each
round, the same ones for both servers within a round), so neither prefix cache
helps, and llama-server is told `cache_prompt: false` besides. Each request
asks for one token; the time to its answer is the time to first token. The
prompts are token ids cut to the exact length from shoal's /tokenize, so both
servers prefill exactly the same tokens.

Writes benchmarks/results/long_prompts.{md,json}: median TTFT per length,
prefill tokens/s, shoal's rate against its own 500-token rate (the determinism
issue's long-prompt target), and llama-server's TTFT over shoal's.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_peers import LLAMA_SERVER, THREADS, LlamaServer, Server, Shoal  # noqa: E402
from publish import cpu_flags, machine, machine_line, publish, table  # noqa: E402

LENGTHS = (500, 2000, 4000, 6000, 8000)  # the README table, and 6,000: the determinism issue's target
CONTEXT = 8192  # the model's positions; room for the longest prompt and its token
WORDS = ("time year people way day man thing woman life child world school state family student group country problem "
         "hand part place case week company system program question work government number night point home water room "
         "mother area money story fact month lot right study book eye job word business issue side kind head house").split()


class LongShoal(Shoal):
    def __init__(self, name: str = "shoal", flags: tuple[str, ...] = ()) -> None:
        super().__init__(name, ("--max-model-len", str(CONTEXT), "--served-model-name", "smollm2", *flags))
        self.label = " ".join(("shoal", *flags))
        self.settings = self.settings.replace("defaults (", f"defaults but --max-model-len {CONTEXT} (")
        if flags:
            self.settings = "bfloat16 activations (emulated here): what a CPU with native bf16 runs by default; " + self.settings


class OneSlotLlamaServer(LlamaServer):
    def __init__(self) -> None:
        super().__init__()
        self.label = "llama.cpp llama-server -np 1"
        self.settings = f"GGUF as is (Q4_1), -t {THREADS}, one slot of {CONTEXT} tokens, cache_prompt false"

    def command(self, port, gguf):
        return [str(LLAMA_SERVER), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(THREADS),
                "-tb", str(THREADS), "-np", "1", "-c", str(CONTEXT), "--log-disable"]


WARM_UP = 0  # the key of the warm-up prompt: as long as the first measured one, sharing none of its tokens' prefix


def make_prompts(shoal: Server, rng: random.Random) -> dict[int, list[int]]:
    """One unique prompt per length, as exactly that many of shoal's token ids, and a warm-up prompt."""
    root = shoal.base_url.removesuffix("/v1")
    prompts = {}
    for key in (*LENGTHS, WARM_UP):
        n = key or LENGTHS[0]
        text = " ".join(rng.choice(WORDS) for _ in range(n + 64))
        ids = httpx.post(f"{root}/tokenize", json={"prompt": text}, timeout=60).json()["tokens"]
        if len(ids) < n:
            raise RuntimeError(f"{n + 64} words made only {len(ids)} tokens")
        prompts[key] = ids[:n]
    return prompts


def ttft(server: Server, ids: list[int]) -> float:
    root = server.base_url.removesuffix("/v1")
    if isinstance(server.peer, OneSlotLlamaServer):
        url, body = f"{root}/completion", {"prompt": ids, "n_predict": 1, "cache_prompt": False, "temperature": 0}
    else:
        url, body = f"{root}/v1/completions", {"model": "smollm2", "prompt": ids, "max_tokens": 1, "temperature": 0}
    t0 = time.perf_counter()
    r = httpx.post(url, json=body, timeout=1800)
    elapsed = time.perf_counter() - t0
    if r.status_code != 200:
        raise RuntimeError(f"{server.peer.name} answered {r.status_code}: {r.text[:300]}")
    return elapsed


def main() -> None:
    from shoal.model.loader import resolve_model_path

    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if not LLAMA_SERVER.exists():
        sys.exit("llama-server is missing: run `make peers` first")
    gguf = Path(resolve_model_path("smollm2")).resolve()
    native_bf16 = cpu_flags().get("avx512_bf16", False)
    peers = [LongShoal(), OneSlotLlamaServer()]
    if not native_bf16:  # the other CPU kind's default: the same weights and attention, bf16 activations
        peers.insert(1, LongShoal("shoal-bf16", ("--dtype", "bfloat16")))
    rng = random.Random(a.seed)
    times: dict[str, dict[int, list[float]]] = {p.name: {n: [] for n in LENGTHS} for p in peers}
    logs = Path(tempfile.mkdtemp(prefix="shoal-long-prompts-"))
    with tqdm(total=a.rounds * len(peers) * len(LENGTHS), desc="long prompts", unit="prompt", file=sys.stderr) as bar:
        for _ in range(a.rounds):
            prompts = None
            for peer in peers:  # shoal first: its /tokenize makes the round's prompts
                server = Server(peer, gguf, logs)
                try:
                    server.wait_ready()
                    prompts = prompts or make_prompts(server, rng)
                    # warm-up: first-call allocations at a full step's shapes are not what we measure; a prompt of its
                    # own, since a prefix of a measured one would be a prefix-cache hit for it
                    ttft(server, prompts[WARM_UP])
                    for n in LENGTHS:
                        times[peer.name][n].append(ttft(server, prompts[n]))
                        bar.update()
                finally:
                    server.stop()
    bf16 = "native bf16 (avx512_bf16)" if native_bf16 else "no native bf16 (shoal's default dtype: float32)"
    result = {"machine": {**machine(), "bf16": bf16}, "rounds": a.rounds, "lengths": LENGTHS,
              "peers": {p.name: {"label": p.label, "settings": p.settings} for p in peers},
              "ttft_s": {name: {str(n): v for n, v in per.items()} for name, per in times.items()}}
    write(result)


def write(result: dict) -> None:
    med = {name: {int(n): statistics.median(v) for n, v in per.items()} for name, per in result["ttft_s"].items()}
    llama = med["llama-server"]
    shoals = [name for name in med if name != "llama-server"]
    rows = []
    for n in LENGTHS:
        cells = []
        for name in shoals:
            t, base = med[name][n], LENGTHS[0] / med[name][LENGTHS[0]]
            cells.append(f"{t * 1e3:.0f} ms, {n / t:.0f} tok/s, {n / t / base:.0%}, {llama[n] / t:.2f}x")
        rows.append([n, f"{llama[n] * 1e3:.0f} ms ({n / llama[n]:.0f} tok/s)", *cells])
    lines = [f"# Long prompts: time to first token, median of {result['rounds']} rounds", "",
             f"Machine: {machine_line(result['machine'])}, {result['machine']['bf16']}. "
             + " ".join(f"{p['label']}: {p['settings']}." for p in result["peers"].values()), "",
             "For each shoal: TTFT, prefill tokens/s, that rate against its own 500-token rate, and its speed-up over llama-server.", "",
             *table(["prompt tokens", "llama-server TTFT", *(result["peers"][name]["label"] for name in shoals)], rows)]
    publish("long_prompts", result, lines)


if __name__ == "__main__":
    main()
