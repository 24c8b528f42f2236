"""Mixtral (8x7B, 8x22B): Mistral's attention with a sparse MLP in every layer.

A token goes to `num_experts_per_tok` (2) of `num_local_experts` (8) experts of width `intermediate_size`,
their weights renormalized over the chosen ones. The checkpoint names the sparse MLP `block_sparse_moe` and
an expert's gate, down and up projections `w1`, `w2`, `w3`; they are read under shoal's (`checkpoint_renames`).
llama.cpp writes Mixtral as arch `llama` with `llama.expert_count` (gguf_loader). Reference: transformers'
modeling_mixtral.py.
"""

from shoal.model.layers import DecoderForCausalLM
from shoal.model.spec import ModelSpec, sparse_layers


def mixtral_spec(config) -> ModelSpec:
    hf = config.hf_config
    return sparse_layers(config, hf.num_local_experts, hf.num_experts_per_tok, config.intermediate_size, True)


class MixtralForCausalLM(DecoderForCausalLM):
    model_spec = staticmethod(mixtral_spec)
    checkpoint_renames = ((".block_sparse_moe.", ".mlp."), (".w1.", ".gate_proj."), (".w2.", ".down_proj."), (".w3.", ".up_proj."))
