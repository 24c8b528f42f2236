"""runner/kv_sizing.py: the KV pool and the served context from the model's shape and the machine's memory.
Plain arithmetic: exact sizes on faked machines."""

from __future__ import annotations

import pytest

from shoal.runner.kv_sizing import (
    FALLBACK_POOL,
    MIN_CONTEXT,
    WORKSPACE,
    GiB,
    KVShape,
    Machine,
    MiB,
    PoolSize,
    group_blocks,
    read_meminfo,
    served_context,
    size_pool,
    size_words,
)

# SmolLM2-135M in float32: 30 layers x (K, V) x 3 KV heads x 64 x 4 bytes
SMOL = KVShape(bytes_per_token=30 * 2 * 3 * 64 * 4, block_size=16)  # 46,080 bytes a token, 737,280 a block


def pool(machine: Machine, **kw) -> PoolSize:
    args = dict(pool_bytes=None, context=8192, max_num_seqs=64, workspace=WORKSPACE, gpu_fraction=0.8)
    return size_pool(SMOL, machine, **{**args, **kw})


def test_meminfo_is_read_in_bytes(tmp_path):
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       24576000 kB\nMemFree:         1000000 kB\nMemAvailable:   20480000 kB\nBuffers: 1 kB\n")
    assert read_meminfo(str(f)) == Machine("cpu", 20480000 * 1024, 24576000 * 1024)
    assert read_meminfo(str(tmp_path / "missing")) == Machine("cpu", None)


def test_cpu_pool_aims_at_max_num_seqs_conversations_or_one_whole_context():
    big = Machine("cpu", available=200 * GiB, total=256 * GiB)
    got = pool(big, context=8192)  # 64 conversations of 1024 tokens are more than one 8k sequence
    assert got.num_blocks == 64 * 1024 // 16 == 4096
    assert got.why == ("auto: 64 sequences of 1024 tokens, within the room (200.0 GiB available after the weights, "
                       "less 25.6 GiB for the system and 256 MiB of workspace)")
    long = pool(big, context=131072)  # one whole context is more
    assert long.num_blocks == 131072 // 16 and long.why.startswith("auto: one sequence of the context, within the room")
    short = pool(big, context=128)  # never more than max_num_seqs sequences of the context fill
    assert short.num_blocks == 64 * 128 // 16 and short.why.startswith("auto: 64 sequences of 128 tokens")


def test_cpu_pool_takes_the_room_less_margin_and_workspace_where_the_aim_does_not_fit():
    machine = Machine("cpu", available=8 * GiB, total=16 * GiB)
    margin = int(0.1 * 16 * GiB)  # a tenth of the machine, more than the 1 GiB floor
    got = pool(machine, context=262144)  # one sequence of it would need 11.3 GiB
    assert got.num_blocks == (8 * GiB - margin - WORKSPACE) // SMOL.bytes_per_block == 8956
    assert got.why == "auto: the room, 8.0 GiB available after the weights, less 1.6 GiB for the system and 256 MiB of workspace"


