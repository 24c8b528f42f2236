"""Tensor and pipeline parallelism on one machine: one process against two ranks, the two
tensor-parallel ranks' collectives through shared memory (the default) against gloo over loopback,
and two pipeline stages (one batch in flight), same run.

    .venv/bin/python benchmarks/tensor_parallel.py [--rounds 2] [--dtype auto]

For each configuration in turn (rebuilt every round, as only one process group
can live in a process), offline on the default model:

- output tokens/s with 1 and with 16 requests in flight (64 tokens each, ignore_eos);
- on rank 0, the time spent in the collectives (the per-layer sums and the
  step's broadcast, waiting for the other rank included) as a share of the
  forward's time: the issue's "more than a fifth of a TP step" test.

On a 2-core machine two ranks get one core each where one process had two, so
tensor parallelism cannot be faster here; what it buys is room (each rank holds
half the layers' weights and half the KV cache). The ratios say what the
communication costs. Writes benchmarks/results/tensor_parallel.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch.distributed as dist  # noqa: E402

from shoal import LLM, SamplingParams  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
CONFIGS = {  # name -> LLM keyword arguments
    "1 process": {},
    "2 ranks, shared memory": {"tensor_parallel_size": 2},
    "2 ranks, gloo": {"tensor_parallel_size": 2, "shared_memory": False},
    "2 pipeline stages": {"pipeline_parallel_size": 2},
}
STREAMS = (1, 16)


class Clock:
    """Seconds rank 0 spends inside `fn` calls."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, fn):
        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.seconds += time.perf_counter() - t

        return timed


def measure(kwargs: dict, dtype: str, salt: int) -> dict:
    comm, forward = Clock(), Clock()
    with LLM("smollm2", dtype=dtype, max_model_len=2048, **kwargs) as llm:
        ex = llm.engine.executor
        runner = llm.engine.runner
        if hasattr(ex, "group"):  # the whole distributed forward (broadcast, rank 0's part, the others') is the base
            ex._forward_everywhere = forward.wrap(ex._forward_everywhere)
            group = ex.group
            group.broadcast = comm.wrap(group.broadcast)
            group.send_hidden = comm.wrap(group.send_hidden)  # pipeline hops; the way back waits for the other stages
            group.recv_hidden = comm.wrap(group.recv_hidden)
            if group.shm is not None:
                group.shm.reduce = comm.wrap(group.shm.reduce)
            else:
                dist.all_gather = comm.wrap(dist.all_gather)
        else:
            runner.forward = forward.wrap(runner.forward)
        tok = llm.engine.tokenizer
        llm.generate([tok.encode("warm up the kernels")], SamplingParams(max_tokens=8, ignore_eos=True))
        out = {}
        for n in STREAMS:
            prompts = [tok.encode(f"Story {salt}-{i}: the river and the stone, chapter {i}.") for i in range(n)]
            shm = getattr(getattr(ex, "group", None), "shm", None)
            comm.seconds = forward.seconds = 0.0
            if shm is not None:
                shm.waited = 0.0
            t = time.perf_counter()
            outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
            dt = time.perf_counter() - t
            out[f"tok_s_{n}"] = sum(len(o.outputs[0].token_ids) for o in outs) / dt
            out[f"comm_share_{n}"] = comm.seconds / forward.seconds if forward.seconds else 0.0
            # the part of it spent waiting for the other rank to arrive (shared memory only: gloo's wait is inside its call)
            sums = shm is not None and kwargs.get("tensor_parallel_size", 1) > 1  # pipeline stages post no sums
            out[f"wait_share_{n}"] = shm.waited / forward.seconds if sums and forward.seconds else None
    return out


def _cpu() -> str:
    try:
        name = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        name = platform.machine()
    return f"{name} ({os.cpu_count()} cores)"


def _waits(m: dict) -> str:
    if m.get("wait_share_1") is None:
        return "n/a"
    return f"{m['wait_share_1']:.0%} / {m['wait_share_16']:.0%}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dtype", default="auto")
    a = p.parse_args()
    real_all_gather = dist.all_gather
    runs: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    for r in range(a.rounds):
        for name, kwargs in CONFIGS.items():
            print(f"round {r + 1}/{a.rounds}: {name} ...", file=sys.stderr, flush=True)
            dist.all_gather = real_all_gather
            runs[name].append(measure(kwargs, a.dtype, r))
            print(f"  {runs[name][-1]}", file=sys.stderr, flush=True)
    dist.all_gather = real_all_gather
    med = {name: {k: (statistics.median(x[k] for x in rs) if rs[0][k] is not None else None) for k in rs[0]} for name, rs in runs.items()}
    base = med["1 process"]
    lines = [
        "# Tensor and pipeline parallelism on one machine",
        "",
        f"`benchmarks/tensor_parallel.py --rounds {a.rounds} --dtype {a.dtype}` on {_cpu()}, "
        "default model, 64 output tokens per request, median over rounds. Comm share: rank 0's time in the step's "
        "broadcast, the per-layer sums and the pipeline's sends and receives (waiting for the other ranks included: for "
        "pipeline stages, the way back is the other stage's whole compute) over the whole forward; of which waiting: the "
        "part spent waiting for the other rank to post a sum (shared memory only).",
        "",
        "| configuration | 1 stream tok/s | vs 1 process | 16 streams tok/s | vs 1 process | comm share, 1 stream | comm share, 16 streams | of which waiting, 1 / 16 streams |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, m in med.items():
        lines.append(f"| {name} | {m['tok_s_1']:.1f} | {m['tok_s_1'] / base['tok_s_1']:.2f}x | {m['tok_s_16']:.1f} | "
                     f"{m['tok_s_16'] / base['tok_s_16']:.2f}x | {m['comm_share_1']:.0%} | {m['comm_share_16']:.0%} | {_waits(m)} |")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "tensor_parallel.md").write_text("\n".join(lines) + "\n")
    (RESULTS / "tensor_parallel.json").write_text(json.dumps({"args": vars(a), "runs": runs, "median": med}, indent=2))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
