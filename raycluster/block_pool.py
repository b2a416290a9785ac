"""Ledger of paged KV blocks: which block ids are free and which are handed out.

A block holds `block_size` consecutive tokens of one sequence for every DSA layer (latent rows
plus the indexer's pooled keys), so the block size must be a whole number of indexer pools.
Block id 0 is the null block: block tables are padded with it, so it is never handed out.

Prefix caching: a full block may carry the chained hash of its contents (prefix_cache.py
computes it); a block keeps its hash after its last holder frees it, so a later request with the
same prefix can take it back (`touch`) until `allocate` hands it out again (eviction). Blocks are
reference counted: a cached block may be held by several requests at once.

This module owns only the id bookkeeping. It must never touch tensors or know which request owns
a block (the scheduler keeps that).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

NULL_BLOCK = 0


class NoFreeBlocksError(RuntimeError):
    """Raised by `BlockPool.allocate` when fewer blocks are free than asked for."""


class BlockPool:
    """Free/allocated ledger over block ids 1..num_blocks-1 (id 0 is the null block).

    Free ids form a FIFO queue, initially ascending: `allocate` takes from the front and `free`
    appends to the back, so a freed block is reused as late as possible (the prefix cache can
    then still hit on its contents): the free queue is the LRU of cached blocks. Both operations
    are all-or-nothing. A block is free when no request holds it (reference count 0).
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
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self._refs: dict[int, int] = {}  # held blocks -> number of holders
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self.num_evictions = 0  # cached blocks handed out again (their contents lost)

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_allocated(self) -> int:
        return len(self._refs)

    @property
    def num_cached(self) -> int:
        """Blocks that carry a prefix hash (held or free)."""
        return len(self._block_of)

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
        ids = [self._free.popitem(last=False)[0] for _ in range(n)]
        for i in ids:
            self._refs[i] = 1
            if (h := self._hash_of.pop(i, None)) is not None:
                del self._block_of[h]
                self.num_evictions += 1
        return ids

    def free(self, ids: Iterable[int]) -> None:
        """Drop one holder of each block; a block nobody holds goes to the back of the free
        queue, in the order given (keeping its hash, if any, until it is handed out again).

        Every id is checked before any is freed, so a bad id (the null block, one out of range,
        one not currently held, or one repeated in `ids`) leaves the ledger unchanged.
        """
        ids = list(ids)
        seen: set[int] = set()
        for i in ids:
            if i == NULL_BLOCK:
                raise ValueError("cannot free the null block (id 0); it is never allocated")
            if not 0 < i < self.num_blocks:
                raise ValueError(f"block id {i} out of range 1..{self.num_blocks - 1}")
            if i not in self._refs or i in seen:
                raise ValueError(f"block {i} is not allocated (double free?)")
            seen.add(i)
        for i in ids:
            self._refs[i] -= 1
            if not self._refs[i]:
                del self._refs[i]
                self._free[i] = None

    # ----- prefix caching -----
    def lookup(self, block_hash: bytes) -> int | None:
        """The block holding the contents hashed `block_hash`, held or free (None: not cached)."""
        return self._block_of.get(block_hash)

    def cache(self, block_id: int, block_hash: bytes) -> bool:
        """Record that held block `block_id` is full and holds the contents `block_hash`.
        False (and nothing recorded) if another block already holds them or this block holds
        other contents."""
        if block_id not in self._refs:
            raise ValueError(f"block {block_id} is not allocated; only held blocks are cached")
        if self._block_of.get(block_hash, block_id) != block_id or self._hash_of.get(
                block_id, block_hash) != block_hash:
            return False
        self._hash_of[block_id] = block_hash
        self._block_of[block_hash] = block_id
        return True

    def num_free_in(self, ids: Iterable[int]) -> int:
        """How many of `ids` nobody holds (a `touch` of them takes that many free blocks)."""
        return sum(i not in self._refs for i in ids)

    def touch(self, ids: Iterable[int]) -> None:
        """Add one holder to each cached block in `ids` (taking free ones off the free queue)."""
        ids = list(ids)
        for i in ids:
            if i not in self._hash_of:
                raise ValueError(f"block {i} holds no cached contents")
        for i in ids:
            if i in self._refs:
                self._refs[i] += 1
            else:
                del self._free[i]
                self._refs[i] = 1
