"""How a checkpoint says it embeds: sentence-transformers' modules in a Hugging Face folder, or a GGUF's
`{arch}.pooling_type`. Plain file reading; the answer is a `types.Pooling` (or None: the files name no pooling).

sentence-transformers' layout (Qwen3-Embedding's, all-MiniLM's, bge's):

    modules.json            [{"path": "", "type": "sentence_transformers.models.Transformer"},
                             {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                             {"path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    1_Pooling/config.json   {"pooling_mode_lasttoken": true, ...} (or, newer, {"pooling_mode": "lasttoken"})

A GGUF's pooling_type is llama.cpp's enum: 0 none, 1 mean, 2 cls, 3 last, 4 rank; llama.cpp's server
L2-normalizes what it pools (embd_normalize 2, its default), and so does shoal.
"""

from __future__ import annotations

import json
from pathlib import Path

from shoal.types import Pooling

ST_MODES = {"lasttoken": "last", "mean_tokens": "mean", "mean": "mean", "cls_token": "cls", "cls": "cls",
            "max_tokens": "max", "max": "max", "mean_sqrt_len_tokens": "mean_sqrt_len", "weightedmean_tokens": "weightedmean"}
GGUF_POOLING = {1: "mean", 2: "cls", 3: "last", 4: "rank"}  # llama.cpp's llama_pooling_type (0: none)
SUPPORTED = ("last", "mean")


def read_pooling(path: Path, gguf_metadata: dict | None, hidden_size: int, hf_config=None) -> Pooling | None:
    """The pooling a checkpoint's files name, None where they name none. ValueError for one shoal cannot serve
    (CLS pooling of an encoder, a Dense module, ...), naming it."""
    if gguf_metadata is not None:
        arch = gguf_metadata.get("general.architecture")
        kind = gguf_metadata.get(f"{arch}.pooling_type")
        if kind is None or int(kind) == 0:
            return None
        mode = GGUF_POOLING.get(int(kind), f"type {kind}")
        return _checked(Pooling(mode, True, hidden_size), f"{path.name}'s {arch}.pooling_type", arch in ("bert", "nomic-bert"))
    modules_file = Path(path) / "modules.json"
    if not modules_file.is_file():
        return None
    modules = json.loads(modules_file.read_text())
    mode, normalize = None, False
    for m in modules:
        kind = str(m.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Transformer":
            continue
        if kind == "Pooling":
            mode = _st_mode(json.loads((Path(path) / m.get("path", "") / "config.json").read_text()))
        elif kind == "Normalize":
            normalize = True
        else:
            raise ValueError(f"{modules_file}: sentence-transformers' {kind} module is not supported (shoal serves "
                             "Transformer, Pooling and Normalize)")
    if mode is None:
        return None
    dims = getattr(hf_config, "matryoshka_dimensions", None) if hf_config is not None else None
    encoder = bool({"BertModel", "NomicBertModel"} & set(getattr(hf_config, "architectures", None) or []))
    return _checked(Pooling(mode, normalize, hidden_size, tuple(int(d) for d in dims) if dims else None), str(modules_file),
                    encoder)


def max_seq_length(path: Path) -> int | None:
    """sentence-transformers' `max_seq_length` (sentence_bert_config.json): the longest input the model was trained
    to embed (all-MiniLM's 256, of BERT's 512 positions); None where the folder names none."""
    file = Path(path) / "sentence_bert_config.json"
    if not file.is_file():
        return None
    try:
        n = json.loads(file.read_text()).get("max_seq_length")
    except (ValueError, AttributeError):
        raise ValueError(f"{file.name}: not a JSON object") from None
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise ValueError(f"{file.name}: max_seq_length must be a positive integer, not {n!r}")
    return n


def _st_mode(config: dict) -> str:
    """A sentence-transformers Pooling module's mode: `pooling_mode`, or the one `pooling_mode_*` flag set."""
    if "pooling_mode" in config:
        return ST_MODES.get(config["pooling_mode"], config["pooling_mode"])
    on = [k.removeprefix("pooling_mode_") for k, v in config.items() if k.startswith("pooling_mode_") and v is True]
    if len(on) != 1:
        raise ValueError(f"the Pooling module sets {len(on)} pooling modes ({', '.join(on) or 'none'}); shoal serves exactly one")
    return ST_MODES.get(on[0], on[0])


def _checked(pooling: Pooling, where: str, encoder: bool = False) -> Pooling:
    if pooling.mode not in SUPPORTED + (("cls",) if encoder else ()):
        raise ValueError(f"{where} asks for {pooling.mode} pooling; shoal pools a decoder's last token or its mean "
                         "(an encoder's CLS pooling needs the BERT family, which shoal does not serve yet)")
    return pooling
