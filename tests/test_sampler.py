"""Sampler tests: each parameter against a hand-computed value or HF's own processor, and
property tests (Hypothesis) that every admitted parameter value gives an allowed token."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from shoal import kernels
from shoal.runner import sampler as sampler_mod
from shoal.runner.sampler import (
    ROW_ALL_BANNED,
    ROW_ERRORS,
    ROW_NONFINITE_LOGITS,
    SamplerRow,
    SamplingBatch,
    _banned_tokens,
    apply_processors,
    apply_top_k_top_p,
    apply_top_p_candidates,
    argmax_rows,
    log_softmax_rows,
    logits_to_probs,
    no_repeat_ngram_bans,
    process_logits,
    sample,
    uniform_to_exponential_,
)
from shoal.types import SamplingParams

INF = float("inf")


def row(prompt=(), output=(), eos=(), gen=None, num_logprobs=0, **params) -> SamplerRow:
    params.setdefault("max_tokens", None)
    return SamplerRow(
        params=SamplingParams(**params),
        prompt_token_ids=tuple(prompt),
        output_token_ids=tuple(output),
        eos_token_ids=tuple(eos),
        generator=gen,
        num_logprobs=num_logprobs,
    )


def build(rows, V) -> SamplingBatch:
    return SamplingBatch.build(rows, V, "cpu")


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def run(logits: torch.Tensor, rows) -> torch.Tensor:
    return sample(logits, build(rows, logits.shape[-1])).token_ids


def probs_logits(probs) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float32).log()


def support(logits_row: torch.Tensor, n: int, seed: int = 0, **params) -> torch.Tensor:
    """Draw n tokens from one row's distribution (n identical rows, one global-RNG call)."""
    torch.manual_seed(seed)
    logits = logits_row.expand(n, -1).contiguous()
    return run(logits, [row(**params)] * n)


def hf_chain(logits_row: torch.Tensor, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0):
    """HF's warpers in `generate`'s order, each added only when its param is active (like HF)."""
    x = logits_row.unsqueeze(0)
    ids = torch.zeros(1, 1, dtype=torch.long)
    if temperature != 1.0:
        x = TemperatureLogitsWarper(float(temperature))(ids, x)
    if top_k:
        x = TopKLogitsWarper(top_k)(ids, x)
    if top_p < 1.0:
        x = TopPLogitsWarper(top_p)(ids, x)
    if min_p > 0.0:
        x = MinPLogitsWarper(min_p)(ids, x)
    if typical_p < 1.0:
        x = TypicalLogitsWarper(typical_p)(ids, x)
    return x.squeeze(0)


# ---------------------------------------------------------------- greedy and the fast path


def test_greedy_is_argmax_and_all_greedy_batch_skips_every_stage():
    torch.manual_seed(0)
    logits = torch.randn(5, 50)
    b = build([row(temperature=0.0)] * 5, 50)
    assert b.all_greedy and not b.any_processor
    assert b.temperature is None and b.top_k is None and b.top_p_rm is None and b.num_top_logprobs == 0
    assert torch.equal(sample(logits, b).token_ids, logits.argmax(-1))


@pytest.mark.parametrize("V", [49152, 1000, 999, 64])
def test_argmax_rows_equals_argmax_including_first_tie(V):
    g = gen(20)
    for levels in (3, 1000):
        x = torch.randint(0, levels, (16, V), generator=g).float()  # many ties for the max
        x[3] = -INF
        assert torch.equal(argmax_rows(x), x.argmax(-1))
    x = torch.randn(8, 2 * V, generator=g)[:, ::2]  # non-contiguous rows
    assert torch.equal(argmax_rows(x), x.argmax(-1))


@pytest.mark.skipif(not kernels.available(), reason="the native op")
@pytest.mark.parametrize("V", [49152, 999, 1])
def test_row_argmax_gives_torchs_argmax_and_amax_and_each_row_alone_its_own(V):
    """The native op (kernels.row_argmax, argmax_rows' where it built) against torch's argmax and amax: first ties, a
    NaN row (its first NaN), infinities, rows of a wider tensor, and every row alone as in the batch."""
    g = gen(21)
    x = torch.randint(0, 3, (6, V + 5), generator=g).float()[:, :V]  # rows with a stride, ties for the max
    x[1] = -INF
    x[2, V // 2] = float("nan")
    x[2, V - 1] = float("nan")
    x[3, V // 3] = INF
    x[4, 0] = INF
    ids, top = kernels.row_argmax(x)
    assert torch.equal(argmax_rows(x), ids)
    assert torch.equal(ids, x.argmax(-1))
    assert torch.equal(top.nan_to_num(0.5), x.amax(-1).nan_to_num(0.5))
    for r in range(len(x)):
        alone = kernels.row_argmax(x[r : r + 1].clone())
        assert alone[0].item() == ids[r].item() and alone[1].nan_to_num(0.5).item() == top[r].nan_to_num(0.5).item()


def test_top_k_1_equals_greedy():
    torch.manual_seed(1)
    logits = torch.randn(64, 100) * 3
    tok = run(logits, [row(temperature=1.5, top_k=1)] * 64)
    assert torch.equal(tok, logits.argmax(-1))


def test_greedy_applies_penalties_bias_and_bans():
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0]])
    assert run(logits, [row(temperature=0.0, logit_bias={0: -10.0})]).item() == 1
    assert run(logits, [row(temperature=0.0, eos=(0,), ignore_eos=True)]).item() == 1
    assert run(logits, [row(temperature=0.0, output=(0, 0), frequency_penalty=2.0)]).item() == 1


