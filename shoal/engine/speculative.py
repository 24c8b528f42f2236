"""Speculative decoding: drafts proposed, verified by exact match, k adapted per sequence. No torch.

A decoding sequence with a draft d_0..d_{k-1} computes its newest token and the k drafted ones in one
chunk of k + 1 positions, and every one of those positions samples, as a decode of that position would:
the same logits (the forward is batch- and chunk-invariant), the same processors over the history up to
it, the same generator (seeded by (seed, position)), the grammar's mask after the drafted tokens before
it. The target's own tokens t_0..t_k come back, and the step keeps them while the draft agreed:

    t_0 .. t_j   where j is the first position with t_j != d_j (or k: all agreed, t_k is a bonus token)

Each kept token is exactly the one decoding without a draft gives at that position, with the same
logprobs, because the positions before it held exactly the tokens decoding would have put there. So a
greedy or seeded request gives the same tokens with speculation as without; a draft only changes how
many of them one step yields. The KV of rejected positions is dropped at once (the scheduler trims the
blocks past the accepted tokens); the prefix cache indexes computed tokens only, which are accepted ones.

Proposers:
    NgramProposer  prompt lookup: the longest recent n-gram of the sequence's own tokens (prompt and
                   output) that occurred before; its continuation is the draft. No model, ~µs a step.
    a draft model  engine/draft.py: a small model with the target's tokenizer, greedy, its own KV pool.

`Speculator` decides, per step, who drafts and how far:
    - k adapts per sequence: the length that yields the most tokens per unit of step time (`best_k`), from
      the sequence's recent acceptance (decayed counts), the other sequences decoding in the step, and what a
      drafted position costs on this host (`draft_cost`, measured at start: builder.time_steps); 0 when no
      draft pays, and then a one-token probe once in PROBE_TOKENS tokens, so that a sequence that starts to
      repeat itself is noticed.
    - no drafts in a step with more than `max_batch` decoding sequences (the step is compute-bound there:
      the drafted positions cost about what they would save), nor for beam search (the group picks its
      beams from every candidate's scores, which a draft cannot know) or a sequence with prompt logprobs
      still to give.
    - a draft never runs past max_tokens or the context, and a constrained sequence's draft stops at the
      first token its grammar refuses.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shoal.engine.sequence import Sequence

# A sequence's per-token acceptance is a decayed count of agreements over the positions checked up to the first
# disagreement; each verified draft weighs the past by ACCEPTANCE_DECAY. A fresh sequence starts from PRIOR.
ACCEPTANCE_DECAY = 0.8
PRIOR = (3.0, 4.0)  # (agreements, positions checked): 0.75
PROBE_TOKENS = 8  # a sequence whose drafts do not pay drafts one token once in this many of its tokens
DRAFT_COST = 0.08  # a drafted position's cost as a fraction of a one-token decode step, where none was measured


def best_k(a: float, cost: float, k_max: int, others: int = 0) -> int:
    """The draft length with the most tokens per unit of step time: a draft of k whose tokens each agree with
    probability a yields (1 - a^(k+1)) / (1 - a) tokens on average. The step also decodes `others` sequences,
    a token each, and costs 1 + cost * (others + k) one-token steps (a position of a batch costs about what a
    drafted one does). So a draft must beat the step's own rate: beside many decodes, only a likely one pays.
    0 when none pays."""
    base = 1 + cost * others
    best, value = 0, (others + 1) / base
    for k in range(1, k_max + 1):
        tokens = k + 1 if a >= 1 else (1 - a ** (k + 1)) / (1 - a)
        v = (others + tokens) / (base + cost * k)
        if v > value:
            best, value = k, v
    return best


@dataclass
class SpecState:
    """One sequence's speculation: its acceptance and its n-gram index."""

    agreements: float = PRIOR[0]  # decayed counts: drafted tokens the target agreed with ...
    checked: float = PRIOR[1]  # ... over positions checked (each draft's up to its first disagreement)
    next_probe: int = 0  # the output length at which a sequence whose drafts do not pay drafts one token
    # n-gram index: for each n, the n-gram -> the position just after its latest occurrence, for every
    # n-gram that ends before the sequence's last token (the last one is the key looked up)
    index: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)
    indexed: int = 0  # positions 0 .. indexed - 1 are the ends of indexed n-grams

    @property
    def acceptance(self) -> float:
        return self.agreements / self.checked


@dataclass
class ProposerStats:
    """Per proposer: drafts verified, their drafted tokens, and the drafted tokens the target agreed with."""

    drafts: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0


