"""A prompt that arrives while a long one prefills: its time to first token, with and without the scheduler's share.

    .venv/bin/python benchmarks/arrivals.py [--long 6000] [--short 64] [--rounds 2] [--isa native avx2]

The default model in its default configuration, offline (the engine driven directly, no HTTP). A long prompt of
--long unique tokens starts alone on an idle engine; once a quarter of it is computed, a short prompt of --short
unique tokens arrives. Measured: the short prompt's time to first token (from its arrival), and the long one's
(from its own). Three runs per round, each in a process of its own:

    alone        the short prompt on an idle engine: what its TTFT is when nothing is in its way
    shared       the default scheduler: an arrival that could start gets half of the step's budget beside the
                 running prefill (engine/scheduler.py, "Arrivals")
    first come   the scheduler before that share: the long prompt takes whole budgets until its prompt is done

Each instruction-set path is its own process (`--isa avx2` forces SHOAL_CPU_ISA=avx2, the path an AVX2-only CPU
runs; "native" is this CPU's best). Writes benchmarks/results/arrivals-<CPU kind>.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from publish import cpu_kind, machine, machine_line, publish, table  # noqa: E402

MODES = ("alone", "shared", "first come")


def child(mode: str, long_len: int, short_len: int, seed: int) -> dict:
    """One measurement in this process: the TTFTs of the short prompt (and the long one, but alone)."""
    from shoal import LLM, SamplingParams
    from shoal.engine.scheduler import Scheduler
    from shoal.types import GenerationRequest

    if mode == "first come":
        Scheduler._arrival_waits = lambda self, seats: False  # the scheduler as it was: no share for arrivals
    llm = LLM("smollm2", max_model_len=8192)
    engine = llm.engine
    rng = random.Random(seed)

    def tokens(n: int) -> tuple[int, ...]:  # unique prompts: no prefix-cache hit (SmolLM2's vocabulary has 49,152)
        return tuple(rng.randrange(100, 40000) for _ in range(n))

    params = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate([list(tokens(600))], params)  # warm-up: first-call allocations at a full step's shapes
    long_ids, short_ids = tokens(long_len), tokens(short_len)  # the same pair in every mode of a round
    first: dict[str, float] = {}
    start: dict[str, float] = {}

    def step_until(done) -> None:
        while not done():
            for out in engine.step():
                if out.outputs[0].token_ids and out.request_id not in first:
                    first[out.request_id] = time.perf_counter()

    if mode != "alone":
        start["long"] = time.perf_counter()
        engine.add_request(GenerationRequest("long", long_ids, params))
        step_until(lambda: engine.scheduler.running and engine.scheduler.running[0].num_computed_tokens >= long_len // 4)
    start["short"] = time.perf_counter()
    engine.add_request(GenerationRequest("short", short_ids, params))
    step_until(lambda: not engine.has_unfinished())
    return {name: first[name] - t for name, t in start.items()}


def run(isa: str, mode: str, args, seed: int) -> dict:
    env = dict(os.environ)
    if isa != "native":
        env["SHOAL_CPU_ISA"] = isa
    cmd = [sys.executable, __file__, "--child", mode, "--long", str(args.long), "--short", str(args.short), "--seed", str(seed)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def markdown(doc: dict) -> list[str]:
    lines = [
        f"# A prompt arriving while a long one prefills ({time.strftime('%Y-%m-%d')}, {doc['cpu_kind']})", "",
        f"SmolLM2-135M-Instruct (the default configuration), offline. A {doc['long']:,}-token prompt starts alone; a "
        f"{doc['short']}-token prompt arrives once a quarter of it is computed. Median of {doc['rounds']} rounds, each run "
        f"in a process of its own. On {machine_line(doc['machine'])}.", "",
        "- **alone**: the short prompt on an idle engine;",
        "- **shared**: the default scheduler, which gives an arrival half of the step's budget beside a running prefill;",
        "- **first come**: the scheduler before that: the long prompt takes whole budgets until it is done.", "",
    ]
    rows = []
    for isa, runs in doc["runs"].items():
        med = {mode: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for mode, rs in runs.items()}
        alone, shared, fcfs = med["alone"]["short"], med["shared"]["short"], med["first come"]["short"]
        rows.append([isa, f"{alone * 1e3:.0f}", f"{shared * 1e3:.0f} ({shared / alone:.1f}x alone)",
                     f"{fcfs * 1e3:.0f} ({fcfs / alone:.1f}x alone)", f"{fcfs / shared:.1f}x",
                     f"{med['shared']['long']:.2f} s / {med['first come']['long']:.2f} s ({med['shared']['long'] / med['first come']['long']:.2f}x)"])
    lines += table(["path", "short TTFT alone (ms)", "shared (ms)", "first come (ms)", "first come / shared",
                    "long prompt's TTFT, shared / first come"], rows, align="lrrrrr")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--long", type=int, default=6000)
    ap.add_argument("--short", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--isa", nargs="+", default=["native", "avx2"], choices=["native", "avx512", "avx2", "baseline"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.long, args.short, args.seed)))
        return
    from tqdm import tqdm

    doc = {"machine": machine(), "cpu_kind": cpu_kind(), "long": args.long, "short": args.short, "rounds": args.rounds,
           "runs": {isa: {mode: [] for mode in MODES} for isa in args.isa}}
    with tqdm(total=args.rounds * len(args.isa) * len(MODES), desc="arrivals", unit="run", file=sys.stderr) as bar:
        for r in range(args.rounds):
            for isa in args.isa:
                for mode in MODES:  # the same prompts for the three, new ones each round
                    doc["runs"][isa][mode].append(run(isa, mode, args, args.seed + r))
                    bar.update()
    publish(f"arrivals-{doc['cpu_kind']}", doc, markdown(doc))


if __name__ == "__main__":
    main()
