"""GET /api/tags, POST /api/show, GET /api/version: what Ollama's clients ask of a server's models.

A model's details come from its checkpoint's header (a GGUF's metadata and tensor index, a safetensors folder's
headers: no weight is read) and, once it is loaded, from its engine (context length, chat template). /api/show
never loads a model: before a load it says what the file says.
"""

from __future__ import annotations

import asyncio
import math
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path

from shoal import __version__
from shoal.server.errors import bad_request
from shoal.server.ollama.generate import model_name

# The Ollama release whose API these routes follow: clients compare it to decide what they may send.
OLLAMA_API_VERSION = "0.12.0"


def version() -> dict:
    return {"version": OLLAMA_API_VERSION, "shoal_version": __version__}


@lru_cache(maxsize=32)
def _checkpoint(path: str, size: int, mtime: int) -> dict:
    """(format, architecture, parameters, quantization) of a checkpoint, read from its headers."""
    p = Path(path)
    if p.suffix == ".gguf":
        import gguf

        from shoal.model.gguf_loader import GGUFFileReader

        reader = GGUFFileReader(p)  # not loader.open_gguf: that would take the parse a coming load was handed
        field = reader.fields.get("general.file_type")
        try:
            quant = gguf.LlamaFileType(int(field.contents())).name.removeprefix("MOSTLY_") if field is not None else ""
        except ValueError:
            quant = ""
        arch = reader.fields.get("general.architecture")
        return {"format": "gguf", "family": arch.contents() if arch is not None else "",
                "parameters": sum(int(t.n_elements) for t in reader.tensors), "quantization": quant}
    import json

    from shoal.model.file_checks import check_safetensors_header
    from shoal.model.loader import safetensors_files

    params = sum(math.prod(shape) for f in safetensors_files(p) for shape in check_safetensors_header(f).values())
    try:
        config = json.loads((p / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    return {"format": "safetensors", "family": config.get("model_type", ""), "parameters": params,
            "quantization": str(config.get("torch_dtype") or config.get("dtype") or "").upper()}


async def checkpoint(m) -> dict:
    """A model's checkpoint facts (cached by path, size and modification time), or empty ones where it cannot be read."""
    from shoal.model.loader import resolve_model_path

    try:
        path = resolve_model_path(str(m.config.model))
        stat = path.stat()
        info = await asyncio.to_thread(_checkpoint, str(path), stat.st_size, stat.st_mtime_ns)
    except (OSError, ValueError):
        return {"format": "", "family": "", "parameters": 0, "quantization": "", "modified": 0.0}
    return {**info, "modified": stat.st_mtime}


def parameter_size(n: int) -> str:
    """135M, 1.7B, as Ollama writes them."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            value = f"{n / scale:.1f}".removesuffix(".0")
            return f"{value}{unit}"
    return str(n)


def details(m, info: dict) -> dict:
    family = info["family"] or (m.engine.facts.architecture if m.engine is not None else "")
    quant = info["quantization"]
    if m.engine is not None and m.engine.facts.weight_format not in ("none", "gguf", ""):
        quant = m.engine.facts.weight_format.upper()  # rounded when loaded (--quantization)
    return {"parent_model": "", "format": info["format"], "family": family, "families": [family] if family else None,
            "parameter_size": parameter_size(info["parameters"]), "quantization_level": quant}


def _time(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat().replace("+00:00", "Z")


async def tags(state) -> dict:
    out = []
    for m in state.models.models.values():
        info = await checkpoint(m)
        out.append({"name": m.name, "model": m.name, "modified_at": _time(info["modified"]), "size": m.memory,
                    "digest": "", "details": details(m, info)})
    return {"models": out}


def capabilities(m) -> list[str]:
    """completion and tools for every model (a template without tools gets them described in the prompt), vision
    for a model that takes images, thinking where the server splits reasoning out, embedding for a loaded model
    that embeds (its files' pooling, or --embeddings)."""
    caps = ["completion", "tools"]
    if m.takes_images:
        caps.append("vision")
    if m.settings.reasoning_parser is not None:
        caps.append("thinking")
    if m.engine is not None and m.engine.pooling is not None:
        caps.append("embedding")
    return caps


async def show(state, name: str | None) -> dict:
    if not name:
        raise bad_request("model is required", "model")
    m = state.models.find(model_name(state, name))
    info = await checkpoint(m)
    d = details(m, info)
    template = (m.renderer.template_source or "") if m.renderer is not None else ""
    defaults = {**m.generation_defaults, **m.settings.sampling_defaults}
    stop = m.renderer.default_stop if m.renderer is not None else ()
    parameters = "\n".join([*(f"{k} {v}" for k, v in sorted(defaults.items())), *(f'stop "{s}"' for s in stop)])
    model_info = {"general.architecture": d["family"], "general.parameter_count": info["parameters"],
                  "general.basename": Path(str(m.config.model)).stem}
    if m.engine is not None:
        model_info[f"{d['family']}.context_length"] = m.engine.max_model_len
    modelfile = "\n".join([
        f"# Modelfile of {m.name}, as shoal serves it (the template is the model's Jinja chat template)",
        f"FROM {Path(str(m.config.model)).name}",
        *([f'TEMPLATE """{template}"""'] if template else []),
        *(f"PARAMETER {p}" for p in parameters.splitlines()),
    ])
    return {"license": "", "modelfile": modelfile, "parameters": parameters, "template": template, "details": d,
            "model_info": model_info, "capabilities": capabilities(m), "modified_at": _time(info["modified"])}
