"""The native forward: a decoder's layers in one C++ call (kernels/decoder.cpp), where the model allows it.

The Python forward (`layers.DecoderModel._forward_fused`) calls about nine native ops a layer through torch's
dispatcher and the modules' forwards; on the default model, 270 calls and some 0.8 ms of Python a token, which
is what one stream on a small model waits for besides its kernels. `DecoderPlan` takes every layer's weights,
norms and KV cache once, and its `forward` runs those ops in the same order on the same tensors with nothing
between them, so it gives the Python forward's bits: batch, chunk and cache invariance hold as they hold there.
The Python forward stays the reference (tests/test_native_decoder.py compares the two) and the path for what
a plan does not cover.

A plan covers (`unsupported` says why not, in the start-up log):
- layers of two plain RMSNorms around attention and an MLP (spec.LayerSpec.fusable), the MLP with SiLU, dense or
  a mixture of experts whose experts are stacked GGUF projections (formats.GroupedGGUF) on float32 activations:
  the router, routing and weighted sum are the native ops MoE.forward calls there (kernels/moe.cpp);
- projections on shoal's low-bit kernels: a GGUF's types, and `--quantization int8` / `int4` (their
  `native_runs`); float weights keep the Python forward (their matmuls are torch's);
- q/k norms per head (Qwen3), rotary over the whole head, the invariant attention op with one KV group;
- one process: tensor parallelism's gathers sit between the ops, so a sharded model keeps the Python forward.
A pipeline stage is covered (its layers; the stage before the last hands on its residual stream). Where the
embedding is a GGUF table and the rotary tables are plain, the plan looks up the step's embeddings and rope rows too
(`forward_ids`), so a step is one call from its token ids.

SHOAL_NATIVE_FORWARD=0 turns it off (the Python forward everywhere), for comparisons.
"""

from __future__ import annotations

import logging
import os

import torch

from shoal import kernels
from shoal.model.attention.common import MODEL_WINDOW
from shoal.model.attention.invariant import NativeMetadata
from shoal.model.formats import GGUFEmbedding
from shoal.model.layers import MLP, MoE, RMSNorm, Rotary

log = logging.getLogger("shoal.model")


def enabled() -> bool:
    return os.environ.get("SHOAL_NATIVE_FORWARD", "1").strip() != "0"


class NativeForward:
    """One model's (or pipeline stage's) plan over its KV caches `kv`: call it with the step's inputs. The runner
    builds it once the model is final (`build`) and sets it as the DecoderModel's `native_forward`."""

    def __init__(self, model, kv: list[torch.Tensor]) -> None:
        self.plan = torch.classes.shoal_kernels.DecoderPlan(*describe(model, kv))
        self.ids = takes_ids(model)  # the plan looks up the embeddings and rope tables itself (forward_ids)

    @staticmethod
    def takes(ropes, meta) -> bool:
        """Whether this step's inputs suit the plan: the native attention op's metadata (one KV group) and tables."""
        return type(meta) is NativeMetadata and all(r.native for r in ropes)

    def takes_step(self, positions: torch.Tensor, meta) -> bool:
        """Whether the whole step, from the token ids, suits the plan (forward_ids): it holds the lookups, one row of
        positions (not M-RoPE's three), the native attention op's metadata."""
        return self.ids and positions.dim() == 1 and type(meta) is NativeMetadata

    def from_ids(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: NativeMetadata) -> torch.Tensor:
        """The step from its token ids and positions [T]: the model's output, as DecoderModel.forward gives it."""
        return self.plan.forward_ids(input_ids, positions, meta.slot_mapping, meta.tables, meta.row_seq, meta.row_pos,
                                     meta.backend.window or 0)

    def __call__(self, x: torch.Tensor, ropes, meta: NativeMetadata) -> torch.Tensor:
        b = meta.backend
        return self.plan.forward(x, [r.cos for r in ropes], [r.signed_sin for r in ropes], meta.slot_mapping, meta.tables,
                                 meta.row_seq, meta.row_pos, b.window or 0)


def build(model, kv: list[torch.Tensor]) -> NativeForward | None:
    """model's native forward over its KV caches `kv`, or None where a plan does not cover it (logged)."""
    why = unsupported(model)
    if why is not None:
        log.info("native forward: off for this model (%s); its layers run op by op from Python", why)
        return None
    native = NativeForward(model, kv)
    log.info("native forward: on, %d layers in one native call a step", len(model.layers))
    return native


