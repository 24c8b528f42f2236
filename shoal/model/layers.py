"""Building blocks shared by every model family.

References: transformers' modeling_llama.py / modeling_qwen3.py (the numerics
we must match), nano-vllm's layers (fused qkv and gate_up projections).

Projections are fused (q|k|v into one matrix, gate|up into another) because on
a 2-core CPU each linear call has a fixed cost: 30 layers x 5 fewer calls per
step is measurable. The checkpoint names stay HF's; `weights.STACKED_PARAMS` maps them.

What each layer is (its attention's window, rope and softcap, its norms, its MLP's activation) comes from
its `spec.LayerSpec`, which the family builds; nothing here reads a family's name.

Beside this file: weights.py loads a checkpoint into these layers, and
invariance.py makes their matmuls batch-invariant where the host's are not.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from shoal import kernels
from shoal.model.config import ModelConfig
from shoal.model.spec import AttentionSpec, LayerSpec, MlpSpec, ModelSpec, RopeSpec, default_layers, rope_of

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


def embedding(rows: int, hidden: int) -> nn.Embedding:
    """An embedding table left uninitialized: its rows are always loaded from the checkpoint, and nn.Embedding's
    own random init (normal_) imports torch._dynamo, some 0.6 s of a server's start."""
    return nn.Embedding(rows, hidden, _weight=torch.empty(rows, hidden))


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
    """unit_offset: Gemma's kind, x * (1 + w) in float32 rounded once (spec.NormSpec); else HF Llama's."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self.eps = eps
        self.unit_offset = unit_offset

    def scale(self) -> torch.Tensor:
        """What the normalized rows are multiplied by: the weight, or Gemma's 1 + w in float32 (model/native.py's plan
        holds the same)."""
        return 1.0 + self.weight.float() if self.unit_offset else self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.unit_offset:
            if x.dtype == torch.float32 and kernels.native_for(x):  # nothing rounds between the products: one native op
                return kernels.rms_norm(x.reshape(-1, x.shape[-1]), self.scale(), self.eps).view(x.shape)
            return (F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps) * self.scale()).to(x.dtype)
        if kernels.native_for(x):  # one op where torch runs about fifteen
            return kernels.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
        # HF normalizes in float32 and casts back before scaling.
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


class Rotary(Layer):
    """cos/sin tables for every position, HF's rotate-half layout, over the rotated part of a head (`rope`:
    the layer's; None: the model's own, from its config)."""

    def __init__(self, config: ModelConfig, max_positions: int, rope: RopeSpec | None = None) -> None:
        super().__init__()
        rope = rope or rope_of(config.hf_config, config.head_dim)
        if torch.get_default_device().type == "meta":  # a model built before its weights (runner/build.py): shapes
            # only; the tables are computed after to_empty (and torch's meta arange would import torch._dynamo, ~0.6 s)
            for name in ("cos", "sin"):
                self.register_buffer(name, torch.empty(max_positions, rope.rotary_dim), persistent=False)
            return
        inv_freq, scaling = rope_inv_freq(config, rope, max_positions)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", signed(emb.sin() * scaling), persistent=False)  # signed once here, not per step

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        """positions: [T] -> the step's cos and signed sin: looked up once per step, used by every layer."""
        return self.tables(self.cos[positions], self.sin[positions], dtype)

    @staticmethod
    def tables(cos: torch.Tensor, signed_sin: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        """cos, signed_sin: [T, D], the step's rows of the tables (the sin table signed, `signed`) -> what apply_rope
        takes."""
        cos = cos.float()
        if kernels.native_for(cos):  # the native op takes float32 [T, D] and rounds once
            return RopeTables(cos.contiguous(), signed_sin.contiguous(), native=True)
        return RopeTables(cos.unsqueeze(1).to(dtype), signed_sin.unsqueeze(1).to(dtype), native=False)


def signed(sin: torch.Tensor) -> torch.Tensor:
    """A sin table [.., D] with its first half negated: what apply_rope multiplies the rolled head by.

    HF rotates x by x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1).
    That is roll(x, D/2) * cat(-sin1, sin2): the sign moves into the table,
    and the rotation is one roll instead of a chunk, a negation and a cat.
    """
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


class RopeTables(NamedTuple):
    cos: torch.Tensor  # [T, 1, D] in the model's dtype, or [T, D] float32 for the native op
    signed_sin: torch.Tensor
    native: bool


def apply_rope(x: torch.Tensor, rope: RopeTables) -> torch.Tensor:
    """x: [T, H, D] rotated by its token's position (see Rotary.forward); in place on the native path. Tables
    narrower than the head rotate its first dimensions and pass the rest (partial rotary, as HF's Phi-3)."""
    rotated = rope.cos.shape[-1]
    if rotated < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rotated].contiguous(), rope), x[..., rotated:]), dim=-1)
    if rope.native:
        return kernels.rope_(x, rope.cos, rope.signed_sin)
    return torch.addcmul(x * rope.cos, x.roll(x.shape[-1] // 2, dims=-1), rope.signed_sin)


def rope_inv_freq(config: ModelConfig, rope: RopeSpec | None = None, max_positions: int | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling of a layer's rope (None: the model's), as transformers computes them.

    LongRoPE (Phi-3) has two sets of factors, and transformers picks one per forward by the sequence's
    length: the long ones past `original_max_position_embeddings`. The tables here are built once, so the
    choice is made once, by the context served (`max_positions`), as llama.cpp makes it by its context size:
    up to the original length, the short factors (what transformers gives every sequence that fits); past it,
    the long ones for every sequence (what transformers gives a sequence longer than the original length).
    """
    rope = rope or rope_of(config.hf_config, config.head_dim)
    hf = config.hf_config
    rope_type = rope.rope_type
    if rope_type == "default":
        dim = rope.rotary_dim
        return 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)), 1.0
    if rope_type == "dynamic":
        raise NotImplementedError("dynamic NTK rope scaling changes with sequence length; not supported yet")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope type {rope_type!r} is not supported (supported: default, {', '.join(sorted(ROPE_INIT_FUNCTIONS))})")
    kwargs = {} if rope.layer_type is None else {"layer_type": rope.layer_type}
    if rope_type == "longrope":
        kwargs["seq_len"] = max_positions if max_positions is not None else config.max_position_embeddings
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu", **kwargs)
    return inv_freq.float(), float(scaling)


class Attention(Layer):
    def __init__(self, config: ModelConfig, linear=float_linear, spec: LayerSpec | None = None) -> None:
        """spec: the layer's (None: the model's default, spec.default_layers)."""
        super().__init__()
        spec = spec or default_layers(config).layers[0]
        a: AttentionSpec = spec.attention
        self.c = config
        parts = (config.q_size, config.kv_size, config.kv_size)
        self.qkv_proj = linear(config.hidden_size, sum(parts), config.attention_bias, parts)
        self.o_proj = linear(config.q_size, config.hidden_size, False)
        self.qk_norm, self.qk_norm_whole, self.clip = a.qk_norm, a.qk_norm_whole, a.clip_qkv
        if a.qk_norm:  # over each head, or (qk_norm_whole) over all of q's and of k's heads at once
            q_dim, k_dim = (config.q_size, config.kv_size) if a.qk_norm_whole else (config.head_dim, config.head_dim)
            self.q_norm = RMSNorm(q_dim, config.rms_norm_eps, spec.norms.unit_offset)
            self.k_norm = RMSNorm(k_dim, config.rms_norm_eps, spec.norms.unit_offset)
        self.scale, self.window, self.softcap = a.scale, a.window, a.softcap

    def forward(self, x: torch.Tensor, rope, kv: torch.Tensor, meta) -> torch.Tensor:
        """kv: this layer's cache [2, Hkv, blocks, block_size, D]; meta: the attention backend's metadata for the step."""
        c = self.c
        T = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (Hq + 2 Hkv) * D]
        if self.qk_norm_whole or self.clip is not None:  # OLMoE: norms over whole q and k, then a clamp of q, k, v
            qkv = self._whole_norm_clip(qkv)
        # q and k sit side by side in qkv: rotate them in one go, [T, Hq + Hkv, D].
        qk = qkv[:, : c.q_size + c.kv_size].view(T, c.num_heads + c.num_kv_heads, c.head_dim)
        v = qkv[:, c.q_size + c.kv_size :].view(T, c.num_kv_heads, c.head_dim)
        if self.qk_norm and not self.qk_norm_whole:
            qk = torch.cat((self.q_norm(qk[:, : c.num_heads]), self.k_norm(qk[:, c.num_heads :])), dim=1)
        qk = apply_rope(qk, rope)
        q, k = qk[:, : c.num_heads], qk[:, c.num_heads :]
        return self.o_proj(meta.forward(q, k, v, kv, self.scale, window=self.window, softcap=self.softcap).reshape(T, c.q_size))

    def _whole_norm_clip(self, qkv: torch.Tensor) -> torch.Tensor:
        c = self.c
        if self.qk_norm_whole:
            q, k, v = qkv.split((c.q_size, c.kv_size, c.kv_size), dim=1)
            qkv = torch.cat((self.q_norm(q.contiguous()), self.k_norm(k.contiguous()), v), dim=1)
        return qkv if self.clip is None else qkv.clamp(-self.clip, self.clip)


class MLP(Layer):
    """The gated MLP, dense; also one expert of a sparse one (MoE)."""

    def __init__(self, config: ModelConfig, linear=float_linear, spec: LayerSpec | None = None) -> None:
        super().__init__()
        mlp = spec.mlp if spec is not None else MlpSpec()
        width = mlp.width or config.intermediate_size
        self.gate_up_proj = linear(config.hidden_size, 2 * width, False, (width,) * 2)
        self.down_proj = linear(width, config.hidden_size, False)
        self.activation = mlp.activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gated(self.gate_up_proj(x), self.activation))


def gated(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up of a fused [T, 2 * width] gate|up projection's output."""
    if activation == "silu" and kernels.native_for(gate_up):
        return kernels.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return (F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")) * up


def route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's experts and their weights from the router's logits [T, E]: the top_k softmax probabilities
    (float32), renormalized where `normalize` (spec.MlpSpec). -> (weights [T, k] float32, experts [T, k] int64),
    each row's experts in descending probability.

    Ties go to the lower expert index: a stable sort of each row on its own (torch.topk leaves the order of
    equal values unspecified). A row's choice reads that row alone, so no token's experts depend on its
    neighbours in the batch.
    """
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, experts = weights[:, :top_k], experts[:, :top_k]
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


class Router(Linear):
    """A sparse MLP's router (checkpoint name `mlp.gate`): each token's logits over the experts, the same bits whatever
    else is in the batch. On the native kernels, float32 logits from one fixed-order accumulation per output
    (kernels.row_linear: an eighth of the float64 GEMM's time at 8 rows); elsewhere on the CPU, a float64 GEMM rounded
    once (as invariance.wide_matmul); on other devices, the linear as it is. invariance.make_row_invariant leaves it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernels.native_for(x):
            return kernels.row_linear(x.float() if x.stride(-1) == 1 else x.float().contiguous(), self.weight.float())
        if x.device.type == "cpu":
            return torch.matmul(x.double(), self.weight.double().T).float()
        return F.linear(x, self.weight, self.bias)


class MoE(Layer):
    """A mixture-of-experts MLP (spec.MlpSpec with experts): the router `gate` (float, as every family ships it),
    then each token through its top-k experts, weighted. Checkpoint names: `mlp.gate`, `mlp.experts.E.*_proj`.

    Tokens are grouped by expert: the step's (token, expert) pairs are sorted by expert, stably, so each expert
    multiplies all its tokens' rows at once and its weights are read once a step, however many tokens chose it
    (Experts: in one native call for the whole layer, where the experts allow). The rows are put back in token
    order and each token's weighted outputs added in ascending expert order, as transformers adds them, whatever
    else is in the step: with row-invariant expert matmuls, a token's answer does not depend on its batch.
    On float32 rows on the native kernels, the router, the routing and the weighted sum are three native ops
    (kernels/moe.cpp: 0.8 of 5 ms a layer at 8 decoding streams went to some twenty small torch ops);
    `reference` is the same in torch ops. `counts` adds up the tokens each expert took (metrics), unless None. Under
    tensor parallelism (tensor_parallel.py) each rank holds every expert's slice of columns, and `gather` joins the
    ranks' ranges of the output.
    """

    def __init__(self, config: ModelConfig, linear=float_linear, spec: LayerSpec | None = None) -> None:
        super().__init__()
        m = spec.mlp
        self.gate = Router(config.hidden_size, m.experts, bias=False)
        self.experts = Experts([MLP(config, linear, spec) for _ in range(m.experts)], m.activation)
        self.top_k, self.normalize = m.top_k, m.normalize
        self.counts: torch.Tensor | None = None
        self.gather = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        if x.dtype == logits.dtype == torch.float32 and kernels.native_for(x):  # the routing and the sum in 2 native ops
            rows, counts, scales, back = kernels.moe_route(logits, self.top_k, self.normalize)
            if self.counts is not None:
                self.counts += counts
            out = kernels.moe_combine(self.experts(x.index_select(0, rows), counts), scales, back, self.top_k)
            return out if self.gather is None else self.gather(out)
        return self.reference(x, logits)

    def reference(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """The routing and the weighted sum in torch ops (any dtype and device); on float32 rows, the bits of the
        native ops' but for the routing weights, whose softmax is torch's here (within a few ulp)."""
        weights, chosen = route(logits, self.top_k, self.normalize)
        chosen, slot = chosen.sort(dim=1)  # each token's experts in ascending order: the order its outputs are added in
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert, tokens in order within one
        counts = torch.bincount(flat, minlength=len(self.experts.mlps))
        if self.counts is not None:
            self.counts += counts
        y = self.experts(x.index_select(0, order // self.top_k), counts.tolist())  # order // k: each pair's token
        y = y * weights.gather(1, slot).reshape(-1).index_select(0, order).unsqueeze(1).to(y.dtype)
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=order.device)
        y = y.index_select(0, back).to(x.dtype).view(x.shape[0], self.top_k, -1)  # [T, k, out], each token's in expert order
        out = y[:, 0]
        for j in range(1, self.top_k):  # one add after another (index_add_ is serial: 16 ms a prefill layer here)
            out = out + y[:, j]
        return out if self.gather is None else self.gather(out)


class ExpertCounts:
    """Tokens each expert of each sparse layer took, since the model was built (the `moe_expert_tokens` metric): one
    int64 tensor [sparse layers, experts] that the MoE layers add their step's counts to (a row each), read whole.
    `layers`: the model's index of each row's layer."""

    def __init__(self, model: nn.Module) -> None:
        layers = getattr(getattr(model, "model", None), "layers", ())
        moes = [(i, layer.mlp) for i, layer in enumerate(layers) if isinstance(getattr(layer, "mlp", None), MoE)]
        first = getattr(model, "layer_range", (0, 0))[0]  # a pipeline stage's layers are numbered from its first
        self.layers = tuple(first + i for i, _ in moes)
        widths = {len(moe.experts.mlps) for _, moe in moes}
        device = next(itertools.chain(moes[0][1].parameters(), moes[0][1].buffers())).device if moes else None
        self.tensor = torch.zeros(len(moes), max(widths, default=0), dtype=torch.int64, device=device)
        for row, (_, moe) in enumerate(moes):
            moe.counts = self.tensor[row, : len(moe.experts.mlps)]

    @classmethod
    def of(cls, model: nn.Module) -> ExpertCounts | None:
        counts = cls(model)
        return counts if counts.layers else None

    def read(self) -> list[list[int]]:
        return self.tensor.tolist()


class Experts(Layer):
    """A sparse MLP's experts applied to rows grouped by expert: `counts[e]` rows for expert e, in order.

    `mlps`: one MLP per expert (registered as `0`, `1`, ..., the checkpoint's `experts.E`), built by the model's
    linear factory, so every weight format, the loader's parts and the invariant float path take experts as they
    take any projection. Experts whose projections are GGUF blocks of one type (formats.GGUFLinear) are packed
    straight into one [E, ...] tensor per projection as they load (GGUFLinear.pack_experts; stacked after packing
    where that cannot be: stack_experts), and a layer's experts run in one native call per projection
    (formats.GroupedGGUF); others one expert after another.
    """

    def __init__(self, mlps, activation: str) -> None:
        super().__init__()
        for i, mlp in enumerate(mlps):
            self.add_module(str(i), mlp)
        self.mlps, self.activation = tuple(mlps), activation
        self.grouped = None  # (gate_up, down) grouped projections, set by pack_parts or finish_loading
        self.gather = None  # tensor parallelism: every rank's columns of the activations, before the down projections

    def pack_parts(self) -> None:
        """Before the experts' own projections pack (weights.py): each projection of every expert packed straight into
        one stacked tensor, where their layer class can (a `pack_experts` classmethod: None, packing nothing, where not)."""
        self.grouped = self._grouped("pack_experts")

    def finish_loading(self) -> None:
        """Stack the experts' packed projections where their layer class can (a `stack_experts` classmethod: None where
        not), unless `pack_parts` packed them stacked already."""
        if self.grouped is None:
            self.grouped = self._grouped("stack_experts")

    def _grouped(self, method: str) -> tuple | None:
        """(gate_up, down), each every expert's projection made one by their layer class's `method`; None where it
        has none or declines either."""
        grouped = []
        for proj in ("gate_up_proj", "down_proj"):
            layers = [getattr(m, proj) for m in self.mlps]
            make = getattr(type(layers[0]), method, None)
            grouped.append(make(layers) if make is not None else None)
        return None if None in grouped else tuple(grouped)

    def forward(self, x: torch.Tensor, counts: torch.Tensor | list[int]) -> torch.Tensor:
        gate_up, down = self.grouped or (partial(self._each, "gate_up_proj"), partial(self._each, "down_proj"))
        h = gated(gate_up(x, counts), self.activation)
        return down(h if self.gather is None else self.gather(h), counts)

    def _each(self, proj: str, x: torch.Tensor, counts: torch.Tensor | list[int]) -> torch.Tensor:
        """Each expert's projection `proj` of its rows, one expert after another."""
        counts = counts.tolist() if isinstance(counts, torch.Tensor) else counts
        out, start = [], 0
        for mlp, n in zip(self.mlps, counts):
            if n:
                out.append(getattr(mlp, proj)(x[start : start + n]))
                start += n
        return torch.cat(out) if out else getattr(self.mlps[0], proj)(x[:0])


class DecoderLayer(Layer):
    """Attention and MLP, each with its residual add, and the norms its spec places around them (named as the
    checkpoint names them: spec.NormSpec)."""

    def __init__(self, config: ModelConfig, linear=float_linear, spec: LayerSpec | None = None) -> None:
        super().__init__()
        self.spec = spec = spec or default_layers(config).layers[0]
        n = spec.norms
        for name in n.names:
            setattr(self, name, RMSNorm(config.hidden_size, config.rms_norm_eps, n.unit_offset))
        self.self_attn = Attention(config, linear, spec)
        self.mlp = (MoE if spec.mlp.experts else MLP)(config, linear, spec)
        # (pre-attention, post-attention, pre-MLP, post-MLP), None where the layer has none; a plain tuple, not
        # registered twice: the modules are registered above under the checkpoint's names
        self.norms = tuple(None if name is None else getattr(self, name) for name in (n.pre_attention, n.post_attention, n.pre_mlp, n.post_mlp))

    def forward(self, x, rope, kv, meta):
        pre_attn, post_attn, pre_mlp, post_mlp = self.norms
        h = self.self_attn(pre_attn(x), rope, kv, meta)
        x = x + (h if post_attn is None else post_attn(h))
        h = self.mlp(pre_mlp(x))
        return x + (h if post_mlp is None else post_mlp(h))


class DecoderModel(Layer):
    """Embeddings, N decoder layers as their specs say, final norm: the HF `model.` prefix."""

    def __init__(self, config: ModelConfig, max_positions: int, linear=float_linear, first: bool = True, last: bool = True,
                 rotary=Rotary, spec: ModelSpec | None = None) -> None:
        """first / last: whether this holds the model's first / last layers (a pipeline stage may hold neither):
        the embedding lives on the first stage, the final norm is applied on the last. rotary: the class of
        the position tables (the family's). spec: this model's (or stage's) layers (None: spec.default_layers)."""
        super().__init__()
        self.spec = spec = spec or default_layers(config)
        if len(spec.layers) != config.num_layers:
            raise ValueError(f"{len(spec.layers)} layer specs for {config.num_layers} layers")
        self.config, self.rotary_class = config, rotary
        self.embed_tokens = embedding(config.vocab_size, config.hidden_size) if first else None
        # one table per distinct rope (Gemma 3: local and global), shared by the layers that use it
        self.ropes: tuple[RopeSpec, ...] = tuple(dict.fromkeys(layer.attention.rope for layer in spec.layers))
        self.rope_index = [self.ropes.index(layer.attention.rope) for layer in spec.layers]
        self.set_max_positions(max_positions)
        self.layers = nn.ModuleList(DecoderLayer(config, linear, layer) for layer in spec.layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, spec.final_norm_unit_offset)
        self.last = last
        self.fused = spec.fusable  # the native fused path computes these layers (LayerSpec.fusable)
        # every layer in one native call (model/native.py), set by the runner over its KV caches where a plan covers
        # these layers; None: the layers op by op from here
        self.native_forward = None

    def set_max_positions(self, max_positions: int, device: torch.device | None = None) -> None:
        """(Re)build the rope tables for positions [0, max_positions) (the served context, runner/build.py)."""
        self.rotaries = nn.ModuleList(self.rotary_class(self.config, max_positions, rope) for rope in self.ropes)
        if device is not None:
            self.rotaries.to(device)

    @property
    def rotary(self) -> Rotary:
        """The first layer's position tables (a model with one rope: its only ones)."""
        return self.rotaries[0]

    def forward(self, input_ids, positions, kv_caches, meta, hidden=None, embeds=None):
        """hidden: the previous pipeline stage's output, in place of embedding input_ids. embeds: (rows [N],
        values [N, hidden]) that replace those rows' token embeddings (an image's, from its encoder)."""
        native = self.native_forward
        if native is not None and hidden is None and embeds is None and native.takes_step(positions, meta):
            return native.from_ids(input_ids, positions, meta)  # the whole step in one native call
        if hidden is None:
            x = self.embed_tokens(input_ids)  # [T, hidden]
            if self.spec.embed_scale is not None:  # rounded to the model's dtype first, as HF's Gemma does
                x = x * torch.tensor(self.spec.embed_scale, dtype=x.dtype)
        else:
            x = hidden
        if embeds is not None:
            x = x.index_copy(0, embeds[0], embeds[1].to(x.dtype))
        ropes = [rotary(positions, x.dtype) for rotary in self.rotaries]
        if native is not None and kernels.native_for(x) and native.takes(ropes, meta):
            return native(x, ropes, meta)
        if self.fused and kernels.native_for(x):
            return self._forward_fused(x, ropes, kv_caches, meta)
        for layer, kv, r in zip(self.layers, kv_caches, self.rope_index):
            x = layer(x, ropes[r], kv, meta)
        return self.norm(x) if self.last else x

    def _forward_fused(self, x, ropes, kv_caches, meta):
        """The same layers with each residual add fused into the norm that follows it (native ops):
        x <- x + delta and h <- RMSNorm(x) in one op, so a layer is norm, attention, add+norm, MLP.
        Only for layers of two plain norms (LayerSpec.fusable)."""
        layers = self.layers
        h = layers[0].norms[0](x)
        for i, (layer, kv, r) in enumerate(zip(layers, kv_caches, self.rope_index)):
            pre_mlp = layer.norms[2]
            x, h = kernels.add_rms_norm(x, layer.self_attn(h, ropes[r], kv, meta), pre_mlp.weight, pre_mlp.eps)
            delta = layer.mlp(h)
            norm = layers[i + 1].norms[0] if i + 1 < len(layers) else self.norm if self.last else None
            if norm is None:  # a pipeline stage before the last: the residual stream goes on
                return x + delta
            x, h = kernels.add_rms_norm(x, delta, norm.weight, norm.eps)
        return h


class DecoderForCausalLM(nn.Module):
    """A decoder-only LM. Families subclass it to say what differs (see llama.py)."""

    qk_norm = False
    attention_bias: bool | None = None  # None: as the config says
    rotary = Rotary  # the position tables' class (M-RoPE for Qwen2-VL)
    # ModelConfig -> ModelSpec: what each layer is (spec.py); a family with other layers gives its own
    model_spec = staticmethod(default_layers)
    checkpoint_renames: tuple[tuple[str, str], ...] = ()  # (old, new) parts of checkpoint names read under shoal's

    def __init__(self, hf_config, max_positions: int, linear=float_linear, layers: tuple[int, int] | None = None) -> None:
        """linear(in, out, bias, parts) builds the decoder's projections: `quant.WeightFormat.linear`
        chooses their weight format here, before any weight is loaded.

        layers (first, end): a pipeline stage's range of decoder layers. The embedding and the logits
        head live on the stage with layer 0 (rank 0, which samples); the final norm on every stage,
        applied by the last.

        The model is built whole (one rank's math). A tensor-parallel rank's part is cut from it after
        construction (model/tensor_parallel.py), which sets `tp`, `shard`, `vocab` and `gather_logits`.
        """
        super().__init__()
        self.config = ModelConfig.from_hf(hf_config, qk_norm=self.qk_norm, attention_bias=self.attention_bias)
        self.head_dim = self.config.head_dim
        total = self.config.num_layers
        self.spec = self.model_spec(self.config)  # every layer's, the whole model's
        self.layer_range = layers or (0, total)
        first = self.layer_range[0] == 0
        spec = self.spec
        if self.layer_range != (0, total):
            self.config = replace(self.config, num_layers=self.layer_range[1] - self.layer_range[0])
            spec = replace(spec, layers=spec.layers[self.layer_range[0] : self.layer_range[1]])
        self.model = DecoderModel(self.config, max_positions, linear, first, self.layer_range[1] == total, self.rotary, spec)
        if not self.config.tie_word_embeddings and first:
            self.lm_head = Linear(self.config.hidden_size, self.config.vocab_size, bias=False)
        self.logits_head: nn.Module | None = None  # set by WeightFormat.finish_head: replaces the (tied) head
        self.tp = self.shard = self.vocab = None  # a tensor-parallel rank's split, shard and vocabulary rows
        self.gather_logits = None  # with a split vocabulary: every rank's logits side by side

    def forward(self, input_ids, positions, kv_caches, meta, hidden=None, embeds=None) -> torch.Tensor:
        """input_ids, positions: [T] ([3, T] for M-RoPE) -> hidden states [T, hidden] (hidden: a previous pipeline
        stage's; embeds: rows whose embeddings are given, see DecoderModel.forward)."""
        return self.model(input_ids, positions, kv_caches, meta, hidden, embeds)

    def greedy_head(self) -> tuple[torch.Tensor, int, int] | None:
        """(packed weight, rows, GGUF type) of a logits head that kernels.greedy_head may run with the greedy pick: one
        native run on the CPU, no bias, the whole vocabulary here, no softcap: compute_logits is then that run's
        gguf_linear and .float(). None: compute_logits, then the sampler."""
        runs = getattr(self.logits_head, "native_runs", lambda: None)()
        if runs is None or len(runs.runs) != 1 or runs.bias is not None or self.gather_logits is not None:
            return None
        weight, rows, kind = runs.runs[0]
        if self.spec.logit_softcap is not None or weight.device.type != "cpu" or not kernels.available():
            return None
        return weight, rows, kind

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> logits [N, vocab] in float32. With a split vocabulary (`vocab`) every
        tensor-parallel rank computes its rows' logits, and they are gathered: call it on every rank alike."""
        if self.logits_head is not None:
            logits = self.logits_head(hidden).float()
        else:
            w = self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
            logits = F.linear(hidden, w).float()
        if self.gather_logits is not None:
            logits = self.gather_logits(logits)
        cap = self.spec.logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap  # Gemma 2's final softcap
