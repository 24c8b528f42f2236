"""Which part of the model each tensor-parallel rank holds: plain bookkeeping, no torch.

A rank holds a contiguous range of query heads with the KV heads they read,
a contiguous range of the MLP's intermediate columns, and a contiguous range
of the hidden size. The q/k/v and gate/up projections are split by output
rows, as in Megatron. The attention output and down projections are split by
output rows too (the hidden range), not by input columns as in Megatron, vLLM
and SGLang: their input is gathered whole on every rank first, and each rank
computes its hidden range, which is gathered after. So no output of any
projection is a sum of partial sums made on different ranks, and a rank adds
up every output in the order one process does: tensor parallelism gives one
process's bits (tensor_parallel.TensorParallel; docs/guides/scale-out.md). The cost is two
gathers where Megatron has one sum, after each of those two projections.

Unlike vLLM, which asks that the head counts divide by the rank count, a
split here may be uneven: SmolLM2-135M has 9 query heads over 3 KV heads, so
two ranks hold one KV group and two (3 and 6 query heads). Work is split by
whole KV groups while there are at least as many KV heads as ranks; past that
each rank holds one KV head (replicated on several ranks) and a share of its
group's query heads. Intermediate columns and hidden rows move in units of
`unit` (32, the low-bit formats' group along the input, so a GGUF's codes
split without re-rounding) and are split evenly: the ranks meet at a gather
after every part of a layer, so no part can make up for another's imbalance.
The larger shares go to the later ranks: rank 0 also serves HTTP and samples.

Without pipeline stages the vocabulary is split too: each rank holds a range
of the embedding's and the logits head's rows, embeds the tokens in its range
and computes their logits, and the ranks gather both. SmolLM2-135M's head is a
third of its weights; held on rank 0 alone, it left the other rank idle for
that third of every step.
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
    hidden: tuple[int, int]  # the attention output and down projections' output rows [first, end)
    vocab: tuple[int, int] | None = None  # the embedding's and the logits head's rows [first, end); None: held whole
    experts: tuple[int, int] | None = None  # each expert's intermediate columns [first, end) (mixture of experts); None: none

    @property
    def num_heads(self) -> int:
        return self.heads[1] - self.heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def intermediate_size(self) -> int:
        return self.intermediate[1] - self.intermediate[0]

    @property
    def hidden_size(self) -> int:
        return self.hidden[1] - self.hidden[0]

    def describe(self) -> dict:
        return {"heads": list(self.heads), "kv_heads": list(self.kv_heads), "intermediate": list(self.intermediate),
                "hidden": list(self.hidden), **({"vocab": list(self.vocab)} if self.vocab is not None else {}),
                **({"experts": list(self.experts)} if self.experts is not None else {})}


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


def plan_tensor_parallel(num_heads: int, num_kv_heads: int, intermediate_size: int, hidden_size: int, size: int,
                         unit: int = 32, vocab_size: int = 0, expert_size: int = 0) -> list[TensorShard]:
    """One TensorShard per rank; a ValueError naming the shortfall when the model cannot be split `size` ways.
    vocab_size: split the embedding and the logits head's rows too (0: every rank holds them whole).
    expert_size: a mixture of experts' expert width: every expert's intermediate columns split as a dense MLP's are
    (each rank holds a slice of every expert, so routing never sends a token to another rank: vLLM's and
    SGLang's tensor-parallel MoE does the same; expert parallelism, whole experts per rank, is not done here)."""
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
    inter = _split_in_units(intermediate_size, size, unit, "the MLP's intermediate columns")
    hidden = _split_in_units(hidden_size, size, unit, "the hidden size")
    vocab = _split_in_units(vocab_size, size, unit, "the vocabulary") if vocab_size else [None] * size
    experts = _split_in_units(expert_size, size, unit, "an expert's intermediate columns") if expert_size else [None] * size
    return [TensorShard(r, size, heads[r], kv[r], inter[r], hidden[r], vocab[r], experts[r]) for r in range(size)]


def _split_in_units(total: int, size: int, unit: int, what: str) -> list[tuple[int, int]]:
    """`total` in `size` contiguous ranges, even to a `unit` (1 where `total` is no multiple of it, or too short)."""
    step = unit if total % unit == 0 and total // unit >= size else 1
    if total // step < size:
        raise ValueError(f"--tensor-parallel-size {size} exceeds {what} ({total})")
    return _ranges(split_evenly(total // step, size), step)


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
