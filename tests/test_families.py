"""The families on per-layer specs against transformers on the same weights: Phi-3 (LongRoPE, a window),
Phi-4-mini's shape (partial rotary), Gemma 2 (local/global layers, softcaps), Gemma 3 (5 local : 1 global,
per-kind rope, q/k norms).

Tiny random-weight models (tests/tiny_models.py FAMILY_ARCHS, windows of 8 keys) go through shoal's loader,
layers and paged attention (both backends), and must give transformers' logits within 1e-4 in float32: prompts
longer than the window, chunked across its edge; several sequences in one step; after a prefix-cache hit.
And the same model written as llama.cpp's converter writes it (GGUF) gives the folder's greedy tokens.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file

from shoal import LLM, SamplingParams, kernels
from shoal.engine.block_pool import KVBlockPool
from shoal.engine.kv_manager import NO_MATCH, KVCacheManager
from shoal.engine.sequence import Sequence
from shoal.runner.model_runner import KVCacheSpec, ModelRunner
from shoal.types import ScheduledSeq, kv_groups
from test_loader import write_vocab
from test_models import build_runner as models_runner
from test_models import hf_logits, step_logits
from tiny_models import FAMILY_ARCHS, make_tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=1)
# LongRoPE's short factors hold for a context up to the original 32 positions (layers.rope_inv_freq): the tests
# that compare with transformers' short factors serve 32 positions.
SHORT = 32


@pytest.fixture(scope="module", params=sorted(FAMILY_ARCHS))
def family(request, tmp_path_factory):
    path = make_tiny_model(request.param, tmp_path_factory.mktemp(request.param))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    return request.param, path, hf


def build_runner(path, attention: str, max_positions: int = SHORT) -> ModelRunner:
    return models_runner(path, attention=attention, max_positions=max_positions)


def seq(rid, ids, start, table, decode=False):
    return ScheduledSeq(rid, tuple(ids), start, tuple(table), decode, GREEDY)


A_IDS = [(13 * i) % 380 + 5 for i in range(21)]  # longer than the window (8), within LongRoPE's short range
B_IDS = [(29 * i) % 370 + 11 for i in range(11)]


@pytest.mark.parametrize("attention", ["sdpa", "invariant"])
def test_chunks_across_the_window_and_a_batch_match_transformers(family, attention):
    name, path, hf = family
    runner = build_runner(path, attention)
    spec = runner.model.spec
    windows = {layer.attention.window for layer in spec.layers}
    if name.startswith("gemma"):
        assert windows == {8, None}  # local and global layers both run
    ref_a, ref_b = hf_logits(hf, A_IDS), hf_logits(hf, B_IDS)
    A, B = range(0, 6), range(10, 13)  # block tables (block_size 4)
    a, b = A_IDS, B_IDS
    first = step_logits(runner, [seq(1, a[0:6], 0, A)])
    second = step_logits(runner, [seq(1, a[6:13], 6, A), seq(2, b[0:10], 0, B)])  # a's chunk crosses the window's edge
    third = step_logits(runner, [seq(1, a[13:20], 13, A)])
    decode = step_logits(runner, [seq(1, a[20:], 20, A, True), seq(2, b[10:], 10, B, True)])  # two contexts, one step
    got_a = torch.cat([first, second[:7], third, decode[:1]])
    torch.testing.assert_close(got_a, ref_a, atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.cat([second[7:], decode[1:]]), ref_b, atol=1e-4, rtol=0)


@pytest.mark.parametrize("attention", ["sdpa", "invariant"])
def test_after_a_prefix_cache_hit_matches_transformers(family, attention):
    """A second sequence reuses the first's first three blocks (12 positions, past the window) as the prefix
    cache hands them out, and computes only its own tokens from position 12."""
    name, path, hf = family
    runner = build_runner(path, attention)
    A = tuple(range(0, 5))
    step_logits(runner, [seq(1, A_IDS[:17], 0, A)])
    other = A_IDS[:12] + [7, 300, 42, 42, 9, 100, 250]
    got = step_logits(runner, [seq(2, other[12:], 12, A[:3] + (20, 21))])
    torch.testing.assert_close(got, hf_logits(hf, other)[12:], atol=1e-4, rtol=0)


@pytest.mark.parametrize("attention", ["sdpa", "invariant"])
def test_kv_groups_keep_only_the_window_and_match_transformers(family, attention):
    """The KV manager's tables, one per group (types.KVGroup): a windowed group's blocks out of the window are
    freed and its table holds its null block there, and the logits are still transformers', chunked across the
    window's edge, with two sequences in a step, and decoding."""
    name, path, hf = family
    model = build_runner(path, attention).model
    groups = kv_groups([layer.attention.window for layer in model.spec.layers])
    blocks = tuple(64 if g.window is None else 7 for g in groups)  # a windowed pool of 7: a reuses what slid out
    runner = ModelRunner(model, KVCacheSpec(blocks[0], 4, 0, torch.float32, groups, blocks), (), torch.device("cpu"),
                         torch.float32, attention)
    pools = [KVBlockPool(n, 4) for n in blocks]
    kv = KVCacheManager(pools, windows=[g.window for g in groups])
    a = Sequence("a", A_IDS, GREEDY)
    b = Sequence("b", B_IDS, GREEDY)

    def step(*work):
        plan = []
        for s, n in work:
            kv.grow(s, n) if s.block_table else kv.admit(s, NO_MATCH, n)
            c = s.num_computed_tokens
            plan.append(ScheduledSeq(s.seq_id, tuple(s.token_ids[c : c + n]), c, tuple(s.block_table), n == 1, GREEDY,
                                     group_tables=tuple(tuple(t) for t in s.block_tables[1:])))
        logits = step_logits(runner, plan)
        for s, n in work:
            s.num_computed_tokens += n
            kv.commit(s)
        return logits

    got_a = [step((a, 6))]
    second = step((a, 7), (b, 10))  # a's chunk crosses the window's edge
    got_a += [second[:7], step((a, 7))]
    decode = step((a, 1), (b, 1))  # a at 20 reads 13..20 of the window's layers
    got_a.append(decode[:1])
    torch.testing.assert_close(torch.cat(got_a), hf_logits(hf, A_IDS), atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.cat([second[7:], decode[1:]]), hf_logits(hf, B_IDS), atol=1e-4, rtol=0)
    for g, group in enumerate(groups):  # a computed 21: its next query, at 21, sees 14..21 of a window of 8
        held = [blk for blk in a.block_tables[g] if blk != pools[g].null_block]
        assert len(held) == (6 if group.window is None else 3), (name, group)
    kv.check_integrity(*([a.block_tables[g], b.block_tables[g]] for g in range(len(groups))))


