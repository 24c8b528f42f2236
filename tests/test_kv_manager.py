"""KVCacheManager unit tests: exact block ids, reference counts and copies. No model, no scheduler."""

from shoal.engine.block_pool import KVBlockPool
from shoal.engine.kv_manager import NO_MATCH, KVCacheManager
from shoal.engine.prefix_cache import PrefixCache
from shoal.engine.sequence import Sequence
from shoal.types import SamplingParams

BS = 4
P = SamplingParams(max_tokens=8)


def make(num_blocks=8, cache=True):
    pool = KVBlockPool(num_blocks, BS)
    return KVCacheManager(pool, PrefixCache(pool) if cache else None), pool


def seq(tokens, rid="r"):
    return Sequence(request_id=rid, prompt_token_ids=list(tokens), params=P)


def computed(kv, s, n):
    """Pretend the model computed n more tokens of s (as Scheduler.on_step_done does), indexing full blocks."""
    s.num_computed_tokens += n
    kv.commit(s)


def test_admit_without_a_cache_allocates_the_blocks_the_tokens_need():
    kv, pool = make(cache=False)
    a = seq(range(10))
    assert kv.match(a) is NO_MATCH
    assert kv.admit(a, NO_MATCH, 10) and a.block_table == [0, 1, 2] and a.num_computed_tokens == 0
    assert kv.can_grow(a, 8 * BS) and not kv.can_grow(a, 8 * BS + 1)  # from 0 computed: 3 held + 5 free = 8 blocks
    kv.grow(a, 12)
    assert a.block_table == [0, 1, 2] and pool.num_free == 5  # 12 tokens fit the three blocks already held
    kv.check_integrity([a.block_table])


def test_a_hit_shares_full_blocks_copies_the_partial_one_and_records_the_copy():
    kv, pool = make()
    a = seq(range(10))
    kv.admit(a, kv.match(a), 10)
    computed(kv, a, 10)
    kv.release(a)  # blocks 0, 1 full and cached; block 2 holds tokens 8, 9 (partial, cached)
    assert pool.num_free == 8 and pool.num_cached_free == 3
    b = seq(list(range(10)) + [99, 98])
    m = kv.match(b)
    assert (m.num_tokens, m.match.blocks, m.match.copy_block) == (10, (0, 1), 2)
    assert kv.admit(b, m, 2)
    # shared 0, 1 by reference; the partial block 2 copied into a fresh one (3: the oldest truly free)
    assert b.block_table == [0, 1, 3] and b.num_computed_tokens == 10 and b.num_cached_tokens == 10
    assert kv.take_copies() == ((2, 3),) and kv.take_copies() == ()
    assert pool.ref_counts[:4] == [1, 1, 0, 1] and kv.cache.stats.copies == 1
    kv.check_integrity([b.block_table])


def test_an_admission_that_does_not_fit_takes_nothing():
    kv, pool = make(num_blocks=4)
    a = seq(range(8))
    kv.admit(a, kv.match(a), 8)
    computed(kv, a, 8)
    kv.release(a)
    other = seq(range(100, 104), rid="o")
    kv.admit(other, kv.match(other), 4)  # holds block 2; blocks 0, 1 stay cached; one free
    b = seq(list(range(8)) + list(range(50, 62)))  # 8 cached tokens, then 12 more: 3 blocks, only 1 free
    m = kv.match(b)
    assert m.num_tokens == 8 and m.match.copy_block is None  # both cached blocks, whole
    before = (list(pool.ref_counts), pool.num_free, pool.num_cached_free)
    assert not kv.admit(b, m, 12)  # 3 fresh blocks wanted, 1 free once the match is pinned
    assert (b.block_table, b.num_computed_tokens, b.cache_nodes) == ([], 0, [])
    assert (list(pool.ref_counts), pool.num_free, pool.num_cached_free) == before and kv.take_copies() == ()
    kv.check_integrity([other.block_table])


def test_fork_shares_the_parents_prefix_and_promises_the_partial_copy_in_order():
    kv, pool = make(cache=False)
    parent = seq(range(10))
    kv.admit(parent, NO_MATCH, 10)
    parent.num_computed_tokens = 10
    first, second = seq(range(10), rid="c1"), seq(range(10), rid="c2")
    assert kv.fork(first, parent, 9, 1)  # 9 shared: blocks 0, 1 and a copy of block 2 for tokens 8 (and 9 recomputed)
    assert kv.fork(second, parent, 8, 0)  # on a block boundary: nothing to copy, nothing new
    assert (first.block_table, first.num_computed_tokens) == ([0, 1, 3], 9)
    assert (second.block_table, second.num_computed_tokens) == ([0, 1], 8)
    assert kv.take_copies() == ((2, 3),)
    assert pool.ref_counts[:4] == [3, 3, 1, 1]
    assert not kv.fork(seq(range(10), rid="c3"), parent, 9, 5 * BS)  # 5 more blocks wanted, 4 free: nothing taken
    assert pool.num_free == 4
    kv.check_integrity([parent.block_table, first.block_table, second.block_table])


def test_release_leaves_full_and_partial_blocks_findable():
    kv, pool = make()
    a = seq(range(6))
    kv.admit(a, kv.match(a), 6)
    computed(kv, a, 6)
    assert len(a.cache_nodes) == 1  # the full block is indexed as soon as it is computed
    kv.release(a)
    assert (a.block_table, a.cache_nodes, pool.num_cached_free) == ([], [], 2)
    again = seq(list(range(6)) + [7])
    assert kv.match(again).num_tokens == 6
    kv.check_integrity([])


def test_a_sequence_matched_every_step_while_it_waits_counts_once_in_the_statistics():
    kv, pool = make(num_blocks=4)
    a = seq(range(9), "a")
    assert kv.admit(a, kv.match(a), 9)
    computed(kv, a, 9)
    kv.release(a)  # blocks 0 and 1 cached full, block 2 partial
    hog = seq(range(100, 113), "hog")
    assert kv.admit(hog, kv.match(hog), 13)  # takes the free block and evicts the cached ones
    b = seq(list(range(9)) + [50], "b")
    for _ in range(4):  # the scheduler matches it every step; the pool has no room
        assert not kv.admit(b, kv.match(b), 10)
    s = kv.cache.stats
    assert (s.lookups, s.misses) == (3, 3)  # a, hog, and b once
    kv.release(hog)
    assert kv.admit(b, kv.match(b), 10) and s.lookups == 3
    c = seq(range(200, 210), "c")
    kv.match(c)
    assert s.lookups == 4  # another sequence counts for itself
