"""The prefix cache's second tier (engine/kv_tier.py, engine/kv_store.py).

- the bookkeeping, exactly: chain digests, W-TinyLFU's segments and admission, the frequency sketch's aging,
  the restore-or-recompute policy and its log line;
- the directory store: its entry format, corrupted, truncated and mismatched entries ignored with a log line,
  the byte budget under churn, one server per directory, a full disk turning the tier off;
- the engine: a conversation evicted by other traffic comes back from the tier with the tokens and logprobs
  computing it again gives (the default model, in its default dtype), over an int8 KV cache too, after a
  restart (cached_tokens in the usage of a real server), and with a disk that fills up;
- KV groups: each group's blocks in its own store, a restore reading a windowed group's last window only, with block
  contents standing in for the KV tensors, and a tiny Gemma 3 through the engine, across a restart too.
"""

from __future__ import annotations

import errno
import logging
import random
from pathlib import Path

import pytest

from shoal import LLM, SamplingParams
from shoal.engine.kv_store import ENTRY_HEADER, LAYOUT_VERSION, MAGIC, DirectoryStore, HostStore, checksum, fingerprint_digest
from shoal.engine.kv_tier import ROOT_DIGEST, FrequencySketch, KVTier, RestorePolicy, Spill, TinyLFU, chain_digest
from shoal.engine.scheduler import chunk_cost

from server_utils import LiveServer, tiny_engine

FP = {"model_sha256": "0" * 64, "dtype": "bfloat16", "block_size": 16}
PAYLOAD = 256


def key(i: int) -> bytes:
    return chain_digest(ROOT_DIGEST, (i,))


# ------------------------------------------------------------------ bookkeeping


def test_a_block_is_named_by_its_tokens_and_every_token_before_it():
    a = chain_digest(ROOT_DIGEST, (1, 2, 3))
    assert len(a) == 32 and a == chain_digest(ROOT_DIGEST, (1, 2, 3))
    assert chain_digest(a, (4, 5, 6)) != chain_digest(chain_digest(ROOT_DIGEST, (1, 2, 9)), (4, 5, 6))
    assert chain_digest(ROOT_DIGEST, ((7, 11),)) != chain_digest(ROOT_DIGEST, ((7, 12),))  # an image's content hash counts


def test_w_tinylfu_segments_move_as_specified():
    lfu = TinyLFU(100)  # window 1, main 99 (protected at most 79)
    assert (lfu.window_cap, lfu.main_cap, lfu.protected_cap) == (1, 99, 79)
    assert lfu.add(key(1)) == [] and list(lfu.window) == [key(1)]
    assert lfu.add(key(2)) == []  # 1 is pushed out of the window; the main space has room
    assert list(lfu.window) == [key(2)] and list(lfu.probation) == [key(1)]
    lfu.hit(key(1))  # a hit in probation: protected
    assert list(lfu.protected) == [key(1)] and not lfu.probation
    lfu.add(key(3))
    assert list(lfu.probation) == [key(2)] and list(lfu.window) == [key(3)]
    lfu.hit(key(2))
    lfu.hit(key(1))  # protected: to its most recent end
    assert list(lfu.protected) == [key(2), key(1)] and not lfu.probation
    lfu.remove(key(2))
    assert key(2) not in lfu and len(lfu) == 2


def test_w_tinylfu_admits_a_candidate_only_if_it_was_wanted_more_than_the_victim():
    lfu = TinyLFU(4)  # window 1, main 3
    for i in range(4):
        lfu.record(key(i))
        lfu.add(key(i))
    assert len(lfu) == 4 and list(lfu.probation) == [key(0), key(1), key(2)]
    lfu.record(key(4))
    assert lfu.add(key(4)) == [key(3)]  # 3 (seen once) loses to the victim 0 (seen once): ties keep the victim
    for _ in range(3):
        lfu.record(key(4))
    lfu.record(key(5))
    assert lfu.add(key(5)) == [key(0)]  # 4 (seen 4 times) beats the victim 0 (once)
    assert key(4) in lfu and list(lfu.window) == [key(5)]


def test_a_popular_block_survives_a_scan_of_one_off_blocks_that_lru_would_flush():
    lfu, lru = TinyLFU(20), []
    system = key(-1)
    for _ in range(5):  # a system prompt every conversation starts from
        lfu.record(system)
    lfu.add(system)
    lru.append(system)
    for i in range(200):  # one-off prompts, each seen once
        lfu.record(key(i))
        lfu.add(key(i))
        lru = (lru + [key(i)])[-20:]
        if i % 10 == 0:  # the system prompt is wanted now and then
            lfu.record(system)
            lfu.hit(system)
    assert system in lfu
    assert system not in lru  # LRU of the same size lost it to the scan
    assert len(lfu) == 20


def test_the_frequency_sketch_counts_to_15_and_halves_every_sample():
    sk = FrequencySketch(4)  # sample: 40 increments
    for _ in range(20):
        sk.increment(key(1))
    assert sk.estimate(key(1)) == 15 and sk.estimate(key(2)) == 0
    for i in range(19):
        sk.increment(key(100 + i))
    assert sk.estimate(key(1)) == 15 and sk.additions == 39
    sk.increment(key(200))  # the 40th: everything halves
    assert sk.estimate(key(1)) == 7 and sk.additions == 20


def test_loading_more_entries_than_the_capacity_pushes_out_the_oldest():
    lfu = TinyLFU(3)
    left = [old for i in range(5) for old in lfu.load(key(i))]
    assert left == [key(0), key(1)] and len(lfu) == 3


