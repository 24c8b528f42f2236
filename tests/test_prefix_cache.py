"""Prefix cache: the seed document's checklist (section 16) with exact numbers, eviction
order with exact block ids, and outputs with the cache equal to outputs without it."""

import pytest

from shoal.config import SchedulerConfig
from shoal.engine.block_pool import KVBlockPool
from shoal.engine.prefix_cache import PrefixCache
from shoal.engine.kv_manager import KVCacheManager
from shoal.engine.scheduler import Scheduler
from shoal.engine.sequence import Sequence
from shoal.types import FinishReason, SampledToken, SamplingParams

P = SamplingParams(max_tokens=100)
BS = 4


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def make(num_blocks=64, budget=64, ttl=None, clock=None, max_num_seqs=8):
    pool = KVBlockPool(num_blocks, BS)
    cache = PrefixCache(pool, ttl=ttl, clock=clock or Clock())
    return Scheduler(SchedulerConfig(max_num_seqs, budget, 256), KVCacheManager(pool, cache)), pool, cache


def step(s, token=7):
    out = s.schedule()
    s.on_step_done(out, [SampledToken(x.seq_id, token, 0.0) for x in out.plan.seqs if x.sample])
    s.kv.check_integrity(s.held_block_tables())
    return out


def run(s, tokens, n_out=3, rid="r"):
    """Run one request to completion (n_out sampled tokens); return its sequence."""
    seq = Sequence(request_id=rid, prompt_token_ids=list(tokens), params=P)
    s.add(seq)
    while seq.num_output_tokens < n_out:
        step(s, token=900 + seq.num_output_tokens)
    seq._released_table = list(seq.block_table)  # for the assertions: finish() clears it
    s.finish(seq, FinishReason.STOP)
    return seq


def admit(s, tokens, rid="q"):
    """Admit a request and return (sequence, the step's plan entry)."""
    seq = Sequence(request_id=rid, prompt_token_ids=list(tokens), params=P)
    s.add(seq)
    out = step(s)
    return seq, next(x for x in out.plan.seqs if x.seq_id == seq.seq_id), out


SYS = list(range(100, 123))  # 23 tokens: the system prompt ends mid-block (block 5 holds 3)
USER_A = list(range(200, 210))
USER_B = list(range(300, 306))


def test_cold_start_is_a_miss():
    s, pool, cache = make()
    seq, x, _ = admit(s, SYS + USER_A)
    assert (seq.num_cached_tokens, x.start_pos, len(x.token_ids)) == (0, 0, 33)
    assert (cache.stats.lookups, cache.stats.misses, cache.stats.hits) == (1, 1, 0)


def test_identical_request_reuses_every_prompt_token_but_the_last():
    s, pool, cache = make()
    first = run(s, SYS + USER_A)
    seq, x, out = admit(s, SYS + USER_A)
    # 32 of 33 tokens: 8 full blocks shared, nothing partial (32 = 8 * 4); the last token computed.
    assert (seq.num_cached_tokens, x.start_pos, x.token_ids) == (32, 32, (209,))
    assert out.plan.block_copies == ()
    assert cache.stats.hits_supersequence == 1  # the cached sequence goes on with the reply


def test_continuing_a_conversation_reuses_the_whole_earlier_prefix():
    s, pool, cache = make()
    first = run(s, SYS + USER_A, n_out=5)
    # The KV of prompt + reply is cached except the last sampled token (never computed).
    turn2 = first.token_ids + USER_B
    seq, x, out = admit(s, turn2)
    assert seq.num_cached_tokens == len(first.token_ids) - 1 == 37
    assert x.start_pos == 37 and len(x.token_ids) == len(turn2) - 37
    # 37 = 9 full blocks + 1 token of the finished sequence's partial last block, copied.
    assert out.plan.block_copies == ((first_block_of(first, 9), seq.block_table[9]),)
    assert cache.stats.hits_extension == 1


def first_block_of(seq_before, index):
    return seq_before._released_table[index]


def test_tool_call_and_result_two_messages_later_still_match():
    s, pool, cache = make()
    first = run(s, SYS + USER_A, n_out=6)
    tool_call = first.token_ids  # prompt + assistant tool call
    turn2 = tool_call + [400, 401, 402, 403, 404] + [500, 501]  # tool result, then a new user line
    seq, x, _ = admit(s, turn2)
    assert seq.num_cached_tokens == len(tool_call) - 1
    assert cache.stats.hits_extension == 1


