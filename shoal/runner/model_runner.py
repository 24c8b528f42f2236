"""ModelRunner: owns the KV tensors, turns a StepPlan into tensors, runs the model, samples.

Every tensor of a step is built here, once: the model and the sampler only
consume them. The runner makes no scheduling decisions.

A step has three parts. `forward(ForwardBatch)` is what every tensor-parallel
rank runs on its shard: block copies, token ids, positions and block tables,
no request state. `logits(ForwardBatch, hidden)` is the head's part, on every
rank that holds a slice of the vocabulary (tensor-parallel ranks gather their
slices; elsewhere rank 0 alone holds the head). Sampling (and prompt logprobs)
runs on rank 0 alone, where the requests' parameters and histories are;
`execute` does all three in one process, and a plan's decode runs after them
(`_decode_run`), or, where every row is a plain greedy decode the native
forward takes, the whole step in one native call (`_native_step`).
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import mmap
from dataclasses import dataclass, field, replace

import torch

from shoal import kernels
from shoal.config import CacheConfig
from shoal.model import native
from shoal.model.attention import SeqSpan, make_attention_backend
from shoal.model.attention.common import GroupedMetadata, cache_row, kv_bytes_per_token
from shoal.model.layers import DecoderForCausalLM, ExpertCounts
from shoal.model.qwen2_vl import MRotary
from shoal.multimodal import mrope_positions
from shoal.runner.encoder_cache import EncoderCache
from shoal.runner.kept import KeptHistories, KeptLists, TokenHistory
from shoal.runner.kv_sizing import WORKSPACE, KVShape, Machine, PoolSize, group_blocks, read_meminfo, size_pool
from shoal.runner.pooling import pool
from shoal.runner.sampler import ROW_ERRORS, SamplerRow, SamplingBatch, log_softmax_rows, process_logits, sample
from shoal.types import KVGroup, Logprob, SampledToken, ScheduledSeq, StepOutput, StepPlan, TokenLogprobs, kv_groups

log = logging.getLogger("shoal.runner")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SAMPLING_FAILED = "sampling failed for this request's parameters"
PROMPT_LOGPROBS_ROWS = 512  # prompt positions whose [rows, V] logits exist at once


def inference(f):
    """torch.inference_mode around f, entered only where it is not already: the step's nested calls (execute's forward
    and logits, forward's block copies) skip the context's cost, about 9 us a call on a step's cold caches."""
    @functools.wraps(f)
    def run(*args, **kwargs):
        if torch.is_inference_mode_enabled():
            return f(*args, **kwargs)
        with torch.inference_mode():
            return f(*args, **kwargs)
    return run


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"device {device!r} asked for, but torch sees no CUDA device")
    return torch.device(device)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """"auto" -> bfloat16 where the device multiplies it natively, else float32.

    On a CPU with AVX512-BF16 (or AMX), oneDNN's bf16 GEMM runs the decode
    step's linears 2.8x faster than MKL's fp32 SGEMM (half the bytes to stream
    at one sequence, native bf16 dot products at 32; benchmarks/NOTES.md). A
    CPU without them emulates bf16, so float32 stays the choice there, and in a process that
    SHOAL_CPU_ISA forces below AVX-512.
    """
    if name != "auto":
        return DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    native_bf16 = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    native_bf16 = native_bf16 and not kernels.forced_below_avx512()  # SHOAL_CPU_ISA=avx2 runs as an AVX2 CPU would
    return torch.bfloat16 if native_bf16 else torch.float32


def seeded_generator(seed: int, num_sampled: int, device: torch.device) -> torch.Generator:
    """A generator that depends only on (seed, position): the same seed gives the
    same tokens alone, in a batch, after preemption, or on another rank."""
    g = torch.Generator(device=device)
    g.manual_seed((seed * 0x9E3779B97F4A7C15 + num_sampled) % (1 << 63))
    return g


@dataclass(frozen=True)
class ForwardBatch:
    """What the forward of a step needs, as plain data: the part of a StepPlan every rank gets.

    Tokens are laid out flat, decodes first (one token each), then prefill chunks (attention/common.py).
    """

    token_ids: list[int]
    decodes: list[SeqSpan]
    chunks: list[SeqSpan]
    block_copies: list[tuple[int, ...]]
    sample_rows: list[int] = field(default_factory=list)  # rows whose logits are sampled (a sequence's last token)
    prompt_rows: list[int] = field(default_factory=list)  # rows whose logits give prompt logprobs
    images: list[ImageRows] = field(default_factory=list)  # the sequences with images, where their rows are
    # pooling chunks (ScheduledSeq.pool): their rows, segment after segment, and each segment's row count
    pool_rows: list[int] = field(default_factory=list)
    pool_lengths: list[int] = field(default_factory=list)
    # the other KV groups' block tables (types.KVGroup), per group, of the sequences in the batch's order, each from
    # its entry in group_from on (the spans' tables from their changed_from: runner/kept.py)
    group_tables: list[list[tuple[int, ...]]] = field(default_factory=list)
    group_from: list[list[int]] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)  # sequences that are gone: what the runner kept of them goes

    @property
    def empty(self) -> bool:
        return not self.token_ids


