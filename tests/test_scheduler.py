"""Scheduler unit tests: exact budgets, block ids, preemption order. No model involved."""

import pytest

from shoal.config import SchedulerConfig
from shoal.engine.block_pool import KVBlockPool
from shoal.engine.kv_manager import KVCacheManager
from shoal.engine.scheduler import ATTENTION_CONTEXT, Scheduler, chunk_cost, chunk_within
from shoal.engine.sequence import Sequence, SequenceStatus
from shoal.types import FinishReason, SampledToken, SamplingParams

P = SamplingParams(max_tokens=100)


def make(num_blocks=16, block_size=4, max_num_seqs=8, budget=16, max_model_len=64):
    pool = KVBlockPool(num_blocks, block_size)
    return Scheduler(SchedulerConfig(max_num_seqs, budget, max_model_len), KVCacheManager(pool)), pool


def seq(n_prompt, rid="r", priority=0, **kw):
    return Sequence(request_id=rid, prompt_token_ids=list(range(10, 10 + n_prompt)), params=P, priority=priority, **kw)


def run_step(s: Scheduler, token=7):
    """Schedule, pretend the model ran, feed back one token per sampling sequence."""
    out = s.schedule()
    sampled = [SampledToken(x.seq_id, token, 0.0) for x in out.plan.seqs if x.sample]
    s.on_step_done(out, sampled)
    s.kv.check_integrity(s.held_block_tables())
    return out


def test_prefill_then_decode_is_one_path_of_computed_catching_up():
    s, pool = make()
    a = seq(6)
    s.add(a)
    out = run_step(s)
    (x,) = out.plan.seqs
    assert (x.token_ids, x.start_pos, x.block_table, x.sample) == (tuple(range(10, 16)), 0, (0, 1), True)
    assert (a.num_computed_tokens, a.num_tokens, a.status) == (6, 7, SequenceStatus.RUNNING)
    out = run_step(s)
    (x,) = out.plan.seqs
    # the plan sends the table's new entries only (runner/kept.py): none, the runner holds (0, 1)
    assert (x.token_ids, x.start_pos, x.table_from, x.block_table) == ((7,), 6, 2, ())
    # Position 7 still fits block 1; position 8 needs a third block.
    out = run_step(s)
    assert (out.plan.seqs[0].table_from, out.plan.seqs[0].block_table) == (2, ())
    out = run_step(s)
    assert (out.plan.seqs[0].start_pos, out.plan.seqs[0].table_from, out.plan.seqs[0].block_table) == (8, 2, (2,))
    s.finish(a, FinishReason.STOP)  # the next plan tells the runners to drop what they kept of it
    assert s.schedule().plan.finished == (a.seq_id,)
    assert s.schedule().plan.finished == ()


def test_long_prompt_is_chunked_by_the_token_budget_and_mixed_with_decodes():
    s, pool = make(budget=8)
    a, b = seq(3, "a"), seq(20, "b")
    s.add(a)
    s.add(b)
    out = run_step(s)
    assert [(x.seq_id, len(x.token_ids), x.sample) for x in out.plan.seqs] == [(a.seq_id, 3, True), (b.seq_id, 5, False)]
    out = run_step(s)
    # a decodes (1 token), b gets the remaining 7 of the budget.
    assert [(x.seq_id, len(x.token_ids), x.start_pos) for x in out.plan.seqs] == [(a.seq_id, 1, 3), (b.seq_id, 7, 5)]
    out = run_step(s)
    assert [(len(x.token_ids), x.start_pos) for x in out.plan.seqs] == [(1, 4), (7, 12)]
    out = run_step(s)
    assert [(len(x.token_ids), x.start_pos, x.sample) for x in out.plan.seqs] == [(1, 5, True), (1, 19, True)]
    assert b.num_tokens == 21 and b.num_computed_tokens == 20


def test_max_num_seqs_limits_admission():
    s, _ = make(max_num_seqs=2)
    seqs = [seq(2, str(i)) for i in range(3)]
    for q in seqs:
        s.add(q)
    out = run_step(s)
    assert [x.seq_id for x in out.plan.seqs] == [seqs[0].seq_id, seqs[1].seq_id]
    assert s.waiting == [seqs[2]]


