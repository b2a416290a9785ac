"""Shared bits of the Triton kernel tests: skip without Triton, interpreter or GPU device."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")

if torch.cuda.is_available():
    DEVICE = "cuda"
elif os.environ.get("TRITON_INTERPRET") == "1":
    DEVICE = "cpu"
else:
    DEVICE = None

needs_triton = pytest.mark.skipif(
    DEVICE is None, reason="Triton kernels need CUDA or TRITON_INTERPRET=1")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp64 (NaN counts as a failure)."""
    out, ref = out.double().cpu(), ref.double().cpu()
    assert not torch.isnan(out).any(), "NaN in the kernel output"
    return float((out - ref).norm() / ref.norm().clamp(min=1e-30))
