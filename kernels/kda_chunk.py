"""Chunked KDA prefill in Triton: the gated delta rule of `kernels/ref/kda.py` in chunks of 64.

Per head, within a chunk starting from state S0 (Gc = per-channel cumsum of g inside the chunk,
non-increasing, k and q L2-normalised, q scaled by dk^-0.5):

    A[t,i] = sum_d k_td k_id e^(Gc_td - Gc_id)   (i < t)    T = (I + diag(b) A)^-1 diag(b)
    M[t,i] = sum_d q_td k_id e^(Gc_td - Gc_id)   (i <= t)
    w = T (k * e^Gc),  u = T v                   U = u - w S0      (the delta-rule writes)
    O = (q * e^Gc - M w) S0 + M u
    S_end = diag(e^Gc_last) S0 + (k * e^(Gc_last - Gc))^T U

Two launches over the flat varlen batch, no host sync (CUDA-graph capturable):
- `kda_chunk_intra_kernel`, one program per (chunk, head), all chunks in parallel: the decayed
  k-k and q-k products, the triangular inverse, and the state-independent factors w, qw = q e^Gc
  - M w, kg = k e^(Gc_last - Gc), u and Mu = M u (token-indexed) plus e^Gc_last per chunk. The
  grid is sized by the bound T // 64 + N on the number of chunks; each program finds its
  sequence from cu_seqlens and surplus programs exit.
- `kda_chunk_state_kernel`, one program per (V block, head, sequence): walks the chunks with its
  [dk, BV] state tile in registers (initial state from the slot, or zeros), emits the outputs
  and writes the final state back into the slot in place.

Exponents: every materialised exponent is a non-positive difference, so any g <= 0 is safe
(strong decays underflow to 0, never overflow). Off-diagonal 16x16 sub-blocks factor through the
first row r of the later sub-chunk: e^(Gc_t - Gc_r) e^(Gc_r - Gc_i), both <= 1; diagonal
sub-blocks take each pair's own e^(Gc_t - Gc_j), t >= j (a few channels at a time). The inverse:
the 16x16 diagonal blocks by forward substitution, then (I + L)^-1 = (I + B E)^-1 B with B the
block inverse and E the strictly block-lower part, B E nilpotent (a finite series).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .utils import INTERPRET, is_sm120, next_pow2

__all__ = ["CHUNK", "kda_chunk_attention", "supports"]

CHUNK = 64  # tokens per chunk
SUB = 16  # sub-chunk: the exponent reference granularity and the diagonal inverse blocks
# The state pass loads chunk i+1's factors while chunk i's products run (Triton does not
# pipeline these loads itself; costs ~136 B of spills per thread at BV 32, ptxas sm_90).
# No gain measured yet (H200, 4K tokens: 1.97 vs 1.98 ms at 32 heads, 3.71 vs 3.57 ms at 64).
# Not on SM120 (mma.sync holds the factors in registers): there it spills 1432 B a thread at BV 64
# (344 at BV 32) against 304 (none) without (scripts/kernel_build.py).
STATE_PREFETCH = True
LOG2E = tl.constexpr(1.4426950408889634)  # the kernels work in log2 units (exp2)


@triton.jit
def _chunk_counts(cu_seqlens, N, C: tl.constexpr, BN: tl.constexpr):
    """[BN] chunks per sequence (0 past N) and their inclusive running sum."""
    o_n = tl.arange(0, BN)
    m_n = o_n < N
    bos = tl.load(cu_seqlens + o_n, mask=m_n, other=0)
    eos = tl.load(cu_seqlens + o_n + 1, mask=m_n, other=0)
    n_c = (eos - bos + C - 1) // C
    return n_c, tl.cumsum(n_c, 0)


@triton.jit
def _diag_blocks(k, q, g, o_t, m_t, i_h, stride_k, stride_q, H: tl.constexpr, K: tl.constexpr,
                 NS: tl.constexpr, BC: tl.constexpr, BKD: tl.constexpr):
    """Raw k-k and q-k products of the diagonal sub-blocks, [NS, BC, BC] (row t, column j),
    over BKD-channel slices of the chunk's rows o_t: each pair's own exponent Gc_t - Gc_j (the
    pairs above the diagonal are clamped to e^0 here and masked by the caller)."""
    b_a = tl.zeros((NS, BC, BC), dtype=tl.float32)
    b_m = tl.zeros((NS, BC, BC), dtype=tl.float32)
    for i_k in range(0, K, BKD):
        o_k = i_k + tl.arange(0, BKD)
        k3 = tl.reshape(tl.load(k + o_t[:, None] * stride_k + i_h * K + o_k[None, :],
                                mask=m_t[:, None], other=0.0).to(tl.float32), (NS, BC, BKD))
        q3 = tl.reshape(tl.load(q + o_t[:, None] * stride_q + i_h * K + o_k[None, :],
                                mask=m_t[:, None], other=0.0).to(tl.float32), (NS, BC, BKD))
        b_g = tl.load(g + (o_t[:, None] * H + i_h) * K + o_k[None, :], mask=m_t[:, None],
                      other=0.0).to(tl.float32)
        g3 = tl.reshape(tl.cumsum(b_g * LOG2E, 0), (NS, BC, BKD))
        # [NS, t, j, channel]
        b_kj = k3[:, None, :, :] * tl.exp2(tl.minimum(g3[:, :, None, :] - g3[:, None, :, :],
                                                       0.0))
        b_a += tl.sum(k3[:, :, None, :] * b_kj, 3)
        b_m += tl.sum(q3[:, :, None, :] * b_kj, 3)
    return b_a, b_m


@triton.jit
def _off_diag_blocks(b_k, b_q, b_g, NS: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                     C: tl.constexpr):
    """k-k and q-k products of the strictly block-lower sub-blocks, [C, C], over one BK slice:
    rows scaled by e^(Gc_t - Gc_r), columns by e^(Gc_r - Gc_i), r the first row of the row's
    sub-chunk (i < r <= t, so both factors are <= 1)."""
    g3 = tl.reshape(b_g, (NS, BC, BK))
    g_ref = tl.sum(tl.where(tl.arange(0, BC)[None, :, None] == 0, g3, 0.0), 1)  # [NS, BK]
    g_row = tl.reshape(tl.broadcast_to(g_ref[:, None, :], (NS, BC, BK)), (C, BK))
    e_row = tl.exp2(b_g - g_row)
    b_kr, b_qr = b_k * e_row, b_q * e_row
    o_t = tl.arange(0, C)
    o_s = tl.arange(0, NS)
    b_a = tl.zeros((C, C), dtype=tl.float32)
    b_m = tl.zeros((C, C), dtype=tl.float32)
    for s in range(1, NS):
        g_s = tl.sum(tl.where(o_s[:, None] == s, g_ref, 0.0), 0)  # [BK]
        # columns before sub-chunk s only: later ones would need a positive exponent
        b_kc = tl.where(o_t[:, None] < s * BC,
                        b_k * tl.exp2(tl.minimum(g_s[None, :] - b_g, 0.0)), 0.0)
        in_s = (o_t // BC == s)[:, None]
        b_a += tl.where(in_s, tl.dot(b_kr, tl.trans(b_kc)), 0.0)
        b_m += tl.where(in_s, tl.dot(b_qr, tl.trans(b_kc)), 0.0)
    return b_a, b_m


@triton.jit
def _block_diag(b_x, NS: tl.constexpr, BC: tl.constexpr, C: tl.constexpr):
    """[NS, BC, BC] diagonal blocks -> the [C, C] block-diagonal matrix."""
    o_b = tl.arange(0, NS)
    same = o_b[:, None, None, None] == o_b[None, None, :, None]
    return tl.reshape(tl.where(same, b_x[:, :, None, :], 0.0), (C, C))


@triton.jit
def _solve(b_ad, b_aoff, b_beta, NS: tl.constexpr, BC: tl.constexpr, C: tl.constexpr):
    """T = (I + diag(beta) A)^-1 diag(beta), [C, C]; A strictly lower, given as its diagonal
    sub-blocks b_ad [NS, BC, BC] and the rest b_aoff [C, C]."""
    o_i = tl.arange(0, BC)[None, :, None]
    o_j = tl.arange(0, BC)[None, None, :]
    b_l = b_ad * tl.reshape(b_beta, (NS, BC))[:, :, None]
    # diagonal blocks: X = (I + L)^-1 row by row, X_r = e_r - sum_{s<r} L_rs X_s (small
    # batched products, exact fp32)
    b_x = tl.where(o_i == o_j, 1.0, 0.0) + tl.zeros((NS, BC, BC), dtype=tl.float32)
    for r in range(1, BC):
        b_x -= tl.dot(tl.where(o_i == r, b_l, 0.0), b_x, input_precision="ieee")
    b_b = _block_diag(b_x, NS, BC, C)
    # (I + D + E)^-1 = (I + N)^-1 B with N = B E strictly block-lower: N^NS = 0
    o_t = tl.arange(0, C)
    eye = tl.where(o_t[:, None] == o_t[None, :], 1.0, 0.0)
    b_n = tl.dot(b_b, b_aoff * b_beta[:, None])
    b_p = eye
    b_term = eye
    for _ in tl.static_range(NS - 1):
        b_term = -tl.dot(b_term, b_n)
        b_p += b_term
    return tl.dot(b_p, b_b) * b_beta[None, :]


@triton.jit
def kda_chunk_intra_kernel(q, k, v, g, beta, w, qw, kg, u, mu, decay, cu_seqlens, scale, N,
                           stride_q, stride_k, stride_v, H: tl.constexpr, K: tl.constexpr,
                           V: tl.constexpr, C: tl.constexpr, BC: tl.constexpr,
                           BK: tl.constexpr, BKD: tl.constexpr, BV: tl.constexpr,
                           BN: tl.constexpr):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    NS: tl.constexpr = C // BC
    n_c, c_end = _chunk_counts(cu_seqlens, N, C, BN)
    i_n = tl.sum((c_end <= i_c).to(tl.int32), 0)
    if i_n >= N:  # surplus program: the grid is sized by a bound on the chunk count
        return
    o_n = tl.arange(0, BN)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    first = tl.sum(tl.where(o_n == i_n, c_end - n_c, 0), 0)
    o_i = tl.arange(0, C)
    o_t = bos + (i_c - first) * C + o_i
    m_t = o_t < eos
    b_beta = tl.load(beta + o_t * H + i_h, mask=m_t, other=0.0).to(tl.float32)

    # pass 1 over channel slices: raw (unnormalised) products and the row norms
    ss_k = tl.zeros((C,), dtype=tl.float32)
    ss_q = tl.zeros((C,), dtype=tl.float32)
    b_aoff = tl.zeros((C, C), dtype=tl.float32)
    b_moff = tl.zeros((C, C), dtype=tl.float32)
    for i_k in range(K // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        m_tk = m_t[:, None]
        b_k = tl.load(k + o_t[:, None] * stride_k + i_h * K + o_k[None, :], mask=m_tk,
                      other=0.0).to(tl.float32)
        b_q = tl.load(q + o_t[:, None] * stride_q + i_h * K + o_k[None, :], mask=m_tk,
                      other=0.0).to(tl.float32)
        b_g = tl.load(g + (o_t[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk,
                      other=0.0).to(tl.float32)
        b_g = tl.cumsum(b_g * LOG2E, 0)
        ss_k += tl.sum(b_k * b_k, 1)
        ss_q += tl.sum(b_q * b_q, 1)
        a_o, m_o = _off_diag_blocks(b_k, b_q, b_g, NS, BC, BK, C)
        b_aoff += a_o
        b_moff += m_o
    b_ad, b_md = _diag_blocks(k, q, g, o_t, m_t, i_h, stride_k, stride_q, H, K, NS, BC, BKD)
    r_k = 1.0 / tl.sqrt(ss_k + 1e-6)
    r_q = scale / tl.sqrt(ss_q + 1e-6)
    rk3 = tl.reshape(r_k, (NS, BC))
    rq3 = tl.reshape(r_q, (NS, BC))
    o_bi = tl.arange(0, BC)[None, :, None]
    o_bj = tl.arange(0, BC)[None, None, :]
    b_ad = tl.where(o_bi > o_bj, b_ad * rk3[:, :, None] * rk3[:, None, :], 0.0)
    b_md = tl.where(o_bi >= o_bj, b_md * rq3[:, :, None] * rk3[:, None, :], 0.0)
    b_aoff *= r_k[:, None] * r_k[None, :]
    b_m = b_moff * r_q[:, None] * r_k[None, :] + _block_diag(b_md, NS, BC, C)
    b_t = _solve(b_ad, b_aoff, b_beta, NS, BC, C)

    # pass 2 over channel slices: w = T (k e^Gc), qw = q e^Gc - M w, kg = k e^(Gc_last - Gc)
    for i_k in range(K // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        m_tk = m_t[:, None]
        b_k = tl.load(k + o_t[:, None] * stride_k + i_h * K + o_k[None, :], mask=m_tk,
                      other=0.0).to(tl.float32) * r_k[:, None]
        b_q = tl.load(q + o_t[:, None] * stride_q + i_h * K + o_k[None, :], mask=m_tk,
                      other=0.0).to(tl.float32) * r_q[:, None]
        b_g = tl.load(g + (o_t[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk,
                      other=0.0).to(tl.float32)
        b_g = tl.cumsum(b_g * LOG2E, 0)
        # rows past the sequence end have g = 0, so the last row holds the chunk's total
        g_last = tl.sum(tl.where(o_i[:, None] == C - 1, b_g, 0.0), 0)
        e_g = tl.exp2(b_g)
        b_w = tl.dot(b_t, b_k * e_g)
        b_qw = b_q * e_g - tl.dot(b_m, b_w)
        b_kg = b_k * tl.exp2(g_last[None, :] - b_g)
        p = (o_t[:, None] * H + i_h) * K + o_k[None, :]
        tl.store(w + p, b_w.to(w.dtype.element_ty), mask=m_tk)
        tl.store(qw + p, b_qw.to(qw.dtype.element_ty), mask=m_tk)
        tl.store(kg + p, b_kg.to(kg.dtype.element_ty), mask=m_tk)
        tl.store(decay + (i_c * H + i_h) * K + o_k, tl.exp2(g_last))
    for i_v in range(V // BV):
        o_v = i_v * BV + tl.arange(0, BV)
        b_v = tl.load(v + o_t[:, None] * stride_v + i_h * V + o_v[None, :], mask=m_t[:, None],
                      other=0.0).to(tl.float32)
        b_u = tl.dot(b_t, b_v)
        b_mu = tl.dot(b_m, b_u)
        p = (o_t[:, None] * H + i_h) * V + o_v[None, :]
        tl.store(u + p, b_u.to(u.dtype.element_ty), mask=m_t[:, None])
        tl.store(mu + p, b_mu.to(mu.dtype.element_ty), mask=m_t[:, None])


@triton.jit
def _load_chunk(w, qw, kg, u, mu, decay, t0, eos, i_cg, live, i_h, i_v, H: tl.constexpr,
                K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BV: tl.constexpr):
    """The factors of the chunk of rows t0.. (< eos) that is global chunk i_cg (nothing loaded
    unless `live`): w, qw, kg [C, K]; u, Mu [C, BV] (V block i_v); e^Gc_last [K]."""
    o_t = t0 + tl.arange(0, C)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    m_t = (o_t < eos)[:, None]
    p_k = (o_t[:, None] * H + i_h) * K + o_k[None, :]
    p_v = (o_t[:, None] * H + i_h) * V + o_v[None, :]
    b_w = tl.load(w + p_k, mask=m_t, other=0.0)
    b_qw = tl.load(qw + p_k, mask=m_t, other=0.0)
    b_kg = tl.load(kg + p_k, mask=m_t, other=0.0)
    b_u = tl.load(u + p_v, mask=m_t, other=0.0)
    b_mu = tl.load(mu + p_v, mask=m_t, other=0.0)
    b_d = tl.load(decay + (i_cg * H + i_h) * K + o_k, mask=live, other=0.0)
    return b_w, b_qw, b_kg, b_u, b_mu, b_d


@triton.jit
def kda_chunk_state_kernel(w, qw, kg, u, mu, decay, state, o, cu_seqlens, state_ids,
                           has_initial_state, N, H: tl.constexpr, K: tl.constexpr,
                           V: tl.constexpr, C: tl.constexpr, BV: tl.constexpr,
                           BN: tl.constexpr, PREFETCH: tl.constexpr):
    i_v, i_h, i_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n_c, c_end = _chunk_counts(cu_seqlens, N, C, BN)
    first = tl.sum(tl.where(tl.arange(0, BN) == i_n, c_end - n_c, 0), 0)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    i_s = tl.load(state_ids + i_n).to(tl.int64)
    init = tl.load(has_initial_state + i_n) != 0
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    o_i = tl.arange(0, C)
    p_h = state + (i_s * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :]
    b_h = tl.load(p_h, mask=init, other=0.0).to(tl.float32)
    n = tl.cdiv(eos - bos, C)
    b_w, b_qw, b_kg, b_u, b_mu, b_d = _load_chunk(w, qw, kg, u, mu, decay, bos, eos, first,
                                                  n > 0, i_h, i_v, H, K, V, C, BV)
    for i_c in range(0, n):
        if PREFETCH:  # the next chunk's loads are in flight during this chunk's products
            n_w, n_qw, n_kg, n_u, n_mu, n_d = _load_chunk(
                w, qw, kg, u, mu, decay, bos + (i_c + 1) * C, eos, first + i_c + 1,
                i_c + 1 < n, i_h, i_v, H, K, V, C, BV)
        o_t = bos + i_c * C + o_i
        # the products run in the factors' dtype (bf16 tensor cores for bf16 inputs)
        b_hc = b_h.to(b_w.dtype)
        b_o = b_mu.to(tl.float32) + tl.dot(b_qw, b_hc)
        b_uu = b_u.to(tl.float32) - tl.dot(b_w, b_hc)
        tl.store(o + (o_t[:, None] * H + i_h) * V + o_v[None, :], b_o.to(o.dtype.element_ty),
                 mask=(o_t < eos)[:, None])
        b_h = b_h * b_d[:, None] + tl.dot(tl.trans(b_kg), b_uu.to(b_kg.dtype))
        if PREFETCH:
            b_w, b_qw, b_kg, b_u, b_mu, b_d = n_w, n_qw, n_kg, n_u, n_mu, n_d
        else:
            b_w, b_qw, b_kg, b_u, b_mu, b_d = _load_chunk(
                w, qw, kg, u, mu, decay, bos + (i_c + 1) * C, eos, first + i_c + 1,
                i_c + 1 < n, i_h, i_v, H, K, V, C, BV)
    tl.store(p_h, b_h.to(state.dtype.element_ty))


def supports(dk: int, dv: int) -> bool:
    """Power-of-two head dims of at least 16 (tl.dot tiles)."""
    return all(d >= 16 and d & (d - 1) == 0 for d in (dk, dv))


def kda_chunk_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_ids: torch.Tensor,
    has_initial_state: torch.Tensor,
) -> torch.Tensor:
    """Chunked gated delta rule over a flat varlen batch, states read from and written to slots.

    q, k: [T, H, dk] (rows may be strided, heads packed); v: [T, H, dv]; g: [T, H, dk] fp32
    log-decay (<= 0); beta: [T, H]; state: [S, H, dk, dv] fp32, the slots state_ids [N] updated
    in place (zeros as the start where has_initial_state [N] is False); cu_seqlens: [N+1].
    Returns o: [T, H, dv] in v's dtype.
    """
    n_tok, heads, dk = q.shape
    dv = v.shape[-1]
    n_seq = cu_seqlens.shape[0] - 1
    assert supports(dk, dv)
    for t, d in ((q, dk), (k, dk), (v, dv)):
        assert t.stride(2) == 1 and t.stride(1) == d, "heads must be packed within a row"
    assert g.is_contiguous() and beta.is_contiguous() and state.is_contiguous()
    o = torch.empty((n_tok, heads, dv), dtype=v.dtype, device=v.device)
    if n_seq == 0:
        return o
    # fp32 factors (tf32 products in the state pass). bf16 factors would halve the state pass's
    # traffic, but that variant hit an illegal memory access in the state kernel on the H200
    # (2026-12-02, not yet understood).
    fdt = torch.float32
    dev = v.device
    w, qw, kg = (torch.empty((n_tok, heads, dk), dtype=fdt, device=dev) for _ in range(3))
    u, mu = (torch.empty((n_tok, heads, dv), dtype=fdt, device=dev) for _ in range(2))
    max_chunks = n_tok // CHUNK + n_seq
    decay = torch.empty((max_chunks, heads, dk), dtype=torch.float32, device=dev)
    bn = next_pow2(n_seq)
    # tiles: narrow channel slices in rolled loops keep the intra pass's spills small (ptxas,
    # sm_90, 8 warps, BK 16, BKD 8: 32 B per thread; unrolled ~700 B); the interpreter takes
    # the diagonal blocks in one slice (its per-op overhead dominates)
    if n_tok:
        kda_chunk_intra_kernel[(max_chunks, heads)](
            q, k, v, g, beta, w, qw, kg, u, mu, decay, cu_seqlens, dk ** -0.5, n_seq,
            q.stride(0), k.stride(0), v.stride(0), H=heads, K=dk, V=dv, C=CHUNK, BC=SUB,
            BK=16, BKD=dk if INTERPRET else 8, BV=min(dv, 16 if INTERPRET else 64), BN=bn,
            num_warps=8)
    # One program per SM fits (the [dk, BV] state plus the chunk's factors take the register
    # file): narrow V blocks while the programs fit in one wave, wider ones when they cannot
    # (narrow blocks re-read the k-side factors, from L2 when their programs run together).
    bv = min(dv, 32 if n_seq * heads * triton.cdiv(dv, 32) <= _sm_count(dev) else 64)
    if INTERPRET:  # several V blocks on the CPU tests' small dv too
        bv = min(dv, 16)
    kda_chunk_state_kernel[(triton.cdiv(dv, bv), heads, n_seq)](
        w, qw, kg, u, mu, decay, state, o, cu_seqlens, state_ids, has_initial_state, n_seq,
        H=heads, K=dk, V=dv, C=CHUNK, BV=bv, BN=bn,
        PREFETCH=STATE_PREFETCH and not is_sm120(dev), num_warps=8, num_stages=1)
    return o


@functools.cache
def _sm_count(dev: torch.device) -> int:
    if dev.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(dev).multi_processor_count
