"""Phi-3, Phi-3.5, Phi-4 and Phi-4-mini: Llama's layer, with three things read from the checkpoint as it is.

- q, k, v and gate, up come fused (`qkv_proj`, `gate_up_proj`), as shoal's layers hold them: the loader
  cuts them by rows into their parts (weights.FUSED_PARAMS), so formats and tensor parallelism see parts.
- Phi-4-mini rotates the first `partial_rotary_factor` of each head and passes the rest (spec.RopeSpec.rotary_dim).
- LongRoPE (rope type "longrope"): short or long factors, chosen once by the served context
  (layers.rope_inv_freq says which and why).

A configured `sliding_window` (Phi-3-mini-4k's) limits attention as Mistral's does; Phi-4 has none. Everything
is the default spec (spec.default_layers). Reference: transformers' modeling_phi3.py.
"""

from shoal.model.layers import DecoderForCausalLM


class Phi3ForCausalLM(DecoderForCausalLM):
    pass
