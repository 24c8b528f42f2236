"""The model loader against its references.

* GGUF: tiny models converted by these tests the way llama.cpp's converter does
  (gguf's own HF->GGUF tensor-name map, its q/k row permutation, gguf.quants
  quantization) must load back to the bytes written, and near the original
  weights; the real default GGUF must load to what transformers loads from it,
  tensor for tensor and token for token.
* HF folders: every architecture of tests/tiny_models.py loads to exactly the
  saved tensors, sharded or not, with the right stop tokens and sampling defaults.
"""

from __future__ import annotations

import json
import logging

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from shoal import kernels
from shoal.model.gguf_loader import unpermute_qk
from shoal.model.loader import load_checkpoint, resolve_model_path, template_end_of_turn_id
from shoal.model.weights import load_weights
from tiny_models import ARCHS, make_tiny_model

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  two leading spaces",
    " one leading space",
    "trailing spaces   ",
    "def add(x, y):\n    return x + y  # sum\n\n\n\tindented",
    "Numbers: 0 7 42 1234567 3.14159 -2e10 1,000,000",
    "naïve café, Ελληνικά, русский, 日本語のテキスト, عربى",
    "emoji 🙂👍🏽 🇫🇷 👨‍👩‍👧 ✨",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n",
    "it's they're I'LL we'd",
    "\n\n\r\n \t mixed whitespace",
    "",
    "a<|im_start|>b<|im_end|>c<|endoftext|> d",  # special tokens glued to text
    "中文文本测试，包含标点。 한국어 Crème brûlée ß ø",
    "x = {'a': 12345678}  # https://example.com/path?q=1&r=two#frag",
    "\u00a0no-break\u2003em space\u200bzero width",
    "abab" * 20,
]

# ---------------------------------------------------------------- writing GGUFs like llama.cpp


def llamacpp_permute(w: np.ndarray | torch.Tensor, n_head: int):
    """convert_hf_to_gguf.py's LlamaModel.permute, verbatim (n_head already the
    tensor's own head count)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# Byte offsets of the float16 scales inside one block of the K-quants, which
# gguf.quants cannot quantize to: we write random blocks with sane scales instead.
K_QUANT_SCALES = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def encode(values: np.ndarray, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """The bytes (or floats) a GGUF stores for `values` as `qtype`."""
    if qtype not in K_QUANT_SCALES:
        return gguf.quants.quantize(values, qtype)
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(values.size // block_elems, block_bytes), dtype=np.uint8)
    for offset in K_QUANT_SCALES[qtype]:
        scales = rng.uniform(1e-3, 1e-2, size=len(blocks)).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(values.shape[0], -1)


GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def write_gguf(folder, out, arch: str, types: dict[str, Q], seed=0, extra=None) -> dict[str, tuple[str, np.ndarray]]:
    """Convert the tiny HF model in `folder` to a GGUF file `out`, as llama.cpp would.

    `types` picks the storage type per llama.cpp tensor kind ("attn_q", ...); 1-D
    tensors stay F32 as in llama.cpp. Returns {hf name: (gguf name, the values the
    file holds, dequantized with gguf.quants)}. `extra(writer)` may add metadata.
    """
    rng = np.random.default_rng(seed)
    config = transformers.AutoConfig.from_pretrained(folder)
    gguf_arch = GGUF_ARCH[arch]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[gguf_arch.upper()], config.num_hidden_layers)
    writer = gguf.GGUFWriter(str(out), gguf_arch)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if gguf_arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    write_vocab(writer, folder)
    if extra is not None:
        extra(writer)

    held = {}
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    for hf_name, tensor in load_file(folder / "model.safetensors").items():
        base, suffix = hf_name.rsplit(".", 1)
        gguf_name = f"{names.get_name(base)}.{suffix}"
        values = tensor.float().numpy()
        proj = base.rsplit(".", 1)[-1]
        if gguf_arch == "llama" and proj in heads:
            values = llamacpp_permute(values, heads[proj])
        kind = gguf_name.split(".")[-2]  # blk.0.attn_q.weight -> attn_q
        qtype = types.get(kind, Q.F32) if values.ndim == 2 else Q.F32
        stored = encode(values, qtype, rng)
        writer.add_tensor(gguf_name, stored, raw_dtype=qtype)
        held[hf_name] = (gguf_name, gguf.quants.dequantize(stored, qtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return held


def write_vocab(writer: gguf.GGUFWriter, folder) -> None:
    """Byte-level BPE vocabulary, as convert_hf_to_gguf's _set_vocab_gpt2 writes it:
    tokens by id, special added tokens as CONTROL, merges/special ids/chat template
    via gguf.SpecialVocab."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")  # tiny_models' tokenizer splits like GPT-2
    writer.add_token_list([by_id[i] for i in range(len(by_id))])
    kinds = [gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(len(by_id))]
    writer.add_token_types(kinds)
    gguf.SpecialVocab(folder, load_merges=True).add_to_gguf(writer, quiet=True)


