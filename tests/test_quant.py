"""Weight-only int8 and int4 (`quantization="int8"|"int4"`): the layers' math, the model against transformers
on the same rounded weights, batch invariance, a GGUF's own 4-bit codes served as they are, and the clear
errors for what they do not do."""

import pytest
import torch
import torch.nn.functional as F
import transformers

from shoal import LLM, SamplingParams
from shoal.config import EngineConfig
from shoal.model.gguf_loader import Q4Codes
from shoal.model.quant import Int4Linear, Int8Linear
from tiny_models import make_tiny_model


def test_int8_linear_rounds_each_output_channel_to_its_own_grid():
    torch.manual_seed(0)
    w = torch.randn(48, 32) * torch.logspace(-2, 1, 48)[:, None]  # rows of very different ranges
    bias = torch.randn(48)
    lin = Int8Linear(w.bfloat16(), bias.bfloat16())
    assert lin.weight.dtype == torch.int8 and lin.scale.shape == (48,) and lin.scale.dtype == torch.bfloat16
    assert lin.weight.abs().max().item() == 127
    assert (lin.weight.abs().amax(dim=1) == 127).all()  # every row uses its full range
    deq = lin.dequantized()
    # rounding to the row's grid: off by at most half a step (plus bf16's rounding of the scale)
    step = lin.scale.float()[:, None]
    assert ((deq - w.bfloat16().float()).abs() <= 0.5 * step + 0.01 * w.abs()).all()
    x = torch.randn(5, 32).bfloat16()
    ref = F.linear(x.float(), deq, bias.bfloat16().float())
    torch.testing.assert_close(lin(x).float(), ref, atol=0.05 * ref.abs().max().item(), rtol=0.02)
    assert lin(x.view(5, 1, 32)).shape == (5, 1, 48)


def test_int4_linear_rounds_each_group_of_32_to_16_levels_between_its_min_and_max():
    torch.manual_seed(0)
    w = torch.randn(40, 96) * torch.logspace(-2, 1, 40)[:, None]
    w[3, 32:64] = 0.25  # a constant group: its one value must come back (no division by a zero range)
    bias = torch.randn(40)
    lin = Int4Linear.from_float(w.bfloat16(), bias.bfloat16())
    deq = lin.dequantized()
    groups = w.bfloat16().float().view(40, 3, 32)
    low, high = groups.amin(-1), groups.amax(-1)
    step = ((high - low) / 15)[..., None]
    err = (deq.view(40, 3, 32) - groups).abs()
    # half a step of the group's grid, plus bf16's rounding of the scale and offset the kernel reads
    assert (err <= 0.5 * step + 0.02 * groups.abs().amax(-1, keepdim=True)).all()
    assert torch.allclose(deq[3, 32:64], torch.full((32,), 0.25), atol=1e-3)
    # each group uses 16 levels: its extremes come back (within the rounding above)
    assert ((deq.view(40, 3, 32).amax(-1) - high).abs() <= 0.02 * high.abs() + 1e-6).all()
    x = torch.randn(5, 96).bfloat16()
    ref = F.linear(x.float(), deq, bias.bfloat16().float())
    torch.testing.assert_close(lin(x).float(), ref, atol=0.05 * ref.abs().max().item(), rtol=0.02)
    assert lin(x.view(5, 1, 96)).shape == (5, 1, 40)


def test_int4_linear_from_codes_multiplies_by_exactly_those_weights():
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (24, 64), generator=g, dtype=torch.uint8)
    # scales and offsets that float16 (the kernel's dtype here) holds exactly, as a GGUF's float16 d and m are
    scale = (torch.randint(1, 64, (24, 2), generator=g) / 512.0)
    low = -(torch.randint(0, 64, (24, 2), generator=g) / 64.0)
    lin = Int4Linear(codes, scale, low, None, torch.float16)
    want = Q4Codes(codes, scale, low).dequantized()
    assert torch.equal(lin.dequantized(), want)
    x = torch.randn(3, 64, generator=g).half()
    torch.testing.assert_close(lin(x).float(), x.float() @ want.T, atol=2e-2, rtol=2e-3)


