"""Reference dense projection: y = x W^T through torch (cuBLAS on CUDA, its GEMM on CPU)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from .moe import swiglu

if TYPE_CHECKING:  # the Triton kernels' type (the reference runs without Triton)
    from ..int4_gemv import PairRows


def linear(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None,
           add: torch.Tensor | PairRows | None = None) -> torch.Tensor:
    """x [..., K] (cast to weight's dtype) times weight [N, K] -> [..., N] in weight's dtype,
    plus `add` ([..., N]) if given; `out` (x 2-D, [T, N]): the result is written there. An
    `add` that is a sum not yet taken (the Triton int4 experts' `PairRows`, [T, N]) is taken
    first (its `reduce`)."""
    if add is not None and not isinstance(add, torch.Tensor):
        add = add.reduce().view(*x.shape[:-1], weight.shape[0])
    x = x.to(weight.dtype)
    y = F.linear(x, weight) if out is None else torch.mm(x, weight.t(), out=out)
    if add is not None:
        y += add
    return y


def linear_swiglu(x: torch.Tensor, weight: torch.Tensor, limit: float) -> torch.Tensor:
    """swiglu(gate, up, limit) of x [..., K] times weight [2I, K] = [gate; up] -> [..., I]."""
    gate, up = linear(x, weight).chunk(2, dim=-1)
    return swiglu(gate, up, limit)