def test_restore_or_recompute_follows_the_measured_rates_and_logs_each_change(caplog):
    p = RestorePolicy(block_bytes=1 << 20, block_tokens=16, cost=chunk_cost, read_rate=100 * 2**20, step_seconds=0.005)
    assert p.threshold_read_rate() is None
    with caplog.at_level(logging.INFO, logger="shoal.engine"):
        assert p.worth(4, 0)  # no prefill measured: restore
        p.observe_prefill(cost=1000.0, seconds=1.0)  # 1000 weighted tokens a second
        # 4 blocks: 40 ms read + 5 ms against 64 tokens at 1000/s = 66 ms (more at a later context)
        assert p.restore_seconds(4) == pytest.approx(0.045)
        assert p.recompute_seconds(4, 0) == pytest.approx(chunk_cost(64, 0) / 1000)
        assert p.worth(4, 0)
        p.observe_read(1 << 20, 0.1)  # a slow read: 10 MiB/s enters the mean (0.2 weight): 82 MiB/s
        assert p.read_rate == pytest.approx(0.8 * 100 * 2**20 + 0.2 * 10 * 2**20)
        p.read_rate = 5 * 2**20  # a slow disk: 800 ms to read 4 blocks
        assert not p.worth(4, 0)
        assert not p.worth(4, 0)
        assert p.worth(4, 100_000)  # far into a long prompt computing costs more: restore
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3  # the first decision, the change to computing, the change back
    assert "no prefill measured" in lines[0] and "would lose to" in lines[1] and "beats" in lines[2]
    # the read rate below which computing wins: one block's bytes in the time its tokens take at no context
    assert p.threshold_read_rate() == pytest.approx((1 << 20) * 1000 / chunk_cost(16, 0))
    assert RestorePolicy(1, 16, chunk_cost, None, mode="never").worth(1, 10**6) is False
    p.mode = "always"
    p.read_rate = 1.0
    assert p.worth(100, 0)


# ------------------------------------------------------------------ the directory store


def store_in(path: Path, capacity_entries: int = 100, fp: dict = FP) -> DirectoryStore:
    return DirectoryStore(path, capacity_entries * (ENTRY_HEADER.size + PAYLOAD), PAYLOAD, fp)


def payload(i: int) -> bytearray:
    return bytearray(random.Random(i).randbytes(PAYLOAD))


def spill(tier: KVTier, ids: list[int]) -> None:
    tier.spill([Spill(i, key(i), ROOT_DIGEST, 16) for i in ids], [payload(i) for i in ids])


def test_an_entry_is_a_header_then_the_block_and_reads_back_checked(tmp_path):
    store = store_in(tmp_path)
    parent = key(99)
    assert store.put(key(1), parent, 16, payload(1))
    assert store.drain(10)
    raw = store.path(key(1)).read_bytes()
    magic, layout, fp, digest, par, tokens, length, sums = ENTRY_HEADER.unpack(raw[: ENTRY_HEADER.size])
    assert (magic, layout, fp, digest, par, tokens, length) == (MAGIC, LAYOUT_VERSION, fingerprint_digest(FP), key(1), parent, 16, PAYLOAD)
    assert sums == checksum(payload(1)) and raw[ENTRY_HEADER.size :] == payload(1)
    assert store.path(key(1)).parent.parent == tmp_path / fingerprint_digest(FP).hex()[:16]
    f = store.fetch(3, [key(1), key(2)])
    assert f.event.wait(10)
    assert f.first_block == 3 and f.payloads == [payload(1), None] and f.errors == []  # key 2: a plain miss
    assert f.usable() == [payload(1)] and f.nbytes == PAYLOAD
    store.close()


def test_corrupted_truncated_and_mismatched_entries_are_ignored_with_a_log_line(tmp_path, caplog):
    tier = KVTier(store_in(tmp_path), 16, chunk_cost)
    spill(tier, [1, 2, 3, 4])
    assert tier.store.drain(10)
    corrupt = tier.store.path(key(2))
    data = bytearray(corrupt.read_bytes())
    data[-1] ^= 0xFF
    corrupt.write_bytes(data)
    truncated = tier.store.path(key(3))
    truncated.write_bytes(truncated.read_bytes()[:-10])
    with caplog.at_level(logging.WARNING, logger="shoal.engine"):
        f = tier.fetch(0, 3, {0: [(0, key(1)), (1, key(2)), (2, key(4))]})
        assert f.parts[0][1].event.wait(10)
        assert tier.received(f) == {0: {0: (key(1), payload(1))}}  # stops at the corrupted block: the ones after it are of no use
        assert f.parts[0][1].errors == [(key(2), "checksum mismatch (corrupted)")]
        f = tier.fetch(0, 1, {0: [(0, key(3))]})
        assert f.parts[0][1].event.wait(10)
        assert tier.received(f) == {0: {}} and f.parts[0][1].errors == [(key(3), "truncated")]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "corrupted" in lines[0] and "truncated" in lines[1]
    assert not tier.held(key(2)) and not tier.held(key(3)) and tier.held(key(1)) and tier.stats.rejected_entries == 2
    assert tier.store.drain(10) and not corrupt.exists() and not truncated.exists()  # deleted, never loaded
    tier.close()

    # at start-up: another configuration's entry placed here, a cut one, a stray file; one line says so
    store = store_in(tmp_path)
    other = store_in(tmp_path / "elsewhere", fp={**FP, "dtype": "float32"})
    other.put(key(7), ROOT_DIGEST, 16, payload(7))
    assert other.drain(10)
    other.close()
    (store.path(key(7)).parent).mkdir(exist_ok=True)
    store.path(key(7)).write_bytes(other.path(key(7)).read_bytes())
    store.path(key(8)).parent.mkdir(exist_ok=True)
    store.path(key(8)).write_bytes(store.path(key(1)).read_bytes()[:100])
    store.close()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="shoal.engine"):
        store = store_in(tmp_path)
    assert store.existing() == [key(1), key(4)] or sorted(store.existing()) == sorted([key(1), key(4)])
    assert store.rejected == 2 and len(caplog.records) == 1
    assert "1 truncated" in caplog.records[0].getMessage() and "1 written by another configuration" in caplog.records[0].getMessage()
    assert not store.path(key(7)).exists() and not store.path(key(8)).exists()
    store.close()


