"""Turn one step's logits into one token per row.

Runs once per engine step over the whole batch, so everything below is a fixed
sequence of batched tensor ops with no Python loop over rows (the only per-row
Python is in `SamplingBatch.build`, over plain data, and the noise draw for rows
that carry their own seeded generator) and, on accelerators, no host sync. On
CPU, where a sync is free but torch's sort and argmax are slow, top-p and argmax
take cheaper exact routes (`apply_top_p_candidates`, `argmax_rows`).

Pipeline (same order as HF `generate` and vLLM):

    raw logits [B, V]
      -> logits processors, every row:  repetition penalty -> presence/frequency
         penalty -> logit_bias -> bans (no_repeat_ngram, min_tokens, ignore_eos)
         -> the grammar's mask (structured output: the tokens it does not allow)
      -> greedy rows: argmax
      -> sampled rows only: temperature -> top-k -> top-p -> min-p -> typical-p
         -> softmax -> exponential race (argmax(probs / q), q = -log(U) ~ Exp(1))
    logprobs (chosen token and top-K) always come from the *raw* logits, under a
    grammar too: they say what the model thought of the token, not how likely the
    constrained draw made it (vLLM's default).

`SamplingBatch.build` decides once per step which stages anybody in the batch
uses; `sample` skips the rest, so an all-greedy batch without penalties costs
one argmax (plus a log-sum-exp for the chosen token's logprob).

Every value `SamplingParams` admits is safe: no crash, no NaN, no silent pick.
`build` moves the parameters into float32's safe range, so the ops above need no
per-step checks:
  - temperature below MIN_SAMPLING_TEMPERATURE (1e-5) is greedy (`SamplingParams.greedy`),
    one above float32's largest is clamped to it;
  - top_p is at least float32's smallest normal (1e-46 would round to 0 and keep
    nothing), and a top_p so small that 1 - top_p rounds to 1 keeps the top token only;
  - repetition_penalty is clamped to [1e-20, 1e20]: beyond, every real logit has met the
    same limit (seen tokens pushed to the top or the bottom), and inside it a logit up to
    1e13 stays finite through the penalty and the smallest temperature;
  - min_p, typical_p (any tiny value keeps the first token), top_k > V (off), logit_bias
    (finite, validated) and presence/frequency (bounded) need nothing.
A row with no token to give is an error for its request, never a pick: `sample`
writes a negative code (ROW_ERRORS) in place of its token id. The raw logits hold a
NaN or +inf, or nothing finite (they have no log-sum-exp, which logprobs need);
the bans (ignore_eos, min_tokens, no_repeat_ngram_size) cover the whole vocabulary
(the pick's processed logit is -inf); or the warpers made a NaN, which only logits
beyond ~1e13 can (the exponential race then picks the NaN). The checks are a few
ops over [B] and ride on the token ids' transfer: no extra host sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from typing import NamedTuple

import torch

from shoal import kernels
from shoal.runner.kept import TokenHistory
from shoal.types import SamplingParams

_NEG_INF = float("-inf")
_TINY = torch.finfo(torch.float32).tiny
_FLOAT32_MAX = torch.finfo(torch.float32).max
REPETITION_PENALTY_RANGE = (1e-20, 1e20)

# Token-id codes of rows that have no token, and what their request is told.
ROW_NONFINITE_LOGITS = -1
ROW_ALL_BANNED = -2
ROW_NONFINITE_PROBS = -3
ROW_ERRORS = {
    ROW_NONFINITE_LOGITS: "the model produced non-finite logits for this request",
    ROW_ALL_BANNED: "every token is banned by this request's parameters (ignore_eos, min_tokens, stop_token_ids, no_repeat_ngram_size, structured output)",
    ROW_NONFINITE_PROBS: "sampling with this request's parameters gave non-finite probabilities",
}


# ---------------------------------------------------------------- inputs


@dataclass(frozen=True)
class SamplerRow:
    """Plain data for one sampled row; the runner makes one per sequence."""

    params: SamplingParams
    # The row's token history, read only for penalties and bans: given whole (prompt_token_ids, output_token_ids), or
    # the runner's kept one (`history`, runner/kept.py), with `extra` tokens after it (a draft's, before this row).
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()  # generated so far
    eos_token_ids: tuple[int, ...] = ()  # the model's EOS set
    # Seeded per sequence, on the logits' device; None: the global RNG. A sampled
    # (non-greedy) step draws exactly V uniforms from it; greedy steps draw none.
    generator: torch.Generator | None = None
    num_logprobs: int = 0  # top logprobs wanted besides the chosen token's
    # Structured output: the tokens the grammar allows (bit t of the little-endian bytes:
    # token t), or None for an unconstrained row.
    token_mask: bytes | None = None
    history: TokenHistory | None = None
    extra: tuple[int, ...] = ()

    def tokens(self) -> TokenHistory:
        """The history with the views penalties and bans read: the kept one, or one built from the ids given."""
        if self.history is not None:
            return self.history
        return TokenHistory.of(self.prompt_token_ids, self.output_token_ids, self.params.no_repeat_ngram_size)


@dataclass
class SamplingBatch:
    """One step's sampling inputs as tensors, built once from `SamplerRow`s.

    A field is None when no row in the batch uses that stage, and `sample`
    skips the stage. Shapes: B rows, V vocab, Bs = rows that sample (not greedy).
    """

    batch_size: int
    vocab_size: int

    # -- logits processors, over all B rows. Sparse: they touch only the (row, token)
    # pairs concerned, which on CPU is far cheaper than a dense [B, V] pass.
    rep_index: tuple[torch.Tensor, torch.Tensor] | None = None  # unique (rows [R], tokens [R]) in prompt + output
    rep_penalty: torch.Tensor | None = None  # [R] float32, the row's repetition_penalty
    pf_index: tuple[torch.Tensor, torch.Tensor] | None = None  # unique (rows [F], tokens [F]) in the output
    pf_penalty: torch.Tensor | None = None  # [F] float32: presence + frequency * count, subtracted
    bias_index: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows [N], tokens [N]) int64
    bias_values: torch.Tensor | None = None  # [N] float32, added at bias_index
    ban_index: torch.Tensor | None = None  # [M] int64: row * V + token of each (row, token) set to -inf
    mask_rows: torch.Tensor | None = None  # [C] int64: the constrained rows
    mask_allowed: torch.Tensor | None = None  # [C, V] bool: what their grammars allow

    # -- sampling, over the Bs sampled rows
    all_greedy: bool = True
    all_sampled: bool = False
    sample_rows: torch.Tensor | None = None  # [Bs] int64 row indices; None when all_sampled
    temperature: torch.Tensor | None = None  # [Bs, 1] float32
    top_k: torch.Tensor | None = None  # [Bs, 1] int64 in [1, V] (V for rows with top-k off)
    max_top_k: int = 0  # largest k of the rows with top-k on
    top_p: torch.Tensor | None = None  # [Bs, 1] float32, 1.0 for rows without
    top_p_rm: torch.Tensor | None = None  # [Bs, 1] float32: 1 - top_p, computed in float64 like HF
    top_p_on: torch.Tensor | None = None  # [Bs, 1] bool
    min_p: torch.Tensor | None = None  # [Bs, 1] float32, 0 for rows without
    typical_p: torch.Tensor | None = None  # [Bs, 1] float32
    typical_on: torch.Tensor | None = None  # [Bs, 1] bool
    generators: tuple[torch.Generator | None, ...] = ()  # [Bs], None: global RNG

    # -- logprobs
    num_top_logprobs: int = 0  # K = max num_logprobs in the batch

    @property
    def only_bans(self) -> bool:
        """Whether the bans are the only processor in the batch."""
        return (self.ban_index is not None and self.rep_index is None and self.pf_index is None and self.bias_index is None
                and self.mask_rows is None)

    @property
    def any_processor(self) -> bool:
        return (
            self.rep_index is not None
            or self.pf_index is not None
            or self.bias_index is not None
            or self.ban_index is not None
            or self.mask_rows is not None
        )

    @classmethod
    def build(cls, rows: Sequence[SamplerRow], vocab_size: int, device: torch.device | str) -> SamplingBatch:
        V = vocab_size
        B = len(rows)
        dev = torch.device(device)
        b = cls(batch_size=B, vocab_size=V)

        def f32(xs: list[float]) -> torch.Tensor:  # [n] -> [n, 1]
            return torch.tensor(xs, dtype=torch.float32, device=dev).unsqueeze(1)

        # The histories of the rows that read one (penalties, bans), each once: their views are kept up to date as
        # tokens come (runner/kept.py TokenHistory), so nothing here passes over a history in Python.
        hist = {i: r.tokens() for i, r in enumerate(rows) if r.params.needs_history}

        # -------- repetition penalty: the distinct tokens of prompt + output (HF)
        rep = [r.params.repetition_penalty for r in rows]
        if any(p != 1.0 for p in rep):
            ids = [hist[i].seen_tokens(r.extra) if p != 1.0 else [] for i, (r, p) in enumerate(zip(rows, rep))]
            row_idx, tok_idx, _ = _pairs(ids, V)
            if len(row_idx):
                b.rep_index = (row_idx.to(dev), tok_idx.to(dev))
                lo, hi = REPETITION_PENALTY_RANGE
                rep = [min(max(p, lo), hi) for p in rep]
                b.rep_penalty = torch.tensor(rep, dtype=torch.float32)[row_idx].to(dev)

        # -------- presence / frequency: per-token counts over the output (OpenAI)
        pres = [r.params.presence_penalty for r in rows]
        freq = [r.params.frequency_penalty for r in rows]
        if any(pres) or any(freq):
            pairs = [hist[i].output_counts(r.extra) if (pp or fp) else ([], []) for i, (r, pp, fp) in enumerate(zip(rows, pres, freq))]
            row_idx, tok_idx, counts = _pairs([t for t, _ in pairs], V, [c for _, c in pairs])
            if len(row_idx):
                pres_t = torch.tensor(pres, dtype=torch.float32)[row_idx]
                freq_t = torch.tensor(freq, dtype=torch.float32)[row_idx]
                b.pf_index = (row_idx.to(dev), tok_idx.to(dev))
                b.pf_penalty = (pres_t + freq_t * counts.float()).to(dev)  # presence * (count > 0) + frequency * count

        # -------- logit_bias: sparse (row, token, value); ids outside the vocab are dropped
        bias_rows: list[int] = []
        bias_toks: list[int] = []
        bias_vals: list[float] = []
        for i, r in enumerate(rows):
            for tok, val in (r.params.logit_bias or {}).items():
                tok = int(tok)
                if 0 <= tok < V:
                    bias_rows.append(i)
                    bias_toks.append(tok)
                    bias_vals.append(float(val))
        if bias_rows:
            b.bias_index = (_i64(bias_rows, dev), _i64(bias_toks, dev))
            b.bias_values = torch.tensor(bias_vals, dtype=torch.float32, device=dev)

        # -------- bans: (row, token) pairs forced to -inf
        ban_rows: list[int] = []
        ban_toks: list[int] = []
        for i, r in enumerate(rows):
            banned = _banned_tokens(r, hist.get(i))
            ban_toks.extend(t for t in banned if 0 <= t < V)
            ban_rows.extend([i] * (len(ban_toks) - len(ban_rows)))
        if ban_rows:
            b.ban_index = _i64([r * V + t for r, t in zip(ban_rows, ban_toks)], dev)

        # -------- grammar masks: only the constrained rows, one bool row each
        masked = [i for i, r in enumerate(rows) if r.token_mask is not None]
        if masked:
            b.mask_rows = _i64(masked, dev)
            b.mask_allowed = unpack_token_masks([rows[i].token_mask for i in masked], V).to(dev)

        # -------- sampling params of the non-greedy rows
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        b.all_greedy = not sampled
        b.all_sampled = len(sampled) == B and B > 0
        if sampled:
            ps = [rows[i].params for i in sampled]
            if not b.all_sampled:
                b.sample_rows = _i64(sampled, dev)
            if any(p.temperature != 1.0 for p in ps):
                b.temperature = f32([min(p.temperature, _FLOAT32_MAX) for p in ps])
            ks = [p.top_k for p in ps if 0 < p.top_k < V]
            if ks:
                b.max_top_k = max(ks)
                b.top_k = _i64([p.top_k if 0 < p.top_k < V else V for p in ps], dev).unsqueeze(1)
            if any(p.top_p < 1.0 for p in ps):
                b.top_p = f32([max(p.top_p, _TINY) for p in ps])
                rm = f32([1.0 - p.top_p for p in ps])
                b.top_p_rm = rm.masked_fill(rm >= 1.0, float("inf"))  # 1 - top_p rounds to 1: all but the top go
                b.top_p_on = torch.tensor([p.top_p < 1.0 for p in ps], device=dev).unsqueeze(1)
            if any(p.min_p > 0.0 for p in ps):
                b.min_p = f32([p.min_p for p in ps])
            if any(p.typical_p < 1.0 for p in ps):
                b.typical_p = f32([p.typical_p for p in ps])
                b.typical_on = torch.tensor([p.typical_p < 1.0 for p in ps], device=dev).unsqueeze(1)
            b.generators = tuple(rows[i].generator for i in sampled)

        b.num_top_logprobs = min(max((r.num_logprobs for r in rows), default=0), V)
        return b


def _i64(xs: list[int], dev: torch.device) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64, device=dev)


def _pairs(ids: list[list[int]], V: int, counts: list[list[int]] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-row lists of distinct token ids (and each one's count) -> (row [N], token [N], count [N] or None) on the
    CPU; ids outside [0, V) are dropped."""
    flat = torch.tensor(list(chain.from_iterable(ids)), dtype=torch.int64)  # joined in C, not a Python loop a token
    rows = torch.repeat_interleave(torch.arange(len(ids)), torch.tensor([len(r) for r in ids], dtype=torch.int64))
    keep = (flat >= 0) & (flat < V)
    n = None
    if counts is not None:
        n = torch.tensor(list(chain.from_iterable(counts)), dtype=torch.int64)[keep]
    return rows[keep], flat[keep], n


