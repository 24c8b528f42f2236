"""Tensor and pipeline parallelism over torch.distributed: rank 0 serves, the other ranks compute their part.

Rank 0 owns everything with state (HTTP, scheduler, block pool, prefix cache).
Each step it broadcasts the step's ForwardBatch (token ids, block tables, block
copies, the rows whose logits are wanted: plain data, pickled) to every rank; every rank
runs its shard of every layer on its own slice of the KV cache (its KV heads),
and the ranks gather each other's parts before and after the attention output
and MLP down projections, which each rank computes for its own range of the
hidden size (layers.TensorParallel). Each rank then computes the logits of its
rows of the vocabulary, they are gathered, and rank 0 samples.

Gathers, not sums: no rank ever adds another's partial sums, so every output
is summed in one process's order and the ranks give one process's bits. A sum
(Megatron's all-reduce) would not: with activations rounded to int8 before
each low-bit projection, two partial sums' last bit tips roundings. (gloo's
ring all-reduce would not even keep a row's bits from changing with the batch:
it adds in an order that depends on where an element falls in its chunks.)

Pipeline stages (`--pipeline-parallel-size P`) get the same broadcast; each runs
its own range of layers on the hidden states the previous stage sends (in the
wire dtype), and the last sends its output back to rank 0 uncompressed, which
holds the whole logits head. Each hop is a broadcast in a group of its two ranks
rather than gloo's send/recv: a collective's completion can be polled (a send's
or a receive's cannot, before it is waited for), so rank 0 can give up a wait
and a stage can let go of what it sent.
Both at once: stage s is ranks s*T .. s*T+T-1, which gather among themselves; each
sends its (identical) output on to its counterpart in the next stage, and the
last stage's first rank sends back to rank 0.

Hangs: every other rank counts a heartbeat in rank 0's TCP store twice a second
(a thread, so a rank that is stopped, cut off or stuck stops counting); rank 0
watches the counts, and one that has not moved for --heartbeat-timeout seconds
makes rank 0's waits give up (`RankGroup.lost`): it polls every collective it
waits on, where gloo's own wait on a rank that never answers would last the
whole collective timeout (gloo's abort does not end a wait already begun).

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
import pickle
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from shoal.config import EngineConfig
from shoal.executor.shm import SharedMemoryChannel
from shoal.runner.model_runner import forward_batch

log = logging.getLogger("shoal.executor")
HEARTBEAT = "heartbeat"  # what rank 0 broadcasts when no step has gone out for HEARTBEAT_S (workers skip it)
HEARTBEAT_S = 2.0
BEAT_S = 0.5  # how often the other ranks count their heartbeat in rank 0's store


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
        self.watched = False  # rank 0 watching heartbeats: its waits poll, and give up once `lost` is set
        self.lost: str | None = None  # why the waits give up: a rank has stopped answering (HeartbeatWatch)

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

    def start_beating(self) -> None:
        """A rank other than 0: count this process's heartbeat in rank 0's store every BEAT_S, from a thread of
        its own, for as long as the process lives (HeartbeatWatch reads the counts)."""

        def beat() -> None:
            key = f"shoal/beat/{self.rank}"
            while True:
                try:
                    store = self.store_client()
                    while True:
                        store.add(key, 1)
                        time.sleep(BEAT_S)
                except Exception as e:  # noqa: BLE001 (rank 0 unreachable: connect again; the steps' collectives say what broke)
                    log.debug("rank %d: heartbeat not counted (%s)", self.rank, first_line(e))
                    time.sleep(BEAT_S)

        threading.Thread(target=beat, name="shoal-heartbeat", daemon=True).start()

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

    def settle(self, work) -> None:
        """Wait for a collective. Rank 0, once it watches heartbeats, polls instead, and gives up when a rank
        is found hung (`lost`): gloo's wait on a rank that never answers lasts the whole collective timeout."""
        if self.watched:
            polls = 0
            while not work.is_completed():
                if self.lost is not None:
                    raise RuntimeError(self.lost)
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