def test_input_logits_are_not_modified():
    torch.manual_seed(2)
    logits = torch.randn(3, 20)
    before = logits.clone()
    rows = [
        row(temperature=0.0, logit_bias={1: 5.0}, eos=(2,), ignore_eos=True),
        row(temperature=0.7, top_p=0.5, repetition_penalty=1.3, prompt=(1, 2, 3)),
        row(temperature=1.0, min_p=0.1, frequency_penalty=0.5, output=(4, 4)),
    ]
    sample(logits, build(rows, 20))
    assert torch.equal(logits, before)


# ---------------------------------------------------------------- warpers vs HF


WARPER_ROWS = [
    dict(temperature=0.7),
    dict(temperature=1.0, top_k=5),
    dict(temperature=1.3, top_p=0.8),
    dict(temperature=0.9, top_k=20, top_p=0.6),
    dict(temperature=1.0, min_p=0.05),
    dict(temperature=1.0, typical_p=0.5),
    dict(temperature=0.5, top_k=40, top_p=0.9, min_p=0.02, typical_p=0.8),
    dict(temperature=2.0),
]


@pytest.mark.parametrize("spec", WARPER_ROWS)
def test_warpers_match_hf_per_row(spec):
    """Each warper (and their composition) gives HF's processed logits exactly, row by row."""
    torch.manual_seed(3)
    V = 200
    logits = torch.randn(4, V) * 2
    processed = process_logits(logits, build([row(**spec)] * 4, V))
    for i in range(4):
        torch.testing.assert_close(processed[i], hf_chain(logits[i], **spec), rtol=0, atol=0)


def test_warpers_match_hf_in_a_mixed_batch():
    """Per-row parameters in one batch: each row still gets exactly HF's result for its own params."""
    torch.manual_seed(4)
    V = 300
    logits = torch.randn(len(WARPER_ROWS) + 1, V) * 2
    rows = [row(**spec) for spec in WARPER_ROWS] + [row(temperature=0.0)]
    processed = process_logits(logits, build(rows, V))
    for i, spec in enumerate(WARPER_ROWS):
        torch.testing.assert_close(processed[i], hf_chain(logits[i], **spec), rtol=0, atol=0)
    assert torch.equal(processed[-1], logits[-1])  # greedy row: no warpers


def test_top_k_alone_matches_hf_with_k_off_rows():
    """The topk path (no top-p in the batch): per-row k, k=0 rows untouched, ties with the k-th kept."""
    torch.manual_seed(5)
    V = 100
    logits = torch.randn(4, V)
    logits[1, :10] = 7.0  # ten-way tie at the top: top_k=3 keeps all ten
    ks = [3, 3, 0, 50]
    processed = process_logits(logits, build([row(top_k=k) for k in ks], V))
    for i, k in enumerate(ks):
        torch.testing.assert_close(processed[i], hf_chain(logits[i], top_k=k), rtol=0, atol=0)
    assert (processed[1] > -INF).sum() == 10
    assert torch.equal(processed[2], logits[2])


def test_top_p_candidate_spill_matches_hf(monkeypatch):
    """CPU top-p looks among the top candidates; rows whose nucleus spills past them redo the exact sort."""
    torch.manual_seed(17)
    V = 400
    logits = torch.randn(4, V)
    logits[0, :3] = 8.0  # peaked row: nucleus inside 16 candidates
    specs = [dict(top_p=0.9), dict(top_p=0.9), dict(top_p=0.5, temperature=3.0), dict(temperature=0.8)]
    monkeypatch.setattr(sampler_mod, "TOP_P_CANDIDATES", 16)
    processed = process_logits(logits, build([row(**sp) for sp in specs], V))
    for i, sp in enumerate(specs):
        torch.testing.assert_close(processed[i], hf_chain(logits[i], **sp), rtol=0, atol=0)
    assert (processed[0] > -INF).sum() <= 16 and (processed[1] > -INF).sum() > 16  # both paths taken


