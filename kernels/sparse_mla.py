"""Triton KPool-DSA ops over the paged latent cache (twins of `kernels/ref/sparse_mla.py`).

- `indexer_update`: pools complete 4-token groups (per-channel softmax over gate + ape) into the
  paged pool cache, reading earlier rows of an open pool from the slot's ring, then writes this
  step's rows into the ring (a second launch: the first still reads the ring).
- `indexer_topk`: one program per (BP pools, query) scores the visible pools of the query's
  sequence through its block table (sum_h w_h relu(q_h . K_p / sqrt(d)));
  an exact radix select (`kernels/radix_select.py`: 4 histogram passes of 8 bits over chunks of
  the visible scores, then a write pass) expands the top pools to token positions and appends
  the open-pool tail.
- `sparse_mla_attention`: absorbed MLA over the selected latent rows (plain, or fp8 / nvfp4
  rows dequantised as they are loaded). One program covers all
  heads of a query (up to 64, a tensor-core tile), so every selected row is read once per
  query; the output columns are halved across two programs, and the selection is split when
  there are few queries, the partial results merged by log-sum-exp (flash-decoding);
  DCP-aware.
- `merge_attention_states`: the log-sum-exp merge of partial results (also the split merge).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .latent_quant import latent_kernel_args, latent_tile, store_latent
from .radix_select import select_pools
from .ref.latent_quant import hadamard_rotate
from .utils import INTERPRET, is_sm120, log2_ceil, next_pow2, seq_of_token

__all__ = ["indexer_topk", "indexer_update", "merge_attention_states", "sparse_mla_attention"]

# programs wanted in flight for the split heuristic (2 per SM on an H100/H200)
TARGET_PROGRAMS = 264
# fewest selected rows per split: each split writes an fp32 [H, Lc] partial (2x its row bytes
# at 128 rows of bf16)
MIN_SPLIT_ROWS = 32 if INTERPRET else 128
# output columns per attention program when the latent is halved: bounds the fp32 accumulator
# to [64, 256] (128 registers a thread over 4 warps); narrow in the interpreter so CPU tests
# cover the halves
COL_TILE = 16 if INTERPRET else 256
# software-pipeline depth of the attention loop: the pipeliner issues the index -> block table
# -> row chain of a step as cp.async this many - 1 steps ahead (4 covers the whole chain; on
# the H200, 4 stages with the chain in the step beat resolving it a step ahead by hand by
# 3% / 19% / 32% at batch 1 / 16 / 64: benchmarks/results/sparse_mla_sweep_h200_c3a58b4.json)
ATTENTION_STAGES = 4
# selected rows per attention step in bf16 (the N of the QK^T tile, the K of PV); fp32 takes 16
ATTENTION_ROWS = 32
# warps per bf16 attention program: 4 (one warpgroup, what Hopper's wgmma wants for a 64-row
# tile) measured faster than 8 with the pipelined chain
ATTENTION_WARPS = 4
# the SM120 tiling (RTX PRO 6000 Blackwell: 99 KB of shared memory a block, and mma.sync, whose
# operands sit in registers): the Hopper one needs 103 KB there and spills 72-80 B a thread;
# 16 rows a step on 8 warps needs 84 KB, 184 registers, no spills (scripts/kernel_build.py;
# chosen by fit, not yet timed on an SM120 GPU)
SM120_ATTENTION_ROWS = 16
SM120_ATTENTION_WARPS = 8


@triton.jit
def indexer_pool_kernel(keys, gates, ape, open_rows, pool_cache, positions, slot_mapping,
                        cu_seqlens, state_ids, N, stride_k, stride_g, LOG_N: tl.constexpr,
                        D: tl.constexpr, KPOOL: tl.constexpr, R: tl.constexpr,
                        BKP: tl.constexpr, BD: tl.constexpr, BY_TOKEN: tl.constexpr):
    """Program t: when token t closes a pool, its pooled key goes to the pool's cache slot
    (or, with BY_TOKEN, to row t of pool_cache, for the caller to rotate and pack)."""
    i_t = tl.program_id(0)
    pos = tl.load(positions + i_t)
    if (pos + 1) % KPOOL == 0:
        i_n = seq_of_token(i_t + tl.zeros([1], dtype=tl.int64), cu_seqlens, N, LOG_N)
        bos = tl.sum(tl.load(cu_seqlens + i_n))
        i_s = tl.sum(tl.load(state_ids + i_n))
        first = tl.load(positions + bos)
        o_j, o_d = tl.arange(0, BKP), tl.arange(0, BD)
        m_j, m_d = o_j < KPOOL, o_d < D
        o_p = pos - KPOOL + 1 + o_j  # positions of the pool's rows
        here = o_p >= first
        o_tok = i_t - (pos - o_p)
        m_here = (m_j & here)[:, None] & m_d[None, :]
        m_ring = (m_j & ~here)[:, None] & m_d[None, :]
        p_ring = open_rows + (i_s.to(tl.int64) * R + o_p % R)[:, None] * (2 * D) + o_d[None, :]
        o_tok = o_tok.to(tl.int64)
        b_k = tl.load(keys + o_tok[:, None] * stride_k + o_d[None, :], mask=m_here, other=0.0)
        b_k += tl.load(p_ring, mask=m_ring, other=0.0)
        b_z = tl.load(gates + o_tok[:, None] * stride_g + o_d[None, :], mask=m_here, other=0.0)
        b_z += tl.load(p_ring + D, mask=m_ring, other=0.0)
        b_z = b_z.to(tl.float32) + tl.load(ape + o_j[:, None] * D + o_d[None, :],
                                           mask=m_j[:, None] & m_d[None, :], other=0.0)
        b_z = tl.where(m_j[:, None], b_z, float("-inf"))
        b_z = tl.exp(b_z - tl.max(b_z, 0)[None, :])
        b_pool = tl.sum(b_z * b_k.to(tl.float32), 0) / tl.sum(b_z, 0)
        i_slot = (i_t.to(tl.int64) if BY_TOKEN
                  else tl.load(slot_mapping + i_t).to(tl.int64) // KPOOL)
        tl.store(pool_cache + i_slot * D + o_d, b_pool.to(pool_cache.dtype.element_ty), mask=m_d)


@triton.jit
def indexer_ring_kernel(keys, gates, open_rows, positions, cu_seqlens, state_ids, N, stride_k,
                        stride_g, LOG_N: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
                        BD: tl.constexpr):
    i_t = tl.program_id(0)
    i_n = seq_of_token(i_t + tl.zeros([1], dtype=tl.int64), cu_seqlens, N, LOG_N)
    eos = tl.sum(tl.load(cu_seqlens + i_n + 1))
    i_s = tl.sum(tl.load(state_ids + i_n))
    pos = tl.load(positions + i_t)
    o_d = tl.arange(0, BD)
    m_d = (o_d < D) & (i_t >= eos - R)  # only the last R rows of a step can still be needed
    p_ring = open_rows + (i_s.to(tl.int64) * R + pos % R) * (2 * D) + o_d
    i_t64 = i_t.to(tl.int64)
    b_k = tl.load(keys + i_t64 * stride_k + o_d, mask=m_d, other=0.0)
    b_z = tl.load(gates + i_t64 * stride_g + o_d, mask=m_d, other=0.0)
    tl.store(p_ring, b_k.to(open_rows.dtype.element_ty), mask=m_d)
    tl.store(p_ring + D, b_z.to(keys.dtype.element_ty).to(open_rows.dtype.element_ty), mask=m_d)


def indexer_update(
    keys: torch.Tensor,
    gates: torch.Tensor,
    ape: torch.Tensor,
    open_rows: torch.Tensor,
    pool_cache: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_ids: torch.Tensor,
    pool_format: str = "plain",
) -> None:
    """keys, gates: [T, d]; ape: [kpool, d]; open_rows: [S, R, 2d] ring of recent rows;
    pool_cache: [B, bs/kpool, d] (or fp8 rows of rotated keys, `pool_format` "fp8");
    positions, slot_mapping: [T]; cu_seqlens: [N+1]; state_ids: [N]. With fp8 pool keys the
    pooled rows land in a [T, d] buffer, are rotated (`hadamard_rotate`, the reference's own
    torch code, so bit-identical) and packed by `store_latent`;
    tokens that close no pool write row 0 of the null block, which holds nothing.
    """
    n_tok, d = keys.shape
    kpool, ring = ape.shape[0], open_rows.shape[1]
    n_seq = cu_seqlens.shape[0] - 1
    assert keys.stride(1) == 1 and gates.stride(1) == 1 and open_rows.is_contiguous()
    assert ape.is_contiguous() and pool_cache.is_contiguous() and ring >= kpool
    if n_tok == 0:
        return
    args = dict(LOG_N=log2_ceil(n_seq), D=d, BD=next_pow2(d))
    fp8 = pool_format == "fp8"
    pooled = torch.zeros((n_tok, d), dtype=torch.float32, device=keys.device) if fp8 else None
    indexer_pool_kernel[(n_tok,)](keys, gates, ape, open_rows, pooled if fp8 else pool_cache,
                                  positions, slot_mapping, cu_seqlens, state_ids, n_seq,
                                  keys.stride(0), gates.stride(0), KPOOL=kpool, R=ring,
                                  BKP=next_pow2(kpool), BY_TOKEN=fp8, **args)
    if fp8:
        closing = (positions + 1) % kpool == 0
        slots = torch.where(closing, slot_mapping.long() // kpool, 0)
        store_latent(hadamard_rotate(pooled), pool_cache, slots, latent_format="fp8")
    indexer_ring_kernel[(n_tok,)](keys, gates, open_rows, positions, cu_seqlens, state_ids, n_seq,
                                  keys.stride(0), gates.stride(0), R=ring, **args)


@triton.jit
def indexer_score_kernel(q, w, pool_cache, pool32, block_tables, query_seq, positions, scores,
                         scale, head_scale, P, stride_bt, HI: tl.constexpr, D: tl.constexpr,
                         PPB: tl.constexpr, KPOOL: tl.constexpr, RB: tl.constexpr,
                         PFMT: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr,
                         BP: tl.constexpr, F32: tl.constexpr):
    i_p, i_t = tl.program_id(0), tl.program_id(1).to(tl.int64)
    seq, pos = tl.load(query_seq + i_t).to(tl.int64), tl.load(positions + i_t)
    o_p = i_p * BP + tl.arange(0, BP)
    m_p = (o_p < P) & (o_p * KPOOL + KPOOL - 1 <= pos)
    o_h, o_d = tl.arange(0, BH), tl.arange(0, BD)
    m_h, m_d = o_h < HI, o_d < D
    if i_p * BP * KPOOL + KPOOL - 1 <= pos:
        i_b = tl.load(block_tables + seq * stride_bt + o_p // PPB, mask=m_p, other=0)
        # plain keys, or fp8 rows (PFMT 1) dequantised
        # the row as (i_b PPB - 1) + (o_p % PPB + 1): Triton's alignment analysis takes
        # i_b * PPB + o_p % PPB as a multiple of PPB in every lane (the divisibility of the
        # runs' first rows), and then loaded fp8 rows (132 B, 4-byte aligned) 16 bytes at a
        # time: a misaligned address on the GPU. Written this way no lane claims more than 1.
        i_row = (i_b.to(tl.int64) * PPB - 1) + (o_p % PPB + 1)
        b_k = latent_tile(pool_cache, pool32, i_row, o_d, m_p, m_d, D, RB, 0, PFMT)
        p_q = q + (i_t * HI + o_h)[:, None] * D + o_d[None, :]
        b_q = tl.load(p_q, mask=m_h[:, None] & m_d[None, :], other=0.0)
        if F32:
            b_s = tl.dot(b_q.to(tl.float32), tl.trans(b_k.to(tl.float32)), input_precision="ieee")
        else:
            b_s = tl.dot(b_q, tl.trans(b_k.to(b_q.dtype)))
        b_s = tl.maximum(b_s * scale, 0.0)
        b_w = tl.load(w + i_t * HI + o_h, mask=m_h, other=0.0).to(tl.float32) * head_scale
        b_i = tl.sum(b_s * b_w[:, None], 0)
        # tiles past the visible pools are never read (the select stops there): not written
        tl.store(scores + i_t * P + o_p, tl.where(m_p, b_i, float("-inf")), mask=o_p < P)


def _score_pools(q, head_weights, pool_cache, block_tables, query_seq, positions,
                 kpool, pool_format, head_scale) -> torch.Tensor:
    """Index scores [T, M * bs/kpool] fp32 of the pool slots the block table addresses, defined
    up to each query's last visible pool (-inf past it within the last tile, unwritten beyond):
    one program per (BP pools, query), all heads in one tl.dot."""
    n_tok, heads, d = q.shape
    ppb = pool_cache.shape[1]
    n_pools = block_tables.shape[1] * ppb
    scores = torch.empty((n_tok, n_pools), dtype=torch.float32, device=q.device)
    bp = 64 if n_pools >= 64 else max(16, next_pow2(n_pools))
    cache = latent_kernel_args(pool_cache, d, "fp8" if pool_format == "fp8" else "plain")
    indexer_score_kernel[(triton.cdiv(n_pools, bp), n_tok)](
        q, head_weights, pool_cache, cache["kv32"], block_tables, query_seq, positions, scores,
        d ** -0.5, float(head_scale), n_pools, block_tables.stride(0), HI=heads, D=d, PPB=ppb,
        KPOOL=kpool, RB=cache["RB"], PFMT=cache["FMT"], BH=max(16, next_pow2(heads)),
        BD=max(16, next_pow2(d)), BP=bp, F32=INTERPRET or q.dtype == torch.float32)
    return scores


def indexer_topk(
    q: torch.Tensor,
    head_weights: torch.Tensor,
    pool_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_seq: torch.Tensor,
    positions: torch.Tensor,
    pool_budget: int,
    kpool: int,
    pool_format: str = "plain",
    head_scale: float = 1.0,
) -> torch.Tensor:
    """q: [T, Hi, d]; head_weights: [T, Hi], times head_scale in the scoring kernel (no
    launch of its own); pool_cache: [B, bs/kpool, d] (or fp8 rows of rotated keys,
    `pool_format` "fp8"); block_tables: [N, M];
    query_seq, positions: [T]. Returns token positions [T, pool_budget*kpool + kpool-1] int64
    (-1 = unused): the top pools' tokens (in pool order, ties to the lower pool), then the
    open-pool tail. No host sync: scoring of every pool slot the block table can address, then
    the radix select over each query's visible pools (6 launches; 2 when the table addresses
    at most `pool_budget` pools)."""
    n_tok = q.shape[0]
    if n_tok == 0:
        return torch.empty((0, pool_budget * kpool + kpool - 1), dtype=torch.long,
                           device=q.device)
    if pool_format == "fp8":  # rotated keys: rotate the queries alike
        q = hadamard_rotate(q).to(q.dtype)
    q, head_weights = q.contiguous(), head_weights.contiguous()
    assert pool_cache.is_contiguous()
    scores = _score_pools(q, head_weights, pool_cache, block_tables, query_seq, positions, kpool,
                          pool_format, head_scale)
    return select_pools(scores, positions, pool_budget, kpool)


@triton.jit
def _cache_rows(token_indices, block_tables, seq, i_t, o_w, w_hi, W, stride_bt, dcp_rank,
                LBS: tl.constexpr, DCP: tl.constexpr):
    """Cache rows (block * LBS + offset) holding the latent rows of selected slots o_w ([BW])
    of query i_t, and which slots hold a row on this rank."""
    b_idx = tl.load(token_indices + i_t * W + o_w, mask=o_w < w_hi, other=-1).to(tl.int64)
    ok = b_idx >= 0
    if DCP > 1:
        ok = ok & (b_idx % DCP == dcp_rank)
    b_idx = tl.maximum(b_idx, 0)
    i_b = tl.load(block_tables + seq * stride_bt + b_idx // (LBS * DCP), mask=ok, other=0)
    return i_b.to(tl.int64) * LBS + (b_idx % (LBS * DCP)) // DCP, ok


@triton.jit
def sparse_mla_fwd_kernel(q, kv, kv32, block_tables, query_seq, token_indices, o, lse, scale, T,
                          H, W, WS, stride_bt, dcp_rank, LBS: tl.constexpr, DCP: tl.constexpr,
                          C: tl.constexpr, RB: tl.constexpr, OUTER: tl.constexpr,
                          FMT: tl.constexpr, BH: tl.constexpr, BW: tl.constexpr,
                          BO: tl.constexpr, HALVES: tl.constexpr, F32: tl.constexpr):
    """Program (i_c, i_s, i_t * n_ht + i_h): heads i_h*BH.. of query i_t over selected rows
    i_s*WS.. (a split), accumulating output columns i_c*BO.. . With HALVES the row is read as
    this program's column half (scores and values) and the other half (scores only), so each
    row byte is loaded once. The index -> block table -> row chain (three dependent loads) sits
    in the step, where Triton's pipeliner issues it stages ahead as cp.async. Quantised rows
    (FMT 1 fp8, 2 nvfp4; RB bytes each) are dequantised in registers (`latent_tile`)."""
    i_c, i_s, i_th = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n_ht = tl.cdiv(H, BH)
    i_t, i_h = (i_th // n_ht).to(tl.int64), i_th % n_ht
    seq = tl.load(query_seq + i_t).to(tl.int64)
    o_h, o_b = i_h * BH + tl.arange(0, BH), tl.arange(0, BO)
    o_own, o_oth = i_c * BO + o_b, (1 - i_c) * BO + o_b
    m_h, m_own, m_oth = o_h < H, o_own < C, o_oth < C
    p_q = q + (i_t * H + o_h)[:, None] * C
    b_q = tl.load(p_q + o_own[None, :], mask=m_h[:, None] & m_own[None, :], other=0.0)
    if F32:
        b_q = b_q.to(tl.float32)
    if HALVES:
        b_q2 = tl.load(p_q + o_oth[None, :], mask=m_h[:, None] & m_oth[None, :], other=0.0)
        if F32:
            b_q2 = b_q2.to(tl.float32)
    qk_scale = scale * 1.4426950408889634  # exp2 domain
    b_m = tl.full([BH], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BH], dtype=tl.float32)
    b_acc = tl.zeros([BH, BO], dtype=tl.float32)
    w_lo = i_s * WS
    w_hi = tl.minimum(w_lo + WS, W)
    for w0 in range(w_lo, w_hi, BW):
        i_row, ok = _cache_rows(token_indices, block_tables, seq, i_t, w0 + tl.arange(0, BW), w_hi,
                                W, stride_bt, dcp_rank, LBS, DCP)
        b_kv = latent_tile(kv, kv32, i_row, o_own, ok, m_own, C, RB, OUTER, FMT)
        if HALVES:
            b_kv2 = latent_tile(kv, kv32, i_row, o_oth, ok, m_oth, C, RB, OUTER, FMT)
        if FMT != 0 and not F32:  # dequantised values are exact in bf16 (<= 6 bits)
            b_kv = b_kv.to(q.dtype.element_ty)
            if HALVES:
                b_kv2 = b_kv2.to(q.dtype.element_ty)
        if F32:
            b_kv = b_kv.to(tl.float32)
            b_s = tl.dot(b_q, tl.trans(b_kv), input_precision="ieee")
            if HALVES:
                b_s += tl.dot(b_q2, tl.trans(b_kv2.to(tl.float32)), input_precision="ieee")
        else:
            b_s = tl.dot(b_q, tl.trans(b_kv))
            if HALVES:
                b_s += tl.dot(b_q2, tl.trans(b_kv2))
        b_s = tl.where(ok[None, :], b_s * qk_scale, float("-inf"))
        b_mn = tl.maximum(b_m, tl.max(b_s, 1))
        b_ms = tl.where(b_mn == float("-inf"), 0.0, b_mn)
        b_p = tl.exp2(b_s - b_ms[:, None])
        b_a = tl.exp2(b_m - b_ms)
        b_l = b_l * b_a + tl.sum(b_p, 1)
        if F32:
            b_acc = b_acc * b_a[:, None] + tl.dot(b_p, b_kv, input_precision="ieee")
        else:
            b_acc = b_acc * b_a[:, None] + tl.dot(b_p.to(b_kv.dtype), b_kv)
        b_m = b_mn
    has = b_l > 0
    b_o = b_acc / tl.where(has, b_l, 1.0)[:, None]
    # natural-log lse from the base-2 running max
    b_lse = tl.where(has, (b_m + tl.log2(tl.where(has, b_l, 1.0))) * 0.6931471805599453,
                     float("-inf"))
    o_part = (i_s.to(tl.int64) * T + i_t) * H + o_h
    tl.store(o + o_part[:, None] * C + o_own[None, :], b_o.to(o.dtype.element_ty),
             mask=m_h[:, None] & m_own[None, :])
    tl.store(lse + o_part, b_lse, mask=m_h & (i_c == 0))


@triton.jit
def merge_states_kernel(outs, lses, out, lse, P, TH, C, HAS_LSE: tl.constexpr,
                        BR: tl.constexpr, BC: tl.constexpr):
    """Program (BR rows of T*H, BC columns): out = sum_p exp(lse_p - lse) out_p over the P
    parts (a part with lse -inf has no rows and weighs 0)."""
    i_r, i_c = tl.program_id(0), tl.program_id(1)
    o_r, o_c = i_r.to(tl.int64) * BR + tl.arange(0, BR), i_c * BC + tl.arange(0, BC)
    m_r, m_c = o_r < TH, o_c < C
    b_max = tl.full([BR], float("-inf"), dtype=tl.float32)
    for i_p in range(P):
        b_max = tl.maximum(b_max, tl.load(lses + i_p * TH + o_r, mask=m_r, other=float("-inf")))
    b_ms = tl.where(b_max == float("-inf"), 0.0, b_max)
    b_sum = tl.zeros([BR], dtype=tl.float32)
    b_acc = tl.zeros([BR, BC], dtype=tl.float32)
    for i_p in range(P):
        b_w = tl.exp(tl.load(lses + i_p * TH + o_r, mask=m_r, other=float("-inf")) - b_ms)
        # o_r is int64: the element offsets (parts x rows x C) may pass 2^31
        b_o = tl.load(outs + (i_p * TH + o_r)[:, None] * C + o_c[None, :],
                      mask=m_r[:, None] & m_c[None, :], other=0.0)
        b_sum += b_w
        b_acc += b_w[:, None] * b_o.to(tl.float32)
    has = b_sum > 0
    b_acc = b_acc / tl.where(has, b_sum, 1.0)[:, None]
    tl.store(out + o_r[:, None] * C + o_c[None, :], b_acc.to(out.dtype.element_ty),
             mask=m_r[:, None] & m_c[None, :])
    if HAS_LSE:
        b_tot = tl.where(has, b_ms + tl.log(tl.where(has, b_sum, 1.0)), float("-inf"))
        tl.store(lse + o_r, b_tot, mask=m_r & (i_c == 0))


def _merge(outs: torch.Tensor, lses: torch.Tensor, out: torch.Tensor,
           lse: torch.Tensor | None) -> None:
    parts, c = outs.shape[0], outs.shape[-1]
    rows = outs[0].numel() // c
    if rows == 0:
        return
    bc = min(next_pow2(c), 128)
    # few rows a program on the GPU (batch-1 decode merges only 64 rows); the interpreter
    # pays per program, so it takes many
    br = 16 if INTERPRET else 2
    merge_states_kernel[(triton.cdiv(rows, br), triton.cdiv(c, bc))](
        outs, lses, out, lse, parts, rows, c, HAS_LSE=lse is not None, BR=br, BC=bc)


def merge_attention_states(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """outs: [P, T, H, C]; lses: [P, T, H]. Returns [T, H, C] in outs' dtype."""
    outs, lses = outs.contiguous(), lses.float().contiguous()
    out = torch.empty(outs.shape[1:], dtype=outs.dtype, device=outs.device)
    _merge(outs, lses, out, None)
    return out


