"""Scale-out on one machine and across a shaped link: one process against two tensor-parallel ranks and two
pipeline stages, the bytes each pipeline hop sends, and a projection to N machines.

    .venv/bin/python benchmarks/scale_out.py [--rounds 2] [--dtype auto] [--no-netns]

Every configuration is rebuilt in turn each round (one process group lives in a
process at a time), offline, on the default model, 64 greedy output tokens per
request (ignore_eos), at 1, 16 and 64 requests in flight:

- "1 process": the whole model, every core (two threads on a 2-core machine);
- "TP=2, shared memory" (the default on one machine) and "TP=2, gloo": two
  ranks, one thread each, the per-layer gathers through /dev/shm or gloo on loopback;
- "PP=2": two pipeline stages, one thread each, a micro-batch per stage in flight;
- "TP=2 / PP=2, rank 1 behind the link": rank 1 in its own network namespace, joined
  by a veth pair that `tc netem` shapes to 1 Gbit/s with 0.5 ms of delay each way
  (`shoal worker` there, `shoal serve --nnodes 2` here, gloo between them). The
  benchmark creates and removes the namespace; where it cannot (no root, no
  `ip`/`tc`), it says so and skips those rows. A kernel without netem gets the
  rate alone (a token bucket), and the results say so.

For each: output tokens/s, and rank 0's time in communication (the step's
broadcast, the per-layer gathers, the pipeline's sends and receives; waiting for
the other rank included) as a share of its time in the step. Then the bytes a
pipeline hop sends per token for each --pp-wire-dtype, and a projection of
tokens/s for N machines on 1, 10 and 25 Gbit/s links (the model is written out
in the results). Writes benchmarks/results/scale_out.{md,json}.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch.distributed as dist  # noqa: E402

from publish import load, machine, machine_line, publish, table  # noqa: E402
from shoal import LLM, SamplingParams  # noqa: E402
from shoal.executor.launch import free_port  # noqa: E402
from shoal.executor.wire import WIRE, wire_bytes_per_token  # noqa: E402

LOCAL = {  # name -> LLM keyword arguments
    "1 process": {},
    "TP=2, shared memory": {"tensor_parallel_size": 2},
    "TP=2, gloo": {"tensor_parallel_size": 2, "shared_memory": False},
    "PP=2": {"pipeline_parallel_size": 2},
}
SHAPED = {  # rank 1 behind the shaped link
    "TP=2, rank 1 behind the link": {"tensor_parallel_size": 2},
    "PP=2, rank 1 behind the link": {"pipeline_parallel_size": 2},
}
STREAMS = (1, 16, 64)
TOKENS = 64
NS, HOST_IF, NS_IF = "shoal-bench", "shoal-a", "shoal-b"
HOST_IP, NS_IP = "10.77.0.1", "10.77.0.2"
LINK = {"rate": "1gbit", "delay": "0.5ms"}


class Clock:
    """Seconds rank 0 spends inside `fn` calls (a wrapped call inside another counts once)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.depth = 0

    def wrap(self, fn):
        def timed(*a, **k):
            if self.depth:
                return fn(*a, **k)
            self.depth += 1
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.seconds += time.perf_counter() - t
                self.depth -= 1

        return timed


def instrument(llm: LLM, comm: Clock, step: Clock) -> None:
    ex = llm.engine.executor
    if not hasattr(ex, "group"):
        llm.engine.runner.forward = step.wrap(llm.engine.runner.forward)
        return
    # tensor parallel: the whole step is submit; pipeline: stage 0's part and the send (submit), the wait and the
    # sampling (collect)
    ex.submit, ex.collect = step.wrap(ex.submit), step.wrap(ex.collect)
    group = ex.group
    for name in ("broadcast", "send_hidden", "recv_hidden", "settle"):  # settle: rank 0's waits for collectives
        setattr(group, name, comm.wrap(getattr(group, name)))
    if group.shm is not None:
        group.shm.gather = comm.wrap(group.shm.gather)
    else:
        dist.all_gather = comm.wrap(dist.all_gather)