def test_sorted_top_k_top_p_matches_hf():
    """The one-sort path used on accelerators (here called directly on CPU tensors)."""
    torch.manual_seed(18)
    V = 300
    logits = torch.randn(4, V) * 2
    ks, ps = [10, V, 50, V], [0.8, 0.6, 1.0, 1.0]  # k == V: top-k off; p == 1: top-p off
    out = apply_top_k_top_p(
        logits,
        torch.tensor(ks)[:, None],
        torch.tensor([1.0 - p for p in ps])[:, None],
        torch.tensor([p < 1.0 for p in ps])[:, None],
    )
    for i in range(4):
        expected = hf_chain(logits[i], top_k=ks[i] if ks[i] < V else 0, top_p=ps[i])
        torch.testing.assert_close(out[i], expected, rtol=0, atol=0)
    # and the candidate path agrees with it on the same rows (top-k applied first)
    masked = apply_top_k_top_p(logits, torch.tensor(ks)[:, None], None, None)
    cand = apply_top_p_candidates(
        masked,
        torch.tensor(ps)[:, None],
        torch.tensor([1.0 - p for p in ps])[:, None],
        torch.tensor([p < 1.0 for p in ps])[:, None],
        num_candidates=64,
    )
    torch.testing.assert_close(cand, out, rtol=0, atol=0)


def test_noise_is_finite_and_positive_even_for_u_zero():
    """q = 0 would make p / q NaN for masked tokens, q = inf would zero a lone survivor."""
    q = uniform_to_exponential_(torch.tensor([0.0, 1e-30, 0.5, 1.0 - 2**-24]))
    assert torch.isfinite(q).all() and (q > 0).all()
    torch.testing.assert_close(q[2], torch.tensor(math.log(2.0)))


def test_lone_surviving_token_always_wins():
    """top_p tiny leaves one token; the noise never lets a masked token through."""
    torch.manual_seed(19)
    logits = torch.randn(1, 1000)
    toks = support(logits[0], 5000, top_p=0.01, temperature=1.0)
    assert set(toks.tolist()) == {logits.argmax().item()}


def test_temperature_matches_hf_and_sharpens():
    torch.manual_seed(6)
    logits = torch.randn(2, 30)
    processed = process_logits(logits, build([row(temperature=0.25), row(temperature=4.0)], 30))
    torch.testing.assert_close(processed[0], TemperatureLogitsWarper(0.25)(None, logits[:1])[0], rtol=0, atol=0)
    torch.testing.assert_close(processed[1], TemperatureLogitsWarper(4.0)(None, logits[1:])[0], rtol=0, atol=0)


def test_top_p_removes_exactly_the_tail():
    logits = probs_logits([0.5, 0.3, 0.15, 0.05])
    # top_p = 0.75: {0.5, 0.3} is the smallest head reaching 0.75
    toks = support(logits, 4000, top_p=0.75)
    assert set(toks.tolist()) == {0, 1}
    toks = support(logits, 4000, top_p=0.9)
    assert set(toks.tolist()) == {0, 1, 2}


def test_min_p_removes_exactly_the_tail():
    logits = probs_logits([0.5, 0.3, 0.15, 0.05])
    # threshold 0.2 * 0.5 = 0.1: drops only 0.05
    assert set(support(logits, 4000, min_p=0.2).tolist()) == {0, 1, 2}
    # threshold 0.5 * 0.5 = 0.25: keeps 0.5 and 0.3
    assert set(support(logits, 4000, min_p=0.5).tolist()) == {0, 1}


def test_top_k_removes_exactly_the_tail():
    logits = probs_logits([0.1, 0.4, 0.2, 0.3])
    assert set(support(logits, 4000, top_k=2).tolist()) == {1, 3}


@pytest.mark.parametrize("mass", [0.2, 0.5, 0.9, 0.99])
def test_typical_p_matches_hf(mass):
    torch.manual_seed(7)
    V = 500
    logits = torch.randn(3, V) * 3
    processed = process_logits(logits, build([row(typical_p=mass)] * 3, V))
    expected = TypicalLogitsWarper(mass)(None, logits)
    torch.testing.assert_close(processed, expected, rtol=0, atol=0)
    # and it restricts sampling to the kept set
    kept = set(torch.nonzero(processed[0] > -INF).flatten().tolist())
    assert set(support(logits[0], 2000, typical_p=mass).tolist()) <= kept


def test_typical_p_can_drop_the_most_likely_token():
    # p = [0.3, 0.07 x 10]: entropy H = 2.22 nats; |-ln 0.3 - H| = 1.02 but |-ln 0.07 - H| = 0.44, so
    # the ten 0.07 tokens are the typical ones and mass 0.3 keeps them (all tied) and drops the spike.
    logits = probs_logits([0.3] + [0.07] * 10)
    processed = process_logits(logits[None], build([row(typical_p=0.3)], 11))[0]
    assert processed[0] == -INF  # the atypically likely token is gone
    assert (processed[1:] > -INF).all()
    torch.testing.assert_close(processed, TypicalLogitsWarper(0.3)(None, logits[None])[0], rtol=0, atol=0)


