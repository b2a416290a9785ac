"""CUDA graphs on the GPU: the tiny model through the in-process engine with graphs on gives the
greedy tokens of the same engine under enforce_eager, with requests arriving and finishing
across steps (bucket changes and padding) and with MTP speculation (the KDA commit and the
greedy drafts as the graph after acceptance); graphs really replayed.
With overlapped scheduling too: step N+1 is launched before step N is finished (its tokens
filled in on the device), asking no logprobs, so that nothing makes the host wait in between.

fp32 must match exactly. bf16 may split only at a near tie: a padded batch changes the GEMM
shapes, so bf16 rounding can move logits by ~1e-2; at the first differing position the eager
run's top-2 logprobs must then be within NEAR_TIE (after the split the continuations are
different sequences and are not compared further).

A capture of many buckets and widths takes no more device memory than the memory plan
reserves for the graphs.
"""

from __future__ import annotations

import dataclasses
import gc

import numpy as np
import pytest
import torch

from glm53.actors.memory_plan import MiB, graph_workspace
from glm53.actors.model_runner import ModelRunner
from glm53.actors.step import SamplingParams
from glm53.raycluster.config import EngineConfig
from glm53.raycluster.engine import LLMEngine

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
NEAR_TIE = 0.05
PARAMS = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=2)
          for n in (20, 5, 24, 13, 9, 17, 3, 11)]
NO_LOGPROBS = [dataclasses.replace(p, logprobs=None) for p in PARAMS]


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    return str(tiny_checkpoint)


def _run(engine: LLMEngine, params=PARAMS) -> list[tuple[list[int], list]]:
    """Two requests arrive per step while others decode and finish."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 272, n).tolist() for n in (1, 7, 30, 4, 17, 2, 45, 9)]
    tokens: dict[str, list[int]] = {}
    lps: dict[str, list] = {}
    ids, pending = [], list(zip(prompts, params, strict=True))
    while pending or engine.has_unfinished:
        for _ in range(min(2, len(pending))):
            ids.append(engine.add_request(*pending.pop(0)))
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            lps.setdefault(out.request_id, []).extend(out.logprobs or [])
    assert engine.dead is None
    return [(tokens[i], lps[i]) for i in ids]


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlapped"])
@pytest.mark.parametrize("k", [0, 1, 3])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graphs_match_eager(tiny, dtype, k, overlap):
    spec = {"speculative_method": "mtp", "num_speculative_tokens": k} if k else {}
    kw = dict(model=tiny, dtype=dtype, device="cuda", num_blocks=256, max_num_seqs=6,
              max_num_batched_tokens=48, **spec)
    eager_engine = LLMEngine(EngineConfig(enforce_eager=True, **kw))
    assert eager_engine.executor.runner.graphs is None
    eager = _run(eager_engine)
    graph_engine = LLMEngine(EngineConfig(async_scheduling=overlap, **kw))
    graphs = graph_engine.executor.runner.graphs
    assert graphs is not None and graphs.graphs, "capture failed (see the log)"
    assert graphs.batch_sizes == (1, 2, 4, 6)
    # greedy MTP: every bucket ends in a graph after acceptance (commit + drafts), one for
    # each number of draft passes, 0 (the MTP cache rows only) to k
    assert len(graphs.accepted_graphs) == (len(graphs.graphs) * (k + 1) if k else 0)
    replayed = _run(graph_engine, NO_LOGPROBS if overlap else PARAMS)
    assert graphs.num_replays >= 5
    if k:
        assert graph_engine.spec_stats.num_drafts > 0
    compared = total = 0
    for (want, want_lp), (got, _) in zip(eager, replayed, strict=True):
        total += len(want)
        split = next((i for i, (a, b) in enumerate(zip(want, got, strict=True)) if a != b),
                     None)
        if split is None:
            compared += len(want)
            continue
        assert dtype == "bfloat16", (want, got)
        top = want_lp[split].top
        assert top[0][1] - top[1][1] < NEAR_TIE, (split, top)
        compared += split
    assert compared >= 0.8 * total


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlapped"])
def test_adaptive_widths_through_graphs_match_eager(tiny, overlap):
    """Adaptive draft length with the width forced through stretches of 0 (the graph after a
    step writes only the MTP cache rows, from the samples on the device) and of 3: fp32
    greedy tokens equal the eager engine's, and the 0-pass graphs really ran."""
    kw = dict(model=tiny, dtype="float32", device="cuda", num_blocks=256, max_num_seqs=6,
              max_num_batched_tokens=48, speculative_method="mtp", num_speculative_tokens=3,
              adaptive_drafts=True)

    def forced(engine: LLMEngine) -> LLMEngine:
        turns = iter([0, 0, 0, 0, 3, 3, 3] * 100)
        engine.draft_policy.choose = lambda request_ids: next(turns)
        return engine

    eager_engine = forced(LLMEngine(EngineConfig(enforce_eager=True, **kw)))
    eager = [t for t, _ in _run(eager_engine, NO_LOGPROBS)]
    graph_engine = forced(LLMEngine(EngineConfig(async_scheduling=overlap, **kw)))
    cache_only = []  # replays of the graphs after acceptance with no draft pass
    for (_, passes), (graph, _) in graph_engine.executor.runner.graphs.accepted_graphs.items():
        if passes == 0:
            def counted(replay=graph.replay):
                cache_only.append(1)
                replay()
            graph.replay = counted
    assert [t for t, _ in _run(graph_engine, NO_LOGPROBS)] == eager
    assert eager_engine.spec_stats.num_drafts > 0 and graph_engine.spec_stats.num_drafts > 0
    assert len(cache_only) >= 5