def test_same_system_prompt_other_user_message_reuses_exactly_the_shared_tokens():
    s, pool, cache = make()
    run(s, SYS + USER_A)
    seq, x, out = admit(s, SYS + USER_B)
    # SYS is 23 tokens: 5 full blocks + 3 tokens of block 5, copied (copy-on-write).
    assert seq.num_cached_tokens == 23 and x.start_pos == 23
    assert len(out.plan.block_copies) == 1
    assert cache.stats.hits_divergence == 1


def test_different_system_prompt_gets_no_false_hit():
    s, pool, cache = make()
    run(s, SYS + USER_A)
    other = [t + 1000 for t in SYS] + USER_A
    seq, x, _ = admit(s, other)
    assert seq.num_cached_tokens == 0 and cache.stats.misses == 2


def test_supersequence_query_is_a_prefix_of_a_cached_sequence():
    # cached [A,B,C,D,E], query [A,B,C] (segments of 5 tokens: the prefix ends mid-block)
    A, B, C, D, E = ([10 * k + i for i in range(5)] for k in range(1, 6))
    s, pool, cache = make()
    run(s, A + B + C + D + E)
    seq, x, out = admit(s, A + B + C)
    assert seq.num_cached_tokens == 14  # all 15 but the last; 3 full blocks + 2 copied tokens
    assert len(out.plan.block_copies) == 1
    assert cache.stats.hits_supersequence == 1


def test_divergence_reuses_exactly_the_common_prefix_mid_block():
    S, A, B, X, Y, D, E = ([10 * k + i for i in range(3)] for k in range(1, 8))
    s, pool, cache = make()
    run(s, S + A + B + X + Y)
    seq, x, out = admit(s, S + A + B + D + E)
    assert seq.num_cached_tokens == 9  # S, A, B: 2 full blocks + 1 copied token
    assert x.start_pos == 9 and len(out.plan.block_copies) == 1
    assert cache.stats.hits_divergence == 1


def test_concurrent_requests_share_a_system_prompt_by_reference():
    s, pool, cache = make(num_blocks=128, budget=512, max_num_seqs=16)
    long_sys = list(range(1000, 1064))  # 16 full blocks
    first = Sequence(request_id="a", prompt_token_ids=long_sys + [1], params=P)
    s.add(first)
    step(s)  # computes and indexes the system prompt while it keeps running
    others = [Sequence(request_id=f"b{i}", prompt_token_ids=long_sys + [2 + i], params=P) for i in range(15)]
    for o in others:
        s.add(o)
    step(s)
    assert all(o.num_cached_tokens == 64 for o in others)
    assert all(o.block_table[:16] == first.block_table[:16] for o in others)
    assert [pool.ref_counts[b] for b in first.block_table[:16]] == [16] * 16
    assert cache.stats.computed_prompt_tokens == 65 + 15  # the 64 shared tokens computed once


def test_eviction_is_lru_leaves_first_and_never_takes_referenced_blocks():
    clock = Clock()
    s, pool, cache = make(num_blocks=10, clock=clock)
    a = run(s, list(range(1, 9)), n_out=1)  # 8 tokens computed: blocks b0, b1 full, nothing partial
    a_blocks = a._released_table[:2]
    clock.t = 1
    b = run(s, list(range(50, 58)), n_out=1)
    b_blocks = b._released_table[:2]
    assert pool.num_cached_free == 4 and pool.num_free == 10
    # A running sequence holds 6 fresh blocks and then asks for 2 more: the LRU
    # sequence's leaf goes first, then its parent, before anything of b's.
    c = Sequence(request_id="c", prompt_token_ids=list(range(600, 623)), params=P)
    s.add(c)
    step(s)  # 23 tokens: 6 blocks from the free queue; its next token still fits the 6th
    assert cache.stats.evictions == 0
    d = Sequence(request_id="d", prompt_token_ids=list(range(700, 707)), params=P)
    s.add(d)
    step(s)
    assert d.block_table == [a_blocks[1], a_blocks[0]]  # leaf first, then its parent
    assert cache.stats.evictions == 2
    assert cache.node_of(b_blocks[0]) is not None and cache.node_of(b_blocks[1]) is not None