# Storage types for the tiny models (all row lengths are multiples of 32).
MIXED_TYPES = {
    "token_embd": Q.Q8_0,
    "attn_q": Q.Q4_0,
    "attn_k": Q.Q8_0,
    "attn_v": Q.Q4_1,
    "attn_output": Q.F16,
    "ffn_gate": Q.Q5_0,
    "ffn_up": Q.BF16,
    "ffn_down": Q.Q5_1,
    "output": Q.F16,
}


def as_stored(arch: str, hf_name: str, weight: torch.Tensor, config) -> np.ndarray:
    """Our HF-layout weight put back into the file's layout (llama.cpp's permutation)."""
    proj = hf_name.split(".")[-2]
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    if GGUF_ARCH[arch] == "llama" and proj in heads:
        return llamacpp_permute(weight.numpy(), heads[proj])
    return weight.numpy()


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_tiny_gguf_loads_the_written_weights_config_and_tokenizer(arch, tmp_path):
    folder = make_tiny_model(arch, tmp_path / "hf")
    held = write_gguf(folder, tmp_path / "tiny.gguf", arch, MIXED_TYPES)
    ckpt = load_checkpoint(tmp_path / "tiny.gguf", progress=False)
    hf_config = transformers.AutoConfig.from_pretrained(folder)
    original = load_file(folder / "model.safetensors")

    assert ckpt.format == "gguf"
    assert set(ckpt.state_dict) == set(original)  # incl. lm_head exactly when untied
    for name, weight in ckpt.state_dict.items():
        gguf_name, stored = held[name]
        assert weight.dtype == torch.float32 and weight.shape == original[name].shape, name
        # Exactly the file's values, un-permuted; F32 tensors exactly the original.
        np.testing.assert_array_equal(as_stored(arch, name, weight, hf_config), stored, err_msg=gguf_name)
        if weight.ndim == 1:
            assert torch.equal(weight, original[name]), name
        # Near the original in HF layout: a wrong un-permutation would be far off.
        err = (weight - original[name]).abs().max()
        assert err <= original[name].abs().max() / 8, (name, float(err))

    config = ckpt.hf_config
    # llama.cpp writes Mistral as arch "llama", which runs it the same way.
    assert config.architectures == [{"mistral": "LlamaForCausalLM"}.get(arch, ARCHS[arch][1])]
    assert config.model_type == {"mistral": "llama"}.get(arch, arch)
    for attr in (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "max_position_embeddings", "vocab_size", "tie_word_embeddings",
    ):
        assert getattr(config, attr) == getattr(hf_config, attr), attr
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    assert config.head_dim == head_dim
    assert config.rms_norm_eps == pytest.approx(hf_config.rms_norm_eps, rel=1e-6)  # stored as float32
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": hf_config.rope_parameters["rope_theta"]}

    # The tokenizer rebuilt from the file tokenizes like the tokenizer.json it came from.
    source = Tokenizer.from_file(str(folder / "tokenizer.json"))
    for text in TEXTS:
        ids = ckpt.tokenizer(text).input_ids
        assert ids == source.encode(text).ids, text
        assert ckpt.tokenizer.decode(ids) == source.decode(ids, skip_special_tokens=False) == text
    assert ckpt.tokenizer.chat_template == transformers.AutoTokenizer.from_pretrained(folder).chat_template
    assert ckpt.tokenizer.eos_token == "<|endoftext|>"
    # eos 0 from the file, <|im_end|> (2) from the chat template; GGUF has no generation config.
    assert ckpt.eos_token_ids == (0, 2)
    assert ckpt.generation_defaults == {}


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_tiny_llama_gguf_matches_transformers_gguf_loading(arch, tmp_path):
    """A second reference for llama-arch files: transformers' own GGUF loader
    (which reverses the same permutation) on the same file."""
    pytest.importorskip("accelerate")
    folder = make_tiny_model(arch, tmp_path / "hf")
    write_gguf(folder, tmp_path / "tiny.gguf", arch, MIXED_TYPES)
    ours = load_checkpoint(tmp_path / "tiny.gguf", progress=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf", dtype=torch.float32)
    reference = model.state_dict()
    for name, weight in ours.state_dict.items():
        assert torch.equal(weight, reference[name]), name
    reference_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="tiny.gguf")
    for text in TEXTS:
        assert ours.tokenizer(text).input_ids == reference_tokenizer(text).input_ids, text


