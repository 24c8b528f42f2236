"""Mixture of experts: routing, the grouped expert matmuls, a K-quant MoE file, and the per-expert counts.

The families' parity with transformers (Qwen3-MoE, Mixtral, OLMoE, from HF folders and GGUF) is in
test_families.py, and their batch, chunk and cache invariance in float in test_invariance.py; here:
- routing: ties go to the lower expert, and a token's experts read its own row alone;
- gguf_grouped_linear gives each expert's rows the bits that expert's own GGUFLinear gives them, for every type
  with a kernel and every instruction set;
- a Qwen3-MoE GGUF of llama-quantize's types (Q4_K gate/up experts, Q6_K down experts) runs its experts grouped,
  gives the same tokens and logprobs alone, batched, chunked and after a cache hit, and the same bits as the
  experts one by one;
- the tokens each expert took add up exactly, and /metrics says them.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from conftest import require_native_kernels
from shoal import LLM, SamplingParams, kernels
from shoal.model.formats import NATIVE, GGUFLinear, GroupedGGUF
from shoal.model.layers import MoE, route
from test_formats import ISAS, TYPES, random_blocks, write_byte_vocab
from test_invariance import TINY_GREEDY, TINY_PROMPTS, _first_choices, assert_file_is_invariant, assert_same_as_alone

T = gguf.GGMLQuantizationType


def test_ties_go_to_the_lower_expert_and_a_row_routes_alone():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.5, 3.0, 2.0],  # three-way tie for first
                           [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],  # all tied
                           [5.0, 1.0, 2.0, 2.0, 4.0, 2.0]])  # tie for third, cut by k
    weights, experts = route(logits, 3, normalize=False)
    assert experts.tolist() == [[1, 2, 4], [0, 1, 2], [0, 4, 2]]
    probs = torch.softmax(logits, dim=-1)
    assert torch.equal(weights, probs.gather(1, experts))
    w, _ = route(logits, 3, normalize=True)
    torch.testing.assert_close(w.sum(dim=-1), torch.ones(3), atol=1e-6, rtol=0)
    # a row's choice and weights are the same bits alone as among any neighbours
    many = torch.randn(64, 16, generator=torch.Generator().manual_seed(0)).round(decimals=1)  # rounded: many ties
    wb, eb = route(many, 4, normalize=True)
    for i in (0, 17, 63):
        wa, ea = route(many[i : i + 1], 4, normalize=True)
        assert torch.equal(ea[0], eb[i]) and torch.equal(wa[0], wb[i])


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_grouped_experts_give_each_experts_own_bits(t):
    require_native_kernels()
    fmt = NATIVE[t]
    rows, cols, counts = 40, 512, [3, 0, 1, 9, 0, 2]  # an expert with no tokens, one with a single token
    layers = []
    for e in range(len(counts)):
        layer = GGUFLinear(cols, rows, False)
        layer.load_part(0, random_blocks(t, rows, cols, seed=10 * int(t) + e))
        layer.finish_loading()
        layers.append(layer)
    alone = [layer.packed0.clone() for layer in layers]
    grouped = GroupedGGUF.stack(layers)
    assert grouped is not None and grouped.packed.shape[0] == len(counts)
    assert all(torch.equal(layer.packed0, a) and layer.packed0.data_ptr() == grouped.packed[e].data_ptr()
               for e, (layer, a) in enumerate(zip(layers, alone)))  # each expert now a view of the stack
    x = torch.randn(sum(counts), cols, generator=torch.Generator().manual_seed(1))
    starts = np.cumsum([0, *counts])
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        for isa in ISAS:
            kernels.use_isa(isa)
            try:
                y = grouped(xd, counts)
                each = torch.cat([fmt.linear(xd[starts[e] : starts[e + 1]], alone[e], rows) for e in range(len(counts))])
            finally:
                kernels.use_isa(ISAS[0])
            assert y.dtype == dtype and torch.equal(y, each), f"{t.name}, level {isa}, {dtype}"
    with pytest.raises(RuntimeError, match="add up to 15 rows, x has 16"):
        grouped(torch.randn(16, cols), counts)


def _on_each_path(f):
    """f() on every instruction set this CPU has, best first."""
    out = []
    for isa in ISAS:
        kernels.use_isa(isa)
        try:
            out.append(f())
        finally:
            kernels.use_isa(ISAS[0])
    return out


def _reference_routing(logits, k, normalize):
    """What MoE.reference computes from router logits: each token's experts ascending, the step's pairs grouped by
    expert by a stable sort, each grouped pair's weight, and where each token's pairs went."""
    weights, chosen = route(logits, k, normalize)
    chosen, slot = chosen.sort(dim=1)
    flat = chosen.reshape(-1)
    order = torch.argsort(flat, stable=True)
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel())
    return order // k, torch.bincount(flat, minlength=logits.shape[1]), weights.gather(1, slot).reshape(-1)[order], back


def test_the_router_is_row_invariant_and_the_same_on_every_path():
    """kernels.row_linear: one fixed order of operations per output, so a row's logits are the same bits alone, in
    any batch, past any tile's or task's edge (70 rows: a task takes 64), and on AVX-512 and AVX2; within float32's
    rounding of a float64 product."""
    require_native_kernels()
    g = torch.Generator().manual_seed(2)
    for rows, inputs, outputs in ((70, 2048, 128), (9, 100, 7), (5, 16, 3)):  # inputs past a multiple of 16, odd outputs
        x, w = torch.randn(rows, inputs, generator=g), torch.randn(outputs, inputs, generator=g)
        paths = _on_each_path(lambda x=x, w=w: kernels.row_linear(x, w))
        y = paths[0]
        exact = (x.double() @ w.double().T).float()
        torch.testing.assert_close(y, exact, rtol=0, atol=2e-5 * inputs ** 0.5)
        for i in (0, 1, rows - 1):
            assert torch.equal(kernels.row_linear(x[i : i + 1], w), y[i : i + 1])
        assert torch.equal(kernels.row_linear(x[3:], w), y[3:])
        assert torch.equal(kernels.row_linear(torch.cat([x, x])[rows - 2 :], w)[:2], y[rows - 2 :])
        avx = [p for isa, p in zip(ISAS, paths) if isa >= 2]
        assert all(torch.equal(p, avx[0]) for p in avx), "AVX2 and AVX-512 add in the same order"
    with pytest.raises(RuntimeError, match="float32"):
        kernels.row_linear(x.double(), w)


@pytest.mark.parametrize("experts,k,normalize", [(128, 8, True), (8, 2, True), (64, 8, False), (6, 6, True)])
def test_native_routing_is_the_references(experts, k, normalize):
    """kernels.moe_route gives what the torch routing gives: the same experts (ties to the lower one: the logits are
    rounded to one decimal, so many tie), the same grouping and positions, and weights within a few ulp of torch's
    softmax; a token's routing alone is its routing in the batch."""
    require_native_kernels()
    logits = torch.randn(300, experts, generator=torch.Generator().manual_seed(experts)).round(decimals=1)
    rows, counts, scales, back = kernels.moe_route(logits, k, normalize)
    ref_rows, ref_counts, ref_scales, ref_back = _reference_routing(logits, k, normalize)
    assert torch.equal(rows, ref_rows) and torch.equal(counts, ref_counts) and torch.equal(back, ref_back)
    torch.testing.assert_close(scales, ref_scales, rtol=1e-6, atol=0)  # a few ulp: exp and the sums differ from torch's
    assert counts.sum().item() == 300 * k and torch.equal(rows[back].view(300, k), torch.arange(300).unsqueeze(1).expand(300, k))
    expert_of = torch.repeat_interleave(torch.arange(experts), counts)  # each grouped pair's expert
    for t in (0, 151, 299):
        _, c1, s1, b1 = kernels.moe_route(logits[t : t + 1], k, normalize)
        mine = back[t * k : t * k + k]
        assert torch.equal(torch.repeat_interleave(torch.arange(experts), c1)[b1], expert_of[mine])
        assert torch.equal(s1[b1], scales[mine])
    with pytest.raises(RuntimeError, match="top_k"):
        kernels.moe_route(logits, experts + 1, normalize)