def unsupported(model) -> str | None:
    """Why a plan cannot compute this DecoderModel's layers (None: it can)."""
    if not enabled():
        return "SHOAL_NATIVE_FORWARD=0"
    if not kernels.available():
        return "the native kernels are off"
    if not model.fused:
        return "a layer's norms are not two plain RMSNorms"
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if type(mlp) is MoE:
            why = _experts_unsupported(layer)
            if why is not None:
                return why
        elif type(mlp) is not MLP or mlp.activation != "silu":
            return "an MLP that is not a gated SiLU"
        if attn.qk_norm_whole or attn.clip is not None:
            return "q/k norms over all heads or a clamp (OLMoE)"
        if attn.qk_norm and not all(type(n) is RMSNorm and not n.unit_offset for n in (attn.q_norm, attn.k_norm)):
            return "q/k norms that are not plain RMSNorms"
        for proj in (attn.qkv_proj, attn.o_proj, *((mlp.gate_up_proj, mlp.down_proj) if type(mlp) is MLP else ())):
            runs = getattr(proj, "native_runs", lambda: None)()
            if runs is None:
                return f"{type(proj).__name__} projections (the native forward takes shoal's low-bit kernels)"
            if runs.runs[0][0].device.type != "cpu":
                return "weights off the CPU"
    for rotary in model.rotaries:
        if rotary.cos.shape[-1] != model.config.head_dim:
            return "rotary over part of each head"
    return None


def _experts_unsupported(layer) -> str | None:
    """Why a plan cannot compute this layer's sparse MLP as MoE.forward does (None: it can)."""
    moe = layer.mlp
    if moe.experts.grouped is None:
        return "experts that are not stacked GGUF projections (one expert after another)"
    if moe.experts.activation != "silu":
        return "experts that are not a gated SiLU"
    if moe.gather is not None or moe.experts.gather is not None:
        return "experts split over ranks"
    if layer.norms[0].weight.dtype != torch.float32 or moe.gate.weight.dtype != torch.float32:
        return "a mixture of experts on activations other than float32"
    return None


def takes_ids(model) -> bool:
    """Whether the plan looks up the step's embeddings and rope tables itself (forward_ids): a GGUF embedding table of
    one type, no embedding scale, and plain rotary tables (not M-RoPE's)."""
    embed = model.embed_tokens
    return (type(embed) is GGUFEmbedding and len(embed.runs) == 1 and model.spec.embed_scale is None
            and all(type(r) is Rotary for r in model.rotaries))


def describe(model, kv: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[int], list[float]]:
    """The plan's description (kernels/decoder.cpp's top comment has the order): tensors, integers, floats."""
    c = model.config
    tensors: list[torch.Tensor] = []
    ints = [len(model.layers), int(model.last)]
    floats = [float(model.norm.eps)]
    if model.last:
        tensors.append(model.norm.weight)
    embed = model.embed_tokens
    if takes_ids(model):  # the step's lookups too: the embedding's rows, and each rope's (forward_ids)
        (fmt, _), = embed.runs
        ints += [1, int(fmt.type), embed.in_features]
        tensors += [embed.packed0, torch.empty(0, dtype=embed.dtype)]
        ints.append(len(model.rotaries))
        for rotary in model.rotaries:
            tensors += [rotary.cos, rotary.sin]
    else:
        ints += [0, 0]
    for layer, cache, rope in zip(model.layers, kv, model.rope_index):
        attn, mlp = layer.self_attn, layer.mlp
        pre_attn, pre_mlp = layer.norms[0], layer.norms[2]
        window = -1 if attn.window is MODEL_WINDOW else attn.window or 0
        ints += [c.num_heads, c.num_kv_heads, c.head_dim, window, rope, int(attn.qk_norm)]
        floats += [float(pre_attn.eps), float(pre_mlp.eps), float(attn.q_norm.eps) if attn.qk_norm else 0.0, float(attn.scale),
                   float(attn.softcap or 0.0)]
        tensors += [pre_attn.weight, pre_mlp.weight]
        if attn.qk_norm:
            tensors += [attn.q_norm.weight, attn.k_norm.weight]
        tensors.append(cache)
        for proj in (attn.qkv_proj, attn.o_proj):
            _describe_projection(proj, tensors, ints)
        if type(mlp) is MoE:  # the experts' mark, then what layers.MoE.forward multiplies by
            gate_up, down = mlp.experts.grouped
            ints += [len(mlp.experts.mlps), mlp.top_k, int(mlp.normalize), gate_up.rows, int(gate_up.fmt.type), down.rows,
                     int(down.fmt.type)]
            tensors += [mlp.gate.weight, gate_up.packed, down.packed,
                        mlp.counts if mlp.counts is not None else torch.empty(0, dtype=torch.int64)]
        else:
            ints.append(0)
            for proj in (mlp.gate_up_proj, mlp.down_proj):
                _describe_projection(proj, tensors, ints)
    return tensors, ints, floats


def _describe_projection(proj, tensors: list[torch.Tensor], ints: list[int]) -> None:
    """A projection's part of the description: ints [runs, has bias, (rows, type) per run], tensors [packed per run, (bias)]."""
    runs, bias = proj.native_runs()
    ints += [len(runs), int(bias is not None)]
    for _, rows, ggml_type in runs:
        ints += [rows, ggml_type]
    tensors += [packed for packed, _, _ in runs]
    if bias is not None:
        tensors.append(bias)
