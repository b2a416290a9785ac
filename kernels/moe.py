"""Routing, routed experts as a grouped GEMM, and the clamped SwiGLU (twins of
`kernels/ref/moe.py`).

`router_logits` (up to ROUTER_GEMV_MAX_TOKENS tokens) reads each expert's fp32 router row once,
in one load, for every token of the step, from x in its own dtype: one launch where cuBLAS took
a cast of x and an fp32 GEMV (3.0 + 5.2 us a MoE layer at one token on an H100,
rank0_l24_h100_int4_a4b1ae6.json); beyond, the cast and cuBLAS.
`route_topk` runs the whole noaux_tc router per token in one program: sigmoid scores, the
bias-corrected top-k by k rounds of argmax over the experts in registers (k is 8 of 288:
cheaper than a sort), the gather of the uncorrected scores, renormalisation and scaling.

`fused_moe` permutes the (token, expert) pairs into expert order (stable sort; experts of other
EP ranks sort last and drop out), runs gate|up and down as two grouped GEMMs over the expert
groups (`torch._grouped_mm`: bf16 on Hopper, any float on CPU; a per-group matmul otherwise),
applies the SwiGLU in between (Triton), and scatters the weighted rows back with an fp32
index_add. No host sync on the grouped path, so it can be captured in a CUDA graph (other
dtypes on CUDA take a per-row path while a graph is being captured).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .ref import moe as ref_moe
from .utils import next_pow2, pdl_early, pdl_start, pdl_wait

__all__ = ["fused_moe", "route_topk", "router_logits", "swiglu"]

# up to this many tokens (a decode step of one sequence, or its MTP3 verification) the router
# GEMM is `router_logits_kernel`
ROUTER_GEMV_MAX_TOKENS = 4


@triton.jit
def router_logits_kernel(x, w, out, T, E, D, stride_x, BT: tl.constexpr, BD: tl.constexpr,
                         PDL: tl.constexpr):
    """Program i_e: out[t, i_e] = x[t] . w[i_e] in fp32 for the T <= BT tokens: the expert's
    row (BD >= D) and the tokens' rows loaded at once, one reduction. PDL (`utils.pdl`): the
    weight row is loaded before the wait for the kernel before."""
    pdl_start(PDL)
    i_e = tl.program_id(0)
    o_d, o_t = tl.arange(0, BD), tl.arange(0, BT)
    m_d, m_t = o_d < D, o_t < T
    b_w = tl.load(w + i_e.to(tl.int64) * D + o_d, mask=m_d, other=0.0).to(tl.float32)
    pdl_wait(PDL)
    b_x = tl.load(x + o_t[:, None] * stride_x + o_d[None, :], mask=m_t[:, None] & m_d[None, :],
                  other=0.0).to(tl.float32)
    tl.store(out + o_t * E + i_e, tl.sum(b_x * b_w[None, :], 1), mask=m_t)


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, D] (any float dtype, rows contiguous) times the fp32 router weight [E, D] ->
    logits [T, E] fp32."""
    n_tok, d = x.shape
    if n_tok > ROUTER_GEMV_MAX_TOKENS or x.stride(1) != 1:
        return ref_moe.router_logits(x, weight)
    w32 = weight.float().contiguous()
    on = pdl_early(x.device, "router", (weight, w32))
    out = torch.empty((n_tok, w32.shape[0]), dtype=torch.float32, device=x.device)
    if n_tok:
        router_logits_kernel[(w32.shape[0],)](x, w32, out, n_tok, w32.shape[0], d, x.stride(0),
                                              BT=next_pow2(n_tok), BD=next_pow2(d), PDL=on,
                                              launch_pdl=on, num_warps=8)
    return out


@triton.jit
def route_topk_kernel(logits, bias, weights, ids, E, stride_l, scaling, K: tl.constexpr,
                      BK: tl.constexpr, RENORM: tl.constexpr, BE: tl.constexpr,
                      PDL: tl.constexpr):
    """Program i_t: token i_t's top K experts by sigmoid(logit) + bias and their weights.
    PDL (`utils.pdl`): the bias is loaded before the wait for the kernel before."""
    pdl_start(PDL)
    i_t = tl.program_id(0)
    o_e = tl.arange(0, BE)
    m_e = o_e < E
    b_b = tl.load(bias + o_e, mask=m_e, other=0.0).to(tl.float32)
    pdl_wait(PDL)
    b_s = tl.sigmoid(tl.load(logits + i_t * stride_l + o_e, mask=m_e, other=0.0).to(tl.float32))
    b_c = tl.where(m_e, b_s + b_b, float("-inf"))
    o_k = tl.arange(0, BK)
    b_ids = tl.zeros([BK], dtype=tl.int32)
    b_w = tl.zeros([BK], dtype=tl.float32)
    for j in tl.static_range(K):
        # ties go to the lowest expert id (argmax returns the first maximum)
        best = tl.argmax(b_c, 0)
        b_ids = tl.where(o_k == j, best, b_ids)
        b_w = tl.where(o_k == j, tl.sum(tl.where(o_e == best, b_s, 0.0), 0), b_w)
        b_c = tl.where(o_e == best, float("-inf"), b_c)
    if RENORM:
        b_w = b_w / (tl.sum(b_w, 0) + 1e-20)
    m_k = o_k < K
    tl.store(weights + i_t * K + o_k, b_w * scaling, mask=m_k)
    tl.store(ids + i_t * K + o_k, b_ids.to(tl.int64), mask=m_k)


