"""What structured output costs: 16 streams under a JSON schema against 16 free ones, in one run.

The default model in the default configuration, offline (`LLM`), 16 chat prompts at
once. Three batches take turns for ROUNDS rounds:
  - free: 16 unconstrained requests (ignore_eos, so they run as long as the others);
  - constrained: 16 requests under SCHEMA (nested objects, arrays, enums);
  - mixed: 8 of each.
Constrained documents end when the grammar does, so whole-run throughput would mix
in the batch shrinking. The figure compared is the steady state: output tokens per
second over the engine steps in which all 16 sequences decoded (the step's whole
time, the grammar's masks and their application included). For the mixed batch
that is the free half's speed too: every row of a step waits for the same step.

Also: compiling the schema the first and the second time (the engine's cache).

    .venv/bin/python benchmarks/structured_output.py   # writes benchmarks/results/structured_output.{json,md}
"""

from __future__ import annotations

import json
import statistics
import sys
import time

from tqdm import tqdm

from publish import machine, machine_line, publish, table
from shoal import LLM, SamplingParams
from shoal.engine.structured import GrammarCompiler
from shoal.types import StructuredOutput

STREAMS = 16
ROUNDS = 3
MAX_TOKENS = 160

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "skills": {
            "type": "array",
            "items": {"type": "object", "properties": {"name": {"type": "string"}, "level": {"enum": ["low", "mid", "high"]}},
                      "required": ["name", "level"], "additionalProperties": False},
            "minItems": 2,
            "maxItems": 6,
        },
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"}, "country": {"type": "string"}},
            "required": ["street", "city", "country"],
            "additionalProperties": False,
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "skills", "address", "active"],
    "additionalProperties": False,
}
SPEC = StructuredOutput(json_schema=json.dumps(SCHEMA))
TOPICS = ["a nurse", "a pilot", "a chef", "a student", "a farmer", "a lawyer", "a painter", "a coder",
          "a baker", "a diver", "a judge", "a poet", "a miner", "a tailor", "a guide", "a clerk"]


def conversations() -> list[list[dict]]:
    return [[{"role": "user", "content": f"Describe {t} as a JSON profile with skills and an address."}] for t in TOPICS[:STREAMS]]


def free_params(i: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=i, max_tokens=MAX_TOKENS, ignore_eos=True)


def constrained_params(i: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=i, max_tokens=2 * MAX_TOKENS, structured=SPEC)


def run(llm: LLM, params: list[SamplingParams]) -> dict:
    """Run one batch; the steady state's output tokens/s (steps where every stream decoded)."""
    engine = llm.engine
    real_step = engine.step
    steps: list[tuple[int, float]] = []

    def timed_step():
        running, before = engine.num_running, engine.stats.generated_tokens
        t = time.perf_counter()
        out = real_step()
        dt = time.perf_counter() - t
        if running == STREAMS and engine.stats.generated_tokens - before == STREAMS:
            steps.append((STREAMS, dt))
        return out

    engine.step = timed_step
    try:
        t = time.perf_counter()
        outs = llm.chat(conversations(), params)
        wall = time.perf_counter() - t
    finally:
        engine.step = real_step
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    steady = sum(n for n, _ in steps) / sum(dt for _, dt in steps) if steps else float("nan")
    valid = sum(1 for o, p in zip(outs, params) if p.structured is not None and _parses(o.outputs[0].text))
    return {"steady_tok_s": steady, "steady_steps": len(steps), "wall_tok_s": tokens / wall, "tokens": tokens, "valid_json": valid}


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def compile_times(llm: LLM) -> dict:
    engine = llm.engine
    fresh = GrammarCompiler(engine.tokenizer, tuple(sorted(engine.eos_token_ids)), engine.vocab_size)
    t = time.perf_counter()
    fresh._tokenizer()
    index = time.perf_counter() - t
    t = time.perf_counter()
    fresh.compile(SPEC)
    first = time.perf_counter() - t
    t = time.perf_counter()
    fresh.compile(StructuredOutput(json_schema=json.dumps(SCHEMA)))  # an equal constraint, another object
    again = time.perf_counter() - t
    return {"vocab_index_ms": index * 1e3, "compile_first_ms": first * 1e3, "compile_again_ms": again * 1e3}


def main() -> None:
    llm = LLM()  # the default model and configuration
    cfg = llm.engine.config
    batches = {
        "free": [free_params(i) for i in range(STREAMS)],
        "constrained": [constrained_params(i) for i in range(STREAMS)],
        "mixed": [constrained_params(i) if i % 2 == 0 else free_params(i) for i in range(STREAMS)],
    }
    llm.generate(["Hello"], SamplingParams(max_tokens=8))  # warm-up
    llm.engine.grammars.compile(SPEC)  # the vocabulary index is built on first use: not part of a step
    rows: dict[str, list[dict]] = {k: [] for k in batches}
    with tqdm(total=ROUNDS * len(batches), desc="structured-output benchmark", file=sys.stderr) as bar:
        for _ in range(ROUNDS):
            for name, params in batches.items():
                rows[name].append(run(llm, params))
                bar.update()
    summary = {name: {"steady_tok_s": statistics.median(r["steady_tok_s"] for r in rs),
                      "wall_tok_s": statistics.median(r["wall_tok_s"] for r in rs),
                      "valid_json": f"{sum(r['valid_json'] for r in rs)}/{sum(1 for p in batches[name] if p.structured) * ROUNDS}"}
               for name, rs in rows.items()}
    free = summary["free"]["steady_tok_s"]
    for s in summary.values():
        s["vs_free"] = s["steady_tok_s"] / free
    result = {"model": cfg.model, "dtype": cfg.dtype, "streams": STREAMS, "rounds": ROUNDS, "machine": machine(), "summary": summary,
              "rounds_detail": rows, "compile": compile_times(llm)}
    c = result["compile"]
    lines = [
        f"# Structured output: {STREAMS} streams, default model and configuration (median of {ROUNDS} rounds)",
        "",
        f"On {machine_line(result['machine'])}.",
        "",
        *table(["batch", "steady output tok/s", "vs free", "whole-run tok/s", "documents that parse"],
               [[name, f"{s['steady_tok_s']:.1f}", f"{s['vs_free']:.3f}", f"{s['wall_tok_s']:.1f}", s["valid_json"]]
                for name, s in summary.items()]),
    ]
    lines += ["", f"Compiling the schema: {c['compile_first_ms']:.1f} ms the first time, {c['compile_again_ms']:.3f} ms the second "
              f"(cached); the vocabulary index, once per model: {c['vocab_index_ms']:.0f} ms."]
    publish("structured_output", result, lines)


if __name__ == "__main__":
    main()
