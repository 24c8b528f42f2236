"""How large the KV pool is, and how long a context the engine serves: plain arithmetic over the model's shape and
the machine's memory, no torch (runner/build.py measures, this decides; tests fake the machine).

The pool (`--kv-cache-memory`, default auto):
- an explicit size is kept as given;
- auto aims at room for one sequence of the whole context, or for `max_num_seqs` conversations of
  TYPICAL_TOKENS each, whichever is more (and never more than `max_num_seqs` sequences of the context could
  fill): the default model's 8k context gets 64k tokens, a Llama 3.2's 128k gets 128k, as llama.cpp sizes its
  cache for the trained context;
- within what the memory has room for. On CUDA that is a fraction of the device's free memory after the weights
  (`gpu_memory_fraction`, as vLLM's `gpu_memory_utilization`), which the pool takes whole: a GPU is the
  server's. On the CPU it is what the machine has available after the weights (MemAvailable, read once they are
  loaded), less the step's workspace and a margin left to the system (a tenth of its memory, at least 1 GiB),
  shared equally by the ranks on this machine;
- and within what a server's memory budget leaves the model (`kv_cache_memory_cap`, server/models.py).
Where the machine's memory cannot be read, the pool is 1 GiB, as before sizing existed.

On the CPU the pool is reserved, not written: its pages commit as blocks fill (runner/model_runner.kv_pool_tensor),
so a large pool costs no start-up time and no memory until it is used. The kernel does not count a reservation,
so engines started side by side may together reserve more than the machine has: give each --kv-cache-memory.

The context (`--max-model-len`, default auto) is the model's trained length, capped to what the pool holds for
one sequence. A context shorter than MIN_CONTEXT (or than the trained length, if that is shorter) is refused:
the message says how much memory the model's trained length, and the smallest context, would need. An
explicit length that the pool cannot hold is refused with the flags that would make it fit.
"""

from __future__ import annotations

from dataclasses import dataclass

from shoal.config import GiB, MiB
FALLBACK_POOL = 1 * GiB  # where the machine's memory cannot be read
MARGIN_SHARE = 0.10  # of the machine's memory, left to the system and other programs
MIN_MARGIN = 1 * GiB
MIN_CONTEXT = 2048  # auto refuses a context shorter than this (or than the model's trained length)
TYPICAL_TOKENS = 1024  # a conversation, for an auto pool's aim of max_num_seqs of them
WORKSPACE = 256 * MiB  # one step's activations, logits and scratch, beside the weights and the pool


@dataclass(frozen=True)
class Machine:
    """What the memory the pool lives in has room for, read after the weights are loaded."""

    device: str  # "cpu" or "cuda"
    available: int | None  # bytes this process may still take: MemAvailable, or the device's free memory; None: unknown
    total: int | None = None  # the machine's (device's) memory


@dataclass(frozen=True)
class KVShape:
    """What one token costs in the pool, and the pool's unit."""

    bytes_per_token: int  # over every layer this process holds, K and V (and an int8 cache's scales)
    block_size: int

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)


@dataclass(frozen=True)
class PoolSize:
    num_blocks: int
    why: str  # how the size was chosen, for the start-up line


def read_meminfo(path: str = "/proc/meminfo") -> Machine:
    """The CPU's Machine: MemAvailable and MemTotal from the kernel (unknown where the file is missing)."""
    fields: dict[str, int] = {}
    try:
        with open(path) as f:
            for line in f:
                name, _, rest = line.partition(":")
                parts = rest.split()
                if name in ("MemAvailable", "MemTotal") and parts:
                    fields[name] = int(parts[0]) * 1024  # kB
    except (OSError, ValueError):
        return Machine("cpu", None)
    return Machine("cpu", fields.get("MemAvailable"), fields.get("MemTotal"))


