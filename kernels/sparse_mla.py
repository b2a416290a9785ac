"""Triton KPool-DSA ops over the paged latent cache (twins of `kernels/ref/sparse_mla.py`).

- `indexer_update`: pools complete 4-token groups (per-channel softmax over gate + ape) into the
  paged pool cache, reading earlier rows of an open pool from the slot's ring, then writes this
  step's rows into the ring (a second launch: the first still reads the ring).
- `indexer_topk`: one program per (query, BP pools) scores the pools of the query's sequence
  through its block table (sum_h w_h relu(q_h . K_p / sqrt(d)), -inf where not yet visible);
  torch.topk picks the pools; a last kernel expands them to token positions and appends the
  open-pool tail.
- `sparse_mla_attention`: absorbed MLA over the selected latent rows (flash-decoding: the
  selection is split across programs when there are few queries, and the partial results are
  merged by log-sum-exp); DCP-aware like the reference.
- `merge_attention_states`: the log-sum-exp merge of partial results (also the split merge).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .utils import INTERPRET, log2_ceil, next_pow2, seq_of_token

__all__ = ["indexer_topk", "indexer_update", "merge_attention_states", "sparse_mla_attention"]

# programs wanted in flight for the split heuristic (2 per SM on an H100/H200)
TARGET_PROGRAMS = 264


@triton.jit
def indexer_pool_kernel(keys, gates, ape, open_rows, pool_cache, positions, slot_mapping,
                        cu_seqlens, state_ids, N, stride_k, stride_g, LOG_N: tl.constexpr,
                        D: tl.constexpr, KPOOL: tl.constexpr, R: tl.constexpr,
                        BKP: tl.constexpr, BD: tl.constexpr):
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
        p_ring = open_rows + (i_s * R + o_p % R)[:, None] * (2 * D) + o_d[None, :]
        b_k = tl.load(keys + o_tok[:, None] * stride_k + o_d[None, :], mask=m_here, other=0.0)
        b_k += tl.load(p_ring, mask=m_ring, other=0.0)
        b_z = tl.load(gates + o_tok[:, None] * stride_g + o_d[None, :], mask=m_here, other=0.0)
        b_z += tl.load(p_ring + D, mask=m_ring, other=0.0)
        b_z = b_z.to(tl.float32) + tl.load(ape + o_j[:, None] * D + o_d[None, :],
                                           mask=m_j[:, None] & m_d[None, :], other=0.0)
        b_z = tl.where(m_j[:, None], b_z, float("-inf"))
        b_z = tl.exp(b_z - tl.max(b_z, 0)[None, :])
        b_pool = tl.sum(b_z * b_k.to(tl.float32), 0) / tl.sum(b_z, 0)
        i_slot = tl.load(slot_mapping + i_t) // KPOOL
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
    p_ring = open_rows + (i_s * R + pos % R) * (2 * D) + o_d
    b_k = tl.load(keys + i_t * stride_k + o_d, mask=m_d, other=0.0)
    b_z = tl.load(gates + i_t * stride_g + o_d, mask=m_d, other=0.0)
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
) -> None:
    """keys, gates: [T, d]; ape: [kpool, d]; open_rows: [S, R, 2d] ring of recent rows;
    pool_cache: [B, bs/kpool, d]; positions, slot_mapping: [T]; cu_seqlens: [N+1]; state_ids: [N].
    """
    n_tok, d = keys.shape
    kpool, ring = ape.shape[0], open_rows.shape[1]
    n_seq = cu_seqlens.shape[0] - 1
    assert keys.stride(1) == 1 and gates.stride(1) == 1 and open_rows.is_contiguous()
    assert ape.is_contiguous() and pool_cache.is_contiguous() and ring >= kpool
    if n_tok == 0:
        return
    args = dict(LOG_N=log2_ceil(n_seq), D=d, BD=next_pow2(d))
    indexer_pool_kernel[(n_tok,)](keys, gates, ape, open_rows, pool_cache, positions,
                                  slot_mapping, cu_seqlens, state_ids, n_seq, keys.stride(0),
                                  gates.stride(0), KPOOL=kpool, R=ring, BKP=next_pow2(kpool),
                                  **args)
    indexer_ring_kernel[(n_tok,)](keys, gates, open_rows, positions, cu_seqlens, state_ids, n_seq,
                                  keys.stride(0), gates.stride(0), R=ring, **args)


@triton.jit
def indexer_score_kernel(q, w, pool_cache, block_tables, query_seq, positions, scores, scale, P,
                         stride_bt, HI: tl.constexpr, D: tl.constexpr, PPB: tl.constexpr,
                         KPOOL: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr,
                         BP: tl.constexpr, F32: tl.constexpr):
    i_p, i_t = tl.program_id(0), tl.program_id(1)
    seq, pos = tl.load(query_seq + i_t), tl.load(positions + i_t)
    o_p = i_p * BP + tl.arange(0, BP)
    m_p = (o_p < P) & (o_p * KPOOL + KPOOL - 1 <= pos)
    o_h, o_d = tl.arange(0, BH), tl.arange(0, BD)
    m_h, m_d = o_h < HI, o_d < D
    if i_p * BP * KPOOL + KPOOL - 1 <= pos:
        i_b = tl.load(block_tables + seq * stride_bt + o_p // PPB, mask=m_p, other=0)
        p_k = pool_cache + (i_b * PPB + o_p % PPB)[:, None] * D + o_d[None, :]
        b_k = tl.load(p_k, mask=m_p[:, None] & m_d[None, :], other=0.0)
        p_q = q + (i_t * HI + o_h)[:, None] * D + o_d[None, :]
        b_q = tl.load(p_q, mask=m_h[:, None] & m_d[None, :], other=0.0)
        if F32:
            b_s = tl.dot(b_q.to(tl.float32), tl.trans(b_k.to(tl.float32)), input_precision="ieee")
        else:
            b_s = tl.dot(b_q, tl.trans(b_k))
        b_s = tl.maximum(b_s * scale, 0.0)
        b_w = tl.load(w + i_t * HI + o_h, mask=m_h, other=0.0).to(tl.float32)
        b_i = tl.sum(b_s * b_w[:, None], 0)
        b_i = tl.where(m_p, b_i, float("-inf"))
    else:
        b_i = tl.full([BP], float("-inf"), dtype=tl.float32)
    tl.store(scores + i_t * P + o_p, b_i, mask=o_p < P)


@triton.jit
def indexer_select_kernel(top_idx, top_val, positions, out, K, BUDGET, WOUT,
                          KPOOL: tl.constexpr, BKP: tl.constexpr, BJ: tl.constexpr):
    i_j, i_t = tl.program_id(0), tl.program_id(1)
    o_j, o_k = i_j * BJ + tl.arange(0, BJ), tl.arange(0, BKP)
    m_j, m_k = o_j < BUDGET, o_k < KPOOL
    m_sel = o_j < K
    b_i = tl.load(top_idx + i_t * K + o_j, mask=m_sel, other=0)
    b_v = tl.load(top_val + i_t * K + o_j, mask=m_sel, other=float("-inf"))
    ok = m_sel & (b_v > float("-inf"))
    b_tok = tl.where(ok[:, None], b_i[:, None] * KPOOL + o_k[None, :], -1)
    tl.store(out + i_t * WOUT + o_j[:, None] * KPOOL + o_k[None, :], b_tok,
             mask=m_j[:, None] & m_k[None, :])
    # the open pool holding the query: (pos + 1) % KPOOL tokens, -1 padded to KPOOL - 1
    pos = tl.load(positions + i_t)
    b_tail = (pos + 1) // KPOOL * KPOOL + o_k
    tl.store(out + i_t * WOUT + BUDGET * KPOOL + o_k, tl.where(b_tail <= pos, b_tail, -1),
             mask=(o_k < KPOOL - 1) & (i_j == 0))


def indexer_topk(
    q: torch.Tensor,
    head_weights: torch.Tensor,
    pool_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_seq: torch.Tensor,
    positions: torch.Tensor,
    pool_budget: int,
    kpool: int,
) -> torch.Tensor:
    """q: [T, Hi, d]; head_weights: [T, Hi]; pool_cache: [B, bs/kpool, d]; block_tables: [N, M];
    query_seq, positions: [T]. Returns token positions [T, pool_budget*kpool + kpool-1] int64
    (-1 = unused): the top pools' tokens, then the open-pool tail. Scores every pool slot the
    block table can address (M * bs/kpool), so no host sync is needed."""
    n_tok, heads, d = q.shape
    ppb = pool_cache.shape[1]
    n_pools = block_tables.shape[1] * ppb
    width = pool_budget * kpool + kpool - 1
    out = torch.empty((n_tok, width), dtype=torch.long, device=q.device)
    if n_tok == 0:
        return out
    q, head_weights = q.contiguous(), head_weights.contiguous()
    assert pool_cache.is_contiguous()
    scores = torch.empty((n_tok, n_pools), dtype=torch.float32, device=q.device)
    bp = 64 if n_pools >= 64 else max(16, next_pow2(n_pools))
    indexer_score_kernel[(triton.cdiv(n_pools, bp), n_tok)](
        q, head_weights, pool_cache, block_tables, query_seq, positions, scores, d ** -0.5,
        n_pools, block_tables.stride(0), HI=heads, D=d, PPB=ppb, KPOOL=kpool,
        BH=max(16, next_pow2(heads)), BD=max(16, next_pow2(d)), BP=bp,
        F32=INTERPRET or q.dtype == torch.float32)
    k = min(pool_budget, n_pools)
    top = torch.topk(scores, k, dim=-1, sorted=False)
    bj = min(256, next_pow2(pool_budget))
    indexer_select_kernel[(triton.cdiv(pool_budget, bj), n_tok)](
        top.indices, top.values, positions, out, k, pool_budget, width, KPOOL=kpool,
        BKP=next_pow2(kpool), BJ=bj)
    return out


@triton.jit
def sparse_mla_fwd_kernel(q, kv, block_tables, query_seq, token_indices, o, lse, scale, T, H, W,
                          WS, stride_bt, dcp_rank, LBS: tl.constexpr, DCP: tl.constexpr,
                          C: tl.constexpr, BH: tl.constexpr, BW: tl.constexpr, BC: tl.constexpr,
                          F32: tl.constexpr):
    i_h, i_s, i_t = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq = tl.load(query_seq + i_t)
    o_h, o_c = i_h * BH + tl.arange(0, BH), tl.arange(0, BC)
    m_h, m_c = o_h < H, o_c < C
    b_q = tl.load(q + (i_t * H + o_h)[:, None] * C + o_c[None, :],
                  mask=m_h[:, None] & m_c[None, :], other=0.0)
    if F32:
        b_q = b_q.to(tl.float32)
    b_m = tl.full([BH], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BH], dtype=tl.float32)
    b_acc = tl.zeros([BH, BC], dtype=tl.float32)
    w_lo = i_s * WS
    w_hi = tl.minimum(w_lo + WS, W)
    for w0 in range(w_lo, w_hi, BW):
        o_w = w0 + tl.arange(0, BW)
        b_idx = tl.load(token_indices + i_t * W + o_w, mask=o_w < w_hi, other=-1)
        ok = b_idx >= 0
        if DCP > 1:
            ok = ok & (b_idx % DCP == dcp_rank)
        b_idx = tl.maximum(b_idx, 0)
        i_b = tl.load(block_tables + seq * stride_bt + b_idx // (LBS * DCP), mask=ok, other=0)
        o_row = i_b * LBS + (b_idx % (LBS * DCP)) // DCP
        b_kv = tl.load(kv + o_row[:, None] * C + o_c[None, :], mask=ok[:, None] & m_c[None, :],
                       other=0.0)
        if F32:
            b_kv = b_kv.to(tl.float32)
            b_s = tl.dot(b_q, tl.trans(b_kv), input_precision="ieee") * scale
        else:
            b_s = tl.dot(b_q, tl.trans(b_kv)) * scale
        b_s = tl.where(ok[None, :], b_s, float("-inf"))
        b_mn = tl.maximum(b_m, tl.max(b_s, 1))
        b_ms = tl.where(b_mn == float("-inf"), 0.0, b_mn)
        b_p = tl.exp(b_s - b_ms[:, None])
        b_a = tl.exp(b_m - b_ms)
        b_l = b_l * b_a + tl.sum(b_p, 1)
        if F32:
            b_acc = b_acc * b_a[:, None] + tl.dot(b_p, b_kv, input_precision="ieee")
        else:
            b_acc = b_acc * b_a[:, None] + tl.dot(b_p.to(b_kv.dtype), b_kv)
        b_m = b_mn
    has = b_l > 0
    b_o = b_acc / tl.where(has, b_l, 1.0)[:, None]
    b_lse = tl.where(has, b_m + tl.log(tl.where(has, b_l, 1.0)), float("-inf"))
    o_part = i_s * T * H + i_t * H + o_h
    tl.store(o + o_part[:, None] * C + o_c[None, :], b_o.to(o.dtype.element_ty),
             mask=m_h[:, None] & m_c[None, :])
    tl.store(lse + o_part, b_lse, mask=m_h)


@triton.jit
def merge_states_kernel(outs, lses, out, lse, P, TH, C, HAS_LSE: tl.constexpr,
                        BP: tl.constexpr, BC: tl.constexpr):
    i_r, i_c = tl.program_id(0), tl.program_id(1)
    o_p, o_c = tl.arange(0, BP), i_c * BC + tl.arange(0, BC)
    m_p, m_c = o_p < P, o_c < C
    b_lse = tl.load(lses + o_p * TH + i_r, mask=m_p, other=float("-inf"))
    b_max = tl.max(b_lse, 0)
    b_w = tl.where(b_lse > float("-inf"), tl.exp(b_lse - b_max), 0.0)
    b_sum = tl.sum(b_w, 0)
    b_w = b_w / tl.where(b_sum > 0, b_sum, 1.0)
    b_o = tl.load(outs + (o_p * TH + i_r)[:, None] * C + o_c[None, :],
                  mask=m_p[:, None] & m_c[None, :], other=0.0).to(tl.float32)
    tl.store(out + i_r * C + o_c, tl.sum(b_w[:, None] * b_o, 0).to(out.dtype.element_ty),
             mask=m_c)
    if HAS_LSE:
        b_tot = tl.where(b_sum > 0, b_max + tl.log(tl.where(b_sum > 0, b_sum, 1.0)),
                         float("-inf"))
        tl.store(lse + i_r, b_tot, mask=i_c == 0)


def _merge(outs: torch.Tensor, lses: torch.Tensor, out: torch.Tensor,
           lse: torch.Tensor | None) -> None:
    parts, c = outs.shape[0], outs.shape[-1]
    rows = outs[0].numel() // c
    if rows == 0:
        return
    bc = min(next_pow2(c), 128)
    merge_states_kernel[(rows, triton.cdiv(c, bc))](outs, lses, out, lse, parts, rows, c,
                                                     HAS_LSE=lse is not None,
                                                     BP=next_pow2(parts), BC=bc)


def merge_attention_states(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """outs: [P, T, H, C]; lses: [P, T, H]. Returns [T, H, C] in outs' dtype."""
    outs, lses = outs.contiguous(), lses.float().contiguous()
    out = torch.empty(outs.shape[1:], dtype=outs.dtype, device=outs.device)
    _merge(outs, lses, out, None)
    return out


