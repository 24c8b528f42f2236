"""Architecture name (as in config.json's `architectures`) -> model class, imported lazily."""

from __future__ import annotations

import importlib

_MODELS = {
    "LlamaForCausalLM": ("shoal.model.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("shoal.model.mistral", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("shoal.model.qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("shoal.model.qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("shoal.model.qwen3_moe", "Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": ("shoal.model.mixtral", "MixtralForCausalLM"),
    "OlmoeForCausalLM": ("shoal.model.olmoe", "OlmoeForCausalLM"),
    "Qwen2VLForConditionalGeneration": ("shoal.model.qwen2_vl", "Qwen2VLForConditionalGeneration"),
    "Qwen2_5_VLForConditionalGeneration": ("shoal.model.qwen2_vl", "Qwen2_5_VLForConditionalGeneration"),
    "Phi3ForCausalLM": ("shoal.model.phi3", "Phi3ForCausalLM"),
    "Gemma2ForCausalLM": ("shoal.model.gemma", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("shoal.model.gemma", "Gemma3ForCausalLM"),
    "Idefics3ForConditionalGeneration": ("shoal.model.idefics3", "Idefics3ForConditionalGeneration"),
    "SmolVLMForConditionalGeneration": ("shoal.model.idefics3", "SmolVLMForConditionalGeneration"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def model_class(architectures: list[str] | None):
    for arch in architectures or []:
        if arch in _MODELS:
            module, name = _MODELS[arch]
            return getattr(importlib.import_module(module), name)
    raise ValueError(f"unsupported architecture {architectures}; shoal runs {', '.join(supported_architectures())}")
