"""Model math against HF transformers on the same weights: every architecture.

Tiny random-weight models (tests/tiny_models.py) go through shoal's loader,
model and paged attention, chunked prefill and batched decode, and must give
the logits transformers gives, within 1e-4, and the same greedy tokens.
"""

import pytest
import torch
import transformers

from shoal import LLM, SamplingParams
from shoal.config import EngineConfig
from shoal.runner.build import engine_dtype
from shoal.model.loader import load_checkpoint, open_gguf, planned_weight_format
from shoal.model.registry import model_class
from shoal.model.weights import load_weights
from shoal.runner.model_runner import KVCacheSpec, ModelRunner, forward_batch
from shoal.types import ScheduledSeq, StepPlan
from conftest import require_native_kernels
from tiny_models import ARCHS, make_tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


@pytest.fixture(scope="module", params=sorted(ARCHS))
def tiny(request, tmp_path_factory):
    path = make_tiny_model(request.param, tmp_path_factory.mktemp(request.param))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, path, hf


def build_runner(path, num_blocks=64, block_size=4, attention="invariant", max_positions=512):
    ckpt = load_checkpoint(str(path), progress=False)
    model = model_class(ckpt.hf_config.architectures)(ckpt.hf_config, max_positions)
    load_weights(model, ckpt.state_dict)
    model.eval()
    return ModelRunner(model, KVCacheSpec(num_blocks, block_size, 0, torch.float32), ckpt.eos_token_ids, torch.device("cpu"),
                       torch.float32, attention)


@torch.inference_mode()
def step_logits(runner, seqs: list[ScheduledSeq]) -> torch.Tensor:
    """Hidden states -> logits for every token of the step, in plan order (decodes first)."""
    batch, _ = forward_batch(StepPlan(tuple(seqs)))
    return runner.model.compute_logits(runner.forward(batch))


@torch.inference_mode()
def hf_logits(hf, ids):
    return hf(torch.tensor([ids])).logits[0]


def test_chunked_prefill_and_batched_decode_match_transformers(tiny):
    arch, path, hf = tiny
    runner = build_runner(path)
    a = [5, 17, 99, 23, 8, 200, 150, 3, 44, 61, 77, 12, 300]
    b = [9, 9, 41, 250, 7]
    ref_a, ref_b = hf_logits(hf, a), hf_logits(hf, b)
    A, B = (0, 1, 2, 3, 4), (10, 11)  # block tables (block_size 4)

    # Prefill a in chunks of 5, 5 and 2 (the last starting mid-block), b in one.
    got = [step_logits(runner, [ScheduledSeq(1, tuple(a[0:5]), 0, A, False, GREEDY)])]
    got.append(step_logits(runner, [ScheduledSeq(1, tuple(a[5:10]), 5, A, False, GREEDY), ScheduledSeq(2, tuple(b[:4]), 0, B, False, GREEDY)]))
    got_a = torch.cat([got[0], got[1][:5], step_logits(runner, [ScheduledSeq(1, tuple(a[10:12]), 10, A, False, GREEDY)])])
    torch.testing.assert_close(got_a, ref_a[:12], atol=1e-4, rtol=0)
    torch.testing.assert_close(got[1][5:], ref_b[:4], atol=1e-4, rtol=0)

    # Decode both together: one query each, different context lengths.
    out = step_logits(runner, [ScheduledSeq(1, (a[12],), 12, A, True, GREEDY), ScheduledSeq(2, (b[4],), 4, B, True, GREEDY)])
    torch.testing.assert_close(out[0], ref_a[12], atol=1e-4, rtol=0)
    torch.testing.assert_close(out[1], ref_b[4], atol=1e-4, rtol=0)


