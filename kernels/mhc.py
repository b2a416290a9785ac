"""Triton mHC sites (twins of `kernels/ref/mhc.py`).

`hc_pre`: the [(2+n)n, nD] projection of the un-normalised streams (the RMS factor is a
per-token scalar, applied after) in parts over programs that each read a slice of the flattened
row and of fn; one program per token then sums the parts and computes the RMS, the pre / post
gates, the row softmax and the Sinkhorn iterations on the n x n comb in registers, the collapsed
block input sum_i pre_i X_i and, given the block's input norm, its RMSNorm (one launch fewer a
site, and no fp32 copy of the streams).
`hc_post`: the expansion X'[j] = post[j] y + sum_i comb[i, j] X[i] in one pass over the streams
(the reference needs a broadcast multiply, a batched matmul and an add).
`hc_post_pre`: one site's `hc_post` and the next site's `hc_pre` (each block's output feeds the
next site) in the launches of `hc_pre` alone, below MIX_DOT_MIN_TOKENS tokens: the expansion's
programs also take their part of the next projection from the rows they have just written
(rounded as stored), so the new streams are not read back and one launch a site pair goes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .utils import next_pow2, pdl_early, pdl_start, pdl_wait

__all__ = ["hc_post", "hc_post_pre", "hc_pre"]


# flattened stream columns (of n * D) per program of the mixing pass: one decode token's
# projection is spread over n * D / MIX_COLUMNS programs (128 at release size), which share the
# fp32 fn rows (1.5 MB) without a cast of the streams and a GEMM launch of their own
MIX_COLUMNS = 128
# tokens per program of the mixing pass (tl.dot) from MIX_DOT_MIN_TOKENS on: each program's
# slice of fn is read once per MIX_TOKENS tokens, not once per token (at an 8K-token prefill
# chunk fn was read 8192 times a site from L2: 1.6 ms, rank0_l24_h100_int4_a4b1ae6.json).
# 64 only in TF32 MMAs (MIX_LARGE): in fp32 FMAs that tile spilled 5.7 KB a thread on sm_90 and
# took 2.5 ms a site at a 2048-token chunk (rank0_l24_h100_int4_37be788.json)
MIX_TOKENS, MIX_DOT_MIN_TOKENS = 16, 16
# tl.dot's precision there: "tf32x3" (three TF32 MMAs per product, ~fp32 accuracy: sm_90 48
# HMMA and 27 shared loads a thread at 16 x 128 x 32) or "ieee" (exact fp32 products by FMAs,
# the operands read from shared memory per product: 129 LDS); a 2048-token chunk's pass took
# 189 us against 651 at the same tiles on an H100 (kernels_mhc_h100_da29b95.json); a string
# the benchmark (kernels.py --parts mhc) sets
MIX_PRECISION = "tf32x3"
# MIX_COLUMNS-wide steps a program of that tl.dot path accumulates (a K loop): fewer, longer
# programs and MIX_STEPS times fewer parts for the gates' program to sum
MIX_STEPS = 1
# (tokens, columns, steps) of the tl.dot path's program from MIX_LARGE_MIN_TOKENS tokens on
# (prefill chunks): fn's slice read once per 64 tokens, 16 steps of 32 columns; 119 us a
# 2048-token pass against 189 at (16, 128, 1) and 194 for the cast + cuBLAS fp32 GEMM
# (tf32x3, H100, kernels_mhc_h100_da29b95.json). Below it the decode batch's 16 x 128 tiles
# keep the programs to fill the GPU (64 tokens: 512 against 32)
MIX_LARGE, MIX_LARGE_MIN_TOKENS = (64, 32, 16), 256
# columns a step of `hc_pre_kernel` (at 4 warps 32 a thread): a release row (4096) is one
# step, normalised from registers
PRE_COLUMNS = 4096
# warps of each of `hc_pre_kernel`'s two programs a token (gates and collapse; comb): at one
# token, as one program, 6.8 us with 4, 7.1 with 8, 7.8 with 16 (H100,
# kernels_mhc_h100_da29b95.json: fewer warps, cheaper barriers in its chain)
PRE_WARPS = 4


@triton.jit
def hc_mix_kernel(streams, fn, mix_part, ss_part, T, ND, SPLIT, M: tl.constexpr,
                  BM: tl.constexpr, BC: tl.constexpr, BT: tl.constexpr, STEPS: tl.constexpr,
                  PRECISION: tl.constexpr, PDL: tl.constexpr):
    """Program (i_s, i_t): columns i_s*STEPS*BC.. of tokens i_t*BT.. of the flattened
    streams: their part of the un-normalised projection fn @ x ([M] a token) and of sum x^2.
    BT = 1 (STEPS = 1): the [BM, BC] slice of fn times one token's columns, fn's slice loaded
    before the PDL wait (`utils.pdl`) for the kernel before; BT >= 16: STEPS tl.dot's of the
    [BT, BC] tokens with [BC, BM] slices at PRECISION (MIX_PRECISION), accumulated."""
    pdl_start(PDL)
    i_s, i_t = tl.program_id(0), tl.program_id(1).to(tl.int64)
    o_m = tl.arange(0, BM)
    m_m = o_m < M
    if BT == 1:
        o_c = i_s * BC + tl.arange(0, BC)
        m_c = o_c < ND
        b_w = tl.load(fn + o_m[:, None] * ND + o_c[None, :], mask=m_m[:, None] & m_c[None, :],
                      other=0.0).to(tl.float32)
        pdl_wait(PDL)
        b_x = tl.load(streams + i_t * ND + o_c, mask=m_c, other=0.0).to(tl.float32)
        tl.store(mix_part + (i_t * SPLIT + i_s) * BM + o_m, tl.sum(b_w * b_x[None, :], 1))
        tl.store(ss_part + i_t * SPLIT + i_s, tl.sum(b_x * b_x, 0))
    else:
        pdl_wait(PDL)
        o_t = i_t * BT + tl.arange(0, BT)
        m_t = o_t < T
        b_mix = tl.zeros((BT, BM), dtype=tl.float32)
        b_ss = tl.zeros((BT,), dtype=tl.float32)
        for step in range(STEPS):
            o_c = (i_s * STEPS + step) * BC + tl.arange(0, BC)
            m_c = o_c < ND
            b_w = tl.load(fn + o_m[:, None] * ND + o_c[None, :],
                          mask=m_m[:, None] & m_c[None, :], other=0.0).to(tl.float32)
            b_x = tl.load(streams + o_t[:, None] * ND + o_c[None, :],
                          mask=m_t[:, None] & m_c[None, :], other=0.0).to(tl.float32)
            b_mix += tl.dot(b_x, tl.trans(b_w), input_precision=PRECISION)  # [BT, BM]
            b_ss += tl.sum(b_x * b_x, 1)
        tl.store(mix_part + ((o_t * SPLIT + i_s) * BM)[:, None] + o_m[None, :], b_mix,
                 mask=m_t[:, None])
        tl.store(ss_part + o_t * SPLIT + i_s, b_ss, mask=m_t)


@triton.jit
def sinkhorn(b_c, iters, eps):
    """The comb of [N, N] logits b_c: a row softmax (+ eps), then `iters` column and (after
    the first) row normalisations, as the reference's Sinkhorn."""
    b_c = tl.exp(b_c - tl.max(b_c, 1)[:, None])
    b_c = b_c / tl.sum(b_c, 1)[:, None] + eps
    b_c = b_c / (tl.sum(b_c, 0)[None, :] + eps)
    for _ in range(iters - 1):
        b_c = b_c / (tl.sum(b_c, 1)[:, None] + eps)
        b_c = b_c / (tl.sum(b_c, 0)[None, :] + eps)
    return b_c