def test_native_combine_gives_the_references_bits():
    """kernels.moe_combine: each token's outputs times their weights, added in ascending expert order, one rounding
    per multiply and per add (never fused): torch's bits, on every path, for widths past a multiple of 16."""
    require_native_kernels()
    g = torch.Generator().manual_seed(3)
    for tokens, k, width in ((37, 8, 2048), (5, 2, 70)):
        logits = torch.randn(tokens, 16, generator=g)
        _, _, scales, back = kernels.moe_route(logits, k, True)
        y = torch.randn(tokens * k, width, generator=g)
        weighted = (y * scales.unsqueeze(1)).index_select(0, back).view(tokens, k, width)
        ref = weighted[:, 0]
        for j in range(1, k):
            ref = ref + weighted[:, j]
        for out in _on_each_path(lambda y=y, scales=scales, back=back, k=k: kernels.moe_combine(y, scales, back, k)):
            assert torch.equal(out, ref)
    with pytest.raises(RuntimeError, match="outside"):
        kernels.moe_combine(y, scales, torch.full_like(back, len(back)), k)


def test_a_layers_native_path_is_its_reference():
    """MoE.forward on float32 rows (the native router, routing and sum) against MoE.reference (torch's, from the
    float64 router): the same experts, outputs within float32 rounding."""
    require_native_kernels()
    from shoal.model.config import ModelConfig
    from shoal.model.spec import sparse_layers
    from transformers import Qwen3MoeConfig

    hf = Qwen3MoeConfig(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                        num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, vocab_size=100, norm_topk_prob=True)
    config = ModelConfig.from_hf(hf)
    spec = sparse_layers(config, 8, 2, 32, True).layers[0]
    torch.manual_seed(4)
    moe = MoE(config, spec=spec)
    for p in moe.parameters():
        p.data.normal_(0, 0.2)
    moe.experts.finish_loading()
    x = torch.randn(40, 64)
    logits = moe.gate(x)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, (x.double() @ moe.gate.weight.double().T).float(), rtol=0, atol=1e-5)
    assert torch.equal(kernels.moe_route(logits, 2, True)[0], _reference_routing(logits, 2, True)[0])
    torch.testing.assert_close(moe(x), moe.reference(x, logits), rtol=1e-5, atol=1e-6)


