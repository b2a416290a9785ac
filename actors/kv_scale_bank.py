"""The nvfp4 KV-cache scale bank: one power-of-two outer scale per DSA layer (and the MTP
layer), calibrated from prompts, stored as JSON next to the checkpoint (BANK_FILE) or at a
given path.

Calibration runs the model with a plain cache over the prompts and records, per layer, the
largest finite |value| of the latent rows it stores (amax). The outer scale is the smallest
power of two s with amax <= 6 * 448 * s * HEADROOM: the largest e2m1 code (6) times the
largest e4m3 group scale (448) covers amax with HEADROOM to spare for tokens the prompts did
not show (a group beyond it saturates). Power-of-two scales keep every dequantisation product
exact (kernels/ref/latent_quant.py), and the seed's calibrated power-of-two scales beat its
per-token dynamic ones on KLD (exl3-dflash-spec.md A.5).

The file holds no timestamps: the same prompts and checkpoint give the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import torch

from glm53.kernels.ops import E4M3_MAX, check_outer_scale

from .caches import MTP_LAYER, ModelCaches
from .forward_batch import ForwardBatch
from .loader import DTYPES, load_model, read_config
from .models.glm5_next import Glm5NextForCausalLM

BANK_FILE = "kv_scales_nvfp4.json"
BANK_FORMAT = "glm53-nvfp4-kv-scales/1"
HEADROOM = 2.0
_BLOCK = 16


def outer_scale(amax: float) -> float:
    """The power-of-two outer scale for a layer whose latents reach `amax`."""
    if not math.isfinite(amax) or amax <= 0:
        return 1.0
    return 2.0 ** math.ceil(math.log2(amax / (6 * E4M3_MAX * HEADROOM)))


def bank_path(model_dir: str | Path, explicit: str | Path | None = None) -> Path:
    """Where the bank of a checkpoint is: `explicit`, else BANK_FILE in the checkpoint."""
    return Path(explicit) if explicit else Path(model_dir) / BANK_FILE


def load_scale_bank(path: str | Path) -> dict[str, float]:
    """Layer key (str(layer id) or "mtp") -> outer scale, validated."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no nvfp4 KV scale bank at {path}: build one with "
                                "`glm53 calibrate-kv` or pass --kv-scale-bank PATH")
    data = json.loads(path.read_text())
    if data.get("format") != BANK_FORMAT:
        raise ValueError(f"{path} is not an nvfp4 KV scale bank (format {BANK_FORMAT!r})")
    scales = {str(k): float(v) for k, v in data["scales"].items()}
    for key, value in scales.items():
        try:
            check_outer_scale(value)
        except ValueError as exc:
            raise ValueError(f"{path}: layer {key}: {exc}") from None
    return scales


def _dsa_modules(model: Glm5NextForCausalLM) -> dict[str, torch.nn.Module]:
    """Layer key -> the norm whose output is the cached latent."""
    found = {str(i): layer.self_attn.kv_a_layernorm
             for i, layer in enumerate(model.layers) if not layer.is_kda}
    if model.mtp is not None:
        found[MTP_LAYER] = model.mtp.self_attn.kv_a_layernorm
    return found


@torch.inference_mode()
def calibrate(model: Glm5NextForCausalLM, prompts: list[list[int]]) -> dict:
    """The bank (a JSON-ready dict) of `model` over `prompts` (token ids). The MTP layer, when
    the model has it, sees each prompt's hidden states with the next tokens, as it does when
    drafting."""
    amax = dict.fromkeys(_dsa_modules(model), 0.0)

    def recorder(key: str):
        def hook(_module, _inputs, out: torch.Tensor) -> None:
            finite = torch.where(torch.isfinite(out), out.abs(), 0.0)
            amax[key] = max(amax[key], float(finite.max()) if finite.numel() else 0.0)
        return hook

    handles = [m.register_forward_hook(recorder(k)) for k, m in _dsa_modules(model).items()]
    device = model.embed_tokens.weight.device
    try:
        for ids in prompts:
            n = len(ids)
            caches = ModelCaches.allocate(model.config, 1 + -(-n // _BLOCK), _BLOCK, 1,
                                          model.embed_tokens.weight.dtype, device,
                                          with_mtp=model.mtp is not None)
            blocks = [list(range(1, 1 + -(-n // _BLOCK)))]
            hidden = model(torch.tensor(ids, device=device),
                           ForwardBatch.build([0], [n], [0], blocks, _BLOCK, device), caches)
            if model.mtp is not None and n > 1:
                model.forward_mtp(hidden[:-1], torch.tensor(ids[1:], device=device),
                                  ForwardBatch.build([0], [n - 1], [0], blocks, _BLOCK, device),
                                  caches)
    finally:
        for handle in handles:
            handle.remove()
    digest = hashlib.sha256(json.dumps(prompts).encode()).hexdigest()
    return {"format": BANK_FORMAT, "rule": f"2^ceil(log2(amax / (6 * 448 * {HEADROOM:g})))",
            "prompts": len(prompts), "tokens": sum(map(len, prompts)),
            "prompts_sha256": digest,
            "scales": {k: outer_scale(v) for k, v in amax.items()},
            "amax": {k: float(v) for k, v in amax.items()}}


def calibrate_checkpoint(model_dir: str | Path, prompts: list[list[int]],
                         dtype: str | None = None, device: str = "cpu") -> dict:
    """`calibrate` of the checkpoint in `model_dir` (with its MTP layer when it has one)."""
    model = load_model(model_dir, with_mtp=read_config(model_dir).has_mtp,
                       dtype=DTYPES[dtype] if dtype else None, device=device, progress=False)
    return calibrate(model, prompts)


def write_bank(bank: dict, path: str | Path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(bank, indent=2, sort_keys=True) + "\n")
    return path
