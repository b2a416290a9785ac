"""Ledger of KDA state checkpoints: spare state slots that hold a sequence's recurrent state and
conv windows at a block boundary, keyed by the chained hash of the blocks before it.

A hybrid model can only resume a cached prefix where it also has the KDA state, so the prefix
cache keeps these next to the cached blocks, with their own LRU and their own budget (a fixed
number of checkpoints, each costing one state slot on every rank). A checkpoint is held while a
copy into or out of it is pending; only checkpoints nobody holds are evicted, least recently
used first.

This module owns only the checkpoint-index bookkeeping (0..num_checkpoints-1); which state slot a
checkpoint lives in is the cache plan's, and copying is the worker's.
"""

from __future__ import annotations

from collections import OrderedDict


class CheckpointPool:
    def __init__(self, num_checkpoints: int) -> None:
        if num_checkpoints < 0:
            raise ValueError(f"num_checkpoints must be >= 0, got {num_checkpoints}")
        self.num_checkpoints = num_checkpoints
        # not held, least recently used first: unused ones and evictable ones
        self._lru: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_checkpoints))
        self._refs: dict[int, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._index_of: dict[bytes, int] = {}
        self.num_evictions = 0  # checkpoints overwritten by a newer one

    @property
    def num_cached(self) -> int:
        return len(self._index_of)

    @property
    def num_held(self) -> int:
        return len(self._refs)

    def lookup(self, block_hash: bytes) -> int | None:
        return self._index_of.get(block_hash)

    def hash_of(self, index: int) -> bytes | None:
        return self._hash_of.get(index)

    def hold(self, index: int) -> None:
        if index not in self._hash_of:
            raise ValueError(f"checkpoint {index} holds nothing")
        if index in self._refs:
            self._refs[index] += 1
        else:
            del self._lru[index]
            self._refs[index] = 1

    def release(self, index: int) -> None:
        if index not in self._refs:
            raise ValueError(f"checkpoint {index} is not held (double release?)")
        self._refs[index] -= 1
        if not self._refs[index]:
            del self._refs[index]
            self._lru[index] = None  # most recently used

    def save(self, block_hash: bytes) -> int | None:
        """Take a checkpoint for the state after the blocks hashed `block_hash`, held by the
        caller until its copy is done. None if one exists already (it becomes the most recently
        used) or every checkpoint is held."""
        if (index := self._index_of.get(block_hash)) is not None:
            if index in self._lru:
                self._lru.move_to_end(index)
            return None
        if not self._lru:
            return None
        index, _ = self._lru.popitem(last=False)
        if (old := self._hash_of.pop(index, None)) is not None:
            del self._index_of[old]
            self.num_evictions += 1
        self._hash_of[index] = block_hash
        self._index_of[block_hash] = index
        self._refs[index] = 1
        return index

    def drop(self, index: int) -> None:
        """Forget a checkpoint nobody holds (superseded), making it the first to be reused."""
        if index in self._refs:
            return  # a copy still reads it; it ages out through the LRU instead
        if (old := self._hash_of.pop(index, None)) is not None:
            del self._index_of[old]
            self._lru.move_to_end(index, last=False)
