"""Prefix cache bookkeeping without a model: a simulated worker records, for every block row
and state slot, which tokens produced it, applies the step's state copies in order, and checks
that every request resumes from its own prefix; reference counts match the requests holding each
block, and nothing in use (a held block, a checkpoint a queued copy reads or writes) is evicted.
Seeded random loops of admissions, shared prefixes, branches, aborts and preemptions under a
tight cache; plus exact-id tests of the two ledgers."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from glm53.actors.step import SamplingParams
from glm53.raycluster.block_pool import BlockPool
from glm53.raycluster.prefix_cache import PrefixCache, cache_identity
from glm53.raycluster.request import Request, RequestStatus
from glm53.raycluster.scheduler import Scheduler
from glm53.raycluster.state_checkpoints import CheckpointPool
from glm53.raycluster.state_slots import StateSlotPool

BS, SLOTS, CHECKPOINTS = 4, 4, 3


class FakeWorker:
    """What the caches hold, as token tuples: row contents per (block, offset), the prefix
    each state slot (and checkpoint slot) stands for."""

    def __init__(self) -> None:
        self.rows: dict[tuple[int, int], tuple[int, ...]] = {}
        self.state: dict[int, tuple[int, ...]] = {}

    def run(self, copies, scheduled) -> None:
        for src, dst in [] if copies is None else copies.tolist():
            self.state[dst] = self.state.get(src)
        for item in scheduled:
            r, start = item.request, item.request.num_computed_tokens
            tokens = tuple(r.token_ids(0, start + item.num_tokens))
            if start:  # resumes: its slot and every earlier row must be its own prefix
                assert self.state.get(r.state_slot) == tokens[:start], r.request_id
                for p in range(start):
                    assert self.rows.get((r.block_ids[p // BS], p % BS)) == tokens[:p + 1]
            for p in range(start, start + item.num_tokens):
                self.rows[(r.block_ids[p // BS], p % BS)] = tokens[:p + 1]
            # a verify step keeps the state of the accepted tokens only; here all are accepted
            self.state[r.state_slot] = tokens


def _check_ledgers(s: Scheduler, prefix: PrefixCache) -> None:
    holders = Counter(b for r in s.running for b in r.block_ids)
    assert s.blocks._refs == dict(holders)  # exact reference counts, nothing else held
    assert not set(holders) & set(s.blocks._free)
    assert Counter(prefix._held) == Counter(prefix.checkpoints._refs)


@pytest.mark.parametrize("seed", range(4))
def test_random_traffic_resumes_only_from_its_own_prefix(seed):
    rng = random.Random(seed)
    blocks = BlockPool(num_blocks=14, block_size=BS)
    prefix = PrefixCache(blocks, CheckpointPool(CHECKPOINTS), lambda i: SLOTS + 1 + i,
                         cache_identity("fake"), 8, hash_next_token=seed % 2 == 1)
    s = Scheduler(blocks, StateSlotPool(SLOTS), 10, SLOTS, 48, prefix=prefix)
    worker = FakeWorker()
    system = [rng.randrange(3) for _ in range(9)]
    finished: list[list[int]] = [system]
    resumed = 0
    for step in range(400):
        if rng.random() < 0.35 and len(s.requests) < 8:  # a new turn or branch of old text
            base = rng.choice(finished)[: rng.randrange(1, 30)]
            prompt = base + [rng.randrange(3) for _ in range(rng.randrange(1, 8))]
            s.add(Request(f"r{step}", prompt[:30], SamplingParams(
                max_tokens=rng.randrange(1, 10), ignore_eos=True), 0))
        if rng.random() < 0.05 and s.requests:
            s.abort(rng.choice(sorted(s.requests)))
        out = s.schedule()
        copies = prefix.take_copies() if out.scheduled else None
        resumed += sum(x.request.num_computed_tokens > 0 for x in out.scheduled)
        worker.run(copies, out.scheduled)
        sampled = [len(x.request.token_ids(0, x.request.num_computed_tokens + x.num_tokens)) % 3
                   for x in out.scheduled if x.samples]
        s.commit(out.scheduled, None)
        s.update(out.scheduled, sampled, eos_ids=())
        finished += [x.request.prompt_ids + x.request.output_ids for x in out.scheduled
                     if x.request.status == RequestStatus.FINISHED]
        _check_ledgers(s, prefix)
    assert resumed > 50 and prefix.hits > 100
    assert blocks.num_evictions > 10 and prefix.checkpoints.num_evictions > 10


def test_checkpoint_pool_evicts_least_recently_used_and_never_a_held_one():
    pool = CheckpointPool(2)
    a, b = pool.save(b"a"), pool.save(b"b")
    assert (a, b) == (0, 1) and pool.save(b"c") is None  # both held by their save copies
    pool.release(a)
    pool.release(b)
    pool.hold(b)  # a restore reads b
    assert pool.save(b"c") == a and pool.lookup(b"a") is None and pool.num_evictions == 1
    assert pool.save(b"b") is None  # b exists already
    pool.release(b)
    pool.release(a)
    assert pool.save(b"d") == b  # b was used before c's save released
    with pytest.raises(ValueError, match="double release"):
        pool.release(a)


def test_block_pool_keeps_freed_cached_blocks_until_handed_out_again():
    pool = BlockPool(num_blocks=4, block_size=4)
    x, y = pool.allocate(2)
    assert pool.cache(x, b"x") and not pool.cache(y, b"x")  # one block per contents
    pool.free([y, x])
    assert (pool.lookup(b"x"), pool.num_free, pool.num_cached) == (x, 3, 1)
    assert pool.num_free_in([x]) == 1
    pool.touch([x])  # a hit takes it back off the free queue
    assert pool.allocate(2) == [3, y] and pool.lookup(b"x") == x
    pool.touch([x])  # now two holders
    pool.free([x])
    assert pool.num_free == 0 and pool.num_evictions == 0
    pool.free([x])
    assert pool.allocate(1) == [x] and pool.lookup(b"x") is None and pool.num_evictions == 1


def test_a_superseded_checkpoint_is_dropped_only_when_nobody_holds_it():
    pool = CheckpointPool(2)
    a = pool.save(b"a")
    pool.drop(a)  # its save copy is still queued
    assert pool.lookup(b"a") == a
    pool.release(a)
    pool.drop(a)
    assert pool.lookup(b"a") is None and pool.save(b"b") == a  # reused first
