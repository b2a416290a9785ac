"""Helpers for checking our model against transformers' Glm5Next (the CPU oracle)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from glm53.actors.tiny import TINY_VISION_CONFIG, placeholder_token_ids


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
def save_hf_checkpoint(text: dict, out: Path, seed: int):
    """transformers' own tiny checkpoint: `Glm5NextConfig(text_config=text)`, its model with
    seeded random weights (non-degenerate where its initialiser uses constants), written by
    its `save_pretrained`. Returns the fp32 model."""
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    config = Glm5NextConfig(text_config=text, vision_config={
        **TINY_VISION_CONFIG, "out_hidden_size": text["hidden_size"]},
        **placeholder_token_ids(text["vocab_size"]))
    model = Glm5NextForConditionalGeneration(config).float().eval()
    gen = torch.Generator().manual_seed(seed)
    for name, p in [*model.named_parameters(), *model.named_buffers()]:
        noise = torch.randn(p.shape, generator=gen)
        if name.endswith("embed_tokens.weight"):
            p.copy_(noise)
        elif p.ndim >= 2:  # matrices, stacked experts, conv taps: activations stay O(1)
            p.copy_(noise / p.shape[-1] ** 0.5)
        elif name.endswith(("weight", "scale")):  # norms and hc scales: around 1
            p.copy_(1.0 + 0.1 * noise)
        elif p.is_floating_point():  # biases, hc base, gate dt_bias and A_log
            p.copy_(0.3 * noise)
    model.save_pretrained(out)
    return model


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


def write_dequantized(src: Path, dst: Path) -> Path:
    """Copy the checkpoint `src` with its EXL3 routed experts replaced by their dequantised
    fp32 weights (HF layout W^T) and no quantization_config: what transformers can load."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from glm53.actors.config import EXL3_CODEBOOKS
    from glm53.kernels.ref.exl3 import exl3_weight

    config = json.loads((src / "config.json").read_text())
    codebook = EXL3_CODEBOOKS[config.pop("quantization_config")["codebook"]]
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, dst / f.name)
    tensors = load_file(src / "model.safetensors")
    out = {}
    for name, t in tensors.items():
        if name.endswith((".suh", ".svh", ".mcg", ".mul1")):
            continue
        if name.endswith(".trellis"):
            stem = name[: -len(".trellis")]
            w = exl3_weight(t, tensors[stem + ".suh"], tensors[stem + ".svh"], codebook)
            out[stem + ".weight"] = w.T.contiguous().float()
        else:
            out[name] = t
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return dst