def test_gguf_k_quants_dequantize_like_gguf(tmp_path):
    """Q4_K/Q5_K/Q6_K (256-wide blocks), through the same path, incl. un-permuted q/k."""
    folder = make_tiny_model("llama", tmp_path / "hf", hidden_size=256, intermediate_size=512)
    types = {"token_embd": Q.Q6_K, "attn_q": Q.Q4_K, "attn_k": Q.Q5_K, "attn_v": Q.Q6_K,
             "attn_output": Q.Q4_K, "ffn_gate": Q.Q5_K, "ffn_up": Q.Q4_K, "ffn_down": Q.Q6_K}
    held = write_gguf(folder, tmp_path / "k.gguf", "llama", types)
    ckpt = load_checkpoint(tmp_path / "k.gguf", progress=False)
    for name, weight in ckpt.state_dict.items():
        gguf_name, stored = held[name]
        np.testing.assert_array_equal(as_stored("llama", name, weight, ckpt.hf_config), stored, err_msg=gguf_name)
    assert np.abs(held["model.layers.0.self_attn.q_proj.weight"][1]).max() > 0  # the blocks are not empty


def test_gguf_end_of_turn_ids_and_sampling_metadata(tmp_path):
    """llama.cpp's eot/eom ids also stop; general.sampling.* become generation defaults."""

    def extra(writer):
        writer.add_eot_token_id(1)
        writer.add_float32("general.sampling.temp", 0.6)
        writer.add_int32("general.sampling.top_k", 20)

    folder = make_tiny_model("qwen3", tmp_path / "hf")
    write_gguf(folder, tmp_path / "tiny.gguf", "qwen3", MIXED_TYPES, extra=extra)
    ckpt = load_checkpoint(tmp_path / "tiny.gguf", progress=False)
    assert ckpt.eos_token_ids == (0, 1, 2)
    assert ckpt.generation_defaults == {"temperature": pytest.approx(0.6), "top_k": 20}


