"""What every attention backend shares: the step's sequences as plain spans, the
KV cache's layout, writing a step's keys and values into it, and slot mapping.

The runner lays a step's tokens out flat, decodes first:

    tokens: | d0 d1 ... d(B-1) | prefill chunk of seq a | prefill chunk of seq b | ...
            |<--- decodes --->|<----------------- chunks ----------------------->|

A layer's KV cache is one tensor [2 (k|v), Hkv, num_blocks + 1, block_size, D],
head-major: gathering a sequence's blocks gives each head's keys as one
contiguous [tokens, D] matrix, which the matmuls read as they are, with no
transposing copy. The last block is the null block, never handed out by the
pool and never written, so a backend can pad block tables with it and read zeros.

The cache's dtype (`--kv-cache-dtype`) may differ from the activations': keys and
values are rounded to it once when written. An int8 cache is [2, Hkv, num_blocks + 1,
block_size, D + 4] int8: each block of one head holds its codes ([block_size, D]) and
then block_size float32 scales, one per token (`int8_views`). A token's row of one head
is quantized on its own (`quantize_rows`), so its codes never depend on what was written
with it: chunking and batching leave them as they are, as batch invariance needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class _ModelWindow:
    """What a layer that names no window gets: the backend's own, the model's (ModelConfig.sliding_window)."""

    def __repr__(self) -> str:
        return "MODEL_WINDOW"


# metadata.forward(..., window=MODEL_WINDOW): the backend's window. A layer of a model whose layers differ (Gemma's
# local and global layers, spec.AttentionSpec.window) names its own, None for none; each backend builds what a
# window needs (its masks) once per step and window.
MODEL_WINDOW = _ModelWindow()


class PerWindow:
    """What a step's metadata does for a model whose layers have different windows (the torch backends'): the
    metadata for another window, built on first use and kept for the step. Needs `window`, `backend`, `spans` and
    `other_windows` fields."""

    def for_window(self, window):
        """The step's metadata for layers with `window` (MODEL_WINDOW: the backend's): this, or built once per step."""
        if window is MODEL_WINDOW or window == self.window:
            return self
        if window not in self.other_windows:
            self.other_windows[window] = self.backend.prepare(*self.spans, window=window)
        return self.other_windows[window]


class GroupedMetadata:
    """A step's metadata where the model's layers keep their KV in several groups (types.KVGroup: a sliding
    window's layers, the full-attention layers), each with its own block tables and null block: one backend
    metadata per group, found by the layer's window. A model with one group gets the backend's metadata as it is."""

    def __init__(self, by_window: dict, default_window) -> None:
        self.by_window = by_window  # window -> the backend's metadata over that group's block tables
        self.default_window = default_window  # what MODEL_WINDOW names: the backend's window

    def forward(self, q, k, v, kv, scale: float, window=MODEL_WINDOW, softcap: float | None = None):
        window = self.default_window if window is MODEL_WINDOW else window
        return self.by_window[window].forward(q, k, v, kv, scale, window=window, softcap=softcap)


def softcapped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None, scale: float, cap: float) -> torch.Tensor:
    """q [B, H, M, D], k/v [B, H, S, D]; visible: [.., M, S] bool (True: seen) or None (all) -> [B, H, M, D].

    transformers' eager attention with a logit softcap (Gemma 2): scores = cap * tanh(q.k * scale / cap),
    then the mask and a float32 softmax. SDPA's kernels have no softcap.
    """
    s = torch.matmul(q, k.transpose(-1, -2)).float().mul_(scale)
    s = torch.tanh(s / cap).mul_(cap)
    if visible is not None:
        s.masked_fill_(~visible, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1).to(v.dtype), v)


@dataclass(frozen=True)
class SeqSpan:
    """One sequence's tokens in a step: `length` query tokens from position `start_pos`."""

    start_pos: int
    length: int
    block_table: tuple[int, ...]  # on the wire (ForwardBatch), the entries from changed_from on; in a backend, all
    seq_id: int = -1  # the sequence's, where the runner knows it (-1: none; a backend then keeps nothing of it)
    # The first entry of the table that may differ from the one this sequence had in the last step that named it
    # (runner/kept.py): a backend that keeps tables rewrites from there. 0: all of it.
    changed_from: int = 0

    @property
    def context_len(self) -> int:
        return self.start_pos + self.length


def slot_mapping(spans: list[SeqSpan], block_size: int, device: torch.device) -> torch.Tensor:
    """The cache slot (block_id * block_size + offset) of every token of the step, in flat order."""
    slots: list[int] = []
    for s in spans:
        bt = s.block_table
        slots.extend(bt[p // block_size] * block_size + p % block_size for p in range(s.start_pos, s.context_len))
    return torch.tensor(slots, dtype=torch.long, device=device)


def visible_keys(keys: torch.Tensor, pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """keys [S], query positions [rows] -> [rows, S] bool: the keys each query attends to (causal, and
    within the sliding window if there is one)."""
    visible = keys <= pos[:, None]
    if window is not None:
        visible &= keys > pos[:, None] - window
    return visible


SCALE_BYTES = 4  # an int8 cache's float32 scale per token and head, after its block's codes


def cache_row(head_dim: int, kv_dtype: torch.dtype) -> int:
    """The cache tensor's last dimension: D elements, or an int8 cache's D codes and a scale's 4 bytes."""
    return head_dim + SCALE_BYTES if kv_dtype == torch.int8 else head_dim


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, kv_dtype: torch.dtype) -> int:
    """What one token's keys and values take in the cache, over every layer and KV head."""
    return 2 * num_layers * num_kv_heads * cache_row(head_dim, kv_dtype) * kv_dtype.itemsize


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> int8 codes [..., D] and float32 scales [...]: scale = max|x| / 127 per row,
    code = round(x / scale) (half to even), as shoal's native attention op quantizes (kernels/cpu.cpp)."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / 127
    codes = torch.where(scale[..., None] > 0, torch.round(xf / scale[..., None]), 0.0)
    return codes.clamp_(-127, 127).to(torch.int8), scale


def int8_views(kv: torch.Tensor, head_dim: int, transposed_keys: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An int8 cache [2, Hkv, blocks, block_size, D + 4] as views: key codes [Hkv, blocks, block_size, D] (or
    [Hkv, blocks, D, block_size] where keys are stored transposed, as the native op does), value codes
    [Hkv, blocks, block_size, D], and scales [2, Hkv, blocks, block_size] float32."""
    _, h, nb, bs, _ = kv.shape
    flat = kv.view(2, h, nb, -1)
    codes, scales = flat[..., : bs * head_dim], flat[..., bs * head_dim :].view(torch.float32)
    keys = codes[0].view(h, nb, head_dim, bs) if transposed_keys else codes[0].view(h, nb, bs, head_dim)
    return keys, codes[1].view(h, nb, bs, head_dim), scales


def write_kv(kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, transposed_keys: bool = False) -> None:
    """kv: [2, Hkv, num_blocks, block_size, D] (int8: D + 4); k, v: [T, Hkv, D]; slots: [T].
    transposed_keys: keys stored [D, block_size] within their block, as shoal's native op keeps them."""
    _, h, nb, bs, _ = kv.shape
    d = k.shape[-1]
    block, off = slots // bs, slots % bs
    if kv.dtype == torch.int8:
        keys, values, scales = int8_views(kv, d, transposed_keys)
        (kc, ks), (vc, vs) = quantize_rows(k), quantize_rows(v)
        if transposed_keys:
            keys[:, block, :, off] = kc  # the two indexed dimensions are apart: [T, Hkv, D]
        else:
            keys[:, block, off] = kc.transpose(0, 1)
        values[:, block, off] = vc.transpose(0, 1)
        scales[0][:, block, off], scales[1][:, block, off] = ks.transpose(0, 1), vs.transpose(0, 1)
        return
    if transposed_keys:
        kv[0].view(h, nb, d, bs)[:, block, :, off] = k.to(kv.dtype)
        kv[1].view(h, nb * bs, d).index_copy_(1, slots, v.transpose(0, 1).to(kv.dtype))
        return
    # as bytes where torch has no index_copy_ for the dtype (fp8)
    raw = (lambda t: t.view(torch.uint8)) if kv.element_size() == 1 else (lambda t: t)
    raw(kv[0]).view(h, nb * bs, d).index_copy_(1, slots, raw(k.transpose(0, 1).to(kv.dtype)))
    raw(kv[1]).view(h, nb * bs, d).index_copy_(1, slots, raw(v.transpose(0, 1).to(kv.dtype)))


def gather_blocks(kv: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """kv [2, Hkv, num_blocks, block_size, D], block_ids [n] -> [2, Hkv, n * block_size, D] in `dtype` (default:
    the cache's; an int8 cache's codes times their scales, rounded once to `dtype`).

    index_select over rows of one block each is a plain row copy: measured 4x
    faster on this CPU than advanced indexing of the cache; K and V in one call.
    """
    _, h, nb, bs, row = kv.shape
    if kv.dtype == torch.float8_e4m3fn:  # as bytes: torch has no index_select for fp8
        out = torch.index_select(kv.view(torch.uint8).view(2, h, nb, bs * row), 2, block_ids).view(kv.dtype).view(2, h, -1, row)
        return out.to(dtype or kv.dtype)
    blocks = torch.index_select(kv.view(2, h, nb, bs * row), 2, block_ids)
    if kv.dtype != torch.int8:
        out = blocks.view(2, h, -1, row)
        return out if dtype is None or dtype == kv.dtype else out.to(dtype)
    d = row - SCALE_BYTES
    codes = blocks[..., : bs * d].reshape(2, h, -1, d)
    scales = blocks[..., bs * d :].contiguous().view(torch.float32).reshape(2, h, -1, 1)
    return (codes.float() * scales).to(dtype or torch.float32)
