"""Embeddings (issue 55, part 2): prompt-only pooled requests through the engine, and POST /v1/embeddings.

- shoal's vectors equal sentence-transformers' on the same tiny random folders (a Qwen3 with last-token pooling
  and a Normalize module, as Qwen3-Embedding ships; a llama with mean pooling and none), and transformers' own last
  hidden state for a generation model served with --embeddings;
- a batch gives each input its vector alone, and a prompt in chunks the vector of the whole (batch-invariant
  attention, the default dtype);
- a pooling request keeps no KV: its blocks go back to the pool and none is indexed in the prefix cache;
  last-token pooling starts from a cached prefix, mean pooling does not;
- the openai SDK (float, base64, dimensions) and LangChain's OpenAIEmbeddings against a live server, bad inputs
  answered in OpenAI's format with the server going on, embeddings beside a chat stream leaving its greedy
  tokens as they were, the protocol label in /metrics, and the guide's snippets as written.
"""

from __future__ import annotations

import base64
import json
import math
import os
import re
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from server_utils import LiveServer, tiny_engine, tiny_engine_config
from shoal.model.pooling_files import read_pooling
from shoal.types import GenerationRequest, PoolingParams, SamplingParams
from tiny_models import make_tiny_model

ROOT = Path(__file__).resolve().parents[1]
TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", "def add(x, y):\n    return x + y\n" * 6, "a"]


def add_st_modules(path: Path, mode: str, normalize: bool) -> Path:
    """sentence-transformers' files in a model folder: modules.json, the Pooling module's config, a Normalize module."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (path / "2_Normalize").mkdir(exist_ok=True)
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    flags = {f"pooling_mode_{m}": m == mode for m in ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "lasttoken")}
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **flags}))
    return path


@pytest.fixture(scope="module")
def qwen3_embedding(tmp_path_factory) -> Path:
    """Qwen3-Embedding's layout, tiny: a Qwen3 with last-token pooling and a Normalize module."""
    return add_st_modules(make_tiny_model("qwen3", tmp_path_factory.mktemp("qwen3-emb"), seed=3), "lasttoken", True)


@pytest.fixture(scope="module")
def llama_mean(tmp_path_factory) -> Path:
    """A llama with mean pooling and no Normalize module."""
    return add_st_modules(make_tiny_model("llama", tmp_path_factory.mktemp("llama-mean"), seed=4), "mean_tokens", False)


def embed(engine, token_lists, dimensions=None, prefix="e") -> list[list[float]]:
    """Every token list's vector, all added at once (one batch), through the engine's step loop."""
    p = engine.pooling
    return run_pooled(engine, token_lists, PoolingParams(p.mode, p.normalize, dimensions), prefix)


def run_pooled(engine, token_lists, pooling: PoolingParams, prefix: str) -> list[list[float]]:
    """Each token list's pooled output (`embedding`), all added at once (one batch), through the step loop."""
    for i, ids in enumerate(token_lists):
        engine.add_request(GenerationRequest(f"{prefix}{i}", tuple(ids), SamplingParams(), pooling=pooling))
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                assert o.error is None, o.error
                outs[o.request_id] = o
    return [outs[f"{prefix}{i}"].embedding for i in range(len(token_lists))]


def max_diff(a, b) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def assert_embeds_as_sentence_transformers(engine, folder: Path) -> None:
    """A GGUF's engine tokenizes as the folder it was written from does (punctuation and case included), and its
    vectors are within 1e-5 of sentence-transformers' on that folder."""
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(folder), device="cpu")
    texts = [*TEXTS, "Hello, World: the Fox!"]
    assert [engine.tokenizer.encode(t) for t in texts] == [st.tokenizer(t)["input_ids"] for t in texts]
    ref = st.encode(texts, convert_to_tensor=True, batch_size=1).double()
    for vec, want in zip(embed(engine, [engine.tokenizer.encode(t) for t in texts]), ref):
        assert max_diff(vec, want.tolist()) < 1e-5


# ---------------------------------------------------------------- the files


