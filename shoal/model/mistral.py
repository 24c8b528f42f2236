"""Mistral: Llama's layout; a configured sliding window limits how far back attention reaches."""

from shoal.model.layers import DecoderForCausalLM


class MistralForCausalLM(DecoderForCausalLM):
    pass
