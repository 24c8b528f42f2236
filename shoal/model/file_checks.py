"""Model files checked before they are used: a bad file is one line that names it and what is wrong.

A model file comes from outside (a download, a copy cut short, a hostile upload to a models folder), and every
count, offset and dimension in it is a claim. The readers (gguf_loader.GGUFFileReader, loader.load_safetensors,
the mmproj reader, which is a GGUF reader) check each claim against the file's real length before they act on
it, so a lie costs an error, never an allocation of gigabytes or a loop over 2^40 entries. What is checked
here is plain arithmetic, so it imports no torch and no numpy:

* `check_spans`: tensors' byte ranges inside the file's length, aligned, and not overlapping;
* `check_safetensors_header`: a safetensors header's length, JSON, dtypes, shapes and offsets;
* `check_config`: a config's layer count and sizes against the checkpoint's own tensor shapes, before the
  model those sizes describe is allocated.

The limits follow llama.cpp's gguf.cpp where it has one (four dimensions, no arrays of arrays) and are far
above any real model's otherwise: Gemma 3's vocabulary, the largest shipped, has 262,144 entries.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path


class ModelFileError(ValueError):
    """A model file that is not what it claims to be. The message names the file and what is wrong, in one line."""

    def __init__(self, path: str | Path, what: str) -> None:
        super().__init__(f"{Path(path).name}: {what}")


MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
MAX_ARRAY_ENTRIES = 1 << 21  # one metadata array (a vocabulary, its scores, its merges)
MAX_METADATA_ENTRIES = 1 << 22  # every array's entries together: each costs a Python object when read
MAX_STRING_BYTES = 64 << 20  # one metadata string (a chat template, an embedded tokenizer.json)
SAFETENSORS_MAX_HEADER = 100 << 20  # the safetensors library's own limit


def in_words(n: int) -> str:
    """A count as people read it: 1,048,576, or 2^40 where it is an exact power of two over a million."""
    if n > 1 << 20 and n & (n - 1) == 0:
        return f"2^{n.bit_length() - 1}"
    return f"{n:,}"


def first_line(e: BaseException) -> str:
    """A library's exception in one short line, for a ModelFileError's parenthesis (some run to pages)."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


def truncated(path: str | Path, what: str, start: int, end: int, size: int) -> ModelFileError:
    return ModelFileError(path, f"truncated: {what} needs bytes {start:,}–{end:,}, the file has {size:,}")


@dataclass(frozen=True)
class Span:
    name: str  # the tensor's name in the file
    start: int  # absolute byte offsets in the file, end exclusive
    end: int


def check_spans(path: str | Path, spans: Iterable[Span], size: int, alignment: int = 1, base: int = 0) -> None:
    """Every tensor's bytes inside the file, starting on `alignment` (relative to `base`, where the data
    section starts), and no two tensors sharing a byte."""
    ordered = sorted(spans, key=lambda s: (s.start, s.end))
    for s in ordered:
        if s.start < base or s.end < s.start:
            raise ModelFileError(path, f"tensor {s.name} has a negative offset or size")
        if (s.start - base) % alignment:
            raise ModelFileError(path, f"tensor {s.name} starts at byte {s.start:,}, not on the file's {alignment}-byte alignment")
        if s.end > size:
            raise truncated(path, f"tensor {s.name}", s.start, s.end, size)
    for a, b in zip(ordered, ordered[1:]):
        if b.start < a.end and b.end > b.start and a.end > a.start:
            raise ModelFileError(path, f"tensors {a.name} and {b.name} overlap (bytes {b.start:,}–{min(a.end, b.end):,})")


# ---------------------------------------------------------------- safetensors

SAFETENSORS_DTYPES = {  # bytes per element (sub-byte float types take a whole byte each in safetensors' count)
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8,
}