def test_priority_orders_waiting_lower_first_ties_fifo():
    s, _ = make(max_num_seqs=1)
    low, high1, high2 = seq(2, "low", priority=5), seq(2, "h1", priority=-1), seq(2, "h2", priority=-1)
    for q in (low, high1, high2):
        s.add(q)
    assert [q.request_id for q in s.waiting] == ["h1", "h2", "low"]
    out = run_step(s)
    assert out.plan.seqs[0].seq_id == high1.seq_id


def test_preemption_takes_the_newest_running_and_frees_its_blocks():
    # 4 blocks of 2 tokens. Two sequences of 3 prompt tokens take 2 blocks each.
    s, pool = make(num_blocks=4, block_size=2, budget=16)
    a, b = seq(3, "a"), seq(3, "b")
    s.add(a)
    s.add(b)
    run_step(s)
    assert (a.block_table, b.block_table, pool.num_free) == ([0, 1], [2, 3], 0)
    run_step(s)  # position 3 still fits the second block
    # Both now hold 5 tokens: position 4 needs a third block each. a goes first
    # and takes one by preempting b (the newest); b's blocks are freed.
    out = run_step(s)
    assert out.preempted == [b]
    assert [x.seq_id for x in out.plan.seqs] == [a.seq_id]
    assert a.block_table == [0, 1, 3]
    assert (b.status, b.num_computed_tokens, b.block_table, b.num_tokens) == (SequenceStatus.WAITING, 0, [], 5)
    assert s.waiting == [b]
    assert pool.num_free == 1


def test_plans_send_diffs_a_preempted_table_goes_whole_and_a_history_only_its_new_tokens():
    """The plan of diffs (runner/kept.py): a table after preemption is new, so it goes out whole; a sequence with
    penalties sends its prompt once, then each new token; one without sends no history."""
    s, pool = make(num_blocks=4, block_size=2, budget=16)
    a = seq(3, "a")
    b = Sequence(request_id="b", prompt_token_ids=[10, 11, 12], params=SamplingParams(max_tokens=100, repetition_penalty=1.2))
    s.add(a)
    s.add(b)
    out = run_step(s)
    x, y = out.plan.seqs
    assert (x.history_from, x.history) == (0, ())
    assert (y.table_from, y.block_table, y.history_from, y.history) == (0, (2, 3), 0, (10, 11, 12))
    out = run_step(s)
    x, y = out.plan.seqs
    assert (y.table_from, y.block_table, y.history_from, y.history) == (2, (), 3, (7,))
    out = run_step(s)  # b is preempted: its blocks are gone
    assert out.preempted == [b]
    assert (out.plan.seqs[0].table_from, out.plan.seqs[0].block_table) == (2, (3,))  # a's new block only
    s.finish(a, FinishReason.STOP)
    out = run_step(s)  # b comes back with new blocks: its table goes whole, its history goes on from where it was
    (y,) = out.plan.seqs
    assert out.plan.finished == (a.seq_id,)
    assert (y.table_from, y.block_table, y.history_from, y.history) == (0, tuple(b.block_table), 4, (7,))


def test_a_sequence_that_cannot_grow_preempts_itself_when_it_is_newest():
    s, pool = make(num_blocks=2, block_size=2, budget=16)
    a = seq(3, "a")
    s.add(a)
    run_step(s)
    run_step(s)  # 5 tokens known, blocks [0, 1] full
    out = run_step(s)
    assert out.preempted == [a] and out.plan.seqs == ()
    assert pool.num_free == 2


def test_preempted_sequence_recomputes_prompt_and_output_when_readmitted():
    s, pool = make(num_blocks=4, block_size=2, budget=16)
    a, b = seq(3, "a"), seq(3, "b")
    s.add(a)
    s.add(b)
    run_step(s)
    run_step(s)
    run_step(s)  # b preempted with 5 known tokens
    s.finish(a, FinishReason.STOP)
    out = run_step(s)
    (x,) = out.plan.seqs
    assert x.seq_id == b.seq_id and x.start_pos == 0 and len(x.token_ids) == 5 and x.sample
    assert b.num_preemptions == 1 and s.num_preemptions == 1