def llamacpp_llama3_rope_factors(theta, dim, factor=8.0, low=1.0, high=4.0, old_context=8192):
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors (rope_freqs.weight)."""
    freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factors = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < old_context / high:
            factors.append(1)
        elif wavelen > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def test_gguf_rope_scaling_metadata(tmp_path):
    rope = {"rope_type": "default", "rope_theta": 500000.0}
    folder = make_tiny_model("llama", tmp_path / "hf", rope_parameters=rope)
    factors = llamacpp_llama3_rope_factors(500000.0, 16)
    assert 1.0 < factors.mean() < 8.0  # some frequencies are scaled, some not

    def llama3(writer):
        writer.add_tensor("rope_freqs.weight", factors)

    def yarn(writer):
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(4.0)
        writer.add_rope_scaling_orig_ctx_len(128)

    write_gguf(folder, tmp_path / "llama3.gguf", "llama", {}, extra=llama3)
    write_gguf(folder, tmp_path / "yarn.gguf", "llama", {}, extra=yarn)
    got = load_checkpoint(tmp_path / "llama3.gguf", progress=False)
    assert got.hf_config.rope_parameters == {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
    }
    assert "rope_freqs.weight" not in got.state_dict
    got = load_checkpoint(tmp_path / "yarn.gguf", progress=False)
    assert got.hf_config.rope_parameters == {
        "rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0, "original_max_position_embeddings": 128,
    }


def test_gguf_bfloat16_dtype(tmp_path):
    folder = make_tiny_model("qwen3", tmp_path / "hf")
    held = write_gguf(folder, tmp_path / "tiny.gguf", "qwen3", MIXED_TYPES)
    ckpt = load_checkpoint(tmp_path / "tiny.gguf", dtype=torch.bfloat16, progress=False)
    for name, weight in ckpt.state_dict.items():
        assert weight.dtype == torch.bfloat16
        assert torch.equal(weight, torch.from_numpy(held[name][1]).to(torch.bfloat16)), name


def write_spm_gguf(path, add_space_prefix: bool | None = None) -> None:
    """A SentencePiece-style vocabulary as llama.cpp writes Llama 2 / Mistral files (tokenizer.ggml.model
    "llama"): <unk> <s> </s>, 256 byte-fallback tokens, then a BPE vocabulary learned on tiny_models'
    corpus, scores instead of merges; `tokenizer.ggml.add_space_prefix` only when given."""
    from tokenizers import SentencePieceBPETokenizer

    from tiny_models import _CORPUS

    spm = SentencePieceBPETokenizer()
    spm.train_from_iterator(_CORPUS * 20, vocab_size=300, show_progress=False)
    learned = [t for t, _ in sorted(spm.get_vocab().items(), key=lambda kv: kv[1])]
    T = gguf.TokenType
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + learned)
    writer.add_token_types([T.UNKNOWN, T.CONTROL, T.CONTROL] + [T.BYTE] * 256 + [T.NORMAL] * len(learned))
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(learned))])  # merge order
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    if add_space_prefix is not None:
        writer.add_add_space_prefix(add_space_prefix)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("add_space_prefix", [None, True])
def test_sentencepiece_gguf_tokenizer_equals_transformers(add_space_prefix, tmp_path):
    """A SentencePiece-style vocabulary (tokenizer.ggml.model "llama", as Llama 2 /
    Mistral files have): scores instead of merges, byte-fallback tokens, BOS added
    by default. Compared with transformers' conversion of the same file."""
    from shoal.model.gguf_loader import GGUFFileReader, build_tokenizer, read_metadata

    write_spm_gguf(tmp_path / "spm.gguf", add_space_prefix)
    ours = build_tokenizer(read_metadata(GGUFFileReader(tmp_path / "spm.gguf")))
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="spm.gguf")
    for text in TEXTS + ["Hello</s> <s>world"]:
        ids = ours(text).input_ids
        assert ids == reference(text).input_ids, text
        assert ids[0] == 1  # <s>
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)
    for attr in ("bos_token_id", "eos_token_id", "unk_token_id", "pad_token_id"):
        assert getattr(ours, attr) == getattr(reference, attr), attr
    assert len(ours) == len(reference)
    # Characters outside the tiny vocabulary go through byte fallback and come back.
    assert ours.decode(ours("naïve 日本語 🙂").input_ids, skip_special_tokens=True) == "naïve 日本語 🙂"


def test_sentencepiece_gguf_without_space_prefix(tmp_path):
    """`tokenizer.ggml.add_space_prefix = false`: llama.cpp puts no "▁" before the text, so a text
    tokenizes as that text after one space does with the prefix on, and decodes back whole.
    transformers' GGUF converter ignores the flag (one reason shoal builds its own, issue 57)."""
    from shoal.model.gguf_loader import GGUFFileReader, build_tokenizer

    write_spm_gguf(tmp_path / "prefix.gguf", True)
    write_spm_gguf(tmp_path / "bare.gguf", False)
    prefixed = build_tokenizer(GGUFFileReader(tmp_path / "prefix.gguf").metadata)
    bare = build_tokenizer(GGUFFileReader(tmp_path / "bare.gguf").metadata)
    for text in TEXTS:
        assert bare.decode(bare(text).input_ids, skip_special_tokens=True) == text, text
        if text and not text.startswith(" "):  # the prefix is not doubled before a leading space (Metaspace)
            assert bare(" " + text).input_ids == prefixed(text).input_ids, text
    first = [t.convert_ids_to_tokens(t("Hello").input_ids)[1] for t in (bare, prefixed)]
    assert not first[0].startswith("▁") and first[1].startswith("▁"), first


