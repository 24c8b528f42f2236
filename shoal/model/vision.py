"""What a vision-language model adds to its decoder: the image's preparation, and the tower that encodes it.

- `VisionSpec`: what a prompt needs to hold images (the placeholder token, the tower's merge). Plain data that
  the server reads.
- `ImagePreparer`: a decoded image -> the processor's tensors, the placeholder count and the content digest.
  It runs on the server's side, in a worker thread. The processor is transformers' own for the model (its
  Pillow backend), so the pixels equal what transformers feeds the model, by construction.
- `VisionTower`: the processor's tensors -> the placeholder tokens' embeddings. transformers' module for the
  family, with the checkpoint's weights; the runner calls it through its encoder cache, one image at a time.

The digest is SHA-256 over the decoded pixels (with the image's size) and the processor settings that shaped
them, `detail` included. The same picture sent as PNG, lossless WebP, base64, a file or a URL has one digest;
a different picture, or the same one at another detail, has another.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger("shoal.loader")

# OpenAI's `detail: "low"` asks for a cheap look. For Qwen2-VL that is at most 448 x 448 pixels: 256 tokens
# after the 2x2 merge (OpenAI's own low detail is one 512-pixel tile).
LOW_DETAIL_PIXELS = 448 * 448
DETAILS = ("auto", "low", "high")


@dataclass(frozen=True)
class VisionSpec:
    image_token_id: int  # the placeholder each image's tokens are, before its embeddings replace them
    image_token: str  # its text, as the chat template writes it (once per image)
    merge_size: int  # the tower merges merge x merge patches into one token
    family: str  # the architecture, for messages


@dataclass(frozen=True)
class PreparedImage:
    pixels: dict  # the processor's tensors for one image: pixel_values [patches, C*T*P*P], image_grid_thw [1, 3]
    grid: tuple[int, int, int]  # (t, h, w) of its tokens, after the merge
    digest: bytes

    @property
    def length(self) -> int:
        t, h, w = self.grid
        return t * h * w


class ImagePreparer:
    """A decoded RGB image -> PreparedImage, with the model's own processor."""

    def __init__(self, processor, spec: VisionSpec) -> None:
        self.processor = processor
        self.spec = spec
        size = dict(processor.size)
        self.max_pixels = size["longest_edge"]
        self.min_pixels = size["shortest_edge"]
        self.settings = {k: v for k, v in processor.to_dict().items() if k != "image_processor_type"}

    def prepare(self, image, pixel_digest: bytes, detail: str | None = None) -> PreparedImage:
        """image: a decoded RGB PIL image; pixel_digest: its pixels' (server/media.pixel_digest); detail: OpenAI's
        auto | low | high."""
        size = self._size(detail)
        out = self.processor(images=[image], return_tensors="pt", size=size)
        t, h, w = (int(x) for x in out["image_grid_thw"][0])
        m = self.spec.merge_size
        settings = json.dumps({**self.settings, "size": size}, sort_keys=True, default=str).encode()
        digest = hashlib.sha256(b"shoal.image.v1\0" + pixel_digest + settings).digest()
        return PreparedImage({"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}, (t, h // m, w // m), digest)

    def _size(self, detail: str | None) -> dict:
        most = self.max_pixels if detail in (None, "auto", "high") else min(self.max_pixels, max(self.min_pixels, LOW_DETAIL_PIXELS))
        return {"shortest_edge": self.min_pixels, "longest_edge": most}


class VisionTower:
    """The processor's tensors of one image -> its tokens' embeddings [length, hidden]."""

    def __init__(self, module: torch.nn.Module, dtype: torch.dtype) -> None:
        self.module = module
        self.dtype = dtype
        self.weight_bytes = sum(p.numel() * p.element_size() for p in module.parameters())

    @torch.inference_mode()
    def __call__(self, pixels: dict) -> torch.Tensor:
        device = next(self.module.parameters()).device
        out = self.module(pixels["pixel_values"].to(device, self.dtype), grid_thw=pixels["image_grid_thw"].to(device))
        return out.pooler_output


def build_tower(model_cls, hf_config, state_dict: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype) -> VisionTower:
    """The family's tower (`model_cls.vision_tower`, a transformers class) with the checkpoint's `visual.*` tensors."""
    name = model_cls.vision_tower
    module_name = {"Qwen2VisionTransformerPretrainedModel": "qwen2_vl", "Qwen2_5_VisionTransformerPretrainedModel": "qwen2_5_vl"}[name]
    cls = getattr(importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}"), name)
    start = time.perf_counter()
    module = cls._from_config(hf_config.vision_config, dtype=torch.float32)
    missing, unexpected = module.load_state_dict(state_dict, strict=False)
    if missing or unexpected:
        raise KeyError(f"the vision tower's tensors do not match the checkpoint: missing {missing[:3]}, unexpected {unexpected[:3]}")
    module = module.to(device=device, dtype=dtype).eval()
    tower = VisionTower(module, dtype)
    log.info("vision tower %s: %.1fM parameters, %s, loaded in %.2f s", name, sum(p.numel() for p in module.parameters()) / 1e6,
             str(dtype).removeprefix("torch."), time.perf_counter() - start)
    return tower


def load_preparer(folder: Path, hf_config, tokenizer) -> ImagePreparer:
    """The model folder's image processor (preprocessor_config.json) and its placeholder token."""
    import transformers

    processor = transformers.AutoImageProcessor.from_pretrained(folder)
    token_id = int(hf_config.image_token_id)
    spec = VisionSpec(token_id, tokenizer.convert_ids_to_tokens(token_id), int(processor.merge_size), (hf_config.architectures or ["?"])[0])
    return ImagePreparer(processor, spec)
