"""shoal's low-bit matmuls (`shoal/kernels/lowbit.cpp`, packed by `model/quant.py`) on their own.

- packing: codes and float16 scales come back out of the panels exactly, for sizes that are
  not multiples of the panel;
- the kernels compute exactly the arithmetic lowbit.cpp describes (activations rounded to
  int8 per block of 32, exact integer sums, one float32 sum per output in block order):
  checked against that arithmetic in float64, on every code path this CPU has;
- every code path gives the same bits (integer sums are exact, the float operations are
  the same), each row gives the same bits alone and in any batch (1 to 64 rows), in
  float32, bfloat16 and float16;
- and the result is close to the float product with the dequantized weights.
How the model uses them is tests/test_quant.py.
"""

from __future__ import annotations

import pytest
import torch

from shoal import kernels
from shoal.model.gguf_loader import Q4Codes
from shoal.model.quant import pack_q4, pack_q8, round_q8, unpack_q4, unpack_q8

from conftest import require_native_kernels

# (outputs, inputs): the model's shapes, odd output counts, one block of inputs
SHAPES = [(960, 576), (17, 64), (33, 32), (576, 1536), (5, 96)]
ROWS = [1, 2, 3, 4, 5, 7, 16, 33, 64]


@pytest.fixture(scope="module", autouse=True)
def native():
    require_native_kernels()


