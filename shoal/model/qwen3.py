"""Qwen3: per-head RMSNorm on q and k before rotary; no q/k/v bias unless configured."""

from shoal.model.layers import DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):
    qk_norm = True
