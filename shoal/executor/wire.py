"""Hidden states between pipeline stages: as they are, cast to a narrower float, or int8 with a scale per token row."""

from __future__ import annotations

import torch

WIRE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.int8}


def encode_wire(hidden: torch.Tensor, wire: str | None) -> list[torch.Tensor]:
    """Hidden states as sent between pipeline stages: cast, or int8 with one float32 scale per token row."""
    if wire is None:
        return [hidden]
    if wire != "int8":
        return [hidden.to(WIRE[wire])]
    h = hidden.float()
    scale = h.abs().amax(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny) / 127.0
    return [torch.round(h / scale).clamp_(-127, 127).to(torch.int8), scale]


def decode_wire(parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    if parts[0].dtype == torch.int8:
        return (parts[0].float() * parts[1]).to(dtype)
    return parts[0].to(dtype)


def wire_bytes_per_token(width: int, wire: str) -> int:
    return width * WIRE[wire].itemsize + (4 if wire == "int8" else 0)
