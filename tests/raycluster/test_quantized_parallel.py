"""4-bit routed experts under TP / EP / DCP on CPU (Ray actors, gloo): every layout reproduces
TP1 token for token (greedy) and its prompt logprobs within 1e-4 (fp32), for EXL3 checkpoints
and for experts quantised to int4 while loading; each rank holds only its experts' codes."""

from __future__ import annotations

import numpy as np
import pytest

from glm53.raycluster.engine import LLMEngine
from glm53.raycluster.executor import RayExecutor

from .test_parallel import _config, _prompts, _run

# the full tier (make test-all, CI): runs TP/EP/DCP engines as Ray worker actors
pytestmark = pytest.mark.slow

# EXL3 shards never cut a 128-wide Hadamard block: TP-sharded experts (no EP) need an expert
# width of 2 x 128, the EP layouts keep whole experts
EXL3_LAYOUTS = {"tp2": (2, 1, 1), "ep2": (1, 2, 1), "tp2-ep2-dcp2": (2, 2, 2)}
INT4_LAYOUTS = {"tp2": (2, 1, 1), "ep2": (1, 2, 1), "tp2-ep2-dcp2": (2, 2, 2)}


@pytest.fixture(scope="module")
def exl3_tiny(tiny_checkpoints):
    return str(tiny_checkpoints(seed=8, layers=5, index_topk=8, exl3=True,
                                moe_intermediate_size=256))


@pytest.fixture(scope="module")
def dense_tiny(tiny_checkpoints):
    # expert width 128: int4 groups (64, the hidden size) stay whole when TP halves the down
    # projection's input
    return str(tiny_checkpoints(seed=9, layers=5, index_topk=8, moe_intermediate_size=128))


def _reference(path: str, **kw):
    engine = LLMEngine(_config(path, **kw))
    prompts = _prompts(engine.model_config.vocab_size)
    return prompts, _run(engine, prompts)


def _check_layout(path: str, layout: tuple[int, int, int], reference, **kw) -> None:
    prompts, (ref_tokens, ref_logprobs) = reference
    engine = LLMEngine(_config(path, *layout, **kw))
    try:
        tokens, logprobs = _run(engine, prompts)
    finally:
        engine.shutdown()
    assert tokens == ref_tokens
    for ours, ref in zip(logprobs, ref_logprobs, strict=True):
        assert ours.shape == ref.shape and np.abs(ours - ref).max() <= 1e-4


@pytest.fixture(scope="module")
def exl3_reference(exl3_tiny):
    return _reference(exl3_tiny)


@pytest.fixture(scope="module")
def int4_reference(dense_tiny):
    return _reference(dense_tiny, quantize_experts="int4")


@pytest.mark.parametrize("layout", sorted(EXL3_LAYOUTS))
def test_exl3_layout_matches_tp1(ray_session, exl3_tiny, exl3_reference, layout):
    _check_layout(exl3_tiny, EXL3_LAYOUTS[layout], exl3_reference)


@pytest.mark.parametrize("layout", sorted(INT4_LAYOUTS))
def test_int4_layout_matches_tp1(ray_session, dense_tiny, int4_reference, layout):
    _check_layout(dense_tiny, INT4_LAYOUTS[layout], int4_reference, quantize_experts="int4")


def test_each_rank_holds_only_its_expert_codes(ray_session, exl3_tiny):
    full = RayExecutor(_config(exl3_tiny), channel="ray")
    tp = RayExecutor(_config(exl3_tiny, 2, 1, 1), channel="ray")
    try:
        (whole,) = full.parameter_bytes()
        ranks = tp.parameter_bytes()
    finally:
        full.shutdown()
        tp.shutdown()
    experts = [n for n in whole if ".mlp.experts." in n]
    assert experts
    for name in experts:
        per_rank = [r[name] for r in ranks]
        if name.endswith(("w13_suh", "w2_svh")):  # the side TP does not cut is replicated
            assert per_rank == [whole[name]] * 2, name
        else:
            assert per_rank == [whole[name] // 2] * 2, name