@dataclass(frozen=True)
class ImageRows:
    """A sequence with images in a step: its first row in the batch, the position of that row, its row count."""

    row: int
    start_pos: int
    num_tokens: int
    images: tuple  # multimodal.ImageSpan, the sequence's all


@dataclass(frozen=True)
class KVCacheSpec:
    num_blocks: int  # the first KV group's
    block_size: int
    bytes_per_block: int  # of the first group's layers
    dtype: torch.dtype  # what the cache holds (resolve_kv_dtype)
    # The model's KV groups (types.KVGroup) and each one's blocks; empty: one group of every layer, num_blocks.
    groups: tuple[KVGroup, ...] = ()
    group_blocks: tuple[int, ...] = ()


KV_DTYPES = {**DTYPES, "int8": torch.int8, "fp8": torch.float8_e4m3fn}


def resolve_kv_dtype(name: str, dtype: torch.dtype, device: torch.device, *, low_bit: bool, chosen: bool) -> torch.dtype:
    """--kv-cache-dtype: "auto" is the activations' dtype `dtype`, but where --dtype auto made that float32 on the CPU
    (`chosen` False): int8 beside low-bit weights (a GGUF's, the default configuration), bfloat16 beside float ones.
    Measured (docs/guides/kv-cache.md): beside low-bit weights every rounding of the cache moves answers about as
    much, and int8 decodes fastest with 3.8x float32's tokens; beside float weights bfloat16 moves them far less
    than int8, and float16 reads slowly where the CPU lacks bfloat16. A --dtype given keeps its cache: float32
    is the reference math. fp8 (e4m3, scale 1, as vLLM's default) only on CUDA."""
    if name == "auto":
        if device.type == "cpu" and dtype == torch.float32 and not chosen:
            return torch.int8 if low_bit else torch.bfloat16
        return dtype
    if name == "fp8" and device.type != "cuda":
        raise ValueError("--kv-cache-dtype fp8 needs a CUDA device; on the CPU int8 halves the cache with a scale per token and head")
    return KV_DTYPES[name]


