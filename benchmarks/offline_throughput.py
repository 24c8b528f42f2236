"""Offline throughput: shoal's engine against transformers generate() on the same weights.

    .venv/bin/python benchmarks/offline_throughput.py [--num-prompts 64] [--max-tokens 128]

The default model (SmolLM2-135M-Instruct, GGUF Q4_1 dequantized for both, in the
dtype shoal's `auto` picks on this machine: bfloat16 on a CPU with native bf16,
else float32), prompts of mixed lengths, `ignore_eos` so every request makes exactly
`--max-tokens` tokens. shoal runs at 1, 8 and 32 requests in flight; the peer
is transformers `generate()` run sequentially (one prompt at a time) and as a
left-padded batch. Every number is measured in the same run, and the report is
ratios: absolute seconds on a shared 2-core machine mean little.

Writes benchmarks/results/offline_throughput.{md,json}.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from publish import machine, machine_line, publish, table  # noqa: E402
from shoal import LLM, SamplingParams  # noqa: E402
from shoal.model.loader import resolve_model_path  # noqa: E402
from shoal.runner.model_runner import resolve_dtype  # noqa: E402

DTYPE = resolve_dtype("auto", torch.device("cpu"))  # both sides run in it

TOPICS = [
    "the water cycle", "how a CPU cache works", "the history of the printing press", "why the sky is blue",
    "binary search", "photosynthesis", "the rules of chess", "how vaccines work", "plate tectonics",
    "the French revolution", "compound interest", "how airplanes fly", "the life of bees", "black holes",
    "how to bake bread", "the internet's packet switching",
]


def make_prompts(n: int) -> list[str]:
    out = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        detail = " Please be thorough, use examples, and explain every step carefully." * (i % 5)
        out.append(f"Write a short essay about {topic}.{detail}")
    return out


def run_shoal(prompts: list[str], max_tokens: int, in_flight: int) -> dict:
    # max_num_seqs caps requests in flight; everything else waits in the queue.
    # float weights like transformers' (the default would serve the file's int4: not the same weights)
    llm = LLM("smollm2", max_model_len=2048, max_num_seqs=in_flight, quantization="none")
    llm.generate(prompts[:2], SamplingParams(max_tokens=4))  # warm-up
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    dt = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"seconds": dt, "output_tokens": tokens, "tok_per_s": tokens / dt}


def run_hf_sequential(model, tok, prompts: list[str], max_tokens: int) -> dict:
    from tqdm import tqdm

    tokens, t = 0, time.perf_counter()
    for p in tqdm(prompts, desc="transformers sequential"):
        ids = tok(p, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=tok.pad_token_id or 0)
        tokens += out.shape[1] - ids.shape[1]
    dt = time.perf_counter() - t
    return {"seconds": dt, "output_tokens": tokens, "tok_per_s": tokens / dt}


def run_hf_batched(model, tok, prompts: list[str], max_tokens: int, batch: int) -> dict:
    from tqdm import tqdm

    tok.padding_side = "left"
    tokens, t = 0, time.perf_counter()
    for i in tqdm(range(0, len(prompts), batch), desc=f"transformers batch {batch}"):
        enc = tok(prompts[i : i + batch], return_tensors="pt", padding=True)
        out = model.generate(**enc, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=tok.pad_token_id or 0)
        tokens += (out.shape[1] - enc.input_ids.shape[1]) * out.shape[0]
    dt = time.perf_counter() - t
    return {"seconds": dt, "output_tokens": tokens, "tok_per_s": tokens / dt}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--hf-sequential-prompts", type=int, default=8, help="sequential transformers is slow: time this many")
    ap.add_argument("--in-flight", type=int, nargs="+", default=[1, 8, 32])
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompts = make_prompts(args.num_prompts)
    path = resolve_model_path("smollm2")
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).to(DTYPE).eval()
    hf_tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    results: dict = {"shoal": {}, "transformers": {}}
    for k in args.in_flight:
        sub = prompts if k > 1 else prompts[: max(args.hf_sequential_prompts, 4)]
        results["shoal"][f"in_flight_{k}"] = run_shoal(sub, args.max_tokens, k)
        print(f"shoal, {k} in flight: {results['shoal'][f'in_flight_{k}']['tok_per_s']:.1f} tok/s", flush=True)
    with torch.inference_mode():
        results["transformers"]["sequential"] = run_hf_sequential(hf, hf_tok, prompts[: args.hf_sequential_prompts], args.max_tokens)
        results["transformers"]["batch_32"] = run_hf_batched(hf, hf_tok, prompts, args.max_tokens, 32)
    seq = results["transformers"]["sequential"]["tok_per_s"]
    pad = results["transformers"]["batch_32"]["tok_per_s"]
    results["machine"] = {
        **machine(),
        "dtype": str(DTYPE).removeprefix("torch."),
        "model": path.name,
        "num_prompts": args.num_prompts,
        "max_tokens": args.max_tokens,
    }
    rows = [
        ("transformers generate, sequential", seq, 1.0, seq / pad),
        ("transformers generate, padded batch of 32", pad, pad / seq, 1.0),
    ] + [
        (f"shoal, {k} in flight", r["tok_per_s"], r["tok_per_s"] / seq, r["tok_per_s"] / pad)
        for k, r in ((k, results["shoal"][f"in_flight_{k}"]) for k in args.in_flight)
    ]
    md = [
        f"# Offline throughput ({time.strftime('%Y-%m-%d')})",
        "",
        f"Model {path.name} in {str(DTYPE).removeprefix('torch.')} (both sides), {args.num_prompts} prompts x {args.max_tokens} output tokens (ignore_eos), "
        f"on {machine_line(results['machine'])}. Same run, same machine.",
        "",
        *table(["runner", "output tok/s", "x transformers sequential", "x transformers padded batch"],
               [[name, f"{tps:.1f}", f"{r1:.2f}", f"{r2:.2f}"] for name, tps, r1, r2 in rows], align="lrrr"),
    ]
    publish("offline_throughput", results, md)


if __name__ == "__main__":
    main()
