"""The GGUF files people download, at the sizes people run: shoal against llama-server on the same file.

    make peers                                              # llama-server, llama-quantize, the llama.cpp sources
    .venv/bin/python benchmarks/gguf_formats.py             # 1B and 3B, Q4_K_M Q5_K_M Q6_K Q8_0
    .venv/bin/python benchmarks/gguf_formats.py --sizes 1b --types Q4_K_M --isa avx2
    .venv/bin/python benchmarks/gguf_formats.py --sizes gemma3-1b moe --types Q4_K_M

Models: random weights at real shapes, with SmolLM2's tokenizer (the default GGUF's) and its 49,152-token vocabulary,
written as safetensors one decoder layer at a time, converted by llama.cpp's own `convert_hf_to_gguf.py` and
quantized by its `llama-quantize`, into .peers/models/ (kept for the next run). The shapes (--sizes):
- 1b, 3b, 8b: Llama-3.2-1B, Llama-3.2-3B, Llama-3.1-8B (`LlamaForCausalLM`, gguf arch llama);
- gemma3-1b: Gemma 3 1B's text model (`Gemma3ForCausalLM`, gguf arch gemma3): 26 layers of 1152, 4 query heads and
  1 KV head of 256, five sliding-window (512) layers to one global, rope base 1e6 global and 10k local, the
  embedding tied. Its 1152-wide rows are not a multiple of 256, so llama-quantize gives the tensors they feed
  (q, k, v, gate, up) a 32-block fallback type instead of the k-quant asked for, as it does for the real model;
- moe: Qwen3-30B-A3B's layer (`Qwen3MoeForCausalLM`, gguf arch qwen3moe: hidden 2048, 32 query heads and 4 KV
  heads of 128, 128 experts of 768, 8 used a token, top-k weights normalized, rope base 1e6, untied head) at 6
  layers of its 48 (3.9B parameters, 0.5B active a token), so the safetensors and the BF16 GGUF fit a small
  disk together; both are deleted once the asked-for types are quantized (rebuilt from the same seed when
  another type is asked for).
Random weights give honest speed and memory figures; quality comes from real weights (--quality).

Per file, each server in turn (so they never share the cores), in its default configuration:
- cold start: the process started to its first 200 on /health;
- footprint: idle RSS after a warm-up, less the KV pool's resident part (shoal's pool is a mapping committed as it
  fills: its resident pages, from /proc/PID/smaps; llama-server clears its whole cache at start: its `-c` and the
  model's shape, float16);
- 1, 8 and 32 streams of 128-token prompts and 64 output tokens (output tok/s), and one 1.5k-token prompt
  (prefill tok/s from its time to first token);
- the physical limit at one stream: the file's bytes read once a token, in GB/s, against a memory bandwidth
  measured here (a numpy copy of 1 GiB); of an MoE's expert tensors, only the share a token uses (experts used
  over experts) counts.
Rounds alternate the servers; the report gives each round's ratios and their median.

`--isa avx2` runs the pair an AVX2-only CPU runs (shoal forced onto its AVX2 path, `.peers/llama-server-avx2`).
`--quality` requantizes the default model to Q4_K_M and reports first-token agreement with llama-server over
40 prompts and the KL divergence against its float32 weights (as kv_quality.py does for the cache).
Results: benchmarks/results/gguf_formats-KIND.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))

from tqdm.auto import tqdm  # noqa: E402

MODELS = ROOT / ".peers" / "models"
SRC = ROOT / ".peers" / "src"

# Real shapes (config.json of each release), tied as the releases are; `architecture` (Llama's when absent) picks
# the transformers config and the tensors written. `moe` keeps Qwen3-30B-A3B's layer at 6 of its 48 layers.
SHAPES = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               head_dim=64, tie_word_embeddings=True, rope_theta=500000.0, max_position_embeddings=131072),
    "3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
               head_dim=128, tie_word_embeddings=True, rope_theta=500000.0, max_position_embeddings=131072),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               head_dim=128, tie_word_embeddings=False, rope_theta=500000.0, max_position_embeddings=131072),
    "gemma3-1b": dict(architecture="Gemma3ForCausalLM", hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                      num_attention_heads=4, num_key_value_heads=1, head_dim=256, hidden_activation="gelu_pytorch_tanh",
                      query_pre_attn_scalar=256, sliding_window=512,
                      layer_types=["full_attention" if (n + 1) % 6 == 0 else "sliding_attention" for n in range(26)],
                      rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                                       "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
                      rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=32768),
    "moe": dict(architecture="Qwen3MoeForCausalLM", hidden_size=2048, intermediate_size=6144, num_hidden_layers=6,
                num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                moe_intermediate_size=768, norm_topk_prob=True, decoder_sparse_step=1, rms_norm_eps=1e-6,
                tie_word_embeddings=False, rope_theta=1000000.0, max_position_embeddings=40960),
}
# Shapes whose safetensors folder (once converted) and BF16 GGUF (once the types asked for are quantized) are
# deleted: only the quantized files stay on the disk.
TRANSIENT = {"moe"}
TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")


def llama_cpp() -> Path:
    """The llama.cpp sources `make peers` unpacks (the llama-cpp-python sdist's vendored copy)."""
    found = sorted(SRC.glob("llama_cpp_python-*/vendor/llama.cpp"))
    if not found:
        raise SystemExit("no llama.cpp sources in .peers/src: run `make peers` first")
    return found[-1]


def quantize_binary() -> Path:
    for p in (ROOT / ".peers" / "llama-quantize", *sorted(SRC.glob("build-*/bin/llama-quantize"))):
        if p.exists():
            return p
    raise SystemExit("no llama-quantize: run `make peers` first")


def write_hf_model(size: str, out: Path) -> None:
    """A random-weight model at `size`'s shape with SmolLM2's tokenizer, as a Hugging Face folder: one safetensors
    file per decoder layer, each tensor drawn as transformers' init draws it (normal, std 0.02, the MoE router
    too, so a token's top 8 spread over all 128 experts; norms at 1, which Gemma stores as 0: its norm scales by
    1 + weight), so at most one layer is in memory at once. The experts are stored one tensor each, as HF
    checkpoints store them (`mlp.experts.E.{gate,up,down}_proj.weight`, the router `mlp.gate.weight`)."""
    import torch
    import transformers
    from safetensors.torch import save_file

    from shoal.model.loader import load_checkpoint

    shape = dict(SHAPES[size])
    arch = shape.pop("architecture", "LlamaForCausalLM")
    shape.setdefault("rms_norm_eps", 1e-5)
    configs = {"LlamaForCausalLM": transformers.LlamaConfig, "Gemma3ForCausalLM": transformers.Gemma3TextConfig,
               "Qwen3MoeForCausalLM": transformers.Qwen3MoeConfig}
    tokenizer = load_checkpoint("smollm2", progress=False).tokenizer
    config = configs[arch](vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                           pad_token_id=tokenizer.pad_token_id, torch_dtype="bfloat16", **shape)
    config.architectures = [arch]
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    h, i, kv = shape["hidden_size"], shape["intermediate_size"], shape["num_key_value_heads"] * shape["head_dim"]
    q, d = shape["num_attention_heads"] * shape["head_dim"], shape["head_dim"]
    gemma, moe = arch == "Gemma3ForCausalLM", arch == "Qwen3MoeForCausalLM"

    def normal(*dims):
        return (torch.randn(*dims, generator=gen) * 0.02).to(torch.bfloat16)

    def norm(n):
        return (torch.zeros if gemma else torch.ones)(n, dtype=torch.bfloat16)

    files: dict[str, str] = {}
    parts = [("embed", {"model.embed_tokens.weight": lambda: normal(config.vocab_size, h), "model.norm.weight": lambda: norm(h)})]
    if not shape["tie_word_embeddings"]:
        parts.append(("head", {"lm_head.weight": lambda: normal(config.vocab_size, h)}))
    for n in range(shape["num_hidden_layers"]):
        p = f"model.layers.{n}."
        layer = {p + "self_attn.q_proj.weight": lambda: normal(q, h), p + "self_attn.k_proj.weight": lambda: normal(kv, h),
                 p + "self_attn.v_proj.weight": lambda: normal(kv, h), p + "self_attn.o_proj.weight": lambda: normal(h, q),
                 p + "input_layernorm.weight": lambda: norm(h), p + "post_attention_layernorm.weight": lambda: norm(h)}
        if gemma or moe:  # Gemma 3's and Qwen3's per-head RMS norms of q and k
            layer.update({p + "self_attn.q_norm.weight": lambda: norm(d), p + "self_attn.k_norm.weight": lambda: norm(d)})
        if gemma:  # the feed-forward block's own pre- and post-norm (the attention's output is post-normed too)
            layer.update({p + "pre_feedforward_layernorm.weight": lambda: norm(h), p + "post_feedforward_layernorm.weight": lambda: norm(h)})
        if moe:
            e, m = shape["num_experts"], shape["moe_intermediate_size"]
            layer[p + "mlp.gate.weight"] = lambda: normal(e, h)
            for x in range(e):
                layer.update({p + f"mlp.experts.{x}.gate_proj.weight": lambda: normal(m, h),
                              p + f"mlp.experts.{x}.up_proj.weight": lambda: normal(m, h),
                              p + f"mlp.experts.{x}.down_proj.weight": lambda: normal(h, m)})
        else:
            layer.update({p + "mlp.gate_proj.weight": lambda: normal(i, h), p + "mlp.up_proj.weight": lambda: normal(i, h),
                          p + "mlp.down_proj.weight": lambda: normal(h, i)})
        parts.append((f"layer{n}", layer))
    for name, tensors in tqdm(parts, desc=f"writing a random {size} ({arch})", unit="file"):
        fname = f"model-{name}.safetensors"
        save_file({k: make() for k, make in tensors.items()}, str(out / fname), metadata={"format": "pt"})
        files.update(dict.fromkeys(tensors, fname))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": files}))
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)


