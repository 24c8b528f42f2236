"""The native forward (model/native.py, kernels/decoder.cpp): a decoder's layers in one C++ call give the Python
forward's bits, for every step a server runs (prompts alone and batched, chunked prefill, speculation's drafts,
seeded sampling, prefix-cache hits, beams), for every low-bit format it covers, in float32 and bfloat16; a model it does
not cover says why and keeps the Python forward."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shoal import kernels
from shoal.engine.llm import LLM
from shoal.model import native
from shoal.model.attention.common import SeqSpan
from shoal.types import SamplingParams

FIXTURES = Path(__file__).parent / "fixtures"

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the native forward needs shoal's native kernels")


def _prompts(vocab: int) -> list[list[int]]:
    return [[(7 * i + 13 * j * j) % (vocab - 10) + 5 for i in range(n)] for j, n in enumerate((3, 29, 70, 11))]


def _workload(llm: LLM, vocab: int) -> list[tuple]:
    """Greedy prompts batched (chunked by the small token budget), a seeded sampled one, then the greedy ones again
    (prefix-cache hits), then beams beside a greedy prompt: every token id and logprob, and each beam's tokens and
    score, as the engine reports them."""
    prompts = _prompts(vocab)
    greedy = SamplingParams(temperature=0.0, max_tokens=10, logprobs=3, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=10, logprobs=3, ignore_eos=True)
    outs = llm.generate(prompts + [prompts[2]], [greedy] * len(prompts) + [seeded])
    outs += llm.generate(prompts[:2], greedy)
    got = [(o.outputs[0].token_ids, [(lp.logprob, tuple((t.token_id, t.logprob) for t in lp.top)) for lp in o.outputs[0].logprobs])
           for o in outs]
    beams = SamplingParams(num_beams=3, n=3, max_tokens=6, ignore_eos=True)
    outs = llm.generate([prompts[1], prompts[3]], [beams, greedy])
    return got + [[(c.token_ids, c.cumulative_logprob) for c in o.outputs] for o in outs]


def _native_of(llm: LLM):
    return llm.engine.runner.model.model.native_forward


def _both(monkeypatch, model: str, vocab: int, **kwargs) -> tuple[list, list, LLM]:
    """The workload with the native forward and with SHOAL_NATIVE_FORWARD=0, each in an engine of its own."""
    kwargs = dict(num_blocks=128, block_size=4, max_model_len=160, max_num_batched_tokens=32, speculative="ngram", **kwargs)
    calls = []  # the plan's steps: from the token ids, or from the embeddings
    for name in ("from_ids", "__call__"):
        run = getattr(native.NativeForward, name)
        monkeypatch.setattr(native.NativeForward, name, lambda self, *a, run=run, name=name: calls.append(name) or run(self, *a))
    with LLM(model, **kwargs) as llm:
        ours = _workload(llm, vocab)
        assert isinstance(_native_of(llm), native.NativeForward)
        assert len(calls) >= 20  # every step of the workload ran in the plan
        # a GGUF's embedding table or a float one: the plan looks up the step's embeddings and rope tables too
        assert _native_of(llm).ids and calls.count("from_ids") == len(calls)
    monkeypatch.setenv("SHOAL_NATIVE_FORWARD", "0")
    with LLM(model, **kwargs) as ref_llm:
        ref = _workload(ref_llm, vocab)
        assert _native_of(ref_llm) is None
    return ours, ref, llm


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_k_quant_mix_gives_the_python_forwards_bits(monkeypatch, dtype):
    """tiny-llama-Q4_K_M: a layer's q and k in one Q4_K run and v in a Q6_K run, a projection of two kernel calls."""
    ours, ref, llm = _both(monkeypatch, str(FIXTURES / "tiny-llama-Q4_K_M.gguf"), 400, dtype=dtype)
    assert any(len(layer.self_attn.qkv_proj.native_runs().runs) == 2 for layer in llm.engine.runner.model.model.layers)
    assert ours == ref


