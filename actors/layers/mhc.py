"""mHC site: the projection that mixes the residual streams around one block (attn or FFN)."""

from __future__ import annotations

import torch
from torch import nn

from glm53.kernels import ops

from ..config import ModelConfig
from .norm import RMSNorm


class HyperConnection(nn.Module):
    """Parameters `fn` [(2+n)n, n*D], `base` [(2+n)n], `scale` [3], all fp32."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        n = cfg.hc_mult
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * cfg.hidden_size, dtype=torch.float32))
        self.base = nn.Parameter(torch.empty((2 + n) * n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32))
        self.rms_eps = cfg.rms_norm_eps
        self.hc_eps = cfg.hc_eps
        self.iters = cfg.hc_sinkhorn_iters

    def forward(self, streams: torch.Tensor, norm: RMSNorm
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, n, D] -> (post [T, n], comb [T, n, n], block input [T, D] after the
        block's input `norm`, which the op applies in the same pass)."""
        return ops.hc_pre(streams, self.fn, self.base, self.scale, self.rms_eps, self.hc_eps,
                          self.iters, norm.weight, norm.eps)

    def after(self, streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor,
              comb: torch.Tensor, norm: RMSNorm
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The previous site's expansion of its block output [T, D] (with that site's post
        [T, n] and comb [T, n, n]) into streams [T, n, D], then this site: (the new streams,
        post, comb, block input), in one op (`ops.hc_post_pre`: fewer launches)."""
        return ops.hc_post_pre(streams, block_out, post, comb, self.fn, self.base, self.scale,
                               self.rms_eps, self.hc_eps, self.iters, norm.weight, norm.eps)