def test_the_byte_budget_holds_under_churn(tmp_path):
    tier = KVTier(store_in(tmp_path, capacity_entries=20), 16, chunk_cost)
    rng = random.Random(0)
    hot = list(range(5))
    for step in range(60):
        ids = rng.sample(range(1000), 8) + [rng.choice(hot)]
        spill(tier, [i for i in ids if not tier.held(key(i))])
        found = [key(i) for i in hot if tier.held(key(i))]
        tier.wanted([key(i) for i in hot])
        if found:
            tier.restored(len(found), {0: found})
        tier.store.drain(10)
        files = list(tier.store.dir.glob("*/*.kv"))
        assert sum(f.stat().st_size for f in files) <= tier.stats.capacity_bytes
        assert len(files) == tier.stats.entries == len(tier.index) <= 20
    assert {f.stem for f in tier.store.dir.glob("*/*.kv")} == {d.hex() for d in tier.index.keys()}
    assert tier.stats.evictions > 0
    assert sum(tier.held(key(i)) for i in hot) >= 4  # the blocks wanted again and again stayed
    tier.close()


def test_a_second_server_on_the_same_directory_is_refused_with_a_clear_message(tmp_path):
    first = store_in(tmp_path)
    with pytest.raises(ValueError, match=r"in use by another shoal server \(pid \d+\); give each server its own directory"):
        store_in(tmp_path)
    first.close()
    store_in(tmp_path).close()  # the lock goes with the server that held it


def test_a_full_disk_turns_the_tier_off_with_one_log_line_and_nothing_else(tmp_path, caplog, monkeypatch):
    tier = KVTier(store_in(tmp_path), 16, chunk_cost)
    spill(tier, [1])
    assert tier.store.drain(10)

    def full(*_):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tier.store, "_write", full)
    spill(tier, [2, 3])
    assert tier.store.drain(10)
    with caplog.at_level(logging.WARNING, logger="shoal.engine"):
        tier.poll()
        tier.poll()
    assert [r.getMessage() for r in caplog.records] == [
        f"prefix-cache tier off: the disk is full in {tier.store.dir}; requests go on without it (evicted prefixes are dropped)"]
    assert not tier.enabled and tier.stats.entries == 0 and not tier.held(key(1))
    spill(tier, [4])
    assert tier.stats.spills_dropped == 1
    tier.close()


def test_the_host_store_is_the_same_tier_in_ram():
    tier = KVTier(HostStore(10 * PAYLOAD, PAYLOAD), 16, chunk_cost)
    spill(tier, [1, 2])
    f = tier.fetch(0, 3, {0: [(0, key(1)), (1, key(2)), (2, key(3))]})
    assert f.done and tier.received(f) == {0: {0: (key(1), payload(1)), 1: (key(2), payload(2))}}
    with pytest.raises(ValueError, match="fewer than 2 blocks"):
        KVTier(HostStore(PAYLOAD, PAYLOAD), 16, chunk_cost)


