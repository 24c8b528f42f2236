"""What a model runner keeps of each sequence from step to step: its block tables, and its token history.

A step's plan carries diffs, not whole state (issue 53; vLLM v1's `InputBatch` with its cached requests): each
block table from the first entry the runner's copy lacks or has wrong (`engine/sequence.py` BlockTable), the
history from the first token the runner lacks, and the ids of the sequences that are gone. So nothing of a
sequence's length is copied, sent or compared per step, and the ranks of tensor and pipeline parallelism get a
broadcast the size of what changed. Every rank applies every plan once, in order, so their copies stay the same.

Plain Python, no tensors. A sequence's tables are lists the runner passes on as they are; the attention backend
learns from a span's `changed_from` which entries it must write again (model/attention/invariant.py TableRows).
"""

from __future__ import annotations


class OutOfStep(RuntimeError):
    """A diff that starts past what the runner holds: the scheduler and the runner disagree."""


class _BySequence:
    """What is kept, by sequence id; a plan's finished ids drop theirs."""

    def __init__(self) -> None:
        self.of: dict = {}

    def drop(self, seq_ids) -> None:
        for seq_id in seq_ids:
            self.of.pop(seq_id, None)

    def __len__(self) -> int:
        return len(self.of)


class KeptLists(_BySequence):
    """seq_id -> a few lists of ints (a table per KV group), changed by diffs. A sequence id below 0 (a probe's) keeps
    nothing: its diffs must be whole."""

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what

    def put(self, seq_id: int, starts, tails) -> list[list[int]]:
        """The sequence's lists after a diff: list i from `starts[i]` on is `tails[i]`. The lists returned are the
        kept ones, changed in place: read them within the step, do not hold on to them."""
        kept = self.of.setdefault(seq_id, []) if seq_id >= 0 else []
        while len(kept) < len(tails):
            kept.append([])
        for i, (start, tail) in enumerate(zip(starts, tails)):
            lst = kept[i]
            if start > len(lst):
                raise OutOfStep(f"sequence {seq_id}: the plan's {self.what} {i} starts at {start}, the runner holds {len(lst)}")
            del lst[start:]
            lst.extend(tail)
        return kept


class TokenHistory:
    """A sequence's tokens (prompt, then output) and what the sampler's penalties and bans read of them, brought up
    to date as tokens come, so that a step reads them in O(distinct tokens), with no pass over the history in Python:
      - `seen`, the distinct tokens of prompt and output (the repetition penalty, HF's);
      - `counts`, each output token's count (the presence and frequency penalties, OpenAI's);
      - the n-gram index, each (n-1)-token window's successors in order (no_repeat_ngram_size, HF's).
    Each view takes `extra`, tokens past the history (a draft's, verified row by row) that count as if appended.
    """

    def __init__(self, prompt_len: int, ngram: int = 0) -> None:
        self.tokens: list[int] = []
        self.prompt_len = prompt_len
        self.ngram = ngram
        self.seen: dict[int, None] = {}
        self.counts: dict[int, int] = {}
        self.index: dict[tuple[int, ...], list[int]] = {}

    @classmethod
    def of(cls, prompt, output, ngram: int = 0) -> TokenHistory:
        h = cls(len(prompt), ngram)
        h.extend(prompt)
        h.extend(output)
        return h

    def extend(self, tail) -> None:
        tokens, n, seen, counts, index = self.tokens, self.ngram, self.seen, self.counts, self.index
        for t in tail:
            p = len(tokens)
            seen[t] = None
            if p >= self.prompt_len:
                counts[t] = counts.get(t, 0) + 1
            if n > 1 and p >= n - 1:
                index.setdefault(tuple(tokens[p - n + 1 : p]), []).append(t)
            tokens.append(t)

    def num_output(self, extra=()) -> int:
        return len(self.tokens) + len(extra) - self.prompt_len

    def seen_tokens(self, extra=()) -> list[int]:
        """The distinct tokens of prompt, output and extra."""
        if not extra:
            return list(self.seen)
        return [*self.seen, *dict.fromkeys(t for t in extra if t not in self.seen)]

    def output_counts(self, extra=()) -> tuple[list[int], list[int]]:
        """(the distinct output tokens, each one's count), extra counted as output."""
        counts = self.counts
        if extra:
            counts = dict(counts)
            for t in extra:
                counts[t] = counts.get(t, 0) + 1
        return list(counts), list(counts.values())

    def ngram_bans(self, extra=()) -> list[int]:
        """The tokens that would complete an n-gram already in the tokens (and extra): sampler.no_repeat_ngram_bans's
        answer, in its order, from the index and the windows that end in extra."""
        n, tokens = self.ngram, self.tokens
        total = len(tokens) + len(extra)
        if n <= 0 or total < n:
            return []
        if n == 1:
            return self.seen_tokens(extra)
        if not extra:
            return list(self.index.get(tuple(tokens[-(n - 1) :]), ()))
        T = len(tokens)
        near = tokens[max(0, T - (n - 1)) :] + list(extra)  # near[k] is token base + k
        base = total - len(near)
        key = tuple(near[-(n - 1) :])
        bans = list(self.index.get(key, ()))
        for p in range(max(T, n - 1), total):  # successors in extra, after the window tokens[p - n + 1 : p]
            if tuple(near[p - n + 1 - base : p - base]) == key:
                bans.append(near[p - base])
        return bans


class KeptHistories(_BySequence):
    """seq_id -> TokenHistory, changed by the plans' diffs (rank 0, for sampling)."""

    def put(self, seq_id: int, start: int, tail, prompt_len: int, ngram: int) -> TokenHistory:
        h = self.of.get(seq_id) if seq_id >= 0 else None
        if h is None:
            h = TokenHistory(prompt_len, ngram)
        if start > len(h.tokens):
            raise OutOfStep(f"sequence {seq_id}: the plan's token history starts at {start}, the runner holds {len(h.tokens)}")
        if start < len(h.tokens):  # a history rewritten from there (the scheduler only appends): its views again
            old, h = h.tokens, TokenHistory(prompt_len, ngram)
            h.extend(old[:start])
        h.extend(tail)
        if seq_id >= 0:
            self.of[seq_id] = h
        return h
