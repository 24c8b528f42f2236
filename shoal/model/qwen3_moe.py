"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B, Qwen3-235B-A22B): Qwen3's attention with a sparse MLP.

Each sparse layer routes a token to `num_experts_per_tok` of `num_experts` experts of width
`moe_intermediate_size`, renormalizing their weights where `norm_topk_prob` (every release does). Layers listed
in `mlp_only_layers`, or off the `decoder_sparse_step` stride, stay dense (width `intermediate_size`); the
releases have none. Reference: transformers' modeling_qwen3_moe.py.
"""

from shoal.model.layers import DecoderForCausalLM
from shoal.model.spec import ModelSpec, sparse_layers


def qwen3_moe_spec(config) -> ModelSpec:
    hf = config.hf_config
    dense = set(getattr(hf, "mlp_only_layers", None) or ())
    step = int(getattr(hf, "decoder_sparse_step", 1) or 1)
    return sparse_layers(config, hf.num_experts, hf.num_experts_per_tok, hf.moe_intermediate_size, bool(hf.norm_topk_prob),
                         lambda i: hf.num_experts > 0 and i not in dense and (i + 1) % step == 0)


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    qk_norm = True
    model_spec = staticmethod(qwen3_moe_spec)
