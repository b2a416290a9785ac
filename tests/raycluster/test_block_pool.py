"""BlockPool: exact ids for allocation/free/reuse, error cases, and no leaks under random
admission traffic (both ledgers together, as the scheduler's admission uses them)."""

from __future__ import annotations

import random
from collections import deque

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from glm53.raycluster.block_pool import NULL_BLOCK, BlockPool, NoFreeBlocksError
from glm53.raycluster.state_slots import StateSlotPool


def test_initial_ids_ascending_and_null_block_excluded():
    pool = BlockPool(num_blocks=6, block_size=16)
    assert (pool.num_usable, pool.num_free, pool.num_allocated, pool.usage) == (5, 5, 0, 0.0)
    assert pool.allocate(2) == [1, 2]
    assert pool.allocate(3) == [3, 4, 5]
    assert (pool.num_free, pool.num_allocated, pool.usage) == (0, 5, 1.0)


def test_freed_blocks_are_reused_last_in_free_order():
    pool = BlockPool(num_blocks=8, block_size=4)
    assert pool.allocate(4) == [1, 2, 3, 4]
    pool.free([3, 1])
    # 5..7 were never used, so they come first; then 3 and 1 in the order they were freed.
    assert pool.allocate(4) == [5, 6, 7, 3]
    pool.free([2])
    assert pool.allocate(2) == [1, 2]
    assert pool.num_free == 0


def test_allocate_zero_and_usage():
    pool = BlockPool(num_blocks=5, block_size=8)
    assert pool.allocate(0) == []
    pool.allocate(1)
    assert pool.usage == 0.25
    assert pool.can_allocate(3) and not pool.can_allocate(4) and not pool.can_allocate(-1)


def test_exhaustion_raises_and_allocates_nothing():
    pool = BlockPool(num_blocks=4, block_size=4)
    pool.allocate(2)
    with pytest.raises(NoFreeBlocksError, match="asked for 2 blocks but only 1 of 3 are free"):
        pool.allocate(2)
    assert (pool.num_free, pool.num_allocated) == (1, 2)
    assert pool.allocate(1) == [3]
    assert isinstance(NoFreeBlocksError(), RuntimeError)


@pytest.mark.parametrize(("num_tokens", "blocks"), [(0, 0), (1, 1), (16, 1), (17, 2), (64, 4)])
def test_blocks_for_tokens_is_ceil(num_tokens, blocks):
    assert BlockPool(num_blocks=2, block_size=16).blocks_for_tokens(num_tokens) == blocks


def test_bad_constructor_args():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(num_blocks=1, block_size=16)
    with pytest.raises(ValueError, match="multiple of the 4-token"):
        BlockPool(num_blocks=4, block_size=6)
    with pytest.raises(ValueError, match="multiple"):
        BlockPool(num_blocks=4, block_size=0)
    with pytest.raises(ValueError, match="8-token"):
        BlockPool(num_blocks=4, block_size=12, pool_tokens=8)
    with pytest.raises(ValueError):
        BlockPool(num_blocks=4, block_size=16).blocks_for_tokens(-1)
    with pytest.raises(ValueError):
        BlockPool(num_blocks=4, block_size=16).allocate(-1)


@pytest.mark.parametrize(
    ("bad", "msg"),
    [([0], "null block"), ([9], "out of range"), ([-1], "out of range"),
     ([5], "not allocated"), ([2, 2], "not allocated"), ([1, 0], "null block")],
)
def test_bad_free_raises_and_changes_nothing(bad, msg):
    pool = BlockPool(num_blocks=9, block_size=4)
    pool.allocate(3)  # 1, 2, 3 allocated; 4..8 free
    with pytest.raises(ValueError, match=msg):
        pool.free(bad)
    assert (pool.num_free, pool.num_allocated) == (5, 3)
    assert pool.allocate(5) == [4, 5, 6, 7, 8]  # queue order untouched too


def test_double_free_raises():
    pool = BlockPool(num_blocks=4, block_size=4)
    ids = pool.allocate(2)
    pool.free(ids)
    with pytest.raises(ValueError, match="double free"):
        pool.free([ids[0]])