def model_path(size: str, kind: str) -> Path:
    return MODELS / f"random-{size}-{kind}.gguf"


def build_file(size: str, kind: str, keep_bf16: bool = False) -> Path:
    """.peers/models/random-SIZE-KIND.gguf, made (once) as a user's file is: convert_hf_to_gguf.py to bf16, then
    llama-quantize. Each step writes a .part file renamed when complete, so an interrupted run starts that step
    again. For a TRANSIENT size the safetensors folder goes once converted, and the BF16 GGUF once quantized
    unless `keep_bf16` (another type of the size is to be made from it next)."""
    target = model_path(size, kind)
    if target.exists():
        return target
    MODELS.mkdir(parents=True, exist_ok=True)
    bf16 = model_path(size, "BF16")
    if not bf16.exists():
        hf = MODELS / f"random-{size}-hf"
        if not (hf / "config.json").exists():  # written last
            write_hf_model(size, hf)
        src = llama_cpp()
        env = {**os.environ, "PYTHONPATH": str(src / "gguf-py"), "NO_LOCAL_GGUF": ""}
        print(f"converting {hf.name} with convert_hf_to_gguf.py", flush=True)
        part = bf16.with_name(bf16.name + ".part")
        # the peers' venv: `make peers` gives it what the script imports and shoal's venv lacks (sentencepiece)
        python = ROOT / ".peers" / "venv" / "bin" / "python"
        subprocess.run([str(python if python.exists() else sys.executable), str(src / "convert_hf_to_gguf.py"), str(hf), "--outtype", "bf16", "--outfile", str(part)],
                       check=True, env=env, stdout=subprocess.DEVNULL)
        part.rename(bf16)
        if size in TRANSIENT:
            shutil.rmtree(hf)
    print(f"quantizing to {kind} with llama-quantize", flush=True)
    part = target.with_name(target.name + ".part")
    subprocess.run([str(quantize_binary()), str(bf16), str(part), kind, str(os.cpu_count() or 1)], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    part.rename(target)
    if size in TRANSIENT and not keep_bf16:
        bf16.unlink()
    return target


# ---------------------------------------------------------------- measuring


STREAMS = (1, 8, 32)
PREFILL = 1536


def scenarios(quick: bool) -> list:
    from compare_peers import Scenario

    n = 1 if quick else 2
    out = [Scenario(f"c{c}", f"{c} stream{'s' * (c > 1)}, 128-token prompts, 64 output tokens",
                    dict(workload="random", concurrency=[c], num_requests=max(2, c) * n, input_len=(128, 128), output_len=(64, 64)),
                    exact_length=64) for c in STREAMS]
    out.append(Scenario("prefill", f"one {PREFILL}-token prompt at a time, 1 output token",
                        dict(workload="random", concurrency=[1], num_requests=2 * n, input_len=(PREFILL, PREFILL), output_len=(1, 1)),
                        exact_length=1))
    return out


def peers(isa: str | None):
    from compare_peers import THREADS, LlamaServer, Shoal

    class Theirs(LlamaServer):
        def command(self, port, gguf):  # 32 slots of 2,048 tokens: every scenario's requests at once
            return [str(self.binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(THREADS),
                    "-tb", str(THREADS), "-np", "32", "-c", str(32 * 2048), "--log-disable"]

    ours, theirs = Shoal("shoal", isa=isa), Theirs(isa)
    # the physical limit: one stream reading the weights once a token (speculation reads them once for several)
    plain = Shoal("shoal-no-spec", ("--speculative", "off"), isa=isa)
    plain.only = {"c1"}
    ours.settings = "defaults (the context and KV pool sized by shoal: the log's line)" + (f", SHOAL_CPU_ISA={isa}" if isa else "")
    plain.settings = ours.settings + ", --speculative off (one stream only: what a token's read of the weights costs)"
    theirs.settings = f"-t {THREADS} -np 32 -c {32 * 2048}" + (" (built for AVX2 only)" if isa == "avx2" else "")
    return [ours, theirs, plain]


def resident_mapping(pid: int, size: int) -> int:
    """Rss of the process's mapping of `size` bytes (give or take one KV block and a page)."""
    rss, found = 0, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        key, _, value = line.partition(":")
        if key == "Size":
            found = abs(int(value.split()[0]) * 1024 - size) <= max(1 << 20, size // 100)
        elif key == "Rss" and found:
            rss = max(rss, int(value.split()[0]) * 1024)
    return rss


def rss_bytes(pid: int) -> int:
    """Resident memory of a process and its children (shoal's ranks, if any)."""
    total, pids = 0, [pid]
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        kids = []
    for p in pids + [int(k) for k in kids]:
        try:
            total += next(int(line.split()[1]) * 1024 for line in Path(f"/proc/{p}/status").read_text().splitlines() if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            pass
    return total


def kv_pool_bytes(peer: str, log_path: Path, gguf: Path, pid: int) -> int:
    """The KV pool's resident bytes: shoal's pool is the mapping of the size its start-up line gives, committed as
    it fills (its Rss in /proc/PID/smaps); llama-server's cache, cleared at start, from -c and the shape, float16:
    32 slots of 2,048 cells a layer, but for Gemma 3's sliding-window layers (five of every six) the window and a
    ubatch of 512, rounded up to 256 cells (llama_kv_cache_iswa, without --swa-full)."""
    import re

    from shoal.model.gguf_loader import GGUFFileReader

    if peer.startswith("shoal"):
        m = re.search(r"KV pool .*? = (\d+) tokens of \w+ at (\d+) bytes a token", log_path.read_text())
        return resident_mapping(pid, int(m.group(1)) * int(m.group(2))) if m else 0
    meta = GGUFFileReader(gguf).metadata
    arch = meta["general.architecture"]
    layers, kv_heads = meta[f"{arch}.block_count"], meta[f"{arch}.attention.head_count_kv"]
    head = meta.get(f"{arch}.attention.key_length") or meta[f"{arch}.embedding_length"] // meta[f"{arch}.attention.head_count"]
    cells = [2048] * layers
    if arch == "gemma3" and meta.get(f"{arch}.attention.sliding_window"):
        swa = min(2048, -(-(meta[f"{arch}.attention.sliding_window"] + 512) // 256) * 256)
        cells = [swa if n % 6 < 5 else c for n, c in enumerate(cells)]
    return 32 * sum(cells) * kv_heads * head * 2 * 2


def bytes_per_token(gguf: Path) -> int:
    """The bytes one stream reads a token: the whole file, but of an MoE's expert tensors (`*_exps`) only the
    share of experts a token uses."""
    from shoal.model.gguf_loader import GGUFFileReader

    reader = GGUFFileReader(gguf)
    arch = reader.metadata["general.architecture"]
    used, experts = reader.metadata.get(f"{arch}.expert_used_count"), reader.metadata.get(f"{arch}.expert_count")
    if not experts:
        return gguf.stat().st_size
    exps = sum(int(t.n_bytes) for t in reader.tensors if "_exps" in t.name)
    return gguf.stat().st_size - exps + exps * used // experts


def bandwidth() -> float:
    """GB/s of a 1 GiB numpy copy (read and write counted): the ceiling decode approaches at one stream."""
    import numpy as np

    a, b = np.ones(2**27), np.empty(2**27)
    best = 0.0
    for _ in range(5):
        t = time.perf_counter()
        np.copyto(b, a)
        best = max(best, 2 * a.nbytes / (time.perf_counter() - t) / 1e9)
    return best


def measure(gguf: Path, isa: str | None, rounds: int, quick: bool, log_dir: Path) -> dict:
    """Every scenario on each server, the servers taking turns, `rounds` times."""
    from compare_peers import Server, bench, warm_up

    out: dict = {}
    for rnd in range(rounds):
        for peer in peers(isa):
            server = Server(peer, gguf, log_dir)
            try:
                start = server.wait_ready()
                warm_up(server)
                time.sleep(1.0)
                entry = {"cold_start_s": start, "idle_rss": rss_bytes(server.proc.pid), "kv_pool": kv_pool_bytes(peer.name, server.log_path, gguf, server.proc.pid)}
                for s in scenarios(quick):
                    if s.name not in getattr(peer, "only", {s.name}):
                        continue
                    r = bench(server, s, seed=rnd, progress=False)
                    entry[s.name] = {"output_tok_s": r["output_throughput"], "ttft_p50_ms": r["ttft_ms"]["p50"],
                                     "tpot_p50_ms": r["tpot_ms"]["p50"], "completed": r["completed"], "failed": r["failed"]}
                    print(f"  round {rnd + 1} {peer.name:12s} {s.name:8s} {r['output_throughput']:8.1f} tok/s  "
                          f"TTFT p50 {r['ttft_ms']['p50']:.0f} ms", flush=True)
                out.setdefault(peer.name, []).append(entry)
            finally:
                server.stop()
    return out


def summary(runs: list[dict], read_bytes: int) -> dict:
    """The median over rounds of each figure, and footprint and bytes-per-token rates."""
    import statistics

    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    row = {"cold_start_s": med([r["cold_start_s"] for r in runs]),
           "footprint_mb": med([(r["idle_rss"] - r["kv_pool"]) / 1e6 for r in runs])}
    for c in STREAMS:
        row[f"c{c}_tok_s"] = med([r[f"c{c}"]["output_tok_s"] for r in runs if f"c{c}" in r])
    row["prefill_tok_s"] = med([PREFILL / (r["prefill"]["ttft_p50_ms"] / 1e3) for r in runs if "prefill" in r])
    tpot = med([r["c1"]["tpot_p50_ms"] for r in runs])
    row["c1_gb_s"] = read_bytes / (tpot / 1e3) / 1e9 if tpot else None
    return row


def report(doc: dict) -> list[str]:
    from publish import machine_line, table

    lines = ["# GGUF files at real sizes: shoal against llama-server", "",
             f"On {machine_line(doc['machine'])}; {doc['isa_note']}. Memory bandwidth measured here (a numpy copy): "
             f"{doc['bandwidth_gb_s']:.1f} GB/s. The servers take turns; figures are medians over a file's rounds, "
             "ratios shoal / llama-server (lower is better for footprint and cold start). Output tok/s includes the "
             "streams' own prefill; GB/s is the file's bytes (of an MoE's experts, the share a token uses) over one "
             "stream's time per output token (with "
             "speculation, several tokens share a read of the weights: shoal-no-spec is the physical figure).", "",
             f"- shoal: {doc['settings']['shoal']}", f"- llama-server: {doc['settings']['llama-server']}", ""]
    head = ["file (date, rounds)", "server", "cold start s", "footprint MB", "1 stream tok/s", "8 streams", "32 streams",
            f"prefill {PREFILL} tok/s", "1 stream GB/s"]
    rows = []
    cell = lambda v, fmt: "–" if v is None else format(v, fmt)  # noqa: E731
    for name, f in doc["files"].items():
        for peer in ("shoal", "llama-server", "shoal-no-spec"):
            r = f["summary"].get(peer)
            if r is None:
                continue
            partial = peer == "shoal-no-spec"  # started for one scenario: its start and memory are shoal's
            label = f"{name} ({f.get('date', '?')}, {f.get('rounds', '?')})" if peer == "shoal" else ""
            rows.append([label, peer, cell(None if partial else r["cold_start_s"], ".1f"),
                         cell(None if partial else r["footprint_mb"], ".0f"),
                         *(cell(r[f"c{c}_tok_s"], ".1f") for c in STREAMS), cell(r["prefill_tok_s"], ".0f"), cell(r["c1_gb_s"], ".1f")])
        ratio = f.get("ratios")
        if ratio:
            rows.append(["", "**ratio**", f"{ratio['cold_start_s']:.2f}x", f"{ratio['footprint_mb']:.2f}x",
                         *(f"**{ratio[f'c{c}_tok_s']:.2f}x**" for c in STREAMS), f"**{ratio['prefill_tok_s']:.2f}x**", ""])
    return lines + table(head, rows)


# ---------------------------------------------------------------- quality on real weights


QUALITY_PROMPTS = 40
QUALITY_TOKENS = 200  # each prompt: a window of shoal's docs and source, as kv_quality.py takes its text


def requantized_default(kind: str = "Q4_K_M") -> Path:
    """The default model (SmolLM2-135M, Q4_1) requantized by llama-quantize --allow-requantize."""
    from shoal.model.loader import resolve_model_path

    target = MODELS / f"smollm2-135m-{kind}.gguf"
    if not target.exists():
        MODELS.mkdir(parents=True, exist_ok=True)
        subprocess.run([str(quantize_binary()), "--allow-requantize", str(resolve_model_path("smollm2")), str(target), kind],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return target


def first_tokens_llama_server(gguf: Path, prompts: list[list[int]], isa: str | None) -> list[int]:
    """llama-server's greedy first token after each prompt (token ids in, /completion)."""
    import httpx
    from compare_peers import Server

    server = Server(peers(isa)[1], gguf, Path(tempfile.mkdtemp()))
    try:
        server.wait_ready()
        out = []
        for ids in prompts:
            r = httpx.post(f"http://127.0.0.1:{server.port}/completion", timeout=300, trust_env=False,
                           json={"prompt": ids, "n_predict": 1, "temperature": 0, "cache_prompt": False, "return_tokens": True})
            r.raise_for_status()
            out.append(r.json()["tokens"][0])
        return out
    finally:
        server.stop()


def quality(isa: str | None) -> dict:
    """The default model requantized to Q4_K_M: first-token agreement with llama-server on the same file, and the
    KL divergence of shoal's next-token distributions against the model's float32 weights (its Q4_1 file
    dequantized), over the last 256 positions of 2k tokens of real text, as kv_quality.py measures the cache."""
    from kv_quality import compare, quality as kv_quality, real_text

    from shoal import LLM, SamplingParams
    from shoal.model.loader import resolve_model_path

    q4km = requantized_default()
    default = str(resolve_model_path("smollm2"))
    firsts = {}
    for name, kw in (("shoal", {}), ("shoal, float32 weights", {"quantization": "none", "dtype": "float32"})):
        with LLM(str(q4km), max_model_len=4096, **kw) as llm:
            text = real_text(llm)
            prompts = [text[997 * i : 997 * i + QUALITY_TOKENS] for i in range(QUALITY_PROMPTS)]
            firsts[name] = [o.outputs[0].token_ids[0] for o in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1))]
    theirs = first_tokens_llama_server(q4km, prompts, isa)
    ref = kv_quality(default, "auto", [2048], "float32 weights")[2048]
    kl = {name: compare(ref, kv_quality(path, "auto", [2048], weights)[2048])
          for name, path, weights in (("Q4_1 (the shipped file) on shoal's kernels", default, "default"),
                                      ("Q4_K_M on shoal's kernels", str(q4km), "default"),
                                      ("Q4_K_M dequantized to float32 (no activation rounding)", str(q4km), "float32 weights"))}
    agree = {name: sum(a == b for a, b in zip(ours, theirs)) / len(prompts) for name, ours in firsts.items()}
    return {"file": q4km.name, "first_token_agreement": agree["shoal"], "agreement_by_path": agree, "prompts": len(prompts), "kl": kl}


def main(argv: list[str] | None = None) -> int:
    from publish import RESULTS, cpu_kind, machine, publish, table

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=["1b", "3b"], choices=sorted(SHAPES))
    ap.add_argument("--types", nargs="+", default=list(TYPES))
    ap.add_argument("--isa", choices=("avx2",), help="shoal forced onto its AVX2 path, against llama-server built for AVX2 only")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="half the requests per scenario")
    ap.add_argument("--build-only", action="store_true", help="make the files, measure nothing")
    ap.add_argument("--out", default=None, help="results name in benchmarks/results (default: gguf_formats-<CPU kind>, "
                    "or -avx2; another machine of the same kind gets a name of its own)")
    ap.add_argument("--quality", action="store_true", help="only the quality check on the default model's real weights")
    args = ap.parse_args(argv)
    if args.quality:
        doc = {"machine": machine(), "quality": quality(args.isa)}
        q = doc["quality"]
        lines = ["# The default model requantized to Q4_K_M: quality on real weights", "",
                 f"First token after {q['prompts']} windows of real text, shoal and llama-server on the same file "
                 f"({q['file']}): **{100 * q['first_token_agreement']:.0f}%** the same (shoal with the file dequantized to "
                 f"float32 weights, no activation rounding: {100 * q['agreement_by_path']['shoal, float32 weights']:.0f}%).", "",
                 "KL divergence of the next token against the float32 weights (the shipped Q4_1 file dequantized), over "
                 "the last 256 positions of 2,048 tokens of real text:", "",
                 *table(["served", "KL mean", "KL p99", "top-1 agreement"],
                        [[k, f"{v['kl_mean']:.4f}", f"{v['kl_p99']:.3f}", f"{100 * v['top1_agreement']:.1f}%"] for k, v in q["kl"].items()])]
        publish(f"gguf_quality-{args.isa or cpu_kind()}", doc, lines)
        return 0
    files = {f"{size} {kind}": build_file(size, kind, keep_bf16=any(not model_path(size, k).exists() for k in args.types[n + 1:]))
             for size in args.sizes for n, kind in enumerate(args.types)}
    if args.build_only:
        return 0
    doc = {"machine": machine(), "rounds": args.rounds, "isa": args.isa, "bandwidth_gb_s": bandwidth(), "files": {},
           "isa_note": "shoal forced onto its AVX2 path against llama-server built for AVX2 only" if args.isa else
           "each server on the best path this CPU has",
           "settings": {p.name: p.settings for p in peers(args.isa)}}
    with tempfile.TemporaryDirectory() as logs:
        for name, path in files.items():
            print(f"{name}: {path.name}, {path.stat().st_size / 1e6:.0f} MB", flush=True)
            # in the page cache before either server starts: a cold start is the process's, not the disk's
            subprocess.run(["cat", str(path)], stdout=subprocess.DEVNULL, check=True)
            runs = measure(path, args.isa, args.rounds, args.quick, Path(logs))
            summ = {peer: summary(r, bytes_per_token(path)) for peer, r in runs.items()}
            entry = {"bytes": path.stat().st_size, "runs": runs, "summary": summ, "date": time.strftime("%Y-%m-%d"),
                     "rounds": args.rounds}
            if "shoal" in summ and "llama-server" in summ:
                a, b = summ["shoal"], summ["llama-server"]
                entry["ratios"] = {k: a[k] / b[k] for k in a if a[k] and b.get(k)}
            doc["files"][name] = entry
    name = args.out or f"gguf_formats-{args.isa or cpu_kind()}"
    if (RESULTS / f"{name}.json").exists():  # files measured in earlier runs stay, each with its own date and rounds
        for f, entry in json.loads((RESULTS / f"{name}.json").read_text())["files"].items():
            doc["files"].setdefault(f, entry)
    publish(name, doc, report(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
