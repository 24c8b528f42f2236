"""What one rank holds and does each step, the same on rank 0 and on the workers: its pipeline stage's part of a
step (the protocol between stages, written once), what /v1/cluster shows of it, and the room its gathers need."""

from __future__ import annotations

import os
import socket

import torch

from shoal.config import EngineConfig, ParallelConfig
from shoal.executor.group import RankGroup


class PipelineStage:
    """This rank's stage of the pipeline: the previous stage's hidden states in (stage 0: none, it embeds the
    tokens), its layers, and the output on to the same place in the next stage, in the wire dtype; the last
    stage's first rank sends it back to rank 0 uncompressed, for the logits (its other ranks hold the same
    output). Sends are not waited for: a stage goes on with the next micro-batch; `run` returns them."""

    def __init__(self, group: RankGroup, runner, parallel: ParallelConfig) -> None:
        self.group, self.runner = group, runner
        tp, stages = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        stage, local = parallel.place(group.rank)
        self.source = group.rank - tp if stage > 0 else None  # the rank whose output this stage takes
        self.wire = parallel.pp_wire_dtype
        if stage < stages - 1:
            self.dest, self.dest_wire = group.rank + tp, self.wire
        else:
            self.dest, self.dest_wire = (0 if local == 0 else None), None

    def run(self, batch) -> list:
        """This stage's part of `batch`: the sends still going out."""
        runner = self.runner
        if batch.empty:  # only block copies: every stage makes them, nothing passes between stages
            runner.forward(batch)
            return []
        hidden = None
        if self.source is not None:
            hidden = self.group.recv_hidden(len(batch.token_ids), runner.config.hidden_size, self.source, self.wire, runner.dtype)
        out = runner.forward(batch, hidden)
        if self.dest is None:
            return []
        return self.group.send_hidden(out, self.dest, self.dest_wire)


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


def part_bytes(config: EngineConfig, runner) -> int:
    """The largest part a rank puts into a layer's gather: every token of the biggest step, at the widest part, 4 bytes
    each; and at least one row of a rank's logits (a step's logits are gathered in pieces of rows that fit)."""
    tp = runner.model.tp
    if tp is None:
        return 0
    logits = max(tp.widths("vocab")) if runner.model.vocab is not None else 0
    return max(config.scheduler.max_num_batched_tokens * tp.widest(runner.config.head_dim), logits) * 4
