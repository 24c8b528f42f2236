"""GGUF checkpoints (llama.cpp's single-file format) -> HF-named weights, config and tokenizer.

Everything is read and dequantized with the `gguf` package; this module only
decides what the pieces mean in Hugging Face terms:

* tensor names: llama.cpp's `blk.N.attn_q.weight` -> `model.layers.N.self_attn.q_proj.weight`
  (the tables below);
* layout: llama.cpp's converter permutes the q/k rows of llama-arch models for its
  rotary kernel, which we undo (`unpermute_qk`);
* hyperparameters: the `{arch}.*` metadata -> a transformers config class;
* tokenizer: the vocabulary, merges and special-token ids in the metadata -> a
  `tokenizers.Tokenizer`, wrapped as a transformers fast tokenizer.

transformers' own GGUF loading (`from_pretrained(..., gguf_file=...)`) is the
reference the tests compare against; where this module decides something, the
comment says whose rule it follows.
"""

from __future__ import annotations

import functools
import logging
import math
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
import transformers
from gguf.gguf_reader import READER_SUPPORTED_VERSIONS
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from tqdm.auto import tqdm

from shoal import kernels
from shoal.model.file_checks import (
    MAX_ARRAY_ENTRIES, MAX_DIMS, MAX_METADATA_ENTRIES, MAX_STRING_BYTES, ModelFileError, Span, check_spans, first_line, in_words,
    truncated,
)
from shoal.model.formats import NATIVE, QuantTensor, file_mapping, is_quantized, type_counts
from shoal.model.quant import Q4Codes

log = logging.getLogger("shoal.loader")

# ---------------------------------------------------------------- architectures


@dataclass(frozen=True)
class ArchSpec:
    model_type: str  # transformers' model_type of the decoder's config
    model_class: str  # what config.architectures names
    qk_permuted: bool  # convert_hf_to_gguf.py applied LlamaModel.permute to q/k rows
    fixed_qkv_bias: bool = False  # q/k/v always carry biases: the family's config has no attention_bias flag
    config_class: str | None = None  # the transformers config class built, where a plain config will not do (below)
    tensors: tuple[tuple[str, str], ...] = ()  # BLOCK_TENSORS entries this architecture names otherwise
    rope_dims_are_head_dim: bool = True  # `rope.dimension_count` is the head size (not so where a family rotates part of it)
    norm_shift: float = 0.0  # what the converter added to every norm weight (Gemma's 1: its (1 + w) norms store w + 1)

    def block_tensors(self) -> dict[str, str]:
        return {**BLOCK_TENSORS, **dict(self.tensors)}


# llama.cpp writes Llama *and* Mistral checkpoints as arch "llama" (convert_hf_to_gguf's
# LlamaModel is registered for both, with undo_permute = True); Qwen2Model and
# Qwen3Model are plain TextModels, which write q/k rows as they are.
# The decoder of Qwen2-VL *and* Qwen2.5-VL is arch "qwen2vl" (Qwen2VLModel, a plain TextModel
# registered for both, that leaves the visual.* tensors to the mmproj file): Qwen2's tensors plus
# `qwen2vl.rope.dimension_sections` (M-RoPE). Only the mmproj's projector type tells the two apart, so the
# config names Qwen2-VL until the caller reads it (model/mmproj.py). Its vision side builds transformers'
# own modules, which read the family's config class.
# Phi3MiniModel (phi3: Phi-3, 3.5, 4, 4-mini) is a plain TextModel too: it writes the fused qkv_proj as `attn_qkv`
# and the fused gate_up_proj as `ffn_up` (gate rows first), a partial rotary as `rope.dimension_count`, and
# LongRoPE's factors as the tensors `rope_factors_long` / `rope_factors_short` (phi3_config).
# Gemma2Model / Gemma3Model write every `*norm.weight` plus 1 (their norms scale by 1 + w), which we subtract: in
# float32, s - 1 + 1 gives s back for every s in [0.5, 2] (Sterbenz), so the norms compute with the stored value.
# Their FFN_NORM is the pre-MLP norm and `post_attention_norm` the attention output's (gemma_config for the rest).
GEMMA_TENSORS = (("ffn_norm", "pre_feedforward_layernorm"),)
ARCHS: dict[str, ArchSpec] = {
    "llama": ArchSpec("llama", "LlamaForCausalLM", qk_permuted=True),
    "qwen2": ArchSpec("qwen2", "Qwen2ForCausalLM", qk_permuted=False, fixed_qkv_bias=True),
    "qwen3": ArchSpec("qwen3", "Qwen3ForCausalLM", qk_permuted=False),
    "qwen2vl": ArchSpec("qwen2_vl_text", "Qwen2VLForConditionalGeneration", qk_permuted=False, fixed_qkv_bias=True,
                        config_class="Qwen2VLTextConfig"),
    "phi3": ArchSpec("phi3", "Phi3ForCausalLM", qk_permuted=False, tensors=(("ffn_up", "mlp.gate_up_proj"),), rope_dims_are_head_dim=False),
    "gemma2": ArchSpec("gemma2", "Gemma2ForCausalLM", qk_permuted=False, tensors=GEMMA_TENSORS, norm_shift=1.0),
    "gemma3": ArchSpec("gemma3_text", "Gemma3ForCausalLM", qk_permuted=False, tensors=GEMMA_TENSORS, norm_shift=1.0),
    "qwen3moe": ArchSpec("qwen3_moe", "Qwen3MoeForCausalLM", qk_permuted=False),
    "olmoe": ArchSpec("olmoe", "OlmoeForCausalLM", qk_permuted=False),
}
# What the families' transformers configs default to where a file says nothing: the decoders all use SiLU,
# and transformers' Llama, Qwen2 and Qwen3 configs all take 1e-6 for a missing epsilon.
CONFIG_DEFAULTS: dict[str, Any] = {"hidden_act": "silu", "rms_norm_eps": 1e-6}

# `{arch}.<key>` metadata -> config attribute.
HPARAMS: dict[str, str] = {
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
}

