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
"""

from __future__ import annotations

from dataclasses import dataclass

from shoal.engine.block_pool import KVBlockPool
from shoal.engine.kv_tier import ROOT_DIGEST, KVTier, Spill, chain_digest
from shoal.engine.prefix_cache import PrefixCache, PrefixMatch
from shoal.engine.sequence import Sequence


@dataclass(frozen=True)
class Admission:
    """What a fresh sequence starts from: `num_tokens` of its tokens already have KV somewhere.
    restore: (digest, payload) of the blocks after the match's full ones, from the tier, which then cover its
    first `restored_to` tokens (the match's partial copy goes unused).
    pending: the tier is reading blocks for it; it waits, holding no blocks, until they are in."""

    match: PrefixMatch | None = None
    restore: tuple = ()
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
    def __init__(self, pool: KVBlockPool, cache: PrefixCache | None = None, tier: KVTier | None = None) -> None:
        self.pool = pool
        self.cache = cache
        self.tier = tier if cache is not None else None
        self.block_size = pool.block_size
        self._copies: list[tuple[int, int]] = []  # (source, destination) promised, not yet in a plan
        self._spills: list[Spill] = []  # evicted blocks whose bytes go to the tier before anything overwrites them
        self._restores: list[tuple[int, object]] = []  # (block, payload) to write before the next forward
        # waiting sequences matched already: a sequence the pool cannot take yet is matched every step, and counts
        # in the cache's statistics, and asks the tier, once while it waits (it would count and weigh its blocks
        # every step)
        self._matched: set[int] = set()
        if self.tier is not None:
            cache.on_evict = self._evicted

    @property
    def num_free(self) -> int:
        return self.pool.num_free

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
                return self._with_restore(m, fetch)
            if not self.tier.overdue(fetch):
                return PENDING
            seq.kv_fetch = None  # the store hangs (a stalled disk): compute instead of waiting on it
            return Admission(m)
        if not first:
            return Admission(m)
        start = len(m.blocks)
        found = self.tier.find(self._digests_after(m, keys))
        if not found or not self.tier.policy.worth(len(found), start * self.block_size):
            self.tier.stats.recomputed_blocks += len(found)
            return Admission(m)
        seq.kv_fetch = self.tier.fetch(start, found)
        return PENDING

    def _digests_after(self, m: PrefixMatch, keys: list):
        """The chain digests of the prompt's full blocks after the match's (the last prompt token excluded)."""
        bs = self.block_size
        digest = m.nodes[-1].digest if m.nodes else ROOT_DIGEST
        for i in range(len(m.blocks), (len(keys) - 1) // bs):
            digest = chain_digest(digest, tuple(keys[i * bs : (i + 1) * bs]))
            yield digest

    def _with_restore(self, m: PrefixMatch, fetch) -> Admission:
        """The match after a fetch came back: the fetched blocks that follow the pool's match go in."""
        payloads = self.tier.received(fetch)  # the first time: checks and counts; again (a retry): the same
        skip = len(m.blocks) - fetch.first_block  # blocks the pool got back meanwhile (another sequence computed them)
        if skip < 0 or skip >= len(payloads):
            return Admission(m)  # nothing to add: the pool has them all, or lost the blocks before them
        restore = tuple(zip(fetch.digests[skip : len(payloads)], payloads[skip:]))
        return Admission(m, restore=restore, restored_to=(len(m.blocks) + len(restore)) * self.block_size)

    def admit(self, seq: Sequence, admission: Admission, num_new: int) -> bool:
        """Give a waiting sequence its matched blocks and room for `num_new` tokens after them.
        False, with nothing taken, when the pool is short."""
        pool, m = self.pool, admission.match
        restore = admission.restore
        copy_block = m.copy_block if m is not None and not restore else None
        if m is not None:
            pool.incref(m.blocks)
            if copy_block is not None:
                pool.incref([copy_block])  # pinned: the allocation below must not evict it
            seq.block_table = list(m.blocks)
            seq.num_computed_tokens = admission.num_tokens
        fits = self.can_grow(seq, num_new)  # the restored blocks among what it needs
        if fits:
            if restore:
                fresh = pool.allocate(len(restore))
                seq.block_table.extend(fresh)
                self._restores.extend((b, payload) for b, (_, payload) in zip(fresh, restore))
                self.tier.restored([d for d, _ in restore])
            self.grow(seq, num_new)
        if m is None:
            return fits
        if copy_block is not None:
            if fits:
                self._copies.append((copy_block, seq.block_table[len(m.blocks)]))
                self.cache.stats.copies += 1
            pool.free([copy_block])
        if not fits:  # undo: the shared blocks go back to the cache
            pool.free(seq.block_table)
            seq.block_table, seq.num_computed_tokens = [], 0
            return False
        seq.cache_nodes = list(m.nodes)
        seq.kv_fetch = None
        self._matched.discard(seq.seq_id)
        if seq.num_preemptions == 0:
            seq.cache_hit_kind = "tier" if restore else m.kind
            seq.num_cached_tokens = min(admission.num_tokens, seq.prompt_len)
            self.cache.record(seq.prompt_len, seq.num_cached_tokens)
        return True

    # ------------------------------------------------------------ growth
    def _blocks_needed(self, seq: Sequence, num_new: int) -> int:
        return self.pool.blocks_for_tokens(seq.num_computed_tokens + num_new) - len(seq.block_table)

    def can_grow(self, seq: Sequence, num_new: int) -> bool:
        return self._blocks_needed(seq, num_new) <= self.pool.num_free

    def grow(self, seq: Sequence, num_new: int) -> None:
        """Room for `num_new` more tokens (check can_grow first)."""
        need = self._blocks_needed(seq, num_new)
        if need > 0:
            seq.block_table.extend(self.pool.allocate(need))

    def trim(self, seq: Sequence) -> None:
        """Free the blocks past the sequence's computed tokens: those a rejected draft's positions took. They
        were allocated for this sequence in this step, and nothing indexes them (commit stops at computed)."""
        keep = self.pool.blocks_for_tokens(seq.num_computed_tokens)
        if len(seq.block_table) > keep:
            self.pool.free(seq.block_table[keep:])
            del seq.block_table[keep:]

    def fork(self, child: Sequence, parent: Sequence, shared: int, num_new: int) -> bool:
        """The child starts from the parent's first `shared` computed tokens: full blocks by reference,
        a partial one by copy, then fresh blocks for `num_new` tokens. False, with nothing taken, when
        the pool is short.

            parent blocks: [ full | full | partial ]
            child blocks:  [ same | same | copy    | fresh ... ]
        """
        num_full, partial = divmod(shared, self.block_size)
        need = self.pool.blocks_for_tokens(shared + num_new) - num_full
        if need > self.pool.num_free:
            return False
        full = parent.block_table[:num_full]
        self.pool.incref(full)
        fresh = self.pool.allocate(need)
        if partial:
            self._copies.append((parent.block_table[num_full], fresh[0]))
        child.block_table = full + fresh
        child.cache_nodes = parent.cache_nodes[:num_full]
        child.num_computed_tokens = shared
        return True

    def take_copies(self) -> tuple[tuple[int, int], ...]:
        """The block copies promised so far, in promise order; the plan that carries them runs them first."""
        copies, self._copies = tuple(self._copies), []
        return copies

    # ------------------------------------------------------------ the second tier
    def _evicted(self, node) -> None:
        """The prefix cache dropped a full node: its block goes to the tier, unless the tier has it."""
        if node.num_tokens != self.block_size or self.tier.held(node.digest):
            return
        if self.tier.enabled:
            self._spills.append(Spill(node.block_id, node.digest, node.parent.digest, node.num_tokens))
        else:
            self.tier.stats.spills_dropped += 1

    def take_spills(self) -> list[Spill]:
        """Evicted blocks whose bytes must be copied out before the next forward (which may overwrite them)."""
        spills, self._spills = self._spills, []
        return spills

    def take_restores(self) -> list[tuple[int, object]]:
        """(block, payload) pairs to write into the KV cache before the next forward: after the spills' copies."""
        restores, self._restores = self._restores, []
        return restores

    def spill_all(self) -> list[Spill]:
        """Every cached full block the tier lacks, most recently used first, at most what the tier holds: for
        keeping the pool's content across a restart (none for a store that ends with the process)."""
        if self.tier is None or not self.tier.enabled or not self.tier.store.persistent:
            return []
        room = self.tier.index.capacity
        return [Spill(n.block_id, n.digest, n.parent.digest, n.num_tokens)
                for n in self.cache.full_nodes() if not self.tier.held(n.digest)][:room]

    # ------------------------------------------------------------ the prefix cache
    def expire(self) -> None:
        """Drop cached blocks idle past the cache's TTL."""
        if self.cache is not None and self.cache.ttl is not None:
            self.cache.expire()

    def commit(self, seq: Sequence) -> None:
        """Index every computed full block of `seq` not indexed yet (none of a pooling request's: Sequence.keeps_kv)."""
        if self.cache is None or not seq.keeps_kv:
            return
        bs = self.block_size
        num_full = seq.num_computed_tokens // bs
        if len(seq.cache_nodes) >= num_full:
            return
        keys = _key_tokens(seq)
        for i in range(len(seq.cache_nodes), num_full):
            parent = seq.cache_nodes[-1] if seq.cache_nodes else None
            node = self.cache.insert_full(parent, tuple(keys[i * bs : (i + 1) * bs]), seq.block_table[i])
            if node.block_id != seq.block_table[i]:
                # The content was cached already (the same prompt admitted in the same step, or
                # a prompt-logprobs request that took no hit): hold the cached block instead of
                # the copy. A sequence then holds every node on its path, so an unreferenced
                # cached block never has a referenced child and eviction always finds a leaf.
                self.pool.incref([node.block_id])
                self.pool.free([seq.block_table[i]])
                seq.block_table[i] = node.block_id
            seq.cache_nodes.append(node)

    def release(self, seq: Sequence) -> None:
        """Drop the sequence's block references; with the prefix cache, its computed content stays
        findable (the last partial block included)."""
        self._matched.discard(seq.seq_id)  # a waiting sequence that finished (aborted) without being admitted
        if not seq.block_table:
            return
        if self.cache is not None and seq.keeps_kv:
            self.commit(seq)
            bs = self.block_size
            num_full, partial = divmod(seq.num_computed_tokens, bs)
            if partial:
                parent = seq.cache_nodes[num_full - 1] if num_full else None
                key = tuple(_key_tokens(seq)[num_full * bs : seq.num_computed_tokens])
                self.cache.insert_partial(parent, key, seq.block_table[num_full])
        self.pool.free(seq.block_table)
        seq.block_table = []
        seq.cache_nodes = []

    def clear_cache(self) -> int:
        """Forget all cached prefixes; returns blocks dropped."""
        return self.cache.clear() if self.cache is not None else 0

    def check_integrity(self, block_tables) -> None:
        """Raise AssertionError unless the pool's counts equal the references in `block_tables`
        (every sequence that holds blocks) and the cache agrees with the pool."""
        self.pool.check_integrity(block_tables)
        if self.cache is not None:
            self.cache.check_integrity()


def _key_tokens(seq: Sequence) -> list:
    """The cache key of a sequence's tokens: token ids, with (token, content hash)
    at positions that carry extra content (an image placeholder), so equal tokens
    with different images never match."""
    if not seq.extra_keys:
        return seq.token_ids
    return [(t, seq.extra_keys[i]) if i in seq.extra_keys else t for i, t in enumerate(seq.token_ids)]
