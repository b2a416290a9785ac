"""Reference dense projection: y = x W^T through torch (cuBLAS on CUDA, its GEMM on CPU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, weight: torch.Tensor,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (cast to weight's dtype) times weight [N, K] -> [..., N] in weight's dtype;
    `out` (x 2-D, [T, N]): the product is written there and returned."""
    x = x.to(weight.dtype)
    if out is None:
        return F.linear(x, weight)
    return torch.mm(x, weight.t(), out=out)
