"""Helpers for checking our model against transformers' Glm5Next (the CPU oracle)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch


def load_hf(model_dir: Path):
    """transformers' Glm5NextForConditionalGeneration in fp32, asserting no text weight is
    missing or mismatched (the vision tower of a tiny checkpoint is absent and irrelevant)."""
    from transformers import Glm5NextForConditionalGeneration
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    model, info = Glm5NextForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32, output_loading_info=True)
    missing = [k for k in info["missing_keys"] if not k.startswith("model.visual.")]
    assert not missing and not info["mismatched_keys"], (missing, info["mismatched_keys"])
    return model.eval()


@torch.no_grad()
def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    """Full-prompt logits [L, V] of one sequence."""
    device = next(hf.parameters()).device
    return hf(input_ids=torch.tensor([ids], device=device)).logits[0].float()


@torch.no_grad()
def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    """Greedy continuation with transformers' own cache (prefill, then one token at a time)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=hf.config.text_config)
    out = hf(input_ids=torch.tensor([ids], device=next(hf.parameters()).device), cache=cache,
             use_cache=True)
    tokens: list[int] = []
    for _ in range(n):
        tokens.append(int(out.logits[0, -1].argmax()))
        out = hf(input_ids=torch.tensor([[tokens[-1]]]), cache=out.cache, use_cache=True)
    return tokens