def test_capture_takes_no_more_than_the_plan_reserves(tiny):
    """The device memory a capture of the decode graphs takes stays within what the memory
    plan reserves for them (memory_plan.graph_workspace: the one set of outputs every graph
    shares, exact, and the largest graph's scratch, estimated per row) at 32 slots with MTP3
    and adaptive draft length: 7 buckets x widths 1-4, each with the graphs after acceptance
    for 0-3 draft passes (140 graphs into one pool). Measured as mem_get_info's drop over the
    capture, its eager warm-ups included, after a first capture paid the one-time costs that
    the plan's OVERHEAD_BYTES covers (Triton kernel images for these shapes); the new side
    stream's cuBLAS workspace still counts here. The tiny model's outputs are small, so this
    bounds the capture as a whole; the real model's rows are hand-counted in
    test_memory_plan.py."""
    slots, k = 32, 3
    runner = ModelRunner(tiny, device="cuda", dtype="bfloat16", num_slots=slots,
                         num_blocks=512, with_mtp=True, num_spec=k, adaptive_drafts=True,
                         enforce_eager=True)  # no capture in allocate_caches
    runner.allocate_caches(512)

    def capture():
        graphs = runner.make_graphs(capture=True)
        assert graphs.batch_sizes == (1, 2, 4, 8, 16, 24, 32)
        assert graphs.widths == (1, 2, 3, 4)
        assert len(graphs.graphs) == 28 and len(graphs.accepted_graphs) == 28 * (k + 1)
        return graphs

    first = capture()
    # let the first capture go: its graphs, its pool, and its outputs, which the KDA layers'
    # pending replay (set by the last warm-up) still points into
    for attn in first.kda.values():
        attn.pending = None
    del first
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free = torch.cuda.mem_get_info()[0]
    graphs = capture()
    torch.cuda.synchronize()
    used = free - torch.cuda.mem_get_info()[0]
    budget = graph_workspace(runner.config, num_slots=slots, num_spec=k,
                             max_model_len=runner.max_model_len, dtype=torch.bfloat16)
    assert graphs.outputs.nbytes < budget
    assert 0 < used <= budget, (f"the capture took {used / MiB:.1f} MiB, the plan reserves "
                                f"{budget / MiB:.1f} MiB")