def _attention_plan(n_tok: int, heads: int, width: int, lc: int, f32: bool,
                    sm120: bool = False) -> dict:
    """Tiles, warps and splits of `sparse_mla_fwd_kernel` for T queries of H heads over W rows
    (the SM120 tiling where `sm120`).

    All heads of a query share one program (a 64-row tensor-core tile; more heads tile the
    grid), so each selected row is read once per query. A latent of at least 2 * COL_TILE
    columns is halved across two programs to bound the fp32 accumulator ([64, 256] over
    ATTENTION_WARPS); both read the whole row for the scores (the second from L2). The selection is
    split so about TARGET_PROGRAMS programs run, but never below MIN_SPLIT_ROWS rows per split:
    every split writes a [H, Lc] fp32 partial (2x its row reads at 128 rows)."""
    bh = min(64, max(16, next_pow2(heads)))
    bc = next_pow2(lc)
    bw = 16 if f32 else SM120_ATTENTION_ROWS if sm120 else ATTENTION_ROWS
    warps = 4 if f32 else SM120_ATTENTION_WARPS if sm120 else ATTENTION_WARPS
    halves = bc >= 2 * COL_TILE
    base = n_tok * triton.cdiv(heads, bh) * (2 if halves else 1)
    splits = max(1, min(triton.cdiv(TARGET_PROGRAMS, base), triton.cdiv(width, MIN_SPLIT_ROWS)))
    ws = triton.cdiv(triton.cdiv(width, splits), bw) * bw if width else bw
    return dict(BH=bh, BW=bw, BO=bc // 2 if halves else bc, HALVES=halves,
                splits=triton.cdiv(width, ws) or 1, ws=ws, grid_c=2 if halves else 1, warps=warps)