# ---------------------------------------------------------------- penalties, bias, bans


def test_repetition_penalty_matches_hf():
    torch.manual_seed(8)
    V = 40
    logits = torch.randn(3, V) * 2  # both signs
    prompts = [(1, 2, 3, 3, 9), (5, 6), (7,)]
    outputs = [(4, 1), (6, 30, 31), ()]
    pens = [1.3, 0.7, 1.0]
    rows = [row(prompt=p, output=o, repetition_penalty=r) for p, o, r in zip(prompts, outputs, pens)]
    processed = process_logits(logits, build(rows, V))
    for i in range(3):
        ids = torch.tensor([prompts[i] + outputs[i]])
        expected = RepetitionPenaltyLogitsProcessor(pens[i])(ids, logits[i : i + 1])[0]
        torch.testing.assert_close(processed[i], expected, rtol=0, atol=0)
    assert not torch.equal(processed[0], logits[0]) and not torch.equal(processed[1], logits[1])
    assert torch.equal(processed[2], logits[2])


def test_presence_and_frequency_exact_amounts():
    V = 10
    logits = torch.zeros(2, V)
    rows = [
        row(prompt=(7, 7, 8), output=(1, 1, 1, 2), presence_penalty=0.5, frequency_penalty=0.25),
        row(prompt=(1,), output=(3,), presence_penalty=-1.0),
    ]
    processed = process_logits(logits, build(rows, V))
    exp0 = torch.zeros(V)
    exp0[1] = -(0.5 + 3 * 0.25)
    exp0[2] = -(0.5 + 1 * 0.25)  # prompt tokens 7, 8 are not penalized (OpenAI: output only)
    exp1 = torch.zeros(V)
    exp1[3] = 1.0
    torch.testing.assert_close(processed[0], exp0, rtol=0, atol=0)
    torch.testing.assert_close(processed[1], exp1, rtol=0, atol=0)


def test_logit_bias_added_bans_and_forces():
    V = 8
    torch.manual_seed(9)
    logits = torch.randn(1, V)
    processed = process_logits(logits, build([row(logit_bias={2: 1.5, 5: -0.25, 99: 3.0})], V))
    expected = logits.clone()
    expected[0, 2] += 1.5
    expected[0, 5] -= 0.25  # id 99 is outside the vocab: ignored
    torch.testing.assert_close(processed, expected, rtol=0, atol=0)

    peaked = probs_logits([0.97, 0.01, 0.01, 0.01])
    # a large negative bias bans the dominant token, under sampling and greedy
    assert 0 not in set(support(peaked, 2000, logit_bias={0: -100.0}).tolist())
    assert run(peaked[None], [row(temperature=0.0, logit_bias={0: -100.0})]).item() != 0
    # a large positive bias forces a token
    assert set(support(peaked, 2000, logit_bias={3: 100.0}).tolist()) == {3}


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_no_repeat_ngram_matches_hf(n):
    V = 12
    torch.manual_seed(10)
    prompt = (1, 2, 3, 1, 2)
    output = (4, 1, 2, 3, 1, 2)
    logits = torch.randn(1, V)
    processed = process_logits(logits, build([row(prompt=prompt, output=output, no_repeat_ngram_size=n)], V))
    expected = NoRepeatNGramLogitsProcessor(n)(torch.tensor([prompt + output]), logits)
    torch.testing.assert_close(processed, expected, rtol=0, atol=0)
    assert (processed == -INF).any()


def test_no_repeat_ngram_helper_matches_hf_on_random_sequences():
    g = gen(11)
    V = 6
    for _ in range(200):
        L = int(torch.randint(0, 25, (1,), generator=g))
        n = int(torch.randint(1, 5, (1,), generator=g))
        toks = torch.randint(0, V, (1, L), generator=g)
        scores = torch.zeros(1, V)
        hf = NoRepeatNGramLogitsProcessor(n)(toks, scores)[0]
        ours = torch.zeros(V)
        ours[no_repeat_ngram_bans(toks[0].tolist(), n)] = -INF
        assert torch.equal(hf, ours), (toks, n)


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    V = 8
    logits = torch.tensor([[0.0, 1.0, 9.0, 0.0, 0.0, 8.0, 0.0, 0.0]])  # EOS=2 best, stop id 5 next
    for out_len in range(5):
        output = (1,) * out_len
        r = row(temperature=0.0, output=output, eos=(2, 7), min_tokens=3, stop_token_ids=(5,))
        processed = process_logits(logits, build([r], V))[0]
        tok = run(logits, [r]).item()
        if out_len < 3:
            assert processed[2] == processed[7] == processed[5] == -INF
            assert tok == 1
        else:
            assert torch.equal(processed, logits[0])
            assert tok == 2
    # sampled rows too: EOS (p ~ 0.73) and the stop id (p ~ 0.27) are never drawn before min_tokens
    drawn = set(support(logits[0], 1000, output=(), eos=(2,), min_tokens=1, stop_token_ids=(5,)).tolist())
    assert drawn and not {2, 5} & drawn


