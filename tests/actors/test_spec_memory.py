"""A DFlash draft's memory is in the memory plan (issue 23, deliverable 2): its weights and its
per-sequence K/V ring (this rank's shard: the draft is TP-sharded like the target) come out of
the same budget as the target's cache, the runner allocates exactly what the plan counts, and
benchmarks/spec_capacity.py reports sequences held."""

from __future__ import annotations

import dataclasses
import json
import re
import weakref
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from glm53.actors.caches import DSAState, KDAState
from glm53.actors.loader import load_model, read_config
from glm53.actors.memory_plan import GiB, MiB, meta_shard, plan_memory, sequences_held
from glm53.actors.model_runner import ModelRunner
from glm53.actors.parallel import ParallelConfig, ParallelState
from glm53.actors.release import dflash2_release_config, exl3_release_config, release_config
from glm53.actors.speculative.dflash import (
    DRAFT_CHUNK,
    DFlashProposer,
    forward_bytes_per_sequence,
    ring_bytes_per_sequence,
)
from glm53.actors.speculative.dflash_model import (
    DFlashConfig,
    DFlashDraftModel,
    draft_weight_bytes,
    load_draft,
)
from glm53.actors.tiny import write_tiny_draft
from glm53.raycluster.config import EngineConfig
from glm53.raycluster.engine import LLMEngine

