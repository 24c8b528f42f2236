"""shoal's native CPU kernels (`shoal/kernels/`): the invariant attention op on its own.

On every code path this CPU has (baseline x86-64, AVX2, AVX-512), on random
shapes (head dims that are not multiples of 16, block sizes below, at and above
16, grouped and plain heads, sliding windows) and in bfloat16, float16 and float32:
- the op matches a float64 softmax attention over the same keys;
- a row's output is the same bits whatever rows share the call (decodes of other
  sequences, longer contexts, chunks cut anywhere);
- what it writes into the cache is what the backend's `write_kv` writes.
How the engine uses it is tests/test_invariance.py (every step shape, real model).
"""

from __future__ import annotations

import dataclasses
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as gguf_type

from shoal import kernels
from shoal.model.attention import SeqSpan
from shoal.model.attention.common import cache_row, quantize_rows, slot_mapping
from shoal.model.attention.invariant import InvariantAttention

from conftest import require_native_kernels

ATOL = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 1e-5}
# (KV heads, query heads per KV head, head dim, block size, window)
SHAPES = [(3, 3, 64, 16, None), (2, 2, 16, 4, None), (1, 4, 24, 3, 20), (2, 1, 40, 32, None), (1, 2, 128, 16, 70),
          (2, 3, 8, 1, None), (1, 1, 72, 48, 33)]


@pytest.fixture(scope="module", autouse=True)
def native():
    require_native_kernels()


@pytest.fixture(params=[3, 2, 1], ids=["avx512", "avx2", "baseline"])
def isa(request):
    """Each code path the CPU has (a request above it runs the best one below, already covered)."""
    got = kernels.use_isa(request.param)
    if got != kernels.ISA_NAMES[request.param]:
        pytest.skip(f"this CPU has no {kernels.ISA_NAMES[request.param]}")
    yield got
    kernels.use_isa(0)


class Sequences:
    """Sequences with fixed queries, keys and values at every position, in one shuffled paged cache."""

    def __init__(self, shape, dtype, lengths, seed=0, kv_dtype=None, softcap=None):
        self.hkv, self.g, self.d, self.bs, self.window = shape
        self.softcap = softcap  # scores s -> softcap * tanh(s / softcap) (Gemma 2's layers)
        gen = torch.Generator().manual_seed(seed)
        self.dtype, self.lengths = dtype, lengths
        blocks = [-(-n // self.bs) for n in lengths]
        perm = torch.randperm(sum(blocks), generator=gen).tolist()
        self.tables = [tuple(perm[sum(blocks[:i]) : sum(blocks[: i + 1])]) for i in range(len(lengths))]
        self.q = [torch.randn(n, self.hkv * self.g, self.d, generator=gen).to(dtype) for n in lengths]
        self.k = [torch.randn(n, self.hkv, self.d, generator=gen).to(dtype) for n in lengths]
        self.v = [torch.randn(n, self.hkv, self.d, generator=gen).to(dtype) for n in lengths]
        self.null = sum(blocks)
        self.backend = InvariantAttention(block_size=self.bs, num_kv_heads=self.hkv, group_size=self.g,
                                          sliding_window=self.window, null_block=self.null, device=torch.device("cpu"),
                                          dtype=dtype, native=True)
        self.kv_dtype = kv_dtype or dtype  # the cache's: the activations', another float dtype, or int8 codes
        self.kv = torch.zeros(2, self.hkv, self.null + 1, self.bs, cache_row(self.d, self.kv_dtype), dtype=self.kv_dtype)
        self.scale = self.d**-0.5

    def step(self, decodes, chunks):
        """decodes [(seq, pos)], chunks [(seq, start, length)] -> {(seq, pos): [Hq, D]}; the step's own keys and
        values go in through the op, as in a forward (earlier positions must have been written)."""
        spans = [SeqSpan(p, 1, self.tables[s]) for s, p in decodes] + [SeqSpan(a, n, self.tables[s]) for s, a, n in chunks]
        rows = [(s, p) for s, p in decodes] + [(s, p) for s, a, n in chunks for p in range(a, a + n)]
        meta = self.backend.prepare(spans[: len(decodes)], spans[len(decodes) :])
        q = torch.stack([self.q[s][p] for s, p in rows])
        k = torch.stack([self.k[s][p] for s, p in rows])
        v = torch.stack([self.v[s][p] for s, p in rows])
        out = meta.forward(q, k, v, self.kv, self.scale, softcap=self.softcap)
        assert out.dtype == self.dtype and out.shape == q.shape
        return dict(zip(rows, out))

    def fill(self):
        """Every position of every sequence, one whole-prompt chunk each."""
        return self.step([], [(s, 0, n) for s, n in enumerate(self.lengths)])

    def stored(self, x: torch.Tensor) -> torch.Tensor:
        """Keys or values as the cache gives them back: rounded to its float dtype, or int8 codes times their scales."""
        if self.kv_dtype == torch.int8:
            codes, scales = quantize_rows(x)
            return codes.double() * scales.double()[..., None]
        return x.to(self.kv_dtype).double()

    def reference(self, seq, pos):
        first = 0 if self.window is None else max(0, pos - self.window + 1)
        k = self.stored(self.k[seq][first : pos + 1]).repeat_interleave(self.g, 1)
        v = self.stored(self.v[seq][first : pos + 1]).repeat_interleave(self.g, 1)
        s = torch.einsum("hd,khd->hk", self.q[seq][pos].double(), k) * self.scale
        if self.softcap is not None:
            s = torch.tanh(s / self.softcap) * self.softcap
        return torch.einsum("hk,khd->hd", s.softmax(-1), v)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"kv{h}xg{g}-d{d}-bs{b}-w{w}" for h, g, d, b, w in SHAPES])
