"""Llama (and SmolLM2, which is one): the plain pre-norm decoder with rotary and GQA."""

from shoal.model.layers import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    pass
