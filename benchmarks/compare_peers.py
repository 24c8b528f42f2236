"""shoal against its peers: the same model file, the same workloads, the same run.

    make bench-peers                                    # installs the peers (.peers/), then runs this
    .venv/bin/python benchmarks/compare_peers.py        # every peer that is installed
    .venv/bin/python benchmarks/compare_peers.py --peers shoal llama-server --scenarios random-c32
    .venv/bin/python benchmarks/compare_peers.py --isa avx2     # the AVX2 pair, on any CPU that has AVX2

Each server is started on a free 127.0.0.1 port, waited for until it answers,
loaded through `shoal bench` (shoal.bench.run, the code behind the command)
with each scenario, and stopped before the next one starts, so no two servers
share the two cores. Results: benchmarks/results/compare_peers-KIND.{md,json}, with
ratios shoal/peer and the issue's targets checked against them.

Peers (see benchmarks/peers/setup.sh for how they are installed):
- shoal: default settings, with the prefix cache off, and with --quantization int8 and int4;
- `transformers serve`, with and without --continuous-batching, on an HF folder
  exported once from the same GGUF (it cannot serve the GGUF itself: the config
  it builds has no `architectures`, and a GGUF-loaded model refuses save_pretrained,
  so the weights are copied into a fresh LlamaForCausalLM);
- llama-cpp-python's server (one request at a time) and llama.cpp's own
  llama-server with 32 parallel slots (continuous batching), both on the GGUF.

`--isa avx2` measures the pair an AVX2-only CPU runs, on a CPU that may have more: shoal forced onto its
AVX2 path (SHOAL_CPU_ISA=avx2, which also caps torch's kernels and makes `--dtype auto` float32, as on such
a CPU) against `.peers/llama-server-avx2`, llama.cpp built with native tuning, AVX-512 and AVX-VNNI off.
`--isa baseline` does the same for the x86-64 baseline (SSE2) against `.peers/llama-server-baseline`.

`--against-rev REV` adds shoal as it was at git revision REV (a worktree in .peers/rev-REV, same venv, same
kernels where their sources are the same) as a peer: a change's before and after, taking turns in one run.
Results go to compare_peers-ISA.{md,json}; without --isa, to compare_peers-KIND (publish.cpu_kind).

Every peer decodes greedily (temperature 0). The random scenarios ask for exact
output lengths; each server is told so in its own words: `ignore_eos` (shoal,
llama-server), `min_new_tokens` in a generation_config (transformers serve), a
-100 logit bias on the end-of-turn tokens (llama-cpp-python, which has neither).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from publish import RESULTS, cpu_kind, machine, machine_line, publish, table  # noqa: E402
from shoal.bench import BenchConfig, run  # noqa: E402

PEERS_DIR = ROOT / ".peers"
PEERS_PY = PEERS_DIR / "venv" / "bin" / "python"
LLAMA_SERVER = PEERS_DIR / "llama-server"
LLAMA_SERVER_AVX2 = PEERS_DIR / "llama-server-avx2"  # native tuning, AVX-512 and AVX-VNNI off (peers/setup.sh)
LLAMA_SERVER_BASELINE = PEERS_DIR / "llama-server-baseline"  # every x86 extension off: SSE2
FORCED_BUILDS = {"avx2": (LLAMA_SERVER_AVX2, "AVX2 only"), "baseline": (LLAMA_SERVER_BASELINE, "the x86-64 baseline, SSE2")}
HF_EXPORT = PEERS_DIR / "smollm2-hf"
THREADS = os.cpu_count() or 1


def shoal_cpu_dtype(isa: str | None = None, quantization: str = "none") -> str:
    """What `--dtype auto` picks on this CPU (forced onto `isa`: SHOAL_CPU_ISA) for the default GGUF served with
    `quantization`: with "none" (float weights), what transformers serve is given too; with "auto", shoal's
    default (float32 on the native low-bit kernels: builder.engine_dtype)."""
    import torch

    from shoal.config import EngineConfig
    from shoal.runner.build import engine_dtype
    from shoal.model.loader import DEFAULT_MODEL, open_gguf

    before = os.environ.get("SHOAL_CPU_ISA")
    if isa:
        os.environ["SHOAL_CPU_ISA"] = isa
    try:
        config = EngineConfig(quantization=quantization)
        return str(engine_dtype(config, torch.device("cpu"), open_gguf(DEFAULT_MODEL))).removeprefix("torch.")
    finally:
        if isa:
            os.environ.pop("SHOAL_CPU_ISA") if before is None else os.environ.update(SHOAL_CPU_ISA=before)


DTYPE = shoal_cpu_dtype()  # float weights
PARALLEL = 32  # llama-server slots: as many as the widest scenario has streams


# ---------------------------------------------------------------- scenarios


@dataclass(frozen=True)
class Scenario:
    name: str
    what: str
    bench: dict  # BenchConfig fields
    exact_length: int | None = None  # the random scenarios: every output exactly this long


def scenarios(quick: bool) -> list[Scenario]:
    n = 1 if quick else 2  # scale of the request counts
    return [
        Scenario("random-c1", "1 stream, 128-token prompts, 128 output tokens",
                 dict(workload="random", concurrency=[1], num_requests=2 * n, input_len=(128, 128), output_len=(128, 128)),
                 exact_length=128),
        Scenario("random-c32", "32 streams, 128-token prompts, 128 output tokens",
                 dict(workload="random", concurrency=[32], num_requests=32 * n, input_len=(128, 128), output_len=(128, 128)),
                 exact_length=128),
        *(Scenario(f"chat-c{c}", f"{c} stream{'s' * (c > 1)}, one-question chat prompts (~30 tokens), 64 output tokens",
                   dict(workload="chat", concurrency=[c], num_requests=max(4 * n, 2 * c * n), max_tokens=64), exact_length=64)
          for c in (1, 16, 32)),
        Scenario("agentic", f"4 interleaved agent conversations x {2 * n} turns, ~520-token shared system prompt with 6 tools, "
                 "up to 64 output tokens",
                 dict(workload="agentic", concurrency=[4], num_requests=8 * n, turns=2 * n, max_tokens=64)),
    ]


# ---------------------------------------------------------------- peers


@dataclass
class Peer:
    name: str
    label: str
    health_path: str
    available: bool
    missing: str = ""
    model: str | None = None  # the `model` field to send (None: the server's first)
    settings: str = ""
    env: dict = field(default_factory=dict)  # set for the server's process

    def command(self, port: int, gguf: Path) -> list[str]:
        raise NotImplementedError

    def extra_body(self, s: Scenario) -> dict | None:
        """Fields for this server's requests: by default `ignore_eos` where the scenario wants exact lengths."""
        return {"ignore_eos": True} if s.exact_length else None


