"""RankGroup: this process's place among the ranks, and the collectives the model and the executor use.

The group meets at rank 0's TCP store (a generation of keys per (re)start), over gloo on the CPU and NCCL on
CUDA; where every rank is on one machine, the per-step broadcast and gathers go through shared memory
(shm.py). Gathers, not sums: see distributed.py. Pipeline hops are broadcasts in two-rank groups, so that a
wait can be polled (`settle`) and given up when a rank is lost.
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import socket
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shoal.executor.shm import SharedMemoryChannel
from shoal.executor.wire import WIRE, decode_wire, encode_wire

log = logging.getLogger("shoal.executor")


class RankGroup:
    """This process's place among the ranks, and the collectives the model and the executor use."""

    def __init__(self, rank: int, size: int, backend: str, timeout: float = 300.0, address: tuple[str, int] | None = None) -> None:
        self.rank, self.size, self.backend, self.timeout = rank, size, backend, timeout
        self.address = address  # rank 0's (host, port), where the group meets again after a lost rank; None: torchrun's
        self.store: dist.TCPStore | None = None  # rank 0's rendezvous store: it outlives each group
        self.generation = 0  # which group of the store's this is: rank 0 counts one more at each restart
        self.tp = size  # ranks that split each layer and gather together: this rank's pipeline stage's (set_layout)
        self.tp_group = None  # their process group, where it is not every rank
        self.shm: SharedMemoryChannel | None = None  # same-host broadcast (and gathers), once open_shared_memory ran
        self.stage_shm: SharedMemoryChannel | None = None  # the same-host channel this rank's gathers go through
        self.hops: dict[tuple[int, int], object] = {}  # (from, to) rank: the two-rank group a pipeline hop goes through
        self._verdict = None  # rank 0, watching heartbeats: why its waits give up (a rank is lost), or None (poll_waits)

    @classmethod
    def join(cls, rank: int, size: int, addr: str, port: int, timeout: float, device: str = "cpu") -> RankGroup:
        group = cls(rank, size, "nccl" if device.startswith("cuda") else "gloo", timeout, (addr, port))
        group.store = dist.TCPStore(addr, port, is_master=rank == 0, timeout=datetime.timedelta(seconds=timeout),
                                    wait_for_workers=False)
        group._init()
        return group

    def _init(self) -> None:
        """Form the group. Each (re)start is a generation with its own keys in rank 0's store, so a rank that
        comes back can never meet a half of the broken group's rendezvous."""
        if self.rank == 0:
            self.generation += 1
            self.store.set("generation", str(self.generation))
        else:
            self.generation = self._next_generation()
        # torch names a group's keys by a count of the groups made in this process: it starts again at 0
        # when a group is destroyed, but not after an init that failed. A fresh process starts at 0.
        world = getattr(dist.distributed_c10d, "_world", None)
        if world is not None and hasattr(world, "group_count"):
            world.group_count = 0
        dist.init_process_group(self.backend, store=dist.PrefixStore(f"shoal/{self.generation}", self.store), rank=self.rank,
                                world_size=self.size, timeout=datetime.timedelta(seconds=self.timeout))

    def _next_generation(self) -> int:
        """A later generation than the one this rank was in (rank 0 has started the group again)."""
        deadline = time.monotonic() + self.timeout
        while (current := int(self.store.get("generation"))) <= self.generation:  # get waits until rank 0 set it once
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank 0 did not start the group again within {self.timeout:.0f}s")
            time.sleep(0.05)
        return current

    def rejoin(self) -> None:
        """Leave the broken group and meet the (restarted) ranks again through rank 0's store. The same
        object: the model's layers hold its `gather_columns`."""
        self.leave()
        self._init()

    @classmethod
    def from_environment(cls, timeout: float) -> RankGroup:
        """Joined as torchrun (or any launcher setting RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) says."""
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=timeout))
        return cls(rank, size, "gloo", timeout)

    def store_client(self) -> dist.TCPStore:
        """A connection of this thread's own to rank 0's store (ours, or the one torchrun's MASTER_ADDR:MASTER_PORT names)."""
        host, port = self.address or (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
        return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=self.timeout))

    def set_layout(self, tp: int) -> None:
        """Collective: ranks s*tp .. s*tp+tp-1 are pipeline stage s's tensor-parallel ranks, and gather together.
        Each pipeline hop (a rank to its counterpart in the next stage, and the last stage's first rank back to
        rank 0) gets a group of its two ranks, for `send_hidden`."""
        self.tp, self.tp_group, self.hops = tp, None, {}
        stages = self.size // tp
        if 1 < tp < self.size:  # both kinds at once: a process group per stage (every rank makes every group)
            for stage in range(stages):
                group = dist.new_group(list(range(stage * tp, (stage + 1) * tp)))
                if self.rank // tp == stage:
                    self.tp_group = group
        links = [(s * tp + i, (s + 1) * tp + i) for s in range(stages - 1) for i in range(tp)]
        for link in links + ([((stages - 1) * tp, 0)] if stages > 1 else []):
            group = dist.new_group(sorted(link))  # every rank makes every group, in the same order
            if self.rank in link:
                self.hops[link] = group

    def open_shared_memory(self, part_bytes: int, alive=None, message_bytes: int = 1 << 20, enabled: bool = True) -> bool:
        """Collective: where every rank runs on this machine (and on the CPU), move the per-step
        collectives to shared memory (shm.py): one channel for the step's broadcast (which also gathers when
        every rank is one tensor-parallel group), and one per pipeline stage for its gathers when tensor and
        pipeline parallelism go together. False where they stay on gloo/NCCL."""
        hosts = self.gather(socket.gethostname())
        if not enabled or self.backend != "gloo" or len(set(hosts)) > 1 or not os.path.isdir("/dev/shm"):
            return False
        stages = self.size // self.tp if 1 < self.tp < self.size else 0
        paths = self.broadcast([SharedMemoryChannel.new_path() for _ in range(1 + stages)] if self.rank == 0 else None)
        world_part = part_bytes if self.tp == self.size else 0  # pipeline stages alone gather nothing
        stage, local = divmod(self.rank, self.tp)
        for opening in (True, False):  # the creators first, then the others map what they made
            if (self.rank == 0) == opening:
                self.shm = SharedMemoryChannel(paths[0], self.rank, self.size, world_part, message_bytes, opening, self.timeout, alive)
            if stages and (local == 0) == opening:
                self.stage_shm = SharedMemoryChannel(paths[1 + stage], local, self.tp, part_bytes, 64, opening, self.timeout, alive)
            dist.barrier()
        if self.tp == self.size:
            self.stage_shm = self.shm
        return True

    def gather_columns(self, part: torch.Tensor, widths: tuple[int, ...]) -> torch.Tensor:
        """This stage's tensor-parallel ranks' parts [T, widths[r]] side by side in rank order: [T, sum(widths)],
        the same on every one of them."""
        rows, shm = part.shape[0], self.stage_shm
        fit = shm.rows_that_fit(max(widths), part.element_size()) if shm is not None else 0
        if rows <= fit:
            return shm.gather(part, widths)
        if fit:  # more rows than a slot holds (a step's logits): in pieces, the same on every rank
            return torch.cat([shm.gather(part[i : i + fit], widths) for i in range(0, rows, fit)])
        parts = [part.new_empty(rows, max(widths)) for _ in range(self.tp)]  # all_gather takes one shape: padded
        mine = parts[self.rank % self.tp]
        mine[:, : part.shape[1]].copy_(part)
        self.settle(dist.all_gather(parts, mine, group=self.tp_group, async_op=True))
        return torch.cat([p[:, :w] for p, w in zip(parts, widths)], dim=1)

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
        # pickled, as broadcast_object_list does, but through collectives rank 0 can poll (settle)
        if self.rank == 0:
            data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.long)
        else:
            size = torch.empty(1, dtype=torch.long)
        self.settle(dist.broadcast(size, 0, async_op=True))
        if self.rank != 0:
            data = torch.empty(int(size), dtype=torch.uint8)
        self.settle(dist.broadcast(data, 0, async_op=True))
        return obj if self.rank == 0 else pickle.loads(data.numpy().tobytes())

    def poll_waits(self, verdict) -> None:
        """From now on, wait for collectives by polling, and give up as soon as `verdict()` says why (a
        str: a rank is lost; None: wait on). Rank 0 does this once it watches the heartbeats."""
        self._verdict = verdict

    def settle(self, work) -> None:
        """Wait for a collective. Once poll_waits was called, poll instead, and give up when the verdict says
        a rank is lost: gloo's wait on a rank that never answers lasts the whole collective timeout."""
        if self._verdict is not None:
            polls = 0
            while not work.is_completed():
                if (lost := self._verdict()) is not None:
                    raise RuntimeError(lost)
                polls += 1
                if polls < 64:
                    os.sched_yield()
                else:
                    time.sleep(min(5e-4, 1e-5 * polls))
        work.wait()  # done: raises the collective's error, if it failed

    def send_hidden(self, hidden: torch.Tensor, dst: int, wire: str | None) -> list:
        """A pipeline stage's output to rank `dst`, in the wire dtype (int8: symmetric, a scale per row; None: as
        it is, for the way back to the logits, which is never compressed), as a broadcast in the hop's two-rank
        group. The sends are not waited for (a stage goes on with the next micro-batch): settle what it
        returns before it is dropped."""
        hop = self.hops[(self.rank, dst)]
        return [_Send(t, dist.broadcast(t, self.rank, group=hop, async_op=True))
                for t in (p.contiguous() for p in encode_wire(hidden, wire))]

    def recv_hidden(self, rows: int, width: int, src: int, wire: str | None, dtype: torch.dtype) -> torch.Tensor:
        parts = [torch.empty(rows, width, dtype=WIRE[wire] if wire is not None else dtype)]
        if wire == "int8":
            parts.append(torch.empty(rows, 1, dtype=torch.float32))
        hop = self.hops[(src, self.rank)]
        for t in parts:
            self.settle(dist.broadcast(t, src, group=hop, async_op=True))
        return decode_wire(parts, dtype)

    def agree_min(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def gather(self, obj) -> list:
        out = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    def leave(self) -> None:
        """Out of this generation's group (the store stays, for the next)."""
        if self.stage_shm is not None and self.stage_shm is not self.shm:
            self.stage_shm.close(unlink=self.rank % self.tp == 0)
        self.stage_shm = None
        if self.shm is not None:
            self.shm.close(unlink=self.rank == 0)
            self.shm = None
        self.tp_group, self.hops = None, {}
        if dist.is_initialized():
            dist.destroy_process_group()

    def close(self) -> None:
        self.leave()
        self.store = None


@dataclass
class _Send:
    tensor: torch.Tensor  # kept alive until the send is done
    work: object

    def done(self) -> bool:
        return self.work.is_completed()


def first_line(e: BaseException) -> str:
    """An exception in one short line, for a log line (gloo's messages run to several)."""
    return (str(e).splitlines() or [type(e).__name__])[0][:200]
