"""Speculative decoding: shoal with and without it, and llama-server with its own n-gram speculation, in one run.

    .venv/bin/python benchmarks/speculative.py [--rounds 2] [--quick] [--isa avx2]

The default model (SmolLM2-135M-Instruct, the Q4_1 GGUF) on every server. Workloads, greedy:

    echo-c1     1 stream: prompts that ask to rewrite a code block with one change, to repeat a JSON tool result
                with one field changed, or to quote a paragraph with a correction (up to 320 output tokens)
    chat-c1     shoal bench's chat workload, 1 stream, 64 output tokens
    chat-c32    the same at 32 streams
    agentic     shoal bench's agent loop: 4 conversations sharing a system prompt with tools, 64 output tokens

Servers, one at a time on the same cores (compare_peers.Server), taking turns round after round (every other
round in the reverse order):

    shoal                 the default (--speculative auto: n-gram prompt lookup on the batch-invariant attention)
    shoal-off             --speculative off
    llama-server          no speculation, and with --spec-type ngram-simple, ngram-map-k and ngram-mod (its n-gram
                          kinds that need no second model), each with its default sizes

Each row is the round with the median output tok/s. The targets (issue 34): echo-c1 at least 2x shoal-off and
1.5x llama-server's best n-gram kind; chat-c1 and chat-c32 within 3% of shoal-off. Writes
benchmarks/results/speculative-KIND.{md,json} (KIND: publish.cpu_kind, or the forced --isa path).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from compare_peers import FORCED_BUILDS, LLAMA_SERVER, PARALLEL, THREADS, Scenario, Server, Shoal, bench, warm_up  # noqa: E402
from publish import cpu_kind, machine, machine_line, publish, table  # noqa: E402

from shoal.model.loader import resolve_model_path  # noqa: E402

CODE = '''def parse_config(path):
    with open(path) as f:
        data = json.load(f)
    result = {}
    for key, value in data.items():
        if key.startswith("_"):
            continue
        result[key.lower()] = value
    return result
'''
CLASS = '''class Cache:
    def __init__(self, capacity):
        self.capacity = capacity
        self.items = {}
        self.order = []

    def get(self, key):
        if key not in self.items:
            return None
        self.order.remove(key)
        self.order.append(key)
        return self.items[key]

    def put(self, key, value):
        if key in self.items:
            self.order.remove(key)
        elif len(self.items) >= self.capacity:
            oldest = self.order.pop(0)
            del self.items[oldest]
        self.items[key] = value
        self.order.append(key)
'''
WEATHER = json.dumps({"city": "Lisbon", "country": "PT", "temperature_c": 19, "feels_like_c": 18, "conditions": "partly cloudy",
                      "wind_kph": 14, "humidity": 0.62, "forecast": [{"day": "Mon", "high": 21, "low": 14},
                                                                      {"day": "Tue", "high": 19, "low": 13}]}, indent=2)
ORDER = json.dumps({"order_id": "A-10293", "status": "shipped", "items": [{"sku": "KB-201", "qty": 1, "price": 49.9},
                                                                         {"sku": "MS-77", "qty": 2, "price": 19.5}],
                    "shipping": {"carrier": "DHL", "tracking": "JD014600003428", "eta": "2026-12-02"}}, indent=2)
PARAGRAPH = ("The old harbour bridge opened in 1886 and carried horse trams until 1901, when electric trams replaced "
             "them. It was widened in 1932, closed for repairs in 1975, and reopened to pedestrians in 1979. Today it "
             "links the market square with the railway station, and about forty thousand people cross it every day.")
LETTER = ("Dear residents, the water supply in the north district will be interrupted on Tuesday from 9 a.m. to 3 p.m. "
          "while the main pipe under Elm Street is replaced. Please store enough water for the day. The works team "
          "will restore the supply as soon as the new pipe is tested. We apologise for the inconvenience.")
ECHO_PROMPTS = [
    f"Rewrite this Python function, renaming the variable `data` to `config`. Reply with the code only.\n\n{CODE}",
    f"Rewrite this class so that `capacity` is called `max_items`. Reply with the code only.\n\n{CLASS}",
    f"Here is a tool result. Repeat it exactly, but with temperature_c set to 21.\n\n{WEATHER}",
    f"Repeat this JSON order record exactly, with status changed to \"delivered\".\n\n{ORDER}",
    f"Quote this paragraph word for word, correcting the year the bridge opened to 1887.\n\n{PARAGRAPH}",
    f"Copy this notice exactly, changing Tuesday to Thursday.\n\n{LETTER}",
]
ECHO_MAX_TOKENS = 320

LLAMA_SPEC_TYPES = ("ngram-simple", "ngram-map-k", "ngram-mod")


class LlamaServerSpec:
    """llama-server as compare_peers runs it, with --spec-type TYPE (None: no speculation)."""

    def __init__(self, spec_type: str | None, isa: str | None) -> None:
        self.binary = FORCED_BUILDS[isa][0] if isa else LLAMA_SERVER
        self.spec_type = spec_type
        self.name = f"llama-server-{spec_type}" if spec_type else "llama-server"
        self.label = f"llama.cpp llama-server -np {PARALLEL}" + (f" --spec-type {spec_type}" if spec_type else "")
        self.health_path, self.model, self.env, self.available = "/health", None, {}, self.binary.exists()
        self.settings = f"GGUF as is (Q4_1), -t {THREADS}, -np {PARALLEL}" + (f", --spec-type {spec_type} (its defaults)" if spec_type else "")

    def command(self, port, gguf):
        spec = ["--spec-type", self.spec_type] if self.spec_type else []
        return [str(self.binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(THREADS),
                "-tb", str(THREADS), "-np", str(PARALLEL), "-c", str(PARALLEL * 4096), "--log-disable", *spec]

    def extra_body(self, s):
        return None


def scenarios(quick: bool, echo_file: Path) -> list[Scenario]:
    n = 1 if quick else 2
    return [
        Scenario("echo-c1", "1 stream, rewrite / repeat / quote with one change, up to 320 output tokens",
                 dict(workload="file", file=str(echo_file), concurrency=[1], num_requests=len(ECHO_PROMPTS) * n,
                      max_tokens=ECHO_MAX_TOKENS)),
        Scenario("chat-c1", "1 stream, one-question chat prompts, 64 output tokens",
                 dict(workload="chat", concurrency=[1], num_requests=6 * n, max_tokens=64)),
        Scenario("chat-c32", "32 streams, one-question chat prompts, 64 output tokens",
                 dict(workload="chat", concurrency=[32], num_requests=64 * n, max_tokens=64)),
        Scenario("agentic", "4 interleaved agent conversations, shared system prompt with tools, up to 64 output tokens",
                 dict(workload="agentic", concurrency=[4], num_requests=8 * n, turns=2 * n, max_tokens=64)),
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="half the requests per scenario")
    ap.add_argument("--isa", choices=("avx2",), default=None, help="shoal forced onto its AVX2 path, against llama-server built for AVX2")
    ap.add_argument("--scenarios", nargs="+", default=None, help="a subset (echo-c1 chat-c1 chat-c32 agentic)")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)

    gguf = resolve_model_path()
    tmp = Path(tempfile.mkdtemp(prefix="shoal-spec-"))
    echo_file = tmp / "echo.jsonl"
    echo_file.write_text("".join(json.dumps({"messages": [{"role": "user", "content": p}], "max_tokens": ECHO_MAX_TOKENS}) + "\n"
                                 for p in ECHO_PROMPTS))
    scens = [s for s in scenarios(args.quick, echo_file) if not args.scenarios or s.name in args.scenarios]
    peers = [Shoal("shoal", isa=args.isa), Shoal("shoal-off", ("--speculative", "off"), isa=args.isa),
             LlamaServerSpec(None, args.isa), *(LlamaServerSpec(t, args.isa) for t in LLAMA_SPEC_TYPES)]
    peers = [p for p in peers if p.available]
    runs: dict[str, dict[str, list[dict]]] = {p.name: {s.name: [] for s in scens} for p in peers}
    for rnd in range(args.rounds):
        for peer in (peers if rnd % 2 == 0 else peers[::-1]):  # every other round backwards: no server always goes first
            server = Server(peer, gguf, tmp)
            try:
                server.wait_ready()
                warm_up(server)
                for s in scens:
                    before = _spec_stats(server) if peer.name.startswith("shoal") else None
                    r = bench(server, s, seed=rnd, progress=not args.no_progress)
                    r.pop("requests", None)  # each request's record: megabytes at 32 streams, and the summary has what the page uses
                    if before is not None:
                        after = _spec_stats(server)
                        r["speculative"] = {k: after[k] - before[k] for k in ("drafts", "drafted_tokens", "accepted_tokens", "steps_off")}
                    runs[peer.name][s.name].append(r)
                    print(f"round {rnd + 1} {peer.name} {s.name}: {r['output_throughput']:.1f} tok/s, "
                          f"TTFT p50 {r['ttft_ms']['p50']:.0f} ms", flush=True)
            finally:
                server.stop()

    results = {p.name: {s: _median(rs) for s, rs in by.items()} for p, by in ((p, runs[p.name]) for p in peers)}
    kind = args.isa or cpu_kind()
    doc = {"machine": machine(), "kind": kind, "rounds": args.rounds, "peers": {p.name: {"label": p.label, "settings": p.settings} for p in peers},
           "scenarios": {s.name: s.what for s in scens}, "results": results, "runs": runs, "targets": targets(results)}
    publish(f"speculative-{kind}", doc, markdown(doc, args))
    return 0


def _spec_stats(server) -> dict | None:
    import httpx

    stats = httpx.get(f"http://127.0.0.1:{server.port}/stats", timeout=10, trust_env=False).json()
    return stats.get("speculative") or {"drafts": 0, "drafted_tokens": 0, "accepted_tokens": 0, "steps_off": 0}


def _median(rs: list[dict]) -> dict:
    if not rs:
        return {}
    by = sorted(rs, key=lambda r: r["output_throughput"])
    return by[(len(by) - 1) // 2]


def _tps(results, peer, scen) -> float | None:
    r = results.get(peer, {}).get(scen)
    return r.get("output_throughput") if r else None


def targets(results: dict) -> list[dict]:
    out = []

    def ratio(a, b):
        return a / b if a and b else None

    echo = _tps(results, "shoal", "echo-c1")
    best = max(((p, _tps(results, p, "echo-c1")) for p in results if p.startswith("llama-server-")),
               key=lambda x: x[1] or 0, default=(None, None))
    for what, r, goal in (
        ("echo-c1: output tok/s >= 2x shoal --speculative off", ratio(echo, _tps(results, "shoal-off", "echo-c1")), 2.0),
        (f"echo-c1: output tok/s >= 1.5x llama-server's best n-gram kind ({best[0] or 'no llama-server for this path here'})",
         ratio(echo, best[1]), 1.5),
        ("chat-c1: auto loses at most 3% against off", ratio(_tps(results, "shoal", "chat-c1"), _tps(results, "shoal-off", "chat-c1")), 0.97),
        ("chat-c32: auto loses at most 3% against off", ratio(_tps(results, "shoal", "chat-c32"), _tps(results, "shoal-off", "chat-c32")), 0.97),
    ):
        out.append({"target": what, "ratio": r, "goal": goal, "met": None if r is None else r >= goal})
    return out


def markdown(doc: dict, args) -> list[str]:
    res = doc["results"]
    lines = [
        "# Speculative decoding: shoal with and without it, against llama-server's n-gram speculation", "",
        f"Measured {machine_line(doc['machine'])}; {doc['rounds']} rounds, each row the round with the median output tok/s. "
        f"Reproduce with `.venv/bin/python benchmarks/speculative.py --rounds {args.rounds}{' --quick' if args.quick else ''}"
        f"{f' --isa {args.isa}' if args.isa else ''}` (after `make bench-peers`).", "",
        *table(["server", "settings"], [[p["label"], p["settings"]] for p in doc["peers"].values()]), "",
        "## Targets", "",
        *table(["target", "ratio", "met"], [[t["target"], f"{t['ratio']:.2f}" if t["ratio"] else "-",
                                           {True: "yes", False: "no", None: "-"}[t["met"]]] for t in doc["targets"]]), "",
    ]
    for s, what in doc["scenarios"].items():
        base = _tps(res, "shoal-off", s)
        rows = []
        for name, by in res.items():
            r = by.get(s)
            if not r:
                continue
            spec = r.get("speculative") or {}
            acc = f"{spec['accepted_tokens']} of {spec['drafted_tokens']}" if spec.get("drafted_tokens") else "-"
            rows.append([doc["peers"][name]["label"], f"{r['output_throughput']:.1f}",
                         f"{r['output_throughput'] / base:.2f}" if base else "-", f"{r['ttft_ms']['p50']:.0f}",
                         f"{r['tpot_ms']['p50']:.2f}" if r.get("tpot_ms", {}).get("p50") else "-", acc])
        lines += [f"## {s}: {what}", "", *table(["server", "out tok/s", "÷ shoal-off", "TTFT p50 ms", "TPOT p50 ms",
                                                 "drafted tokens accepted"], rows), ""]
        lines.append("Rounds (out tok/s): " + "; ".join(
            f"{name} " + ", ".join(f"{r['output_throughput']:.1f}" for r in doc["runs"][name][s]) for name in res) + ".")
        lines.append("")
    return lines


if __name__ == "__main__":
    sys.exit(main())