_BIT = torch.tensor([1 << j for j in range(8)], dtype=torch.uint8)


def unpack_token_masks(masks: list[bytes], V: int) -> torch.Tensor:
    """Bitmasks (bit t of the little-endian bytes: token t; the same length each) -> [n, V] bool."""
    packed = torch.frombuffer(bytearray(b"".join(masks)), dtype=torch.uint8).view(len(masks), -1)  # [n, bytes]
    bits = (packed.unsqueeze(-1) & _BIT) != 0  # [n, bytes, 8]
    allowed = bits.view(len(masks), -1)
    if allowed.shape[1] < V:  # tokens past the mask (a vocabulary padded beyond the tokenizer's) are never allowed
        allowed = torch.cat([allowed, allowed.new_zeros(len(masks), V - allowed.shape[1])], dim=1)
    return allowed[:, :V]


def _banned_tokens(r: SamplerRow, history: TokenHistory | None = None) -> list[int]:
    """Token ids this row may not pick this step (duplicates are harmless). history: r.tokens(), where built."""
    p = r.params
    banned: list[int] = []
    if p.ignore_eos:
        banned.extend(r.eos_token_ids)
    if p.min_tokens > 0 or p.no_repeat_ngram_size > 0:
        history = history if history is not None else r.tokens()
        if history.num_output(r.extra) < p.min_tokens:
            banned.extend(r.eos_token_ids)
            banned.extend(p.stop_token_ids)
        if p.no_repeat_ngram_size > 0:
            banned.extend(history.ngram_bans(r.extra))
    return banned