def machine_memory(device: torch.device) -> Machine:
    """Where the pool will live, and the room it has now: a CUDA device's free and total memory, else the
    kernel's MemAvailable and MemTotal."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return Machine("cuda", free, total)
    return read_meminfo()


def plan_kv_cache(config, cache: CacheConfig, device: torch.device, kv_dtype: torch.dtype, *, context: int,
                  max_num_seqs: int, ranks_here: int = 1, machine: Machine | None = None, windows=None,
                  layers: tuple[int, int] | None = None, step_tokens: int = 512) -> tuple[KVCacheSpec, PoolSize]:
    """The pool's blocks of `kv_dtype` (config: the model's ModelConfig, or this rank's part of it): as many as
    --kv-cache-memory, or sized from the machine (kv_sizing.size_pool); `cache.num_blocks` overrides both.
    context: the longest a sequence may be, for the auto size's cap. machine: what the pool has room in (by
    default read now; a server's estimate before a load passes the room less the weights to come).
    windows: each layer's sliding window, the whole model's (None: all full attention, one KV group): layers of a
    window share a group, whose blocks are bounded by the window and a step's `step_tokens` (kv_sizing.group_blocks).
    layers: the range of them this part holds (a pipeline stage's), numbered from its first; every group is kept,
    so that all ranks' groups line up, a group without layers here with none."""
    shape = KVShape(kv_bytes_per_token(config.num_layers, config.num_kv_heads, config.head_dim, kv_dtype), cache.block_size)
    if cache.num_blocks is not None:
        pool = PoolSize(cache.num_blocks, f"{cache.num_blocks} blocks, as configured")
    else:
        machine = machine if machine is not None else machine_memory(device)
        pool = size_pool(shape, machine, pool_bytes=cache.kv_cache_memory, context=context, max_num_seqs=max_num_seqs,
                         workspace=WORKSPACE, gpu_fraction=cache.gpu_memory_fraction, cap_bytes=cache.kv_cache_memory_cap,
                         ranks_here=ranks_here, share=cache.kv_share)
    groups = kv_groups(windows) if windows is not None else ()
    if len(groups) <= 1 and not any(g.window is not None for g in groups):
        return KVCacheSpec(pool.num_blocks, cache.block_size, shape.bytes_per_block, kv_dtype), pool
    first, end = layers or (0, len(windows))
    groups = tuple(KVGroup(g.window, tuple(i - first for i in g.layers if first <= i < end)) for g in groups)
    layer_bytes = shape.bytes_per_block // config.num_layers
    blocks = group_blocks(pool.num_blocks, groups, layer_bytes=layer_bytes, block_size=cache.block_size,
                          max_num_seqs=max_num_seqs, step_tokens=step_tokens, fixed=cache.num_blocks is not None)
    return KVCacheSpec(blocks[0], cache.block_size, layer_bytes * len(groups[0].layers), kv_dtype, groups, blocks), pool


def kv_pool_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The pool, zero. On the CPU it is an anonymous mapping: its pages are the kernel's zero page until a block
    is written, so a pool sized to the machine costs no start-up time and no memory until it fills."""
    count = math.prod(shape)
    if device.type != "cpu" or count == 0:  # (no layers of a KV group on this pipeline stage)
        return torch.zeros(shape, dtype=dtype, device=device)
    mapping = mmap.mmap(-1, max(count * dtype.itemsize, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(mapping, dtype=dtype, count=count).view(shape)  # the tensors keep the mapping


class ModelRunner:
    decode_runs = True  # execute runs a plan's decode runs (ScheduledSeq.steps)

    def __init__(
        self,
        model: DecoderForCausalLM,
        spec: KVCacheSpec,
        eos_token_ids: tuple[int, ...],
        device: torch.device,
        dtype: torch.dtype,
        attention: str = "invariant",
        vision_tower=None,
        encoder_cache_memory: int = 256 << 20,
    ) -> None:
        """vision_tower: a vision-language model's (model/vision.py), whose image embeddings replace the
        placeholder tokens' (through an EncoderCache of `encoder_cache_memory` bytes)."""
        self.model = model
        self.config = model.config
        self.device = device
        self.dtype = dtype
        self.block_size = spec.block_size
        self.num_blocks = spec.num_blocks
        self.bytes_per_block = spec.bytes_per_block
        self.kv_dtype = spec.dtype
        self.eos_token_ids = eos_token_ids
        # The model's tensors once each (tied embeddings share storage), and a vision tower's, for the server's memory budget.
        seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in (*model.parameters(), *model.buffers())}
        self.weight_bytes = sum(seen.values()) + (vision_tower.weight_bytes if vision_tower is not None else 0)
        c = self.config
        # One tensor for all layers: [layers, 2 (k|v), Hkv, blocks + 1, block_size, D] (head-major, see
        # attention/common.py). The last block is the null block: the pool never hands it out, attention
        # pads block tables with it and reads zeros.
        # An int8 cache holds each block's codes, then a float32 scale per token (attention/common.py).
        # With KV groups (types.KVGroup) one such tensor per group, over its layers and with its own blocks.
        row = cache_row(c.head_dim, spec.dtype)
        self.kv_groups = spec.groups or (KVGroup(None, tuple(range(c.num_layers))),)
        self.group_blocks = spec.group_blocks or (spec.num_blocks,)
        self.kv_tensors = [kv_pool_tensor((len(g.layers), 2, c.num_kv_heads, n + 1, spec.block_size, row), spec.dtype, device)
                           for g, n in zip(self.kv_groups, self.group_blocks)]
        self.kv = self.kv_tensors[0]
        self.kv_caches = [None] * c.num_layers  # per layer: [2, Hkv, blocks + 1, block_size, D (int8: D + 4)]
        for g, t in zip(self.kv_groups, self.kv_tensors):
            for i, layer in enumerate(g.layers):
                self.kv_caches[layer] = t[i]
        self.attention = make_attention_backend(attention, c, block_size=spec.block_size, null_block=spec.num_blocks, device=device,
                                                dtype=dtype)
        self.encoder = EncoderCache(vision_tower, encoder_cache_memory) if vision_tower is not None else None
        self.expert_tokens = ExpertCounts.of(model)  # a mixture-of-experts model's routing counts (metrics); else None
        self.mrope = isinstance(model.model.rotary, MRotary)
        # Each sequence's block tables (every rank) and token history (rank 0's sampler), kept from step to step: the
        # plans carry diffs (runner/kept.py).
        self.kept_tables = KeptLists("block table of KV group")
        self.kept_history = KeptHistories()
        self._kept_sampling = None  # (rows' key, their SamplingBatch, top logprobs per row, seeded rows): _sampling_batch
        if getattr(self.attention, "native", False):  # every layer in one native call, where it can
            model.model.native_forward = native.build(model.model, self.kv_caches)
        self.greedy_head = model.greedy_head()  # the head's run where a greedy step's logits stay native (_sample_batch)
        # Not 0: something waits for the engine thread, so a decode run ends after its current forward (interrupt_run;
        # read between forwards here and in the native run)
        self.run_flag = torch.zeros(1, dtype=torch.int32)
        self._run_flag = self.run_flag.numpy()  # (the same memory)
        log.debug(
            "KV cache: %d blocks x %d tokens = %d tokens, %.1f MiB of %s (%d bytes a token); %s attention",
            spec.num_blocks, spec.block_size, spec.num_blocks * spec.block_size, sum(t.numel() * t.element_size() for t in self.kv_tensors) / 2**20,
            str(spec.dtype).removeprefix("torch."), spec.bytes_per_block // spec.block_size, self.attention.name,
        )

    # ------------------------------------------------------------ whole blocks (the prefix cache's second tier)
    @property
    def group_block_bytes(self) -> tuple[int, ...]:
        """A block's bytes in each KV group's tensor (its layers' keys and values)."""
        return tuple(t[:, :, :, 0].numel() * t.element_size() for t in self.kv_tensors)

    @inference
    def read_blocks(self, block_ids: list[int], group: int = 0) -> list:
        """Copies of these blocks' bytes as KV group `group`'s tensor holds them (its layers' keys and values, with
        an int8 cache's scales): one flat uint8 host array per block, in the layout write_blocks takes back."""
        if not block_ids:
            return []
        kv = self.kv_tensors[group]
        data = torch.stack([kv[:, :, :, b] for b in block_ids]).cpu()  # [n, layers, 2, Hkv, block_size, row]
        flat = data.view(torch.uint8).reshape(len(block_ids), -1).numpy()
        return list(flat)

    @inference
    def copy_blocks(self, copies) -> None:
        """(source, destination) block copies: copy-on-write for prefix-cache hits, forks and beams."""
        if not copies:
            return
        for g, kv in enumerate(self.kv_tensors):  # (source, destination) in the first group, a third item names another
            pairs = [c for c in copies if (c[2] if len(c) > 2 else 0) == g] if len(self.kv_tensors) > 1 else copies
            if pairs:
                src = torch.tensor([c[0] for c in pairs], device=self.device)
                dst = torch.tensor([c[1] for c in pairs], device=self.device)
                kv[:, :, :, dst] = kv[:, :, :, src]

    @inference
    def write_blocks(self, block_ids: list[int], payloads: list, group: int = 0) -> None:
        """Write read_blocks' bytes into these blocks of KV group `group`."""
        kv = self.kv_tensors[group]
        shape = kv[:, :, :, 0].shape
        for b, payload in zip(block_ids, payloads):  # a copy per block: 5x faster than one indexed put of them all
            kv[:, :, :, b].copy_(torch.frombuffer(payload, dtype=torch.uint8).view(kv.dtype).view(shape))

    # ------------------------------------------------------------ step
    @inference
    def execute(self, plan: StepPlan) -> StepOutput:
        """The whole step, in one process (executor/distributed.py runs the parts on every rank)."""
        batch, seqs = forward_batch(plan)
        if plan.run_steps > 1 and self._runs_natively(seqs):
            return self._native_step(batch, seqs)
        out = self.outputs(seqs, batch, self.forward(batch))
        return self._decode_run(plan, out) if plan.run_steps > 1 else out

    def interrupt_run(self, on: bool) -> None:
        """on: a decode run under way ends after its current forward, and runs take one forward, until called with
        False. Thread-safe: another thread raises it (Engine.interrupt_run)."""
        self._run_flag[0] = int(on)

    @inference
    def _decode_run(self, plan: StepPlan, first: StepOutput) -> StepOutput:
        """The rest of the plan's decode runs (ScheduledSeq.steps) after its first forward: each forward decodes the
        token the one before it picked, as the next step would (its position, its generator's draw, its tables with
        nothing new), so the tokens are a step's each. A sequence's run stops at a failed row or a token that ends it,
        and every run stops where the run's flag says something waits for the engine (interrupt_run)."""
        sampled = list(first.sampled)
        last = {t.seq_id: t for t in first.sampled}
        seqs = [s for s in plan.seqs if s.steps > 1]
        for i in range(1, plan.run_steps):
            seqs = [s for s in seqs if s.steps > i and not self._ends_run(last[s.seq_id], s)]
            if not seqs or self._run_flag[0]:
                break  # (an interrupted run computed what it ran: the scheduler gives its other blocks back)
            if i == 1 and self._runs_natively(seqs):  # the rest of every run in one native call
                kept = self.kept_tables.of
                tables = self.attention.native_tables([SeqSpan(s.start_pos + 1, 1, t, s.seq_id, len(t)) for s in seqs
                                                       for t in (kept[s.seq_id][0],)])
                sampled.extend(self._native_run(seqs, [last[s.seq_id].token_id for s in seqs], 1, tables))
                break
            # a step of its own's plan, with nothing new in its tables
            step = StepPlan(tuple(replace(
                s, token_ids=(last[s.seq_id].token_id,), start_pos=s.start_pos + i, num_sampled=s.num_sampled + i,
                block_table=(), table_from=s.table_from + len(s.block_table), group_tables=tuple(() for _ in s.group_tables),
                group_from=tuple(f + len(g) for f, g in zip(s.group_from, s.group_tables))) for s in seqs))
            batch, ordered = forward_batch(step)
            got = self.outputs(ordered, batch, self.forward(batch)).sampled
            sampled.extend(got)
            last.update((t.seq_id, t) for t in got)
        return StepOutput(sampled, first.prompt_logprobs, first.pooled)

    def _ends_run(self, t: SampledToken, s: ScheduledSeq) -> bool:
        """Whether the token ends its sequence's run: a failed row, an end-of-sequence id (unless ignored), a stop id."""
        return t.error is not None or t.token_id in self._run_stops(s)

    def _run_stops(self, s: ScheduledSeq) -> tuple[int, ...]:
        """The ids that end a sequence's run: its stop ids, and the end-of-sequence ids unless it ignores them."""
        stops = tuple(s.params.stop_token_ids)
        return stops if s.params.ignore_eos else stops + self.eos_token_ids

    def _runs_natively(self, seqs: list[ScheduledSeq]) -> bool:
        """Whether these decodes' runs go in one native call (DecoderPlan.greedy_run): every row a greedy pick the fused
        head makes (as _sample_batch would: no logits processor but bans, no top logprobs) of a plain decode (one token,
        no draft, grammar, history, images, pooling or prompt logprobs), one KV group, and a plan that looks up the
        step's inputs itself."""
        forward = self.model.model.native_forward
        if forward is None or not forward.ids or self.greedy_head is None or len(self.kv_groups) != 1:
            return False
        if any(len(s.token_ids) != 1 or s.draft or s.images or s.pool or not s.sample or s.prompt_targets or s.history
               or s.params.needs_history or s.token_mask is not None for s in seqs):
            return False
        return _head_picks(self._sampling_batch(seqs, self.greedy_head[1], {})[0])

    def _native_step(self, batch: ForwardBatch, seqs: list[ScheduledSeq]) -> StepOutput:
        """A step of decode runs in one native call, its first forwards too: what forward and sample keep from plan to
        plan (the tables with the plan's diffs, its block copies, its finished sequences' histories dropped), then
        every forward of the runs."""
        spans = self._spans(batch)
        self.copy_blocks(batch.block_copies)
        self.kept_history.drop(batch.finished)
        return StepOutput(self._native_run(seqs, [s.token_ids[0] for s in seqs], 0, self.attention.native_tables(spans[0])), {})

    def _native_run(self, seqs: list[ScheduledSeq], tokens: list[int], done: int, tables: torch.Tensor) -> list[SampledToken]:
        """The forwards of these sequences' runs after the first `done` (NativeForward.greedy_run), from the tokens the
        last ones picked (or the step's own), over their block tables with the runs' blocks (the attention's
        native_tables): each forward and pick as a step of its own would run them, with no Python between them. The
        step's own forward (done 0) runs whatever the run's flag says."""
        vocab = self.greedy_head[1]
        stops = [[t for t in self._run_stops(s) if 0 <= t < vocab] for s in seqs]  # (others are never picked)
        batch, _ = self._sampling_batch(seqs, vocab, {})
        rows, tokens, logprobs = self.model.model.native_forward.greedy_run(
            torch.tensor(tokens, dtype=torch.long), torch.tensor([s.start_pos + done for s in seqs], dtype=torch.long),
            [s.steps - done for s in seqs], tables, self.attention, self.greedy_head, batch.ban_index, [t for x in stops for t in x],
            list(itertools.accumulate(map(len, stops))), self.run_flag, int(done == 0))
        return _picks([seqs[r] for r in rows], tokens, logprobs)

    def outputs(self, seqs: list[ScheduledSeq], batch: ForwardBatch, hidden: torch.Tensor | None) -> StepOutput:
        """The step's end on rank 0 from the forward's hidden states: logits, sampled tokens, prompt logprobs."""
        return self.sample(seqs, self.logits(batch, hidden, seqs), batch.finished)

    @inference
    def logits(self, batch: ForwardBatch, hidden: torch.Tensor | None, seqs: list[ScheduledSeq] | None = None) -> StepLogits | None:
        """The head's part of a step: the sampled rows' logits, and the prompt-logprob rows' in pieces of
        PROMPT_LOGPROBS_ROWS, each reduced to what the answer needs as it comes (with `seqs`: rank 0). Where
        the vocabulary is split over tensor-parallel ranks every one of them runs this on the same batch, and
        each piece is a gather; without `seqs` (the other ranks) the pieces are dropped."""
        if hidden is None:
            return None
        pooled = pool(hidden, batch.pool_rows, batch.pool_lengths) if batch.pool_rows else None
        head = self.model.compute_logits
        rows = batch.sample_rows
        if rows and len(rows) == len(batch.token_ids) and rows[-1] == len(rows) - 1:  # every row, in order (they only increase):
            if seqs is not None and self.greedy_head is not None and not batch.prompt_rows:
                return StepLogits(None, [], pooled, hidden)  # rank 0's sampler may run the head with its pick
            sampled = head(hidden)  # a step of decodes, with no gather
        else:
            sampled = head(hidden[torch.tensor(rows, dtype=torch.long, device=self.device)]) if rows else None
        pieces = []
        if batch.prompt_rows:
            row_t = torch.tensor(batch.prompt_rows, dtype=torch.long, device=self.device)
            if seqs is not None:
                wanted = [s for s in seqs if s.prompt_targets]
                k = max(s.prompt_logprobs for s in wanted)
                targets = torch.tensor([t for s in wanted for t in s.prompt_targets], dtype=torch.long, device=self.device)
            for i in range(0, len(row_t), PROMPT_LOGPROBS_ROWS):
                logits = head(hidden[row_t[i : i + PROMPT_LOGPROBS_ROWS]])
                if seqs is not None:
                    logp = log_softmax_rows(logits)  # [n, V], as every logprob is taken
                    top = logp.topk(k, dim=-1) if k else None
                    chosen = logp.gather(1, targets[i : i + PROMPT_LOGPROBS_ROWS, None]).squeeze(1)
                    pieces.append((chosen, top.values if k else None, top.indices if k else None))
        return StepLogits(sampled, pieces, pooled)

    def sample(self, seqs: list[ScheduledSeq], logits: StepLogits | None, finished=()) -> StepOutput:
        """Rank 0: the sampled tokens and prompt logprobs of a step whose logits are in. finished: the plan's
        sequences that are gone. Runs once per plan, in the plans' order (as the forwards do), so the histories
        kept here follow the plans' diffs."""
        self.kept_history.drop(finished)
        if logits is None:
            return StepOutput([], {})
        histories = {s.seq_id: self.kept_history.put(s.seq_id, s.history_from, s.history, s.prompt_len, s.params.no_repeat_ngram_size)
                     for s in seqs if s.history or s.history_from}  # every sequence's diff, the ones that do not sample too
        sampled = [row for s in seqs if s.sample for row in _verified_rows(s)]
        result = self._sample(sampled, logits, histories) if sampled else []
        pooled = None
        if logits.pooled is not None:  # one host transfer for every pooling chunk of the step
            pooled = dict(zip((s.seq_id for s in seqs if s.pool), logits.pooled.tolist()))
        return StepOutput(result, self._prompt_logprobs(seqs, logits.prompt) if logits.prompt else {}, pooled)

    @inference
    def forward(self, batch: ForwardBatch, hidden: torch.Tensor | None = None) -> torch.Tensor | None:
        """Copy blocks, then run the model over the batch: hidden states [T, hidden] (None when it has no tokens).
        hidden: the previous pipeline stage's output, for a stage without the embedding."""
        dev = self.device
        spans = self._spans(batch)  # first: what the runner keeps follows every batch, whatever fails after
        self.copy_blocks(batch.block_copies)
        if batch.empty:
            return None
        pos: list[int] = []
        for s in batch.decodes:
            pos.append(s.start_pos)
        for s in batch.chunks:
            pos.extend(range(s.start_pos, s.context_len))
        input_ids = torch.tensor(batch.token_ids, dtype=torch.long, device=dev)
        embeds = None
        if batch.images and self.mrope:
            positions = torch.tensor(self._mrope_positions(pos, batch.images), dtype=torch.long, device=dev)  # [3, T]
        else:
            positions = torch.tensor(pos, dtype=torch.long, device=dev)
        if batch.images and self.encoder is not None:
            embeds = self._image_embeddings(batch.images)
        n = len(batch.decodes)
        if len(spans) == 1:
            meta = self.attention.prepare(spans[0][:n], spans[0][n:])
        else:  # each KV group's metadata over its own block tables
            meta = GroupedMetadata({group.window: self.attention.prepare(s[:n], s[n:], window=group.window, null_block=null)
                                    for group, null, s in zip(self.kv_groups, self.group_blocks, spans)}, self.attention.window)
        return self.model(input_ids, positions, self.kv_caches, meta, hidden, embeds)

    def _spans(self, batch: ForwardBatch) -> list[list[SeqSpan]]:
        """Per KV group, the step's spans (decodes, then chunks) with whole block tables: the kept ones with the
        batch's diffs in place (runner/kept.py). Runs once per batch, on every rank."""
        self.kept_tables.drop(batch.finished)
        groups = len(self.kv_groups)
        out: list[list[SeqSpan]] = [[] for _ in range(groups)]
        for i, s in enumerate(batch.decodes + batch.chunks):
            if groups == 1:
                starts, tails = (s.changed_from,), (s.block_table,)
            elif batch.group_tables:
                starts = (s.changed_from, *(f[i] for f in batch.group_from))
                tails = (s.block_table, *(t[i] for t in batch.group_tables))
            else:  # a plan made outside the KV manager (builder.time_steps' probe) names its blocks once, for all groups
                starts, tails = (s.changed_from,) * groups, (s.block_table,) * groups
            tables = self.kept_tables.put(s.seq_id, starts, tails)
            for g in range(groups):
                out[g].append(SeqSpan(s.start_pos, s.length, tables[g], s.seq_id, starts[g]))
        return out

    @staticmethod
    def _mrope_positions(pos: list[int], images: list[ImageRows]) -> list[list[int]]:
        """The step's three M-RoPE rows: every token's index, but where a sequence with images has its own."""
        rows = [pos, list(pos), list(pos)]
        for at in images:
            for row, own in zip(rows, mrope_positions(at.images, at.start_pos, at.start_pos + at.num_tokens)):
                row[at.row : at.row + at.num_tokens] = own
        return rows

    def _image_embeddings(self, images: list[ImageRows]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows, embeddings) of the step's image placeholders: each image's tower output (EncoderCache), sliced to
        the placeholders this step computes."""
        rows: list[int] = []
        parts: list[torch.Tensor] = []
        for at in images:
            end = at.start_pos + at.num_tokens
            for span in at.images:
                a, b = max(span.offset, at.start_pos), min(span.end, end)
                if a >= b:
                    continue
                parts.append(self.encoder.embeddings(span)[a - span.offset : b - span.offset])
                rows.extend(range(at.row + a - at.start_pos, at.row + b - at.start_pos))
        if not rows:
            return None
        return torch.tensor(rows, dtype=torch.long, device=self.device), torch.cat(parts)

    def _sample(self, seqs: list[ScheduledSeq], step: StepLogits, histories: dict[int, TokenHistory]) -> list[SampledToken]:
        """One SampledToken per sequence. A failure that belongs to some rows (their
        parameters, a bug they trigger) fails those sequences alone: the batch is
        sampled again row by row, and the rows that still raise get an error."""
        try:
            return self._sample_batch(seqs, step, histories)
        except Exception:
            log.exception("sampling %d rows failed; sampling them one by one to find the culprits", len(seqs))
        logits = step.rows(self.model)
        result = []
        for i, s in enumerate(seqs):
            try:
                result.extend(self._sample_batch([s], StepLogits(logits[i : i + 1], []), histories))
            except Exception:
                log.exception("sampling failed for sequence %d", s.seq_id)
                result.append(SampledToken(s.seq_id, -1, float("nan"), error=SAMPLING_FAILED))
        return result

    def _sampling_batch(self, seqs: list[ScheduledSeq], vocab_size: int, histories: dict[int, TokenHistory]) -> tuple[SamplingBatch, list[int]]:
        """The rows' SamplingBatch, and each row's number of top logprobs. The last step's batch serves again while
        its rows are the same sequences with the same parameters, and none of them carries what changes from step
        to step (a history for penalties or bans, a grammar's mask, a beam): only seeded rows' generators are made
        anew, for their position. So SamplingBatch.build runs only when the batch changes (issue 53)."""
        key = [(s.seq_id, s.params) for s in seqs]  # the same parameters: the same histories read, the same beams
        kept = self._kept_sampling
        if kept is not None and kept[0] == key and all(s.token_mask is None for s in seqs):  # a grammar's mask: anew
            batch, num_logprobs, seeded = kept[1:]
            if seeded:  # the sampled rows' generators, for this step's positions
                batch.generators = tuple(self._generator(seqs[i]) for i in seeded)
            return batch, num_logprobs
        rows = []
        for s in seqs:
            p = s.params
            if p.use_beam_search:
                p = replace(p, temperature=0.0)  # beams pick by score: processors apply, warpers do not
            rows.append(
                SamplerRow(
                    params=p,
                    eos_token_ids=self.eos_token_ids,
                    generator=self._generator(s),
                    num_logprobs=_num_logprobs(p),
                    token_mask=s.token_mask,
                    history=histories.get(s.seq_id),
                    extra=s.draft,  # a verified row's: the drafted tokens before it (_verified_rows)
                )
            )
        batch = SamplingBatch.build(rows, vocab_size, self.device)
        num_logprobs = [r.num_logprobs for r in rows]
        same_next = not any(s.seq_id in histories or s.token_mask is not None or s.params.use_beam_search for s in seqs)
        seeded = [i for i, s in enumerate(seqs) if not s.params.greedy] if any(r.generator is not None for r in rows) else []
        self._kept_sampling = (key, batch, num_logprobs, seeded) if same_next else None
        return batch, num_logprobs

    def _generator(self, s: ScheduledSeq) -> torch.Generator | None:
        """A seeded sampled row's generator at its position; None: the global RNG (or a greedy row's, which draws none)."""
        if s.seed is None or s.params.greedy or s.params.use_beam_search:
            return None
        return seeded_generator(s.seed, s.num_sampled, self.device)

    def _sample_batch(self, seqs: list[ScheduledSeq], step: StepLogits, histories: dict[int, TokenHistory]) -> list[SampledToken]:
        vocab = step.sampled.shape[-1] if step.sampled is not None else self.greedy_head[1]
        batch, num_logprobs = self._sampling_batch(seqs, vocab, histories)
        if step.sampled is None and _head_picks(batch):
            return _picks(seqs, *kernels.greedy_head(step.hidden, *self.greedy_head, batch.ban_index))
        logits = step.rows(self.model)
        out = sample(logits, batch)
        # The step's one host sync: everything the engine needs, in one transfer each.
        token_ids = out.token_ids.tolist()
        logprobs = out.logprobs.tolist()
        top_ids = out.top_ids.tolist() if out.top_ids is not None else None
        top_lps = out.top_logprobs.tolist() if out.top_logprobs is not None else None
        beam_rows = [i for i, s in enumerate(seqs) if s.params.use_beam_search]
        if beam_rows:
            # Beams rank continuations by the logits processors (penalties, bias,
            # bans) applied to the logprobs, not renormalized: transformers' beam search.
            idx = torch.tensor(beam_rows, device=self.device)
            k = max(num_logprobs[i] for i in beam_rows)
            best = process_logits(log_softmax_rows(logits.float()), batch)[idx].topk(k)
            for i, ids, lps in zip(beam_rows, best.indices.tolist(), best.values.tolist()):
                top_ids[i], top_lps[i] = ids, lps
        result = []
        for i, s in enumerate(seqs):
            if token_ids[i] < 0:  # no token: the sampler's code says why
                result.append(SampledToken(s.seq_id, -1, float("nan"), error=ROW_ERRORS[token_ids[i]]))
                continue
            k = num_logprobs[i]
            top = tuple(Logprob(t, lp) for t, lp in zip(top_ids[i][:k], top_lps[i][:k])) if k and top_ids else ()
            result.append(SampledToken(s.seq_id, token_ids[i], logprobs[i], top))
        return result

    def _prompt_logprobs(self, seqs: list[ScheduledSeq], pieces: list) -> dict[int, list[TokenLogprobs]]:
        """Prompt logprobs from the step's pieces (`logits`), for each sequence that asked.

        The logits of prompt position p give the logprob of prompt token p + 1 (its
        target) under log_softmax in float32.
        """
        chosen_l = torch.cat([p[0] for p in pieces]).tolist()
        tops = pieces[0][1] is not None  # some sequence asked for top-k alternatives
        top_vals_l = torch.cat([p[1] for p in pieces]).tolist() if tops else None
        top_ids_l = torch.cat([p[2] for p in pieces]).tolist() if tops else None
        out, i = {}, 0
        for s in seqs:
            if not s.prompt_targets:
                continue
            sk, entries = s.prompt_logprobs, []
            for tok in s.prompt_targets:
                top = [Logprob(t, lp) for t, lp in zip(top_ids_l[i][:sk], top_vals_l[i][:sk])] if sk else []
                entries.append(TokenLogprobs(tok, chosen_l[i], top))
                i += 1
            out[s.seq_id] = entries
        return out


@dataclass
class StepLogits:
    """A step's logits as the sampler takes them (ModelRunner.logits)."""

    sampled: torch.Tensor | None  # [rows that sample, V]
    prompt: list  # per piece of prompt-logprob rows: (the target's logprob [n], top-k logprobs [n, k], their ids), k >= 0
    pooled: torch.Tensor | None = None  # [pooling chunks, hidden] float64 (runner/pooling.py), in the batch's order
    # where `sampled` is None: the sampled rows' hidden states, whose logits the sampler computes (rows()), or runs with
    # a greedy pick in one native call (ModelRunner.greedy_head)
    hidden: torch.Tensor | None = None

    def rows(self, model) -> torch.Tensor:
        """The sampled rows' logits, computed from `hidden` by `model`'s head the first time they are asked for."""
        if self.sampled is None:
            self.sampled = model.compute_logits(self.hidden)
        return self.sampled


