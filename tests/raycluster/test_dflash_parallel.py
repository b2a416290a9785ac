"""DFlash2 drafts under TP on CPU (Ray actors, gloo): the draft's attention and MLP are sharded
like the target's (each rank keeps half of the KV heads in its ring, o_proj and down_proj
all-reduced), and every layout must draft what TP1 drafts: the same tokens (greedy, equal to
plain decoding), the same draft ids step by step, the same acceptance counts."""

from __future__ import annotations

import numpy as np
import pytest

from glm53.actors.loader import read_config
from glm53.actors.step import SamplingParams
from glm53.actors.tiny import write_tiny_draft
from glm53.raycluster.config import EngineConfig
from glm53.raycluster.engine import LLMEngine

# the full tier (make test-all, CI): runs TP engines as Ray worker actors
pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
LAYOUTS = {"tp2": (2, 1, 1), "tp2-ep2-dcp2": (2, 2, 2)}
RINGS = ("auto", "fp8")  # draft_kv_cache_dtype: each rank's fp8 rows are its heads' rows


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoints, tmp_path_factory):
    target = tiny_checkpoints(seed=4, layers=5, index_topk=8)
    draft = write_tiny_draft(tmp_path_factory.mktemp("dflash-tp") / "draft", read_config(target),
                             seed=2)
    return str(target), str(draft)


def _generate(engine: LLMEngine) -> tuple[list[list[int]], list[list[int]]]:
    """(tokens per prompt, the draft ids rank 0 returned, step by step)."""
    execute, drafts = engine.executor.execute, []

    def recording(step):
        out = execute(step)
        if out.draft_ids is not None:
            drafts.append(np.asarray(out.draft_ids).tolist())
        return out

    engine.executor.execute = recording
    return engine.generate(_prompts(), GREEDY), drafts


def _engine(target: str, draft: str | None, tp: int = 1, ep: int = 1, dcp: int = 1,
            ring: str = "auto") -> LLMEngine:
    spec = ({"speculative_method": "dflash", "num_speculative_tokens": 7, "draft_model": draft,
             "draft_kv_cache_dtype": ring} if draft else {})
    return LLMEngine(EngineConfig(model=target, num_blocks=96, block_size=8,
                                  max_num_batched_tokens=24, tensor_parallel_size=tp,
                                  expert_parallel_size=ep, decode_context_parallel_size=dcp,
                                  **spec))


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(0, 256, n).tolist() for n in (45, 3, 30, 17)]  # 45 > the 16 window


@pytest.fixture(scope="module")
def reference(checkpoints):
    """ring -> TP1's (tokens, draft ids, spec stats)."""
    target, draft = checkpoints
    plain = _engine(target, None).generate(_prompts(), GREEDY)
    out = {}
    for ring in RINGS:
        engine = _engine(target, draft, ring=ring)
        tokens, drafts = _generate(engine)
        assert tokens == plain
        assert engine.spec_stats.num_drafts > 0 and len(drafts) > 5
        out[ring] = tokens, drafts, engine.spec_stats
    return out


# the fp8 ring on the layout that shards everything (each rank packs its own heads' rows)
@pytest.mark.parametrize(("layout", "ring"), [*((layout, "auto") for layout in sorted(LAYOUTS)),
                                              ("tp2-ep2-dcp2", "fp8")])
def test_dflash_layout_drafts_what_tp1_drafts(ray_session, checkpoints, reference, layout,
                                              ring):
    target, draft = checkpoints
    ref_tokens, ref_drafts, ref_stats = reference[ring]
    engine = _engine(target, draft, *LAYOUTS[layout], ring=ring)
    try:
        tokens, drafts = _generate(engine)
        stats = engine.spec_stats
    finally:
        engine.shutdown()
    assert tokens == ref_tokens
    assert drafts == ref_drafts
    assert stats.accepted_per_position == ref_stats.accepted_per_position
