"""A Qwen2-VL / Qwen2.5-VL folder (tiny_models.make_tiny_vl_model) -> the GGUF pair llama.cpp's converter writes.

`convert_hf_to_gguf.py` run twice over a vision-language folder writes:

* the decoder (`Qwen2VLModel`, a TextModel of arch "qwen2vl" for both families): Qwen2's metadata and
  tensors, the M-RoPE sections as `qwen2vl.rope.dimension_sections` (HF's three, padded with a zero), the
  byte-level BPE vocabulary (`_set_vocab_gpt2`), and no visual.* tensor;
* with `--mmproj`, the vision tower (`Qwen2VLVisionModel`, an MmprojModel of arch "clip"): `clip.*`
  metadata, the visual.* tensors renamed by gguf-py's tensor map, the fused qkv split into q, k, v, and the
  Conv3d patch embedding split into its two temporal kernels.

This module does the same with the `gguf` package (llama.cpp's own gguf-py), so the names come from
llama.cpp's tensor map. Where it cannot follow the converter, it says so:
* `tokenizer.ggml.pre` is "gpt-2": the converter hashes the tokenizer's output to name its pre-tokenizer
  and would reject the tiny one; tiny_models' tokenizer splits like GPT-2.
* `clip.vision.window_size` is written when the tower's window is not 112 pixels: the converter writes
  none (every released Qwen2.5-VL uses 112, clip.cpp's default), the tiny tower uses 56.
* `pixel_limits=True` adds `clip.vision.image_min_pixels` / `image_max_pixels` from the folder's
  preprocessor config (keys the converter writes for other projectors, never for Qwen2-VL).
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file

PROJECTOR = {"qwen2_vl": gguf.VisionProjectorType.QWEN2VL, "qwen2_5_vl": gguf.VisionProjectorType.QWEN25VL}
FILE_TYPE = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16}
LLAMACPP_WINDOW = 112


def write_vl_gguf_pair(hf_folder: Path, out_dir: Path, *, outtype: str = "f32", pixel_limits: bool = False) -> tuple[Path, Path]:
    """Write `out_dir/model.gguf` (the decoder) and `out_dir/mmproj.gguf` (the vision tower) of `hf_folder`.

    outtype: the converter's --outtype, "f32" or "f16" (2-D and larger tensors in F16, 1-D ones in F32).
    """
    hf_folder, out_dir = Path(hf_folder), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = transformers.AutoConfig.from_pretrained(hf_folder)
    tensors = load_file(hf_folder / "model.safetensors")
    text = out_dir / "model.gguf"
    mmproj = out_dir / "mmproj.gguf"
    write_text_gguf(hf_folder, config, {k: v for k, v in tensors.items() if not k.startswith("visual.")}, text, outtype)
    write_mmproj_gguf(hf_folder, config, {k: v for k, v in tensors.items() if k.startswith("visual.")}, mmproj, outtype, pixel_limits)
    return text, mmproj


def write_text_gguf(folder: Path, config, tensors: dict[str, torch.Tensor], path: Path, outtype: str) -> None:
    """Qwen2VLModel: TextModel.set_gguf_parameters over the text config, _set_vocab_gpt2, the decoder's tensors."""
    text = config.text_config
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.QWEN2VL])
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(folder.name)
    writer.add_block_count(text.num_hidden_layers)
    writer.add_context_length(text.max_position_embeddings)
    writer.add_embedding_length(text.hidden_size)
    writer.add_feed_forward_length(text.intermediate_size)
    writer.add_head_count(text.num_attention_heads)
    writer.add_head_count_kv(text.num_key_value_heads)
    # rope_type "default" writes no scaling keys; the sections are padded to four [time, height, width, extra]
    sections = list(text.rope_parameters["mrope_section"])
    writer.add_rope_dimension_sections((sections + [0] * 4)[:4])
    writer.add_rope_freq_base(text.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(text.rms_norm_eps)
    writer.add_file_type(FILE_TYPE[outtype])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    write_vocab(writer, folder, text.vocab_size)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2VL, text.num_hidden_layers)
    for hf_name, tensor in tensors.items():
        base, suffix = hf_name.rsplit(".", 1)
        add_tensor(writer, f"{names.get_name(base)}.{suffix}", tensor, outtype)
    finish(writer)