def test_attention_matches_float64_and_a_row_never_depends_on_the_call(isa, shape, dtype):
    _check_rows(isa, Sequences(shape, dtype, [150, 1, 97, 64, 200]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[2], SHAPES[4]], ids=["kv3xg3-d64-bs16", "kv1xg4-d24-bs3-w20", "kv1xg2-d128-bs16-w70"])
def test_softcapped_scores_match_float64_and_a_row_never_depends_on_the_call(isa, shape, dtype):
    """Gemma 2's logit softcap in the op (tile_softcap): a cap small enough that it bends most scores (1.5, with
    scores of spread about 1), and one that bends few (50, Gemma 2's own)."""
    for cap in (1.5, 50.0):
        seqs = Sequences(shape, dtype, [150, 1, 97, 64, 200], softcap=cap)
        _check_rows(isa, seqs)
        capped = seqs.step([(0, 149)], [])[0, 149]
        seqs.softcap = None
        if cap < 2:  # the cap moved the answer: the op applied it
            assert (capped.double() - seqs.step([(0, 149)], [])[0, 149].double()).abs().max() > 1e-2


# (activations, cache): int8 codes beside each activation dtype, and a cache in another float dtype than the activations
KV_DTYPES = [(torch.float32, torch.int8), (torch.bfloat16, torch.int8), (torch.float16, torch.int8), (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("dtype,kv_dtype", KV_DTYPES, ids=["fp32-int8", "bf16-int8", "fp16-int8", "fp32-bf16"])
@pytest.mark.parametrize("shape", SHAPES[:5], ids=[f"kv{h}xg{g}-d{d}-bs{b}-w{w}" for h, g, d, b, w in SHAPES[:5]])
def test_a_cache_in_another_dtype_is_read_as_it_was_stored_and_rows_never_depend_on_the_call(isa, shape, dtype, kv_dtype):
    """The op reads int8 codes (times their scales) or another float dtype straight from the cache: it matches float64
    attention over the keys and values as stored, and every invariance holds as with a cache in the activations' dtype."""
    _check_rows(isa, Sequences(shape, dtype, [150, 1, 97, 64, 200], kv_dtype=kv_dtype))


def _check_rows(isa, seqs: Sequences) -> None:
    rng = random.Random(1)
    dtype = seqs.dtype
    whole = seqs.fill()
    for (s, p), row in whole.items():
        err = (row.double() - seqs.reference(s, p)).abs().max().item()
        assert err < ATOL[dtype], f"{isa}: sequence {s} position {p}: {err}"
    # the same rows again (rewriting the same keys), in other company: lone decodes, batches of decodes
    # of other sequences, and chunks cut at random places
    for s, p in rng.sample(sorted(whole), 12):
        assert torch.equal(seqs.step([(s, p)], [])[s, p], whole[s, p]), f"{isa}: lone decode {s}/{p}"
    for size in (2, 5, 17, 64):
        batch = rng.sample(sorted(whole), min(size, len(whole)))
        by_seq: dict[int, tuple[int, int]] = {}
        for s, p in batch:  # one row per sequence in a decode batch
            by_seq.setdefault(s, (s, p))
        for key, row in seqs.step(list(by_seq.values()), []).items():
            assert torch.equal(row, whole[key]), f"{isa}: decode {key} among {len(by_seq)}"
    for s, n in enumerate(seqs.lengths):
        cut = sorted(rng.sample(range(1, n), min(3, n - 1))) if n > 1 else []
        bounds = [0, *cut, n]
        others = [(o, seqs.lengths[o] - 1) for o in range(len(seqs.lengths)) if o != s][:2]
        for a, b in zip(bounds, bounds[1:]):
            for key, row in seqs.step(others, [(s, a, b - a)]).items():
                assert torch.equal(row, whole[key]), f"{isa}: {key} in chunk [{a}, {b}) beside decodes"


@pytest.mark.parametrize("dtype,kv_dtype", [(torch.float32, None), (torch.bfloat16, None), *KV_DTYPES],
                         ids=["fp32", "bf16", "fp32-int8", "bf16-int8", "fp16-int8", "fp32-bf16"])
def test_a_few_long_decodes_split_across_threads_give_the_bits_of_one_task_each(isa, dtype, kv_dtype):
    """A step of a few short runs (decodes, or a decode with its drafted tokens: up to 16 rows), one of them seeing
    1,024 keys or more, on more than one thread, splits each run's keys (scores) and then its head dimension
    (values) among the threads. Every row must keep the bits it has when one task computes it whole: in the
    prefill that wrote it, alone on one thread, or beside a prefill chunk. (The bfloat16 case softcaps its scores:
    the split's scores pass caps them as a whole task does.)"""
    threads = torch.get_num_threads()
    softcap = 1.5 if dtype == torch.bfloat16 and kv_dtype is None else None
    try:
        for shape in SHAPES[:5] + SHAPES[6:]:
            seqs = Sequences(shape, dtype, [1500, 1100, 40], kv_dtype=kv_dtype, softcap=softcap)
            whole = seqs.fill()  # whole chunks: never split
            steps = [([(0, 1499)], []), ([(0, 1200), (1, 1099)], []), ([(1, 1023), (2, 39)], []),
                     ([(0, 1499), (1, 700), (2, 20)], []), ([], [(0, 1490, 9)]), ([(1, 1099)], [(0, 1480, 16)]),
                     ([(2, 30)], [(1, 1020, 5)])]
            for decodes, chunks in steps:
                rows = decodes + [(s, p) for s, a, n in chunks for p in range(a, a + n)]
                for n in (2, 3):
                    torch.set_num_threads(n)
                    got = seqs.step(decodes, chunks)
                    assert all(torch.equal(got[key], whole[key]) for key in rows), f"{isa} {shape} {decodes} {chunks} on {n} threads"
            torch.set_num_threads(1)
            alone = seqs.step([(0, 1499)], [])
            assert torch.equal(alone[0, 1499], whole[0, 1499]), f"{isa} {shape}: one thread"
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[4]], ids=["kv3xg3-d64-bs16", "kv1xg2-d128-bs16-w70"])
def test_a_chunk_gives_the_same_bits_whatever_length_of_task_it_is_cut_into(isa, shape):
    """The op cuts a chunk into tasks of 128, 64 or 32 positions: the longest that gives each thread 4 tasks. A
    600-row chunk on 1, 2, 4 and 8 threads is cut each of those ways (with 3 KV heads: 128, 128, 64, 32; with 1:
    128, 64, 32, 32). Every row keeps its bits, and they are those of the row computed alone as a decode."""
    threads = torch.get_num_threads()
    rng = random.Random(2)
    try:
        seqs = Sequences(shape, torch.bfloat16, [600])
        cuts = {}
        for n in (1, 2, 4, 8):
            torch.set_num_threads(n)
            cuts[n] = seqs.step([], [(0, 0, 600)])
        torch.set_num_threads(1)
        for p in rng.sample(range(600), 24) + [0, 63, 64, 127, 128, 599]:
            alone = seqs.step([(0, p)], [])[0, p]
            for n, rows in cuts.items():
                assert torch.equal(rows[0, p], alone), f"{isa} {shape}: position {p} on {n} threads"
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype,kv_dtype", [(torch.bfloat16, None), (torch.float32, None), *KV_DTYPES],
                         ids=["bf16", "fp32", "fp32-int8", "bf16-int8", "fp16-int8", "fp32-bf16"])
