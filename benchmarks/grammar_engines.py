"""xgrammar against llguidance on this CPU, with the default model's tokenizer.

What shoal's structured output needs of a grammar engine, measured for both in
one run:
  - set-up: the tokenizer's info, once per model;
  - compiling a JSON schema (nested objects, arrays, enums) the first time, and a
    regex; and the second time (the engine's own cache, if any);
  - one decode step for 16 constrained sequences: fill 16 token bitmasks (one
    call for the batch where the library has one) and accept a token in each;
  - the mask's application to [16, V] float32 logits.
The walk follows the tokens of a valid document (the schema's example, tokenized),
so every step is a real mid-document state.

    .venv/bin/pip install xgrammar==0.2.8   # not a dependency of shoal (it pulls triton, ~290 MB)
    .venv/bin/python benchmarks/grammar_engines.py   # writes benchmarks/results/grammar_engines.{json,md}

llguidance has no compile cache of its own ("compile again" is a second compile);
shoal's GrammarCompiler caches by value (benchmarks/structured_output.py measures it).
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from publish import machine, machine_line, publish, table

BATCH = 16

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
DOCUMENT = json.dumps(
    {"name": "Ada Lovelace", "age": 36, "role": "admin", "tags": ["math", "poetry"], "address": {"city": "London", "zip": "12345"}},
    separators=(", ", ": "),
)
REGEX = r"\d{3}-\d{3}-\d{4}"


def timed(fn, repeat: int = 1) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def bench_xgrammar(tokenizer, vocab: int, tokens: list[int]) -> dict:
    import xgrammar as xgr

    setup, info = timed(lambda: xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab))
    compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=True)
    first, compiled = timed(lambda: compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(", ", ": ")))
    again, _ = timed(lambda: compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(", ", ": ")))
    regex, _ = timed(lambda: compiler.compile_regex(REGEX))
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(BATCH)]
    mask = xgr.allocate_token_bitmask(BATCH, vocab)
    batch = xgr.BatchGrammarMatcher(max_threads=2)
    fills, accepts = [], []
    for tok in tokens:
        t = time.perf_counter()
        batch.batch_fill_next_token_bitmask(matchers, mask)
        fills.append(time.perf_counter() - t)
        t = time.perf_counter()
        for m in matchers:
            assert m.accept_token(tok), "the document's token was refused"
        accepts.append(time.perf_counter() - t)
    logits = torch.randn(BATCH, vocab)
    apply, _ = timed(lambda: xgr.apply_token_bitmask_inplace(logits, mask), repeat=20)
    return _row("xgrammar", setup, first, again, regex, fills, accepts, apply)


def bench_llguidance(tokenizer, vocab: int, tokens: list[int]) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch as llt

    setup, info = timed(lambda: llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab))
    # llguidance has no compile step of its own: the matcher builds its lexer lazily, so
    # "compile" is the grammar's translation plus the first matcher and its first mask.
    def compile_schema():
        grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
        m = llguidance.LLMatcher(info, grammar)
        m.compute_bitmask()
        return grammar

    first, grammar = timed(compile_schema)
    again, _ = timed(compile_schema)

    def compile_regex():
        m = llguidance.LLMatcher(info, llguidance.LLMatcher.grammar_from_regex(REGEX))
        m.compute_bitmask()

    regex, _ = timed(compile_regex)
    matchers = [llguidance.LLMatcher(info, grammar) for _ in range(BATCH)]
    mask = llt.allocate_token_bitmask(BATCH, vocab)
    executor = llguidance.LLExecutor(num_threads=2)
    pairs = [(m, i) for i, m in enumerate(matchers)]
    fills, accepts = [], []
    for tok in tokens:
        t = time.perf_counter()
        llt.fill_next_token_bitmask_par(executor, pairs, mask)
        fills.append(time.perf_counter() - t)
        t = time.perf_counter()
        for m in matchers:
            assert m.consume_token(tok), m.get_error()
        accepts.append(time.perf_counter() - t)
    logits = torch.randn(BATCH, vocab)
    apply, _ = timed(lambda: llt.apply_token_bitmask_inplace(logits, mask), repeat=20)
    return _row("llguidance", setup, first, again, regex, fills, accepts, apply)


def _row(name, setup, first, again, regex, fills, accepts, apply) -> dict:
    ms = 1e3
    return {
        "engine": name,
        "tokenizer_setup_ms": setup * ms,
        "schema_compile_first_ms": first * ms,
        "schema_compile_again_ms": again * ms,
        "regex_compile_ms": regex * ms,
        "fill_16_median_ms": statistics.median(fills) * ms,
        "fill_16_max_ms": max(fills) * ms,
        "accept_16_median_ms": statistics.median(accepts) * ms,
        "apply_16_ms": apply * ms,
    }


def main() -> None:
    import importlib.metadata as md

    from shoal.model.loader import load_checkpoint

    ckpt = load_checkpoint(progress=False)
    tok = ckpt.tokenizer
    vocab = ckpt.hf_config.vocab_size
    tokens = tok.encode(DOCUMENT, add_special_tokens=False)
    rows = []
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        print("xgrammar is not installed (pip install xgrammar==0.2.8): measuring llguidance alone")
    else:
        rows.append(bench_xgrammar(tok, vocab, tokens))
    rows.append(bench_llguidance(tok, vocab, tokens))
    for r in rows:
        r["version"] = md.version(r["engine"])
    doc = {"document_tokens": len(tokens), "batch": BATCH, "machine": machine(), "rows": rows}
    cols = list(rows[0])[1:-1]  # the timings: every key but "engine" and "version"
    lines = [
        f"# Grammar engines on this CPU ({BATCH} sequences, the default model's tokenizer, a {len(tokens)}-token JSON document)",
        "",
        f"On {machine_line(doc['machine'])}.",
        "",
        *table(["engine", *(c.replace("_", " ") for c in cols)],
               [[f"{r['engine']} {r['version']}", *(f"{r[c]:.2f}" for c in cols)] for r in rows]),
    ]
    publish("grammar_engines", doc, lines)


if __name__ == "__main__":
    main()