# llama.cpp tensor name (without .weight/.bias) -> HF name, outside the blocks ...
TOP_TENSORS: dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# ... and inside block N (`blk.N.<key>` -> `model.layers.N.<value>`).
BLOCK_TENSORS: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_qkv": "self_attn.qkv_proj",  # phi3: q, k, v fused as HF's Phi-3 stores them
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",  # qwen3
    "attn_k_norm": "self_attn.k_norm",  # qwen3
    "ffn_norm": "post_attention_layernorm",  # HF's name for Llama's pre-MLP norm (Gemma: ArchSpec.tensors)
    "post_attention_norm": "post_attention_layernorm",  # gemma2/3: the attention output's norm
    "post_ffw_norm": "post_feedforward_layernorm",  # gemma2/3
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # a sparse MLP (qwen3moe; llama with llama.expert_count, Mixtral): the router, and every expert's projection as
    # one [experts, rows, cols] tensor, read expert by expert under `mlp.experts.E.*` (expert_parts)
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
# Tensors with no HF parameter: Llama 3.1's and Phi-3's rope factors go into the config instead.
CONFIG_ONLY_TENSORS = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}

# llama.cpp's sampling metadata -> SamplingParams / generation_config names.
SAMPLING_KEYS: dict[str, str] = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_k": "top_k",
    "general.sampling.top_p": "top_p",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


@dataclass
class GGUFCheckpoint:
    config: transformers.PretrainedConfig
    state_dict: dict[str, torch.Tensor]
    tokenizer: transformers.PreTrainedTokenizerFast
    generation_eos_ids: tuple[int, ...]  # end-of-generation ids besides the tokenizer's eos (eot, eom)
    generation_defaults: dict[str, float]
    weight_format: str = "none"  # "gguf": quantized tensors stay their file's blocks (QuantTensor); "int4": Q4 ones as Q4Codes
    names: tuple[str, ...] = ()  # what the file calls its model: general.basename, general.name


# ---------------------------------------------------------------- reading

ORDER_SWAPPED = {"little": "big", "big": "little"}


