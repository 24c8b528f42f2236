"""Long prompts: time to first token at 0.5k to 8k tokens, shoal against llama.cpp's llama-server.

    make peers                                   # builds .peers/llama-server (and its AVX2 build) once
    .venv/bin/python benchmarks/long_prompts.py [--rounds 2]
    .venv/bin/python benchmarks/long_prompts.py --isa avx2    # the pair an AVX2-only CPU runs

Measured as a user would: `shoal serve` in its default configuration (only
--max-model-len raised to fit 8k) and llama-server on the same GGUF with one
slot of the same context (-t = the cores), each alone on the machine, taking
turns for ROUNDS rounds. Every prompt is unique (random words, new ones each
round, the same ones for both servers within a round), so neither prefix cache
helps, and llama-server is told `cache_prompt: false` besides. Each request
asks for one token; the time to its answer is the time to first token. The
prompts are token ids cut to the exact length from shoal's /tokenize, so both
servers prefill exactly the same tokens.

Writes benchmarks/results/long_prompts-KIND.{md,json} (KIND: publish.cpu_kind, or the
forced path): median TTFT per length,
prefill tokens/s, shoal's rate against its own 500-token rate (the determinism
issue's long-prompt target), and llama-server's TTFT over shoal's. The 4k and
8k requests then decode 64 more tokens (streamed, exact): the decode rate of one
stream at those contexts, against llama-server's.

Then whether a long prompt starves the others (each shoal, not llama-server): 8 streams decode
(unique 64-token prompts, 320 tokens each, exact), once by themselves and once
with one 8k-token prompt sent beside them once they are under way. Reported: the
8 streams' output tokens/s in the window the long prompt prefills (from its
request to its first token) against the same streams' rate without it, the
longest gap between two tokens of one stream in that window, and the long
prompt's TTFT beside them.

`--isa avx2`: shoal forced onto its AVX2 path (SHOAL_CPU_ISA) against the
llama-server built for AVX2 only (compare_peers.py says more): KIND is avx2.
`--variant '--kv-cache-dtype int8'` (repeatable) measures shoal with those
flags too, in the same rounds, and writes long_prompts-variants-KIND instead.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_peers import FORCED_BUILDS, THREADS, LlamaServer, Server, Shoal  # noqa: E402
from publish import cpu_flags, cpu_kind, machine, machine_line, publish, table  # noqa: E402

LENGTHS = (500, 2000, 4000, 6000, 8000)  # the benchmarks page's table, and 6,000: the determinism issue's target
CONTEXT = 8192  # the model's positions; room for the longest prompt and its token
WORDS = ("time year people way day man thing woman life child world school state family student group country problem "
         "hand part place case week company system program question work government number night point home water room "
         "mother area money story fact month lot right study book eye job word business issue side kind head house").split()


class LongShoal(Shoal):
    def __init__(self, name: str = "shoal", flags: tuple[str, ...] = (), isa: str | None = None) -> None:
        super().__init__(name, ("--max-model-len", str(CONTEXT), "--served-model-name", "smollm2", *flags), isa=isa)
        self.label = " ".join(("shoal", *flags)) + (f" (SHOAL_CPU_ISA={isa})" if isa else "")
        self.settings = self.settings.replace("defaults (", f"defaults but --max-model-len {CONTEXT} (")


class OneSlotLlamaServer(LlamaServer):
    def __init__(self, isa: str | None = None) -> None:
        super().__init__(isa)
        build = f" (built for {FORCED_BUILDS[isa][1]})" if isa else ""
        self.label = f"llama.cpp llama-server -np 1{build}"
        self.settings = f"GGUF as is (Q4_1), -t {THREADS}, one slot of {CONTEXT} tokens, cache_prompt false{build}"

    def command(self, port, gguf):
        return [str(self.binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(THREADS),
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


DECODE_AT = (4000, 8000)  # prompt lengths whose requests also decode DECODE_TOKENS, for the decode rate at that context
DECODE_TOKENS = 65


def ttft(server: Server, ids: list[int]) -> float:
    return request(server, ids, 1)[0]


def request(server: Server, ids: list[int], max_tokens: int) -> tuple[float, float | None]:
    """A streamed request of exactly max_tokens: (time to first token, time per output token after it, or None).

    llama-server streams one token a chunk. shoal streams what a step made, which with speculative decoding (on by
    default) can be several tokens: its usage chunk gives the count, and the first chunk holds the first token
    alone (a prefill step makes one). Counting chunks instead made shoal's decode rate its rate of steps."""
    root = server.base_url.removesuffix("/v1")
    if isinstance(server.peer, OneSlotLlamaServer):
        url = f"{root}/completion"
        body = {"prompt": ids, "n_predict": max_tokens, "cache_prompt": False, "temperature": 0, "ignore_eos": True, "stream": True}
    else:
        url = f"{root}/v1/completions"
        body = {"model": "smollm2", "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    stamps = []
    tokens = None
    with httpx.stream("POST", url, json=body, timeout=1800) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{server.peer.name} answered {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("content") or (chunk.get("choices") and chunk["choices"][0].get("text")):
                stamps.append(time.perf_counter())
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    if not stamps:
        raise RuntimeError(f"{server.peer.name} streamed no token")
    tokens = tokens if tokens is not None else len(stamps)
    tpot = (stamps[-1] - stamps[0]) / (tokens - 1) if len(stamps) > 1 else None
    return stamps[0] - t0, tpot


NEIGHBOURS = 8  # streams decoding beside the long prompt
NEIGHBOUR_TOKENS = 320
LONG = 8000  # the long prompt beside them


def stream_tokens(server: Server, ids: list[int], max_tokens: int, stamps: list[float]) -> None:
    """One streamed completion of exactly max_tokens; each token's arrival time goes into stamps (a chunk's time once
    per token in it: `logprobs: 0` lists them, as speculative decoding can send several at once)."""
    body = {"model": "smollm2", "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "logprobs": 0}
    with httpx.stream("POST", f"{server.base_url}/completions", json=body, timeout=1800) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{server.peer.name} answered {r.status_code}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:])["choices"]
            if choices and choices[0].get("logprobs"):
                now = time.perf_counter()
                stamps.extend([now] * len(choices[0]["logprobs"]["tokens"]))


def neighbours(server: Server, rng: random.Random, long_prompt: list[int] | None) -> dict:
    """NEIGHBOURS streams decoding; with long_prompt, it is sent once every stream has its 16th token. Returns the
    streams' output tokens/s and longest gap in the window from then to the long prompt's first token (without
    it: 2 s from the same point of the streams' progress), cut where the first stream ends, and that TTFT."""
    root = server.base_url.removesuffix("/v1")
    prompts = []
    for _ in range(NEIGHBOURS):
        text = " ".join(rng.choice(WORDS) for _ in range(96))
        prompts.append(httpx.post(f"{root}/tokenize", json={"prompt": text}, timeout=60).json()["tokens"][:64])
    stamps: list[list[float]] = [[] for _ in prompts]
    threads = [threading.Thread(target=stream_tokens, args=(server, p, NEIGHBOUR_TOKENS, st)) for p, st in zip(prompts, stamps)]
    for t in threads:
        t.start()
    while min(len(st) for st in stamps) < 16:
        time.sleep(0.01)
    start = time.perf_counter()
    ttft_s = ttft(server, long_prompt) if long_prompt else None
    end = time.perf_counter()
    for t in threads:
        t.join()
    if long_prompt is None:
        end = start + 2.0
    end = min(end, min(st[-1] for st in stamps))  # while every stream still decodes
    inside = [[t for t in st if start <= t <= end] for st in stamps]
    gaps = [b - a for st in stamps for a, b in zip(st, st[1:]) if b >= start and a <= end]
    return {"tokens_per_s": sum(map(len, inside)) / (end - start), "max_gap_ms": max(gaps) * 1e3 if gaps else None,
            "window_s": end - start, "long_ttft_s": ttft_s}


def main() -> None:
    from shoal.model.loader import resolve_model_path

    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--isa", choices=sorted(FORCED_BUILDS), default=None,
                    help="shoal forced onto this path, against llama-server built for it (results: long_prompts-ISA)")
    ap.add_argument("--variant", action="append", default=[], metavar="FLAGS",
                    help="also measure shoal with these flags (quoted; may be given again), e.g. '--kv-cache-dtype int8'; "
                         "the results then go to long_prompts-variants-KIND, beside the default pair's page")
    ap.add_argument("--page", default=None, help="the results page's name (default: long_prompts[-variants]-KIND)")
    a = ap.parse_args()
    llama = OneSlotLlamaServer(a.isa)
    variants = [LongShoal(name=f"shoal {v}", flags=tuple(v.split()), isa=a.isa) for v in a.variant]
    peers = [LongShoal(isa=a.isa), *variants, llama]
    if not llama.available:
        sys.exit(f"{llama.binary} is missing: run `make peers` first")
    gguf = Path(resolve_model_path("smollm2")).resolve()
    rng = random.Random(a.seed)
    times: dict[str, dict[int, list[float]]] = {p.name: {n: [] for n in LENGTHS} for p in peers}
    tpots: dict[str, dict[int, list[float]]] = {p.name: {n: [] for n in DECODE_AT} for p in peers}
    beside = {p.name: {"alone": [], "with the long prompt": []} for p in peers if p is not llama}
    logs = Path(tempfile.mkdtemp(prefix="shoal-long-prompts-"))
    steps = a.rounds * (len(peers) * len(LENGTHS) + 2 * len(beside))
    with tqdm(total=steps, desc="long prompts", unit="step", file=sys.stderr) as bar:
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
                        first, per_token = request(server, prompts[n], DECODE_TOKENS if n in DECODE_AT else 1)
                        times[peer.name][n].append(first)
                        if n in DECODE_AT:
                            tpots[peer.name][n].append(per_token)
                        bar.update()
                    if peer.name in beside:  # each shoal's neighbours, with a fresh long prompt (no prefix-cache hit)
                        beside[peer.name]["alone"].append(neighbours(server, rng, None))
                        bar.update()
                        long_ids = make_prompts(server, rng)[LENGTHS[-1]][:LONG]
                        beside[peer.name]["with the long prompt"].append(neighbours(server, rng, long_ids))
                        bar.update()
                finally:
                    server.stop()
    bf16 = f"forced onto the {a.isa} path" if a.isa else ("native bf16 (avx512_bf16)" if cpu_flags().get("avx512_bf16") else "no native bf16")
    result = {"machine": {**machine(), "bf16": bf16}, "page": a.page, "rounds": a.rounds, "lengths": LENGTHS, "isa": a.isa, "variants": a.variant,
              "peers": {p.name: {"label": p.label, "settings": p.settings} for p in peers},
              "ttft_s": {name: {str(n): v for n, v in per.items()} for name, per in times.items()},
              "tpot_s": {name: {str(n): v for n, v in per.items()} for name, per in tpots.items()},
              "neighbours": beside}
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
    tp = result.get("tpot_s")
    if tp:
        tmed = {name: {int(n): statistics.median(v) for n, v in per.items()} for name, per in tp.items()}
        rows = [[n, f"{1 / tmed['llama-server'][n]:.1f} tok/s",
                 *(f"{1 / tmed[name][n]:.1f} tok/s, {tmed['llama-server'][n] / tmed[name][n]:.2f}x" for name in shoals)]
                for n in DECODE_AT]
        lines += ["", "## One stream decoding at long contexts", "",
                  f"The {', '.join(map(str, DECODE_AT))}-token prompts' requests go on for {DECODE_TOKENS - 1} more tokens: "
                  "decode tokens/s after the first token (median; shoal's tokens counted from its usage chunk, as with "
                  "speculative decoding a chunk can hold several), and shoal's rate over llama-server's.", "",
                  *table(["context", "llama-server", *(result["peers"][name]["label"] for name in shoals)], rows)]
    near = result.get("neighbours")
    if near:
        rows = []
        for name, runs in near.items():
            alone = statistics.median(r["tokens_per_s"] for r in runs["alone"])
            for r in runs["with the long prompt"]:
                rows.append([result["peers"][name]["label"], f"{r['tokens_per_s']:.1f}", f"{alone:.1f}",
                             f"{r['tokens_per_s'] / alone:.0%}", f"{r['max_gap_ms']:.0f} ms", f"{r['long_ttft_s']:.1f} s"])
        lines += ["", f"## {NEIGHBOURS} streams decoding while one {LONG}-token prompt prefills (shoal)", "",
                  f"Each round: {NEIGHBOURS} streams of {NEIGHBOUR_TOKENS} tokens, and one {LONG}-token prompt sent once they are under way. "
                  "Their output tokens/s while it prefills, against the same streams without it (median of the rounds), "
                  "the longest gap between two tokens of one stream in that window, and the long prompt's TTFT.", "",
                  *table(["shoal", "tok/s beside the prefill", "tok/s without it", "kept", "longest gap", "long prompt's TTFT"], rows)]
    variants = "variants-" if result.get("variants") else ""
    publish(result.get("page") or f"long_prompts-{variants}{result.get('isa') or cpu_kind(result['machine']['cpu_flags'])}", result, lines)


if __name__ == "__main__":
    main()
