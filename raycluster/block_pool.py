"""Ledger of paged KV blocks: which block ids are free and which are handed out.

A block holds `block_size` consecutive tokens of one sequence for every DSA layer (latent rows
plus the indexer's pooled keys), so the block size must be a whole number of indexer pools.
Block id 0 is the null block: block tables are padded with it, so it is never handed out.

This module owns only the id bookkeeping. It must never touch tensors or know which request owns
a block (the scheduler keeps that); it does no prefix caching yet.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

NULL_BLOCK = 0


class NoFreeBlocksError(RuntimeError):
    """Raised by `BlockPool.allocate` when fewer blocks are free than asked for."""


class BlockPool:
    """Free/allocated ledger over block ids 1..num_blocks-1 (id 0 is the null block).

    Free ids form a FIFO queue, initially ascending: `allocate` takes from the front and `free`
    appends to the back, so a freed block is reused as late as possible (a later prefix cache can
    then still hit on its contents). Both operations are all-or-nothing.
    """

    def __init__(self, num_blocks: int, block_size: int, *, pool_tokens: int = 4) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        if pool_tokens < 1:
            raise ValueError(f"pool_tokens must be >= 1, got {pool_tokens}")
        if block_size < 1 or block_size % pool_tokens:
            raise ValueError(
                f"block_size must be a positive multiple of the {pool_tokens}-token indexer pool "
                f"(a pool must never straddle two blocks), got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(1, num_blocks))
        self._allocated: set[int] = set()

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_allocated(self) -> int:
        return len(self._allocated)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks currently handed out, in [0, 1]."""
        return self.num_allocated / self.num_usable

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens of one sequence."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        """Hand out `n` block ids from the front of the free queue; nothing if too few are free."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > self.num_free:
            raise NoFreeBlocksError(
                f"asked for {n} blocks but only {self.num_free} of {self.num_usable} are free")
        ids = [self._free.popleft() for _ in range(n)]
        self._allocated.update(ids)
        return ids

    def free(self, ids: Iterable[int]) -> None:
        """Return allocated blocks to the back of the free queue, in the order given.

        Every id is checked before any is freed, so a bad id (the null block, one out of range,
        one not currently allocated, or one repeated in `ids`) leaves the ledger unchanged.
        """
        ids = list(ids)
        seen: set[int] = set()
        for i in ids:
            if i == NULL_BLOCK:
                raise ValueError("cannot free the null block (id 0); it is never allocated")
            if not 0 < i < self.num_blocks:
                raise ValueError(f"block id {i} out of range 1..{self.num_blocks - 1}")
            if i not in self._allocated or i in seen:
                raise ValueError(f"block {i} is not allocated (double free?)")
            seen.add(i)
        self._allocated.difference_update(ids)
        self._free.extend(ids)