def sparse_mla_attention(
    q_latent: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_seq: torch.Tensor,
    token_indices: torch.Tensor,
    scale: float,
    dcp_rank: int = 0,
    dcp_size: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q_latent: [T, H, Lc]; latent_cache: [B, bs / dcp_size, Lc]; block_tables: [N, M];
    query_seq: [T]; token_indices: [T, W] (-1 = unused). Returns out [T, H, Lc] in q's dtype and
    lse [T, H] fp32 (-inf where a query has no row on this rank)."""
    n_tok, heads, lc = q_latent.shape
    width = token_indices.shape[1]
    q_latent, token_indices = q_latent.contiguous(), token_indices.contiguous()
    assert latent_cache.is_contiguous()
    out = torch.empty_like(q_latent)
    lse = torch.empty((n_tok, heads), dtype=torch.float32, device=q_latent.device)
    if n_tok == 0:
        return out, lse
    f32 = INTERPRET or q_latent.dtype == torch.float32
    bh = 16
    bw = 16 if f32 else 32
    n_prog = n_tok * triton.cdiv(heads, bh)
    splits = max(1, min(triton.cdiv(TARGET_PROGRAMS, n_prog), triton.cdiv(width, 4 * bw)))
    ws = triton.cdiv(triton.cdiv(width, splits), bw) * bw
    splits = triton.cdiv(width, ws) if width else 1
    if splits == 1:
        o_part, lse_part = out, lse
    else:
        o_part = torch.empty((splits, n_tok, heads, lc), dtype=torch.float32,
                             device=q_latent.device)
        lse_part = torch.empty((splits, n_tok, heads), dtype=torch.float32,
                               device=q_latent.device)
    grid = (triton.cdiv(heads, bh), splits, n_tok)
    sparse_mla_fwd_kernel[grid](q_latent, latent_cache, block_tables, query_seq, token_indices,
                                o_part, lse_part, scale, n_tok, heads, width, ws,
                                block_tables.stride(0), dcp_rank, LBS=latent_cache.shape[1],
                                DCP=dcp_size, C=lc, BH=bh, BW=bw, BC=next_pow2(lc), F32=f32,
                                num_warps=8 if not f32 else 4)
    if splits > 1:
        _merge(o_part, lse_part, out, lse)
    return out, lse
