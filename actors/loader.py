"""Build a GLM-5.3-Flash model for a checkpoint directory and fill it from the safetensors."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .config import ModelConfig
from .models.glm5_next import Glm5NextForCausalLM
from .parallel import ParallelState
from .weights import load_weights

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: is {model_dir} a model directory?")
    return ModelConfig.from_hf(json.loads(path.read_text()))


def build_model(cfg: ModelConfig, with_mtp: bool = False, dtype: torch.dtype | None = None,
                device: torch.device | str = "cpu",
                ps: ParallelState | None = None) -> Glm5NextForCausalLM:
    """Allocate this rank's model in `dtype` (default: the config's); parameters that the math
    keeps in fp32 (router, mHC, conv taps, gate constants) are declared fp32 and stay fp32."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype or DTYPES[cfg.dtype])
    try:
        with torch.device(device):
            model = Glm5NextForCausalLM(cfg, with_mtp=with_mtp, ps=ps)
    finally:
        torch.set_default_dtype(previous)
    return model.requires_grad_(False).eval()


def load_model(model_dir: str | Path, with_mtp: bool = False, dtype: torch.dtype | None = None,
               device: torch.device | str = "cpu", progress: bool = True,
               ps: ParallelState | None = None) -> Glm5NextForCausalLM:
    model = build_model(read_config(model_dir), with_mtp=with_mtp, dtype=dtype, device=device,
                        ps=ps)
    load_weights(model, model_dir, progress=progress)
    return model
