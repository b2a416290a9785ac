"""Norm modules: RMSNorm (weighted) and the indexer's LayerNorm."""

from __future__ import annotations

import torch
from torch import nn

from glm53.kernels import ops


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)
