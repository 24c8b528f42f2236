"""Frozen configuration, one dataclass per subsystem, validated on construction.

No torch here: the engine's bookkeeping reads these too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

GiB = 1 << 30
MiB = 1 << 20

# MKL's float32 GEMM gives a row other bits depending on how many rows share the call (a GEMV for one row,
# other blockings for a few); in this strict reproducible mode it computes every row the same way, at up to
# half the speed of a one-sequence float32 decode (docs/guides/determinism.md). MKL reads MKL_CBWR once, at its
# first call, so it must be in the environment before torch computes anything.
STRICT_MKL = "AUTO,STRICT"


def parse_bytes(value: str | int | float) -> int:
    """'2GiB', '512MiB', '1.5G', '1000000' or a number -> bytes."""
    if isinstance(value, (int, float)):
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?B)?\s*", value, re.IGNORECASE)
    if not m:
        raise ValueError(f"cannot read {value!r} as a size in bytes (try '2GiB' or '500MiB')")
    number, unit = float(m.group(1)), m.group(2).upper()
    return int(number * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[unit])


def auto_bytes(value: str | int | None) -> int | None:
    """'auto' (or None) -> None (sized by the engine), else parse_bytes: what --kv-cache-memory takes."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return None
    return parse_bytes(value)


def auto_int(value: str | int) -> int | None:
    """'auto' -> None (the engine decides), else a whole number: what --max-model-len takes."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return None
    return int(value)


@dataclass(frozen=True)
class SchedulerConfig:
    # 32 in flight keeps a 2-core CPU busy on decode; more mostly adds latency.
    max_num_seqs: int = 64
    # Tokens per forward pass. Big enough that a prefill chunk amortizes the
    # weight reads, small enough that decodes sharing the step are not stalled.
    max_num_batched_tokens: int = 512
    max_model_len: int = 8192  # the engine sets the model's (or --max-model-len)
    # After a step that finishes several requests and leaves the engine idle, wait up to this long
    # (seconds) after the next arrival for as many requests, so that clients coming back together
    # share one prefill step (AsyncEngine). 0 turns it off.
    follow_up_window: float = 0.02
    # A step that also decodes (or starts a prompt that arrived) holds its prefill chunks to what this many tokens
    # cost at the start of a prompt (scheduler.chunk_cost); None: max_num_batched_tokens. Lower keeps streams
    # smoother while a long prompt prefills, and makes that prompt's first token later.
    max_prefill_beside_decodes: int | None = None
    # A step in which every sequence decodes and none waits runs each one's next tokens back to back, as many one-token
    # forwards as fit in about this many milliseconds (at most MAX_DECODE_RUN), each on the token the last one picked:
    # the scheduler, the outputs and the stats run once for them all (engine/scheduler.py, decode runs); an arrival or
    # an abort ends a run after its current forward. 0: a token a step.
    decode_run_ms: float = 25.0

    def __post_init__(self) -> None:
        if self.follow_up_window < 0:
            raise ValueError(f"follow_up_window must be >= 0 seconds, got {self.follow_up_window}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.max_prefill_beside_decodes is not None and self.max_prefill_beside_decodes < 1:
            raise ValueError(f"max_prefill_beside_decodes must be at least 1, got {self.max_prefill_beside_decodes}")
        if not 0 <= self.decode_run_ms <= 1000:
            raise ValueError(f"decode_run_ms must be in [0, 1000] milliseconds, got {self.decode_run_ms}")


# What the KV cache may hold: the activations' dtype (auto), a float dtype, or int8 codes with a float32 scale
# per token and head (model/attention/common.py); fp8 (e4m3) on CUDA.
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "fp8")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # KV-cache budget in bytes; None: auto, sized from the machine (runner/kv_sizing.py), on CUDA a fraction of free memory
    kv_cache_memory: int | None = None
    kv_cache_memory_cap: int | None = None  # the most an auto pool takes (what a server's --models-memory leaves a model)
    kv_share: float = 1.0  # the part of the machine's room an auto pool takes (a draft model's target leaves it the rest)
    gpu_memory_fraction: float = 0.8
    num_blocks: int | None = None  # overrides the budget (tests use tiny pools)
    enable_prefix_cache: bool = True
    prefix_cache_ttl: float | None = None  # seconds an unreferenced cached block may idle
    kv_cache_dtype: str = "auto"  # KV_CACHE_DTYPES; auto: the activations' dtype
    # The prefix cache's second tier (engine/kv_tier.py): evicted blocks kept in a directory (survives restarts) ...
    prefix_cache_dir: str | None = None
    prefix_cache_disk_bytes: int = 8 * GiB  # ... up to this many bytes
    prefix_cache_host_bytes: int = 0  # ... or in host RAM, up to this many bytes (for a KV cache on a GPU)
    prefix_cache_restore: str = "auto"  # auto: restore when the measured rates say it is cheaper | always | never
    # A vision model's image embeddings kept by content (runner/encoder_cache.py), so an image is encoded once.
    encoder_cache_memory: int = 256 * MiB
    # Layers that share a sliding window keep only the window's blocks, in a KV group of their own (types.KVGroup).
    # False: every layer keeps every block in one table (a draft model's pool, engine/draft.py, which keeps one).
    kv_groups: bool = True

    def __post_init__(self) -> None:
        if self.encoder_cache_memory < 0:
            raise ValueError(f"encoder_cache_memory must not be negative, got {self.encoder_cache_memory}")
        if self.prefix_cache_disk_bytes < 1 or self.prefix_cache_host_bytes < 0:
            raise ValueError("prefix_cache_disk_bytes must be positive and prefix_cache_host_bytes not negative")
        if self.prefix_cache_restore not in ("auto", "always", "never"):
            raise ValueError(f"prefix_cache_restore must be auto, always or never, got {self.prefix_cache_restore!r}")
        if self.prefix_cache_dir and self.prefix_cache_host_bytes:
            raise ValueError("the prefix-cache tier is a directory or host RAM: give prefix_cache_dir or prefix_cache_host_bytes, not both")
        if (self.prefix_cache_dir or self.prefix_cache_host_bytes) and not self.enable_prefix_cache:
            raise ValueError("the prefix-cache tier keeps what the prefix cache evicts: it needs the prefix cache on")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if self.prefix_cache_ttl is not None and self.prefix_cache_ttl <= 0:
            raise ValueError(f"prefix_cache_ttl must be positive, got {self.prefix_cache_ttl}")
        if not 0 < self.gpu_memory_fraction <= 1:
            raise ValueError(f"gpu_memory_fraction must be in (0, 1], got {self.gpu_memory_fraction}")


QUANTIZATIONS = ("auto", "none", "int8", "int4")


WIRE_DTYPES = ("float32", "bfloat16", "float16", "int8")


@dataclass(frozen=True)
class ParallelConfig:
    """How many processes hold the model (docs/guides/scale-out.md). Rank 0 serves; the others only compute."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1  # contiguous layer ranges, one per stage (of tensor_parallel_size ranks each)
    pp_layers: tuple[int, ...] | None = None  # layers per stage, e.g. (10, 10, 10); None: planned
    pp_wire_dtype: str = "float32"  # hidden states between stages: float32 | bfloat16 | float16 | int8 (a scale per row)
    nnodes: int = 1  # machines; each runs world_size // nnodes ranks
    node_rank: int = 0  # this machine's place; 0 is the one that serves
    master_addr: str = "127.0.0.1"  # rank 0's address, where the others meet it
    master_port: int = 0  # 0: a free port (one machine only)
    timeout: float = 300.0  # seconds a collective may wait for a rank (loading included)
    shared_memory: bool = True  # ranks on one machine gather and broadcast through /dev/shm, not gloo (executor/shm.py)
    restart_workers: bool = False  # after a lost rank: start the ranks again and resume (else 503 until restarted)
    heartbeat_timeout: float = 5.0  # seconds without a rank's heartbeat before rank 0 takes it for hung

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size and pipeline_parallel_size must be at least 1, got "
                             f"{self.tensor_parallel_size} and {self.pipeline_parallel_size}")
        if self.pp_wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"pp_wire_dtype must be one of {', '.join(WIRE_DTYPES)}, got {self.pp_wire_dtype!r}")
        if self.pp_layers is not None:
            counts = self.pp_layers.split(",") if isinstance(self.pp_layers, str) else self.pp_layers  # "10,10,10" from a flag
            object.__setattr__(self, "pp_layers", tuple(int(n) for n in counts))
            if len(self.pp_layers) != self.pipeline_parallel_size:
                raise ValueError(f"pp_layers gives {len(self.pp_layers)} stages, pipeline_parallel_size is {self.pipeline_parallel_size}")
        if self.nnodes < 1 or self.world_size % self.nnodes:
            raise ValueError(f"{self.world_size} ranks must split evenly over nnodes {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and not self.master_port:
            raise ValueError("several machines need an explicit --master-port that rank 0 listens on")
        if not self.heartbeat_timeout >= 1.0:  # the ranks beat twice a second
            raise ValueError(f"heartbeat_timeout must be at least 1 second, got {self.heartbeat_timeout}")
        if not 0 <= self.master_port < 65536:
            raise ValueError(f"master_port must be a TCP port, got {self.master_port}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def place(self, rank: int) -> tuple[int, int]:
        """(pipeline stage, tensor-parallel rank within it) of global `rank`: stage s holds ranks s*T .. s*T+T-1."""
        return divmod(rank, self.tensor_parallel_size)

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes


SPECULATIVE_METHODS = ("auto", "ngram", "draft", "off")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (engine/speculative.py, docs/guides/speculative-decoding.md)."""

    # auto: a draft model when one is given, else n-gram prompt lookup, on the batch-invariant attention only
    # (where a verified token is exactly the decoded one); ngram | draft: that proposer; off: none
    method: str = "auto"
    model: str | None = None  # the draft model (same tokenizer as the target): a GGUF, a folder, or a name
    num_tokens: int = 8  # the longest draft a sequence verifies in one step (k adapts up to it)
    ngram_min: int = 2  # prompt lookup's n-gram sizes, longest first
    ngram_max: int = 4
    # no drafts in a step with more decoding sequences than this: there the step is compute-bound and the
    # drafted positions cost about what they save (benchmarks/results/speculative-*.md)
    max_batch: int = 8

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.method!r}")
        if self.method == "draft" and not self.model:
            raise ValueError("speculative method 'draft' needs a draft model (--speculative-model)")
        if not 1 <= self.num_tokens <= 64:
            raise ValueError(f"speculative num_tokens must be in [1, 64], got {self.num_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"speculative n-gram sizes must satisfy 1 <= min <= max, got {self.ngram_min} and {self.ngram_max}")
        if self.max_batch < 1:
            raise ValueError(f"speculative max_batch must be at least 1, got {self.max_batch}")


@dataclass(frozen=True)
class EngineConfig:
    model: str = "smollm2"
    mmproj: str | None = None  # a GGUF model's vision tower, as llama.cpp ships it (an mmproj GGUF)
    # auto: bfloat16 where the device multiplies it natively (CUDA; CPUs with AVX512-BF16 or AMX), else float32
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # cpu | cuda | auto
    max_model_len: int | None = None  # None: auto, the model's trained length capped to the KV pool (runner/kv_sizing.py)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    num_threads: int | None = None  # torch intra-op threads; None: leave torch's default
    # the weights' format. "auto": a GGUF's quantized tensors each in its file's own type on shoal's native kernels
    # (model/formats.py; without them, torch's int4/int8 kernels for all-Q4 or all-Q8_0 files), else float; "none":
    # weights in `dtype`; "int8" / "int4": weight-only, rounded from float where the file has no such codes (None: "none")
    quantization: str | None = "auto"
    check_integrity: bool = False  # run the pool's integrity check after every step (tests)
    # "sdpa": attention kernels picked by the step's shape (fast; a greedy answer may change with the load);
    # "invariant": --deterministic, a token is computed the same way whatever else is in the step (docs/guides/determinism.md);
    # "auto": invariant with int8/int4 weights (their kernels are row-invariant as they are, so only attention
    # costs anything: ~10% at one stream), sdpa with float weights (where the linears would need splitting too)
    attention: str = "auto"
    # serve embeddings (/v1/embeddings) from a model whose files name no pooling: last-token pooling, L2-normalized
    # (docs/guides/embeddings.md); a model whose files do (sentence-transformers' modules.json, a GGUF's
    # pooling_type) embeds without it, as they say
    embeddings: bool = False
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.quantization is None:
            object.__setattr__(self, "quantization", "none")
        if (self.cache.prefix_cache_dir or self.cache.prefix_cache_host_bytes) and self.parallel.world_size > 1:
            raise ValueError("the prefix-cache tier needs the whole KV cache in one process: it is not available with "
                             "tensor or pipeline parallelism")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be auto, none, int8 or int4, got {self.quantization!r}")
        if self.attention not in ("auto", "invariant", "sdpa"):
            raise ValueError(f"attention must be auto, invariant or sdpa, got {self.attention!r}")
        if self.device not in ("cpu", "cuda", "auto") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be cpu, cuda or auto, got {self.device!r}")