def test_waiting_is_not_admitted_without_blocks_and_never_preempts_running():
    s, pool = make(num_blocks=3, block_size=2, budget=16)
    a, b = seq(4, "a"), seq(4, "b")
    s.add(a)
    s.add(b)
    out = run_step(s)
    assert [x.seq_id for x in out.plan.seqs] == [a.seq_id]
    assert s.waiting == [b] and out.preempted == []


def test_finish_releases_blocks_and_abort_of_waiting_works():
    s, pool = make()
    a, b = seq(5, "a"), seq(5, "b")
    s.add(a)
    run_step(s)
    s.add(b)
    s.finish(b, FinishReason.ABORT)
    s.finish(a, FinishReason.ABORT)
    assert (pool.num_free, s.has_unfinished()) == (16, False)
    assert a.finish_reason is FinishReason.ABORT and a.block_table == []


def test_prompt_longer_than_context_is_rejected():
    s, _ = make(max_model_len=8)
    with pytest.raises(ValueError, match="prompt has 8 tokens"):
        s.add(seq(8))


def test_fork_shares_full_prompt_blocks_and_copies_the_partial_one():
    s, pool = make(block_size=4)
    parent = seq(10, "r")  # positions 0..9: blocks 0, 1 full, block 2 holds 8, 9
    child = seq(10, "r", index=1, arrival=parent.arrival, fork_parent=parent)
    s.add(parent)
    s.add(child)
    out = run_step(s)
    assert [x.seq_id for x in out.plan.seqs] == [parent.seq_id]  # the child waits for the prompt
    assert parent.block_table == [0, 1, 2]
    out = run_step(s)
    # Child shares positions 0..8 (all but the last prompt token): blocks 0, 1 by
    # reference, block 2 by copy into a fresh block 3; it recomputes position 9.
    assert out.plan.block_copies == ((2, 3),)
    assert child.block_table == [0, 1, 3]
    x = {q.seq_id: q for q in out.plan.seqs}[child.seq_id]
    assert (x.token_ids, x.start_pos, x.sample) == ((19,), 9, True)
    assert pool.ref_counts[:4] == [2, 2, 1, 1]
    assert child.num_cached_tokens == 9


def test_fork_on_a_block_boundary_copies_nothing():
    s, pool = make(block_size=4)
    parent = seq(9, "r")  # shared prefix is 8 tokens = exactly 2 blocks
    child = seq(9, "r", index=1, arrival=parent.arrival, fork_parent=parent)
    s.add(parent)
    s.add(child)
    run_step(s)
    out = run_step(s)
    assert out.plan.block_copies == ()
    assert child.block_table == [0, 1, 3]


def test_paused_beams_holding_all_blocks_are_preempted_so_their_sibling_can_run():
    # Two beams of one group: b1 sampled and paused (holding all blocks), b2 was
    # preempted before sampling and now waits. Without help this would deadlock.
    s, pool = make(num_blocks=2, block_size=4)
    b1, b2 = seq(4, "r"), seq(4, "r", arrival=0)
    s.add(b1)
    run_step(s)
    b1.paused = True
    s.add(b2)
    b1.block_table.extend(pool.allocate(1))  # b1 now holds every block
    out = run_step(s)
    assert b1 in out.preempted and b1.block_table == []
    assert [x.seq_id for x in out.plan.seqs] == [b2.seq_id]


