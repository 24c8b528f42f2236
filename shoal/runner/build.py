"""Build this process's part of the model from an EngineConfig: load the checkpoint, build the model (or this
rank's shard of it), make its matmuls batch-invariant, and size the KV cache. The engine's builder and the
executors' ranks call it; it knows nothing of requests."""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from dataclasses import dataclass, replace

import torch

from shoal import kernels
from shoal.config import STRICT_MKL, EngineConfig
from shoal.model.config import ModelConfig
from shoal.model.file_checks import ModelFileError
from shoal.model.invariance import make_row_invariant
from shoal.model.layers import bind_attributes
from shoal.model.loader import LoadedCheckpoint, load_checkpoint, open_gguf, planned_weight_format, read_config, resolve_model_path
from shoal.model.formats import GGUFLinear, served_bytes
from shoal.model.quant import Int4Linear, Int8Linear, WeightFormat
from shoal.model.bert import GGUF_ENCODERS, encoder_config, is_cross_encoder, is_encoder, load_encoder, score_activation
from shoal.model.pooling_files import max_seq_length, read_pooling
from shoal.model.registry import model_class
from shoal.model.vision import build_tower
from shoal.model.tensor_parallel import TensorParallel, connect_ranks, shard_model
from shoal.model.weights import load_weights, shard_slice, stage_name
from shoal.runner.host import keep_freed_memory
from shoal.model.attention.common import kv_bytes_per_token
from shoal.runner.kv_sizing import KVShape, served_context, size_words
from shoal.runner.model_runner import (
    ModelRunner,
    machine_memory,
    plan_kv_cache,
    resolve_device,
    resolve_dtype,
    resolve_kv_dtype,
)
from shoal.runner.shard_plan import plan_pipeline, plan_tensor_parallel
from shoal.types import Pooling

log = logging.getLogger("shoal.engine")


@dataclass
class ModelPart:
    """What one process holds of the model: its runner (weights, KV slice) and what the engine needs."""

    runner: ModelRunner
    checkpoint: LoadedCheckpoint
    weight_format: str
    max_model_len: int
    pooling: Pooling | None = None  # how the model embeds (its files', or --embeddings'), None: it does not


