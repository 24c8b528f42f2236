"""A GGUF's weight types: one registry, keyed by the type, that owns each type's packing, its kernel and its size.

A format is a property of a tensor, not of a model: a Q4_K_M file mixes Q4_K with Q6_K (attention values, half
the down projections, the head) and, where a row is not whole super-blocks of 256, Q5_0 or Q8_0. So every
tensor keeps the type its file stores it in. The loader hands a tensor's blocks as the file holds them
(`QuantTensor`, a view of the memory map); the layer packs them once into shoal's panels
(`kernels/kquants.cpp`) and multiplies with that type's kernel. Nothing else switches on a type's name:
ggml's `type_traits` table is the model (one row per type: block size, bytes, to_float, vec_dot).

Types with a kernel here (`NATIVE`) are served as stored. The others a file may hold (Q2_K, Q3_K, the IQ
family, TQ, MXFP4) are dequantized at load by gguf-py, one tensor at a time, and rounded to Q8_0 (ggml's own
rounding, by gguf-py), so they too run on the low-bit kernels: no tensor is ever held whole in float32.

Activations are rounded as llama.cpp rounds them for each type's dot product: per block of 32 (ggml's Q8_0)
for the 32-weight types, per 256 with 16-input sums (ggml's Q8_K) for the K-quants; by one piece of code on
every instruction set, so the matmuls are row-invariant and give the same bits on AVX-512, AVX2 and SSE2.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import warnings
import weakref
from collections import Counter
from dataclasses import dataclass
from typing import NamedTuple

import gguf
import numpy as np
import torch
from torch import nn

from shoal import kernels
from shoal.model.layers import Layer

log = logging.getLogger("shoal.loader")

T = gguf.GGMLQuantizationType
PANEL = 16  # outputs packed side by side (kquants.cpp)
FLOAT_TYPES = frozenset({T.F32, T.F16, T.BF16})


@dataclass(frozen=True)
class Format:
    """One weight type as shoal serves it (a row of the registry)."""

    type: gguf.GGMLQuantizationType
    packed_bytes: int  # bytes of one packed (panel of 16 outputs, block)
    activations: str  # how its kernel rounds each activation row: "Q8_0" (per 32) or "Q8_K" (per 256)

    @property
    def name(self) -> str:
        return self.type.name

    @property
    def block(self) -> int:
        """Weights per block, in the file and packed."""
        return gguf.GGML_QUANT_SIZES[self.type][0]

    @property
    def file_bytes(self) -> int:
        return gguf.GGML_QUANT_SIZES[self.type][1]

    @property
    def bits_per_weight(self) -> float:
        """Packed, as held in memory and streamed per token."""
        return self.packed_bytes * 8 / (PANEL * self.block)

    def panels(self, rows: int, cols: int) -> tuple[int, int, int]:
        """The packed shape of a [rows, cols] weight: (panels of 16 outputs, blocks a row, packed bytes a block)."""
        return -(-rows // PANEL), cols // self.block, self.packed_bytes

    def pack(self, data: torch.Tensor, cols: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """The file's blocks [rows, row bytes] -> panels [ceil(rows / 16), cols / block, packed_bytes], written into
        `out` where given (a contiguous slice of a stacked tensor)."""
        if out is None:
            return torch.ops.shoal_kernels.gguf_pack(data.contiguous(), int(self.type), cols)
        torch.ops.shoal_kernels.gguf_pack_into(data.contiguous(), int(self.type), cols, out)
        return out

    def linear(self, x: torch.Tensor, packed: torch.Tensor, rows: int) -> torch.Tensor:
        """x [T, cols] -> x @ W.T [T, rows], in x's dtype."""
        return torch.ops.shoal_kernels.gguf_linear(x, packed, rows, int(self.type))

    def rows(self, packed: torch.Tensor, ids: torch.Tensor, cols: int) -> torch.Tensor:
        """Rows `ids` of W as float32, each weight as gguf-py's dequantize computes it."""
        return torch.ops.shoal_kernels.gguf_rows(packed, ids, int(self.type), cols)


