"""Scheduler counters, budgets, admission order and preemption, with exact ids (no model)."""

from __future__ import annotations

import numpy as np
import pytest

from glm53.actors.step import SamplingParams
from glm53.raycluster.block_pool import BlockPool
from glm53.raycluster.request import FinishReason, Request, RequestStatus
from glm53.raycluster.scheduler import RequestRejectedError, Scheduler
from glm53.raycluster.state_slots import StateSlotPool


def _scheduler(num_blocks=32, block_size=4, slots=4, budget=10, max_seqs=4, max_len=64):
    return Scheduler(BlockPool(num_blocks, block_size), StateSlotPool(slots), budget, max_seqs,
                     max_len)


def _req(rid: str, n_prompt: int, max_tokens: int = 4, **kw) -> Request:
    return Request(rid, list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens, **kw),
                   seed=0)


def _plan(out) -> list[tuple[str, int]]:
    return [(s.request.request_id, s.num_tokens) for s in out.scheduled]


def _run(s: Scheduler, token: int = 7):
    out = s.schedule()
    s.commit(out.scheduled)
    s.update(out.scheduled, [token] * sum(x.samples for x in out.scheduled), eos_ids=(0,))
    return out


def test_budget_splits_prefill_into_chunks_and_decodes_one_token_each():
    s = _scheduler(budget=10)
    s.add(_req("a", 7))
    s.add(_req("b", 9))
    assert _plan(_run(s)) == [("a", 7), ("b", 3)]  # b gets the rest of the budget
    assert s.requests["a"].output_ids == [7] and s.requests["b"].output_ids == []
    assert _plan(_run(s)) == [("a", 1), ("b", 6)]  # a decodes, b finishes its prompt
    assert _plan(_run(s)) == [("a", 1), ("b", 1)]
    # blocks are handed out as each request grows: 9 computed tokens = 3 blocks of 4
    assert s.requests["a"].block_ids == [1, 2, 6] and s.requests["b"].block_ids == [3, 4, 5]


def test_admission_is_fcfs_and_capped_by_max_num_seqs():
    s = _scheduler(budget=100, max_seqs=2)
    for rid in "abc":
        s.add(_req(rid, 3))
    assert [x[0] for x in _plan(_run(s))] == ["a", "b"]
    assert [r.request_id for r in s.waiting] == ["c"]


def test_preemption_takes_the_latest_request_and_requeues_it_first():
    s = _scheduler(num_blocks=5, block_size=4, budget=100)  # 4 usable blocks
    s.add(_req("a", 7, max_tokens=8))
    s.add(_req("b", 7, max_tokens=8))
    _run(s)  # prompts: 7 tokens each, 2 blocks each
    _run(s)  # position 7 still fits in 2 blocks
    out = _run(s)  # position 8 needs a third block for a: b (admitted last) is preempted
    assert [r.request_id for r in out.preempted] == ["b"]
    b = s.requests["b"]
    assert b.status == RequestStatus.WAITING and b.num_computed_tokens == 0
    assert b.block_ids == [] and b.state_slot is None and b.num_preemptions == 1
    assert list(s.waiting) == [b] and b.output_ids == [7, 7]  # outputs kept for recompute
    assert s.blocks.num_free == 1


def test_stop_rules_and_finish_reasons():
    s = _scheduler(budget=100)
    s.add(_req("eos", 2))
    s.add(_req("ignore", 2, ignore_eos=True, max_tokens=2))
    s.add(_req("stop", 2, stop_token_ids=(0,), min_tokens=1))
    out = s.schedule()
    s.commit(out.scheduled)
    finished = {r.request_id: r for r in (x.request for x in out.scheduled)}
    s.update(out.scheduled, [0, 0, 0], eos_ids=(0,))
    assert finished["eos"].finish_reason == FinishReason.STOP
    assert finished["stop"].finish_reason == FinishReason.STOP
    assert not finished["ignore"].finished
    _run(s, token=0)
    assert finished["ignore"].finish_reason == FinishReason.LENGTH
    assert not s.has_unfinished and s.blocks.num_free == s.blocks.num_usable


def test_abort_while_the_step_runs_keeps_the_others_aligned():
    s = _scheduler(budget=100)
    s.add(_req("a", 2))
    s.add(_req("b", 2))
    out = s.schedule()
    s.commit(out.scheduled)
    s.abort("a")
    progressed = s.update(out.scheduled, [11, 12], eos_ids=(0,))
    assert [p.request.request_id for p in progressed] == ["b"] and progressed[0].tokens == [12]
    assert s.requests["b"].output_ids == [12]


def test_rejections():
    s = _scheduler(num_blocks=5, block_size=4, max_len=64)  # 16 tokens of cache
    with pytest.raises(RequestRejectedError, match="max_model_len"):
        s.add(_req("long", 60, max_tokens=10))
    with pytest.raises(RequestRejectedError, match="can never fit"):
        s.add(_req("big", 14, max_tokens=4))
    with pytest.raises(RequestRejectedError, match="empty"):
        s.add(_req("empty", 0))
    s.add(_req("x", 2))
    with pytest.raises(RequestRejectedError, match="duplicate"):
        s.add(_req("x", 2))


def test_token_ids_span_prompt_outputs_and_drafts():
    r = _req("a", 4)  # prompt 1 2 3 4
    r.output_ids, r.draft_ids = [5, 6], [7, 8]
    whole = [1, 2, 3, 4, 5, 6, 7, 8]
    for start in range(9):
        for end in range(start, 9):
            assert r.token_ids(start, end) == whole[start:end], (start, end)


def test_block_table_follows_growth_and_replacement():
    """The int32 mirror of block_ids the step builder reads tracks every change the scheduler
    makes: blocks added as a request grows, all freed on preemption, new ones on re-admission."""
    s = _scheduler(num_blocks=5, block_size=4, budget=100)
    s.add(_req("a", 7, max_tokens=8))
    s.add(_req("b", 7, max_tokens=8))
    b = s.requests["b"]
    for _ in range(6):
        _run(s)
        for r in s.requests.values():
            table = r.block_table()
            assert table.dtype == np.int32 and table.tolist() == r.block_ids, r.request_id
    assert b.num_preemptions == 1  # b was preempted (empty table) and re-admitted


def test_step_input_carries_outputs_only_for_penalised_rows():
    from glm53.raycluster.batch import build_step_input

    s = _scheduler(budget=100)
    s.add(_req("plain", 3, max_tokens=8))
    s.add(_req("penalised", 3, max_tokens=8, repetition_penalty=1.3))
    for token in (7, 9):  # prompts, then one decode step: two outputs each
        out = s.schedule()
        s.commit(out.scheduled)
        s.update(out.scheduled, [token] * sum(x.samples for x in out.scheduled), eos_ids=(0,))
    step = build_step_input(0, s.schedule(), 4)
    sampling = step.sampling
    assert step.request_ids == ["plain", "penalised"]
    assert sampling.output_offsets.tolist() == [0, 0, 2]  # plain: none; penalised: 7, 9
    assert sampling.output_ids.tolist() == [7, 9]
    assert sampling.prompt_offsets.tolist() == [0, 0, 3]
    assert step.block_tables.tolist() == [r.block_ids + [0] * (step.block_tables.shape[1] - len(
        r.block_ids)) for r in (s.requests["plain"], s.requests["penalised"])]