class Shoal(Peer):
    def __init__(self, name: str, flags: tuple[str, ...] = (), isa: str | None = None) -> None:
        """isa: SHOAL_CPU_ISA for the server (None: the best path this CPU has)."""
        dtype = shoal_cpu_dtype(isa, "none" if "none" in flags else "auto")
        quant = next((f for f in ("int8", "int4") if f in flags), None)
        own = "--quantization auto (the GGUF's own Q4_1 codes, int8 head, on shoal's low-bit kernels), the invariant attention"
        if quant:
            weights = f"{quant} weights, bfloat16 activations"
        elif "none" in flags:
            weights = f"float weights (dtype auto: {dtype} on this CPU), sdpa attention"
        elif "bfloat16" in flags:
            weights = f"bfloat16 activations, {own}"
        else:
            weights = f"dtype auto ({dtype} {'on the forced path' if isa else 'on this CPU'}), {own}"
        forced = f"SHOAL_CPU_ISA={isa}: kernels and torch on the {isa} path, " if isa else ""
        super().__init__(
            name=name, label=" ".join(("shoal",) + flags) + (f" (SHOAL_CPU_ISA={isa})" if isa else ""),
            health_path="/health", available=True, env={"SHOAL_CPU_ISA": isa} if isa else {},
            settings=f"{forced}{weights}, torch threads {THREADS}, defaults (max 64 sequences, 512-token steps, 1 GiB KV)",
        )
        self.flags = flags

    def command(self, port, gguf):
        cmd = [sys.executable, "-m", "shoal.cli", "serve", "--model", str(gguf), "--port", str(port), "--no-log-requests"]
        return cmd + list(self.flags)