def test_a_hit_makes_a_prefix_recent_again_and_stale_heap_entries_stay_bounded():
    clock = Clock()
    s, pool, cache = make(num_blocks=10, clock=clock)
    a = run(s, list(range(1, 9)), n_out=1, rid="a")  # blocks a0 <- a1, cached, unreferenced
    b = run(s, list(range(50, 58)), n_out=1, rid="b")  # b0 <- b1, more recent
    a_blocks, b_blocks = a._released_table[:2], b._released_table[:2]
    for i in range(200):  # a's prompt again and again: each hit leaves a stale heap entry behind
        run(s, list(range(1, 9)), n_out=1, rid=f"again{i}")
    assert cache.stats.cached_blocks == 4 and cache.stats.hits_supersequence + cache.stats.hits_extension == 200
    assert len(cache._lru) <= 2 * cache.stats.cached_blocks + 64
    # a is the recent one now: a request that needs every truly free block and two more evicts b's branch, leaf first.
    truly_free = pool.num_free - pool.num_cached_free
    c = Sequence(request_id="c", prompt_token_ids=list(range(600, 600 + BS * (truly_free + 2) - 1)), params=P)
    s.add(c)
    step(s)
    assert cache.stats.evictions == 2 and c.block_table[-2:] == [b_blocks[1], b_blocks[0]]
    assert cache.node_of(a_blocks[0]) is not None and cache.node_of(a_blocks[1]) is not None
    cache.check_integrity()


def test_referenced_blocks_are_never_evicted():
    s, pool, cache = make(num_blocks=6)
    a = Sequence(request_id="a", prompt_token_ids=list(range(1, 17)), params=P)
    s.add(a)
    step(s)  # 4 full blocks, indexed, referenced by the running sequence
    b = Sequence(request_id="b", prompt_token_ids=list(range(50, 62)), params=P)
    s.add(b)
    step(s)  # needs 3 blocks, only 2 free and nothing evictable: waits
    assert b.block_table == [] and cache.stats.evictions == 0
    assert all(cache.node_of(x) is not None for x in a.block_table[:4])


def test_after_all_requests_end_blocks_are_free_or_cached_and_clear_frees_all():
    s, pool, cache = make(num_blocks=32)
    for i in range(4):
        run(s, SYS + [i] * 5, n_out=4, rid=str(i))
    assert pool.num_free == 32  # everything available again...
    assert pool.num_cached_free == cache.stats.cached_blocks > 0  # ...much of it still cached
    pool.check_integrity([])
    assert cache.clear() > 0
    assert (pool.num_cached_free, len(list(pool._free))) == (0, 32)
    seq, x, _ = admit(s, SYS + [0] * 5)
    assert seq.num_cached_tokens == 0


def test_ttl_drops_idle_unreferenced_blocks():
    clock = Clock()
    s, pool, cache = make(num_blocks=32, ttl=10.0, clock=clock)
    run(s, SYS + USER_A)
    assert cache.stats.cached_blocks > 0
    clock.t = 5.0
    step(s)
    assert cache.stats.cached_blocks > 0
    clock.t = 20.0
    step(s)
    assert cache.stats.cached_blocks == 0 and pool.num_cached_free == 0


def test_aborted_request_leaves_its_computed_prefix_reusable():
    s, pool, cache = make()
    seq = Sequence(request_id="a", prompt_token_ids=SYS + USER_A, params=P)
    s.add(seq)
    step(s)
    step(s)  # 33 prompt tokens + 1 output token computed
    s.finish(seq, FinishReason.ABORT)
    again, x, _ = admit(s, SYS + USER_A + [seq.token_ids[33], 5, 6])
    assert again.num_cached_tokens == 34


def test_extra_keys_keep_equal_tokens_with_different_images_apart():
    s, pool, cache = make()
    img = [7] * 8  # placeholder tokens
    first = Sequence(request_id="a", prompt_token_ids=SYS + img + [1], params=P, extra_keys={23: 111})
    s.add(first)
    step(s)
    s.finish(first, FinishReason.STOP)
    other = Sequence(request_id="b", prompt_token_ids=SYS + img + [1], params=P, extra_keys={23: 222})
    s.add(other)
    step(s)
    assert other.num_cached_tokens == 23  # the system prompt only: the image differs
    same = Sequence(request_id="c", prompt_token_ids=SYS + img + [1], params=P, extra_keys={23: 111})
    s.add(same)
    step(s)
    assert same.num_cached_tokens == 31


def test_block_hashes_chain_over_full_blocks():
    s, pool, cache = make()
    seq = run(s, SYS + USER_A)
    t = seq._released_table
    assert pool.block_hashes[t[0]] is not None and pool.block_hashes[t[1]] is not None
    assert pool.block_hashes[t[0]] != pool.block_hashes[t[1]]


