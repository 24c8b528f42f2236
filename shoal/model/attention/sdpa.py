"""The default backend, fast and not batch-invariant: SDPA kernels picked by the step's shape.

Every token's K/V is first written into the cache at its slot
(block_id * block_size + offset). Then:
- the decodes (one query each) attend in one batched SDPA call over K/V
  gathered through their block tables, padded to the longest and masked;
- each chunk (a prompt piece, or a recompute) attends on its own over its
  sequence's cached K/V, causally offset by the chunk's start position
  (SDPA, or two matmuls around a float32 softmax where that is faster:
  `eager_chunk`; on the CPU without a sliding window, SDPA's flash kernel
  unmasked over the keys before the chunk plus a causal call over its own
  keys, merged by log-sum-exp: `prefix_and_causal`).

Queries of the KV heads' groups are folded into the query-length axis
(`[B, Hkv, G*q, D]`), which is GQA without repeating K/V and measured faster
than SDPA's enable_gqa on CPU.

Which kernel a token's attention takes depends on the step: an unmasked
one-sequence decode, a masked batched decode, a chunk through the eager path or
SDPA's flash kernel. Each reduces in its own order, so in bfloat16 a greedy
answer can change with the load; `invariant.py` (`--deterministic`) does not.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.nn.functional as F

from shoal.model.attention.common import MODEL_WINDOW, PerWindow, SeqSpan, gather_blocks, slot_mapping, softcapped, visible_keys, write_kv


@dataclass
class ChunkMeta:
    start: int  # first row of this chunk in the flat batch
    length: int  # number of query tokens
    block_table: torch.Tensor  # [num_blocks] long, covering the whole context
    context_len: int  # keys visible to the last query (start_pos + length)
    windowed: bool  # a sliding window hides keys before the chunk too
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
class AttentionMetadata(PerWindow):
    slot_mapping: torch.Tensor  # [T] long
    num_decodes: int
    decode_block_tables: torch.Tensor | None = None  # [Bd, max_blocks] long
    decode_mask: torch.Tensor | None = None  # [Bd, 1, 1, max_blocks * block_size] bool
    decode_context_len: int | None = None  # instead of the mask when one sequence decodes: its keys, all visible
    chunks: list[ChunkMeta] = field(default_factory=list)
    window: int | None = None  # the sliding window these masks hide keys outside of
    backend: SdpaAttention | None = None
    spans: tuple = ()  # (decodes, chunks): what prepare was given, for another window's metadata
    other_windows: dict = field(default_factory=dict)  # window -> the step's metadata for it, built on first use

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor, scale: float,
                window=MODEL_WINDOW, softcap: float | None = None) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] of this step; kv [2, Hkv, blocks, block_size, D]: the layer's cache.
        window: the layer's sliding window (None: none; MODEL_WINDOW: the backend's); softcap: its logit softcap."""
        write_kv(kv, k, v, self.slot_mapping)
        return paged_attention(q, kv, self.for_window(window), scale, softcap)


class SdpaAttention:
    name = "sdpa"

    def __init__(self, *, block_size: int, group_size: int, sliding_window: int | None, device: torch.device) -> None:
        self.block_size = block_size
        self.group_size = group_size
        self.window = sliding_window
        self.device = device

    def prepare(self, decodes: list[SeqSpan], chunks: list[SeqSpan], window=MODEL_WINDOW, null_block: int | None = None) -> AttentionMetadata:
        """null_block: unused; tables pad with block 0 here, which every cache has, and the masks hide it."""
        dev, bs, G = self.device, self.block_size, self.group_size
        window = self.window if window is MODEL_WINDOW else window
        meta = AttentionMetadata(slot_mapping=slot_mapping(decodes + chunks, bs, dev), num_decodes=len(decodes), window=window,
                                 backend=self, spans=(decodes, chunks))
        if decodes:
            max_blocks = max(len(s.block_table) for s in decodes)
            meta.decode_block_tables = torch.tensor(
                [list(s.block_table) + [0] * (max_blocks - len(s.block_table)) for s in decodes], dtype=torch.long, device=dev)
            if len(decodes) == 1 and window is None:
                meta.decode_context_len = decodes[0].context_len  # one sequence: its keys, unmasked
            else:
                dpos = torch.tensor([s.start_pos for s in decodes], device=dev)
                meta.decode_mask = visible_keys(torch.arange(max_blocks * bs, device=dev), dpos, window)[:, None, None, :]
        start = len(decodes)
        for s in chunks:
            L, ctx = s.length, s.context_len
            mask = None
            if s.start_pos or G > 1 or window is not None:
                m = visible_keys(torch.arange(ctx, device=dev), torch.arange(s.start_pos, ctx, device=dev), window)  # [L, ctx]
                mask = m.repeat(G, 1)  # rows g*L + i, matching the folded queries
            meta.chunks.append(ChunkMeta(start, L, torch.tensor(s.block_table, dtype=torch.long, device=dev), ctx, window is not None, mask))
            start += L
        return meta


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