def size_pool(shape: KVShape, machine: Machine, *, pool_bytes: int | None, context: int, max_num_seqs: int,
              workspace: int, gpu_fraction: float, cap_bytes: int | None = None, ranks_here: int = 1,
              share: float = 1.0) -> PoolSize:
    """The pool's blocks. pool_bytes: an explicit --kv-cache-memory (None: auto). context: the longest a sequence
    may be (an explicit --max-model-len, else the model's trained length), for the cap of max_num_seqs of them.
    cap_bytes: the most an auto pool takes (the room a server's memory budget leaves the model). share: the part
    of the room it takes (a speculative draft model's pool has the rest, runner/build.with_draft_share)."""
    per_block = shape.bytes_per_block
    if pool_bytes is not None:
        return PoolSize(pool_bytes // per_block, f"--kv-cache-memory {size_words(pool_bytes)}")
    if machine.available is None:
        blocks, why, where = FALLBACK_POOL // per_block, f"auto: {size_words(FALLBACK_POOL)}, as this machine's free memory is unknown", ""
    else:
        if machine.device == "cuda":  # the device is the server's: the pool takes the room
            room = int(machine.available * gpu_fraction * share)
            where = f"{gpu_fraction:.0%} of the {size_words(machine.available)} free on the device"
            aim = None
        else:
            margin = max(MIN_MARGIN, int(MARGIN_SHARE * (machine.total or 0)))
            room = int(max(0, machine.available - margin - workspace) // max(1, ranks_here) * share)
            where = (f"{size_words(machine.available)} available after the weights, less {size_words(margin)} for the "
                     f"system and {size_words(workspace)} of workspace" + (f", shared by {ranks_here} ranks" if ranks_here > 1 else ""))
            aim_tokens = min(max(context, max_num_seqs * TYPICAL_TOKENS), max_num_seqs * context)
            aim = shape.blocks_for(aim_tokens)
        if share < 1:
            where += f"; {share:.0%} of that, the draft model's pool beside"
        blocks, why = room // per_block, f"auto: the room, {where}"
        if aim is not None and aim < blocks:
            aim_why = ("one sequence of the context" if aim_tokens == context
                       else f"{max_num_seqs} sequences of {aim_tokens // max_num_seqs} tokens")
            blocks, why = aim, f"auto: {aim_why}, within the room ({where})"
    if cap_bytes is not None and cap_bytes // per_block < blocks:
        blocks, why = cap_bytes // per_block, (f"auto: {size_words(cap_bytes)}, what the memory budget leaves the model"
                                               + (f" ({where})" if where else ""))
    return PoolSize(blocks, why)


UNBOUNDED = 1 << 40  # blocks: more than any pool holds


def group_blocks(num_blocks: int, groups, *, layer_bytes: int, block_size: int, max_num_seqs: int, step_tokens: int,
                 fixed: bool) -> tuple[int, ...]:
    """Each KV group's blocks (types.KVGroup), from a pool of `num_blocks` blocks of every layer (layer_bytes: one
    layer's block). A windowed group beside a full-attention one never holds more than what its window and a step
    need of each sequence: max_num_seqs times the window's blocks and two more (the block a window starts in, the
    one a step ends in), and the step's tokens; the memory that frees goes to the full-attention group, unless the
    pool was given in blocks (`fixed`), which the full-attention group then keeps. A model whose layers are all
    windowed gives each group the pool's blocks (its served context is the pool's, as with full attention). A pipeline
    stage's groups hold its layers only, and one may hold none."""
    if len(groups) == 1 or groups[0].window is not None:
        return (num_blocks,) * len(groups)
    blocks_for = lambda tokens: -(-tokens // block_size)  # noqa: E731
    windowed = [min(num_blocks, max_num_seqs * (blocks_for(g.window) + 2) + blocks_for(step_tokens)) for g in groups[1:]]
    if fixed:
        return (num_blocks, *windowed)
    if not groups[0].layers:  # a pipeline stage without full-attention layers: no bound from here (the ranks agree
        return (UNBOUNDED, *windowed)  # on the smallest)
    total = num_blocks * sum(len(g.layers) for g in groups)  # layer-blocks the budget holds
    full = (total - sum(n * len(g.layers) for n, g in zip(windowed, groups[1:]))) // len(groups[0].layers)
    return (max(num_blocks, full), *windowed)


def served_context(shape: KVShape, num_blocks: int, *, trained: int, requested: int | None, pool: PoolSize,
                   cache: str) -> tuple[int, str]:
    """The context the engine serves, and why: an explicit --max-model-len if the pool holds one sequence of it,
    else the model's trained length capped to the pool. Raises ValueError, in words a user acts on, where
    nothing sensible fits. cache: what the cache holds ("int8", "float32"...), so int8 is offered only where it
    would halve something."""
    held = num_blocks * shape.block_size  # tokens
    smaller = cache != "int8"
    if requested is not None:  # (runner/build.py refuses one past the trained length before loading the weights)
        if shape.blocks_for(requested) > num_blocks:
            raise ValueError(
                f"--max-model-len {requested} needs {size_words(shape.blocks_for(requested) * shape.bytes_per_block)} of KV cache "
                f"for one sequence, and the pool holds {size_words(num_blocks * shape.bytes_per_block)} ({held} tokens; "
                f"{pool.why}): lower --max-model-len to at most {held}, give --kv-cache-memory "
                f"{size_words(shape.blocks_for(requested) * shape.bytes_per_block, up=True)} or more"
                + (", or halve the cache's bytes with --kv-cache-dtype int8" if smaller else ""))
        return requested, "--max-model-len"
    least = min(trained, MIN_CONTEXT)
    if held < least:
        raise ValueError(
            f"not even a context of {least} tokens fits the KV cache: the pool holds {held} tokens "
            f"({size_words(num_blocks * shape.bytes_per_block)}; {pool.why}), and {least} tokens need "
            f"{size_words(shape.blocks_for(least) * shape.bytes_per_block, up=True)} ({trained} tokens, the model's trained "
            f"length, {size_words(shape.blocks_for(trained) * shape.bytes_per_block, up=True)}): free memory"
            + (", give --kv-cache-memory, or use --kv-cache-dtype int8" if smaller else " or give --kv-cache-memory"))
    if held >= trained:
        return trained, "the model's trained length"
    return held, f"the model's trained length is {trained}; the pool holds one sequence of {held}"


def size_words(n: int, up: bool = False) -> str:
    """Bytes in words: GiB with one decimal from 1 GiB, else MiB, else KiB; rounded to the nearest, or up where
    the figure is a flag's value to give."""
    if n >= GiB:
        return f"{(-(-n * 10 // GiB) if up else round(n * 10 / GiB)) / 10:.1f} GiB"
    if n >= MiB:
        return f"{-(-n // MiB) if up else round(n / MiB)} MiB"
    return f"{-(-n // 1024) if up else round(n / 1024)} KiB"
