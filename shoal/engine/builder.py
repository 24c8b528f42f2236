"""Wire an Engine from an EngineConfig: this process's part of the model (runner/build.py), the executor that
reaches every part (one process, or rank 0 of several), and the engine over it."""

from __future__ import annotations

import logging
import time
from types import MappingProxyType

from shoal.config import EngineConfig
from shoal.engine.engine import Engine
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
    engine = Engine(executor, ckpt.tokenizer, ckpt.eos_token_ids, config, part.max_model_len, facts=facts)
    log.info(
        "engine ready in %.1fs: %s, %s%s on %s, max_model_len %d, %d KV blocks%s",
        time.perf_counter() - t0, facts.architecture, facts.dtype,
        f" ({facts.weight_format} weights)" if facts.weight_format != "none" else "", facts.device, part.max_model_len,
        runner.num_blocks, _parallel_words(config.parallel),
    )
    return engine


def _parallel_words(par) -> str:
    words = []
    if par.pipeline_parallel_size > 1:
        words.append(f"{par.pipeline_parallel_size} pipeline stages")
    if par.tensor_parallel_size > 1:
        words.append(f"tensor parallel over {par.tensor_parallel_size} ranks" + (" each" if words else ""))
    return "".join(f", {w}" for w in words)
