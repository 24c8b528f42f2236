"""Wire an Engine from an EngineConfig: this process's part of the model (runner/build.py), the executor that
reaches every part (one process, or rank 0 of several), and the engine over it."""

from __future__ import annotations

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
from shoal.engine.stats import EngineFacts
from shoal.executor import LocalExecutor
from shoal.runner.build import build_part

log = logging.getLogger("shoal.engine")


def build_engine(config: EngineConfig) -> Engine:
    t0 = time.perf_counter()
    if config.parallel.world_size > 1:
        from shoal.executor.distributed import start_rank0

        executor, part = start_rank0(config)
    else:
        part = build_part(config)
        executor = LocalExecutor(part.runner)
    runner, ckpt = part.runner, part.checkpoint
    facts = EngineFacts.of(config.model, runner, path=str(ckpt.path), weight_format=part.weight_format,
                           generation_defaults=MappingProxyType(dict(ckpt.generation_defaults)))
    tier = build_tier(config, runner, facts)
    engine = Engine(executor, ckpt.tokenizer, ckpt.eos_token_ids, config, part.max_model_len, facts=facts, tier=tier)
    log.info(
        "engine ready in %.1fs: %s, %s%s on %s, max_model_len %d, %d KV blocks%s",
        time.perf_counter() - t0, facts.architecture, facts.dtype,
        f" ({facts.weight_format} weights)" if facts.weight_format != "none" else "", facts.device, part.max_model_len,
        runner.num_blocks, _parallel_words(config.parallel),
    )
    return engine


def build_tier(config: EngineConfig, runner, facts: EngineFacts) -> KVTier | None:
    """The prefix cache's second tier (engine/kv_tier.py), if one is configured."""
    cache = config.cache
    if cache.prefix_cache_host_bytes:
        store = HostStore(cache.prefix_cache_host_bytes, runner.bytes_per_block)
    elif cache.prefix_cache_dir:
        c = runner.config
        root = Path(cache.prefix_cache_dir).expanduser()
        root.mkdir(parents=True, exist_ok=True)
        fingerprint = {
            "model_sha256": model_digest(facts.path, root), "dtype": facts.dtype, "kv_cache_dtype": facts.kv_cache_dtype,
            "weight_format": facts.weight_format, "attention": runner.attention.name, "block_size": runner.block_size,
            "layers": c.num_layers, "kv_heads": c.num_kv_heads, "head_dim": c.head_dim,
            "layout_version": LAYOUT_VERSION, "shoal_version": shoal.__version__,
        }
        store = DirectoryStore(root, cache.prefix_cache_disk_bytes, runner.bytes_per_block, fingerprint)
    else:
        return None
    try:
        tier = KVTier(store, runner.bytes_per_block, runner.block_size, chunk_cost, cache.prefix_cache_restore)
    except BaseException:
        store.close()  # the directory's lock with it
        raise
    s = tier.stats
    log.info("prefix-cache tier: %s, %d of %d blocks (%.1f of %.0f MiB) held from earlier runs; first read rate %s; "
             "restores: %s", f"directory {store.dir}" if s.kind == "disk" else "host RAM", s.entries, tier.index.capacity,
             s.bytes / 2**20, s.capacity_bytes / 2**20,
             f"{store.read_rate / 2**20:.0f} MiB/s" if store.read_rate else "not measured yet",
             {"auto": "when cheaper than computing (measured)", "always": "always", "never": "never"}[cache.prefix_cache_restore])
    return tier


def _parallel_words(par) -> str:
    words = []
    if par.pipeline_parallel_size > 1:
        words.append(f"{par.pipeline_parallel_size} pipeline stages")
    if par.tensor_parallel_size > 1:
        words.append(f"tensor parallel over {par.tensor_parallel_size} ranks" + (" each" if words else ""))
    return "".join(f", {w}" for w in words)
