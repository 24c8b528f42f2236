"""Idefics3 and SmolVLM: a Llama decoder beside a SigLIP vision transformer and a pixel-shuffle connector.

The decoder is Llama's layers with plain rotary positions: an image's tokens sit in the prompt as text tokens
do, between row and column marker tokens, and only their embeddings come from the tower. The tower and the
connector are transformers' modules (model/vision.py), run on one tile at a time.

Reference: transformers' modeling_idefics3.py (`get_image_features`, `inputs_merger`), processing_smolvlm.py.
"""

from shoal.model.llama import LlamaForCausalLM


class Idefics3ForConditionalGeneration(LlamaForCausalLM):
    vision = "idefics3"  # its tower and image preparation (model/vision.py FAMILIES)


class SmolVLMForConditionalGeneration(LlamaForCausalLM):
    vision = "smolvlm"
