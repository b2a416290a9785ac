"""A DFlash draft's memory is in the memory plan (issue 23, deliverable 2): its weights and its
per-sequence K/V ring come out of the same budget as the target's cache, the runner allocates
exactly what the plan counts, and benchmarks/spec_capacity.py reports sequences held."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

from glm53.actors.caches import DSAState, KDAState
from glm53.actors.loader import read_config
from glm53.actors.memory_plan import GiB, MiB, meta_shard, plan_memory, sequences_held
from glm53.actors.model_runner import ModelRunner
from glm53.actors.release import dflash2_release_config, exl3_release_config
from glm53.actors.speculative.dflash import (
    DRAFT_CHUNK,
    forward_bytes_per_sequence,
    ring_bytes_per_sequence,
)
from glm53.actors.speculative.dflash_model import DFlashConfig, draft_weight_bytes
from glm53.actors.tiny import write_tiny_draft

DFLASH2 = DFlashConfig.from_hf(dflash2_release_config())
# exl3-dflash-spec.md §C.2: 1,171,080,448 bf16 parameters; a ring of 5 layers x (K, V) x
# 2048 positions x 8 KV heads x 128 x 2 B, plus 2048 int64 positions
DFLASH2_WEIGHTS = 2 * 1_171_080_448
DFLASH2_RING = 5 * 2 * 2048 * 8 * 128 * 2 + 2048 * 8


@pytest.fixture(scope="module")
def tiny(tiny_checkpoints, tmp_path_factory):
    """(target dir, its config.json dict, tiny draft dir): the TINY spec (MTP layer)."""
    target = tiny_checkpoints(seed=3, layers=5, mtp=True, index_topk=8)
    draft = write_tiny_draft(tmp_path_factory.mktemp("draft"), read_config(target), seed=2)
    return target, json.loads((target / "config.json").read_text()), draft


def test_dflash2_draft_memory_matches_hand_counts() -> None:
    assert draft_weight_bytes(DFLASH2, torch.bfloat16) == DFLASH2_WEIGHTS
    assert ring_bytes_per_sequence(DFLASH2, torch.bfloat16) == DFLASH2_RING  # 40.02 MiB


def test_plan_with_a_draft_holds_fewer_tokens_by_exactly_the_draft_bytes() -> None:
    """Same rank, same reserve: the KV pool loses the draft's weights, the state its 16 rings,
    and the blocks are what is left."""
    model = meta_shard(exl3_release_config(), tp=2, ep=2, dcp=2, with_mtp=False)
    kw = dict(block_size=32, num_slots=16, num_spec=7, reserve_bytes=4 * GiB)
    plain = plan_memory(model, int(139.8 * GiB), 0.9, **kw)
    drafted = plan_memory(model, int(139.8 * GiB), 0.9, draft=DFLASH2, **kw)
    assert plain.kv_pool_bytes - drafted.kv_pool_bytes == DFLASH2_WEIGHTS
    assert drafted.state_bytes - plain.state_bytes == 16 * DFLASH2_RING
    free = plain.kv_pool_bytes - plain.state_bytes
    assert plain.num_blocks == free // plain.bytes_per_block
    draft_bytes = DFLASH2_WEIGHTS + 16 * DFLASH2_RING
    assert drafted.num_blocks == (free - draft_bytes) // plain.bytes_per_block
    assert plain.num_tokens - drafted.num_tokens == 32 * (
        plain.num_blocks - drafted.num_blocks)
    text = drafted.describe()
    assert re.search(r"dflash_draft +2.18 GiB \(replicated\)", text)
    assert "16 DFlash rings x 40.0 MiB" in text
    # prefix caching: each checkpoint is one more KDA state slot and one more ring
    cached = plan_memory(model, int(139.8 * GiB), 0.9, draft=DFLASH2, num_checkpoints=16, **kw)
    assert cached.state_bytes - drafted.state_bytes == 16 * (cached.bytes_per_slot
                                                             + DFLASH2_RING)
    assert ("(17 KDA state slots + 16 prefix checkpoints) x" in cached.describe()
            and "32 DFlash rings x 40.0 MiB" in cached.describe())


def test_draft_forward_is_in_the_reserve() -> None:
    """Without an explicit reserve the plan keeps one draft forward of DRAFT_CHUNK sequences
    (K/V repeated to the 32 query heads in bf16 and fp32, scores, logits) after the caches."""
    model = meta_shard(exl3_release_config(), tp=2, ep=2, dcp=2, with_mtp=False)
    kw = dict(block_size=32, num_slots=16, num_spec=7)
    plain = plan_memory(model, int(139.8 * GiB), 0.9, **kw)
    drafted = plan_memory(model, int(139.8 * GiB), 0.9, draft=DFLASH2, **kw)
    c = 2048 + 8
    per_seq = (2 * 2048 * 8 * 128 * 2 + 2 * c * 8 * 128 * 2 + 2 * c * 32 * 128 * (2 + 4)
               + 2 * 32 * 8 * c * 4 + 3 * 7 * 154880 * 4)
    assert forward_bytes_per_sequence(DFLASH2, torch.bfloat16) == per_seq  # 128.8 MiB
    assert drafted.draft_workspace_bytes == DRAFT_CHUNK * per_seq
    assert drafted.reserve_bytes - plain.reserve_bytes == DRAFT_CHUNK * per_seq
    assert drafted.after_cache_bytes == drafted.workspace_bytes + DRAFT_CHUNK * per_seq
    assert "1.01 GiB DFlash forward" in drafted.describe()


def _tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, KDAState | DSAState):
        return sum(_tensor_bytes(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    return 0


@pytest.mark.parametrize("checkpoints", [0, 3])
def test_runner_allocates_what_the_plan_counts(tiny, checkpoints) -> None:
    """The tiny model with its DFlash draft on CPU under a byte budget: the caches and the
    proposer's rings together are the CachePlan's bytes, within the budget, and the blocks are
    the MemoryPlan's for the same KV pool (no memory outside the plan). Prefix-cache
    checkpoints each take a state slot and a ring."""
    target, config, draft = tiny
    budget, slots = 1 * MiB, 4
    runner = ModelRunner(str(target), num_slots=slots, cache_bytes=budget, num_spec=7,
                         draft_model=str(draft), num_checkpoints=checkpoints)
    plan = runner.allocate_caches(runner.plan.num_blocks)
    ring = ring_bytes_per_sequence(runner.draft.config, runner.draft.fc.weight.dtype)
    assert plan.draft_bytes_per_slot == ring > 0
    caches = sum(_tensor_bytes(s) for s in (*runner.caches.layers, runner.caches.mtp))
    assert runner.proposer.state_bytes == (slots + checkpoints) * ring
    allocated = caches + runner.proposer.state_bytes
    assert allocated == plan.total_bytes <= budget
    assert budget - allocated < plan.bytes_per_block  # the rest is less than one block
    # the memory plan of the same model and draft, its KV pool set to the runner's budget
    model = meta_shard(config, with_mtp=False)  # as the runner builds it for DFlash
    dcfg = DFlashConfig.from_dir(draft)
    weights = plan_memory(model, 0, 1.0, block_size=16, num_slots=slots, num_spec=7,
                          reserve_bytes=0, draft=dcfg).weight_bytes
    memory = plan_memory(model, weights + budget, 1.0, block_size=16, num_slots=slots,
                         num_spec=7, reserve_bytes=0, draft=dcfg, num_checkpoints=checkpoints)
    assert memory.kv_pool_bytes == budget
    assert (memory.num_blocks, memory.bytes_per_block, memory.bytes_per_slot,
            memory.draft_bytes_per_slot) == (plan.num_blocks, plan.bytes_per_block,
                                             plan.bytes_per_slot, ring)


def test_sequences_held_is_the_largest_that_fits(tiny) -> None:
    _, config, draft = tiny
    model = meta_shard(config, with_mtp=False)
    kw = dict(context_len=256, block_size=16, num_spec=7, reserve_bytes=0,
              max_num_batched_tokens=64, draft=DFlashConfig.from_dir(draft))
    n, plan = sequences_held(model, 8 * MiB, 1.0, **kw)
    assert n > 0 and plan.num_slots == n and plan.num_blocks - 1 >= n * 16
    more = plan_memory(model, 8 * MiB, 1.0, block_size=16, num_slots=n + 1, max_model_len=256,
                       **{k: v for k, v in kw.items() if k not in ("context_len", "block_size")})
    assert more.num_blocks - 1 < (n + 1) * 16


def test_capacity_report_of_the_tiny_model(monkeypatch, capsys) -> None:
    """benchmarks/spec_capacity.py's CPU case: 8 MiB for the tiny model's weights and caches.
    The tiny draft's ring is small (window 16), so DFlash holds more than MTP3, whose extra
    DSA layer is in every block; the real shapes' numbers are in its results file."""
    monkeypatch.syspath_prepend("benchmarks")
    from spec_capacity import tiny_cpu

    rows = {(r["context"], r["mode"]): r["sequences"] for r in tiny_cpu()}
    assert {m: rows[256, m] for m in ("none", "mtp3", "dflash7")} == {
        "none": 133, "mtp3": 71, "dflash7": 106}
    assert {m: rows[2048, m] for m in ("none", "mtp3", "dflash7")} == {
        "none": 21, "mtp3": 10, "dflash7": 19}
    assert "dflash7/mtp3 1.493" in capsys.readouterr().out