DFLASH2 = DFlashConfig.from_hf(dflash2_release_config())
# exl3-dflash-spec.md §C.2: 1,171,080,448 bf16 parameters; a ring of 5 layers x (K, V) x
# 2048 positions x 8 KV heads x 128 x 2 B, plus 2048 int64 positions
DFLASH2_WEIGHTS = 2 * 1_171_080_448
DFLASH2_RING = 5 * 2 * 2048 * 8 * 128 * 2 + 2048 * 8
# TP2: each rank keeps half of every layer's q/k/v/o (4096 x 4096, 2 x 4096 x 1024,
# 4096 x 4096) and gate/up/down (3 x 4096 x 12288) and all of the rest, and 4 of the 8 KV heads
LAYER_SHARDED = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 12288
DFLASH2_TP2_WEIGHTS = 2 * (1_171_080_448 - 5 * LAYER_SHARDED // 2)  # 1.28 GiB
DFLASH2_TP2_RING = 5 * 2 * 2048 * 4 * 128 * 2 + 2048 * 8  # 20.02 MiB
# the fp8 ring (draft_kv_cache_dtype "fp8"): each row of 128 values is 128 e4m3 codes and one
# fp32 scale, 132 B instead of 256
DFLASH2_TP2_RING_FP8 = 5 * 2 * 2048 * 4 * (128 + 4) + 2048 * 8  # 10.33 MiB


@pytest.fixture(scope="module")
def tiny(tiny_checkpoints, tmp_path_factory):
    """(target dir, its config.json dict, tiny draft dir): the TINY spec (MTP layer)."""
    target = tiny_checkpoints(seed=3, layers=5, mtp=True, index_topk=8)
    draft = write_tiny_draft(tmp_path_factory.mktemp("draft"), read_config(target), seed=2)
    return target, json.loads((target / "config.json").read_text()), draft


def test_dflash2_draft_memory_matches_hand_counts() -> None:
    assert draft_weight_bytes(DFLASH2, torch.bfloat16) == DFLASH2_WEIGHTS
    assert ring_bytes_per_sequence(DFLASH2, torch.bfloat16) == DFLASH2_RING  # 40.02 MiB
    for rank in (0, 1):
        ps = ParallelState(ParallelConfig(tp=2, ep=2, dcp=2), rank)
        assert draft_weight_bytes(DFLASH2, torch.bfloat16, ps) == DFLASH2_TP2_WEIGHTS
    assert ring_bytes_per_sequence(DFLASH2, torch.bfloat16, tp=2) == DFLASH2_TP2_RING
    assert ring_bytes_per_sequence(DFLASH2, torch.bfloat16, 2, "fp8") == DFLASH2_TP2_RING_FP8
    assert ring_bytes_per_sequence(DFLASH2, torch.bfloat16, 1, "fp8") == (
        5 * 2 * 2048 * 8 * 132 + 2048 * 8)  # 20.64 MiB
    with pytest.raises(ValueError, match="draft_kv_cache_dtype 'int4'"):
        ring_bytes_per_sequence(DFLASH2, torch.bfloat16, 2, "int4")
    with pytest.raises(ValueError, match="head_dim <= 128"):
        ring_bytes_per_sequence(dataclasses.replace(DFLASH2, head_dim=256), torch.bfloat16,
                                2, "fp8")


def test_plan_with_a_draft_holds_fewer_tokens_by_exactly_the_draft_bytes() -> None:
    """Same rank (TP2), same reserve: the KV pool loses the rank's share of the draft's
    weights, the state its 16 rings of 4 KV heads, and the blocks are what is left."""
    model = meta_shard(exl3_release_config(), tp=2, ep=2, dcp=2, with_mtp=False)
    kw = dict(block_size=32, num_slots=16, num_spec=7, reserve_bytes=4 * GiB)
    plain = plan_memory(model, int(139.8 * GiB), 0.9, **kw)
    drafted = plan_memory(model, int(139.8 * GiB), 0.9, draft=DFLASH2, **kw)
    assert plain.kv_pool_bytes - drafted.kv_pool_bytes == DFLASH2_TP2_WEIGHTS
    assert drafted.state_bytes - plain.state_bytes == 16 * DFLASH2_TP2_RING
    free = plain.kv_pool_bytes - plain.state_bytes
    assert plain.num_blocks == free // plain.bytes_per_block
    draft_bytes = DFLASH2_TP2_WEIGHTS + 16 * DFLASH2_TP2_RING
    assert drafted.num_blocks == (free - draft_bytes) // plain.bytes_per_block
    assert plain.num_tokens - drafted.num_tokens == 32 * (
        plain.num_blocks - drafted.num_blocks)
    text = drafted.describe()
    assert re.search(r"dflash_draft +1.28 GiB\n", text)
    assert "16 DFlash rings x 20.0 MiB" in text
    # prefix caching: each checkpoint is one more KDA state slot and one more ring
    cached = plan_memory(model, int(139.8 * GiB), 0.9, draft=DFLASH2, num_checkpoints=16, **kw)
    assert cached.state_bytes - drafted.state_bytes == 16 * (cached.bytes_per_slot
                                                             + DFLASH2_TP2_RING)
    assert ("(17 KDA state slots + 16 prefix checkpoints) x" in cached.describe()
            and "32 DFlash rings x 20.0 MiB" in cached.describe())
    # the fp8 ring: the same weights, 16 rings of 10.33 MiB (their scales included)
    fp8 = plan_memory(model, int(139.8 * GiB), 0.9, draft=DFLASH2, draft_kv_cache_dtype="fp8",
                      **kw)
    assert plain.kv_pool_bytes - fp8.kv_pool_bytes == DFLASH2_TP2_WEIGHTS
    assert fp8.state_bytes - plain.state_bytes == 16 * DFLASH2_TP2_RING_FP8
    assert fp8.num_blocks == (free - DFLASH2_TP2_WEIGHTS - 16 * DFLASH2_TP2_RING_FP8
                              ) // plain.bytes_per_block
    assert "16 DFlash rings x 10.3 MiB (fp8)" in fp8.describe()


def test_draft_forward_is_in_the_reserve() -> None:
    """Without an explicit reserve the plan keeps one draft forward of DRAFT_CHUNK sequences
    after the caches: per sequence (TP2: 4 KV heads, 16 query heads) the ring gather in bf16,
    one fp32 copy of the context keys or values, three fp32 score tensors over the window +
    block, and the head's logits (x3); K/V are not repeated to the query heads."""
    model = meta_shard(exl3_release_config(), tp=2, ep=2, dcp=2, with_mtp=False)
    kw = dict(block_size=32, num_slots=16, num_spec=7)
    plain = plan_memory(model, int(139.8 * GiB), 0.9, **kw)
    drafted = plan_memory(model, int(139.8 * GiB), 0.9, draft=DFLASH2, **kw)
    c = 2048 + 8
    per_seq = (2 * 2048 * 4 * 128 * 2 + 2048 * 4 * 128 * 4 + 3 * 16 * 8 * c * 4
               + 3 * 7 * 154880 * 4)
    assert forward_bytes_per_sequence(DFLASH2, torch.bfloat16, tp=2) == per_seq  # 23.4 MiB
    assert drafted.draft_workspace_bytes == DRAFT_CHUNK * per_seq
    # and the CUDA graphs' shared tap states: 16 x 8 rows of the 5 target layers' hidden (bf16)
    assert len(DFLASH2.target_layer_ids) == 5
    assert drafted.reserve_bytes - plain.reserve_bytes == (DRAFT_CHUNK * per_seq
                                                           + 16 * 8 * 5 * 4096 * 2)
    assert drafted.after_cache_bytes == drafted.workspace_bytes + DRAFT_CHUNK * per_seq
    assert "0.18 GiB DFlash forward" in drafted.describe()
    # the fp8 ring: its gather is rows of 128 codes + a 4 B scale, and the attention's copy
    # needs the fp32 scales [W, kv] besides
    fp8_seq = (2 * 2048 * 4 * 132 + 2048 * 4 * 4 + 2048 * 4 * 128 * 4 + 3 * 16 * 8 * c * 4
               + 3 * 7 * 154880 * 4)
    assert forward_bytes_per_sequence(DFLASH2, torch.bfloat16, 2, "fp8") == fp8_seq  # 21.5 MiB
    fp8 = plan_memory(model, int(139.8 * GiB), 0.9, draft=DFLASH2, draft_kv_cache_dtype="fp8",
                      **kw)
    assert fp8.draft_workspace_bytes == DRAFT_CHUNK * fp8_seq


def _tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, KDAState | DSAState):
        return sum(_tensor_bytes(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    return 0


@pytest.mark.parametrize("tp,checkpoints,ring", [(1, 0, "auto"), (1, 3, "auto"), (2, 3, "auto"),
                                                 (1, 3, "fp8"), (2, 3, "fp8")])
def test_runner_allocates_what_the_plan_counts(tiny, tp, checkpoints, ring) -> None:
    """The tiny model with its DFlash draft on CPU under a byte budget, at TP1 and as rank 1
    of TP2 (emulated: its shapes, no other rank): the caches and the proposer's rings together
    are the CachePlan's bytes, within the budget; the blocks are the MemoryPlan's for the same
    KV pool, and the target's and draft's parameters are the plan's weights (no memory outside
    the plan). At TP2 the rank keeps its half of the draft's heads and MLP, as cut from the
    checkpoint. Prefix-cache checkpoints each take a state slot and a ring; an fp8 ring (uint8
    rows of 16 codes + a 4 B scale) is counted with its scales."""
    target, config, draft = tiny
    budget, slots = 1 * MiB, 4
    ps = ParallelState(ParallelConfig(tp=tp), rank=tp - 1, emulated=True)
    runner = ModelRunner(str(target), num_slots=slots, cache_bytes=budget, num_spec=7,
                         draft_model=str(draft), ps=ps, num_checkpoints=checkpoints,
                         draft_kv_cache_dtype=ring)
    plan = runner.allocate_caches(runner.plan.num_blocks)
    dcfg = DFlashConfig.from_dir(draft)
    kind, ring = ring, ring_bytes_per_sequence(dcfg, runner.draft.fc.weight.dtype, tp, ring)
    # 2 layers x (K, V) x 16 positions x 2 / tp KV heads x a row (16 x 4 B fp32, or 16 e4m3
    # codes + a 4 B scale) + 16 int64 positions
    row = 16 * 4 if kind == "auto" else 16 + 4
    assert plan.draft_bytes_per_slot == ring == 2 * 2 * 16 * (2 // tp) * row + 16 * 8
    assert runner.proposer.ring.dtype == (torch.float32 if kind == "auto" else torch.uint8)
    caches = sum(_tensor_bytes(s) for s in (*runner.caches.layers, runner.caches.mtp))
    assert runner.proposer.state_bytes == (slots + checkpoints) * ring
    allocated = caches + runner.proposer.state_bytes
    assert allocated == plan.total_bytes <= budget
    assert budget - allocated < plan.bytes_per_block  # the rest is less than one block
    # the memory plan of the same model and draft, its KV pool set to the runner's budget
    model = meta_shard(config, tp=tp, rank=tp - 1, with_mtp=False)  # as the runner builds it
    weights = plan_memory(model, 0, 1.0, block_size=16, num_slots=slots, num_spec=7,
                          reserve_bytes=0, draft=dcfg).weight_bytes
    assert weights == sum(_tensor_bytes(p) for m in (runner.model, runner.draft)
                          for p in m.parameters())
    memory = plan_memory(model, weights + budget, 1.0, block_size=16, num_slots=slots,
                         num_spec=7, reserve_bytes=0, draft=dcfg, num_checkpoints=checkpoints,
                         draft_kv_cache_dtype=kind)
    assert memory.kv_pool_bytes == budget
    assert (memory.num_blocks, memory.bytes_per_block, memory.bytes_per_slot,
            memory.draft_bytes_per_slot) == (plan.num_blocks, plan.bytes_per_block,
                                             plan.bytes_per_slot, ring)
    whole = load_draft(draft, torch.float32, "cpu").layers[1]
    ours = runner.draft.layers[1]
    rows = slice(whole.self_attn.k_proj.weight.shape[0] // tp * (tp - 1), None)
    assert torch.equal(ours.self_attn.k_proj.weight, whole.self_attn.k_proj.weight[rows])
    cols = slice(whole.mlp.down_proj.weight.shape[1] // tp * (tp - 1), None)
    assert torch.equal(ours.mlp.down_proj.weight, whole.mlp.down_proj.weight[:, cols])
    assert torch.equal(ours.mlp_conv.base_kernel, whole.mlp_conv.base_kernel)


def test_dflash_engine_does_not_load_the_mtp_layer(tiny) -> None:
    """The target checkpoint has an MTP layer; with DFlash drafting it is unused, so neither
    its weights nor its cache are allocated (the plan's DFlash rows are built without it)."""
    target, _, draft = tiny
    engine = LLMEngine(EngineConfig(model=str(target), num_blocks=32,
                                    speculative_method="dflash", num_speculative_tokens=7,
                                    draft_model=str(draft)))
    runner = engine.executor.runner
    assert runner.model.config.has_mtp
    assert runner.model.mtp is None and runner.caches.mtp is None
    assert not any(n.startswith("mtp.") for n, _ in runner.model.named_parameters())


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


@pytest.mark.parametrize("experts,latents,ring", [("exl3", "auto", "auto"),
                                                  ("int4", "auto", "auto"),
                                                  ("exl3", "nvfp4", "fp8")])
def test_dflash_holds_nine_tenths_of_mtp3_at_8k(experts, latents, ring) -> None:
    """Issue 23: at the same memory (TP2/EP2/DCP2 rank 0, 139.8 GiB x 0.9, 8K contexts, same
    verify width) DFlash2 holds >= 0.9x the sequences MTP3 does: its ring and weights are TP
    sharded and its forward is small (benchmarks/spec_capacity.py records the numbers). With
    the nvfp4 latents of the lang-mtp3 profile a block is 3.1x smaller, the bf16 ring weighs
    more against it (0.859x), and the fp8 ring is what keeps DFlash3 above 0.9x (0.940x)."""
    config = exl3_release_config() if experts == "exl3" else release_config()
    quantize = None if experts == "exl3" else "int4"
    held = {}
    for mode, with_mtp, draft in (("mtp3", True, None), ("dflash3", False, DFLASH2)):
        model = meta_shard(config, tp=2, ep=2, dcp=2, with_mtp=with_mtp,
                           quantize_experts=quantize)
        held[mode], _ = sequences_held(model, int(139.8 * GiB), 0.9, context_len=8192,
                                       block_size=32, num_spec=3, draft=draft,
                                       kv_cache_dtype=latents, draft_kv_cache_dtype=ring)
    assert held["dflash3"] >= 0.9 * held["mtp3"] > 0, held


def test_capacity_report_of_the_tiny_model(monkeypatch, capsys) -> None:
    """benchmarks/spec_capacity.py's CPU case: 8 MiB for the tiny model's weights and caches.
    The tiny draft's ring is small (window 16), so DFlash holds more than MTP3, whose extra
    DSA layer is in every block; the real shapes' numbers are in its results file."""
    monkeypatch.syspath_prepend("benchmarks")
    from spec_capacity import tiny_cpu

    rows = {(r["context"], r["mode"]): r["sequences"] for r in tiny_cpu()}
    assert {m: rows[256, m] for m in ("none", "mtp3", "dflash7", "dflash7_fp8")} == {
        "none": 133, "mtp3": 71, "dflash7": 106, "dflash7_fp8": 117}
    assert {m: rows[2048, m] for m in ("none", "mtp3", "dflash7")} == {
        "none": 21, "mtp3": 10, "dflash7": 19}
    assert "dflash7/mtp3 1.493" in capsys.readouterr().out


class _LiveBytes(TorchDispatchMode):
    """Bytes of the tensors the ops under this mode create that are still alive, and their
    peak: what a forward adds on top of the tensors that existed before it (views and in-place
    results share an input's storage and are not new)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.seen: set[int] = set()

    def _free(self, key: int, n: int) -> None:
        self.live -= n
        self.seen.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key and key not in self.seen and key not in inputs:
                self.seen.add(key)
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._free, key, storage.nbytes())
        return out


@pytest.mark.parametrize("tp,ring", [(1, "auto"), (2, "auto"), (1, "fp8"), (2, "fp8")])
def test_draft_forward_transient_is_what_the_plan_reserves(tiny, tp, ring) -> None:
    """One draft forward of DRAFT_CHUNK sequences, measured tensor by tensor on CPU with a draft
    whose window dominates as GLM's does (1024 positions of 4 KV heads x 64): its peak is
    within the plan's DRAFT_CHUNK x forward_bytes_per_sequence and above 90% of it (as rank 0
    of TP2, emulated: the rank's heads, no other rank). Measured: 95.4% at TP1, 95.8% at TP2;
    with the fp8 ring (uint8 rows, dequantised in the attention's copy) 91.8% and 92.5%."""
    target, _, _ = tiny
    ps = ParallelState(ParallelConfig(tp=tp), rank=0, emulated=True)
    model = load_model(target, progress=False, ps=ps)
    cfg = DFlashConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8,
                       num_kv_heads=4, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e4,
                       sliding_window=1024, block_size=8, mask_token_id=271,
                       target_layer_ids=(1, 3), conv_group_size=16, selector_rank=8,
                       selector_top_k=4, vocab_size=272)
    torch.manual_seed(0)
    draft = DFlashDraftModel(cfg, ps).requires_grad_(False)
    for p in draft.parameters():
        p.data.normal_(0, 0.1)
    n, w = DRAFT_CHUNK, cfg.sliding_window
    proposer = DFlashProposer(model, draft, n, num_spec=7, draft_kv_cache_dtype=ring)
    if ring == "fp8":  # rows of finite codes and scales of 1 (never NaN codes)
        proposer.ring.view(-1, 68)[:, :64].random_(0, 0x7F)
        proposer.ring.view(-1, 68)[:, 64:] = torch.tensor([1.0]).view(torch.uint8)
    else:
        proposer.ring.normal_()
    proposer.ring_pos[:] = torch.arange(w)  # full windows: every context row visible
    step = SimpleNamespace(cu_seqlens=np.arange(n + 1), state_ids=np.arange(n),
                           positions=np.full(n, w - 1))
    with torch.inference_mode(), _LiveBytes() as live:
        drafts = proposer._draft(step, np.arange(n), np.ones(n, dtype=np.int64),
                                 np.arange(n))
    assert drafts.shape == (n, 7)
    planned = n * forward_bytes_per_sequence(cfg, torch.float32, tp, ring)
    print(f"tp{tp} {ring} ring: draft forward peak {live.peak / MiB:.2f} MiB, "
          f"planned {planned / MiB:.2f}")
    assert 0.9 * planned <= live.peak <= planned