def forward_batch(plan: StepPlan) -> tuple[ForwardBatch, list[ScheduledSeq]]:
    """The plan's forward half, and its sequences in the batch's order (decodes first, then chunks)."""
    decodes = [s for s in plan.seqs if len(s.token_ids) == 1]
    chunks = [s for s in plan.seqs if len(s.token_ids) > 1]
    seqs = decodes + chunks
    ids: list[int] = []
    sample_rows: list[int] = []
    prompt_rows: list[int] = []
    images: list[ImageRows] = []
    pool_rows: list[int] = []
    pool_lengths: list[int] = []
    for s in seqs:
        if s.prompt_targets:  # the first position whose logits give prompt logprobs, and on
            first = len(ids) + s.prompt_logprobs_from - s.start_pos
            prompt_rows.extend(range(first, first + len(s.prompt_targets)))
        if s.images:
            images.append(ImageRows(len(ids), s.start_pos, len(s.token_ids), s.images))
        ids.extend(s.token_ids)
        if s.sample:  # the last token's row, and with a draft every drafted token's too
            sample_rows.extend(range(len(ids) - 1 - len(s.draft), len(ids)))
        if s.pool:  # a mean-pooling chunk's every row; a last-token request's last row; a CLS request's first
            n = len(s.token_ids) if s.pool == "mean" else 1
            first = len(ids) - len(s.token_ids) if s.pool in ("cls", "score") else len(ids) - n
            pool_rows.extend(range(first, first + n))
            pool_lengths.append(n)
    others = range(len(seqs[0].group_tables)) if seqs else ()
    batch = ForwardBatch(
        ids,
        [SeqSpan(s.start_pos, 1, s.block_table, s.seq_id, s.table_from) for s in decodes],
        [SeqSpan(s.start_pos, len(s.token_ids), s.block_table, s.seq_id, s.table_from) for s in chunks],
        list(plan.block_copies),
        sample_rows,
        prompt_rows,
        images,
        pool_rows,
        pool_lengths,
        [[s.group_tables[g] for s in seqs] for g in others],
        [[s.group_from[g] if s.group_from else 0 for s in seqs] for g in others],
        list(plan.finished),
    )
    return batch, seqs


