"""PrefixCache: token content -> cached KV blocks, so repeated prefixes cost nothing. No torch.

A trie over blocks. Each node is one block of KV whose tokens are the node's
key, under the node holding the tokens before it:

    root
     └─ [S0..S15] block 4          (system prompt, first block)
         └─ [S16..S31] block 9
             ├─ [U0..U15] block 2  (conversation A)
             │   └─ [R0..R6] block 7   partial: a finished sequence's last block
             └─ [V0..V9] block 5   partial (conversation B)

Keys are the token tuples themselves, so a dict lookup is an exact content
comparison: a hit is never a hash collision. A lookup walks full blocks while
they match, then looks for the child sharing the longest common prefix with
the rest of the query (full or partial); that block is copied into a fresh one
(copy-on-write), so reuse is token-level, not rounded down to a block. At most
len(query) - 1 tokens match: the last prompt token is always computed, its
logits are needed.

Full nodes are inserted as soon as a sequence fills a block (so concurrent
requests share a long system prompt while it is still running); a sequence's
last, partial block is inserted when it releases its blocks (finish, abort or
preemption), when no one writes to it any more. Partial nodes are always
leaves and are only ever copied, never shared.

Eviction takes only unreferenced leaves, least recently used first, and only
when the pool needs a block (or they idle past the TTL). The three shapes of
the seed document fall out of the one walk; `stats` keeps them apart.

With a second tier (kv_tier.py) each full node also carries its chain digest,
the name the tier knows the block by, and `on_evict` is told of every full
node dropped for room or by the TTL, before its block is reused.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from shoal.engine.block_pool import KVBlockPool, hash_block_tokens
from shoal.engine.kv_tier import ROOT_DIGEST, chain_digest

Key = tuple  # a block's tokens, or (token, extra_hash) pairs where extra keys apply


@dataclass(eq=False)
class _Node:
    key: Key
    block_id: int
    parent: _Node | None
    children: dict[Key, _Node] = field(default_factory=dict)
    last_access: int = 0  # a logical clock: larger is more recent
    touched_at: float = 0.0  # wall clock, for the TTL
    digest: bytes = ROOT_DIGEST  # a full node's chain digest (kv_tier.chain_digest), with a second tier

    @property
    def num_tokens(self) -> int:
        return len(self.key)


@dataclass(frozen=True)
class PrefixMatch:
    """The result of a lookup; the scheduler takes it as it is."""

    blocks: tuple[int, ...]  # full blocks to share by reference
    copy_block: int | None  # a block to copy for the partial remainder
    num_tokens: int  # tokens covered: len(blocks) * block_size + partial tokens
    kind: str  # "miss" | "extension" | "supersequence" | "divergence"
    nodes: tuple[_Node, ...] = ()  # the matched full nodes, for the sequence's later inserts


@dataclass
class PrefixCacheStats:
    """Plain counters the server exports."""

    lookups: int = 0
    misses: int = 0
    hits_extension: int = 0  # the query extends a cached sequence (next turn of a chat)
    hits_supersequence: int = 0  # the query is a prefix of a cached sequence (retry, regenerate)
    hits_divergence: int = 0  # shared prefix, then different (same system prompt, other question)
    hit_tokens: int = 0  # prompt tokens served from the cache
    computed_prompt_tokens: int = 0  # prompt tokens that had to be computed
    cached_blocks: int = 0
    evictions: int = 0
    copies: int = 0  # partial blocks copied (copy-on-write)
    last_match_tokens: int = 0
    last_match_fraction: float = 0.0  # of the last request's prompt
    recorded_requests: int = 0  # requests whose prompt was accounted (record)
    match_fraction_sum: float = 0.0  # their matched fractions, summed: / recorded_requests is the average
    block_bytes: int = 0  # KV bytes one block holds
    pool_blocks: int = 0

    @property
    def cached_bytes(self) -> int:
        return self.cached_blocks * self.block_bytes

    @property
    def pool_bytes(self) -> int:
        return self.pool_blocks * self.block_bytes

    @property
    def hits(self) -> int:
        return self.hits_extension + self.hits_supersequence + self.hits_divergence

    @property
    def token_hit_rate(self) -> float:
        total = self.hit_tokens + self.computed_prompt_tokens
        return self.hit_tokens / total if total else 0.0


class PrefixCache:
    def __init__(
        self, pool: KVBlockPool, *, ttl: float | None = None, block_bytes: int = 0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.ttl = ttl
        self.clock = clock
        self.root = _Node(key=(), block_id=-1, parent=None)
        self._nodes: dict[int, _Node] = {}  # block id -> node
        self._tick = itertools.count(1)
        # (last_access, block id) of nodes that were evictable when pushed; checked when popped.
        self._lru: list[tuple[int, int]] = []
        self.stats = PrefixCacheStats(block_bytes=block_bytes, pool_blocks=pool.num_blocks)
        # With a second tier: full nodes get their chain digests, and dropped ones are handed over.
        self.on_evict: Callable[[_Node], None] | None = None
        pool.evict_one = self._evict_one
        pool.on_unreferenced = self._maybe_evictable

    # ------------------------------------------------------------ lookup
    def match(self, key_tokens: Sequence, count: bool = True) -> PrefixMatch:
        """Longest common prefix of `key_tokens` with anything cached (at most len - 1 tokens).

        Touches the matched nodes (LRU) but takes no references: the caller increfs
        `blocks` (and copies `copy_block`) before anything else can evict them.
        count: False for a sequence matched again while it waits (the pool could not take it yet, or the second
        tier is reading its blocks): a wait counts once in the stats.
        """
        bs = self.block_size
        limit = len(key_tokens) - 1
        node, nodes = self.root, []
        while (len(nodes) + 1) * bs <= limit:
            start = len(nodes) * bs
            child = node.children.get(tuple(key_tokens[start : start + bs]))
            if child is None:
                break
            nodes.append(child)
            node = child
        start = len(nodes) * bs
        rest = key_tokens[start : min(limit, start + bs)]
        copy_node, copy_len = None, 0
        for child in node.children.values():
            n = _common_prefix_len(child.key, rest)
            if n > copy_len:
                copy_node, copy_len = child, n
        num = start + copy_len
        kind = self._kind(node, nodes, copy_node, copy_len, key_tokens, num)
        self._touch(copy_node or node)
        if count:
            self.stats.lookups += 1
            if kind == "miss":
                self.stats.misses += 1
            else:
                setattr(self.stats, f"hits_{kind}", getattr(self.stats, f"hits_{kind}") + 1)
        return PrefixMatch(
            blocks=tuple(n.block_id for n in nodes),
            copy_block=copy_node.block_id if copy_node else None,
            num_tokens=num,
            kind=kind,
            nodes=tuple(nodes),
        )

    def _kind(self, node, nodes, copy_node, copy_len, key_tokens, num) -> str:
        if num == 0:
            return "miss"
        end = copy_node if copy_node is not None else node
        end_len = copy_len if copy_node is not None else self.block_size
        # The query's last token (never matched, it is always computed) still
        # follows the cached content: the query is a prefix of what is cached.
        nxt = key_tokens[num] if num < len(key_tokens) else None
        follows = (end_len < end.num_tokens and end.key[end_len] == nxt) or (
            end_len == end.num_tokens and any(c.key and c.key[0] == nxt for c in end.children.values())
        )
        if follows:
            return "supersequence"
        if end_len == end.num_tokens and not end.children:
            return "extension"  # everything down this branch is a prefix of the query
        return "divergence"

    def record(self, prompt_len: int, matched: int) -> None:
        """Account a request's prompt: how much came from the cache."""
        self.stats.hit_tokens += matched
        self.stats.computed_prompt_tokens += prompt_len - matched
        self.stats.last_match_tokens = matched
        self.stats.last_match_fraction = matched / prompt_len if prompt_len else 0.0
        self.stats.recorded_requests += 1
        self.stats.match_fraction_sum += self.stats.last_match_fraction

    # ------------------------------------------------------------ insert
    def insert_full(self, parent: _Node | None, key: Key, block_id: int) -> _Node:
        """Index a just-filled block under `parent` (None: the root). Returns the node
        now holding this content: an existing one when it was cached already (the
        caller's block then stays uncached and is freed normally)."""
        parent = parent or self.root
        node = parent.children.get(key)
        if node is None:
            node = self._add(parent, key, block_id)
        self._touch(node)
        return node

    def insert_partial(self, parent: _Node | None, key: Key, block_id: int) -> None:
        """Index a released sequence's last, partial block (copied on a hit, never shared)."""
        parent = parent or self.root
        if not key or key in parent.children or self.pool.cached[block_id]:
            return
        self._touch(self._add(parent, key, block_id))

    def _add(self, parent: _Node, key: Key, block_id: int) -> _Node:
        node = _Node(key=key, block_id=block_id, parent=parent)
        parent.children[key] = node
        self._nodes[block_id] = node
        self.pool.mark_cached(block_id)
        parent_hash = self.pool.block_hashes[parent.block_id] if parent is not self.root else None
        self.pool.set_block_hash(block_id, hash_block_tokens(parent_hash, key))
        if self.on_evict is not None and len(key) == self.block_size:
            node.digest = chain_digest(parent.digest, key)
        self.stats.cached_blocks += 1
        return node

    def _touch(self, node: _Node) -> None:
        """Mark a node and its ancestors used, ancestors later: a parent is never
        older than its children, so LRU among leaves never strands a child."""
        now = self.clock()
        while node is not None and node is not self.root:
            node.last_access = next(self._tick)
            node.touched_at = now
            self._maybe_evictable(node.block_id)
            node = node.parent

    # ------------------------------------------------------------ eviction
    # Evictable: an unreferenced leaf. Every time a node becomes one, or is touched
    # while it is one, (last_access, block) goes on a heap; an entry is acted on
    # only if it is still true when it comes off (the node is there, evictable and
    # untouched since). So an eviction costs O(log n), not a scan of every node.
    # last_access and touched_at grow together, so the heap is also oldest-first
    # for the TTL.

    def _evictable(self, node: _Node | None) -> bool:
        return node is not None and not node.children and self.pool.ref_counts[node.block_id] == 0

    def _maybe_evictable(self, block_id: int) -> None:
        node = self._nodes.get(block_id)
        if self._evictable(node):
            heapq.heappush(self._lru, (node.last_access, block_id))
            if len(self._lru) > 2 * len(self._nodes) + 64:  # stale entries dominate: rebuild
                self._lru = [(n.last_access, b) for b, n in self._nodes.items() if self._evictable(n)]
                heapq.heapify(self._lru)

    def _oldest_evictable(self) -> _Node | None:
        """The least recently used evictable node (stale heap entries dropped on the way), or None."""
        while self._lru:
            access, block_id = self._lru[0]
            node = self._nodes.get(block_id)
            if self._evictable(node) and node.last_access == access:
                return node
            heapq.heappop(self._lru)
        return None

    def _evict_one(self) -> int:
        """Called by the pool when it needs a block: drop the LRU unreferenced leaf."""
        node = self._oldest_evictable()
        if node is None:
            raise RuntimeError("the pool asked for an eviction but no cached block is unreferenced")
        self._remove(node)
        self.stats.evictions += 1
        if self.on_evict is not None:
            self.on_evict(node)
        return node.block_id

    def _remove(self, node: _Node) -> None:
        del node.parent.children[node.key]
        del self._nodes[node.block_id]
        self.stats.cached_blocks -= 1
        if node.parent is not self.root:
            self._maybe_evictable(node.parent.block_id)  # it may be a leaf now

    def expire(self) -> int:
        """Drop unreferenced leaves idle for longer than the TTL (their parents
        follow once they are leaves and old too). Returns how many blocks were freed."""
        if self.ttl is None:
            return 0
        cutoff = self.clock() - self.ttl
        freed = 0
        while (node := self._oldest_evictable()) is not None and node.touched_at < cutoff:
            self._remove(node)
            if self.on_evict is not None:
                self.on_evict(node)
            self.pool.uncache(node.block_id)
            freed += 1
        return freed

    def clear(self) -> int:
        """Forget everything (e.g. the model changed). Referenced blocks stay with
        their sequences but are no longer indexed. Returns blocks dropped."""
        n = len(self._nodes)
        for node in list(self._nodes.values()):
            self.pool.uncache(node.block_id)
        self._nodes.clear()
        self._lru.clear()
        self.root.children.clear()
        self.stats.cached_blocks = 0
        return n

    def check_integrity(self) -> None:
        """Raise AssertionError unless the trie and the pool agree on what is cached."""
        indexed = set(self._nodes)
        flagged = {b for b, c in enumerate(self.pool.cached) if c}
        if indexed != flagged:
            raise AssertionError(f"cache nodes {sorted(indexed)} != blocks flagged cached {sorted(flagged)}")
        for b, node in self._nodes.items():
            if node.parent.children.get(node.key) is not node:
                raise AssertionError(f"block {b}'s node is not reachable from its parent")

    def node_of(self, block_id: int) -> _Node | None:
        return self._nodes.get(block_id)

    def full_nodes(self) -> list[_Node]:
        """Every full node, most recently used first, a parent before its children among equals."""
        nodes = [n for n in self._nodes.values() if n.num_tokens == self.block_size]
        nodes.sort(key=lambda n: -n.last_access)
        return nodes


def _common_prefix_len(a: Sequence, b: Sequence) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
