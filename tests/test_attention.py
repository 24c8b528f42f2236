"""Both attention backends' chunk path against a float32 reference written out head by head.

A chunk after a cached prefix attends over keys gathered through a shuffled
block table, causally offset by its start. The invariant backend
(`--deterministic`) tiles the keys; the sdpa backend (the default) sends
that chunk in bf16 on the CPU through `eager_attention` (half-precision
matmuls around a float32 softmax) instead of SDPA's flash kernel, and keeps
SDPA in float32. Each must give the reference's numbers, to the precision of
its dtype. (That the invariant backend gives the same bits in every step
shape is tests/test_invariance.py.)
"""

import pytest
import torch

from shoal.model.attention import SeqSpan
from shoal.model.attention.invariant import InvariantAttention
from shoal.model.attention.sdpa import AttentionMetadata, ChunkMeta, eager_chunk, paged_attention

HKV, G, D, BS = 3, 3, 16, 4
START, LENGTH = 23, 9  # 23 cached keys, then a 9-token chunk that starts mid-block


def _setup(dtype, window=None):
    g = torch.Generator().manual_seed(0)
    ctx = START + LENGTH
    nb = 16
    k_cache = torch.randn(nb, BS, HKV, D, generator=g).to(dtype)
    v_cache = torch.randn(nb, BS, HKV, D, generator=g).to(dtype)
    block_table = torch.randperm(nb, generator=g)[: -(-ctx // BS)]
    q = torch.randn(LENGTH, HKV * G, D, generator=g).to(dtype)
    pos = torch.arange(START, ctx)
    keys = torch.arange(ctx)[None, :]
    mask = keys <= pos[:, None]  # as ModelRunner builds it
    if window is not None:
        mask &= keys > pos[:, None] - window
    mask = mask.repeat(G, 1)
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), num_decodes=0,
                             chunks=[ChunkMeta(0, LENGTH, block_table, ctx, window is not None, mask)])
    return q, k_cache, v_cache, block_table, meta


def _reference(q, k_cache, v_cache, block_table, scale, window=None, causal=True):
    """Per query head, in float32: softmax(q k^T * scale + causal offset) v over the gathered keys.
    causal=False: every query sees every key (what a chunk that lost its offset would compute)."""
    ctx = START + LENGTH
    k = k_cache.float()[block_table].reshape(-1, HKV, D)[:ctx]
    v = v_cache.float()[block_table].reshape(-1, HKV, D)[:ctx]
    out = torch.empty(LENGTH, HKV * G, D)
    for h in range(HKV * G):
        kv = h // G  # query head h reads KV head h // G, as transformers' repeat_kv lays them out
        s = q.float()[:, h] @ k[:, kv].T * scale
        keys, pos = torch.arange(ctx)[None, :], torch.arange(START, ctx)[:, None]
        if causal:
            s[keys > pos] = float("-inf")
        if window is not None:
            s[keys <= pos - window] = float("-inf")
        out[:, h] = torch.softmax(s, -1) @ v[:, kv]
    return out


@pytest.mark.parametrize("window", [None, 12])  # 12: a sliding window hides the oldest keys too
@pytest.mark.parametrize("dtype, eager, atol", [(torch.bfloat16, True, 2e-2), (torch.float16, True, 3e-3), (torch.float32, False, 1e-5)])
def test_chunk_after_cached_prefix_matches_float32_reference(dtype, eager, atol, window):
    q, k_cache, v_cache, block_table, meta = _setup(dtype, window)
    assert eager_chunk(q, HKV * G * LENGTH, START + LENGTH) is eager
    scale = D**-0.5
    # the layer's cache as the runner holds it: [2, Hkv, blocks + 1 (the null block), block_size, D]
    kv = torch.stack((k_cache, v_cache)).permute(0, 3, 1, 2, 4)
    kv = torch.cat((kv, torch.zeros_like(kv[:, :, :1])), dim=2).contiguous()
    invariant = InvariantAttention(block_size=BS, num_kv_heads=HKV, group_size=G, sliding_window=window,
                                   null_block=kv.shape[2] - 1, device=torch.device("cpu"), dtype=dtype)
    inv_meta = invariant.prepare([], [SeqSpan(START, LENGTH, tuple(block_table.tolist()))])
    inv_kv = torch.zeros_like(kv)  # the same keys and values in the invariant backend's own layout
    invariant.write_kv(inv_kv, k_cache.reshape(-1, HKV, D), v_cache.reshape(-1, HKV, D), torch.arange(k_cache.shape[0] * BS))
    want = _reference(q, k_cache, v_cache, block_table, scale, window)
    wrong = _reference(q, k_cache, v_cache, block_table, scale, causal=False)
    for got in (paged_attention(q, kv, meta, scale).float(), invariant.attend(q, inv_kv, inv_meta, scale).float()):
        assert (got - want).abs().max().item() < atol
        # the output really is the attention: far from attending to the wrong keys (no causal offset)
        assert (got - wrong).abs().max().item() > 10 * atol


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("length, prefix, hkv, g", [(5, 0, 3, 3), (7, 13, 3, 3), (64, 300, 2, 4), (1, 9, 1, 1), (33, 31, 4, 1)])
def test_prefix_and_causal_parts_merge_to_the_masked_attention(dtype, atol, length, prefix, hkv, g):
    """The CPU path for a chunk without a window: the keys before the chunk unmasked, the chunk's own causal square,
    merged by their log-sum-exps. It must equal one softmax over the causally masked context."""
    from shoal.model.attention.sdpa import prefix_and_causal

    gen = torch.Generator().manual_seed(length * 100 + prefix)
    q = torch.randn(length, hkv * g, D, generator=gen).to(dtype)
    k, v = (torch.randn(hkv, prefix + length, D, generator=gen).to(dtype) for _ in range(2))
    got = prefix_and_causal(q, k, v, prefix, D**-0.5).float()
    kk, vv = k.repeat_interleave(g, 0).float(), v.repeat_interleave(g, 0).float()
    s = (q.float().transpose(0, 1) @ kk.transpose(-1, -2)) * D**-0.5
    s.masked_fill_(torch.arange(prefix + length)[None] > torch.arange(prefix, prefix + length)[:, None], float("-inf"))
    want = (s.softmax(-1) @ vv).transpose(0, 1)
    assert got.shape == q.shape and (got - want).abs().max().item() < atol


def test_eager_chunk_only_on_the_cpu_and_for_bounded_score_matrices():
    q = torch.zeros(1, 1, dtype=torch.bfloat16)
    assert eager_chunk(q, 1536, 4096)
    assert not eager_chunk(q, 1536, 32768)  # 200 MB of float32 scores: SDPA's flash kernel instead
    assert not eager_chunk(torch.zeros(1, 1, dtype=torch.bfloat16, device="meta"), 16, 16)  # any other device (CUDA) keeps SDPA