def no_repeat_ngram_bans(tokens: list[int], n: int) -> list[int]:
    """Tokens that would complete an n-gram already in `tokens` (HF NoRepeatNGramLogitsProcessor).

    The next token completes the n-gram (last n-1 tokens, next); it is banned iff
    some earlier window tokens[i : i+n-1] equals that prefix, and then the
    window's successor tokens[i+n-1] is the banned token. O(len * n) in Python,
    only for rows that ask for it.
    """
    L = len(tokens)
    if n <= 0 or L < n:
        return []
    if n == 1:
        return list(set(tokens))
    prefix = tokens[L - n + 1 :]
    first = prefix[0]
    return [tokens[i + n - 1] for i in range(L - n + 1) if tokens[i] == first and tokens[i : i + n - 1] == prefix]


# ---------------------------------------------------------------- processors (all rows)


def apply_repetition_penalty_(
    logits: torch.Tensor, index: tuple[torch.Tensor, torch.Tensor], penalty: torch.Tensor
) -> torch.Tensor:
    """In place, HF/CTRL: each seen token's logit x penalty if negative, / penalty otherwise.

    logits [B, V]; index: distinct (rows [R], tokens [R]); penalty [R].
    """
    seen = logits[index]  # [R]
    logits.index_put_(index, torch.where(seen < 0, seen * penalty, seen / penalty))
    return logits


