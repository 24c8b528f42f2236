"""KVBlockPool: which KV-cache blocks are free, who references them. No torch.

The KV tensors themselves live in the model runner as
`[num_blocks, block_size, num_kv_heads, head_dim]` per layer; this pool only
hands out block ids. A block is referenced by every sequence whose block table
holds it (siblings of an n > 1 request share their prompt's full blocks), and
returns to the free queue when its last reference goes.

The free queue is a dict used as an ordered set: allocation pops the oldest
free block, and a specific block can be taken out of the middle in O(1)
(the prefix cache needs that to revive a cached block).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


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

    # ------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------ changes
    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks (oldest freed first), each with one reference."""
        if n > len(self._free):
            raise NoFreeBlocksError(f"asked for {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
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
                raise ValueError(f"block {b} is free; only referenced blocks can be shared")
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
                self._free[b] = None

    def set_block_hash(self, block_id: int, block_hash: int) -> None:
        self.block_hashes[block_id] = block_hash

    # ------------------------------------------------------------ checks
    def check_integrity(self, block_tables: Iterable[Sequence[int]]) -> None:
        """Raise AssertionError unless the ref counts equal the references held.

        `block_tables` are the tables of every sequence that holds blocks.
        """
        expected = [0] * self.num_blocks
        for table in block_tables:
            if len(set(table)) != len(table):
                raise AssertionError(f"block table holds a block twice: {list(table)}")
            for b in table:
                expected[b] += 1
        if expected != self.ref_counts:
            diff = {b: (self.ref_counts[b], e) for b, e in enumerate(expected) if e != self.ref_counts[b]}
            raise AssertionError(f"ref counts differ from references held (block: (count, held)): {diff}")
        free = set(self._free)
        zero = {b for b, r in enumerate(self.ref_counts) if r == 0}
        if free != zero:
            raise AssertionError(f"free queue {sorted(free)} != unreferenced blocks {sorted(zero)}")
