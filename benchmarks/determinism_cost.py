"""What batch-invariant decoding costs: the invariant attention backend (`--deterministic`)
against the shape-picked SDPA/eager paths (the default), same run.

    .venv/bin/python benchmarks/determinism_cost.py [--rounds 3] [--dtype auto]

Both engines load the default model (SmolLM2-135M-Instruct GGUF) in the same
process, in the dtype `auto` picks here (bfloat16 on a CPU with native bf16)
unless --dtype says otherwise. Each round measures, for each engine in turn:

- output tokens/s with 1 and with 32 requests in flight (64 tokens each, ignore_eos);
- agentic time to first token: one conversation over the agentic benchmark's
  ~1,500-token system prompt, turns 2-6 served from the prefix cache (median);
- long prompts: time to first token of unique 500 / 2,000 / 4,000 / 8,000-token
  prompts (no cache reuse), as prefill tokens/s.

The report is the median over rounds of invariant / sdpa ratios, and each
engine's median absolute number: a shared 2-core machine's seconds mean little
alone. Writes benchmarks/results/determinism_cost.{md,json}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from agentic_prefix import USER_TURNS, system_prompt  # noqa: E402
from publish import machine, machine_line, publish, table  # noqa: E402
from shoal import LLM, SamplingParams  # noqa: E402
from shoal.runner.model_runner import resolve_dtype  # noqa: E402

BACKENDS = ("invariant", "sdpa")
LONG = (500, 2000, 4000, 8000)
WORDS = ("river stone market garden engine lantern orbit violet copper meadow signal harbor "
         "canyon ember glacier pepper thunder velvet marble falcon quartz willow prism tundra").split()


def unique_prompt(llm: LLM, n_tokens: int, salt: int) -> list[int]:
    """Token ids of a prompt no other prompt of the run shares a block with (the salt leads)."""
    words = [WORDS[(i * 7 + salt * 13 + i // 5) % len(WORDS)] for i in range(n_tokens)]
    ids = llm.engine.tokenizer.encode(f"Note {salt}: " + " ".join(words))
    return ids[:n_tokens]


def decode_rate(llm: LLM, streams: int, salt: int) -> float:
    prompts = [unique_prompt(llm, 40 + 7 * i, salt * 100 + i) for i in range(streams)]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)


def ttft(llm: LLM, ids: list[int]) -> float:
    t = time.perf_counter()
    llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=1))
    return time.perf_counter() - t


def agentic_ttft(llm: LLM, salt: int, turns: int = 6) -> float:
    conv = [{"role": "system", "content": system_prompt() + f" Session {salt}."}]
    times = []
    for turn in range(turns):
        conv.append({"role": "user", "content": USER_TURNS[turn % len(USER_TURNS)]})
        ids = llm.apply_chat_template(conv)
        t = time.perf_counter()
        out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=16))[0]
        if turn:  # turn 1 fills the cache
            times.append(out.metrics.first_token_time - out.metrics.arrival_time if getattr(out, "metrics", None) else time.perf_counter() - t)
        conv.append({"role": "assistant", "content": out.outputs[0].text})
    return statistics.median(times)


def measure(llm: LLM, rnd: int) -> dict:
    salt = rnd * 10 + 1
    r = {"tok_s_1": decode_rate(llm, 1, salt), "tok_s_32": decode_rate(llm, 32, salt + 1), "agentic_ttft_s": agentic_ttft(llm, salt + 2)}
    for n in LONG:
        r[f"prefill_tok_s_{n}"] = n / ttft(llm, unique_prompt(llm, n, salt + 3 + n))
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    dtype = str(resolve_dtype(args.dtype, torch.device("cpu"))).removeprefix("torch.")
    engines = {b: LLM("smollm2", dtype=dtype, attention=b, max_model_len=8192) for b in BACKENDS}
    for llm in engines.values():  # warm-up
        decode_rate(llm, 2, 999)
    rounds: list[dict] = []
    for rnd in range(args.rounds):
        row = {}
        for b in (BACKENDS if rnd % 2 == 0 else BACKENDS[::-1]):  # alternate who goes first
            row[b] = measure(engines[b], rnd)
            print(f"round {rnd + 1}/{args.rounds} {b:9s} " + "  ".join(f"{k} {v:.3g}" for k, v in row[b].items()), flush=True)
        rounds.append(row)
    keys = list(rounds[0]["invariant"])
    summary = {}
    for k in keys:
        inv = statistics.median(r["invariant"][k] for r in rounds)
        sdpa = statistics.median(r["sdpa"][k] for r in rounds)
        ratio = statistics.median(r["invariant"][k] / r["sdpa"][k] for r in rounds)
        summary[k] = {"invariant": inv, "sdpa": sdpa, "ratio": ratio}
    doc = {"meta": {"dtype": dtype, "rounds": args.rounds}, "machine": machine(), "summary": summary, "rounds": rounds}
    labels = {
        "tok_s_1": "output tok/s, 1 stream", "tok_s_32": "output tok/s, 32 streams",
        "agentic_ttft_s": "agentic TTFT, turns 2-6 (s, lower is better)",
        **{f"prefill_tok_s_{n}": f"prefill tok/s, {n}-token prompt" for n in LONG},
    }
    lines = [
        "# Cost of batch-invariant decoding",
        "",
        f"`benchmarks/determinism_cost.py`, {args.rounds} rounds, {dtype}, on {machine_line(doc['machine'])}.",
        "invariant: `--deterministic` (batch-invariant decoding); sdpa: the default, shape-picked SDPA/eager paths.",
        "Ratio: median over rounds of invariant / sdpa (above 1 is faster, except TTFT where below 1 is faster).",
        "",
        *table(["measure", "invariant", "sdpa", "ratio"],
               [[labels[k], f"{s['invariant']:.3g}", f"{s['sdpa']:.3g}", f"{s['ratio']:.2f}"] for k, s in summary.items()],
               align="lrrr"),
    ]
    publish("determinism_cost", doc, lines)


if __name__ == "__main__":
    main()
