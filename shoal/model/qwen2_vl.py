"""Qwen2-VL and Qwen2.5-VL: Qwen2's decoder with multimodal rotary positions (M-RoPE), beside a vision tower.

The decoder is Qwen2's layers; only its rotary tables differ. Every token has three positions (time, height,
width), and each drives its own section of the rotary frequencies (`mrope_section` in the config's rope
parameters: [16, 24, 24] of the 64 frequencies for the 7B). A text token's three positions are equal, so
text alone is computed exactly as Qwen2 computes it.

The vision tower is transformers' own module for the family (a ViT with 2-D rotary attention and a 2x2 patch
merger; Qwen2.5's adds window attention), loaded from the checkpoint's `visual.*` tensors. It runs once per
distinct image (runner/encoder_cache.py), alone, so its output never depends on what else is in the step.

References: transformers' modeling_qwen2_vl.py (`Qwen2VLRotaryEmbedding.recomposition_frequencies`,
`get_rope_index`), modeling_qwen2_5_vl.py.
"""

from __future__ import annotations

import torch

from shoal.model.layers import Rotary
from shoal.model.qwen2 import Qwen2ForCausalLM


class MRotary(Rotary):
    """The tables of M-RoPE: positions [3, T] pick, for each rotary frequency, the row of its section."""

    def __init__(self, config, max_positions: int, rope=None) -> None:
        super().__init__(config, max_positions, rope)
        section = list(config.hf_config.rope_parameters["mrope_section"])
        half = config.head_dim // 2
        if sum(section) != half:
            raise ValueError(f"mrope_section {section} does not add up to half the head dimension ({half})")
        row = torch.cat([torch.full((n,), i % 3, dtype=torch.long) for i, n in enumerate(section)])  # [D/2]
        self.register_buffer("row", torch.cat((row, row)), persistent=False)  # [D]: which position row drives column d

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        """positions: [T] (text only: every row equal) or [3, T]."""
        if positions.dim() == 1:
            return super().forward(positions, dtype)
        D = self.row.shape[0]
        cols = torch.arange(D, device=positions.device)
        pos = positions[self.row].T  # [T, D]: column d's position, from row row[d]
        return self.tables(self.cos[pos, cols], self.sin[pos, cols], dtype)


class Qwen2VLForConditionalGeneration(Qwen2ForCausalLM):
    rotary = MRotary
    vision = "qwen2_vl"  # its tower and image preparation (model/vision.py FAMILIES)


class Qwen2_5_VLForConditionalGeneration(Qwen2ForCausalLM):
    rotary = MRotary
    vision = "qwen2_5_vl"
