"""Scheduler: which sequences run this step, and how many tokens each. No torch.

There is no prefill phase and no decode phase here: every sequence has
`num_computed_tokens` and `num_tokens`, and a step gives each scheduled
sequence up to `num_tokens - num_computed_tokens` of the step's token budget.
A long prompt is thereby chunked across steps and shares them with decodes.

Order:
  1. running sequences, highest priority (lowest number) first; a prefill
     chunk leaves a token of the budget for each running sequence after it
     that decodes, so that an earlier long prompt never takes a step from
     them; when blocks run out, the lowest-priority, newest running sequence
     is preempted (its blocks freed, its progress reset: it is recomputed
     when readmitted);
  2. waiting sequences in (priority, arrival) order, while budget, seats
     (`max_num_seqs`) and free blocks last. Waiting never preempts running.

Cost: a prefill chunk's tokens each attend to every earlier position, so a
chunk late in a long prompt costs far more than its token count says (an
8k-token prompt's last 512-token chunk took ~2 s of attention on AVX2, and
every decode beside it waited that long for its token). When sequences decode
in a step, its prefill chunks together are held to the `chunk_cost` of a whole
token budget at the start of a prompt (or of `max_prefill_beside_decodes`
tokens, where set): late chunks shrink, and each such step costs about the
same. A chunk still takes at least a block's worth, so the prompt moves on.
A prompt with no decode beside it takes whole budgets.

Arrivals: a prompt that arrives while another prefills would otherwise wait
for the whole of it (an 8k-token prompt is tens of seconds on a 2-core AVX2
CPU). While a waiting sequence as urgent as a running prefill could start,
the running prefills leave it half of what the decodes leave of the budget,
and the step is held to a whole budget's cost as beside decodes, so the
arrival's first chunk runs in the next step, in a step of normal length.
What the arrivals do not use of that half goes back to the prefills in the
same step, within the step's cost; when none can start after all (no blocks
free), a lone prompt takes its whole budget, so a queue that cannot move
never slows it.

With pipeline stages, several steps (micro-batches) are in flight at once: a
sequence in one is skipped until it comes back (its next token depends on it)
and is never a victim of preemption, and `schedule(max_seqs)` caps a
micro-batch's share so that the running sequences spread over the stages.

Decode runs: a step in which every running sequence decodes and none waits
may give each one that samples plainly (no grammar, no penalties or other
history, no beams, no draft) `run_steps` tokens: that many one-token forwards
back to back, each on the token the one before it picked. The engine picks
`run_steps` from the time a forward takes (`decode_run_ms`), so the
scheduler, the outputs and the stats run once for several tokens where a
step is short. Each forward is the one a step of its own would run, so the
tokens are the same. A run never preempts: it takes blocks only where one
more for every decode after it stays free, and gives back those it did not
use (the runner stops a run at a token that ends the sequence).

Blocks are the KV manager's (`kv_manager.py`): the scheduler asks it whether a
sequence fits and how much of it is cached, and never touches a block table.

The result is a plain-data `StepPlan` plus the bookkeeping the engine needs to
apply the step's outcome (`on_step_done`).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

from shoal.config import SchedulerConfig
from shoal.engine.kv_manager import KVCacheManager
from shoal.engine.sequence import BlockTable, Sequence, SequenceStatus
from shoal.engine.speculative import accepted_length
from shoal.types import FinishReason, SampledToken, SamplingParams, ScheduledSeq, StepPlan


# The context at which a token's attention costs about what its projections do, per layer, on the CPUs measured
# (about 0.7k tokens on AVX-512 VNNI and 1.4k on AVX2: benchmarks/NOTES.md, fourteenth round).
ATTENTION_CONTEXT = 1024
WAITS_ON_TIER = 0  # _admit's answer for a sequence whose prefix is being read from the second tier
MAX_DECODE_RUN = 8  # the most one-token forwards of a decode run


def chunk_cost(num_new: int, start: int) -> float:
    """The cost of computing positions start .. start + num_new - 1, in tokens computed at no context."""
    return num_new * (1.0 + (start + num_new / 2) / ATTENTION_CONTEXT)


def chunk_within(cost: float, start: int) -> int:
    """The most tokens from position `start` whose chunk_cost is at most `cost` (0 if none)."""
    if cost <= 0:
        return 0
    b = 1.0 + start / ATTENTION_CONTEXT
    n = int(ATTENTION_CONTEXT * (math.sqrt(b * b + 2 * cost / ATTENTION_CONTEXT) - b))
    return n - 1 if n > 0 and chunk_cost(n, start) > cost else n  # float rounding never lets a chunk over


@dataclass
class SchedulerOutput:
    plan: StepPlan
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens this step)
    preempted: list[Sequence] = field(default_factory=list)
    runs: dict[int, int] = field(default_factory=dict)  # seq_id -> its decode run's forwards, where more than one

    @property
    def empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: list[Sequence] = []  # sorted by Sequence.sort_key
        self.running: list[Sequence] = []  # sorted by Sequence.sort_key
        self._by_id: dict[int, Sequence] = {}
        self._gone: list[int] = []  # sequences finished since the last plan, whose runner state goes with the next
        self.num_preemptions = 0

    # ------------------------------------------------------------ queues
    def add(self, seq: Sequence) -> None:
        if seq.prompt_len + (seq.pooling is None) > self.config.max_model_len:  # a pooling request samples nothing
            raise ValueError(
                f"prompt has {seq.prompt_len} tokens; with at least one output token that exceeds "
                f"max_model_len {self.config.max_model_len}"
            )
        seq.status = SequenceStatus.WAITING
        self._by_id[seq.seq_id] = seq
        bisect.insort(self.waiting, seq, key=Sequence.sort_key)

    def get(self, seq_id: int) -> Sequence | None:
        return self._by_id.get(seq_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Take a sequence out of the queues and release its blocks."""
        if seq.finished:
            return
        _take(self.running if seq.status is SequenceStatus.RUNNING else self.waiting, seq)
        self.kv.release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self._by_id[seq.seq_id]
        self._gone.append(seq.seq_id)  # the next plan tells the runners

    def held_block_tables(self, group: int = 0) -> list[list[int]]:
        """Every block table of a KV group that holds references (for the integrity check)."""
        return [s.block_tables[group] for s in self.running + self.waiting if s.block_table]

    # ------------------------------------------------------------ schedule
    def schedule(self, max_seqs: int | None = None, run_steps: int = 1) -> SchedulerOutput:
        """The next step. max_seqs: at most this many sequences (a pipeline micro-batch's share). run_steps: the
        longest decode run a sequence may take (see the module's docstring)."""
        budget = self.config.max_num_batched_tokens
        seats = max_seqs if max_seqs is not None else self.config.max_num_seqs
        self.kv.expire()
        out = SchedulerOutput(plan=StepPlan(()))

        decodes_left = sum(1 for s in self.running if not (s.paused or s.in_flight) and s.num_uncomputed_tokens == 1)
        if run_steps > 1 and (self.waiting or any(s.num_uncomputed_tokens != 1 for s in self.running if not (s.paused or s.in_flight))):
            run_steps = 1  # a prefill or an arrival would wait for the run: a token a step
        # a prompt that arrived while others prefill gets half of what the decodes leave (see the module's docstring)
        reserve = (budget - decodes_left) // 2 if self._arrival_waits(seats) else 0
        # with decodes or an arrival in the step, its prefill chunks share the cost of a whole budget at no context
        # (or of --max-prefill-beside-decodes tokens)
        shared = self.config.max_prefill_beside_decodes or self.config.max_num_batched_tokens
        cost = chunk_cost(shared, 0) if decodes_left or reserve else math.inf
        decoded = decodes_left > 0
        reserve_cost = chunk_cost(reserve, 0)
        i = 0
        while i < len(self.running) and budget > 0 and len(out.scheduled) < seats:
            seq = self.running[i]
            if seq.paused or seq.in_flight:
                i += 1
                continue
            decoding = seq.num_uncomputed_tokens == 1
            decodes_left -= decoding
            num_new = self._with_draft(seq, budget - decodes_left - reserve) if decoding else \
                self._chunk(seq, budget - decodes_left - reserve, cost - reserve_cost)
            if num_new <= 0:  # what is left of the budget is the decodes' after it
                i += 1
                continue
            if run_steps > 1 and num_new == 1 and decoding:
                steps = self._run(seq, min(run_steps, budget - decodes_left), decodes_left)
                if steps > 1:
                    num_new = out.runs[seq.seq_id] = steps
            if not self._reserve_or_preempt(seq, num_new, out):
                break  # `seq` itself was the newest and got preempted
            out.scheduled.append((seq, num_new))
            budget -= num_new
            if not decoding:
                cost -= chunk_cost(num_new, seq.num_computed_tokens)
            i += 1

        j, admitted = 0, False
        while j < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs and len(out.scheduled) < seats:
            seq = self.waiting[j]
            if seq in out.preempted:
                break  # just preempted for lack of blocks: it cannot fit this step
            if seq.paused:
                j += 1
                continue
            parent = seq.fork_parent
            if parent is not None and not self._fork_ready(seq, parent, self.kv):
                j += 1  # siblings wait for the first choice to compute the prompt
                continue
            num_new = self._fork(seq, budget) if seq.fork_parent else self._admit(seq, budget, cost)
            if num_new is None:
                break
            if num_new == WAITS_ON_TIER:
                j += 1  # its blocks are being read from the prefix cache's second tier; the others go on
                continue
            self.waiting.pop(j)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=Sequence.sort_key)
            out.scheduled.append((seq, num_new))
            budget -= num_new
            admitted = True
            if num_new > 1:
                cost -= chunk_cost(num_new, seq.num_computed_tokens)

        if reserve and budget > 0:  # what the arrivals left of their share goes back to the prefills
            # within the step's cost when it has decodes or an arrival; a lone prompt's whole budget otherwise
            self._extend_prefills(out, budget, cost if decoded or admitted else math.inf)
        if not out.scheduled and self._unpause_by_preemption(out):
            again = self.schedule(max_seqs)
            again.preempted[:0] = out.preempted
            return again
        gone, self._gone = tuple(self._gone), []
        runs = out.runs
        seqs = tuple(self._scheduled_seq(s, n, runs.get(s.seq_id, 1)) for s, n in out.scheduled)
        out.plan = StepPlan(seqs, self.kv.take_copies(), gone, max(runs.values(), default=1))
        return out

    def _run(self, seq: Sequence, steps: int, decodes_after: int) -> int:
        """How many forwards of a decode run `seq` takes, at most `steps` (1: none): a plain sampler's sequence, within
        its max_tokens and the context, and only where the blocks leave one for every decode after it. (A sequence with
        a draft never gets here: the caller asks only for one whose step is a single token, and _with_draft empties a
        draft it cannot fit.)"""
        p = seq.params
        if seq.grammar is not None or seq.pooling or p.needs_history or p.use_beam_search:
            return 1
        if p.max_tokens is not None:
            steps = min(steps, p.max_tokens - seq.num_output_tokens)
        steps = min(steps, self.config.max_model_len - seq.num_tokens)
        while steps > 1 and not self.kv.can_grow(seq, steps, spare=decodes_after):
            steps //= 2
        return max(steps, 1)

    def _arrival_waits(self, seats: int) -> bool:
        """Whether a waiting sequence may start beside a running prefill: one free to run (not held by its group,
        not a choice waiting for its first, not waiting on the tier), as urgent as that prefill, with a seat."""
        if not self.waiting or len(self.running) >= min(seats, self.config.max_num_seqs):
            return False
        prefills = [s.priority for s in self.running if not (s.paused or s.in_flight) and s.num_uncomputed_tokens > 1]
        if not prefills:
            return False
        return any(not s.paused and s.fork_parent is None and s.kv_fetch is None and s.priority <= min(prefills)
                   for s in self.waiting)

    def _extend_prefills(self, out: SchedulerOutput, budget: int, cost: float) -> None:
        """Give what is left of the budget held back for arrivals to the step's prefill chunks, in order."""
        for k, (seq, num_new) in enumerate(out.scheduled):
            if budget <= 0:
                return
            if seq.num_uncomputed_tokens == 1 or seq.status is not SequenceStatus.RUNNING:
                continue
            start = seq.num_computed_tokens
            more = self._chunk(seq, num_new + budget, cost + chunk_cost(num_new, start)) if cost < math.inf else \
                min(seq.num_tokens - start, num_new + budget)
            if more <= num_new or not self.kv.can_grow(seq, more):
                continue
            self.kv.grow(seq, more)
            out.scheduled[k] = (seq, more)
            budget -= more - num_new
            cost -= chunk_cost(more, start) - chunk_cost(num_new, start)

    def _chunk(self, seq: Sequence, budget: int, cost: float, start: int | None = None) -> int:
        """How many of seq's uncomputed tokens from `start` (its computed count if None) this step computes
        (0: none): the token budget's share, and for a prefill chunk the cost left (at least a block's worth,
        so that a prompt beside many decodes moves on)."""
        start = seq.num_computed_tokens if start is None else start
        num_new = min(seq.num_tokens - start, budget)
        if num_new > 1 and cost < math.inf:
            floor = min(num_new, self.kv.block_size)
            num_new = max(floor, min(num_new, chunk_within(cost, start)))
        if seq.whole and num_new < seq.num_tokens - start:
            return 0  # an encoder's input runs whole or waits
        return num_new

    def _with_draft(self, seq: Sequence, budget: int) -> int:
        """A decode's tokens: its newest, and its draft as far as the budget and free blocks go (a draft
        never preempts anyone: without room it is dropped)."""
        draft = seq.draft
        if not draft:
            return 1
        k = max(0, min(len(draft), budget - 1))
        if k and not self.kv.can_grow(seq, 1 + k):
            k = 0
        seq.draft, seq.draft_masks = draft[:k], seq.draft_masks[:k]
        return 1 + k

    def _unpause_by_preemption(self, out: SchedulerOutput) -> bool:
        """Nothing could run: if paused sequences hold the blocks a waiting sequence
        needs (their group waits on that sequence), preempt the newest of them."""
        if not any(not s.paused and s.kv_fetch is None for s in self.waiting):
            return False
        paused = [s for s in self.running if s.paused]
        if not paused:
            return False
        self._preempt(paused[-1])
        out.preempted.append(paused[-1])
        return True

    def _reserve_or_preempt(self, seq: Sequence, num_new: int, out: SchedulerOutput) -> bool:
        """Make sure `seq` has blocks for `num_new` more tokens, preempting from the back."""
        while not self.kv.can_grow(seq, num_new):
            victim = next(s for s in reversed(self.running) if not s.in_flight)  # `seq` itself at the latest
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        self.kv.grow(seq, num_new)
        return True

    def _admit(self, seq: Sequence, budget: int, cost: float) -> int | None:
        """A waiting sequence's tokens this step, its blocks given (None: they do not fit; WAITS_ON_TIER: its
        cached prefix is being read from the second tier). With the prefix cache, a fresh sequence starts from
        the longest cached prefix of its tokens."""
        admission = self.kv.match(seq)
        if admission.pending:
            return WAITS_ON_TIER
        num_new = self._chunk(seq, budget, cost, start=max(admission.num_tokens, seq.num_computed_tokens))
        if num_new == 0:
            return None  # an encoder's whole input does not fit this step
        return num_new if self.kv.admit(seq, admission, num_new) else None

    # ------------------------------------------------------------ n > 1
    @staticmethod
    def _fork_ready(seq: Sequence, parent: Sequence, kv: KVCacheManager) -> bool:
        if parent.status is SequenceStatus.RUNNING and parent.num_computed_tokens >= parent.prompt_len:
            if not kv.can_share(parent, Scheduler._shared_prefix_len(seq)):
                seq.fork_parent = None  # a windowed group of the parent slid past the prompt's end: compute it
            return True
        if parent.status is SequenceStatus.FINISHED:
            seq.fork_parent = None  # nothing to share any more: compute the prompt itself
            return True
        return False

    @staticmethod
    def _shared_prefix_len(seq: Sequence) -> int:
        # The last prompt token is recomputed: its logits give this choice's first token.
        return seq.prompt_len - 1

    def _fork(self, seq: Sequence, budget: int) -> int | None:
        """Share the parent's prompt KV but for its last token, whose logits give this choice's first token."""
        shared = self._shared_prefix_len(seq)
        num_new = min(seq.prompt_len - shared, budget)
        if not self.kv.fork(seq, seq.fork_parent, shared, num_new):
            return None
        seq.num_cached_tokens = shared
        seq.fork_parent = None
        return num_new

    # ------------------------------------------------------------ continuations
    def add_fork(self, child: Sequence, parent: Sequence) -> None:
        """Add `child`, a continuation of `parent`'s tokens (a beam), sharing the KV the parent computed.
        It runs at once; without a free block for the copy of a partial last block, or when the parent
        holds no KV (preempted), it waits and is recomputed."""
        self._by_id[child.seq_id] = child
        computed = parent.num_computed_tokens if parent.block_table else 0
        if computed and self.kv.fork(child, parent, computed, 0):
            child.status = SequenceStatus.RUNNING
            bisect.insort(self.running, child, key=Sequence.sort_key)
        else:
            child.status = SequenceStatus.WAITING
            bisect.insort(self.waiting, child, key=Sequence.sort_key)

    # ------------------------------------------------------------ preemption
    def _preempt(self, seq: Sequence) -> None:
        """Recompute later: free the blocks, keep the known tokens."""
        _take(self.running, seq)
        self.kv.release(seq)
        seq.num_computed_tokens = 0
        seq.draft, seq.draft_masks = (), ()
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=Sequence.sort_key)

    # ------------------------------------------------------------ plan / update
    @staticmethod
    def _scheduled_seq(seq: Sequence, num_new: int, steps: int = 1) -> ScheduledSeq:
        start = seq.num_computed_tokens
        draft = seq.draft if num_new > 1 and seq.num_uncomputed_tokens == 1 and steps == 1 else ()
        end = start + num_new - len(draft) - (steps - 1)
        p = seq.params
        lp_from, targets = 0, ()
        if seq.wants_prompt_logprobs:  # positions lp_from .. min(end, prompt_len - 1) - 1 give them
            lp_from = max(start, seq.num_prompt_logprobs)
            targets = tuple(seq.token_ids[lp_from + 1 : min(end, seq.prompt_len - 1) + 1])
        sample = end == seq.num_tokens and seq.pooling is None
        p_mode = seq.pooling
        pool = p_mode if p_mode == "mean" or (p_mode == "last" and end == seq.num_tokens) or (p_mode in ("cls", "score") and start == 0) else ""
        froms, tails = _table_diffs(seq.block_tables)
        history_from, history = seq.history_sent, ()
        if p.needs_history:  # the tokens the runner lacks of it
            history = tuple(seq.token_ids[history_from:])
            seq.history_sent = len(seq.token_ids)
        return ScheduledSeq(
            seq_id=seq.seq_id,
            token_ids=tuple(seq.token_ids[start:end]) + draft,
            start_pos=start,
            block_table=tails[0],
            sample=sample,
            params=p,
            table_from=froms[0],
            prompt_len=seq.prompt_len,
            history=history,
            history_from=history_from,
            seed=seq.seed,
            num_sampled=seq.num_output_tokens,
            prompt_logprobs=p.prompt_logprobs or 0,
            prompt_logprobs_from=lp_from,
            prompt_targets=targets,
            token_mask=seq.grammar.mask if sample and seq.grammar is not None else None,
            draft=draft,
            draft_masks=seq.draft_masks if draft and seq.grammar is not None else (),
            images=seq.images,
            pool=pool or "",
            group_tables=tails[1:],
            group_from=froms[1:],
            steps=steps,
        )

    def on_step_done(self, out: SchedulerOutput, sampled: list[SampledToken]) -> tuple[list[SampledToken], list]:
        """Advance the computed counters, append the sampled tokens, hash full blocks. A drafted sequence keeps
        its target's tokens while they agree with the draft (speculative.accepted_length), and its blocks
        past them go back to the pool. A token with an error appends nothing: the engine fails its request.
        Returns the tokens kept, in order per sequence, and (sequence, drafted, accepted) per verified draft."""
        by_seq: dict[int, list[SampledToken]] = {}
        for s in sampled:
            by_seq.setdefault(s.seq_id, []).append(s)
        kept: list[SampledToken] = []
        verified = []
        runs = out.runs
        for i, (seq, num_new) in enumerate(out.scheduled):
            got = by_seq.get(seq.seq_id, ())
            draft = seq.draft
            if seq.finished:
                continue  # aborted while its micro-batch was in flight: its blocks are gone already
            run = runs.get(seq.seq_id, 1) if runs else 1
            if run > 1:  # a forward per token it got: a run that stopped early computed fewer positions (the stats
                num_new = len(got)  # count those it computed)
                out.scheduled[i] = (seq, num_new)
            elif draft:
                seq.draft, seq.draft_masks = (), ()
                got = got[: accepted_length(draft, [s.token_id if s.error is None else None for s in got])]
                num_new -= len(draft) + 1 - len(got)  # the positions of rejected drafted tokens hold nothing
                verified.append((seq, len(draft), len(got) - 1))
            seq.num_computed_tokens += num_new
            if draft or num_new < run:
                self.kv.trim(seq)
            if seq.wants_prompt_logprobs:  # the plan asked for every prompt position computed so far
                seq.num_prompt_logprobs = max(seq.num_prompt_logprobs, min(seq.num_computed_tokens, seq.prompt_len - 1))
            for s in got:
                if s.error is None:
                    seq.token_ids.append(s.token_id)
            self.kv.commit(seq)
            kept.extend(got)
        return kept, verified


def _table_diffs(tables: list[list[int]]) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """Each KV group's table from where the runners' copy of it stops being right (BlockTable.diff): a table the
    KV manager made anew is wrapped here, and goes out whole."""
    froms, tails = [], []
    for g, table in enumerate(tables):
        if type(table) is not BlockTable:
            table = tables[g] = BlockTable(table)
        start, tail = table.diff()
        froms.append(start)
        tails.append(tail)
    return tuple(froms), tuple(tails)


def _take(queue: list[Sequence], seq: Sequence) -> None:
    """Remove `seq` from a queue sorted by Sequence.sort_key: a binary search instead
    of list.remove's scan from the front (a finished request is usually the oldest
    of many, so the scan was the common case's worst)."""
    i = bisect.bisect_left(queue, seq.sort_key(), key=Sequence.sort_key)
    while queue[i] is not seq:  # equal keys (none today) sit side by side
        i += 1
    del queue[i]