class ShoalAt(Shoal):
    """shoal at another git revision, from a worktree of it (PYTHONPATH first, so its `shoal` package is imported)."""

    def __init__(self, rev: str, isa: str | None = None) -> None:
        """isa: SHOAL_CPU_ISA for it, as for the current shoal (--isa)."""
        commit = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
        self.source = PEERS_DIR / f"rev-{commit}"
        if not self.source.exists():
            subprocess.run(["git", "worktree", "add", "--detach", str(self.source), commit], cwd=ROOT, check=True, capture_output=True)
        super().__init__(f"shoal@{commit}", isa=isa)
        self.label = f"shoal at {commit} (before)" + (f" (SHOAL_CPU_ISA={isa})" if isa else "")
        self.env = {**self.env, "PYTHONPATH": str(self.source)}


class TransformersServe(Peer):
    def __init__(self, continuous_batching: bool) -> None:
        ok = PEERS_PY.exists()
        super().__init__(
            name="transformers-serve-cb" if continuous_batching else "transformers-serve",
            label="transformers serve" + (" --continuous-batching" if continuous_batching else ""),
            health_path="/health", available=ok, missing="" if ok else "run `make bench-peers` (.peers/venv)",
            model=str(HF_EXPORT), settings=f"{DTYPE} (shoal's dtype; HF folder exported from the GGUF), torch threads {THREADS}",
        )
        self.cb = continuous_batching

    def command(self, port, gguf):
        cmd = [str(PEERS_PY.parent / "transformers"), "serve", str(HF_EXPORT), "--host", "127.0.0.1", "--port", str(port),
               "--device", "cpu", "--dtype", DTYPE, "--log-level", "warning"]
        return cmd + (["--continuous-batching"] if self.cb else [])

    def extra_body(self, s):
        if s.exact_length is None:
            return None
        gen = {"max_new_tokens": s.exact_length, "min_new_tokens": s.exact_length, "do_sample": False}
        return {"ignore_eos": None, "generation_config": json.dumps(gen)}


class LlamaCppPython(Peer):
    def __init__(self) -> None:
        ok = PEERS_PY.exists() and _has_module(PEERS_PY, "llama_cpp.server")
        super().__init__(
            name="llama-cpp-python", label="llama-cpp-python server", health_path="/v1/models", available=ok,
            missing="" if ok else "run `make bench-peers` (llama-cpp-python[server])",
            settings=f"GGUF as is (Q4_1), n_threads {THREADS}, n_ctx 8192, one request at a time",
        )

    def command(self, port, gguf):
        return [str(PEERS_PY), "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                "--n_ctx", "8192", "--n_threads", str(THREADS), "--n_threads_batch", str(THREADS), "--verbose", "false",
                "--interrupt_requests", "false"]  # queue concurrent requests instead of cutting the running one off

    def extra_body(self, s):
        if s.exact_length is None:
            return None
        # no ignore_eos here: push SmolLM2's end tokens (<|endoftext|> 0, <|im_end|> 2) out of reach
        return {"ignore_eos": None, "logit_bias": {"0": -100, "2": -100}}