def test_pooling_is_read_from_sentence_transformers_files_and_gguf_metadata(qwen3_embedding, llama_mean, tiny_llama_path, tmp_path):
    assert read_pooling(qwen3_embedding, None, 64).mode == "last"
    assert read_pooling(qwen3_embedding, None, 64).normalize is True
    mean = read_pooling(llama_mean, None, 64)
    assert (mean.mode, mean.normalize) == ("mean", False)
    assert read_pooling(tiny_llama_path, None, 64) is None  # no modules.json: a generation model
    # newer sentence-transformers write one `pooling_mode` string
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "modules.json").write_text((qwen3_embedding / "modules.json").read_text())
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "mean"}))
    assert read_pooling(tmp_path, None, 64).mode == "mean"
    # a GGUF's {arch}.pooling_type: llama.cpp's enum, normalized as its server does
    meta = {"general.architecture": "qwen3"}
    assert read_pooling(Path("m.gguf"), meta, 64) is None
    assert read_pooling(Path("m.gguf"), {**meta, "qwen3.pooling_type": 0}, 64) is None
    last = read_pooling(Path("m.gguf"), {**meta, "qwen3.pooling_type": 3}, 64)
    assert (last.mode, last.normalize, last.hidden_size) == ("last", True, 64)
    assert read_pooling(Path("m.gguf"), {**meta, "qwen3.pooling_type": 1}, 64).mode == "mean"
    with pytest.raises(ValueError, match="cls pooling"):
        read_pooling(Path("m.gguf"), {**meta, "qwen3.pooling_type": 2}, 64)
    # a module shoal does not run is refused by name, not ignored
    modules = json.loads((qwen3_embedding / "modules.json").read_text())
    (tmp_path / "modules.json").write_text(json.dumps([*modules, {"idx": 3, "path": "3_Dense", "type": "sentence_transformers.models.Dense"}]))
    with pytest.raises(ValueError, match="Dense"):
        read_pooling(tmp_path, None, 64)


# ---------------------------------------------------------------- the vectors


@pytest.mark.parametrize("layout", ["qwen3_embedding", "llama_mean"])
def test_vectors_equal_sentence_transformers(layout, request):
    from sentence_transformers import SentenceTransformer

    path = request.getfixturevalue(layout)
    st = SentenceTransformer(str(path), device="cpu")
    ref = st.encode(TEXTS, convert_to_tensor=True, batch_size=1).double()  # one at a time: no padding in the reference
    engine = tiny_engine(path)
    ids = [st.tokenizer(t)["input_ids"] for t in TEXTS]
    assert ids == [engine.tokenizer.encode(t) for t in TEXTS]  # what /v1/embeddings tokenizes
    got = embed(engine, ids)
    for vec, want in zip(got, ref):
        assert len(vec) == 64
        assert max_diff(vec, want.tolist()) < 1e-5
    if layout == "qwen3_embedding":
        assert all(abs(math.fsum(x * x for x in v) - 1) < 1e-9 for v in got)  # the Normalize module


def test_a_generation_model_with_embeddings_pools_its_last_token_normalized(tiny_llama_path, tiny_llama_hf):
    engine = tiny_engine(tiny_llama_path, embeddings=True)
    assert (engine.pooling.mode, engine.pooling.normalize) == ("last", True)
    ids = [engine.tokenizer.encode(t) for t in TEXTS]
    got = embed(engine, ids)
    for vec, x in zip(got, ids):
        with torch.no_grad():
            h = tiny_llama_hf.model(torch.tensor([x])).last_hidden_state[0, -1].double()
        assert max_diff(vec, (h / h.norm()).tolist()) < 1e-5
    # without the flag the model does not embed, and says so
    plain = tiny_engine(tiny_llama_path)
    assert plain.pooling is None
    with pytest.raises(ValueError, match="does not serve embeddings"):
        plain.validate(GenerationRequest("x", (5, 6), SamplingParams(), pooling=PoolingParams()))


@pytest.mark.parametrize("kind", ["LAST", "MEAN"])
def test_a_gguf_pools_as_its_pooling_type_says(kind, qwen3_embedding, tmp_path):
    """A GGUF of the tiny Qwen3 with `qwen3.pooling_type` (as convert_hf_to_gguf writes Qwen3-Embedding's): its
    vectors are the folder's, pooled as the type says and normalized, as llama.cpp's server does."""
    import gguf
    from sentence_transformers import SentenceTransformer
    from test_loader import write_gguf

    write_gguf(qwen3_embedding, tmp_path / "emb.gguf", "qwen3", {}, extra=lambda w: w.add_pooling_type(getattr(gguf.PoolingType, kind)))
    engine = tiny_engine(tmp_path / "emb.gguf")
    assert (engine.pooling.mode, engine.pooling.normalize) == (kind.lower(), True)
    st = SentenceTransformer(str(qwen3_embedding), device="cpu")
    ids = [st.tokenizer(t)["input_ids"] for t in TEXTS]
    hidden = [st.forward({"input_ids": torch.tensor([x]), "attention_mask": torch.ones(1, len(x), dtype=torch.long)})
              ["token_embeddings"][0].double() for x in ids]
    for vec, h in zip(embed(engine, ids), hidden):
        want = h[-1] if kind == "LAST" else h.mean(0)
        assert max_diff(vec, (want / want.norm()).tolist()) < 1e-5


