"""Tensor and pipeline parallelism over torch.distributed: rank 0 serves, the other ranks compute their part.

Rank 0 owns everything with state (HTTP, scheduler, block pool, prefix cache)
and the logits head. Each step it broadcasts the step's ForwardBatch (token
ids, block tables, block copies: plain data, pickled) to every rank; every rank
runs its shard of every layer on its own slice of the KV cache (its KV heads),
and after each row-parallel projection (attention output, MLP down) the ranks
sum their partial outputs. Rank 0 then computes the logits and samples.

The sum is an all-gather followed by an add in rank order, not gloo's
all-reduce: a ring all-reduce over three or more ranks adds the parts in an
order that depends on where an element falls in the ring's chunks, which
depends on the size of the step, so a row's bits would change with the batch.
Gathering costs (ranks - 1) times the bytes of a reduce, a few kilobytes per
token for the models shoal runs on CPUs.

Pipeline stages (`--pipeline-parallel-size P`) get the same broadcast; each runs
its own range of layers on the hidden states the previous stage sends (send/recv,
in the wire dtype), and the last sends its output back to rank 0 uncompressed.

Processes: `shoal serve --tensor-parallel-size N` on one machine starts ranks
1..N-1 itself (`python -m shoal.executor.worker`); across machines the others
run `shoal worker`; under torchrun every process runs `shoal serve` and the
environment says which is which. They meet at rank 0's TCP store
(MASTER_ADDR:MASTER_PORT), gloo on the CPU, NCCL on CUDA.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import subprocess
import sys
import threading

import torch
import torch.distributed as dist

from shoal.config import EngineConfig
from shoal.executor.shm import SharedMemoryChannel

log = logging.getLogger("shoal.executor")


class RankGroup:
    """This process's place among the ranks, and the collectives the model and the executor use."""

    def __init__(self, rank: int, size: int, backend: str, timeout: float = 300.0) -> None:
        self.rank, self.size, self.backend, self.timeout = rank, size, backend, timeout
        self.shm: SharedMemoryChannel | None = None  # same-host collectives, once open_shared_memory ran

    @classmethod
    def join(cls, rank: int, size: int, addr: str, port: int, timeout: float, device: str = "cpu") -> RankGroup:
        backend = "nccl" if device.startswith("cuda") else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{_url_host(addr)}:{port}", rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=timeout))
        return cls(rank, size, backend, timeout)

    @classmethod
    def from_environment(cls, timeout: float) -> RankGroup:
        """Joined as torchrun (or any launcher setting RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) says."""
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=timeout))
        return cls(rank, size, "gloo", timeout)

    def open_shared_memory(self, part_bytes: int, alive=None, message_bytes: int = 1 << 20, enabled: bool = True) -> bool:
        """Collective: where every rank runs on this machine (and on the CPU), move the per-step
        collectives to shared memory (shm.py). False where they stay on gloo/NCCL."""
        hosts = self.gather(socket.gethostname())
        if not enabled or self.backend != "gloo" or len(set(hosts)) > 1 or not os.path.isdir("/dev/shm"):
            return False
        path = self.broadcast(SharedMemoryChannel.new_path() if self.rank == 0 else None)
        if self.rank == 0:
            self.shm = SharedMemoryChannel(path, 0, self.size, part_bytes, message_bytes, True, self.timeout, alive)
        dist.barrier()
        if self.rank:
            self.shm = SharedMemoryChannel(path, self.rank, self.size, part_bytes, message_bytes, False, self.timeout, alive)
        dist.barrier()
        return True

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `partial`, added in rank order in float32: the same bits on every
        rank, and a row's sum does not depend on the other rows."""
        if self.shm is not None and self.shm.fits(partial):
            return self.shm.reduce(partial)
        parts = [torch.empty_like(partial) for _ in range(self.size)]
        dist.all_gather(parts, partial.contiguous())
        total = parts[0].float()
        for p in parts[1:]:
            total += p
        return total.to(partial.dtype)

    def broadcast(self, obj=None):
        """Rank 0's `obj`, on every rank."""
        if self.shm is not None:
            if self.rank == 0:
                if self.shm.send(obj):
                    return obj
            else:
                ok, got = self.shm.receive()
                if ok:
                    return got
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def send_hidden(self, hidden: torch.Tensor, dst: int, wire: str | None) -> None:
        """A pipeline stage's output to the next stage, in the wire dtype (int8: symmetric, a scale per row;
        None: as it is, for the way back to the logits, which is never compressed)."""
        for t in encode_wire(hidden, wire):
            dist.send(t.contiguous(), dst)

    def recv_hidden(self, rows: int, width: int, src: int, wire: str | None, dtype: torch.dtype) -> torch.Tensor:
        parts = [torch.empty(rows, width, dtype=WIRE[wire] if wire is not None else dtype)]
        if wire == "int8":
            parts.append(torch.empty(rows, 1, dtype=torch.float32))
        for t in parts:
            dist.recv(t, src)
        return decode_wire(parts, dtype)

    def agree_min(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def gather(self, obj) -> list:
        out = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close(unlink=self.rank == 0)
            self.shm = None
        if dist.is_initialized():
            dist.destroy_process_group()


def rank_info(part, group: RankGroup) -> dict:
    """What GET /v1/cluster shows of one rank."""
    runner = part.runner
    model = runner.model
    weight_bytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    c = runner.config
    held = model.shard.describe() if model.shard is not None else {
        "heads": [0, c.num_heads], "kv_heads": [0, c.num_kv_heads], "intermediate": [0, c.intermediate_size]}
    return {
        "rank": group.rank, "host": socket.gethostname(), "pid": os.getpid(), "state": "ready",
        "layers": list(model.layer_range), **held, "threads": torch.get_num_threads(),
        "weights_bytes": weight_bytes, "kv_cache_bytes": runner.kv.numel() * runner.kv.element_size(),
    }


WIRE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.int8}