def test_cpu_margin_is_at_least_one_gib_and_ranks_share_the_room():
    machine = Machine("cpu", available=6 * GiB, total=4 * GiB)  # a tenth of 4 GiB is below the floor
    assert pool(machine, context=131072).num_blocks == (6 * GiB - GiB - WORKSPACE) // SMOL.bytes_per_block
    two = pool(machine, context=131072, ranks_here=2)
    assert two.num_blocks == ((6 * GiB - GiB - WORKSPACE) // 2) // SMOL.bytes_per_block
    assert two.why.endswith("shared by 2 ranks")


def test_a_draft_model_leaves_its_share_and_a_budget_caps_the_pool():
    machine = Machine("cpu", available=8 * GiB, total=16 * GiB)
    room = 8 * GiB - int(0.1 * 16 * GiB) - WORKSPACE
    share = pool(machine, context=262144, share=0.75)
    assert share.num_blocks == int(room * 0.75) // SMOL.bytes_per_block
    assert share.why.endswith("; 75% of that, the draft model's pool beside")
    capped = pool(machine, context=262144, cap_bytes=512 * MiB)
    assert capped.num_blocks == 512 * MiB // SMOL.bytes_per_block
    assert capped.why.startswith("auto: 512 MiB, what the memory budget leaves the model (8.0 GiB available")


def test_cuda_pool_is_a_fraction_of_free_device_memory():
    got = pool(Machine("cuda", available=40 * GiB, total=80 * GiB), gpu_fraction=0.5)
    assert got.num_blocks == (20 * GiB) // SMOL.bytes_per_block  # the device is the server's: no aim
    assert got.why == "auto: the room, 50% of the 40.0 GiB free on the device"


def test_explicit_and_unknown_machines():
    assert pool(Machine("cpu", 64 * GiB, 64 * GiB), pool_bytes=512 * MiB) == PoolSize(512 * MiB // SMOL.bytes_per_block,
                                                                                     "--kv-cache-memory 512 MiB")
    unknown = pool(Machine("cpu", None))
    assert unknown.num_blocks == FALLBACK_POOL // SMOL.bytes_per_block
    assert unknown.why == "auto: 1.0 GiB, as this machine's free memory is unknown"
    budgeted = pool(Machine("cpu", None), cap_bytes=256 * MiB)  # a memory budget caps the fallback too
    assert budgeted == PoolSize(256 * MiB // SMOL.bytes_per_block, "auto: 256 MiB, what the memory budget leaves the model")


def test_a_machine_with_no_room_gives_no_blocks():
    assert pool(Machine("cpu", available=GiB // 2, total=8 * GiB)).num_blocks == 0


def test_auto_context_is_the_trained_length_when_it_fits():
    assert served_context(SMOL, 1000, trained=8192, requested=None, pool=PoolSize(1000, "x"), cache="float32") == (8192, "the model's trained length")


def test_auto_context_is_capped_to_one_sequence_of_the_pool():
    got, why = served_context(SMOL, 300, trained=131072, requested=None, pool=PoolSize(300, "x"), cache="float32")
    assert got == 300 * 16 == 4800
    assert why == "the model's trained length is 131072; the pool holds one sequence of 4800"


def test_auto_context_refuses_below_the_smallest_and_says_what_would_fit():
    with pytest.raises(ValueError) as e:
        served_context(SMOL, 100, trained=131072, requested=None, pool=PoolSize(100, "auto: 0.1 GiB"), cache="float32")
    msg = str(e.value)
    assert msg.startswith(f"not even a context of {MIN_CONTEXT} tokens fits the KV cache: the pool holds 1600 tokens (70 MiB; auto: 0.1 GiB)")
    assert f"{MIN_CONTEXT} tokens need 90 MiB" in msg and "(131072 tokens, the model's trained length, 5.7 GiB)" in msg
    assert "--kv-cache-memory" in msg
    # a model trained on fewer tokens than MIN_CONTEXT needs only its own length
    assert served_context(SMOL, 8, trained=128, requested=None, pool=PoolSize(8, "x"), cache="float32") == (128, "the model's trained length")


def test_explicit_context_that_does_not_fit_names_the_flags():
    with pytest.raises(ValueError) as e:
        served_context(SMOL, 256, trained=8192, requested=8192, pool=PoolSize(256, "--kv-cache-memory 180 MiB"), cache="float32")
    assert str(e.value) == (
        "--max-model-len 8192 needs 360 MiB of KV cache for one sequence, and the pool holds 180 MiB (4096 tokens; "
        "--kv-cache-memory 180 MiB): lower --max-model-len to at most 4096, give --kv-cache-memory 360 MiB or more, "
        "or halve the cache's bytes with --kv-cache-dtype int8")
    assert served_context(SMOL, 256, trained=8192, requested=4096, pool=PoolSize(256, "x"), cache="float32") == (4096, "--max-model-len")


def test_an_int8_cache_is_not_told_to_become_int8():
    with pytest.raises(ValueError) as e:
        served_context(SMOL, 256, trained=8192, requested=8192, pool=PoolSize(256, "x"), cache="int8")
    assert str(e.value).endswith("give --kv-cache-memory 360 MiB or more") and "int8" not in str(e.value)
    with pytest.raises(ValueError) as e:
        served_context(SMOL, 100, trained=131072, requested=None, pool=PoolSize(100, "x"), cache="int8")
    assert str(e.value).endswith("(131072 tokens, the model's trained length, 5.7 GiB): free memory or give --kv-cache-memory")


def test_size_words():
    assert (size_words(GiB + GiB // 20), size_words(GiB + GiB // 20, up=True)) == ("1.0 GiB", "1.1 GiB")
    assert (size_words(MiB + 1), size_words(MiB + 1, up=True)) == ("1 MiB", "2 MiB")
    assert (size_words(1500), size_words(1500, up=True)) == ("1 KiB", "2 KiB")


def test_auto_values_of_the_flags():
    from shoal.config import auto_bytes, auto_int

    assert (auto_bytes("auto"), auto_bytes(None), auto_bytes("2GiB"), auto_bytes(512)) == (None, None, 2 * GiB, 512)
    assert (auto_int("auto"), auto_int(" AUTO "), auto_int("4096"), auto_int(4096)) == (None, None, 4096, 4096)
    with pytest.raises(ValueError):
        auto_int("long")


def test_a_windowed_group_holds_its_windows_and_the_full_group_takes_the_rest():
    """Gemma 3 1B's shape: 4 global layers, 22 local ones with a window of 512. A pool of 4096 blocks of every
    layer: the local layers need at most 64 sequences' windows (32 blocks, 2 more) and a step's 512 tokens, 2208
    blocks; the layer-blocks that frees go to the global layers (14480 blocks), the bytes the same."""
    from shoal.types import kv_groups  # noqa: PLC0415

    gemma = kv_groups(([512] * 5 + [None]) * 4 + [512, 512])
    assert [(g.window, len(g.layers)) for g in gemma] == [(None, 4), (512, 22)]
    sized = dict(layer_bytes=1, block_size=16, max_num_seqs=64, step_tokens=512)
    assert group_blocks(4096, gemma, fixed=False, **sized) == (14480, 2208)
    assert 14480 * 4 + 2208 * 22 == 4096 * 26
    assert group_blocks(4096, gemma, fixed=True, **sized) == (4096, 2208)  # a pool in blocks: the full group keeps them
    assert group_blocks(1000, gemma, fixed=False, **sized) == (1000, 1000)  # a window as large as the pool saves nothing
    assert group_blocks(4096, kv_groups([None] * 4), fixed=False, **sized) == (4096,)
    assert group_blocks(4096, kv_groups([4096, 512]), fixed=False, **sized) == (4096, 4096)  # every layer windowed


def test_a_pipeline_stage_keeps_every_group_with_its_layers_of_it():
    """Gemma 3 1B's layers over two stages: each stage's groups are the model's, in the same order, with that stage's
    layers renumbered from its first (so the ranks' block tables line up); each stage's 13 layers hold 2 global ones,
    which take what the local ones' windows leave of the stage's pool. A stage with no full-attention layer puts no bound on that group's blocks (the ranks agree on the least)."""
    from types import SimpleNamespace  # noqa: PLC0415

    import torch  # noqa: PLC0415

    from shoal.config import CacheConfig  # noqa: PLC0415
    from shoal.runner.kv_sizing import UNBOUNDED  # noqa: PLC0415
    from shoal.runner.model_runner import plan_kv_cache  # noqa: PLC0415
    from shoal.types import KVGroup  # noqa: PLC0415

    windows = ([512] * 5 + [None]) * 4 + [512, 512]
    cache = CacheConfig(num_blocks=None, kv_cache_memory=2**30)

    def stage(first, end):
        config = SimpleNamespace(num_layers=end - first, num_kv_heads=1, head_dim=256)  # what the plan reads
        spec, pool = plan_kv_cache(config, cache, torch.device("cpu"), torch.int8, context=32768, max_num_seqs=64,
                                   windows=windows, layers=(first, end), step_tokens=512)
        return spec, pool.num_blocks  # the pool's blocks of every layer of the stage

    (a, n), (b, _) = stage(0, 13), stage(13, 26)
    assert a.groups == (KVGroup(None, (5, 11)), KVGroup(512, (0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 12)))
    assert b.groups == (KVGroup(None, (4, 10)), KVGroup(512, (0, 1, 2, 3, 5, 6, 7, 8, 9, 11, 12)))
    assert a.group_blocks == b.group_blocks == ((13 * n - 11 * 2208) // 2, 2208)
    sized = dict(layer_bytes=1, block_size=16, max_num_seqs=64, step_tokens=512, fixed=False)
    assert group_blocks(4096, (KVGroup(None, ()), KVGroup(512, (0, 1, 2))), **sized) == (UNBOUNDED, 2208)
