"""Triton RMSNorm (twin of `kernels/ref/norm.py`): one program per row, fp32 statistics."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .utils import next_pow2

__all__ = ["rms_norm"]


@triton.jit
def rms_norm_kernel(x, weight, y, eps, D, stride_x, HAS_WEIGHT: tl.constexpr, BD: tl.constexpr):
    i_r = tl.program_id(0)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    b_x = tl.load(x + i_r * stride_x + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_y = b_x / tl.sqrt(tl.sum(b_x * b_x) / D + eps)
    # like the reference: normalise in fp32, round to x's dtype, then scale
    b_y = b_y.to(x.dtype.element_ty).to(tl.float32)
    if HAS_WEIGHT:
        b_y = b_y * tl.load(weight + o_d, mask=m_d, other=0.0).to(tl.float32)
    tl.store(y + i_r * D + o_d, b_y.to(y.dtype.element_ty), mask=m_d)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x: [..., D] (rows may be strided); weight: [D] or None. Returns x's dtype promoted with
    weight's."""
    d = x.shape[-1]
    x2 = x.reshape(-1, d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    dtype = x.dtype if weight is None else torch.promote_types(x.dtype, weight.dtype)
    y = torch.empty(x.shape, dtype=dtype, device=x.device)
    if x2.shape[0]:
        rms_norm_kernel[(x2.shape[0],)](x2, weight, y, eps, d, x2.stride(0),
                                        HAS_WEIGHT=weight is not None, BD=next_pow2(d),
                                        num_warps=4 if d <= 4096 else 8)
    return y