@pytest.fixture(scope="module", params=["int8", "int4"])
def tiny_pair(request, tmp_path_factory):
    """A tiny llama (weights large enough that rounding shows in the logits) served with int8 weights and float16
    activations (fp16's 10-bit mantissa keeps the activations' rounding below the weights'), transformers' float32
    copy whose projections and head hold shoal's int8-rounded weights, and transformers on the original weights."""
    path = make_tiny_model("llama", tmp_path_factory.mktemp(request.param), tie_word_embeddings=False, initializer_range=0.3)
    llm = LLM(str(path), dtype="float16", quantization=request.param, num_blocks=64, block_size=4, max_model_len=96,
              check_integrity=True)
    model = llm.engine.runner.model
    original = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rounded = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    c = model.config
    with torch.no_grad():
        for ours, theirs in zip(model.model.layers, rounded.model.layers):
            q, k, v = ours.self_attn.qkv_proj.dequantized().split([c.q_size, c.kv_size, c.kv_size])
            theirs.self_attn.q_proj.weight.copy_(q)
            theirs.self_attn.k_proj.weight.copy_(k)
            theirs.self_attn.v_proj.weight.copy_(v)
            theirs.self_attn.o_proj.weight.copy_(ours.self_attn.o_proj.dequantized())
            gate, up = ours.mlp.gate_up_proj.dequantized().chunk(2)
            theirs.mlp.gate_proj.weight.copy_(gate)
            theirs.mlp.up_proj.weight.copy_(up)
            theirs.mlp.down_proj.weight.copy_(ours.mlp.down_proj.dequantized())
        rounded.lm_head.weight.copy_(model.logits_head.dequantized())
    return llm, rounded, original


def test_every_projection_is_quantized_and_the_head_is_int8(tiny_pair):
    llm = tiny_pair[0]
    model = llm.engine.runner.model
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert linears == []  # nothing left in floating point but the embedding table and norms
    kind = Int8Linear if llm.engine.config.quantization == "int8" else Int4Linear
    assert sum(isinstance(m, kind) for m in model.modules()) == 4 * model.config.num_layers + (kind is Int8Linear)
    assert isinstance(model.logits_head, Int8Linear)  # int4 too: the head stays at 8 bits
    assert not hasattr(model, "lm_head")  # untied: the float head is gone, its int8 copy replaces it


def test_quantized_model_matches_transformers_on_the_same_rounded_weights(tiny_pair):
    llm, rounded, original = tiny_pair
    for ids in ([5, 17, 99, 23, 8, 200, 41], [300, 12, 7], list(range(40, 70))):
        top = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=1, logprobs=20))[0].outputs[0].logprobs[0].top
        token_ids = torch.tensor([t.token_id for t in top])
        ours = torch.tensor([t.logprob for t in top])
        with torch.inference_mode():
            ref = torch.log_softmax(rounded(torch.tensor([ids])).logits[0, -1], -1)[token_ids]
            unrounded = torch.log_softmax(original(torch.tensor([ids])).logits[0, -1], -1)[token_ids]
        to_rounded, to_original = (ours - ref).abs().mean(), (ours - unrounded).abs().mean()
        assert to_rounded < 0.025  # float16 activations' rounding only
        # ...and the original weights are at least 3x farther: the test sees which weights were used
        assert to_original > 3 * to_rounded


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_outputs_do_not_depend_on_the_batch(tiny_llama_path, quantization):
    llm = LLM(str(tiny_llama_path), dtype="bfloat16", quantization=quantization, num_blocks=128, block_size=4, max_model_len=96)
    prompts = [[5 + i, 17, 99, 23 + 2 * i, 8] * (1 + i % 3) for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    assert batched == alone


def test_quantization_refuses_float32_activations_and_unknown_formats(tiny_llama_path):
    for q in ("int8", "int4"):
        with pytest.raises(ValueError, match=f"{q} weights run with bfloat16 or float16 activations"):
            EngineConfig(model=str(tiny_llama_path), dtype="float32", quantization=q)
    with pytest.raises(ValueError, match="quantization must be auto, none, int8 or int4, got 'fp8'"):
        EngineConfig(model=str(tiny_llama_path), quantization="fp8")


def test_auto_serves_float_weights_where_the_low_bit_kernels_do_not_run(tmp_path):
    """The default "auto" on a Q4 GGUF: int4 with bfloat16 activations, float weights with float32 ones
    (the CPU without native bf16 gets that dtype by default), and "none" turns it off."""
    from test_loader import Q, write_gguf

    folder = make_tiny_model("llama", tmp_path / "hf")
    kinds = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    write_gguf(folder, tmp_path / "q4.gguf", "llama", {"token_embd": Q.Q8_0, **dict.fromkeys(kinds, Q.Q4_1)})
    for dtype, quantization, want in (("bfloat16", "auto", "int4"), ("float32", "auto", "none"), ("bfloat16", "none", "none")):
        llm = LLM(str(tmp_path / "q4.gguf"), dtype=dtype, quantization=quantization, num_blocks=16, block_size=4, max_model_len=64)
        model = llm.engine.runner.model
        assert llm.engine.weight_format == want, (dtype, quantization)
        assert sum(isinstance(m, Int4Linear) for m in model.modules()) == (4 * model.config.num_layers if want == "int4" else 0)
