"""Gemma 2 and Gemma 3 (text): the layers of the Gemma family as a spec (spec.LayerSpec), nothing else.

- four norms a layer, around attention and around the MLP, each Gemma's (1 + w) RMSNorm, and the final one too;
- token embeddings times sqrt(hidden), rounded to the model's dtype first, as transformers does;
- a GELU-tanh gated MLP;
- scores scaled by query_pre_attn_scalar ** -0.5, not head_dim's;
- local and global layers as `layer_types` lists them: a local layer sees a window of `sliding_window` keys;
  Gemma 2 alternates them, Gemma 3 has five local layers to a global one, each kind with its own rope
  (Gemma 3: theta 10k local, 1M global, with the global layers' scaling);
- Gemma 2 softcaps attention scores (attn_logit_softcapping) and the logits (final_logit_softcapping);
  Gemma 3 instead normalizes q and k per head before rotary.

The local layers keep their window's KV only: they form a KV group of their own (types.KVGroup, engine/kv_manager.py).
Reference: transformers' modeling_gemma2.py, modeling_gemma3.py.
"""

from __future__ import annotations

from shoal.model.config import ModelConfig
from shoal.model.layers import DecoderForCausalLM
from shoal.model.spec import AttentionSpec, LayerSpec, MlpSpec, ModelSpec, NormSpec, hf_activation, rope_of, softcap_or_none

GEMMA_NORMS = NormSpec("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm",
                       unit_offset=True)
LAYER_TYPES = ("sliding_attention", "full_attention")


def gemma_spec(config: ModelConfig) -> ModelSpec:
    hf = config.hf_config
    if getattr(hf, "use_bidirectional_attention", False):
        raise ValueError("a Gemma config with use_bidirectional_attention is an encoder (EmbeddingGemma); shoal runs it causal only")
    types = list(hf.layer_types)
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown or len(types) != config.num_layers:
        raise ValueError(f"layer_types {types}: expected {config.num_layers} of {', '.join(LAYER_TYPES)}")
    scale = float(hf.query_pre_attn_scalar) ** -0.5
    softcap = softcap_or_none(getattr(hf, "attn_logit_softcapping", None))
    mlp = MlpSpec(hf_activation(getattr(hf, "hidden_activation", None) or hf.hidden_act))
    layers = tuple(
        LayerSpec(AttentionSpec(rope_of(hf, config.head_dim, kind), scale, hf.sliding_window if kind == "sliding_attention" else None,
                                softcap, qk_norm=config.qk_norm), GEMMA_NORMS, mlp)
        for kind in types
    )
    return ModelSpec(layers, embed_scale=config.hidden_size**0.5, final_norm_unit_offset=True,
                     logit_softcap=softcap_or_none(getattr(hf, "final_logit_softcapping", None)))


class Gemma2ForCausalLM(DecoderForCausalLM):
    model_spec = staticmethod(gemma_spec)


class Gemma3ForCausalLM(DecoderForCausalLM):
    qk_norm = True  # Gemma 3's q_norm and k_norm, (1 + w) as its other norms
    model_spec = staticmethod(gemma_spec)
