"""Tiny random-weight models and a tiny tokenizer, built by the tests themselves.

Nothing here downloads anything: the tokenizer is a byte-level BPE trained in a
few milliseconds on a fixed corpus, the models are transformers models built
from small configs with a fixed seed and saved as safetensors.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# ChatML with tools the way Qwen 2.5 / Hermes templates do it: definitions in the system
# turn, calls as <tool_call> blocks, results as <tool_response> in a user turn.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{% endif %}"
    "# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n"
    "Call a tool with <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n"
    "{% elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{% elif message['role'] == 'assistant' %}<|im_start|>assistant\n{{ message['content'] or '' }}"
    "{% for call in message.get('tool_calls') or [] %}<tool_call>\n"
    "{\"name\": \"{{ call['function']['name'] }}\", \"arguments\": {{ call['function']['arguments'] | tojson }}}\n</tool_call>{% endfor %}"
    "<|im_end|>\n"
    "{% elif message['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_CORPUS = [
    "The quick brown fox jumps over the lazy dog. ",
    "What is the capital of France? Paris is the capital of France.",
    "def add(x, y):\n    return x + y\n",
    "Hello, world! 0123456789 héllo naïve café 日本語 emoji 🙂 ",
    "Once upon a time there was a small model that loved to count: one two three four five.",
    "<think>reasoning goes here</think> and then the answer.",
]


def make_tokenizer(vocab_size: int = 400):
    """A byte-level BPE tokenizer with ChatML special tokens (ids 0, 1, 2)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


# Small but shaped like the real thing: GQA (4 query heads over 2 KV heads),
# several layers, a head_dim that is not the hidden size / heads for Qwen3.
_BASE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=None,
    eos_token_id=0,
    pad_token_id=0,
)

ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(tie_word_embeddings=False, sliding_window=None)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=True, head_dim=32)),
}


# The families on per-layer specs (tests/test_families.py), kept apart from ARCHS, which every test of the
# Llama-shaped families runs over. Windows (8) shorter than the tests' prompts; LongRoPE factors for a head's
# 8 rotary frequencies (6 where Phi-4-mini rotates 3/4 of the head).
_LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 32,
             "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8], "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 8.5, 11.5, 15.0]}
FAMILY_ARCHS = {
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(tie_word_embeddings=False, max_position_embeddings=128, sliding_window=8, original_max_position_embeddings=32,
                                                   rope_parameters=_LONGROPE)),
    "phi4mini": ("Phi3Config", "Phi3ForCausalLM", dict(tie_word_embeddings=True, partial_rotary_factor=0.75,
                                                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                        "partial_rotary_factor": 0.75})),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(num_hidden_layers=4, head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                                                         attn_logit_softcapping=0.1, final_logit_softcapping=0.5)),
    # Gemma 3's pattern, five local layers to a global one; rope theta 10k local, 1M global scaled by 8 (its 4B+)
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(num_hidden_layers=6, head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                                                             rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                                              "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                                                 "rope_theta": 1000000.0}})),
    # mixture of experts: 8 experts, 2 or 3 a token; Qwen3-MoE with a dense layer (mlp_only_layers) between sparse ones
    "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(tie_word_embeddings=False, head_dim=32, num_experts=8, num_experts_per_tok=3,
                                                               moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1])),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(tie_word_embeddings=False, num_local_experts=8, num_experts_per_tok=2,
                                                            intermediate_size=64, sliding_window=None)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(tie_word_embeddings=False, num_experts=8, num_experts_per_tok=3, intermediate_size=32,
                                                      norm_topk_prob=False, clip_qkv=2.0)),
}


def make_tiny_model(arch: str, path: Path, *, seed: int = 0, rope_parameters: dict | None = None, chat_template: str | None = None, **overrides) -> Path:
    """Write a random-weight `arch` model folder (config, safetensors, tokenizer) to `path` (ARCHS or FAMILY_ARCHS)."""
    import transformers

    tokenizer = make_tokenizer()
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    config_cls_name, model_cls_name, extra = {**ARCHS, **FAMILY_ARCHS}[arch]
    kwargs = {**_BASE, **extra, "vocab_size": len(tokenizer), **overrides}
    if rope_parameters is not None:
        kwargs["rope_parameters"] = rope_parameters
    config = getattr(transformers, config_cls_name)(**kwargs)
    config.architectures = [model_cls_name]
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls_name)(config).to(torch.float32).eval()
    # Random init leaves norms at 1 and biases at 0; perturb them so a loader
    # that drops them, or applies them wrongly, changes the logits.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    path = Path(path)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2], "temperature": 0.7}))
    return path


