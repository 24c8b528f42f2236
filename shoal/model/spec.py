"""A decoder described per layer: what each layer's attention, norms and MLP are, as plain data.

A family says what its layers are by building these from its config (a spec builder, see llama.py,
phi3.py, gemma.py); the shared decoder (layers.py) reads them and never a family's name. Imports no torch.

    LayerSpec
      attention: AttentionSpec   full or a window of N keys, its rope (RopeSpec), a logit softcap, the scale
      norms: NormSpec            which norms the layer has, where (the checkpoint's module names), which kind
      mlp: MlpSpec               the activation of the gated MLP; dense, or experts and their routing

References: transformers' `layer_types` (Gemma 2/3 configs list each layer's attention kind), vLLM's
FullAttentionSpec / SlidingWindowSpec.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

ACTIVATIONS = ("silu", "gelu_tanh")
# transformers' hidden_act names -> ours
HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


@dataclass(frozen=True)
class RopeSpec:
    """The rotary positions of one layer: `params` are transformers' rope parameters for it (a dict's items,
    so the spec stays hashable and layers with equal ropes share one table), rotating the first `rotary_dim`
    dimensions of each head (Phi-4-mini's partial rotary: fewer than the head's)."""

    params: tuple[tuple[str, Any], ...]
    rotary_dim: int
    layer_type: str | None = None  # the key of this layer's parameters in a per-type `rope_parameters` (Gemma 3)

    @property
    def rope_type(self) -> str:
        return dict(self.params).get("rope_type", "default")

    @property
    def theta(self) -> float:
        return float(dict(self.params).get("rope_theta", 10000.0))


@dataclass(frozen=True)
class AttentionSpec:
    rope: RopeSpec
    scale: float  # on the scores q.k (head_dim ** -0.5 unless the family says otherwise)
    window: int | None = None  # a query sees its last `window` keys (itself included); None: all before it
    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap) before the mask (Gemma 2)
    qk_norm: bool = False  # an RMSNorm over each head of q and k before rotary (Qwen3, Gemma 3)
    qk_norm_whole: bool = False  # the q and k norms span all of q's (k's) heads at once, not each head (OLMoE)
    clip_qkv: float | None = None  # q, k and v clamped to [-clip, clip] after their projection (OLMoE's option)

    def __post_init__(self) -> None:
        if self.window is not None and self.window < 1:
            raise ValueError(f"a sliding window of {self.window} keys sees nothing")
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"attention logit softcap {self.softcap} must be positive")


@dataclass(frozen=True)
class NormSpec:
    """The layer's norms by place, each the checkpoint's module name or None where the layer has none.

    Llama: `input_layernorm` before attention, `post_attention_layernorm` before the MLP (HF's name for what
    is a pre-MLP norm). Gemma 2/3: four, one on each side of attention and of the MLP.
    unit_offset: Gemma's RMSNorm scales by (1 + w), in float32, before rounding once; plain RMSNorm by w.
    """

    pre_attention: str = "input_layernorm"
    post_attention: str | None = None
    pre_mlp: str = "post_attention_layernorm"
    post_mlp: str | None = None
    unit_offset: bool = False

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n in (self.pre_attention, self.post_attention, self.pre_mlp, self.post_mlp) if n is not None)


@dataclass(frozen=True)
class MlpSpec:
    """A gated MLP, act(gate) * up then down; or, with `experts`, a sparse one: a router (a linear layer to one
    logit per expert) sends each token to its `top_k` experts, each a gated MLP of `width`, and the token's output
    is their outputs weighted by the router's softmax probabilities of them (renormalized to sum to 1 over the
    chosen ones where `normalize`: Mixtral, and Qwen3-MoE's norm_topk_prob; OLMoE does not). Every family here
    takes the softmax over all experts first and then the top k, as transformers does (Mixtral's top k of the
    logits then a softmax over them is the same choice and the same weights, up to rounding)."""

    activation: str = "silu"  # of the gate: act(gate) * up
    width: int | None = None  # the inner width (an expert's, with experts); None: the config's intermediate_size
    experts: int = 0  # 0: dense
    top_k: int = 0
    normalize: bool = False

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"MLP activation {self.activation!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
        if self.experts and not 0 < self.top_k <= self.experts:
            raise ValueError(f"{self.top_k} experts a token out of {self.experts}: it must be between 1 and {self.experts}")
        if self.width is not None and self.width < 1:
            raise ValueError(f"an MLP of inner width {self.width}")


@dataclass(frozen=True)
class LayerSpec:
    attention: AttentionSpec
    norms: NormSpec = NormSpec()
    mlp: MlpSpec = MlpSpec()

    @property
    def fusable(self) -> bool:
        """Whether the native fused path (each residual add fused into the plain RMSNorm after it) computes this
        layer: two plain norms, each right after a residual add."""
        n = self.norms
        return not n.unit_offset and n.post_attention is None and n.post_mlp is None


@dataclass(frozen=True)
class ModelSpec:
    """Every layer's spec, and what sits around the layers."""

    layers: tuple[LayerSpec, ...]
    embed_scale: float | None = None  # token embeddings times this, rounded to the model's dtype (Gemma: sqrt(hidden))
    final_norm_unit_offset: bool = False  # the final norm's kind (see NormSpec.unit_offset)
    logit_softcap: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)

    @property
    def fusable(self) -> bool:
        return not self.final_norm_unit_offset and all(layer.fusable for layer in self.layers)


