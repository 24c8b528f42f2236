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


# ------------------------------------------------------------ KV groups: a full-attention group and a window of 6
W = 6
NULL_S = 8  # the windowed pool's null block: its size


def make_groups(full_blocks=16, window_blocks=8, cache=True):
    full, windowed = KVBlockPool(full_blocks, BS), KVBlockPool(window_blocks, BS)
    pc = PrefixCache([full, windowed], windows=(None, W)) if cache else None
    return KVCacheManager([full, windowed], pc, windows=(None, W)), full, windowed


def check(kv, *seqs):
    kv.check_integrity(*([s.block_tables[g] for s in seqs] for g in kv.groups))


def test_a_windowed_group_frees_the_blocks_no_query_can_see_any_more():
    kv, full, win = make_groups(cache=False)
    a = seq(range(40))
    assert kv.admit(a, NO_MATCH, 12) and a.block_tables == [[0, 1, 2], [0, 1, 2]]
    computed(kv, a, 12)  # the next query, at 12, sees 7..12: block 0 (positions 0..3) goes
    assert a.block_tables == [[0, 1, 2], [NULL_S, 1, 2]] and (full.num_free, win.num_free) == (13, 6)
    assert kv.can_grow(a, 12)
    kv.grow(a, 12)
    assert a.block_tables == [[0, 1, 2, 3, 4, 5], [NULL_S, 1, 2, 3, 4, 5]]
    computed(kv, a, 12)  # next query at 24 sees 19..24: blocks 0..3 (positions 0..15) are out
    assert a.block_tables[1] == [NULL_S] * 4 + [4, 5] and (full.num_free, win.num_free) == (10, 6)
    for _ in range(16):  # decodes: the window group never holds more than the blocks of positions c-5 .. c
        kv.grow(a, 1)
        computed(kv, a, 1)
        assert len([b for b in a.block_tables[1] if b != NULL_S]) <= 3
    assert a.num_computed_tokens == 40 and len(a.block_tables[0]) == 10 and full.num_free == 6
    assert a.block_tables[1][:8] == [NULL_S] * 8 and win.num_free == 8 - 2  # 40: sees 35..40, blocks 8 and 9
    check(kv, a)
    kv.release(a)
    assert (full.num_free, win.num_free) == (16, 8) and a.block_tables == [[], []]
    check(kv)


def test_a_windowed_groups_step_holds_the_window_and_the_steps_tokens():
    """A chunk past the window needs its blocks while it runs (its first query sees back to c - 5), and lets
    go of all but the window's after it."""
    kv, full, win = make_groups(cache=False)
    a = seq(range(40))
    kv.admit(a, NO_MATCH, 8)
    computed(kv, a, 8)  # next query at 8 sees 3..8: block 0 stays
    assert a.block_tables[1] == [0, 1]
    kv.grow(a, 24)  # positions 8..31: blocks 2..7, and block 0 is still read by the query at 8
    assert a.block_tables[1] == [0, 1, 2, 3, 4, 5, 6, 7] and win.num_free == 0
    assert not kv.can_grow(a, 25)  # the window's pool is full; the full group's is not
    computed(kv, a, 24)
    assert a.block_tables[1] == [NULL_S] * 6 + [6, 7] and win.num_free == 6
    check(kv, a)