def measure(kwargs: dict, dtype: str, salt: int) -> dict:
    comm, step = Clock(), Clock()
    real_all_gather = dist.all_gather
    try:
        with LLM("smollm2", dtype=dtype, max_model_len=2048, **kwargs) as llm:
            instrument(llm, comm, step)
            tok = llm.engine.tokenizer
            llm.generate([tok.encode("warm up the kernels")], SamplingParams(max_tokens=8, ignore_eos=True))
            out = {}
            for n in STREAMS:
                prompts = [tok.encode(f"Story {salt}-{i}: the river and the stone, chapter {i}.") for i in range(n)]
                comm.seconds = step.seconds = 0.0
                t = time.perf_counter()
                outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True))
                dt = time.perf_counter() - t
                out[f"tok_s_{n}"] = sum(len(o.outputs[0].token_ids) for o in outs) / dt
                out[f"step_ms_{n}"] = 1000 * dt / TOKENS  # wall time per token of every stream
                out[f"comm_share_{n}"] = comm.seconds / step.seconds if step.seconds else 0.0
            ranks = llm.engine.executor.cluster()["ranks"]
            out["layers"] = [r["layers"] for r in ranks]
            model = llm.engine.runner.model  # rank 0's weights: all of them in one process
            out["weight_bytes"] = sum(t.numel() * t.element_size() for name, t in [*model.named_parameters(), *model.named_buffers()]
                                      if "rotary" not in name)
            out["rank_weight_bytes"] = [r.get("weights_bytes", out["weight_bytes"]) for r in ranks]
            return out
    finally:
        dist.all_gather = real_all_gather


# ---------------------------------------------------------------- the shaped link


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def _shape(qdisc: list[str]) -> None:
    _sh("tc", "qdisc", "add", "dev", HOST_IF, "root", *qdisc)
    _sh("ip", "netns", "exec", NS, "tc", "qdisc", "add", "dev", NS_IF, "root", *qdisc)


@contextlib.contextmanager
def shaped_link():
    """A network namespace joined to this one by a veth pair shaped to LINK each way: yields (True, how it
    is shaped), or (False, why not)."""
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        yield False, "network namespaces need root, ip and tc"
        return
    subprocess.run(["ip", "netns", "del", NS], capture_output=True)
    try:
        _sh("ip", "netns", "add", NS)
        _sh("ip", "link", "add", HOST_IF, "type", "veth", "peer", "name", NS_IF)
        _sh("ip", "link", "set", NS_IF, "netns", NS)
        _sh("ip", "addr", "add", f"{HOST_IP}/24", "dev", HOST_IF)
        _sh("ip", "link", "set", HOST_IF, "up")
        _sh("ip", "netns", "exec", NS, "ip", "addr", "add", f"{NS_IP}/24", "dev", NS_IF)
        _sh("ip", "netns", "exec", NS, "ip", "link", "set", NS_IF, "up")
        _sh("ip", "netns", "exec", NS, "ip", "link", "set", "lo", "up")
        shaped = "shaped by tc netem to {rate} and {delay} each way".format(**LINK)
        try:
            _shape(["netem", "delay", LINK["delay"], "rate", LINK["rate"]])
        except subprocess.CalledProcessError:  # a kernel without sch_netem: the rate alone, by a token bucket
            _shape(["tbf", "rate", LINK["rate"], "burst", "128kb", "latency", "50ms"])
            shaped = f"shaped by tc tbf to {LINK['rate']} each way; this kernel has no netem, so no delay was added"
    except (subprocess.CalledProcessError, OSError) as e:
        subprocess.run(["ip", "netns", "del", NS], capture_output=True)
        subprocess.run(["ip", "link", "del", HOST_IF], capture_output=True)
        yield False, f"could not create the namespace ({getattr(e, 'stderr', '') or e})".strip()
        return
    try:
        yield True, shaped
    finally:
        subprocess.run(["ip", "netns", "del", NS], capture_output=True)  # takes the veth pair with it
        subprocess.run(["ip", "link", "del", HOST_IF], capture_output=True)


def measure_shaped(kwargs: dict, dtype: str, salt: int) -> dict:
    """Rank 0 here, rank 1 (`shoal worker`) in the namespace; one thread each, as on one machine."""
    port = free_port(HOST_IP)
    size = ["--tensor-parallel-size", str(kwargs.get("tensor_parallel_size", 1)),
            "--pipeline-parallel-size", str(kwargs.get("pipeline_parallel_size", 1))]
    cmd = ["ip", "netns", "exec", NS, "env", f"GLOO_SOCKET_IFNAME={NS_IF}", sys.executable, "-m", "shoal.cli", "worker",
           *size, "--nnodes", "2", "--node-rank", "1", "--master-addr", HOST_IP, "--master-port", str(port)]
    worker = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              cwd=Path(__file__).resolve().parent.parent)
    old = os.environ.get("GLOO_SOCKET_IFNAME")
    os.environ["GLOO_SOCKET_IFNAME"] = HOST_IF
    try:
        return measure({**kwargs, "nnodes": 2, "master_addr": HOST_IP, "master_port": port, "shared_memory": False,
                        "num_threads": 1}, dtype, salt)
    finally:
        if old is None:
            os.environ.pop("GLOO_SOCKET_IFNAME", None)
        else:
            os.environ["GLOO_SOCKET_IFNAME"] = old
        try:
            worker.wait(timeout=30)
        except subprocess.TimeoutExpired:
            worker.kill()


