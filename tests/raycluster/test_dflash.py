"""DFlash2 speculation on CPU: a tiny draft checkpoint (2 layers, 16-token sliding window,
block 8) proposes up to 7 drafts per step; outputs must equal plain decoding, and its
per-sequence state must stay small next to a KDA state."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from glm53.actors.config import ModelConfig
from glm53.actors.loader import read_config
from glm53.actors.speculative.dflash_model import DFlashConfig, load_draft
from glm53.actors.step import SamplingParams
from glm53.actors.tiny import write_tiny_draft
from glm53.raycluster.config import EngineConfig
from glm53.raycluster.engine import LLMEngine

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_checkpoints):
    root = tmp_path_factory.mktemp("dflash")
    target = tiny_checkpoints(seed=6, layers=5, index_topk=8)
    draft = write_tiny_draft(root / "draft", read_config(target), seed=2)
    return str(target), str(draft)


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [rng.integers(0, 256, n).tolist() for n in (1, 4, 19, 40, 66, 8, 31, 52)]


def _engine(target: str, draft: str | None = None, k: int = 7, **kw) -> LLMEngine:
    spec = ({"speculative_method": "dflash", "num_speculative_tokens": k, "draft_model": draft}
            if draft else {})
    return LLMEngine(EngineConfig(model=target, num_blocks=256, max_num_batched_tokens=48,
                                  **spec, **kw))


def test_dflash_greedy_equals_plain_decoding(checkpoints):
    target, draft = checkpoints
    plain = _engine(target).generate(_prompts(), GREEDY)
    engine = _engine(target, draft)
    assert engine.generate(_prompts(), GREEDY) == plain
    stats = engine.spec_stats
    assert stats.num_drafts > 0 and len(stats.drafts_per_position) == 7
    assert stats.drafts_per_position[0] >= stats.drafts_per_position[6] > 0


def test_dflash_fp8_ring_greedy_equals_plain_decoding(checkpoints):
    """draft_kv_cache_dtype fp8: the ring holds e4m3 rows (tests/actors/test_dflash_fp8_ring.py
    measures how close its drafts are); verification is exact, so the output is plain
    decoding's whatever is drafted, and drafts are still accepted."""
    target, draft = checkpoints
    plain = _engine(target).generate(_prompts(), GREEDY)
    engine = _engine(target, draft, draft_kv_cache_dtype="fp8")
    assert engine.generate(_prompts(), GREEDY) == plain
    assert engine.executor.runner.proposer.ring.dtype == torch.uint8
    stats = engine.spec_stats
    assert stats.num_drafts > 0 and sum(stats.accepted_per_position) > 0
    with pytest.raises(ValueError, match="draft_kv_cache_dtype is the DFlash draft's ring"):
        EngineConfig(model=target, speculative_method="mtp", num_speculative_tokens=3,
                     draft_kv_cache_dtype="fp8")


def test_dflash_seeded_sampling_equals_plain(checkpoints):
    target, draft = checkpoints
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=5, ignore_eos=True)
    prompts = _prompts()[:4]
    assert _engine(target, draft, k=3).generate(prompts, params) == \
        _engine(target).generate(prompts, params)


def test_draft_checkpoint_is_loaded_strictly(checkpoints, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    _, draft = checkpoints
    broken = tmp_path / "broken"
    shutil.copytree(draft, broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["layers.1.mlp_conv.base_kernel"]
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(ValueError, match="layers.1.mlp_conv.base_kernel"):
        load_draft(broken, dtype=__import__("torch").float32, device="cpu")


def _kda_state_bytes(cfg: ModelConfig) -> int:
    per_layer = (cfg.linear_num_heads * cfg.linear_head_dim**2 * 4
                 + 3 * cfg.linear_dim * (cfg.linear_conv_kernel - 1) * 2)
    return len(cfg.kda_layers) * per_layer


def test_dflash_state_per_sequence_within_two_kda_states(checkpoints):
    target, draft = checkpoints
    engine = _engine(target, draft)
    proposer = engine.executor.runner.proposer
    tiny_kda = _kda_state_bytes(engine.model_config)
    ring = proposer.state_bytes_per_sequence
    print(f"tiny: KDA state {tiny_kda} B, DFlash ring {ring} B per sequence")
    assert tiny_kda + ring <= 2 * tiny_kda
    # the real pair: GLM-5.3-Flash KDA state vs the DFlash2 drafter's 2048-token window
    real = ModelConfig.from_hf({"num_hidden_layers": 45})
    cfg = DFlashConfig(hidden_size=4096, intermediate_size=12288, num_layers=5, num_heads=32,
                       num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=1e4,
                       sliding_window=2048, block_size=8, mask_token_id=154856,
                       target_layer_ids=(5, 14, 24, 33, 42), conv_group_size=16,
                       selector_rank=256, selector_top_k=16, vocab_size=154880)
    real_ring = cfg.num_layers * 2 * cfg.sliding_window * cfg.num_kv_heads * cfg.head_dim * 2
    print(f"GLM-5.3-Flash: KDA state {_kda_state_bytes(real) / 2**20:.1f} MiB, DFlash2 ring "
          f"{real_ring / 2**20:.1f} MiB per sequence")
    assert _kda_state_bytes(real) + real_ring <= 2 * _kda_state_bytes(real)


def test_dflash_overlapped_equals_plain_decoding(checkpoints):
    """Overlapped scheduling: steps verify DFlash drafts before the engine has seen them (the
    worker settles tokens and positions from the step before); output still equals plain."""
    target, draft = checkpoints
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    prompts = _prompts()[:4]
    engine = _engine(target, draft, k=3, async_scheduling=True)
    submit, continued = engine.executor.submit, []

    def counting(step):
        continued.append(step.previous_seqs is not None)
        return submit(step)

    engine.executor.submit = counting
    assert engine.generate(prompts, params) == _engine(target).generate(prompts, params)
    assert any(continued)


def test_drafting_in_chunks_drafts_the_same(checkpoints, monkeypatch):
    """With many resident requests the proposer drafts DRAFT_CHUNK sequences per forward (a
    bounded transient, in the memory plan's reserve): chunks of 3 over 8 sequences propose
    what one forward does (same acceptance counts) and the output stays plain decoding's."""
    from glm53.actors.speculative import dflash

    target, draft = checkpoints
    whole = _engine(target, draft)
    out = whole.generate(_prompts(), GREEDY)
    monkeypatch.setattr(dflash, "DRAFT_CHUNK", 3)
    chunked = _engine(target, draft)
    assert chunked.generate(_prompts(), GREEDY) == out
    assert chunked.spec_stats.num_drafts == whole.spec_stats.num_drafts
    assert chunked.spec_stats.accepted_per_position == whole.spec_stats.accepted_per_position