@pytest.mark.parametrize("arch,quantization,dtype", [("qwen2", "int8", "float32"), ("qwen3", "int4", "bfloat16"),
                                                     ("llama", "int4", "float32")])
def test_int8_and_int4_with_biases_and_qk_norms_give_the_python_forwards_bits(monkeypatch, tmp_path, arch, quantization, dtype):
    """Qwen2's q/k/v biases and Qwen3's per-head q/k norms run inside the plan too."""
    from tiny_models import make_tiny_model

    path = make_tiny_model(arch, tmp_path / arch)
    ours, ref, _ = _both(monkeypatch, str(path), 400, quantization=quantization, dtype=dtype)
    assert ours == ref


@pytest.mark.parametrize("arch,quantization,dtype", [("gemma3", "int8", "float32"), ("gemma2", "int4", "bfloat16")])
def test_gemmas_layers_give_the_python_forwards_bits(monkeypatch, tmp_path, arch, quantization, dtype):
    """Gemma's four (1 + w) norms, GELU, q/k norms of that kind (Gemma 3), the attention's softcap (Gemma 2), and local
    and global layers over two KV groups, each layer reading its group's tables, run inside the plan too."""
    from tiny_models import make_tiny_model

    path = make_tiny_model(arch, tmp_path / arch)
    ours, ref, llm = _both(monkeypatch, str(path), 400, quantization=quantization, dtype=dtype)
    assert ours == ref
    assert len(llm.engine.runner.kv_groups) == 2 and len(_native_of(llm).windows) == 2


def test_a_gemma_gguf_looks_up_its_scaled_embeddings_in_the_plan(monkeypatch, tmp_path):
    """A Gemma 3 GGUF in Q8_0 (its embedding table too): the plan multiplies the looked-up rows by the embedding
    scale, as DecoderModel.forward does, and runs the step from its token ids."""
    from test_families import write_family_gguf
    from tiny_models import make_tiny_model

    import gguf

    folder = make_tiny_model("gemma3", tmp_path / "hf")
    write_family_gguf(folder, tmp_path / "gemma3.gguf", "gemma3", quantize=gguf.GGMLQuantizationType.Q8_0)
    ours, ref, llm = _both(monkeypatch, str(tmp_path / "gemma3.gguf"), 400)
    assert ours == ref
    assert llm.engine.runner.model.model.spec.embed_scale is not None


def test_the_default_model_gives_the_python_forwards_bits_on_every_instruction_set(monkeypatch, default_gguf_path):
    """On each code path this CPU has (AVX-512 with each way of reading one or two rows' weights,
    kernels.use_rows_rule; AVX2; the SSE2 baseline) the plan gives the Python forward's bits on that path, in two
    engines whose prefix caches serve the later paths' runs. (The row ops' FMAs differ between paths, so paths are
    compared with themselves; the matmuls give the same bits on all, tests/test_formats.py.)"""
    kwargs = dict(num_blocks=128, block_size=4, max_model_len=160, max_num_batched_tokens=32, speculative="ngram")
    best = int(torch.ops.shoal_kernels.use_isa(0))
    paths = [(level, rule) for level in (3, 2, 1) if level <= best for rule in ((1, 2) if level == 3 else (0,))]
    with LLM(str(default_gguf_path), **kwargs) as llm:
        assert isinstance(_native_of(llm), native.NativeForward)
        monkeypatch.setenv("SHOAL_NATIVE_FORWARD", "0")
        with LLM(str(default_gguf_path), **kwargs) as ref_llm:
            assert _native_of(ref_llm) is None
            try:
                for level, rule in paths:
                    kernels.use_isa(level)
                    kernels.use_rows_rule(rule)
                    assert _workload(llm, 49152) == _workload(ref_llm, 49152), f"level and rule {(level, rule)}"
            finally:
                kernels.use_isa(0)
                kernels.use_rows_rule(0)
    assert len(paths) == {3: 4, 2: 2, 1: 1}[best]


