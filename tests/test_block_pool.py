import sys

import pytest

from shoal.engine.block_pool import KVBlockPool, NoFreeBlocksError, hash_block_tokens


def test_bookkeeping_modules_do_not_import_torch():
    import subprocess

    code = (
        "import sys; import shoal.engine.block_pool, shoal.engine.prefix_cache, shoal.engine.kv_manager, shoal.engine.kv_tier, shoal.engine.kv_store, "
        "shoal.engine.scheduler, shoal.engine.sequence, shoal.engine.request, shoal.engine.beam, shoal.engine.stats, "
        "shoal.engine.detokenizer, shoal.json_schema, shoal.runner.shard_plan, shoal.runner.kv_sizing, shoal.runner.kept, shoal.model.file_checks, shoal.types, shoal.config; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_allocate_hands_out_lowest_ids_first_with_one_reference():
    pool = KVBlockPool(num_blocks=4, block_size=16)
    assert pool.allocate(2) == [0, 1]
    assert pool.ref_counts == [1, 1, 0, 0]
    assert pool.num_free == 2
    assert pool.allocate(1) == [2]
    assert pool.usage == 0.75


def test_allocate_beyond_free_raises_and_changes_nothing():
    pool = KVBlockPool(num_blocks=3, block_size=16)
    pool.allocate(2)
    with pytest.raises(NoFreeBlocksError, match="asked for 2 blocks, 1 free"):
        pool.allocate(2)
    assert pool.num_free == 1
    assert pool.ref_counts == [1, 1, 0]


def test_free_returns_blocks_tail_first_and_reuses_them_in_that_order():
    pool = KVBlockPool(num_blocks=4, block_size=4)
    a = pool.allocate(3)  # [0, 1, 2]
    pool.free(a)
    # Remaining free block 3 is oldest; then the freed ones, tail first.
    assert pool.allocate(4) == [3, 2, 1, 0]


def test_shared_blocks_stay_until_the_last_reference_goes():
    pool = KVBlockPool(num_blocks=4, block_size=4)
    a = pool.allocate(2)
    pool.incref(a[:1])
    assert pool.ref_counts[:2] == [2, 1]
    pool.free(a)
    assert pool.ref_counts[:2] == [1, 0]
    assert pool.num_free == 3
    pool.free([0])
    assert pool.num_free == 4


def test_double_free_and_sharing_a_free_block_are_errors():
    pool = KVBlockPool(num_blocks=2, block_size=4)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(ValueError, match="double free of block 0"):
        pool.free([b])
    with pytest.raises(ValueError, match="block 1 is free"):
        pool.incref([1])


def test_integrity_check_catches_leaks_and_miscounts():
    pool = KVBlockPool(num_blocks=4, block_size=4)
    t1 = pool.allocate(2)
    t2 = t1[:1] + pool.allocate(1)
    pool.incref(t1[:1])
    pool.check_integrity([t1, t2])
    with pytest.raises(AssertionError, match="ref counts differ"):
        pool.check_integrity([t1])  # t2's references are unaccounted for: a leak
    with pytest.raises(AssertionError, match="holds a block twice"):
        pool.check_integrity([[0, 0]])


def test_blocks_for_tokens_rounds_up():
    pool = KVBlockPool(num_blocks=1, block_size=16)
    assert [pool.blocks_for_tokens(n) for n in (0, 1, 16, 17, 32, 33)] == [0, 1, 1, 2, 2, 3]


def test_block_hash_chains_on_parent():
    h1 = hash_block_tokens(None, [1, 2, 3])
    assert h1 == hash_block_tokens(None, (1, 2, 3))
    assert hash_block_tokens(h1, [4]) != hash_block_tokens(None, [4])
    pool = KVBlockPool(num_blocks=2, block_size=3)
    (b,) = pool.allocate(1)
    pool.set_block_hash(b, h1)
    pool.free([b])
    assert pool.allocate(1) == [1]
    assert pool.allocate(1) == [0]
    assert pool.block_hashes[0] is None  # reallocation clears the old content's hash
