"""KVCacheManager: the one owner of KV blocks. No torch.

It holds the block pool and the prefix cache, and it is the only thing that
changes a sequence's block table. The scheduler decides order and budgets; for
blocks it asks the manager, and gets answers it does not look inside:

    match(seq)                 what the prefix cache holds of a fresh sequence's tokens (takes no references)
    admit(seq, match, n)       pin the match and allocate for n more tokens; on a shortfall undo it all: False
    can_grow(seq, n), grow     room for n more tokens of a running sequence
    fork(child, parent, k, n)  the child shares the parent's first k computed tokens, and gets room for n more
    trim(seq)                  free the blocks past its computed tokens (a rejected draft's, speculative.py)
    commit(seq)                index the sequence's computed full blocks in the prefix cache
    release(seq)               drop its references; with the cache, what it computed stays findable
    take_copies()              block copies promised to admitted and forked sequences, for the next plan
    take_spills(), take_restores()  with a second tier: evicted blocks to copy out, fetched ones to write in

With a second tier (kv_tier.py) a match may go on past the pool: the next blocks of the prompt, found in
the tier by chain digest, are fetched in the background while the sequence waits (`Admission.pending`),
and on its next admission they are written into fresh blocks instead of being computed:

    | shared full blocks (by reference) | restored blocks (written from the tier) | fresh blocks |

A sequence's blocks after a hit or a fork, by position:

    | shared full blocks (by reference) | copied partial block | fresh blocks for the new tokens |
    0                                   num_full * block_size  k                         k + n

The copy is copy-on-write done eagerly: a partial block is never shared, so no
one writes into a block someone else reads. Copies run in the runner before the
plan's forward (`StepPlan.block_copies`).

KV groups (types.KVGroup, as vLLM's KVCacheManager with a SingleTypeKVCacheManager
per group): the layers of one sliding window share a group, the full-attention
layers another, each with its own pool, and a sequence has a block table per group
(`Sequence.block_tables`), all as long as its tokens need. Every answer above is
for all groups at once: a sequence grows only if every group's pool has room. A
windowed group of window w lets go of the blocks no query can see any more: once
a sequence has computed c tokens, its next query is at c and sees positions
c - w + 1 .. c, so every block wholly before c - w + 1 goes back (to the prefix
cache if it indexes it) and the table holds the pool's null block there:

    positions:     0          c-w+1            c         c+n
    full group:    [ b | b | b | b | b | b | b | new ]
    window w:      [ null | null | b | b | b | b | new ]   (blocks wholly before c-w+1 freed)

so a windowed group holds about w + a step's tokens per sequence, however long it
is. A hit, a fork and a trim keep to the same rule; a fork whose parent has slid
past what the child needs is refused (`can_share`), and the child computes its
prompt.

The second tier keeps each group's evicted blocks apart (a store per group), and a
restore reads from each group what a step computing from the restore's end reads:
the full group every block after the pool's match, a windowed group only the
blocks of its last window. So the restore ends where every group has its part
(`_restorable`), and a windowed group's table holds the null block before it:

    positions:     0        pool match        end-w+1      end
    full group:    [ b | b | b | restored | restored | restored ]
    window w:      [ null ...      | null | restored | restored ]
"""

from __future__ import annotations

from dataclasses import dataclass

from collections.abc import Sequence as Seq

from shoal.engine.block_pool import KVBlockPool
from shoal.engine.kv_tier import ROOT_DIGEST, KVTier, Spill, chain_digest
from shoal.engine.prefix_cache import PrefixCache, PrefixMatch
from shoal.engine.sequence import Sequence


@dataclass(frozen=True)
class Admission:
    """What a fresh sequence starts from: `num_tokens` of its tokens already have KV somewhere.
    restore: (group, block index, digest, payload) of the blocks after the match's full ones, from the tier, which
    with `shared` then cover its first `restored_to` tokens (the match's partial copy goes unused); a windowed
    group's only where its window at `restored_to` reaches.
    pending: the tier is reading blocks for it; it waits, holding no blocks, until they are in."""

    match: PrefixMatch | None = None
    restore: tuple = ()
    shared: tuple = ()  # (group, block index, block): blocks after the match that the restore takes from the pool
    restored_to: int = 0
    pending: bool = False

    @property
    def num_tokens(self) -> int:
        if self.restore:
            return self.restored_to
        return self.match.num_tokens if self.match is not None else 0


