"""StateSlotPool: lowest-free-id allocation, exact reuse order, and error cases.

The random admission simulation over both ledgers lives in test_block_pool.py.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from glm53.raycluster.state_slots import NoFreeSlotsError, StateSlotPool


def test_allocates_lowest_free_id_first():
    pool = StateSlotPool(num_slots=4)
    assert [pool.allocate() for _ in range(4)] == [0, 1, 2, 3]
    assert (pool.num_free, pool.num_allocated, pool.can_allocate()) == (0, 4, False)
    pool.free(2)
    pool.free(0)
    # Lowest id first, regardless of free order.
    assert pool.allocate() == 0
    pool.free(3)
    assert [pool.allocate(), pool.allocate()] == [2, 3]


def test_exhaustion_raises_and_changes_nothing():
    pool = StateSlotPool(num_slots=2)
    pool.allocate()
    pool.allocate()
    with pytest.raises(NoFreeSlotsError, match="all 2 state slots are in use"):
        pool.allocate()
    assert (pool.num_free, pool.num_allocated) == (0, 2)
    assert isinstance(NoFreeSlotsError(), RuntimeError)
    pool.free(1)
    assert pool.can_allocate() and pool.allocate() == 1


@pytest.mark.parametrize(("bad", "msg"), [(-1, "out of range"), (3, "out of range"),
                                          (2, "not allocated")])
def test_bad_free_raises_and_changes_nothing(bad, msg):
    pool = StateSlotPool(num_slots=3)
    pool.allocate()
    pool.allocate()
    with pytest.raises(ValueError, match=msg):
        pool.free(bad)
    assert (pool.num_free, pool.num_allocated) == (1, 2)


def test_double_free_raises():
    pool = StateSlotPool(num_slots=2)
    slot = pool.allocate()
    pool.free(slot)
    with pytest.raises(ValueError, match="double free"):
        pool.free(slot)
    assert pool.num_free == 2


def test_num_slots_must_be_positive():
    with pytest.raises(ValueError, match="num_slots"):
        StateSlotPool(num_slots=0)


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 7)), max_size=60))
def test_always_returns_min_free_slot(ops):
    """Any interleaving of allocate/free: allocate returns the minimum of the model's free set."""
    pool, model_free = StateSlotPool(num_slots=8), set(range(8))
    for is_alloc, slot in ops:
        if is_alloc and model_free:
            got = pool.allocate()
            assert got == min(model_free)
            model_free.remove(got)
        elif not is_alloc and slot not in model_free:
            pool.free(slot)
            model_free.add(slot)
        assert pool.num_free == len(model_free)
        assert pool.num_allocated == 8 - len(model_free)