def route_topk(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    renormalize: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits: [T, E] (rows may be strided); correction_bias: [E]. Returns
    (weights [T, k] fp32, ids [T, k] int64); the bias only decides which experts win."""
    n_tok, n_exp = router_logits.shape
    if router_logits.stride(1) != 1:
        router_logits = router_logits.contiguous()
    weights = torch.empty((n_tok, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((n_tok, top_k), dtype=torch.int64, device=router_logits.device)
    bias = correction_bias.contiguous()
    on = pdl_early(router_logits.device, "router", (correction_bias, bias))
    if n_tok:
        route_topk_kernel[(n_tok,)](router_logits, bias, weights, ids, n_exp,
                                    router_logits.stride(0), float(scaling), K=top_k,
                                    BK=next_pow2(top_k), RENORM=renormalize,
                                    BE=next_pow2(n_exp), PDL=on, launch_pdl=on)
    return weights, ids


@triton.jit
def swiglu_kernel(gate, up, out, n_cols, stride_g, stride_u, limit, BN: tl.constexpr):
    i_r, i_n = tl.program_id(0), tl.program_id(1)
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < n_cols
    b_g = tl.load(gate + i_r * stride_g + o_n, mask=m_n, other=0.0).to(tl.float32)
    b_u = tl.load(up + i_r * stride_u + o_n, mask=m_n, other=0.0).to(tl.float32)
    b_g = tl.minimum(b_g, limit)
    b_u = tl.minimum(tl.maximum(b_u, -limit), limit)
    b_y = b_g * tl.sigmoid(b_g) * b_u
    tl.store(out + i_r * n_cols + o_n, b_y.to(out.dtype.element_ty), mask=m_n)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit). gate, up: [..., I] (rows may be
    strided, e.g. the two halves of one projection). Returns [..., I] contiguous."""
    n_cols = gate.shape[-1]
    g2, u2 = gate.reshape(-1, n_cols), up.reshape(-1, n_cols)
    if g2.stride(-1) != 1:
        g2 = g2.contiguous()
    if u2.stride(-1) != 1:
        u2 = u2.contiguous()
    out = torch.empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype),
                      device=gate.device)
    bn = min(next_pow2(n_cols), 1024)
    if g2.shape[0]:
        swiglu_kernel[(g2.shape[0], triton.cdiv(n_cols, bn))](
            g2, u2, out, n_cols, g2.stride(0), u2.stride(0), float(limit), BN=bn)
    return out


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """a: [M, K] rows grouped by expert (group e ends at offs[e]); b: [E, K, N]. Rows past
    offs[-1] are undefined."""
    if not a.is_cuda or a.dtype == torch.bfloat16:
        return torch._grouped_mm(a, b, offs=offs)
    if torch.cuda.is_current_stream_capturing():
        # no host sync in a CUDA graph: each row times its expert's matrix (decode-sized M)
        expert = torch.searchsorted(offs, torch.arange(a.shape[0], dtype=offs.dtype,
                                                       device=a.device),
                                    right=True).clamp(max=b.shape[0] - 1)
        return torch.bmm(a.unsqueeze(1), b[expert]).squeeze(1)
    out = torch.empty((a.shape[0], b.shape[-1]), dtype=a.dtype, device=a.device)
    start = 0
    for e, end in enumerate(offs.tolist()):
        out[start:end] = a[start:end] @ b[e]
        start = end
    return out


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    swiglu_limit: float,
    expert_offset: int = 0,
) -> torch.Tensor:
    """x: [T, D]; w13: [E_local, 2I, D] (gate rows, then up rows); w2: [E_local, D, I];
    topk_weights, topk_ids: [T, k] (global ids; experts outside [expert_offset,
    expert_offset + E_local) are another EP rank's). Returns [T, D] in x's dtype."""
    n_tok, k = topk_ids.shape
    n_local, two_i, _ = w13.shape
    local = topk_ids.reshape(-1) - expert_offset
    valid = (local >= 0) & (local < n_local)
    key = torch.where(valid, local, n_local)
    order = torch.argsort(key, stable=True)
    # group e ends after the last key <= e (searchsorted: no host sync, unlike bincount)
    bounds = torch.arange(1, n_local + 1, device=key.device)
    offs = torch.searchsorted(key[order], bounds, right=False).to(torch.int32)
    tok = order // k
    h = _grouped_mm(x[tok], w13.transpose(1, 2), offs)  # [T*k, 2I]
    a = swiglu(h[:, : two_i // 2], h[:, two_i // 2:], swiglu_limit)
    y = _grouped_mm(a, w2.transpose(1, 2), offs)  # [T*k, D]
    wts = topk_weights.reshape(-1)[order].float().unsqueeze(1)
    y = torch.where(valid[order].unsqueeze(1), y.float() * wts, 0.0)
    out = torch.zeros((n_tok, x.shape[1]), dtype=torch.float32, device=x.device)
    return out.index_add_(0, tok, y).to(x.dtype)
