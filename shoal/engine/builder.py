"""Wire an Engine from an EngineConfig: this process's part of the model (runner/build.py), the executor that
reaches every part (one process, or rank 0 of several), and the engine over it."""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from types import MappingProxyType

import shoal
from shoal.config import EngineConfig
from shoal.engine.engine import Engine
from shoal.engine.kv_store import LAYOUT_VERSION, DirectoryStore, HostStore, model_digest
from shoal.engine.kv_tier import KVTier
from shoal.engine.scheduler import chunk_cost
from shoal.engine.speculative import DRAFT_COST, NgramProposer, Speculator
from shoal.engine.stats import EngineFacts
from shoal.executor import LocalExecutor
from shoal.model.loader import resolve_model_path
from shoal.runner.build import build_part, planned_pool_bytes, with_draft_share
from shoal.runner.kv_sizing import WORKSPACE

log = logging.getLogger("shoal.engine")


def build_engine(config: EngineConfig) -> Engine:
    t0 = time.perf_counter()
    if config.parallel.world_size > 1:
        from shoal.executor.distributed import start_rank0

        executor, part = start_rank0(config)
    else:
        config = with_draft_share(config)
        part = build_part(config)
        executor = LocalExecutor(part.runner)
    runner, ckpt = part.runner, part.checkpoint
    facts = EngineFacts.of(config.model, runner, path=str(ckpt.path), weight_format=part.weight_format,
                           generation_defaults=MappingProxyType(dict(ckpt.generation_defaults)), pooling=part.pooling)
    tier = build_tier(config, runner, facts)
    speculator = build_speculator(config, runner, ckpt.tokenizer, part.max_model_len)
    engine = Engine(executor, ckpt.tokenizer, ckpt.eos_token_ids, config, part.max_model_len, facts=facts, tier=tier,
                    speculator=speculator, vision=ckpt.image_preparer, pooling=part.pooling)
    log.info(
        "engine ready in %.1fs: %s, %s%s on %s, max_model_len %d, %d KV blocks%s",
        time.perf_counter() - t0, facts.architecture, facts.dtype,
        f" ({facts.weight_format} weights)" if facts.weight_format != "none" else "", facts.device, part.max_model_len,
        runner.num_blocks, _parallel_words(config.parallel),
    )
    return engine


