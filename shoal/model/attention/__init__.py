"""Attention backends: each turns a step's sequences into its own metadata once
(`prepare`), then every layer calls `metadata.forward(q, k, v, kv_cache, scale)`.

- `sdpa`: SDPA/eager kernels picked by the step's shape; what `--attention auto`
  gives beside float weights.
- `invariant`: a query's attention is computed the same way whatever else is in
  the step, so answers do not change with the load; what `--attention auto` gives
  beside low-bit weights (runner/build.py), and `--deterministic`.

The backend is chosen once, when the runner is built; the model never branches on it.
"""

from __future__ import annotations

import torch

from shoal.model.attention.common import SeqSpan, gather_blocks, write_kv
from shoal.model.attention.invariant import InvariantAttention
from shoal.model.attention.sdpa import SdpaAttention

BACKENDS = ("invariant", "sdpa")

__all__ = ["BACKENDS", "SeqSpan", "gather_blocks", "make_attention_backend", "write_kv"]


def make_attention_backend(name: str, config, *, block_size: int, null_block: int, device: torch.device, dtype: torch.dtype):
    """config: the model's ModelConfig (heads, group size, sliding window; a layer may name its own window and its
    logit softcap, arguments of each call)."""
    if name == "invariant":
        return InvariantAttention(block_size=block_size, num_kv_heads=config.num_kv_heads, group_size=config.group_size,
                                  sliding_window=config.sliding_window, null_block=null_block, device=device, dtype=dtype)
    if name == "sdpa":
        return SdpaAttention(block_size=block_size, group_size=config.group_size, sliding_window=config.sliding_window, device=device)
    raise ValueError(f"unknown attention backend {name!r}: choose one of {', '.join(BACKENDS)}")
