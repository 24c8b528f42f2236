"""OLMoE (OLMoE-1B-7B): Llama's layer with a sparse MLP, and q and k normalized whole.

- 64 experts, 8 a token, their softmax weights used as they are (`norm_topk_prob` false in the releases);
- an RMSNorm over all of q (and of k) after its projection, not per head (spec.AttentionSpec.qk_norm_whole);
- `clip_qkv`, where set, clamps q, k and v after the norms.

Reference: transformers' modeling_olmoe.py.
"""

from dataclasses import replace

from shoal.model.layers import DecoderForCausalLM
from shoal.model.spec import ModelSpec, sparse_layers


def olmoe_spec(config) -> ModelSpec:
    hf = config.hf_config
    spec = sparse_layers(config, hf.num_experts, hf.num_experts_per_tok, config.intermediate_size, bool(hf.norm_topk_prob))
    clip = float(hf.clip_qkv) if getattr(hf, "clip_qkv", None) else None
    return replace(spec, layers=tuple(replace(layer, attention=replace(layer.attention, qk_norm_whole=True, clip_qkv=clip))
                                      for layer in spec.layers))


class OlmoeForCausalLM(DecoderForCausalLM):
    qk_norm = True
    model_spec = staticmethod(olmoe_spec)