def build_tier(config: EngineConfig, runner, facts: EngineFacts) -> KVTier | None:
    """The prefix cache's second tier (engine/kv_tier.py), if one is configured: a store per KV group
    (types.KVGroup), the budget split so that each holds as many blocks (the full-attention group as many as it would
    with every layer in it)."""
    cache = config.cache
    budget = cache.prefix_cache_host_bytes or cache.prefix_cache_disk_bytes
    if not (cache.prefix_cache_host_bytes or cache.prefix_cache_dir):
        return None
    sizes = runner.group_block_bytes
    shares = [budget * b // sum(sizes) for b in sizes]
    several = len(sizes) > 1
    stores = []
    try:
        if cache.prefix_cache_host_bytes:
            stores = [HostStore(share, size) for share, size in zip(shares, sizes)]
        else:
            c = runner.config
            root = Path(cache.prefix_cache_dir).expanduser()
            root.mkdir(parents=True, exist_ok=True)
            fingerprint = {
                "model_sha256": model_digest(facts.path, root), "dtype": facts.dtype, "kv_cache_dtype": facts.kv_cache_dtype,
                "weight_format": facts.weight_format, "attention": runner.attention.name, "block_size": runner.block_size,
                "layers": c.num_layers, "kv_heads": c.num_kv_heads, "head_dim": c.head_dim,
                "layout_version": LAYOUT_VERSION, "shoal_version": shoal.__version__,
            }
            if several:
                fingerprint["kv_groups"] = [[g.window, list(g.layers)] for g in runner.kv_groups]
            for g, (share, size) in enumerate(zip(shares, sizes)):
                stores.append(DirectoryStore(root, share, size, fingerprint, group=g if several else None))
        tier = KVTier(stores, runner.block_size, chunk_cost, cache.prefix_cache_restore)
    except BaseException:
        for store in reversed(stores):
            store.close()  # the directory's lock with the first
        raise
    s, store = tier.stats, stores[0]
    log.info("prefix-cache tier: %s, %d of %d blocks (%.1f of %.0f MiB) held from earlier runs%s; first read rate %s; "
             "restores: %s", f"directory {store.dir}" if s.kind == "disk" else "host RAM", s.entries,
             sum(i.capacity for i in tier.indexes), s.bytes / 2**20, s.capacity_bytes / 2**20,
             f", a store for each of {len(stores)} KV groups" if several else "",
             f"{store.read_rate / 2**20:.0f} MiB/s" if store.read_rate else "not measured yet",
             {"auto": "when cheaper than computing (measured)", "always": "always", "never": "never"}[cache.prefix_cache_restore])
    return tier


def build_speculator(config: EngineConfig, runner, tokenizer, max_model_len: int) -> Speculator | None:
    """Speculative decoding as configured (engine/speculative.py). `auto` turns it on where a verified token is
    exactly the one decoding gives: the batch-invariant attention (with sdpa, a chunk's rows and a decode may
    round differently, and an answer could change)."""
    spec = config.speculative
    method = spec.method
    invariant = runner.attention.name == "invariant"
    if method == "auto":
        if not invariant:
            log.info("speculative decoding: off (auto turns it on with the batch-invariant attention, where it changes "
                     "no answer; this engine runs %s attention)", runner.attention.name)
            return None
        method = "draft" if spec.model else "ngram"
    if method == "off":
        return None
    if not invariant:
        log.warning("speculative decoding on %s attention: a verified token may differ in its last bits from the decoded "
                    "one, so an answer can change (--attention invariant makes it exact)", runner.attention.name)
    measured = config.parallel.world_size == 1  # another rank's part cannot run a step alone
    key = (config.model, config.quantization, str(runner.dtype), str(runner.kv_dtype), runner.attention.name,
           spec.num_tokens, torch_threads())
    if not measured:
        step, verify = 1.0, 1.0 + DRAFT_COST * spec.num_tokens
    elif key in _STEP_TIMES:  # the same model and settings in this process (an LLM built again): measured once
        step, verify = _STEP_TIMES[key]
    else:
        step, verify = _STEP_TIMES[key] = time_steps(runner, spec.num_tokens)
    cost = max(0.0, (verify - step) / (spec.num_tokens * step))
    if method == "draft":
        from shoal.engine.draft import DraftProposer  # noqa: PLC0415 (loads a second model)

        proposer = DraftProposer.load(spec.model, config, tokenizer, max_model_len, runner.num_blocks)
        cost += time_steps(proposer.runner, 0)[0] / step  # each drafted token is a step of the draft model
    else:
        proposer = NgramProposer(spec.ngram_min, spec.ngram_max)
    log.info("speculative decoding: %s proposer, drafts of up to %d tokens, in steps of at most %d decoding sequences; "
             "a drafted token costs %.2f of a decode step here (%s)", proposer.name, spec.num_tokens, spec.max_batch, cost,
             f"a step of 1 token took {step * 1e3:.1f} ms, of {spec.num_tokens + 1} {verify * 1e3:.1f} ms" if measured else "assumed")
    return Speculator(proposer, spec.num_tokens, spec.max_batch, max_model_len, draft_cost=cost)


_STEP_TIMES: dict[tuple, tuple[float, float]] = {}


def torch_threads() -> int:
    import torch  # noqa: PLC0415

    return torch.get_num_threads()


def time_steps(runner, k: int, repeats: int = 3) -> tuple[float, float]:
    """Seconds of a one-token decode step, and of one that verifies a draft of k tokens (k + 1 positions, each
    sampled), on this host: the fastest of `repeats` each after a warm-up, the two kinds taking turns, in the
    pool's first blocks (nothing holds them at start). Taking turns and the fastest, so that a moment when the
    host is busy (another process, the page cache filling) slows neither figure: once, a median of three one-token
    steps read 443 ms against 26 ms (the drafts were then judged free, and one stream ran at a quarter speed)."""
    from shoal.types import SamplingParams, ScheduledSeq, StepPlan  # noqa: PLC0415

    blocks = tuple(range(-(-(k + 2) // runner.block_size)))
    greedy = SamplingParams(temperature=0.0)

    def plan(n: int) -> StepPlan:
        ids = tuple(range(1, n + 1))
        return StepPlan((ScheduledSeq(seq_id=-1, token_ids=ids, start_pos=1, block_table=blocks, sample=True,
                                      params=greedy, draft=ids[1:]),))

    plans = [plan(1)] + ([plan(k + 1)] if k else [])
    best = [float("inf")] * len(plans)
    for i in range(repeats + 1):
        for j, p in enumerate(plans):
            t0 = time.perf_counter()
            runner.execute(p)
            if i:
                best[j] = min(best[j], time.perf_counter() - t0)
    return best[0], best[-1]


def _parallel_words(par) -> str:
    words = []
    if par.pipeline_parallel_size > 1:
        words.append(f"{par.pipeline_parallel_size} pipeline stages")
    if par.tensor_parallel_size > 1:
        words.append(f"tensor parallel over {par.tensor_parallel_size} ranks" + (" each" if words else ""))
    return "".join(f", {w}" for w in words)


# ---------------------------------------------------------------- what a load will take, before it


def weight_file_bytes(config: EngineConfig) -> int | None:
    """The checkpoint's weight files (and a vision tower's), in bytes; None where the model cannot be found."""
    try:
        path = resolve_model_path(config.model)
    except (ValueError, FileNotFoundError):
        return None  # it will fail to load, and say why
    if path.is_file():
        weights = path.stat().st_size
    else:
        weights = sum(p.stat().st_size for p in path.iterdir() if p.suffix in (".safetensors", ".bin", ".gguf"))
    if config.mmproj and Path(config.mmproj).is_file():
        weights += Path(config.mmproj).stat().st_size
    return weights


def within_budget(config: EngineConfig, budget: int | None) -> EngineConfig:
    """A model's config under a server's memory budget (--models-memory): an auto KV pool takes at most what the
    budget leaves once its weights and workspace are in, so the model alone always fits."""
    weights = weight_file_bytes(config)
    if budget is None or config.cache.kv_cache_memory is not None or weights is None:
        return config
    cap = max(0, budget - weights - WORKSPACE)
    return dataclasses.replace(config, cache=dataclasses.replace(config.cache, kv_cache_memory_cap=cap))


def estimate_bytes(config: EngineConfig) -> int:
    """Memory a model will take before it was ever loaded: its checkpoint's weight files, the KV pool its load
    will size (the load's own sizing, runner/build.planned_pool_bytes), a workspace."""
    weights = weight_file_bytes(config)
    if weights is None:
        return 0
    try:
        pool = planned_pool_bytes(config, weights)
    except Exception as e:  # noqa: BLE001 (a file the load will refuse, and say why; until then, the weights)
        log.debug("model %s: no KV pool estimate before its load (%s)", config.model, e)
        pool = 0
    return weights + pool + WORKSPACE