class HeartbeatWatch:
    """Rank 0's watch over the other ranks' heartbeats (RankGroup.start_beating): a rank whose count has not
    moved for `timeout` seconds is hung (stopped, cut off, stuck in a call), and the group's waits give up."""

    def __init__(self, group: RankGroup, timeout: float) -> None:
        self.group, self.timeout = group, timeout
        self.silent: int | None = None  # the rank found hung
        self.active = True  # False while the ranks restart (they load before they count again)
        self._seen: dict[int, tuple[int, float]] = {}  # rank: (count, when it last moved)
        self._stop = threading.Event()
        group.watched = True
        threading.Thread(target=self._run, name="shoal-heartbeat-watch", daemon=True).start()

    def reset(self) -> None:
        """After a restart: every rank's silence is timed from now."""
        self._seen, self.silent, self.group.lost = {}, None, None
        self.active = True

    def _run(self) -> None:
        store = None
        while not self._stop.wait(BEAT_S):
            try:
                store = store or self.group.store_client()
                counts = {r: store.add(f"shoal/beat/{r}", 0) for r in range(1, self.group.size)}
            except Exception as e:  # noqa: BLE001 (the store is this process's: a hiccup, try again)
                log.debug("heartbeat counts not read (%s)", first_line(e))
                store = None
                continue
            self.check(counts, time.monotonic())

    def check(self, counts: dict[int, int], now: float) -> None:
        """One look at the ranks' counts at monotonic time `now`."""
        if not self.active:  # reset() starts the timing again
            return
        for rank, count in counts.items():
            seen = self._seen.get(rank)
            if seen is None or seen[0] != count:
                self._seen[rank] = (count, now)
            elif now - seen[1] > self.timeout and self.group.lost is None:
                self.silent = rank
                self.group.lost = f"rank {rank} sent no heartbeat for {now - seen[1]:.0f} s (stopped, hung or cut off)"
                log.error("%s: the steps waiting on it give up", self.group.lost)

    def close(self) -> None:
        self._stop.set()


def first_line(e: BaseException) -> str:
    """An exception in one short line, for a log line (gloo's messages run to several)."""
    return (str(e).splitlines() or [type(e).__name__])[0][:200]


def rank_info(runner, group: RankGroup) -> dict:
    """What GET /v1/cluster shows of one rank."""
    model = runner.model
    weight_bytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    c = runner.config
    held = model.shard.describe() if model.shard is not None else {
        "heads": [0, c.num_heads], "kv_heads": [0, c.num_kv_heads], "intermediate": [0, c.intermediate_size],
        "hidden": [0, c.hidden_size]}
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


@dataclass
class _MicroBatch:
    """A pipeline step between submit and collect."""

    seqs: list  # the plan's ScheduledSeqs, for sampling when it comes back
    batch: object  # its ForwardBatch: the tokens in the step, the rows whose logits are wanted
    has_hidden: bool  # False: only block copies
    sends: list  # stage 0's sends still going out


