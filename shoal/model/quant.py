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

import torch
from torch import nn

from shoal.model.layers import STACKED_PARAMS, Layer

GROUP_SIZE = 32  # ggml's Q4 block: codes and scales map across unchanged


class Int8Linear(Layer):
    """y = x @ (q * scale).T + bias, with q int8 [out, in] and one scale per output channel (symmetric)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        w = weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127.0
        self.register_buffer("weight", torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(weight.dtype))
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight this layer multiplies by (for references and tests)."""
        return self.weight.float() * self.scale.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:  # the model's activations are [tokens, features] already
            return self(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)
        y = torch._weight_int8pack_mm(x, self.weight, self.scale)  # [rows, out]
        return y if self.bias is None else y + self.bias


class Int4Linear(Layer):
    """y = x @ w.T + bias, w[r, c] = codes[r, c] * scale[r, g] + low[r, g] for group g = c // 32.

    torch's kernel takes the codes packed, and per group (scale, zero) with
    w = (code - 8) * scale + zero, so zero = low + 8 * scale.
    """

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        out_features, in_features = codes.shape
        if in_features % GROUP_SIZE or scale.shape != (out_features, in_features // GROUP_SIZE) or low.shape != scale.shape:
            raise ValueError(f"int4 needs groups of {GROUP_SIZE} along the input: codes {tuple(codes.shape)}, scales {tuple(scale.shape)}")
        self.in_features, self.out_features = in_features, out_features
        pad = -out_features % 16  # the kernel packs 16 output rows at a time: padded rows compute zeros, sliced off
        if pad:
            codes, scale, low = (torch.cat((t, t.new_zeros(pad, t.shape[1]))) for t in (codes, scale, low))
        self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1))
        zero = low.float() + 8 * scale.float()
        # [groups, out, 2] in the activation dtype, the kernel's layout
        self.register_buffer("scales_and_zeros", torch.stack((scale.float(), zero), dim=-1).transpose(0, 1).contiguous().to(dtype))
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int4Linear:
        """Round each group of 32 to the nearest of 16 levels between its minimum and maximum (ggml's Q4_1)."""
        w = weight.detach().float()
        groups = w.view(w.shape[0], -1, GROUP_SIZE)
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)
        scale = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
        codes = torch.round((groups - low[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8).view(w.shape)
        return cls(codes, scale, low, bias, weight.dtype)

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


PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
# fused projection -> the checkpoint tensors stacked in it, in shard order
PARTS = {fused: tuple(part for f, part, _ in sorted(STACKED_PARAMS, key=lambda p: p[2]) if f == fused) for fused, _, _ in STACKED_PARAMS}


def quantize_int8(model: nn.Module) -> None:
    """Swap every decoder layer's projections and the logits head for Int8Linear, in place.

    The embedding table stays as it is: a lookup reads only the rows it needs.
    With tied embeddings the head gets its own int8 copy of the table.
    """
    for _, owner, attr, lin in _projections(model):
        setattr(owner, attr, Int8Linear(lin.weight, lin.bias))
    _int8_head(model)


def quantize_int4(model: nn.Module, codes: dict | None = None) -> tuple[int, int]:
    """Swap every decoder layer's projections for Int4Linear, in place; the logits head becomes Int8Linear.

    codes: HF tensor name -> gguf_loader.Q4Codes (a GGUF's own 4-bit tensors);
    a projection whose parts all have codes is built from them, any other is
    rounded from its float weight. Returns (projections from codes, total).
    The head stays at 8 bits: it is the one matrix whose rounding every
    logit sees directly.
    """
    codes = codes or {}
    exact = total = 0
    for i, owner, attr, lin in _projections(model):
        prefix = f"model.layers.{i}.{'self_attn' if attr in ('qkv_proj', 'o_proj') else 'mlp'}"
        names = [f"{prefix}.{part}.weight" for part in PARTS.get(attr, (attr,))]
        total += 1
        if all(n in codes for n in names):
            parts = [codes[n] for n in names]
            new = Int4Linear(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]),
                             torch.cat([p.low for p in parts]), lin.bias, lin.weight.dtype)
            exact += 1
        else:
            new = Int4Linear.from_float(lin.weight, lin.bias)
        setattr(owner, attr, new)
    _int8_head(model)
    return exact, total


def _projections(model: nn.Module):
    for i, layer in enumerate(model.model.layers):
        for path in PROJECTIONS:
            owner_name, attr = path.split(".")
            owner = getattr(layer, owner_name)
            yield i, owner, attr, getattr(owner, attr)


def _int8_head(model: nn.Module) -> None:
    head = model.model.embed_tokens.weight if model.config.tie_word_embeddings else model.lm_head.weight
    model.logits_head = Int8Linear(head)
    if not model.config.tie_word_embeddings:
        del model.lm_head
