"""Where a one-stream decode step's time goes: inside shoal's native calls, and everything else (issue 53).

    .venv/bin/python benchmarks/step_cost.py                          # the default model, every path this CPU has
    .venv/bin/python benchmarks/step_cost.py --models smollm2 .peers/models/random-1b-Q4_0.gguf --rounds 2

One stream decodes greedily with the offline engine (`LLM`, speculation off, so every forward is one token; no
`ignore_eos`, as a chat client asks, so the answer may end before `--tokens`: a step's time is per token made) on each
model, each code path (SHOAL_CPU_ISA), on both cores and held to one (`taskset -c 0`, one thread: a stand-in for
a slower machine, where the kernels slow down and Python's share does not), three ways: the default (the native
forward, and decode runs: a step of several forwards where they take under --decode-run-ms, engine/scheduler.py),
the native forward a token a step (decode_run_ms=0), and the Python forward (SHOAL_NATIVE_FORWARD=0: the layers op
by op from Python). Each case runs in a process of its own, the three taking turns round after round.

- **step**: milliseconds a token, the median of the timed generations;
- **native**: the time inside native calls a token: the decoder plan (kernels/decoder.cpp: the embedding lookup,
  the rope tables and every layer in one call; a decode run's forwards and greedy picks in one, greedy_run) and
  every shoal_kernels op called from Python (the logits head with
  the greedy pick, greedy_head; with the native forward off, every layer's ops too), timed around each call in a second,
  instrumented pass;
- **outside**: step - native: Python, torch's dispatcher and the tensors the runner, the sampler, the scheduler and
  the engine build and read each step. Its share of the step is what issue 53 bounds (<= 10% on the default model);
- **RSS**: the process's resident memory after its timed generations (the native forward holds references to the
  model's tensors, no copies, so it should match the Python forward's).

The outside milliseconds are roughly the same on a faster and a slower core of one clock, and the native ones
scale with the memory the step reads, so a slower CPU's step is about outside * (this clock / its clock) plus
native * (this bandwidth / its bandwidth). Results: benchmarks/results/step_cost-<CPU kind>.{md,json} (`--out` names another machine's).
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

PATHS = ("avx512", "avx2")
OPS = ("greedy_head", "greedy_rows", "row_argmax", "gguf_linear", "gguf_rows", "gguf_grouped_linear", "q4_linear", "q8_linear",
       "invariant_attention", "rms_norm", "add_rms_norm", "rope_", "silu_mul")
PROMPT = "Write a long story about a lighthouse keeper and the ships she guides through the winter storms."


class Timer:
    """Nanoseconds spent inside wrapped callables."""

    def __init__(self) -> None:
        self.ns = 0
        self.calls = 0

    def wrap(self, f):
        def timed(*args, **kwargs):
            t = time.perf_counter_ns()
            try:
                return f(*args, **kwargs)
            finally:
                self.ns += time.perf_counter_ns() - t
                self.calls += 1
        return timed


class TimedPlan:
    """A decoder plan whose calls are timed."""

    def __init__(self, plan, timer: Timer) -> None:
        self.forward = timer.wrap(plan.forward)
        self.forward_ids = timer.wrap(plan.forward_ids)
        self.greedy_run = timer.wrap(plan.greedy_run)


def measure(model: str, tokens: int, reps: int, decode_run_ms: float) -> dict:
    """In the child process: one stream's step time, and the native part of it."""
    import torch

    from gguf_formats import rss_bytes

    from shoal import kernels
    from shoal.engine.llm import LLM
    from shoal.types import SamplingParams

    llm = LLM(model, speculative="off", decode_run_ms=decode_run_ms)
    # a request as a chat client sends it: no ignore_eos, whose ban of the end token costs the sampler a copy of the
    # logits every step (0.05 ms of a 4.5 ms step); greedy, so every generation is the same length
    params = SamplingParams(temperature=0.0, max_tokens=tokens)
    chat = [{"role": "user", "content": PROMPT}]
    n = len(llm.chat(chat, params)[0].outputs[0].token_ids)  # warm-up: the plan is built, the pages are in
    if n < tokens // 2:
        raise SystemExit(f"{model} ended its answer after {n} tokens: too short to time a step")
    counted = [0]

    def per_token() -> float:
        t = time.perf_counter()
        out = llm.chat(chat, params)[0]
        counted[0] += len(out.outputs[0].token_ids)
        return (time.perf_counter() - t) / len(out.outputs[0].token_ids) * 1e3

    steps = [per_token() for _ in range(reps)]
    counted[0] = 0
    timer = Timer()
    ns = torch.ops.shoal_kernels
    for name in OPS:
        setattr(ns, name, timer.wrap(getattr(ns, name)))
    decoder = llm.engine.runner.model.model
    native = decoder.__dict__.get("native_forward")
    if native is not None:
        native.plan = TimedPlan(native.plan, timer)
    instrumented = [per_token() for _ in range(reps)]
    native_ms = timer.ns / 1e6 / counted[0]
    timed = sum(instrumented) / reps
    # outside: the instrumented pass's own step less its native time (both of one pass, so the memory's pace that
    # day cancels); the wrappers add about 0.5 us a native call to it
    return {"model": model, "path": kernels.isa(), "threads": torch.get_num_threads(), "native_forward": native is not None,
            "step_ms": statistics.median(steps), "steps_ms": steps, "instrumented_ms": timed, "native_ms": native_ms,
            "outside_ms": timed - native_ms, "native_calls_per_token": timer.calls / counted[0], "generated": n,
            "decode_run_ms": decode_run_ms,
            "rss_bytes": rss_bytes(os.getpid())}  # resident after the timed passes: the weights, the KV pool's written part


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["smollm2"], help="models to measure (default: the default model)")
    ap.add_argument("--paths", nargs="+", choices=PATHS, help="code paths (default: every one this CPU has)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds; in each, every case runs once, native and Python in turn")
    ap.add_argument("--tokens", type=int, default=128, help="tokens a timed generation decodes (default 128)")
    ap.add_argument("--reps", type=int, default=3, help="timed generations per case and round (default 3)")
    ap.add_argument("--out", default=None, help="results name in benchmarks/results (default: step_cost-<CPU kind>; "
                    "another machine of the same kind gets a name of its own)")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)  # model, tokens, reps, decode_run_ms: the child process's mode
    a = ap.parse_args()
    if a.child:
        print(json.dumps(measure(a.child[0], int(a.child[1]), int(a.child[2]), float(a.child[3]))))
        return
    from publish import cpu_kind, machine, machine_line, publish, table

    import torch

    from shoal import kernels
    from shoal.config import SchedulerConfig

    assert kernels.available(), "shoal's native kernels did not build"
    best = int(torch.ops.shoal_kernels.use_isa(0))
    paths = [p for p in (a.paths or PATHS) if kernels.ISA_LEVELS[p] <= best]
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")}
    cases = [(m, p, cores) for m in a.models for p in paths for cores in ("all", "one")]
    default_ms = SchedulerConfig().decode_run_ms
    # (name, SHOAL_NATIVE_FORWARD, decode_run_ms): the default, the native forward a token a step, the Python forward
    ways = [("default", "1", default_ms), ("a token a step", "1", 0.0), ("Python forward", "0", default_ms)]
    runs: list[dict] = []
    total, done = len(cases) * len(ways) * a.rounds, 0
    for r in range(a.rounds):
        for model, path, cores in cases:
            turn = (r + len(runs)) % len(ways)  # the ways take turns going first
            for name, flag, ms in ways[turn:] + ways[:turn]:
                done += 1
                print(f"[{done}/{total}] round {r + 1}: {Path(model).name}, {path}, {cores} cores, {name}", file=sys.stderr, flush=True)
                child_env = {**env, "SHOAL_CPU_ISA": path, "SHOAL_NATIVE_FORWARD": flag}
                cmd = [sys.executable, __file__, "--child", model, str(a.tokens), str(a.reps), str(ms)]
                if cores == "one":
                    child_env["OMP_NUM_THREADS"] = "1"
                    cmd = ["taskset", "-c", "0", *cmd]
                out = subprocess.run(cmd, env=child_env, stdout=subprocess.PIPE, text=True, check=True)
                run = {**json.loads(out.stdout), "round": r + 1, "cores": cores, "isa": path, "way": name}
                runs.append(run)
                print(f"    {run['step_ms']:.2f} ms a token; instrumented {run['instrumented_ms']:.2f}: {run['native_ms']:.2f} native, "
                      f"{run['outside_ms']:.2f} outside ({run['outside_ms'] / run['instrumented_ms']:.0%})", file=sys.stderr, flush=True)
    doc = {"machine": machine(), "tokens": a.tokens, "reps": a.reps, "rounds": a.rounds, "runs": runs}
    kind = cpu_kind(doc["machine"]["cpu_flags"])
    rows = []
    for model, path, cores in cases:
        cells = [Path(model).name, path, cores]
        for name, flag, _ in ways:
            mine = [x for x in runs if (x["model"], x["isa"], x["cores"], x["way"], x["native_forward"]) == (model, path, cores, name, flag == "1")]
            if not mine:  # a model the native forward does not cover
                cells.append("n/a")
                continue
            step = statistics.median(x["step_ms"] for x in mine)
            share = statistics.median(x["outside_ms"] / x["instrumented_ms"] for x in mine)
            out = statistics.median(x["outside_ms"] for x in mine)
            rss = statistics.median(x["rss_bytes"] for x in mine) / 2**20
            cells.append(f"{step:.2f}: {step - out:.2f} + {out:.2f} ({share:.0%}), RSS {rss:.0f} MiB")
        rows.append(cells)
    made = ", ".join(sorted({f"{Path(x['model']).name} {x['generated']}" for x in runs}))
    lines = [f"# A one-stream decode step: native calls and everything else ({kind})", "",
             f"On {machine_line(doc['machine'])}. One stream, greedy, speculation off (every forward one token), up to {a.tokens} tokens a generation "
             f"({made} made), "
             f"{a.reps} generations a case and round, {a.rounds} rounds (medians). Milliseconds a token: step: native + "
             "outside (outside's share of the instrumented step), and the process's resident memory after its timed "
             "generations. `one` core: `taskset -c 0` and one thread. "
             "`benchmarks/step_cost.py` says what each part holds.", "",
             *table(["model", "path", "cores", f"default (native forward, decode runs of up to {default_ms:g} ms)",
                     "native forward, a token a step (decode_run_ms=0)", "Python forward (SHOAL_NATIVE_FORWARD=0)"], rows)]
    publish(a.out or f"step_cost-{kind}", doc, lines)


if __name__ == "__main__":
    main()