class LlamaServer(Peer):
    def __init__(self, isa: str | None = None) -> None:
        """isa "avx2" or "baseline": the build for that path only (FORCED_BUILDS); None: the one tuned for this CPU."""
        self.binary, what = FORCED_BUILDS[isa] if isa else (LLAMA_SERVER, "")
        ok = self.binary.exists()
        build = f" (built for {what})" if isa else ""
        super().__init__(
            name="llama-server", label=f"llama.cpp llama-server -np {PARALLEL}{build}", health_path="/health", available=ok,
            missing="" if ok else f"run `make bench-peers` (.peers/{self.binary.name})",
            settings=f"GGUF as is (Q4_1), -t {THREADS}, -np {PARALLEL} (continuous batching), 4096 tokens per slot{build}",
        )

    def command(self, port, gguf):
        return [str(self.binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(THREADS),
                "-tb", str(THREADS), "-np", str(PARALLEL), "-c", str(PARALLEL * 4096), "--log-disable"]


def all_peers(isa: str | None = None) -> list[Peer]:
    if isa:  # the pair an AVX2-only CPU runs; the other peers have no forced path
        return [Shoal("shoal", isa=isa), LlamaServer(isa)]
    return [Shoal("shoal"), Shoal("shoal-no-prefix-cache", ("--no-prefix-cache",)),
            Shoal("shoal-bf16", ("--quantization", "none")), Shoal("shoal-int8", ("--quantization", "int8", "--dtype", "bfloat16")),
            # on a CPU without native bf16: what such a CPU would run with bf16 activations (the file's int4, invariant attention)
            Shoal("shoal-bf16-int4", ("--dtype", "bfloat16")),
            TransformersServe(True), TransformersServe(False), LlamaServer(), LlamaCppPython()]


def _has_module(python: Path, module: str) -> bool:
    return subprocess.run([str(python), "-c", f"import {module}"], capture_output=True).returncode == 0


# ---------------------------------------------------------------- running a server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A peer's server process on a free port, in its own process group; logs to a file."""

    def __init__(self, peer: Peer, gguf: Path, log_dir: Path) -> None:
        self.peer = peer
        self.port = free_port()
        self.log_path = log_dir / f"{peer.name}.log"
        self.log = open(self.log_path, "w")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", **peer.env}
        self.proc = subprocess.Popen(peer.command(self.port, gguf), stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     cwd=ROOT, start_new_session=True)
        self.base_url = f"http://127.0.0.1:{self.port}/v1"

    def wait_ready(self, timeout: float = 900.0) -> float:
        import httpx

        t0 = time.perf_counter()
        url = f"http://127.0.0.1:{self.port}{self.peer.health_path}"
        while time.perf_counter() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.peer.name} exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(url, timeout=5.0, trust_env=False).status_code == 200:
                    return time.perf_counter() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.peer.name} not ready after {timeout:.0f} s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def bench(server: Server, s: Scenario, seed: int, progress: bool) -> dict:
    cfg = BenchConfig(base_url=server.base_url, model=server.peer.model, seed=seed, temperature=0.0,
                      extra_body=server.peer.extra_body(s), progress=progress, timeout=1800.0, **s.bench)
    return run(cfg)["runs"][0]


def warm_up(server: Server) -> None:
    """A few short requests first: lazy loading, first-call allocations and kernel selection are not what we measure."""
    s = Scenario("warm-up", "", dict(workload="random", concurrency=[2], num_requests=2, input_len=(32, 32),
                                     output_len=(8, 8)), exact_length=8)
    r = bench(server, s, seed=12345, progress=False)
    if r["completed"] != 2:
        raise RuntimeError(f"{server.peer.name} failed its warm-up: {r['errors']}; see {server.log_path}")


# ---------------------------------------------------------------- the HF folder for transformers serve


def export_hf_folder(gguf: Path, out: Path) -> None:
    """Load the GGUF with transformers, copy its weights into a fresh LlamaForCausalLM, save it with the tokenizer."""
    if (out / "config.json").exists():
        return
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    print(f"exporting {gguf.name} to an HF folder for transformers serve (once) ...", flush=True)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    src = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = src.config
    config.architectures = ["LlamaForCausalLM"]
    if hasattr(config, "quantization_config"):  # the weights are saved dequantized: nothing GGUF about the folder
        del config.quantization_config
    model = LlamaForCausalLM(config).to(torch.float32)
    model.load_state_dict(src.state_dict())
    model.generation_config = src.generation_config
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out)


# ---------------------------------------------------------------- report


def versions() -> dict:
    import torch
    import transformers

    import shoal

    out = {"shoal": shoal.__version__, "torch": torch.__version__, "transformers": transformers.__version__}
    if PEERS_PY.exists():
        code = ("import importlib.metadata as m\nfor p in ('transformers', 'torch', 'llama_cpp_python'):\n"
                "    try: print(p, m.version(p))\n    except Exception: pass")
        lines = subprocess.run([str(PEERS_PY), "-c", code], capture_output=True, text=True).stdout.split("\n")
        for line in filter(None, lines):
            name, version = line.split(" ", 1)
            out[f"peers venv: {name}"] = version
    if LLAMA_SERVER.exists():
        p = subprocess.run([str(LLAMA_SERVER), "--version"], capture_output=True, text=True)
        out["llama-server"] = " ".join((p.stdout + p.stderr).split())[:160]
    return out


