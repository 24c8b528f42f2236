"""What a quantized or half-precision KV cache costs in answers, and what it buys in speed, on the default model.

For each context length (2k, 4k and 8k tokens of real text: shoal's own docs and source, prose and code as agent
traffic is) and each cache dtype, against the float32 cache the default configuration uses on this CPU:
- KL divergence of the next-token distribution (full vocabulary) over the context's last 256 positions, teacher-forced;
- top-1 agreement of the next token over every position of the context;
- how many greedy tokens pass before the first difference, over 128 generated from the context.
Then one stream's decode rate at 4k and 8k of context, and 32 streams' at 4k, per cache dtype (in the same run, so the
ratios hold on a shared machine). Results: benchmarks/results/kv_quality-<CPU kind>.md.

    python benchmarks/kv_quality.py [--contexts 2048 4096 8000] [--dtypes bfloat16 float16 int8] [--no-speed]
    SHOAL_CPU_ISA=avx2 python benchmarks/kv_quality.py --no-quality --quality-from kv_quality-avx512-vnni-bf16 \
        --speed-dtypes bfloat16 float16 int8 --one-stream --out kv_quality-avx2   # a CPU without native bfloat16
"""

from __future__ import annotations

import argparse
import gc
import logging
import multiprocessing
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from publish import RESULTS, cpu_kind, load, machine, machine_line, publish, table  # noqa: E402
from shoal import LLM, SamplingParams  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TAIL = 256  # positions whose whole next-token distribution is compared
GREEDY_TOKENS = 128
# llama.cpp's published q8_0 KV figures (ggml-org/llama.cpp PR #7412, LLaMA-2 7B on wikitext): beside ours, for scale
LLAMA_CPP_Q8_0 = {"perplexity change": "+0.0046", "KL divergence": "0.00098"}


def real_text(llm: LLM) -> list[int]:
    """shoal's docs and source as the model's tokens; `window` takes prompts from it."""
    text = "\n\n".join(p.read_text() for p in sorted((ROOT / "docs").rglob("*.md")) + sorted((ROOT / "shoal").rglob("*.py")))
    return llm.tokenizer.encode(text)


def window(ids: list[int], tokens: int, offset: int = 0) -> list[int]:
    """`tokens` of the text from `offset` on (distinct windows for distinct streams)."""
    if len(ids) < offset + tokens:
        raise SystemExit(f"only {len(ids)} tokens of text, {offset + tokens} needed")
    return ids[offset : offset + tokens]


class Capture:
    """Wraps the runner's logits step while a prompt's logprobs are computed: each prompt row's top token, and the
    whole log-distribution of the last TAIL rows (rows come in order, step by step, in pieces)."""

    def __init__(self, llm: LLM) -> None:
        self.runner = llm.engine.runner
        self.logits = self.runner.logits
        self.top: list[torch.Tensor] = []
        self.tail: torch.Tensor | None = None

    def __enter__(self) -> Capture:
        def logits(batch, hidden, seqs=None):
            rows = torch.tensor(batch.prompt_rows, dtype=torch.long)
            for i in range(0, len(rows), 512):
                logp = self.runner.model.compute_logits(hidden[rows[i : i + 512]]).log_softmax(dim=-1)
                self.top.append(logp.argmax(dim=-1))
                self.tail = logp if self.tail is None else torch.cat((self.tail, logp))[-TAIL:]
            return self.logits(batch, hidden, seqs)

        self.runner.logits = logits
        return self

    def __exit__(self, *exc) -> None:
        self.runner.logits = self.logits


# The model as served by default (the file's 4-bit weights, whose kernels round each activation to int8 per block of
# 32, as llama.cpp's do), and with those weights dequantized to float32 (no activation rounding), which isolates what
# the cache's rounding does from how far the default model carries a small change.
WEIGHTS = {"default": {}, "float32 weights": {"quantization": "none", "dtype": "float32", "attention": "invariant"}}


def quality(model: str, kv: str, contexts: list[int], weights: str) -> dict:
    """Per context: the prompt's top tokens, the tail's log-distributions and 128 greedy tokens, over a `kv` cache."""
    out = {}
    with LLM(model, kv_cache_dtype=kv, enable_prefix_cache=False, max_model_len=8192, kv_cache_memory=2**30,
             **WEIGHTS[weights]) as llm:
        text = real_text(llm)
        for n in contexts:
            ids = window(text, n)
            with Capture(llm) as cap:
                llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))
            greedy = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True))[0]
            assert sum(len(t) for t in cap.top) == n - 1  # a prediction for every prompt token but the first
            out[n] = {"top": torch.cat(cap.top), "tail": cap.tail, "greedy": list(greedy.outputs[0].token_ids)}
    gc.collect()  # the engine's objects refer to each other: free its pool before the next one is built
    return out


def compare(ref: dict, got: dict) -> dict:
    kl = torch.nn.functional.kl_div(got["tail"], ref["tail"], log_target=True, reduction="none").sum(-1)  # KL(ref || got)
    first = next((i for i, (a, b) in enumerate(zip(ref["greedy"], got["greedy"])) if a != b), len(ref["greedy"]))
    return {"kl_mean": kl.mean().item(), "kl_p99": kl.quantile(0.99).item(),
            "top1_agreement": (ref["top"] == got["top"]).float().mean().item(), "greedy_same": first}


