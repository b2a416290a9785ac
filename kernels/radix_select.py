"""Exact top-k of the indexer's pool scores by radix select, in Triton, for
`sparse_mla.indexer_topk`: 4 histogram passes of 8 bits over chunks of each query's visible
scores, then a write pass that expands the top pools to token positions and appends the
open-pool tail. No host sync; the output is deterministic (ties go to the lower pool).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .utils import INTERPRET, next_pow2

__all__ = ["select_pools"]

# pools per radix-select program (8 warps: 8 keys a thread); small in the interpreter so CPU
# tests cover several chunks
SELECT_CHUNK = 64 if INTERPRET else 2048
# from this many (chunk, query) programs a pass, the last program of a query to finish a pass
# folds the chunk histograms into the next prefix once (an arrival counter per query and pass;
# one more launch, to zero the counters); below it, every program of the next pass re-reads
# them, which is cheaper while they are few. H200, batch 64 x 128K (1024 programs): select
# 96 us folded vs 163 us; batch 1 x 32K / 128K (4 / 16): 33 / 35 us folded vs 29 / 31 us
SELECT_FOLD_PROGRAMS = 32 if INTERPRET else 512


@triton.jit
def _order_key(b_v):
    """fp32 -> int64 in [0, 2^32) in the same order (sign-magnitude bits made monotonic)."""
    b_b = b_v.to(tl.int32, bitcast=True)
    b_b = tl.where(b_b >= 0, b_b, b_b ^ 0x7FFFFFFF)
    return b_b.to(tl.int64) + 2147483648


@triton.jit
def _threshold(hists, i_t, NCH, n_ch, BUDGET, PASSES: tl.constexpr, BNCH: tl.constexpr):
    """From the per-chunk radix histograms of the first PASSES digits (hists: [T, 4, NCH, 256],
    8 bits a digit from the top): the key prefix of the BUDGET-th largest key, how many keys
    with that prefix are still to be taken (`need`), and per chunk how many of its keys lie
    above the prefix (`n_gt`) and share it (`n_eq`, from the last pass)."""
    o_ch, o_bin = tl.arange(0, BNCH), tl.arange(0, 256)
    prefix = tl.zeros([1], dtype=tl.int64)
    need = tl.zeros([1], dtype=tl.int32) + BUDGET
    n_gt = tl.zeros([BNCH], dtype=tl.int32)
    n_eq = tl.zeros([BNCH], dtype=tl.int32)
    for d in tl.static_range(PASSES):
        p_h = hists + ((i_t * 4 + d) * NCH + o_ch)[:, None] * 256 + o_bin[None, :]
        b_hc = tl.load(p_h, mask=(o_ch < n_ch)[:, None], other=0)  # [BNCH, 256]
        b_h = tl.sum(b_hc, 0)
        above = tl.sum(b_h, 0) - tl.cumsum(b_h, 0)  # keys in bins above each bin
        # the highest bin with at least `need` keys in it and above it
        b_bin = tl.max(tl.where(above + b_h >= need, o_bin, -1), 0)
        need -= tl.sum(tl.where(o_bin == b_bin, above, 0), 0)
        prefix += b_bin.to(tl.int64) << (24 - 8 * d)
        n_gt += tl.sum(tl.where(o_bin[None, :] > b_bin, b_hc, 0), 1)
        n_eq = tl.sum(tl.where(o_bin[None, :] == b_bin, b_hc, 0), 1)
    return prefix, need, n_gt, n_eq


@triton.jit
def indexer_hist_kernel(scores, positions, hists, sel, before, arrivals, P, NCH, BUDGET,
                        KPOOL: tl.constexpr, PASS: tl.constexpr, CH: tl.constexpr,
                        BNCH: tl.constexpr, FOLD: tl.constexpr):
    """Program (chunk, query), radix pass PASS: the histogram of digit PASS over the chunk's
    visible keys that share the prefix the earlier passes fixed (only when the query sees more
    than BUDGET pools). The prefix comes from the earlier passes' histograms of all chunks or,
    with FOLD, from sel ([T, 2]: prefix, need), which the query's last program to arrive (a
    counter per query and pass) writes once; after the last pass that program also writes
    each chunk's count of keys above and at the threshold in the chunks before it (before:
    [T, 2, NCH])."""
    i_c, i_t = tl.program_id(0), tl.program_id(1).to(tl.int64)
    n = tl.minimum((tl.load(positions + i_t) + 1) // KPOOL, P)  # visible pools
    n_ch = tl.cdiv(n, CH)
    if (n > BUDGET) & (i_c < n_ch):
        if PASS == 0:
            prefix = tl.zeros([1], dtype=tl.int64)
        elif FOLD:
            prefix = tl.load(sel + i_t * 2 + tl.zeros([1], dtype=tl.int64))
        else:
            prefix, _, _, _ = _threshold(hists, i_t, NCH, n_ch, BUDGET, PASS, BNCH)
        o_p = i_c * CH + tl.arange(0, CH)
        b_key = _order_key(tl.load(scores + i_t * P + o_p, mask=o_p < n, other=0.0))
        shift: tl.constexpr = 24 - 8 * PASS
        match = (o_p < n) & ((b_key >> (shift + 8)) == (prefix >> (shift + 8)))
        b_h = tl.histogram(((b_key >> shift) & 255).to(tl.int32), 256, mask=match)
        tl.store(hists + ((i_t * 4 + PASS) * NCH + i_c) * 256 + tl.arange(0, 256), b_h)
        if FOLD:
            # every thread's stores before the arrival; the counter's acquire-release orders
            # them before the last program's loads
            tl.debug_barrier()
            last = tl.atomic_add(arrivals + i_t * 4 + PASS, 1, sem="acq_rel") == n_ch - 1
        else:
            last = False
        if last:
            prefix, need, n_gt, n_eq = _threshold(hists, i_t, NCH, n_ch, BUDGET, PASS + 1, BNCH)
            tl.store(sel + i_t * 2 + tl.arange(0, 2),
                     tl.where(tl.arange(0, 2) == 0, prefix, need.to(tl.int64)))
            if PASS == 3:
                o_ch = tl.arange(0, BNCH)
                p_b = before + i_t * 2 * NCH + o_ch
                tl.store(p_b, tl.cumsum(n_gt, 0) - n_gt, mask=o_ch < n_ch)
                tl.store(p_b + NCH, tl.cumsum(n_eq, 0) - n_eq, mask=o_ch < n_ch)


@triton.jit
def indexer_write_kernel(scores, positions, hists, sel, before, out, P, NCH, BUDGET, WOUT,
                         KPOOL: tl.constexpr, BKP: tl.constexpr, CH: tl.constexpr,
                         BNCH: tl.constexpr, FOLD: tl.constexpr):
    """Program (chunk, query): writes the tokens of the chunk's selected pools. Winners take
    output slots in pool order: keys above the threshold first, then the lowest pools among
    those equal to it, so the output is deterministic. Chunk 0 also writes the -1 padding
    (fewer visible pools than BUDGET) and the open-pool tail."""
    i_c, i_t = tl.program_id(0), tl.program_id(1).to(tl.int64)
    pos = tl.load(positions + i_t)
    n = tl.minimum((pos + 1) // KPOOL, P)
    p_out = out + i_t * WOUT
    o_p, o_k = i_c * CH + tl.arange(0, CH), tl.arange(0, BKP)
    m_p, m_k = o_p < n, o_k < KPOOL
    if n > BUDGET:
        if FOLD:
            i_1 = tl.zeros([1], dtype=tl.int64)
            m_c = i_c * CH < n
            prefix = tl.load(sel + i_t * 2 + i_1)
            need = tl.load(sel + i_t * 2 + 1 + i_1).to(tl.int32)
            gt_before = tl.load(before + (i_t * 2 + 0) * NCH + i_c + i_1, mask=m_c, other=0)
            eq_before = tl.load(before + (i_t * 2 + 1) * NCH + i_c + i_1, mask=m_c, other=0)
        else:
            prefix, need, n_gt, n_eq = _threshold(hists, i_t, NCH, tl.cdiv(n, CH), BUDGET, 4,
                                                  BNCH)
            ahead = tl.arange(0, BNCH) < i_c
            gt_before = tl.sum(tl.where(ahead, n_gt, 0), 0)
            eq_before = tl.sum(tl.where(ahead, n_eq, 0), 0)
        b_key = _order_key(tl.load(scores + i_t * P + o_p, mask=m_p, other=0.0))
        gt = m_p & (b_key > prefix)
        eq = m_p & (b_key == prefix)
        r_gt = gt_before + tl.cumsum(gt.to(tl.int32), 0) - 1
        r_eq = eq_before + tl.cumsum(eq.to(tl.int32), 0) - 1
        take = gt | (eq & (r_eq < need))
        slot = tl.where(gt, r_gt, BUDGET - need + r_eq)
    else:
        take = m_p
        slot = o_p
    # slot < BUDGET holds when the histograms are consistent; the mask keeps every store inside
    # its row regardless
    tl.store(p_out + slot[:, None] * KPOOL + o_k[None, :], o_p[:, None] * KPOOL + o_k[None, :],
             mask=(take & (slot >= 0) & (slot < BUDGET))[:, None] & m_k[None, :])
    if i_c == 0:
        for c in range(tl.minimum(n, BUDGET), BUDGET, CH):
            o_j = c + tl.arange(0, CH)
            tl.store(p_out + o_j[:, None] * KPOOL + o_k[None, :], -1,
                     mask=(o_j < BUDGET)[:, None] & m_k[None, :])
        # the open pool holding the query: (pos + 1) % KPOOL tokens, -1 padded to KPOOL - 1
        b_tail = (pos + 1) // KPOOL * KPOOL + o_k
        tl.store(p_out + BUDGET * KPOOL + o_k, tl.where(b_tail <= pos, b_tail, -1),
                 mask=o_k < KPOOL - 1)


def select_pools(scores: torch.Tensor, positions: torch.Tensor, pool_budget: int,
                 kpool: int) -> torch.Tensor:
    """scores: [T, P] -> token positions [T, pool_budget*kpool + kpool-1] (see
    sparse_mla.indexer_topk).

    Exact top-k by radix select over the order-preserving 32-bit keys of the scores: 4 passes
    of 8 bits, each one launch over (chunk of SELECT_CHUNK pools, query) storing per-chunk
    histograms (with many programs, the last program of a query to finish a pass folds them
    into the next prefix: SELECT_FOLD_PROGRAMS), then the write launch. Only the pools a
    query sees are read; when the block table addresses at most `pool_budget` pools every
    visible pool is taken and the passes are skipped."""
    n_tok, n_pools = scores.shape
    width = pool_budget * kpool + kpool - 1
    out = torch.empty((n_tok, width), dtype=torch.long, device=scores.device)
    n_ch = triton.cdiv(n_pools, SELECT_CHUNK)
    warps = 4 if INTERPRET else 8
    dev = scores.device
    passes = n_pools > pool_budget
    fold = passes and n_ch * n_tok >= SELECT_FOLD_PROGRAMS
    hists = torch.empty((n_tok, 4, n_ch, 256) if passes else (1,), dtype=torch.int32,
                        device=dev)
    if fold:  # the folded prefix and need, per-chunk counts before each chunk, arrivals
        sel = torch.empty((n_tok, 2), dtype=torch.long, device=dev)
        before = torch.empty((n_tok, 2, n_ch), dtype=torch.int32, device=dev)
        arrivals = torch.zeros((n_tok, 4), dtype=torch.int32, device=dev)
    else:  # not read by the unfolded kernels
        sel = before = arrivals = hists
    if passes:
        for d in range(4):
            indexer_hist_kernel[(n_ch, n_tok)](scores, positions, hists, sel, before, arrivals,
                                               n_pools, n_ch, pool_budget, KPOOL=kpool, PASS=d,
                                               CH=SELECT_CHUNK, BNCH=next_pow2(n_ch), FOLD=fold,
                                               num_warps=warps)
    indexer_write_kernel[(n_ch, n_tok)](scores, positions, hists, sel, before, out, n_pools,
                                        n_ch, pool_budget, width, KPOOL=kpool,
                                        BKP=next_pow2(kpool), CH=SELECT_CHUNK,
                                        BNCH=next_pow2(n_ch), FOLD=fold, num_warps=warps)
    return out