@triton.jit
def pick(v, o_m, idx, RANK: tl.constexpr):
    """v[idx] for every entry of the index tensor idx of RANK dimensions (v: [BM] over o_m), in
    registers: a masked sum over v, exact (one term is not zero)."""
    hit = tl.expand_dims(idx, RANK) == o_m
    return tl.sum(tl.where(hit, v, 0.0), RANK)


@triton.jit
def hc_pre_kernel(streams, mix_part, ss_part, base, scale, norm_w, post, comb, collapsed,
                  normed, rms_eps, hc_eps, norm_eps, iters, D, SPLIT, N: tl.constexpr,
                  BM: tl.constexpr, BS: tl.constexpr, BD: tl.constexpr, NORM: tl.constexpr,
                  ONE_PASS: tl.constexpr, PDL: tl.constexpr):
    """Programs (i_t, 0) and (i_t, 1) (PRE_WARPS each: at decode the two are the whole site's
    latency, side by side): token i_t's gates, and the collapsed block input sum_i pre_i X_i
    with, if NORM, its RMSNorm (as `rms_norm`: the collapsed row rounded to the streams'
    dtype, normalised in fp32, rounded, scaled); and its comb, whose Sinkhorn loop is a chain
    of ~20 dependent shuffles and divisions (~2 us at one token on an H100) that the collapse
    need not wait for, from the mixing pass's parts. The projection's entries are picked from
    registers (no store, barrier and load of the summed projection). ONE_PASS (D <= BD, a
    release row): the collapsed row stays in registers for its norm (and is not stored when
    normed); else BD columns a step, the row read back for the norm. PDL (`utils.pdl`):
    scale, base and the norm weight are loaded before the wait for the kernel before."""
    pdl_start(PDL)
    i_t = tl.program_id(0).to(tl.int64)
    gates = tl.program_id(1) == 0
    o_s, o_m, o_i, o_d = tl.arange(0, BS), tl.arange(0, BM), tl.arange(0, N), tl.arange(0, BD)
    o_ij = o_i[:, None] * N + o_i[None, :]
    p_x = streams + i_t * N * D + o_i[:, None] * D
    m_s = o_s < SPLIT
    # every load is issued before the first reduction: placed after a reduction (a barrier)
    # or a store (which it cannot pass: the pointers may alias), each was a round trip of its
    # own in the one program's chain (sm_90: 5 such steps before, 1 now)
    s0, s1, s2 = tl.load(scale), tl.load(scale + 1), tl.load(scale + 2)
    base_pre, base_post = tl.load(base + o_i), tl.load(base + N + o_i)
    base_c = tl.load(base + 2 * N + o_ij)
    if ONE_PASS:
        m_d = o_d < D
        b_w = tl.load(norm_w + o_d, mask=m_d & NORM & gates, other=0.0)
    pdl_wait(PDL)
    b_ss = tl.load(ss_part + i_t * SPLIT + o_s, mask=m_s, other=0.0)
    b_mix = tl.load(mix_part + (i_t * SPLIT + o_s[:, None]) * BM + o_m[None, :],
                    mask=m_s[:, None], other=0.0)
    if ONE_PASS:  # (the comb's program reads no streams)
        b_x = tl.load(p_x + o_d[None, :], mask=m_d[None, :] & gates, other=0.0)
    b_ss, b_mix = tl.sum(b_ss, 0), tl.sum(b_mix, 0)
    b_r = 1.0 / tl.sqrt(b_ss / (N * D) + rms_eps)
    if not gates:
        b_c = sinkhorn(pick(b_mix, o_m, 2 * N + o_ij, 2) * b_r * s2 + base_c, iters, hc_eps)
        tl.store(comb + i_t * N * N + o_ij, b_c)
    else:
        b_pre = tl.sigmoid(pick(b_mix, o_m, o_i, 1) * b_r * s0 + base_pre) + hc_eps
        b_post = 2.0 * tl.sigmoid(pick(b_mix, o_m, N + o_i, 1) * b_r * s1 + base_post)
        tl.store(post + i_t * N + o_i, b_post)
        if ONE_PASS:
            b_u = tl.sum(b_pre[:, None] * b_x.to(tl.float32), 0).to(collapsed.dtype.element_ty)
            if NORM:
                b_uf = b_u.to(tl.float32)
                b_n = 1.0 / tl.sqrt(tl.sum(b_uf * b_uf, 0) / D + norm_eps)
                b_y = (b_uf * b_n).to(collapsed.dtype.element_ty).to(tl.float32)
                tl.store(normed + i_t * D + o_d, (b_y * b_w.to(tl.float32)).to(
                    normed.dtype.element_ty), mask=m_d)
            else:
                tl.store(collapsed + i_t * D + o_d, b_u, mask=m_d)
        else:
            b_uu = tl.zeros([BD], dtype=tl.float32)
            for d0 in range(0, D, BD):
                m_d = d0 + o_d < D
                b_x = tl.load(p_x + d0 + o_d[None, :], mask=m_d[None, :], other=0.0)
                b_u = tl.sum(b_pre[:, None] * b_x.to(tl.float32), 0).to(
                    collapsed.dtype.element_ty)
                tl.store(collapsed + i_t * D + d0 + o_d, b_u, mask=m_d)
                b_uu += b_u.to(tl.float32) * b_u.to(tl.float32)
            if NORM:
                b_n = 1.0 / tl.sqrt(tl.sum(b_uu, 0) / D + norm_eps)
                tl.debug_barrier()  # the row written above, read back by other threads
                for d0 in range(0, D, BD):
                    m_d = d0 + o_d < D
                    b_u = tl.load(collapsed + i_t * D + d0 + o_d, mask=m_d, other=0.0)
                    b_y = (b_u.to(tl.float32) * b_n).to(collapsed.dtype.element_ty).to(
                        tl.float32)
                    b_y = b_y * tl.load(norm_w + d0 + o_d, mask=m_d, other=0.0).to(tl.float32)
                    tl.store(normed + i_t * D + d0 + o_d, b_y.to(normed.dtype.element_ty),
                             mask=m_d)