def prefix_and_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int, scale: float) -> torch.Tensor:
    """A chunk's attention without a mask: q [L, Hq, D] at positions prefix..prefix+L-1; k/v [Hkv, prefix + L, D].

    The keys before the chunk are all visible, and the chunk's own keys are the
    causal square. CPU SDPA with a boolean mask turns it into a float one and
    reads it in its inner loop (a 512-token chunk at a 6,000-token context:
    a 37 MB mask per layer, and 12% of a long prefill in `where`). So the two
    parts go through the flash kernel unmasked, the square with its own causal
    flag, and are merged by their log-sum-exps in float32.
    """
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    L, Hq, D = q.shape
    Hkv = k.shape[0]
    G = Hq // Hkv
    qh = q.transpose(0, 1)[None]  # [1, Hq, L, D]
    own_k, own_v = (t[:, prefix:].repeat_interleave(G, dim=0)[None] for t in (k, v))  # [1, Hq, L, D]: small
    o_own, lse_own = flash(qh, own_k, own_v, 0.0, True, scale=scale)
    if prefix == 0:
        return o_own[0].transpose(0, 1)
    # the prefix: query heads folded into the rows of their KV head, as in paged_attention
    qf = q.view(L, Hkv, G, D).permute(1, 2, 0, 3).reshape(1, Hkv, G * L, D)
    o_pre, lse_pre = flash(qf, k[None, :, :prefix], v[None, :, :prefix], 0.0, False, scale=scale)
    o_pre, lse_pre = o_pre.reshape(Hq, L, D), lse_pre.reshape(Hq, L)  # head kv * G + g, as HF's repeat_kv
    o_own, lse_own = o_own[0], lse_own[0]
    top = torch.maximum(lse_pre, lse_own)
    w_pre, w_own = (lse_pre - top).exp_(), (lse_own - top).exp_()
    o = (o_pre.float() * w_pre[..., None] + o_own.float() * w_own[..., None]) / (w_pre + w_own)[..., None]
    return o.to(q.dtype).transpose(0, 1)


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    kv: torch.Tensor,  # [2, Hkv, num_blocks, block_size, D]
    meta: AttentionMetadata,
    scale: float,
    softcap: float | None = None,  # a logit softcap: eager attention (common.softcapped) for every query
) -> torch.Tensor:  # [T, Hq, D]
    T, Hq, D = q.shape
    Hkv = kv.shape[1]
    G = Hq // Hkv

    Bd = meta.num_decodes
    if Bd:
        flat = meta.decode_block_tables.view(-1)
        n = meta.decode_context_len  # None: padded to the longest table, masked
        if n is None:
            k, v = gather_blocks(kv, flat, q.dtype).view(2, Hkv, Bd, -1, D).transpose(1, 2)  # [Bd, Hkv, S, D] each
        else:  # one sequence
            k, v = gather_blocks(kv, flat, q.dtype)[:, :, :n].unsqueeze(1)
        qd = q[:Bd].view(Bd, Hkv, G, D)  # head h = kv_head * G + g, as in HF's repeat_kv
        if softcap is not None:
            o = softcapped(qd, k, v, meta.decode_mask, scale, softcap).reshape(Bd, Hq, D)
        else:
            o = F.scaled_dot_product_attention(qd, k, v, attn_mask=meta.decode_mask, scale=scale).reshape(Bd, Hq, D)
        if not meta.chunks:
            return o  # a decode-only step: no buffer to assemble
    out = torch.empty_like(q)
    if Bd:
        out[:Bd] = o

    for c in meta.chunks:
        k, v = gather_blocks(kv, c.block_table, q.dtype)[:, :, : c.context_len]  # [Hkv, S, D] each
        # [L, Hq, D] -> [Hkv, G*L, D]: rows g*L + i are query i of group member g.
        qc = q[c.start : c.start + c.length].view(c.length, Hkv, G, D).permute(1, 2, 0, 3).reshape(Hkv, G * c.length, D)
        # 4-D with a batch of one: with a mask, 3-D inputs send CPU SDPA down its math path (bmm, where,
        # softmax), 4-D ones to the flash kernel: 1.9-3.7x faster per call (benchmarks/NOTES.md).
        if softcap is not None:
            mask = c.mask if c.mask is not None else torch.ones(c.length, c.length, dtype=torch.bool, device=q.device).tril()
            o = softcapped(qc[None], k[None], v[None], mask, scale, softcap)[0]
        elif c.mask is not None and eager_chunk(q, Hkv * G * c.length, c.context_len):
            o = eager_attention(qc[None], k[None], v[None], c.hidden, scale)[0]
        elif c.mask is not None and not c.windowed and q.device.type == "cpu":
            out[c.start : c.start + c.length] = prefix_and_causal(q[c.start : c.start + c.length], k, v, c.context_len - c.length, scale)
            continue
        else:
            mask = None if c.mask is None else c.mask[None, None]
            o = F.scaled_dot_product_attention(qc[None], k[None], v[None], attn_mask=mask, is_causal=mask is None, scale=scale)[0]
        out[c.start : c.start + c.length] = o.view(Hkv, G, c.length, D).permute(2, 0, 1, 3).reshape(c.length, Hq, D)  # o: [Hkv, G*L, D]
    return out
