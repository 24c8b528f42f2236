"""A GGUF's weight types on shoal's kernels (model/formats.py, kernels/kquants.cpp), checked against gguf-py and
llama.cpp's own blocks.

- Layout: for every type, shoal's packing read back gives gguf-py's `dequantize` bit for bit, on blocks
  llama-quantize wrote (tests/fixtures, how they were made is in make_gguf_fixtures.py) and on random blocks,
  which reach every bit pattern of the scales: Q4_K/Q5_K's 6-bit scales and minimums with their high bits,
  Q5_K's shared fifth bits, Q6_K's signed scales, negative super-block scales.
- Kernels: each type's matmul against a float64 sum over the same rounded activations (ggml's Q8_0 or Q8_K,
  emulated here), and within the rounding's error of the unrounded product; the same bits on every
  instruction set and for a row alone or among others; rows 1, 7, 32 and 512.
- Files: a Q4_K_M and a Q5_K_M file of a tiny Llama load every tensor in its own type, hold no float copy of a
  quantized weight, and follow transformers' greedy tokens on the same (dequantized) weights.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers

from shoal import LLM, SamplingParams, kernels
from shoal.model.formats import NATIVE, GGUFEmbedding, GGUFLinear, QuantTensor

from conftest import require_native_kernels

T = gguf.GGMLQuantizationType
FIXTURES = Path(__file__).parent / "fixtures"
MIXES = {"Q4_K_M": FIXTURES / "tiny-llama-Q4_K_M.gguf", "Q5_K_M": FIXTURES / "tiny-llama-Q5_K_M.gguf"}
TYPES = sorted(NATIVE, key=int)
_FLAGS = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()
ISAS = [level for level, flag in ((3, "avx512_vnni"), (2, "avx2"), (1, None)) if flag is None or flag in _FLAGS]  # best first


@pytest.fixture(autouse=True)
def _native_kernels():
    require_native_kernels()


def _bits(a) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a, dtype=np.float32)).view(np.uint32)


def _unpacked(qt: QuantTensor) -> torch.Tensor:
    fmt = NATIVE[qt.type]
    packed = fmt.pack(qt.data, qt.cols)
    return fmt.rows(packed, torch.arange(qt.shape[0]), qt.cols)


def random_blocks(t, rows: int, cols: int, seed: int = 0) -> QuantTensor:
    """Random bytes as `t`'s blocks (every code, scale and minimum pattern), with float16 scales drawn from a
    normal law: half of them negative, none a NaN or infinity."""
    rng = np.random.default_rng(seed)
    block, size = gguf.GGML_QUANT_SIZES[t]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    halves = {T.Q6_K: (208,), T.Q4_1: (0, 2), T.Q5_1: (0, 2), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q3_K: (108,),
              T.Q2_K: (80, 82)}.get(t, (0,))
    for offset in halves:
        raw[..., offset : offset + 2] = (rng.standard_normal(raw.shape[:2]) * 0.01).astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)
    return QuantTensor(t, torch.from_numpy(raw.reshape(rows, -1)), cols)


def fixture_tensors() -> list[tuple[str, QuantTensor]]:
    out = []
    for mix, path in MIXES.items():
        for t in gguf.GGUFReader(path).tensors:
            if t.tensor_type in NATIVE:
                out.append((f"{mix}:{t.name}", QuantTensor.of(t)))
    return out


# ---------------------------------------------------------------- layout


def test_the_fixtures_hold_every_type_a_k_quant_file_mixes():
    assert {qt.type for _, qt in fixture_tensors()} == {T.Q4_K, T.Q5_K, T.Q6_K, T.Q5_0, T.Q5_1, T.Q8_0}


@pytest.mark.parametrize("name,qt", fixture_tensors(), ids=lambda v: v if isinstance(v, str) else "")
def test_llama_quantize_blocks_unpack_as_gguf_py_dequantizes_them(name, qt):
    np.testing.assert_array_equal(_bits(_unpacked(qt)), _bits(qt.dequantized()), err_msg=name)


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_random_blocks_unpack_as_gguf_py_dequantizes_them(t):
    qt = random_blocks(t, rows=37, cols=1024)  # 37 rows: the last panel of 16 is partly empty
    np.testing.assert_array_equal(_bits(_unpacked(qt)), _bits(qt.dequantized()))
    size = gguf.GGML_QUANT_SIZES[t][1]
    blocks = qt.data.numpy().reshape(-1, size)
    d = blocks[:, 208:210] if t == T.Q6_K else blocks[:, :2]
    assert (d.copy().view(np.float16) < 0).any()  # negative (super-)block scales were in the draw
    if t in (T.Q4_K, T.Q5_K):  # scales and minimums of blocks 4-7 take their high bits from bytes 0-7
        assert (blocks[:, 4:12] >= 64).any() and (blocks[:, 12:16] >= 16).any()


@pytest.mark.parametrize("t", [T.Q4_0, T.Q4_1, T.Q8_0], ids=lambda t: t.name)
def test_packing_from_the_file_gives_the_bytes_the_q4_q8_packers_give(t):
    """The 32-weight types packed from the file's blocks (C++) and from their codes (model/quant.py) agree byte for
    byte, so a file's Q4 projections run on the same bits as before."""
    from shoal.model.gguf_loader import q4_codes
    from shoal.model.quant import pack_q4, pack_q8, round_q8

    w = torch.randn(40, 256)
    qt = QuantTensor(t, torch.from_numpy(gguf.quants.quantize(w.numpy(), t)), 256)
    ours = NATIVE[t].pack(qt.data, 256)
    if t == T.Q8_0:
        theirs = pack_q8(*round_q8(qt.dequantized()))
    else:
        part = type("Part", (), {"tensor_type": t, "shape": (256, 40), "data": qt.data.numpy()})
        theirs = pack_q4(q4_codes(part))
    assert torch.equal(ours, theirs)


