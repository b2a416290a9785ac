"""Quantised latent caches under TP / DCP (and MTP3 drafts) on CPU (Ray actors, gloo): with the
same fp8 or nvfp4 cache, every layout reproduces TP1 without drafts token for token (greedy)
and its prompt logprobs within 1e-4 (fp32). Each rank quantises the rows it stores the same
way (the latent is replicated under TP; DCP splits rows, not their values)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from glm53.actors import kv_scale_bank
from glm53.actors.loader import load_model
from glm53.raycluster.engine import LLMEngine

from .test_parallel import _config, _prompts, _run

# the full tier (make test-all, CI): runs TP/DCP engines as Ray worker actors
pytestmark = pytest.mark.slow

MTP3 = {"speculative_method": "mtp", "num_speculative_tokens": 3}
LAYOUTS = {"tp2": ((2, 1, 1), {}), "dcp2": ((1, 1, 2), {}), "tp2-dcp2-mtp3": ((2, 1, 2), MTP3)}


@pytest.fixture(scope="module")
def tiny(tiny_checkpoints, tmp_path_factory):
    # a copy: the scale bank is written into it
    path = Path(shutil.copytree(tiny_checkpoints(seed=4, layers=5, index_topk=8, mtp=True),
                                tmp_path_factory.mktemp("kvq-parallel") / "tiny"))
    model = load_model(path, progress=False, with_mtp=True)
    rng = np.random.default_rng(2)
    bank = kv_scale_bank.calibrate(model, [rng.integers(0, 256, 48).tolist()])
    kv_scale_bank.write_bank(bank, path / kv_scale_bank.BANK_FILE)
    return str(path)


@pytest.fixture(scope="module", params=["fp8", "nvfp4"])
def reference(request, tiny):
    engine = LLMEngine(_config(tiny, kv_cache_dtype=request.param))
    prompts = _prompts(engine.model_config.vocab_size)
    return request.param, prompts, _run(engine, prompts)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_quantised_cache_layout_matches_tp1(ray_session, tiny, reference, layout):
    dtype, prompts, (ref_tokens, ref_logprobs) = reference
    sizes, spec = LAYOUTS[layout]
    engine = LLMEngine(_config(tiny, *sizes, kv_cache_dtype=dtype, **spec))
    try:
        assert engine.executor.cache_plan.kv_cache_dtype == dtype
        tokens, logprobs = _run(engine, prompts)
        assert not spec or engine.spec_stats.num_drafts > 0
    finally:
        engine.shutdown()
    assert tokens == ref_tokens
    for ours, ref in zip(logprobs, ref_logprobs, strict=True):
        assert ours.shape == ref.shape and np.abs(ours - ref).max() <= 1e-4