NO_MATCH = Admission()
PENDING = Admission(pending=True)


class KVCacheManager:
    def __init__(self, pool: KVBlockPool | Seq[KVBlockPool], cache: PrefixCache | None = None, tier: KVTier | None = None,
                 windows: Seq[int | None] | None = None) -> None:
        """pool: each KV group's pool (one pool: one group, full attention); windows: each group's sliding window
        (None: full attention), in the pools' order; the prefix cache, where given, is over the same pools."""
        self.pools = [pool] if isinstance(pool, KVBlockPool) else list(pool)
        self.pool = self.pools[0]
        self.windows = tuple(windows) if windows is not None else (None,) * len(self.pools)
        if len(self.windows) != len(self.pools):
            raise ValueError(f"{len(self.windows)} windows for {len(self.pools)} KV groups")
        self.groups = range(len(self.pools))
        self.windowed = any(w is not None for w in self.windows)
        self.cache = cache
        self.tier = tier if cache is not None else None
        self.block_size = self.pool.block_size
        self._copies: list[tuple[int, ...]] = []  # (source, destination[, group > 0]) promised, not yet in a plan
        self._spills: list[Spill] = []  # evicted blocks whose bytes go to the tier before anything overwrites them
        self._restores: list[tuple[int, int, object]] = []  # (group, block, payload) to write before the next forward
        # waiting sequences matched already: a sequence the pool cannot take yet is matched every step, and counts
        # in the cache's statistics, and asks the tier, once while it waits (it would count and weigh its blocks
        # every step)
        self._matched: set[int] = set()
        if self.tier is not None:
            cache.on_evict = self._evicted

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    def first_needed(self, group: int, start: int) -> int:
        """The first block of `group` a step computing from position `start` reads (0 without a window): a query
        at `start` sees start - w + 1 .. start."""
        w = self.windows[group]
        return 0 if w is None else max(0, start - w + 1) // self.block_size

    def _fresh_tables(self, seq: Sequence) -> None:
        if len(seq.block_tables) != len(self.pools):
            seq.block_tables = [[] for _ in self.groups]

    def _held(self, group: int, table: list[int]) -> list[int]:
        """The blocks a table references (not its null entries)."""
        null = self.pools[group].null_block
        return [b for b in table if b != null] if self.windows[group] is not None else table

    # ------------------------------------------------------------ admission
    def match(self, seq: Sequence) -> Admission:
        """The longest cached prefix of a fresh sequence's tokens. A sequence that still wants prompt
        logprobs takes no hit (vLLM's rule): cached tokens have no hidden states to give them, so it
        computes the whole prompt (its blocks still go into the cache); so does a mean-pooling request."""
        if self.cache is None or seq.block_table or seq.needs_every_row:
            return NO_MATCH
        keys = _key_tokens(seq)
        fetch = seq.kv_fetch
        first = seq.seq_id not in self._matched
        self._matched.add(seq.seq_id)
        m = self.cache.match(keys, count=first)
        if self.tier is None or not self.tier.enabled:
            seq.kv_fetch = None
            return Admission(m)
        if fetch is not None:  # kept until an admission takes its blocks: a pool too short for it now may not be later
            if fetch.done:
                return self._with_restore(m, keys, fetch)
            if not self.tier.overdue(fetch):
                return PENDING
            seq.kv_fetch = None  # the store hangs (a stalled disk): compute instead of waiting on it
            return Admission(m)
        if not first:
            return Admission(m)
        n = len(m.blocks)
        digests = list(self._digests_after(m, keys))
        top = n + len(digests)
        pooled = self._pooled_after(m, keys, top)
        end = self._restorable(n, top, lambda g, i: pooled(g, i) is not None or self.tier.held(digests[i - n], g))
        reads = {}
        for g in self.groups:  # what each group would read: its frequencies count toward the tier's admission
            stop = end if end > n else top
            wanted = [(i, digests[i - n]) for i in range(max(n, self.first_needed(g, stop * self.block_size)), stop)
                      if pooled(g, i) is None]
            self.tier.wanted([d for _, d in wanted], g)
            if end > n and wanted:
                reads[g] = wanted
        nbytes = sum(len(r) * self.tier.block_bytes[g] for g, r in reads.items())
        if not reads or not self.tier.policy.worth(end - n, n * self.block_size, nbytes):
            self.tier.stats.recomputed_blocks += end - n
            return Admission(m)
        seq.kv_fetch = self.tier.fetch(n, end, reads)
        return PENDING

    def _pooled_after(self, m: PrefixMatch, keys: list, top: int):
        """(group, block index) -> the pool's cached block there, or None: past the match, the trie may still hold
        some groups' blocks of the prompt (a windowed group's last ones, where the full group lost them)."""
        bs = self.block_size
        node, nodes = (m.nodes[-1] if m.nodes else self.cache.root), []
        for i in range(len(m.blocks), top):
            node = node.children.get(tuple(keys[i * bs : (i + 1) * bs]))
            if node is None:
                break
            nodes.append(node)
        n = len(m.blocks)
        return lambda g, i: nodes[i - n].blocks[g] if i - n < len(nodes) else None

    def _restorable(self, n: int, top: int, has) -> int:
        """Where the longest restore after the pool's `n` matched blocks can end, at most at block `top`, such that
        every group has what a step computing from there reads: group g its blocks max(n, first_needed) .. end - 1
        (all of them with full attention, a window's with a window). `has(g, i)`: group g's block i is at hand.
        n: no restore."""
        missing = []  # per group: how many of blocks n .. n + j - 1 are not at hand
        for g in self.groups:
            run = [0]
            for i in range(n, top):
                run.append(run[-1] + (not has(g, i)))
            missing.append(run)
        for end in range(top, n, -1):
            if all(run[end - n] == run[max(n, self.first_needed(g, end * self.block_size)) - n]
                   for g, run in zip(self.groups, missing)):
                return end
        return n

    def _digests_after(self, m: PrefixMatch, keys: list):
        """The chain digests of the prompt's full blocks after the match's (the last prompt token excluded)."""
        bs = self.block_size
        digest = m.nodes[-1].digest if m.nodes else ROOT_DIGEST
        for i in range(len(m.blocks), (len(keys) - 1) // bs):
            digest = chain_digest(digest, tuple(keys[i * bs : (i + 1) * bs]))
            yield digest

    def _with_restore(self, m: PrefixMatch, keys: list, fetch) -> Admission:
        """The match after a fetch came back: the blocks after the pool's match go in, read or still cached, as far
        as every group has what it reads."""
        got = self.tier.received(fetch)  # the first time: checks and counts; again (a retry): the same
        n = len(m.blocks)  # the pool may have got blocks back meanwhile (another sequence computed them)
        if n < fetch.first_block:
            return Admission(m)  # the pool lost blocks before them
        pooled = self._pooled_after(m, keys, fetch.end)
        end = self._restorable(n, fetch.end, lambda g, i: pooled(g, i) is not None or i in got.get(g, ()))
        if end == n:
            return Admission(m)
        restore, shared = [], []
        for g in self.groups:
            for i in range(max(n, self.first_needed(g, end * self.block_size)), end):
                if pooled(g, i) is not None:
                    shared.append((g, i, pooled(g, i)))
                else:
                    restore.append((g, i, *got[g][i]))
        return Admission(m, restore=tuple(restore), shared=tuple(shared), restored_to=end * self.block_size)

    def admit(self, seq: Sequence, admission: Admission, num_new: int) -> bool:
        """Give a waiting sequence its matched blocks and room for `num_new` tokens after them.
        False, with nothing taken, when the pool is short."""
        m = admission.match
        restore = admission.restore
        copies = m.copies if m is not None and not restore else (None,) * len(self.pools)
        self._fresh_tables(seq)
        for g, _, b in admission.shared:
            self.pools[g].incref([b])  # pinned: nothing below may evict them
        if m is not None:
            for g, (pool, table, copy) in enumerate(zip(self.pools, m.tables, copies)):
                held = [b for b in table if b is not None]
                pool.incref(held)
                if copy is not None:
                    pool.incref([copy])  # pinned: the allocation below must not evict it
                seq.block_tables[g] = [pool.null_block if b is None else b for b in table]
            seq.num_computed_tokens = admission.num_tokens
        fits = self.can_grow(seq, num_new)  # the restored blocks among what it needs
        if fits:
            if restore:
                self._restore_into(seq, admission)
            self.grow(seq, num_new)
        if m is None:
            return fits
        for g, copy in enumerate(copies):
            if copy is None:
                continue
            if fits:
                self._copies.append((copy, seq.block_tables[g][len(m.blocks)], *((g,) if g else ())))
                if g == 0:
                    self.cache.stats.copies += 1
            self.pools[g].free([copy])
        if not fits:  # undo: the shared blocks go back to the cache
            for g, pool in enumerate(self.pools):
                pool.free(self._held(g, seq.block_tables[g]))
            for g, _, b in admission.shared:
                self.pools[g].free([b])
            seq.block_tables, seq.num_computed_tokens = [[] for _ in self.groups], 0
            return False
        seq.cache_nodes = list(m.nodes)
        seq.kv_fetch = None
        self._matched.discard(seq.seq_id)
        if seq.num_preemptions == 0:
            seq.cache_hit_kind = "tier" if restore else m.kind
            seq.num_cached_tokens = min(admission.num_tokens, seq.prompt_len)
            self.cache.record(seq.prompt_len, seq.num_cached_tokens)
        return True

    def _restore_into(self, seq: Sequence, admission: Admission) -> None:
        """The blocks after the match, each group's: a cached one shared (pinned already), or a fresh one the tier's
        bytes go into; a windowed group holds the null block where the restore's last window does not reach, and
        lets go of the matched blocks there."""
        end, n = admission.restored_to // self.block_size, len(seq.block_table)
        read = {}
        for g in self.groups:
            table, pool = seq.block_tables[g], self.pools[g]
            reads = {i: (d, p) for gg, i, d, p in admission.restore if gg == g}
            at = {i: b for gg, i, b in admission.shared if gg == g}
            fresh = iter(pool.allocate(len(reads)))
            for i in range(len(table), end):
                if i in at:
                    table.append(at[i])
                elif i in reads:
                    table.append(next(fresh))
                    self._restores.append((g, table[-1], reads[i][1]))
                else:
                    table.append(pool.null_block)  # before a windowed group's last window
            read[g] = [d for d, _ in reads.values()]
            if self.windows[g] is not None:
                first = self.first_needed(g, admission.restored_to)
                pool.free([b for b in table[:first] if b != pool.null_block])
                table[:first] = [pool.null_block] * first
        self.tier.restored(end - n, read)

    # ------------------------------------------------------------ growth
    def can_grow(self, seq: Sequence, num_new: int, spare: int = 0) -> bool:
        """Whether every group's pool has the blocks for `num_new` more tokens, and `spare` more free after them."""
        need = self.pool.blocks_for_tokens(seq.num_computed_tokens + num_new) + spare
        tables = seq.block_tables
        if len(self.pools) == 1:  # the common case, on every step of every sequence: no generator
            return need - len(tables[0]) <= self.pool.num_free
        if len(tables) != len(self.pools):  # a sequence that holds nothing yet
            return all(need <= pool.num_free for pool in self.pools)
        return all(need - len(table) <= pool.num_free for pool, table in zip(self.pools, tables))

    def grow(self, seq: Sequence, num_new: int) -> None:
        """Room for `num_new` more tokens (check can_grow first)."""
        if len(seq.block_tables) != len(self.pools):
            self._fresh_tables(seq)
        need = self.pool.blocks_for_tokens(seq.num_computed_tokens + num_new)
        for pool, table in zip(self.pools, seq.block_tables):
            if need > len(table):
                table.extend(pool.allocate(need - len(table)))

    def trim(self, seq: Sequence) -> None:
        """Free the blocks past the sequence's computed tokens: those a rejected draft's positions took. They
        were allocated for this sequence in this step, and nothing indexes them (commit stops at computed)."""
        keep = self.pool.blocks_for_tokens(seq.num_computed_tokens)
        for pool, table in zip(self.pools, seq.block_tables):
            if len(table) > keep:
                pool.free(table[keep:])
                del table[keep:]

    def slide(self, seq: Sequence) -> int:
        """Free each windowed group's blocks that the sequence's next query (at its computed count) cannot see;
        returns how many. Their content stays findable where the prefix cache indexes it."""
        freed = 0
        for g, w in enumerate(self.windows):
            if w is None:
                continue
            table, null = seq.block_tables[g], self.pools[g].null_block
            # the table is nulls, then held blocks: walk back from the first needed one to the nulls
            end = i = min(self.first_needed(g, seq.num_computed_tokens), len(table))
            while i > 0 and table[i - 1] != null:
                i -= 1
            if i < end:
                self.pools[g].free(table[i:end])
                table[i:end] = [null] * (end - i)
                freed += end - i
        return freed

    def can_share(self, parent: Sequence, shared: int) -> bool:
        """Whether the parent still holds every block a child computing from position `shared` reads (a windowed
        group's parent may have slid past them)."""
        num_full, partial = divmod(shared, self.block_size)
        for g in self.groups:
            if self.windows[g] is None:
                continue
            table, null = parent.block_tables[g], self.pools[g].null_block
            if any(b == null for b in table[self.first_needed(g, shared) : num_full + (partial > 0)]):
                return False
        return True

    def fork(self, child: Sequence, parent: Sequence, shared: int, num_new: int) -> bool:
        """The child starts from the parent's first `shared` computed tokens: full blocks by reference,
        a partial one by copy, then fresh blocks for `num_new` tokens. False, with nothing taken, when
        the pool is short or the parent no longer holds what the child reads (can_share).

            parent blocks: [ full | full | partial ]
            child blocks:  [ same | same | copy    | fresh ... ]
        """
        num_full, partial = divmod(shared, self.block_size)
        need = self.pool.blocks_for_tokens(shared + num_new) - num_full
        if any(need > pool.num_free for pool in self.pools) or not self.can_share(parent, shared):
            return False
        tables = []
        for g, pool in enumerate(self.pools):
            full = parent.block_tables[g][:num_full]
            first = self.first_needed(g, shared)
            if first:
                full = [pool.null_block] * first + full[first:]
            pool.incref(full[first:])
            fresh = pool.allocate(need)
            if partial:
                self._copies.append((parent.block_tables[g][num_full], fresh[0], *((g,) if g else ())))
            tables.append(full + fresh)
        child.block_tables = tables
        child.cache_nodes = parent.cache_nodes[:num_full]
        child.num_computed_tokens = shared
        return True

    def take_copies(self) -> tuple[tuple[int, ...], ...]:
        """The block copies promised so far, in promise order; the plan that carries them runs them first.
        (source, destination) in the first group, (source, destination, group) in another."""
        copies, self._copies = tuple(self._copies), []
        return copies

    # ------------------------------------------------------------ the second tier
    def _evicted(self, node, group: int) -> None:
        """The prefix cache dropped a full node's block of `group`: it goes to the tier, unless the tier has it."""
        if node.num_tokens != self.block_size or self.tier.held(node.digest, group):
            return
        if self.tier.enabled:
            self._spills.append(Spill(node.blocks[group], node.digest, node.parent.digest, node.num_tokens, group))
        else:
            self.tier.stats.spills_dropped += 1

    def take_spills(self) -> list[Spill]:
        """Evicted blocks whose bytes must be copied out before the next forward (which may overwrite them)."""
        spills, self._spills = self._spills, []
        return spills

    def take_restores(self) -> list[tuple[int, int, object]]:
        """(group, block, payload) to write into the KV cache before the next forward: after the spills' copies."""
        restores, self._restores = self._restores, []
        return restores

    def spill_all(self) -> list[Spill]:
        """Every cached full block the tier lacks, most recently used first, at most what its group's store holds: for
        keeping the pool's content across a restart (none for a store that ends with the process)."""
        if self.tier is None or not self.tier.enabled or not self.tier.persistent:
            return []
        return [Spill(n.blocks[g], n.digest, n.parent.digest, n.num_tokens, g) for g in self.groups
                for n in [n for n in self.cache.full_nodes(g) if not self.tier.held(n.digest, g)][: self.tier.indexes[g].capacity]]

    # ------------------------------------------------------------ the prefix cache
    def expire(self) -> None:
        """Drop cached blocks idle past the cache's TTL."""
        if self.cache is not None and self.cache.ttl is not None:
            self.cache.expire()

    def commit(self, seq: Sequence) -> None:
        """Index every computed full block of `seq` not indexed yet (none of a pooling request's: Sequence.keeps_kv),
        then let windowed groups' blocks out of the window go (slide)."""
        if self.cache is not None and seq.keeps_kv:
            self._index(seq)
        if self.windowed:
            self.slide(seq)

    def _index(self, seq: Sequence) -> None:
        bs = self.block_size
        num_full = seq.num_computed_tokens // bs
        if len(seq.cache_nodes) >= num_full:
            return
        keys = _key_tokens(seq)
        for i in range(len(seq.cache_nodes), num_full):
            parent = seq.cache_nodes[-1] if seq.cache_nodes else None
            own = [self._own(g, seq.block_tables[g][i]) for g in self.groups]
            node = self.cache.insert_full(parent, tuple(keys[i * bs : (i + 1) * bs]), own)
            for g, b in enumerate(own):
                if b is not None and node.blocks[g] != b:
                    # The content was cached already (the same prompt admitted in the same step, or
                    # a prompt-logprobs request that took no hit): hold the cached block instead of
                    # the copy, in each group. A sequence then holds every node on its path, so an
                    # unreferenced cached block never has a referenced child and eviction always finds a leaf.
                    self.pools[g].incref([node.blocks[g]])
                    self.pools[g].free([b])
                    seq.block_tables[g][i] = node.blocks[g]
            seq.cache_nodes.append(node)

    def _own(self, group: int, block: int) -> int | None:
        return None if block == self.pools[group].null_block and self.windows[group] is not None else block

    def release(self, seq: Sequence) -> None:
        """Drop the sequence's block references; with the prefix cache, its computed content stays
        findable (the last partial block included)."""
        self._matched.discard(seq.seq_id)  # a waiting sequence that finished (aborted) without being admitted
        if not seq.block_table:
            return
        if self.cache is not None and seq.keeps_kv:
            self._index(seq)
            bs = self.block_size
            num_full, partial = divmod(seq.num_computed_tokens, bs)
            if partial:
                parent = seq.cache_nodes[num_full - 1] if num_full else None
                key = tuple(_key_tokens(seq)[num_full * bs : seq.num_computed_tokens])
                self.cache.insert_partial(parent, key, [self._own(g, seq.block_tables[g][num_full]) for g in self.groups])
        for g, pool in enumerate(self.pools):
            pool.free(self._held(g, seq.block_tables[g]))
        seq.block_tables = [[] for _ in self.groups]
        seq.cache_nodes = []

    def clear_cache(self) -> int:
        """Forget all cached prefixes; returns blocks dropped."""
        return self.cache.clear() if self.cache is not None else 0

    def check_integrity(self, block_tables, *group_tables) -> None:
        """Raise AssertionError unless the pool's counts equal the references in `block_tables`
        (every sequence that holds blocks), each other group's pool's those in its `group_tables`,
        and the cache agrees with the pools."""
        for pool, tables in zip(self.pools, (block_tables, *group_tables)):
            pool.check_integrity(tables)
        if self.cache is not None:
            self.cache.check_integrity()


def _key_tokens(seq: Sequence) -> list:
    """The cache key of a sequence's tokens: token ids, with (token, content hash)
    at positions that carry extra content (an image placeholder), so equal tokens
    with different images never match."""
    if not seq.extra_keys:
        return seq.token_ids
    return [(t, seq.extra_keys[i]) if i in seq.extra_keys else t for i, t in enumerate(seq.token_ids)]