def apply_presence_frequency_(
    logits: torch.Tensor, index: tuple[torch.Tensor, torch.Tensor], penalty: torch.Tensor
) -> torch.Tensor:
    """In place, OpenAI: logit -= presence * (count > 0) + frequency * count, for the output's
    distinct tokens. index: (rows [F], tokens [F]); penalty [F] = presence + frequency * count."""
    logits.index_put_(index, -penalty, accumulate=True)  # x + (-d) == x - d exactly
    return logits


def apply_processors(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Penalties, logit_bias and bans on every row [B, V]: one copy of the logits, then
    sparse in-place updates. Returns the input itself when nothing applies (never modifies it)."""
    if not batch.any_processor:
        return logits
    logits = logits.clone()
    if batch.rep_index is not None:
        apply_repetition_penalty_(logits, batch.rep_index, batch.rep_penalty)
    if batch.pf_index is not None:
        apply_presence_frequency_(logits, batch.pf_index, batch.pf_penalty)
    if batch.bias_index is not None:
        logits.index_put_(batch.bias_index, batch.bias_values, accumulate=True)
    if batch.ban_index is not None:
        logits.view(-1).index_fill_(0, batch.ban_index, _NEG_INF)  # flat: a tenth of index_put_'s cost
    if batch.mask_rows is not None:
        constrained = logits.index_select(0, batch.mask_rows).masked_fill_(~batch.mask_allowed, _NEG_INF)
        logits.index_copy_(0, batch.mask_rows, constrained)
    return logits


# ---------------------------------------------------------------- warpers (sampled rows)


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """logits [Bs, V] / temperature [Bs, 1] (HF TemperatureLogitsWarper)."""
    return logits / temperature


def apply_top_k(logits: torch.Tensor, k: torch.Tensor, max_k: int) -> torch.Tensor:
    """Keep the k largest logits (and ties with the k-th), like HF TopKLogitsWarper.

    k [Bs, 1] in [1, V], V meaning off. One topk of the batch's largest k; rows
    with k == V keep everything.
    """
    V = logits.shape[-1]
    top = logits.topk(max_k, dim=-1).values  # [Bs, max_k] descending
    kth = top.gather(1, (k.clamp(max=max_k) - 1))  # [Bs, 1] k-th largest
    kth = kth.masked_fill(k >= V, _NEG_INF)
    return logits.masked_fill(logits < kth, _NEG_INF)


def apply_top_k_top_p(
    logits: torch.Tensor,
    k: torch.Tensor | None,
    top_p_rm: torch.Tensor | None,
    top_p_on: torch.Tensor | None,
) -> torch.Tensor:
    """Top-k then top-p with one ascending sort (HF TopK then TopPLogitsWarper).

    In ascending order the k-th largest sits at column V - k, and masking below
    it leaves exactly the sorted tensor HF's top-p would sort again, so the
    cumulative sums match HF bit for bit. top_p_rm [Bs, 1] = 1 - top_p: a sorted
    position is removed while the mass up to and including it is <= 1 - top_p;
    the largest token always stays.
    """
    V = logits.shape[-1]
    sorted_logits, sorted_idx = logits.sort(dim=-1)  # [Bs, V] ascending
    remove = None
    if k is not None:
        kth = sorted_logits.gather(1, V - k)  # [Bs, 1]; k == V -> the minimum -> keeps all
        remove = sorted_logits < kth
        sorted_logits = sorted_logits.masked_fill(remove, _NEG_INF)
    if top_p_rm is not None:
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [Bs, V]
        remove_p = cum <= top_p_rm
        remove_p[:, -1] = False
        remove_p &= top_p_on  # rows with top_p == 1 are untouched (HF skips the warper)
        remove = remove_p if remove is None else remove | remove_p
    mask = remove.scatter(1, sorted_idx, remove)  # back to vocab order
    return logits.masked_fill(mask, _NEG_INF)


TOP_P_CANDIDATES = 1024  # CPU top-p looks for the nucleus among this many most likely tokens


def apply_top_p_candidates(
    logits: torch.Tensor,
    top_p: torch.Tensor,
    top_p_rm: torch.Tensor,
    top_p_on: torch.Tensor,
    num_candidates: int | None = None,
) -> torch.Tensor:
    """Top-p without a full sort (for CPU, where torch's sort is slow), same result as HF.

    HF keeps a token iff the mass of the tokens ranked above it is < top_p. Taking
    the n most likely tokens (a partial sort) and their probabilities under the
    full distribution, that mass is the exclusive cumsum; the kept tokens are a
    prefix, and the row's cut is the logit of the last kept one. When the n
    candidates hold less than top_p of the mass the nucleus reaches past them:
    those rows (checked on the host, which costs nothing on CPU) redo the exact
    sort. top_p / top_p_rm / top_p_on: [Bs, 1].
    """
    V = logits.shape[-1]
    n = min(V, num_candidates or TOP_P_CANDIDATES)
    vals, idx = logits.topk(n, dim=-1)  # [Bs, n] descending
    # candidates' probabilities under the whole (renormalized) distribution; log_softmax, not
    # logsumexp: see `sample`
    p = logits.log_softmax(dim=-1).gather(1, idx).exp_()
    cum = p.cumsum(dim=-1)
    above = torch.cat([cum.new_zeros(cum.shape[0], 1), cum[:, :-1]], dim=1)  # mass ranked above each
    num_kept = (above < top_p).sum(dim=-1, keepdim=True)  # >= 1: the first has 0 above
    cut = vals.gather(1, num_kept - 1)  # [Bs, 1] smallest kept logit
    cut = cut.masked_fill(~top_p_on, _NEG_INF)
    out = logits.masked_fill(logits < cut, _NEG_INF)
    if n < V:
        spill = (cum[:, -1:] < top_p) & top_p_on  # nucleus not inside the candidates
        if spill.any():
            rows = spill.squeeze(1).nonzero().squeeze(1)
            exact = apply_top_k_top_p(logits[rows], None, top_p_rm[rows], top_p_on[rows])
            out = out.index_copy(0, rows, exact)
    return out


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens with prob < min_p * max prob (HF MinPLogitsWarper). min_p [Bs, 1], 0 = off."""
    probs = logits.softmax(dim=-1)
    threshold = min_p * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, _NEG_INF)  # the max never falls below (min_p <= 1)


def apply_typical_p(logits: torch.Tensor, mass: torch.Tensor, on: torch.Tensor) -> torch.Tensor:
    """Locally typical sampling (HF TypicalLogitsWarper), per-row mass [Bs, 1].

    Sort tokens by |-log p - H| (closest to the entropy first) and keep the
    shortest prefix whose mass reaches `mass`, plus ties with its last score.
    """
    V = logits.shape[-1]
    logp = logits.log_softmax(dim=-1)
    ent = -(logp * logp.exp()).nansum(-1, keepdim=True)  # [Bs, 1]; -inf * 0 = nan is skipped
    shifted = (-logp - ent).abs()
    sorted_scores, sorted_idx = shifted.sort(dim=-1)
    cum = logits.gather(-1, sorted_idx).softmax(dim=-1).cumsum(dim=-1)
    last = (cum < mass).sum(dim=1, keepdim=True).clamp_(max=V - 1)  # [Bs, 1]
    remove = sorted_scores > sorted_scores.gather(1, last)
    remove[:, 0] = False
    remove &= on
    mask = remove.scatter(1, sorted_idx, remove)
    return logits.masked_fill(mask, _NEG_INF)


def apply_warpers(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Temperature -> top-k -> top-p -> min-p -> typical on the sampled rows' logits [Bs, V]."""
    if batch.temperature is not None:
        logits = apply_temperature(logits, batch.temperature)
    if batch.top_p is not None and logits.device.type == "cpu":
        # CPU: a full sort costs ~5 ms per 49k-vocab row; look for the nucleus in the top candidates.
        if batch.top_k is not None:
            logits = apply_top_k(logits, batch.top_k, batch.max_top_k)
        logits = apply_top_p_candidates(logits, batch.top_p, batch.top_p_rm, batch.top_p_on)
    elif batch.top_p is not None:
        # Accelerators: one sort is cheap and needs no host sync.
        logits = apply_top_k_top_p(logits, batch.top_k, batch.top_p_rm, batch.top_p_on)
    elif batch.top_k is not None:
        logits = apply_top_k(logits, batch.top_k, batch.max_top_k)
    if batch.min_p is not None:
        logits = apply_min_p(logits, batch.min_p)
    if batch.typical_p is not None:
        logits = apply_typical_p(logits, batch.typical_p, batch.typical_on)
    return logits


def process_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The logits each row is finally picked from, [B, V]: processors on every row,
    warpers on sampled rows (greedy rows take the argmax of this). For tests and
    debugging; `sample` does the same without materializing the full tensor."""
    logits = apply_processors(logits.float(), batch)
    if batch.all_greedy:
        return logits
    if batch.all_sampled:
        return apply_warpers(logits, batch)
    warped = apply_warpers(logits[batch.sample_rows], batch)
    return logits.index_copy(0, batch.sample_rows, warped)


# ---------------------------------------------------------------- sampling


def logits_to_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Sampled rows' processed logits [Bs, V] -> probabilities [Bs, V]."""
    return apply_warpers(logits, batch).softmax(dim=-1)


def exponential_noise(batch: SamplingBatch, n: int, V: int, device: torch.device) -> torch.Tensor:
    """q ~ Exp(1), [n, V], as -log(u) with u ~ U(0, 1) from `torch.rand`.

    Rows with a generator draw their own row from it (`torch.rand(V, generator=g)`),
    so a seeded row's q depends only on its generator; the rest share one global
    draw. -log(rand) rather than `exponential_`: 4-6x cheaper on CPU, where
    `exponential_` works in float64. u is clamped away from 0 so q is finite and
    positive: p / q is then never NaN (0/0) and a lone surviving token always wins.
    """
    u = torch.empty(n, V, device=device)
    gens = batch.generators
    if any(g is None for g in gens):
        u.uniform_()
    for j, g in enumerate(gens):
        if g is not None:
            u[j].uniform_(generator=g)  # the same numbers as torch.rand(V, generator=g)
    return uniform_to_exponential_(u)


def uniform_to_exponential_(u: torch.Tensor) -> torch.Tensor:
    """In place: u ~ U[0, 1) -> -log(u) ~ Exp(1), with u = 0 clamped so the result is finite (<= 87.3)."""
    return u.clamp_min_(_TINY).log_().neg_()


def sample_from_probs(probs: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Exponential race: argmax(p / q) with q ~ Exp(1) is a draw from p, with no
    host sync (unlike torch.multinomial). [n, V] -> [n] int64; overwrites probs."""
    return argmax_rows(probs.div_(q))


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) for [n, V], first index on ties, the same result.

    On CPU torch's argmax is a scalar loop (~3 ns/element, 20x slower than amax): one native op where the kernels
    built (kernels.row_argmax: 10 us at V = 49152, a row's first NaN where it has one, as torch's); elsewhere find
    the block holding the max with the vectorized amax over [n, V/blk, blk], then argmax only the first such block
    (~5x faster than torch's argmax at V = 49152).
    """
    if _native_rows(x):
        return kernels.row_argmax(x)[0]
    n, V = x.shape
    blk = next((b for b in (128, 64, 32) if V % b == 0), 0)
    if x.device.type != "cpu" or not blk or V < 4 * blk:
        return x.argmax(dim=-1)
    xb = x.reshape(n, V // blk, blk)
    block = xb.amax(dim=-1).argmax(dim=-1)  # [n] first block containing the row max
    inner = xb.gather(1, block.view(n, 1, 1).expand(n, 1, blk)).squeeze(1).argmax(dim=-1)  # [n]
    return block * blk + inner


def _native_rows(x: torch.Tensor) -> bool:
    """Whether shoal's native row ops take x [n, V]: float32 rows on the CPU, where the kernels built."""
    return x.is_cpu and x.dtype == torch.float32 and x.stride(-1) == 1 and x.shape[-1] > 0 and kernels.available()


def topk_ids(x: torch.Tensor, k: int) -> torch.Tensor:
    """The ids of each row's k largest values of float32 `x` [n, V], largest first, and among equal values the
    smallest id first. torch's topk breaks ties by its own blocking, which changes with the number of rows:
    in bfloat16 equal logits are common, and a row's alternatives then changed with its batch (a tiny
    Qwen2's, with and without speculative decoding's extra rows). torch's topk picks the set; only a row
    whose k-th value is tied past the set is picked again, by (value, id) as one int64 key."""
    vals, ids = x.topk(k, dim=-1)
    V = x.shape[-1]
    ids = ids.gather(1, _sort_keys(vals, V - 1 - ids).argsort(dim=-1, descending=True))
    straddle = ((x >= vals[:, -1:]).sum(dim=-1) > k).nonzero().flatten()
    if len(straddle):
        rows = x[straddle]
        ids[straddle] = _sort_keys(rows, V - 1 - torch.arange(V, device=x.device)).topk(k, dim=-1).indices
    return ids


def _sort_keys(values: torch.Tensor, rank: torch.Tensor) -> torch.Tensor:
    """int64 keys ordered as (float32 value, rank), for rank in [0, V)."""
    bits = values.contiguous().view(torch.int32)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)  # the floats' order, as integers
    return ordered * (1 << 20) + rank


class SamplerOutput(NamedTuple):
    token_ids: torch.Tensor  # [B] int64; a negative id is a ROW_ERRORS code: that row has no token
    logprobs: torch.Tensor  # [B] float32: chosen token under log_softmax_rows(raw logits)
    top_ids: torch.Tensor | None  # [B, K] int64, most likely first, from the raw distribution
    top_logprobs: torch.Tensor | None  # [B, K] float32, descending


def log_softmax_rows(x: torch.Tensor) -> torch.Tensor:
    """log_softmax over each row of float32 x [n, V], as every logprob the engine reports is taken (sampled tokens, top
    logprobs, beams, prompt logprobs): on the CPU, where the kernels built, x less each row's native log-sum-exp
    (kernels.row_logsumexp: 35 -> about 12 us a row of 49,152, with no [n, V] output where only picks are read);
    elsewhere torch's log_softmax. Either way a row's values do not depend on the other rows."""
    if _native_rows(x):
        return x - kernels.row_logsumexp(x).unsqueeze(1)
    return x.log_softmax(dim=-1)


def _greedy_op(batch: SamplingBatch) -> bool:
    """Whether a batch whose rows the native ops take ends in kernels.greedy_rows: every row greedy, no top logprobs."""
    return batch.all_greedy and not batch.num_top_logprobs


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    """One token per row of `logits` [B, V] (the raw model output)."""
    raw = logits.float()
    native = _native_rows(raw)  # and so the processed copy's (a clone of raw, changed in place)
    greedy_op = native and _greedy_op(batch)
    if greedy_op and batch.only_bans and raw.is_contiguous():
        # bans alone (ignore_eos, min_tokens, n-gram bans): the op bans them in raw for its argmax and puts them back
        return SamplerOutput(*kernels.greedy_rows(raw, raw, batch.ban_index), None, None)
    processed = apply_processors(raw, batch)  # [B, V]; `raw` itself is never modified
    if greedy_op:
        # the steps below for greedy rows in one native op: the same argmax, log-sum-exp and codes
        return SamplerOutput(*kernels.greedy_rows(raw, processed), None, None)

    drawn_ok = None  # [B] bool: the exponential race picked a token of positive probability
    if batch.all_greedy:
        token_ids = argmax_rows(processed)
    else:
        sub = processed if batch.all_sampled else processed[batch.sample_rows]  # [Bs, V]
        probs = logits_to_probs(sub, batch)
        q = exponential_noise(batch, probs.shape[0], probs.shape[1], probs.device)
        sampled = sample_from_probs(probs, q)  # [Bs]; probs now holds p / q
        won = probs.gather(1, sampled.unsqueeze(1)).squeeze(1) > 0  # a NaN anywhere in the row wins the race
        if batch.all_sampled:
            token_ids, drawn_ok = sampled, won
        else:
            token_ids = argmax_rows(processed).index_copy_(0, batch.sample_rows, sampled)
            drawn_ok = torch.ones_like(token_ids, dtype=torch.bool).index_copy_(0, batch.sample_rows, won)

    # Logprobs under the raw model distribution (what vLLM/OpenAI report), as log_softmax_rows takes them: row by row
    # whatever the batch (torch's logsumexp would split a lone row's vocabulary across threads, so a request's
    # logprobs would change with the batch). Natively only the picks are computed: each less its row's log-sum-exp.
    top_ids = top_logprobs = None
    if batch.num_top_logprobs > 0:
        top_ids = topk_ids(raw, batch.num_top_logprobs)  # sorted descending, ties by token id
    if native:
        lse = kernels.row_logsumexp(raw).unsqueeze(1)  # [B, 1]; NaN where a row has a NaN, +inf or nothing finite
        chosen = (raw.gather(1, token_ids.unsqueeze(1)) - lse).squeeze(1)
        if top_ids is not None:
            top_logprobs = raw.gather(1, top_ids) - lse
        finite = lse.squeeze(1).isfinite()
    else:
        logp = raw.log_softmax(dim=-1)  # [B, V]
        chosen = logp.gather(1, token_ids.unsqueeze(1)).squeeze(1)
        if top_ids is not None:
            top_logprobs = logp.gather(1, top_ids)
        # NaN or +inf anywhere in a row, or nothing finite, leaves no finite log_softmax maximum
        finite = logp.amax(dim=-1).isfinite()
    return SamplerOutput(_mark_rows_without_token(token_ids, finite, processed, drawn_ok), chosen, top_ids, top_logprobs)


def _mark_rows_without_token(
    token_ids: torch.Tensor, finite: torch.Tensor, processed: torch.Tensor, drawn_ok: torch.Tensor | None
) -> torch.Tensor:
    """token_ids [B] with each row that has no real token replaced by its ROW_ERRORS code,
    the model's fault first: finite [B], whether the raw logits have a finite log_softmax; processed [B, V]."""
    allowed = processed.gather(1, token_ids.unsqueeze(1)).squeeze(1) > _NEG_INF  # -inf picked: all banned
    if drawn_ok is not None:
        token_ids = torch.where(drawn_ok, token_ids, ROW_NONFINITE_PROBS)
    token_ids = torch.where(allowed, token_ids, ROW_ALL_BANNED)
    return torch.where(finite, token_ids, ROW_NONFINITE_LOGITS)
