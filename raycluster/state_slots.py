"""Ledger of fixed per-sequence state slots (KDA recurrent state + short-conv windows).

Unlike KV blocks, a sequence's recurrent state has a fixed size, so each running sequence holds
exactly one slot for its whole life. Slots are 0..num_slots-1, all usable.

This module owns only the slot-id bookkeeping. It must never touch tensors (zeroing a reused
slot's state is the worker's job) or know which request owns a slot.
"""

from __future__ import annotations

import heapq


class NoFreeSlotsError(RuntimeError):
    """Raised by `StateSlotPool.allocate` when every slot is in use."""


class StateSlotPool:
    """Free/allocated ledger over slot ids 0..num_slots-1; `allocate` returns the lowest free id.

    Lowest-first keeps live slots packed near 0 and makes the order deterministic.
    """

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._free: list[int] = list(range(num_slots))  # ascending, hence already a heap
        self._allocated: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_allocated(self) -> int:
        return len(self._allocated)

    def can_allocate(self) -> bool:
        return bool(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise NoFreeSlotsError(f"all {self.num_slots} state slots are in use")
        slot = heapq.heappop(self._free)
        self._allocated.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"state slot {slot} out of range 0..{self.num_slots - 1}")
        if slot not in self._allocated:
            raise ValueError(f"state slot {slot} is not allocated (double free?)")
        self._allocated.remove(slot)
        heapq.heappush(self._free, slot)
