"""How the engine reaches the model: one process (`local`) or several (`distributed`: tensor and pipeline parallel).

The engine calls `executor.submit(plan)` up to `executor.depth` times (one for a
process or tensor parallelism, one micro-batch per pipeline stage), then
`executor.collect(ticket)` for the oldest, and reads `executor.runner` (this
process's ModelRunner: KV geometry, dtype, the logits head), `failure` and
`check()` (a lost rank). Workers (`worker.py`) hold no request state: they get
each step's ForwardBatch and run their part of the forward.
"""

from shoal.executor.local import LocalExecutor

__all__ = ["LocalExecutor"]