# ---------------------------------------------------------------- the projection

SHAPES = {  # name -> (hidden, layers, weight bytes of the layers in bf16, MLP intermediate size)
    "SmolLM2-135M": (576, 30, 30 * 2 * (576 * (576 + 2 * 192) + 576 * 576 + 3 * 576 * 1536), 1536),
    "70B (Llama-2/3 shape)": (8192, 80, 80 * 2 * (8192 * (8192 + 2 * 1024) + 8192 * 8192 + 3 * 8192 * 28672), 28672),
}
LINKS_GBIT = (1, 10, 25)
HOP_LATENCY_S = 0.5e-3
STAGES = (2, 4, 8)


def projection(token_s: float, weight_bytes: int) -> list[str]:
    """One stream's tokens/s through N stages, and a long prompt's time per hop (the model: see the text)."""
    rows, prompt_rows = [], []
    for name, (hidden, _, layer_bytes, _) in SHAPES.items():
        # SmolLM2: the measured time per token; the 70B: scaled by its bf16 layers' bytes over the weights measured
        compute = token_s if name.startswith("SmolLM2") else token_s * layer_bytes / weight_bytes
        back = wire_bytes_per_token(hidden, "float32")  # the last hop, to the logits, is never compressed
        for wire in ("float32", "bfloat16", "int8"):
            hop = wire_bytes_per_token(hidden, wire)
            cells = []
            for n in STAGES:
                for g in LINKS_GBIT:
                    bw = g * 1e9 / 8
                    cells.append(f"{1 / (compute + (n - 1) * (HOP_LATENCY_S + hop / bw) + HOP_LATENCY_S + back / bw):.3g}")
            rows.append([name, wire, f"{hop:,}", *cells])
            prompt_rows.append([name, wire, f"{4096 * hop / 2**20:.1f} MiB",
                                *(f"{1e3 * (HOP_LATENCY_S + 4096 * hop / (g * 1e9 / 8)):.0f} ms" for g in LINKS_GBIT)])
    return [*table(["model", "wire", "bytes per token per hop", *(f"N={n}, {g} Gbit/s" for n in STAGES for g in LINKS_GBIT)], rows),
            "",
            *table(["model", "wire", "4,096-token prompt per hop", *(f"{g} Gbit/s" for g in LINKS_GBIT)], prompt_rows)]


# ---------------------------------------------------------------- report


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--no-netns", action="store_true", help="skip the shaped-link rows")
    p.add_argument("--report-only", action="store_true", help="write the report again from results/scale_out.json")
    a = p.parse_args()
    if a.report_only:
        saved = load("scale_out")
        a.rounds, a.dtype = saved["args"]["rounds"], saved["args"]["dtype"]
        # results saved before the machine was recorded in full have only a "cpu" string, which machine_line reads
        return report(a, saved["runs"], saved["link"], saved.get("machine") or {"cpu": saved.get("cpu")})
    host = machine()  # before any configuration sets torch's threads for its ranks
    runs: dict[str, list[dict]] = {name: [] for name in LOCAL}
    link_note = "skipped (--no-netns)"
    with contextlib.ExitStack() as stack:
        if not a.no_netns:
            made, how = stack.enter_context(shaped_link())
            link_note = f"rank 1 in its own network namespace, a veth pair {how}" if made else f"not run: {how}"
            if made:
                runs.update({name: [] for name in SHAPED})
        for r in range(a.rounds):
            for name in runs:
                print(f"round {r + 1}/{a.rounds}: {name} ...", file=sys.stderr, flush=True)
                fn = measure_shaped if name in SHAPED else measure
                runs[name].append(fn({**LOCAL, **SHAPED}[name], a.dtype, r))
                print(f"  {runs[name][-1]}", file=sys.stderr, flush=True)
    return report(a, runs, link_note, host)