def encode_wire(hidden: torch.Tensor, wire: str | None) -> list[torch.Tensor]:
    """Hidden states as sent between pipeline stages: cast, or int8 with one float32 scale per token row."""
    if wire is None:
        return [hidden]
    if wire != "int8":
        return [hidden.to(WIRE[wire])]
    h = hidden.float()
    scale = h.abs().amax(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny) / 127.0
    return [torch.round(h / scale).clamp_(-127, 127).to(torch.int8), scale]


def decode_wire(parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    if parts[0].dtype == torch.int8:
        return (parts[0].float() * parts[1]).to(dtype)
    return parts[0].to(dtype)


def wire_bytes_per_token(width: int, wire: str) -> int:
    return width * WIRE[wire].itemsize + (4 if wire == "int8" else 0)


class DistributedExecutor:
    """Rank 0's side: broadcast each step's forward, run rank 0's shard, sample."""

    def __init__(self, runner, group: RankGroup, ranks: list[dict], workers: list[subprocess.Popen], stages: int = 1, wire: str = "float32") -> None:
        self.runner = runner
        self.group = group
        self.stages, self.wire = stages, wire  # pipeline stages (1: tensor parallel), the dtype between them
        self.ranks = ranks
        self.workers = workers  # the ranks this process started (one machine); others are someone else's
        self.failure: str | None = None

    def execute(self, plan):
        if self.failure is not None:
            raise RuntimeError(f"the ranks holding the model are out of step: {self.failure}")
        return self.runner.execute(plan, forward=self._forward_everywhere)

    def _forward_everywhere(self, batch):
        try:
            self.group.broadcast(batch)
            hidden = self.runner.forward(batch)
            if self.stages > 1 and hidden is not None:  # through the other stages, and back for the logits
                self.group.send_hidden(hidden, 1, self.wire)
                # the last stage's output comes back in the model's dtype: logits are never computed from a compressed copy
                hidden = self.group.recv_hidden(len(batch.token_ids), hidden.shape[-1], self.stages - 1, None, self.runner.dtype)
            return hidden
        except BaseException as e:
            # The ranks run every collective in lockstep: after a failure mid-forward (a lost rank,
            # a timeout, an error in this rank's shard) they no longer agree on where they are.
            self.failure = (str(e).splitlines() or [type(e).__name__])[0][:200]
            log.error("the distributed forward failed (%s); every step from now on fails", self.failure)
            raise

    def cluster(self) -> dict:
        ranks = []
        for info in self.ranks:
            info = dict(info)
            proc = next((w for w in self.workers if w.args[-1] == str(info["rank"])), None) if info["rank"] else None
            if proc is not None and proc.poll() is not None:
                info["state"] = f"exited ({proc.returncode})"
            elif self.failure is not None:
                info["state"] = "unreachable"
            ranks.append(info)
        return {
            "tensor_parallel_size": 1 if self.stages > 1 else self.group.size, "pipeline_parallel_size": self.stages,
            "backend": self.group.backend,
            "collectives": "shared memory" if self.group.shm is not None else self.group.backend,
            "stage_hops": self.group.backend if self.stages > 1 else None,  # pipeline: hidden states by send/recv
            "wire_dtype": self.wire if self.stages > 1 else str(self.runner.dtype).removeprefix("torch."),
            "wire_bytes_per_token": wire_bytes_per_token(self.runner.config.hidden_size, self.wire) if self.stages > 1 else None,
            "ranks": ranks,
        }

    def close(self) -> None:
        if self.failure is None and dist.is_initialized():
            try:
                self.group.broadcast(None)  # the workers' signal to stop
            except RuntimeError:
                pass
        self.group.close()
        for w in self.workers:
            try:
                w.wait(timeout=10)
            except subprocess.TimeoutExpired:
                w.kill()


def start_rank0(config: EngineConfig):
    """Start (or meet) the other ranks, build rank 0's shard: (DistributedExecutor, ModelPart)."""
    from shoal.engine.builder import build_part

    par = config.parallel
    workers: list[subprocess.Popen] = []
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        group = RankGroup.from_environment(par.timeout)
    else:
        port = par.master_port or free_port(par.master_addr)
        workers = [spawn_worker(r, par.world_size, par.master_addr, port, par.timeout) for r in range(1, par.ranks_per_node)]
        log.info("tensor parallel over %d ranks: started %d worker process(es) on this machine, meeting at %s:%d",
                 par.world_size, len(workers), par.master_addr, port)
        _watch(workers)
        group = RankGroup.join(0, par.world_size, par.master_addr, port, par.timeout, config.device)
    try:
        group.broadcast(config)
        part = build_part(config, 0, group)
        shared = group.open_shared_memory(part_bytes(config, part), alive=lambda: all(w.poll() is None for w in workers),
                                          enabled=par.shared_memory)
        ranks = group.gather(rank_info(part, group))
    except BaseException:
        group.close()
        for w in workers:
            w.kill()
        raise
    log.info("per-step collectives: %s", "shared memory (every rank on this machine)" if shared else f"{group.backend} (ranks on several machines)")
    for info in ranks:
        log.info("rank %d on %s (pid %d): layers %s, query heads %s, KV heads %s, MLP columns %s, %.1f MiB of weights",
                 info["rank"], info["host"], info["pid"], info["layers"], info["heads"], info["kv_heads"], info["intermediate"],
                 info["weights_bytes"] / 2**20)
    stages = par.pipeline_parallel_size
    if stages > 1:
        log.info("pipeline: %d stages, hidden states sent as %s (%d bytes per token per hop)", stages, par.pp_wire_dtype,
                 wire_bytes_per_token(part.runner.config.hidden_size, par.pp_wire_dtype))
    return DistributedExecutor(part.runner, group, ranks, workers, stages, par.pp_wire_dtype), part


def part_bytes(config: EngineConfig, part) -> int:
    """The largest partial output of a step: every token of the biggest step, hidden wide, 4 bytes each."""
    return config.scheduler.max_num_batched_tokens * part.runner.config.hidden_size * 4


def spawn_worker(rank: int, size: int, addr: str, port: int, timeout: float) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "shoal.executor.worker", "--world-size", str(size), "--master-addr", addr,
           "--master-port", str(port), "--timeout", str(timeout), "--rank", str(rank)]
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL)


def free_port(addr: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def _url_host(addr: str) -> str:
    return f"[{addr}]" if ":" in addr else addr


def _watch(workers: list[subprocess.Popen]) -> None:
    """Say at once when a started rank dies (rank 0 would otherwise wait for it until the timeout)."""

    def watch():
        for w in workers:
            code = w.wait()
            if code:
                log.error("tensor-parallel worker %s exited with code %d", w.args[-1], code)

    threading.Thread(target=watch, name="shoal-tp-watch", daemon=True).start()
