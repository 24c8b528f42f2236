"""shoal's native kernels against torch's ops, per code path, at the default model's shapes.

    .venv/bin/python benchmarks/kernels.py                 # every path this CPU has
    .venv/bin/python benchmarks/kernels.py --paths avx2    # one path

Each path runs in a process of its own with SHOAL_CPU_ISA set: that forces shoal's kernels onto the path
and caps torch's own kernels (ATen, oneDNN, MKL) to the same instructions, so both sides of a ratio run
the same instruction set, as on a CPU that has nothing wider. Shapes are SmolLM2-135M's (the default
model: 9 query heads over 3 KV heads of 64, hidden 576, MLP 1536, vocabulary 49,152):
- attention, float32 and bfloat16: 1 row (one decode), 32 rows (32 sequences' decodes) and 512 rows
  (a prefill chunk ending at the context), at 0.5k, 2k and 8k tokens of context. shoal's op reads its
  paged cache; torch's scaled_dot_product_attention gets contiguous keys and values (a chunk: a causal
  mask offset to the chunk's start);
- a layer's low-bit projections (q/k/v, o, gate/up, down; the GGUF's Q4_1) and the logits head (Q8_0)
  at 1, 32 and 512 rows, float32 activations, against torch's float32 linear on the same weights
  dequantized (what `--quantization none` runs);
- the row ops (residual add + RMSNorm, rotary, SiLU-and-multiply) at 1, 32 and 512 rows, against the
  torch ops that compute them.

A time is the median of repeated calls (at least 0.2 s of them) after a warm-up, both cores in use.
Results: benchmarks/results/kernels-<CPU kind>.{md,json}, the kind named by publish.cpu_kind.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import shoal  # noqa: E402,F401  before torch: SHOAL_CPU_ISA caps torch's kernels only if set before torch loads

PATHS = ("avx512", "avx2", "baseline")
HQ, HKV, D, BS = 9, 3, 64, 16
HIDDEN, MLP, VOCAB = 576, 1536, 49152
ROWS = (1, 32, 512)
CONTEXTS = (512, 2048, 8192)


def timed(f, min_seconds: float = 0.2, min_calls: int = 5) -> float:
    """Median milliseconds of f() over at least min_calls calls and min_seconds, after one warm-up call."""
    f()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_calls or time.perf_counter() - start < min_seconds:
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def attention_cases(dtype):
    """(name, shoal's call, torch's call) for each rows x context."""
    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(0)
    for rows in ROWS:
        for ctx in CONTEXTS:
            seqs = rows if rows == 32 else 1
            per = -(-ctx // BS)
            kv = torch.randn(2, HKV, seqs * per + 1, BS, D, generator=gen).to(dtype)
            tables = torch.arange(seqs * per, dtype=torch.int32).view(seqs, per)
            if rows == 512:  # a chunk of one sequence, ending at the context
                row_seq = torch.zeros(rows, dtype=torch.int32)
                row_pos = torch.arange(ctx - rows, ctx, dtype=torch.int32)
            else:  # decodes, each of its own sequence
                row_seq = torch.arange(rows, dtype=torch.int32)
                row_pos = torch.full((rows,), ctx - 1, dtype=torch.int32)
            q = torch.randn(rows, HQ, D, generator=gen).to(dtype)
            none = torch.empty(0, HKV, D, dtype=dtype)
            slots = torch.empty(0, dtype=torch.long)

            def shoal_op(q=q, kv=kv, tables=tables, row_seq=row_seq, row_pos=row_pos, none=none, slots=slots):
                return torch.ops.shoal_kernels.invariant_attention(q, none, none, kv, slots, tables, row_seq, row_pos,
                                                                   D**-0.5, 0, HQ // HKV)

            # torch's op on contiguous keys and values: [batch, heads, positions, D]
            k = torch.randn(seqs, HKV, ctx, D, generator=gen).to(dtype)
            v = torch.randn(seqs, HKV, ctx, D, generator=gen).to(dtype)
            if rows == 512:
                tq = q.view(1, rows, HQ, D).transpose(1, 2)
                mask = torch.ones(rows, ctx, dtype=torch.bool).tril(ctx - rows)

                def torch_op(tq=tq, k=k, v=v, mask=mask):
                    return F.scaled_dot_product_attention(tq, k, v, attn_mask=mask, enable_gqa=True)
            else:
                tq = q.view(rows, 1, HQ, D).transpose(1, 2)

                def torch_op(tq=tq, k=k, v=v):
                    return F.scaled_dot_product_attention(tq, k, v, enable_gqa=True)

            yield f"{rows} rows at {ctx}", shoal_op, torch_op


def matmul_cases():
    """A layer's four low-bit projections, and the head, per row count."""
    import torch
    import torch.nn.functional as F

    from shoal.model.quant import Q4Codes, pack_q4, pack_q8, round_q4, round_q8

    gen = torch.Generator().manual_seed(1)
    layer = [(3 * 192 + 384, HIDDEN), (HIDDEN, HIDDEN), (2 * MLP, HIDDEN), (HIDDEN, MLP)]  # q|k|v, o, gate|up, down
    q4 = []
    for n, k in layer:
        codes = Q4Codes(*round_q4(torch.randn(n, k, generator=gen) * 0.05))
        q4.append((n, pack_q4(codes), codes.dequantized()))
    head_codes, head_scale = round_q8(torch.randn(VOCAB, HIDDEN, generator=gen) * 0.05)
    head_packed = pack_q8(head_codes, head_scale)
    head_float = (head_codes.float().view(VOCAB, -1, 32) * head_scale[..., None]).view(VOCAB, HIDDEN)
    for rows in ROWS:
        xs = {k: torch.randn(rows, k, generator=gen) for k in (HIDDEN, MLP)}

        def shoal_layer(xs=xs):
            for (n, packed, w), (_, k) in zip(q4, layer):
                torch.ops.shoal_kernels.q4_linear(xs[k], packed, n)

        def torch_layer(xs=xs):
            for (n, packed, w), (_, k) in zip(q4, layer):
                F.linear(xs[k], w)

        yield f"a layer's Q4_1 projections, {rows} rows", shoal_layer, torch_layer
        x = xs[HIDDEN]
        yield (f"the Q8_0 head, {rows} rows", lambda x=x: torch.ops.shoal_kernels.q8_linear(x, head_packed, VOCAB),
               lambda x=x: F.linear(x, head_float))


