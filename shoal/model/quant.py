"""Weight-only int8: the CPU format that halves the bytes a decode step streams.

At one or a few sequences a decode step is bound by reading the weights, so
fewer bytes per weight is fewer milliseconds per token. torch's
`_weight_int8pack_mm` (int8 weights, one scale per output channel, bfloat16 or
float16 activations) ran SmolLM2-135M's 120 layer projections in 5.8 ms against
11.5 ms for bfloat16 at one sequence on this project's CPU, but 29 ms against
20 ms at 32 sequences, where the matmuls are compute-bound and bf16's native dot
products win (benchmarks/NOTES.md). So int8 is an opt-in for latency, not the
default. With float32 activations the same kernel is several times slower than
plain float32, so int8 refuses them.

Activations are not quantized: every row is computed on its own, so results do
not depend on what else is in the batch.
"""

from __future__ import annotations

import torch
from torch import nn

class Int8Linear(nn.Module):
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
        lead = x.shape[:-1]
        y = torch._weight_int8pack_mm(x.reshape(-1, x.shape[-1]), self.weight, self.scale)  # [rows, out]
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, -1)


PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def quantize_int8(model: nn.Module) -> None:
    """Swap every decoder layer's projections and the logits head for Int8Linear, in place.

    The embedding table stays as it is: a lookup reads only the rows it needs.
    With tied embeddings the head gets its own int8 copy of the table.
    """
    for layer in model.model.layers:
        for path in PROJECTIONS:
            owner_name, attr = path.split(".")
            owner = getattr(layer, owner_name)
            lin = getattr(owner, attr)
            setattr(owner, attr, Int8Linear(lin.weight, lin.bias))
    head = model.model.embed_tokens.weight if model.config.tie_word_embeddings else model.lm_head.weight
    model.logits_head = Int8Linear(head)
    if not model.config.tie_word_embeddings:
        del model.lm_head
