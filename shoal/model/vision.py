"""What a vision-language model adds to its decoder: the image's preparation, and the tower that encodes it.

- `VisionSpec`: what a prompt needs to hold images (the placeholder token). Plain data that the server reads.
- `ImagePreparer`: a decoded image -> the tokens that replace its placeholder, and the runs of them the tower
  fills (ImageSpans: where, how many, the processor's tensors, a content digest). It runs on the server's side, in
  a worker thread. The processor is transformers' own for the model (its Pillow backend), so the pixels equal
  what transformers feeds the model, by construction. One subclass per family: Qwen2-VL's image is one run;
  Idefics3's (SmolVLM's) is a tile per run, between row and column marker tokens, as its processor writes it.
- `VisionTower`: a run's tensors -> its tokens' embeddings. transformers' modules for the family, with the
  checkpoint's weights; the runner calls it through its encoder cache, one run at a time.

The digest is SHA-256 over the decoded pixels (with the image's size) and the processor settings that shaped
them, `detail` included (and the tile's index). The same picture sent as PNG, lossless WebP, base64, a file or
a URL has one digest; a different picture, or the same one at another detail, has another.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from shoal.multimodal import ImageSpan

log = logging.getLogger("shoal.loader")

# OpenAI's `detail: "low"` asks for a cheap look. For Qwen2-VL that is at most 448 x 448 pixels: 256 tokens
# after the 2x2 merge (OpenAI's own low detail is one 512-pixel tile).
LOW_DETAIL_PIXELS = 448 * 448
DETAILS = ("auto", "low", "high")


@dataclass(frozen=True)
class VisionSpec:
    image_token_id: int  # the placeholder: once per image in the rendered prompt, then under every image token
    image_token: str  # its text, as the chat template writes it
    family: str  # the architecture, for messages


@dataclass(frozen=True)
class PreparedImage:
    tokens: tuple[int, ...]  # what replaces the image's one placeholder in the rendered prompt
    # The runs of those tokens the tower fills, each with its own digest and tensors: a whole Qwen2-VL image, or
    # one of an Idefics3 image's tiles. Offsets count from the image's first token (expand_placeholders moves them).
    tiles: tuple[ImageSpan, ...]

    @property
    def length(self) -> int:
        return len(self.tokens)


class ImagePreparer:
    """A decoded RGB image -> PreparedImage, with the model's own processor (a family's subclass says how)."""

    def __init__(self, processor, spec: VisionSpec) -> None:
        self.processor = processor
        self.spec = spec
        self.settings = {k: v for k, v in processor.to_dict().items() if k != "image_processor_type"}

    def prepare(self, image, pixel_digest: bytes, detail: str | None = None) -> PreparedImage:
        """image: a decoded RGB PIL image; pixel_digest: its pixels' (server/media.pixel_digest); detail: OpenAI's
        auto | low | high."""
        raise NotImplementedError

    def digest(self, pixel_digest: bytes, **call) -> bytes:
        """SHA-256 over the pixels and every processor setting that shaped them (this call's too)."""
        settings = json.dumps({**self.settings, **call}, sort_keys=True, default=str).encode()
        return hashlib.sha256(b"shoal.image.v1\0" + pixel_digest + settings).digest()


class Qwen2VLPreparer(ImagePreparer):
    """Qwen2-VL: the image resized to multiples of 28 within the pixel budget, one run of (h/28) x (w/28) tokens.
    detail "low" lowers the budget to LOW_DETAIL_PIXELS."""

    def __init__(self, processor, spec: VisionSpec) -> None:
        super().__init__(processor, spec)
        size = dict(processor.size)
        self.max_pixels = size["longest_edge"]
        self.min_pixels = size["shortest_edge"]
        self.merge = int(processor.merge_size)

    def prepare(self, image, pixel_digest: bytes, detail: str | None = None) -> PreparedImage:
        size = self._size(detail)
        out = self.processor(images=[image], return_tensors="pt", size=size)
        t, h, w = (int(x) for x in out["image_grid_thw"][0])
        grid = (t, h // self.merge, w // self.merge)
        pixels = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
        n = grid[0] * grid[1] * grid[2]
        tile = ImageSpan(0, n, self.digest(pixel_digest, size=size), grid, pixels)
        return PreparedImage((self.spec.image_token_id,) * n, (tile,))

    def _size(self, detail: str | None) -> dict:
        most = self.max_pixels if detail in (None, "auto", "high") else min(self.max_pixels, max(self.min_pixels, LOW_DETAIL_PIXELS))
        return {"shortest_edge": self.min_pixels, "longest_edge": most}


class Idefics3Preparer(ImagePreparer):
    """Idefics3 and SmolVLM: the image split into square tiles plus a downscaled global view, each tile one run
    of `image_seq_len` tokens between its row/column marker tokens, as transformers' processor writes the prompt
    (`get_image_prompt_string`). detail "low" sends the global view alone."""

    def __init__(self, processor, spec: VisionSpec, tokenizer, image_seq_len: int) -> None:
        super().__init__(processor, spec)
        self.tokenizer = tokenizer
        self.image_seq_len = image_seq_len

    def prepare(self, image, pixel_digest: bytes, detail: str | None = None) -> PreparedImage:
        from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

        split = bool(self.processor.do_image_splitting) and detail != "low"
        out = self.processor(images=[[image]], return_tensors="pt", return_row_col_info=True, do_image_splitting=split)
        rows, cols = out["rows"][0][0], out["cols"][0][0]
        text = get_image_prompt_string(rows, cols, self.image_seq_len, "<fake_token_around_image>", self.spec.image_token, "<global-img>")
        tokens = tuple(self.tokenizer.encode(text, add_special_tokens=False))
        digest = self.digest(pixel_digest, do_image_splitting=split)
        side = math.isqrt(self.image_seq_len)
        tiles, i = [], 0
        for k in range(out["pixel_values"].shape[1]):  # tiles in prompt order: row by row, then the global view
            i = tokens.index(self.spec.image_token_id, i)
            pixels = {"pixel_values": out["pixel_values"][:, k : k + 1], "pixel_attention_mask": out["pixel_attention_mask"][:, k : k + 1]}
            tiles.append(ImageSpan(i, self.image_seq_len, hashlib.sha256(digest + k.to_bytes(2, "little")).digest(), (1, side, side), pixels))
            i += self.image_seq_len
        return PreparedImage(tokens, tuple(tiles))


class VisionTower:
    """A tile's processor tensors -> its tokens' embeddings [length, hidden]: transformers' modules for the family."""

    def __init__(self, module: torch.nn.Module, dtype: torch.dtype, encode) -> None:
        self.module = module
        self.dtype = dtype
        self.encode = encode  # (module, pixels on the device in dtype) -> [length, hidden]
        self.weight_bytes = sum(p.numel() * p.element_size() for p in module.parameters())

    @torch.inference_mode()
    def __call__(self, pixels: dict) -> torch.Tensor:
        device = next(self.module.parameters()).device
        return self.encode(self.module, {k: v.to(device, self.dtype) if v.is_floating_point() else v.to(device) for k, v in pixels.items()})


def _qwen2_vl_encode(module, pixels):
    return module(pixels["pixel_values"], grid_thw=pixels["image_grid_thw"]).pooler_output


class Idefics3Tower(torch.nn.Module):
    """Idefics3's vision transformer and connector (pixel shuffle, projection), as its model holds them."""

    def __init__(self, config, vision_cls, connector_cls) -> None:
        super().__init__()
        self.config = config
        self.vision_model = vision_cls._from_config(config.vision_config)
        self.connector = connector_cls(config)

    def forward(self, pixel_values, pixel_attention_mask):
        """One tile: [1, 1, 3, H, W] and its mask [1, 1, H, W] -> [image_seq_len, hidden] (get_image_features' math)."""
        pixel_values = pixel_values.flatten(0, 1)
        mask = pixel_attention_mask.flatten(0, 1)
        p = self.config.vision_config.patch_size
        patches = mask.unfold(1, p, p).unfold(2, p, p)
        patch_mask = patches.sum(dim=(-1, -2)) > 0
        hidden = self.vision_model(pixel_values=pixel_values, patch_attention_mask=patch_mask).last_hidden_state
        return self.connector(hidden).flatten(0, 1)


def _idefics3_encode(module, pixels):
    return module(pixels["pixel_values"], pixels["pixel_attention_mask"])


# family -> (transformers' module holding its tower's classes: one tower module, or Idefics3's vision transformer
# and connector; how the tower encodes one run)
FAMILIES = {
    "qwen2_vl": ("qwen2_vl", ("Qwen2VisionTransformerPretrainedModel",), _qwen2_vl_encode),
    "qwen2_5_vl": ("qwen2_5_vl", ("Qwen2_5_VisionTransformerPretrainedModel",), _qwen2_vl_encode),
    "idefics3": ("idefics3", ("Idefics3VisionTransformer", "Idefics3Connector"), _idefics3_encode),
    "smolvlm": ("smolvlm", ("SmolVLMVisionTransformer", "SmolVLMConnector"), _idefics3_encode),
}


def build_tower(model_cls, hf_config, state_dict: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype) -> VisionTower:
    """The family's tower (`model_cls.vision`, a FAMILIES key) with the checkpoint's tower tensors."""
    module_name, classes, encode = FAMILIES[model_cls.vision]
    found = [getattr(importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}"), c) for c in classes]
    start = time.perf_counter()
    if len(found) == 1:
        module = found[0]._from_config(hf_config.vision_config, dtype=torch.float32)
    else:
        module = Idefics3Tower(hf_config, *found)
    missing, unexpected = module.load_state_dict(state_dict, strict=False)
    if missing or unexpected:
        raise KeyError(f"the vision tower's tensors do not match the checkpoint: missing {missing[:3]}, unexpected {unexpected[:3]}")
    module = module.to(device=device, dtype=dtype).eval()
    tower = VisionTower(module, dtype, encode)
    log.info("vision tower (%s): %.1fM parameters, %s, loaded in %.2f s", model_cls.vision, sum(p.numel() for p in module.parameters()) / 1e6,
             str(dtype).removeprefix("torch."), time.perf_counter() - start)
    return tower


def load_preparer(folder: Path, hf_config, tokenizer) -> ImagePreparer:
    """The model folder's image processor (preprocessor_config.json) and its placeholder token."""
    import transformers

    from shoal.model.registry import model_class

    family = model_class(hf_config.architectures).vision
    processor = transformers.AutoImageProcessor.from_pretrained(folder)
    token_id = int(hf_config.image_token_id)
    spec = VisionSpec(token_id, tokenizer.convert_ids_to_tokens(token_id), (hf_config.architectures or ["?"])[0])
    if family in ("idefics3", "smolvlm"):
        v = hf_config.vision_config
        seq_len = (v.image_size // v.patch_size) ** 2 // hf_config.scale_factor**2
        return Idefics3Preparer(processor, spec, tokenizer, seq_len)
    return Qwen2VLPreparer(processor, spec)