def test_micro_batches_split_the_sequences_skip_those_in_flight_and_never_preempt_them():
    """Pipeline stages: each micro-batch takes its share, a sequence in flight is skipped until it comes back,
    preemption passes over it, and one that was aborted in flight is left alone when its step comes back."""
    s, pool = make(num_blocks=6, block_size=2, budget=16)
    a, b, c = seq(3, "a"), seq(3, "b"), seq(3, "c")
    for x in (a, b, c):
        s.add(x)
    first = s.schedule(max_seqs=2)
    assert [x.seq_id for x in first.plan.seqs] == [a.seq_id, b.seq_id]
    a.in_flight = b.in_flight = True
    second = s.schedule(max_seqs=2)
    assert [x.seq_id for x in second.plan.seqs] == [c.seq_id]
    c.in_flight = True
    assert s.schedule(max_seqs=2).empty  # everything is in flight
    a.in_flight = b.in_flight = False
    s.on_step_done(first, [SampledToken(a.seq_id, 7, 0.0), SampledToken(b.seq_id, 7, 0.0)])
    # a and b hold 4 tokens in 2 blocks each, c 2 blocks: the pool is full. a's next token fits its
    # second block; b (3 computed + 1) too; then at 5 tokens a needs a third block: the newest not in
    # flight is b (c is in flight), so b is preempted, not c.
    s.on_step_done(s.schedule(max_seqs=2), [SampledToken(a.seq_id, 7, 0.0), SampledToken(b.seq_id, 7, 0.0)])
    out = s.schedule(max_seqs=2)
    assert out.preempted == [b] and c.status is SequenceStatus.RUNNING and c.block_table
    assert [x.seq_id for x in out.plan.seqs] == [a.seq_id]
    s.finish(c, FinishReason.ABORT)  # aborted while in flight: its step comes back after
    s.on_step_done(second, [SampledToken(c.seq_id, 7, 0.0)])
    assert (c.num_computed_tokens, c.token_ids[-1]) == (0, 12) and pool.num_free == 3
    pool.check_integrity(s.held_block_tables())


def test_chunk_cost_grows_with_the_context_and_chunk_within_is_its_exact_inverse():
    assert chunk_cost(512, 0) == 512 * (1 + 256 / ATTENTION_CONTEXT)
    assert chunk_cost(1, 8000) == 1 + 8000.5 / ATTENTION_CONTEXT
    assert chunk_within(chunk_cost(512, 0), 0) == 512 and chunk_within(0, 0) == 0 and chunk_within(-3, 100) == 0
    for start in (0, 5, 511, 4096, 8000):
        for cost in (1.0, 17.5, 300.0, 640.0):
            n = chunk_within(cost, start)
            assert chunk_cost(n, start) <= cost < chunk_cost(n + 1, start), (start, cost)


def test_beside_decodes_a_late_chunk_of_a_long_prompt_shrinks_to_the_cost_of_a_whole_budget():
    s, pool = make(num_blocks=700, block_size=16, budget=512, max_model_len=9000)
    a, b = seq(3, "a"), seq(8192, "b")
    s.add(a)
    run_step(s)  # a's prompt; a decodes from now on
    s.add(b)
    out = run_step(s)
    # a's decode and b's first chunk at no context: the whole budget less a's token
    assert [(x.seq_id, len(x.token_ids), x.start_pos) for x in out.plan.seqs] == [(a.seq_id, 1, 3), (b.seq_id, 511, 0)]
    cap = chunk_cost(512, 0)
    while b.num_computed_tokens < 7000:
        start = b.num_computed_tokens
        out = run_step(s)
        chunk = [x for x in out.plan.seqs if x.seq_id == b.seq_id][0]
        assert len(chunk.token_ids) == min(511, chunk_within(cap, start), 8192 - start)
        assert any(x.seq_id == a.seq_id for x in out.plan.seqs)  # a decodes in every step
    start = b.num_computed_tokens
    out = run_step(s)
    assert len(out.plan.seqs[1].token_ids) == chunk_within(cap, start) < 100  # about 80 tokens at 7k of context


