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
- Gemma 2's and 3's layers: four (1 + w) norms, a dense MLP with GELU (or SiLU), the embedding scale, the
  attention's softcap, and local and global layers over KV groups of their own (each reads its group's metadata);
- projections on shoal's low-bit kernels: a GGUF's types, and `--quantization int8` / `int4` (their
  `native_runs`); float weights keep the Python forward (their matmuls are torch's);
- q/k norms per head (Qwen3, Gemma 3), rotary over the whole head, the invariant attention op;
- one process: tensor parallelism's gathers sit between the ops, so a sharded model keeps the Python forward.
A pipeline stage is covered (its layers; the stage before the last hands on its residual stream). Where the
embedding is a GGUF table or a float one and the rotary tables are plain, the plan looks up the step's embeddings and rope rows too
(`forward_ids`), so a step is one call from its token ids. Then a step of greedy decode runs (engine/scheduler.py) is
one call too, every forward of it with the head's pick between them (`greedy_run`, ModelRunner._native_step).

SHOAL_NATIVE_FORWARD=0 turns it off (the Python forward everywhere), for comparisons.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from shoal import kernels
from shoal.model.attention.common import MODEL_WINDOW, GroupedMetadata
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
        self.windows = kv_windows(model)  # the layers' windows, in the order of their KV groups' metadata
        self.plan = torch.classes.shoal_kernels.DecoderPlan(*describe(model, kv))
        self.ids = takes_ids(model)  # the plan looks up the embeddings and rope tables itself (forward_ids)

    @staticmethod
    def takes_meta(meta) -> bool:
        """Whether the step's attention metadata is the native op's: one KV group's, or each group's."""
        if type(meta) is GroupedMetadata:
            return all(type(m) is NativeMetadata for m in meta.by_window.values())
        return type(meta) is NativeMetadata

    def takes(self, ropes, meta) -> bool:
        """Whether this step's inputs suit the plan: the native attention op's metadata and tables."""
        return self.takes_meta(meta) and all(r.native for r in ropes)

    def takes_step(self, positions: torch.Tensor, meta) -> bool:
        """Whether the whole step, from the token ids, suits the plan (forward_ids): it holds the lookups, one row of
        positions (not M-RoPE's three), the native attention op's metadata."""
        return self.ids and positions.dim() == 1 and self.takes_meta(meta)

    def _metas(self, meta) -> tuple[list, list, list, list, int]:
        """The step's metadata as the plan takes it: slots, tables, rows' sequences and positions per KV group (the
        layers' `group` indices), and the backend's window."""
        if type(meta) is GroupedMetadata:
            parts = [meta.by_window[meta.default_window if w is MODEL_WINDOW else w] for w in self.windows]
        else:  # one group: every layer reads the same tables
            parts = [meta] * len(self.windows)
        return ([m.slot_mapping for m in parts], [m.tables for m in parts], [m.row_seq for m in parts],
                [m.row_pos for m in parts], parts[0].backend.window or 0)

    def from_ids(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """The step from its token ids and positions [T]: the model's output, as DecoderModel.forward gives it."""
        return self.plan.forward_ids(input_ids, positions, *self._metas(meta))

    def greedy_run(self, ids: torch.Tensor, positions: torch.Tensor, steps: list[int], tables: torch.Tensor, backend, head,
                   bans, stop_ids: list[int], stop_ends: list[int], interrupt: torch.Tensor, own: int) -> tuple[list[int], list[int], list[float]]:
        """Greedy decode runs (kernels/decoder.cpp DecoderPlan.greedy_run): each sequence from its token (ids) at its
        position (positions), up to steps[s] forwards with the head's greedy pick (head: the model's greedy_head),
        stopping at a failed row or a stop id, and all of them, after the first `own` forwards, where interrupt[0] is
        set. tables: their block tables with the runs' blocks (backend.native_tables), backend: the one KV group's
        attention. -> each pick's sequence, token, logprob."""
        return self.plan.greedy_run(ids, positions, steps, tables, backend.block_size, backend.null_block, backend.window or 0,
                                    *head, bans, stop_ids, stop_ends, interrupt, own)

    def __call__(self, x: torch.Tensor, ropes, meta) -> torch.Tensor:
        return self.plan.forward(x, [r.cos for r in ropes], [r.signed_sin for r in ropes], *self._metas(meta))


def kv_windows(model) -> list:
    """The distinct windows of the model's layers (MODEL_WINDOW: the backend's), in their first layer's order: a
    layer's KV group in the plan is its window's index here (attention.common.GroupedMetadata finds a group by it)."""
    return list(dict.fromkeys(layer.self_attn.window for layer in model.layers))


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
    sandwich = _sandwich(model.layers[0])
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if _sandwich(layer) != sandwich or not (sandwich or layer.spec.fusable):
            return "a layer's norms are neither two plain RMSNorms nor Gemma's four (1 + w) ones"
        if not all(type(n) is RMSNorm for n in layer.norms if n is not None):
            return "norms that are not RMSNorms"
        if type(mlp) is MoE:
            why = _experts_unsupported(layer) if not sandwich else "experts beside Gemma's norms"
            if why is not None:
                return why
        elif type(mlp) is not MLP or mlp.activation not in (("silu", "gelu_tanh") if sandwich else ("silu",)):
            return "an MLP that is not a gated SiLU (nor Gemma's GELU)"
        if attn.qk_norm_whole or attn.clip is not None:
            return "q/k norms over all heads or a clamp (OLMoE)"
        if attn.qk_norm and not all(type(n) is RMSNorm and n.unit_offset == sandwich for n in (attn.q_norm, attn.k_norm)):
            return "q/k norms of another kind than the layer's"
        for proj in (attn.qkv_proj, attn.o_proj, *((mlp.gate_up_proj, mlp.down_proj) if type(mlp) is MLP else ())):
            runs = getattr(proj, "native_runs", lambda: None)()
            if runs is None:
                return f"{type(proj).__name__} projections (the native forward takes shoal's low-bit kernels)"
            if runs.runs[0][0].device.type != "cpu":
                return "weights off the CPU"
    for rotary in model.rotaries:
        if rotary.cos.shape[-1] != model.config.head_dim:
            return "rotary over part of each head"
    if model.last and model.norm.unit_offset != sandwich:
        return "a final norm of another kind than the layers'"
    return None


def _sandwich(layer) -> bool:
    """Gemma's layer: four (1 + w) RMSNorms, one on each side of attention and of the MLP (spec.NormSpec)."""
    return layer.spec.norms.unit_offset and all(n is not None for n in layer.norms)


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
    one type or a float one (nn.Embedding's), times Gemma's scale where the model has one, and plain rotary tables (not
    M-RoPE's)."""
    embed = model.embed_tokens
    gguf = type(embed) is GGUFEmbedding and len(embed.runs) == 1
    return (gguf or type(embed) is nn.Embedding) and all(type(r) is Rotary for r in model.rotaries)


def describe(model, kv: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[int], list[float]]:
    """The plan's description (kernels/decoder.cpp's top comment has the order): tensors, integers, floats."""
    c = model.config
    tensors: list[torch.Tensor] = []
    ints = [len(model.layers), int(model.last), int(model.norm.unit_offset)]
    floats = [float(model.norm.eps)]
    if model.last:
        tensors.append(model.norm.scale())
    embed = model.embed_tokens
    if takes_ids(model):  # the step's lookups too: the embedding's rows, and each rope's (forward_ids)
        scale = model.spec.embed_scale
        if type(embed) is GGUFEmbedding:
            (fmt, _), = embed.runs
            dtype = embed.dtype
            ints += [1, int(fmt.type), embed.in_features, int(scale is not None)]
            tensors += [embed.packed0, torch.empty(0, dtype=dtype)]
        else:  # a float table (type -1): its rows as nn.Embedding gives them
            dtype = embed.weight.dtype
            ints += [1, -1, embed.embedding_dim, int(scale is not None)]
            tensors += [embed.weight, torch.empty(0, dtype=dtype)]
        if scale is not None:  # DecoderModel.forward's factor, a 0-dim tensor of the model's dtype
            tensors.append(torch.tensor(scale, dtype=dtype))
        ints.append(len(model.rotaries))
        for rotary in model.rotaries:
            tensors += [rotary.cos, rotary.sin]
    else:
        ints += [0, 0]
    windows = kv_windows(model)
    for layer, cache, rope in zip(model.layers, kv, model.rope_index):
        attn, mlp = layer.self_attn, layer.mlp
        pre_attn, post_attn, pre_mlp, post_mlp = layer.norms
        sandwich = _sandwich(layer)
        window = -1 if attn.window is MODEL_WINDOW else attn.window or 0
        ints += [c.num_heads, c.num_kv_heads, c.head_dim, window, rope, int(attn.qk_norm), windows.index(attn.window),
                 int(sandwich), int(type(mlp) is MLP and mlp.activation == "gelu_tanh")]
        floats += [float(pre_attn.eps), float(pre_mlp.eps), float(attn.q_norm.eps) if attn.qk_norm else 0.0, float(attn.scale),
                   float(attn.softcap or 0.0)]
        if sandwich:
            floats += [float(post_attn.eps), float(post_mlp.eps)]
        tensors += [pre_attn.scale(), pre_mlp.scale()]
        if attn.qk_norm:
            tensors += [attn.q_norm.scale(), attn.k_norm.scale()]
        if sandwich:
            tensors += [post_attn.scale(), post_mlp.scale()]
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
