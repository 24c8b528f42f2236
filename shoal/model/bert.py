"""The BERT family as an encoder for embeddings: bidirectional attention over a whole input, no KV cache.

all-MiniLM and bge ship as Hugging Face folders in sentence-transformers' layout (a `BertModel` and its modules,
model/pooling_files.py). The forward is transformers' own `BertModel` with the checkpoint's weights, as the vision
towers are (model/vision.py): every row of an input attends to every other, so an input is computed whole, in one
step, and nothing of it is kept (runner/encoder_runner.py). Not served yet: nomic-bert and bert from GGUF.
"""

from __future__ import annotations

from pathlib import Path

import torch

from shoal.model.config import ModelConfig

ENCODER_ARCHITECTURES = ("BertModel",)


def is_encoder(hf_config) -> bool:
    return any(a in ENCODER_ARCHITECTURES for a in (getattr(hf_config, "architectures", None) or []))


def encoder_config(hf) -> ModelConfig:
    """The shape the engine and its stats read, for an encoder (no KV heads are cached: num_kv_heads is nominal)."""
    heads = hf.num_attention_heads
    return ModelConfig(
        architecture=hf.architectures[0], vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size, num_layers=hf.num_hidden_layers, num_heads=heads, num_kv_heads=heads,
        head_dim=hf.hidden_size // heads, rms_norm_eps=hf.layer_norm_eps, max_position_embeddings=hf.max_position_embeddings,
        tie_word_embeddings=False, attention_bias=True, qk_norm=False, sliding_window=None, hf_config=hf,
    )


def load_encoder(path: Path, dtype: torch.dtype, device: torch.device):
    """(transformers' BertModel with the folder's weights, in eval mode; its fast tokenizer)."""
    import transformers

    model = transformers.AutoModel.from_pretrained(path, dtype=dtype).to(device).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    return model, tokenizer
