"""Quantised latent cache (fp8 / nvfp4) in the model and the engine, on CPU with tiny models.

KLD bounds (mean over every prompt position, float64, teacher = the model-dtype fp32 cache;
the quantised caches also hold fp8 pool keys): fp8 < 0.015 and nvfp4 < 0.03; measured on the
session checkpoint 0.0057 and 0.0083 (other seeds of the same spec: 0.0005-0.0028 and
0.0039-0.0085), bf16 latents ~2e-7. Tiny random checkpoints have near-flat next-token
distributions, which exaggerate any error. nvfp4 must also cost more than fp8 and fp8 more
than a bf16 cache, or the formats are not what they claim.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from glm53.actors import kv_scale_bank
from glm53.actors.caches import ModelCaches, cache_bytes, plan_cache
from glm53.actors.config import ModelConfig
from glm53.actors.kld import CacheSpec, kl_rows, window_logits
from glm53.actors.loader import load_model, read_config
from glm53.actors.release import release_config
from glm53.actors.step import SamplingParams
from glm53.actors.tiny import tiny_text_config, write_tiny_draft
from glm53.raycluster.config import EngineConfig
from glm53.raycluster.engine import LLMEngine
from tests.tiny import FP8_KLD_BOUND, NVFP4_KLD_BOUND

BLOCK = 16
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint, tmp_path_factory):
    """A copy of the session checkpoint: the scale bank is written into it."""
    return Path(shutil.copytree(tiny_checkpoint, tmp_path_factory.mktemp("kvq") / "tiny"))


@pytest.fixture(scope="module")
def model(tiny):
    return load_model(tiny, progress=False, with_mtp=True)


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, length).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def bank(tiny, model):
    """The tiny checkpoint's scale bank, written next to it (where engines look for it)."""
    data = kv_scale_bank.calibrate(model, _prompts(2, 48, seed=1))
    kv_scale_bank.write_bank(data, tiny / kv_scale_bank.BANK_FILE)
    return data


def test_cache_bytes_per_token_match_the_design_for_glm53():
    """glm53-model.md 4.2, 11 DSA layers: fp8-528 latents + fp8 pool keys (132 B a pool of 4)
    = 6,171 B per token, nvfp4 + pool keys = 3,707; bf16 keeps bf16 latents and pool keys."""
    cfg = ModelConfig.from_hf(release_config())
    per_token = {d: cache_bytes(cfg, 16, torch.bfloat16, False, kv_cache_dtype=d)[0] / 16
                 for d in ("auto", "fp8", "nvfp4")}
    assert per_token == {"auto": 11 * (1024 + 64), "fp8": 6171, "nvfp4": 3707}
    plans = {d: plan_cache(cfg, 16, 1, torch.bfloat16, False, budget_bytes=2**30,
                           kv_cache_dtype=d) for d in ("auto", "fp8", "nvfp4")}
    assert plans["nvfp4"].tokens_per_gib == 2**30 / 3707
    assert plans["auto"].tokens_per_gib < plans["fp8"].tokens_per_gib
    assert "kv_cache_dtype nvfp4: 289,653 tokens per GiB" in plans["nvfp4"].describe(4096)


def test_widths_a_quantised_cache_cannot_pack_are_refused():
    odd_latent = ModelConfig.from_hf(tiny_text_config(5, kv_lora_rank=40))
    with pytest.raises(ValueError, match="multiple of 16, not 40"):
        cache_bytes(odd_latent, 16, torch.float32, False, kv_cache_dtype="fp8")
    odd_keys = ModelConfig.from_hf(tiny_text_config(5, index_head_dim=48))
    with pytest.raises(ValueError, match="power-of-two index_head_dim, not 48"):
        cache_bytes(odd_keys, 16, torch.float32, False, kv_cache_dtype="nvfp4")
    cache_bytes(odd_keys, 16, torch.float32, False, kv_cache_dtype="bf16")  # unpacked: fine


def test_caches_hold_packed_rows_and_nvfp4_needs_every_layer_scale(model):
    cfg = model.config
    caches = ModelCaches.allocate(cfg, 3, BLOCK, 1, torch.float32, with_mtp=True,
                                  kv_cache_dtype="fp8")
    assert caches.layers[3].latent.dtype == torch.uint8
    assert caches.layers[3].latent.shape[-1] == cfg.kv_lora_rank + 4
    assert caches.layers[3].pool_keys.shape[-1] == cfg.index_head_dim + 4  # fp8 rows
    assert caches.mtp.latent_format == "fp8"
    with pytest.raises(ValueError, match="outer scale for layer mtp.*calibrate-kv"):
        ModelCaches.allocate(cfg, 3, BLOCK, 1, torch.float32, with_mtp=True,
                             kv_cache_dtype="nvfp4", kv_scales={"3": 1.0})