def test_the_embeddings_flag_reaches_the_engine_config():
    from shoal.cli import build_parser, engine_config, serve_values

    assert engine_config(serve_values(build_parser().parse_args(["serve", "--embeddings"]))).embeddings is True
    assert engine_config(serve_values(build_parser().parse_args(["serve"]))).embeddings is False


@pytest.mark.parametrize("layout", ["qwen3_embedding", "llama_mean"])
def test_a_batch_and_chunks_give_each_input_its_vector_alone(layout, request):
    """In the default dtype with the batch-invariant attention: each input alone, all together beside each other,
    and a long input in chunks of 8 tokens give the same vectors."""
    path = request.getfixturevalue(layout)
    kw = dict(dtype="auto", attention="invariant")
    engine = tiny_engine(path, **kw)
    ids = [engine.tokenizer.encode(t) for t in TEXTS]
    assert len(ids[2]) > 40  # several chunks of 8 below
    alone = [embed(engine, [x], prefix=f"alone{i}-")[0] for i, x in enumerate(ids)]
    together = embed(engine, ids, prefix="batch")
    for a, b in zip(alone, together):
        assert a == b
    chunked = tiny_engine(path, max_num_batched_tokens=8, **kw)
    in_chunks = embed(chunked, ids, prefix="chunk")
    for a, b in zip(alone, in_chunks):
        assert a == b
    assert chunked.snapshot.counters.steps >= len(ids[2]) // 8  # it did take chunks


def finished(engine, request: GenerationRequest):
    engine.add_request(request)
    last = None
    while engine.has_unfinished():
        last = next((o for o in engine.step() if o.finished), last)
    return last


def test_a_pooling_request_keeps_no_kv_in_the_pool_or_the_prefix_cache(qwen3_embedding):
    engine = tiny_engine(qwen3_embedding, check_integrity=True)
    total = engine.pool.num_free
    embed(engine, [engine.tokenizer.encode(t) for t in TEXTS])
    assert engine.pool.num_free == total
    assert engine.pool.num_used == 0 and engine.pool.num_cached_free == 0  # nothing indexed in the prefix cache
    assert engine.prefix_cache.full_nodes() == []
    assert not engine.scheduler.held_block_tables()


def test_last_token_pooling_starts_from_a_cached_prefix_and_mean_pooling_does_not(qwen3_embedding, llama_mean):
    for path, hits in ((qwen3_embedding, True), (llama_mean, False)):
        engine = tiny_engine(path, check_integrity=True)
        prompt = engine.tokenizer.encode(TEXTS[2])
        finished(engine, GenerationRequest("gen", tuple(prompt), SamplingParams(max_tokens=1, temperature=0)))
        longer = prompt + engine.tokenizer.encode(" and more")
        p = engine.pooling
        out = finished(engine, GenerationRequest("emb", tuple(longer), SamplingParams(), pooling=PoolingParams(p.mode, p.normalize)))
        if hits:  # a causal decoder's KV of a prefix is the same whoever computed it
            assert out.num_cached_tokens >= len(prompt) - engine.runner.block_size
        else:  # every row's hidden state is wanted
            assert out.num_cached_tokens == 0
        assert max_diff(out.embedding, embed(tiny_engine(path), [longer])[0]) < 1e-5


def test_a_preempted_pooling_request_starts_its_sum_again(llama_mean):
    """Preempted after some chunks (recompute from the start): the vector is the unpreempted one, not the earlier
    chunks counted twice."""
    engine = tiny_engine(llama_mean, max_num_batched_tokens=8, check_integrity=True)
    ids = engine.tokenizer.encode(TEXTS[2])
    want = embed(tiny_engine(llama_mean, max_num_batched_tokens=8), [ids])[0]
    engine.add_request(GenerationRequest("p", tuple(ids), SamplingParams(), pooling=PoolingParams("mean", False)))
    for _ in range(3):
        engine.step()
    seq = engine.scheduler.running[0]
    assert 0 < seq.num_computed_tokens < len(ids)
    engine.scheduler._preempt(seq)
    out = None
    while engine.has_unfinished():
        out = next((o for o in engine.step() if o.finished), out)
    assert seq.num_preemptions == 1
    assert max_diff(out.embedding, want) < 1e-9


