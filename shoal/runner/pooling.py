"""Pooling: a step's pooling rows (engine/pooled.py's requests) reduced to one part per sequence, in one call.

A pooling request's chunk names its rows in the batch (`ForwardBatch.pool_rows`, built once in `forward_batch`):
every row of a mean-pooling chunk, the last row of the chunk that ends a last-token request's prompt. Each
sequence's rows are contiguous and one segment: `torch.segment_reduce` sums every segment at once (a last-token
segment is its one row), in float64, so a prompt's parts add up to the same mean however it was chunked, and each
segment is reduced on its own (the same sum alone or in any batch). The hidden states are the model's output, after
the final norm, as transformers' `last_hidden_state` and sentence-transformers' pooling take them.
"""

from __future__ import annotations

import torch


def pool(hidden: torch.Tensor, rows: list[int], lengths: list[int]) -> torch.Tensor:
    """hidden [T, H]; rows: the pooled rows, segment after segment; lengths: each segment's row count ->
    [segments, H] float64 sums."""
    x = hidden[torch.tensor(rows, dtype=torch.long, device=hidden.device)].double()  # [R, H]
    return torch.segment_reduce(x, "sum", lengths=torch.tensor(lengths, device=hidden.device))  # [S, H]