def _head_picks(batch: SamplingBatch) -> bool:
    """Whether kernels.greedy_head may pick the batch's tokens: greedy rows whose logits nothing changes but bans
    (ignore_eos, min_tokens) and no top logprobs, so the head and the pick in one native call give the bits of
    compute_logits and sample's greedy_rows (no beams: they ask for top logprobs)."""
    return batch.all_greedy and not batch.num_top_logprobs and (batch.only_bans or not batch.any_processor)


def _picks(seqs: list[ScheduledSeq], token_ids: list[int], logprobs: list[float]) -> list[SampledToken]:
    """kernels.greedy_head's answer as a SampledToken per row (a negative id: the row's error code)."""
    return [SampledToken(s.seq_id, t, lp) if t >= 0 else SampledToken(s.seq_id, -1, float("nan"), error=ROW_ERRORS[t])
            for s, t, lp in zip(seqs, token_ids, logprobs)]


def _verified_rows(s: ScheduledSeq) -> list[ScheduledSeq]:
    """The sampling rows of a sequence: one, or with a draft d_0..d_{k-1} k + 1, row i sampling as a decode
    after d_0..d_{i-1} would (engine/speculative.py): its `draft` is those tokens (what its penalties and bans count
    after the history), its generator the one of its position, its mask the grammar's after them."""
    if not s.draft:
        return [s]
    rows = [replace(s, draft=())]
    for i in range(1, len(s.draft) + 1):
        rows.append(replace(
            s,
            draft=s.draft[:i],
            num_sampled=s.num_sampled + i,
            token_mask=s.draft_masks[i - 1] if s.draft_masks else None,
        ))
    return rows


def _num_logprobs(p) -> int:
    k = p.logprobs or 0
    if p.use_beam_search:
        k = max(k, 2 * p.num_beams)  # beam search picks among the top 2*beams of each beam
    return k