def test_dimensions_cut_then_renormalize(qwen3_embedding):
    engine = tiny_engine(qwen3_embedding)
    ids = [engine.tokenizer.encode(TEXTS[1])]
    full = embed(engine, ids, prefix="full")[0]
    cut = embed(engine, ids, dimensions=16, prefix="cut")[0]
    norm = math.sqrt(math.fsum(x * x for x in full[:16]))
    assert len(cut) == 16
    assert max_diff(cut, [x / norm for x in full[:16]]) < 1e-12
    with pytest.raises(ValueError, match="dimensions"):
        engine.validate(GenerationRequest("x", (5,), SamplingParams(), pooling=PoolingParams(dimensions=65)))


# ---------------------------------------------------------------- the BERT family (an encoder)

BERT_WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"abcdefghijklmnopqrstuvwxyz0123456789.,:()+=_",
              "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "hello", "world", "def", "add", "return",
              *(f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz")]


def wordpiece_tokenizer():
    """make_tiny_bert's WordPiece tokenizer over BERT_WORDS."""
    import transformers

    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    vocab = {w: i for i, w in enumerate(BERT_WORDS)}
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                                           special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    backend.decoder = decoders.WordPiece()
    return transformers.BertTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
                                          pad_token="[PAD]", mask_token="[MASK]")


def make_tiny_bert(path: Path, seed: int = 0) -> Path:
    """A random-weight BertModel folder with a WordPiece tokenizer (all-MiniLM's and bge's layout, tiny)."""
    import transformers

    tokenizer = wordpiece_tokenizer()
    path.mkdir(parents=True, exist_ok=True)
    config = transformers.BertConfig(vocab_size=len(BERT_WORDS), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=128, max_position_embeddings=128)
    config.architectures = ["BertModel"]
    torch.manual_seed(seed)
    model = transformers.BertModel(config).eval()
    perturb_norms_and_biases(model)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def minilm(tmp_path_factory) -> Path:
    """all-MiniLM's layout: a BertModel, mean pooling, a Normalize module."""
    return add_st_modules(make_tiny_bert(tmp_path_factory.mktemp("minilm"), seed=5), "mean_tokens", True)


@pytest.fixture(scope="module")
def bge(tmp_path_factory) -> Path:
    """bge's layout: a BertModel, CLS pooling, a Normalize module."""
    return add_st_modules(make_tiny_bert(tmp_path_factory.mktemp("bge"), seed=6), "cls_token", True)


@pytest.mark.parametrize("layout", ["minilm", "bge"])
def test_an_encoder_s_vectors_equal_sentence_transformers_alone_and_in_a_batch(layout, request):
    """Within 1e-5 of sentence-transformers' vectors, and the same bits alone as in a batch."""
    from sentence_transformers import SentenceTransformer

    path = request.getfixturevalue(layout)
    st = SentenceTransformer(str(path), device="cpu")
    ref = st.encode(TEXTS, convert_to_tensor=True, batch_size=1).double()
    engine = tiny_engine(path, check_integrity=True)
    assert engine.pooling.mode == ("mean" if layout == "minilm" else "cls")
    assert engine.prefix_cache is None  # a prefix's hidden states depend on what follows it
    ids = [st.tokenizer(t)["input_ids"] for t in TEXTS]
    assert ids[1].count(BERT_WORDS.index("[UNK]")) == 0 and len(ids[2]) > 40  # real words and pieces, not [UNK]s
    assert ids == [engine.tokenizer.encode(t) for t in TEXTS]
    together = embed(engine, ids, prefix="batch")
    for i, (vec, want) in enumerate(zip(together, ref)):
        assert max_diff(vec, want.tolist()) < 1e-5
        assert embed(engine, [ids[i]], prefix=f"alone{i}-")[0] == vec  # alone, bitwise: each input runs unpadded
    assert engine.pool.num_free == engine.runner.num_blocks  # no KV: every block back


