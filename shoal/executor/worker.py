"""A rank other than 0 (a tensor-parallel shard or a pipeline stage): meet rank 0, build this rank's part,
run forwards until told to stop.

It holds no request state: rank 0 sends the engine's config once, then one
ForwardBatch per step (None to stop).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import torch

from shoal.executor.group import RankGroup, first_line
from shoal.executor.heartbeat import HEARTBEAT, start_beating
from shoal.executor.stage import PipelineStage, part_bytes, rank_info

log = logging.getLogger("shoal.worker")


def serve_forwards(group: RankGroup) -> None:
    from shoal.runner.build import build_part

    config = group.broadcast()
    try:
        part = build_part(config, group.rank, group)
    except BaseException:
        log.exception("rank %d could not build its shard", group.rank)
        group.close()
        raise
    parent = os.getppid()
    group.open_shared_memory(part_bytes(config, part.runner), alive=lambda: os.getppid() == parent, enabled=config.parallel.shared_memory)
    info = rank_info(part.runner, group)
    group.gather(info)
    log.info("rank %d ready: layers %s, query heads %s, KV heads %s, MLP columns %s, hidden rows %s, vocabulary %s, "
             "%d KV blocks, %d threads", group.rank, info["layers"], info["heads"], info["kv_heads"], info["intermediate"],
             info["hidden"], info.get("vocab", "whole" if part.runner.model.model.embed_tokens is not None else "none"),
             part.runner.num_blocks, info["threads"])
    runner = part.runner
    stage = PipelineStage(group, runner, config.parallel) if config.parallel.pipeline_parallel_size > 1 else None
    sending: list = []  # this stage's outputs still going out (it does not wait: the next micro-batch may be there)
    with torch.inference_mode():
        while True:
            batch = group.broadcast()
            if batch is None:
                break
            if batch == HEARTBEAT:  # rank 0 is idle and alive
                continue
            if stage is None:  # tensor parallel: every rank runs the whole batch on its shard
                hidden = runner.forward(batch)
                if runner.model.vocab is not None:  # and its slice of the logits, gathered on rank 0
                    runner.logits(batch, hidden)
                continue
            sending = [s for s in sending if not s.done()] + stage.run(batch)
    for s in sending:
        s.work.wait()
    log.info("rank %d: stopped by rank 0", group.rank)
    group.close()


def run_rank(group: RankGroup, rejoin: bool) -> None:
    """Serve forwards until rank 0 says stop. `rejoin`: when the group breaks (another rank was lost, rank 0
    is restarting the ranks: --restart-workers), meet it again and reload, instead of exiting."""
    stop_beating = start_beating(group)
    try:
        while True:
            try:
                serve_forwards(group)
                return
            except Exception as e:
                if not rejoin or group.address is None:
                    raise
                log.warning("rank %d lost the group (%s); meeting rank 0 again at %s:%d", group.rank,
                            first_line(e), *group.address)
                group.rejoin()
    finally:
        stop_beating()


def setup_logging(rank: int) -> None:
    """A started rank logs as the process that started it did (`shoal serve` or `shoal worker` set
    SHOAL_LOG_LEVEL and SHOAL_LOG_FORMAT), with its rank on every line."""
    from shoal.logs import configure_logging

    configure_logging(os.environ.get("SHOAL_LOG_LEVEL", "info"), os.environ.get("SHOAL_LOG_FORMAT", "text"), f"rank {rank} ",
                      {"rank": rank})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shoal.executor.worker", description=__doc__)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, required=True)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--rejoin", action="store_true", help="meet the group again after losing it (--restart-workers)")
    a = p.parse_args(argv)
    if not logging.getLogger().handlers:
        setup_logging(a.rank)
    group = RankGroup.join(a.rank, a.world_size, a.master_addr, a.master_port, a.timeout)
    run_rank(group, a.rejoin)
    return 0


if __name__ == "__main__":
    sys.exit(main())