class DistributedExecutor:
    """Rank 0's side: broadcast each step's forward, run rank 0's shard, sample; notice a lost rank and,
    with --restart-workers, bring the ranks back."""

    def __init__(self, runner, group: RankGroup, ranks: list[dict], workers: list[subprocess.Popen], config: EngineConfig) -> None:
        self.runner = runner
        self.group = group
        self.config = config
        par = config.parallel
        self.stages, self.wire = par.pipeline_parallel_size, par.pp_wire_dtype  # pipeline stages (1: tensor parallel), the dtype between them
        self.tp = par.tensor_parallel_size  # ranks per stage: stage s is ranks s*tp .. s*tp+tp-1
        self.ranks = ranks
        self.workers = workers  # the ranks this process started (one machine); others are someone else's
        self.failure: str | None = None  # why the ranks are out of step (for the log); None while they are well
        self.restarts = 0
        self._last_broadcast = time.monotonic()
        self.watch: HeartbeatWatch | None = None  # started once every rank is ready (start_rank0)

    @property
    def depth(self) -> int:
        """Steps in flight at once: a micro-batch per pipeline stage, one step at a time for tensor parallel."""
        return self.stages

    def submit(self, plan):
        """Tensor parallel: run the step everywhere, the outcome is the ticket. Pipeline: broadcast the step,
        run stage 0's layers and send them on; the step comes back through `collect` while this rank goes on
        with the next micro-batch (stages work on different micro-batches at once)."""
        if self.failure is not None:
            raise RuntimeError(f"the ranks holding the model are out of step: {self.failure}")
        batch, seqs = forward_batch(plan)
        if self.stages == 1:  # the forward and the head's gathers, every rank in step; then rank 0 samples
            with self._failing():
                self._broadcast(batch)
                logits = self.runner.logits(batch, self.runner.forward(batch), seqs)
            return self.runner.sample(seqs, logits)
        with self._failing():
            self._broadcast(batch)
            hidden = self.runner.forward(batch)
            sends = self.group.send_hidden(hidden, self.tp, self.wire) if hidden is not None else []  # to stage 1's first rank
        return _MicroBatch(seqs, batch, hidden is not None, sends)

    def collect(self, ticket):
        if self.stages == 1:
            return ticket
        hidden = None
        with self._failing():
            if ticket.has_hidden:  # the last stage's output, in the model's dtype: logits never come from a compressed copy
                last = (self.stages - 1) * self.tp  # the last stage's first rank
                hidden = self.group.recv_hidden(len(ticket.batch.token_ids), self.runner.config.hidden_size, last, None, self.runner.dtype)
            for send in ticket.sends:
                self.group.settle(send.work)
        return self.runner.outputs(ticket.seqs, ticket.batch, hidden)

    def _broadcast(self, obj) -> None:
        self.group.broadcast(obj)
        self._last_broadcast = time.monotonic()

    @contextmanager
    def _failing(self):
        try:
            yield
        except BaseException as e:
            # The ranks run every collective in lockstep: after a failure mid-forward (a lost rank,
            # a timeout, an error in this rank's part) they no longer agree on where they are.
            self._fail(self.group.lost or first_line(e))
            raise

    def _fail(self, why: str) -> None:
        self.failure = why
        log.error("the distributed forward cannot go on (%s); every step fails until the ranks are %s", why,
                  "restarted" if self.config.parallel.restart_workers else "restarted with the server (--restart-workers does it in place)")

    def check(self) -> str | None:
        """Between steps: a started rank that exited makes the executor failed at once, not at the next step.
        When no step has gone out for HEARTBEAT_S, a heartbeat does: a rank on another machine that is gone
        shows up while the server is idle, and the workers' wait for the next step never times out."""
        if self.failure is None:
            for w in self.workers:
                if w.poll() is not None:
                    self._fail(f"rank {w.rank} exited with code {w.returncode}")
                    break
        if self.failure is None and self.group.lost is not None:
            self._fail(self.group.lost)
        if self.failure is None and time.monotonic() - self._last_broadcast > HEARTBEAT_S:
            try:
                with self._failing():
                    self._broadcast(HEARTBEAT)
            except Exception:  # noqa: BLE001 (recorded in self.failure, which the caller reads)
                pass
        return self.failure

    def restart(self) -> None:
        """Bring the ranks back after a failure (--restart-workers): the ranks this process started are killed
        and started again, ranks on other machines (`shoal worker --restart-workers`) rejoin; each reloads its
        part with the plan it had. Rank 0 keeps its part and its KV pool, so the HTTP side never stops. The
        caller has ended every request and must forget the prefix cache: the other ranks' KV is gone."""
        log.warning("restarting the ranks that hold the model (%s)", self.failure)
        if self.watch is not None:
            self.watch.active = False
        self.group.lost = None
        _stop(self.workers)
        self.group.leave()
        self.workers = _start_workers(self.config, self.group.address[1])
        try:
            self.group.rejoin()
            par = self.config.parallel
            if self.stages > 1:  # the layers each stage had: no new survey of free memory
                par = replace(par, pp_layers=tuple(r["layers"][1] - r["layers"][0] for r in self.ranks[:: self.tp]))
            self._broadcast(replace(self.config, parallel=par))
            self.group.set_layout(self.tp)
            blocks = self.group.agree_min(self.runner.num_blocks)
            if blocks < self.runner.num_blocks:
                raise RuntimeError(f"the restarted ranks have room for {blocks} KV blocks, rank 0's pool has {self.runner.num_blocks}")
            self._open_shared_memory()
            self.ranks = self.group.gather(rank_info(self.runner, self.group))
        except BaseException:
            _stop(self.workers)
            raise
        self.failure = None
        if self.watch is not None:
            self.watch.reset()
        self.restarts += 1
        log.info("the ranks are back (restart %d): serving resumes", self.restarts)

    def _open_shared_memory(self) -> bool:
        def alive() -> bool:
            return self.group.lost is None and all(w.poll() is None for w in self.workers)

        return self.group.open_shared_memory(part_bytes(self.config, self.runner), alive=alive, enabled=self.config.parallel.shared_memory)

    def down_ranks(self) -> list[int]:
        """The ranks known to be gone (exited, or silent past the heartbeat timeout); empty while every rank is
        well, or when only the group broke."""
        return [info["rank"] for info in self.cluster()["ranks"] if info["state"] not in ("ready", "unreachable")]

    def cluster(self) -> dict:
        ranks = []
        for info in self.ranks:
            info = dict(info)
            proc = next((w for w in self.workers if w.rank == info["rank"]), None)
            if proc is not None and proc.poll() is not None:
                info["state"] = f"exited ({proc.returncode})"
            elif self.failure is not None and self.watch is not None and self.watch.silent == info["rank"]:
                info["state"] = "not answering (no heartbeat)"
            elif self.failure is not None:
                info["state"] = "unreachable"
            ranks.append(info)
        return {
            "tensor_parallel_size": self.tp, "pipeline_parallel_size": self.stages,
            "backend": self.group.backend,
            "collectives": "shared memory" if self.group.shm is not None else self.group.backend,
            "stage_hops": self.group.backend if self.stages > 1 else None,  # pipeline: hidden states by send/recv
            "wire_dtype": self.wire if self.stages > 1 else str(self.runner.dtype).removeprefix("torch."),
            "wire_bytes_per_token": wire_bytes_per_token(self.runner.config.hidden_size, self.wire) if self.stages > 1 else None,
            "restart_workers": self.config.parallel.restart_workers, "restarts": self.restarts,
            "heartbeat_timeout_s": self.config.parallel.heartbeat_timeout,
            "ranks": ranks,
        }

    def close(self) -> None:
        if self.watch is not None:
            self.watch.close()
        if self.failure is None and dist.is_initialized():
            try:
                self.group.broadcast(None)  # the workers' signal to stop
            except RuntimeError:
                pass
        else:
            _stop(self.workers)  # out of step (or hung): they cannot take the signal
        self.group.close()
        for w in self.workers:
            try:
                w.wait(timeout=10)
            except subprocess.TimeoutExpired:
                w.kill()