def test_closing_keeps_the_pool_in_a_directory_and_nothing_in_host_ram(tmp_path):
    """At close the engine copies out what spill_all names: the cached full blocks the tier lacks, most recently used
    first. A host-RAM tier ends with the process, so it names none (copying a whole pool out would only delay the exit)."""
    from shoal.engine.block_pool import KVBlockPool
    from shoal.engine.kv_manager import KVCacheManager
    from shoal.engine.prefix_cache import PrefixCache
    from shoal.engine.sequence import Sequence

    def served(store):
        pool = KVBlockPool(8, 4)
        kv = KVCacheManager(pool, PrefixCache(pool), KVTier(store, 4, chunk_cost))
        for rid, tokens in (("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]), ("b", [11, 12, 13, 14, 15])):
            seq = Sequence(rid, tokens, SamplingParams())
            assert kv.admit(seq, kv.match(seq), len(tokens))
            seq.num_computed_tokens = len(tokens)
            kv.commit(seq)
            kv.release(seq)
        return kv

    kv = served(store_in(tmp_path, 10))
    # b's full block was used last; then a's two, parent first
    assert [(s.block_id, s.num_tokens) for s in kv.spill_all()] == [(3, 4), (0, 4), (1, 4)]
    kv.tier.close()
    assert served(HostStore(10 * PAYLOAD, PAYLOAD)).spill_all() == []


# ------------------------------------------------------------------ the engine

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, logprobs=3, ignore_eos=True)


def traffic(rng: random.Random, n: int, length: int, vocab: int = 2000) -> list[list[int]]:
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def run_turns(llm: LLM, first: list[int], others: list[list[int]], follow: list[int]):
    """A conversation's first turn, other traffic that needs its blocks, then its next turn."""
    one = llm.generate([first], PARAMS)[0]
    for o in others:
        llm.generate([o], PARAMS)
    return one, llm.generate([first + one.outputs[0].token_ids + follow], PARAMS)[0]


def answer(out) -> tuple:
    c = out.outputs[0]
    return tuple(c.token_ids), tuple((lp.logprob, tuple(lp.top)) for lp in c.logprobs)


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_an_evicted_conversation_is_restored_with_what_computing_it_again_gives(default_gguf_path, tmp_path, kv):
    """The default model in its default dtype: 36 blocks of 16 tokens; the other prompts take them all."""
    rng = random.Random(1)
    first, others, follow = traffic(rng, 1, 200)[0], traffic(rng, 2, 300), traffic(rng, 1, 20)[0]
    kw = dict(num_blocks=36, max_model_len=512, kv_cache_dtype=kv, check_integrity=True)
    with LLM(str(default_gguf_path), **kw) as plain:
        want = run_turns(plain, first, others, follow)
        assert plain.engine.prefix_cache.stats.evictions > 0
    with LLM(str(default_gguf_path), prefix_cache_dir=str(tmp_path), prefix_cache_restore="always", **kw) as llm:
        got = run_turns(llm, first, others, follow)
        t = llm.engine.tier.stats
    assert t.spilled_blocks > 0 and t.restored_blocks >= 200 // 16 - 1 and t.hits == 1
    assert got[1].num_cached_tokens >= (200 // 16) * 16 > want[1].num_cached_tokens  # restored, not computed
    assert answer(got[0]) == answer(want[0]) and answer(got[1]) == answer(want[1])


@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
def test_windowed_layers_and_the_tier(arch, tmp_path, caplog):
    """Every layer windowed (a Mistral with a window of 40): one KV group, whose evicted blocks the tier keeps and
    restores with what computing them again gives. Local and global layers (Gemma 3): two groups, a store each; the
    restore reads every global block after the pool's match and the local layers' last window only."""
    from tiny_models import make_tiny_model  # noqa: PLC0415

    path = str(make_tiny_model(arch, tmp_path / arch, **({"sliding_window": 40} if arch == "mistral" else {})))
    rng = random.Random(1)
    first, others, follow = traffic(rng, 1, 200, 380)[0], traffic(rng, 2, 300, 380), traffic(rng, 1, 20, 380)[0]
    kw = dict(num_blocks=36, max_model_len=512, check_integrity=True)  # the default dtype, where a hit changes no bit
    with LLM(path, **kw) as plain:
        want = run_turns(plain, first, others, follow)
        assert plain.engine.prefix_cache.stats.evictions > 0
    with LLM(path, prefix_cache_host_bytes=64 << 20, prefix_cache_restore="always", **kw) as llm:
        got = run_turns(llm, first, others, follow)
        tier = llm.engine.tier
        assert tier.stats.restored_blocks >= 8 and got[1].num_cached_tokens > want[1].num_cached_tokens
    assert answer(got[0]) == answer(want[0]) and answer(got[1]) == answer(want[1])


def test_a_model_with_kv_groups_keeps_each_groups_blocks_across_a_restart(tmp_path):
    """Gemma 3's local and global layers: at close each group's cached blocks go to its own folder of the directory,
    and a new engine on it restores the prompt from both, with the answer computing it gives."""
    from tiny_models import make_tiny_model  # noqa: PLC0415

    path = str(make_tiny_model("gemma3", tmp_path / "gemma3"))
    rng = random.Random(2)
    first, follow = traffic(rng, 1, 200, 380)[0], traffic(rng, 1, 20, 380)[0]
    kw = dict(max_model_len=512, check_integrity=True)
    with LLM(path, **kw) as plain:
        want = plain.generate([first + follow], PARAMS)[0]
    tier_dir = tmp_path / "tier"
    with LLM(path, prefix_cache_dir=str(tier_dir), prefix_cache_restore="always", **kw) as llm:
        llm.generate([first], PARAMS)
    folders = sorted(p for p in tier_dir.iterdir() if p.is_dir())
    assert [p.name[16:] for p in folders] == ["-group0", "-group1"]
    assert all(list(p.glob("*/*.kv")) for p in folders)
    with LLM(path, prefix_cache_dir=str(tier_dir), prefix_cache_restore="always", **kw) as llm:
        got = llm.generate([first + follow], PARAMS)[0]
        t = llm.engine.tier.stats
    assert t.hits == 1 and t.restored_blocks == 200 // 16 and got.num_cached_tokens == 200 // 16 * 16
    assert answer(got) == answer(want)


def test_a_restarted_server_finds_its_prompt_in_the_tier(tiny_llama_path, tmp_path):
    messages = [{"role": "user", "content": "Remember this prompt across a restart of the server, please. " * 3}]

    def ask(srv):
        return srv.openai().chat.completions.create(model=srv.state.model_name, messages=messages, max_tokens=6,
                                                    temperature=0.0, logprobs=True, extra_body={"ignore_eos": True})

    def engine():  # the invariant attention: its bits after a cache hit are the same by construction on every path
        # (sdpa, the float weights' default, promises no such thing; forced onto AVX2 its logprobs moved in the 7th digit)
        return tiny_engine(tiny_llama_path, max_model_len=256, prefix_cache_dir=str(tmp_path), prefix_cache_restore="always",
                           attention="invariant")

    with LiveServer(engine()) as srv:
        before = ask(srv)
        with pytest.raises(ValueError, match="in use by another shoal server"):
            engine()  # a second server on the directory, while the first runs
    # the first server kept its cached blocks in the tier as it stopped
    with LiveServer(engine()) as srv:
        after = ask(srv)
        tier = srv.engine.snapshot.kv_tier
    assert before.usage.prompt_tokens_details.cached_tokens == 0
    cached = after.usage.prompt_tokens_details.cached_tokens
    assert cached >= (after.usage.prompt_tokens - 1) // 8 * 8 > 0  # every full block of the prompt came back
    assert tier["restored_blocks"] == cached // 8 and tier["hits"] == 1
    assert after.choices[0].message.content == before.choices[0].message.content
    assert [t.logprob for t in after.choices[0].logprobs.content] == [t.logprob for t in before.choices[0].logprobs.content]


def test_a_disk_that_fills_up_costs_the_tier_and_no_request(tiny_llama_path, tmp_path, caplog, monkeypatch):
    rng = random.Random(2)
    prompts = traffic(rng, 6, 100, vocab=400)
    kw = dict(dtype="auto", quantization="int4", num_blocks=40, block_size=8, max_model_len=160, check_integrity=True)
    with LLM(str(tiny_llama_path), **kw) as plain:
        want = [answer(plain.generate([p], PARAMS)[0]) for p in prompts]
    with LLM(str(tiny_llama_path), prefix_cache_dir=str(tmp_path), **kw) as llm:

        def full(*_):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(llm.engine.tier.store, "_write", full)
        with caplog.at_level(logging.WARNING, logger="shoal.engine"):
            got = [answer(llm.generate([p], PARAMS)[0]) for p in prompts]
        t = llm.engine.snapshot.kv_tier
    assert got == want
    assert not t["enabled"] and t["spills_dropped"] > 0
    assert sum("the disk is full" in r.getMessage() for r in caplog.records) == 1


def test_a_request_waiting_on_the_tier_holds_up_no_other(tiny_llama_path, tmp_path, monkeypatch):
    """The engine never waits on the disk while it holds a step: a prompt whose prefix is being read waits in
    the queue, and a request behind it runs meanwhile."""
    from shoal.types import GenerationRequest

    rng = random.Random(3)
    first, other, other2, behind = traffic(rng, 4, 100, vocab=400)
    kw = dict(dtype="auto", quantization="int4", num_blocks=20, block_size=8, max_model_len=160, check_integrity=True)
    with LLM(str(tiny_llama_path), **kw) as plain:
        want = answer(plain.generate([first + [5, 6]], PARAMS)[0])
    with LLM(str(tiny_llama_path), prefix_cache_dir=str(tmp_path), prefix_cache_restore="always", **kw) as llm:
        e = llm.engine
        llm.generate([first], PARAMS)
        llm.generate([other], PARAMS)  # the others take the blocks: the first prompt's go to the tier
        llm.generate([other2], PARAMS)
        assert e.tier.store.drain(10) and e.tier.stats.spilled_blocks >= 100 // 8 - 2
        store = e.tier.store
        gate = __import__("threading").Event()
        read = store._read
        monkeypatch.setattr(store, "_read", lambda d: (gate.wait(30), read(d))[1])
        e.add_request(GenerationRequest("restored", tuple(first + [5, 6]), PARAMS))
        e.add_request(GenerationRequest("behind", tuple(behind), PARAMS))
        outs = {}
        for _ in range(200):
            for o in e.step():
                outs[o.request_id] = o
            if "behind" in outs and outs["behind"].finished:
                break
        assert outs["behind"].finished and "restored" not in outs  # it ran to its end while the read waited
        assert next(s for s in e.scheduler.waiting if s.request_id == "restored").kv_fetch is not None
        gate.set()
        while e.has_unfinished():
            for o in e.step():
                outs[o.request_id] = o
        assert answer(outs["restored"]) == want and outs["restored"].num_cached_tokens >= 96
        assert e.tier.stats.restored_blocks >= 12


def test_the_tier_settings_are_checked_where_they_are_given():
    from shoal import cli
    from shoal.config import CacheConfig, EngineConfig, ParallelConfig

    parser = cli.build_parser()
    a = parser.parse_args(["serve", "--prefix-cache-dir", "/tmp/x", "--prefix-cache-disk-bytes", "2GiB", "--prefix-cache-restore", "never"])
    c = cli.engine_config(cli.serve_values(a)).cache
    assert (c.prefix_cache_dir, c.prefix_cache_disk_bytes, c.prefix_cache_host_bytes, c.prefix_cache_restore) == ("/tmp/x", 2 << 30, 0, "never")
    with pytest.raises(ValueError, match="give prefix_cache_dir or prefix_cache_host_bytes, not both"):
        CacheConfig(prefix_cache_dir="/tmp/x", prefix_cache_host_bytes=1 << 30)
    with pytest.raises(ValueError, match="needs the prefix cache on"):
        CacheConfig(prefix_cache_dir="/tmp/x", enable_prefix_cache=False)
    with pytest.raises(ValueError, match="prefix_cache_restore must be auto, always or never"):
        CacheConfig(prefix_cache_restore="sometimes")
    with pytest.raises(ValueError, match="needs the whole KV cache in one process"):
        EngineConfig(cache=CacheConfig(prefix_cache_dir="/tmp/x"), parallel=ParallelConfig(tensor_parallel_size=2))


def test_a_restore_may_land_in_the_source_of_a_copy_of_the_same_step_so_copies_run_first():
    """Seen at the KV manager: one schedule admits A, a hit whose partial block is copied from block 1, and then B,
    a restore, whose allocation evicts that now unreferenced block 1 and writes into it. The engine therefore runs
    the step's copies before its restores (and both after the spills' reads)."""
    from types import SimpleNamespace

    from shoal.engine.block_pool import KVBlockPool
    from shoal.engine.engine import Engine
    from shoal.engine.kv_manager import KVCacheManager
    from shoal.engine.prefix_cache import PrefixCache
    from shoal.engine.sequence import Sequence
    from shoal.types import StepPlan

    pool = KVBlockPool(7, 4)
    kv = KVCacheManager(pool, PrefixCache(pool), KVTier(HostStore(4 * PAYLOAD, PAYLOAD), 4, chunk_cost))

    def run(request_id, tokens, num_new=None):
        seq = Sequence(request_id, tokens, SamplingParams())
        assert kv.admit(seq, kv.match(seq), num_new or len(tokens))
        seq.num_computed_tokens = len(tokens)
        return seq

    kv.release(run("s1", [1, 2, 3, 4, 5, 6]))  # block 0 cached full, block 1 cached partial ([5, 6])
    s2 = run("s2", [30, 31, 32, 33, 34])  # blocks 2 and 3, still running
    a = Sequence("a", [1, 2, 3, 4, 5, 9, 9, 9, 9, 9], SamplingParams())
    assert kv.admit(a, kv.match(a), 5)  # tokens 0-4 cached (one copied from block 1 into 4), 5 more
    assert a.block_table == [0, 4, 5]
    run("c", [40, 41, 42])  # takes block 6, the last never used
    kv.release(s2)  # blocks 2 (full) and 3 (partial) cached; block 1 is now the least recently used leaf
    kv.tier.spill([Spill(9, chain_digest(ROOT_DIGEST, (20, 21, 22, 23)), ROOT_DIGEST, 4)], [payload(9)])
    b = Sequence("b", [20, 21, 22, 23, 24, 25], SamplingParams())
    assert kv.match(b).pending  # the read starts; the host store's is done at once
    admission = kv.match(b)
    assert admission.num_tokens == 4 and kv.admit(b, admission, 2)  # evicts block 1 for the restore, then block 3
    assert b.block_table == [1, 3]
    assert kv.take_copies() == ((1, 4),) and kv.take_restores() == [(0, 1, payload(9))]  # block 1: copy source and restore target

    calls = []
    runner = SimpleNamespace(read_blocks=lambda ids, group: calls.append(("read", ids, group)) or [payload(i) for i in ids],
                             copy_blocks=lambda copies: calls.append(("copy", copies)),
                             write_blocks=lambda ids, payloads, group: calls.append(("write", ids, group)))
    kv._spills = [Spill(1, key(1), ROOT_DIGEST, 4)]
    kv._restores = [(0, 1, payload(9))]
    engine = SimpleNamespace(kv=kv, tier=kv.tier, runner=runner)
    engine._read_spills = lambda spills: Engine._read_spills(engine, spills)
    plan = Engine._move_tier_blocks(engine, StepPlan((), ((1, 4),)))
    assert calls == [("read", [1], 0), ("copy", ((1, 4),)), ("write", [1], 0)] and plan.block_copies == ()


def test_a_sequence_waiting_for_blocks_asks_the_tier_once():
    """The scheduler matches a waiting sequence every step until the pool takes it. The tier is asked once while it
    waits: its blocks' frequencies and the 'found but computed' count go up once, not once a step."""
    from shoal.engine.block_pool import KVBlockPool
    from shoal.engine.kv_manager import KVCacheManager
    from shoal.engine.prefix_cache import PrefixCache
    from shoal.engine.sequence import Sequence

    pool = KVBlockPool(4, 4)
    tier = KVTier(HostStore(10 * PAYLOAD, PAYLOAD), 4, chunk_cost, restore="never")
    kv = KVCacheManager(pool, PrefixCache(pool), tier)
    first = chain_digest(ROOT_DIGEST, (1, 2, 3, 4))
    tier.spill([Spill(0, first, ROOT_DIGEST, 4), Spill(1, chain_digest(first, (5, 6, 7, 8)), first, 4)], [payload(0), payload(1)])
    hog = Sequence("hog", list(range(20, 33)), SamplingParams())
    assert kv.admit(hog, kv.match(hog), 13)  # every block of the pool
    seq = Sequence("s", [1, 2, 3, 4, 5, 6, 7, 8, 9], SamplingParams())
    before = tier.index.sketch.estimate(first)
    for _ in range(5):  # five steps without room
        assert not kv.admit(seq, kv.match(seq), 9)
    assert tier.stats.recomputed_blocks == 2 and tier.index.sketch.estimate(first) == before + 1
    kv.release(hog)
    assert kv.admit(seq, kv.match(seq), 9)  # admitted: computed, as the policy said
    again = Sequence("t", [1, 2, 3, 4, 5, 6, 7, 8, 10], SamplingParams())
    kv.match(again)  # another sequence asks for itself (s has computed nothing yet, so the pool has no match)
    assert tier.stats.recomputed_blocks == 4


def test_a_read_that_fails_or_stalls_costs_its_prompt_a_recompute_and_nothing_else(tmp_path, caplog, monkeypatch):
    """Whatever goes wrong in a read, the request waiting on it is not left waiting: a read that raises ends its
    fetch (the reader goes on with the next one), and one that hangs past FETCH_TIMEOUT is given up on."""
    import threading

    import shoal.engine.kv_tier as kv_tier
    from shoal.engine.block_pool import KVBlockPool
    from shoal.engine.kv_manager import KVCacheManager
    from shoal.engine.prefix_cache import PrefixCache
    from shoal.engine.sequence import Sequence

    tier = KVTier(store_in(tmp_path), 4, chunk_cost, restore="always")
    store = tier.store
    first = chain_digest(ROOT_DIGEST, (1, 2, 3, 4))
    tier.spill([Spill(0, first, ROOT_DIGEST, 4)], [payload(0)])
    assert store.drain(10)
    read = store._read
    monkeypatch.setattr(store, "_read", lambda d: 1 / 0)
    with caplog.at_level(logging.WARNING, logger="shoal.engine"):
        f = store.fetch(0, [first])
        assert f.event.wait(10) and f.usable() == []
    assert "a read failed (ZeroDivisionError)" in caplog.text
    monkeypatch.setattr(store, "_read", read)
    f = store.fetch(0, [first])  # the reader is still there
    assert f.event.wait(10) and f.usable() == [payload(0)]

    pool = KVBlockPool(8, 4)
    kv = KVCacheManager(pool, PrefixCache(pool), tier)
    gate = threading.Event()
    monkeypatch.setattr(store, "_read", lambda d: (gate.wait(30), read(d))[1])
    seq = Sequence("s", [1, 2, 3, 4, 5, 6], SamplingParams())
    assert kv.match(seq).pending and kv.match(seq).pending  # the read hangs; the sequence waits
    monkeypatch.setattr(kv_tier, "FETCH_TIMEOUT", 0.0)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="shoal.engine"):
        admission = kv.match(seq)
    assert not admission.pending and admission.num_tokens == 0 and seq.kv_fetch is None
    assert "has taken over 0 s; computing its prompt instead" in caplog.text and tier.stats.recomputed_blocks == 1
    assert kv.admit(seq, admission, 6) and kv.take_restores() == []
    gate.set()
    tier.close()


# ------------------------------------------------------------------ KV groups: a full-attention group and a window


class GroupedSim:
    """The KV manager over a full-attention group and a window of 6 (blocks of 4), with a host store for each group,
    and block contents standing in for the KV tensors: block i of group g, once computed, holds (g, every token up to
    its end). The engine's moves run between the manager's calls and a forward, as Engine._move_tier_blocks does."""

    BS, W = 4, 6

    def __init__(self, full_blocks: int, window_blocks: int) -> None:
        from shoal.engine.block_pool import KVBlockPool
        from shoal.engine.kv_manager import KVCacheManager
        from shoal.engine.prefix_cache import PrefixCache

        self.pools = [KVBlockPool(full_blocks, self.BS), KVBlockPool(window_blocks, self.BS)]
        cache = PrefixCache(self.pools, windows=(None, self.W))
        self.tier = KVTier([HostStore(64 * 64, 64), HostStore(64 * 320, 320)], self.BS, chunk_cost, restore="always")
        self.kv = KVCacheManager(self.pools, cache, self.tier, windows=(None, self.W))
        self.content: dict[tuple[int, int], bytes] = {}
        self.live: list = []

    @staticmethod
    def tag(g: int, tokens: list[int], i: int) -> bytes:
        return repr((g, tuple(tokens[: (i + 1) * GroupedSim.BS]))).encode()

    def move(self) -> None:
        spills = self.kv.take_spills()
        self.tier.spill(spills, [self.content[(s.group, s.block_id)] for s in spills])
        for c in self.kv.take_copies():
            g = c[2] if len(c) > 2 else 0
            self.content[(g, c[1])] = self.content[(g, c[0])]
        for g, b, p in self.kv.take_restores():
            self.content[(g, b)] = bytes(p)

    def check(self) -> None:
        self.kv.check_integrity(*([s.block_tables[g] for s in self.live] for g in self.kv.groups))

    def start(self, seq, chunk: int | None = None):
        """Admit `seq` (after the tier's read, which the host store does at once) for its prompt's next `chunk`
        tokens (by default the rest)."""
        admission = self.kv.match(seq)
        if admission.pending:
            admission = self.kv.match(seq)
        rest = len(seq.token_ids) - admission.num_tokens
        assert self.kv.admit(seq, admission, min(chunk or rest, rest))
        self.live.append(seq)
        self.move()
        self.check()
        return admission

    def compute(self, seq, chunk: int | None = None) -> None:
        """Compute the rest of the prompt, in chunks of `chunk` tokens, then let the sequence go."""
        bs = self.BS
        while seq.num_computed_tokens < len(seq.token_ids):
            c = seq.num_computed_tokens
            n = min(chunk or len(seq.token_ids), len(seq.token_ids) - c)
            if len(seq.block_table) * bs < c + n:
                assert self.kv.can_grow(seq, n)
                self.kv.grow(seq, n)
                self.move()
            for g in self.kv.groups:
                for i in range(c // bs, (c + n - 1) // bs + 1):
                    self.content[(g, seq.block_tables[g][i])] = self.tag(g, seq.token_ids, i)
            seq.num_computed_tokens = c + n
            self.kv.commit(seq)
            self.check()
        self.kv.release(seq)
        self.live.remove(seq)
        self.move()
        self.check()

    def assert_holds_its_prompt(self, seq) -> None:
        """Every block a step computing from the sequence's computed count reads holds that sequence's content."""
        c = seq.num_computed_tokens
        for g in self.kv.groups:
            for i in range(self.kv.first_needed(g, c), c // self.BS):
                assert self.content[(g, seq.block_tables[g][i])] == self.tag(g, seq.token_ids, i), (g, i)


def grouped_seq(rid: str, tokens: list[int]):
    from shoal.engine.sequence import Sequence

    return Sequence(rid, tokens, SamplingParams())


def digests_of(tokens: list[int], n: int, bs: int = 4) -> list[bytes]:
    out, d = [], ROOT_DIGEST
    for i in range(n):
        d = chain_digest(d, tuple(tokens[i * bs : (i + 1) * bs]))
        out.append(d)
    return out


def test_a_restore_with_kv_groups_reads_the_full_groups_blocks_and_the_windows_last_ones():
    """A (25 tokens) is evicted from both groups by B; each group's blocks go to its own store. C, A's prompt and 3
    more tokens, restores its first 24: the full group's blocks 0-5, and the window's last blocks only (4 and 5: a
    step from position 24 sees 19..24); the window's table holds the null block before them."""
    sim = GroupedSim(full_blocks=9, window_blocks=7)
    a = list(range(100, 125))
    sim.compute(sim_start(sim, "a", a))
    sim.compute(sim_start(sim, "b", list(range(200, 236)), 4), chunk=4)  # 9 blocks, a chunk at a time: evicts all of A
    d = digests_of(a, 6)
    assert all(sim.tier.held(x, 0) and sim.tier.held(x, 1) for x in d)  # each group's store got A's full blocks

    c = grouped_seq("c", a + [7, 8, 9])
    assert sim.kv.match(c).pending
    fetch = c.kv_fetch
    assert {g: idx for g, (idx, _) in fetch.parts.items()} == {0: [0, 1, 2, 3, 4, 5], 1: [4, 5]}
    restores_before = sim.tier.stats.restored_bytes
    admission = sim.start(c)
    assert admission.restored_to == 24 and admission.shared == () and c.num_computed_tokens == 24
    null = sim.pools[1].null_block
    assert c.block_tables[1][:4] == [null] * 4 and null not in c.block_tables[1][4:]
    assert len(c.block_tables[0]) == len(c.block_tables[1]) == 7
    sim.assert_holds_its_prompt(c)
    assert sim.tier.stats.restored_blocks == 6 and sim.tier.stats.restored_bytes - restores_before == 6 * 64 + 2 * 320
    sim.compute(c)


def sim_start(sim: GroupedSim, rid: str, tokens: list[int], chunk: int | None = None):
    seq = grouped_seq(rid, tokens)
    sim.start(seq, chunk)
    return seq


def test_a_restore_ends_where_the_window_group_has_its_last_window():
    """The window's store lost A's block 5: the longest restore every group can serve ends at block 5 (20 tokens),
    whose window needs blocks 3 and 4."""
    sim = GroupedSim(full_blocks=9, window_blocks=7)
    a = list(range(100, 125))
    sim.compute(sim_start(sim, "a", a))
    sim.compute(sim_start(sim, "b", list(range(200, 236)), 4), chunk=4)
    d = digests_of(a, 6)
    sim.tier._drop(d[5], 1)
    c = grouped_seq("c", a + [7, 8, 9])
    assert sim.kv.match(c).pending
    assert {g: idx for g, (idx, _) in c.kv_fetch.parts.items()} == {0: [0, 1, 2, 3, 4], 1: [3, 4]}
    admission = sim.start(c)
    assert admission.restored_to == 20 == c.num_computed_tokens
    assert c.block_tables[1][:3] == [sim.pools[1].null_block] * 3
    sim.assert_holds_its_prompt(c)
    sim.compute(c)


def test_a_restore_takes_what_the_pool_still_holds_and_reads_the_rest():
    """B evicts only the full group's last blocks of A (its least recently used leaves), while the window's pool keeps
    all of A's. C's pool match stops at block 4 (the full group's); the restore reads the full group's blocks 4 and 5
    and shares the window's 4 and 5 from the pool, and lets go of the matched window blocks before its last window."""
    sim = GroupedSim(full_blocks=9, window_blocks=12)
    a = list(range(100, 125))
    sim.compute(sim_start(sim, "a", a))
    sim.compute(sim_start(sim, "b", list(range(200, 220))))
    win = sim.pools[1]
    c = grouped_seq("c", a + [7, 8, 9])
    assert sim.kv.match(c).pending
    assert {g: idx for g, (idx, _) in c.kv_fetch.parts.items()} == {0: [4, 5]}
    admission = sim.start(c)
    assert admission.match.num_tokens == 16 and admission.restored_to == 24
    assert [(g, i) for g, i, _ in admission.shared] == [(1, 4), (1, 5)]
    assert c.block_tables[1][:4] == [win.null_block] * 4
    matched = admission.match.group_blocks[0]  # the window's blocks 2 and 3, pinned by the match, then let go
    assert all(win.ref_counts[b] == 0 for b in matched if b is not None)
    sim.assert_holds_its_prompt(c)
    sim.compute(c)
    d = grouped_seq("d", a + [7, 8, 9, 10])
    assert sim.kv.match(d).num_tokens == 28  # what C computed is in the pool now, in both groups
