"""Tensor and pipeline parallelism over torch.distributed: rank 0 serves, the other ranks compute their part.

Rank 0 owns everything with state (HTTP, scheduler, block pool, prefix cache).
Each step it broadcasts the step's ForwardBatch (token ids, block tables, block
copies, the rows whose logits are wanted: plain data, pickled) to every rank; every rank
runs its shard of every layer on its own slice of the KV cache (its KV heads),
and the ranks gather each other's parts before and after the attention output
and MLP down projections, which each rank computes for its own range of the
hidden size (model/tensor_parallel.py). Each rank then computes the logits of its
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
makes rank 0's waits give up (`HeartbeatWatch.lost`): it polls every collective it
waits on, where gloo's own wait on a rank that never answers would last the
whole collective timeout (gloo's abort does not end a wait already begun).

Processes: `shoal serve --tensor-parallel-size N` on one machine starts ranks
1..N-1 itself (`python -m shoal.executor.worker`); across machines the others
run `shoal worker`; under torchrun every process runs `shoal serve` and the
environment says which is which. They meet at rank 0's TCP store
(MASTER_ADDR:MASTER_PORT), gloo on the CPU, NCCL on CUDA.

The pieces, one job each: group.py (the process group and its collectives),
heartbeat.py (the heartbeats and rank 0's watch), wire.py (the hidden states'
format between stages), stage.py (a rank's part of a step, the same on every
rank), launch.py (the worker processes), worker.py (a rank other than 0), and
this file: rank 0's executor.
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch.distributed as dist

from shoal.config import EngineConfig
from shoal.executor.group import RankGroup, first_line
from shoal.executor.heartbeat import HEARTBEAT, HEARTBEAT_S, HeartbeatWatch
from shoal.executor.launch import Worker, free_port, start_workers, stop_workers
from shoal.executor.stage import PipelineStage, part_bytes, rank_info
from shoal.executor.wire import wire_bytes_per_token
from shoal.runner.model_runner import forward_batch

log = logging.getLogger("shoal.executor")


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

    decode_runs = False  # a step is one forward on every rank: the engine gives it no decode runs

    def __init__(self, runner, group: RankGroup, workers: list[Worker], config: EngineConfig) -> None:
        """Collective with the other ranks: rank 0's shared memory, every rank's facts, the heartbeat watch."""
        self.runner = runner
        self.group = group
        self.config = config
        par = config.parallel
        self.stages, self.wire = par.pipeline_parallel_size, par.pp_wire_dtype  # pipeline stages (1: tensor parallel), the dtype between them
        self.tp = par.tensor_parallel_size  # ranks per stage: stage s is ranks s*tp .. s*tp+tp-1
        self.workers = workers  # the ranks this process started (one machine); others are someone else's
        self.failure: str | None = None  # why the ranks are out of step (for the log); None while they are well
        self.restarts = 0
        self._last_broadcast = time.monotonic()
        self.stage = PipelineStage(group, runner, par) if self.stages > 1 else None  # rank 0's: stage 0
        self.watch: HeartbeatWatch | None = None  # started below, once every rank is ready
        self.shared_memory = self._open_shared_memory()
        self.ranks: list[dict] = group.gather(rank_info(runner, group))
        self.watch = HeartbeatWatch(group, par.heartbeat_timeout)  # once every rank is ready

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
            return self.runner.sample(seqs, logits, batch.finished)
        with self._failing():
            self._broadcast(batch)
            sends = self.stage.run(batch)  # stage 0's layers, on to stage 1
        return _MicroBatch(seqs, batch, not batch.empty, sends)

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
            self._fail(self.watch.lost or first_line(e))
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
        if self.failure is None and self.watch.lost is not None:
            self._fail(self.watch.lost)
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
        self.watch.pause()
        stop_workers(self.workers)
        self.group.leave()
        self.workers = start_workers(self.config, self.group.address[1])
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
            stop_workers(self.workers)
            raise
        self.failure = None
        self.watch.reset()
        self.restarts += 1
        log.info("the ranks are back (restart %d): serving resumes", self.restarts)

    def _open_shared_memory(self) -> bool:
        def alive() -> bool:
            return (self.watch is None or self.watch.lost is None) and all(w.poll() is None for w in self.workers)

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
            elif self.failure is not None and self.watch.silent == info["rank"]:
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
        self.watch.close()
        if self.failure is None and dist.is_initialized():
            try:
                self.group.broadcast(None)  # the workers' signal to stop
            except RuntimeError:
                pass
        else:
            stop_workers(self.workers)  # out of step (or hung): they cannot take the signal
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
    workers: list[Worker] = []
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if par.restart_workers:
            raise ValueError("--restart-workers is shoal's own launcher's: under torchrun, torchrun restarts the ranks")
        group = RankGroup.from_environment(par.timeout)
    else:
        port = par.master_port or free_port(par.master_addr)
        workers = start_workers(config, port)
        log.info("%d ranks: started %d worker process(es) on this machine, meeting at %s:%d",
                 par.world_size, len(workers), par.master_addr, port)
        group = RankGroup.join(0, par.world_size, par.master_addr, port, par.timeout, config.device)
    try:
        group.broadcast(config)
        part = build_part(config, 0, group)
        executor = DistributedExecutor(part.runner, group, workers, config)
    except BaseException:
        group.close()
        stop_workers(workers)
        raise
    log.info("per-step collectives: %s", "shared memory (every rank on this machine)" if executor.shared_memory else f"{group.backend} (ranks on several machines)")
    for info in executor.ranks:
        log.info("rank %d on %s (pid %d): layers %s, query heads %s, KV heads %s, MLP columns %s, hidden rows %s, "
                 "%.1f MiB of weights", info["rank"], info["host"], info["pid"], info["layers"], info["heads"], info["kv_heads"],
                 info["intermediate"], info["hidden"], info["weights_bytes"] / 2**20)
    if par.pipeline_parallel_size > 1:
        log.info("pipeline: %d stages, hidden states sent as %s (%d bytes per token per hop)", par.pipeline_parallel_size,
                 par.pp_wire_dtype, wire_bytes_per_token(part.runner.config.hidden_size, par.pp_wire_dtype))
    return executor, part