def decode_rate(model: str, kv: str, context: int, streams: int) -> dict:
    """decode_rate_here in a process of its own: each configuration starts fresh, and its pool is returned whole."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(decode_rate_here, (model, kv, context, streams))


def decode_rate_here(model: str, kv: str, context: int, streams: int) -> dict:
    """Output tok/s of `streams` greedy streams, each over its own `context` tokens, decoding 64 tokens after a
    prefill that is timed apart."""
    logging.disable(logging.INFO)
    memory = 7 * 2**30 if streams > 1 else 2**30  # 32 float32 streams of 4k need 6.1 GB
    with LLM(model, kv_cache_dtype=kv, enable_prefix_cache=True, max_model_len=8192, kv_cache_memory=memory,
             max_num_seqs=max(streams, 8)) as llm:
        text = real_text(llm)
        prompts = [window(text, context, offset=997 * i) for i in range(streams)]
        t = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1))  # prefill, kept by the prefix cache
        prefill = time.perf_counter() - t
        t = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=65, ignore_eos=True))
        took = time.perf_counter() - t
        tokens = sum(len(o.outputs[0].token_ids) - 1 for o in outs)
        return {"prefill_tok_s": streams * context / prefill, "decode_tok_s": tokens / took,
                "bytes_per_token": llm.engine.snapshot.kv_bytes_per_token}


def markdown(doc: dict) -> list[str]:
    m = doc["machine"]
    model = doc.get("model", "smollm2")
    model = ("SmolLM2-135M-Instruct (Q4_1 GGUF, the default configuration: float32 activations)" if model == "smollm2"
             else f"`{model}`")
    lines = ["# KV cache dtype: quality and speed on the default model", "",
             f"On {machine_line(m)}. {model}. "
             f"Reference: the float32 cache. Text: shoal's docs and source. `python benchmarks/kv_quality.py`.", "",
             "## Quality against the float32 cache", ""]
    rows = []
    for weights, by_kv in doc["quality"].items():
        for kv, per in by_kv.items():
            for n, r in per.items():
                rows.append([weights, kv, n, f"{r['kl_mean']:.5f}", f"{r['kl_p99']:.4f}", f"{100 * r['top1_agreement']:.1f}%",
                             f"{r['greedy_same']}/{GREEDY_TOKENS}"])
    lines += table(["weights", "cache", "context", f"KL mean (last {TAIL})", "KL p99", "top-1 agreement",
                    "greedy tokens before a difference"], rows)
    lines += ["", f"llama.cpp's published q8_0 KV figures, for scale (LLaMA-2 7B, wikitext, its PR #7412): perplexity "
              f"{LLAMA_CPP_Q8_0['perplexity change']}, KL divergence {LLAMA_CPP_Q8_0['KL divergence']}."]
    if doc.get("speed"):
        lines += ["", "## Decode speed", ""]
        rows = []
        for key, per in doc["speed"].items():
            base = per["float32"]["decode_tok_s"]
            for kv, r in per.items():
                rows.append([key, kv, r["bytes_per_token"], f"{r['prefill_tok_s']:.0f}", f"{r['decode_tok_s']:.1f}",
                             f"{r['decode_tok_s'] / base:.2f}"])
        lines += table(["streams × context", "cache", "bytes/token", "prefill tok/s", "decode tok/s", "vs float32"], rows)
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="a GGUF or a Hugging Face folder (default: the default model)")
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096, 8000])
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16", "int8"])
    p.add_argument("--speed-dtypes", nargs="+", default=["bfloat16", "int8"])
    p.add_argument("--no-speed", action="store_true", help="quality only (the last run's speed figures are kept)")
    p.add_argument("--no-quality", action="store_true", help="speed only (quality is the same bits on every "
                   "instruction set: the last run's figures are kept, or --quality-from's)")
    p.add_argument("--quality-from", default=None, help="a results name whose quality figures this run shows")
    p.add_argument("--one-stream", action="store_true", help="speed at one stream only (32 streams of 4k take long on 2 cores)")
    p.add_argument("--out", default=None, help="results name (default: kv_quality-<CPU kind>)")
    a = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    out = a.out or f"kv_quality-{cpu_kind()}"
    doc = {"machine": machine(), "model": a.model, "contexts": a.contexts, "quality": {}, "speed": {}}
    if a.no_speed and (RESULTS / f"{out}.json").exists():
        doc["speed"] = load(out).get("speed", {})
    if a.no_quality and (RESULTS / f"{a.quality_from or out}.json").exists():
        doc["quality"] = load(a.quality_from or out).get("quality", {})
    speed_cases = [(4096, 1), (8000, 1)] + ([] if a.one_stream else [(4096, 32)])  # (context, streams)
    bar = tqdm(total=(0 if a.no_quality else len(WEIGHTS) * (1 + len(a.dtypes)))
               + (0 if a.no_speed else len(speed_cases) * (1 + len(a.speed_dtypes))),
               desc="kv_quality", unit="run")
    for weights in [] if a.no_quality else WEIGHTS:
        ref = quality(a.model, "float32", a.contexts, weights)
        bar.update()
        doc["quality"][weights] = {}
        for kv in a.dtypes:
            got = quality(a.model, kv, a.contexts, weights)
            doc["quality"][weights][kv] = {n: compare(ref[n], got[n]) for n in a.contexts}
            bar.update()
    publish(out, doc, markdown(doc))  # the quality part, kept if the speed part fails
    if not a.no_speed:
        for context, streams in speed_cases:
            key = f"{streams} × {context}"
            doc["speed"][key] = {}
            for kv in ["float32", *a.speed_dtypes]:
                doc["speed"][key][kv] = decode_rate(a.model, kv, context, streams)
                bar.update()
    bar.close()
    publish(out, doc, markdown(doc))


if __name__ == "__main__":
    main()
