"""The draft-model proposer of speculative decoding (engine/speculative.py): a small model with the target's
tokenizer, run greedily on its own KV pool, kept in step with each sequence's accepted tokens.

Per sequence it remembers the tokens whose KV its pool holds. Before drafting, that list is cut to its
longest common prefix with the sequence's tokens (the accepted part of its last draft survives, a rejected
tail is overwritten), and the rest of the sequence's tokens are computed as one chunk, whose last row gives
the first drafted token; each further drafted token is a batched one-token decode. A sequence's first draft
thereby computes its whole prompt on the draft model; a long one is computed CATCH_UP_TOKENS a step, without
drafting, so that no step stalls on it.

The draft's blocks come from its own KVBlockPool: with an explicit `kv_cache_memory`, the target's byte budget (a
draft model is smaller, so it holds more tokens than the target's); with an auto one, as many blocks as the
target's pool (the target left it the room, runner/build.with_draft_share). A sequence that does not fit gets
no draft in that step; a finished or preempted one's blocks go back at the next proposal.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

from shoal.engine.block_pool import KVBlockPool
from shoal.engine.sequence import SequenceStatus
from shoal.types import SamplingParams, ScheduledSeq, StepPlan

log = logging.getLogger("shoal.engine")

CATCH_UP_TOKENS = 512  # the most tokens of one sequence the draft model computes in a step before drafting
GREEDY = SamplingParams(temperature=0.0, max_tokens=None)


@dataclass
class _DraftSeq:
    tokens: list[int] = field(default_factory=list)  # the tokens whose KV the draft pool holds, in order
    blocks: list[int] = field(default_factory=list)
    confirmed: int = 0  # tokens[:confirmed] came from the sequence's own tokens (which only ever grow)


class DraftProposer:
    name = "draft"

    def __init__(self, runner, max_model_len: int) -> None:
        self.runner = runner
        self.max_model_len = max_model_len
        self.pool = KVBlockPool(runner.num_blocks, runner.block_size)
        self._seqs: dict[int, tuple[object, _DraftSeq]] = {}
        self._gone: list[int] = []  # sequences released since the last step, for the runner to forget

    @classmethod
    def load(cls, model: str, config, tokenizer, max_model_len: int, target_blocks: int) -> DraftProposer:
        """Build the draft model's runner from `model`, with the target's engine settings (dtype, device, weight
        format) and a pool of its own, and check that it reads the target's tokens. target_blocks: the target's
        pool, which an auto-sized draft pool matches."""
        from shoal.config import CacheConfig  # noqa: PLC0415
        from shoal.runner.build import build_part  # noqa: PLC0415

        memory, blocks = config.cache.kv_cache_memory, config.cache.num_blocks
        cache = CacheConfig(block_size=config.cache.block_size, enable_prefix_cache=False, kv_cache_memory=memory,
                            num_blocks=blocks if blocks is not None or memory is not None else target_blocks, kv_groups=False)
        draft_config = replace(config, model=model, cache=cache, max_model_len=max_model_len, parallel=type(config.parallel)())
        part = build_part(draft_config)
        check_same_vocabulary(part.checkpoint.tokenizer, tokenizer)
        log.info("speculative decoding: draft model %s, %d KV blocks of its own", model, part.runner.num_blocks)
        return cls(part.runner, max_model_len)

    def propose_many(self, wanted: list) -> list[list[int]]:
        """Drafts of up to k tokens for each (sequence, k), in one catch-up step and k - 1 decode steps."""
        self._forget_gone()
        drafts: dict[int, list[int]] = {}
        active = []  # (sequence, its _DraftSeq, k) that draft this step
        chunks = []
        for seq, k in wanted:
            d = self._seqs.setdefault(seq.seq_id, (seq, _DraftSeq()))[1]
            tokens = seq.token_ids
            common = _common_prefix(d.tokens, tokens, d.confirmed, len(tokens) - 1)  # the newest is always computed here
            del d.tokens[common:]
            feed = tokens[common:]
            drafting = len(feed) <= CATCH_UP_TOKENS
            feed = feed[:CATCH_UP_TOKENS]
            if not self._room(d, common + len(feed) + (k - 1 if drafting else 0)):
                self._free(d)
                continue
            chunks.append(self._scheduled(seq.seq_id, feed, common, d))
            d.tokens.extend(feed)
            d.confirmed = len(d.tokens)
            drafts[seq.seq_id] = []
            if drafting:
                active.append((seq, d, k))
        if not chunks:
            return [[] for _ in wanted]
        step = 0
        sampled = self._run(chunks)
        while active:
            for seq, d, _ in active:
                drafts[seq.seq_id].append(sampled[seq.seq_id])
            step += 1
            active = [(seq, d, k) for seq, d, k in active if step < k]
            if not active:
                break
            decodes = []
            for seq, d, _ in active:
                tok = drafts[seq.seq_id][-1]
                decodes.append(self._scheduled(seq.seq_id, [tok], len(d.tokens), d))
                d.tokens.append(tok)
            sampled = self._run(decodes)
        return [drafts.get(seq.seq_id, []) for seq, _ in wanted]

    def _run(self, seqs: list[ScheduledSeq]) -> dict[int, int]:
        gone, self._gone = tuple(self._gone), []  # the runner drops what it kept of them (runner/kept.py)
        out = self.runner.execute(StepPlan(tuple(seqs), finished=gone))
        return {s.seq_id: s.token_id for s in out.sampled if s.error is None}

    def _scheduled(self, seq_id: int, tokens: list[int], start: int, d: _DraftSeq) -> ScheduledSeq:
        return ScheduledSeq(seq_id=seq_id, token_ids=tuple(tokens), start_pos=start, block_table=tuple(d.blocks),
                            sample=True, params=GREEDY)

    def _room(self, d: _DraftSeq, num_tokens: int) -> bool:
        """Blocks for `num_tokens` positions in d's table (those past them freed)."""
        need = self.pool.blocks_for_tokens(min(num_tokens, self.max_model_len))
        if need < len(d.blocks):
            self.pool.free(d.blocks[need:])
            del d.blocks[need:]
        more = need - len(d.blocks)
        if more > self.pool.num_free:
            return False
        if more > 0:
            d.blocks.extend(self.pool.allocate(more))
        return True

    def _free(self, d: _DraftSeq) -> None:
        if d.blocks:
            self.pool.free(d.blocks)
        d.blocks, d.tokens, d.confirmed = [], [], 0

    def release(self, seq_id: int) -> None:
        """The sequence is done: its blocks go back now."""
        entry = self._seqs.pop(seq_id, None)
        if entry is not None:
            self._free(entry[1])
            self._gone.append(seq_id)

    def _forget_gone(self) -> None:
        """Return the blocks of sequences that finished or were preempted (they recompute from the start)."""
        for seq_id, (seq, d) in list(self._seqs.items()):
            if seq.status is not SequenceStatus.RUNNING or not seq.block_table:
                self._free(d)
                del self._seqs[seq_id]
                self._gone.append(seq_id)

    @property
    def num_tracked(self) -> int:
        return len(self._seqs)


def _common_prefix(a: list[int], b: list[int], start: int, limit: int) -> int:
    """The length of a's and b's common prefix (at most `limit`), knowing they agree on their first `start`."""
    n = min(len(a), len(b), limit)
    i = min(start, n)
    while i < n and a[i] == b[i]:
        i += 1
    return i


def check_same_vocabulary(draft_tokenizer, target_tokenizer) -> None:
    """Refuse a draft model whose token ids mean other text than the target's."""
    if draft_tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise ValueError("the speculative draft model must use the target model's tokenizer (its vocabulary differs)")
