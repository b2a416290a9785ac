"""Reference RMSNorm (Llama-style: normalise in fp32, cast back, then scale)."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMS-normalise the last dimension.

    x: [..., D]; weight: [D] or None (unweighted). Returns x's dtype (promoted with weight's).
    """
    xf = x.float()
    y = (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y if weight is None else weight * y