def test_byte_level_gguf_added_tokens_equal_transformers(tmp_path):
    """USER_DEFINED tokens (`<think>`) matched whole, tokens stored with raw characters respelled in
    the byte alphabet (and so a USER_DEFINED one among them not matched whole), CONTROL tokens
    special: token for token what transformers' conversion of the same file gives."""
    from shoal.model.gguf_loader import GGUFFileReader, build_tokenizer
    from tiny_models import make_tokenizer

    source = make_tokenizer()
    by_id = {i: t for t, i in source.get_vocab().items()}
    merges = json.loads(source.backend_tokenizer.to_str())["model"]["merges"]
    T = gguf.TokenType
    tokens = [by_id[i] for i in range(len(by_id))] + ["<think>", "</think>", "raw spaces here", "raw\nnewline"]
    types = [T.CONTROL if i < 3 else T.NORMAL for i in range(len(by_id))]
    types += [T.USER_DEFINED, T.USER_DEFINED, T.NORMAL, T.USER_DEFINED]
    writer = gguf.GGUFWriter(str(tmp_path / "bpe.gguf"), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_eos_token_id(0)
    writer.add_bos_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    ours = build_tokenizer(GGUFFileReader(tmp_path / "bpe.gguf").metadata)
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="bpe.gguf")
    for text in TEXTS + ["<think>\nhmm</think> raw spaces here raw\nnewline"]:
        ids = ours(text).input_ids
        assert ids == reference(text).input_ids, text
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)
    assert ours("<think>").input_ids == [len(by_id)]
    assert ours.convert_ids_to_tokens(len(by_id) + 2) == "rawĠspacesĠhere"
    assert len(ours) == len(reference) == len(tokens)
    added = {i: (str(t), t.special) for i, t in ours.added_tokens_decoder.items()}
    assert added == {i: (str(t), t.special) for i, t in reference.added_tokens_decoder.items()}
    assert set(ours.all_special_ids) == {0, 1, 2}


@pytest.mark.parametrize("pre, pieces", [
    ("gpt-2", ["ab", "c", "Ġ", "12"]),  # GPT-2's split, then the merges
    ("smollm", ["ab", "c", "Ġ", "1", "2"]),  # digits one by one first (SmolLM2's tokenizer.json)
    ("llama-bpe", ["abc", "Ġ", "12"]),  # a pre-token in the vocabulary is one token (Llama 3's ignore_merges)
])
def test_byte_level_pre_types_follow_llamacpp(pre, pieces):
    """The pre-types' rules as llama.cpp applies them (llama-vocab.cpp), on a vocabulary whose merges
    give "ab" and "12" but never reach "abc". transformers' GGUF converter (5.24) has neither of the
    last two rules: it splits "smollm" files like GPT-2 and never ignores merges (issue 57)."""
    from tokenizers import pre_tokenizers

    from shoal.model.gguf_loader import build_tokenizer

    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": sorted(pre_tokenizers.ByteLevel.alphabet()) + ["ab", "12", "abc"],
        "tokenizer.ggml.merges": ["a b", "1 2"],
    }
    tokenizer = build_tokenizer(meta)
    ids = tokenizer("abc 12").input_ids
    assert tokenizer.convert_ids_to_tokens(ids) == pieces
    assert tokenizer.decode(ids) == "abc 12"


def test_unpermute_qk_inverts_llamacpp_permute():
    # 3 kv heads of dim 8 over 5 input features; and a bias of 4 heads of dim 6.
    w = torch.randn(24, 5)
    assert torch.equal(unpermute_qk(llamacpp_permute(w, 3), 3), w)
    assert not torch.equal(llamacpp_permute(w, 3), w)
    b = torch.randn(24)
    assert torch.equal(unpermute_qk(llamacpp_permute(b, 4), 4), b)


# ---------------------------------------------------------------- the default model

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello. 🙂"},
        {"role": "user", "content": "Count: 1 2 3"},
    ],
]


@pytest.mark.slow
def test_default_gguf_weights_equal_transformers(default_checkpoint, hf_default_model):
    ours, reference = default_checkpoint.state_dict, hf_default_model.state_dict()
    assert default_checkpoint.hf_config.tie_word_embeddings
    assert set(reference) - set(ours) == {"lm_head.weight"}  # tied: transformers lists it, we leave it out
    for name, weight in ours.items():
        assert weight.dtype == torch.float32
        assert torch.equal(weight, reference[name]), name
    ref_config, config = hf_default_model.config, default_checkpoint.hf_config
    for attr in (
        "model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "max_position_embeddings", "vocab_size", "rms_norm_eps",
        "rope_parameters", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id",
    ):
        assert getattr(config, attr) == getattr(ref_config, attr), attr
    assert config.architectures == ["LlamaForCausalLM"]