def test_random_add_grow_abort_finish_has_no_leaks():
    """1,000 seeded events against both ledgers, checked against a reference model every step."""
    rng = random.Random(0)
    blocks, slots = BlockPool(num_blocks=41, block_size=16), StateSlotPool(num_slots=6)
    ref_free_blocks = deque(range(1, 41))  # what the pool's FIFO must look like
    ref_free_slots = set(range(6))
    live: dict[int, tuple[int, list[int]]] = {}  # request id -> (slot, blocks)
    counts = dict.fromkeys(("add", "reject", "grow", "abort", "finish"), 0)
    handed_out: set[int] = set()

    def release(rid: int, shuffle: bool) -> None:
        slot, owned = live.pop(rid)
        if shuffle:  # aborts free blocks in arbitrary order; the FIFO must follow it
            rng.shuffle(owned)
        blocks.free(owned)
        ref_free_blocks.extend(owned)
        slots.free(slot)
        ref_free_slots.add(slot)

    for rid in range(1_000):
        event = rng.choice(("add", "add", "grow", "grow", "abort", "finish"))
        if event == "add":
            k = rng.randint(1, 8)
            if not (slots.can_allocate() and blocks.can_allocate(k)):
                assert not ref_free_slots or len(ref_free_blocks) < k
                counts["reject"] += 1
                continue
            slot = slots.allocate()
            assert slot == min(ref_free_slots)
            ref_free_slots.remove(slot)
            got = blocks.allocate(k)
            assert got == [ref_free_blocks.popleft() for _ in range(k)]
            live[rid] = (slot, got)
        elif event == "grow" and live and blocks.can_allocate(1):
            [b] = blocks.allocate(1)
            assert b == ref_free_blocks.popleft()
            live[rng.choice(sorted(live))][1].append(b)
        elif event in ("abort", "finish") and live:
            release(rng.choice(sorted(live)), shuffle=event == "abort")
        else:
            continue
        counts[event] += 1

        owned_blocks = [b for _, bs in live.values() for b in bs]
        owned_slots = [s for s, _ in live.values()]
        handed_out.update(owned_blocks)
        assert len(owned_blocks) == len(set(owned_blocks)), "a block owned by two requests"
        assert len(owned_slots) == len(set(owned_slots)), "a slot owned by two requests"
        assert NULL_BLOCK not in owned_blocks
        assert blocks.num_allocated == len(owned_blocks)
        assert blocks.num_free + blocks.num_allocated == blocks.num_usable
        assert blocks.num_free == len(ref_free_blocks)
        assert slots.num_allocated == len(owned_slots)
        assert slots.num_free + slots.num_allocated == slots.num_slots

    # The run must have exercised every path, including exhaustion and reuse of every block.
    assert all(n > 20 for n in counts.values()), counts
    assert handed_out == set(range(1, 41))

    for rid in sorted(live):
        release(rid, shuffle=False)
    assert (blocks.num_free, blocks.num_allocated) == (40, 0)
    assert (slots.num_free, slots.num_allocated) == (6, 0)
    assert blocks.allocate(40) == list(ref_free_blocks)
    assert [slots.allocate() for _ in range(6)] == list(range(6))


class BlockPoolMachine(RuleBasedStateMachine):
    """Random allocate/free sequences against a deque model of the FIFO free queue."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(num_blocks=9, block_size=4)
        self.model_free = deque(range(1, 9))
        self.owned: list[list[int]] = []

    @rule(n=st.integers(0, 9))
    def allocate(self, n: int) -> None:
        if n > len(self.model_free):
            with pytest.raises(NoFreeBlocksError):
                self.pool.allocate(n)
            return
        got = self.pool.allocate(n)
        assert got == [self.model_free.popleft() for _ in range(n)]
        self.owned.append(got)

    @precondition(lambda self: self.owned)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        ids = self.owned.pop(data.draw(st.integers(0, len(self.owned) - 1)))
        ids = data.draw(st.permutations(ids))
        self.pool.free(ids)
        self.model_free.extend(ids)

    @rule(bad=st.integers(-2, 10))
    def free_unowned_raises(self, bad: int) -> None:
        if any(bad in ids for ids in self.owned):
            return
        with pytest.raises(ValueError):
            self.pool.free([bad])

    @invariant()
    def ledger_matches_model(self) -> None:
        held = [b for ids in self.owned for b in ids]
        assert len(held) == len(set(held)) and NULL_BLOCK not in held
        assert self.pool.num_allocated == len(held)
        assert self.pool.num_free == len(self.model_free) == self.pool.num_usable - len(held)


TestBlockPoolMachine = BlockPoolMachine.TestCase
TestBlockPoolMachine.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