def test_greedy_generation_with_the_prefix_cache_matches_transformers(family):
    """The engine's own path: chunked prefill (8 tokens a step), several sequences, a prompt whose prefix is cached."""
    name, path, hf = family
    llm = LLM(str(path), dtype="float32", num_blocks=64, block_size=4, max_model_len=SHORT, max_num_batched_tokens=8, check_integrity=True)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [A_IDS[:18], B_IDS, [300, 301, 2, 7, 7, 7, 9, 14, 90, 91]]
    outs = llm.generate(prompts, params)
    again = llm.generate([A_IDS[:18] + [44, 45]], params)[0]
    assert again.num_cached_tokens >= 16  # the first prompt's blocks
    for ids, out in zip([*prompts, A_IDS[:18] + [44, 45]], [*outs, again]):
        # ignore_eos bans the stop tokens (the tiny models' generation_config: 0 and 2), as suppress_tokens does
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0,
                          suppress_tokens=[0, 2])[0, len(ids):].tolist()
        assert out.outputs[0].token_ids == ref, name


def test_the_specs_say_what_each_family_is(family):
    name, path, hf = family
    spec = build_runner(path, "sdpa").model.spec
    layers = spec.layers
    if name == "phi3":
        assert {layer.attention.window for layer in layers} == {8} and layers[0].attention.rope.rope_type == "longrope"
    if name == "phi4mini":
        assert layers[0].attention.rope.rotary_dim == 12 and spec.fusable  # 3/4 of a 16-wide head
    if name == "gemma2":
        assert [layer.attention.window for layer in layers] == [8, None, 8, None]
        assert {layer.attention.softcap for layer in layers} == {0.1} and spec.logit_softcap == 0.5
        assert not spec.fusable and layers[0].mlp.activation == "gelu_tanh" and spec.embed_scale == 8.0
    if name == "gemma3":
        assert [layer.attention.window for layer in layers] == [8] * 5 + [None]
        assert layers[0].attention.rope.theta == 10000.0 and layers[5].attention.rope.theta == 1e6
        assert layers[5].attention.rope.rope_type == "linear" and layers[0].attention.qk_norm


