"""Checkpoint tensors into a model: HF's names mapped onto the fused projections, and each rank's or pipeline
stage's part chosen, as data (STACKED_PARAMS, SHARDED_PARAMS). The loaders call `stage_name` and `shard_slice`
to read only what a rank holds; `load_weights` copies it in."""

from __future__ import annotations

import torch

from shoal.model.config import ModelConfig

# (fused parameter, checkpoint parameter, shard index): weight-name mapping as data.
STACKED_PARAMS = (
    ("qkv_proj", "q_proj", 0),
    ("qkv_proj", "k_proj", 1),
    ("qkv_proj", "v_proj", 2),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)

# Projections a checkpoint may hold already fused, as the model does (Phi-3's `qkv_proj` and `gate_up_proj`, and
# llama.cpp's `attn_qkv` and phi3 `ffn_up`): read as stored, and cut by rows into the parts above (views, no
# copy), so that a tensor-parallel rank's rows, a low-bit layer's parts and the fused copy take them as they
# take a checkpoint's separate q, k, v. (fused parameter, its parts in row order)
FUSED_PARAMS = (
    ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
    ("gate_up_proj", ("gate_proj", "up_proj")),
)

# Tensor parallelism (runner/shard_plan.py): checkpoint projection -> which of its shard's ranges holds its output rows.
# Every split is by output rows; the attention output and down projections read their whole input, gathered.
SHARDED_PARAMS = (
    ("q_proj", "heads"),
    ("k_proj", "kv_heads"),
    ("v_proj", "kv_heads"),
    ("o_proj", "hidden"),
    ("gate_proj", "intermediate"),
    ("up_proj", "intermediate"),
    ("down_proj", "hidden"),
    ("embed_tokens", "vocab"),  # without pipeline stages (TensorShard.vocab)
    ("lm_head", "vocab"),
)
# An expert's projections (`mlp.experts.E.*`) split as a dense MLP's, by the expert's width; the router stays whole.
EXPERT_SHARDED_PARAMS = (
    ("gate_proj", "experts"),
    ("up_proj", "experts"),
    ("down_proj", "hidden"),
)


@torch.no_grad()
def load_weights(model, state_dict: dict) -> None:
    """Copy HF-named tensors into `model` (a DecoderForCausalLM: all of it, a pipeline stage's layers or a
    tensor-parallel rank's part), fusing the stacked projections; every parameter must be set.

    A projection whose layer loads by parts (a low-bit format, see quant.PartLoader)
    takes its weight through `load_part` (a float tensor or a GGUF's Q4 codes) and
    packs it in `finish_loading`; everything else is copied into its parameter.
    """
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    loaded: set[str] = set()
    renames = model.checkpoint_renames
    for name, tensor in split_fused(state_dict.items(), model.config.hf_config):
        for old, new in renames:
            name = name.replace(old, new)
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        if "rotary_emb" in name:
            continue
        name = stage_name(name, model.layer_range, model.model.embed_tokens is not None)
        if name is None:  # another pipeline stage's
            continue
        if model.shard is not None:
            tensor = _shard_tensor(name, tensor, model.shard, model.head_dim)
        target, shard = name, None
        for fused, part, index in STACKED_PARAMS:
            if f".{part}." in name:
                target, shard = name.replace(f".{part}.", f".{fused}."), index
                break
        owner_name, _, leaf = target.rpartition(".")
        owner = modules.get(owner_name)
        if leaf == "weight" and hasattr(owner, "load_part"):
            owner.load_part(shard or 0, tensor)
            continue
        if not isinstance(tensor, torch.Tensor):  # 4-bit codes for a float layer
            tensor = tensor.dequantized()
        if shard is not None:
            _copy_shard(params[target], tensor, shard, model.config, target.split(".")[-2])
            loaded.add(f"{target}#{shard}")
            continue
        if name not in params:
            raise KeyError(f"checkpoint tensor {name!r} has no place in {type(model).__name__}")
        if params[name].shape != tensor.shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(params[name].shape)}")
        params[name].copy_(tensor)
        loaded.add(name)
    missing = [n for n in params if not _is_loaded(n, loaded)]
    missing += [f"{n}.weight (parts {m.missing_parts()})" for n, m in modules.items() if hasattr(m, "load_part") and m.missing_parts()]
    if missing:
        raise KeyError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    for m in modules.values():  # modules that pack their children's parts themselves (layers.Experts: stacked), first
        if hasattr(m, "pack_parts"):
            m.pack_parts()
    for m in reversed(modules.values()):  # children first: a module's finish sees its parts finished (layers.Experts)
        if hasattr(m, "finish_loading"):
            m.finish_loading()


