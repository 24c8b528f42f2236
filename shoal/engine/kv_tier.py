"""The prefix cache's second tier: what the pool evicts is kept, and restored when a prompt wants it again. No torch.

When the KV pool needs room, the prefix cache drops its least recently used unreferenced leaves. With a tier,
each dropped full block is spilled first: the engine copies its bytes out of the KV tensor before the step's
forward can overwrite them, and a background thread writes them to the store (a directory, or host RAM:
kv_store.py). A later prompt whose tokens run past what the pool holds finds the next blocks here by content,
and they are read back, checked, and written into fresh blocks instead of being computed again:

    prompt blocks:  | in the pool (shared)    | in the tier (restored)  | computed |
                    0                         n                         n + k

A block is named by a chain digest: BLAKE2b-256 over its parent's digest and its tokens (with an image's
content hash where one applies), so equal digests mean the same tokens from the very first one. The trie's
nodes carry the same digests, so the lookup starts where the pool's match ends.

Three pieces, each plain bookkeeping:
- `TinyLFU`: which blocks the tier keeps. W-TinyLFU (Einziger, Friedman and Manes, 2017; Caffeine's policy, and
  the choice of seed 001): a small LRU window takes new blocks; one pushed out of it enters the main space only
  if it was wanted more often, by a count-min sketch's estimate, than the main space's own victim. A burst of
  one-off prompts therefore cannot flush a system prompt every conversation starts from, which LRU lets happen.
- `RestorePolicy`: restore or recompute. Restoring costs the blocks' bytes at the measured read rate, plus the
  step the request waits for them; recomputing costs their tokens at the measured prefill rate. Both rates are
  running means of what this host did; the decision is logged when it changes.
- `KVTier`: the two over a store; what the KV manager calls.

A model with several KV groups (types.KVGroup: Gemma's local and global layers) has a store and an index per group,
each holding that group's blocks under the same chain digests; the KV manager says which of each group's blocks a
restore reads (a windowed group's last window only).

The engine never waits on the store while it holds a step: spills are handed to the store's writer thread,
and a restore is a fetch the request waits for in the waiting queue while other work runs.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

log = logging.getLogger("shoal.engine")

ROOT_DIGEST = b""  # the parent of a prompt's first block
FETCH_TIMEOUT = 10.0  # seconds a request waits on a read before it computes its prompt instead (a stalled disk)


def chain_digest(parent: bytes, key: tuple) -> bytes:
    """A full block's name: BLAKE2b-256 over its parent's name and its tokens (ints, or (token, content hash)
    pairs at image positions)."""
    return hashlib.blake2b(parent + repr(key).encode(), digest_size=32).digest()


# ---------------------------------------------------------------------------------------------------- W-TinyLFU


class FrequencySketch:
    """How often each key was wanted lately: a count-min sketch of four rows of 4-bit counters (at most 15),
    all halved once `sample` increments have been counted (TinyLFU's reset), so old popularity fades."""

    ROWS = 4
    MAX = 15

    def __init__(self, capacity: int) -> None:
        self.width = max(16, 1 << max(0, capacity - 1).bit_length())
        self.table = [[0] * self.width for _ in range(self.ROWS)]
        self.sample = 10 * max(1, capacity)
        self.additions = 0

    def _slots(self, key: bytes) -> list[int]:
        h = hashlib.blake2b(key, digest_size=4 * self.ROWS).digest() if len(key) < 4 * self.ROWS else key
        return [int.from_bytes(h[4 * r : 4 * r + 4], "little") % self.width for r in range(self.ROWS)]

    def increment(self, key: bytes) -> None:
        for row, i in zip(self.table, self._slots(key)):
            if row[i] < self.MAX:
                row[i] += 1
        self.additions += 1
        if self.additions >= self.sample:
            for row in self.table:
                row[:] = [c >> 1 for c in row]
            self.additions //= 2

    def estimate(self, key: bytes) -> int:
        return min(row[i] for row, i in zip(self.table, self._slots(key)))


class TinyLFU:
    """Which keys a store of `capacity` entries keeps (W-TinyLFU). Plain bookkeeping: the caller stores and
    deletes, told by `add`'s and `load`'s return values which keys left.

        add ──► window (LRU, 1%) ──pushed out──► admission: candidate's frequency > victim's?
                                                   yes: victim leaves, candidate ──► probation (LRU)
                                                   no:  candidate leaves
        hit in probation ──► protected (LRU, 80% of the main space; its overflow goes back to probation)
    """

    def __init__(self, capacity: int, window_fraction: float = 0.01, protected_fraction: float = 0.8) -> None:
        if capacity < 2:
            raise ValueError(f"a W-TinyLFU store needs room for at least 2 entries, got {capacity}")
        self.capacity = capacity
        self.window_cap = max(1, int(capacity * window_fraction))
        self.main_cap = capacity - self.window_cap
        self.protected_cap = max(1, int(self.main_cap * protected_fraction))
        self.sketch = FrequencySketch(capacity)
        self.window: OrderedDict[bytes, None] = OrderedDict()
        self.probation: OrderedDict[bytes, None] = OrderedDict()
        self.protected: OrderedDict[bytes, None] = OrderedDict()

    def __contains__(self, key: bytes) -> bool:
        return key in self.window or key in self.probation or key in self.protected

    def __len__(self) -> int:
        return len(self.window) + len(self.probation) + len(self.protected)

    def keys(self) -> list[bytes]:
        return [*self.window, *self.probation, *self.protected]

    def record(self, key: bytes) -> None:
        """Someone wanted `key` (found or not): its frequency counts toward admission."""
        self.sketch.increment(key)

    def hit(self, key: bytes) -> None:
        """`key` was used: it moves up its segment, from probation to protected."""
        if key in self.window:
            self.window.move_to_end(key)
        elif key in self.protected:
            self.protected.move_to_end(key)
        elif key in self.probation:
            del self.probation[key]
            self.protected[key] = None
            if len(self.protected) > self.protected_cap:
                demoted, _ = self.protected.popitem(last=False)
                self.probation[demoted] = None

    def add(self, key: bytes) -> list[bytes]:
        """A new key enters the window; returns the keys that left the store (`key` itself among them when the
        window pushed it out and it lost the admission, which with a window of one is at once)."""
        if key in self:
            self.hit(key)
            return []
        self.window[key] = None
        left = []
        while len(self.window) > self.window_cap:
            candidate, _ = self.window.popitem(last=False)
            left.extend(self._admit(candidate))
        return left

    def _admit(self, candidate: bytes) -> list[bytes]:
        if len(self.probation) + len(self.protected) < self.main_cap:
            self.probation[candidate] = None
            return []
        victims = self.probation or self.protected
        victim = next(iter(victims))
        if self.sketch.estimate(candidate) > self.sketch.estimate(victim):
            del victims[victim]
            self.probation[candidate] = None
            return [victim]
        return [candidate]

    def load(self, key: bytes) -> list[bytes]:
        """An entry found at start-up (oldest first): it joins the main space with no history; returns the
        oldest entries pushed out when there are more than the capacity (a smaller budget than last time)."""
        self.probation[key] = None
        left = []
        while len(self) > self.capacity:
            old, _ = self.probation.popitem(last=False)
            left.append(old)
        return left

    def remove(self, key: bytes) -> None:
        for seg in (self.window, self.probation, self.protected):
            seg.pop(key, None)


# ---------------------------------------------------------------------------------------------------- policy


class RestorePolicy:
    """Restore blocks from the tier or compute them again, from rates measured on this host.

    restore(k blocks)  = the bytes they read / read rate + one step's wait
                         (k * block_bytes with one KV group; with several, a windowed group reads only a window's)
    recompute(k blocks) = cost(k * block_tokens tokens at their context) / prefill rate

    `cost` is the scheduler's chunk_cost (tokens weighted by the context they attend to), so late blocks of a
    long prompt, which cost more to compute, are worth more to restore. The prefill rate is in those weighted
    tokens a second. Until the engine has computed a prefill there is no rate, and the tier restores.
    mode "always" or "never" (--prefix-cache-restore) fixes the answer: for measuring both sides.
    """

    SMOOTHING = 0.2  # weight of a new measurement in the running means

    def __init__(self, block_bytes: int, block_tokens: int, cost: Callable[[int, int], float], read_rate: float | None,
                 step_seconds: float = 0.005, mode: str = "auto") -> None:
        self.mode = mode
        self.block_bytes = block_bytes
        self.block_tokens = block_tokens
        self.cost = cost
        self.read_rate = read_rate  # bytes a second
        self.prefill_rate: float | None = None  # weighted tokens a second
        self.step_seconds = step_seconds
        self.decision: bool | None = None  # the last one logged

    @staticmethod
    def _mean(old: float | None, new: float, weight: float) -> float:
        return new if old is None else old + weight * (new - old)

    def observe_read(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self.read_rate = self._mean(self.read_rate, nbytes / seconds, self.SMOOTHING)

    def observe_prefill(self, cost: float, seconds: float) -> None:
        if cost > 0 and seconds > 0:
            self.prefill_rate = self._mean(self.prefill_rate, cost / seconds, self.SMOOTHING)

    def restore_seconds(self, blocks: int, nbytes: int | None = None) -> float:
        nbytes = blocks * self.block_bytes if nbytes is None else nbytes
        return self.step_seconds + nbytes / self.read_rate if self.read_rate else self.step_seconds

    def recompute_seconds(self, blocks: int, start: int) -> float | None:
        if not self.prefill_rate:
            return None
        return self.cost(blocks * self.block_tokens, start) / self.prefill_rate

    def worth(self, blocks: int, start: int, nbytes: int | None = None) -> bool:
        """Whether restoring `blocks` blocks from position `start`, reading `nbytes` (by default `blocks` blocks of
        every KV group's), beats computing them; logged when it changes."""
        if self.mode != "auto":
            return self.mode == "always"
        nbytes = blocks * self.block_bytes if nbytes is None else nbytes
        restore, recompute = self.restore_seconds(blocks, nbytes), self.recompute_seconds(blocks, start)
        decision = recompute is None or restore < recompute
        if decision != self.decision:
            self.decision = decision
            tokens = blocks * self.block_tokens
            if recompute is None:
                log.info("prefix-cache tier: restoring %d blocks (%d tokens); no prefill measured yet to compare with", blocks, tokens)
            else:
                log.info(
                    "prefix-cache tier: %s %d blocks (%.1f MiB at %.0f MiB/s read: %.1f ms) %s computing their %d tokens "
                    "from position %d (at %.0f tokens/s measured: %.1f ms)",
                    "restoring" if decision else "computing, not restoring,", blocks, nbytes / 2**20,
                    (self.read_rate or 0) / 2**20, restore * 1e3, "beats" if decision else "would lose to",
                    tokens, start, self.prefill_rate, recompute * 1e3,
                )
        return decision

    def threshold_read_rate(self) -> float | None:
        """The read rate below which computing a block at no context beats restoring it (bytes a second)."""
        if not self.prefill_rate:
            return None
        return self.block_bytes * self.prefill_rate / self.cost(self.block_tokens, 0)


# ---------------------------------------------------------------------------------------------------- the tier


@dataclass(frozen=True)
class Spill:
    """A block leaving the pool for the tier: which block of which KV group, and its name in the chain."""

    block_id: int
    digest: bytes
    parent: bytes
    num_tokens: int
    group: int = 0


@dataclass
class TierStats:
    kind: str = ""  # "disk" | "host"
    enabled: bool = True  # False once the store failed (the disk filled up): no tier from then on
    capacity_bytes: int = 0
    entry_bytes: int = 0  # one entry: a block's bytes and its header (of every KV group's, summed)
    entries: int = 0  # of every KV group
    bytes: int = 0  # the entries' bytes
    spilled_blocks: int = 0  # blocks written to the tier (of any KV group)
    spills_dropped: int = 0  # evicted blocks not written (the writer was behind, or the tier is off)
    lookups: int = 0  # admissions that looked past the pool
    hits: int = 0  # admissions that restored at least one block
    restored_blocks: int = 0  # prompt blocks restored (each one every KV group's bytes that its restore needed)
    restored_bytes: int = 0
    recomputed_blocks: int = 0  # found in the tier but computed: the policy said it was cheaper
    evictions: int = 0  # entries the tier dropped for room
    rejected_entries: int = 0  # entries ignored: truncated, corrupted, or written by another configuration
    read_rate: float = 0.0  # bytes a second, measured
    prefill_rate: float = 0.0  # weighted tokens a second, measured
    restore_threshold_rate: float = 0.0  # the read rate below which computing wins (0: not known yet)


@dataclass
class TierFetch:
    """A prompt's blocks being read for a restore of its blocks `first_block` .. `end` - 1: `parts[g]` is
    (the block indices, their kv_store.Fetch) of KV group g's that come from its store; a group that reads none
    has no part."""

    first_block: int  # the first block past the pool's match when the read started
    end: int
    parts: dict
    accounted: bool = False  # the tier took in its errors and rate (KVTier.received)

    @property
    def done(self) -> bool:
        return all(f.done for _, f in self.parts.values())

    @property
    def started(self) -> float:
        return min(f.started for _, f in self.parts.values())

    @property
    def num_blocks(self) -> int:
        """The prompt blocks the restore would cover."""
        return self.end - self.first_block


class KVTier:
    """The second tier over one store per KV group (types.KVGroup; kv_store.DirectoryStore or HostStore), each
    with its own W-TinyLFU index, under one restore policy. A model with one group has one store. Driven by the
    engine's thread; which blocks of which group a restore needs is the KV manager's to say."""

    def __init__(self, store, block_tokens: int, cost: Callable[[int, int], float], restore: str = "auto") -> None:
        self.stores = list(store) if isinstance(store, (list, tuple)) else [store]
        self.store = self.stores[0]
        self.block_tokens = block_tokens
        capacities = [s.capacity_bytes // s.entry_bytes for s in self.stores]
        if min(capacities) < 2:
            raise ValueError(
                f"the prefix-cache tier's budget ({sum(s.capacity_bytes for s in self.stores)} bytes) holds fewer than 2 "
                f"blocks of {max(s.entry_bytes for s in self.stores)} bytes: raise --prefix-cache-disk-bytes"
            )
        self.indexes = [TinyLFU(c) for c in capacities]
        self.index = self.indexes[0]
        self.block_bytes = [s.payload_bytes for s in self.stores]
        self.policy = RestorePolicy(sum(self.block_bytes), block_tokens, cost, self.store.read_rate, mode=restore)
        self.stats = TierStats(kind=self.store.kind, capacity_bytes=sum(c * s.entry_bytes for c, s in zip(capacities, self.stores)),
                               entry_bytes=sum(s.entry_bytes for s in self.stores))
        for store, index in zip(self.stores, self.indexes):
            for digest in store.existing():
                for old in index.load(digest):
                    store.delete(old)
                    self.stats.evictions += 1
            self.stats.rejected_entries += store.rejected
        self._count()
        self._fetches: list = []

    @property
    def enabled(self) -> bool:
        return self.stats.enabled

    @property
    def persistent(self) -> bool:
        return self.store.persistent

    def _count(self) -> None:
        self.stats.entries = sum(len(i) for i in self.indexes)
        self.stats.bytes = sum(len(i) * s.entry_bytes for i, s in zip(self.indexes, self.stores))

    # ------------------------------------------------------------ lookup and restore
    def held(self, digest: bytes, group: int = 0) -> bool:
        return digest in self.indexes[group]

    def wanted(self, digests: Iterable[bytes], group: int = 0) -> None:
        """These blocks of a group were looked for (found or not): their frequencies count toward admission."""
        for d in digests:
            self.indexes[group].record(d)

    def fetch(self, first_block: int, end: int, reads: dict) -> TierFetch:
        """Start reading, for each group g in `reads`, its blocks reads[g] = [(block index, digest), ...] of a prompt
        whose restore would cover blocks `first_block` .. `end` - 1: a TierFetch to poll."""
        self.stats.lookups += 1
        parts = {g: ([i for i, _ in r], self.stores[g].fetch(r[0][0], [d for _, d in r])) for g, r in reads.items()}
        self._fetches.extend(f for _, f in parts.values())
        return TierFetch(first_block, end, parts)

    def overdue(self, fetch: TierFetch) -> bool:
        """Whether a read still in progress has taken longer than FETCH_TIMEOUT: then its prompt is computed
        (counted as found but computed, with a log line) and whatever the read brings later is dropped."""
        if time.monotonic() - fetch.started <= FETCH_TIMEOUT:
            return False
        log.warning("prefix-cache tier: a read of %d blocks has taken over %.0f s; computing its prompt instead",
                    fetch.num_blocks, FETCH_TIMEOUT)
        self.stats.recomputed_blocks += fetch.num_blocks
        return True

    def received(self, fetch: TierFetch) -> dict:
        """A fetch came back: per group, {block index: (digest, payload)} up to its first missing block. Entries
        that failed their checks are ignored with a log line and leave the tier; the read's speed goes into the
        policy (once a fetch)."""
        first, fetch.accounted = not fetch.accounted, True
        out = {}
        for g, (indices, f) in fetch.parts.items():
            for digest, reason in f.errors if first else ():
                log.warning("prefix-cache tier: ignored and deleted block %s: %s", digest.hex()[:16], reason)
                self._drop(digest, g)
                self.stats.rejected_entries += 1
            out[g] = {i: (d, p) for i, d, p in zip(indices, f.digests, f.usable())}
        nbytes = sum(f.nbytes for _, f in fetch.parts.values())
        if first and nbytes:  # the stores read side by side
            self.policy.observe_read(nbytes, max(f.seconds for _, f in fetch.parts.values()))
        return out

    def restored(self, blocks: int, digests: dict) -> None:
        """A restore of `blocks` prompt blocks went into the pool, reading `digests[g]` of each group: count them,
        and move them up in the eviction order."""
        self.stats.hits += 1
        self.stats.restored_blocks += blocks
        for g, ds in digests.items():
            self.stats.restored_bytes += len(ds) * self.block_bytes[g]
            for d in ds:
                self.indexes[g].hit(d)

    def wait(self, timeout: float) -> None:
        """Wait (the engine has nothing else to do) until a read in progress is done, at most `timeout` s."""
        self._fetches = [f for f in self._fetches if not f.done]
        if self._fetches:
            self._fetches[0].event.wait(timeout)

    # ------------------------------------------------------------ spill
    def spill(self, spills: Sequence[Spill], payloads: Sequence) -> None:
        """Blocks the pool evicted, with their bytes: into their group's store (which writes them in the
        background)."""
        for s, payload in zip(spills, payloads):
            if not self.enabled:
                self.stats.spills_dropped += 1
                continue
            index, store = self.indexes[s.group], self.stores[s.group]
            index.record(s.digest)
            if s.digest in index:
                index.hit(s.digest)
                continue
            if not store.put(s.digest, s.parent, s.num_tokens, payload):
                self.stats.spills_dropped += 1
                continue
            left = index.add(s.digest)
            for old in left:
                store.delete(old)
            self.stats.evictions += sum(1 for old in left if old != s.digest)
            self.stats.spilled_blocks += s.digest not in left
        self._count()

    # ------------------------------------------------------------ health
    def poll(self) -> None:
        """Take in what the stores' threads found: a failed write turns the tier off, with one log line."""
        failure = next((s.failure for s in self.stores if s.failure is not None), None)
        if failure is not None and self.enabled:
            self.stats.enabled = False
            log.warning("prefix-cache tier off: %s; requests go on without it (evicted prefixes are dropped)", failure)
            for index in self.indexes:
                for d in index.keys():
                    index.remove(d)
            self._count()
        self.stats.read_rate = self.policy.read_rate or 0.0
        self.stats.prefill_rate = self.policy.prefill_rate or 0.0
        self.stats.restore_threshold_rate = self.policy.threshold_read_rate() or 0.0

    def _drop(self, digest: bytes, group: int = 0) -> None:
        index = self.indexes[group]
        if digest in index:
            index.remove(digest)
            self.stores[group].delete(digest)
            self._count()

    def drain(self, timeout: float) -> bool:
        """Wait until every store's queued writes are done (at most `timeout` s in all)."""
        deadline = time.monotonic() + timeout
        return all(s.drain(max(0.0, deadline - time.monotonic())) for s in self.stores)

    def close(self) -> None:
        """Finish the writes in progress and release the stores (the directory's lock with the first)."""
        for s in reversed(self.stores):
            s.close()