def test_experts_pack_straight_into_their_stack():
    """GGUFLinear.pack_experts: each expert's parts (gate and up, two runs of one type) packed into its slice of one
    stacked tensor give the bytes of packing each expert alone and stacking after; each layer holds its slice. Parts
    of two types pack nothing and leave every part pending (then the experts pack one by one and stack)."""
    require_native_kernels()

    def experts(types):
        layers = []
        for e, t in enumerate(types):
            layer = GGUFLinear(256, 32, False, parts=(16, 16))
            layer.load_part(0, random_blocks(t, 16, 256, seed=2 * e))
            layer.load_part(1, random_blocks(t, 16, 256, seed=2 * e + 1))
            layers.append(layer)
        return layers

    straight, after = experts([T.Q4_K] * 3), experts([T.Q4_K] * 3)
    grouped = GGUFLinear.pack_experts(straight)
    for layer in after:
        layer.finish_loading()
    assert grouped is not None and torch.equal(grouped.packed, GroupedGGUF.stack(after).packed)
    assert all(layer.packed0.data_ptr() == grouped.packed[e].data_ptr() and not layer.pending for e, layer in enumerate(straight))
    mixed = experts([T.Q4_K, T.Q6_K])
    assert GGUFLinear.pack_experts(mixed) is None and all(len(layer.pending) == 2 and not layer.runs for layer in mixed)


def test_experts_of_other_kinds_are_not_stacked():
    require_native_kernels()
    a, b = GGUFLinear(256, 16, False), GGUFLinear(256, 16, False)
    a.load_part(0, random_blocks(T.Q4_K, 16, 256))
    b.load_part(0, random_blocks(T.Q6_K, 16, 256))
    a.finish_loading(), b.finish_loading()
    assert GroupedGGUF.stack([a, b]) is None  # two types: one expert after another
    assert GroupedGGUF.stack([a, torch.nn.Linear(256, 16)]) is None


# ---------------------------------------------------------------- a K-quant Qwen3-MoE file

HIDDEN, WIDTH, EXPERTS, USED, LAYERS, VOCAB = 256, 256, 8, 2, 2, 400  # TINY_PROMPTS use ids up to 384