def split_fused(items, hf_config):
    """(name, tensor) pairs with every stored fused projection (FUSED_PARAMS) cut into its parts by rows: q, k, v
    by the whole model's head counts (hf_config: the decoder's transformers config), gate and up in halves."""
    for name, tensor in items:
        fused = next((f for f in FUSED_PARAMS if f".{f[0]}." in name), None)
        if fused is None:
            yield name, tensor
            continue
        rows = getattr(tensor, "codes", tensor).shape[0]
        if fused[0] == "qkv_proj":
            heads = hf_config.num_attention_heads
            q = heads * (getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads)
            sizes = (q, (rows - q) // 2, (rows - q) // 2)
        else:
            sizes = (rows // 2, rows // 2)
        if sum(sizes) != rows:
            raise ValueError(f"{name}: {rows} rows do not split into {', '.join(fused[1])}")
        start = 0
        for part, size in zip(fused[1], sizes):
            yield name.replace(f".{fused[0]}.", f".{part}."), tensor.narrow(0, start, size)
            start += size


def _shard_tensor(name: str, tensor, shard, head_dim: int):
    """This rank's rows or columns of a checkpoint tensor (SHARDED_PARAMS), unless the loader
    already read only those (`shard_slice`); others whole."""
    where = shard_slice(name, shard, head_dim)
    if where is None:
        return tensor
    dim, start, length = where
    if getattr(tensor, "codes", tensor).shape[dim] == length:  # a Tensor, or a GGUF's Q4Codes
        return tensor
    return tensor.narrow(dim, start, length)


def stage_name(name: str, layers: tuple[int, int], first: bool) -> str | None:
    """`name` renumbered for a pipeline stage holding decoder layers [first, end) (layer i -> i - first),
    or None when the stage does not hold it (another stage's layer; the embedding and head off stage 0)."""
    if name.startswith("model.layers."):
        index, _, rest = name[len("model.layers.") :].partition(".")
        i = int(index)
        return f"model.layers.{i - layers[0]}.{rest}" if layers[0] <= i < layers[1] else None
    if not first and (name.startswith("model.embed_tokens.") or name.startswith("lm_head.")):
        return None
    return name


def shard_slice(name: str, shard, head_dim: int) -> tuple[int, int, int] | None:
    """(dimension, start, length) of tensor-parallel `shard`'s part of checkpoint tensor `name`
    (SHARDED_PARAMS: rows of weights and biases alike), or None where every rank holds it whole.
    Loaders call it to read only that part (loader.load_checkpoint's select)."""
    for part, what in EXPERT_SHARDED_PARAMS if ".mlp.experts." in name else SHARDED_PARAMS:
        if f".{part}." in f".{name}" and getattr(shard, what) is not None:
            a, b = getattr(shard, what)
            if what in ("heads", "kv_heads"):
                a, b = a * head_dim, b * head_dim
            return 0, a, b - a
    return None


def _shard_sizes(param: torch.Tensor, config: ModelConfig, fused: str) -> list[int]:
    if fused == "qkv_proj":
        return [config.q_size, config.kv_size, config.kv_size]
    return [param.shape[0] // 2] * 2  # gate and up: halves (an expert's width is not the config's intermediate_size)


def _copy_shard(param: torch.Tensor, tensor: torch.Tensor, shard: int, config: ModelConfig, fused: str) -> None:
    sizes = _shard_sizes(param, config, fused)
    offset = sum(sizes[:shard])
    dst = param.narrow(0, offset, sizes[shard])
    if dst.shape != tensor.shape:
        raise ValueError(f"{fused} shard {shard}: checkpoint shape {tuple(tensor.shape)} != {tuple(dst.shape)}")
    dst.copy_(tensor)


def _is_loaded(name: str, loaded: set[str]) -> bool:
    if name in loaded:
        return True
    for fused, _, shard in STACKED_PARAMS:
        if f".{fused}." in name:
            n = 3 if fused == "qkv_proj" else 2
            return all(f"{name}#{i}" in loaded for i in range(n))
    return False
