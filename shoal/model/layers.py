"""Building blocks shared by every model family.

References: transformers' modeling_llama.py / modeling_qwen3.py (the numerics
we must match), nano-vllm's layers (fused qkv and gate_up projections).

Projections are fused (q|k|v into one matrix, gate|up into another) because on
a 2-core CPU each linear call has a fixed cost: 30 layers x 5 fewer calls per
step is measurable. The checkpoint names stay HF's; `STACKED_PARAMS` maps them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from shoal import kernels
from shoal.model.config import ModelConfig

# (fused parameter, checkpoint parameter, shard index): weight-name mapping as data.
STACKED_PARAMS = (
    ("qkv_proj", "q_proj", 0),
    ("qkv_proj", "k_proj", 1),
    ("qkv_proj", "v_proj", 2),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)

# Tensor parallelism (runner/shard_plan.py): checkpoint projection -> which of its shard's ranges holds its output rows.
# Every split is by output rows; the attention output and down projections read their whole input, gathered.
SHARDED_PARAMS = (
    ("q_proj", "heads"),
    ("k_proj", "kv_heads"),
    ("v_proj", "kv_heads"),
    ("o_proj", "hidden"),
    ("gate_proj", "intermediate"),
    ("up_proj", "intermediate"),
    ("down_proj", "hidden"),
    ("embed_tokens", "vocab"),  # without pipeline stages (TensorShard.vocab)
    ("lm_head", "vocab"),
)


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
    process's at the next near tie; README, Scale-out.)
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
        return max(max(self.widths("heads", head_dim)), max(self.widths("intermediate")), max(self.widths("hidden")))


class Layer(nn.Module):
    """An nn.Module whose call is its forward.

    nn.Module.__call__ dispatches hooks on every call; the model calls about
    270 modules per step and registers no hooks, so that machinery (with the
    `__getattr__` lookups it triggers) cost ~0.8 ms of a 10 ms one-sequence
    int4 decode step (cProfile, benchmarks/NOTES.md). Hooks on these modules
    therefore do not fire.
    """

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls.__call__ = cls.forward


class Linear(Layer, nn.Linear):
    pass


def float_linear(in_features: int, out_features: int, bias: bool, parts: tuple[int, ...] | None = None) -> Linear:
    """The default linear factory (quant.WeightFormat.linear is the general one); fused parts load by row ranges."""
    return Linear(in_features, out_features, bias=bias)


# oneDNN's bfloat16/float16 GEMMs on the CPU give a row the same bits whatever the
# number of rows only while the reduction is at most this long: past it, rows in a
# full M block and rows in a tail block add their partial sums differently
# (tests/test_invariance.py measures it at SmolLM2's 1536-wide down projection).
INVARIANT_K = 1024


@functools.cache
def gemm_is_row_invariant(dtype: torch.dtype) -> bool:
    """Whether this host's GEMMs in `dtype`, called the way the invariant paths call them, give a row
    the same bits whatever the number of rows, for linears and batched matmuls. Probed once per
    process and dtype, on random data.

    - float32 (MKL, in the strict mode `--deterministic` sets): yes on the Intel Xeon hosts; no on
      an AMD EPYC host of the same kind (2026-11-23), where MKL's strict mode still changed a row
      with the batch.
    - bfloat16/float16 with reductions of at most INVARIANT_K (InvariantLinear splits longer ones):
      yes where the CPU multiplies bf16 natively (oneDNN's AVX512-BF16/AMX kernels); no on an Intel
      Xeon without avx512_bf16 (2026-11-23), where oneDNN's emulated bf16 GEMM blocks rows its own way.

    Where the answer is no, the invariant paths compute in a wider dtype (`wide_dtype`).
    """
    g = torch.Generator().manual_seed(0)
    shapes = ((576, 960), (1536, 576)) if dtype == torch.float32 else ((576, 960), (INVARIANT_K, 576))
    sizes = (2, 3, 5, 8, 17, 33)
    for k, n in shapes:
        w, x = torch.randn(n, k, generator=g).to(dtype), torch.randn(70, k, generator=g).to(dtype)
        full = F.linear(x, w)
        if any(not torch.equal(F.linear(x[:b], w), full[:b]) for b in sizes):
            return False
    a, b = torch.randn(3, 4, 70, 64, generator=g).to(dtype), torch.randn(3, 4, 64, 256, generator=g).to(dtype)
    full = torch.matmul(a, b)
    return all(torch.equal(torch.matmul(a[:, :, :m], b), full[:, :, :m]) for m in sizes)


def wide_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """The dtype the invariant paths multiply `dtype` tensors in on this CPU: None (as they are) where its
    GEMMs are row-invariant, else float32 for a half dtype where float32's are, else float64."""
    if gemm_is_row_invariant(dtype):
        return None
    if dtype != torch.float32 and gemm_is_row_invariant(torch.float32):
        return torch.float32
    return torch.float64


def pads_single_row(dtype: torch.dtype) -> bool:
    """Whether the invariant paths run a one-row GEMM in `dtype` on two copies of the row: oneDNN's half-precision
    GEMMs take another kernel for one row than for several, which rounds a few outputs differently (float16 on the
    Intel Xeon hosts; bfloat16 on an AMD EPYC with avx512_bf16, 2026-11-24: 3 rows in 2,048 at a 64 x 64 linear,
    and never at two rows). Not where the GEMM is widened (`wide_dtype`), which has no such kernel."""
    return dtype in (torch.float16, torch.bfloat16) and wide_dtype(dtype) is None


def wide_matmul(a: torch.Tensor, b: torch.Tensor, via: torch.dtype = torch.float64) -> torch.Tensor:
    """a @ b computed in `via`, rounded once to a's dtype: a row's bits then depend on its own products
    only (float64's sum order changes nothing a float32 rounding can see, in practice; float32's GEMM
    is row-invariant where `via` is float32)."""
    return torch.matmul(a.to(via), b.to(via)).to(a.dtype)


class InvariantLinear(Layer):
    """A linear layer whose every output row is the same whatever else is in the batch.

    - A reduction longer than INVARIANT_K is cut into equal pieces of at most
      that length; each piece is one GEMM in the activation dtype, and the
      pieces are added in order in float32 (one rounding back at the end).
    - `pad_single_row` (`pads_single_row`): the half-precision GEMMs take another kernel
      for a single row than for several, so a one-row call runs on the row twice.

    - `wide` (a dtype, where the host's GEMM in the activation dtype is not
      row-invariant: `wide_dtype`): one GEMM in that dtype, rounded back once.
      True means float64.

    Chosen once per layer by `make_row_invariant` when the device and dtype need it.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, pad_single_row: bool, wide: torch.dtype | bool | None = None) -> None:
        super().__init__()
        self.wide = torch.float64 if wide is True else (wide or None)
        if self.wide is not None:
            self.register_buffer("weight_t", weight.to(self.wide).T.contiguous(), persistent=False)
            self.bias, self.in_features, self.out_features = bias, weight.shape[1], weight.shape[0]
            return
        k = weight.shape[1]
        pieces = -(-k // INVARIANT_K)
        size = -(-k // pieces)
        self.bounds = [(i, min(i + size, k)) for i in range(0, k, size)]
        self.parts = [weight[:, a:b].contiguous() for a, b in self.bounds]
        for i, w in enumerate(self.parts):
            self.register_buffer(f"weight_{i}", w, persistent=False)
        self.bias = bias
        self.pad_single_row = pad_single_row
        self.in_features, self.out_features = k, weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.wide is not None:
            y = wide_matmul(x, self.weight_t, self.wide)
            return y if self.bias is None else y + self.bias
        single = self.pad_single_row and x.shape[0] == 1
        if single:
            x = torch.cat((x, x))
        if len(self.parts) == 1:
            y = F.linear(x, self.parts[0], self.bias)
        else:
            y = None
            for (a, b), w in zip(self.bounds, self.parts):
                part = F.linear(x[:, a:b].contiguous(), w)
                y = part.float() if y is None else y.add_(part)
            y = y.to(x.dtype) if self.bias is None else y.add_(self.bias).to(x.dtype)
        return y[:1] if single else y


def make_row_invariant(model: nn.Module, device: torch.device, dtype: torch.dtype, head: bool = True) -> int:
    """Swap the linear layers (and the logits head, where this rank computes logits: `head`) whose GEMM is
    not row-invariant on this device and dtype for InvariantLinear; returns how many were swapped.

    bfloat16/float16 on the CPU: reductions longer than INVARIANT_K are split,
    and single rows are padded (`pads_single_row`). float32 on the CPU needs nothing here where
    MKL's strict reproducible mode (config.STRICT_MKL) is row-invariant. Where
    the host's GEMMs in `dtype` are not row-invariant even so (`gemm_is_row_invariant`),
    every linear goes wide (`wide_dtype`). Weight-only int8/int4 kernels are
    row-invariant as they are.
    """
    if device.type != "cpu":
        return 0
    wide = wide_dtype(dtype)
    if dtype == torch.float32 and wide is None:
        return 0
    pad = pads_single_row(dtype)
    swapped = 0
    if head and model.logits_head is None and model.model.embed_tokens is not None:  # the head (rank 0's): F.linear over the embedding or lm_head
        head = model.model.embed_tokens.weight if model.config.tie_word_embeddings else model.lm_head.weight
        if wide is not None or pad or head.shape[1] > INVARIANT_K:
            model.logits_head = InvariantLinear(head.detach(), None, pad, wide)
            swapped += 1
    for owner in list(model.model.modules()):  # the decoder's projections; the head is done
        for name, child in list(owner.named_children()):
            if type(child) is Linear and (wide is not None or pad or child.in_features > INVARIANT_K):
                setattr(owner, name, InvariantLinear(child.weight.detach(), child.bias, pad, wide))
                swapped += 1
    return swapped


def bind_attributes(model: nn.Module) -> None:
    """Copy every module's submodules, parameters and buffers into its instance dict.

    Reading `self.weight` or `self.qkv_proj` goes through nn.Module.__getattr__
    (they live in `_parameters`/`_modules`/`_buffers`): ~550 slow lookups per
    step, ~0.5 ms of a one-sequence int4 decode step. With the copies, plain
    attribute lookup finds them first. Call it once the model is final: a later
    `setattr` of a module or parameter drops its copy (nn.Module.__setattr__
    does), but `.to()` swaps buffers without touching the copies.
    """
    for m in model.modules():
        for registry in (m._modules, m._parameters, m._buffers):
            for name, value in registry.items():
                m.__dict__[name] = value


class RMSNorm(Layer):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernels.native_for(x):  # one op where torch runs about fifteen
            return kernels.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
        # HF normalizes in float32 and casts back before scaling.
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


class Rotary(Layer):
    """cos/sin tables for every position, HF's rotate-half layout."""

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        inv_freq, scaling = rope_inv_freq(config)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        """positions: [T] -> the step's cos and signed sin: looked up once per step, used by every layer.

        HF rotates x by x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1).
        That is roll(x, D/2) * cat(-sin1, sin2): the sign moves into the table,
        and the rotation is one roll instead of a chunk, a negation and a cat.
        """
        sin = self.sin[positions].float()
        half = sin.shape[-1] // 2
        signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        cos = self.cos[positions].float()
        if kernels.native_for(cos):  # the native op takes float32 [T, D] and rounds once
            return RopeTables(cos.contiguous(), signed, native=True)
        return RopeTables(cos.unsqueeze(1).to(dtype), signed.unsqueeze(1).to(dtype), native=False)


class RopeTables(NamedTuple):
    cos: torch.Tensor  # [T, 1, D] in the model's dtype, or [T, D] float32 for the native op
    signed_sin: torch.Tensor
    native: bool


def apply_rope(x: torch.Tensor, rope: RopeTables) -> torch.Tensor:
    """x: [T, H, D] rotated by its token's position (see Rotary.forward); in place on the native path."""
    if rope.native:
        return kernels.rope_(x, rope.cos, rope.signed_sin)
    return torch.addcmul(x * rope.cos, x.roll(x.shape[-1] // 2, dims=-1), rope.signed_sin)


def rope_inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling, as transformers computes them."""
    hf = config.hf_config
    params = getattr(hf, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
        dim = config.head_dim
        return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)), 1.0
    if rope_type == "dynamic":
        raise NotImplementedError("dynamic NTK rope scaling changes with sequence length; not supported yet")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu")
    return inv_freq.float(), float(scaling)


class Attention(Layer):
    def __init__(self, config: ModelConfig, linear=float_linear, tp: TensorParallel | None = None) -> None:
        """tp: this rank's part of a tensor-parallel split (None: one rank); config is then the rank's shape."""
        super().__init__()
        self.c = config
        self.tp = tp
        parts = (config.q_size, config.kv_size, config.kv_size)
        self.qkv_proj = linear(config.hidden_size, sum(parts), config.attention_bias, parts)
        if tp is None:
            self.o_proj = linear(config.q_size, config.hidden_size, False)
        else:  # every rank's heads in, this rank's hidden range out
            self.gathered = (tp.widths("heads", config.head_dim), tp.widths("hidden"))
            self.o_proj = linear(sum(self.gathered[0]), self.gathered[1][tp.rank], False)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.scale = config.head_dim**-0.5

    def forward(self, x: torch.Tensor, rope, kv: torch.Tensor, meta) -> torch.Tensor:
        """kv: this layer's cache [2, Hkv, blocks, block_size, D]; meta: the attention backend's metadata for the step."""
        c = self.c
        T = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (Hq + 2 Hkv) * D]
        # q and k sit side by side in qkv: rotate them in one go, [T, Hq + Hkv, D].
        qk = qkv[:, : c.q_size + c.kv_size].view(T, c.num_heads + c.num_kv_heads, c.head_dim)
        v = qkv[:, c.q_size + c.kv_size :].view(T, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            qk = torch.cat((self.q_norm(qk[:, : c.num_heads]), self.k_norm(qk[:, c.num_heads :])), dim=1)
        qk = apply_rope(qk, rope)
        q, k = qk[:, : c.num_heads], qk[:, c.num_heads :]
        o = meta.forward(q, k, v, kv, self.scale).reshape(T, c.q_size)
        if self.tp is None:
            return self.o_proj(o)
        heads, hidden = self.gathered
        return self.tp.gather(self.o_proj(self.tp.gather(o, heads)), hidden)


class MLP(Layer):
    def __init__(self, config: ModelConfig, linear=float_linear, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.gate_up_proj = linear(config.hidden_size, 2 * config.intermediate_size, False, (config.intermediate_size,) * 2)
        if tp is None:
            self.down_proj = linear(config.intermediate_size, config.hidden_size, False)
        else:  # every rank's columns in, this rank's hidden range out
            self.gathered = (tp.widths("intermediate"), tp.widths("hidden"))
            self.down_proj = linear(sum(self.gathered[0]), self.gathered[1][tp.rank], False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if kernels.native_for(gate_up):
            act = kernels.silu_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate) * up
        if self.tp is None:
            return self.down_proj(act)
        columns, hidden = self.gathered
        return self.tp.gather(self.down_proj(self.tp.gather(act, columns)), hidden)


class DecoderLayer(Layer):
    def __init__(self, config: ModelConfig, linear=float_linear, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, linear, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, linear, tp)

    def forward(self, x, rope, kv, meta):
        x = x + self.self_attn(self.input_layernorm(x), rope, kv, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(Layer):
    """Embeddings, N pre-norm decoder layers, final norm: the HF `model.` prefix."""

    def __init__(self, config: ModelConfig, max_positions: int, linear=float_linear, tp: TensorParallel | None = None, first: bool = True,
                 last: bool = True) -> None:
        """first / last: whether this holds the model's first / last layers (a pipeline stage may hold neither):
        the embedding lives on the first stage, the final norm is applied on the last."""
        super().__init__()
        self.vocab = tp.shard.vocab if tp is not None else None  # this rank's rows of a split embedding
        rows = config.vocab_size if self.vocab is None else self.vocab[1] - self.vocab[0]
        self.embed_tokens = nn.Embedding(rows, config.hidden_size) if first else None
        if self.vocab is not None:
            self.tp, self.vocab_starts = tp, [s.vocab[0] for s in tp.shards[1:]]
        self.rotary = Rotary(config, max_positions)
        self.layers = nn.ModuleList(DecoderLayer(config, linear, tp) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.last = last

    def forward(self, input_ids, positions, kv_caches, meta, hidden=None):
        """hidden: the previous pipeline stage's output, in place of embedding input_ids."""
        x = self._embed(input_ids) if hidden is None else hidden  # [T, hidden]
        rope = self.rotary(positions, x.dtype)
        if kernels.native_for(x):
            return self._forward_fused(x, rope, kv_caches, meta)
        for layer, kv in zip(self.layers, kv_caches):
            x = layer(x, rope, kv, meta)
        return self.norm(x) if self.last else x

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows; with a split vocabulary, each rank looks up the tokens in its range and every rank
        takes each token's row from the rank that holds it (a gather: the values move, nothing is added)."""
        if self.vocab is None:
            return self.embed_tokens(input_ids)
        first, end = self.vocab
        local = input_ids - first
        mine = (local >= 0) & (local < end - first)
        x = self.embed_tokens(torch.where(mine, local, torch.zeros_like(local)))
        T, H = x.shape
        every = self.tp.gather(x, (H,) * len(self.tp.shards)).view(T, -1, H)  # [T, ranks, H]
        owner = torch.bucketize(input_ids, torch.tensor(self.vocab_starts, device=input_ids.device), right=True)
        return every[torch.arange(T), owner]

    def _forward_fused(self, x, rope, kv_caches, meta):
        """The same layers with each residual add fused into the norm that follows it (native ops):
        x <- x + delta and h <- RMSNorm(x) in one op, so a layer is norm, attention, add+norm, MLP."""
        layers = self.layers
        h = layers[0].input_layernorm(x)
        for i, (layer, kv) in enumerate(zip(layers, kv_caches)):
            x, h = kernels.add_rms_norm(x, layer.self_attn(h, rope, kv, meta), layer.post_attention_layernorm.weight,
                                        layer.post_attention_layernorm.eps)
            delta = layer.mlp(h)
            norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.norm if self.last else None
            if norm is None:  # a pipeline stage before the last: the residual stream goes on
                return x + delta
            x, h = kernels.add_rms_norm(x, delta, norm.weight, norm.eps)
        return h


class DecoderForCausalLM(nn.Module):
    """A decoder-only LM. Families subclass it to say what differs (see llama.py)."""

    qk_norm = False
    attention_bias: bool | None = None  # None: as the config says

    def __init__(self, hf_config, max_positions: int, linear=float_linear, tp: TensorParallel | None = None,
                 layers: tuple[int, int] | None = None) -> None:
        """linear(in, out, bias, parts) builds the decoder's projections: `quant.WeightFormat.linear`
        chooses their weight format here, before any weight is loaded.

        tp (TensorParallel): build one tensor-parallel rank's part, its heads, intermediate columns and
        range of the hidden size, whose layers gather what they need from the other ranks; and, where its
        shard has a `vocab` range (no pipeline stages), its rows of the embedding and the logits head,
        whose lookups and logits are gathered too. Norms stay whole on every rank.

        layers (first, end): a pipeline stage's range of decoder layers. The embedding and the logits
        head live on the stage with layer 0 (rank 0, which samples); the final norm on every stage,
        applied by the last.
        """
        super().__init__()
        self.config = ModelConfig.from_hf(hf_config, qk_norm=self.qk_norm, attention_bias=self.attention_bias)
        tp = tp if tp is not None and len(tp.shards) > 1 else None
        self.tp = tp
        self.shard = tp.shard if tp is not None else None
        self.head_dim = self.config.head_dim
        total = self.config.num_layers
        self.layer_range = layers or (0, total)
        if self.shard is not None:
            self.config = self.config.sharded(self.shard)
        first = self.layer_range[0] == 0
        if self.layer_range != (0, total):
            self.config = replace(self.config, num_layers=self.layer_range[1] - self.layer_range[0])
        self.model = DecoderModel(self.config, max_positions, linear, tp, first, self.layer_range[1] == total)
        self.vocab = self.model.vocab
        if not self.config.tie_word_embeddings and first:
            rows = self.model.embed_tokens.num_embeddings  # this rank's slice of a split vocabulary
            self.lm_head = Linear(self.config.hidden_size, rows, bias=False)
        self.logits_head: nn.Module | None = None  # set by WeightFormat.finish_head: replaces the (tied) head

    def forward(self, input_ids, positions, kv_caches, meta, hidden=None) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden states [T, hidden] (hidden: a previous pipeline stage's)."""
        return self.model(input_ids, positions, kv_caches, meta, hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> logits [N, vocab] in float32. With a split vocabulary (`vocab`) every
        tensor-parallel rank computes its rows' logits, and they are gathered: call it on every rank alike."""
        if self.logits_head is not None:
            logits = self.logits_head(hidden).float()
        else:
            w = self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
            logits = F.linear(hidden, w).float()
        return logits if self.vocab is None else self.tp.gather(logits, self.tp.widths("vocab"))

    @torch.no_grad()
    def load_weights(self, state_dict: dict) -> None:
        """Copy HF-named tensors in, fusing the stacked projections; every parameter must be set.

        A projection whose layer loads by parts (a low-bit format, see quant.PartLoader)
        takes its weight through `load_part` (a float tensor or a GGUF's Q4 codes) and
        packs it in `finish_loading`; everything else is copied into its parameter.
        """
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        for name, tensor in state_dict.items():
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            if "rotary_emb" in name:
                continue
            name = self._local_name(name)
            if name is None:  # another pipeline stage's
                continue
            if self.shard is not None:
                tensor = self._shard_tensor(name, tensor)
            target, shard = name, None
            for fused, part, index in STACKED_PARAMS:
                if f".{part}." in name:
                    target, shard = name.replace(f".{part}.", f".{fused}."), index
                    break
            owner_name, _, leaf = target.rpartition(".")
            owner = modules.get(owner_name)
            if leaf == "weight" and hasattr(owner, "load_part"):
                owner.load_part(shard or 0, tensor)
                continue
            if not isinstance(tensor, torch.Tensor):  # 4-bit codes for a float layer
                tensor = tensor.dequantized()
            if shard is not None:
                _copy_shard(params[target], tensor, shard, self.config, target.split(".")[-2])
                loaded.add(f"{target}#{shard}")
                continue
            if name not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            if params[name].shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(params[name].shape)}")
            params[name].copy_(tensor)
            loaded.add(name)
        missing = [n for n in params if not _is_loaded(n, loaded)]
        missing += [f"{n}.weight (parts {m.missing_parts()})" for n, m in modules.items() if hasattr(m, "load_part") and m.missing_parts()]
        if missing:
            raise KeyError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
        for m in modules.values():
            if hasattr(m, "finish_loading"):
                m.finish_loading()


    def _local_name(self, name: str) -> str | None:
        """A checkpoint name as this model (a pipeline stage's layers, renumbered from 0) calls it; None
        for a tensor it does not hold."""
        return stage_name(name, self.layer_range, self.model.embed_tokens is not None)

    def _shard_tensor(self, name: str, tensor):
        """This rank's rows or columns of a checkpoint tensor (SHARDED_PARAMS), unless the loader
        already read only those (`shard_slice`); others whole."""
        where = shard_slice(name, self.shard, self.head_dim)
        if where is None:
            return tensor
        dim, start, length = where
        if getattr(tensor, "codes", tensor).shape[dim] == length:  # a Tensor, or a GGUF's Q4Codes
            return tensor
        return tensor.narrow(dim, start, length)


def stage_name(name: str, layers: tuple[int, int], first: bool) -> str | None:
    """`name` renumbered for a pipeline stage holding decoder layers [first, end) (layer i -> i - first),
    or None when the stage does not hold it (another stage's layer; the embedding and head off stage 0)."""
    if name.startswith("model.layers."):
        index, _, rest = name[len("model.layers.") :].partition(".")
        i = int(index)
        return f"model.layers.{i - layers[0]}.{rest}" if layers[0] <= i < layers[1] else None
    if not first and (name.startswith("model.embed_tokens.") or name.startswith("lm_head.")):
        return None
    return name


def shard_slice(name: str, shard, head_dim: int) -> tuple[int, int, int] | None:
    """(dimension, start, length) of tensor-parallel `shard`'s part of checkpoint tensor `name`
    (SHARDED_PARAMS: rows of weights and biases alike), or None where every rank holds it whole.
    Loaders call it to read only that part (loader.load_checkpoint's select_for)."""
    for part, what in SHARDED_PARAMS:
        if f".{part}." in f".{name}" and getattr(shard, what) is not None:
            a, b = getattr(shard, what)
            if what in ("heads", "kv_heads"):
                a, b = a * head_dim, b * head_dim
            return 0, a, b - a
    return None


def _shard_sizes(config: ModelConfig, fused: str) -> list[int]:
    if fused == "qkv_proj":
        return [config.q_size, config.kv_size, config.kv_size]
    return [config.intermediate_size, config.intermediate_size]


def _copy_shard(param: torch.Tensor, tensor: torch.Tensor, shard: int, config: ModelConfig, fused: str) -> None:
    sizes = _shard_sizes(config, fused)
    offset = sum(sizes[:shard])
    dst = param.narrow(0, offset, sizes[shard])
    if dst.shape != tensor.shape:
        raise ValueError(f"{fused} shard {shard}: checkpoint shape {tuple(tensor.shape)} != {tuple(dst.shape)}")
    dst.copy_(tensor)


def _is_loaded(name: str, loaded: set[str]) -> bool:
    if name in loaded:
        return True
    for fused, _, shard in STACKED_PARAMS:
        if f".{fused}." in name:
            n = 3 if fused == "qkv_proj" else 2
            return all(f"{name}#{i}" in loaded for i in range(n))
    return False
