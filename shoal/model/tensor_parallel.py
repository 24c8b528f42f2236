"""Tensor parallelism, applied to a model built whole: the layers stay single-rank math.

Two steps, as in gpt-fast's tp.py, split in two because loading sits between them:

- `shard_model`, on the meta device before any weight is read: the projections, the embedding and the
  logits head are rebuilt at this rank's size (runner/shard_plan.py says which heads, columns and rows),
  and the attention layers take the rank's shape. The loader then reads only those rows.
- `connect_ranks`, once the weights are in and the model is otherwise final (its int8 head, its invariant
  matmuls): the attention output and down projections, the embedding and the logits are wrapped in gathers.
  Loading, the head and the invariance swap therefore only ever see plain single-rank layers.

Why every split is by output rows, with two gathers where Megatron sums partial outputs once: see
`TensorParallel` and runner/shard_plan.py.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from functools import partial
from typing import Callable

import torch
from torch import nn

from shoal.model.layers import MLP, Attention, Layer, Linear, MoE, embedding


@dataclass(frozen=True)
class TensorParallel:
    """One tensor-parallel rank's view of the split: every rank's TensorShard (runner/shard_plan.py), which is
    this one, and `gather(part, widths)`, which sets every rank's [T, widths[r]] part side by side, in rank
    order, on every rank (the executor's collective).

    The attention output and down projections are split by output rows: each rank gathers their whole
    input, computes its range of the hidden size, and the ranges are gathered. Two gathers where Megatron
    sums partial outputs once, so that every output of every projection is summed on one rank in one
    process's order: the ranks give one process's bits. (With activations rounded to int8 before each
    low-bit projection, a partial sum's last bit can tip a rounding, and answers would part from one
    process's at the next near tie; docs/guides/scale-out.md.)
    """

    shards: tuple  # runner.shard_plan.TensorShard, one per rank
    rank: int
    gather: Callable[[torch.Tensor, tuple[int, ...]], torch.Tensor]

    @property
    def shard(self):
        return self.shards[self.rank]

    def widths(self, what: str, scale: int = 1) -> tuple[int, ...]:
        """Every rank's size of one of its shard's ranges ("heads", "intermediate", "hidden", "vocab"), times `scale`."""
        return tuple((getattr(s, what)[1] - getattr(s, what)[0]) * scale for s in self.shards)

    def widest(self, head_dim: int) -> int:
        """The widest part any rank puts into a layer's gathers, in values per token (the logits' gathers go in
        pieces of rows that fit: RankGroup.gather_columns)."""
        experts = self.widths("experts") if self.shard.experts is not None else (0,)
        return max(max(self.widths("heads", head_dim)), max(self.widths("intermediate")), max(self.widths("hidden")), max(experts))


def shard_model(model, tp: TensorParallel, linear) -> None:
    """Rebuild a DecoderForCausalLM (on the meta device) at rank `tp.rank`'s size. `linear` is the factory it was
    built with (quant.WeightFormat.linear). q/k/v and gate/up keep this rank's heads and columns; the output and
    down projections read every rank's (gathered) and give this rank's range of the hidden size; where the
    shard has a vocabulary range, the embedding and an untied head keep those rows. Norms stay whole."""
    shard, whole = tp.shard, model.config
    c = whole.sharded(shard)
    hidden = tp.widths("hidden")[tp.rank]
    for layer in model.model.layers:  # the layers' own constructors at the rank's shape, then the split outputs
        layer.self_attn = Attention(c, linear, layer.spec)
        layer.self_attn.o_proj = linear(sum(tp.widths("heads", c.head_dim)), hidden, False)
        if layer.spec.mlp.experts:  # every expert at the rank's columns of it (TensorShard.experts)
            width = tp.widths("experts")[tp.rank]
            layer.mlp = MoE(c, linear, replace(layer.spec, mlp=replace(layer.spec.mlp, width=width)))
            for expert in layer.mlp.experts.mlps:
                expert.down_proj = linear(sum(tp.widths("experts")), hidden, False)
        else:
            layer.mlp = MLP(c, linear, layer.spec)
            layer.mlp.down_proj = linear(sum(tp.widths("intermediate")), hidden, False)
    if shard.vocab is not None:
        rows = shard.vocab[1] - shard.vocab[0]
        if model.model.embed_tokens is not None:
            model.model.embed_tokens = embedding(rows, c.hidden_size)
        if hasattr(model, "lm_head"):
            model.lm_head = Linear(c.hidden_size, rows, bias=False)
    model.config, model.tp, model.shard, model.vocab = c, tp, shard, shard.vocab


def connect_ranks(model) -> None:
    """Wrap a sharded, loaded model's layers in the gathers that join the ranks: the output and down projections
    take every rank's input and give every rank the whole hidden state; a split embedding looks up each token
    on the rank that holds it; split logits are gathered (DecoderForCausalLM.gather_logits)."""
    tp = model.tp
    heads, columns, hidden = tp.widths("heads", model.config.head_dim), tp.widths("intermediate"), tp.widths("hidden")
    experts = tp.widths("experts") if tp.shard.experts is not None else None
    for layer in model.model.layers:
        layer.self_attn.o_proj = Gathered(layer.self_attn.o_proj, tp.gather, heads, hidden)
        if isinstance(layer.mlp, MoE):  # two gathers a layer as for a dense MLP, each over all the step's experts' rows
            layer.mlp.experts.gather = partial(tp.gather, widths=experts)
            layer.mlp.gather = partial(tp.gather, widths=hidden)
        else:
            layer.mlp.down_proj = Gathered(layer.mlp.down_proj, tp.gather, columns, hidden)
    if model.vocab is None:
        return
    if model.model.embed_tokens is not None:
        model.model.embed_tokens = SplitEmbedding(model.model.embed_tokens, tp)
    vocab = tp.widths("vocab")
    model.gather_logits = lambda logits: tp.gather(logits, vocab)


class Gathered(Layer):
    """A projection split by output rows: its input is gathered whole from every rank first (`into`: each
    rank's width), and its output range is gathered with the other ranks' after (`out`)."""

    def __init__(self, inner: nn.Module, gather, into: tuple[int, ...], out: tuple[int, ...]) -> None:
        super().__init__()
        self.inner, self.gather, self.into, self.out = inner, gather, into, out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gather(self.inner(self.gather(x, self.into)), self.out)


class SplitEmbedding(Layer):
    """An embedding split by vocabulary rows: each rank looks up the tokens in its range, and every rank takes
    each token's row from the rank that holds it (a gather: the values move, nothing is added)."""

    def __init__(self, inner: nn.Module, tp: TensorParallel) -> None:
        super().__init__()
        self.inner, self.gather, self.ranks = inner, tp.gather, len(tp.shards)
        self.first, self.end = tp.shard.vocab
        device = next(itertools.chain(inner.parameters(), inner.buffers())).device
        self.register_buffer("starts", torch.tensor([s.vocab[0] for s in tp.shards[1:]], device=device), persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        """The rank's rows of a float table: a tied logits head reads them (DecoderForCausalLM.compute_logits)."""
        return self.inner.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.first
        mine = (local >= 0) & (local < self.end - self.first)
        x = self.inner(torch.where(mine, local, torch.zeros_like(local)))
        T, H = x.shape
        every = self.gather(x, (H,) * self.ranks).view(T, -1, H)  # [T, ranks, H]
        owner = torch.bucketize(input_ids, self.starts, right=True)
        return every[torch.arange(T), owner]