def _f(v, nd=1) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def _ratio(a, b, higher_is_better: bool) -> float | None:
    if a is None or b is None or a == 0 or b == 0:
        return None
    return a / b if higher_is_better else b / a


def targets(results: dict) -> list[dict]:
    """The issue's targets, as ratios measured in this run (None where a side is missing)."""

    def get(peer, scen, *path):
        v = results.get(peer, {}).get(scen)
        for p in path:
            v = None if v is None else v.get(p)
        return v

    rows = []
    tf_cb = get("transformers-serve-cb", "random-c32", "output_throughput")
    shoal32 = get("shoal", "random-c32", "output_throughput")
    r = _ratio(shoal32, tf_cb, True)
    rows.append({"target": "random, 32 streams: output tok/s >= 3x transformers serve --continuous-batching",
                 "ratio": r, "met": None if r is None else r >= 3.0})
    r = _ratio(shoal32, get("llama-server", "random-c32", "output_throughput"), True)
    rows.append({"target": "random, 32 streams: output tok/s ahead of llama-server", "ratio": r,
                 "met": None if r is None else r > 1.0})
    for scenario, streams, want in (("chat-c1", 1, 1.0), ("chat-c32", 32, 2.5), ("random-c1", 1, 1.0), ("random-c32", 32, 2.5)):
        r = _ratio(get("shoal", scenario, "output_throughput"), get("llama-server", scenario, "output_throughput"), True)
        rows.append({"target": f"{scenario}: default shoal's output tok/s >= {want}x llama-server's", "ratio": r,
                     "met": None if r is None else r >= want})
    r = _ratio(get("shoal", "chat-c1", "ttft_ms", "p50"), get("llama-server", "chat-c1", "ttft_ms", "p50"), False)
    rows.append({"target": "chat-c1: default shoal's median TTFT no worse than llama-server's (ratio = llama-server / shoal)",
                 "ratio": r, "met": None if r is None else r >= 1.0})
    llama_tpot = get("llama-server", "random-c1", "tpot_ms", "p50")
    for name, label in (("shoal", "shoal"), ("shoal-bf16", "shoal --quantization none"), ("shoal-int8", "shoal --quantization int8")):
        shoal_tpot = get(name, "random-c1", "tpot_ms", "p50")
        r = None if not (shoal_tpot and llama_tpot) else shoal_tpot / llama_tpot
        rows.append({"target": f"1 stream: TPOT <= 1.5x llama-server's (ratio = {label} TPOT / llama-server TPOT)",
                     "ratio": r, "met": None if r is None else r <= 1.5})
    tf_ttft = [get(p, "agentic", "ttft_ms_turn2_on", "p50") for p in ("transformers-serve-cb", "transformers-serve")]
    tf_ttft = [t for t in tf_ttft if t]
    r = _ratio(get("shoal", "agentic", "ttft_ms_turn2_on", "p50"), min(tf_ttft) if tf_ttft else None, False)
    rows.append({"target": "agentic: median TTFT from turn 2 on >= 5x lower than transformers serve (its better mode)",
                 "ratio": r, "met": None if r is None else r >= 5.0})
    return rows