def test_a_k_quant_mixture_of_experts_gives_the_python_forwards_bits(monkeypatch, tmp_path, caplog):
    """A Qwen3-MoE GGUF (Q4_K gate/up experts, Q6_K down experts, a float32 router): the plan runs the router, the
    routing, both grouped projections and the weighted sum as MoE.forward does, and counts the same tokens per
    expert. In bfloat16 (MoE.forward's torch path) it says why not."""
    from test_moe import EXPERTS, VOCAB, write_random_qwen3moe

    path = tmp_path / "moe.gguf"
    write_random_qwen3moe(path)
    ours, ref, llm = _both(monkeypatch, str(path), VOCAB)
    assert ours == ref
    assert all(layer.mlp.experts.grouped is not None for layer in llm.engine.runner.model.model.layers)
    monkeypatch.delenv("SHOAL_NATIVE_FORWARD")
    counts = []
    for setting in ("1", "0"):
        monkeypatch.setenv("SHOAL_NATIVE_FORWARD", setting)
        with LLM(str(path), num_blocks=64, block_size=4, max_model_len=64, speculative="off", enable_prefix_cache=False) as one:
            one.generate(_prompts(VOCAB)[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
            counts.append(one.engine.snapshot.experts["tokens"])
    assert counts[0] == counts[1] and len(counts[0][0]) == EXPERTS and sum(counts[0][0]) > 0
    monkeypatch.delenv("SHOAL_NATIVE_FORWARD")
    with caplog.at_level("INFO", logger="shoal.model"), LLM(str(path), num_blocks=32, block_size=4, max_model_len=64,
                                                             speculative="off", dtype="bfloat16") as bf16:
        assert _native_of(bf16) is None
    assert any("a mixture of experts on activations other than float32" in r.getMessage() for r in caplog.records)


def _spans(runner, lengths: list[int]) -> list[SeqSpan]:
    """Prefill spans from position 0, each sequence on blocks of its own."""
    bs, spans, next_block = runner.block_size, [], 0
    for n in lengths:
        blocks = -(-n // bs)
        spans.append(SeqSpan(0, n, tuple(range(next_block, next_block + blocks))))
        next_block += blocks
    return spans


def test_a_pipeline_stage_hands_on_its_residual_stream_as_the_python_forward_does():
    """A stage before the last returns the residual stream, not the normed output: the plan's `last` flag, against
    the Python forward on the same inputs (both write the same keys and values at the same slots)."""
    with LLM(str(FIXTURES / "tiny-llama-Q4_K_M.gguf"), num_blocks=64, block_size=4, max_model_len=64, speculative="off") as llm:
        runner = llm.engine.runner
        decoder = runner.model.model
        spans = _spans(runner, [9, 5])
        ids = torch.tensor([(3 * i) % 300 + 5 for i in range(14)])
        pos = torch.tensor([*range(9), *range(5)])
        for last in (True, False):
            decoder.last = last
            decoder.native_forward = native.build(decoder, runner.kv_caches)
            assert isinstance(decoder.native_forward, native.NativeForward)
            meta = runner.attention.prepare([], spans)
            with torch.inference_mode():
                got = decoder(ids, pos, runner.kv_caches, meta)
                x = decoder.embed_tokens(ids)
                ropes = [r(pos, x.dtype) for r in decoder.rotaries]
                want = decoder._forward_fused(x, ropes, runner.kv_caches, meta)
            assert torch.equal(got, want), last
        decoder.last = True


def test_a_model_the_plan_does_not_cover_says_why_and_keeps_the_python_forward(tiny_llama_path, caplog):
    """Float weights: their matmuls are torch's, so the plan does not take them."""
    with caplog.at_level("INFO", logger="shoal.model"), LLM(str(tiny_llama_path), num_blocks=32, block_size=4, max_model_len=64,
                                                             speculative="off", quantization="none", attention="invariant") as llm:
        llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=2))
        assert _native_of(llm) is None
    assert any("native forward: off for this model (InvariantLinear projections" in r.getMessage() for r in caplog.records)


def test_a_description_that_does_not_add_up_is_refused():
    with pytest.raises(RuntimeError, match="decoder plan: too few"):
        torch.classes.shoal_kernels.DecoderPlan([], [1, 0], [1e-5])
    with pytest.raises(RuntimeError, match="longer than its layers"):
        torch.classes.shoal_kernels.DecoderPlan([], [0, 0, 0, 0, 0, 7], [1e-5])


def test_a_closed_engine_lets_its_kv_pool_go_though_the_plan_held_it(monkeypatch, default_gguf_path):
    """The native plan holds every layer's KV cache (no copies). Once the engine is closed and dropped, nothing keeps
    the pool: its anonymous mapping is gone, as it is with the Python forward (a server unloading a model gets its
    memory back)."""
    import gc
    import mmap
    import weakref

    from shoal.runner import model_runner

    pools = []
    real = mmap.mmap

    def recording(fileno, *args, **kwargs):
        m = real(fileno, *args, **kwargs)
        if fileno == -1:  # an anonymous mapping: the KV pool's (model_runner.kv_pool_tensor)
            pools.append(weakref.ref(m))
        return m

    monkeypatch.setattr(model_runner.mmap, "mmap", recording)
    with LLM(str(default_gguf_path), max_model_len=256) as llm:
        assert isinstance(_native_of(llm), native.NativeForward)
        assert llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0].outputs[0].token_ids
        assert pools and all(r() is not None for r in pools)
    del llm
    gc.collect()
    assert all(r() is None for r in pools)


