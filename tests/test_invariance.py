"""Batch invariance: a request's tokens and logprobs do not depend on what else the engine is doing.

A greedy (or seeded) request must give the same bits whether it runs alone, in a
batch, in small prefill chunks, after a prefix-cache hit (whole blocks shared or a
partial block copied), after preemption, or as one choice of several, in
bfloat16 as in float32. Logprobs are compared with `==`: they are the logits'
log_softmax, so equal logprobs are equal logits as far as they are reported.

Bottom up:
- the kernels: the invariant attention backend (a query's attention is the same
  as a lone decode, as a row of any prefill chunk, beside any other sequences,
  and close to a float32 reference), the linear
  layers (InvariantLinear, float32 MKL in strict mode, int8, int4: a row's output
  does not depend on the number of rows) and the sampler's logprobs;
- tiny random models of every architecture, in bfloat16, float16 and float32;
- the real default model (SmolLM2-135M GGUF) in bfloat16, and with int8 and int4
  weights: 24 chat prompts, 48 greedy tokens each, against each prompt run alone.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from shoal import LLM, SamplingParams  # first: shoal sets MKL's strict mode before torch computes anything
from shoal.model.attention.common import SeqSpan, cache_row, int8_views, quantize_rows, slot_mapping
from shoal.model.attention.invariant import InvariantAttention
from shoal.model.invariance import INVARIANT_K, NARROW, InvariantLinear, narrow_wide, pads_single_row, wide_dtype
from shoal.model.quant import Int4Linear, Int8Linear
from shoal.runner.model_runner import seeded_generator
from shoal.runner.sampler import SamplerRow, SamplingBatch, sample

from conftest import require_native_kernels
from tiny_models import ARCHS, make_tiny_model

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
DTYPE_IDS = ["bf16", "fp16", "fp32"]


# ---------------------------------------------------------------- attention kernel

BS = 16  # tokens per cache block
# (KV heads, query heads per KV head, head dim): SmolLM2's 9 query heads over 3 KV heads of 64, the tiny
# models' 4 over 2 of 16, and attention without grouping (a decode is then a single row).
HEADS = {"smollm2": (3, 3, 64), "gqa2": (2, 2, 16), "mha": (4, 1, 32)}
LENGTHS = (300, 17, 140, 1100, 64, 129)  # the world's sequences: 1100 keys reach past 512 and 1024
ATOL = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 1e-5}


class AttentionWorld:
    """Sequences whose key, value and query at every position are fixed, in one shuffled paged cache.

    `step` runs a mix of decodes and prefill chunks the way the runner lays them out
    (decodes first); `alone` runs one query as a lone decode over a cache of its own,
    where the sequence's later slots hold other numbers (in a real run they are not
    written yet); `reference` is the float32 attention of one query.
    """

    def __init__(self, heads: str, dtype: torch.dtype, window: int | None, native: bool, seed: int = 0,
                 kv_dtype: torch.dtype | None = None) -> None:
        """kv_dtype: what the cache holds (default: the activations' dtype; int8: codes and a scale per token and head)."""
        g = torch.Generator().manual_seed(seed)
        self.native = native
        self.kv_dtype = kv_dtype or dtype
        self.hkv, self.group, self.dim = HEADS[heads]
        self.dtype, self.window = dtype, window
        blocks = [-(-n // BS) for n in LENGTHS]
        perm = torch.randperm(sum(blocks), generator=g).tolist()
        self.tables = [tuple(perm[sum(blocks[:i]) : sum(blocks[: i + 1])]) for i in range(len(LENGTHS))]
        self.k = [torch.randn(n, self.hkv, self.dim, generator=g).to(dtype) for n in LENGTHS]
        self.v = [torch.randn(n, self.hkv, self.dim, generator=g).to(dtype) for n in LENGTHS]
        self.q = [torch.randn(n, self.hkv * self.group, self.dim, generator=g).to(dtype) for n in LENGTHS]
        self.backend = self._backend(null_block=sum(blocks))
        self.kv = self._cache(sum(blocks))
        for s, n in enumerate(LENGTHS):
            self._write(self.kv, s, n, self.tables[s])
        self.stale = self.kv * 3
        if self.kv_dtype == torch.int8:  # other codes (wrapped around), and other but finite scales
            self.stale = self.kv.clone()
            keys, values, scales = int8_views(self.stale, self.dim, transposed_keys=native)
            keys.mul_(3), values.mul_(-1), scales.mul_(3)
        self.scale = self.dim**-0.5
        self._alone: dict[tuple[int, int], torch.Tensor] = {}

    def _cache(self, num_blocks: int, fill: torch.Tensor | None = None) -> torch.Tensor:
        """A layer's cache as ModelRunner lays it out, [2, Hkv, num_blocks + 1, BS, D]: the last block is the
        null block (zeros); `fill` (any numbers) goes into the others."""
        kv = torch.zeros(2, self.hkv, num_blocks + 1, BS, cache_row(self.dim, self.kv_dtype), dtype=self.kv_dtype)
        if fill is not None:
            body = kv[:, :, :num_blocks]
            body.copy_(fill[:, :, :num_blocks] if self.kv_dtype == torch.int8 else fill.flatten()[: body.numel()].view_as(body))
        return kv

    def _backend(self, null_block: int):
        backend = InvariantAttention(block_size=BS, num_kv_heads=self.hkv, group_size=self.group, sliding_window=self.window,
                                     null_block=null_block, device=torch.device("cpu"), dtype=self.dtype, native=self.native)
        assert backend.native == self.native
        return backend

    def _write(self, kv: torch.Tensor, seq: int, upto: int, table: tuple[int, ...]) -> None:
        """Positions 0 .. upto - 1 of the sequence into the cache, through its block table."""
        slots = slot_mapping([SeqSpan(0, upto, table)], BS, torch.device("cpu"))
        self.backend.write_kv(kv, self.k[seq][:upto], self.v[seq][:upto], slots)  # in the backend's layout

    def _attend(self, backend, kv, decodes: list[tuple[int, int]], chunks: list[tuple[int, int, int]], tables):
        meta = backend.prepare([SeqSpan(p, 1, tables[s]) for s, p in decodes],
                               [SeqSpan(a, n, tables[s]) for s, a, n in chunks])
        rows = [(s, p) for s, p in decodes] + [(s, p) for s, a, n in chunks for p in range(a, a + n)]
        q = torch.stack([self.q[s][p] for s, p in rows])
        qk = torch.cat((q, q[:, : self.hkv]), dim=1)  # [q | k] heads, q handed over as a view like the model's
        return dict(zip(rows, backend.attend(qk[:, : q.shape[1]], kv, meta, self.scale)))

    def step(self, decodes: list[tuple[int, int]], chunks: list[tuple[int, int, int]]) -> dict[tuple[int, int], torch.Tensor]:
        """decodes: (seq, position); chunks: (seq, start, length) -> {(seq, position): output [Hq, D]}."""
        return self._attend(self.backend, self.kv, decodes, chunks, self.tables)

    def alone(self, seq: int, pos: int) -> torch.Tensor:
        if (seq, pos) not in self._alone:
            n = pos // BS + 1
            kv = self._cache(n, fill=self.stale)  # in the slots past pos: other numbers
            table = tuple(reversed(range(n)))  # other block ids, in another order
            self._write(kv, seq, pos + 1, table)
            self._alone[seq, pos] = self._attend(self._backend(null_block=n), kv, [(seq, pos)], [], {seq: table})[seq, pos]
        return self._alone[seq, pos]

    def stored(self, x: torch.Tensor) -> torch.Tensor:
        """Keys or values in float32 as the cache gives them back (int8: codes times their scales)."""
        if self.kv_dtype == torch.int8:
            codes, scales = quantize_rows(x)
            return codes.float() * scales[..., None]
        return x.to(self.kv_dtype).float()

    def reference(self, seq: int, pos: int) -> torch.Tensor:
        """softmax(q k^T * scale) v in float32 over the keys position `pos` sees (as the cache holds them), query
        head h on KV head h // G."""
        first = 0 if self.window is None else max(0, pos - self.window + 1)
        k, v = (self.stored(x[seq][first : pos + 1]) for x in (self.k, self.v))
        q = self.q[seq][pos].float().view(self.hkv, self.group, self.dim)
        scores = torch.einsum("hgd,khd->hgk", q, k) * self.scale
        return torch.einsum("hgk,khd->hgd", scores.softmax(-1), v).reshape(-1, self.dim)


# Steps over the world's sequences (blocks of 16 keys; kernels may cut the keys at 128, 512, 1024, ...).
ATTENTION_STEPS = {
    "decodes": ([(0, 299), (1, 16), (2, 139), (3, 1099), (4, 63), (5, 128)], []),
    "decodes, other order and lengths": ([(5, 127), (3, 512), (0, 5), (2, 0)], []),
    "two decodes": ([(4, 63), (3, 1024)], []),
    "whole prompts": ([], [(0, 0, 300), (1, 0, 17), (5, 0, 129)]),
    "chunks from mid-block": ([], [(0, 37, 91), (2, 3, 137)]),
    "chunks across 128 keys": ([], [(0, 120, 20), (5, 126, 3)]),
    "a long prompt": ([], [(3, 0, 600)]),
    "a chunk across 512 keys": ([(0, 250)], [(3, 450, 150)]),
    "a chunk across 1024 keys": ([], [(3, 1000, 100), (0, 250, 50)]),
    "decodes and chunks": ([(1, 16), (5, 128), (4, 10)], [(0, 120, 20), (2, 100, 40), (3, 1010, 13)]),
}


# Each world on both paths of the invariant backend: shoal's native op (the CPU default) and the torch one
# (CUDA, and CPUs where the op did not build); SmolLM2's heads also over an int8 cache, and a bfloat16 cache
# beside float32 activations.
WORLDS = [(h, d, w, native, None) for native in (True, False)
          for h, d, w in [("smollm2", d, w) for d in DTYPES for w in (None, 200)] + [(h, d, None) for h in ("gqa2", "mha") for d in DTYPES]]
WORLDS += [("smollm2", d, w, native, kv) for native in (True, False)
           for d, w, kv in [(torch.float32, None, torch.int8), (torch.bfloat16, 200, torch.int8), (torch.float32, None, torch.bfloat16)]]


def _world_id(h, d, w, n, kv) -> str:
    return f"{h}-{str(d)[6:]}-window{w}-{'native' if n else 'torch'}" + (f"-kv{str(kv)[6:]}" if kv is not None else "")


@pytest.fixture(scope="module", params=WORLDS, ids=[_world_id(*w) for w in WORLDS])
def attention_world(request):
    if request.param[3]:
        require_native_kernels()
    h, d, w, native, kv = request.param
    return AttentionWorld(h, d, w, native, kv_dtype=kv)


def _checked(decodes: list[tuple[int, int]], chunks: list[tuple[int, int, int]]) -> set[tuple[int, int]]:
    """The rows of a step held to their lone decode: every decode; of a chunk, its first and last two rows, the
    rows on each side of a block's edge (16 keys; the kernels' tiles and cuts are multiples of it) and every 5th
    row besides. A lone decode costs about a millisecond, and checking every row of the worlds' 1,700 took
    most of this file's time, while a row's arithmetic depends only on its position against those edges."""
    rows = set(decodes)
    for s, a, n in chunks:
        for p in range(a, a + n):
            if p - a < 2 or a + n - p <= 2 or p % BS in (0, 1, BS - 1) or (p - a) % 5 == 0:
                rows.add((s, p))
    return rows


@pytest.mark.parametrize("step", sorted(ATTENTION_STEPS))
def test_attention_of_a_query_is_its_lone_decode_whatever_the_step(attention_world, step):
    world = attention_world
    out = world.step(*ATTENTION_STEPS[step])
    rows = _checked(*ATTENTION_STEPS[step])
    assert rows <= out.keys()
    for s, p in sorted(rows):
        assert torch.equal(out[s, p], world.alone(s, p)), f"sequence {s} position {p}"


def test_lone_decode_attention_matches_float32_reference(attention_world):
    world = attention_world
    atol = ATOL[world.dtype]
    for s, n in enumerate(LENGTHS):
        for p in sorted({0, 1, 15, 16, 127, 128, 511, 512, 1023, 1024, n // 2, n - 1} & set(range(n))):
            err = (world.alone(s, p).float() - world.reference(s, p)).abs().max().item()
            assert err < atol, f"sequence {s} position {p}: {err}"


# ---------------------------------------------------------------- linear layers

# (in, out) of SmolLM2's projections: qkv, gate|up, down (1536 > INVARIANT_K: split), a 4096-wide reduction
# (split in 4), and the 49152-token head.
LINEAR_SHAPES = [(576, 960), (576, 3072), (1536, 576), (4096, 1024), (576, 49152)]
MAX_ROWS = 70


def _rows_alone_vs_in_batches(forward, x: torch.Tensor, sizes) -> list[tuple[int, int]]:
    """(M, row) of every row whose output, computed in a batch of M consecutive rows of x (at several
    offsets), differs from the same row computed alone; [] when the layer is row-invariant."""
    alone = torch.cat([forward(x[i : i + 1]) for i in range(len(x))])
    bad = []
    for m in sizes:
        for off in sorted({0, min(1, len(x) - m), len(x) - m}):
            out = forward(x[off : off + m])
            bad += [(m, off + i) for i in range(m) if not torch.equal(out[i], alone[off + i])]
    return bad


# numbers of rows around the kernels' blockings (4, 8, 16, 32, 64 rows ...), up to MAX_ROWS
BATCH_SIZES = [1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 13, 15, 16, 17, 23, 24, 25, 31, 32, 33, 47, 48, 49, 63, 64, 65, 70]


def _linear_inputs(k: int, n: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(dtype)
    return w, torch.randn(MAX_ROWS, k, generator=g).to(dtype)


@pytest.mark.parametrize("k, n", LINEAR_SHAPES, ids=[f"{k}x{n}" for k, n in LINEAR_SHAPES])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_linear_rows_do_not_depend_on_the_batch(k, n, dtype):
    """A row's output is the same alone as among up to 70 rows: InvariantLinear as the engine builds it for
    bfloat16 and float16 (split past INVARIANT_K; float16 pads a single row), in float32 plain F.linear where
    MKL's strict mode is row-invariant on this host (with MKL_CBWR=AUTO instead, it fails here) and the
    float64 path where it is not (AMD EPYC hosts)."""
    w, x = _linear_inputs(k, n, dtype)
    wide = wide_dtype(dtype)
    if dtype == torch.float32 and wide is None:
        forward = lambda rows: F.linear(rows, w)  # noqa: E731
    else:
        forward = InvariantLinear(w, None, pad_single_row=pads_single_row(dtype), wide=wide)
    assert _rows_alone_vs_in_batches(forward, x, BATCH_SIZES) == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_a_single_half_precision_row_is_its_row_in_any_batch(dtype):
    """oneDNN's one-row half-precision GEMM rounds a few outputs differently from its many-row one: at a 64 x 64
    linear (the tiny models' attention output) on an AMD EPYC with avx512_bf16, 3 rows in 2,048 in bfloat16.
    Each row alone, through InvariantLinear as make_row_invariant builds it, has its bits in the 2,048-row call.
    Plain F.linear is checked too, to show what the padding is for; skipped where this CPU's kernel agrees."""
    g = torch.Generator().manual_seed(0)
    w, x = (torch.randn(64, 64, generator=g) / 8).to(dtype), torch.randn(2048, 64, generator=g).to(dtype)
    forward = InvariantLinear(w, None, pad_single_row=pads_single_row(dtype), wide=wide_dtype(dtype))
    full = forward(x)
    assert [i for i in range(len(x)) if not torch.equal(forward(x[i : i + 1]), full[i : i + 1])] == []
    plain = F.linear(x, w)
    if all(torch.equal(F.linear(x[i : i + 1], w), plain[i : i + 1]) for i in range(len(x))):
        pytest.skip(f"this CPU's one-row {dtype} GEMM rounds as its many-row one: nothing to show")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_narrow_half_precision_projections_are_computed_wide_and_keep_their_rows(dtype):
    """oneDNN's float16 GEMM on an Intel Xeon with AVX512-FP16 gave a row of a 32-long reduction other bits at two to
    four rows than at more, about one random weight in ten (a tiny Qwen3-MoE's experts). A projection narrower than
    NARROW on either side is computed wide (narrow_wide), and its rows then keep their bits in every batch size, over
    40 random weights of each narrow shape; a wide one keeps the host's own choice (wide_dtype)."""
    g = torch.Generator().manual_seed(3)
    for n, k in ((64, 32), (64, 16), (32, 64), (8, 64)):
        assert min(n, k) < NARROW
        for _ in range(40):
            w, x = torch.randn(n, k, generator=g).to(dtype), torch.randn(40, k, generator=g).to(dtype)
            wide = narrow_wide(dtype, w)
            assert wide in (torch.float32, torch.float64) and (wide_dtype(dtype) is None or wide == wide_dtype(dtype))
            forward = InvariantLinear(w, None, pad_single_row=pads_single_row(dtype), wide=wide)
            full = forward(x)
            assert [m for m in (1, 2, 3, 4, 5, 8, 17) if not torch.equal(forward(x[:m]), full[:m])] == []
    assert narrow_wide(dtype, torch.zeros(NARROW, NARROW, dtype=dtype)) == wide_dtype(dtype)


def test_plain_bfloat16_linear_past_invariant_k_depends_on_the_batch():
    """Why InvariantLinear exists: oneDNN's bfloat16 GEMM gives a row of SmolLM2's down projection
    (K = 1536) other bits depending on how many rows share the call. Skipped on a CPU whose kernel
    happens to be row-invariant; InvariantLinear must be invariant either way."""
    k, n = 1536, 576
    assert k > INVARIANT_K
    w, x = _linear_inputs(k, n, torch.bfloat16)
    assert _rows_alone_vs_in_batches(InvariantLinear(w, None, pad_single_row=False, wide=wide_dtype(torch.bfloat16)), x, BATCH_SIZES) == []
    if not _rows_alone_vs_in_batches(lambda rows: F.linear(rows, w), x, BATCH_SIZES):
        pytest.skip("this CPU's bfloat16 GEMM is row-invariant at K = 1536: nothing to show")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_linear_rows_do_not_depend_on_the_batch(kind, dtype):
    """torch's int8 and int4 weight-only kernels, used as they are (make_row_invariant leaves them).
    Their float16 paths are ~50x slower on the CPU: one shape there."""
    for k, n in LINEAR_SHAPES if dtype == torch.bfloat16 else [(1536, 576)]:
        w, x = _linear_inputs(k, n, dtype)
        layer = Int8Linear(w) if kind == "int8" else Int4Linear.from_float(w)
        assert _rows_alone_vs_in_batches(layer, x, BATCH_SIZES) == [], (k, n)


# ---------------------------------------------------------------- sampler

def test_sampler_logprobs_and_seeded_tokens_of_a_row_do_not_depend_on_the_batch():
    """The chosen token, its logprob and the top logprobs of a row (as ModelRunner._sample_batch asks for
    them) are the same alone as among other rows: greedy rows, and seeded rows whose noise comes from
    their own generator."""
    V, B = 49152, 40
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, V, generator=g) * 4
    params = [SamplingParams(temperature=0.0, logprobs=5) if i % 3 else
              SamplingParams(temperature=0.8, top_p=0.95, seed=i, logprobs=20) for i in range(B)]

    def generator(p: SamplingParams):  # as the runner makes it for a seeded row's 4th token
        return None if p.greedy else seeded_generator(p.seed, 3, torch.device("cpu"))

    def run(rows: list[int]) -> list[tuple]:
        batch = SamplingBatch.build([SamplerRow(params[i], generator=generator(params[i]), num_logprobs=params[i].logprobs)
                                     for i in rows], V, "cpu")
        out = sample(logits[rows], batch)
        k = [params[i].logprobs for i in rows]  # the runner keeps each row's own k of the batch's top K
        return [(out.token_ids[j].item(), out.logprobs[j].item(), out.top_ids[j, : k[j]].tolist(),
                 out.top_logprobs[j, : k[j]].tolist()) for j in range(len(rows))]

    alone = [run([i])[0] for i in range(B)]
    for size in (2, 3, 7, 16, 33, B):
        for first in sorted({0, B - size, (B - size) // 2}):
            rows = list(range(first, first + size))
            assert run(rows) == [alone[i] for i in rows], (size, first)
    assert run(list(reversed(range(B)))) == alone[::-1]


# ---------------------------------------------------------------- the real default model

def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _sales_table(days: int, salt: int = 0) -> str:
    products = ["umbrellas", "sunglasses", "notebooks", "teapots", "bicycle bells", "candles"]
    rows = [f"Day {d}: {(d * 37 + salt) % 90 + 5} {products[(d + salt) % 6]}, "
            f"revenue ${(d * 53 + 7 * salt) % 400 + 120}.{d % 10}0" for d in range(1, days + 1)]
    return ("Here are our shop's sales, one line per day:\n" + "\n".join(rows)
            + "\nWhich product sold best overall, and which day had the highest revenue?")


def _server_log(lines: int, salt: int = 0) -> str:
    out = []
    for i in range(salt, salt + lines):
        level = "ERROR" if i % 9 == 4 else "INFO"
        what = f"processed job {1000 + 7 * i} in {(i * 29) % 300 + 20} ms"
        if level == "ERROR":
            what = f"disk quota exceeded on volume vol-{i % 4}"
        out.append(f"2024-05-{1 + i // 12:02d} 12:{(i * 7) % 60:02d}:{(i * 13) % 60:02d} {level} worker-{i % 3} {what}")
    return "Summarize what went wrong in this server log and suggest a fix:\n" + "\n".join(out)


# 24 conversations: short questions, code, other languages, a multi-turn chat, paragraphs to work on, and four
# long ones (246, 266, 405 and 456 tokens rendered: their keys fill several of the attention's tiles).
CONVERSATIONS = [
    _user("What is the capital of France?"),
    _user("Write a haiku about autumn leaves."),
    _user("How many legs does a spider have?"),
    _user("Translate 'thank you very much' into German."),
    _user("Give me three tips for learning to play the guitar."),
    _user("What is the difference between weather and climate?"),
    _user("def is_prime(n):\n    # finish this Python function"),
    _user("Who painted 'The Starry Night'?"),
    _user("Explain photosynthesis to a ten-year-old."),
    _user("¿Por qué el cielo es azul?"),
    _user("Write a limerick about a cat who loves coffee ☕."),
    _user("What is 17 times 23?"),
    [{"role": "system", "content": "You are a terse assistant who answers in one sentence."},
     {"role": "user", "content": "I want to bake bread at home. Where do I start?"},
     {"role": "assistant", "content": "Start with a simple no-knead recipe: flour, water, salt and yeast."},
     {"role": "user", "content": "How long should the dough rise, and how do I know it is ready?"}],
    _user("Reply politely to this customer email: 'Hi, I ordered a blue kettle three weeks ago (order 48213) and it "
          "still has not arrived. The tracking page has said \"in transit\" for ten days. I need it before my mother "
          "visits next weekend. Can you send a replacement or refund me? Thanks, Dana.'"),
    _user("Review this function and point out the bugs:\n\ndef average(values):\n    total = 0\n"
          "    for i in range(1, len(values)):\n        total += values[i]\n    return total / len(values)\n\n"
          "print(average([]))"),
    _user("Continue the story in three sentences: The lighthouse keeper had not seen a ship in forty years, so when "
          "the lamp flickered on by itself one foggy November night and a bell rang somewhere below the rocks, "
          "she put on her coat, took the brass lantern and walked down the spiral stairs."),
    _user("A train leaves Lyon at 9:40 and travels at 120 km/h. A second train leaves Paris, 460 km away, at 10:10 "
          "and travels towards Lyon at 150 km/h on the parallel track. At what time do they meet, and how far from "
          "Paris? Show your reasoning step by step."),
    _user("I have chicken thighs, a can of coconut milk, an onion, garlic, rice, half a bag of spinach, curry powder "
          "and some limes. I do not have ginger or fresh chillies. Suggest a dinner for four that uses most of this, "
          "with steps and timings, and say what I could add next time."),
    _user("Plan a three-day trip to Kyoto in April for two people who like gardens, food markets and quiet temples "
          "but dislike crowds. We arrive by train at 2pm on the first day and leave at noon on the third. Keep the "
          "budget moderate and include one rainy-day alternative."),
    _user("Explain this Python error and how to fix it:\n\nTraceback (most recent call last):\n  File \"app.py\", line 12, "
          "in <module>\n    main()\n  File \"app.py\", line 9, in main\n    counts[word] += 1\nKeyError: 'banana'"),
    _user(_sales_table(10)),
    _user(_server_log(6)),
    _user(_sales_table(18)),
    _user(_server_log(11)),
]

# Long prompts of other topics that only share the batch (~300-600 tokens each).
UNRELATED = [_user(_sales_table(13 + 2 * i, salt=i) if i % 2 else _server_log(7 + i, salt=40 + 20 * i)) for i in range(8)]

MAX_LEN = 1024
GREEDY = SamplingParams(temperature=0.0, max_tokens=48, logprobs=5, ignore_eos=True)
# Sampled with a seed: choice i draws from seed + i, so choice 2 of n=3 is one fixed stream of tokens.
SEEDED = SamplingParams(n=3, temperature=0.8, top_p=0.95, seed=1234, max_tokens=48, logprobs=5, ignore_eos=True)
SEEDED_PROMPTS = (4, 16)  # conversations also sent as seeded n=3 requests
QUANT_PROMPTS = (0, 13, 17, 23)  # the int8 / int4 subset: 37, 101, 97 and 456 tokens
QUANT_GREEDY = SamplingParams(temperature=0.0, max_tokens=32, logprobs=5, ignore_eos=True)
PREEMPTION_BLOCKS = 96  # 1,536 tokens of KV for 24 prompts that need ~3,700 together
slow = pytest.mark.slow


def _completion(c) -> tuple:
    """A completion as plain data: its tokens and every logprob it reports (the chosen token's and the top 5)."""
    return tuple(c.token_ids), tuple((lp.token_id, lp.logprob, tuple(lp.top)) for lp in c.logprobs)


def _first_choices(outs) -> list[tuple]:
    return [_completion(o.outputs[0]) for o in outs]


def assert_same_as_alone(got: list[tuple], alone: list[tuple], what: str) -> None:
    """Every completion equal to its prompt's run alone: tokens, and logprobs to the bit."""
    assert len(got) == len(alone)
    first_difference = {
        i: next((t for t, (a, b) in enumerate(zip(zip(*g), zip(*w))) if a != b), min(len(g[0]), len(w[0])))
        for i, (g, w) in enumerate(zip(got, alone)) if g != w
    }
    assert not first_difference, (
        f"{what}: {len(first_difference)} of {len(alone)} prompts differ from their run alone "
        f"(prompt: first token that differs) {first_difference}"
    )


def _smollm(**kwargs) -> LLM:
    return LLM("smollm2", **{"dtype": "bfloat16", "attention": "invariant", "max_model_len": MAX_LEN, **kwargs})


class Reference:
    """A fresh engine without a prefix cache, and each prompt's completion run alone on it, one after the
    other: nothing beside it, nothing carried over from the one before."""

    def __init__(self, conversations: list, params: SamplingParams, **kwargs) -> None:
        self.llm = _smollm(enable_prefix_cache=False, **kwargs)
        self.prompts = [self.llm.apply_chat_template(c) for c in conversations]
        self.alone = [_completion(self.llm.generate([p], params)[0].outputs[0]) for p in self.prompts]


@pytest.fixture(scope="module")
def smollm(default_gguf_path) -> Reference:
    return Reference(CONVERSATIONS, GREEDY, num_blocks=1024)


class Run:
    """The prompts (greedy) and the seeded requests, in one batch with `before` and `after` around them."""

    def __init__(self, llm: LLM, prompts: list[list[int]], before=(), after=()) -> None:
        seeded = [prompts[i] for i in SEEDED_PROMPTS]
        outs = llm.generate([p for p, _ in before] + prompts + seeded + [p for p, _ in after],
                            [s for _, s in before] + [GREEDY] * len(prompts) + [SEEDED] * len(seeded) + [s for _, s in after])
        outs = outs[len(before) : len(outs) - len(after)]
        self.greedy = _first_choices(outs[: len(prompts)])
        self.cached = [o.num_cached_tokens for o in outs[: len(prompts)]]
        self.seeded = [_completion(o.outputs[2]) for o in outs[len(prompts) :]]


@pytest.fixture(scope="module")
def seeded_alone(smollm) -> list[tuple]:
    """Choice 2 of each seeded request, run alone."""
    outs = [smollm.llm.generate([smollm.prompts[i]], SEEDED)[0] for i in SEEDED_PROMPTS]
    for o in outs:  # the seed makes the choices differ from each other, not from their own runs
        assert len({tuple(c.token_ids) for c in o.outputs}) == 3
    return [_completion(o.outputs[2]) for o in outs]


@pytest.fixture(scope="module")
def crowded(smollm) -> Run:
    """The prompts beside 8 long unrelated ones, sampled from the global RNG and finishing at different steps."""
    unrelated = [(smollm.llm.apply_chat_template(c), SamplingParams(max_tokens=4 + 4 * i, ignore_eos=True))
                 for i, c in enumerate(UNRELATED)]
    assert all(300 <= len(p) <= 600 for p, _ in unrelated)
    return Run(smollm.llm, smollm.prompts, before=unrelated[::2], after=unrelated[1::2])


@pytest.fixture(scope="module")
def cache_hits(smollm) -> tuple[list[int], Run, Run]:
    """With the prefix cache: first, for each prompt, a request that shares its first k tokens (k not a multiple
    of the block size) and then goes elsewhere; then the prompts (a copy-on-write hit of k tokens); then the
    prompts again (a hit of the whole prompt but its last token). Returns (k per prompt, both runs)."""
    llm = _smollm(num_blocks=1024)
    block = llm.engine.runner.block_size
    shared = [len(p) - 6 - (len(p) % block == 6) for p in smollm.prompts]  # into the user's text
    tail = llm.tokenizer.encode(" Answer in French, please.")
    assert all(k % block and p[k] != tail[0] for p, k in zip(smollm.prompts, shared))
    llm.generate([p[:k] + tail for p, k in zip(smollm.prompts, shared)], SamplingParams(temperature=0.0, max_tokens=1))
    return shared, Run(llm, smollm.prompts), Run(llm, smollm.prompts)


@slow
def test_a_batch_of_all_prompts_matches_each_alone(smollm):
    outs = smollm.llm.generate(smollm.prompts, GREEDY)
    assert_same_as_alone(_first_choices(outs), smollm.alone, "all 24 prompts in one batch")


@slow
def test_a_batch_crowded_with_long_prompts_matches_alone(smollm, crowded):
    assert_same_as_alone(crowded.greedy, smollm.alone, "beside 8 long prompts")


@slow
def test_prefill_in_chunks_of_32_tokens_matches_alone(smollm):
    # 32 tokens a step, 24 of them decodes once every prompt runs: prompts go in chunks of a few tokens
    # that start anywhere in a block and cross tiles.
    llm = _smollm(enable_prefix_cache=False, max_num_batched_tokens=32, num_blocks=1024)
    outs = llm.generate(smollm.prompts, GREEDY)
    assert llm.engine.stats.steps > sum(map(len, smollm.prompts)) / 32
    assert_same_as_alone(_first_choices(outs), smollm.alone, "prefill in chunks of 32 tokens")


@slow
def test_a_copy_on_write_prefix_cache_hit_matches_alone(smollm, cache_hits):
    shared, copied, _ = cache_hits
    assert copied.cached == shared  # k tokens from the cache: whole blocks shared, the partial one copied
    assert_same_as_alone(copied.greedy, smollm.alone, "after a copy-on-write prefix-cache hit")


@slow
def test_a_full_prefix_cache_hit_matches_alone(smollm, cache_hits):
    _, _, again = cache_hits
    assert again.cached == [len(p) - 1 for p in smollm.prompts]  # all but the last token, which is computed
    assert_same_as_alone(again.greedy, smollm.alone, "served once before (a full prefix-cache hit)")


@slow
def test_preempted_and_recomputed_requests_match_alone(smollm):
    llm = _smollm(enable_prefix_cache=False, num_blocks=PREEMPTION_BLOCKS)
    outs = llm.generate(smollm.prompts, GREEDY)
    assert llm.engine.stats.preemptions > 0  # the pool holds a fraction of what the prompts need together
    assert_same_as_alone(_first_choices(outs), smollm.alone, "with preemption")


@slow
def test_a_seeded_choice_is_the_same_alone_in_a_batch_and_after_cache_hits(seeded_alone, crowded, cache_hits):
    _, copied, again = cache_hits
    assert crowded.seeded == seeded_alone, "beside other requests"
    assert copied.seeded == seeded_alone, "after a copy-on-write prefix-cache hit"
    assert again.seeded == seeded_alone, "after a full prefix-cache hit"


QUANT_CONFIGS = {  # bf16 with each low-bit format, and the default configuration (on a CPU without native bf16:
    # float32 activations with the file's int4 on shoal's kernels)
    "int8": {"quantization": "int8"}, "int4": {"quantization": "int4"}, "default": {"dtype": "auto", "quantization": "auto"},
    # the default configuration over an int8 KV cache (--kv-cache-dtype int8)
    "default-kv-int8": {"dtype": "auto", "quantization": "auto", "kv_cache_dtype": "int8"},
}


@pytest.fixture(scope="module", params=list(QUANT_CONFIGS))
def quantized(request, default_gguf_path) -> Reference:
    ref = Reference([CONVERSATIONS[i] for i in QUANT_PROMPTS], QUANT_GREEDY, num_blocks=512, **QUANT_CONFIGS[request.param])
    ref.config = QUANT_CONFIGS[request.param]
    assert ref.llm.engine.facts.weight_format in ("int8", "int4", "gguf")
    return ref


@slow
def test_quantized_batch_matches_alone(quantized):
    outs = quantized.llm.generate(quantized.prompts, QUANT_GREEDY)
    assert_same_as_alone(_first_choices(outs), quantized.alone, "in one batch")


@slow
def test_quantized_chunks_and_cache_hits_match_alone(quantized):
    # with the prefix cache: the prompts admitted later also find the system prompt's first block cached
    llm = _smollm(max_num_batched_tokens=32, num_blocks=512, **quantized.config)
    chunked = llm.generate(quantized.prompts, QUANT_GREEDY)
    assert_same_as_alone(_first_choices(chunked), quantized.alone, "prefill in chunks of 32 tokens")
    again = llm.generate(quantized.prompts, QUANT_GREEDY)
    assert [o.num_cached_tokens for o in again] == [len(p) - 1 for p in quantized.prompts]
    assert_same_as_alone(_first_choices(again), quantized.alone, "after a full prefix-cache hit")


# ---------------------------------------------------------------- tiny models of every architecture

# Gemma 2 and 3 (tiny_models.FAMILY_ARCHS): local layers with a window of 8 beside global ones; Gemma 2's softcap
# takes the torch invariant path, Gemma 3 the native op with a window per layer. Qwen3-MoE: a router and experts
# (tokens grouped by expert, so a step's rows per expert change with the batch).
TINY = {arch: (arch, {}) for arch in sorted(ARCHS)} | {"mistral-window40": ("mistral", {"sliding_window": 40}),
                                                       "gemma2": ("gemma2", {}), "gemma3": ("gemma3", {}), "qwen3moe": ("qwen3moe", {})}
# Token ids of tiny prompts: 420 tokens reach a fourth tile of keys.
TINY_PROMPTS = [[(7 * i + 13 * j * j) % 380 + 5 for i in range(n)] for j, n in enumerate((3, 17, 40, 77, 150, 420))]
TINY_GREEDY = SamplingParams(temperature=0.0, max_tokens=24, logprobs=5, ignore_eos=True)


@pytest.fixture(scope="module", params=sorted(TINY))
def tiny_path(request, tmp_path_factory):
    arch, overrides = TINY[request.param]
    return str(make_tiny_model(arch, tmp_path_factory.mktemp(request.param), **overrides))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_tiny_models_alone_batched_chunked_and_cached_are_identical(tiny_path, dtype):
    plain = LLM(tiny_path, dtype=dtype, attention="invariant", enable_prefix_cache=False, num_blocks=128)
    alone = [_completion(plain.generate([p], TINY_GREEDY)[0].outputs[0]) for p in TINY_PROMPTS]
    assert_same_as_alone(_first_choices(plain.generate(TINY_PROMPTS, TINY_GREEDY)), alone, "in one batch")
    llm = LLM(tiny_path, dtype=dtype, attention="invariant", max_num_batched_tokens=13, num_blocks=128)  # with the prefix cache
    if "gemma" in tiny_path:  # its local layers in a KV group of their own, which frees what slides out of the window
        assert [g.window for g in llm.engine.runner.kv_groups] == [None, 8]
    chunked = llm.generate(TINY_PROMPTS, TINY_GREEDY)
    assert [o.num_cached_tokens for o in chunked] == [0] * len(TINY_PROMPTS)  # the prompts share no prefix
    assert_same_as_alone(_first_choices(chunked), alone, "prefill in chunks of 13")
    again = llm.generate(TINY_PROMPTS, TINY_GREEDY)
    assert [o.num_cached_tokens for o in again] == [len(p) - 1 for p in TINY_PROMPTS]
    assert_same_as_alone(_first_choices(again), alone, "after a full prefix-cache hit")


# ---------------------------------------------------------------- K-quant files (llama-quantize's own blocks)

K_QUANT_FILES = {mix: Path(__file__).parent / "fixtures" / f"tiny-llama-{mix}.gguf" for mix in ("Q4_K_M", "Q5_K_M")}


@pytest.mark.parametrize("mix", sorted(K_QUANT_FILES))
def test_k_quant_files_alone_batched_chunked_and_cached_are_identical(mix):
    """The default configuration on a Q4_K_M / Q5_K_M file (every tensor in its own type on shoal's kernels, the
    invariant attention): a greedy row's tokens and logprobs alone, in a batch, in chunks and after a cache hit."""
    require_native_kernels()
    assert_file_is_invariant(str(K_QUANT_FILES[mix]))


def assert_file_is_invariant(path: str) -> tuple[list[tuple], LLM]:
    """A GGUF in the default configuration (every tensor in its own type on shoal's kernels, the invariant
    attention): TINY_PROMPTS' greedy tokens and logprobs alone, in one batch, in chunks of 13 and after a full
    prefix-cache hit. -> (each prompt's alone, the engine that chunked and hit)."""
    plain = LLM(path, enable_prefix_cache=False, num_blocks=128)
    assert plain.engine.facts.weight_format == "gguf" and plain.engine.runner.attention.name == "invariant"
    alone = [_completion(plain.generate([p], TINY_GREEDY)[0].outputs[0]) for p in TINY_PROMPTS]
    assert_same_as_alone(_first_choices(plain.generate(TINY_PROMPTS, TINY_GREEDY)), alone, "in one batch")
    llm = LLM(path, max_num_batched_tokens=13, num_blocks=128)
    assert_same_as_alone(_first_choices(llm.generate(TINY_PROMPTS, TINY_GREEDY)), alone, "prefill in chunks of 13")
    again = llm.generate(TINY_PROMPTS, TINY_GREEDY)
    assert [o.num_cached_tokens for o in again] == [len(p) - 1 for p in TINY_PROMPTS]
    assert_same_as_alone(_first_choices(again), alone, "after a full prefix-cache hit")
    return alone, llm