def test_ignore_eos_bans_eos_but_not_stop_ids():
    logits = torch.tensor([[0.0, 1.0, 9.0, 0.0, 0.0, 8.0]])
    r = row(temperature=0.0, eos=(2,), ignore_eos=True, stop_token_ids=(5,), output=(1,) * 50)
    processed = process_logits(logits, build([r], 6))[0]
    assert processed[2] == -INF and processed[5] == 8.0
    assert run(logits, [r]).item() == 5
    assert 2 not in set(support(logits[0], 1000, eos=(2,), ignore_eos=True).tolist())
    # without ignore_eos EOS is picked
    assert run(logits, [row(temperature=0.0, eos=(2,))]).item() == 2


# ---------------------------------------------------------------- sampling


def test_seeded_row_same_alone_and_in_batch():
    torch.manual_seed(12)
    V = 1000
    steps = 5
    logits = torch.randn(steps, 6, V) * 2
    spec = dict(temperature=0.8, top_p=0.95)
    # alone
    g = gen(1234)
    alone = [run(logits[s, 2:3], [row(gen=g, **spec)]).item() for s in range(steps)]
    # in a batch with an unseeded row, a greedy row, another seeded row and different params
    g = gen(1234)
    g_other = gen(99)
    batched = []
    for s in range(steps):
        rows = [
            row(temperature=1.0),
            row(temperature=0.0),
            row(gen=g, **spec),
            row(gen=g_other, temperature=1.2, top_k=10),
            row(temperature=0.5, min_p=0.1, repetition_penalty=1.2, prompt=(1, 2)),
            row(temperature=1.0, typical_p=0.7),
        ]
        batched.append(run(logits[s], rows)[2].item())
    assert alone == batched
    # and it is exactly the documented recipe: argmax(probs / q), q = -log(torch.rand(V, generator=g))
    g = gen(1234)
    manual = []
    for s in range(steps):
        probs = process_logits(logits[s, 2:3], build([row(**spec)], V)).softmax(-1)[0]
        q = -torch.rand(V, generator=g).log()
        manual.append((probs / q).argmax().item())
    assert manual == alone
    # different seed -> (almost surely) a different sequence over 5 steps of a near-flat distribution
    g = gen(4321)
    other = [run(logits[s, 2:3], [row(gen=g, **spec)]).item() for s in range(steps)]
    assert other != alone


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum().item()
    exp = probs * n
    return float(((counts - exp) ** 2 / exp).sum())


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_sampling_frequencies_match_probabilities(temperature):
    p = torch.tensor([0.4, 0.3, 0.2, 0.07, 0.03])
    n = 50_000
    toks = support(p.log(), n, seed=13, temperature=temperature)
    counts = torch.bincount(toks, minlength=5).float()
    target = (p.log() / temperature).softmax(-1)
    # df = 4: P(chi2 > 40) ~ 4e-8; a sampler that ignored temperature scores in the thousands
    assert _chi2(counts, target) < 40.0
    if temperature != 1.0:
        assert _chi2(counts, p) > 200.0