def test_the_op_writes_the_cache_as_write_kv_does(dtype, kv_dtype):
    """Bit for bit, int8 codes and scales included: the op quantizes a row as common.quantize_rows does."""
    seqs = Sequences((2, 2, 24, 4, None), dtype, [37, 9], kv_dtype=kv_dtype)
    seqs.fill()
    written = torch.zeros_like(seqs.kv)
    for s, n in enumerate(seqs.lengths):
        slots = slot_mapping([SeqSpan(0, n, seqs.tables[s])], seqs.bs, torch.device("cpu"))
        seqs.backend.write_kv(written, seqs.k[s], seqs.v[s], slots)
    assert torch.equal(written, seqs.kv)
    # the layout: a block's keys transposed ([D, block size]), its values as they are ([block size, D]); an int8
    # block's codes are followed by one float32 scale per token, keys' and values' alike
    int8 = seqs.kv_dtype == torch.int8
    for s, n in enumerate(seqs.lengths):
        k, v = (quantize_rows(x) if int8 else (x.to(seqs.kv_dtype), None) for x in (seqs.k[s], seqs.v[s]))
        for p in range(n):
            block, off = seqs.tables[s][p // seqs.bs], p % seqs.bs
            for h in range(seqs.hkv):
                for i, (codes, scales) in enumerate((k, v)):
                    raw = seqs.kv[i, h, block].view(-1)
                    rows = raw[: seqs.d * seqs.bs].view(seqs.d, seqs.bs).T if i == 0 else raw[: seqs.d * seqs.bs].view(seqs.bs, seqs.d)
                    assert torch.equal(rows[off], codes[p, h])
                    if int8:
                        assert raw[seqs.d * seqs.bs :].view(torch.float32)[off].item() == scales[p, h].item()
    assert not seqs.kv[:, :, seqs.null].any()  # the null block is never written


def test_bad_calls_raise_instead_of_reading_out_of_bounds():
    seqs = Sequences((1, 2, 16, 4, None), torch.float32, [8])
    meta = seqs.backend.prepare([], [SeqSpan(0, 8, seqs.tables[0])])
    q = torch.randn(8, 2, 16)
    with pytest.raises(RuntimeError, match="share a dtype"):
        meta.forward(q.bfloat16(), q[:, :1], q[:, :1], seqs.kv, 0.25)
    with pytest.raises(RuntimeError, match="shapes"):
        meta.forward(torch.randn(8, 3, 16), q[:, :1], q[:, :1], seqs.kv, 0.25)
    none = q.new_empty(0, 1, 16)  # nothing to write: the cache is read only
    # a position past its sequence's block table, a block id outside the cache, a slot outside the cache
    with pytest.raises(RuntimeError, match="block table"):
        dataclasses.replace(meta, row_pos=meta.row_pos + 100).forward(q, none, none, seqs.kv, 0.25)
    with pytest.raises(RuntimeError, match="block id outside"):
        dataclasses.replace(meta, tables=meta.tables + seqs.null + 1).forward(q, none, none, seqs.kv, 0.25)
    with pytest.raises(RuntimeError, match="slot outside"):
        dataclasses.replace(meta, slot_mapping=meta.slot_mapping - 1000).forward(q, q[:, :1], q[:, :1], seqs.kv, 0.25)


# ---------------------------------------------------------------- a decoder layer's row-wise ops

ROW_TOL = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3, torch.float32: 2e-6}  # relative: a rounding of the dtype


