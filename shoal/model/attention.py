"""Paged attention over a flat batch of tokens from many sequences.

The runner lays a step's tokens out flat, decodes first:

    tokens: | d0 d1 ... d(B-1) | prefill chunk of seq a | prefill chunk of seq b | ...
            |<--- decodes --->|<----------------- chunks ----------------------->|

Every token's K/V is first written into the cache at its slot
(block_id * block_size + offset). Then:
- the decodes (one query each) attend in one batched SDPA call over K/V
  gathered through their block tables, padded to the longest and masked;
- each chunk (a prompt piece, or a recompute) attends on its own over its
  sequence's cached K/V, causally offset by the chunk's start position.

Queries of the KV heads' groups are folded into the query-length axis
(`[B, Hkv, G*q, D]`), which is GQA without repeating K/V and measured faster
than SDPA's enable_gqa on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long
    num_decodes: int
    decode_block_tables: torch.Tensor | None = None  # [Bd, max_blocks] long
    decode_mask: torch.Tensor | None = None  # [Bd, 1, 1, max_blocks * block_size] bool
    chunks: list[ChunkMeta] = field(default_factory=list)


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
    out = torch.empty_like(q)

    Bd = meta.num_decodes
    if Bd:
        flat = meta.decode_block_tables.view(-1)
        k = gather_blocks(k_cache, flat).view(Bd, -1, Hkv, D).transpose(1, 2)  # [Bd, Hkv, S, D]
        v = gather_blocks(v_cache, flat).view(Bd, -1, Hkv, D).transpose(1, 2)
        qd = q[:Bd].view(Bd, Hkv, G, D)  # head h = kv_head * G + g, as in HF's repeat_kv
        o = F.scaled_dot_product_attention(qd, k, v, attn_mask=meta.decode_mask, scale=scale)
        out[:Bd] = o.reshape(Bd, Hq, D)

    for c in meta.chunks:
        k = gather_blocks(k_cache, c.block_table)[: c.context_len].transpose(0, 1)  # [Hkv, S, D]
        v = gather_blocks(v_cache, c.block_table)[: c.context_len].transpose(0, 1)
        # [L, Hq, D] -> [Hkv, G*L, D]: rows g*L + i are query i of group member g.
        qc = q[c.start : c.start + c.length].view(c.length, Hkv, G, D).permute(1, 2, 0, 3).reshape(Hkv, G * c.length, D)
        # 4-D with a batch of one: with a mask, 3-D inputs send CPU SDPA down its math path (bmm, where,
        # softmax), 4-D ones to the flash kernel: 1.9-3.7x faster per call (benchmarks/NOTES.md).
        mask = None if c.mask is None else c.mask[None, None]
        o = F.scaled_dot_product_attention(qc[None], k[None], v[None], attn_mask=mask, is_causal=mask is None, scale=scale)[0]
        out[c.start : c.start + c.length] = o.view(Hkv, G, c.length, D).permute(2, 0, 1, 3).reshape(c.length, Hq, D)  # o: [Hkv, G*L, D]
    return out