def test_longrope_serves_the_long_factors_past_the_original_context(tmp_path):
    """Served past the original 32 positions, every sequence gets the long factors, as transformers gives a
    sequence longer than 32: a 40-token prompt matches it; a short prompt then differs from transformers',
    which takes the short factors for it (the documented choice)."""
    path = make_tiny_model("phi3", tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    runner = build_runner(path, "sdpa", max_positions=128)
    ids = [(17 * i) % 390 + 3 for i in range(40)]
    got = step_logits(runner, [seq(1, ids, 0, range(10))])
    torch.testing.assert_close(got, hf_logits(hf, ids), atol=1e-4, rtol=0)
    short = step_logits(runner, [seq(2, ids[:20], 0, range(20, 25))])
    assert (short - hf_logits(hf, ids[:20])).abs().max() > 1e-3


def test_gemma2_softcaps_are_applied(tmp_path):
    """The invariant attention softcaps in its native op where it is built (tile_softcap). Without the attention
    softcap the logits differ (so the parity tests saw it applied), and the final one bounds them."""
    path = make_tiny_model("gemma2", tmp_path)
    runner = build_runner(path, "invariant")
    assert runner.attention.native is kernels.available()
    plain = build_runner(make_tiny_model("gemma2", tmp_path / "plain", attn_logit_softcapping=None), "invariant")
    ids = A_IDS[:12]
    capped = step_logits(runner, [seq(1, ids, 0, range(3))])
    assert (capped - step_logits(plain, [seq(1, ids, 0, range(3))])).abs().max() > 1e-3
    assert capped.abs().max() < 0.5


# ---------------------------------------------------------------- GGUF, as llama.cpp's converter writes these families

GGUF_ARCH = {"phi3": "phi3", "phi4mini": "phi3", "gemma2": "gemma2", "gemma3": "gemma3", "qwen3moe": "qwen3moe", "mixtral": "llama",
             "olmoe": "olmoe"}
# Mixtral's expert projections as HF names them, and what the converters stack them under
MIXTRAL_EXPERTS = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


def stacked_experts(tensors: dict) -> dict:
    """The converters' (Qwen2MoeModel, OlmoeModel, LlamaModel for Mixtral) merge of each layer's experts: every
    expert's projection stacked into one [experts, rows, cols] tensor under `mlp.experts.<proj>`."""
    out, experts = {}, {}
    for name, t in tensors.items():
        name = name.replace(".block_sparse_moe.", ".mlp.")
        if ".mlp.experts." not in name:
            out[name] = t
            continue
        head, _, rest = name.partition(".mlp.experts.")
        e, proj, suffix = rest.split(".")
        experts.setdefault(f"{head}.mlp.experts.{MIXTRAL_EXPERTS.get(proj, proj)}.{suffix}", {})[int(e)] = t
    for name, parts in experts.items():
        out[name] = torch.stack([parts[e] for e in sorted(parts)])
    return out


def permute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf's LlamaModel.permute of q/k rows (arch llama)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_family_gguf(folder, out, family: str, quantize: gguf.GGMLQuantizationType | None = None) -> None:
    """The tiny HF model in `folder` as convert_hf_to_gguf.py writes it (Phi3MiniModel, Gemma2Model, Gemma3Model),
    every tensor F32: the metadata each writes, its tensor names, Gemma's norms plus 1, Phi-3's rope factor tensors.
    quantize: a type gguf-py quantizes to (Q8_0), for the matrices whose rows are whole blocks of it."""
    config = transformers.AutoConfig.from_pretrained(folder)
    arch = GGUF_ARCH[family]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    w = gguf.GGUFWriter(str(out), arch)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_block_count(config.num_hidden_layers)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = config.rope_parameters
    extra: dict[str, np.ndarray] = {}
    if arch == "phi3":
        n_embd, n_head = config.hidden_size, config.num_attention_heads
        w.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * n_embd) // n_head)
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_rope_scaling_orig_ctx_len(rope.get("original_max_position_embeddings", config.original_max_position_embeddings))
        w.add_sliding_window(config.sliding_window or 0)
        if rope.get("rope_type") == "longrope":
            extra = {"rope_factors_long.weight": np.array(rope["long_factor"], dtype=np.float32),
                     "rope_factors_short.weight": np.array(rope["short_factor"], dtype=np.float32)}
    elif arch in ("qwen3moe", "llama", "olmoe"):  # TextModel's metadata, and Qwen2MoeModel's expert width
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_expert_count(getattr(config, "num_experts", None) or config.num_local_experts)
        w.add_expert_used_count(config.num_experts_per_tok)
        if arch == "qwen3moe":
            w.add_key_length(config.head_dim)
            w.add_value_length(config.head_dim)
            w.add_expert_feed_forward_length(config.moe_intermediate_size)
        else:
            w.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
        if arch == "olmoe" and config.clip_qkv:
            w.add_clamp_kqv(config.clip_qkv)
    else:
        w.add_key_length(config.head_dim)
        w.add_value_length(config.head_dim)
        w.add_sliding_window(config.sliding_window)
        if arch == "gemma2":
            w.add_attn_logit_softcapping(config.attn_logit_softcapping)
            w.add_final_logit_softcapping(config.final_logit_softcapping)
        else:
            full = rope["full_attention"]
            w.add_rope_freq_base(full["rope_theta"])
            if full.get("rope_type") == "linear":
                w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
                w.add_rope_scaling_factor(full["factor"])
    write_vocab(w, folder)
    for hf_name, tensor in stacked_experts(load_file(folder / "model.safetensors")).items():
        if arch == "gemma2" and hf_name == "lm_head.weight":
            continue  # Gemma2Model drops it (tied)
        base, suffix = hf_name.rsplit(".", 1)
        if arch == "llama" and base.endswith(("q_proj", "k_proj")):
            heads = config.num_attention_heads if base.endswith("q_proj") else config.num_key_value_heads
            tensor = permute_qk(tensor, heads)
        values = tensor.float().numpy()
        if arch.startswith("gemma") and hf_name.endswith("norm.weight"):
            values = values + 1  # Gemma2Model / Gemma3Model.modify_tensors
        if quantize is not None and values.ndim == 2 and values.shape[1] % gguf.GGML_QUANT_SIZES[quantize][0] == 0:
            w.add_tensor(f"{names.get_name(base)}.{suffix}", gguf.quants.quantize(values, quantize), raw_dtype=quantize)
            continue
        w.add_tensor(f"{names.get_name(base)}.{suffix}", values)
    for name, values in extra.items():
        w.add_tensor(name, values)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def layers_of(spec):
    """What a spec makes, floats to six digits (a GGUF holds float32s)."""
    r = lambda x: None if x is None else float(f"{x:.6g}")  # noqa: E731
    return [(a.window, r(a.softcap), r(a.scale), a.qk_norm, a.rope.rope_type, r(a.rope.theta), a.rope.rotary_dim, layer.norms, layer.mlp)
            for layer in spec.layers for a in [layer.attention]], r(spec.embed_scale), spec.final_norm_unit_offset, r(spec.logit_softcap)