def perturb_norms_and_biases(model) -> None:
    """Random init leaves norms at 1 and biases at 0, which hides a layout mistake: move them off."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name.lower() or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)


def write_wordpiece_vocab(writer) -> None:
    """The tiny WordPiece vocabulary as llama.cpp's converter writes a BERT's: phantom-space form, [CLS] as BOS."""
    tokens = [t if t.startswith("[") and t.endswith("]") else t[2:] if t.startswith("##") else "\u2581" + t for t in BERT_WORDS]
    writer.add_tokenizer_model("bert")
    writer.add_token_list(tokens)
    writer.add_bos_token_id(BERT_WORDS.index("[CLS]"))
    writer.add_sep_token_id(BERT_WORDS.index("[SEP]"))
    writer.add_unk_token_id(BERT_WORDS.index("[UNK]"))
    writer.add_pad_token_id(BERT_WORDS.index("[PAD]"))


def encoder_gguf_writer(out: Path, arch: str, config, pooling):
    """A GGUFWriter for an encoder, with the metadata llama.cpp's converter writes for every BERT-like one."""
    import gguf

    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_layer_norm_eps(config.layer_norm_eps)
    writer.add_causal_attention(False)
    writer.add_pooling_type(pooling)
    return writer


def write_bert_gguf(folder: Path, out: Path, pooling) -> Path:
    """The tiny BERT folder as llama.cpp's convert_hf_to_gguf writes a `bert` GGUF: its metadata, the vocabulary in
    phantom-space form ([CLS] as BOS), every tensor in float32 by gguf's name table."""
    import gguf
    import transformers
    from safetensors.torch import load_file

    config = transformers.AutoConfig.from_pretrained(folder)
    writer = encoder_gguf_writer(out, "bert", config, pooling)
    write_wordpiece_vocab(writer)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BERT, config.num_hidden_layers)
    for hf_name, tensor in load_file(folder / "model.safetensors").items():
        base, suffix = hf_name.rsplit(".", 1)
        if base.startswith("pooler"):
            continue  # sentence-transformers never reads BERT's pooler, and llama.cpp drops it
        writer.add_tensor(f"{names.get_name(base)}.{suffix}", tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.mark.parametrize("layout", ["minilm", "bge"])
def test_a_bert_gguf_embeds_as_its_folder_does(layout, request, tmp_path):
    import gguf

    folder = request.getfixturevalue(layout)
    kind = gguf.PoolingType.MEAN if layout == "minilm" else gguf.PoolingType.CLS
    engine = tiny_engine(write_bert_gguf(folder, tmp_path / "bert.gguf", kind))
    assert (engine.pooling.mode, engine.pooling.normalize) == (("mean" if layout == "minilm" else "cls"), True)
    assert_embeds_as_sentence_transformers(engine, folder)


def make_tiny_nomic(path: Path, seed: int = 0) -> Path:
    """A random-weight NomicBertModel folder (nomic-embed-text's layout, tiny: rotary positions, a SwiGLU MLP)."""
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    config = transformers.NomicBertConfig(vocab_size=len(BERT_WORDS), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                          intermediate_size=96, max_position_embeddings=128, layer_norm_eps=1e-12,
                                          rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
    config.architectures = ["NomicBertModel"]
    torch.manual_seed(seed)
    model = transformers.NomicBertModel(config).eval()
    perturb_norms_and_biases(model)
    model.save_pretrained(path, safe_serialization=True)
    wordpiece_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def nomic(tmp_path_factory) -> Path:
    """nomic-embed-text's layout: a NomicBertModel, mean pooling, a Normalize module."""
    return add_st_modules(make_tiny_nomic(tmp_path_factory.mktemp("nomic"), seed=7), "mean_tokens", True)


def test_a_nomic_bert_folder_s_vectors_equal_sentence_transformers_alone_and_in_a_batch(nomic):
    """transformers' NomicBertModel (rotary positions, SwiGLU) through the encoder path: within 1e-5 of
    sentence-transformers' vectors, and the same bits alone as in a batch."""
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(nomic), device="cpu")
    assert type(st[0].auto_model).__name__ == "NomicBertModel"
    ref = st.encode(TEXTS, convert_to_tensor=True, batch_size=1).double()
    engine = tiny_engine(nomic, check_integrity=True)
    assert (engine.pooling.mode, engine.pooling.normalize) == ("mean", True)
    assert type(engine.runner.model).__name__ == "NomicBertModel"
    assert engine.prefix_cache is None
    ids = [st.tokenizer(t)["input_ids"] for t in TEXTS]
    assert ids == [engine.tokenizer.encode(t) for t in TEXTS] and len(ids[2]) > 40
    together = embed(engine, ids, prefix="batch")
    for i, (vec, want) in enumerate(zip(together, ref)):
        assert len(vec) == 64
        assert max_diff(vec, want.tolist()) < 1e-5
        assert embed(engine, [ids[i]], prefix=f"alone{i}-")[0] == vec  # alone, bitwise: each input runs unpadded
    assert engine.pool.num_free == engine.runner.num_blocks


def write_nomic_gguf(folder: Path, out: Path, pooling) -> Path:
    """The tiny nomic folder as llama.cpp's convert_hf_to_gguf writes a `nomic-bert` GGUF from nomic's own checkpoint:
    its metadata (rope.freq_base the rotary base), the vocabulary as `write_bert_gguf` writes it, every tensor in
    float32 by gguf's NOMIC_BERT name table (nomic's fused Wqkv as one `attn_qkv`)."""
    import gguf
    import transformers
    from safetensors.torch import load_file

    config = transformers.AutoConfig.from_pretrained(folder)
    writer = encoder_gguf_writer(out, "nomic-bert", config, pooling)
    writer.add_head_count_kv(config.num_attention_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_token_type_count(config.type_vocab_size)
    write_wordpiece_vocab(writer)
    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.NOMIC_BERT, config.num_hidden_layers)
    # transformers saves a NomicBertModel under nomic's own names (emb_ln, encoder.layers.N.attn.Wqkv, mlp.fc11, ...,
    # its conversion_mapping run backwards): what convert_hf_to_gguf reads from nomic-embed-text's folder
    out_tensors = {f"{table.get_name(name.rsplit('.', 1)[0])}.{name.rsplit('.', 1)[1]}": tensor
                   for name, tensor in load_file(folder / "model.safetensors").items()}
    assert out_tensors["blk.0.attn_qkv.weight"].shape == (3 * config.hidden_size, config.hidden_size)  # fused q, k, v
    assert {"token_embd.weight", "token_types.weight", "token_embd_norm.bias", "blk.1.ffn_gate.weight",
            "blk.1.layer_output_norm.weight", "blk.1.attn_output_norm.bias"} <= set(out_tensors)
    for name, tensor in out_tensors.items():
        writer.add_tensor(name, tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_a_nomic_bert_gguf_embeds_as_its_folder_does(nomic, tmp_path):
    import gguf

    engine = tiny_engine(write_nomic_gguf(nomic, tmp_path / "nomic.gguf", gguf.PoolingType.MEAN))
    assert (engine.pooling.mode, engine.pooling.normalize) == ("mean", True)
    model = engine.runner.model
    assert type(model).__name__ == "NomicBertModel" and model.config.rope_parameters["rope_theta"] == 1000.0
    assert_embeds_as_sentence_transformers(engine, nomic)


def test_an_encoder_serves_sentence_transformers_max_seq_length(minilm, tmp_path):
    """sentence_bert_config.json's max_seq_length is the encoder's context: an input sentence-transformers would cut
    is refused in words, never embedded whole into a vector it would not give."""
    import shutil

    from sentence_transformers import SentenceTransformer

    folder = tmp_path / "short"
    shutil.copytree(minilm, folder)
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 16, "do_lower_case": False}))
    assert SentenceTransformer(str(folder), device="cpu").max_seq_length == 16  # the library reads it so too
    engine = tiny_engine(folder)
    assert engine.max_model_len == 16 and tiny_engine(minilm).max_model_len > 16
    p = engine.pooling
    with pytest.raises(ValueError, match="the input has 20 tokens but the context is 16 tokens"):
        engine.validate(GenerationRequest("long", tuple(range(5, 25)), SamplingParams(), pooling=PoolingParams(p.mode, p.normalize)))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": "long"}))
    with pytest.raises(ValueError, match="max_seq_length must be a positive integer, not 'long'"):
        tiny_engine(folder)