def _mix_tile(n_tok: int) -> tuple[int, int, int]:
    """(tokens, columns, steps) of a mixing-pass program at n_tok tokens: one token a program
    below MIX_DOT_MIN_TOKENS, the decode batch's tl.dot tile, MIX_LARGE for prefill chunks."""
    if n_tok < MIX_DOT_MIN_TOKENS:
        return 1, MIX_COLUMNS, 1
    if n_tok < MIX_LARGE_MIN_TOKENS:
        return MIX_TOKENS, MIX_COLUMNS, MIX_STEPS
    return MIX_LARGE


def hc_pre(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    rms_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    norm_weight: torch.Tensor | None = None,
    norm_eps: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams: [T, n, D]; fn: [(2+n)*n, n*D]; base: [(2+n)*n]; scale: [3]; norm_weight: [D]
    (the block's input RMSNorm) or None. Returns post [T, n] fp32, comb [T, n, n] fp32,
    collapsed [T, D] in streams' dtype (RMS-normed when norm_weight is given, in streams' dtype
    promoted with its). n must be a power of 2. Two launches: the projection spread over
    programs, then one program a token."""
    n_tok, n, d = streams.shape
    assert n == next_pow2(n) and streams.is_contiguous()
    m, nd = (2 + n) * n, n * d
    bt, bc, steps = _mix_tile(n_tok)
    # tl.dot's operands are at least 16 wide
    bm = next_pow2(m) if bt == 1 else max(16, next_pow2(m))
    split = triton.cdiv(nd, bc * steps)
    mix_part = torch.empty((n_tok, split, bm), dtype=torch.float32, device=streams.device)
    ss_part = torch.empty((n_tok, split), dtype=torch.float32, device=streams.device)
    fn32 = fn.float().contiguous()
    on = pdl_early(streams.device, "mhc", (fn, fn32))
    if n_tok:
        hc_mix_kernel[(split, triton.cdiv(n_tok, bt))](
            streams, fn32, mix_part, ss_part, n_tok, nd, split, M=m, BM=bm, BC=bc, BT=bt,
            STEPS=steps, PRECISION=MIX_PRECISION, PDL=on, launch_pdl=on)
    return _gates(streams, mix_part, ss_part, base, scale, rms_eps, hc_eps, sinkhorn_iters,
                  norm_weight, norm_eps)


def _gates(streams, mix_part, ss_part, base, scale, rms_eps, hc_eps, sinkhorn_iters,
           norm_weight, norm_eps) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`hc_pre_kernel` over the mixing pass's parts [T, split, BM] and [T, split]: (post,
    comb, collapsed), as `hc_pre` returns them."""
    n_tok, n, d = streams.shape
    split, bm = mix_part.shape[1:]
    dev = streams.device
    post = torch.empty((n_tok, n), dtype=torch.float32, device=dev)
    comb = torch.empty((n_tok, n, n), dtype=torch.float32, device=dev)
    collapsed = torch.empty((n_tok, d), dtype=streams.dtype, device=dev)
    norm = norm_weight is not None
    out = collapsed if not norm else torch.empty(
        (n_tok, d), dtype=torch.promote_types(streams.dtype, norm_weight.dtype), device=dev)
    if n_tok:
        bd = min(next_pow2(d), PRE_COLUMNS)
        base32, scale32 = base.float().contiguous(), scale.float().contiguous()
        on = pdl_early(dev, "mhc", (base, base32), (scale, scale32))
        hc_pre_kernel[(n_tok, 2)](streams, mix_part, ss_part, base32, scale32,
                                norm_weight if norm else collapsed,
                                post, comb, collapsed, out, rms_eps, hc_eps, float(norm_eps),
                                sinkhorn_iters, d, split, N=n, BM=bm, BS=next_pow2(split),
                                BD=bd, NORM=norm, ONE_PASS=d <= bd, PDL=on, launch_pdl=on,
                                num_warps=PRE_WARPS)
    return post, comb, out


@triton.jit
def expand_rows(p_x, b_y, p_post, p_comb, D, N: tl.constexpr, m_d):
    """[N, BD] fp32: row j = post[j] y + sum_i comb[i, j] X[i] over the columns of p_x (the
    pointers [BD] of stream 0's columns; stream i lies i D on) and b_y [BD] fp32, as a chain of
    FMAs per element in i order (`hc_post_kernel`'s arithmetic). Every stream row is loaded
    here, before the caller stores anything: a load placed after a store is not hoisted above
    it (the pointers may alias), and an expansion per output stream with its loads between
    the stores cost `hc_post_mix_kernel` a round trip per stream (sm_90: 600 instructions,
    464 this way, all 28 loads ahead of the first store). At `hc_post_kernel`'s 512 columns
    the [BD] rows go through shared memory into the [N, BD] layout, a barrier per stream:
    that kernel keeps its per-stream form."""
    o_j = tl.arange(0, N)
    b_o = tl.load(p_post + o_j)[:, None] * b_y[None, :]
    for i in tl.static_range(N):
        b_x = tl.load(p_x + i * D, mask=m_d, other=0.0).to(tl.float32)
        # comb[i, j]: how much of input stream i flows into output stream j
        b_o += tl.load(p_comb + i * N + o_j)[:, None] * b_x[None, :]
    return b_o


@triton.jit
def hc_post_kernel(streams, block_out, post, comb, out, D, N: tl.constexpr, BD: tl.constexpr):
    """Program (i_t, i_d): columns i_d*BD.. of token i_t's N output streams. Each stream row is
    its own [BD] vector and the gates are scalars, so every output is a chain of FMAs in the
    thread that holds its column: no reduction across the streams (with the streams as one
    [N, BD] tile, each output's sum over them crossed warps, through shared memory)."""
    i_t, i_d = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    p_x = streams + i_t * N * D + o_d
    b_y = tl.load(block_out + i_t * D + o_d, mask=m_d, other=0.0).to(tl.float32)
    p_c = comb + i_t * N * N
    for j in tl.static_range(N):
        # comb[i, j]: how much of input stream i flows into output stream j
        b_o = tl.load(post + i_t * N + j) * b_y
        for i in tl.static_range(N):
            b_x = tl.load(p_x + i * D, mask=m_d, other=0.0).to(tl.float32)
            b_o += tl.load(p_c + i * N + j) * b_x
        tl.store(out + i_t * N * D + j * D + o_d, b_o.to(out.dtype.element_ty), mask=m_d)


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


@triton.jit
def hc_post_mix_kernel(streams, block_out, post, comb, out, fn, mix_part, ss_part, D, ND, SPLIT,
                       N: tl.constexpr, M: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr,
                       PDL: tl.constexpr):
    """Program (i_d, i_t): `hc_post_kernel` on columns i_d*BD.. of token i_t's N output
    streams, and, from the rows as stored (rounded to out's dtype), their part of the next
    site's projection fn @ x' ([M]) and of sum x'^2 over the N BD flattened columns j D + d
    (`hc_mix_kernel`'s parts, one a program: SPLIT = D / BD of them). fn's [BM, N, BD] slice
    is loaded first, with the streams: every load before the first store. PDL (`utils.pdl`):
    fn's slice is loaded before the wait for the kernel before."""
    pdl_start(PDL)
    i_d, i_t = tl.program_id(0), tl.program_id(1).to(tl.int64)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    o_m, o_j = tl.arange(0, BM), tl.arange(0, N)
    c_w = (o_j[:, None] * D + o_d[None, :])[None, :, :]
    m_w = (o_m < M)[:, None, None] & m_d[None, None, :]
    b_w = tl.load(fn + o_m[:, None, None] * ND + c_w, mask=m_w, other=0.0)
    pdl_wait(PDL)
    b_y = tl.load(block_out + i_t * D + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_o = expand_rows(streams + i_t * N * D + o_d, b_y, post + i_t * N, comb + i_t * N * N, D,
                      N, m_d).to(out.dtype.element_ty)
    tl.store(out + i_t * N * D + o_j[:, None] * D + o_d[None, :], b_o, mask=m_d[None, :])
    b_o = b_o.to(tl.float32)  # 0 past D: y and the streams load as 0 there
    tl.store(mix_part + (i_t * SPLIT + i_d) * BM + o_m, tl.sum(tl.sum(b_w * b_o[None], 2), 1))
    tl.store(ss_part + i_t * SPLIT + i_d, tl.sum(tl.sum(b_o * b_o, 1), 0))


def hc_post_pre(
    streams: torch.Tensor,
    block_out: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    rms_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    norm_weight: torch.Tensor | None = None,
    norm_eps: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`hc_post` then the next site's `hc_pre` on its output (arguments as theirs). Returns
    (streams [T, n, D] in streams' dtype, post, comb, collapsed). Below MIX_DOT_MIN_TOKENS
    tokens two launches (`hc_post_mix_kernel`, then `hc_pre_kernel`); from there on the
    mixing pass reads many tokens a program by tl.dot, and the three launches of the two ops
    run."""
    n_tok, n, d = streams.shape
    if n_tok >= MIX_DOT_MIN_TOKENS:
        streams = hc_post(streams, block_out, post, comb)
        return (streams, *hc_pre(streams, fn, base, scale, rms_eps, hc_eps, sinkhorn_iters,
                                 norm_weight, norm_eps))
    assert n == next_pow2(n)
    streams, block_out = streams.contiguous(), block_out.contiguous()
    post, comb = post.float().contiguous(), comb.float().contiguous()
    out = torch.empty_like(streams)
    m, bd = (2 + n) * n, max(1, MIX_COLUMNS // n)
    bm, split = next_pow2(m), triton.cdiv(d, bd)
    mix_part = torch.empty((n_tok, split, bm), dtype=torch.float32, device=streams.device)
    ss_part = torch.empty((n_tok, split), dtype=torch.float32, device=streams.device)
    fn32 = fn.float().contiguous()
    on = pdl_early(streams.device, "mhc", (fn, fn32))
    if n_tok:
        hc_post_mix_kernel[(split, n_tok)](streams, block_out, post, comb, out,
                                           fn32, mix_part, ss_part, d, n * d,
                                           split, N=n, M=m, BM=bm, BD=bd,
                                           PDL=on, launch_pdl=on)
    return (out, *_gates(out, mix_part, ss_part, base, scale, rms_eps, hc_eps, sinkhorn_iters,
                         norm_weight, norm_eps))