# ---------------------------------------------------------------- kernels


def round_activations(x: torch.Tensor, fmt) -> torch.Tensor:
    """x as the kernel rounds it, dequantized in float64: ggml's Q8_0 (32 inputs a scale, amax / 127) or Q8_K
    (256 inputs a scale, 1 / (127 / amax)), codes rounded to nearest even."""
    n = 256 if fmt.activations == "Q8_K" else 32
    g = x.float().view(x.shape[0], -1, n)
    amax = g.abs().amax(-1, keepdim=True)
    full = partial(torch.full_like, amax)  # tensor / tensor: `127.0 / t` is 127 times t's reciprocal, not a division
    iscale = torch.where(amax > 0, full(127.0) / amax, full(0.0))
    codes = torch.round(iscale * g)
    if fmt.activations == "Q8_K":
        d = torch.where(amax > 0, full(1.0) / iscale, full(0.0))
    else:
        d = amax / full(127.0)
    return (codes.double() * d.double()).view(x.shape)


def block_minimums(qt: QuantTensor) -> torch.Tensor:
    """Per weight, the part of it the kernels multiply by the unrounded activations' sum: the block minimum m of
    Q4_1 and Q5_1 (and Q4_0's -8 d), as lowbit.cpp does; zero for the others, whose products all see the
    rounded activations."""
    rows, cols = qt.shape
    if qt.type not in (T.Q4_0, T.Q4_1, T.Q5_1):
        return torch.zeros(rows, cols, dtype=torch.float64)
    blocks = qt.data.numpy().reshape(rows, cols // 32, -1)
    if qt.type == T.Q4_0:
        m = -8.0 * blocks[..., :2].copy().view(np.float16).astype(np.float64)
    else:
        m = blocks[..., 2:4].copy().view(np.float16).astype(np.float64)
    return torch.from_numpy(np.repeat(m[..., 0], 32, axis=1))


def _linear(fmt, x, packed, rows, isa, rule=0):
    """fmt.linear on instruction-set level `isa`, one or two rows read by `rule` (kernels.use_rows_rule)."""
    kernels.use_isa(isa)
    kernels.use_rows_rule(rule)
    try:
        return fmt.linear(x, packed, rows)
    finally:
        kernels.use_isa(ISAS[0])
        kernels.use_rows_rule(0)


# every path: each instruction set, and on VNNI both ways of reading few rows' weights (AMD's a panel at a time,
# Intel's two a pass), whichever this CPU takes
PATHS = [(isa, rule) for isa in ISAS for rule in ((1, 2) if isa == 3 else (0,))]


@pytest.mark.parametrize("t", [gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q5_0], ids=["Q4_K", "Q5_0"])
def test_parts_pack_straight_into_their_panels(t):
    """formats.pack_run: parts that end on a panel pack each into its own panels, with the bytes of packing them
    joined; a part that does not (20 rows) joins them first; the last part may end inside a panel (7 rows)."""
    from shoal.model.formats import pack_run

    fmt = NATIVE[t]
    for rows in ((32, 16, 48), (32, 16, 7), (20, 16, 32)):
        blocks = [random_blocks(t, n, 256, seed=i + 10 * n).data for i, n in enumerate(rows)]
        joined = fmt.pack(torch.cat(blocks), 256)
        assert torch.equal(pack_run(fmt, blocks, 256), joined), rows
        out = torch.full_like(joined, 7)
        assert pack_run(fmt, blocks, 256, out=out) is out and torch.equal(out, joined), rows


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_each_type_multiplies_like_a_float_sum_over_its_rounded_activations(t):
    fmt = NATIVE[t]
    rows, cols = 37, 768  # three super-blocks, 24 blocks of 32
    qt = random_blocks(t, rows, cols, seed=int(t))
    w = qt.dequantized().double()
    packed = fmt.pack(qt.data, cols)
    gen = torch.Generator().manual_seed(0)
    for m in (1, 7, 32, 512):
        x = torch.randn(m, cols, generator=gen) * torch.linspace(0.1, 3, cols)  # blocks of different ranges
        x[0, :256] = 0.0  # an all-zero super-block
        y = fmt.linear(x, packed, rows)
        assert y.dtype == torch.float32 and y.shape == (m, rows)
        low = block_minimums(qt)  # what the integer sums and scales add up to
        exact = round_activations(x, fmt) @ (w - low).T + x.double() @ low.T
        scale = (x.double().abs() @ w.abs().T).clamp(min=1e-30)
        assert ((y.double() - exact).abs() / scale).max() < 1e-5, f"{t.name}, {m} rows"
        # and the rounding of the activations is all that separates it from the unrounded product
        assert ((y.double() - x.double() @ w.T).abs() / scale).max() < 0.02, f"{t.name}, {m} rows"


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_every_instruction_set_and_any_batch_give_the_same_bits(t):
    fmt = NATIVE[t]
    rows, cols = 53, 512
    qt = random_blocks(t, rows, cols, seed=7)
    packed = fmt.pack(qt.data, cols)
    x = torch.randn(512, cols, generator=torch.Generator().manual_seed(1))
    for m in (1, 2, 7, 32, 512):
        ys = [_linear(fmt, x[:m], packed, rows, *path) for path in PATHS]
        for path, y in zip(PATHS[1:], ys[1:]):
            assert torch.equal(y, ys[0]), f"{t.name}: level and rule {path} differ from {PATHS[0]} at {m} rows"
        alone = [_linear(fmt, x[i : i + 1], packed, rows, *PATHS[-1]) for i in (0, m // 2, m - 1)]
        assert all(torch.equal(a[0], ys[0][i]) for a, i in zip(alone, (0, m // 2, m - 1)))


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_bfloat16_activations_and_a_nan_stay_in_their_row(t):
    fmt = NATIVE[t]
    qt = random_blocks(t, 16, 256, seed=3)
    packed = fmt.pack(qt.data, 256)
    x = torch.randn(3, 256)
    x[1, 5] = float("nan")
    y = fmt.linear(x.bfloat16(), packed, 16)
    assert y.dtype == torch.bfloat16
    assert y[1].isnan().all() and y[[0, 2]].isfinite().all()
    assert torch.equal(y[0], fmt.linear(x[:1].bfloat16(), packed, 16)[0])


# ---------------------------------------------------------------- files


@pytest.fixture(scope="module", params=list(MIXES))
def mixed(request):
    return request.param, LLM(str(MIXES[request.param]), num_blocks=256, max_model_len=512)


def test_a_mixed_file_keeps_every_tensor_in_its_own_type(mixed):
    mix, llm = mixed
    reader = gguf.GGUFReader(MIXES[mix])
    stored = {t.name: t.tensor_type.name for t in reader.tensors}
    model = llm.engine.runner.model
    assert llm.engine.facts.weight_format == "gguf" and llm.engine.runner.attention.name == "invariant"
    for i, layer in enumerate(model.model.layers):
        qkv = [stored[f"blk.{i}.attn_{k}.weight"] for k in "qkv"]
        runs = [qkv[0]] + [b for a, b in zip(qkv, qkv[1:]) if a != b]  # adjacent parts of one type share a kernel call
        assert layer.self_attn.qkv_proj.formats == tuple(runs)
        assert layer.self_attn.o_proj.formats == (stored[f"blk.{i}.attn_output.weight"],)
        assert layer.mlp.down_proj.formats == (stored[f"blk.{i}.ffn_down.weight"],)
    assert isinstance(model.model.embed_tokens, GGUFEmbedding)
    assert model.model.embed_tokens.formats == (stored["token_embd.weight"],)
    assert model.logits_head.formats == (stored["output.weight"],)
    # no float copy of a quantized weight: the float tensors left are the norms (and the rotary tables)
    floats = [(n, t.numel()) for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_floating_point()]
    assert all(n.endswith("norm.weight") or ".rotaries." in n for n, _ in floats), floats
    packed = sum(b.numel() for m in model.modules() if isinstance(m, GGUFLinear) for n, b in m.named_buffers(recurse=False))
    weights = sum(t.n_bytes for t in reader.tensors if t.tensor_type in NATIVE)
    assert weights < packed < 1.05 * weights  # the file's bytes, give or take the unpacked scales and the panels' padding


def test_a_mixed_file_follows_transformers_on_the_same_weights(mixed):
    """Greedy tokens against transformers' own GGUF loading (gguf-py's dequantized weights) in float32: the same
    tokens where the activations' rounding does not tip a near tie (the top-5 rule at a first difference)."""
    from test_real_model import _hf_greedy_along

    mix, llm = mixed
    hf = transformers.AutoModelForCausalLM.from_pretrained(MIXES[mix].parent, gguf_file=MIXES[mix].name, dtype=torch.float32).eval()
    prompts = [[(7 * i + 13 * j * j) % 380 + 5 for i in range(n)] for j, n in enumerate((3, 17, 40, 77))]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, logprobs=5, ignore_eos=True))
    exact = 0
    with torch.inference_mode():
        for ids, out in zip(prompts, outs):
            ours = out.outputs[0]
            ref, ref_top5 = _hf_greedy_along(hf, ids, ours.token_ids)
            if ours.token_ids == ref:
                exact += 1
                continue
            i = next(k for k, (a, b) in enumerate(zip(ours.token_ids, ref)) if a != b)
            assert ours.token_ids[i] in ref_top5[i] and ref[i] in [t.token_id for t in ours.logprobs[i].top], (mix, ids)
    assert exact >= 2, f"{mix}: only {exact} of {len(prompts)} prompts matched to the end"


def test_the_first_token_logprobs_follow_transformers(mixed):
    """Next-token log-probabilities over the whole vocabulary after a prompt, against transformers on the
    dequantized weights: close, as the activations' rounding to 8 bits allows."""
    mix, llm = mixed
    hf = transformers.AutoModelForCausalLM.from_pretrained(MIXES[mix].parent, gguf_file=MIXES[mix].name, dtype=torch.float32).eval()
    ids = [(7 * i + 5) % 380 + 5 for i in range(30)]
    out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))[0]
    ours = torch.tensor([p.logprob for p in out.prompt_logprobs[1:]])
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    want = torch.tensor([ref[i - 1, ids[i]].item() for i in range(1, len(ids))])
    assert (ours - want).abs().max() < 0.05 * want.abs().max()


# ---------------------------------------------------------------- memory

_LOAD_PEAK = """
import gc, resource, sys
from shoal import LLM
# a first, tiny load: what any first load imports and allocates once (transformers' config and tokenizer modules,
# the BLAS's buffers) is then in the baseline, not in the figure
LLM(sys.argv[2], num_blocks=16, max_model_len=64, speculative="off").close()
gc.collect()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
llm = LLM(sys.argv[1], num_blocks=16, max_model_len=64, speculative="off")
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
weights = sum(b.numel() for n, b in llm.engine.runner.model.named_buffers() if "packed" in n)
print(before * 1024, after * 1024, weights)
"""


def write_byte_vocab(writer: gguf.GGUFWriter, vocab: int) -> None:
    """A byte-level BPE vocabulary of `vocab` single-character tokens (no merges), token 0 the end of text."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list([chr(0x100 + i) if i >= 256 else bytes([i]).decode("latin-1") for i in range(vocab)])
    writer.add_token_types([gguf.TokenType.NORMAL] * vocab)
    writer.add_eos_token_id(0)


def write_random_llama(path: Path, hidden: int, layers: int, vocab: int, t=T.Q4_K) -> None:
    """A Llama GGUF of random `t` blocks (sane float16 scales), written directly: no float model behind it."""
    writer = gguf.GGUFWriter(str(path), "llama")
    inter, heads = 4 * hidden, hidden // 64
    for key, value in (("context_length", 64), ("embedding_length", hidden), ("block_count", layers),
                       ("feed_forward_length", inter), ("attention.head_count", heads), ("attention.head_count_kv", heads)):
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    write_byte_vocab(writer, vocab)

    def add(name, rows, cols):
        writer.add_tensor(name, random_blocks(t, rows, cols, seed=len(name) + rows).data.numpy(), raw_dtype=t)

    add("token_embd.weight", vocab, hidden)
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(layers):
        for name, rows, cols in (("attn_q", hidden, hidden), ("attn_k", hidden, hidden), ("attn_v", hidden, hidden),
                                 ("attn_output", hidden, hidden), ("ffn_gate", inter, hidden), ("ffn_up", inter, hidden),
                                 ("ffn_down", hidden, inter)):
            add(f"blk.{i}.{name}.weight", rows, cols)
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", np.ones(hidden, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_load_peaks_near_the_file_size_with_no_float_copy(tmp_path):
    """Peak RSS while a 77 MB Q4_K file loads grows by the packed weights and little more: each tensor's blocks are
    read from the memory map once, packed, and their pages dropped (formats.release), and nothing is ever
    dequantized to float. Measured: 1.2x the file under pytest, 1.6x in a plain shell (the allocator's kept
    temporaries differ); with the file's pages held to the end, 2.0x and 2.6x; a float32 copy would be 7x."""
    import subprocess
    import sys

    path = tmp_path / "q4k.gguf"
    write_random_llama(path, hidden=1024, layers=8, vocab=2048)
    size = path.stat().st_size
    out = subprocess.run([sys.executable, "-c", _LOAD_PEAK, str(path), str(MIXES["Q4_K_M"])], capture_output=True, text=True, timeout=600,
                         cwd=Path(__file__).parent.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    before, after, weights = map(int, out.stdout.split()[-3:])
    assert size < weights < 1.05 * size  # the weights held: the file's bytes
    assert after - before < 1.75 * size, f"peak grew by {(after - before) / 1e6:.0f} MB for a {size / 1e6:.0f} MB file"


def test_a_type_without_a_kernel_loads_rounded_to_q8_0(tmp_path, caplog):
    """Q2_K and Q3_K tensors load: dequantized by gguf-py one tensor at a time and rounded to Q8_0, within Q8_0's
    rounding of the file's weights, with one log line naming them."""
    import logging

    for t in (T.Q3_K, T.Q2_K):
        path = tmp_path / f"{t.name}.gguf"
        write_random_llama(path, hidden=256, layers=1, vocab=256, t=t)
        with caplog.at_level(logging.INFO, logger="shoal.loader"):
            llm = LLM(str(path), num_blocks=16, max_model_len=64)
        assert f"{t.name} x 8 have no kernel here" in caplog.text
        model = llm.engine.runner.model
        layer = model.model.layers[0].mlp.down_proj
        assert layer.formats == ("Q8_0",) and model.logits_head.formats == ("Q8_0",)
        stored = QuantTensor.of(next(x for x in gguf.GGUFReader(path).tensors if x.name == "blk.0.ffn_down.weight")).dequantized()
        want = gguf.quants.dequantize(gguf.quants.quantize(stored.numpy(), T.Q8_0), T.Q8_0)  # ggml's own Q8_0 rounding
        np.testing.assert_array_equal(_bits(layer.dequantized()), _bits(want))
        assert (layer.dequantized() - stored).abs().max() < 0.01 * stored.abs().max()
