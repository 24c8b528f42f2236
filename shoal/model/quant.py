"""Weight-only int8 and int4: CPU formats that cut the bytes a decode step streams.

At one or a few sequences a decode step is bound by reading the weights, so
fewer bytes per weight is fewer milliseconds per token. torch's
`_weight_int8pack_mm` (int8 weights, one scale per output channel, bfloat16 or
float16 activations) ran SmolLM2-135M's 120 layer projections in 5.8 ms against
11.5 ms for bfloat16 at one sequence on this project's CPU, but 29 ms against
20 ms at 32 sequences, where the matmuls are compute-bound and bf16's native dot
products win (benchmarks/NOTES.md). So int8 is an opt-in for latency, not the
default. With float32 activations the same kernel is several times slower than
plain float32, so int8 refuses them.

int4 (`_weight_int4pack_mm_for_cpu`: 4-bit codes in groups of 32 along the
input, each group with its own scale and offset) halves the bytes again: 2.9 ms
for the same projections at one sequence, 4.2 at four, 24.5 at 32. A GGUF's
Q4_0/Q4_1 tensors already are this format (ggml blocks of 32 codes with a
scale and a minimum), so from a GGUF file int4 serves the file's own weights
instead of a second rounding: the codes are copied as they are, and only the
group scales and offsets are rounded to the activation dtype. Other weights
(safetensors checkpoints, other GGUF types) are rounded to the nearest of 16
levels between each group's minimum and maximum, as ggml's Q4_1 does.

Activations are not quantized: every row is computed on its own, so results do
not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from shoal.model.layers import Layer, Linear

GROUP_SIZE = 32  # ggml's Q4 block: codes and scales map across unchanged


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
    """y = x @ (q * scale).T + bias, with q int8 [out, in] and one scale per output channel (symmetric)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self._start_loading(weight.shape[1], weight.shape[0], False, (weight.shape[0],), weight.dtype)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self._pack(weight)

    def finish_loading(self) -> None:
        self._pack(torch.cat([self._float(p) for p in self._take_parts()]))

    def _pack(self, weight: torch.Tensor) -> None:
        w = weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127.0
        self.register_buffer("weight", torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(self.dtype))

    def dequantized(self) -> torch.Tensor:
        """The float32 weight this layer multiplies by (for references and tests)."""
        return self.weight.float() * self.scale.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:  # the model's activations are [tokens, features] already
            return self(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)
        y = torch._weight_int8pack_mm(x, self.weight, self.scale)  # [rows, out]
        return y if self.bias is None else y + self.bias


class Int4Linear(PartLoader, Layer):
    """y = x @ w.T + bias, w[r, c] = codes[r, c] * scale[r, g] + low[r, g] for group g = c // 32.

    torch's kernel takes the codes packed, and per group (scale, zero) with
    w = (code - 8) * scale + zero, so zero = low + 8 * scale. Parts that arrive
    as a GGUF's Q4 codes are packed as they are (`from_codes` counts them);
    float parts are rounded like ggml's Q4_1.
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
        pad = -out_features % 16  # the kernel packs 16 output rows at a time: padded rows compute zeros, sliced off
        if pad:
            codes, scale, low = (torch.cat((t, t.new_zeros(pad, t.shape[1]))) for t in (codes, scale, low))
        self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1))
        zero = low.float() + 8 * scale.float()
        # [groups, out, 2] in the activation dtype, the kernel's layout
        self.register_buffer("scales_and_zeros", torch.stack((scale.float(), zero), dim=-1).transpose(0, 1).contiguous().to(self.dtype))

    def dequantized(self) -> torch.Tensor:
        """The float32 weight this layer multiplies by (for references and tests): the identity's product."""
        eye = torch.eye(self.in_features, dtype=self.scales_and_zeros.dtype)
        y = torch._weight_int4pack_mm_for_cpu(eye, self.packed, GROUP_SIZE, self.scales_and_zeros)
        return y[:, : self.out_features].float().T.contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return self(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)
        y = torch._weight_int4pack_mm_for_cpu(x, self.packed, GROUP_SIZE, self.scales_and_zeros)
        if y.shape[1] != self.out_features:
            y = y[:, : self.out_features]
        return y if self.bias is None else y + self.bias


def round_q4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, scale, low) of ggml's Q4_1 rounding: each group of 32 to the nearest of 16 levels between its min and max."""
    w = weight.detach().float()
    groups = w.view(w.shape[0], -1, GROUP_SIZE)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
    codes = torch.round((groups - low[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8).view(w.shape)
    return codes, scale, low


FORMATS = ("none", "int8", "int4")


@dataclass(frozen=True)
class WeightFormat:
    """How the decoder's projections hold their weights, chosen before the model is built.

    "none": `layers.Linear` in the model's dtype; "int8"/"int4": weight-only
    layers that take their parts while loading. The logits head follows with
    `finish_head` (int8 for either low-bit format).
    """

    name: str = "none"
    dtype: torch.dtype = torch.float32  # the activations'

    def __post_init__(self) -> None:
        if self.name not in FORMATS:
            raise ValueError(f"unknown weight format {self.name!r}: choose one of {', '.join(FORMATS)}")

    def linear(self, in_features: int, out_features: int, bias: bool, parts: tuple[int, ...] | None = None) -> Layer:
        if self.name == "none":
            return Linear(in_features, out_features, bias=bias)
        cls = Int8Linear if self.name == "int8" else Int4Linear
        return cls.empty(in_features, out_features, bias, parts or (out_features,), self.dtype)

    def finish_head(self, model: nn.Module) -> None:
        """With low-bit projections, the logits head gets its own int8 copy of its (tied) weight.

        The head stays at 8 bits even with int4: it is the one matrix whose
        rounding every logit sees directly. The embedding table stays as it
        is: a lookup reads only the rows it needs.
        """
        if self.name == "none":
            return
        head = model.model.embed_tokens.weight if model.config.tie_word_embeddings else model.lm_head.weight
        model.logits_head = Int8Linear(head)
        if not model.config.tie_word_embeddings:
            del model.lm_head
