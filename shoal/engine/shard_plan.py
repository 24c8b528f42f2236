"""Which part of the model each tensor-parallel rank holds: plain bookkeeping, no torch.

Megatron's split, as vLLM and SGLang use it: a rank holds a contiguous range
of query heads with the KV heads they read, and a contiguous range of the MLP's
intermediate columns. The q/k/v and gate/up projections are split by output
rows (column-parallel), the attention output and down projections by input
columns (row-parallel), and one sum across ranks follows each of the latter.

Unlike vLLM, which asks that the head counts divide by the rank count, a
split here may be uneven: SmolLM2-135M has 9 query heads over 3 KV heads, so
two ranks hold one KV group and two (3 and 6 query heads). Work is split by
whole KV groups while there are at least as many KV heads as ranks; past that
each rank holds one KV head (replicated on several ranks) and a share of its
group's query heads. Intermediate columns move in units of `unit` (32, the
4-bit formats' group along the input, so a GGUF's codes split without
re-rounding). Given the head size, the columns even out the ranks' projection
weights, so an uneven head split is made up in the MLP: the ranks meet at a sum
after every attention and every MLP, so a layer runs at its heaviest rank's
pace (SmolLM2 over two ranks: 864 and 672 columns beside 3 and 6 query heads,
where 768 each left rank 1 with 18% more to do). On a tie the smaller share
goes to the lower rank: rank 0 also serves HTTP and samples.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TensorShard:
    rank: int
    size: int
    heads: tuple[int, int]  # query heads [first, end)
    kv_heads: tuple[int, int]  # KV heads [first, end)
    intermediate: tuple[int, int]  # MLP intermediate columns [first, end)

    @property
    def num_heads(self) -> int:
        return self.heads[1] - self.heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def intermediate_size(self) -> int:
        return self.intermediate[1] - self.intermediate[0]

    def describe(self) -> dict:
        return {"heads": list(self.heads), "kv_heads": list(self.kv_heads), "intermediate": list(self.intermediate)}


def split_evenly(total: int, parts: int) -> list[int]:
    """Sizes of `parts` contiguous pieces of `total`, differing by at most one, larger ones last."""
    base, extra = divmod(total, parts)
    return [base + (1 if i >= parts - extra else 0) for i in range(parts)]


def _ranges(sizes: list[int], scale: int = 1) -> list[tuple[int, int]]:
    out, start = [], 0
    for s in sizes:
        out.append((start * scale, (start + s) * scale))
        start += s
    return out


def plan_tensor_parallel(num_heads: int, num_kv_heads: int, intermediate_size: int, size: int, unit: int = 32,
                         head_dim: int = 0) -> list[TensorShard]:
    """One TensorShard per rank; a ValueError naming the shortfall when the model cannot be split `size` ways.
    head_dim: weigh the heads against the columns (0: split the columns evenly)."""
    if size < 1:
        raise ValueError(f"tensor parallel size must be at least 1, got {size}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group evenly over {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads
    if size <= num_kv_heads:
        kv = _ranges(split_evenly(num_kv_heads, size))
        heads = [(a * group, b * group) for a, b in kv]
    else:
        if size % num_kv_heads:
            raise ValueError(f"--tensor-parallel-size {size} is more than the model's {num_kv_heads} KV heads and not a "
                             f"multiple of them: each KV head would be replicated on an uneven number of ranks")
        replicas = size // num_kv_heads
        if group < replicas:
            raise ValueError(f"--tensor-parallel-size {size} leaves a rank without query heads: the model has {num_heads} "
                             f"({group} per KV head, {replicas} ranks per KV head)")
        kv, heads = [], []
        for h in range(num_kv_heads):
            for a, b in _ranges(split_evenly(group, replicas)):
                kv.append((h, h + 1))
                heads.append((h * group + a, h * group + b))
    step = unit if intermediate_size % unit == 0 and intermediate_size // unit >= size else 1
    if intermediate_size // step < size:
        raise ValueError(f"--tensor-parallel-size {size} exceeds the MLP's {intermediate_size} intermediate columns")
    # Per rank, in weights per hidden unit: a query head has q and o rows of head_dim (2 d), a KV head k and v
    # (2 d), a column gate, up and down (3). Every rank gets one unit of columns, then each next unit goes to
    # the rank with the least so far (the highest such rank).
    work = [2 * head_dim * ((b - a) + (kb - ka)) + 3 * step for (a, b), (ka, kb) in zip(heads, kv)]
    units = [1] * size
    for _ in range(intermediate_size // step - size):
        r = min(range(size), key=lambda i: (work[i], -i))
        units[r] += 1
        work[r] += 3 * step
    inter = _ranges(units, step)
    return [TensorShard(r, size, heads[r], kv[r], inter[r]) for r in range(size)]


# ---------------------------------------------------------------- pipeline stages


def plan_pipeline(num_layers: int, size: int, explicit: tuple[int, ...] | None = None,
                  free_bytes: list[int] | None = None, layer_bytes: int = 0, stage0_work: float = 0.0) -> list[tuple[int, int]]:
    """Contiguous layer ranges [first, end) for `size` pipeline stages, every stage at least one layer.

    - `explicit` (`--pp-layers 10,10,10`): those counts, checked.
    - otherwise the stages get equal work, because a pipeline runs at the pace of its slowest stage:
      a layer is one unit, and stage 0 also has `stage0_work` units (the logits head, in layers' worth
      of weights read per step). With `free_bytes` (one figure per stage) and `layer_bytes`, memory
      caps each stage at free // layer_bytes layers (the seed's planner is memory-aware and gives every
      stage at least one layer); a ValueError names the shortfall when the layers do not fit.
      Layers go one at a time to the stage with the least work that has room; ties go to the later
      stage (stage 0 also schedules and samples).
    """
    if size < 1 or size > num_layers:
        raise ValueError(f"--pipeline-parallel-size {size} must be between 1 and the model's {num_layers} layers")
    if explicit is not None:
        counts = list(explicit)
        if len(counts) != size or any(c < 1 for c in counts) or sum(counts) != num_layers:
            raise ValueError(f"--pp-layers {','.join(map(str, counts))} must give each of the {size} stages at least one "
                             f"layer and add up to the model's {num_layers}")
        return _ranges(counts)
    room = [num_layers] * size
    if free_bytes is not None and layer_bytes > 0:
        room = [max(0, f) // layer_bytes for f in free_bytes]
        if sum(room) < num_layers or min(room) < 1:
            short = [f"rank {r}: room for {n}" for r, n in enumerate(room)]
            raise ValueError(f"the model's {num_layers} layers of {layer_bytes / 2**20:.1f} MiB each do not fit the "
                             f"{size} stages' free memory ({'; '.join(short)} layers; every stage needs at least one)")
    counts = [1] * size
    for _ in range(num_layers - size):
        r = min((r for r in range(size) if counts[r] < room[r]),
                key=lambda r: (counts[r] + (stage0_work if r == 0 else 0.0), -r))
        counts[r] += 1
    return _ranges(counts)
