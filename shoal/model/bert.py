"""The BERT family as an encoder for embeddings: bidirectional attention over a whole input, no KV cache.

all-MiniLM and bge ship as Hugging Face folders in sentence-transformers' layout (a `BertModel` and its modules,
model/pooling_files.py). The forward is transformers' own `BertModel` with the checkpoint's weights, as the vision
towers are (model/vision.py): every row of an input attends to every other, so an input is computed whole, in one
step, and nothing of it is kept (runner/encoder_runner.py).

A cross-encoder (sentence-transformers' CrossEncoder layout: a `BertForSequenceClassification` folder) reranks: a
(query, document) pair is one input `[CLS] q [SEP] d [SEP]` with segment ids 0 then 1, and its score is the
classifier's logit on the pooled [CLS] row, through the activation CrossEncoder.predict applies (`score_activation`).

A GGUF of architecture `bert` (as llama.cpp's convert_hf_to_gguf writes one) loads into the same module: its
config from the metadata, each tensor by gguf's own name table for BERT, dequantized to float; its WordPiece
vocabulary back from llama.cpp's phantom-space form (a word's first piece "▁word", a continuation "word", for
BERT's "word" and "##word"), lowercased as llama.cpp's WPM tokenizer does. Not served yet: nomic-bert (rotary
positions, a fused qkv, a SwiGLU MLP: not transformers' BertModel).
"""

from __future__ import annotations

from pathlib import Path

import torch

from shoal.model.config import ModelConfig

ENCODER_ARCHITECTURES = ("BertModel", "BertForSequenceClassification")
CROSS_ENCODER = "BertForSequenceClassification"  # sentence-transformers' CrossEncoder layout: it reranks


def is_encoder(hf_config) -> bool:
    return any(a in ENCODER_ARCHITECTURES for a in (getattr(hf_config, "architectures", None) or []))


def is_cross_encoder(hf_config) -> bool:
    return CROSS_ENCODER in (getattr(hf_config, "architectures", None) or [])


def score_activation(hf_config):
    """What a cross-encoder's logits go through, as sentence-transformers' CrossEncoder.predict applies it: the
    activation its config names (`sentence_transformers.activation_fn`), else a sigmoid for one label and none for
    several. ValueError for one shoal does not apply (only Sigmoid and Identity)."""
    named = (getattr(hf_config, "sentence_transformers", None) or {}).get("activation_fn")
    if named is None:
        named = "Sigmoid" if hf_config.num_labels == 1 else "Identity"
    kind = str(named).rsplit(".", 1)[-1]
    if kind == "Sigmoid":
        return torch.sigmoid
    if kind == "Identity":
        return lambda x: x
    raise ValueError(f"the cross-encoder's activation {named!r} is not served (shoal applies Sigmoid or Identity)")


def encoder_config(hf) -> ModelConfig:
    """The shape the engine and its stats read, for an encoder (no KV heads are cached: num_kv_heads is nominal)."""
    heads = hf.num_attention_heads
    return ModelConfig(
        architecture=hf.architectures[0], vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size, num_layers=hf.num_hidden_layers, num_heads=heads, num_kv_heads=heads,
        head_dim=hf.hidden_size // heads, rms_norm_eps=hf.layer_norm_eps, max_position_embeddings=hf.max_position_embeddings,
        tie_word_embeddings=False, attention_bias=True, qk_norm=False, sliding_window=None, hf_config=hf,
    )


def load_encoder(path: Path, dtype: torch.dtype, device: torch.device, gguf_reader=None):
    """(transformers' BertModel with the folder's (or the GGUF's) weights, in eval mode; its fast tokenizer)."""
    import transformers

    if gguf_reader is not None:
        return _load_gguf(gguf_reader, dtype, device)
    auto = transformers.AutoModelForSequenceClassification if is_cross_encoder(read_hf_config(path)) else transformers.AutoModel
    model = auto.from_pretrained(path, dtype=dtype).to(device).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    return model, tokenizer


def read_hf_config(path: Path):
    import transformers

    return transformers.AutoConfig.from_pretrained(path)


PHANTOM = "\u2581"


def _load_gguf(reader, dtype: torch.dtype, device: torch.device):
    import gguf
    import transformers

    from shoal.model.gguf_loader import dequantize

    meta = reader.metadata
    arch = meta.get("general.architecture")
    if arch != "bert":
        raise ValueError(f"GGUF architecture {arch!r} is not served as an encoder (shoal serves bert)")
    tensors = {t.name: t for t in reader.tensors}
    tokens = list(meta["tokenizer.ggml.tokens"])
    config = transformers.BertConfig(
        vocab_size=len(tokens), hidden_size=int(meta["bert.embedding_length"]), num_hidden_layers=int(meta["bert.block_count"]),
        num_attention_heads=int(meta["bert.attention.head_count"]), intermediate_size=int(meta["bert.feed_forward_length"]),
        max_position_embeddings=int(meta["bert.context_length"]), layer_norm_eps=float(meta["bert.attention.layer_norm_epsilon"]),
        type_vocab_size=int(tensors["token_types.weight"].shape[-1]) if "token_types.weight" in tensors else 2,
    )
    config.architectures = ["BertModel"]
    model = transformers.BertModel(config, add_pooling_layer=False)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BERT, config.num_hidden_layers)
    state = {}
    for hf_name, param in model.state_dict().items():
        base, suffix = hf_name.rsplit(".", 1)
        if base.endswith("position_ids") or hf_name.endswith("position_ids"):
            continue
        gguf_name = f"{names.get_name(base)}.{suffix}"
        if gguf_name not in tensors:
            raise ValueError(f"the GGUF lacks {gguf_name} ({hf_name})")
        state[hf_name] = dequantize(tensors[gguf_name]).reshape(param.shape)
    model.load_state_dict(state, strict=False)
    return model.to(dtype).to(device).eval(), _wordpiece(meta, tokens)


def _wordpiece(meta: dict, tokens: list[str]):
    """BERT's WordPiece tokenizer from llama.cpp's phantom-space vocabulary (see the module docstring)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    vocab = {}
    for i, t in enumerate(tokens):
        if t.startswith("[") and t.endswith("]"):
            word = t
        elif t.startswith(PHANTOM):
            word = t[len(PHANTOM):]
        else:
            word = "##" + t
        vocab.setdefault(word, i)
    def special(key: str, default: str) -> str:  # llama.cpp writes BERT's [CLS] as its BOS
        return tokens[meta[key]] if key in meta else default

    unk = special("tokenizer.ggml.unknown_token_id", "[UNK]")
    cls = special("tokenizer.ggml.bos_token_id", "[CLS]")
    sep = special("tokenizer.ggml.seperator_token_id", "[SEP]")
    backend = Tokenizer(models.WordPiece(vocab, unk_token=unk))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.post_processor = processors.TemplateProcessing(single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} $B:1 {sep}:1",
                                                           special_tokens=[(cls, vocab[cls]), (sep, vocab[sep])])
    backend.decoder = decoders.WordPiece()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token=unk, cls_token=cls, sep_token=sep,
                                                pad_token="[PAD]" if "[PAD]" in vocab else None)