@pytest.mark.parametrize("name", sorted(FAMILY_ARCHS))
def test_gguf_written_as_llama_cpp_does_gives_the_folders_greedy_tokens(name, tmp_path):
    # llama.cpp's qwen3moe has no dense layers (its tensor map names no ffn_gate): every layer sparse
    folder = make_tiny_model(name, tmp_path / "hf", **({"mlp_only_layers": []} if name == "qwen3moe" else {}))
    write_family_gguf(folder, tmp_path / f"{name}.gguf", name)
    kwargs = dict(dtype="float32", num_blocks=64, block_size=4, max_model_len=SHORT, max_num_batched_tokens=8)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    prompts = [A_IDS[:18], B_IDS]
    from_gguf = LLM(str(tmp_path / f"{name}.gguf"), quantization="none", **kwargs)
    from_hf = LLM(str(folder), **kwargs)
    # the same layers, read from llama.cpp's metadata (rope parameters compared by what they make, not as written)
    assert layers_of(from_gguf.engine.runner.model.spec) == layers_of(from_hf.engine.runner.model.spec)
    for g, h in zip(from_gguf.generate(prompts, params), from_hf.generate(prompts, params)):
        assert g.outputs[0].token_ids == h.outputs[0].token_ids
        assert abs(g.outputs[0].logprobs[0].logprob - h.outputs[0].logprobs[0].logprob) < 1e-4


def test_unsupported_settings_name_themselves():
    """Validated at the edge: an activation, a rope type, a window or a layer kind shoal cannot run is an error that
    names it, not a silent Llama layer."""
    from shoal.model.config import ModelConfig
    from shoal.model.gemma import gemma_spec
    from shoal.model.layers import rope_inv_freq
    from shoal.model.spec import AttentionSpec, hf_activation, rope_of

    with pytest.raises(ValueError, match="'relu'"):
        hf_activation("relu")
    base = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=64, architectures=["LlamaForCausalLM"])
    config = ModelConfig.from_hf(transformers.PretrainedConfig(**base, rope_parameters={"rope_type": "weird", "rope_theta": 1e4}))
    with pytest.raises(ValueError, match="rope type 'weird'"):
        rope_inv_freq(config)
    with pytest.raises(ValueError, match="sees nothing"):
        AttentionSpec(rope_of(config.hf_config, 16), 0.25, window=0)
    with pytest.raises(ValueError, match="even number"):
        rope_of(transformers.PretrainedConfig(rope_parameters={"partial_rotary_factor": 0.2}), 16)  # 3 of 16
    gemma = transformers.PretrainedConfig(**base, layer_types=["sliding_attention", "chunked_attention"], query_pre_attn_scalar=16,
                                          sliding_window=8, hidden_activation="gelu_pytorch_tanh")
    with pytest.raises(ValueError, match="chunked_attention"):
        gemma_spec(ModelConfig.from_hf(gemma))