def markdown(doc: dict) -> list[str]:
    m, res = doc["machine"], doc["results"]
    lines = [
        "# shoal against its peers",
        "",
        f"Measured {m['time']} on {machine_line(m)}, {m['platform']}; "
        f"model {doc['model']}. Reproduce with `{doc['command']}` (after `make bench-peers` has installed the peers).",
        "Servers ran one at a time on the same machine; every number on this page comes from this one run."
        + (f" They took turns {doc['rounds']} times (round after round, so a slow spell of the shared machine hits"
           " several servers); each row is that server's round with the median headline metric, and every round's"
           " value is listed under the table." if doc.get("rounds", 1) > 1 else ""),
        "",
        *table(["peer", "settings", "ready after"],
               [[p["label"], p["settings"], f"{p['ready_s']:.1f} s" if p.get("ready_s") is not None else f"not run: {p.get('skipped', '')}"]
                for p in doc["peers"]]),
    ]
    lines += ["", "Versions: " + ", ".join(f"{k} {v}" for k, v in doc["versions"].items()), ""]
    met = {None: "-", True: "yes", False: "**no**"}
    lines += ["## Targets", "",
              *table(["target", "ratio", "met"], [[t["target"], _f(t["ratio"], 2), met[t["met"]]] for t in doc["targets"]])]
    for s in doc["scenarios"]:
        name = s["name"]
        lines += ["", f"## {name}: {s['what']}", ""]
        agentic = name == "agentic"
        head = ["peer", "ok/fail", "out tok/s", "shoal ÷ peer", "TTFT p50 ms", "TTFT p90", "TPOT p50 ms", "TPOT p90", "ITL p50 ms"]
        if agentic:
            head += ["TTFT p50 turn>=2", "peer ÷ shoal"]
        rows = []
        base = res.get("shoal", {}).get(name)
        for p in doc["peers"]:
            r = res.get(p["name"], {}).get(name)
            if r is None:
                continue
            row = [p["label"], f"{r['completed']}/{r['failed']}", _f(r["output_throughput"]),
                   _f(_ratio(base["output_throughput"], r["output_throughput"], True) if base else None, 2),
                   _f(r["ttft_ms"]["p50"]), _f(r["ttft_ms"]["p90"]), _f(r["tpot_ms"]["p50"], 2), _f(r["tpot_ms"]["p90"], 2),
                   _f(r["itl_ms"]["p50"], 2)]
            if agentic:
                t2 = (r.get("ttft_ms_turn2_on") or {}).get("p50")
                b2 = ((base or {}).get("ttft_ms_turn2_on") or {}).get("p50")
                row += [_f(t2), _f(_ratio(b2, t2, False), 1)]
            rows.append(row)
            notes = []
            if r["errors"]:
                notes.append("errors: " + "; ".join(f"{n}× {e}" for e, n in r["errors"].items()))
            if r.get("requests_without_usage"):
                notes.append(f"{r['requests_without_usage']} requests had no usage: output tokens counted as chunks")
            if notes:  # a row of its own under the peer's, in the first column
                rows.append([f"↳ {p['label']}: " + "; ".join(notes)] + [""] * (len(head) - 1))
        lines += table(head, rows)
        if doc.get("rounds", 1) > 1:
            each = [f"{p['label']} " + ", ".join(_f(v, 2) for v in res[p["name"]][name]["rounds"])
                    for p in doc["peers"] if name in res.get(p["name"], {})]
            lines += ["", f"Rounds ({HEADLINE.get(name, 'output tok/s')}): " + "; ".join(each) + "."]
    lines += ["", "Ratios: *shoal ÷ peer* is shoal's output tokens/s over the peer's (above 1: shoal is faster); "
              "*peer ÷ shoal* is the peer's median TTFT from turn 2 on over shoal's (above 1: shoal answers sooner). "
              "TPOT is (end-to-end − TTFT) / (output tokens − 1) per request; ITL is the gap between streamed chunks. "
              "Output tokens come from each server's usage report."]
    return lines


# ---------------------------------------------------------------- main


HEADLINE = {"random-c1": "TPOT p50 ms", "random-c32": "output tok/s", "agentic": "TTFT p50 from turn 2, ms"}


def headline(scenario: str, r: dict) -> float | None:
    """The number a scenario's target reads: TPOT at one stream, throughput at 32, TTFT from turn 2 for agentic."""
    if scenario == "agentic":
        return (r.get("ttft_ms_turn2_on") or {}).get("p50")
    if scenario == "random-c1":
        return r["tpot_ms"]["p50"]
    return r["output_throughput"]