@pytest.mark.slow
def test_default_gguf_tokenizer_equals_transformers(default_checkpoint, hf_default_tokenizer):
    ours, reference = default_checkpoint.tokenizer, hf_default_tokenizer
    rendered = [reference.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in CHATS]
    for text in TEXTS + rendered:
        ids = ours(text).input_ids
        assert ids == reference(text).input_ids, text
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)
        assert ours.decode(ids) == text
    assert ours.chat_template == reference.chat_template
    for chat in CHATS:
        assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == (
            reference.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        )
    for attr in ("bos_token", "eos_token", "unk_token", "pad_token"):
        assert getattr(ours, attr) == getattr(reference, attr), attr
    assert len(ours) == len(reference) == 49152
    # The file's 17 CONTROL tokens, special in both; ours also lists them in all_special_ids,
    # which the detokenizer skips (transformers' lists only bos/eos/unk/pad there).
    added = {i: (str(t), t.special) for i, t in ours.added_tokens_decoder.items()}
    assert added == {i: (str(t), t.special) for i, t in reference.added_tokens_decoder.items()}
    assert sorted(ours.all_special_ids) == sorted(i for i, (_, special) in added.items() if special)
    assert len(ours.all_special_ids) == 17
    # Like transformers (the file's add_bos_token is false), nothing is prepended.
    assert ours("Hi").input_ids == reference("Hi").input_ids
    assert ours.bos_token_id not in ours("Hi").input_ids


@pytest.mark.slow
def test_default_gguf_eos_and_alias(default_checkpoint, default_gguf_path):
    tokenizer = default_checkpoint.tokenizer
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in default_checkpoint.eos_token_ids
    assert template_end_of_turn_id(tokenizer) == im_end
    assert list(default_checkpoint.eos_token_ids) == sorted(set(default_checkpoint.eos_token_ids))
    assert resolve_model_path("smollm2") == default_gguf_path
    assert default_checkpoint.path == default_gguf_path and default_checkpoint.format == "gguf"


# ---------------------------------------------------------------- HF folders


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_hf_folder_loads_saved_tensors_and_stop_tokens(arch, tmp_path, caplog):
    folder = make_tiny_model(arch, tmp_path)
    with caplog.at_level(logging.INFO, logger="shoal.loader"):
        ckpt = load_checkpoint(folder, progress=False)
    saved = load_file(folder / "model.safetensors")
    assert ckpt.format == "hf" and ckpt.path == folder.resolve()
    assert set(ckpt.state_dict) == set(saved)
    assert ("lm_head.weight" in saved) != ckpt.hf_config.tie_word_embeddings
    for name, tensor in saved.items():
        assert torch.equal(ckpt.state_dict[name], tensor), name
    assert ckpt.hf_config.architectures == [ARCHS[arch][1]]
    # generation_config [0, 2]; tokenizer eos 0; the template ends turns with <|im_end|> = 2.
    assert ckpt.eos_token_ids == (0, 2)
    assert ckpt.generation_defaults == {"temperature": 0.7}
    assert ckpt.tokenizer.chat_template
    assert any("loaded" in r.getMessage() and " s" in r.getMessage() for r in caplog.records)


def test_hf_folder_sharded_and_bfloat16(tmp_path):
    folder = make_tiny_model("qwen2", tmp_path / "one")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="50KB")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (sharded / name).write_bytes((folder / name).read_bytes())
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1

    whole = load_checkpoint(folder, progress=False).state_dict
    ckpt = load_checkpoint(sharded, dtype=torch.bfloat16, progress=False)
    assert set(ckpt.state_dict) == set(whole)
    for name, tensor in whole.items():
        assert torch.equal(ckpt.state_dict[name], tensor.to(torch.bfloat16)), name