# Qwen2-VL's chat template, reduced: a message's content is a string or a list of parts, and each image part
# becomes <|vision_start|><|image_pad|><|vision_end|> (the processor, or shoal, repeats the pad per token).
VL_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]

VL_ARCHS = {
    "qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration", "qwen2_vl.image_processing_pil_qwen2_vl", "Qwen2VLImageProcessorPil"),
    "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration", "qwen2_vl.image_processing_pil_qwen2_vl", "Qwen2VLImageProcessorPil"),
    "idefics3": ("Idefics3Config", "Idefics3ForConditionalGeneration", "idefics3.image_processing_pil_idefics3", "Idefics3ImageProcessorPil"),
    "smolvlm": ("SmolVLMConfig", "SmolVLMForConditionalGeneration", "smolvlm.image_processing_pil_smolvlm", "SmolVLMImageProcessorPil"),
}

# SmolVLM's chat template: it takes a message's content as a list of parts only (a string's text is dropped).
IDEFICS3_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'][0]['type'] == 'image' %}{{ ':' }}{% else %}{{ ': ' }}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{ line['text'] }}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
IDEFICS3_TOKENS = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>",
                   *(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7))]


def _make_tiny_idefics3(family: str, path: Path, seed: int) -> Path:
    """Idefics3, or SmolVLM (its architecture under its own classes): a two-layer SigLIP over 16-pixel patches of
    64-pixel tiles, the pixel shuffle (scale 2: 4 tokens a tile) and a two-layer Llama. Images are resized to at
    most 128 pixels a side, so up to 2 x 2 tiles and the global view."""
    import importlib

    import transformers

    config_cls, model_cls, proc_module, proc_cls = VL_ARCHS[family]

    tokenizer = make_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", *IDEFICS3_TOKENS]})
    tokenizer.chat_template = IDEFICS3_TEMPLATE
    text = dict(_BASE, model_type="llama", num_hidden_layers=2, vocab_size=len(tokenizer), tie_word_embeddings=False)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=64, patch_size=16)
    config = getattr(transformers, config_cls)(text_config=text, vision_config=vision, scale_factor=2,
                                               image_token_id=tokenizer.convert_tokens_to_ids("<image>"), tie_word_embeddings=False)
    config.architectures = [model_cls]
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    path = Path(path)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    processor = getattr(importlib.import_module(f"transformers.models.{proc_module}"), proc_cls)
    processor(size={"longest_edge": 128}, max_image_size={"longest_edge": 64}).save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    return path


def make_tiny_vl_model(family: str, path: Path, *, seed: int = 0, max_pixels: int = 28 * 28 * 64, text: dict | None = None,
                       vision: dict | None = None) -> Path:
    """Write a random-weight vision-language model folder (config, safetensors, tokenizer, chat template and
    preprocessor config) of `family` (VL_ARCHS). Qwen2-VL's: a two-layer ViT over 14-pixel patches, merged 2x2,
    before a two-layer Qwen2 decoder with M-RoPE; max_pixels keeps images small (64 tokens at most)."""
    import importlib

    import transformers

    if family in ("idefics3", "smolvlm"):
        return _make_tiny_idefics3(family, path, seed)
    tokenizer = make_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", *VL_TOKENS]})
    tokenizer.chat_template = VL_TEMPLATE
    ids = dict(zip(VL_TOKENS, tokenizer.convert_tokens_to_ids(VL_TOKENS)))
    config_cls, model_cls, proc_module, proc_cls = VL_ARCHS[family]
    text_kw = {**_BASE, "num_hidden_layers": 2, "vocab_size": len(tokenizer),
               "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}, **(text or {})}
    vision_kw = dict(depth=2, hidden_size=32 if family == "qwen2_5_vl" else 64, num_heads=2, patch_size=14, spatial_merge_size=2,
                     temporal_patch_size=2, in_channels=3)
    if family == "qwen2_vl":
        vision_kw.update(embed_dim=32, mlp_ratio=2)
    else:  # window attention over 2x2 windows of merged tokens, full attention in the last block
        vision_kw.update(intermediate_size=64, out_hidden_size=64, window_size=56, fullatt_block_indexes=[1])
    vision_kw.update(vision or {})  # a larger model for benchmarks (text and vision override the shapes)
    config = getattr(transformers, config_cls)(
        text_config=text_kw, vision_config=vision_kw, image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False,
    )
    config.architectures = [model_cls]
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias") or "norm1" in name or "norm2" in name or "ln_q" in name:
                p.add_(torch.randn_like(p) * 0.1)
    path = Path(path)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    processor = getattr(importlib.import_module(f"transformers.models.{proc_module}"), proc_cls)(min_pixels=56 * 56, max_pixels=max_pixels)
    processor.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    return path