def report(a, runs: dict[str, list[dict]], link_note: str, host: dict) -> int:
    per_rank = ("layers", "rank_weight_bytes")  # the same every round
    med = {name: {k: statistics.median(x[k] for x in rs) for k in rs[0] if k not in per_rank}
           | {k: rs[0][k] for k in per_rank if k in rs[0]} for name, rs in runs.items()}
    base = med["1 process"]
    lines = [
        "# Scale-out: tensor and pipeline parallelism",
        "",
        f"`benchmarks/scale_out.py --rounds {a.rounds} --dtype {a.dtype}` on {machine_line(host)}, default model, {TOKENS} greedy "
        "output tokens per request, offline, median over rounds. Ranks get one thread each; one process gets every core. "
        "Comm: rank 0's time in the step's broadcast, the per-layer gathers and the pipeline's sends and receives (waiting "
        "for the other rank included: for pipeline stages, the wait for the other stage's compute) over its time in the "
        f"step. Shaped link: {link_note}.",
        "",
    ]
    rows = []
    for name, m in med.items():
        cells = [cell for n in STREAMS
                 for cell in (f"{m[f'tok_s_{n}']:.1f} ({m[f'tok_s_{n}'] / base[f'tok_s_{n}']:.2f}x)", f"{m[f'comm_share_{n}']:.0%}")]
        weights = ", ".join(f"{b / 2**20:.0f}" for b in m["rank_weight_bytes"]) if "rank_weight_bytes" in m else "–"
        rows.append([name, ", ".join(f"{lo}-{hi - 1}" for lo, hi in m["layers"]), weights, *cells])
    lines += table(["configuration", "layers per rank", "weights per rank, MiB", *(h for n in STREAMS for h in (f"{n} streams tok/s (vs 1 process)", "comm"))],
                   rows)
    lines += [
        "",
        "Each round against that round's one process (1 / 16 / 64 streams). The machine is shared, and the rounds "
        "differ more than the medians show: one process gave "
        + ", ".join(f"{x['tok_s_1']:.1f}" for x in runs["1 process"]) + " tok/s at 1 stream in rounds "
        + ", ".join(str(r + 1) for r in range(len(runs["1 process"]))) + ".",
        "",
        *table(["configuration", *(f"round {r + 1}" for r in range(len(runs["1 process"])))],
               [[name, *(" / ".join(f"{x[f'tok_s_{n}'] / b[f'tok_s_{n}']:.2f}" for n in STREAMS) for x, b in zip(rs, runs["1 process"]))]
                for name, rs in runs.items()]),
    ]
    lines += [
        "",
        "## Bytes on the wire",
        "",
        "A pipeline hop sends each token's hidden state in the wire dtype (int8: one byte a value and a float32 scale "
        "per token); the hop back to the logits is the model's dtype. Two tensor-parallel ranks gather instead, in "
        "every layer: the attention output, the MLP's intermediate columns and twice half the hidden size, so a rank "
        "takes in layers x (heads x head size + intermediate + 2 hidden) / 2 values per token, in float32 "
        "(and each sampled row's logits from the other half of the vocabulary).",
        "",
        *table(["model", *WIRE, "TP=2 gathers per token per rank"],
               [[name, *(f"{wire_bytes_per_token(hidden, w):,}" for w in WIRE), f"{layers * (3 * hidden + inter) // 2 * 4:,}"]  # heads x head size = hidden
                for name, (hidden, layers, _, inter) in SHAPES.items()]),
    ]
    token_s = 1 / base["tok_s_1"]
    lines += [
        "",
        "## Projection to N machines",
        "",
        f"The model. One stream's token costs the measured one-process time here ({1e3 * token_s:.1f} ms for the "
        f"default model as loaded, {base['weight_bytes'] / 2**20:.0f} MiB of weights). For the 70B shape it is scaled by "
        "its bf16 layers' bytes over those weights, since a decode step reads every weight once. Split over N stages, "
        "the token passes each in turn, so its compute is the same. Each of the N-1 hops between stages adds "
        f"{HOP_LATENCY_S * 1e3:.1f} ms and its bytes over the link, and so does the hop back to rank 0, which carries "
        "float32. So one stream gains nothing from more machines; they buy room: each holds 1/N of the layers. With "
        "micro-batches in flight the many-stream rate can approach N times one stage's, until a hop's bytes per step "
        "bind. A prompt is where the link shows: the second table is the time to move a 4,096-token prompt's hidden "
        "states over one hop. The seed's 64 MB per hop is the 70B's hidden state in 16 bits.",
        "",
        "One stream, tokens/s:",
        "",
        *projection(token_s, base["weight_bytes"]),
    ]
    publish("scale_out", {"args": {"rounds": a.rounds, "dtype": a.dtype}, "machine": host, "link": link_note, "runs": runs,
                          "median": med}, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