def test_hf_folder_without_model_prefix(tmp_path):
    """Weights saved from a bare LlamaModel ("layers.0...", no "model.") load under HF's names."""
    folder = make_tiny_model("llama", tmp_path)
    saved = load_file(folder / "model.safetensors")
    save_file({k.removeprefix("model."): v for k, v in saved.items()}, folder / "model.safetensors")
    ckpt = load_checkpoint(folder, progress=False)
    assert set(ckpt.state_dict) == set(saved)


def test_qwen3_style_eos_and_end_of_turn_both_stop(tmp_path):
    """Tokenizer eos <|endoftext|>, turns end in <|im_end|>, no eos in generation_config."""
    folder = make_tiny_model("qwen3", tmp_path)
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.95, "top_k": 20}))
    ckpt = load_checkpoint(folder, progress=False)
    assert ckpt.tokenizer.eos_token == "<|endoftext|>"
    assert template_end_of_turn_id(ckpt.tokenizer) == ckpt.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert ckpt.eos_token_ids == (0, 2)
    assert ckpt.generation_defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}


def test_no_chat_template_no_generation_config(tmp_path):
    folder = make_tiny_model("llama", tmp_path)
    (folder / "generation_config.json").unlink()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    for extra in folder.glob("chat_template.*"):
        extra.unlink()
    ckpt = load_checkpoint(folder, progress=False)
    assert template_end_of_turn_id(ckpt.tokenizer) is None
    assert ckpt.eos_token_ids == (0,)  # the config's and the tokenizer's
    assert ckpt.generation_defaults == {}


# ---------------------------------------------------------------- errors