def test_a_shared_prefix_still_hits_after_its_window_slid():
    """The first sequence's windowed blocks of positions before 24 were let go (cached, unreferenced) while it
    ran; a second prompt with the same 30 tokens needs only the last window's: blocks 6 and the partial 7."""
    kv, full, win = make_groups()
    a = seq(range(30))
    for n in (12, 12, 6):
        kv.grow(a, n) if a.block_table else kv.admit(a, kv.match(a), n)
        computed(kv, a, n)
    assert a.block_tables[1] == [NULL_S] * 6 + [6, 7]
    kv.release(a)
    assert (full.num_cached_free, win.num_cached_free) == (8, 8)
    b = seq(list(range(30)) + [99])
    adm = kv.match(b)
    m = adm.match
    assert (m.num_tokens, m.blocks, m.copy_block) == (30, (0, 1, 2, 3, 4, 5, 6), 7)
    assert (m.group_blocks, m.group_copies) == (((None,) * 6 + (6,),), (7,))
    assert kv.admit(b, adm, 1) and b.num_cached_tokens == 30
    # the windowed pool had no truly free block: it evicted the one the first sequence let go first (0, when its
    # window slid past it) for the copy of the partial block 7
    assert b.block_tables == [[0, 1, 2, 3, 4, 5, 6, 8], [NULL_S] * 6 + [6, 0]]
    assert kv.take_copies() == ((7, 8), (7, 0, 1))
    check(kv, b)


def test_a_hit_stops_where_the_window_group_lost_the_blocks_it_needs():
    """Where the windowed group evicted the blocks the longest prefix's window needs, the hit is the longest
    prefix whose last window it still holds: 16 tokens need blocks 2 and 3, 12 tokens 1 and 2, 8 tokens 0 and 1
    (held by another sequence that hit them, so the evictions took 2 and 3)."""
    kv, full, win = make_groups(window_blocks=4)
    a = seq(range(17))
    kv.admit(a, kv.match(a), 8)
    computed(kv, a, 8)
    kv.grow(a, 8)
    computed(kv, a, 8)
    assert a.block_tables[1] == [win.null_block, win.null_block, 2, 3]
    kv.release(a)
    other = seq(list(range(8)) + [50, 51, 52, 53, 54])  # hits the first 8 tokens, whose window is blocks 0 and 1
    assert kv.admit(other, kv.match(other), 5)  # the windowed pool evicts the only unreferenced ones: 3, then 2
    assert other.block_tables == [[0, 1, 4, 5], [0, 1, 3, 2]]
    b = seq(list(range(16)) + [99])
    m = kv.match(b).match
    assert (m.num_tokens, m.blocks, m.group_blocks, m.kind) == (8, (0, 1), ((0, 1),), "supersequence")
    check(kv, other)


def test_fork_trim_and_can_share_under_a_window():
    kv, full, win = make_groups(cache=False)
    parent = seq(range(20))
    kv.admit(parent, NO_MATCH, 18)
    computed(kv, parent, 18)  # next query at 18 sees 13..18: windowed blocks 0..2 go
    assert parent.block_tables[1] == [NULL_S] * 3 + [3, 4]
    child = seq(range(20), rid="c")
    assert kv.can_share(parent, 18) and kv.can_share(parent, 17)  # from 17 the child reads 12..17: blocks 3 and 4
    assert not kv.can_share(parent, 16)  # from 16 it reads 11..16, and 11 sits in block 2, gone
    assert kv.fork(child, parent, 18, 2)  # shares 3 by reference, copies the partial 4, one fresh block for 18..19
    assert child.block_tables == [[0, 1, 2, 3, 5], [NULL_S] * 3 + [3, 5]]
    assert kv.take_copies() == ((4, 5), (4, 5, 1))
    assert not kv.fork(seq(range(20), rid="d"), parent, 13, 2)  # what it would read is gone: refused, nothing taken
    assert (full.num_free, win.num_free) == (16 - 6, 8 - 3)  # blocks 3 (shared), 4 and 5
    # a draft of 5 tokens past 18, 2 of them accepted: the blocks past 20 go from both groups
    kv.grow(parent, 6)
    assert parent.block_tables == [[0, 1, 2, 3, 4, 6], [NULL_S] * 3 + [3, 4, 6]]
    parent.num_computed_tokens += 2
    kv.trim(parent)
    assert parent.block_tables == [[0, 1, 2, 3, 4], [NULL_S] * 3 + [3, 4]]
    kv.commit(parent)  # next query at 20 sees 15..20: block 3 (12..15) stays
    assert parent.block_tables[1] == [NULL_S] * 3 + [3, 4]
    check(kv, parent, child)


