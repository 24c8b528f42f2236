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
the name the tier knows the block by, and `on_evict` is told of every block of
every group dropped for room or by the TTL, before it is reused.

KV groups (types.KVGroup: the layers of one sliding window, or the full-attention
layers) each have their own pool, and a node holds one block per group, or None
where that group has dropped it. A windowed group's sequences let go of the
blocks that slid out of their window, so its cached blocks are evicted one by
one, leaf or not, in the order they lost their last reference (what slid out
goes before a prefix's last window), while a full-attention group's go leaves
first, least recently used, as with one group. A node that holds no block and has no children is removed.
A hit must suit every group: a full-attention group needs all of the matched
prefix's blocks, a windowed group only those that hold the last `window - 1`
positions before the first computed one (vLLM's SlidingWindowManager). The match
is the longest prefix every group can serve:

    positions:   0 ........................ L-w+1 ........ L | computed from here
    full group:  [ b0 | b1 | b2 | b3 | b4 | b5 | b6 | b7 ]     every block
    window w:    [ -  | -  | -  | -  | -  | b5 | b6 | b7 ]     the blocks holding L-w+1 .. L-1
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

from shoal.engine.block_pool import KVBlockPool, hash_block_tokens
from shoal.engine.kv_tier import ROOT_DIGEST, chain_digest

Key = tuple  # a block's tokens, or (token, extra_hash) pairs where extra keys apply


@dataclass(eq=False)
class _Node:
    key: Key
    blocks: list  # the block of each KV group (None: that group holds none for these tokens)
    parent: _Node | None
    children: dict[Key, _Node] = field(default_factory=dict)
    last_access: int = 0  # a logical clock: larger is more recent
    touched_at: float = 0.0  # wall clock, for the TTL
    freed: list = field(default_factory=list)  # per windowed group: the clock when its block lost its last reference
    digest: bytes = ROOT_DIGEST  # a full node's chain digest (kv_tier.chain_digest), with a second tier

    @property
    def num_tokens(self) -> int:
        return len(self.key)

    @property
    def block_id(self) -> int | None:
        """The first group's block (the only one with one group)."""
        return self.blocks[0]


@dataclass(frozen=True)
class PrefixMatch:
    """The result of a lookup; the scheduler takes it as it is."""

    blocks: tuple[int | None, ...]  # full blocks to share by reference (None: out of a windowed group's window)
    copy_block: int | None  # a block to copy for the partial remainder
    num_tokens: int  # tokens covered: len(blocks) * block_size + partial tokens
    kind: str  # "miss" | "extension" | "supersequence" | "divergence"
    nodes: tuple[_Node, ...] = ()  # the matched full nodes, for the sequence's later inserts
    # the other KV groups' full blocks and copy blocks, in group order (empty with one group)
    group_blocks: tuple[tuple[int | None, ...], ...] = ()
    group_copies: tuple[int | None, ...] = ()

    @property
    def tables(self) -> tuple[tuple[int | None, ...], ...]:
        return (self.blocks, *self.group_blocks)

    @property
    def copies(self) -> tuple[int | None, ...]:
        return (self.copy_block, *self.group_copies)


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
        self, pool: KVBlockPool | Sequence[KVBlockPool], *, windows: Sequence[int | None] | None = None,
        ttl: float | None = None, block_bytes: int = 0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        """pool: the pool of each KV group (one pool: one group); windows: each group's window (None: full)."""
        self.pools = [pool] if isinstance(pool, KVBlockPool) else list(pool)
        self.pool = self.pools[0]
        self.windows = tuple(windows) if windows is not None else (None,) * len(self.pools)
        self._full_groups = [g for g, w in enumerate(self.windows) if w is None]
        self.block_size = self.pool.block_size
        self.ttl = ttl
        self.clock = clock
        groups = range(len(self.pools))
        self.root = _Node(key=(), blocks=[-1] * len(self.pools), parent=None)
        self._nodes: list[dict[int, _Node]] = [{} for _ in groups]  # per group: block id -> node
        self._tick = itertools.count(1)
        # per group: (last_access, block id) of nodes that were evictable when pushed; checked when popped.
        self._lru: list[list[tuple[int, int]]] = [[] for _ in groups]
        self.stats = PrefixCacheStats(block_bytes=block_bytes, pool_blocks=self.pool.num_blocks)
        # With a second tier: full nodes get their chain digests, and dropped ones are handed over.
        self.on_evict: Callable[[_Node, int], None] | None = None  # (the node, the KV group whose block goes)
        for g, p in enumerate(self.pools):
            p.evict_one = partial(self._evict_one, g)
            p.on_unreferenced = partial(self._unreferenced, g)

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
        if len(self.pools) > 1 or self.windows[0] is not None:
            nodes, copy_node, copy_len = self._servable(nodes, copy_node, copy_len)
            node = nodes[-1] if nodes else self.root
        num = len(nodes) * bs + copy_len
        kind = self._kind(node, nodes, copy_node, copy_len, key_tokens, num)
        self._touch(copy_node or node)
        if count:
            self.stats.lookups += 1
            if kind == "miss":
                self.stats.misses += 1
            else:
                setattr(self.stats, f"hits_{kind}", getattr(self.stats, f"hits_{kind}") + 1)
        tables = [tuple(self._wanted(g, n.blocks[g], i, num) for i, n in enumerate(nodes)) for g in range(len(self.pools))]
        copies = [copy_node.blocks[g] if copy_node else None for g in range(len(self.pools))]
        return PrefixMatch(
            blocks=tables[0],
            copy_block=copies[0],
            num_tokens=num,
            kind=kind,
            nodes=tuple(nodes),
            group_blocks=tuple(tables[1:]),
            group_copies=tuple(copies[1:]),
        )

    def first_needed(self, group: int, start: int) -> int:
        """The first block of group `group` a step computing from position `start` reads: a window of w keys
        shows the query at `start` positions start - w + 1 .. start; a full-attention group reads them all."""
        w = self.windows[group]
        return 0 if w is None else max(0, start - w + 1) // self.block_size

    def _wanted(self, group: int, block: int | None, index: int, num: int) -> int | None:
        return block if index >= self.first_needed(group, num) else None

    def _servable(self, nodes: list[_Node], copy_node: _Node | None, copy_len: int) -> tuple[list[_Node], _Node | None, int]:
        """The longest of the walked prefixes (the partial copy's, then whole blocks, longest first) whose blocks
        every group holds: its first `first_needed` .. the last, and the partial copy's where there is one."""
        bs = self.block_size
        # missing[g][i]: how many of nodes[:i] lack group g's block
        missing = []
        for g in range(len(self.pools)):
            run = [0]
            for n in nodes:
                run.append(run[-1] + (n.blocks[g] is None))
            missing.append(run)

        def serves(num_full: int, copy: _Node | None, part: int) -> bool:
            for g, run in enumerate(missing):
                first = min(self.first_needed(g, num_full * bs + part), num_full)
                if run[num_full] - run[first] or (copy is not None and copy.blocks[g] is None):
                    return False
            return True

        if copy_node is not None and serves(len(nodes), copy_node, copy_len):
            return nodes, copy_node, copy_len
        for k in range(len(nodes), 0, -1):
            if serves(k, None, 0):
                return nodes[:k], None, 0
        return [], None, 0

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
    def insert_full(self, parent: _Node | None, key: Key, block_id) -> _Node:
        """Index a just-filled block under `parent` (None: the root): block_id, or with several KV groups each
        group's block (None where the sequence holds none). Returns the node now holding this content: where a
        group's block was cached already, the node keeps that one (the caller's block then stays uncached and is
        freed normally)."""
        parent = parent or self.root
        blocks = self._per_group(block_id)
        node = parent.children.get(key)
        if node is None:
            node = self._add(parent, key, blocks)
        else:
            for g, b in enumerate(blocks):
                if node.blocks[g] is None and b is not None:
                    self._adopt(node, g, b)
        self._touch(node)
        return node

    def insert_partial(self, parent: _Node | None, key: Key, block_id) -> None:
        """Index a released sequence's last, partial block (copied on a hit, never shared): block_id, or each
        group's with several."""
        parent = parent or self.root
        blocks = self._per_group(block_id)
        if not key or key in parent.children or any(b is not None and self.pools[g].cached[b] for g, b in enumerate(blocks)):
            return
        self._touch(self._add(parent, key, blocks))

    def _per_group(self, block_id) -> list:
        return [block_id] if isinstance(block_id, int) else list(block_id)

    def _add(self, parent: _Node, key: Key, blocks: list) -> _Node:
        node = _Node(key=key, blocks=[None] * len(self.pools), parent=parent, freed=[0] * len(self.pools))
        parent.children[key] = node
        for g, b in enumerate(blocks):
            if b is not None:
                self._adopt(node, g, b)
        if self.on_evict is not None and len(key) == self.block_size:
            node.digest = chain_digest(parent.digest, key)
        return node

    def _adopt(self, node: _Node, group: int, block_id: int) -> None:
        """`node` holds group `group`'s block `block_id` from now on."""
        node.blocks[group] = block_id
        self._nodes[group][block_id] = node
        pool = self.pools[group]
        pool.mark_cached(block_id)
        if group == 0:
            parent = node.parent
            parent_hash = pool.block_hashes[parent.block_id] if parent is not self.root and parent.block_id is not None else None
            pool.set_block_hash(block_id, hash_block_tokens(parent_hash, node.key))
            self.stats.cached_blocks += 1

    def _touch(self, node: _Node) -> None:
        """Mark a node and its ancestors used, ancestors later: a parent is never
        older than its children, so LRU among leaves never strands a child."""
        now = self.clock()
        full = self._full_groups  # a windowed group's eviction key is not the touch's
        while node is not None and node is not self.root:
            node.last_access = next(self._tick)
            node.touched_at = now
            for g in full:
                if node.blocks[g] is not None:
                    self._maybe_evictable(g, node.blocks[g])
            node = node.parent

    # ------------------------------------------------------------ eviction
    # Evictable in a group: an unreferenced block, of a leaf where the group has full attention (a leaf: no child
    # holds a block of the group). Every time a node becomes one, or is touched while it is one, (its key, block)
    # goes on the group's heap; an entry is acted on only if it is still true when it comes off (the node is there,
    # evictable and its key unchanged). So an eviction costs O(log n), not a scan of every node.
    # A full-attention group's key is last_access, which grows with touched_at, so the heap is also oldest-first
    # for the TTL. A windowed group's is when the block lost its last reference: the blocks a sequence let go as
    # its window slid go before those of its last window, which a hit on the same prefix needs (a touch of a
    # prefix's nodes, which makes every ancestor recent, would keep the early ones and evict the late ones).

    def _key(self, group: int, node: _Node) -> int:
        return node.last_access if self.windows[group] is None else node.freed[group]

    def _unreferenced(self, group: int, block_id: int) -> None:
        """A cached block lost its last reference (the pool says so)."""
        node = self._nodes[group].get(block_id)
        if node is not None and self.windows[group] is not None:
            node.freed[group] = next(self._tick)
        self._maybe_evictable(group, block_id)

    def _evictable(self, group: int, node: _Node | None) -> bool:
        if node is None or self.pools[group].ref_counts[node.blocks[group]] != 0:
            return False
        if not node.children or self.windows[group] is not None:
            return True
        return all(c.blocks[group] is None for c in node.children.values())

    def _maybe_evictable(self, group: int, block_id: int) -> None:
        node = self._nodes[group].get(block_id)
        if self._evictable(group, node):
            lru = self._lru[group]
            heapq.heappush(lru, (self._key(group, node), block_id))
            if len(lru) > 2 * len(self._nodes[group]) + 64:  # stale entries dominate: rebuild
                lru[:] = [(self._key(group, n), b) for b, n in self._nodes[group].items() if self._evictable(group, n)]
                heapq.heapify(lru)

    def _oldest_evictable(self, group: int) -> _Node | None:
        """The least recently used evictable node of a group (stale heap entries dropped on the way), or None."""
        lru = self._lru[group]
        while lru:
            access, block_id = lru[0]
            node = self._nodes[group].get(block_id)
            if self._evictable(group, node) and self._key(group, node) == access:
                return node
            heapq.heappop(lru)
        return None

    def _evict_one(self, group: int) -> int:
        """Called by a group's pool when it needs a block: drop the group's LRU evictable block."""
        node = self._oldest_evictable(group)
        if node is None:
            raise RuntimeError("the pool asked for an eviction but no cached block is unreferenced")
        block_id = node.blocks[group]
        if self.on_evict is not None:
            self.on_evict(node, group)
        self._drop(node, group)
        self.stats.evictions += 1
        return block_id

    def _drop(self, node: _Node, group: int) -> None:
        """The node lets go of its block of `group`; a node left with no block and no child goes."""
        del self._nodes[group][node.blocks[group]]
        node.blocks[group] = None
        if group == 0:
            self.stats.cached_blocks -= 1
        removed = False
        while node is not self.root and not node.children and all(b is None for b in node.blocks):
            del node.parent.children[node.key]
            node, removed = node.parent, True
        if node is self.root:
            return
        if removed:  # the parent of what went may be a leaf now, in every group
            for g, b in enumerate(node.blocks):
                if b is not None:
                    self._maybe_evictable(g, b)
        elif node.parent is not self.root and node.parent.blocks[group] is not None:
            self._maybe_evictable(group, node.parent.blocks[group])  # a leaf of the group now, its child kept the others

    def expire(self) -> int:
        """Drop unreferenced blocks idle for longer than the TTL (a full-attention group's parents
        follow once they are leaves and old too). Returns how many blocks were freed."""
        if self.ttl is None:
            return 0
        cutoff = self.clock() - self.ttl
        freed = 0
        for g, pool in enumerate(self.pools):
            while (node := self._oldest_evictable(g)) is not None and node.touched_at < cutoff:
                block_id = node.blocks[g]
                if self.on_evict is not None:
                    self.on_evict(node, g)
                self._drop(node, g)
                pool.uncache(block_id)
                freed += 1
        return freed

    def clear(self) -> int:
        """Forget everything (e.g. the model changed). Referenced blocks stay with
        their sequences but are no longer indexed. Returns blocks dropped."""
        n = 0
        for g, pool in enumerate(self.pools):
            for block_id in self._nodes[g]:
                pool.uncache(block_id)
            n += len(self._nodes[g])
            self._nodes[g].clear()
            self._lru[g].clear()
        self.root.children.clear()
        self.stats.cached_blocks = 0
        return n

    def check_integrity(self) -> None:
        """Raise AssertionError unless the trie and the pools agree on what is cached."""
        for g, pool in enumerate(self.pools):
            indexed = set(self._nodes[g])
            flagged = {b for b, c in enumerate(pool.cached) if c}
            if indexed != flagged:
                raise AssertionError(f"group {g}: cache nodes {sorted(indexed)} != blocks flagged cached {sorted(flagged)}")
            for b, node in self._nodes[g].items():
                if node.blocks[g] != b:
                    raise AssertionError(f"group {g}: block {b}'s node holds {node.blocks[g]}")
                if node.parent.children.get(node.key) is not node:
                    raise AssertionError(f"group {g}: block {b}'s node is not reachable from its parent")

    def node_of(self, block_id: int, group: int = 0) -> _Node | None:
        return self._nodes[group].get(block_id)

    def full_nodes(self, group: int = 0) -> list[_Node]:
        """Every full node holding a block of `group`, most recently used first, a parent before its children among equals."""
        nodes = [n for n in self._nodes[group].values() if n.num_tokens == self.block_size]
        nodes.sort(key=lambda n: -n.last_access)
        return nodes


def _common_prefix_len(a: Sequence, b: Sequence) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
