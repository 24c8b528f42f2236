"""KVBlockPool: which KV-cache blocks are free, who references them. No torch.

The KV tensors themselves live in the model runner as
`[num_blocks, block_size, num_kv_heads, head_dim]` per layer; this pool only
hands out block ids. A block is referenced by every sequence whose block table
holds it (siblings of an n > 1 request share their prompt's full blocks), and
returns to the free queue when its last reference goes.

The free queue is a dict used as an ordered set: allocation pops the oldest
free block in O(1).

With a prefix cache, a block whose last reference goes but whose content is
cached does not join the free queue: it stays "cached-free", still counted as
available, and is revived by a cache hit (`incref`) or handed back by the
cache's evictor when `allocate` runs out of truly free blocks:

    referenced (ref > 0) --free--> cached-free (ref 0, in the cache) --evict--> free queue
             ^                              |                                      |
             +------------ incref (hit) ----+             allocate <---------------+
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence


class NoFreeBlocksError(RuntimeError):
    pass


def hash_block_tokens(parent_hash: int | None, tokens: Sequence[int]) -> int:
    """Content hash of a full block, chained on its parent's hash.

    Equal hashes mean "probably the same prefix"; the prefix cache checks the
    stored tokens before trusting a hit.
    """
    return hash((parent_hash, tuple(tokens)))


class KVBlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        # Content hash of each full block (None while partial or unknown).
        self.block_hashes: list[int | None] = [None] * num_blocks
        self._free: dict[int, None] = dict.fromkeys(range(num_blocks))
        self.cached = [False] * num_blocks  # set by the prefix cache while it indexes the block
        self._num_cached_free = 0
        # The prefix cache's evictor: uncache one unreferenced block, return its id.
        self.evict_one: Callable[[], int] | None = None
        # Told when a cached block loses its last reference (it may be evicted from now on).
        self.on_unreferenced: Callable[[int], None] | None = None

    # ------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        """Blocks an allocation can get: truly free plus unreferenced cached ones."""
        return len(self._free) + self._num_cached_free

    @property
    def num_cached_free(self) -> int:
        return self._num_cached_free

    @property
    def num_used(self) -> int:
        """Blocks referenced by some sequence."""
        return self.num_blocks - self.num_free

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    @property
    def null_block(self) -> int:
        """What a windowed KV group's table holds where its block slid out of the window: the id past the pool's
        blocks, the runner's null block (read as zeros, never written, never handed out)."""
        return self.num_blocks

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------ changes
    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks (oldest freed first), each with one reference."""
        if n > self.num_free:
            raise NoFreeBlocksError(f"asked for {n} blocks, {self.num_free} free")
        out = []
        for _ in range(n):
            if not self._free:
                self._uncache(self.evict_one())
            block = next(iter(self._free))
            del self._free[block]
            self.ref_counts[block] = 1
            self.block_hashes[block] = None
            out.append(block)
        return out

    def incref(self, block_ids: Iterable[int]) -> None:
        """Share blocks that are already referenced (forking a sequence)."""
        for b in block_ids:
            if self.ref_counts[b] <= 0:
                if not self.cached[b]:
                    raise ValueError(f"block {b} is free; only referenced or cached blocks can be shared")
                self._num_cached_free -= 1  # a cache hit revives it
            self.ref_counts[b] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block; blocks with none left become free.

        Blocks are released in reverse so that the tail of a sequence (the
        least likely to be shared) is reused first.
        """
        for b in reversed(list(block_ids)):
            if self.ref_counts[b] <= 0:
                raise ValueError(f"double free of block {b}")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                if self.cached[b]:
                    self._num_cached_free += 1
                    if self.on_unreferenced is not None:
                        self.on_unreferenced(b)
                else:
                    self._free[b] = None

    def mark_cached(self, block_id: int) -> None:
        """The prefix cache indexes this (referenced) block from now on."""
        if self.ref_counts[block_id] <= 0 or self.cached[block_id]:
            raise ValueError(f"block {block_id} cannot be cached (ref {self.ref_counts[block_id]}, cached {self.cached[block_id]})")
        self.cached[block_id] = True

    def _uncache(self, block_id: int) -> None:
        """The cache dropped an unreferenced block: it joins the free queue."""
        if not self.cached[block_id] or self.ref_counts[block_id] != 0:
            raise ValueError(f"evictor returned block {block_id}, which is not cached and unreferenced")
        self.cached[block_id] = False
        self._num_cached_free -= 1
        self._free[block_id] = None

    def uncache(self, block_id: int) -> None:
        """The cache forgets a block; an unreferenced one becomes free."""
        if self.ref_counts[block_id] == 0:
            self._uncache(block_id)
        else:
            self.cached[block_id] = False

    def set_block_hash(self, block_id: int, block_hash: int) -> None:
        self.block_hashes[block_id] = block_hash

    # ------------------------------------------------------------ checks
    def check_integrity(self, block_tables: Iterable[Sequence[int]]) -> None:
        """Raise AssertionError unless the ref counts equal the references held.

        `block_tables` are the tables of every sequence that holds blocks (null entries skipped).
        """
        expected = [0] * self.num_blocks
        for table in block_tables:
            table = [b for b in table if b != self.num_blocks]
            if len(set(table)) != len(table):
                raise AssertionError(f"block table holds a block twice: {list(table)}")
            for b in table:
                expected[b] += 1
        if expected != self.ref_counts:
            diff = {b: (self.ref_counts[b], e) for b, e in enumerate(expected) if e != self.ref_counts[b]}
            raise AssertionError(f"ref counts differ from references held (block: (count, held)): {diff}")
        free = set(self._free)
        zero = {b for b, r in enumerate(self.ref_counts) if r == 0 and not self.cached[b]}
        if free != zero:
            raise AssertionError(f"free queue {sorted(free)} != unreferenced uncached blocks {sorted(zero)}")
        cached_free = sum(1 for b, r in enumerate(self.ref_counts) if r == 0 and self.cached[b])
        if cached_free != self._num_cached_free:
            raise AssertionError(f"{cached_free} cached unreferenced blocks, counter says {self._num_cached_free}")