# The registry: every type shoal's kernels serve as stored. Packed sizes: kquants.cpp's layouts.
NATIVE: dict[gguf.GGMLQuantizationType, Format] = {
    f.type: f
    for f in (
        Format(T.Q4_0, 320, "Q8_0"),
        Format(T.Q4_1, 320, "Q8_0"),
        Format(T.Q5_0, 352, "Q8_0"),
        Format(T.Q5_1, 384, "Q8_0"),
        Format(T.Q8_0, 544, "Q8_0"),
        Format(T.Q4_K, 2368, "Q8_K"),
        Format(T.Q5_K, 2880, "Q8_K"),
        Format(T.Q6_K, 3360, "Q8_K"),
    )
}
# what a type without a kernel here is rounded to at load (after gguf-py dequantizes it)
FALLBACK = NATIVE[T.Q8_0]


class NativeRuns(NamedTuple):
    """A projection as the native forward takes it (kernels/decoder.cpp): runs of packed weights, each (panels, rows,
    GGUF type) and multiplied by gguf_linear, side by side, then the bias (None: none)."""

    runs: tuple[tuple[torch.Tensor, int, int], ...]
    bias: torch.Tensor | None


def is_quantized(ggml_type) -> bool:
    return ggml_type not in FLOAT_TYPES


def served_as(ggml_type) -> Format:
    """The format a quantized type runs in: its own where a kernel exists, else Q8_0."""
    return NATIVE.get(ggml_type, FALLBACK)


@dataclass
class QuantTensor:
    """A quantized tensor as its file stores it: W [rows, cols] as rows of blocks, `data` [rows, row bytes] uint8
    (a view of the file's memory map until a row permutation copies it)."""

    type: gguf.GGMLQuantizationType
    data: torch.Tensor
    cols: int

    @classmethod
    def of(cls, tensor) -> QuantTensor:
        """A gguf ReaderTensor (or a part of one) -> its blocks, unread: the memory map's pages load on first use."""
        rows, cols = (int(n) for n in reversed(tensor.shape))
        raw = np.asarray(tensor.data).reshape(rows, -1)
        with warnings.catch_warnings():  # the map is read-only, and nothing writes through this view
            warnings.simplefilter("ignore", UserWarning)
            return cls(gguf.GGMLQuantizationType(tensor.tensor_type), torch.from_numpy(raw), cols)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.data.shape[0], self.cols)

    def numel(self) -> int:
        return self.data.shape[0] * self.cols

    def permute_rows(self, fn) -> QuantTensor:
        """fn applied to the rows (a function of a tensor's first dimension, like unpermute_qk)."""
        return QuantTensor(self.type, fn(self.data), self.cols)

    def narrow(self, dim: int, start: int, length: int) -> QuantTensor | torch.Tensor:
        """Rows or columns [start, start + length), as torch.Tensor.narrow: blocks as they are where the columns
        fall on block boundaries, else the dequantized float slice."""
        if dim == 0:
            return QuantTensor(self.type, self.data.narrow(0, start, length), self.cols)
        block, size = gguf.GGML_QUANT_SIZES[self.type]
        if start % block or length % block:
            return self.dequantized().narrow(1, start, length)
        return QuantTensor(self.type, self.data.narrow(1, start // block * size, length // block * size), length)

    def dequantized(self) -> torch.Tensor:
        """float32 [rows, cols] by gguf-py (references, and float layers)."""
        return torch.from_numpy(gguf.quants.dequantize(self.data.numpy(), self.type).reshape(self.shape).astype(np.float32, copy=False))

    def served(self) -> QuantTensor:
        """Itself where its type has a kernel here; else rounded to Q8_0, one tensor at a time."""
        if self.type in NATIVE:
            return self
        return quantize(self.dequantized(), FALLBACK)


# Read-only file mappings (a GGUF reader's), by the array that keeps each alive: the address ranges whose pages
# `release` may drop.
_MAPPINGS: weakref.WeakValueDictionary[int, np.ndarray] = weakref.WeakValueDictionary()


def file_mapping(array: np.ndarray) -> None:
    """Note `array` (a view of a whole read-only file mapping) as a range `release` may drop pages of."""
    if not array.flags.writeable and array.size:
        _MAPPINGS[array.ctypes.data] = array


def release(data: torch.Tensor) -> None:
    """Drop the pages of `data` that lie in a read-only file mapping from this process's memory (madvise
    DONTNEED; they stay in the page cache, and a later read maps them again). A tensor's blocks are read once,
    to pack them: without this every page of the file stayed resident until the load ended, doubling the
    weights' share of peak RSS. Anything not in such a mapping (a copy, a heap tensor) is left alone."""
    start, end = data.data_ptr(), data.data_ptr() + data.numel() * data.element_size()
    for base, array in list(_MAPPINGS.items()):
        if base <= start and end <= base + array.nbytes:
            first, last = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, end // mmap.PAGESIZE * mmap.PAGESIZE
            if last > first and _LIBC is not None:
                _LIBC.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), 4)  # MADV_DONTNEED
            return