def write_random_qwen3moe(path) -> None:
    """A qwen3moe GGUF as llama-quantize's Q4_K_M mixes one (Q4_K attention, gate and up experts; Q6_K value and
    down experts; a float32 router), random blocks with sane float16 scales, written directly."""
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    heads, head_dim = 4, 64
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(WIDTH)
    w.add_head_count(heads)
    w.add_head_count_kv(heads // 2)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    w.add_expert_count(EXPERTS)
    w.add_expert_used_count(USED)
    w.add_expert_feed_forward_length(WIDTH)
    write_byte_vocab(w, VOCAB)
    rng = np.random.default_rng(0)

    def add(name, t, *shape):  # shape: [experts,] rows, cols
        rows = int(np.prod(shape[:-1]))
        blocks = random_blocks(t, rows, shape[-1], seed=len(name) * 31 + rows).data.numpy()
        w.add_tensor(name, blocks.reshape(*shape[:-1], -1), raw_dtype=t)

    add("token_embd.weight", T.Q4_K, VOCAB, HIDDEN)
    add("output.weight", T.Q6_K, VOCAB, HIDDEN)
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    kv = heads // 2 * head_dim
    for i in range(LAYERS):
        add(f"blk.{i}.attn_q.weight", T.Q4_K, heads * head_dim, HIDDEN)
        add(f"blk.{i}.attn_k.weight", T.Q4_K, kv, HIDDEN)
        add(f"blk.{i}.attn_v.weight", T.Q6_K, kv, HIDDEN)
        add(f"blk.{i}.attn_output.weight", T.Q4_K, HIDDEN, heads * head_dim)
        add(f"blk.{i}.ffn_gate_exps.weight", T.Q4_K, EXPERTS, WIDTH, HIDDEN)
        add(f"blk.{i}.ffn_up_exps.weight", T.Q4_K, EXPERTS, WIDTH, HIDDEN)
        add(f"blk.{i}.ffn_down_exps.weight", T.Q6_K, EXPERTS, HIDDEN, WIDTH)
        w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", rng.standard_normal((EXPERTS, HIDDEN)).astype(np.float32))
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", np.ones(HIDDEN, np.float32))
        for norm in ("attn_q_norm", "attn_k_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", np.ones(head_dim, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def moe_file(tmp_path_factory):
    require_native_kernels()
    path = tmp_path_factory.mktemp("moe") / "random-qwen3moe-Q4_K_M.gguf"
    write_random_qwen3moe(path)
    return str(path)


def moes(llm) -> list[MoE]:
    return [layer.mlp for layer in llm.engine.runner.model.model.layers]


def test_a_k_quant_moe_file_runs_its_experts_grouped_and_invariant(moe_file):
    alone, llm = assert_file_is_invariant(moe_file)
    assert llm.engine.facts.architecture == "Qwen3MoeForCausalLM"
    layers = moes(llm)
    assert len(layers) == LAYERS and all(isinstance(m, MoE) and m.top_k == USED and m.normalize for m in layers)
    assert [tuple(g.fmt.name for g in m.experts.grouped) for m in layers] == [("Q4_K", "Q6_K")] * LAYERS
    assert llm.engine.runner.model.model.native_forward is not None  # the whole step in one native call
    llm.engine.runner.model.model.native_forward = None  # the Python forward, which reads `grouped` at each call
    for m in layers:  # the experts one by one, each its own GGUFLinear: the same bits
        m.experts.grouped = None
    assert_same_as_alone(_first_choices(llm.generate(TINY_PROMPTS[:3], TINY_GREEDY)), alone[:3], "experts one by one")


def test_each_layer_counts_top_k_experts_a_token(moe_file):
    llm = LLM(moe_file, enable_prefix_cache=False, num_blocks=128)
    before = llm.engine.snapshot.experts
    assert before["layers"] == tuple(range(LAYERS)) and all(sum(row) == 0 for row in before["tokens"])
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    prompts = TINY_PROMPTS[:4]
    llm.generate(prompts, params)
    tokens = llm.engine.snapshot.experts["tokens"]
    computed = sum(len(p) + params.max_tokens - 1 for p in prompts)  # every prompt token, and each output but the last
    assert [sum(row) for row in tokens] == [computed * USED] * LAYERS
    assert all(len(row) == EXPERTS for row in tokens) and sum(n > 0 for n in tokens[0]) > 1


def test_a_model_without_experts_reports_none(default_gguf_path):
    assert LLM(str(default_gguf_path), num_blocks=64, max_model_len=256).engine.snapshot.experts is None