def test_calibration_is_deterministic_and_covers_every_dsa_layer(model, tiny, tmp_path):
    prompts = _prompts(1, 24, seed=2)
    first = kv_scale_bank.write_bank(kv_scale_bank.calibrate(model, prompts), tmp_path / "a")
    again = kv_scale_bank.write_bank(kv_scale_bank.calibrate(model, prompts), tmp_path / "b")
    assert first.read_bytes() == again.read_bytes()
    bank = json.loads(first.read_text())
    assert set(bank["scales"]) == {"3", "mtp"}
    for key, scale in bank["scales"].items():
        amax = bank["amax"][key]
        # the smallest power of two that covers amax with the headroom
        assert amax <= 6 * 448 * scale * kv_scale_bank.HEADROOM < 2 * amax
    assert kv_scale_bank.load_scale_bank(first) == bank["scales"]
    other = kv_scale_bank.calibrate(model, _prompts(1, 24, seed=3))
    assert other["prompts_sha256"] != bank["prompts_sha256"]


def test_a_missing_or_malformed_bank_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="glm53 calibrate-kv"):
        kv_scale_bank.load_scale_bank(tmp_path / "none.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": kv_scale_bank.BANK_FORMAT, "scales": {"3": 0.3}}))
    with pytest.raises(ValueError, match="layer 3.*power of two"):
        kv_scale_bank.load_scale_bank(bad)


def test_quantised_cache_kld_vs_full_precision_cache_is_bounded(model, bank):
    """Every prompt position (the last included: no next token is needed for KL)."""
    kld = {}
    prompts = _prompts(2, 64, seed=4)
    teacher = [window_logits(model, ids, CacheSpec("auto", block_size=BLOCK)) for ids in prompts]
    for dtype in ("bf16", "fp8", "nvfp4"):
        spec = CacheSpec(dtype, bank["scales"], BLOCK)
        kls = [kl_rows(p, window_logits(model, ids, spec))[0]
               for ids, p in zip(prompts, teacher, strict=True)]
        kld[dtype] = float(torch.cat(kls).mean())
    assert kld["fp8"] < FP8_KLD_BOUND and kld["nvfp4"] < NVFP4_KLD_BOUND, kld
    assert kld["bf16"] < kld["fp8"] < kld["nvfp4"], kld


@pytest.mark.parametrize("dtype", ["fp8", "nvfp4"])
def test_mtp3_with_quantised_cache_equals_plain_decoding(tiny, bank, dtype):
    prompts = _prompts(2, 37, seed=5) + [[7, 8, 9]]

    def run(k: int) -> list[list[int]]:
        spec = {"speculative_method": "mtp", "num_speculative_tokens": k} if k else {}
        engine = LLMEngine(EngineConfig(model=str(tiny), num_blocks=64, block_size=8,
                                        max_num_batched_tokens=24, kv_cache_dtype=dtype, **spec))
        assert engine.executor.cache_plan.kv_cache_dtype == dtype
        return engine.generate(prompts, GREEDY)

    assert run(3) == run(0)


@pytest.mark.slow
def test_dflash_with_a_quantised_cache_equals_plain_decoding(tiny, tmp_path):
    """The DFlash2 drafter keeps its own model-dtype cache (as the reference's did); the
    target's fp8 cache serves its verify steps."""
    draft = str(write_tiny_draft(tmp_path / "draft", read_config(tiny), seed=2))
    prompts = _prompts(2, 29, seed=6)

    def engine(**spec) -> LLMEngine:
        return LLMEngine(EngineConfig(model=str(tiny), num_blocks=64, block_size=8,
                                      max_num_batched_tokens=24, kv_cache_dtype="fp8", **spec))

    drafting = engine(speculative_method="dflash", num_speculative_tokens=7, draft_model=draft)
    assert drafting.generate(prompts, GREEDY) == engine().generate(prompts, GREEDY)
    assert drafting.spec_stats.num_drafts > 0
    assert drafting.executor.runner.caches.layers[3].latent.dtype == torch.uint8


def test_engine_refuses_a_scale_bank_without_nvfp4(tiny):
    with pytest.raises(ValueError, match="kv_scale_bank.*nvfp4"):
        EngineConfig(model=str(tiny), kv_cache_dtype="fp8", kv_scale_bank="x.json")
