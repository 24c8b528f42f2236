"""Paged attention over a flat batch of tokens from many sequences.

The runner lays a step's tokens out flat, decodes first:

    tokens: | d0 d1 ... d(B-1) | prefill chunk of seq a | prefill chunk of seq b | ...
            |<--- decodes --->|<----------------- chunks ----------------------->|

Every token's K/V is first written into the cache at its slot
(block_id * block_size + offset). Then:
- the decodes (one query each) attend in one batched SDPA call over K/V
  gathered through their block tables, padded to the longest and masked;
- each chunk (a prompt piece, or a recompute) attends on its own over its
  sequence's cached K/V, causally offset by the chunk's start position
  (SDPA, or two matmuls around a float32 softmax where that is faster:
  `eager_chunk`).

Queries of the KV heads' groups are folded into the query-length axis
(`[B, Hkv, G*q, D]`), which is GQA without repeating K/V and measured faster
than SDPA's enable_gqa on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.nn.functional as F


@dataclass
class ChunkMeta:
    start: int  # first row of this chunk in the flat batch
    length: int  # number of query tokens
    block_table: torch.Tensor  # [num_blocks] long, covering the whole context
    context_len: int  # keys visible to the last query (start_pos + length)
    # [G * length, context_len] bool (rows repeat per query-group member), or None
    # when the chunk starts at 0 and G == 1: then SDPA's own causal mask applies.
    mask: torch.Tensor | None

    @cached_property
    def hidden(self) -> tuple[int, torch.Tensor]:
        """Keys the queries must not see, computed once per step (CPU path):
        (first key column with any hidden entry, the inverted mask from that column on).
        After a cached prefix only the chunk's own keys (the causal triangle) are
        hidden, so masking touches L columns instead of the whole context."""
        hidden = self.mask.logical_not()
        cols = hidden.any(dim=0).nonzero()
        first = int(cols[0]) if len(cols) else hidden.shape[1]
        return first, hidden[:, first:]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long
    num_decodes: int
    decode_block_tables: torch.Tensor | None = None  # [Bd, max_blocks] long
    decode_mask: torch.Tensor | None = None  # [Bd, 1, 1, max_blocks * block_size] bool
    decode_context_len: int | None = None  # instead of the mask when one sequence decodes: its keys, all visible
    chunks: list[ChunkMeta] = field(default_factory=list)


# Largest score matrix (query rows x keys, over all KV heads) the eager chunk path
# materializes: 64 MiB of float32, about 10k keys for a full 512-token chunk.
EAGER_MAX_SCORES = 1 << 24


def eager_chunk(q: torch.Tensor, rows: int, keys: int) -> bool:
    """Whether a masked chunk takes `eager_attention` instead of SDPA's flash kernel.

    On the CPU in bf16/fp16, torch's flash kernel is slow at the shapes of a
    chunk (tens to hundreds of queries over hundreds to thousands of keys):
    two half-precision matmuls around a float32 softmax are 1.6-1.9x faster
    per call, and a 45-token turn after a 600-token cached prefix steps
    ~15% faster (benchmarks/NOTES.md). In float32 the two are even, and on
    CUDA the flash kernels win, so both keep SDPA.
    """
    return q.device.type == "cpu" and q.dtype != torch.float32 and rows * keys <= EAGER_MAX_SCORES


def eager_attention(q, k, v, hidden: tuple[int, torch.Tensor], scale):
    """q [B, H, M, D], k/v [B, H, S, D]; hidden: (first, [M, S - first] bool, True: masked out), see ChunkMeta.hidden.

    transformers' eager attention: half-precision scores, softmax in float32,
    probabilities cast back for the second matmul (scaled in float32 here).
    """
    s = torch.matmul(q, k.transpose(-1, -2)).float().mul_(scale)
    first, tail = hidden
    s[..., first:].masked_fill_(tail, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1).to(q.dtype), v)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """k_cache: [num_blocks, block_size, Hkv, D]; k: [T, Hkv, D]; slots: [T]."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v)


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """cache [num_blocks, block_size, Hkv, D], block_ids [n] -> [n * block_size, Hkv, D].

    index_select over 2-D rows (one row per block) is a plain row copy: measured
    4x faster on this CPU than advanced indexing of the 4-D cache.
    """
    nb, bs, h, d = cache.shape
    return torch.index_select(cache.view(nb, bs * h * d), 0, block_ids).view(-1, h, d)


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, Hq, D]
    T, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    G = Hq // Hkv

    Bd = meta.num_decodes
    if Bd:
        flat = meta.decode_block_tables.view(-1)
        n = meta.decode_context_len  # None: padded to the longest table, masked
        k = gather_blocks(k_cache, flat)[:n].view(Bd, -1, Hkv, D).transpose(1, 2)  # [Bd, Hkv, S, D]
        v = gather_blocks(v_cache, flat)[:n].view(Bd, -1, Hkv, D).transpose(1, 2)
        qd = q[:Bd].view(Bd, Hkv, G, D)  # head h = kv_head * G + g, as in HF's repeat_kv
        o = F.scaled_dot_product_attention(qd, k, v, attn_mask=meta.decode_mask, scale=scale).reshape(Bd, Hq, D)
        if not meta.chunks:
            return o  # a decode-only step: no buffer to assemble
    out = torch.empty_like(q)
    if Bd:
        out[:Bd] = o

    for c in meta.chunks:
        k = gather_blocks(k_cache, c.block_table)[: c.context_len].transpose(0, 1)  # [Hkv, S, D]
        v = gather_blocks(v_cache, c.block_table)[: c.context_len].transpose(0, 1)
        # [L, Hq, D] -> [Hkv, G*L, D]: rows g*L + i are query i of group member g.
        qc = q[c.start : c.start + c.length].view(c.length, Hkv, G, D).permute(1, 2, 0, 3).reshape(Hkv, G * c.length, D)
        # 4-D with a batch of one: with a mask, 3-D inputs send CPU SDPA down its math path (bmm, where,
        # softmax), 4-D ones to the flash kernel: 1.9-3.7x faster per call (benchmarks/NOTES.md).
        if c.mask is not None and eager_chunk(q, Hkv * G * c.length, c.context_len):
            o = eager_attention(qc[None], k[None], v[None], c.hidden, scale)[0]
        else:
            mask = None if c.mask is None else c.mask[None, None]
            o = F.scaled_dot_product_attention(qc[None], k[None], v[None], attn_mask=mask, is_causal=mask is None, scale=scale)[0]
        out[c.start : c.start + c.length] = o.view(Hkv, G, c.length, D).permute(2, 0, 1, 3).reshape(c.length, Hq, D)  # o: [Hkv, G*L, D]
    return out