def test_an_encoder_computes_each_input_whole_and_refuses_text_generation(minilm):
    engine = tiny_engine(minilm, max_num_batched_tokens=16)
    ids = [engine.tokenizer.encode(t) for t in TEXTS]
    assert len(ids[2]) > 16 and len(ids[1]) < 16
    with pytest.raises(ValueError, match="whole"):
        engine.validate(GenerationRequest("long", tuple(ids[2]), SamplingParams(), pooling=PoolingParams("mean")))
    steps = []
    real = engine.runner.execute
    engine.runner.execute = lambda plan: steps.append([len(s.token_ids) for s in plan.seqs]) or real(plan)
    embed(engine, [ids[1], ids[0], ids[1]])
    assert sorted(n for step in steps for n in step) == sorted([len(ids[1]), len(ids[0]), len(ids[1])])  # never a chunk
    with pytest.raises(ValueError, match="encoder"):
        engine.validate(GenerationRequest("gen", tuple(ids[0]), SamplingParams(max_tokens=2)))


def test_an_encoder_behind_the_http_route(minilm):
    from sentence_transformers import SentenceTransformer

    ref = SentenceTransformer(str(minilm), device="cpu").encode(TEXTS[:2])
    with LiveServer(tiny_engine_config(minilm)) as srv:
        client = srv.openai()
        name = model_name(srv)
        got = client.embeddings.create(model=name, input=TEXTS[:2], encoding_format="float")
        for d, want in zip(got.data, ref):
            assert max_diff(d.embedding, want.tolist()) < 1e-5
        r = srv.http().post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
        assert r.status_code == 400 and "encoder" in r.json()["error"]["message"]
        assert client.embeddings.create(model=name, input="hello").data  # the server goes on