def test_greedy_generation_matches_transformers_generate(tiny):
    arch, path, hf = tiny
    llm = LLM(str(path), dtype="float32", num_blocks=64, block_size=4, max_model_len=64, max_num_batched_tokens=8, check_integrity=True)
    prompts = [[5, 17, 99, 23, 8, 200, 150, 3, 44, 61, 77], [9, 41], [300, 301, 2, 7, 7, 7]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(prompts, params)
    for ids, out in zip(prompts, outs):
        ref = hf.generate(
            torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0, min_new_tokens=12
        )[0, len(ids) :].tolist()
        assert out.outputs[0].token_ids == ref, arch


def test_rope_scaling_as_configured_matches_transformers(tmp_path):
    rope = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    path = make_tiny_model("llama", tmp_path, rope_parameters=rope)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    runner = build_runner(path)
    ids = list(range(3, 40))
    got = step_logits(runner, [ScheduledSeq(1, tuple(ids), 0, tuple(range(10)), True, GREEDY)])
    torch.testing.assert_close(got, hf_logits(hf, ids), atol=1e-4, rtol=0)
    # And the scaling is really applied: unscaled rope gives different logits.
    plain = build_runner(make_tiny_model("llama", tmp_path / "plain"))
    assert (step_logits(plain, [ScheduledSeq(1, tuple(ids), 0, tuple(range(10)), True, GREEDY)]) - got).abs().max() > 1e-3


def test_unknown_architecture_is_a_clear_error():
    with pytest.raises(ValueError, match="unsupported architecture.*LlamaForCausalLM"):
        model_class(["GPTNeoXForCausalLM"])


def test_mistral_sliding_window_matches_transformers(tmp_path):
    path = make_tiny_model("mistral", tmp_path, sliding_window=6)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    runner = build_runner(path)
    assert runner.config.sliding_window == 6
    ids = [(11 * i) % 390 + 5 for i in range(20)]
    bt = tuple(range(6))
    prefill = step_logits(runner, [ScheduledSeq(1, tuple(ids[:19]), 0, bt, False, GREEDY)])
    decode = step_logits(runner, [ScheduledSeq(1, (ids[19],), 19, bt, True, GREEDY)])
    ref = hf_logits(hf, ids)
    torch.testing.assert_close(torch.cat([prefill, decode]), ref, atol=1e-4, rtol=0)
    full = build_runner(make_tiny_model("mistral", tmp_path / "full"))  # same weights, no window
    assert (step_logits(full, [ScheduledSeq(1, tuple(ids), 0, bt, True, GREEDY)])[-1] - ref[-1]).abs().max() > 1e-3


def test_auto_dtype_is_bfloat16_only_where_the_cpu_multiplies_it_natively(monkeypatch, tiny_llama_path):
    from shoal.runner.model_runner import resolve_dtype

    monkeypatch.delenv("SHOAL_CPU_ISA", raising=False)  # the CPU is the mocked one, whatever path the suite is forced onto
    cpu = torch.device("cpu")
    for avx512_bf16, amx, expected in [(True, False, torch.bfloat16), (False, True, torch.bfloat16), (False, False, torch.float32)]:
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v)
        assert resolve_dtype("auto", cpu) == expected
        assert resolve_dtype("float32", cpu) == torch.float32 and resolve_dtype("bfloat16", cpu) == torch.bfloat16
        # the engine builds its weights in the resolved dtype, and its KV cache too, but in bfloat16 where that is
        # float32 (float weights: kv_cache_dtype auto, runner/model_runner.resolve_kv_dtype)
        llm = LLM(str(tiny_llama_path), device="cpu", num_blocks=16, block_size=4, max_model_len=32)
        assert llm.engine.runner.kv.dtype == torch.bfloat16
        assert next(llm.engine.runner.model.parameters()).dtype == expected
        explicit = LLM(str(tiny_llama_path), device="cpu", dtype="float32", num_blocks=16, block_size=4, max_model_len=32)
        assert explicit.engine.runner.kv.dtype == torch.float32  # a --dtype given keeps its cache
    # a process forced onto the AVX2 path runs as an AVX2 CPU does: float32, though this one has bf16 (shoal/kernels)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    monkeypatch.setenv("SHOAL_CPU_ISA", "avx2")
    assert resolve_dtype("auto", cpu) == torch.float32
    monkeypatch.setenv("SHOAL_CPU_ISA", "avx512")
    assert resolve_dtype("auto", cpu) == torch.bfloat16


