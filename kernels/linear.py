"""Dense projections of a few tokens as one GEMV launch (the Triton twin of `ref/linear.py`).

At decode the dense weights (in_proj, o_proj, the dense FFNs, q/kv projections, the LM head:
8.6 GB of a rank-0 step's ~11) are read for 1-8 token rows. cuBLAS picks split-K kernels for
the narrow ones, a second (reduce) launch each: 72 of a 24-layer batch-1 step's 280 GEMM
launches on an H100 (rank0_l24_h100_int4_a4b1ae6.json). Here one program owns BN output rows
over the whole K: it streams [BN, BK] weight tiles with the next tile loaded before this one's
products, keeps the products per K lane in fp32 registers ([BT, BN, BK]) and reduces them once
after the loop, so every sum runs in one program in a fixed order (no atomics, no scratch, no
second launch). BN shrinks (8, 4, 2) until the grid has GEMV_PROGRAMS_PER_SM programs per
SM, because a program keeps only ~2 tiles in flight and the bandwidth needs many in flight.

Past GEMV_MAX_TOKENS rows (and for x whose rows are not contiguous, or K not a multiple of 8)
the reference (cuBLAS) runs: here every extra row costs an FMA a weight and registers (smaller
tiles a step), which tensor cores absorb. The constants are read at call time
(benchmarks/dense_gemv.py sweeps them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import moe
from .int4_gemv import PairRows, pair_rows_sum
from .ref import linear as ref_linear
from .utils import INTERPRET, next_pow2, num_sms, pdl, pdl_start, pdl_wait

__all__ = ["linear", "linear_swiglu"]

# token rows up to which the GEMV runs. Rank 0's projections summed over a step on an H100
# (dense_gemv_h100_37be788.json): 1 row 3.86 ms against cuBLAS's 4.19; 2 rows 4.24 vs 4.18,
# 4 rows 5.30 vs 4.19 (FMAs and registers grow with the rows; cuBLAS's tensor cores don't care)
GEMV_MAX_TOKENS = 1
# most K elements per step (a row's step is BK * 2 contiguous bytes) and warps per program
GEMV_BK, GEMV_WARPS = 2048, 4
# output rows per program at one token (divided by the token rows at more), and the programs
# per SM the grid is shrunk-BN towards. Rank 0's step sum at one row on an H100
# (dense_gemv_h100_3eba9c4.json): BN 8 3.82 ms, 16 3.95, 32 3.94 (4 programs an SM; 8 an SM
# 3.94-3.95 at any BN): 8 rows x 512 columns a step, 1 KiB runs a row
GEMV_BN_MAX, GEMV_PROGRAMS_PER_SM = 8, 4
# fp32 products a program keeps per K lane (BT x BN x BK): 32 registers a thread at 4 warps;
# BK takes what BT x BN leaves, so every tile streams the same bytes a step (8192: 4.10-4.26
# ms in the same sweep, registers)
GEMV_ACC = 4096


@triton.jit
def linear_gemv_kernel(x, w, out, add, T, N, K, stride_x, stride_o, stride_a, limit,
                       a_ids, a_wts, a_off, a_local,
                       BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       EVEN_K: tl.constexpr, ADD: tl.constexpr, SWIGLU: tl.constexpr,
                       A_K: tl.constexpr, A_SPLIT: tl.constexpr, A_BR: tl.constexpr,
                       PDL: tl.constexpr):
    """Program i_n: out[t, i_n*BN : +BN] = x[t] . w[rows] (+ add) for the T <= BT token rows:
    ADD 1, add[t, rows]; ADD 2, the sum of the `int4_gemv.PairRows` whose partial rows are
    add (`int4_gemv.pair_rows_sum`: a_ids, a_wts, a_off, a_local and A_K pairs a token,
    A_SPLIT rows a pair, A_BR >= their product), summed where its `reduce` would have
    written it. SWIGLU: w
    is [gate; up] (N rows, N/2 each) and the program takes BN/2 gate rows interleaved with
    their up rows (2j: gate j, 2j+1: up j), writing out[t, i_n*BN/2 : +BN/2] =
    silu(min(gate, limit)) * clamp(up, +-limit) from the fp32 sums. PDL (`utils.pdl`): the
    first weight tile is loaded before the wait for the kernel before."""
    pdl_start(PDL)
    i_n = tl.program_id(0)
    if SWIGLU:
        o_j = tl.arange(0, BN)
        o_c = i_n * (BN // 2) + o_j // 2
        m_n = o_c < N // 2
        o_n = o_c + (o_j % 2) * (N // 2)
    else:
        o_n = i_n * BN + tl.arange(0, BN)
        m_n = o_n < N
    o_t = tl.arange(0, BT)
    m_t = o_t < T
    o_k = tl.arange(0, BK)
    p_w = w + o_n.to(tl.int64)[:, None] * K + o_k[None, :]
    p_x = x + o_t[:, None] * stride_x + o_k[None, :]
    m_w = m_n[:, None]
    m_x = m_t[:, None]
    if not EVEN_K:
        m_w = m_w & (o_k[None, :] < K)
        m_x = m_x & (o_k[None, :] < K)
    b_w = tl.load(p_w, mask=m_w, other=0.0)
    pdl_wait(PDL)
    b_x = tl.load(p_x, mask=m_x, other=0.0)
    # what the epilogue adds, read now: its latency hides behind the K loop (ADD never comes
    # with SWIGLU, so these are the output's rows)
    if ADD == 1:
        b_add = tl.load(add + o_t[:, None] * stride_a + o_n[None, :],
                        mask=m_t[:, None] & m_n[None, :]).to(tl.float32)
    if ADD == 2:  # rounded to out's dtype, as the routed output `PairRows.reduce` writes
        b_add = pair_rows_sum(add, a_ids, a_wts, a_off, a_local, o_t, m_t, o_n, m_n, N, A_K,
                              A_SPLIT, A_BR).to(out.dtype.element_ty).to(tl.float32)
    acc = tl.zeros([BT, BN, BK], dtype=tl.float32)
    for k in range(BK, K, BK):
        # the next step's tiles before this step's products
        m_wn = m_n[:, None]
        m_xn = m_t[:, None]
        if not EVEN_K:
            m_wn = m_wn & (o_k[None, :] + k < K)
            m_xn = m_xn & (o_k[None, :] + k < K)
        n_w = tl.load(p_w + k, mask=m_wn, other=0.0)
        n_x = tl.load(p_x + k, mask=m_xn, other=0.0)
        acc += b_x.to(tl.float32)[:, None, :] * b_w.to(tl.float32)[None, :, :]
        b_w, b_x = n_w, n_x
    acc += b_x.to(tl.float32)[:, None, :] * b_w.to(tl.float32)[None, :, :]
    y = tl.sum(acc, 2)
    if SWIGLU:
        gate, up = tl.split(tl.reshape(y, [BT, BN // 2, 2]))
        gate = tl.minimum(gate, limit)
        y = gate * tl.sigmoid(gate) * tl.minimum(tl.maximum(up, -limit), limit)
        o_n = i_n * (BN // 2) + tl.arange(0, BN // 2)
        m_n = o_n < N // 2
    m_y = m_t[:, None] & m_n[None, :]
    if ADD != 0:
        y += b_add
    tl.store(out + o_t[:, None] * stride_o + o_n[None, :], y.to(out.dtype.element_ty), mask=m_y)


def gemv_tile(t: int, n: int, k: int, device: torch.device) -> tuple[int, int, int]:
    """(BT, BN, BK) for t token rows of an [n, k] weight. BN: GEMV_BN_MAX / BT, halved (down to
    2) while the grid has fewer than GEMV_PROGRAMS_PER_SM programs per SM; BK: the GEMV_ACC
    products over BT x BN, at most GEMV_BK and K's power of two."""
    bt = next_pow2(t)
    bn = max(2, GEMV_BN_MAX // bt)
    while bn > 2 and triton.cdiv(n, bn) < GEMV_PROGRAMS_PER_SM * num_sms(device):
        bn //= 2
    return bt, bn, max(16, min(GEMV_BK, next_pow2(k), GEMV_ACC // (bt * bn)))


def _gemv_fits(x2: torch.Tensor, weight: torch.Tensor, *rows_of: torch.Tensor | None) -> bool:
    """Whether the GEMV takes x2 [T, K] times weight: few rows, K in whole 16-byte words,
    contiguous rows everywhere (x2 and the `rows_of` tensors given)."""
    return (0 < x2.shape[0] <= GEMV_MAX_TOKENS and weight.shape[1] % 8 == 0
            and weight.is_contiguous() and x2.stride(-1) == 1
            and all(r is None or r.stride(-1) == 1 for r in rows_of))


def _launch(x2, weight, y, add2: torch.Tensor | PairRows | None, limit, swiglu):
    t, (n, k) = x2.shape[0], weight.shape
    if weight.dtype != torch.float32:
        # the reference rounds x to the weight's dtype first; to fp32 (the indexer's fp32
        # head weights) the kernel's own load widens it exactly: no cast launch
        x2 = x2.to(weight.dtype)
    bt, bn, bk = gemv_tile(t, n, k, x2.device)
    on = pdl(x2.device, "linear")
    pairs = add2 if isinstance(add2, PairRows) else None
    if pairs is not None:
        add2 = pairs.partial
        a_args = (pairs.ids, pairs.weights, pairs.expert_offset, pairs.num_local)
        a_const = dict(A_K=pairs.k, A_SPLIT=pairs.split, A_BR=next_pow2(pairs.k * pairs.split))
    else:
        a_args, a_const = (y, y, 0, 0), dict(A_K=1, A_SPLIT=1, A_BR=1)
    linear_gemv_kernel[(triton.cdiv(n, bn),)](
        x2, weight, y, y if add2 is None else add2, t, n, k, x2.stride(0), y.stride(0),
        0 if add2 is None else add2.stride(0), float(limit), *a_args, BT=bt, BN=bn, BK=bk,
        EVEN_K=k % bk == 0, ADD=0 if add2 is None else 2 if pairs is not None else 1,
        SWIGLU=swiglu, PDL=on, launch_pdl=on, num_warps=1 if INTERPRET else GEMV_WARPS,
        **a_const)


def linear(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None,
           add: torch.Tensor | PairRows | None = None) -> torch.Tensor:
    """x [..., K] times weight [N, K] -> [..., N] in weight's dtype, plus `add` ([..., N],
    summed in fp32 before the one rounding) if given; `out` (x 2-D, [T, N], rows contiguous):
    written there. Up to GEMV_MAX_TOKENS rows one GEMV launch, else cuBLAS (and an add). `add`
    may be the routed experts' sum not yet taken (`int4_gemv.PairRows`, [T, N]): the GEMV
    takes it in its epilogue, as `PairRows.reduce` would (a launch fewer); else it is reduced
    first. The GEMV may read the weight before the kernel before it has finished
    (`utils.pdl`): a weight, not something the kernel just before wrote."""
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    if isinstance(add, PairRows):
        if add.shape != (x2.shape[0], n):
            raise ValueError(f"linear: add sums to {add.shape}, the product is "
                             f"{(x2.shape[0], n)}")
        if not _gemv_fits(x2, weight, out, add.partial):
            add = add.reduce().view(*x.shape[:-1], n)
    add2 = add if add is None or isinstance(add, PairRows) else add.reshape(-1, n)
    if not _gemv_fits(x2, weight, out, add2.partial if isinstance(add2, PairRows) else add2):
        return ref_linear.linear(x, weight, out, add)
    y = out if out is not None else torch.empty(x2.shape[0], n, dtype=weight.dtype,
                                                device=x.device)
    _launch(x2, weight, y, add2, 0.0, False)
    return y if out is not None else y.view(*x.shape[:-1], n)


def linear_swiglu(x: torch.Tensor, weight: torch.Tensor, limit: float) -> torch.Tensor:
    """swiglu of x [..., K] times weight [2I, K] = [gate; up] -> [..., I] in weight's dtype,
    from the fp32 sums (one launch, no [T, 2I] intermediate); past the GEMV's rows cuBLAS and
    `moe.swiglu` (two launches)."""
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    if not _gemv_fits(x2, weight):
        return moe.swiglu(*ref_linear.linear(x, weight).chunk(2, dim=-1), limit)
    y = torch.empty(x2.shape[0], n // 2, dtype=weight.dtype, device=x.device)
    _launch(x2, weight, y, None, limit, True)
    return y.view(*x.shape[:-1], n // 2)
