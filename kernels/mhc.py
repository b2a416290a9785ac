"""Triton mHC sites (twins of `kernels/ref/mhc.py`).

`hc_pre`: the [(2+n)n, nD] projection is one fp32 GEMM on the un-normalised streams (the RMS
factor is a per-token scalar, applied after); one program per token then computes the RMS, the
pre / post gates, the row softmax and the Sinkhorn iterations on the n x n comb in registers, and
the collapsed block input sum_i pre_i X_i.
`hc_post`: the expansion X'[j] = post[j] y + sum_i comb[i, j] X[i] in one pass over the streams
(the reference needs a broadcast multiply, a batched matmul and an add).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .utils import next_pow2

__all__ = ["hc_post", "hc_pre"]


@triton.jit
def hc_pre_kernel(streams, mixed, base, scale, post, comb, collapsed, rms_eps, hc_eps, iters, D,
                  N: tl.constexpr, BD: tl.constexpr):
    i_t = tl.program_id(0)
    o_i = tl.arange(0, N)
    o_d = tl.arange(0, BD)
    p_x = streams + i_t * N * D + o_i[:, None] * D
    b_ss = tl.zeros([N], dtype=tl.float32)
    for d0 in range(0, D, BD):
        b_x = tl.load(p_x + d0 + o_d[None, :], mask=(d0 + o_d < D)[None, :], other=0.0)
        b_x = b_x.to(tl.float32)
        b_ss += tl.sum(b_x * b_x, 1)
    b_r = 1.0 / tl.sqrt(tl.sum(b_ss) / (N * D) + rms_eps)
    s0, s1, s2 = tl.load(scale), tl.load(scale + 1), tl.load(scale + 2)
    p_m = mixed + i_t * (2 + N) * N
    b_pre = tl.sigmoid(tl.load(p_m + o_i) * b_r * s0 + tl.load(base + o_i)) + hc_eps
    b_post = 2.0 * tl.sigmoid(tl.load(p_m + N + o_i) * b_r * s1 + tl.load(base + N + o_i))
    o_ij = o_i[:, None] * N + o_i[None, :]
    b_c = tl.load(p_m + 2 * N + o_ij) * b_r * s2 + tl.load(base + 2 * N + o_ij)
    b_c = tl.exp(b_c - tl.max(b_c, 1)[:, None])
    b_c = b_c / tl.sum(b_c, 1)[:, None] + hc_eps
    b_c = b_c / (tl.sum(b_c, 0)[None, :] + hc_eps)
    for _ in range(iters - 1):
        b_c = b_c / (tl.sum(b_c, 1)[:, None] + hc_eps)
        b_c = b_c / (tl.sum(b_c, 0)[None, :] + hc_eps)
    tl.store(post + i_t * N + o_i, b_post)
    tl.store(comb + i_t * N * N + o_ij, b_c)
    for d0 in range(0, D, BD):
        m_d = d0 + o_d < D
        b_x = tl.load(p_x + d0 + o_d[None, :], mask=m_d[None, :], other=0.0).to(tl.float32)
        b_u = tl.sum(b_pre[:, None] * b_x, 0)
        tl.store(collapsed + i_t * D + d0 + o_d, b_u.to(collapsed.dtype.element_ty), mask=m_d)


def hc_pre(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    rms_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams: [T, n, D]; fn: [(2+n)*n, n*D]; base: [(2+n)*n]; scale: [3]. Returns post [T, n]
    fp32, comb [T, n, n] fp32, collapsed [T, D] in streams' dtype. n must be a power of 2."""
    n_tok, n, d = streams.shape
    assert n == next_pow2(n) and streams.is_contiguous()
    mixed = F.linear(streams.reshape(n_tok, n * d).float(), fn.float())  # [T, (2+n)n]
    post = torch.empty((n_tok, n), dtype=torch.float32, device=streams.device)
    comb = torch.empty((n_tok, n, n), dtype=torch.float32, device=streams.device)
    collapsed = torch.empty((n_tok, d), dtype=streams.dtype, device=streams.device)
    if n_tok:
        hc_pre_kernel[(n_tok,)](streams, mixed, base.float().contiguous(),
                                scale.float().contiguous(), post, comb, collapsed, rms_eps,
                                hc_eps, sinkhorn_iters, d, N=n, BD=min(next_pow2(d), 1024))
    return post, comb, collapsed


@triton.jit
def hc_post_kernel(streams, block_out, post, comb, out, D, N: tl.constexpr, BD: tl.constexpr):
    i_t, i_d = tl.program_id(0), tl.program_id(1)
    o_i = tl.arange(0, N)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    p_x = streams + i_t * N * D + o_i[:, None] * D + o_d[None, :]
    b_x = tl.load(p_x, mask=m_d[None, :], other=0.0).to(tl.float32)  # [N, BD]
    b_y = tl.load(block_out + i_t * D + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_post = tl.load(post + i_t * N + o_i)
    p_out = out + i_t * N * D + o_d
    for j in tl.static_range(N):
        # column j of comb: how much of each input stream flows into output stream j
        b_cj = tl.load(comb + i_t * N * N + o_i * N + j)
        b_pj = tl.sum(tl.where(o_i == j, b_post, 0.0), 0)
        b_o = b_pj * b_y + tl.sum(b_cj[:, None] * b_x, 0)
        tl.store(p_out + j * D, b_o.to(out.dtype.element_ty), mask=m_d)


def hc_post(
    streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """streams: [T, n, D]; block_out: [T, D]; post: [T, n] fp32; comb: [T, n, n] fp32.
    Returns [T, n, D] in streams' dtype (math in fp32, rounded once). n must be a power of 2."""
    n_tok, n, d = streams.shape
    assert n == next_pow2(n)
    streams, block_out = streams.contiguous(), block_out.contiguous()
    post, comb = post.float().contiguous(), comb.float().contiguous()
    out = torch.empty_like(streams)
    bd = min(next_pow2(d), 512)
    if n_tok:
        hc_post_kernel[(n_tok, triton.cdiv(d, bd))](streams, block_out, post, comb, out, d,
                                                    N=n, BD=bd)
    return out