def test_auto_dtype_is_float32_for_low_bit_codes_on_the_native_kernels(monkeypatch, default_gguf_path, tiny_llama_path):
    """The native low-bit kernels round each activation row to int8 themselves; bfloat16 activations beneath that
    rounding derailed the default model on a CPU with native bf16 (tests/test_server_real_model.py's question was
    answered in French). So `--dtype auto` is float32 there, and bfloat16 stays for float weights, where it pays."""
    require_native_kernels()
    monkeypatch.delenv("SHOAL_CPU_ISA", raising=False)  # the CPU is the mocked one, whatever path the suite is forced onto
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    cpu = torch.device("cpu")
    gguf, reader = str(default_gguf_path), open_gguf(default_gguf_path)
    assert open_gguf(tiny_llama_path) is None  # a Hugging Face folder
    assert planned_weight_format("auto", reader) == "gguf" and planned_weight_format("auto", None) == "none"
    assert planned_weight_format("int8", None) == "int8"
    assert engine_dtype(EngineConfig(model=gguf), cpu, reader) == torch.float32
    assert engine_dtype(EngineConfig(model=gguf, quantization="none"), cpu, reader) == torch.bfloat16
    assert engine_dtype(EngineConfig(model=gguf, dtype="bfloat16"), cpu, reader) == torch.bfloat16  # asked for: given
    assert engine_dtype(EngineConfig(model=str(tiny_llama_path)), cpu) == torch.bfloat16
    assert engine_dtype(EngineConfig(model=str(tiny_llama_path), quantization="int4"), cpu) == torch.float32


def test_bfloat16_runs_with_bfloat16_weights_and_kv(tmp_path):
    path = str(make_tiny_model("llama", tmp_path))
    llm32 = LLM(path, dtype="float32", num_blocks=64, block_size=4, max_model_len=64)
    llm16 = LLM(path, dtype="bfloat16", num_blocks=64, block_size=4, max_model_len=64)
    assert llm16.engine.runner.kv.dtype == torch.bfloat16
    assert next(llm16.engine.runner.model.parameters()).dtype == torch.bfloat16
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5, ignore_eos=True)
    p = [5, 17, 99, 23, 8, 200]
    a = llm32.generate([p], params)[0].outputs[0].logprobs[0]
    b = llm16.generate([p], params)[0].outputs[0].logprobs[0]
    # bf16 has ~3 significant digits: the top tokens agree and logprobs are close, not equal.
    assert a.top[0].token_id == b.top[0].token_id
    assert abs(a.logprob - b.logprob) < 0.05 and a.logprob != b.logprob


def test_bound_attributes_are_the_registered_tensors_and_change_nothing(tmp_path):
    """The engine copies every module's parameters, buffers and submodules into its instance dict (fast lookups
    in forward): they must be the very objects nn.Module registered, and the logits must not change."""
    from shoal.model.layers import Layer, bind_attributes

    runner = build_runner(make_tiny_model("llama", tmp_path))
    seq = [ScheduledSeq(1, (5, 17, 99, 23, 8), 0, (0, 1), True, GREEDY)]
    before = step_logits(runner, seq)
    bind_attributes(runner.model)
    for m in runner.model.modules():
        for registry in (m._modules, m._parameters, m._buffers):
            for name, value in registry.items():
                assert m.__dict__[name] is value
        if isinstance(m, Layer):
            assert type(m).__call__ is type(m).forward  # no hook dispatch on the hot path
    assert torch.equal(step_logits(runner, seq), before)