class NgramProposer:
    """Prompt lookup: find the sequence's last n tokens earlier in its own tokens (n from max_n down to
    min_n, the most recent occurrence) and propose what followed them."""

    name = "ngram"

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min <= max, got {min_n} and {max_n}")
        self.min_n, self.max_n = min_n, max_n

    def propose_many(self, wanted: list[tuple[Sequence, int]]) -> list[list[int]]:
        """A draft of up to k tokens for each (sequence, k): the proposers' one interface (engine/draft.py)."""
        return [self.propose(seq, seq.spec, k) for seq, k in wanted]

    def release(self, seq_id: int) -> None:
        """Nothing to return: a sequence's index lives on its SpecState."""

    def propose(self, seq: Sequence, state: SpecState, k: int) -> list[int]:
        tokens = seq.token_ids
        last = len(tokens) - 1
        self._index(tokens, state, last)
        for n in range(self.max_n, self.min_n - 1, -1):
            if n > last + 1:
                continue
            at = state.index.get(n, {}).get(tuple(tokens[last - n + 1 :]))
            if at is not None:
                return tokens[at : at + k]
        return []

    def _index(self, tokens: list[int], state: SpecState, last: int) -> None:
        """Index the n-grams ending at positions state.indexed .. last - 1 (each n-gram's latest occurrence wins)."""
        for end in range(state.indexed, last):
            for n in range(self.min_n, self.max_n + 1):
                if end + 1 >= n:
                    state.index.setdefault(n, {})[tuple(tokens[end - n + 1 : end + 1])] = end + 1
        state.indexed = max(state.indexed, last)


def accepted_length(draft: tuple[int, ...] | list[int], sampled: list[int]) -> int:
    """How many of the target's tokens a step keeps: up to and including its first disagreement with the
    draft (all k + 1 when the draft agreed throughout). `sampled` has len(draft) + 1 tokens."""
    for j, (d, t) in enumerate(zip(draft, sampled)):
        if t != d:
            return j + 1
    return min(len(draft) + 1, len(sampled))


class Speculator:
    """Who drafts in a step, how far, and what came of it (`observe`)."""

    def __init__(self, proposer, max_tokens: int, max_batch: int, max_model_len: int, draft_cost: float = DRAFT_COST) -> None:
        self.proposer = proposer
        self.draft_cost = draft_cost  # a drafted position's cost, as a fraction of a one-token decode step
        self.max_tokens = max_tokens
        self.max_batch = max_batch
        self.max_model_len = max_model_len
        self.stats = ProposerStats()
        self.steps_off = 0  # steps the batch was too large to draft in

    @property
    def name(self) -> str:
        return self.proposer.name

    def eligible(self, seq: Sequence) -> bool:
        p = seq.params
        return not (p.use_beam_search or seq.paused or seq.in_flight or seq.num_uncomputed_tokens != 1
                    or seq.wants_prompt_logprobs or seq.finished or seq.pooling is not None)

    def propose(self, running: list[Sequence]) -> None:
        """Set `draft` (and a constrained sequence's `draft_masks`) on the running sequences that decode next."""
        decoding = [s for s in running if self.eligible(s)]
        for seq in decoding:
            seq.draft, seq.draft_masks = (), ()
        if len(decoding) > self.max_batch:
            self.steps_off += 1
            return
        wanted = []
        for seq in decoding:
            state = seq.spec
            if state is None:
                state = seq.spec = SpecState()
            k = best_k(state.acceptance, self.draft_cost, self.max_tokens, len(decoding) - 1)
            if k == 0 and seq.num_output_tokens >= state.next_probe:  # drafts do not pay: probe now and then
                k, state.next_probe = 1, seq.num_output_tokens + PROBE_TOKENS
            k = min(k, self._room(seq))
            if k > 0:
                wanted.append((seq, k))
        for (seq, _), draft in zip(wanted, self.proposer.propose_many(wanted)):
            if draft and seq.grammar is not None:
                draft, masks = _within_grammar(seq.grammar, draft)
                seq.draft_masks = masks
            seq.draft = tuple(draft)

    def release(self, seqs: list[Sequence]) -> None:
        """A request retired: its sequences' drafting state goes (a draft model's KV blocks included)."""
        for seq in seqs:
            seq.spec = None
            seq.draft, seq.draft_masks = (), ()
            self.proposer.release(seq.seq_id)

    def _room(self, seq: Sequence) -> int:
        """The longest draft worth verifying: the step yields at most k + 1 tokens, within max_tokens and the context."""
        room = self.max_model_len - seq.num_tokens
        if seq.params.max_tokens is not None:
            room = min(room, seq.params.max_tokens - seq.num_output_tokens - 1)
        return room

    def observe(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """A verified draft of `drafted` tokens kept `accepted` of them (the bonus token not counted)."""
        st = self.stats
        st.drafts += 1
        st.drafted_tokens += drafted
        st.accepted_tokens += accepted
        state = seq.spec
        state.agreements = ACCEPTANCE_DECAY * state.agreements + accepted
        state.checked = ACCEPTANCE_DECAY * state.checked + accepted + (accepted < drafted)


def _within_grammar(matcher, draft: list[int]) -> tuple[list[int], tuple]:
    """The draft cut at the first token the grammar refuses (or after the one that completes it), and the
    mask of each verified position after the first, which is the sequence's own matcher's: masks[i] is what
    the grammar allows after draft[: i + 1]. A matcher that fails here gives no draft (the sequence's own
    token will meet the failure)."""
    kept, masks = [], []
    try:
        m = matcher.fork()
        for t in draft:
            mask = m.mask
            if mask is not None and not (mask[t // 8] >> (t % 8)) & 1:
                break
            m.accept(t)
            kept.append(t)
            masks.append(m.mask)
            if m.done:
                break
    except Exception:
        return [], ()
    return kept, tuple(masks)
