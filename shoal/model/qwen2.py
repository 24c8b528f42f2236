"""Qwen2: Llama's layout with biases on the q/k/v projections (not on o_proj)."""

from shoal.model.layers import DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    attention_bias = True