# ---------------------------------------------------------------- the HTTP route


@pytest.fixture(scope="module")
def server(qwen3_embedding):
    with LiveServer(tiny_engine_config(qwen3_embedding, attention="invariant")) as srv:
        yield srv


def model_name(srv) -> str:
    return srv.openai().models.list().data[0].id


def test_the_openai_sdk_gets_float_base64_and_cut_vectors(server, qwen3_embedding):
    client = server.openai()
    name = model_name(server)
    engine = tiny_engine(qwen3_embedding, attention="invariant")
    want = embed(engine, [engine.tokenizer.encode(t) for t in TEXTS])
    floats = client.embeddings.create(model=name, input=TEXTS, encoding_format="float")
    assert [d.index for d in floats.data] == list(range(len(TEXTS)))
    for d, w in zip(floats.data, want):
        assert max_diff(d.embedding, w) < 1e-6
    n_tokens = sum(len(engine.tokenizer.encode(t)) for t in TEXTS)
    assert (floats.usage.prompt_tokens, floats.usage.total_tokens) == (n_tokens, n_tokens)
    # the SDK's default is base64, decoded by the SDK; the raw body is little-endian float32
    b64 = client.embeddings.create(model=name, input=TEXTS[0])
    assert max_diff(b64.data[0].embedding, floats.data[0].embedding) < 1e-6
    raw = server.http().post("/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"}).json()
    data = base64.b64decode(raw["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(data) // 4}f", data)) == pytest.approx(floats.data[0].embedding, abs=1e-6)
    cut = client.embeddings.create(model=name, input=TEXTS[1], dimensions=8, encoding_format="float").data[0].embedding
    full = floats.data[1].embedding
    norm = math.sqrt(sum(x * x for x in full[:8]))
    assert len(cut) == 8
    assert max_diff(cut, [x / norm for x in full[:8]]) < 1e-6
    # token ids, and a list of token-id lists
    ids = engine.tokenizer.encode(TEXTS[1])
    by_ids = client.embeddings.create(model=name, input=ids, encoding_format="float").data[0].embedding
    assert max_diff(by_ids, full) < 1e-6
    lists = client.embeddings.create(model=name, input=[ids, ids[:3]], encoding_format="float")
    assert len(lists.data) == 2 and lists.usage.prompt_tokens == len(ids) + 3


def test_langchain_openai_embeddings(server):
    from langchain_openai import OpenAIEmbeddings

    name = model_name(server)
    lc = OpenAIEmbeddings(model=name, base_url=server.url + "/v1", api_key="unused", check_embedding_ctx_length=False, max_retries=0)
    docs = lc.embed_documents(TEXTS[:3])
    query = lc.embed_query(TEXTS[1])
    ref = server.openai().embeddings.create(model=name, input=TEXTS[:3], encoding_format="float").data
    assert len(docs) == 3 and len(docs[0]) == 64
    for d, r in zip(docs, ref):
        assert max_diff(d, r.embedding) < 1e-6
    assert max_diff(query, ref[1].embedding) < 1e-6


BAD = [
    ({"input": 3}, "input"),
    ({"input": {"text": "x"}}, "input"),
    ({"input": [1, "a"]}, "input"),
    ({"input": [True, 2]}, "input"),
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": ["ok", ""]}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": [10**6]}, "input"),
    ({"input": [[1, 2], [-1]]}, "input"),
    ({"input": ["x"] * 2049}, "input"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "dimensions": 65}, "dimensions"),
    ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": "x", "dimensions": "8"}, "dimensions"),
    ({}, "input"),
]