def start_rank0(config: EngineConfig):
    """Start (or meet) the other ranks, build rank 0's shard: (DistributedExecutor, ModelPart)."""
    from shoal.runner.build import build_part

    par = config.parallel
    workers: list[subprocess.Popen] = []
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if par.restart_workers:
            raise ValueError("--restart-workers is shoal's own launcher's: under torchrun, torchrun restarts the ranks")
        group = RankGroup.from_environment(par.timeout)
    else:
        port = par.master_port or free_port(par.master_addr)
        workers = _start_workers(config, port)
        log.info("%d ranks: started %d worker process(es) on this machine, meeting at %s:%d",
                 par.world_size, len(workers), par.master_addr, port)
        group = RankGroup.join(0, par.world_size, par.master_addr, port, par.timeout, config.device)
    try:
        group.broadcast(config)
        part = build_part(config, 0, group)
        executor = DistributedExecutor(part.runner, group, [], workers, config)
        shared = executor._open_shared_memory()
        executor.ranks = group.gather(rank_info(part.runner, group))
        executor.watch = HeartbeatWatch(group, par.heartbeat_timeout)
    except BaseException:
        group.close()
        _stop(workers)
        raise
    log.info("per-step collectives: %s", "shared memory (every rank on this machine)" if shared else f"{group.backend} (ranks on several machines)")
    for info in executor.ranks:
        log.info("rank %d on %s (pid %d): layers %s, query heads %s, KV heads %s, MLP columns %s, hidden rows %s, "
                 "%.1f MiB of weights", info["rank"], info["host"], info["pid"], info["layers"], info["heads"], info["kv_heads"],
                 info["intermediate"], info["hidden"], info["weights_bytes"] / 2**20)
    if par.pipeline_parallel_size > 1:
        log.info("pipeline: %d stages, hidden states sent as %s (%d bytes per token per hop)", par.pipeline_parallel_size,
                 par.pp_wire_dtype, wire_bytes_per_token(part.runner.config.hidden_size, par.pp_wire_dtype))
    return executor, part


def part_bytes(config: EngineConfig, runner) -> int:
    """The largest part a rank puts into a layer's gather: every token of the biggest step, at the widest part, 4 bytes
    each; and at least one row of a rank's logits (a step's logits are gathered in pieces of rows that fit)."""
    tp = runner.model.tp
    if tp is None:
        return 0
    logits = max(tp.widths("vocab")) if runner.model.vocab is not None else 0
    return max(config.scheduler.max_num_batched_tokens * tp.widest(runner.config.head_dim), logits) * 4


def _start_workers(config: EngineConfig, port: int) -> list[subprocess.Popen]:
    """The other ranks of rank 0's machine, started (and watched) by rank 0."""
    par = config.parallel
    workers = [spawn_worker(r, par.world_size, par.master_addr, port, par.timeout) for r in range(1, par.ranks_per_node)]
    _watch(workers)
    return workers


def spawn_worker(rank: int, size: int, addr: str, port: int, timeout: float, rejoin: bool = False) -> subprocess.Popen:
    """`rejoin`: after losing the group, meet it again (a machine's own ranks under --restart-workers)."""
    cmd = [sys.executable, "-m", "shoal.executor.worker", "--world-size", str(size), "--master-addr", addr,
           "--master-port", str(port), "--timeout", str(timeout), *(["--rejoin"] if rejoin else []), "--rank", str(rank)]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
    proc.rank = rank
    return proc


def free_port(addr: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def _stop(workers: list[subprocess.Popen]) -> None:
    for w in workers:
        w.stopping = True  # for _watch: this exit is rank 0's doing
        w.kill()
        w.wait()


def _watch(workers: list[subprocess.Popen]) -> None:
    """Say at once when a started rank dies (rank 0 would otherwise wait for it until the timeout)."""

    def watch():
        for w in workers:
            code = w.wait()
            if code and not getattr(w, "stopping", False):
                log.error("rank %d (a worker process) exited with code %d", w.rank, code)

    threading.Thread(target=watch, name="shoal-tp-watch", daemon=True).start()
