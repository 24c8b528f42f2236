"""The GGUF files people download, at the sizes people run: shoal against llama-server on the same file.

    make peers                                              # llama-server, llama-quantize, the llama.cpp sources
    .venv/bin/python benchmarks/gguf_formats.py             # 1B and 3B, Q4_K_M Q5_K_M Q6_K Q8_0
    .venv/bin/python benchmarks/gguf_formats.py --sizes 1b --types Q4_K_M --isa avx2

Models: random weights at real shapes (Llama-3.2-1B, Llama-3.2-3B, Llama-3.1-8B), with SmolLM2's tokenizer (the
default GGUF's), written as safetensors one tensor at a time, converted by llama.cpp's own
`convert_hf_to_gguf.py` and quantized by its `llama-quantize`, into .peers/models/ (kept for the next run).
Random weights give honest speed and memory figures; quality comes from real weights (--quality).

Per file, each server in turn (so they never share the cores), in its default configuration:
- cold start: the process started to its first 200 on /health;
- footprint: idle RSS after a warm-up, less the KV pool each reports (shoal's log; llama-server's from its
  `-c` and the model's shape, float16);
- 1, 8 and 32 streams of 128-token prompts and 64 output tokens (output tok/s), and one 1.5k-token prompt
  (prefill tok/s from its time to first token);
- the physical limit at one stream: the file's bytes read once a token, in GB/s, against a memory bandwidth
  measured here (a numpy copy of 1 GiB).
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
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))

from tqdm.auto import tqdm  # noqa: E402

MODELS = ROOT / ".peers" / "models"
SRC = ROOT / ".peers" / "src"

# Real shapes (config.json of each release), tied as the releases are.
SHAPES = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               head_dim=64, tie_word_embeddings=True, rope_theta=500000.0, max_position_embeddings=131072),
    "3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
               head_dim=128, tie_word_embeddings=True, rope_theta=500000.0, max_position_embeddings=131072),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               head_dim=128, tie_word_embeddings=False, rope_theta=500000.0, max_position_embeddings=131072),
}
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
    """A random-weight Llama at `size`'s shape with SmolLM2's tokenizer, as a Hugging Face folder: one
    safetensors file per decoder layer, each tensor drawn as transformers' init draws it (normal, std 0.02;
    norms at 1), so at most one layer is in memory at once."""
    import torch
    import transformers
    from safetensors.torch import save_file

    from shoal.model.loader import load_checkpoint

    shape = SHAPES[size]
    tokenizer = load_checkpoint("smollm2", progress=False).tokenizer
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                      eos_token_id=tokenizer.eos_token_id, rms_norm_eps=1e-5, torch_dtype="bfloat16", **shape)
    config.architectures = ["LlamaForCausalLM"]
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    h, i, kv = shape["hidden_size"], shape["intermediate_size"], shape["num_key_value_heads"] * shape["head_dim"]
    q = shape["num_attention_heads"] * shape["head_dim"]

    def normal(*dims):
        return (torch.randn(*dims, generator=gen) * 0.02).to(torch.bfloat16)

    files: dict[str, str] = {}
    parts = [("embed", {"model.embed_tokens.weight": lambda: normal(config.vocab_size, h),
                        "model.norm.weight": lambda: torch.ones(h, dtype=torch.bfloat16)})]
    if not shape["tie_word_embeddings"]:
        parts.append(("head", {"lm_head.weight": lambda: normal(config.vocab_size, h)}))
    for n in range(shape["num_hidden_layers"]):
        p = f"model.layers.{n}."
        parts.append((f"layer{n}", {
            p + "self_attn.q_proj.weight": lambda: normal(q, h), p + "self_attn.k_proj.weight": lambda: normal(kv, h),
            p + "self_attn.v_proj.weight": lambda: normal(kv, h), p + "self_attn.o_proj.weight": lambda: normal(h, q),
            p + "mlp.gate_proj.weight": lambda: normal(i, h), p + "mlp.up_proj.weight": lambda: normal(i, h),
            p + "mlp.down_proj.weight": lambda: normal(h, i),
            p + "input_layernorm.weight": lambda: torch.ones(h, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": lambda: torch.ones(h, dtype=torch.bfloat16)}))
    for name, tensors in tqdm(parts, desc=f"writing a random {size} Llama", unit="file"):
        fname = f"model-{name}.safetensors"
        save_file({k: make() for k, make in tensors.items()}, str(out / fname), metadata={"format": "pt"})
        files.update(dict.fromkeys(tensors, fname))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": files}))
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)


def build_file(size: str, kind: str) -> Path:
    """.peers/models/random-SIZE-KIND.gguf, made (once) as a user's file is: convert_hf_to_gguf.py to bf16, then
    llama-quantize."""
    target = MODELS / f"random-{size}-{kind}.gguf"
    if target.exists():
        return target
    MODELS.mkdir(parents=True, exist_ok=True)
    bf16 = MODELS / f"random-{size}-BF16.gguf"
    if not bf16.exists():
        hf = MODELS / f"random-{size}-hf"
        if not (hf / "config.json").exists():
            write_hf_model(size, hf)
        src = llama_cpp()
        env = {**os.environ, "PYTHONPATH": str(src / "gguf-py"), "NO_LOCAL_GGUF": ""}
        print(f"converting {hf.name} with convert_hf_to_gguf.py", flush=True)
        subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(hf), "--outtype", "bf16", "--outfile", str(bf16)],
                       check=True, env=env, stdout=subprocess.DEVNULL)
    print(f"quantizing to {kind} with llama-quantize", flush=True)
    subprocess.run([str(quantize_binary()), str(bf16), str(target), kind, str(os.cpu_count() or 1)], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return target


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=["1b", "3b"], choices=sorted(SHAPES))
    ap.add_argument("--types", nargs="+", default=list(TYPES))
    ap.add_argument("--build-only", action="store_true", help="make the files, measure nothing")
    args = ap.parse_args(argv)
    for size in args.sizes:
        for kind in args.types:
            print(build_file(size, kind))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