def test_missing_path_and_unknown_alias(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_checkpoint(tmp_path / "nope.gguf")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_path(str(tmp_path / "missing_folder"))
    with pytest.raises(ValueError, match="unknown model 'smollm3'.*smollm2"):
        resolve_model_path("smollm3")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf file"):
        resolve_model_path(str(tmp_path / "weights.bin"))
    with pytest.raises(ValueError, match="without config.json"):
        resolve_model_path(str(tmp_path))


def test_gguf_q4_codes_are_the_stored_blocks_and_feed_int4_projections(tmp_path):
    """quantization="int4": every Q4_0/Q4_1 projection comes back as its codes and group scales, never
    dequantized, and they dequantize exactly to what "none" loads (q/k un-permuted like them); a model built
    with the int4 format packs them as they are, and rounds a projection whose parts are not all 4-bit codes."""
    from shoal.model.quant import Int4Linear, Q4Codes, WeightFormat
    from shoal.model.registry import model_class

    folder = make_tiny_model("llama", tmp_path / "hf")
    types = {"token_embd": Q.Q8_0, "attn_q": Q.Q4_0, "attn_k": Q.Q4_1, "attn_v": Q.Q4_1, "attn_output": Q.Q4_1,
             "ffn_gate": Q.Q4_0, "ffn_up": Q.Q8_0, "ffn_down": Q.Q4_1}
    write_gguf(folder, tmp_path / "q4.gguf", "llama", types)
    ckpt = load_checkpoint(tmp_path / "q4.gguf", progress=False, quantization="int4")
    plain = load_checkpoint(tmp_path / "q4.gguf", progress=False)
    assert ckpt.weight_format == "int4" and plain.weight_format == "none"
    kinds = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj")
    layers = ckpt.hf_config.num_hidden_layers
    coded = {n for n, v in ckpt.state_dict.items() if isinstance(v, Q4Codes)}
    assert sorted(coded) == sorted(f"model.layers.{i}.{'mlp' if k in ('gate_proj', 'down_proj') else 'self_attn'}.{k}.weight"
                                   for i in range(layers) for k in kinds)
    for name in coded:
        codes = ckpt.state_dict[name]
        assert codes.codes.dtype == torch.uint8 and int(codes.codes.max()) <= 15
        assert torch.equal(codes.dequantized(), plain.state_dict[name]), name
    assert not any(isinstance(v, Q4Codes) for v in plain.state_dict.values())  # only when asked for
    up = "model.layers.0.mlp.up_proj.weight"
    assert ckpt.state_dict[up].dtype == torch.float32  # rounded by its layer later, from float32

    weights = WeightFormat("int4", torch.bfloat16)
    model = model_class(ckpt.hf_config.architectures)(ckpt.hf_config, 64, weights.linear)
    load_weights(model, ckpt.state_dict)
    model = model.to(torch.bfloat16)
    projections = [m for m in model.modules() if isinstance(m, Int4Linear)]
    # qkv, o and down from codes; gate_up is rounded (its up half is Q8_0)
    assert len(projections) == 4 * layers and sum(m.from_codes for m in projections) == 3 * layers
    o = model.model.layers[0].self_attn.o_proj.dequantized()
    want = plain.state_dict["model.layers.0.self_attn.o_proj.weight"]
    assert (o - want).abs().max() <= 0.01 * want.abs().max()
    # mixed Q4/Q8: each in its own type on shoal's kernels; torch's weight-only kernels take no mix
    assert load_checkpoint(tmp_path / "q4.gguf", progress=False, quantization="auto").weight_format == ("gguf" if kernels.available() else "none")


def test_auto_quantization_picks_the_files_own_format(tmp_path):
    """"auto": with shoal's native kernels, every quantized tensor in its own type ("gguf"), whatever the mix;
    without them (torch's weight-only kernels), int4 when every projection is Q4_0/Q4_1, int8 when every one
    is Q8_0; float otherwise, and always for F16 projections."""
    from shoal.model.gguf_loader import GGUFFileReader, projection_format

    folder = make_tiny_model("llama", tmp_path / "hf")
    kinds = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    cases = {"q4": (dict.fromkeys(kinds, Q.Q4_1), "gguf", "int4"), "q8": (dict.fromkeys(kinds, Q.Q8_0), "gguf", "int8"),
             "mixed": ({**dict.fromkeys(kinds, Q.Q4_0), "attn_v": Q.Q8_0, "ffn_down": Q.Q5_1}, "gguf", "none"),
             "f16": ({}, "none", "none")}
    for name, (types, native, torch_kernels) in cases.items():
        write_gguf(folder, tmp_path / f"{name}.gguf", "llama", {"token_embd": Q.Q8_0, **types})
        tensors = GGUFFileReader(tmp_path / f"{name}.gguf").tensors
        assert (projection_format(tensors, native=True), projection_format(tensors, native=False)) == (native, torch_kernels), name
        want = native if kernels.available() else torch_kernels
        assert load_checkpoint(tmp_path / f"{name}.gguf", progress=False, quantization="auto").weight_format == want, name
    assert load_checkpoint(folder, progress=False, quantization="auto").weight_format == "none"  # safetensors

@pytest.mark.parametrize("fixture", ["tiny-llama-Q4_K_M.gguf", "tiny-llama-Q5_K_M.gguf"])
def test_gguf_metadata_parse_equals_gguf_py(fixture):
    """GGUFFileReader reads arrays in bulk: every key's value, and the tensor index, as gguf-py's own reader gives them."""
    from pathlib import Path

    from shoal.model.gguf_loader import GGUFFileReader, read_metadata

    path = Path(__file__).parent / "fixtures" / fixture
    ours, theirs = GGUFFileReader(path), gguf.GGUFReader(path)
    assert read_metadata(ours) == {name: field.contents() for name, field in theirs.fields.items()}
    assert len(ours.fields["tokenizer.ggml.tokens"].contents()) >= 400  # arrays of strings and numbers
    assert [(t.name, t.tensor_type, t.data_offset, t.n_bytes) for t in ours.tensors] == [
        (t.name, t.tensor_type, t.data_offset, t.n_bytes) for t in theirs.tensors]


def test_gguf_cut_inside_its_metadata_is_refused(tmp_path):
    from pathlib import Path

    from shoal.model.gguf_loader import GGUFFileReader

    whole = (Path(__file__).parent / "fixtures" / "tiny-llama-Q4_K_M.gguf").read_bytes()
    tokens = whole.index(b"tokenizer.ggml.tokens")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[:tokens + 2000])  # inside the vocabulary's strings
    with pytest.raises(ValueError, match=r"cut.gguf: metadata 'tokenizer.ggml.tokens' counts [\d,]+ entries, more than the [\d,]+ bytes after it can hold"):
        GGUFFileReader(cut)
    scores = whole.index(b"tokenizer.ggml.token_type")
    cut.write_bytes(whole[:scores + 100])  # inside an array of numbers
    with pytest.raises(ValueError, match=r"cut.gguf: metadata 'tokenizer.ggml.token_type' counts [\d,]+ entries, more than"):
        GGUFFileReader(cut)
