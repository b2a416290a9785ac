"""Reference INT4 routed experts: group-wise asymmetric 4-bit weights.

Storage of one linear weight W [N, Kin] (nn.Linear layout [out, in]) with group size g along the
input dim: q uint8 [N, Kin/2] holds two 4-bit codes per byte (low nibble = even input column),
scale and zero fp16 [N, Kin/g], and W ~ q * scale + zero. `moe_int4` is `fused_moe`
(kernels/ref/moe.py) on the dequantised weights, in fp32.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .moe import swiglu

if TYPE_CHECKING:  # the Triton kernels' type (the reference runs without Triton)
    from ..int4_gemv import PairRows


def _check_group(kin: int, group_size: int) -> None:
    if group_size <= 0 or group_size % 2 or kin % group_size:
        raise ValueError(f"int4 groups: in_features {kin} must be a multiple of the group size "
                         f"{group_size}, which must be even and positive")


def quantize_int4(
    w: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w: [..., N, Kin] float. Returns (q uint8 [..., N, Kin/2], scale fp16 [..., N, Kin/g],
    zero fp16 [..., N, Kin/g]): zero = group min, scale = (max - min) / 15.

    Codes are rounded against the fp16 scale and zero that are stored, so dequantisation is the
    best fit of what the checkpoint holds. A constant group gets scale 0 and codes 0 (no 0/0)."""
    *lead, n, kin = w.shape
    _check_group(kin, group_size)
    wg = w.float().reshape(*lead, n, kin // group_size, group_size)
    lo, hi = wg.amin(-1), wg.amax(-1)
    zero = lo.half()
    scale = ((hi - lo) / 15).half()
    s, z = scale.float().unsqueeze(-1), zero.float().unsqueeze(-1)
    codes = torch.where(s > 0, (wg - z) / torch.where(s > 0, s, 1.0), 0.0)
    codes = codes.round().clamp(0, 15).to(torch.uint8).reshape(*lead, n, kin)
    q = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return q, scale, zero


def dequantize_int4(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int
) -> torch.Tensor:
    """q: uint8 [..., N, Kin/2]; scale, zero: fp16 [..., N, Kin/g]. Returns fp32 [..., N, Kin]
    = code * scale + zero (the product of a 4-bit code and an fp16 scale is exact in fp32, so
    any fused multiply-add gives the same bits)."""
    *lead, n, half = q.shape
    kin = 2 * half
    _check_group(kin, group_size)
    codes = torch.stack((q & 15, q >> 4), dim=-1).reshape(*lead, n, kin).float()
    s = scale.float().repeat_interleave(group_size, dim=-1)
    z = zero.float().repeat_interleave(group_size, dim=-1)
    return codes * s + z


def moe_int4(
    x: torch.Tensor,
    w13_q: torch.Tensor,
    w13_scale: torch.Tensor,
    w13_zero: torch.Tensor,
    w2_q: torch.Tensor,
    w2_scale: torch.Tensor,
    w2_zero: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    swiglu_limit: float,
    expert_offset: int,
    group_size: int,
    num_experts: int | None = None,
    defer_reduce: bool = False,
) -> torch.Tensor | PairRows:
    """Routed experts on INT4 weights, fp32 math.

    x: [T, D]; w13_q: uint8 [E, 2I, D/2] (gate rows, then up rows), w13_scale / w13_zero: fp16
    [E, 2I, D/g13]; w2_q: uint8 [E, D, I/2], w2_scale / w2_zero: fp16 [E, D, I/g2];
    topk_weights: [T, k] fp32; topk_ids: [T, k] global expert ids (experts outside
    [expert_offset, expert_offset + E) are another EP rank's and are skipped). Each projection's
    group is min(group_size, in_features) (spec: g = min(128, in_features)). num_experts: the
    experts of all EP ranks (None: E), which the kernels size their launches by; the result
    does not depend on it. Returns [T, D] in x's dtype. defer_reduce: the kernels may return
    the sum undone instead (a value `linear`'s `add` takes); here it changes nothing.
    """
    n_local, two_i, _ = w13_q.shape
    d, inter = x.shape[1], two_i // 2
    g13, g2 = min(group_size, d), min(group_size, inter)
    xf = x.float()
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    local = topk_ids - expert_offset
    for e in torch.unique(local[(local >= 0) & (local < n_local)]).tolist():
        token_idx, slot = torch.where(local == e)
        w13 = dequantize_int4(w13_q[e], w13_scale[e], w13_zero[e], g13)
        w2 = dequantize_int4(w2_q[e], w2_scale[e], w2_zero[e], g2)
        gate, up = (xf[token_idx] @ w13.T).chunk(2, dim=-1)
        y = swiglu(gate, up, swiglu_limit) @ w2.T
        out.index_add_(0, token_idx, y * topk_weights[token_idx, slot, None].float())
    return out.to(x.dtype)