def test_max_prefill_beside_decodes_holds_a_shared_step_to_that_many_tokens_cost_and_a_lone_prompt_to_none():
    pool = KVBlockPool(700, 16)
    s = Scheduler(SchedulerConfig(8, 512, 9000, max_prefill_beside_decodes=128), KVCacheManager(pool))
    a, b = seq(3, "a"), seq(8192, "b")
    s.add(a)
    run_step(s)
    s.add(b)
    sizes = []
    while b.num_computed_tokens < 2000:
        start = b.num_computed_tokens
        out = run_step(s)
        assert [x.seq_id for x in out.plan.seqs] == [a.seq_id, b.seq_id]  # a decodes in every step
        sizes.append(len(out.plan.seqs[1].token_ids))
        assert sizes[-1] == max(16, min(511, chunk_within(chunk_cost(128, 0), start)))
    assert sizes[0] == 128 and 16 <= sizes[-1] < 50  # a quarter of the default's chunks, shrinking with the context
    s.finish(a, FinishReason.ABORT)
    out = run_step(s)  # alone, the prompt takes whole budgets, as without the setting
    assert [len(x.token_ids) for x in out.plan.seqs] == [512]
    with pytest.raises(ValueError, match="max_prefill_beside_decodes"):
        SchedulerConfig(max_prefill_beside_decodes=0)


def test_without_decodes_a_long_prompt_takes_whole_budgets_at_any_context():
    s, pool = make(num_blocks=700, block_size=16, budget=512, max_model_len=9000)
    b = seq(8192, "b")
    s.add(b)
    sizes = [len(run_step(s).plan.seqs[0].token_ids) for _ in range(16)]
    assert sizes == [512] * 16


def test_a_prompt_ahead_of_decodes_leaves_a_token_for_each_decode_after_it():
    s, pool = make(num_blocks=64, block_size=4, budget=8, max_model_len=64)
    decoders = [seq(3, f"d{i}") for i in range(3)]
    for d in decoders:
        s.add(d)
    run_step(s)  # their prompts; they decode from now on
    b = seq(40, "b", priority=-1)  # more urgent: it runs ahead of them
    s.add(b)
    out = run_step(s)
    assert [(x.seq_id, len(x.token_ids)) for x in out.plan.seqs] == [*((d.seq_id, 1) for d in decoders), (b.seq_id, 5)]
    out = run_step(s)
    # b first, taking what the cost allows (7 tokens from position 5) less a token for each decode after it
    assert chunk_within(chunk_cost(8, 0), 5) == 7
    assert [(x.seq_id, len(x.token_ids)) for x in out.plan.seqs] == [(b.seq_id, 5), *((d.seq_id, 1) for d in decoders)]


def test_a_prefill_beside_decodes_still_takes_a_block_when_the_cost_is_spent():
    s, pool = make(num_blocks=800, block_size=4, budget=8, max_model_len=3200)
    a, b = seq(3, "a"), seq(3000, "b")
    s.add(a)
    run_step(s)
    s.add(b)
    while b.num_computed_tokens < 2100:
        run_step(s)
    start = b.num_computed_tokens
    out = run_step(s)
    assert chunk_within(chunk_cost(8, 0), start) < 4  # the cost of 8 tokens at no context buys under a block here
    assert [len(x.token_ids) for x in out.plan.seqs] == [1, 4] and out.plan.seqs[1].start_pos == start



def test_a_prompt_that_arrives_while_a_long_one_prefills_starts_in_the_next_step():
    s, pool = make(num_blocks=700, block_size=16, budget=512, max_model_len=9000)
    b = seq(8192, "b")
    s.add(b)
    for _ in range(12):
        run_step(s)  # alone: whole budgets
    assert b.num_computed_tokens == 12 * 512
    a = seq(40, "a")
    s.add(a)
    out = run_step(s)
    # b left half the budget and its cost to a, then took back what a's 40 tokens left: the step keeps to the cost
    # of a whole budget at no context
    want_b = chunk_within(chunk_cost(512, 0) - chunk_cost(40, 0), 6144)
    assert chunk_within(chunk_cost(512, 0) - chunk_cost(256, 0), 6144) < want_b < 256
    assert [(x.seq_id, len(x.token_ids), x.start_pos) for x in out.plan.seqs] == [(b.seq_id, want_b, 6144), (a.seq_id, 40, 0)]
    assert a.num_output_tokens == 1  # its first token, in the step after it arrived
    out = run_step(s)  # a decodes beside b now: b's chunk is held to the cost of a whole budget, less a's token
    start = 6144 + want_b
    assert [(x.seq_id, len(x.token_ids)) for x in out.plan.seqs] == [(b.seq_id, min(511, chunk_within(chunk_cost(512, 0), start))), (a.seq_id, 1)]


