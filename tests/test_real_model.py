"""Real weights: the default SmolLM2-135M-Instruct GGUF, shoal against transformers.

Greedy continuations of 64 tokens for varied chat prompts must be
transformers' greedy continuations token for token (its argmax at every
position, in one teacher-forced forward). Where float32 rounding flips a near
tie, the vLLM rule applies at the first difference: each side's token must be
among the other side's top 5 (and the texts are not compared past that point).
"""

import pytest
import torch

from shoal import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a binary search does, in two sentences.",
    "List three primary colors.",
    "Translate 'good morning' into Spanish.",
    "def fibonacci(n):\n    # complete this Python function",
    "What is 12 times 7?",
    "Give me a short tip for sleeping better.",
    "Who wrote 'Romeo and Juliet'?",
    "Summarize the water cycle for a child.",
    "¿Cuál es el río más largo del mundo?",
    "Write one sentence about a cat named Mochi 🐱.",
]
N = 64


@pytest.fixture(scope="module")
def llm():
    """The default model's float math: the GGUF dequantized, in float32 (the low-bit default is tested below)."""
    return LLM("smollm2", dtype="float32", quantization="none", max_model_len=1024, check_integrity=True)


def _hf_greedy_along(hf, ids, ours):
    """transformers' greedy choice and top 5 at every position of our continuation, in one forward over the prompt
    and our tokens (teacher-forced). Greedy decoding picks the argmax given the tokens before it, so up to the first
    position where transformers' argmax is not our token, its generate() writes exactly our tokens; from there the
    texts are not compared. The only difference from running generate() is the float rounding of its incremental KV
    cache against one forward, which the near-tie rule covers; it costs one forward instead of 64 (~5 s a prompt)."""
    logits = hf(torch.tensor([list(ids) + list(ours)])).logits[0, len(ids) - 1 : len(ids) - 1 + len(ours)]
    return logits.argmax(-1).tolist(), logits.topk(5).indices.tolist()


def _assert_greedy_matches(llm, hf, prompts, min_exact):
    """Greedy continuations of every prompt, batched in shoal, must be transformers' greedy continuations; at a first
    difference, each side's token must be in the other's top 5 (a near tie). At least `min_exact` must match to the
    end."""
    convs = [[{"role": "user", "content": p}] for p in prompts]
    prompt_ids = [llm.apply_chat_template(c) for c in convs]
    # All prompts in one batch: batching must not change greedy results either.
    # shoal stops at the model's end of turn (past it the distribution is
    # flat and near ties are everywhere); transformers must have chosen it there too.
    outs = llm.generate(prompt_ids, SamplingParams(temperature=0.0, max_tokens=N, logprobs=5))
    eos = sorted(llm.engine.eos_token_ids)
    exact = 0
    with torch.inference_mode():
        for ids, out in zip(prompt_ids, outs):
            ours = out.outputs[0]
            assert len(ours.token_ids) == N or ours.token_ids[-1] in eos
            ref, ref_top5 = _hf_greedy_along(hf, ids, ours.token_ids)
            if ours.token_ids == ref:
                exact += 1
                continue
            i = next(k for k, (a, b) in enumerate(zip(ours.token_ids, ref)) if a != b)
            our_top5 = [t.token_id for t in ours.logprobs[i].top]
            assert ours.token_ids[i] in ref_top5[i] and ref[i] in our_top5, (
                f"prompt {llm.tokenizer.decode(ids)!r}: first difference at token {i} is not a near tie"
            )
    assert exact >= min_exact, f"only {exact} of {len(prompts)} continuations matched to the end"


def test_greedy_matches_transformers_on_real_weights(llm, hf_default_model):
    # Near ties are rare in float32: most prompts must match exactly.
    _assert_greedy_matches(llm, hf_default_model, PROMPTS, min_exact=len(PROMPTS) - 2)


def test_bfloat16_greedy_matches_transformers_in_bfloat16(default_gguf_path, hf_default_model):
    """`--quantization none` with `dtype="auto"` serves in bfloat16 on CPUs with native bf16: check that path on
    real weights against transformers in bfloat16 (same weights, rounded the same way)."""
    import copy

    llm = LLM(str(default_gguf_path), dtype="bfloat16", quantization="none", max_model_len=1024, check_integrity=True)
    hf16 = copy.deepcopy(hf_default_model).to(torch.bfloat16)
    # bf16 keeps ~3 significant digits: near ties are commoner than in float32, so fewer need to match to the end.
    _assert_greedy_matches(llm, hf16, PROMPTS[:8], min_exact=3)