class GGUFFileReader(gguf.GGUFReader):
    """`gguf.GGUFReader`, checking every claim of the file against its length, and parsing over a plain-ndarray
    view of its memory map.

    Checked (file_checks): the magic and version first; every count, string and array against the bytes left,
    so a count of 2^40 is refused before any loop; each tensor's dimensions, type and bytes against the file's
    length and each other's, before a view is made. A bad file raises `ModelFileError`, one line naming the
    file and what is wrong.

    Speed: the reader makes a few tiny numpy views per metadata value, three per vocabulary entry. Sliced from
    an `np.memmap`, each view runs memmap's Python-level `__array_finalize__`; that made parsing SmolLM2's 49k
    tokens and 49k merges take 3-4 s, against ~0.9 s over a plain view of the same mapping. The view keeps the
    mapping alive (it is the view's base) and read-only.
    """

    def __init__(self, path: str | Path) -> None:
        self.seconds: dict[str, float] = {}  # what parsing, the tokenizer and the config took, for the load's log line
        self.path, self._where, self._entries = Path(path), "the header", 0
        t0 = time.perf_counter()
        self._check_start()
        try:
            super().__init__(path)
        except ModelFileError:
            raise
        except (ValueError, KeyError, UnicodeDecodeError, OverflowError, IndexError) as e:  # what gguf-py checks itself
            raise ModelFileError(path, f"malformed GGUF ({self._where}): {str(e).strip(chr(39))}") from None
        self.seconds["metadata"] = time.perf_counter() - t0

    def _check_start(self) -> None:
        size = self.path.stat().st_size
        with self.path.open("rb") as f:
            head = f.read(24)
        if head[:4] != b"GGUF":
            raise ModelFileError(self.path, "not a GGUF file (it does not start with the GGUF magic)")
        if len(head) < 24:
            raise truncated(self.path, "the GGUF header", 0, 24, size)
        version = int.from_bytes(head[4:8], "little")
        if version & 0xFFFF == 0:  # written on a big-endian machine
            version = int.from_bytes(head[4:8], "big")
        if version not in READER_SUPPORTED_VERSIONS:
            raise ModelFileError(self.path, f"unsupported GGUF version {version} (shoal reads versions "
                                            f"{' and '.join(map(str, READER_SUPPORTED_VERSIONS))})")

    @property
    def data(self) -> np.ndarray:
        return self._array

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._array = value.view(np.ndarray)
        file_mapping(self._array)  # its pages may be dropped once a tensor is packed (formats.release)

    def _get(self, offset: int, dtype, count: int = 1, override_order=None) -> np.ndarray:
        end = offset + np.dtype(dtype).itemsize * int(count)
        if end > len(self._array):
            raise truncated(self.path, self._where, offset, end, len(self._array))
        return super()._get(offset, dtype, count, override_order)

    def _get_str(self, offset: int) -> tuple[np.ndarray, np.ndarray]:
        length = int(self._get(offset, np.uint64)[0])
        if length > MAX_STRING_BYTES:
            raise ModelFileError(self.path, f"{self._where} is a string of {in_words(length)} bytes "
                                            f"(shoal reads at most {in_words(MAX_STRING_BYTES)})")
        return super()._get_str(offset)

    def _counted(self, count: int, offs: int, least: int, who: str, what: str) -> int:
        """`count` entries of at least `least` bytes each, refused before a loop if the bytes left cannot hold them."""
        count, left = int(count), len(self._array) - offs
        if count * least > left:
            raise ModelFileError(self.path, f"{who} counts {in_words(count)} {what}, more than the {left:,} bytes "
                                            "after it can hold")
        return count

    def _build_fields(self, offs: int, count: int) -> int:
        count = self._counted(count, offs, 8 + 4 + 1, "the header", "metadata entries")  # a key's length, the type, a 1-byte value
        for i in range(count):
            self._where = f"metadata entry {i + 1} of {count}"
            key_length, key = self._get_str(offs)
            self._where = f"metadata {bytes(key).decode('utf-8', 'replace')!r}"
            raw_type = self._get(offs + 8 + len(key), np.uint32)
            size, parts, idxs, types = self._get_field_parts(offs + 12 + len(key), raw_type[0])
            self._push_field(gguf.ReaderField(offs, str(bytes(key), encoding="utf-8"), [key_length, key, raw_type, *parts],
                                              [j + 3 for j in idxs], types), skip_sum=True)
            offs += 12 + len(key) + size
        return offs

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list, list[int], list[gguf.GGUFValueType]]:
        """gguf-py's, but an array in bulk: gguf-py parses it an entry at a time, with three numpy views per string
        (0.7 s of a 1B model's start for a vocabulary of 49k tokens, their types and scores, and 49k merges).
        Here an array of numbers is one view (so `contents()` reads it whole, as read_metadata does), and an
        array of strings one memoryview slice per string."""
        if raw_type not in gguf.GGUFValueType._value2member_map_:
            raise ModelFileError(self.path, f"{self._where} has an unknown GGUF value type {int(raw_type)}")
        if raw_type != gguf.GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        parts: list = [self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)]
        count, offs = int(parts[1][0]), orig_offs + 12
        if parts[0][0] == gguf.GGUFValueType.ARRAY:  # llama.cpp's gguf.cpp refuses them too
            raise ModelFileError(self.path, f"{self._where} is an array of arrays, which GGUF readers do not take")
        if parts[0][0] not in gguf.GGUFValueType._value2member_map_:
            raise ModelFileError(self.path, f"{self._where} is an array of an unknown GGUF value type {int(parts[0][0])}")
        item = gguf.GGUFValueType(parts[0][0])
        numbers = self.gguf_scalar_to_np.get(item)
        self._counted(count, offs, np.dtype(numbers).itemsize if numbers is not None else 8, self._where, "entries")
        self._entries += count
        if count > MAX_ARRAY_ENTRIES or self._entries > MAX_METADATA_ENTRIES:
            raise ModelFileError(self.path, f"{self._where} is an array of {in_words(count)} entries (shoal reads at most "
                                            f"{in_words(MAX_ARRAY_ENTRIES)} in one, {in_words(MAX_METADATA_ENTRIES)} in all)")
        types = [gguf.GGUFValueType.ARRAY, item]
        if numbers is not None:
            parts.append(self._get(offs, numbers, count))
            return 12 + parts[2].nbytes, parts, [2], types
        data, order = memoryview(self._array), sys.byteorder if self.byte_order == "I" else ORDER_SWAPPED[sys.byteorder]
        end = len(data)
        for i in range(count):
            if offs + 8 > end:
                raise truncated(self.path, self._where, offs, offs + 8, end)
            length = int.from_bytes(data[offs:offs + 8], order)
            if offs + 8 + length > end:
                raise ModelFileError(self.path, f"{self._where}: entry {i + 1} of {count} is a string of {in_words(length)} "
                                                f"bytes at byte {offs:,}, past the end of the file ({end:,} bytes)")
            parts.append(data[offs + 8:offs + 8 + length])  # .tobytes(), as ReaderField.contents reads a part
            offs += 8 + length
        return offs - orig_offs, parts, list(range(2, 2 + count)), types

    def _build_tensor_info(self, offs: int, count: int) -> tuple[int, list[gguf.ReaderField]]:
        count = self._counted(count, offs, 8 + 4 + 4 + 8, "the header", "tensors")  # a name's length, dims, type, offset
        fields = []
        for i in range(count):
            self._where = f"tensor {i + 1} of {count}"
            name_length, name = self._get_str(offs)
            self._where = f"tensor {bytes(name).decode('utf-8', 'replace')}"
            n_dims = self._get(offs + 8 + len(name), np.uint32)
            if n_dims[0] > MAX_DIMS:
                raise ModelFileError(self.path, f"{self._where} has {int(n_dims[0])} dimensions (GGUF allows {MAX_DIMS})")
            at = offs + 12 + len(name)
            dims = self._get(at, np.uint64, n_dims[0])
            raw_type, offset = self._get(at + 8 * int(n_dims[0]), np.uint32), self._get(at + 8 * int(n_dims[0]) + 4, np.uint64)
            fields.append(gguf.ReaderField(offs, str(bytes(name), encoding="utf-8"), [name_length, name, n_dims, dims, raw_type, offset],
                                           [1, 3, 4, 5]))
            offs = at + 8 * int(n_dims[0]) + 12
        return offs, fields

    def _build_tensors(self, start_offs: int, fields: list[gguf.ReaderField]) -> None:
        """Each tensor's type, dimensions and bytes checked, against the file and each other, before gguf-py views them."""
        spans = []
        for field in fields:
            _, _, _, dims, raw_type, offset = field.parts
            self._where = f"tensor {field.name}"
            qtype = gguf.GGMLQuantizationType._value2member_map_.get(int(raw_type[0]))
            if qtype not in gguf.GGML_QUANT_SIZES:
                raise ModelFileError(self.path, f"{self._where} has an unknown tensor type {int(raw_type[0])}")
            shape = [int(d) for d in dims]
            if any(d >= 1 << 62 for d in shape) or math.prod(shape) >= 1 << 62:
                raise ModelFileError(self.path, f"{self._where} has absurd dimensions {' x '.join(in_words(d) for d in shape)}")
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            if shape and shape[0] % block:
                raise ModelFileError(self.path, f"{self._where} has rows of {shape[0]:,} values, not a multiple of "
                                                f"{qtype.name}'s {block}-value blocks")
            start = start_offs + int(offset[0])
            spans.append(Span(field.name, start, start + math.prod(shape) // block * type_size))
        check_spans(self.path, spans, len(self._array), self.alignment, start_offs)
        super()._build_tensors(start_offs, fields)

    @functools.cached_property
    def metadata(self) -> dict[str, Any]:
        try:
            return read_metadata(self)
        except UnicodeDecodeError:
            bad = next(k for k, f in self.fields.items() if not _decodes(f))
            raise ModelFileError(self.path, f"metadata {bad!r} holds a string that is not UTF-8") from None

    @functools.cached_property
    def tokenizer(self) -> transformers.PreTrainedTokenizerFast:
        """Built once (~0.15 s for SmolLM2's 49k vocabulary, ~0.4 s for 128k), whether the config is read before the load or by it."""
        t0 = time.perf_counter()
        try:
            tokenizer = build_tokenizer(self.metadata)
        except ModelFileError:
            raise
        except Exception as e:  # noqa: BLE001 (the tokenizers library raises TypeError, ValueError or its own Exception)
            raise ModelFileError(self.path, f"its tokenizer metadata is unusable ({first_line(e)})") from None
        self.seconds["tokenizer"] = time.perf_counter() - t0
        return tokenizer

    @functools.cached_property
    def hf_config(self) -> transformers.PretrainedConfig:
        meta = self.metadata
        arch = meta.get("general.architecture")
        if arch not in ARCHS:
            raise ModelFileError(self.path, f"GGUF architecture {arch!r} is not supported (supported: {', '.join(ARCHS)})")
        try:
            return build_config(meta, {t.name: t for t in self.tensors}, self.tokenizer)
        except KeyError as e:
            raise ModelFileError(self.path, f"its metadata lacks {e.args[0]!r}, which a {arch} model needs") from None
        except (TypeError, ValueError, ZeroDivisionError, IndexError) as e:
            raise ModelFileError(self.path, f"its {arch} metadata is malformed ({first_line(e)})") from None


def _decodes(field: gguf.ReaderField) -> bool:
    try:
        field.contents()
        return True
    except UnicodeDecodeError:
        return False


def read_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """Every key/value of the file as Python values (str, int, float, bool, lists)."""
    return {name: field.contents() for name, field in reader.fields.items()}


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32, progress: bool = True, quantization: str = "none",
              select=None, reader: GGUFFileReader | None = None) -> GGUFCheckpoint:
    """Read a GGUF file into HF-named tensors, a config and a tokenizer.

    quantization: the format the decoder's projections will have ("none",
    "int8", "int4", or "auto": the file's own, see `projection_format`). With
    int4, a Q4_0/Q4_1 projection comes back as its codes and group scales
    (`Q4Codes`) and is never dequantized; with int8 or int4, projections that
    are rounded later stay float32 until then. Everything else is `dtype`.

    select(hf_name) -> (dim, start, length) | None | False: read only that part of each tensor (a
    tensor-parallel rank's rows or columns, weights.shard_slice), or nothing of it (False: another
    pipeline stage's). A rank plans its part from the config first (`GGUFFileReader.hf_config`).
    Rows are read from the file's blocks as they are; columns too where they fall on
    quantization blocks, else the tensor is read whole and the model slices it.
    reader: the file already parsed (loader.open_gguf), so that decisions made before the load share its parse.
    """
    reader = reader if reader is not None else GGUFFileReader(path)
    meta = reader.metadata
    config = reader.hf_config
    tokenizer = reader.tokenizer
    t0 = time.perf_counter()
    fmt = planned_weight_format(quantization, reader)
    state_dict = load_state_dict(reader.tensors, ARCHS[meta["general.architecture"]], config, dtype, progress, fmt, select)
    kept = [v for v in state_dict.values() if isinstance(v, (Q4Codes, QuantTensor))]
    log.info(
        "GGUF %s: read metadata %.2f s, tokenizer %.2f s, %d tensors %.2f s (%d kept in their file's types, not dequantized%s)",
        Path(path).name, reader.seconds["metadata"], reader.seconds["tokenizer"], len(state_dict),
        time.perf_counter() - t0, len(kept), f": {type_counts(kept)}" if fmt == "gguf" else "",
    )
    other = [v for v in kept if isinstance(v, QuantTensor) and v.type not in NATIVE]
    if other:
        log.info("GGUF %s: %s have no kernel here: each is dequantized at load and rounded to Q8_0",
                 Path(path).name, type_counts(other))
    eos_extra = tuple(meta[k] for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in meta)
    defaults = {name: meta[key] for key, name in SAMPLING_KEYS.items() if key in meta}
    names = tuple(str(meta[k]) for k in ("general.basename", "general.name") if k in meta)
    return GGUFCheckpoint(config, state_dict, tokenizer, eos_extra, defaults, fmt, names)


Q4_TYPES = (gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj")


def planned_weight_format(quantization: str, reader: gguf.GGUFReader | None) -> str:
    """The projections' format a load with `quantization` gives: "auto" is a GGUF's own (`projection_format`,
    from the parsed file's tensor index; no tensor is read), and float ("none") for a checkpoint that is not a
    GGUF (reader None)."""
    if quantization != "auto":
        return quantization
    return projection_format(reader.tensors) if reader is not None else "none"


def projection_format(tensors: Iterable[gguf.ReaderTensor], native: bool | None = None) -> str:
    """The weight format that serves a file's decoder projections as stored. With shoal's native kernels
    (`native`, by default whether they are built): "gguf" when any is quantized, every tensor in its own type
    (model/formats.py). Without them, torch's weight-only kernels: "int4" when every one is Q4_0/Q4_1,
    "int8" when every one is Q8_0 (re-scaled per output row: torch's kernel has one scale per row). Else
    "none": float, for F16/BF16/F32, and for the other types without the native kernels."""
    kinds = {t.tensor_type for t in tensors if _is_projection(hf_tensor_name(t.name))}
    if native is None:
        native = kernels.available()
    if native and any(is_quantized(k) for k in kinds):
        return "gguf"
    if kinds and kinds <= set(Q4_TYPES):
        return "int4"
    if kinds == {gguf.GGMLQuantizationType.Q8_0}:
        return "int8"
    return "none"


def _is_projection(hf_name: str | None) -> bool:
    return bool(hf_name) and hf_name.endswith(".weight") and hf_name.split(".")[-2] in PROJECTIONS


# What "gguf" keeps in its file's types besides the projections: the embedding table and the logits head.
TABLES = ("model.embed_tokens.weight", "lm_head.weight")


# ---------------------------------------------------------------- weights


def hf_tensor_name(gguf_name: str, arch: ArchSpec | None = None) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight` (in `arch`'s names, where it has its own);
    None if unknown."""
    base, _, suffix = gguf_name.rpartition(".")  # suffix: "weight" or "bias"
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        hf = (arch.block_tensors() if arch is not None else BLOCK_TENSORS).get(part)
        return f"model.layers.{layer}.{hf}.{suffix}" if hf else None
    hf = TOP_TENSORS.get(base)
    return f"{hf}.{suffix}" if hf else None


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf's `LlamaModel.permute` on q/k rows (weight or bias).

    HF's rotary embedding pairs dimension i of a head with i + d/2 (rotate_half);
    ggml's pairs 2i with 2i + 1. The converter regroups each head's d rows as
    `w.reshape(n_head, 2, d // 2, ...).swapaxes(1, 2)`, i.e. GGUF row (h, i, half)
    holds HF row (h, half, i). Reading the rows as (h, i, half) and swapping back
    restores HF order. `n_head` is the number of heads in *this* tensor (kv heads for k).
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def dequantize(tensor: gguf.ReaderTensor) -> torch.Tensor:
    """One GGUF tensor as float32 in HF's (out_features, in_features) order.

    GGUF lists dims fastest-first (ne0 = in_features); the reader already exposes
    the data row-major as (ne1, ne0), and `gguf.quants.dequantize` keeps that.
    """
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    if not values.flags.writeable:  # F32 comes back as a view of the read-only map
        values = values.copy()
    expected = tuple(int(n) for n in reversed(tensor.shape))
    if values.shape != expected:
        raise ValueError(f"{tensor.name}: dequantized to {values.shape}, expected {expected}")
    return torch.from_numpy(values)


Q4_BLOCK = 32


def q4_codes(tensor: gguf.ReaderTensor) -> Q4Codes | None:
    """The codes and group scales of a Q4_0 or Q4_1 tensor (ggml's block layout); None for other types.

    A block is its float16 scale (and, for Q4_1, minimum), then 16 bytes whose
    low nibbles are codes 0-15 of the block and high nibbles codes 16-31.
    """
    kind = tensor.tensor_type
    if kind not in Q4_TYPES:
        return None
    rows, cols = (int(n) for n in reversed(tensor.shape))
    head = 4 if kind == gguf.GGMLQuantizationType.Q4_1 else 2
    blocks = np.asarray(tensor.data).reshape(rows, cols // Q4_BLOCK, head + Q4_BLOCK // 2)
    halves = blocks[..., :head].copy().view(np.float16).astype(np.float32)  # [rows, groups, 1 or 2]
    packed = blocks[..., head:]
    codes = np.concatenate((packed & 0x0F, packed >> 4), axis=-1).reshape(rows, cols)
    scale = halves[..., 0]
    low = halves[..., 1] if head == 4 else -8.0 * scale
    return Q4Codes(torch.from_numpy(codes), torch.from_numpy(np.ascontiguousarray(scale)), torch.from_numpy(np.ascontiguousarray(low)))


@dataclass
class TensorPart:
    """Part of a GGUF tensor, shaped like a ReaderTensor for `dequantize` and `q4_codes`."""

    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: fastest dimension first
    data: np.ndarray


def tensor_part(tensor: gguf.ReaderTensor, dim: int, start: int, length: int) -> TensorPart | None:
    """Rows (dim 0) or columns (dim 1, in HF's [out, in] order) [start, start + length) of a tensor,
    read from the file's data without dequantizing the rest; None for columns that cut a quantization block."""
    shape = tuple(int(n) for n in tensor.shape)
    data = tensor.data
    if dim == 0:
        return TensorPart(tensor.name, tensor.tensor_type, (*shape[:-1], length) if len(shape) > 1 else (length,), data[start : start + length])
    block, type_size = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
    if start % block or length % block:
        return None
    # a quantized tensor's data holds each row's blocks as bytes; a float one's, its elements
    a, n = (start // block * type_size, length // block * type_size) if block > 1 else (start, length)
    return TensorPart(tensor.name, tensor.tensor_type, (length, *shape[1:]), np.ascontiguousarray(data[:, a : a + n]))


def expert_parts(name: str, tensor):
    """(HF name, tensor) pairs of one file tensor: itself, or for a stacked experts' tensor (`mlp.experts.up_proj`,
    GGUF shape [cols, rows, experts]) each expert's [rows, cols] part under its own name (`mlp.experts.E.up_proj`),
    a view of the file's blocks."""
    if ".mlp.experts." not in name:
        yield name, tensor
        return
    shape = tuple(int(n) for n in tensor.shape)
    if len(shape) != 3:
        raise ValueError(f"{tensor.name}: an experts' tensor of shape {shape}, not [cols, rows, experts]")
    data = np.asarray(tensor.data).reshape(shape[2], shape[1], -1)
    for e in range(shape[2]):
        yield name.replace(".mlp.experts.", f".mlp.experts.{e}."), TensorPart(tensor.name, tensor.tensor_type, shape[:2], data[e])


def _rows(tensor) -> int:
    """Output rows (HF's first dimension) of a GGUF tensor or part, whose shape lists the fastest dimension first."""
    return int(tensor.shape[-1])


def load_state_dict(
    tensors: Iterable[gguf.ReaderTensor],
    arch: ArchSpec,
    config: transformers.PretrainedConfig,
    dtype: torch.dtype,
    progress: bool,
    weight_format: str = "none",
    select=None,
) -> dict[str, torch.Tensor | Q4Codes | QuantTensor]:
    """Rename and (for llama) un-permute every tensor of the file: dequantized to `dtype`,
    or for the projections of a low-bit `weight_format` as the layers take them (see load_gguf)."""
    tensors = [t for t in tensors if t.name not in CONFIG_ONLY_TENSORS]
    unknown = [t.name for t in tensors if hf_tensor_name(t.name, arch) is None]
    if unknown:
        raise ValueError(f"GGUF tensors with no known Hugging Face name: {unknown[:8]}")
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    state_dict = {}
    named = ((name, part) for tensor in tensors for name, part in expert_parts(hf_tensor_name(tensor.name, arch), tensor))
    total = sum(int(t.shape[-1]) if len(t.shape) == 3 else 1 for t in tensors)  # an experts' tensor: each expert's part
    for name, tensor in tqdm(named, total=total, desc="Loading GGUF tensors", unit="tensor", disable=not progress, file=sys.stderr):
        proj = name.split(".")[-2]  # "q_proj" in model.layers.0.self_attn.q_proj.weight
        lowbit = weight_format != "none" and _is_projection(name)
        rows = _rows(tensor)
        where = select(name) if select is not None else None
        if where is False:  # another pipeline stage's: never read
            continue
        if where is not None:
            tensor = tensor_part(tensor, *where) or tensor
        # the permutation is per head, so a slice of whole heads un-permutes with its own head count
        n_head = heads.get(proj, 0) * _rows(tensor) // rows
        if weight_format == "gguf" and is_quantized(tensor.tensor_type) and (lowbit or name in TABLES):
            value = QuantTensor.of(tensor)
            if arch.qk_permuted and proj in heads:
                value = value.permute_rows(partial(unpermute_qk, n_head=n_head))
        elif lowbit and weight_format == "int4" and tensor.tensor_type in Q4_TYPES:
            value = q4_codes(tensor)
            if arch.qk_permuted and proj in heads:
                value = value.permute_rows(partial(unpermute_qk, n_head=n_head))
        else:
            value = dequantize(tensor)
            if arch.qk_permuted and proj in heads:
                value = unpermute_qk(value, n_head)
            if arch.norm_shift and name.endswith("norm.weight"):
                value = value - arch.norm_shift  # in float32, before any rounding to dtype (see GEMMA_TENSORS)
            if not lowbit:  # a projection to be rounded stays float32 until its layer rounds it
                value = value.to(dtype)
        state_dict[name] = value
    return state_dict


# ---------------------------------------------------------------- config


def build_config(
    meta: dict[str, Any], tensors: dict[str, gguf.ReaderTensor], tokenizer
) -> transformers.PretrainedConfig:
    """The transformers config the file's `{arch}.*` metadata describes."""
    arch = meta["general.architecture"]
    spec = ARCHS[arch]
    kwargs = {attr: meta[f"{arch}.{key}"] for key, attr in HPARAMS.items() if f"{arch}.{key}" in meta}
    hidden, heads = kwargs["hidden_size"], kwargs["num_attention_heads"]
    kwargs.setdefault("num_key_value_heads", heads)
    # Qwen3's head_dim is not hidden/heads; the converter writes it as key_length.
    # For llama the rotary dimension is the head dimension.
    head_dim = (
        meta.get(f"{arch}.attention.key_length") or (spec.rope_dims_are_head_dim and meta.get(f"{arch}.rope.dimension_count"))
        or hidden // heads
    )
    embed = tensors["token_embd.weight"]
    kwargs.update(
        head_dim=head_dim,
        # GGUF lists dims fastest-first, so (hidden, vocab): the last is the vocabulary.
        # (The metadata's vocab_size is optional; the embedding is not.)
        vocab_size=int(embed.shape[-1]),
        tie_word_embeddings="output.weight" not in tensors,
        rope_parameters=rope_parameters(meta, arch, head_dim, tensors),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if arch == "qwen2vl":
        kwargs["rope_parameters"]["mrope_section"] = mrope_section(meta, arch)
    if not spec.fixed_qkv_bias:
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in tensors
    if arch == "llama":
        kwargs["mlp_bias"] = "blk.0.ffn_up.bias" in tensors
    if arch in FAMILY_CONFIG:
        FAMILY_CONFIG[arch](meta, arch, kwargs, tensors)
    architectures = kwargs.pop("architectures", [spec.model_class])  # a family's config may name another (Mixtral)
    model_type = kwargs.pop("model_type", spec.model_type)
    if spec.config_class is not None:
        config = getattr(transformers, spec.config_class)(**kwargs)
    else:  # see plain_config
        config = plain_config(model_type, **CONFIG_DEFAULTS | kwargs)
    config.architectures = architectures
    return config


def plain_config(model_type: str, **fields) -> transformers.PretrainedConfig:
    """A transformers config holding `fields`, of the base class. The decoder reads fields only (ModelConfig.from_hf,
    the rope functions), and importing a family's own config module pulls in transformers' activations and,
    through them, torch.distributed.tensor: a second of every start."""
    config = transformers.PretrainedConfig(**fields)
    config.model_type = model_type
    return config


def rope_parameters(
    meta: dict[str, Any], arch: str, head_dim: int, tensors: dict[str, gguf.ReaderTensor]
) -> dict[str, Any]:
    """transformers 5 `rope_parameters` from llama.cpp's rope metadata."""
    theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if scaling == "linear" and factor:
        params.update(rope_type="linear", factor=float(factor))
    elif scaling == "yarn" and factor:
        params.update(rope_type="yarn", factor=float(factor))
        optional = {
            "original_context_length": "original_max_position_embeddings",
            "yarn_beta_fast": "beta_fast",
            "yarn_beta_slow": "beta_slow",
            "attn_factor": "attention_factor",
        }
        prefix = f"{arch}.rope.scaling."
        params.update({hf: meta[prefix + k] for k, hf in optional.items() if prefix + k in meta})
    elif scaling != "none":
        log.warning("GGUF rope scaling %r is not supported; using plain rope", scaling)
    if "rope_freqs.weight" in tensors:
        positions = int(meta.get(f"{arch}.context_length", 131072))
        params = llama3_rope_parameters(dequantize(tensors["rope_freqs.weight"]), theta, head_dim, positions) or params
    return params


def phi3_config(meta: dict[str, Any], arch: str, kwargs: dict[str, Any], tensors: dict[str, gguf.ReaderTensor]) -> None:
    """Phi-3's fields from what Phi3MiniModel writes: the rotated part of the head (`rope.dimension_count`), LongRoPE
    from the factor tensors and the original context, and a window where `attention.sliding_window` is not 0."""
    head_dim = kwargs["head_dim"]
    fraction = meta.get(f"{arch}.rope.dimension_count", head_dim) / head_dim
    params = kwargs["rope_parameters"]
    if "rope_factors_long.weight" in tensors:
        params = {"rope_type": "longrope", "rope_theta": params["rope_theta"],
                  "long_factor": dequantize(tensors["rope_factors_long.weight"]).tolist(),
                  "short_factor": dequantize(tensors["rope_factors_short.weight"]).tolist(),
                  "original_max_position_embeddings": int(meta[f"{arch}.rope.scaling.original_context_length"])}
    params["partial_rotary_factor"] = fraction
    window = int(meta.get(f"{arch}.attention.sliding_window", 0))
    kwargs.update(rope_parameters=params, partial_rotary_factor=fraction, sliding_window=window or None)


# llama.cpp's Gemma defaults (src/models/gemma2.cpp, gemma3.cpp): the local layers' pattern (every 2nd / 6th layer
# global), Gemma 2's window and softcaps where a file names none, and the local rope base of Gemma 3.
GEMMA_PATTERN = {"gemma2": 2, "gemma3": 6}
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def gemma_config(meta: dict[str, Any], arch: str, kwargs: dict[str, Any], tensors: dict[str, gguf.ReaderTensor]) -> None:
    """Gemma 2 / 3 fields from what Gemma2Model / Gemma3Model write, read as llama.cpp reads them."""
    layers, hidden, heads = kwargs["num_hidden_layers"], kwargs["hidden_size"], kwargs["num_attention_heads"]
    window = int(meta.get(f"{arch}.attention.sliding_window", 4096 if arch == "gemma2" else 0))
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", GEMMA_PATTERN[arch])
    if isinstance(pattern, list):  # one flag per layer
        local = [bool(p) for p in pattern]
    else:  # llama.cpp's set_swa_pattern: the last layer of every `pattern` is global
        local = [pattern == 0 or i % pattern < pattern - 1 for i in range(layers)]
    if not window:
        local = [False] * layers
    types = ["sliding_attention" if s else "full_attention" for s in local]
    # llama.cpp scales scores by 1/sqrt(head_dim), but by 1/sqrt(hidden / heads) for the 27B models, as Google's own code
    scalar = hidden // heads if layers == GEMMA_27B_LAYERS[arch] else kwargs["head_dim"]
    caps = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0} if arch == "gemma2" else \
        {"attn_logit_softcapping": None, "final_logit_softcapping": None}
    caps = {k: meta.get(f"{arch}.{k}", v) for k, v in caps.items()}
    rope = kwargs["rope_parameters"]
    if arch == "gemma3":  # the global layers' base and scaling; the local ones' base apart (10k unless the file says)
        if f"{arch}.rope.freq_base" not in meta:
            rope["rope_theta"] = 1_000_000.0
        local_theta = float(meta.get(f"{arch}.rope.freq_base_swa", 10000.0))
        rope = {"full_attention": rope, "sliding_attention": {"rope_type": "default", "rope_theta": local_theta}}
    kwargs.update(layer_types=types, sliding_window=window or None, query_pre_attn_scalar=scalar, rope_parameters=rope,
                  hidden_activation="gelu_pytorch_tanh", hidden_act="gelu_pytorch_tanh", use_bidirectional_attention=False, **caps)


def experts_config(meta: dict[str, Any], arch: str, kwargs: dict[str, Any], tensors: dict[str, gguf.ReaderTensor]) -> None:
    """A sparse MLP's counts and width (`{arch}.expert_count`, `expert_used_count`, `expert_feed_forward_length`).
    llama.cpp renormalizes the chosen experts' weights for qwen3moe and Mixtral, not for olmoe (build_moe_ffn's
    norm_w in src/models/*.cpp); a layer without a router is dense (Qwen3-MoE's mlp_only_layers). A `llama` file
    with experts is Mixtral (convert_hf_to_gguf writes it so)."""
    experts = int(meta.get(f"{arch}.expert_count", 0) or 0)
    if not experts:
        return
    used = int(meta.get(f"{arch}.expert_used_count", 0) or 0)
    layers = int(kwargs["num_hidden_layers"])
    if arch == "llama":
        kwargs.update(num_local_experts=experts, num_experts_per_tok=used, architectures=["MixtralForCausalLM"], model_type="mixtral")
        return
    width = meta.get(f"{arch}.expert_feed_forward_length") or kwargs.get("intermediate_size")
    kwargs.setdefault("intermediate_size", width)
    kwargs.update(num_experts=experts, num_experts_per_tok=used, moe_intermediate_size=int(width), norm_topk_prob=arch != "olmoe",
                  decoder_sparse_step=1, mlp_only_layers=[i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors])
    if arch == "olmoe":
        kwargs["clip_qkv"] = meta.get(f"{arch}.attention.clamp_kqv")


FAMILY_CONFIG = {"phi3": phi3_config, "gemma2": gemma_config, "gemma3": gemma_config, "qwen3moe": experts_config, "olmoe": experts_config,
                 "llama": experts_config}


def mrope_section(meta: dict[str, Any], arch: str) -> list[int]:
    """HF's `mrope_section` (time, height, width) from llama.cpp's `{arch}.rope.dimension_sections`.

    Both count rotary frequency pairs ([16, 24, 24] of a 128-wide head); convert_hf_to_gguf pads HF's three
    sections with zeros to the four llama.cpp keeps (TextModel.set_gguf_parameters).
    """
    key = f"{arch}.rope.dimension_sections"
    if key not in meta:
        raise ValueError(f"a {arch!r} GGUF needs {key} (its M-RoPE sections); this file has none")
    sections = [int(n) for n in meta[key]]
    if len(sections) != 4 or sections[3] != 0:
        raise ValueError(f"{key} = {sections}: expected three sections and a zero, as llama.cpp writes Qwen2-VL's")
    return sections[:3]


def llama3_rope_parameters(freq_factors: torch.Tensor, theta: float, head_dim: int, positions: int) -> dict[str, Any] | None:
    """HF "llama3" rope parameters that reproduce llama.cpp's `rope_freqs.weight`, or None.

    llama.cpp stores Llama 3.1-style scaling as one divisor per rotary frequency
    (LlamaModel.generate_extra_tensors) instead of HF's four parameters. The largest
    divisor is `factor`; Meta used low 1, high 4 and an original context of 8192
    for every release, so we take those and check by recomputing with transformers.
    """
    params = {
        "rope_type": "llama3",
        "rope_theta": theta,
        "factor": float(freq_factors.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = plain_config("llama", head_dim=head_dim, rope_parameters=params, max_position_embeddings=positions)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    plain = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    if torch.allclose(plain / scaled, freq_factors.float(), rtol=1e-4):
        return params
    log.warning("GGUF rope_freqs do not match Llama 3 rope scaling; ignoring them")
    return None


# ---------------------------------------------------------------- tokenizer

# llama.cpp's token_type values (gguf.TokenType).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED = 1, 2, 3, 4

# The split regexes of the original tokenizer.json files, by `tokenizer.ggml.pre`,
# following llama.cpp's table (llama-vocab.cpp, llm_tokenizer_bpe): a list is applied
# in order, each isolating its matches, before byte-level mapping. llama.cpp rewrites
# `(?i:...)` for its own regex engine; `tokenizers` takes the originals.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS: dict[str, list[str]] = {
    **dict.fromkeys(["gpt-2", "phi-2", "roberta-bpe", "mpt", "olmo", "jais"], [_GPT2]),
    # single digits first, then GPT-2's split (SmolLM's tokenizer.json: Digits + ByteLevel)
    **dict.fromkeys(["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"], [r"\p{N}", _GPT2]),
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe"], [_LLAMA3]),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"], [_QWEN2]),
    "tekken": [_TEKKEN],
    **dict.fromkeys(["gpt-4o", "llama4"], [_GPT4O]),
}
# Pre-types whose original tokenizer.json looks a whole pre-token up in the vocabulary
# before merging (BPE ignore_merges; llama.cpp's tokenizer_ignore_merges).
IGNORE_MERGES_PRE = {"llama3", "llama-v3", "llama-bpe", "falcon3", "tekken"}

_SPECIAL_IDS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def build_tokenizer(meta: dict[str, Any]) -> transformers.PreTrainedTokenizerFast:
    """The tokenizer the file's `tokenizer.*` metadata describes.

    Special tokens and BOS/EOS follow transformers' GGUF conversion: bos/eos/unk/pad
    are the tokens at the file's ids, `add_bos_token` is the file's flag (default:
    on for SentencePiece vocabularies, off for byte-level BPE, as llama.cpp does).

    Why not transformers' `convert_gguf_tokenizer` (5.24, measured for issue 57): it
    gives the same ids on SmolLM2's and the tests' files, but ignores
    `add_space_prefix = false`, never sets `ignore_merges` (Llama 3's pre-types),
    splits "smollm" files like GPT-2, lists no CONTROL token in `all_special_ids`
    (which the detokenizer skips), costs 0.25-0.6 s of imports on first use, and
    builds in 1.5x the time of this.
    """
    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if kind == "gpt2":
        backend = byte_level_bpe(meta, tokens)
    elif kind == "llama":
        backend = sentencepiece_bpe(meta, tokens)
    else:
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (supported: 'gpt2', 'llama')")
    control = add_gguf_added_tokens(backend, tokens, types, byte_level=kind == "gpt2")
    specials = {name: tokens[meta[key]] for name, key in _SPECIAL_IDS.items() if key in meta}
    return wrap_backend(
        backend,
        **specials,
        additional_special_tokens=control,
        add_bos_token=meta.get("tokenizer.ggml.add_bos_token", kind == "llama"),
        add_eos_token=meta.get("tokenizer.ggml.add_eos_token", False),
        chat_template=meta.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
    )


def wrap_backend(backend: Tokenizer, **kwargs) -> transformers.PreTrainedTokenizerFast:
    """transformers' fast tokenizer over `backend`, taking it as it is.

    `PreTrainedTokenizerFast(tokenizer_object=backend)` deep-copies the backend, a
    JSON round trip of the whole vocabulary: 0.3-0.4 s of 0.8 s for 128k tokens. The
    wrapper keeps a backend that is already in place, as transformers' own
    tokenizer classes do (GPT2Tokenizer sets `_tokenizer`, then runs `__init__`).
    """
    tokenizer = transformers.PreTrainedTokenizerFast.__new__(transformers.PreTrainedTokenizerFast)
    tokenizer._tokenizer = backend
    tokenizer.__init__(**kwargs)
    return tokenizer


def _merges(meta: dict[str, Any]) -> list[tuple[str, str]] | None:
    merges = meta.get("tokenizer.ggml.merges")
    return [tuple(m.split(" ", 1)) for m in merges] if merges else None


def byte_level_bpe(meta: dict[str, Any], tokens: list[str]) -> Tokenizer:
    """GPT-2-style byte-level BPE: split by the pre-type's regexes, map bytes to
    printable characters, merge; decode maps back."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    # Tokens are stored already spelled in GPT-2's byte alphabet; a few files hold
    # an added token with raw characters (e.g. a plain space), which we respell the
    # way transformers' conversion does so the vocabulary stays consistent. Checking
    # all the characters at once first is 3x faster than token by token.
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    if set("".join(tokens)) <= alphabet:
        vocab = dict(zip(tokens, range(len(tokens))))
    else:
        vocab = {
            (t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i
            for i, t in enumerate(tokens)
        }
    pre = meta.get("tokenizer.ggml.pre", "default")
    model = models.BPE(
        vocab=vocab, merges=_merges(meta) or [], fuse_unk=False, ignore_merges=pre in IGNORE_MERGES_PRE
    )
    tok = Tokenizer(model)
    splits = PRE_TOKENIZER_SPLITS.get(pre)
    if splits is None:
        # transformers falls back to plain GPT-2 splitting for unknown pre-types too.
        log.warning("unknown GGUF pre-tokenizer %r; splitting like GPT-2", pre)
        splits = [_GPT2]
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def sentencepiece_bpe(meta: dict[str, Any], tokens: list[str]) -> Tokenizer:
    """A SentencePiece BPE vocabulary (Llama 1/2, Mistral v0.1...), built the way
    transformers' LlamaTokenizer is: "▁" for spaces, byte fallback, merges
    recovered from the token scores when the file has none."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = _merges(meta)
    if merges is None:
        from transformers.tokenization_utils_base import generate_merges

        merges = generate_merges(vocab, dict(zip(tokens, meta["tokenizer.ggml.scores"])))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True))
    prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(content=" ", left=1)] if prefix else []))
    return tok


def add_gguf_added_tokens(tok: Tokenizer, tokens: list[str], types: list[int], byte_level: bool) -> list[str]:
    """Make CONTROL tokens special and USER_DEFINED ones whole-matched added tokens.

    Without this `<|im_start|>` would be cut into pieces. Like transformers, a byte-
    level token marked CONTROL that is not spelled in the byte alphabet is a
    llama.cpp mislabel and is skipped. Returns the control tokens' strings.
    """
    alphabet = set(pre_tokenizers.ByteLevel.alphabet()) if byte_level else None
    control = [
        t for t, kind in zip(tokens, types) if kind == CONTROL and (alphabet is None or set(t) <= alphabet)
    ]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    # Looked up one by one: `get_vocab()` would copy the whole vocabulary into a dict (0.08 s for 128k tokens).
    user = [t for t, kind in zip(tokens, types) if kind == USER_DEFINED and tok.token_to_id(t) is not None]
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    return control