def sparse_mla_attention(
    q_latent: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_seq: torch.Tensor,
    token_indices: torch.Tensor,
    scale: float,
    dcp_rank: int = 0,
    dcp_size: int = 1,
    latent_format: str = "plain",
) -> tuple[torch.Tensor, torch.Tensor]:
    """q_latent: [T, H, Lc]; latent_cache: [B, bs / dcp_size, Lc] (or uint8 rows of
    `latent_format` fp8 / nvfp4); block_tables: [N, M];
    query_seq: [T]; token_indices: [T, W] (-1 = unused). Returns out [T, H, Lc] in q's dtype and
    lse [T, H] fp32 (-inf where a query has no row on this rank). One launch, plus the
    log-sum-exp merge when the selection is split (few queries)."""
    n_tok, heads, lc = q_latent.shape
    width = token_indices.shape[1]
    if token_indices.shape[0] != n_tok or query_seq.shape[0] != n_tok:
        raise ValueError(f"{n_tok} queries but {token_indices.shape[0]} index rows and "
                         f"{query_seq.shape[0]} sequence ids")
    q_latent, token_indices = q_latent.contiguous(), token_indices.contiguous()
    assert latent_cache.is_contiguous()
    out = torch.empty_like(q_latent)
    lse = torch.empty((n_tok, heads), dtype=torch.float32, device=q_latent.device)
    if n_tok == 0:
        return out, lse
    f32 = INTERPRET or q_latent.dtype == torch.float32
    sm120 = is_sm120(q_latent.device)
    if sm120 and latent_format != "plain":
        raise NotImplementedError(
            f"sparse attention over {latent_format} latent rows does not fit an SM120 GPU's 99 KB "
            "of shared memory a block yet (scripts/kernel_build.py): use --kv-cache-dtype auto")
    plan = _attention_plan(n_tok, heads, width, lc, f32, sm120)
    splits = plan["splits"]
    if splits == 1:
        o_part, lse_part = out, lse
    else:
        o_part = torch.empty((splits, n_tok, heads, lc), dtype=torch.float32,
                             device=q_latent.device)
        lse_part = torch.empty((splits, n_tok, heads), dtype=torch.float32,
                               device=q_latent.device)
    grid = (plan["grid_c"], splits, n_tok * triton.cdiv(heads, plan["BH"]))
    sparse_mla_fwd_kernel[grid](q_latent, latent_cache, block_tables=block_tables,
                                query_seq=query_seq, token_indices=token_indices, o=o_part,
                                lse=lse_part, scale=scale, T=n_tok, H=heads, W=width,
                                WS=plan["ws"], stride_bt=block_tables.stride(0),
                                dcp_rank=dcp_rank, LBS=latent_cache.shape[1], DCP=dcp_size,
                                C=lc, **latent_kernel_args(latent_cache, lc, latent_format),
                                BH=plan["BH"], BW=plan["BW"],
                                BO=plan["BO"], HALVES=plan["HALVES"], F32=f32,
                                num_warps=plan["warps"],
                                num_stages=ATTENTION_STAGES)
    if splits > 1:
        _merge(o_part, lse_part, out, lse)
    return out, lse