def test_bad_input_is_a_400_in_openai_format_and_the_server_goes_on(server):
    http = server.http()
    for body, param in BAD:
        r = http.post("/v1/embeddings", json=body)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"], (body, err)
    ok = http.post("/v1/embeddings", json={"input": "still here", "encoding_format": "float"})
    assert ok.status_code == 200 and len(ok.json()["data"][0]["embedding"]) == 64
    assert not server.engine.scheduler.held_block_tables()


def test_a_model_that_cannot_embed_is_a_400_naming_the_model(tiny_llama_path):
    with LiveServer(tiny_engine_config(tiny_llama_path)) as srv:
        r = srv.http().post("/v1/embeddings", json={"input": "hello"})
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["param"] == "model" and "--embeddings" in err["message"]
        chat = srv.openai().completions.create(model=model_name(srv), prompt="hello", max_tokens=2)
        assert chat.choices[0].finish_reason in ("stop", "length")  # the server goes on
    with LiveServer(tiny_engine_config(tiny_llama_path, embeddings=True)) as srv:
        r = srv.http().post("/v1/embeddings", json={"input": "hello", "encoding_format": "float"})
        assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 64


def test_embeddings_beside_a_chat_stream_leave_its_greedy_tokens_as_they_were(server):
    client = server.openai()
    name = model_name(server)
    ask = dict(model=name, messages=[{"role": "user", "content": "tell me about foxes"}], max_tokens=40, temperature=0)
    alone = client.chat.completions.create(**ask).choices[0].message.content
    runner = server.engine.runner
    real, mixed = runner.execute, []

    def execute(plan):  # steps that sampled the chat and pooled embeddings together
        if any(s.pool for s in plan.seqs) and any(s.sample for s in plan.seqs):
            mixed.append(len(plan.seqs))
        return real(plan)

    streaming, results = threading.Event(), []

    def embed_while_streaming():
        streaming.wait(30)
        while streaming.is_set():
            results.append(client.embeddings.create(model=name, input=TEXTS, encoding_format="float"))

    worker = threading.Thread(target=embed_while_streaming)
    runner.execute = execute
    try:
        worker.start()
        pieces = []
        for chunk in client.chat.completions.create(**ask, stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
                streaming.set()
                if len(pieces) == 2:  # the embeddings are under way before the chat goes on
                    LiveServer.wait_until(lambda: mixed, what="a step with both")
        streaming.clear()
        worker.join(60)
    finally:
        runner.execute = real
    assert mixed
    assert "".join(pieces) == alone
    assert results and all(len(r.data) == len(TEXTS) for r in results)


def test_metrics_carry_the_openai_embeddings_protocol(server):
    server.openai().embeddings.create(model=model_name(server), input="count me")
    text = server.http().get("/metrics").text
    assert re.search(r'shoal:e2e_request_latency_seconds_count\{[^}]*protocol="openai_embeddings"[^}]*\} [1-9]', text)


# ---------------------------------------------------------------- the guide


def guide_blocks() -> list[tuple[str, str]]:
    text = (ROOT / "docs" / "guides" / "embeddings.md").read_text()
    return re.findall(r"^```(\w+)\n(.*?)^```", text, flags=re.S | re.M)


def test_the_guide_snippets_run_against_a_live_server(server):
    """Every python and curl snippet of docs/guides/embeddings.md, as written but for the address and model name."""
    blocks = [(lang, code) for lang, code in guide_blocks() if lang == "python" or (lang == "sh" and "curl" in code)]
    blocks = [(lang, code) for lang, code in blocks if "/rerank" not in code]  # a cross-encoder's: tests/test_rerank.py
    assert [lang for lang, _ in blocks].count("python") >= 2 and any(lang == "sh" for lang, _ in blocks)
    name = model_name(server)
    for lang, code in blocks:
        code = code.replace("http://127.0.0.1:8000", server.url).replace("Qwen3-Embedding-0.6B", name)
        cmd = ["bash", "-euo", "pipefail", "-c", code] if lang == "sh" else [sys.executable, "-c", code]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "NO_PROXY": "*"})
        assert run.returncode == 0, (code, run.stderr[-2000:])
        assert run.stdout.strip(), code
