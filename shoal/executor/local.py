"""The whole model in this process."""

from __future__ import annotations

import os
import socket


class LocalExecutor:
    failure = None  # one process: there is no other rank to lose
    depth = 1  # steps in flight at once: one, run to its end by submit

    def __init__(self, runner) -> None:
        self.runner = runner
        self.decode_runs = getattr(runner, "decode_runs", False)  # whether a plan may hold decode runs (engine/scheduler.py)

    def submit(self, plan):
        return self.runner.execute(plan)

    def collect(self, ticket):
        return ticket

    def check(self) -> None:
        return None

    def cluster(self) -> dict:
        """The shape GET /v1/cluster shows: here one rank with every layer."""
        c = self.runner.config
        return {
            "tensor_parallel_size": 1,
            "pipeline_parallel_size": 1,
            "backend": None,
            "wire_dtype": None,
            "ranks": [{
                "rank": 0, "host": socket.gethostname(), "pid": os.getpid(), "state": "ready",
                "layers": [0, c.num_layers], "heads": [0, c.num_heads], "kv_heads": [0, c.num_kv_heads],
                "intermediate": [0, c.intermediate_size], "hidden": [0, c.hidden_size],
            }],
        }

    def close(self) -> None:
        pass
