"""TP / EP / DCP on CPU: one Ray actor per fake GPU, gloo collectives, the shared-memory step
channel. Every layout must reproduce TP1 token for token (greedy) and its logits within 1e-4
(fp32), with each rank holding only its shard; a dead worker fails requests, not the caller."""

from __future__ import annotations

import re
import threading
import time

import numpy as np
import pytest

from glm53.actors.step import SamplingParams
from glm53.raycluster.config import EngineConfig
from glm53.raycluster.engine import EngineDeadError, LLMEngine
from glm53.raycluster.executor import RayExecutor, WorkerError
from glm53.raycluster.request import FinishReason

# the full tier (make test-all, CI): runs TP/EP/DCP engines as Ray worker actors
pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
LAYOUTS = {"tp2": (2, 1, 1), "ep2": (1, 2, 1), "dcp2": (1, 1, 2), "tp2-ep2-dcp2": (2, 2, 2)}


@pytest.fixture(scope="module")
def tiny(tiny_checkpoints):
    return str(tiny_checkpoints(seed=4, layers=5, index_topk=8))


def _config(path: str, tp: int = 1, ep: int = 1, dcp: int = 1, **kw) -> EngineConfig:
    return EngineConfig(model=path, num_blocks=96, block_size=8, max_num_batched_tokens=24,
                        tensor_parallel_size=tp, expert_parallel_size=ep,
                        decode_context_parallel_size=dcp, **kw)


def _prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, vocab, n).tolist() for n in (45, 3, 70, 17)]  # up to ~9x index_topk


def _run(engine: LLMEngine, prompts) -> tuple[list[list[int]], list[np.ndarray]]:
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    tokens = {i: [] for i in ids}
    logprobs = {i: [] for i in ids}
    while engine.has_unfinished:
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            logprobs[out.request_id] += [lp.logprob for lp in out.prompt_logprobs or []]
    return [tokens[i] for i in ids], [np.array(logprobs[i]) for i in ids]


@pytest.fixture(scope="module")
def reference(tiny):
    engine = LLMEngine(_config(tiny))
    prompts = _prompts(engine.model_config.vocab_size)
    return prompts, _run(engine, prompts)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layout_matches_tp1(ray_session, tiny, reference, layout):
    prompts, (ref_tokens, ref_logprobs) = reference
    engine = LLMEngine(_config(tiny, *LAYOUTS[layout]))
    try:
        tokens, logprobs = _run(engine, prompts)
    finally:
        engine.shutdown()
    assert tokens == ref_tokens
    for ours, ref in zip(logprobs, ref_logprobs, strict=True):
        assert ours.shape == ref.shape and np.abs(ours - ref).max() <= 1e-4


@pytest.fixture(scope="module")
def mtp_reference(tiny_checkpoints):
    """(checkpoint with MTP weights, prompts, TP1's synchronous tokens and logprobs): the same
    reference for every overlapped run."""
    path = str(tiny_checkpoints(seed=4, layers=5, index_topk=8, mtp=True))
    one = LLMEngine(_config(path))
    prompts = _prompts(one.model_config.vocab_size)
    return path, prompts, _run(one, prompts)


@pytest.mark.parametrize("k", [0, 2], ids=["plain", "mtp2"])
def test_overlapped_execution_matches_tp1(ray_session, mtp_reference, k):
    """Overlapped scheduling through the step channel: the engine sends step N+1 while the
    workers run step N, and they launch it before finishing N (two steps in flight); with MTP
    drafts too (a step verifying them waits for its predecessor's acceptance)."""
    path, prompts, (ref_tokens, ref_logprobs) = mtp_reference
    spec = {"speculative_method": "mtp", "num_speculative_tokens": k} if k else {}
    engine = LLMEngine(_config(path, 2, 2, 2, async_scheduling=True, **spec))
    try:
        tokens, logprobs = _run(engine, prompts)
        drafts = engine.spec_stats.num_drafts if k else None
    finally:
        engine.shutdown()
    assert tokens == ref_tokens
    assert not k or drafts > 0
    for ours, ref in zip(logprobs, ref_logprobs, strict=True):
        assert ours.shape == ref.shape and np.abs(ours - ref).max() <= 1e-4


