"""Adaptive draft length in the engine (CPU, tiny checkpoint): output equal to plain decoding,
and with forced acceptance the chosen widths follow the cost model."""

from __future__ import annotations

import json

import numpy as np
import pytest

from glm53.actors.speculative.verify import SyntheticAcceptance
from glm53.actors.step import SamplingParams
from glm53.raycluster.config import EngineConfig
from glm53.raycluster.engine import LLMEngine
from glm53.raycluster.executor import make_executor

from .test_speculative import OracleProposer

K = 3


@pytest.fixture(scope="module")
def tiny(tiny_checkpoints):
    return str(tiny_checkpoints(seed=5, layers=5, mtp=True, index_topk=8))


@pytest.fixture(scope="module")
def cost_table(tmp_path_factory):
    """A verify costs a fifth of a plain step per draft: drafts pay from ~20% acceptance."""
    path = tmp_path_factory.mktemp("cost") / "latency.json"
    rows = [{"speculative": "none" if w == 0 else f"mtp:{w}", "batch": b, "context": 64,
             "step_ms_median": 10.0 + 2.0 * w} for b in (1, 8) for w in range(K + 1)]
    path.write_text(json.dumps({"results": rows}))
    return str(path)


def _config(tiny: str, adaptive: bool, cost_table: str | None = None, **kw) -> EngineConfig:
    spec = dict(speculative_method="mtp", num_speculative_tokens=K, adaptive_drafts=True,
                draft_cost_table=cost_table) if adaptive else {}
    # no prefix cache: its cuts of the prefill chunks would move the steps the widths are
    # chosen at (test_prefix_cache.py checks caching with speculation)
    return EngineConfig(model=tiny, num_blocks=256, max_num_batched_tokens=64,
                        enable_prefix_caching=False, **spec, **kw)


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(2)
    return [rng.integers(0, 256, n).tolist() for n in (3, 17, 40, 9)]


GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)


@pytest.mark.slow
def test_adaptive_output_equals_plain_decoding_with_mtp_drafts(tiny):
    plain = LLMEngine(_config(tiny, adaptive=False)).generate(_prompts(), GREEDY)
    engine = LLMEngine(_config(tiny, adaptive=True))  # the default (unmeasured) cost table
    assert engine.generate(_prompts(), GREEDY) == plain
    stats = engine.stats()
    assert sum(stats.spec_draft_length_steps) > 0
    assert stats.spec_num_draft_tokens > 0  # drafts were really verified


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlapped"])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_adaptive_output_equals_plain_decoding_at_every_width(tiny, cost_table, params,
                                                              overlap):
    """Drafts from the plain continuation, corrupted by turns (all right, none, the first or
    the last wrong): acceptance moves, and so does the chosen width. Overlapped, each width
    is chosen before the step in flight has settled its drafts (it drops those beyond it)."""
    prompts = _prompts()
    plain = LLMEngine(_config(tiny, adaptive=False)).generate(prompts, params)
    engine = LLMEngine(_config(tiny, adaptive=True, cost_table=cost_table,
                               async_scheduling=overlap))
    ids = [engine.add_request(p, params) for p in prompts]
    full = {i: p + o for i, p, o in zip(ids, prompts, plain, strict=True)}
    engine.executor.runner.proposer = OracleProposer(full, K, skip=not overlap)
    out = {i: [] for i in ids}
    while engine.has_unfinished:
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    assert [out[i] for i in ids] == plain
    stats = engine.stats()
    assert sum(n > 0 for n in stats.spec_draft_length_steps) >= 2  # several widths chosen
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens


def _synthetic_engine(tiny: str, cost_table: str, p: float) -> LLMEngine:
    config = _config(tiny, adaptive=True, cost_table=cost_table)
    executor = make_executor(config)
    executor.runner.verify_drafts = SyntheticAcceptance([p] * K)
    return LLMEngine(config, executor)


def _widths(engine: LLMEngine, steps: int) -> tuple[list[int], list[int]]:
    """Run one long request: the width each step chose, and the drafts it verified; checks
    that no step verifies or proposes more drafts than it chose."""
    engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=400, ignore_eos=True))
    spec, execute = engine.spec_stats, engine.executor.execute
    inputs = []
    engine.executor.execute = lambda step: (inputs.append(step), execute(step))[1]
    widths, verified = [], []
    for _ in range(steps):
        chosen = list(spec.steps_by_draft_length)
        engine.step()
        width = [w for w in range(K + 1) if spec.steps_by_draft_length[w] > chosen[w]]
        step = inputs[-1]
        if width:  # not the first (prefill) step, which has nothing running yet
            assert step.num_drafts.max() <= width[0] and step.propose.max() <= width[0]
        widths.extend(width)
        verified.append(int(step.num_drafts.sum()))
    return widths, verified


def test_backs_off_to_no_drafts_when_acceptance_is_near_zero(tiny, cost_table):
    engine = _synthetic_engine(tiny, cost_table, 0.02)
    widths, verified = _widths(engine, 80)
    assert sum(verified[:5]) > 0  # it tried them first (the prior is optimistic)
    late = widths[30:]
    assert sum(w == 0 for w in late) >= 0.85 * len(late)
    assert sum(verified[30:]) <= 0.15 * K * len(late)  # and dropped them unverified


def test_verifies_every_draft_when_acceptance_is_near_one(tiny, cost_table):
    engine = _synthetic_engine(tiny, cost_table, 1.0)
    widths, verified = _widths(engine, 30)
    assert len(widths) == 29 and widths[4:] == [K] * 25  # the prefill step chose none
    assert verified[5:] == [K] * 25
    per_pos = engine.stats().spec_accepted_per_pos
    assert per_pos == engine.stats().spec_draft_tokens_per_pos and min(per_pos) > 0
