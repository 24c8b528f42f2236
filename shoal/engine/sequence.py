"""A sequence's state: plain Python, no tensors.

Progress is two counters: `num_computed_tokens` (KV written to the cache) and
`num_tokens` (known: prompt plus sampled). Prefill, chunked prefill, decode and
recompute after preemption are all "computed catches up with known":

    token_ids:  | computed (KV in blocks) | known, not yet computed |
                0                num_computed_tokens            num_tokens
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from shoal import multimodal
from shoal.types import FinishReason, SamplingParams

_seq_counter = itertools.count()


class BlockTable(list):
    """A KV group's block table that knows how much of it the model runners hold (the plan of diffs, issue 53).

    The runners keep every sequence's tables from step to step; a step sends each table's entries from `kept` on,
    and the runners put them in place of theirs from there (runner/kept.py). Every change to an entry before the
    end lowers `kept` to it: copy-on-write's swap of a block (kv_manager._index), a window's freed blocks (slide),
    a rejected draft's blocks (trim). Appending needs nothing: the new entries are past `kept`. A table the KV
    manager makes anew (admission, fork, release) is a plain list, which the scheduler wraps with `kept` 0, so it
    goes out whole.
    """

    __slots__ = ("kept",)

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.kept = 0

    def diff(self) -> tuple[int, tuple[int, ...]]:
        """(where the unsent entries start, those entries); from now on the runners hold them all."""
        start = self.kept
        self.kept = len(self)
        return start, tuple(self[start:])

    def _changed(self, index) -> None:
        if isinstance(index, slice):
            index = index.indices(len(self))[0] if index.step in (None, 1) else 0
        elif index < 0:
            index += len(self)
        self.kept = max(0, min(self.kept, index))

    def __setitem__(self, index, value) -> None:
        self._changed(index)
        super().__setitem__(index, value)

    def __delitem__(self, index) -> None:
        self._changed(index)
        super().__delitem__(index)

    def insert(self, index, value) -> None:
        self._changed(index)
        super().insert(index, value)

    def pop(self, index=-1):
        self._changed(index)
        return super().pop(index)

    def _reset(self) -> None:  # a mutator that may move any entry: the whole table goes out again
        self.kept = 0

    def remove(self, value) -> None:
        self._reset()
        super().remove(value)

    def clear(self) -> None:
        self._reset()
        super().clear()

    def sort(self, *args, **kwargs) -> None:
        self._reset()
        super().sort(*args, **kwargs)

    def reverse(self) -> None:
        self._reset()
        super().reverse()

    def __imul__(self, n):
        self._reset()
        return super().__imul__(n)


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    index: int = 0  # which of the request's n choices this is
    priority: int = 0
    seq_id: int = field(default_factory=lambda: next(_seq_counter))
    # Order of arrival, for FIFO among equal priorities; siblings share it.
    arrival: int = -1
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # One block table per KV group (types.KVGroup); only the KV manager changes them. A windowed group's table
    # holds its pool's null block where the blocks fell out of the window.
    block_tables: list[list[int]] = field(default_factory=lambda: [[]])
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    # For n > 1: siblings wait for the first sequence of their request to compute
    # the prompt, then share its blocks (see Scheduler._fork).
    fork_parent: Sequence | None = None
    # The tokens of token_ids the model runner holds as this sequence's history (the sampler's penalties and
    # bans): a step sends it the rest (Scheduler._scheduled_seq).
    history_sent: int = 0
    # Held by its group (a beam that has sampled, engine/beam.py): its next token is the
    # group's choice, so it is never scheduled again; it keeps its KV for what continues it.
    paused: bool = False
    in_flight: bool = False  # in a pipeline micro-batch that has not come back: not scheduled, not preempted
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV came from elsewhere (fork / prefix cache)
    seed: int | None = None
    # Prompt positions whose logits already gave a prompt logprob (of the token after
    # them); the prompt is done at prompt_len - 1. Not reset by preemption, so a recompute
    # does not compute them again.
    num_prompt_logprobs: int = 0
    # The prompt's images (multimodal.ImageSpan), in order.
    images: tuple = ()
    # Extra content hashes at token positions (image placeholders): part of the prefix-cache key. By default
    # each image's digest at each of its placeholders.
    extra_keys: dict[int, int | bytes] | None = None
    # Prefix-cache trie nodes of this sequence's indexed full blocks, in order.
    cache_nodes: list = field(default_factory=list)
    # A read from the prefix cache's second tier in progress for this waiting sequence (kv_store.Fetch).
    kv_fetch: object | None = None
    # The prefix cache's answer when the sequence was admitted: miss | extension | supersequence | divergence | tier.
    cache_hit_kind: str | None = None
    # A token constraint that has accepted exactly its output tokens (engine/structured.py):
    # a GrammarMatcher (structured output) or a BudgetMatcher (a thinking budget); None: free.
    grammar: object | None = None
    # Speculative decoding (engine/speculative.py): the tokens proposed after the newest one, verified in
    # the next step (not part of token_ids until the target agrees); with a grammar, the mask of each drafted
    # position after the first; and the sequence's speculation state (draft length, acceptance, n-gram index).
    draft: tuple[int, ...] = ()
    draft_masks: tuple = ()
    spec: object | None = None
    # A pooling request's mode ("last" | "mean"; engine/pooled.py): computes its prompt, samples nothing, and keeps no
    # KV: its blocks are not indexed in the prefix cache. "last" may start from a cached prefix (only its last row is
    # pooled, and that one is always computed); "mean" needs every row's hidden state, so it takes no hit.
    pooling: str | None = None
    # An encoder's input (bidirectional attention): computed whole in one step, never in chunks.
    whole: bool = False

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.extra_keys is None:
            self.extra_keys = multimodal.extra_keys(self.images)
        if self.arrival < 0:
            self.arrival = self.seq_id

    @property
    def block_table(self) -> list[int]:
        """The first group's table (the only one of a model with one group)."""
        return self.block_tables[0]

    @block_table.setter
    def block_table(self, table: list[int]) -> None:
        self.block_tables[0] = table

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not all computed yet."""
        return self.params.prompt_logprobs is not None and self.num_prompt_logprobs < self.prompt_len - 1

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def keeps_kv(self) -> bool:
        """Whether its computed blocks go into the prefix cache (everything but a pooling request's)."""
        return self.pooling is None

    @property
    def needs_every_row(self) -> bool:
        """Whether every prompt position's output is wanted (prompt logprobs, mean pooling): no prefix-cache hit."""
        return self.wants_prompt_logprobs or self.pooling == "mean"

    def sort_key(self) -> tuple[int, int, int]:
        """Lower runs first: priority, then arrival, then choice index."""
        return (self.priority, self.arrival, self.index)
