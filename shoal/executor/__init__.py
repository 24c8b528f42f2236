"""How the engine reaches the model: one process (`local`) or several (`distributed`, tensor parallel).

The engine calls `executor.execute(plan)` and reads `executor.runner` (this
process's ModelRunner: KV geometry, dtype, the logits head). Workers
(`worker.py`) hold no request state: they get each step's ForwardBatch and run
their shard of the forward.
"""

from shoal.executor.local import LocalExecutor

__all__ = ["LocalExecutor"]