def _rows_alone_equal_batch(f, x: torch.Tensor) -> bool:
    batch = f(x)
    return all(torch.equal(f(x[i : i + 1]), batch[i : i + 1]) for i in range(len(x)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("n", [576, 64, 37])
def test_add_rms_norm_is_hf_rmsnorm_of_the_sum_and_row_invariant(isa, dtype, n):
    g = torch.Generator().manual_seed(n)
    x, delta = (torch.randn(33, n, generator=g) * 3).to(dtype), torch.randn(33, n, generator=g).to(dtype)
    w = (1 + torch.randn(n, generator=g) / 4).to(dtype)
    total, y = kernels.add_rms_norm(x, delta, w, 1e-5)
    assert torch.equal(total, x + delta)  # the residual add rounds as torch's does
    # HF: normalize in float32, cast back, scale in the dtype
    want = w * torch.nn.functional.rms_norm(total.float(), (n,), eps=1e-5).to(dtype)
    assert ((y.float() - want.float()).abs() / want.float().abs().clamp_min(1e-3)).max().item() <= 2 * ROW_TOL[dtype]
    y0 = kernels.rms_norm(x, w, 1e-5)
    assert torch.allclose(y0.float(), (w * torch.nn.functional.rms_norm(x.float(), (n,), eps=1e-5).to(dtype)).float(),
                          rtol=2 * ROW_TOL[dtype], atol=1e-3)
    assert _rows_alone_equal_batch(lambda r: kernels.rms_norm(r, w, 1e-5), x)
    for i in range(len(x)):  # a row alone: the same sum and norm as in the batch
        s_i, y_i = kernels.add_rms_norm(x[i : i + 1], delta[i : i + 1], w, 1e-5)
        assert torch.equal(s_i, total[i : i + 1]) and torch.equal(y_i, y[i : i + 1])
    # strided rows, as views of a wider tensor
    wide = torch.cat((x, x), dim=1)
    assert torch.equal(kernels.rms_norm(wide[:, :n], w, 1e-5), y0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_rope_and_silu_mul_match_torch_and_are_row_invariant(isa, dtype):
    from shoal.model.layers import RopeTables, apply_rope

    g = torch.Generator().manual_seed(3)
    T, H, D, inter = 19, 5, 64, 1536 + 8
    qkv = torch.randn(T, (H + 2) * D, generator=g).to(dtype)
    cos, sin = torch.randn(T, D, generator=g), torch.randn(T, D, generator=g)
    x = qkv[:, : H * D].view(T, H, D)  # a strided view, as the model rotates q and k inside qkv
    want = apply_rope(x.clone(), RopeTables(cos[:, None].to(dtype), sin[:, None].to(dtype), native=False))
    got = kernels.rope_(x, cos, sin)
    assert got.data_ptr() == x.data_ptr() and torch.equal(qkv[:, : H * D].view(T, H, D), got)  # in place
    assert ((got.float() - want.float()).abs().max() / want.float().abs().max()).item() <= 4 * ROW_TOL[dtype]
    fresh = torch.randn(T, H, D, generator=g).to(dtype)
    batch = kernels.rope_(fresh.clone(), cos, sin)
    for i in range(T):  # a row rotated alone gets the same bits
        assert torch.equal(kernels.rope_(fresh[i : i + 1].clone(), cos[i : i + 1].contiguous(), sin[i : i + 1].contiguous()), batch[i : i + 1])

    gate_up = torch.randn(T, 2 * inter, generator=g).mul(4).to(dtype)
    gate, up = gate_up.float().chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    got = kernels.silu_mul(gate_up)
    assert ((got.float() - want).abs() / want.abs().clamp_min(1e-2)).max().item() <= 2 * ROW_TOL[dtype]
    assert _rows_alone_equal_batch(kernels.silu_mul, gate_up)


# ------------------------------------------------------------------ the code paths: forcing one, and their bits


def test_forced_level_is_a_path_the_cpu_has_or_a_clear_error():
    assert kernels.forced_level("", 3) == 0 and kernels.forced_level("", 2) == 0  # unset: the best
    assert kernels.forced_level("AVX2", 3) == 2 and kernels.forced_level("baseline", 2) == 1
    assert kernels.forced_level("avx512", 3) == 3
    with pytest.raises(ValueError, match=r"^SHOAL_CPU_ISA=avx512: this CPU has no AVX-512 \(the best it has is AVX2\)$"):
        kernels.forced_level("avx512", 2)
    with pytest.raises(ValueError, match=r"^SHOAL_CPU_ISA=avx2: this CPU has no AVX2 \(the best it has is x86-64 baseline\)$"):
        kernels.forced_level("avx2", 1)
    with pytest.raises(ValueError, match="^SHOAL_CPU_ISA=sse4 is not a code path: use one of baseline, avx2, avx512$"):
        kernels.forced_level("sse4", 3)
    with pytest.raises(ValueError, match="asks for an x86-64 path, and this CPU is"):
        kernels.forced_level("baseline", None)


@pytest.mark.parametrize("name", ["avx2", "baseline"])
def test_shoal_cpu_isa_forces_a_whole_process_onto_the_path(name):
    """Every native op and torch's own kernels: a forced process runs no wider code, and its log says so."""
    level = kernels.ISA_LEVELS[name]
    best = int(torch.ops.shoal_kernels.use_isa(0))
    if level > best:
        pytest.skip(f"this CPU has no {kernels.ISA_NAMES[level]}")
    code = ("import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stdout, format='%(message)s')\n"
            "import shoal, torch\nfrom shoal import kernels\nassert kernels.available()\n"
            "print('PATHS', kernels.isa(), int(torch.ops.shoal_kernels.matmul_isa()), torch.backends.cpu.get_cpu_capability())")
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")}
    out = subprocess.run([sys.executable, "-c", code], env={**env, "SHOAL_CPU_ISA": name}, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    torch_path = {"avx2": "AVX2", "baseline": "DEFAULT"}[name]
    assert f"PATHS {kernels.ISA_NAMES[level]} {level} {torch_path}" in out.stdout.splitlines()
    why = "forced by SHOAL_CPU_ISA" if level < best else "SHOAL_CPU_ISA asks for it"
    assert f"attention, RMSNorm, rotary and SiLU on the {kernels.ISA_NAMES[level]} path ({why}" in out.stdout


def _on_path(level: int, f):
    try:
        kernels.use_isa(level)
        return f()
    finally:
        kernels.use_isa(0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_the_avx2_path_gives_the_avx512_paths_bits(dtype):
    """The ops are written once for 16 lanes (vec.h) and each path holds them in its own registers, with its own
    register blocking: lanes are independent, both paths contract a * b + c into one FMA, and the two reductions
    use one tree. So the AVX2 path's bits are the AVX-512 path's, for the attention (prefill chunks, decodes,
    windows, every blocking's leftover rows, an int8 cache) and the row ops."""
    if int(torch.ops.shoal_kernels.use_isa(0)) < 3:
        pytest.skip("this CPU has no AVX-512 to compare with")
    cases = [(shape, None, None) for shape in SHAPES] + [(shape, torch.int8, None) for shape in SHAPES[:3]] + \
        [(shape, None, 1.5) for shape in SHAPES[:3]]  # and a softcap
    for shape, kv_dtype, softcap in cases:
        seqs = Sequences(shape, dtype, [150, 1, 97, 64, 200], kv_dtype=kv_dtype, softcap=softcap)
        steps = [([], [(s, 0, n) for s, n in enumerate(seqs.lengths)]), ([(0, 149), (2, 50), (4, 199)], [(3, 7, 40)])]
        for decodes, chunks in steps:
            wide = _on_path(3, lambda: seqs.step(decodes, chunks))
            narrow = _on_path(2, lambda: seqs.step(decodes, chunks))
            assert all(torch.equal(wide[key], narrow[key]) for key in wide), f"{shape} {dtype} cache {kv_dtype}"
    gen = torch.Generator().manual_seed(3)
    for n in (576, 100, 17):
        x, delta = torch.randn(5, n, generator=gen).to(dtype), torch.randn(5, n, generator=gen).to(dtype)
        w = torch.randn(n, generator=gen).to(dtype)
        gate_up = (torch.randn(5, 2 * n, generator=gen) * 4).to(dtype)
        heads = torch.randn(5, 3, n - n % 2, generator=gen).to(dtype)
        cos, sin = torch.randn(5, n - n % 2, generator=gen), torch.randn(5, n - n % 2, generator=gen)
        for f in (lambda: kernels.rms_norm(x, w, 1e-5), lambda: torch.cat(kernels.add_rms_norm(x, delta, w, 1e-5)),
                  lambda: kernels.silu_mul(gate_up), lambda: kernels.rope_(heads.clone(), cos, sin)):
            assert torch.equal(_on_path(3, f), _on_path(2, f)), f"row op at {n} {dtype}"


def _model_row(q, keys, values, lo, hi, scale, fused):
    """One query row of the op, written from its documented arithmetic (the top of cpu.cpp) in numpy float32: scores
    as one multiply-add per dimension in order, tiles of 64 keys from position 0, per tile the maximum, p = vexp(s - m)
    (Cephes' expf as vexp computes it), the tile's sum over 16 lanes by the fixed tree, (m, l, acc) moved on with
    alpha, acc += p_j v_j in key order, out = acc / l. `fused`: a * b + c rounds once (AVX2, AVX-512), or twice."""
    import numpy as np

    f32 = np.float32

    def fma(a, b, c):
        if fused:
            return (np.float64(a) * np.float64(b) + np.float64(c)).astype(f32)
        return (f32(a) * f32(b)).astype(f32) + f32(c)

    def vexp(x):
        x = np.minimum(np.maximum(x.astype(f32), f32(-87.3365447505531)), f32(88.0))
        fx = np.floor(fma(x, f32(1.44269504088896341), f32(0.5)))
        x = fma(-fx, f32(0.693359375), x)
        x = fma(-fx, f32(-2.12194440e-4), x)
        z = (x * x).astype(f32)
        y = np.full_like(x, f32(1.9875691500e-4))
        for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
            y = fma(y, x, f32(c))
        y = fma(y, z, x) + f32(1.0)
        return (y * np.ldexp(f32(1.0), fx.astype(np.int32)).astype(f32)).astype(f32)

    def lane_sum(v):  # lane i with i + 8, then i + 4, i + 2, i + 1
        v = v.astype(f32)
        for half in (8, 4, 2, 1):
            v = (v[:half] + v[half:2 * half]).astype(f32)
        return v[0]

    qs = (q.astype(f32) * f32(scale)).astype(f32)
    m, l, acc = np.finfo(f32).min, f32(0.0), np.zeros(q.shape[0], f32)  # -FLT_MAX, as fresh_rows starts
    for ts in range(lo // 64 * 64, hi + 1, 64):
        tile = np.zeros((64, q.shape[0]), f32)
        tile[:min(64, keys.shape[0] - ts)] = keys[ts:ts + 64]
        s = np.zeros(64, f32)
        for d in range(q.shape[0]):  # 64 keys side by side, one dimension at a time
            s = fma(qs[d], tile[:, d], s)
        a, b = max(lo, ts) - ts, min(hi, ts + 63) - ts
        m_new = max(m, f32(s[a:b + 1].max()))
        alpha = f32(1.0) if m_new == m else vexp(np.array([f32(m) - f32(m_new)]))[0]
        p = np.zeros(64, f32)
        p[a:b + 1] = vexp((s[a:b + 1] - m_new).astype(f32))
        ls = np.zeros(16, f32)
        for v in range(a // 16, b // 16 + 1):
            ls = (ls + p[16 * v:16 * v + 16]).astype(f32)
        l, m = fma(l, alpha, lane_sum(ls)), m_new
        acc = (acc * alpha).astype(f32)
        for j in range(a, b + 1):
            acc = fma(p[j], values[ts + j], acc)
    return (acc / l).astype(f32)


@pytest.mark.parametrize("window", [0, 20])
def test_attention_bits_are_its_documented_arithmetic(isa, window):
    """The op's float32 bits, on each path, against a numpy model of the arithmetic the op documents: both AVX
    paths fuse each multiply-add, the baseline rounds twice. Paths are compared with each other elsewhere; this
    pins the bits themselves, so a change that moves them on every path at once (GCC contracting a sum differently,
    a reordered exponential) fails here. Scores span enough for the exponential's clamp, and rows see one tile,
    up to five, and the edges of tiles; keys grow along the sequence, so most tiles move a row's maximum and its
    running sum is rescaled (a * b + c with alpha)."""
    import numpy as np

    gen = torch.Generator().manual_seed(11)
    D, bs, n = 16, 16, 300
    e = torch.randn(D, generator=gen)
    e = e / e.norm() * 4  # keys drift along e, and queries point along it: most tiles raise a row's maximum a little
    keys = torch.randn(n, D, generator=gen) * 0.5 + e * torch.arange(n).unsqueeze(1) * 0.005
    values = torch.randn(n, D, generator=gen)
    kv = torch.zeros(2, 1, n // bs + 1, bs, D)
    tables = torch.arange(n // bs + 1, dtype=torch.int32).view(1, -1)
    pos = torch.arange(n, dtype=torch.int32)
    q = (e * 2 + torch.randn(n, D, generator=gen) * 0.3).unsqueeze(1)
    q[1::4] *= 12  # scores that differ by more than 87.3: p at the exponential's clamp
    # one call writes every position's key and value into the cache (its layout: test_the_op_writes_the_cache_...)
    # and attends for every row
    out = kernels.invariant_attention(q, keys.unsqueeze(1), values.unsqueeze(1), kv, pos.long(), tables,
                                      torch.zeros(n, dtype=torch.int32), pos, 0.25, window, 1)
    fused = isa != kernels.ISA_NAMES[1]
    for i, p in enumerate(pos.tolist()):
        lo = max(0, p - window + 1) if window else 0
        want = _model_row(q[i, 0].numpy(), keys.numpy(), values.numpy(), lo, p, 0.25, fused)
        assert np.array_equal(out[i, 0].numpy().view(np.int32), want.view(np.int32)), f"row at {p} on {isa}"


def test_step_rows_are_the_slots_sequences_and_positions_python_builds():
    """kernels.step_rows, the native metadata's row indices, equal slot_mapping's slots and the spans' rows, for random
    steps of decodes and chunks over tables padded with the null block; a position past its table is refused."""
    rng = random.Random(5)
    null = 999
    for _ in range(200):
        bs = rng.choice((1, 3, 4, 16))
        spans = []
        for sid in range(rng.randint(1, 6)):
            start, length = rng.randint(0, 40), rng.choice((1, 1, rng.randint(1, 20)))
            table = tuple(rng.sample(range(200), (start + length + bs - 1) // bs + rng.randint(0, 2)))
            spans.append(SeqSpan(start, length, table, sid))
        width = max(len(s.block_table) for s in spans) + rng.randint(0, 3)
        tables = torch.tensor([list(s.block_table) + [null] * (width - len(s.block_table)) for s in spans], dtype=torch.int32)
        starts_lengths = torch.tensor([s.start_pos for s in spans] + [s.length for s in spans])
        slots, seq, pos = kernels.step_rows(starts_lengths, tables, bs, null)
        assert slots.tolist() == slot_mapping(spans, bs, torch.device("cpu")).tolist()
        assert seq.tolist() == [i for i, s in enumerate(spans) for _ in range(s.length)] and seq.dtype == torch.int32
        assert pos.tolist() == [p for s in spans for p in range(s.start_pos, s.context_len)] and pos.dtype == torch.int32
    short = torch.tensor([[7, null]], dtype=torch.int32)  # one block held, a position in the second
    with pytest.raises(RuntimeError, match="past its sequence's block table"):
        kernels.step_rows(torch.tensor([3, 3]), short, 2, null)


def _mapping_of(address: int) -> tuple[int, int, list[str]] | None:
    """(start, end, VmFlags) of this process's mapping that holds `address`, from /proc/self/smaps; None: unmapped."""
    start = end = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                start, end = (lo, hi) if lo <= address < hi else (None, None)
            elif head == "VmFlags:" and start is not None:
                return start, end, line.split()[1:]
    return None


def test_weight_memory_is_advised_huge_pages_laid_end_to_end_and_freed_with_its_tensors():
    """kernels.weight_empty, the packed weights' memory: a tensor of 8 MiB or more is a mapping of its own on a 2 MiB
    boundary, smaller ones lie end to end (a cache line apart at most) in an arena, both
    advised MADV_HUGEPAGE ("hg" in smaps); weight_arena_end starts another arena; a mapping goes when its last tensor
    does. Whether the kernel then backs it with huge pages depends on the host's settings and free memory, so that
    is not asserted; the decode step's gain is in benchmarks/NOTES.md."""
    big = kernels.weight_empty((3, 3 << 20))
    start, end, flags = _mapping_of(big.data_ptr())  # (the kernel may merge it with a neighbour of the same flags)
    assert big.dtype == torch.uint8 and big.shape == (3, 3 << 20) and big.data_ptr() % (2 << 20) == 0
    assert end >= big.data_ptr() + (9 << 20) and "hg" in flags
    big.fill_(7)
    assert int(big.sum()) == 7 * (9 << 20)
    kernels.weight_arena_end()
    a, b = kernels.weight_empty((100, 30)), kernels.weight_empty((1 << 20,))
    assert b.data_ptr() == a.data_ptr() + 3008  # 3000 bytes, rounded to a cache line
    arena = _mapping_of(a.data_ptr())
    assert a.data_ptr() % (2 << 20) == 0 and "hg" in arena[2] and arena[0] <= b.data_ptr() < arena[1]
    kernels.weight_arena_end()
    c = kernels.weight_empty((64,))
    assert c.data_ptr() % (2 << 20) == 0 and c.data_ptr() != b.data_ptr() + (1 << 20)  # a new arena, though the old one has room
    a.fill_(1), b.fill_(2), c.fill_(3)
    assert int(a.sum()) == 3000 and int(b.sum()) == 2 << 20 and int(c.sum()) == 3 * 64
    big_at, arena_at = big.data_ptr(), a.data_ptr()
    del big, a
    assert _mapping_of(big_at) is None and _mapping_of(arena_at) is not None  # b still holds the arena
    del b
    assert _mapping_of(arena_at) is None


def test_greedy_head_is_the_head_then_greedy_rows(isa):
    """kernels.greedy_head, a greedy step's head and pick in one call: the tokens and logprobs of gguf_linear, .float()
    and greedy_rows, bit for bit, for Q8_0 and Q4_0 heads, one row and several, float32 and bfloat16 hidden states,
    with and without bans (each row's best token banned, as ignore_eos bans the end token); a row of NaN gets
    greedy_rows' code -1 and a NaN logprob."""
    from shoal.model.formats import NATIVE, quantize

    g = torch.Generator().manual_seed(3)
    for kind in (gguf_type.Q8_0, gguf_type.Q4_0):
        fmt = NATIVE[kind]
        weight = torch.randn(300, 96, generator=g)
        packed = fmt.pack(quantize(weight, fmt).data, 96)
        for rows, dtype in ((1, torch.float32), (5, torch.float32), (3, torch.bfloat16)):
            hidden = torch.randn(rows, 96, generator=g).to(dtype)
            if rows > 1:
                hidden[1] = float("nan")
            logits = fmt.linear(hidden, packed, 300).float()
            best = logits.nan_to_num(nan=0.0).argmax(dim=1)
            bans = torch.arange(rows) * 300 + best
            for ban in (None, bans):
                ids, logp = kernels.greedy_head(hidden, packed, 300, int(kind), ban)
                want_ids, want_logp = kernels.greedy_rows(logits, logits, ban)
                assert ids == want_ids.tolist() and len(ids) == rows
                assert np.array_equal(np.array(logp, np.float32), want_logp.numpy(), equal_nan=True)
                if rows > 1:
                    assert ids[1] == -1 and logp[1] != logp[1]
            assert ids[0] != best[0]  # the ban moved the pick


def test_the_startup_log_says_how_the_weights_are_paged(tmp_path, monkeypatch):
    """kernels.weight_pages, the log line's words, from the host's transparent huge page setting and SHOAL_HUGE_PAGES."""
    setting = tmp_path / "enabled"
    monkeypatch.delenv("SHOAL_HUGE_PAGES", raising=False)
    setting.write_text("always [madvise] never\n")
    assert kernels.weight_pages(setting) == "on 2 MiB pages where the kernel has them free (transparent huge pages: madvise)"
    setting.write_text("[always] madvise never\n")
    assert kernels.weight_pages(setting).endswith("(transparent huge pages: always)")
    setting.write_text("always madvise [never]\n")
    assert kernels.weight_pages(setting).startswith("on 4 KiB pages: this host's transparent huge pages are off")
    assert "no transparent huge page setting" in kernels.weight_pages(tmp_path / "missing")
    monkeypatch.setenv("SHOAL_HUGE_PAGES", "0")
    assert kernels.weight_pages(setting) == "on 4 KiB pages (SHOAL_HUGE_PAGES=0)"