def row_cases():
    import torch
    import torch.nn.functional as F

    from shoal import kernels

    gen = torch.Generator().manual_seed(2)
    w = torch.randn(HIDDEN, generator=gen)
    for rows in ROWS:
        x, delta = torch.randn(rows, HIDDEN, generator=gen), torch.randn(rows, HIDDEN, generator=gen)
        qk = torch.randn(rows, HQ + HKV, D, generator=gen)
        cos, sin = torch.randn(rows, D, generator=gen), torch.randn(rows, D, generator=gen)
        gate_up = torch.randn(rows, 2 * MLP, generator=gen)

        def torch_norm(x=x, delta=delta):
            s = x + delta
            return s, F.rms_norm(s, (HIDDEN,), w, 1e-5)

        def torch_rope(qk=qk, cos=cos, sin=sin):  # what the op computes: x cos + roll(x, D/2) signed_sin
            return qk * cos[:, None] + torch.roll(qk, D // 2, -1) * sin[:, None]

        def torch_silu(gate_up=gate_up):
            gate, up = gate_up.chunk(2, dim=-1)
            return F.silu(gate) * up

        yield (f"add + RMSNorm, {rows} rows", lambda x=x, delta=delta: kernels.add_rms_norm(x, delta, w, 1e-5), torch_norm)
        yield f"rotary (q and k), {rows} rows", lambda qk=qk, cos=cos, sin=sin: kernels.rope_(qk, cos, sin), torch_rope
        yield f"SiLU-and-multiply, {rows} rows", lambda gate_up=gate_up: kernels.silu_mul(gate_up), torch_silu


def measure_path() -> dict:
    """In a process forced onto one path: every case's times."""
    import torch

    from shoal import kernels

    assert kernels.available(), "shoal's native kernels did not build"
    out = {"path": kernels.isa(), "torch_capability": torch.backends.cpu.get_cpu_capability(), "cases": []}
    groups = [("attention, float32", attention_cases(torch.float32)), ("attention, bfloat16", attention_cases(torch.bfloat16)),
              ("low-bit matmuls", matmul_cases()), ("row ops", row_cases())]
    for group, cases in groups:
        for name, shoal_op, torch_op in cases:
            s, t = timed(shoal_op), timed(torch_op)
            out["cases"].append({"group": group, "case": name, "shoal_ms": s, "torch_ms": t})
            print(f"  {out['path']:16s} {group:20s} {name:36s} shoal {s:9.3f} ms  torch {t:9.3f} ms  {t / s:6.2f}x",
                  file=sys.stderr, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--paths", nargs="+", choices=PATHS, help="the code paths to measure (default: every one this CPU has)")
    ap.add_argument("--one-path", action="store_true", help=argparse.SUPPRESS)  # the child process's mode
    a = ap.parse_args()
    if a.one_path:
        print(json.dumps(measure_path()))
        return
    from publish import cpu_kind, machine, machine_line, publish, table

    from shoal import kernels

    assert kernels.available(), "shoal's native kernels did not build"
    best = int(__import__("torch").ops.shoal_kernels.use_isa(0))
    paths = [p for p in (a.paths or PATHS) if kernels.ISA_LEVELS[p] <= best]
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")}
    results = []
    for i, path in enumerate(paths, 1):
        print(f"[{i}/{len(paths)}] the {path} path, in a process of its own (SHOAL_CPU_ISA={path})", file=sys.stderr, flush=True)
        done = subprocess.run([sys.executable, __file__, "--one-path"], env={**env, "SHOAL_CPU_ISA": path},
                              stdout=subprocess.PIPE, text=True, check=True)
        results.append(json.loads(done.stdout))
    doc = {"machine": machine(), "paths": results}
    kind = cpu_kind(doc["machine"]["cpu_flags"])
    lines = [f"# shoal's native kernels against torch's ops, per code path ({kind})", "",
             f"On {machine_line(doc['machine'])}. Each path ran in its own process with SHOAL_CPU_ISA set, torch's kernels "
             "capped to the same instructions. Milliseconds a call (median); torch/shoal above 1 means shoal's op is faster. "
             "`benchmarks/kernels.py` says what each case is."
             + (" MKL, behind torch's float32 linear, ignores MKL_ENABLE_INSTRUCTIONS on an AMD CPU: there the low-bit "
                "matmuls' torch column ran MKL's own choice of code on every path." if "AMD" in (doc["machine"].get("cpu_model") or "") else ""),
             ""]
    cases = [(c["group"], c["case"]) for c in results[0]["cases"]]
    by_path = {r["path"]: {(c["group"], c["case"]): c for c in r["cases"]} for r in results}
    header = ["group", "case"] + [f"{p}: shoal / torch ms (torch/shoal)" for p in by_path]
    rows = []
    for key in cases:
        cells = []
        for p in by_path:
            c = by_path[p][key]
            cells.append(f"{c['shoal_ms']:.3f} / {c['torch_ms']:.3f} ({c['torch_ms'] / c['shoal_ms']:.2f}x)")
        rows.append([*key, *cells])
    lines += table(header, rows)
    publish(f"kernels-{kind}", doc, lines)


if __name__ == "__main__":
    main()
