"""Build a GLM-5.3-Flash model for a checkpoint directory and fill it from the safetensors.

The model is first built on the meta device (shapes and storage formats only), so the memory
plan can refuse a model that does not fit before a byte is allocated; then this rank's shard is
materialised directly on its device and filled tensor by tensor (host memory stays bounded by
the largest single tensor read).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
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


QUANTIZE_EXPERTS = ("int4",)


def with_expert_format(cfg: ModelConfig, quantize_experts: str | None) -> ModelConfig:
    """`cfg` with its routed experts quantised at load time to `quantize_experts` (None: as
    stored in the checkpoint)."""
    if quantize_experts is None:
        return cfg
    if quantize_experts not in QUANTIZE_EXPERTS:
        raise ValueError(f"--quantize-experts {quantize_experts!r}: one of {QUANTIZE_EXPERTS}")
    if cfg.expert_format != "dense":
        raise ValueError(f"the checkpoint's routed experts are already {cfg.expert_format}; "
                         "--quantize-experts applies to BF16 and FP8 checkpoints")
    return dataclasses.replace(cfg, expert_format=quantize_experts)


def build_model(cfg: ModelConfig, with_mtp: bool = False, dtype: torch.dtype | None = None,
                device: torch.device | str = "cpu", ps: ParallelState | None = None,
                with_vision: bool = False) -> Glm5NextForCausalLM:
    """Allocate this rank's model in `dtype` (default: the config's) on `device` ("meta":
    shapes only, see `materialize`); parameters that the math keeps in fp32 (router, mHC, conv
    taps, gate constants) are declared fp32 and stay fp32, quantised experts keep their
    storage dtypes."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype or DTYPES[cfg.dtype])
    try:
        with torch.device(device):
            model = Glm5NextForCausalLM(cfg, with_mtp=with_mtp, ps=ps, with_vision=with_vision)
    finally:
        torch.set_default_dtype(previous)
    return model.requires_grad_(False).eval()


def materialize(model: Glm5NextForCausalLM, device: torch.device | str
                ) -> Glm5NextForCausalLM:
    """Allocate a meta-built model's parameters on `device`, uninitialised (the loader or a
    benchmark's initialiser fills them). The loader's per-parameter layout attributes
    (`shard_dim`, `expert_offset`, ...) are carried over: `to_empty` makes new Parameters."""
    layout = {name: dict(p.__dict__) for name, p in model.named_parameters()}
    model = model.to_empty(device=device)
    for name, p in model.named_parameters():
        p.__dict__.update(layout[name])
    return model


def load_model(model_dir: str | Path, with_mtp: bool = False, dtype: torch.dtype | None = None,
               device: torch.device | str = "cpu", progress: bool = True,
               ps: ParallelState | None = None, quantize_experts: str | None = None,
               check_memory: Callable[[Glm5NextForCausalLM], None] | None = None,
               with_vision: bool = False) -> Glm5NextForCausalLM:
    """This rank's shard of the checkpoint in `model_dir` (`with_vision`: and its vision
    tower). `check_memory` sees the meta-built model before anything is allocated and raises
    to refuse it (see memory_plan.py)."""
    cfg = with_expert_format(read_config(model_dir), quantize_experts)
    model = build_model(cfg, with_mtp=with_mtp, dtype=dtype, device="meta", ps=ps,
                        with_vision=with_vision)
    if check_memory is not None:
        check_memory(model)
    model = materialize(model, device)
    load_weights(model, model_dir, progress=progress)
    return model