def test_an_arrival_less_urgent_than_the_prefill_or_without_blocks_takes_nothing_from_it():
    s, pool = make(num_blocks=700, block_size=16, budget=512, max_model_len=9000)
    b = seq(8192, "b")
    s.add(b)
    run_step(s)
    s.add(seq(40, "later", priority=1))  # less urgent: it waits, as before
    out = run_step(s)
    assert [len(x.token_ids) for x in out.plan.seqs] == [512]

    s, pool = make(num_blocks=19, block_size=16, budget=64, max_model_len=320)
    b = seq(300, "b")  # 19 blocks with its first output token: the whole pool
    s.add(b)
    for _ in range(4):
        run_step(s)
    assert b.num_computed_tokens == 256 and pool.num_free == 3
    a = seq(40, "a")
    s.add(a)
    out = run_step(s)
    # b left 32 tokens and took 2 blocks; a's 32 tokens needed 2 blocks and found 1; b took the half back in the same step
    assert a.status is SequenceStatus.WAITING and a.block_table == []
    assert [(x.seq_id, len(x.token_ids), x.start_pos) for x in out.plan.seqs] == [(b.seq_id, 44, 256)]
    assert pool.num_free == 0 and len(b.block_table) == 19


def test_preemption_and_readmission_under_a_window():
    """Two sequences, a full-attention group and a window of 6 whose pool (4 blocks) cannot hold both windows
    across a block edge: the newest is preempted, and readmitted once the other is done; both end with every
    token, the windowed group never holds more than a window and a step of either, and every block comes back."""
    from shoal.engine.prefix_cache import PrefixCache  # noqa: PLC0415

    full, win = KVBlockPool(16, 4), KVBlockPool(4, 4)
    kv = KVCacheManager([full, win], PrefixCache([full, win], windows=(None, 6)), windows=(None, 6))
    s = Scheduler(SchedulerConfig(8, 8, 64), kv)
    a = seq(10, "a")
    b = Sequence(request_id="b", prompt_token_ids=list(range(50, 60)), params=P)
    s.add(a)
    s.add(b)
    for _ in range(60):
        out = s.schedule()
        s.on_step_done(out, [SampledToken(x.seq_id, 7, 0.0) for x in out.plan.seqs if x.sample])
        kv.check_integrity(*(s.held_block_tables(g) for g in kv.groups))
        for x in (a, b):
            held = [blk for blk in x.block_tables[1] if blk != win.null_block] if x.block_table else []
            assert len(held) <= 3  # never more than the window's blocks and a step's
            if x.num_output_tokens >= 12 and not x.finished:
                s.finish(x, FinishReason.LENGTH)
        if a.finished and b.finished:
            break
    assert a.finished and b.finished and s.num_preemptions >= 1 and b.num_preemptions >= 1
    assert a.output_token_ids == b.output_token_ids == [7] * 12
    assert (full.num_free, win.num_free) == (16, 4)
    kv.check_integrity([], [])


