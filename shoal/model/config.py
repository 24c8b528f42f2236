"""ModelConfig: the shape of a decoder-only transformer, read off a transformers config."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections (Qwen2)
    qk_norm: bool  # RMSNorm over each head of q and k before rotary (Qwen3)
    sliding_window: int | None
    hf_config: Any  # the decoder's transformers config, for rope parameters and anything family-specific

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} query heads do not group evenly over {self.num_kv_heads} KV heads")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    def sharded(self, shard) -> ModelConfig:
        """The shape one tensor-parallel rank computes (shard: runner.shard_plan.TensorShard)."""
        return replace(self, num_heads=shard.num_heads, num_kv_heads=shard.num_kv_heads, intermediate_size=shard.intermediate_size)

    @classmethod
    def from_hf(cls, config: Any, *, qk_norm: bool = False, attention_bias: bool | None = None) -> ModelConfig:
        """config: a transformers config; a vision-language model's describes its decoder in `text_config`."""
        hf = config.get_text_config()
        heads = hf.num_attention_heads
        window = getattr(hf, "sliding_window", None)
        if getattr(hf, "use_sliding_window", True) is False:
            window = None  # Qwen2 carries a window size it does not use
        return cls(
            architecture=(config.architectures or ["?"])[0],
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
            rms_norm_eps=hf.rms_norm_eps,
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(hf, "attention_bias", False)) if attention_bias is None else attention_bias,
            qk_norm=qk_norm,
            sliding_window=window,
            hf_config=hf,
        )