def test_an_8k_prompt_holds_its_windowed_layers_kv_for_the_window_only():
    """Gemma 3's local window of 512 keys, blocks of 16: an 8192-token prompt in chunks of 512 holds all 512
    blocks in the full-attention group, and 32 (its last 512 positions) in the windowed one; while a chunk runs,
    the window before it and the chunk's own: at most 64."""
    full, win = KVBlockPool(600, 16), KVBlockPool(100, 16)
    kv = KVCacheManager([full, win], windows=(None, 512))
    a = seq(range(8192))
    most = 0
    for c in range(0, 8192, 512):
        kv.grow(a, 512) if c else kv.admit(a, NO_MATCH, 512)
        most = max(most, len([b for b in a.block_tables[1] if b != win.null_block]))
        computed(kv, a, 512)
    assert most == 64 and len(a.block_tables[0]) == len(a.block_tables[1]) == 512
    assert len([b for b in a.block_tables[1] if b != win.null_block]) == 32 and a.block_tables[1][:480] == [100] * 480
    assert (full.num_free, win.num_free) == (600 - 512, 100 - 32)
    check(kv, a)


def test_a_full_groups_block_is_evicted_once_its_children_kept_only_windowed_blocks():
    """A leaf that loses its full-attention block keeps its windowed one (the node stays); its parent is then a
    leaf of the full-attention group, and the next eviction there takes it: three evictions in a row, deepest first."""
    kv, full, win = make_groups(full_blocks=4)
    a = seq(range(13))
    kv.admit(a, kv.match(a), 12)
    computed(kv, a, 12)
    kv.release(a)  # three full nodes; the window's group holds blocks 1 and 2 of them (block 0 slid out, cached)
    assert full.num_cached_free == 3 and win.num_cached_free == 3
    b = seq(range(100, 116))
    assert kv.admit(b, kv.match(b), 16)  # four blocks of the full group: the free one, then 2, 1, 0 evicted
    assert b.block_tables[0] == [3, 2, 1, 0] and kv.cache.stats.evictions == 3
    check(kv, b)


def test_a_model_whose_every_layer_is_windowed_keeps_hollow_nodes_until_their_subtree_goes():
    """One group, a window of 6 (Mistral's shape): a windowed group evicts its blocks in the order they lost
    their last reference, so those that slid out go before the last window's; a node that lost its block stays,
    holding none, while a child holds one; the same prompt still hits on the window's blocks; and once every
    block is evicted the nodes go too."""
    pool = KVBlockPool(6, BS)
    kv = KVCacheManager(pool, PrefixCache(pool, windows=(W,)), windows=(W,))
    null = pool.null_block
    a = seq(range(21))
    kv.admit(a, kv.match(a), 12)
    computed(kv, a, 12)  # next query at 12 sees 7..12: block 0 goes (cached)
    kv.grow(a, 8)
    computed(kv, a, 8)  # at 20: sees 15..20; blocks 2, then 1 go
    assert a.block_table == [null] * 3 + [3, 4] and pool.num_cached_free == 3
    kv.release(a)  # 4, then 3
    b = seq(range(30, 42))
    assert kv.admit(b, kv.match(b), 12)  # three blocks: the free one (5), then evicted 0 and 2, the first let go
    assert b.block_table == [5, 0, 2]
    root = kv.cache.root
    first = root.children[(0, 1, 2, 3)]
    assert first.blocks == [None] and first.children[(4, 5, 6, 7)].blocks == [1]  # hollow, kept for its subtree
    c = seq(range(21))
    m = kv.match(c).match
    assert (m.num_tokens, m.blocks) == (20, (None, None, None, 3, 4))  # the last window's blocks are enough
    kv.release(b)
    d = seq(range(60, 84))
    assert kv.admit(d, kv.match(d), 24)  # every block: the trie empties
    assert root.children == {} and kv.cache.stats.cached_blocks == 0
    kv.check_integrity([d.block_table])
