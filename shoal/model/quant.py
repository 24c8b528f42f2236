"""Weight-only int8 and int4: CPU formats that cut the bytes a decode step streams.

At one or a few sequences a decode step is bound by reading the weights, so
fewer bytes per weight is fewer milliseconds per token. A GGUF's Q4_0/Q4_1 and
Q8_0 tensors are blocks of 32 codes with float16 scales (and, for Q4_1, a
minimum), and those blocks are what a file's author shipped: from a GGUF file
int4 and int8 serve the file's own codes instead of rounding a second time.
Other weights (safetensors checkpoints, other GGUF types) are rounded into the
same block formats: Q4_1's 16 levels between each group's minimum and maximum,
Q8_0's 127 steps of each group's largest magnitude.

Where shoal's native kernels are built (`shoal.kernels`, `lowbit.cpp`) the
layers multiply with them, as llama.cpp does: each activation row is rounded to
int8 per block of 32, the products with the codes are summed exactly in
integers (AVX-512 VNNI, AVX2 or scalar code, the same integers), and each block
is scaled into a float32 sum in input order. That is row-invariant by
construction, the same bits on every instruction set, 2-4x faster than torch's
int4 kernel at every batch size measured, and faster than float32 at 1 and 32
rows (about even at 512; benchmarks/NOTES.md, eleventh round), so it serves
float32 activations too.

Without them (SHOAL_NO_KERNELS=1, no compiler, not x86-64) the layers take
torch's weight-only kernels: `_weight_int4pack_mm_for_cpu` (groups of 32 with a
bf16 scale and offset) and `_weight_int8pack_mm` (one scale per output row),
with unrounded activations; those are slow with float32 activations, so the
builder asks for bfloat16 or float16 there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType as GGUF_TYPE
from torch import nn

from shoal import kernels
from shoal.model.formats import GGUFEmbedding, GGUFLinear, NativeRuns
from shoal.model.layers import Layer, Linear

GROUP_SIZE = 32  # ggml's Q4 and Q8 block: codes and scales map across unchanged
PANEL = 16  # outputs the native kernels keep side by side (lowbit.cpp)


def native_packing(in_features: int) -> bool:
    """Whether a layer with `in_features` inputs is packed for shoal's native kernels."""
    return in_features % GROUP_SIZE == 0 and kernels.available()


def _panels(t: torch.Tensor) -> torch.Tensor:
    """[N, ...] padded with zero rows to a multiple of PANEL: padded outputs compute zeros and are never stored."""
    pad = -t.shape[0] % PANEL
    return torch.cat((t, t.new_zeros(pad, *t.shape[1:]))) if pad else t


def _half_bytes(v: torch.Tensor) -> torch.Tensor:
    """Per-group numbers [N, B] -> [P, B, 32]: each panel's 16 float16s per group, as bytes."""
    p = _panels(v.float()).to(torch.float16)
    return p.view(-1, PANEL, p.shape[1]).transpose(1, 2).contiguous().view(torch.uint8)