def test_greedy_steps_pick_in_the_head_with_the_samplers_bits(monkeypatch, default_gguf_path):
    """A step whose rows all sample greedily with no logits processor but bans and no top logprobs runs the head and
    the pick in one native call (kernels.greedy_head, ModelRunner.greedy_head): the tokens and logprobs are those of
    the logits and the sampler, alone, batched, with speculation's drafts, beside a row with ignore_eos's ban, and in
    steps where a row asks for more (top logprobs, sampling), which take the sampler for all their rows."""
    calls = []
    run = kernels.greedy_head
    monkeypatch.setattr(kernels, "greedy_head", lambda *a: calls.append((len(a[0]), a[4] is not None)) or run(*a))
    prompts = _prompts(49152)
    plain = SamplingParams(temperature=0.0, max_tokens=12, logprobs=0)
    asks = [SamplingParams(temperature=0.0, max_tokens=12, logprobs=0, ignore_eos=True),
            SamplingParams(temperature=0.0, max_tokens=12, logprobs=2), SamplingParams(temperature=0.7, seed=3, max_tokens=12, logprobs=0)]

    def workload(llm):
        outs = [llm.generate([p], plain)[0] for p in prompts[:2]]
        outs += llm.generate(prompts, plain)
        outs += llm.generate(prompts[:3] + prompts[:1], [plain] * 3 + [asks[0]])
        outs += llm.generate(prompts[:2] * 2, [plain, plain, asks[1], asks[2]])
        return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs]

    kwargs = dict(num_blocks=128, block_size=4, max_model_len=160, max_num_batched_tokens=32)
    for speculative in ("off", "ngram"):
        with LLM(str(default_gguf_path), speculative=speculative, **kwargs) as llm:
            assert llm.engine.runner.greedy_head is not None
            calls.clear()
            fused = workload(llm)
            assert (1, False) in calls and max(calls)[0] >= 4  # one stream, and batches of four, picked in the head
            assert any(banned for _, banned in calls)  # and the batch beside ignore_eos's ban
            llm.engine.runner.greedy_head = None  # every step through compute_logits and the sampler
            calls.clear()
            assert workload(llm) == fused and not calls