@pytest.mark.parametrize("windows", [(None, 6), (None, 5, 9), (7,)])
def test_random_traffic_under_windows_keeps_every_pool_and_the_cache_consistent(windows):
    """Seeded traffic over small pools: prompts sharing prefixes (hits after windows slid), chunked prefills,
    preemptions, drafts partly rejected (trims), forks (n > 1) and aborts; the pools' counts equal the tables'
    references and the trie agrees with the pools after every step, and every block comes back at the end."""
    import random  # noqa: PLC0415

    from shoal.engine.prefix_cache import PrefixCache  # noqa: PLC0415

    rng = random.Random(sum(w or 0 for w in windows))
    pools = [KVBlockPool(14 if w is None else 10, 4) for w in windows]
    kv = KVCacheManager(pools, PrefixCache(pools, windows=windows), windows=windows)
    s = Scheduler(SchedulerConfig(4, 12, 64), kv)
    stems = [[rng.randrange(1, 50) for _ in range(20)] for _ in range(3)]
    live: list[Sequence] = []
    for step in range(400):
        if len(live) < 5 and rng.random() < 0.3:
            prompt = rng.choice(stems)[: rng.randrange(2, 21)] + [rng.randrange(1, 50) for _ in range(rng.randrange(0, 8))]
            first = Sequence(request_id=f"r{step}", prompt_token_ids=prompt, params=P)
            s.add(first)
            live.append(first)
            if rng.random() < 0.3:  # a second choice of the same request: it forks the first's prompt
                other = Sequence(request_id=f"r{step}", prompt_token_ids=prompt, params=P, index=1, fork_parent=first,
                                 arrival=first.arrival)
                s.add(other)
                live.append(other)
        for x in s.running:
            if not x.draft and x.num_uncomputed_tokens == 1 and rng.random() < 0.3:
                x.draft = tuple(rng.randrange(1, 50) for _ in range(rng.randrange(1, 4)))
        out = s.schedule()
        sampled = []
        for x in out.plan.seqs:
            if x.sample:  # the target agrees with a draft's first token half of the time
                agree = [t if rng.random() < 0.5 else 99 for t in x.draft[:1]]
                sampled += [SampledToken(x.seq_id, t, 0.0) for t in [*agree, 7][: len(x.draft) + 1]]
        s.on_step_done(out, sampled)
        kv.check_integrity(*(s.held_block_tables(g) for g in kv.groups))
        for x in list(live):
            if not x.finished and (x.num_output_tokens >= 10 or rng.random() < 0.01):
                s.finish(x, FinishReason.LENGTH if x.num_output_tokens >= 10 else FinishReason.ABORT)
            if x.finished:
                live.remove(x)
    for x in list(live):
        s.finish(x, FinishReason.ABORT)
    kv.check_integrity(*([] for _ in kv.groups))
    assert [p.num_free for p in pools] == [p.num_blocks for p in pools]
    assert s.num_preemptions > 0 and kv.cache.stats.hits > 0 and kv.cache.stats.evictions > 0


def test_a_decodes_broadcast_does_not_grow_with_its_context():
    """What rank 0 sends the other ranks each step (the pickled ForwardBatch, executor/group.py): with the plan of
    diffs, a decode step at 4,000 tokens of context is as small as one at 40; whole tables made it grow with them."""
    import pickle

    from shoal.runner.model_runner import forward_batch

    sizes = {}
    for context in (40, 4000):
        s, _ = make(num_blocks=1100, block_size=4, max_num_seqs=4, budget=8192, max_model_len=8192)
        seqs = [seq(context, f"r{i}") for i in range(4)]
        for x in seqs:
            s.add(x)
        out = run_step(s)  # the prompts: whole tables go out once
        first = len(pickle.dumps(forward_batch(out.plan)[0]))
        steady = [len(pickle.dumps(forward_batch(run_step(s).plan)[0])) for _ in range(8)]
        sizes[context] = (first, max(steady))
    assert sizes[4000][0] > sizes[40][0] + 4 * 900  # the first plan carries the tables (1,000 blocks each)
    assert sizes[4000][1] <= sizes[40][1] + 16  # a decode's does not (a few more bytes for larger numbers)


# ---------------------------------------------------------------- decode runs


def run_tokens(s: Scheduler, out, per_seq):
    """Feed back `per_seq[seq_id]` tokens (default: every run's forwards, or one) and check the pool."""
    sampled = [SampledToken(x.seq_id, 7, 0.0) for x in out.plan.seqs if x.sample for _ in range(per_seq.get(x.seq_id, x.steps))]
    s.on_step_done(out, sampled)
    s.kv.check_integrity(s.held_block_tables())


