"""llama.cpp's mmproj files -> a Qwen2-VL / Qwen2.5-VL vision tower for transformers, and its image settings.

llama.cpp splits a vision-language checkpoint in two GGUFs: the decoder (arch "qwen2vl", read by
gguf_loader) and the vision tower, which `convert_hf_to_gguf.py --mmproj` writes as arch "clip"
(`Qwen2VLVisionModel`, an `MmprojModel`). This module inverts that converter:

* tensors (BLOCK_TENSORS, TOP_TENSORS) -> the names under transformers' tower module. The converter
  splits two HF tensors, which we join back:
  - the fused `attn.qkv` rows -> `v.blk.N.attn_q`, `attn_k`, `attn_v` (weight and bias; rows q | k | v);
  - the Conv3d patch embedding [E, C, T=2, P, P] -> its two temporal kernels `v.patch_embd.weight`
    ([:, :, 0]) and `v.patch_embd.weight.1` ([:, :, 1]), which clip.cpp runs as two Conv2d and adds.
  Storage: F32 (`--outtype f32`) or F16 with 1-D tensors in F32; we dequantize everything to float32.
* `clip.vision.*` metadata and tensor shapes -> the kwargs of transformers' vision config. The metadata
  alone is not enough: for Qwen2-VL the converter writes HF's merger width (`hidden_size`) as
  feed_forward_length, so the MLP and merger widths are read off the tensors.
* image settings -> Qwen2VLImageProcessorPil's kwargs. The converter writes mean and std; the merge size
  and pixel limits are clip.cpp's defaults unless the file has `clip.vision.spatial_merge_size`,
  `clip.vision.image_min_pixels` / `image_max_pixels`.

Window attention (Qwen2.5-VL): the file keeps `n_wa_pattern` (every n-th block attends globally; the
converter requires HF's `fullatt_block_indexes` to be evenly spaced) and no window size; clip.cpp uses
`clip.vision.window_size` where a file has it and 112 pixels (every released Qwen2.5-VL's) otherwise.

References (llama.cpp): convert_hf_to_gguf.py (MmprojModel, Qwen2VLVisionModel), gguf-py/gguf/constants.py
(Keys.ClipVision, VisionProjectorType), gguf-py/gguf/tensor_mapping.py (the V_* tensors),
tools/mtmd/clip.cpp (load_hparams, load_tensors), tools/mtmd/models/qwen2vl.cpp (the graph).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from shoal.model.file_checks import ModelFileError
from shoal.model.gguf_loader import GGUFFileReader, dequantize

log = logging.getLogger("shoal.loader")

# clip.projector_type -> family (the suffix of transformers' models.<family> module)
PROJECTORS: dict[str, str] = {"qwen2vl_merger": "qwen2_vl", "qwen2.5vl_merger": "qwen2_5_vl"}

# llama.cpp name inside block N (`v.blk.N.<key>`, without .weight/.bias) -> `blocks.N.<value>` in the tower.
# attn_q, attn_k and attn_v are not here: they are joined into `attn.qkv` (QKV).
BLOCK_TENSORS: dict[str, dict[str, str]] = {
    "qwen2_vl": {  # LayerNorms, a QuickGELU MLP
        "ln1": "norm1",
        "ln2": "norm2",
        "attn_out": "attn.proj",
        "ffn_up": "mlp.fc1",
        "ffn_down": "mlp.fc2",
    },
    "qwen2_5_vl": {  # RMSNorms, a SiLU-gated MLP
        "ln1": "norm1",
        "ln2": "norm2",
        "attn_out": "attn.proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    },
}
QKV = ("attn_q", "attn_k", "attn_v")
# ... and outside the blocks: the merger's norm and its two linears (mlp.1 is the GELU between them).
TOP_TENSORS: dict[str, str] = {"v.post_ln": "merger.ln_q", "mm.0": "merger.mlp.0", "mm.2": "merger.mlp.2"}
PATCH_KERNELS = ("v.patch_embd.weight", "v.patch_embd.weight.1")  # temporal slices 0 and 1 of the Conv3d

# clip.cpp's defaults for Qwen2/2.5-VL (load_hparams): a 2x2 merge, images of 8 to 4096 merged tokens,
# 112-pixel attention windows.
DEFAULT_MERGE = 2
DEFAULT_MIN_TOKENS, DEFAULT_MAX_TOKENS = 8, 4096
DEFAULT_WINDOW = 112
TEMPORAL_PATCH = 2  # the converter asserts it: two kernels
# transformers' towers hard-code their norms' epsilon; a file asking for another cannot be reproduced.
HF_NORM_EPS = 1e-6


@dataclass(frozen=True)
class MMProj:
    family: str  # "qwen2_vl" | "qwen2_5_vl"
    vision_config: dict  # kwargs of transformers' Qwen2VLVisionConfig / Qwen2_5_VLVisionConfig
    state_dict: dict[str, torch.Tensor]  # float32, named as under the tower module (patch_embed.proj.weight, ...)
    processor: dict  # kwargs of transformers' Qwen2VLImageProcessorPil


def read_mmproj(path: str | Path) -> MMProj:
    """Read a llama.cpp mmproj GGUF of a Qwen2-VL or Qwen2.5-VL tower.

    Raises ValueError for a GGUF that is not an mmproj, has no vision encoder, or whose projector shoal
    does not run, and for one whose tensors do not make that projector's tower.
    """
    reader = GGUFFileReader(path)
    meta = reader.metadata
    try:
        family = projector_family(meta)
        tensors = {t.name: dequantize(t) for t in reader.tensors}
        state_dict = tower_state_dict(tensors, family, int(meta["clip.vision.embedding_length"]))
        vision_config = build_vision_config(meta, state_dict, family)
    except KeyError as e:  # a metadata key or tensor the tower needs
        raise ModelFileError(path, f"the mmproj file lacks {e.args[0]!r}") from None
    except ModelFileError:
        raise
    except ValueError as e:
        raise ModelFileError(path, str(e)) from None
    return MMProj(family, vision_config, state_dict, processor_settings(meta, vision_config))


def projector_family(meta: dict) -> str:
    arch = meta.get("general.architecture")
    if arch != "clip":
        raise ValueError(f"not a llama.cpp mmproj file: general.architecture is {arch!r}, an mmproj's is 'clip'")
    if not meta.get("clip.has_vision_encoder", False):
        raise ValueError("the mmproj file has no vision encoder (clip.has_vision_encoder is not set)")
    # files with several encoders (audio too) name the vision one's projector apart
    kind = meta.get("clip.vision.projector_type", meta.get("clip.projector_type"))
    if kind not in PROJECTORS:
        supported = ", ".join(f"{k!r} ({v})" for k, v in PROJECTORS.items())
        raise ValueError(f"mmproj projector type {kind!r} is not supported (supported: {supported})")
    return PROJECTORS[kind]


# ---------------------------------------------------------------- tensors

_BLOCK = re.compile(r"v\.blk\.(\d+)\.(\w+)\.(weight|bias)")


def tower_state_dict(tensors: dict[str, torch.Tensor], family: str, embed_dim: int) -> dict[str, torch.Tensor]:
    """The file's tensors ([out, in] float32, as `dequantize` gives them) renamed and rejoined as the tower's."""
    tensors = dict(tensors)
    out: dict[str, torch.Tensor] = {}
    missing = [n for n in PATCH_KERNELS if n not in tensors]
    if missing:
        raise ValueError(f"mmproj has no {missing[0]} (the Conv3d patch embedding's temporal kernels)")
    out["patch_embed.proj.weight"] = torch.stack([tensors.pop(n) for n in PATCH_KERNELS], dim=2)  # [E, C, 2, P, P]
    qkv: dict[tuple[str, str], dict[str, torch.Tensor]] = {}  # (block, weight|bias) -> {attn_q: ...}
    unknown = []
    for name, value in tensors.items():
        base, _, suffix = name.rpartition(".")
        if match := _BLOCK.fullmatch(name):
            layer, part, suffix = match.groups()
            if part in QKV:
                qkv.setdefault((layer, suffix), {})[part] = value
            elif part in BLOCK_TENSORS[family]:
                out[f"blocks.{layer}.{BLOCK_TENSORS[family][part]}.{suffix}"] = value
            else:
                unknown.append(name)
        elif base in TOP_TENSORS:
            out[f"{TOP_TENSORS[base]}.{suffix}"] = value
        else:
            unknown.append(name)
    if unknown:
        raise ValueError(f"mmproj tensors with no place in the {family} tower: {unknown[:8]}")
    for (layer, suffix), parts in qkv.items():
        if set(parts) != set(QKV):
            raise ValueError(f"block {layer}: q, k and v {suffix}es must all be present, found {sorted(parts)}")
        out[f"blocks.{layer}.attn.qkv.{suffix}"] = torch.cat([parts[p] for p in QKV])  # rows q | k | v
    return unswap_legacy_ffn(out, family, embed_dim)


def unswap_legacy_ffn(state_dict: dict[str, torch.Tensor], family: str, embed_dim: int) -> dict[str, torch.Tensor]:
    """Files from llama.cpp's old Qwen2-VL surgery script hold the MLP's up and down projections under each
    other's names; clip.cpp (load_tensors, `is_ffn_swapped`) swaps them back when the "down" one reads the
    embedding. We do the same, where the shapes leave no doubt."""
    up, down = BLOCK_TENSORS[family]["ffn_up"], BLOCK_TENSORS[family]["ffn_down"]
    for key in [k for k in state_dict if k.endswith(f".{up}.weight")]:
        block = key[: -len(f"{up}.weight")]
        w_up, w_down = state_dict[key], state_dict.get(f"{block}{down}.weight")
        if w_down is None or not (w_down.shape[1] == embed_dim != w_up.shape[1]):
            continue
        for suffix in ("weight", "bias"):
            a, b = f"{block}{up}.{suffix}", f"{block}{down}.{suffix}"
            if a in state_dict and b in state_dict:
                state_dict[a], state_dict[b] = state_dict[b], state_dict[a]
    return state_dict


# ---------------------------------------------------------------- config


def build_vision_config(meta: dict, state_dict: dict[str, torch.Tensor], family: str) -> dict:
    """transformers' vision config kwargs, from `clip.vision.*` and the tensors' shapes."""
    depth = int(meta["clip.vision.block_count"])
    embed = int(meta["clip.vision.embedding_length"])
    patch = int(meta["clip.vision.patch_size"])
    merge = int(meta.get("clip.vision.spatial_merge_size", DEFAULT_MERGE))
    kernel = state_dict["patch_embed.proj.weight"]  # [E, C, T, P, P]
    if tuple(kernel.shape) != (embed, kernel.shape[1], TEMPORAL_PATCH, patch, patch):
        raise ValueError(f"patch embedding {tuple(kernel.shape)} does not match embedding {embed}, patch {patch}")
    blocks = {int(k.split(".")[1]) for k in state_dict if k.startswith("blocks.")}
    if blocks != set(range(depth)):
        raise ValueError(f"clip.vision.block_count is {depth}, the tensors have blocks {sorted(blocks)}")
    merger_in = state_dict["merger.mlp.0.weight"].shape[1]
    if merger_in != embed * merge * merge:
        raise ValueError(f"the merger reads {merger_in} features, not {merge}x{merge} patches of {embed}")
    out_dim = int(state_dict["merger.mlp.2.weight"].shape[0])  # the decoder's width
    ff = int(state_dict[f"blocks.0.{BLOCK_TENSORS[family]['ffn_up']}.weight"].shape[0])
    eps = meta.get("clip.vision.attention.layer_norm_epsilon", HF_NORM_EPS)
    if not np.isclose(eps, HF_NORM_EPS, rtol=1e-3, atol=0):
        log.warning("mmproj asks for norm epsilon %g; transformers' %s tower uses %g", eps, family, HF_NORM_EPS)
    common = dict(
        depth=depth,
        num_heads=int(meta["clip.vision.attention.head_count"]),
        hidden_act=hidden_act(meta),
        in_channels=int(kernel.shape[1]),
        patch_size=patch,
        spatial_merge_size=merge,
        temporal_patch_size=TEMPORAL_PATCH,
    )
    if family == "qwen2_vl":
        if ff % embed:
            raise ValueError(f"MLP width {ff} is not a whole multiple of {embed}: Qwen2-VL's config has an integer mlp_ratio")
        return dict(common, embed_dim=embed, mlp_ratio=ff // embed, hidden_size=out_dim)
    n_wa = int(meta.get("clip.vision.n_wa_pattern", 0))
    # clip.cpp: block il attends globally when (il + 1) % n_wa_pattern == 0; every block when n_wa_pattern is 0
    full = [i for i in range(depth) if n_wa <= 0 or (i + 1) % n_wa == 0]
    window = int(meta.get("clip.vision.window_size", DEFAULT_WINDOW))
    return dict(common, hidden_size=embed, intermediate_size=ff, out_hidden_size=out_dim, window_size=window,
                fullatt_block_indexes=full)


def hidden_act(meta: dict) -> str:
    """The blocks' MLP activation, as clip.cpp picks it: SiLU, tanh-approximated GELU (ggml_gelu), or
    QuickGELU when the file sets neither flag (Qwen2-VL's)."""
    gelu, silu = bool(meta.get("clip.use_gelu", False)), bool(meta.get("clip.use_silu", False))
    if gelu and silu:
        raise ValueError("mmproj sets both clip.use_gelu and clip.use_silu")
    return "silu" if silu else "gelu_pytorch_tanh" if gelu else "quick_gelu"


def processor_settings(meta: dict, vision_config: dict) -> dict:
    """Qwen2VLImageProcessorPil's kwargs. The file stores mean and std as float32."""
    unit = vision_config["patch_size"] * vision_config["spatial_merge_size"]  # pixels per merged token, each side
    return dict(
        image_mean=[float(x) for x in meta["clip.vision.image_mean"]],
        image_std=[float(x) for x in meta["clip.vision.image_std"]],
        patch_size=vision_config["patch_size"],
        merge_size=vision_config["spatial_merge_size"],
        temporal_patch_size=vision_config["temporal_patch_size"],
        min_pixels=int(meta.get("clip.vision.image_min_pixels", DEFAULT_MIN_TOKENS * unit * unit)),
        max_pixels=int(meta.get("clip.vision.image_max_pixels", DEFAULT_MAX_TOKENS * unit * unit)),
    )