@pytest.mark.parametrize("dtype", ["auto", "bfloat16"])
def test_default_serves_the_gguf_own_4bit_weights(default_gguf_path, hf_default_model, dtype):
    """The default configuration (quantization "auto"; dtype "auto", and bfloat16, the default on CPUs with
    native bf16) on the Q4_1 GGUF: every projection is an int4 layer built from the file's codes and multiplies
    by the file's weights, and greedy continuations track transformers on the same weights in the same dtype
    (the top-5 rule at every first difference). With shoal's native kernels every tensor is in its file's type
    (model/formats.py); without them the projections are torch's int4 layers from the file's codes."""
    import copy

    from shoal import kernels
    from shoal.model.formats import GGUFEmbedding, GGUFLinear
    from shoal.model.loader import load_checkpoint
    from shoal.model.quant import Int4Linear

    llm = LLM(str(default_gguf_path), dtype=dtype, max_model_len=1024, check_integrity=True)
    model = llm.engine.runner.model
    native = kernels.available()
    assert llm.engine.facts.weight_format == ("gguf" if native else "int4")
    projections = [m for m in model.model.layers.modules() if isinstance(m, GGUFLinear if native else Int4Linear)]
    assert len(projections) == 4 * model.config.num_layers
    assert all(m.formats == ("Q4_1",) if native else m.from_codes for m in projections)
    file_weights = load_checkpoint(str(default_gguf_path), progress=False).state_dict  # float32, dequantized by gguf
    for i, layer in enumerate(llm.engine.runner.model.model.layers):
        pre = f"model.layers.{i}"
        pairs = [
            (layer.self_attn.qkv_proj, [f"{pre}.self_attn.{p}_proj.weight" for p in "qkv"]),
            (layer.self_attn.o_proj, [f"{pre}.self_attn.o_proj.weight"]),
            (layer.mlp.gate_up_proj, [f"{pre}.mlp.gate_proj.weight", f"{pre}.mlp.up_proj.weight"]),
            (layer.mlp.down_proj, [f"{pre}.mlp.down_proj.weight"]),
        ]
        for lin, names in pairs:
            want = torch.cat([file_weights[n] for n in names])
            got = lin.dequantized()
            # shoal's kernels keep the file's float16 scales and minimums: the same weights, to float32's rounding;
            # torch's round them to bf16: well under one 4-bit step (~1/15 of a range)
            assert (got - want).abs().max() <= (1e-6 if native else 0.01) * want.abs().max(), names
    if native:  # the embedding reads the file's Q8_0 table, bit for bit, and the tied head multiplies by it
        table = file_weights["model.embed_tokens.weight"].to(llm.engine.runner.dtype)
        assert isinstance(model.model.embed_tokens, GGUFEmbedding) and model.model.embed_tokens.formats == ("Q8_0",)
        assert model.logits_head.packed0 is model.model.embed_tokens.packed0
        for start in range(0, len(table), 8192):
            assert torch.equal(model.model.embed_tokens(torch.arange(start, min(start + 8192, len(table)))), table[start:start + 8192])
    # The first differences must be near ties (each side's token in the other's top 5). "What is the capital of
    # France?" is one: its first token is "The" or "L'" at ~0.16 each, and int4's rounding can pick either.
    # The reference multiplies unrounded activations, shoal's kernels int8-rounded ones per block of 32 (as
    # llama.cpp does): SmolLM2's outlier channels make that 1-2% of a projection's output, so near ties tip apart
    # within the first tokens (measured: 1-2 of 8 to the end in float32, 0-1 in bfloat16). The criterion is
    # the top-5 rule at every first difference, and that is what holds.
    ref = copy.deepcopy(hf_default_model).to(llm.engine.runner.dtype)
    _assert_greedy_matches(llm, ref, PROMPTS[:8], min_exact=0)


def test_capital_of_france(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}], SamplingParams(temperature=0.0, max_tokens=32))
    assert "Paris" in out[0].outputs[0].text
    assert out[0].outputs[0].finish_reason.value == "stop"  # ended by <|im_end|>, not the length limit


def test_batch_of_16_real_prompts_equals_each_alone_with_chunked_prefill(default_gguf_path):
    llm = LLM(str(default_gguf_path), dtype="float32", max_model_len=512, max_num_batched_tokens=48, check_integrity=True)
    convs = [[{"role": "user", "content": f"{p} (#{i})"}] for i, p in enumerate(PROMPTS + PROMPTS[:4])]
    ids = [llm.apply_chat_template(c) for c in convs]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=5)
    batched = llm.generate(ids, params)
    for p, b in zip(ids, batched):
        a = llm.generate([p], params)[0].outputs[0]
        b = b.outputs[0]
        if a.token_ids != b.token_ids:
            i = next(k for k, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y)
            assert a.token_ids[i] in [t.token_id for t in b.logprobs[i].top]
            assert b.token_ids[i] in [t.token_id for t in a.logprobs[i].top]