def q4_weights(n: int, k: int, seed: int) -> Q4Codes:
    g = torch.Generator().manual_seed(seed)
    scale = (torch.rand(n, k // 32, generator=g) * 0.02).half().float()
    low = (-torch.rand(n, k // 32, generator=g) * 0.15).half().float()
    return Q4Codes(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8), scale, low)


def q8_weights(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8), (torch.rand(n, k // 32, generator=g) * 0.01).half().float()


def rounded_activations(x: torch.Tensor):
    """lowbit.cpp's rounding of each block of 32: codes, scale amax / 127, and the exact block sums."""
    xb = x.float().view(x.shape[0], -1, 32)
    amax = xb.abs().amax(-1)
    # tensor / tensor: IEEE division (a scalar numerator goes through a reciprocal, rounded twice)
    inv = torch.where(amax > 1e-30, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(xb * inv[..., None]).clamp(-127, 127)
    return q.double(), (amax / 127.0).double(), xb.double().sum(-1)


def model_q4(x: torch.Tensor, w: Q4Codes) -> torch.Tensor:
    q, d, s = rounded_activations(x)
    c = w.codes.double().view(w.codes.shape[0], -1, 32)
    return torch.einsum("mbk,nbk,nb,mb->mn", q, c, w.scale.double(), d) + torch.einsum("nb,mb->mn", w.low.double(), s)


def model_q8(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    q, d, _ = rounded_activations(x)
    return torch.einsum("mbk,nbk,nb,mb->mn", q, codes.double().view(codes.shape[0], -1, 32), scale.double(), d)


def every_path(fn):
    """fn() on each matmul path this CPU has (VNNI, AVX2, SSE2), each path once; on VNNI with both rules for one or
    two rows (kernels.use_rows_rule: AVX2's kernels a panel at a time, as on AMD, or VNNI's two a pass)."""
    out, seen = {}, set()
    try:
        for level in (3, 2, 1):
            kernels.use_isa(level)
            path = int(torch.ops.shoal_kernels.matmul_isa())
            if path not in seen:
                seen.add(path)
                for rule in (1, 2) if path == 3 else (0,):
                    kernels.use_rows_rule(rule)
                    out[(path, rule)] = fn()
    finally:
        kernels.use_isa(0)
        kernels.use_rows_rule(0)
    return out


def assert_every_path_computes_the_model(x, w4: Q4Codes, c8, s8, tol: float) -> None:
    """q4_linear and q8_linear of x give the same bits on every path, in x's dtype, and are within tol (of the
    largest output) of the float64 model of their arithmetic."""
    n = w4.codes.shape[0]
    p4, p8 = pack_q4(w4), pack_q8(c8, s8)
    outs = every_path(lambda: (torch.ops.shoal_kernels.q4_linear(x, p4, n), torch.ops.shoal_kernels.q8_linear(x, p8, n)))
    first = next(iter(outs.values()))
    for path, (y4, y8) in outs.items():
        assert y4.dtype == x.dtype and y4.shape == (x.shape[0], n)
        assert torch.equal(y4, first[0]) and torch.equal(y8, first[1]), f"path {path} differs"
    for got, want in ((first[0], model_q4(x, w4)), (first[1], model_q8(x, c8, s8))):
        assert ((got.double() - want).abs() <= tol * want.abs().amax()).all()


@pytest.mark.parametrize("n,k", SHAPES)
def test_packing_keeps_codes_and_float16_scales_exactly(n, k):
    w = q4_weights(n, k, 0)
    back = unpack_q4(pack_q4(w), n)
    assert torch.equal(back.codes, w.codes) and torch.equal(back.scale, w.scale) and torch.equal(back.low, w.low)
    assert pack_q4(w).shape == (-(-n // 16), k // 32, 320)
    codes, scale = q8_weights(n, k, 1)
    got_codes, got_scale = unpack_q8(pack_q8(codes, scale), n)
    assert torch.equal(got_codes, codes) and torch.equal(got_scale, scale)


def test_q8_rounding_gives_a_q8_0_tensor_its_own_codes_back():
    codes, scale = q8_weights(40, 96, 2)
    codes[:, ::32] = 127  # ggml's Q8_0: every block reaches +-127
    dequantized = (codes.float().view(40, 3, 32) * scale[..., None]).view(40, 96)
    again, again_scale = round_q8(dequantized)
    assert torch.equal(again, codes) and torch.equal(again_scale, scale)


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernels_compute_the_described_arithmetic_on_every_path_with_the_same_bits(n, k, dtype):
    w4 = q4_weights(n, k, 3)
    c8, s8 = q8_weights(n, k, 4)
    x = (torch.randn(max(ROWS), k, generator=torch.Generator().manual_seed(5)) * 2).to(dtype)
    x[3, :32] = 0  # an all-zero block: scale 0, no division by it
    tol = {torch.float32: 2e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]  # float32 sums; the output's rounding
    assert_every_path_computes_the_model(x, w4, c8, s8, tol)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5])
def test_integer_sums_at_their_bounds_stay_exact_on_every_path(rows):
    """Codes at the ends of their ranges and activations that round to +-127 everywhere. A Q4 block's int16 sums
    reach 8 * 2 * 15 * 127 = 30,480, and a Q8 pair sum 2 * 128 * 127 = 32,512: the int16 bounds of AVX2's
    vpmaddubsw pair sums and Q4 block sums, whatever order the compiler adds in. 1 to 5 rows take each row
    blocking (1 to 4)."""
    n, k = 40, 128
    g = torch.Generator().manual_seed(9)
    x = torch.where(torch.rand(rows, k, generator=g) < 0.3, -1.0, 1.0)  # |x| equal in a block: every code is +-127
    x[:, :32] = 1.0  # a block of one sign, against all-15 and all-(-128) codes: the largest sums
    codes4 = torch.full((n, k), 15, dtype=torch.uint8)
    codes4[1::2, 32:] = torch.randint(0, 16, (n // 2, k - 32), generator=g, dtype=torch.uint8)
    scale = (torch.rand(n, k // 32, generator=g) * 0.02 + 0.001).half().float()
    w4 = Q4Codes(codes4, scale, (-torch.rand(n, k // 32, generator=g) * 0.15).half().float())
    c8 = torch.full((n, k), 127, dtype=torch.int8)
    c8[1::2] = -128  # ggml's Q8_0 stores an int8, so -128 can occur in a file
    c8[2::4, 32:] = torch.randint(-128, 128, (n // 4, k - 32), generator=g, dtype=torch.int8)
    assert_every_path_computes_the_model(x, w4, c8, scale, 2e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_is_the_same_bits_alone_and_in_any_batch(dtype):
    n, k = 100, 192
    p4 = pack_q4(q4_weights(n, k, 6))
    p8 = pack_q8(*q8_weights(n, k, 7))
    x = torch.randn(max(ROWS), k, generator=torch.Generator().manual_seed(8)).to(dtype)
    for op, w in ((torch.ops.shoal_kernels.q4_linear, p4), (torch.ops.shoal_kernels.q8_linear, p8)):
        alone = torch.cat([op(x[i : i + 1], w, n) for i in range(x.shape[0])])
        for m in ROWS:
            assert torch.equal(op(x[:m], w, n), alone[:m]), m
        strided = torch.zeros(x.shape[0], 2 * k, dtype=dtype)
        strided[:, k:] = x
        assert torch.equal(op(strided[:, k:], w, n), alone)  # rows with a stride of their own


def test_close_to_the_float_product_with_the_dequantized_weights():
    n, k = 256, 576
    w4 = q4_weights(n, k, 9)
    c8, s8 = q8_weights(n, k, 10)
    x = torch.randn(8, k, generator=torch.Generator().manual_seed(11))
    for got, w in ((torch.ops.shoal_kernels.q4_linear(x, pack_q4(w4), n), w4.dequantized()),
                   (torch.ops.shoal_kernels.q8_linear(x, pack_q8(c8, s8), n), (c8.float().view(n, -1, 32) * s8[..., None]).view(n, k))):
        exact = x.double() @ w.double().T
        assert ((got.double() - exact).norm() / exact.norm()).item() < 0.01  # int8 activations: about 0.5%


def test_a_non_finite_input_makes_its_row_non_finite_and_leaves_the_others_alone():
    n, k = 40, 96
    p4, p8 = pack_q4(q4_weights(n, k, 13)), pack_q8(*q8_weights(n, k, 14))
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(15))
    x[1, 50], x[2, 3] = float("nan"), float("inf")
    for op, w in ((torch.ops.shoal_kernels.q4_linear, p4), (torch.ops.shoal_kernels.q8_linear, p8)):
        y = op(x, w, n)
        assert not y[1].isfinite().any() and not y[2].isfinite().any()
        assert y[0].isfinite().all() and torch.equal(y[3], op(x[3:], w, n)[0])


def test_bad_inputs_raise_instead_of_reading_out_of_bounds():
    p4 = pack_q4(q4_weights(32, 64, 12))
    with pytest.raises(RuntimeError, match="packed weights"):
        torch.ops.shoal_kernels.q4_linear(torch.randn(2, 96), p4, 32)  # inputs that do not match the panels
    with pytest.raises(RuntimeError, match="packed weights"):
        torch.ops.shoal_kernels.q4_linear(torch.randn(2, 64), p4, 48)  # more outputs than the panels hold
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.shoal_kernels.q8_linear(torch.randn(2, 40), p4, 32)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        torch.ops.shoal_kernels.q4_linear(torch.ones(2, 64, dtype=torch.int32), p4, 32)
    assert torch.ops.shoal_kernels.q4_linear(torch.randn(0, 64), p4, 32).shape == (0, 32)


def test_one_or_two_rows_read_their_weights_as_the_cpus_maker_streams_them_fastest():
    """On AVX-512 VNNI, an AMD CPU's one or two rows take AVX2's kernels, a panel at a time (a Zen 4 streams them
    40% faster), and other CPUs' the VNNI kernels, two panels a pass (an Intel Xeon streams those twice as fast);
    use_rows_rule forces either and 0 gives the CPU's back. The vendor comes from /proc/cpuinfo here, from CPUID there."""
    from pathlib import Path

    info = Path("/proc/cpuinfo")
    if not info.exists():
        pytest.skip("no /proc/cpuinfo to read the vendor from")
    vendor = next((line.split(":", 1)[1].strip() for line in info.read_text().splitlines() if line.startswith("vendor_id")), "")
    ops = torch.ops.shoal_kernels
    try:
        assert kernels.use_rows_rule(0) == (1 if vendor == "AuthenticAMD" else 2)
        vnni = int(ops.matmul_isa()) == 3
        assert kernels.use_rows_rule(1) == 1 and int(ops.one_row_isa()) == (2 if vnni else int(ops.matmul_isa()))
        assert kernels.use_rows_rule(2) == 2 and int(ops.one_row_isa()) == int(ops.matmul_isa())
        with pytest.raises(RuntimeError, match="use_rows_rule: 0"):
            kernels.use_rows_rule(3)
    finally:
        kernels.use_rows_rule(0)