def test_dcp_multiplies_token_capacity(ray_session, tiny):
    one = LLMEngine(EngineConfig(model=tiny, block_size=8, cache_bytes=2**20))
    two = RayExecutor(EngineConfig(model=tiny, block_size=8, cache_bytes=2**20,
                                   decode_context_parallel_size=2), channel="ray")
    try:
        ratio = two.cache_plan.num_tokens / one.executor.cache_plan.num_tokens
    finally:
        two.shutdown()
    assert 1.5 < ratio <= 2.0  # pooled indexer keys stay replicated, latent rows split


def test_each_rank_holds_only_its_shard(ray_session, tiny):
    full = RayExecutor(_config(tiny), channel="ray")
    split = RayExecutor(_config(tiny, 2, 2, 1), channel="ray")
    try:
        (whole,) = full.parameter_bytes()
        ranks = split.parameter_bytes()
    finally:
        full.shutdown()
        split.shutdown()
    sharded = ("in_proj", "conv_weight", "dt_bias", "A_log", "b_proj",
               "o_proj", "w13", "w2", "embed_tokens", "lm_head", "gate_up_proj",
               "down_proj")  # b_proj: f_b, g_b, q_b, kv_b
    for name, size in whole.items():
        per_rank = [r[name] for r in ranks]
        if any(part in name for part in sharded):
            assert per_rank == [size // 2] * 2, name
        else:
            assert per_rank == [size] * 2, name  # replicated: norms, mHC, router, indexer


def test_indivisible_sizes_are_a_clear_error(ray_session, tiny_checkpoints):
    odd = str(tiny_checkpoints(layers=4, num_attention_heads=3, num_key_value_heads=3))
    with pytest.raises(WorkerError, match=r"rank \d failed to start.*num_attention_heads \(3\) "
                                          r"is not divisible by the parallel size 2"):
        RayExecutor(_config(odd, tp=2), channel="ray")


def test_dead_worker_fails_requests_then_a_new_engine_works(ray_session, tiny):
    engine = LLMEngine(_config(tiny, tp=2))
    prompts = _prompts(engine.model_config.vocab_size)
    ids = [engine.add_request(p, SamplingParams(max_tokens=200, ignore_eos=True,
                                                temperature=0.0)) for p in prompts[:2]]
    engine.step()
    victim = engine.executor.workers[1]
    threading.Timer(0.2, lambda: ray_session.kill(victim)).start()
    start, outputs = time.monotonic(), []
    while engine.has_unfinished and time.monotonic() - start < 30:
        outputs += engine.step()
    assert time.monotonic() - start < 30
    failed = [o for o in outputs if o.finish_reason == FinishReason.ERROR]
    assert sorted(o.request_id for o in failed) == sorted(ids)
    # the dead rank is named (or rank 0, whose collective the death broke)
    assert all(re.search(r"rank \d (died|failed)", o.error) for o in failed)
    with pytest.raises(EngineDeadError):
        engine.add_request([1, 2], GREEDY)
    engine.shutdown()
    fresh = LLMEngine(_config(tiny, tp=2))
    try:
        assert len(fresh.generate([prompts[1]], GREEDY)[0]) == GREEDY.max_tokens
    finally:
        fresh.shutdown()


def test_engine_inside_a_reserved_pair_uses_that_placement_group(ray_session, tiny, reference):
    """A Serve replica reserves [its CPU, GPU, GPU] STRICT_PACK; its engine's workers must go
    into those GPU bundles (same node as the engine, so the shared-memory channel works)."""
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    ray = ray_session
    pg = placement_group([{"CPU": 1}, {"GPU": 1}, {"GPU": 1}], strategy="STRICT_PACK")
    ray.get(pg.ready(), timeout=60)

    @ray.remote(num_cpus=1)
    def serve(path: str, prompts):
        engine = LLMEngine(_config(path, tp=2))
        try:
            ex = engine.executor
            same_pg = ex.pg.id == ray.util.get_current_placement_group().id
            return _run(engine, prompts)[0], same_pg, ex.channel is not None
        finally:
            engine.shutdown()

    prompts, (ref_tokens, _) = reference
    try:
        tokens, same_pg, shm = ray.get(serve.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=0,
                placement_group_capture_child_tasks=True)).remote(tiny, prompts), timeout=300)
    finally:
        remove_placement_group(pg)
    assert same_pg and shm
    assert tokens == ref_tokens