def median_round(scenario: str, runs: list[dict]) -> dict:
    """The round whose headline metric is the median (the lower middle of an even count), with every round's value.

    Whole rounds, not per-metric medians: every number in a row then comes from one run of that server.
    """
    ranked = sorted(runs, key=lambda r: headline(scenario, r) or 0.0)
    chosen = dict(ranked[(len(ranked) - 1) // 2])
    chosen["rounds"] = [headline(scenario, r) for r in runs]
    return chosen


def main(argv: list[str] | None = None) -> int:
    pre = argparse.ArgumentParser(add_help=False)  # --isa first: it decides the peers the other flags choose from
    pre.add_argument("--isa", choices=sorted(FORCED_BUILDS), default=None,
                     help="shoal forced onto this path against llama-server built for it (results: compare_peers-ISA)")
    isa = pre.parse_known_args(argv)[0].isa
    peers = all_peers(isa)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], parents=[pre])
    ap.add_argument("--peers", nargs="+", default=None, choices=[p.name for p in peers], help="default: every installed peer")
    ap.add_argument("--scenarios", nargs="+", default=None, choices=[s.name for s in scenarios(False)])
    ap.add_argument("--gguf", default=None, help="model file (default: the default SmolLM2 GGUF)")
    ap.add_argument("--quick", action="store_true", help="half the requests")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS / f"compare_peers-{isa or cpu_kind()}"),
                    help="path without extension: writes .md and .json (default: per CPU kind, or per forced path)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="servers take turns this many times; each result is the round with the median headline metric")
    ap.add_argument("--no-progress", dest="progress", action="store_false")
    ap.add_argument("--against-rev", default=None, metavar="REV", help="also run shoal as it was at this git revision")
    a = ap.parse_args(argv)
    if a.against_rev:
        peers.append(ShoalAt(a.against_rev, isa))
        if a.peers is not None:
            a.peers.append(peers[-1].name)

    from shoal.model.loader import resolve_model_path

    gguf = Path(a.gguf or resolve_model_path("smollm2")).resolve()
    chosen = [p for p in peers if a.peers is None or p.name in a.peers]
    scens = [s for s in scenarios(a.quick) if a.scenarios is None or s.name in a.scenarios]
    log_dir = PEERS_DIR / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    if any(isinstance(p, TransformersServe) and p.available for p in chosen):
        export_hf_folder(gguf, HF_EXPORT)

    runs: dict[str, dict[str, list[dict]]] = {}
    peer_rows = [{"name": p.name, "label": p.label, "settings": p.settings} for p in chosen]
    for peer, row in zip(chosen, peer_rows):
        if not peer.available:
            row["skipped"] = peer.missing
            print(f"== {peer.label}: skipped ({peer.missing})", flush=True)
    for rnd in range(a.rounds):
        for peer, row in zip(chosen, peer_rows):
            if row.get("skipped"):
                continue  # not installed, or it failed in an earlier round
            print(f"== {peer.label}: starting" + (f" (round {rnd + 1} of {a.rounds})" if a.rounds > 1 else ""), flush=True)
            server = Server(peer, gguf, log_dir)
            try:
                row["ready_s"] = server.wait_ready()
                row["command"] = " ".join(peer.command(server.port, gguf))
                print(f"   ready after {row['ready_s']:.1f} s; warming up", flush=True)
                warm_up(server)
                for s in scens:
                    r = bench(server, s, a.seed, a.progress)
                    runs.setdefault(peer.name, {}).setdefault(s.name, []).append(r)
                    t2 = (r.get("ttft_ms_turn2_on") or {}).get("p50")
                    print(f"   {s.name}: {r['completed']} ok, {r['failed']} failed, {r['output_throughput']:.1f} out tok/s, "
                          f"TTFT p50 {_f(r['ttft_ms']['p50'])} ms, TPOT p50 {_f(r['tpot_ms']['p50'], 2)} ms"
                          + (f", TTFT p50 from turn 2 {_f(t2)} ms" if t2 else ""), flush=True)
            except Exception as e:  # noqa: BLE001 - one peer failing must not lose the others' results
                row["skipped"] = f"{type(e).__name__}: {e}"
                print(f"   failed: {row['skipped']}", flush=True)
            finally:
                server.stop()
    results = {peer: {name: median_round(name, rs) for name, rs in by_scen.items()} for peer, by_scen in runs.items()}

    argv_text = " ".join(argv if argv is not None else sys.argv[1:])
    doc = {
        "machine": machine(),
        "versions": versions(),
        "model": gguf.name,
        "command": f".venv/bin/python benchmarks/compare_peers.py {argv_text}".strip(),
        "peers": peer_rows,
        "scenarios": [{"name": s.name, "what": s.what, "bench": s.bench} for s in scens],
        "rounds": a.rounds,
        "results": results,
    }
    doc["targets"] = targets(results)
    out = Path(a.out)
    for runs in results.values():  # per-request records stay out of the committed file: the summaries are the result
        for r in runs.values():
            r.pop("requests", None)
    publish(out.name, doc, markdown(doc), where=out.parent)
    return 0


if __name__ == "__main__":
    sys.exit(main())
