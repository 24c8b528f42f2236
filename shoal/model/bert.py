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
BERT's "word" and "##word"), lowercased as llama.cpp's WPM tokenizer does.

nomic-embed-text (model_type `nomic_bert`: rotary positions, a SwiGLU MLP, norms after each sublayer) is transformers'
own `NomicBertModel`, from a folder as BERT's are. Its `nomic-bert` GGUF loads the same way as a `bert` one: config
from the metadata (`rope.freq_base` the rotary base), each tensor by gguf's NOMIC_BERT table back to transformers'
names, the fused `attn_qkv` llama.cpp writes (nomic's `Wqkv`) cut into transformers' separate q, k and v in that
order (as transformers' conversion_mapping does with `Wqkv`), and the WordPiece vocabulary as for `bert`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from shoal.model.config import ModelConfig

ENCODER_ARCHITECTURES = ("BertModel", "BertForSequenceClassification", "NomicBertModel")
GGUF_ENCODERS = ("bert", "nomic-bert")  # llama.cpp's architectures served as encoders
CROSS_ENCODER = "BertForSequenceClassification"  # sentence-transformers' CrossEncoder layout: it reranks


def is_encoder(hf_config) -> bool:
    return (getattr(hf_config, "model_type", None) == "nomic_bert"
            or any(a in ENCODER_ARCHITECTURES for a in (getattr(hf_config, "architectures", None) or [])))


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
    """(transformers' BertModel, or NomicBertModel for `nomic_bert`, with the folder's (or the GGUF's) weights, in
    eval mode; its fast tokenizer)."""
    import transformers

    if gguf_reader is not None:
        return _load_gguf(gguf_reader, dtype, device)
    auto = transformers.AutoModelForSequenceClassification if is_cross_encoder(read_hf_config(path)) else transformers.AutoModel
    model = auto.from_pretrained(path, dtype=dtype).to(device).eval()
    if model.config.model_type == "nomic_bert":
        model.config.architectures = ["NomicBertModel"]
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
    if arch not in GGUF_ENCODERS:
        raise ValueError(f"GGUF architecture {arch!r} is not served as an encoder (shoal serves {', '.join(GGUF_ENCODERS)})")
    tensors = {t.name: t for t in reader.tensors}
    if arch == "nomic-bert":
        return _load_nomic_gguf(meta, tensors, dtype, device)
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


def _nomic_names(layers: int) -> dict[str, str]:
    """transformers' NomicBertModel names (less q/k/v, which are one fused tensor) -> nomic's own, which gguf's
    NOMIC_BERT table maps (the inverse of transformers' conversion_mapping for nomic_bert)."""
    names = {"embeddings.word_embeddings": "embeddings.word_embeddings",
             "embeddings.token_type_embeddings": "embeddings.token_type_embeddings", "embeddings.LayerNorm": "emb_ln"}
    for i in range(layers):
        for ours, theirs in (("self_attn.o_proj", "attn.out_proj"), ("mlp.up_proj", "mlp.fc11"), ("mlp.gate_proj", "mlp.fc12"),
                             ("mlp.down_proj", "mlp.fc2"), ("post_attention_layernorm", "norm1"), ("post_mlp_layernorm", "norm2")):
            names[f"layers.{i}.{ours}"] = f"encoder.layers.{i}.{theirs}"
    return names


def _load_nomic_gguf(meta: dict, tensors: dict, dtype: torch.dtype, device: torch.device):
    import gguf
    import transformers

    from shoal.model.gguf_loader import dequantize

    a = "nomic-bert"
    tokens = list(meta["tokenizer.ggml.tokens"])
    layers = int(meta[f"{a}.block_count"])
    hidden, heads = int(meta[f"{a}.embedding_length"]), int(meta[f"{a}.attention.head_count"])
    if int(meta.get(f"{a}.attention.head_count_kv", heads)) != heads:
        raise ValueError("a nomic-bert GGUF with fewer KV heads than heads is not served")
    config = transformers.NomicBertConfig(
        vocab_size=len(tokens), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        intermediate_size=int(meta[f"{a}.feed_forward_length"]), max_position_embeddings=int(meta[f"{a}.context_length"]),
        layer_norm_eps=float(meta[f"{a}.attention.layer_norm_epsilon"]),
        type_vocab_size=int(tensors["token_types.weight"].shape[-1]) if "token_types.weight" in tensors else 2,
        rope_parameters={"rope_type": "default", "rope_theta": float(meta.get(f"{a}.rope.freq_base", 10000.0))},
    )
    config.architectures = ["NomicBertModel"]
    model = transformers.NomicBertModel(config)
    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.NOMIC_BERT, layers)

    def read(name: str) -> torch.Tensor:
        if name not in tensors:
            raise ValueError(f"the GGUF lacks {name}")
        return dequantize(tensors[name])

    names = _nomic_names(layers)
    state = {}
    for hf_name, param in model.state_dict().items():
        base, suffix = hf_name.rsplit(".", 1)
        if base.endswith(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")):
            i = int(base.split(".")[1])
            which = "qkv".index(base[-6])
            fused = f"blk.{i}.attn_qkv.{suffix}"
            if fused in tensors:  # llama.cpp's fused q, k, v, in that order along the output rows
                state[hf_name] = read(fused).reshape(3 * param.shape[0], *param.shape[1:])[which * param.shape[0]:(which + 1) * param.shape[0]]
            else:  # separate attn_q, attn_k, attn_v (llama.cpp reads either)
                state[hf_name] = read(f"blk.{i}.attn_{'qkv'[which]}.{suffix}").reshape(param.shape)
            continue
        if base == "embeddings.token_type_embeddings" and "token_types.weight" not in tensors:
            state[hf_name] = torch.zeros(param.shape)  # llama.cpp's type embeddings are optional: none added
            continue
        gguf_name = table.get_name(names[base]) if base in names else None
        if gguf_name is None:
            raise ValueError(f"no GGUF tensor for {hf_name}")
        state[hf_name] = read(f"{gguf_name}.{suffix}").reshape(param.shape)
    model.load_state_dict(state, strict=True)
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