def check_safetensors_header(path: str | Path) -> dict[str, tuple[int, ...]]:
    """A safetensors file's header checked against its length: its tensors' shapes by name.

    The format is an 8-byte little-endian header length, a JSON object {name: {dtype, shape, data_offsets}}
    (and an optional "__metadata__" of strings), then the data; offsets are relative to the data's start.
    The safetensors library checks the same things; this names the tensor and the numbers when one fails."""
    path = Path(path)
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelFileError(path, f"not a safetensors file: {size} bytes, shorter than its 8-byte header length")
        (length,) = struct.unpack("<Q", head)
        if length > SAFETENSORS_MAX_HEADER:
            raise ModelFileError(path, f"not a safetensors file: a header of {in_words(length)} bytes "
                                       f"(safetensors allows {in_words(SAFETENSORS_MAX_HEADER)})")
        if 8 + length > size:
            raise truncated(path, "the header", 8, 8 + length, size)
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        raise ModelFileError(path, "not a safetensors file: its header is not JSON") from None
    if not isinstance(header, dict):
        raise ModelFileError(path, "not a safetensors file: its header is not a JSON object")
    data_start, shapes, spans = 8 + length, {}, []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict) or entry.get("dtype") not in SAFETENSORS_DTYPES:
            raise ModelFileError(path, f"tensor {name} has no known dtype ({_shown(entry)})")
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise ModelFileError(path, f"tensor {name} has a malformed shape {_shown(shape)}")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)):
            raise ModelFileError(path, f"tensor {name} has malformed data_offsets {_shown(offsets)}")
        need = math.prod(shape) * SAFETENSORS_DTYPES[entry["dtype"]]
        if offsets[1] - offsets[0] != need:
            raise ModelFileError(path, f"tensor {name}: shape {shape} of {entry['dtype']} is {in_words(need)} bytes, "
                                       f"but its data_offsets span {in_words(offsets[1] - offsets[0])}")
        shapes[name] = tuple(shape)
        spans.append(Span(name, data_start + offsets[0], data_start + offsets[1]))
    check_spans(path, spans, size, base=data_start)
    return shapes


def _shown(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ---------------------------------------------------------------- config against tensors

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_VISION = ("visual.", "vision_model.", "vision_tower.", "connector.", "multi_modal_projector.")


@dataclass(frozen=True)
class Described:
    """What a config says of the decoder's sizes (ModelConfig's fields, as plain numbers)."""
    num_layers: int
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    q_rows: int  # num_heads * head_dim
    kv_rows: int  # num_kv_heads * head_dim


def check_config(path: str | Path, described: Described, shapes: Mapping[str, tuple[int, ...]]) -> None:
    """The config's sizes against the checkpoint's tensor shapes (HF names, the whole checkpoint's index, no
    data read), so a config that lies is refused before the model it describes is allocated."""
    d = described
    for field in ("num_layers", "vocab_size", "hidden_size", "intermediate_size", "q_rows", "kv_rows"):
        if getattr(d, field) <= 0:
            raise ModelFileError(path, f"the config gives {field.replace('_', ' ')} {getattr(d, field)}")
    text = {n: s for n, s in shapes.items() if not any(v in n for v in _VISION)}
    layers = {int(m.group(1)) for n in text if (m := _LAYER.search(n))}
    if layers and max(layers) + 1 != d.num_layers:
        raise ModelFileError(path, f"the config says {in_words(d.num_layers)} layers, the checkpoint's tensors have "
                                   f"{max(layers) + 1}")

    def expect(suffix: str, want: tuple[int, ...], what: str) -> None:
        for name, shape in text.items():
            if name.endswith(suffix) and tuple(shape) != want:
                raise ModelFileError(path, f"the config's {what} gives {name} the shape {_dims(want)}, the checkpoint "
                                           f"holds {_dims(shape)}")

    expect("embed_tokens.weight", (d.vocab_size, d.hidden_size), "vocabulary and hidden size")
    expect("layers.0.self_attn.q_proj.weight", (d.q_rows, d.hidden_size), "heads and head size")
    expect("layers.0.self_attn.k_proj.weight", (d.kv_rows, d.hidden_size), "key-value heads and head size")
    expect("layers.0.mlp.down_proj.weight", (d.hidden_size, d.intermediate_size), "intermediate size")


def _dims(shape: Iterable[int]) -> str:
    return " x ".join(in_words(int(x)) for x in shape)