def test_a_step_of_decodes_alone_gives_each_a_run_within_its_max_tokens_and_the_context():
    s, pool = make(num_blocks=32, max_model_len=20)
    a = seq(6, "a")
    b = Sequence(request_id="b", prompt_token_ids=list(range(10, 16)), params=SamplingParams(max_tokens=3))
    s.add(a)
    s.add(b)
    run_step(s)  # both prompts: no runs in a step with prefills
    out = s.schedule(run_steps=8)
    runs = {x.seq_id: (x.token_ids, x.start_pos, x.steps) for x in out.plan.seqs}
    # b has sampled one of its 3 tokens: a run of 2; a may take 8 (6 + 1 + 8 < 20)
    assert runs == {a.seq_id: ((7,), 6, 8), b.seq_id: ((7,), 6, 2)}
    assert (out.plan.run_steps, out.runs, out.scheduled[0][1]) == (8, {a.seq_id: 8, b.seq_id: 2}, 8)
    # the blocks of every forward of the run are there: positions 6..13 of a in blocks 1..3 (block_size 4)
    assert len(a.block_tables[0]) == 4 and len(b.block_tables[0]) == 2
    run_tokens(s, out, {})
    assert (a.num_computed_tokens, a.num_tokens, b.num_computed_tokens, b.num_tokens) == (14, 15, 8, 9)
    # a's next run ends at the context: 15 tokens, 20 the most
    out = s.schedule(run_steps=8)
    assert {x.seq_id: x.steps for x in out.plan.seqs}[a.seq_id] == 5


def test_a_run_that_stops_early_computes_what_it_ran_and_gives_its_other_blocks_back():
    s, pool = make(num_blocks=32)
    a = seq(6)
    s.add(a)
    run_step(s)
    free = pool.num_free
    out = s.schedule(run_steps=8)
    assert out.plan.seqs[0].steps == 8 and pool.num_free == free - 2  # positions 6..13: blocks 2 and 3
    run_tokens(s, out, {a.seq_id: 2})  # the runner stopped after two forwards (an end token)
    assert (a.num_computed_tokens, a.num_tokens, len(a.block_tables[0]), pool.num_free) == (8, 9, 2, free)
    assert out.scheduled == [(a, 2)]  # what the step computed, as the stats count it


def test_no_run_beside_a_prefill_or_an_arrival_or_for_a_sampler_that_needs_more_than_the_logits():
    s, pool = make(num_blocks=32, budget=64)
    a = seq(6, "a")
    s.add(a)
    run_step(s)
    s.add(seq(5, "w"))  # waits: the arrival would wait for the run
    out = s.schedule(run_steps=8)
    assert [x.steps for x in out.plan.seqs] == [1, 1] and out.plan.run_steps == 1
    run_tokens(s, out, {})
    s.kv.check_integrity(s.held_block_tables())
    for params in (SamplingParams(max_tokens=50, repetition_penalty=1.2), SamplingParams(max_tokens=50, min_tokens=3),
                   SamplingParams(max_tokens=50, num_beams=2)):
        s2, _ = make(num_blocks=32)
        x = Sequence(request_id="p", prompt_token_ids=[1, 2, 3], params=params)
        s2.add(x)
        run_step(s2)
        assert s2.schedule(run_steps=8).plan.seqs[0].steps == 1
    s3, _ = make(num_blocks=32)
    d = seq(6, "d")
    s3.add(d)
    run_step(s3)
    d.draft = (5, 6)  # speculation's draft verifies instead
    out = s3.schedule(run_steps=8)
    assert (out.plan.seqs[0].steps, out.plan.seqs[0].draft) == (1, (5, 6))


def test_a_run_never_preempts_it_leaves_a_block_for_every_decode_after_it():
    s, pool = make(num_blocks=5, budget=64)
    a, b = seq(4, "a"), seq(4, "b")
    s.add(a)
    s.add(b)
    run_step(s)  # each holds one full block and needs a new one for its next position
    assert pool.num_free == 3
    out = s.schedule(run_steps=8)
    # a's 8 positions (4..11) take 2 blocks and leave b its one; b's run is what the last block holds (4 positions)
    assert out.preempted == [] and {x.seq_id: x.steps for x in out.plan.seqs} == {a.seq_id: 8, b.seq_id: 4}
    assert pool.num_free == 0
    run_tokens(s, out, {})
    assert (a.num_computed_tokens, b.num_computed_tokens) == (12, 8)