def write_vocab(writer: gguf.GGUFWriter, folder: Path, vocab_size: int) -> None:
    """TextModel._set_vocab_gpt2 (get_vocab_base): tokens by id, added tokens CONTROL when special (or shaped
    like <|...|>), else USER_DEFINED; merges, special ids and the chat template via gguf.SpecialVocab."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    tokens, kinds = [], []
    for i in range(vocab_size):
        token = by_id.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]")
            kinds.append(gguf.TokenType.UNUSED)
            continue
        tokens.append(token)
        if i not in added:
            kinds.append(gguf.TokenType.NORMAL)
        elif added[i].special or (token.startswith("<|") and token.endswith("|>")):
            kinds.append(gguf.TokenType.CONTROL)
        else:
            kinds.append(gguf.TokenType.USER_DEFINED)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")  # see the module docstring
    writer.add_token_list(tokens)
    writer.add_token_types(kinds)
    gguf.SpecialVocab(folder, load_merges=True).add_to_gguf(writer, quiet=True)


def write_mmproj_gguf(folder: Path, config, tensors: dict[str, torch.Tensor], path: Path, outtype: str, pixel_limits: bool) -> None:
    """Qwen2VLVisionModel: MmprojModel.set_gguf_parameters plus the family's keys, and the visual.* tensors."""
    family = config.model_type
    vision = config.vision_config
    pre = json.loads((folder / "preprocessor_config.json").read_text())
    # Qwen2VLVisionModel.__init__ renames Qwen2-VL's keys: its embed_dim is the embedding, and its hidden_size
    # (the merger's output width) becomes feed_forward_length. Qwen2.5-VL's keys are taken as they are.
    embed, ff = (vision.embed_dim, vision.hidden_size) if family == "qwen2_vl" else (vision.hidden_size, vision.intermediate_size)
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.MMPROJ])
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_name(folder.name)
    writer.add_file_type(FILE_TYPE[outtype])
    writer.add_clip_has_vision_encoder(True)
    writer.add_vision_projection_dim(config.text_config.hidden_size)
    writer.add_vision_image_size(getattr(vision, "image_size", 560))
    writer.add_vision_patch_size(vision.patch_size)
    writer.add_vision_embedding_length(embed)
    writer.add_vision_feed_forward_length(ff)
    writer.add_vision_block_count(vision.depth)
    writer.add_vision_head_count(vision.num_heads)
    writer.add_vision_image_mean(pre["image_mean"])
    writer.add_vision_image_std(pre["image_std"])
    writer.add_clip_projector_type(PROJECTOR[family])
    if family == "qwen2_5_vl":
        writer.add_vision_use_silu(True)
        full = list(vision.fullatt_block_indexes)
        n_wa_pattern = full[0] + 1
        if any(b - a != n_wa_pattern for a, b in zip(full, full[1:])):
            raise ValueError(f"Invalid fullatt_block_indexes: {full}")  # as the converter does
        writer.add_vision_n_wa_pattern(n_wa_pattern)
        if vision.window_size != LLAMACPP_WINDOW:
            writer.add_vision_window_size(vision.window_size)
    # the converter reads rms_norm_eps from the top level of config.json, where Qwen2-VL has none
    writer.add_vision_attention_layernorm_eps(config.to_dict().get("rms_norm_eps", 1e-6))
    if pixel_limits:
        writer.add_vision_min_pixels(pre["size"]["shortest_edge"])
        writer.add_vision_max_pixels(pre["size"]["longest_edge"])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)

    # The converter sizes the tensor map by the block count; mm.2 needs index 2, which a 2-block tower lacks.
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, max(vision.depth, 3))
    for hf_name, tensor in tensors.items():
        for name, part in split_visual(hf_name, tensor):
            if name.startswith("v.patch_embd."):  # MmprojModel.tensor_force_quant
                add_tensor(writer, name, part, outtype, force=Q.F16 if outtype == "f16" else Q.F32)
            else:
                base, suffix = name.rsplit(".", 1)
                add_tensor(writer, f"{names.get_name(base)}.{suffix}", part, outtype)
    finish(writer)


def split_visual(hf_name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Qwen2VLVisionModel.modify_tensors: qkv rows -> q, k, v (HF names, mapped after); the Conv3d
    [E, C, 2, P, P] -> `v.patch_embd.weight` and `v.patch_embd.weight.1`, its temporal slices."""
    if ".qkv." in hf_name:
        c = tensor.shape[0] // 3
        return [(hf_name.replace("qkv", p), tensor[i * c : (i + 1) * c]) for i, p in enumerate("qkv")]
    if "patch_embed.proj.weight" in hf_name:
        assert tensor.shape[2] == 2, "the converter only supports temporal_patch_size 2"
        return [("v.patch_embd.weight", tensor[:, :, 0]), ("v.patch_embd.weight.1", tensor[:, :, 1])]
    return [(hf_name, tensor)]


def add_tensor(writer: gguf.GGUFWriter, name: str, tensor: torch.Tensor, outtype: str, force: Q | None = None) -> None:
    """ModelBase.prepare_tensors' storage rule: 1-D tensors and norms in F32, everything else in the
    outtype, unless the model forces a type."""
    data = tensor.float().contiguous().numpy()
    qtype = force
    if data.ndim <= 1 or name.endswith("_norm.weight"):
        qtype = Q.F32
    if qtype is None:
        qtype = Q.F16 if outtype == "f16" else Q.F32
    writer.add_tensor(name, gguf.quants.quantize(data, qtype) if qtype != Q.F32 else data.astype(np.float32), raw_dtype=qtype)


def finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