try:
    _LIBC = ctypes.CDLL(None, use_errno=True)
    _LIBC.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
except (OSError, AttributeError):  # not Linux: pages stay until the mapping closes
    _LIBC = None


def quantize(weight: torch.Tensor, fmt: Format) -> QuantTensor:
    """A float weight [rows, cols] rounded to `fmt` by gguf-py (ggml's reference rounding; Q8_0 and Q4_0/Q4_1)."""
    blocks = gguf.quants.quantize(weight.detach().float().numpy(), fmt.type)
    return QuantTensor(fmt.type, torch.from_numpy(blocks), weight.shape[1])


def pack_run(fmt: Format, blocks: list[torch.Tensor], cols: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Parts of one type that sit side by side in a projection (each its file's blocks [rows, row bytes]: q and k,
    gate and up) packed as one tensor of panels, into `out` where given. Where every part but the last ends on a
    panel (16 rows: every family's q, k, gate and up), each packs straight into its own panels; else they are joined
    first. The bytes are the same either way; joining copied each part once more (an 8B Q4_K_M packed in 8.3 s with
    the copies, 7.3 without: benchmarks/NOTES.md, thirty-third round)."""
    if out is None and len(blocks) == 1:
        return fmt.pack(blocks[0], cols)
    rows = sum(b.shape[0] for b in blocks)
    if out is None:
        out = kernels.weight_empty(fmt.panels(rows, cols))
    if any(b.shape[0] % PANEL for b in blocks[:-1]):
        return fmt.pack(torch.cat(blocks), cols, out=out)
    start = 0
    for b in blocks:
        fmt.pack(b, cols, out=out[start // PANEL : -(-(start + b.shape[0]) // PANEL)])
        start += b.shape[0]
    return out


def as_quant(value) -> QuantTensor:
    """A part as the layers take it: a QuantTensor, served; a float tensor rounded to Q8_0."""
    return value.served() if isinstance(value, QuantTensor) else quantize(value, FALLBACK)


class GGUFLinear(Layer):
    """y = x @ W.T + bias, W in its file's own types, on shoal's low-bit kernels.

    A fused projection's parts (q, k, v; gate, up) arrive one by one (`load_part`); `finish_loading` packs
    runs of adjacent parts that share a type into one panel tensor (Q4_K_M's q and k together, its Q6_K v
    apart), and the forward calls one kernel per run, outputs side by side.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, parts: tuple[int, ...] | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.parts = parts or (out_features,)
        self.pending: dict[int, QuantTensor] = {}
        self.runs: list[tuple[Format, int]] = []  # (format, rows) per packed tensor `packed{i}`
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None

    @classmethod
    def of(cls, weight: QuantTensor, bias: torch.Tensor | None = None) -> GGUFLinear:
        """A loaded layer from one tensor (the logits head)."""
        layer = cls(weight.cols, weight.shape[0], False)
        layer.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        layer.load_part(0, weight)
        layer.finish_loading()
        return layer

    def load_part(self, index: int, value) -> None:
        rows = self.parts[index]
        if tuple(value.shape) != (rows, self.in_features):
            raise ValueError(f"part {index} of a [{self.out_features}, {self.in_features}] projection: "
                             f"checkpoint shape {tuple(value.shape)} != {(rows, self.in_features)}")
        self.pending[index] = as_quant(value)

    def missing_parts(self) -> list[int]:
        return [i for i in range(len(self.parts)) if i not in self.pending]

    def finish_loading(self) -> None:
        if self.runs and not self.pending:  # packed already
            return
        missing = self.missing_parts()
        if missing:
            raise KeyError(f"checkpoint lacks part(s) {missing} of a fused projection")
        parts, self.pending, self.runs = [self.pending[i] for i in range(len(self.parts))], {}, []
        while parts:
            n = next((i for i, p in enumerate(parts) if p.type != parts[0].type), len(parts))
            run, parts = parts[:n], parts[n:]
            fmt = NATIVE[run[0].type]
            self.register_buffer(f"packed{len(self.runs)}", pack_run(fmt, [p.data for p in run], self.in_features))
            self.runs.append((fmt, sum(p.data.shape[0] for p in run)))
            for p in run:
                release(p.data)

    @classmethod
    def pack_experts(cls, layers) -> GroupedGGUF | None:
        """A sparse MLP's experts' projections, still unpacked, packed straight into one stacked tensor (each expert's
        panels written into its slice, each layer left holding that slice): no tensor per expert, and no moment when
        a layer's experts are held twice, as `stack_experts` holds them (the MoE shape's peak load RSS 3.09 -> 2.75 GB).
        None, packing nothing, where they are not all bias-free layers of this class with every part pending, of one
        type and one shape."""
        first = layers[0]
        if not all(type(layer) is cls and layer.bias is None and not layer.runs and not layer.missing_parts()
                   and (layer.in_features, layer.out_features) == (first.in_features, first.out_features) for layer in layers):
            return None
        types = {part.type for layer in layers for part in layer.pending.values()}
        if len(types) != 1:
            return None
        fmt = NATIVE[types.pop()]
        packed = kernels.weight_empty((len(layers), *fmt.panels(first.out_features, first.in_features)))
        for e, layer in enumerate(layers):
            parts = [layer.pending[i] for i in range(len(layer.parts))]
            pack_run(fmt, [p.data for p in parts], layer.in_features, out=packed[e])
            layer.pending, layer.runs = {}, [(fmt, layer.out_features)]
            layer.register_buffer("packed0", packed[e])
            for p in parts:
                release(p.data)
        return GroupedGGUF(fmt, first.out_features, packed)

    @classmethod
    def stack_experts(cls, layers) -> GroupedGGUF | None:
        """A sparse MLP's experts' projections as one grouped layer (layers.Experts); None where they cannot be."""
        return GroupedGGUF.stack(layers)

    @property
    def formats(self) -> tuple[str, ...]:
        return tuple(fmt.name for fmt, _ in self.runs)

    def native_runs(self) -> NativeRuns:
        """What the native forward multiplies by (model/native.py): this layer's packed runs and bias."""
        return NativeRuns(tuple((getattr(self, f"packed{i}"), rows, int(fmt.type)) for i, (fmt, rows) in enumerate(self.runs)), self.bias)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight this layer multiplies by (references and tests)."""
        return torch.cat([fmt.rows(getattr(self, f"packed{i}"), torch.arange(rows), self.in_features)
                          for i, (fmt, rows) in enumerate(self.runs)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:  # the model's activations are [tokens, features] already
            return self(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)
        x = x if x.stride(-1) == 1 else x.contiguous()
        if len(self.runs) == 1:
            fmt, rows = self.runs[0]
            y = fmt.linear(x, self.packed0, rows)
        else:
            y = torch.cat([fmt.linear(x, getattr(self, f"packed{i}"), rows) for i, (fmt, rows) in enumerate(self.runs)], dim=1)
        return y if self.bias is None else y + self.bias


class GGUFEmbedding(GGUFLinear):
    """An embedding table in its file's type: a token's row is dequantized when it is looked up. A tied logits
    head multiplies by the same packed tensor (`head`), so the table is held once."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(embedding_dim, num_embeddings, False)
        self.dtype = dtype

    def head(self) -> GGUFLinear:
        """A linear layer over this table's packed tensor (not a copy)."""
        head = GGUFLinear(self.in_features, self.out_features, False)
        head.runs = list(self.runs)
        for i in range(len(self.runs)):
            head.register_buffer(f"packed{i}", getattr(self, f"packed{i}"), persistent=False)
        return head

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1)
        fmt, _ = self.runs[0]
        x = fmt.rows(self.packed0, ids, self.in_features)
        return x.to(self.dtype).view(*input_ids.shape, -1)


class GroupedGGUF(Layer):
    """One projection of every expert of a sparse MLP (layers.Experts), stacked: panels [E, P, S, bytes] of one type.
    forward(x, counts): x holds counts[e] rows for expert e, in expert order; each row is multiplied by its
    expert's weight in one native call for all of them (kquants.cpp gguf_grouped_linear), each bit as the
    expert's own GGUFLinear gives it."""

    def __init__(self, fmt: Format, rows: int, packed: torch.Tensor) -> None:
        super().__init__()
        self.fmt, self.rows, self.packed = fmt, rows, packed

    @classmethod
    def stack(cls, layers) -> GroupedGGUF | None:
        """The experts' projections `layers` stacked, each left holding a view of its part (no second copy); None
        where they are not all bias-free GGUFLinears of one packed tensor of one type and shape."""
        if not all(isinstance(layer, GGUFLinear) and len(layer.runs) == 1 and layer.bias is None for layer in layers):
            return None
        if len({layer.runs[0] for layer in layers}) != 1 or len({layer.packed0.shape for layer in layers}) != 1:
            return None
        packed = torch.stack([layer.packed0 for layer in layers])
        for i, layer in enumerate(layers):
            layer.packed0 = packed[i]  # a buffer: registered again, as the view
        fmt, rows = layers[0].runs[0]
        return cls(fmt, rows, packed)

    def forward(self, x: torch.Tensor, counts: torch.Tensor | list[int]) -> torch.Tensor:
        x = x if x.stride(-1) == 1 else x.contiguous()
        counts = counts if isinstance(counts, torch.Tensor) else torch.tensor(counts, dtype=torch.int64)
        return torch.ops.shoal_kernels.gguf_grouped_linear(x, self.packed, counts, self.rows, int(self.fmt.type))


def served_bytes(tensors) -> int:
    """What some of a file's tensors (ReaderTensors) take in memory as served: packed in their own types, or
    Q8_0 for a type without a kernel here; float tensors as stored."""
    total = 0
    for t in tensors:
        if not is_quantized(t.tensor_type):
            total += int(t.n_bytes)
            continue
        fmt = served_as(t.tensor_type)
        rows, cols = int(np.prod(t.shape[1:])), int(t.shape[0])
        total += int(np.prod(fmt.panels(rows, cols)))
    return total


def type_counts(tensors) -> str:
    """'Q4_K x 97, Q6_K x 17' for some QuantTensors' types."""
    return ", ".join(f"{name} x {n}" for name, n in Counter(t.type.name for t in tensors).most_common())
