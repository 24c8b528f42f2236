"""Batch invariance of the matmuls: every output row the same whatever else is in the batch.

A probe, run once per process and dtype, says whether this host's GEMMs already are row-invariant; where
they are not, or only up to a reduction length, `make_row_invariant` swaps the model's float linear layers
for InvariantLinear, which splits, pads or widens the GEMM so that they are. The attention backends use
`wide_dtype`/`wide_matmul` for their own products. Low-bit layers (quant.py) are row-invariant as they are.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from shoal.model.layers import Layer, Linear

# oneDNN's bfloat16/float16 GEMMs on the CPU give a row the same bits whatever the
# number of rows only while the reduction is at most this long: past it, rows in a
# full M block and rows in a tail block add their partial sums differently
# (tests/test_invariance.py measures it at SmolLM2's 1536-wide down projection).
INVARIANT_K = 1024


# oneDNN's half-precision GEMMs on a CPU with AVX512-FP16 (an Intel Xeon of the Sapphire Rapids family, 2026-11-29)
# take another kernel at two to four rows than at more where a side of the weight is short: rows of a 16- or 32-long
# reduction, or of 8 or 32 outputs, came out with other bits now and then (a tiny Qwen3-MoE's 32-wide experts in
# float16), where 48 and more of both never did past one row. A probe of a few random products finds it about one
# seed in ten, so it cannot decide. Half-precision projections narrower than this on either side are computed wide
# (`narrow_wide`); no released model has one, tiny test models do.
NARROW = 128


@functools.cache
def gemm_is_row_invariant(dtype: torch.dtype) -> bool:
    """Whether this host's GEMMs in `dtype`, called the way the invariant paths call them, give a row
    the same bits whatever the number of rows, for linears and batched matmuls. Probed once per
    process and dtype, on random data.

    - float32 (MKL, in the strict mode `--deterministic` sets): yes on the Intel Xeon hosts; no on
      an AMD EPYC host of the same kind (2026-11-23), where MKL's strict mode still changed a row
      with the batch.
    - bfloat16/float16 with reductions of at most INVARIANT_K (InvariantLinear splits longer ones):
      yes where the CPU multiplies bf16 natively (oneDNN's AVX512-BF16/AMX kernels); no on an Intel
      Xeon without avx512_bf16 (2026-11-23), where oneDNN's emulated bf16 GEMM blocks rows its own way.

    Where the answer is no, the invariant paths compute in a wider dtype (`wide_dtype`).
    """
    g = torch.Generator().manual_seed(0)
    shapes = ((576, 960), (1536, 576)) if dtype == torch.float32 else ((576, 960), (INVARIANT_K, 576))
    sizes = (2, 3, 5, 8, 17, 33)
    for k, n in shapes:
        w, x = torch.randn(n, k, generator=g).to(dtype), torch.randn(70, k, generator=g).to(dtype)
        full = F.linear(x, w)
        if any(not torch.equal(F.linear(x[:b], w), full[:b]) for b in sizes):
            return False
    a, b = torch.randn(3, 4, 70, 64, generator=g).to(dtype), torch.randn(3, 4, 64, 256, generator=g).to(dtype)
    full = torch.matmul(a, b)
    return all(torch.equal(torch.matmul(a[:, :, :m], b), full[:, :, :m]) for m in sizes)


def wide_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """The dtype the invariant paths multiply `dtype` tensors in on this CPU: None (as they are) where its
    GEMMs are row-invariant, else float32 for a half dtype where float32's are, else float64."""
    if gemm_is_row_invariant(dtype):
        return None
    if dtype != torch.float32 and gemm_is_row_invariant(torch.float32):
        return torch.float32
    return torch.float64


def narrow_wide(dtype: torch.dtype, weight: torch.Tensor) -> torch.dtype | None:
    """The dtype a projection of this weight [out, in] multiplies `dtype` activations in: `wide_dtype`, or for a
    half-precision weight narrower than NARROW on either side float32 where float32's GEMMs are row-invariant and
    float64 where not."""
    wide = wide_dtype(dtype)
    if wide is None and dtype in (torch.float16, torch.bfloat16) and min(weight.shape) < NARROW:
        return torch.float32 if gemm_is_row_invariant(torch.float32) else torch.float64
    return wide


def pads_single_row(dtype: torch.dtype) -> bool:
    """Whether the invariant paths run a one-row GEMM in `dtype` on two copies of the row: oneDNN's half-precision
    GEMMs take another kernel for one row than for several, which rounds a few outputs differently (float16 on the
    Intel Xeon hosts; bfloat16 on an AMD EPYC with avx512_bf16, 2026-11-24: 3 rows in 2,048 at a 64 x 64 linear,
    and never at two rows). Not where the GEMM is widened (`wide_dtype`), which has no such kernel."""
    return dtype in (torch.float16, torch.bfloat16) and wide_dtype(dtype) is None


def wide_matmul(a: torch.Tensor, b: torch.Tensor, via: torch.dtype = torch.float64) -> torch.Tensor:
    """a @ b computed in `via`, rounded once to a's dtype: a row's bits then depend on its own products
    only (float64's sum order changes nothing a float32 rounding can see, in practice; float32's GEMM
    is row-invariant where `via` is float32)."""
    return torch.matmul(a.to(via), b.to(via)).to(a.dtype)


class InvariantLinear(Layer):
    """A linear layer whose every output row is the same whatever else is in the batch.

    - A reduction longer than INVARIANT_K is cut into equal pieces of at most
      that length; each piece is one GEMM in the activation dtype, and the
      pieces are added in order in float32 (one rounding back at the end).
    - `pad_single_row` (`pads_single_row`): the half-precision GEMMs take another kernel
      for a single row than for several, so a one-row call runs on the row twice.

    - `wide` (a dtype, where the host's GEMM in the activation dtype is not
      row-invariant: `wide_dtype`): one GEMM in that dtype, rounded back once.
      True means float64.

    Chosen once per layer by `make_row_invariant` when the device and dtype need it.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, pad_single_row: bool, wide: torch.dtype | bool | None = None) -> None:
        super().__init__()
        self.wide = torch.float64 if wide is True else (wide or None)
        if self.wide is not None:
            self.register_buffer("weight_t", weight.to(self.wide).T.contiguous(), persistent=False)
            self.bias, self.in_features, self.out_features = bias, weight.shape[1], weight.shape[0]
            return
        k = weight.shape[1]
        pieces = -(-k // INVARIANT_K)
        size = -(-k // pieces)
        self.bounds = [(i, min(i + size, k)) for i in range(0, k, size)]
        self.parts = [weight[:, a:b].contiguous() for a, b in self.bounds]
        for i, w in enumerate(self.parts):
            self.register_buffer(f"weight_{i}", w, persistent=False)
        self.bias = bias
        self.pad_single_row = pad_single_row
        self.in_features, self.out_features = k, weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.wide is not None:
            y = wide_matmul(x, self.weight_t, self.wide)
            return y if self.bias is None else y + self.bias
        single = self.pad_single_row and x.shape[0] == 1
        if single:
            x = torch.cat((x, x))
        if len(self.parts) == 1:
            y = F.linear(x, self.parts[0], self.bias)
        else:
            y = None
            for (a, b), w in zip(self.bounds, self.parts):
                part = F.linear(x[:, a:b].contiguous(), w)
                y = part.float() if y is None else y.add_(part)
            y = y.to(x.dtype) if self.bias is None else y.add_(self.bias).to(x.dtype)
        return y[:1] if single else y


def make_row_invariant(model: nn.Module, device: torch.device, dtype: torch.dtype, head: bool = True) -> int:
    """Swap the linear layers (and the logits head, where this rank computes logits: `head`) whose GEMM is
    not row-invariant on this device and dtype for InvariantLinear; returns how many were swapped.

    bfloat16/float16 on the CPU: reductions longer than INVARIANT_K are split,
    and single rows are padded (`pads_single_row`). float32 on the CPU needs nothing here where
    MKL's strict reproducible mode (config.STRICT_MKL) is row-invariant. Where
    the host's GEMMs in `dtype` are not row-invariant even so (`gemm_is_row_invariant`),
    every linear goes wide (`wide_dtype`). Weight-only int8/int4 kernels are
    row-invariant as they are.
    """
    if device.type != "cpu":
        return 0
    wide = wide_dtype(dtype)
    if dtype == torch.float32 and wide is None:
        return 0
    pad = pads_single_row(dtype)
    swapped = 0
    if head and model.logits_head is None and model.model.embed_tokens is not None:  # the head (rank 0's): F.linear over the embedding or lm_head
        head = model.model.embed_tokens.weight if model.config.tie_word_embeddings else model.lm_head.weight
        if wide is not None or pad or head.shape[1] > INVARIANT_K:
            model.logits_head = InvariantLinear(head.detach(), None, pad, narrow_wide(dtype, head))
            swapped += 1
    for owner in list(model.model.modules()):  # the decoder's projections; the head is done
        for name, child in list(owner.named_children()):
            if type(child) is Linear and (wide is not None or pad or child.in_features > INVARIANT_K):
                setattr(owner, name, InvariantLinear(child.weight.detach(), child.bias, pad, narrow_wide(dtype, child.weight)))
                swapped += 1
    return swapped