def _unhalf(b: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of _half_bytes: [P, B, 32] bytes -> [n, B] float32."""
    return b.contiguous().view(torch.float16).transpose(1, 2).reshape(-1, b.shape[1])[:n].float()


def pack_q4(q: Q4Codes) -> torch.Tensor:
    """Q4 codes and group scales -> lowbit.cpp's q4 panels [P, B, 320] uint8 (scale and low as float16)."""
    n, k = q.codes.shape
    c = _panels(q.codes.to(torch.uint8)).view(-1, PANEL, k // GROUP_SIZE, 8, 4).permute(0, 2, 3, 1, 4)  # [P, B, quad, out, 4]
    lines = (c[:, :, 0::2] | (c[:, :, 1::2] << 4)).reshape(c.shape[0], c.shape[1], 256)
    parts = (lines, _half_bytes(q.scale), _half_bytes(q.low))
    return torch.cat(parts, dim=2, out=kernels.weight_empty((*lines.shape[:2], sum(p.shape[2] for p in parts))))


def unpack_q4(packed: torch.Tensor, n: int) -> Q4Codes:
    """The codes and float16 scales a q4 panel tensor holds (references and tests)."""
    p, b = packed.shape[:2]
    lines = packed[..., :256].reshape(p, b, 4, 1, PANEL, 4)
    c = torch.cat((lines & 0x0F, lines >> 4), dim=3).reshape(p, b, 8, PANEL, 4)  # [P, B, quad, out, 4]
    codes = c.permute(0, 3, 1, 2, 4).reshape(p * PANEL, b * GROUP_SIZE)[:n]
    return Q4Codes(codes, _unhalf(packed[..., 256:288], n), _unhalf(packed[..., 288:320], n))


def pack_q8(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 codes [N, K] and group scales [N, K / 32] -> lowbit.cpp's q8 panels [P, B, 544] uint8 (codes + 128)."""
    n, k = codes.shape
    c = (_panels(codes.to(torch.int8)).view(torch.uint8) ^ 0x80).view(-1, PANEL, k // GROUP_SIZE, 8, 4)
    lines = c.permute(0, 2, 3, 1, 4).reshape(c.shape[0], c.shape[2], 512)
    scales = _half_bytes(scale)
    return torch.cat((lines, scales), dim=2, out=kernels.weight_empty((*lines.shape[:2], lines.shape[2] + scales.shape[2])))


def unpack_q8(packed: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes int8 [n, K], scales float32 [n, K / 32]) of a q8 panel tensor."""
    p, b = packed.shape[:2]
    c = (packed[..., :512] ^ 0x80).reshape(p, b, 8, PANEL, 4).permute(0, 3, 1, 2, 4).reshape(p * PANEL, b * GROUP_SIZE)
    return c[:n].contiguous().view(torch.int8), _unhalf(packed[..., 512:544], n)


def round_q8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scale) of ggml's Q8_0 rounding: each group of 32 to 127 steps of its largest magnitude, the
    scale a float16. A Q8_0 tensor's dequantized values round back to its own codes exactly."""
    w = weight.detach().float()
    groups = w.view(w.shape[0], -1, GROUP_SIZE)
    amax = groups.abs().amax(dim=-1)
    scale = (amax / torch.full_like(amax, 127.0)).clamp(min=2.0**-24, max=65504.0).half().float()  # IEEE division
    codes = torch.round(groups / scale[..., None]).clamp_(-127, 127).to(torch.int8).view(w.shape)
    return codes, scale


@dataclass
class Q4Codes:
    """A 4-bit GGUF tensor as stored: weight[r, c] = codes[r, c] * scale[r, c // 32] + low[r, c // 32].

    Q4_1 blocks hold 32 weights as 4-bit codes with a float16 scale `d` and
    minimum `m`; Q4_0 blocks hold a scale only, around code 8 (low = -8 d).
    """

    codes: torch.Tensor  # [out, in] uint8, 0..15
    scale: torch.Tensor  # [out, in // 32] float32
    low: torch.Tensor  # [out, in // 32] float32

    def dequantized(self) -> torch.Tensor:
        g = self.scale.shape[1]
        w = self.codes.view(self.codes.shape[0], g, -1).float() * self.scale[..., None] + self.low[..., None]
        return w.view(self.codes.shape)

    def numel(self) -> int:
        return self.codes.numel()

    def permute_rows(self, fn) -> Q4Codes:
        return Q4Codes(fn(self.codes), fn(self.scale), fn(self.low))

    def narrow(self, dim: int, start: int, length: int) -> Q4Codes | torch.Tensor:
        """Rows or columns [start, start + length), as torch.Tensor.narrow: codes as they are where
        the columns fall on group boundaries, else the dequantized float slice."""
        if dim == 0:
            return Q4Codes(*(t.narrow(0, start, length) for t in (self.codes, self.scale, self.low)))
        if start % GROUP_SIZE or length % GROUP_SIZE:
            return self.dequantized().narrow(1, start, length)
        g0, gn = start // GROUP_SIZE, length // GROUP_SIZE
        return Q4Codes(self.codes.narrow(1, start, length), self.scale.narrow(1, g0, gn), self.low.narrow(1, g0, gn))


class PartLoader:
    """What a weight-only layer does while a checkpoint loads, so the weight format is chosen
    when the layer is built (`WeightFormat.linear`), not swapped in after a float load.

    A fused projection's parts (q, k, v; gate, up) arrive one by one through
    `load_part`, as float tensors or a GGUF's own 4-bit codes; `finish_loading`
    packs them once all are in. The bias is an ordinary parameter and loads as one.
    """

    def _start_loading(self, in_features: int, out_features: int, bias: bool, parts: tuple[int, ...], dtype: torch.dtype) -> None:
        Layer.__init__(self)
        self.in_features, self.out_features = in_features, out_features
        self.parts, self.dtype = parts, dtype
        self.pending: dict[int, object] = {}
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None

    @classmethod
    def empty(cls, in_features: int, out_features: int, bias: bool, parts: tuple[int, ...], dtype: torch.dtype):
        layer = cls.__new__(cls)
        layer._start_loading(in_features, out_features, bias, parts, dtype)
        return layer

    def load_part(self, index: int, value) -> None:
        rows = self.parts[index]
        shape = tuple(value.codes.shape if isinstance(value, Q4Codes) else value.shape)
        if shape != (rows, self.in_features):
            raise ValueError(f"part {index} of a [{self.out_features}, {self.in_features}] projection: checkpoint shape {shape} != {(rows, self.in_features)}")
        self.pending[index] = value

    def missing_parts(self) -> list[int]:
        return [i for i in range(len(self.parts)) if i not in self.pending]

    def _take_parts(self) -> list:
        missing = self.missing_parts()
        if missing:
            raise KeyError(f"checkpoint lacks part(s) {missing} of a fused projection")
        parts, self.pending = [self.pending[i] for i in range(len(self.parts))], {}
        return parts

    @staticmethod
    def _float(part) -> torch.Tensor:
        return part.dequantized() if isinstance(part, Q4Codes) else part.float()


class Int8Linear(PartLoader, Layer):
    """y = x @ w.T + bias with int8 weights.

    Native: ggml's Q8_0, a float16 scale per group of 32 inputs (`round_q8`),
    multiplied by lowbit.cpp's q8 kernel. torch's path: one scale per output
    row (symmetric), multiplied by `_weight_int8pack_mm`.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self._start_loading(weight.shape[1], weight.shape[0], False, (weight.shape[0],), weight.dtype)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self._pack(weight)

    def finish_loading(self) -> None:
        self._pack(torch.cat([self._float(p) for p in self._take_parts()]))

    def _pack(self, weight: torch.Tensor) -> None:
        self.native = native_packing(self.in_features)
        if self.native:
            self.register_buffer("packed", pack_q8(*round_q8(weight)))
            return
        w = weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127.0
        self.register_buffer("weight", torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(self.dtype))

    def native_runs(self) -> NativeRuns | None:
        """The native forward's view (model/native.py): the packed Q8_0 panels, which gguf_linear multiplies as q8_linear
        does; None on torch's path."""
        return NativeRuns(((self.packed, self.out_features, int(GGUF_TYPE.Q8_0)),), self.bias) if self.native else None

    def dequantized(self) -> torch.Tensor:
        """The float32 weight this layer multiplies by (for references and tests)."""
        if self.native:
            codes, scale = unpack_q8(self.packed, self.out_features)
            return (codes.float().view(self.out_features, -1, GROUP_SIZE) * scale[..., None]).view(codes.shape)
        return self.weight.float() * self.scale.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:  # the model's activations are [tokens, features] already
            return self(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)
        if self.native:
            y = torch.ops.shoal_kernels.q8_linear(x, self.packed, self.out_features)
        else:
            y = torch._weight_int8pack_mm(x, self.weight, self.scale)  # [rows, out]
        return y if self.bias is None else y + self.bias


class Int8Embedding(Layer):
    """An embedding read from an int8 copy of its (tied) table (on rank 0, the logits head): a token's row is its
    codes times their group scales. Used only where that gives the float table's values exactly
    (WeightFormat.finish_head checks), so outputs do not change; what changes is memory: the float table is
    gone (113 MB of float32 for SmolLM2-135M, more than its int4 layers and head together)."""

    def __init__(self, head: Int8Linear, dtype: torch.dtype) -> None:
        super().__init__()
        # the head's own tensor: where the model holds the head too, model.buffers() counts its bytes once
        self.register_buffer("packed", head.packed, persistent=False)
        self.dtype = dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1)
        codes, scale = unpack_q8(self.packed[ids // PANEL], len(ids) * PANEL)  # each token's panel of 16 rows
        rows = torch.arange(len(ids), device=ids.device) * PANEL + ids % PANEL
        codes, scale = codes[rows], scale[rows]
        x = (codes.float().view(len(ids), -1, GROUP_SIZE) * scale[..., None]).view(len(ids), -1)
        return x.to(self.dtype).view(*input_ids.shape, -1)


class Int4Linear(PartLoader, Layer):
    """y = x @ w.T + bias, w[r, c] = codes[r, c] * scale[r, g] + low[r, g] for group g = c // 32.

    Native: lowbit.cpp's q4 panels, scale and low as float16 (a GGUF's d and m
    exactly). torch's path: its kernel takes the codes packed, and per group
    (scale, zero) in the activation dtype with w = (code - 8) * scale + zero, so
    zero = low + 8 * scale. Parts that arrive as a GGUF's Q4 codes are packed as
    they are (`from_codes` counts them); float parts are rounded like ggml's Q4_1.
    """

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        self._start_loading(codes.shape[1], codes.shape[0], False, (codes.shape[0],), dtype)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)
        self._pack(Q4Codes(codes, scale, low))
        self.from_codes = True

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int4Linear:
        """Round each group of 32 to the nearest of 16 levels between its minimum and maximum (ggml's Q4_1)."""
        layer = cls(*round_q4(weight), bias, weight.dtype)
        layer.from_codes = False
        return layer

    def finish_loading(self) -> None:
        parts = self._take_parts()
        self.from_codes = all(isinstance(p, Q4Codes) for p in parts)
        q = [p if isinstance(p, Q4Codes) else Q4Codes(*round_q4(p)) for p in parts]
        self._pack(Q4Codes(*(torch.cat([getattr(p, f) for p in q]) for f in ("codes", "scale", "low"))))

    def _pack(self, q: Q4Codes) -> None:
        codes, scale, low = q.codes, q.scale, q.low
        out_features, in_features = codes.shape
        if in_features % GROUP_SIZE or scale.shape != (out_features, in_features // GROUP_SIZE) or low.shape != scale.shape:
            raise ValueError(f"int4 needs groups of {GROUP_SIZE} along the input: codes {tuple(codes.shape)}, scales {tuple(scale.shape)}")
        self.native = native_packing(in_features)
        if self.native:
            self.register_buffer("packed", pack_q4(q))
            return
        pad = -out_features % 16  # the kernel packs 16 output rows at a time: padded rows compute zeros, sliced off
        if pad:
            codes, scale, low = (torch.cat((t, t.new_zeros(pad, t.shape[1]))) for t in (codes, scale, low))
        self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1))
        zero = low.float() + 8 * scale.float()
        # [groups, out, 2] in the activation dtype, the kernel's layout
        self.register_buffer("scales_and_zeros", torch.stack((scale.float(), zero), dim=-1).transpose(0, 1).contiguous().to(self.dtype))

    def native_runs(self) -> NativeRuns | None:
        """The native forward's view (model/native.py): the packed Q4 panels, which gguf_linear multiplies as q4_linear
        does (as a Q4_1's); None on torch's path."""
        return NativeRuns(((self.packed, self.out_features, int(GGUF_TYPE.Q4_1)),), self.bias) if self.native else None

    def dequantized(self) -> torch.Tensor:
        """The float32 weight this layer multiplies by (for references and tests)."""
        if self.native:
            return unpack_q4(self.packed, self.out_features).dequantized()
        eye = torch.eye(self.in_features, dtype=self.scales_and_zeros.dtype)  # torch's path: the identity's product
        y = torch._weight_int4pack_mm_for_cpu(eye, self.packed, GROUP_SIZE, self.scales_and_zeros)
        return y[:, : self.out_features].float().T.contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return self(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)
        if self.native:
            y = torch.ops.shoal_kernels.q4_linear(x, self.packed, self.out_features)
        else:
            y = torch._weight_int4pack_mm_for_cpu(x, self.packed, GROUP_SIZE, self.scales_and_zeros)
            if y.shape[1] != self.out_features:
                y = y[:, : self.out_features]
        return y if self.bias is None else y + self.bias


def round_q4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, scale, low) of ggml's Q4_1 rounding: each group of 32 to the nearest of 16 levels between its min and max."""
    w = weight.detach().float()
    groups = w.view(w.shape[0], -1, GROUP_SIZE)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    # float16 scale and minimum, as a GGUF stores them (and the native kernel reads them)
    scale = ((high - low) / 15).clamp(min=2.0**-24, max=65504.0).half().float()
    low = low.clamp(min=-65504.0, max=65504.0).half().float()
    codes = torch.round((groups - low[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8).view(w.shape)
    return codes, scale, low


FORMATS = ("none", "int8", "int4", "gguf")


@dataclass(frozen=True)
class WeightFormat:
    """How the decoder's projections hold their weights, chosen before the model is built.

    "none": `layers.Linear` in the model's dtype; "int8"/"int4": weight-only
    layers that take their parts while loading, rounding float weights (or a GGUF's
    Q4 codes as they are). The logits head follows with `finish_head` (int8 for
    either). "gguf": every tensor in its file's own type (`formats.GGUFLinear`),
    the embedding and the head too (`prepare`).
    """

    name: str = "none"
    dtype: torch.dtype = torch.float32  # the activations'

    def __post_init__(self) -> None:
        if self.name not in FORMATS:
            raise ValueError(f"unknown weight format {self.name!r}: choose one of {', '.join(FORMATS)}")

    def linear(self, in_features: int, out_features: int, bias: bool, parts: tuple[int, ...] | None = None) -> Layer:
        if self.name == "none":
            return Linear(in_features, out_features, bias=bias)
        if self.name == "gguf":
            return GGUFLinear(in_features, out_features, bias, parts, self.dtype)
        cls = Int8Linear if self.name == "int8" else Int4Linear
        return cls.empty(in_features, out_features, bias, parts or (out_features,), self.dtype)

    def prepare(self, model: nn.Module) -> None:
        """Before loading (the model on the meta device, split where it is): with "gguf", the embedding and
        an untied head take their file's types too, so no float table is ever allocated."""
        if self.name != "gguf":
            return
        embed = model.model.embed_tokens
        if embed is not None:
            model.model.embed_tokens = GGUFEmbedding(embed.num_embeddings, embed.embedding_dim, self.dtype)
        if hasattr(model, "lm_head"):
            model.lm_head = GGUFLinear(model.lm_head.in_features, model.lm_head.out_features, False)

    def finish_head(self, model: nn.Module, logits: bool = True) -> None:
        """After loading: the logits head, on the rank that computes logits (`logits`; rank 0). The others
        hold no head: an untied lm_head they loaded is dropped.

        With low-bit projections the head is an int8 copy of its (tied) weight. It
        stays at 8 bits even with int4: it is the one matrix whose rounding every
        logit sees directly. A tied embedding table that such a copy gives back
        exactly (a GGUF's Q8_0 table, in float32 or bf16) is then read from the
        copy (Int8Embedding), on every rank that embeds, and the float table is dropped.
        """
        tied = model.config.tie_word_embeddings
        if self.name == "gguf":  # the head in its file's type: the untied one as loaded, a tied one over the table
            head = model.lm_head if hasattr(model, "lm_head") else None
            if head is not None:
                del model.lm_head
            if logits:
                model.logits_head = model.model.embed_tokens.head() if tied else head
            return
        if not tied and hasattr(model, "lm_head") and (self.name != "none" or not logits):
            head = model.lm_head.weight
            del model.lm_head
            if logits:
                model.logits_head = Int8Linear(head)
        if self.name == "none" or not tied or model.model.embed_tokens is None:
            return
        table = model.model.embed_tokens.weight
        copy = Int8Linear(table)
        if logits:
            model.logits_head = copy
        if copy.native and torch.equal(copy.dequantized().to(table.dtype), table):
            model.model.embed_tokens = Int8Embedding(copy, table.dtype)