def hf_activation(name: str) -> str:
    """transformers' `hidden_act` as an MlpSpec activation; an unsupported one names itself."""
    if name not in HF_ACTIVATIONS:
        raise ValueError(f"MLP activation {name!r} is not supported (supported: {', '.join(sorted(HF_ACTIVATIONS))})")
    return HF_ACTIVATIONS[name]


def rope_of(hf, head_dim: int, layer_type: str | None = None) -> RopeSpec:
    """The RopeSpec transformers' config `hf` gives a layer (of `layer_type` where the config's rope parameters
    are per type): the rotated dimensions from `partial_rotary_factor` (in the rope parameters or the config)."""
    params = dict(getattr(hf, "rope_parameters", None) or {})
    if layer_type is not None and layer_type in params:
        params = dict(params[layer_type])
    else:
        layer_type = None
        params.setdefault("rope_theta", getattr(hf, "rope_theta", 10000.0))
    fraction = params.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", None) or 1.0)
    rotary_dim = int(head_dim * fraction)
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"partial_rotary_factor {fraction} rotates {rotary_dim} of {head_dim} dimensions: it must be an even number")
    return RopeSpec(tuple(sorted((k, _hashable(v)) for k, v in params.items())), rotary_dim, layer_type)


def _hashable(v: Any) -> Any:
    return tuple(v) if isinstance(v, list) else v


def default_layers(config) -> ModelSpec:
    """The Llama-shaped decoder (Llama, Mistral, Qwen2/3, Phi-3, the vision-language decoders): every layer alike,
    pre-norm, the config's activation (SiLU), one window for the model if configured, the config's rope (partial
    where it says so). config: a ModelConfig."""
    hf = config.hf_config
    spec = LayerSpec(AttentionSpec(rope_of(hf, config.head_dim), config.head_dim**-0.5, config.sliding_window, qk_norm=config.qk_norm),
                     mlp=MlpSpec(hf_activation(getattr(hf, "hidden_act", None) or "silu")))
    return ModelSpec((spec,) * config.num_layers)


def sparse_layers(config, experts: int, top_k: int, width: int, normalize: bool, sparse=lambda i: True) -> ModelSpec:
    """The Llama-shaped decoder with mixture-of-experts MLPs (Qwen3-MoE, Mixtral, OLMoE): as default_layers, but
    layer i's MLP is `experts` experts of `width` with top-`top_k` routing where `sparse(i)`, dense elsewhere
    (Qwen3-MoE's mlp_only_layers and decoder_sparse_step)."""
    base = default_layers(config).layers[0]
    moe = replace(base, mlp=replace(base.mlp, width=width, experts=experts, top_k=top_k, normalize=normalize))
    return ModelSpec(tuple(moe if sparse(i) else base for i in range(config.num_layers)))


def softcap_or_none(value) -> float | None:
    return float(value) if value else None