def build_part(config: EngineConfig, rank: int = 0, group=None) -> ModelPart:
    """Load the checkpoint and build this process's part of the model: all of it, or global rank `rank`'s
    part: its pipeline stage's layers, and of those its tensor-parallel shard (ParallelConfig.place).
    group: executor.distributed.RankGroup, which gathers the tensor-parallel parts within a stage and agrees
    on the KV pool's size, the smallest over the ranks."""
    size = group.size if group is not None else 1
    threads = config.num_threads or (_threads_per_rank(config.parallel.ranks_per_node) if size > 1 else None)
    if threads:
        torch.set_num_threads(threads)
    device = resolve_device(config.device)
    gguf = open_gguf(config.model)  # parsed once: the dtype reads its tensor index, the load the rest
    dtype = engine_dtype(config, device, gguf)
    if device.type == "cpu":
        keep_freed_memory()
        kernels.weight_arena_end()  # this model's packed weights in arenas of its own
    if gguf.metadata.get("general.architecture") in GGUF_ENCODERS if gguf is not None else is_encoder(read_config(config.model)):
        if group is not None:
            raise ValueError("an encoder (BERT) runs on one rank: tensor and pipeline parallelism take decoders")
        return build_encoder_part(config, device, dtype, gguf)
    quantization = resolve_quantization(config.quantization, device, dtype)
    split = layers = select = None  # this rank's TensorParallel, its stage's layer range, what it reads of the file
    if group is not None:
        group.set_layout(config.parallel.tensor_parallel_size)
        whole = ModelConfig.from_hf(read_config(config.model, gguf_reader=gguf))
        split, layers = plan_part(whole, config, rank, group, planned_weight_format(quantization, gguf), device, dtype, gguf)
        select = part_selector(whole, split, layers)
    ckpt = load_checkpoint(config.model, dtype=dtype, quantization=quantization, progress=rank == 0, select=select, gguf_reader=gguf,
                           mmproj=config.mmproj)
    hf = ckpt.hf_config
    trained = hf.get_text_config().max_position_embeddings
    if config.max_model_len and config.max_model_len > trained:
        raise ValueError(f"--max-model-len {config.max_model_len} exceeds the model's {trained} positions")
    longest = config.max_model_len or trained  # the context, until the pool's size caps an auto one
    if ckpt.vision_state_dict is not None and group is not None:
        raise ValueError("a vision-language model runs on one rank for now: tensor and pipeline parallelism take text-only models")

    weights = WeightFormat(ckpt.weight_format, dtype)
    with torch.device("meta"):
        model = model_class(hf.architectures)(hf, longest, weights.linear, layers)
        if split is not None:
            shard_model(model, split, weights.linear)
        weights.prepare(model)
    model = model.to_empty(device=device)  # the rotary tables are computed once the context is known (below)
    packing = time.perf_counter()
    try:
        load_weights(model, ckpt.state_dict)
    except (KeyError, ValueError) as e:  # a tensor the family has no place for, or lacks: the file's fault
        raise ModelFileError(ckpt.path, str(e.args[0]) if isinstance(e, KeyError) else str(e)) from None
    packing = time.perf_counter() - packing
    model = model.to(dtype).eval()
    head = rank == 0 or model.vocab is not None  # rank 0 computes the logits, or every rank its slice of them
    weights.finish_head(model, logits=head)
    if weights.name == "gguf" and rank == 0:
        kinds = Counter(f for m in model.modules() if isinstance(m, GGUFLinear) for f in m.formats)
        log.info("GGUF weights in their file's types on shoal's low-bit kernels (--quantization %s): %s; the embedding "
                 "and the logits head too; packed in %.2f s", config.quantization,
                 ", ".join(f"{n} x {k}" for n, k in kinds.most_common()), packing)
    elif weights.name != "none" and rank == 0:
        linears = [m for m in model.model.modules() if isinstance(m, (Int4Linear, Int8Linear))]
        exact = sum(getattr(m, "from_codes", False) for m in linears)
        on = "shoal's low-bit kernels" if all(m.native for m in linears) else "torch's weight-only kernels"
        log.info("%s weights (--quantization %s): %d projections, %d of them the checkpoint's own 4-bit codes; "
                 "int8 logits head; on %s", weights.name, config.quantization, len(linears), exact, on)
    attention = config.attention if config.attention != "auto" else ("sdpa" if weights.name == "none" else "invariant")
    if attention == "invariant":
        float_linears = weights.name == "none"  # low-bit layers are row-invariant as they are
        if device.type == "cpu" and dtype == torch.float32 and float_linears and os.environ.get("MKL_CBWR") != STRICT_MKL:
            log.warning("deterministic float32 on the CPU needs MKL_CBWR=%s in the environment before torch's first "
                        "float32 matmul (shoal serve --deterministic sets it at start-up); without it rows may differ "
                        "with the batch", STRICT_MKL)
        swapped = make_row_invariant(model, device, dtype, head=head)
        if swapped and rank == 0:
            log.info("batch-invariant matmuls: %d linear layers split or padded for %s on %s", swapped, str(dtype).removeprefix("torch."), device)
    if split is not None:
        connect_ranks(model)  # the gathers wrap the final layers: loading, the head and the swap saw plain ones
    bind_attributes(model)  # last: the model is final now
    kv_dtype = resolve_kv_dtype(config.cache.kv_cache_dtype, dtype, device, low_bit=weights.name != "none",
                                chosen=config.dtype != "auto")
    # KV groups (types.KVGroup): the whole model's, each with this part's layers of it (a pipeline stage may hold none)
    grouped = config.cache.kv_groups and hasattr(model.model, "spec")
    windows = [layer.attention.window for layer in getattr(model, "spec", model.model.spec).layers] if grouped else None
    spec, pool = plan_kv_cache(model.config, config.cache, device, kv_dtype, context=longest,
                               max_num_seqs=config.scheduler.max_num_seqs, ranks_here=_ranks_here(config), windows=windows,
                               layers=getattr(model, "layer_range", None), step_tokens=config.scheduler.max_num_batched_tokens)
    if group is not None:  # every rank's pools alike: the smallest of each
        agreed = tuple(group.agree_min(n) for n in spec.group_blocks)
        spec = replace(spec, num_blocks=agreed[0] if agreed else group.agree_min(spec.num_blocks), group_blocks=agreed)
    shape = KVShape(spec.bytes_per_block // spec.block_size, spec.block_size)
    max_model_len, why = served_context(shape, spec.num_blocks, trained=trained, requested=config.max_model_len, pool=pool,
                                        cache=str(kv_dtype).removeprefix("torch."))
    model.model.set_max_positions(max_model_len, device)  # the rope tables for the context served, computed at construction
    if rank == 0:
        log.info("context %d tokens (%s); KV pool %s = %d tokens of %s at %d bytes a token (%s); %s attention",
                 max_model_len, why, size_words(spec.num_blocks * spec.bytes_per_block), spec.num_blocks * spec.block_size,
                 str(kv_dtype).removeprefix("torch."), shape.bytes_per_token, pool.why, attention)
        if len(spec.groups) > 1:  # the line above is the first group's (types.KVGroup)
            layer_block = kv_bytes_per_token(1, model.config.num_kv_heads, model.config.head_dim, kv_dtype) * spec.block_size
            log.info("KV groups: %s", "; ".join(
                f"{'full attention' if g.window is None else f'a window of {g.window}'}: {len(g.layers)} layer{'s' if len(g.layers) != 1 else ''}, {n} blocks "
                f"({size_words(n * layer_block * len(g.layers))})" for g, n in zip(spec.groups, spec.group_blocks)))
    tower = None
    if ckpt.vision_state_dict is not None:
        tower = build_tower(type(model), hf, ckpt.vision_state_dict, device, dtype)
        ckpt.vision_state_dict = None
    runner = ModelRunner(model, spec, ckpt.eos_token_ids, device, dtype, attention, tower, config.cache.encoder_cache_memory)
    ckpt.state_dict = {}  # the model holds the weights now; drop the second copy
    return ModelPart(runner, ckpt, weights.name, max_model_len, embedding_pooling(config, ckpt, gguf, model.config.hidden_size))


def build_encoder_part(config: EngineConfig, device: torch.device, dtype: torch.dtype, gguf=None) -> ModelPart:
    """An encoder (BERT) that only embeds (model/bert.py, runner/encoder_runner.py): no KV cache, so the engine's
    block accounting runs on zero-byte blocks, as many as --max-num-seqs inputs of the whole context take."""
    from shoal.runner.encoder_runner import EncoderRunner  # noqa: PLC0415

    path = resolve_model_path(config.model)
    model, tokenizer = load_encoder(path, dtype, device, gguf)
    hf = model.config
    hf.architectures = hf.architectures or ["BertModel"]
    trained = hf.max_position_embeddings
    if config.max_model_len and config.max_model_len > trained:
        raise ValueError(f"--max-model-len {config.max_model_len} exceeds the model's {trained} positions")
    # sentence-transformers' max_seq_length where the folder gives one: longer inputs are refused (as OpenAI's API
    # refuses them), not embedded whole into vectors sentence-transformers would not give (it cuts them)
    max_model_len = config.max_model_len or min(trained, (max_seq_length(path) if gguf is None else None) or trained)
    block = config.cache.block_size
    mc = encoder_config(hf)
    scores = is_cross_encoder(hf)
    runner = EncoderRunner(model, mc, device, dtype, config.scheduler.max_num_seqs * -(-max_model_len // block), block,
                           score=score_activation(hf) if scores else None, sep_token_id=tokenizer.sep_token_id)
    eos = tuple(t for t in (tokenizer.sep_token_id,) if t is not None)
    ckpt = LoadedCheckpoint(hf_config=hf, state_dict={}, tokenizer=tokenizer, eos_token_ids=eos, generation_defaults={},
                            path=path, format="hf")
    if scores:  # a cross-encoder reranks: its part is its classifier's scores, not a vector to embed
        log.info("cross-encoder %s for reranking: %d label(s), context %d tokens, no KV cache", mc.architecture,
                 hf.num_labels, max_model_len)
        return ModelPart(runner, ckpt, "none", max_model_len, Pooling("score", False, hf.num_labels))
    pooling = read_pooling(path, gguf.metadata if gguf is not None else None, mc.hidden_size, hf)
    if pooling is None and config.embeddings:
        pooling = Pooling("mean", True, mc.hidden_size)  # sentence-transformers' default for a plain encoder
    if pooling is None:
        raise ValueError(f"{path} is an encoder, which serves embeddings only, and its files name no pooling: serve it "
                         "with --embeddings (mean pooling, normalized)")
    log.info("encoder %s for embeddings: %s pooling%s, context %d tokens, no KV cache", mc.architecture, pooling.mode,
             ", normalized" if pooling.normalize else "", max_model_len)
    return ModelPart(runner, ckpt, "none", max_model_len, pooling)


def embedding_pooling(config: EngineConfig, ckpt: LoadedCheckpoint, gguf, hidden_size: int) -> Pooling | None:
    """How the model embeds: as its files say (model/pooling_files.py); else, with --embeddings, its last token,
    L2-normalized (llama.cpp's server leaves a generation model unpooled, which its /v1/embeddings refuses; a causal
    decoder's last token is the one position that has seen the whole input, and what Qwen3-Embedding pools); else
    None: it does not embed."""
    pooling = read_pooling(ckpt.path, gguf.metadata if gguf is not None else None, hidden_size, ckpt.hf_config)
    if pooling is None and config.embeddings:
        pooling = Pooling("last", True, hidden_size)
    return pooling


def free_memory(device: torch.device) -> int | None:
    """Bytes this process could still take: free GPU memory, or the kernel's MemAvailable; None if unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None
    return kib * 1024


BYTES_PER_WEIGHT = {"int8": 1.0, "int4": 0.5 + 4 / 32}  # codes, plus int4's two bf16 numbers per group of 32


def plan_part(whole: ModelConfig, config: EngineConfig, rank: int, group, weight_format: str, device: torch.device,
              dtype: torch.dtype, gguf=None) -> tuple[TensorParallel | None, tuple[int, int] | None]:
    """Global rank `rank`'s part of the model (ParallelConfig.place): its tensor-parallel split (None: one rank
    per stage) and its pipeline stage's layers (None: no stages). Planning stages by memory is a collective:
    every rank tells its free memory. gguf: the parsed file, whose tensors' own types size a "gguf" model."""
    par = config.parallel
    stage, local = par.place(rank)
    tp, split, layers = par.tensor_parallel_size, None, None
    if par.pipeline_parallel_size > 1:
        plan = {}
        if par.pp_layers is None:  # equal work per stage, within every rank's free memory
            one_layer, head_work = layer_bytes(whole, weight_format, dtype), head_bytes(whole, weight_format, dtype)
            if weight_format == "gguf":  # the file's own types: layer 0's tensors and the head as they will be held
                one_layer = served_bytes(t for t in gguf.tensors if t.name.startswith("blk.0.") and len(t.shape) > 1)
                head_work = served_bytes(t for t in gguf.tensors if t.name == ("token_embd.weight" if whole.tie_word_embeddings else "output.weight"))
            plan["stage0_work"] = head_work / one_layer
            free = group.gather(free_memory(device))
            if all(f is not None for f in free):
                kv = (config.cache.kv_cache_memory or 0) if device.type == "cpu" else 0  # auto: the pool takes what stages leave
                head = stage0_bytes(whole, dtype) if weight_format != "gguf" else served_bytes(
                    t for t in gguf.tensors if t.name in ("token_embd.weight", "output.weight"))
                # a stage's room: its tightest rank's, each rank holding 1/tp of every layer
                room = [min(free[s * tp : (s + 1) * tp]) - kv - (head if s == 0 else 0) for s in range(par.pipeline_parallel_size)]
                plan.update(free_bytes=room, layer_bytes=-(-one_layer // tp))
        layers = plan_pipeline(whole.num_layers, par.pipeline_parallel_size, par.pp_layers, **plan)[stage]
    if tp > 1:
        vocab = whole.vocab_size if par.pipeline_parallel_size == 1 else 0  # the head is split where it is not only on rank 0
        experts = {layer.mlp.width for layer in model_class(whole.hf_config.architectures or [whole.architecture]).model_spec(whole).layers
                   if layer.mlp.experts}
        if len(experts) > 1:
            raise ValueError(f"experts of different widths ({sorted(experts)}) cannot be split over tensor-parallel ranks yet")
        plan = plan_tensor_parallel(whole.num_heads, whole.num_kv_heads, whole.intermediate_size, whole.hidden_size, tp, vocab_size=vocab,
                                    expert_size=experts.pop() if experts else 0)
        split = TensorParallel(tuple(plan), local, group.gather_columns)
    return split, layers


def part_selector(whole: ModelConfig, split: TensorParallel | None, layers: tuple[int, int] | None):
    """What a rank reads of each checkpoint tensor (load_checkpoint's `select`): nothing of another stage's
    layers, and its own rows or columns of a tensor-parallel split."""

    def select(name):
        if layers is not None and stage_name(name, layers, layers[0] == 0) is None:
            return False  # another stage's
        return shard_slice(name, split.shard, whole.head_dim) if split is not None else None

    return select


def layer_bytes(c: ModelConfig, weight_format: str, dtype: torch.dtype) -> int:
    """One decoder layer's projection weights in `weight_format` (norms are noise)."""
    params = c.hidden_size * (c.q_size + 2 * c.kv_size) + c.q_size * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    return int(params * BYTES_PER_WEIGHT.get(weight_format, torch.finfo(dtype).bits / 8))


def head_bytes(c: ModelConfig, weight_format: str, dtype: torch.dtype) -> int:
    """The logits head's weights read per step: int8 beside low-bit layers (WeightFormat.finish_head), else `dtype`."""
    return c.vocab_size * c.hidden_size * (1 if weight_format in BYTES_PER_WEIGHT else torch.finfo(dtype).bits // 8)


def stage0_bytes(c: ModelConfig, dtype: torch.dtype) -> int:
    """What stage 0 holds beyond its layers: the embedding, and an untied head."""
    return c.vocab_size * c.hidden_size * (torch.finfo(dtype).bits // 8) * (1 if c.tie_word_embeddings else 2)


def _threads_per_rank(ranks_here: int) -> int:
    """Tensor-parallel ranks on one machine share its cores: each gets an equal part (at least one)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // ranks_here)


def planned_kv(config: EngineConfig, device: torch.device, gguf=None) -> tuple[ModelConfig, torch.dtype, int]:
    """Before loading: the whole model's shape, the KV cache's dtype, and the model's trained length."""
    hf = read_config(config.model, gguf_reader=gguf)
    low_bit = planned_weight_format(config.quantization or "none", gguf) != "none"
    kv_dtype = resolve_kv_dtype(config.cache.kv_cache_dtype, engine_dtype(config, device, gguf), device, low_bit=low_bit,
                                chosen=config.dtype != "auto")
    return ModelConfig.from_hf(hf), kv_dtype, hf.get_text_config().max_position_embeddings


def planned_pool_bytes(config: EngineConfig, weights: int) -> int:
    """The KV pool a load of `config` will take, before it: the load's own plan (plan_kv_cache), with the weights'
    `weights` bytes taken off what the machine has now. A GGUF parsed here is the load's (open_gguf)."""
    device = resolve_device(config.device)
    c, kv_dtype, trained = planned_kv(config, device, open_gguf(config.model, keep=True))
    machine = machine_memory(device)
    if machine.available is not None:
        machine = replace(machine, available=max(0, machine.available - weights))
    spec, _ = plan_kv_cache(c, config.cache, device, kv_dtype, context=config.max_model_len or trained,
                            max_num_seqs=config.scheduler.max_num_seqs, ranks_here=_ranks_here(config), machine=machine)
    return spec.num_blocks * spec.bytes_per_block


def with_draft_share(config: EngineConfig) -> EngineConfig:
    """A speculative draft model's pool holds as many tokens as the target's (engine/draft.py), at its own bytes a
    token: an auto target pool leaves it that room, taking t / (t + d) of the machine's, t and d the two models'
    bytes a token. Anything else: the config as it is."""
    spec, cache = config.speculative, config.cache
    if (not spec.model or spec.method not in ("auto", "draft") or cache.kv_cache_memory is not None
            or cache.num_blocks is not None or config.parallel.world_size > 1):
        return config
    device = resolve_device(config.device)

    def per_token(c: ModelConfig, kv_dtype: torch.dtype, _trained: int) -> int:
        return kv_bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, kv_dtype)

    target = per_token(*planned_kv(config, device, open_gguf(config.model, keep=True)))
    draft = per_token(*planned_kv(replace(config, model=spec.model), device, open_gguf(spec.model)))
    return replace(config, cache=replace(cache, kv_share=target / (target + draft)))


def _ranks_here(config: EngineConfig) -> int:
    """The ranks sharing this machine's memory."""
    return config.parallel.ranks_per_node if config.parallel.world_size > 1 else 1


def engine_dtype(config: EngineConfig, device: torch.device, gguf=None) -> torch.dtype:
    """The activations' dtype. `--dtype auto` is float32 on the CPU where the projections are low-bit codes on
    shoal's native kernels (the default GGUF's): those kernels round each activation row to int8 per block of 32
    themselves, so bfloat16 buys them nothing, and its rounding of every activation beneath theirs derailed the
    default model on a CPU with native bf16 ("What is the capital of France?" answered in French from the first
    token; float32, as llama.cpp runs, answers Paris). Otherwise runner.resolve_dtype decides.
    gguf: the checkpoint parsed, where it is a GGUF (loader.open_gguf); None for a Hugging Face folder."""
    if config.dtype == "auto" and device.type == "cpu" and config.quantization != "none" and kernels.available():
        if planned_weight_format(config.quantization, gguf) != "none":
            return torch.float32
    return resolve_dtype(config.dtype, device)


def resolve_quantization(requested: str, device: torch.device, dtype: torch.dtype) -> str:
    """The --quantization value the loader gets. The int8/int4 layers run on the CPU: with shoal's native
    kernels (model/quant.py) for any activation dtype, else with torch's, which want bfloat16 or float16.
    Where they do not run, "auto" (the default) becomes "none" and an explicit int8/int4 is an error."""
    if device.type == "cpu" and (dtype != torch.float32 or kernels.available()):
        return requested
    if requested == "auto":
        log.info("--quantization auto: float weights, because the int8/int4 layers run on the CPU, with float32 activations "
                 "only on shoal's native kernels, and this is %s on %s", str(dtype).removeprefix("torch."), device)
        return "none"
    if requested in ("int8", "int4"):
        raise ValueError(f"{requested} weights need the CPU, and bfloat16 or float16 activations where shoal's native kernels "
                         f"are not built, not {dtype} on {device} (pass --dtype bfloat16)")
    return requested