def test_seeded_generator_sampling_frequencies():
    """Seeded rows (per-row generator path) sample from the right distribution too."""
    p = torch.tensor([0.5, 0.25, 0.125, 0.125])
    g = gen(14)
    n = 4000
    logits = p.log().expand(n, -1).contiguous()
    rows = [row(gen=g)] * n  # same generator for every row: n draws in sequence
    counts = torch.bincount(run(logits, rows), minlength=4).float()
    assert _chi2(counts, p) < 40.0


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_raw_log_softmax_and_top_k_sorted():
    torch.manual_seed(15)
    V = 64
    logits = torch.randn(4, V) * 2
    rows = [
        row(temperature=0.0, num_logprobs=3, logit_bias={0: 50.0}),  # bias changes the pick, not the logprob
        row(temperature=0.3, top_p=0.5, num_logprobs=5, gen=gen(1)),
        row(temperature=1.0, num_logprobs=0),
        row(temperature=0.0, repetition_penalty=2.0, prompt=tuple(range(V)), num_logprobs=1),
    ]
    out = sample(logits, build(rows, V))
    ref = logits.log_softmax(-1)
    assert out.token_ids[0].item() == 0
    torch.testing.assert_close(out.logprobs, ref.gather(1, out.token_ids[:, None])[:, 0])
    assert out.top_ids.shape == out.top_logprobs.shape == (4, 5)  # K = max in batch
    ref_vals, ref_ids = ref.topk(5, dim=-1)
    assert torch.equal(out.top_ids, ref_ids)
    torch.testing.assert_close(out.top_logprobs, ref_vals)
    assert (out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all()
    assert out.token_ids.dtype == torch.int64 and out.logprobs.dtype == torch.float32


def test_no_top_logprobs_when_nobody_asks():
    out = sample(torch.randn(2, 10), build([row(), row(temperature=0.0)], 10))
    assert out.top_ids is None and out.top_logprobs is None
    assert out.logprobs.shape == (2,) and torch.isfinite(out.logprobs).all()


# ---------------------------------------------------------------- mixed batch


def test_mixed_batch_rows_equal_rows_alone():
    torch.manual_seed(16)
    V = 500
    logits = torch.randn(8, V) * 2
    specs = [
        dict(temperature=0.0),
        dict(temperature=0.0, repetition_penalty=1.5, prompt=(1, 2, 3), output=(4,)),
        dict(temperature=0.7, top_p=0.9, seed_=1),
        dict(temperature=1.0, top_k=5, seed_=2),
        dict(temperature=1.2, min_p=0.05, presence_penalty=1.0, output=(3, 3), seed_=3),
        dict(temperature=1.0, typical_p=0.6, seed_=4),
        dict(temperature=0.9, no_repeat_ngram_size=2, prompt=(5, 6, 5), logit_bias={7: 2.0}, seed_=5),
        dict(temperature=0.0, eos=(9,), min_tokens=2, top_k=1),
    ]

    def rows_for(idx):
        out = []
        for i in idx:
            s = dict(specs[i])
            seed = s.pop("seed_", None)
            out.append(row(gen=gen(seed) if seed is not None else None, **s))
        return out

    all_idx = list(range(len(specs)))
    together = sample(logits, build(rows_for(all_idx), V))
    proc_together = process_logits(logits, build(rows_for(all_idx), V))
    for i in all_idx:
        alone = sample(logits[i : i + 1], build(rows_for([i]), V))
        assert together.token_ids[i] == alone.token_ids[0], i
        torch.testing.assert_close(together.logprobs[i], alone.logprobs[0], rtol=0, atol=0)
        torch.testing.assert_close(
            proc_together[i], process_logits(logits[i : i + 1], build(rows_for([i]), V))[0], rtol=0, atol=0
        )
    # the greedy rows are argmaxes of their processed logits
    for i in (0, 1, 7):
        assert together.token_ids[i] == proc_together[i].argmax()
    assert math.isinf(proc_together[7, 9].item())


# ---------------------------------------------------------------- every admitted value (property tests)


def _edges(*values):
    """Edge values first (Hypothesis shrinks towards them), then anything in the range."""
    return st.sampled_from(values)


UNIT_OPEN = _edges(5e-324, 1e-46, 1e-45, 1e-40, 1e-38, 1e-8, 1e-7, 0.3, 0.9, 1 - 1e-9, 1.0) | st.floats(0, 1, exclude_min=True)
TEMPERATURE = _edges(0.0, 5e-324, 1e-45, 1e-40, 9.99e-6, 1e-5, 0.1, 0.7, 1.0, 2.0, 1e30, 1e308) | st.floats(0, 10)
PENALTY = _edges(5e-324, 1e-45, 1e-30, 1e-20, 0.5, 1.0, 1.3, 1e20, 1e30, 1e308) | st.floats(0, 1e308, exclude_min=True)
BIAS = _edges(-100.0, 100.0, 0.0) | st.floats(-100, 100)


@st.composite
def sampler_rows(draw, V: int):
    tokens = st.lists(st.integers(0, V - 1), max_size=12)
    params = dict(
        temperature=draw(TEMPERATURE),
        top_k=draw(_edges(0, 1, 2, 5, V - 1, V, V + 1, 10**9)),
        top_p=draw(UNIT_OPEN),
        min_p=draw(_edges(0.0, 5e-324, 1e-45, 0.05, 1.0) | st.floats(0, 1)),
        typical_p=draw(UNIT_OPEN),
        repetition_penalty=draw(PENALTY),
        presence_penalty=draw(st.floats(-2, 2)),
        frequency_penalty=draw(st.floats(-2, 2)),
        logit_bias=draw(st.dictionaries(st.integers(0, V - 1), BIAS, max_size=V)),
        no_repeat_ngram_size=draw(st.integers(0, 3)),
        min_tokens=draw(st.integers(0, 3)),
        ignore_eos=draw(st.booleans()),
        stop_token_ids=draw(st.lists(st.integers(0, V - 1), max_size=3)),
    )
    seed = draw(st.none() | st.integers(0, 2**32))
    return row(prompt=draw(tokens), output=draw(tokens), eos=(0,), gen=None if seed is None else gen(seed),
               num_logprobs=draw(st.integers(0, 20)), **params)


# Real logits are within a few hundred; up to 1e13 every admitted value must give a token.
# Beyond (up to float32's max) a row may be refused with an error code, but never picks a
# token outside its allowed set.
SAFE_SCALE = 1e13


@st.composite
def batches(draw):
    V = draw(st.sampled_from([8, 64, 256]))  # 256: the CPU argmax's blocked path
    rows = draw(st.lists(sampler_rows(V), min_size=1, max_size=4))
    scale = draw(_edges(1e-30, 1e-3, 1.0, 30.0, 1e4, SAFE_SCALE, 1e20, 1e30, 3e38))
    logits = torch.randn(len(rows), V, generator=gen(draw(st.integers(0, 2**16)))) * scale
    logits = logits.clamp(-torch.finfo(torch.float32).max, torch.finfo(torch.float32).max)
    if draw(st.booleans()):  # a model that masks some tokens (never a whole row: that is the model's error)
        logits[:, 1 : V // 2 : 3] = -INF
    return rows, logits, scale


@settings(max_examples=200, derandomize=True, database=None, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_any_admitted_parameters_give_an_allowed_token_and_finite_probabilities(case):
    rows, logits, scale = case
    V = logits.shape[-1]
    batch = build(rows, V)
    out = sample(logits, batch)
    pre = apply_processors(logits, batch)  # penalties, bias and bans: the HF-checked stages above
    final = process_logits(logits, batch)
    safe = scale <= SAFE_SCALE
    if safe:
        assert not pre.isnan().any() and not (pre == INF).any()  # the clamped penalty cannot overflow
    for i, r in enumerate(rows):
        tok = out.token_ids[i].item()
        banned = set(_banned_tokens(r))
        if banned >= {t for t in range(V) if logits[i, t] > -INF}:
            assert tok == ROW_ALL_BANNED  # nothing left: an error for this request, not a pick
            continue
        if tok < 0:
            assert not safe and tok in ROW_ERRORS
            continue
        assert 0 <= tok < V and tok not in banned and final[i, tok] > -INF and pre[i, tok] > -INF
        # Beyond SAFE_SCALE a pick the processors lifted (a tiny repetition penalty on a
        # -3e38 logit) may have a raw log-probability below float32's range: -inf is its value.
        assert math.isfinite(out.logprobs[i].item()) or not safe
        p = r.params
        if p.greedy:
            assert pre[i, tok] == pre[i].max()
            continue
        z = pre[i] / min(p.temperature, torch.finfo(torch.float32).max)  # float32, as sampled (ties as there)
        if 0 < p.top_k < V:
            assert (z > z[tok]).sum() < p.top_k
            z = z.masked_fill(z < z.topk(p.top_k).values[-1], -INF)
        if safe and p.top_p < 1.0:  # the mass of the tokens more likely than the pick is under top_p
            assert z.double().softmax(-1)[z > z[tok]].sum() < p.top_p + 1e-3
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy and out.token_ids[i] != ROW_ALL_BANNED]
    if safe and sampled:
        probs = logits_to_probs(pre[sampled], build([rows[i] for i in sampled], V))
        assert probs.isfinite().all()
        torch.testing.assert_close(probs.sum(-1), torch.ones(len(sampled)), atol=1e-4, rtol=0)


def test_issue_poison_values_are_greedy_or_keep_the_top_token():
    """The issue's inputs, spelled out: each rule of the module docstring."""
    torch.manual_seed(21)
    logits = torch.randn(6, 300) * 4
    greedy = logits.argmax(-1)
    for spec in (dict(top_p=1e-46), dict(top_p=5e-324), dict(top_p=1e-9, top_k=50), dict(temperature=1e-40),
                 dict(temperature=5e-324, top_p=0.5), dict(temperature=9.9e-6)):
        assert torch.equal(run(logits, [row(**spec)] * 6), greedy), spec
    # The sorted (accelerator) top-p path keeps only the top token for a top_p that rounds 1 - top_p to 1.
    b = build([row(top_p=1e-46)] * 6, 300)
    kept = apply_top_k_top_p(logits, None, b.top_p_rm, b.top_p_on) > -INF
    assert torch.equal(kept.sum(-1), torch.ones(6, dtype=torch.long)) and kept[torch.arange(6), greedy].all()
    # A repetition penalty of 1e-45 is 1e-20: finite logits, the same picks.
    prompt = tuple(range(0, 300, 7))
    tiny = process_logits(logits, build([row(temperature=0.0, repetition_penalty=1e-45, prompt=prompt)] * 6, 300))
    clamped = process_logits(logits, build([row(temperature=0.0, repetition_penalty=1e-20, prompt=prompt)] * 6, 300))
    assert tiny.isfinite().all() and torch.equal(tiny, clamped)


def test_rows_without_a_token_get_error_codes_and_the_rest_are_untouched():
    torch.manual_seed(22)
    V = 64
    logits = torch.randn(5, V)
    logits[1, 7] = float("nan")
    logits[2] = -INF
    logits[3, 9] = INF
    for params in (dict(temperature=0.0), dict(temperature=0.8, top_p=0.9)):
        def rows(n):  # a fresh generator per row: the good row draws the same noise alone and in the batch
            return [row(gen=gen(5), **params) for _ in range(n)] + [row(no_repeat_ngram_size=1, prompt=tuple(range(V)), **params)]

        out = sample(logits, build(rows(4), V))
        assert out.token_ids[1:].tolist() == [ROW_NONFINITE_LOGITS] * 3 + [ROW_ALL_BANNED]
        assert out.token_ids[0] == sample(logits[:1], build(rows(1)[:1], V)).token_ids[0]


@pytest.mark.skipif(not kernels.available(), reason="the native greedy op")
def test_greedy_rows_in_one_native_op_give_the_general_paths_tokens_codes_and_logprob_bits(monkeypatch):
    """An all-greedy batch without top logprobs takes kernels.greedy_rows: against the same batch through the general
    path (the op off), every token id, error code and logprob bit, with and without a processor."""
    g = gen(31)
    V = 1000
    logits = torch.randn(6, V, generator=g) * 3
    logits[1, 7] = float("nan")
    logits[2] = -INF
    logits[3, 9] = INF
    logits[4, 100:110] = logits[4].max() + 1  # ties for the max: the first wins
    bans = (dict(ignore_eos=True, eos=(int(logits[0].argmax()), 3, 3)), dict(min_tokens=2, eos=(int(logits[5].argmax()),)),
            dict(no_repeat_ngram_size=1, prompt=tuple(range(V))))  # bans alone: the op bans in place and puts back
    for extra in (dict(), dict(logit_bias={5: 40.0}), dict(logit_bias={5: 40.0}, ignore_eos=True, eos=(5,)), *bans):
        batch = build([row(temperature=0.0, **extra) for _ in range(6)], V)
        before = logits.clone()
        native = sample(logits, batch)
        assert torch.equal(logits.view(torch.int32), before.view(torch.int32))  # the logits are as they were, bit for bit
        assert batch.only_bans == (extra in bans)
        with monkeypatch.context() as m:
            m.setattr(sampler_mod, "_greedy_op", lambda batch: False)
            ref = sample(logits, batch)
        assert torch.equal(native.token_ids, ref.token_ids), extra
        assert torch.equal(native.logprobs.nan_to_num(0.5, 1.5, -1.5), ref.logprobs.nan_to_num(0.5, 1.5, -1.5)), extra
    assert native.token_ids.tolist() == [ROW_ALL_BANNED, ROW_NONFINITE_LOGITS, ROW_NONFINITE_LOGITS, ROW_NONFINITE_LOGITS,
                                         ROW_ALL_BANNED, ROW_ALL_BANNED]


@pytest.mark.skipif(not kernels.available(), reason="the native log-sum-exp")
def test_every_logprob_is_the_logit_less_a_row_invariant_log_sum_exp():
    """kernels.row_logsumexp, which every CPU logprob is taken from (log_softmax_rows): within float32's rounding of a
    float64 log-sum-exp, the same bits for a row alone as in any batch, NaN where the row has a NaN or +inf or nothing
    finite; and log_softmax_rows within float32 rounding of torch's log_softmax, the sampler's picks and top logprobs its values."""
    g = gen(41)
    for V in (1, 7, 16, 1000, 49152):
        x = torch.randn(5, V, generator=g) * 8
        lse = kernels.row_logsumexp(x)
        ref = torch.logsumexp(x.double(), dim=-1)
        assert torch.allclose(lse.double(), ref, rtol=2e-7, atol=2e-6), V
        for r in range(5):  # a row alone, and in a batch of others
            assert torch.equal(kernels.row_logsumexp(x[r : r + 1]), lse[r : r + 1])
            assert torch.equal(kernels.row_logsumexp(torch.cat([x[r:], x[:r]]))[0], lse[r])
        assert torch.allclose(log_softmax_rows(x), x.log_softmax(-1), atol=1e-5, rtol=1e-6)  # a few ulp at |x| ~ 50
    bad = torch.zeros(4, 9)
    bad[0, 3], bad[1, 5], bad[2] = float("nan"), INF, -INF
    assert kernels.row_logsumexp(bad)[:3].isnan().all() and kernels.row_logsumexp(bad)[3].item() == pytest.approx(math.log(9))
    logits = torch.randn(3, 50, generator=g) * 3
    out = sample(logits, build([row(temperature=0.0, num_logprobs=4), row(temperature=0.7, gen=gen(2), num_logprobs=4),
                                row(temperature=0.0, num_logprobs=4)], 50))
    logp = log_softmax_rows(logits)
    assert torch.equal(out.logprobs, logp.gather(1, out.token_ids[:, None])[:, 0])
    assert torch.equal(out.top_logprobs, logp.gather(1, out.top_ids))