# ---------------------------------------------------------------- through the engine

from shoal import LLM  # noqa: E402
from tiny_models import make_tiny_model  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("llama")))


def conversation(llm, turns, params):
    """Multi-turn traffic: each turn's prompt is the last prompt + reply + a new message."""
    prompt, outs = [], []
    for t in turns:
        prompt = prompt + t
        out = llm.generate([prompt], params)[0]
        outs.append((out.outputs[0].token_ids, out.num_cached_tokens))
        prompt = prompt + out.outputs[0].token_ids
    return outs


def test_engine_outputs_equal_with_and_without_cache_through_cow_and_evictions(tiny_path):
    # A pool small enough that the later turns evict the earlier conversations.
    kw = dict(num_blocks=40, block_size=4, max_model_len=128, max_num_batched_tokens=16, check_integrity=True)
    on = LLM(tiny_path, dtype="float32", **kw)
    off = LLM(tiny_path, dtype="float32", enable_prefix_cache=False, **kw)
    sys_prompt = [(7 * i) % 390 + 5 for i in range(21)]  # ends mid-block
    convs = [[sys_prompt + [300 + c, 301], [310 + c, 5, 6], [320, 321 + c]] for c in range(4)]
    got_on = [conversation(on, turns, GREEDY) for turns in convs]
    got_off = [conversation(off, turns, GREEDY) for turns in convs]
    assert [[t for t, _ in c] for c in got_on] == [[t for t, _ in c] for c in got_off]
    assert all(n == 0 for c in got_off for _, n in c)
    # Turn 2 of every conversation reused all of turn 1 but its last sampled token.
    assert all(c[1][1] == len(turns[0]) + 8 - 1 for c, turns in zip(got_on, convs))
    # Conversation 2's first turn shares the system prompt with conversation 1 (divergence, mid-block).
    assert got_on[1][0][1] == 21
    st = on.engine.prefix_cache.stats
    assert st.evictions > 0 and st.copies > 0
    assert on.engine.pool.num_free == 40


def test_n_choices_with_the_cache_still_share_and_match_greedy(tiny_path):
    llm = LLM(tiny_path, dtype="float32", num_blocks=64, block_size=4, max_model_len=128, check_integrity=True)
    p = [(5 * i) % 390 + 5 for i in range(30)]
    alone = llm.generate([p], GREEDY)[0].outputs[0].token_ids
    out = llm.generate([p], SamplingParams(n=3, temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    assert [o.token_ids for o in out.outputs] == [alone] * 3
    assert out.num_cached_tokens == 29


def test_real_weights_multi_turn_equal_with_and_without_cache(default_gguf_path):
    kw = dict(max_model_len=512, check_integrity=True)
    on, off = LLM(str(default_gguf_path), dtype="float32", **kw), LLM(str(default_gguf_path), dtype="float32", enable_prefix_cache=False, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=24)
    for llm in (on, off):
        msgs = [{"role": "system", "content": "You are a concise assistant."}, {"role": "user", "content": "Name a fruit."}]
        replies, cached = [], []
        for follow in ["Another one?", "And a vegetable?"]:
            out = llm.chat(msgs, params)[0]
            replies.append(out.outputs[0].token_ids)
            cached.append(out.num_cached_tokens)
            msgs += [{"role": "assistant", "content": out.outputs[0].text}, {"role": "user", "content": follow}]
        llm.result = (replies, cached)
    assert on.result[0] == off.result[0]
    assert on.result[1][1] > 20 and off.result[1] == [0, 0]


def test_stats_report_bytes_against_the_pool():
    pool = KVBlockPool(10, BS)
    cache = PrefixCache(pool, block_bytes=1000)
    s = Scheduler(SchedulerConfig(8, 64, 256), KVCacheManager(pool, cache))
    run(s, list(range(1, 10)), n_out=1)  # 9 computed tokens: 2 full blocks + 1 partial
    st = cache.stats
    assert (st.cached_blocks, st.cached_bytes, st.pool_bytes) == (3, 3000, 10000)
    assert (st.hit_tokens, st.computed_prompt_tokens, st.token_hit_rate) == (0, 9, 0.0)
    run(s, list(range(1, 10)) + [50], n_out=1, rid="again")
    assert (st.hit_tokens, st.last_match_tokens, st.last_match_fraction) == (9, 9, 0.9)
    assert st.token_hit_rate == 9 / 19
