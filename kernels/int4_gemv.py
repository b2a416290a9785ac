"""The dot-free (GEMV) variant of `int4`'s fused decode path, for T <= 128 tokens.

Blocks of BM = 1, 2 or 4 rows (T <= 16, 64, 128; table DECODE_GEMV, read by `rows_per_block`).
The codes are read as int32 words (8 codes, [BN rows, 16 words] per K step = 64 contiguous
bytes a row), and each code becomes the fp32 1 + code/16 with one shift and one and-or (code
under the mantissa of 1.0: no int-to-float conversion, whose 16/clk/SM would cap T=1 at ~45% of
the bandwidth); x . (code * s + z) = 16 s (x . (1 + code/16)) + (z - 16 s) sum(x), so a weight
costs one FMA per row, the scale is applied once per step (a step lies in one group) and the
zero terms once per program, after the K loop, from each step's sum(x). Products stay per K
lane in registers and are reduced once at the end: no shared-memory round trip, no 16-row
padding. The next step's words and scales are loaded before this step's arithmetic. w2 is also
split along K (its rows are summed over pairs anyway) until ~GEMV_PROGRAMS_PER_SM programs per
SM, and w13's columns per program are halved while its programs would fill under half of that:
at T = 1, 8 experts give 512 w13 programs (BN 32: 64 rows x 4096 columns each) and 256 x 2 w2
programs. sm_90 SASS per K step and thread at T = 1 and 4 warps (since, 8: GEMV_WARPS_1): w13 64
weights for 314 instructions (64 registers), w2 128 for 508 (128 registers), no spills; with
the zeros and sums of x inside the loop it was 385 and 603, and T = 1 took the same time
(0.0726 vs 0.0718 ms on an H100: moe_4bit_h100_a4b1ae6.json, moe_4bit_int4_h100_9e0769f.json),
as it did on an H100 and an H200 (0.073, 0.072 ms), 1.4x apart in bandwidth: neither the issue rate
nor the nominal bandwidth bounds it (benchmarks/int4_access.py times the access pattern
alone, `tile_words` a tiled one). BM rows share the unpacking (one FMA a row a weight):
BM = 2 beats re-reading for T ~ 32-64 (~1.8 rows per expert hit at T = 64, 288 experts).

`launch` runs the two kernels over the sorted blocks of `int4.align_kernel`, w2 adding
weight * row into the fp32 output with atomics, or, up to PAIRS_MAX_TOKENS tokens, over the
unsorted (token, expert) pairs, one a block (`moe_decode_pairs`). There w2 stores each local
pair's row of each K split into an fp32 scratch (plain stores, no memset) and a third launch,
`pairs_reduce_kernel`, sums a token's rows times their routing weights (read in their own
dtype) straight into the output in x's dtype: three launches in all, against a memset, a
weight cast and an output cast around two with atomics. Every sum then runs in a fixed order,
so this path is also deterministic (bitwise, run to run), which atomics are not. When the
routed sum only feeds the shared expert's down projection (MoE, decode), the scratch is handed
over unsummed (`PairRows`) and that one-token GEMV sums it in its epilogue (`linear.linear`):
two launches. At one token (D 4096, top-8, 2 K splits) the reduce has 32 programs of 8 KiB
for the whole GPU; the GEMV's epilogue reads 256 B in each of its ~1000 (4 columns each).

The constants are read at call time: tests and benchmarks/moe_4bit.py set them on this module.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .utils import next_pow2, num_sms, pdl, pdl_start, pdl_wait

__all__ = ["PairRows", "launch", "moe_decode_pairs", "rows_per_block", "tile_words",
           "words_aligned"]

# dot-free (GEMV) variant of the fused path: (max tokens, rows per block) in order; the first
# entry with T <= its bound is taken, none: the tl.dot variant. Chosen on cost per weight (see
# the module docstring), to be tuned on the GPU.
DECODE_GEMV = ((16, 1), (64, 2), (128, 4))
# past this many tokens the tl.dot variant runs whatever DECODE_GEMV says: an int, so that
# benchmarks/moe_4bit.py --sweep can set the crossover (e.g. GEMV_MAX_TOKENS=16,128 at 64)
GEMV_MAX_TOKENS = 128
# per program: output columns of w13 (x2 rows: gate and up) and of w2 (halved at 2 rows per
# block, quartered at 4: registers), words of 8 codes per K step (at most; inside one group),
# warps
GEMV_BN13, GEMV_BN2, GEMV_BKW, GEMV_WARPS = 64, 128, 16, 4
# steps of words loaded ahead of the arithmetic (1 to 4; `gemv_rows`)
GEMV_AHEAD = 1
# warps and steps ahead of a one-token launch (the batch-1 decode step): EP rank 0's ~4 live
# pairs (moe_4bit.py --ep2) took 0.0535 ms with 8 warps and 2 steps ahead against 0.0629 with
# 4 and 1 on an H100 (8 warps alone 0.0592, 2 ahead alone 0.0642; moe_4bit_ep2_sweep_h100_
# a75066b.json): with few programs, more bytes a program must be in flight
GEMV_WARPS_1, GEMV_AHEAD_1 = 8, 2
# w2's K split: None picks it (programs per SM of the blocks that can hold rows, K steps kept
# per split); an int forces that many splits (at most, a power of two dividing the steps)
GEMV_W2_SPLIT: int | None = None
GEMV_PROGRAMS_PER_SM, GEMV_MIN_STEPS = 4, 4
# w13's columns per program are halved no lower than this (`_w13_columns`): EP rank 0's ~4
# live pairs at one token take 16 (128 programs an expert); 8 doubles the programs again
GEMV_BN13_MIN = 16
# up to this many tokens (and one row per block) the dot-free variant runs on the unsorted
# (token, expert) pairs: no sort, searchsorted or align launch (`moe_decode_pairs`); on an
# H200 (moe_4bit_h200_8fdaacd.json) 0.069 ms against 0.131 sorted at 1 token, 0.40 vs 0.72 at 8
PAIRS_MAX_TOKENS = 16
# elements of a `pairs_reduce_kernel` program's tile [k * split rows, columns]: 2048 (16 a
# thread at 4 warps) gives 128 columns at top-8 and split 2 (32 programs at D = 4096, T = 1)
GEMV_REDUCE_TILE = 2048
ONE_F32_BITS = 0x3F800000
# rows (and words) of a tile of `tile_words`' layout
TILE_ROWS = 16


@triton.jit
def nibble_f32(w, one, I: tl.constexpr):
    """Code I (input column 8c + I) of each int32 word w (8 codes, code I at bits 4I..4I+3) as
    the fp32 1 + code / 16: the code moved to mantissa bits 19..22 under the exponent of 1.0
    (one shift and one and-or per weight, no int-to-float conversion). one: 0x3F800000 passed
    as a kernel argument, so that ptxas fuses the and-or into one LOP3 (of two immediates it
    makes two)."""
    v = w << (19 - 4 * I) if I <= 4 else w >> (4 * I - 19)
    return ((v & 0x780000) | one).to(tl.float32, bitcast=True)


@triton.jit
def step_sums(p_x, n_steps, BKW: tl.constexpr, NS: tl.constexpr):
    """[NS] fp32: the sum of the 8 BKW inputs from p_x of each of the n_steps steps (0 past
    them): the zero points' share of a row, x . z = z sum(x), applied once after the K loop."""
    o_t = tl.arange(0, NS)
    o_k = tl.arange(0, 8 * BKW)
    b_x = tl.load(p_x + o_t[:, None] * (8 * BKW) + o_k[None, :], mask=(o_t < n_steps)[:, None],
                  other=0.0)
    return tl.sum(b_x.to(tl.float32), 1)


@triton.jit
def gemv_rows(p_w, p_s, p_z, p_x0, p_x1, p_x2, p_x3, w0, n_steps, one, GW: tl.constexpr,
              BM: tl.constexpr, BN: tl.constexpr, BKW: tl.constexpr, NS: tl.constexpr,
              AHEAD: tl.constexpr, WS: tl.constexpr):
    """y_m[n] = sum over n_steps <= NS steps of BKW words from word w0 of x_m . W[n] for the
    BM <= 4 input rows m, without tl.dot: W's codes and x meet in fp32 registers (FMAs), reduced
    over K once at the end. p_w, p_s, p_z: [BN] pointers to each weight row's word w0 (int32, 8
    codes; the row's next BKW words lie WS * BKW words on: WS 1 row-major, TILE_ROWS tiled,
    see `word_rows`) and to its first scale / zero; p_xm: row m's input at column 8 w0. Each
    step of BKW words lies inside one group (GW words), so a row has one (scale, zero) per step,
    and x . (code * s + z) = 16 s (x . (1 + code / 16)) + (z - 16 s) sum(x): the codes enter as
    `nibble_f32` and are scaled once per step per row; the zero terms need only each step's
    sum(x) (`step_sums`) and are added after the loop, which thus reads no zeros and sums no
    inputs. The words and scales of the step AHEAD (1 to 4) steps on are loaded
    before this step's arithmetic (in flight while it runs: each step ahead keeps one more
    step of weight bytes in flight per program, for one more step of registers)."""
    c = tl.arange(0, BKW)
    a0 = tl.zeros([BN, BKW], dtype=tl.float32)
    a1 = tl.zeros([BN, BKW], dtype=tl.float32)
    a2 = tl.zeros([BN, BKW], dtype=tl.float32)
    a3 = tl.zeros([BN, BKW], dtype=tl.float32)
    w = tl.load(p_w[:, None] + c[None, :])
    s = tl.load(p_s + w0 // GW).to(tl.float32)
    # the steps after this one, up to AHEAD - 1 of them (w_1 unused when AHEAD is 1)
    w_1 = tl.load(p_w[:, None] + (WS * BKW + c)[None, :], mask=(n_steps > 1) & (AHEAD > 1),
                  other=0)
    s_1 = tl.load(p_s + (w0 + BKW) // GW, mask=(n_steps > 1) & (AHEAD > 1), other=0.0)
    s_1 = s_1.to(tl.float32)
    if AHEAD > 2:
        w_2 = tl.load(p_w[:, None] + (WS * 2 * BKW + c)[None, :], mask=n_steps > 2, other=0)
        s_2 = tl.load(p_s + (w0 + 2 * BKW) // GW, mask=n_steps > 2, other=0.0).to(tl.float32)
    if AHEAD > 3:
        w_3 = tl.load(p_w[:, None] + (WS * 3 * BKW + c)[None, :], mask=n_steps > 3, other=0)
        s_3 = tl.load(p_s + (w0 + 3 * BKW) // GW, mask=n_steps > 3, other=0.0).to(tl.float32)
    for t in range(n_steps):
        kw = t * BKW
        more = t + AHEAD < n_steps
        w_nx = tl.load(p_w[:, None] + (WS * (kw + AHEAD * BKW) + c)[None, :], mask=more,
                       other=0)
        s_nx = tl.load(p_s + (w0 + kw + AHEAD * BKW) // GW, mask=more, other=0.0)
        s_nx = s_nx.to(tl.float32)
        o_x = 8 * (kw + c)
        p0 = tl.zeros([BN, BKW], dtype=tl.float32)
        p1 = tl.zeros([BN, BKW], dtype=tl.float32)
        p2 = tl.zeros([BN, BKW], dtype=tl.float32)
        p3 = tl.zeros([BN, BKW], dtype=tl.float32)
        for i in tl.static_range(8):
            f = nibble_f32(w, one, i)
            p0 += tl.load(p_x0 + o_x + i).to(tl.float32)[None, :] * f
            if BM > 1:
                p1 += tl.load(p_x1 + o_x + i).to(tl.float32)[None, :] * f
            if BM > 2:
                p2 += tl.load(p_x2 + o_x + i).to(tl.float32)[None, :] * f
                p3 += tl.load(p_x3 + o_x + i).to(tl.float32)[None, :] * f
        a0 += s[:, None] * p0
        if BM > 1:
            a1 += s[:, None] * p1
        if BM > 2:
            a2 += s[:, None] * p2
            a3 += s[:, None] * p3
        if AHEAD == 1:
            w, s = w_nx, s_nx
        elif AHEAD == 2:
            w, s, w_1, s_1 = w_1, s_1, w_nx, s_nx
        elif AHEAD == 3:
            w, s, w_1, s_1, w_2, s_2 = w_1, s_1, w_2, s_2, w_nx, s_nx
        else:
            w, s, w_1, s_1, w_2, s_2, w_3, s_3 = w_1, s_1, w_2, s_2, w_3, s_3, w_nx, s_nx
    # the zero terms: sum over steps t of (z - 16 s)[n, t] sum(x_m over step t)
    o_t = tl.arange(0, NS)
    m_t = (o_t < n_steps)[None, :]
    p_g = (w0 + o_t * BKW) // GW
    b_s = tl.load(p_s[:, None] + p_g[None, :], mask=m_t, other=0.0).to(tl.float32)
    b_z = tl.load(p_z[:, None] + p_g[None, :], mask=m_t, other=0.0).to(tl.float32) - 16.0 * b_s
    y0 = 16.0 * tl.sum(a0, 1) + tl.sum(b_z * step_sums(p_x0, n_steps, BKW, NS)[None, :], 1)
    y1, y2, y3 = y0, y0, y0
    if BM > 1:
        y1 = 16.0 * tl.sum(a1, 1) + tl.sum(b_z * step_sums(p_x1, n_steps, BKW, NS)[None, :], 1)
    if BM > 2:
        y2 = 16.0 * tl.sum(a2, 1) + tl.sum(b_z * step_sums(p_x2, n_steps, BKW, NS)[None, :], 1)
        y3 = 16.0 * tl.sum(a3, 1) + tl.sum(b_z * step_sums(p_x3, n_steps, BKW, NS)[None, :], 1)
    return y0, y1, y2, y3


@triton.jit
def word_rows(rows, KW, WS: tl.constexpr):
    """Word offsets of rows' first words in an expert's [N, KW] int32 codes: row-major (WS 1),
    or tiled (WS = TILE_ROWS, `tile_words`: [N / WS, KW / WS, WS, WS] tiles, so that a K step
    of 16 words of 16 consecutive rows is one contiguous KiB). WS comes in as an argument: a
    module global read inside a jit function must be a constexpr, which the interpreter
    cannot then mix with tensors."""
    if WS > 1:
        return (rows // WS) * (KW * WS) + (rows % WS) * WS
    else:
        return rows * KW


@triton.jit
def pair_block(blocks, i_b, e_off, E, PAIRS: tl.constexpr):
    """(local expert, first row, end row) of block i_b. Sorted: blocks [NB, 3] from
    `int4.align_kernel`. PAIRS: blocks are the flat top-k ids [T k] and block i_b is pair i_b
    alone (row i_b of act; no sort, no align launch), empty when its expert is another rank's."""
    if PAIRS:
        e = tl.load(blocks + i_b).to(tl.int64) - e_off
        r0 = i_b
        r1 = tl.where((e >= 0) & (e < E), i_b + 1, i_b)
        e = tl.minimum(tl.maximum(e, 0), E - 1)
    else:
        e = tl.load(blocks + i_b * 3).to(tl.int64)
        r0 = tl.load(blocks + i_b * 3 + 1)
        r1 = tl.load(blocks + i_b * 3 + 2)
    return e, r0, r1


@triton.jit
def row_token(sorted_tok, r, K, PAIRS: tl.constexpr):
    """The token of row r: sorted_tok[r], or r // K for unsorted pairs (K = top-k)."""
    if PAIRS:
        return (r // K).to(tl.int64)
    else:
        return tl.load(sorted_tok + r).to(tl.int64)


@triton.jit
def swiglu_store(h, act, r, ok, o_n, m_n, INTER, limit, BN: tl.constexpr):
    """act[r, o_n] = swiglu of h [2 BN] (gate, up interleaved) where ok and m_n."""
    b_g, b_u = tl.split(tl.reshape(h, [BN, 2]))
    b_g = tl.minimum(b_g, limit)
    b_u = tl.minimum(tl.maximum(b_u, -limit), limit)
    tl.store(act + r * INTER + o_n, b_g * tl.sigmoid(b_g) * b_u, mask=m_n & ok)


@triton.jit
def w13_gemv_kernel(x, q, scale, zero, blocks, sorted_tok, act, stride_x, INTER, KW, NG, limit,
                    one, K, e_off, E, GW: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                    BKW: tl.constexpr, NS: tl.constexpr, PAIRS: tl.constexpr,
                    AHEAD: tl.constexpr, WS: tl.constexpr, PDL: tl.constexpr):
    """`int4.w13_swiglu_kernel` for blocks of BM <= 4 rows, dot-free (`gemv_rows`): one program
    computes gate and up (rows interleaved in one [2 BN] tile) for BN output columns.
    q: int32 words [E, 2I, D/8]. PAIRS (BM = 1): unsorted, see `pair_block`. PDL
    (`utils.pdl`): which expert's weights to read is the router's output, so the wait comes
    first."""
    pdl_start(PDL)
    pdl_wait(PDL)
    i_b, i_n = tl.program_id(0), tl.program_id(1)
    e, r0, r1 = pair_block(blocks, i_b, e_off, E, PAIRS)
    if r0 >= r1:  # past the last block, or another rank's expert: read no weights
        return
    j = tl.arange(0, 2 * BN)
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < INTER
    rows = tl.minimum(i_n * BN + j // 2, INTER - 1) + (j % 2) * INTER  # gate, up, gate, ...
    p_w = q + e * 2 * INTER * KW + word_rows(rows, KW, WS)
    p_s = scale + e * 2 * INTER * NG + rows * NG
    p_z = zero + e * 2 * INTER * NG + rows * NG
    # rows past the block's end re-read its last row (results not stored)
    p_x0 = x + row_token(sorted_tok, r0, K, PAIRS) * stride_x
    p_x1 = x + row_token(sorted_tok, tl.minimum(r0 + 1, r1 - 1), K, PAIRS) * stride_x
    p_x2 = x + row_token(sorted_tok, tl.minimum(r0 + 2, r1 - 1), K, PAIRS) * stride_x
    p_x3 = x + row_token(sorted_tok, tl.minimum(r0 + 3, r1 - 1), K, PAIRS) * stride_x
    h0, h1, h2, h3 = gemv_rows(p_w, p_s, p_z, p_x0, p_x1, p_x2, p_x3, 0, KW // BKW, one, GW, BM,
                               2 * BN, BKW, NS, AHEAD, WS)
    swiglu_store(h0, act, r0, r0 < r1, o_n, m_n, INTER, limit, BN)
    if BM > 1:
        swiglu_store(h1, act, r0 + 1, r0 + 1 < r1, o_n, m_n, INTER, limit, BN)
    if BM > 2:
        swiglu_store(h2, act, r0 + 2, r0 + 2 < r1, o_n, m_n, INTER, limit, BN)
        swiglu_store(h3, act, r0 + 3, r0 + 3 < r1, o_n, m_n, INTER, limit, BN)


@triton.jit
def w2_gemv_kernel(act, q, scale, zero, blocks, sorted_tok, sorted_w, out, D, INTER, KW, NG,
                   STEPS, one, K, e_off, E, GW: tl.constexpr, BM: tl.constexpr,
                   BN: tl.constexpr, BKW: tl.constexpr, NS: tl.constexpr, PAIRS: tl.constexpr,
                   AHEAD: tl.constexpr, WS: tl.constexpr, PDL: tl.constexpr):
    """`int4.w2_kernel` for blocks of BM <= 4 rows, dot-free (`gemv_rows`), split along K: program
    (block, n, s) covers the STEPS * BKW words from s * STEPS * BKW and adds its part of
    weight * y into out [T, D] fp32 with atomics. q: int32 words [E, D, I/8]. PAIRS (BM = 1):
    unsorted, see `pair_block`; the part of y, unweighted, is stored into row
    pair * split + s of out, the scratch [T k split, D] fp32 of `pairs_reduce_kernel`
    (sorted_w unused). PDL: as `w13_gemv_kernel`."""
    pdl_start(PDL)
    pdl_wait(PDL)
    i_b, i_n, i_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    e, r0, r1 = pair_block(blocks, i_b, e_off, E, PAIRS)
    if r0 >= r1:
        return
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < D
    rows = tl.minimum(o_n, D - 1)
    w0 = i_k * STEPS * BKW
    p_w = q + e * D * KW + word_rows(rows, KW, WS) + WS * w0
    p_s = scale + e * D * NG + rows * NG
    p_z = zero + e * D * NG + rows * NG
    ra = act + 8 * w0
    y0, y1, y2, y3 = gemv_rows(p_w, p_s, p_z, ra + r0 * INTER,
                               ra + tl.minimum(r0 + 1, r1 - 1) * INTER,
                               ra + tl.minimum(r0 + 2, r1 - 1) * INTER,
                               ra + tl.minimum(r0 + 3, r1 - 1) * INTER, w0, STEPS, one, GW, BM, BN,
                               BKW, NS, AHEAD, WS)
    if PAIRS:
        row = r0.to(tl.int64) * tl.num_programs(2) + i_k
        tl.store(out + row * D + o_n, y0, mask=m_n)
    else:
        tok = tl.load(sorted_tok + r0).to(tl.int64)
        tl.atomic_add(out + tok * D + o_n, y0 * tl.load(sorted_w + r0), mask=m_n)
    if BM > 1:
        ok = r0 + 1 < r1
        tok = tl.load(sorted_tok + r0 + 1, mask=ok, other=0).to(tl.int64)
        wt = tl.load(sorted_w + r0 + 1, mask=ok, other=0.0)
        tl.atomic_add(out + tok * D + o_n, y1 * wt, mask=m_n & ok)
    if BM > 2:
        ok = r0 + 2 < r1
        tok = tl.load(sorted_tok + r0 + 2, mask=ok, other=0).to(tl.int64)
        wt = tl.load(sorted_w + r0 + 2, mask=ok, other=0.0)
        tl.atomic_add(out + tok * D + o_n, y2 * wt, mask=m_n & ok)
        ok = r0 + 3 < r1
        tok = tl.load(sorted_tok + r0 + 3, mask=ok, other=0).to(tl.int64)
        wt = tl.load(sorted_w + r0 + 3, mask=ok, other=0.0)
        tl.atomic_add(out + tok * D + o_n, y3 * wt, mask=m_n & ok)


@triton.jit
def pair_rows_sum(partial, ids, wts, e_off, E, o_t, m_t, o_n, m_n, D, K: tl.constexpr,
                  SPLIT: tl.constexpr, BR: tl.constexpr):
    """[BT, BN] fp32: for tokens o_t and columns o_n, the sum over each token's K pairs p and
    the SPLIT K splits s of w(p) * partial[p SPLIT + s, n] (partial [T K SPLIT, D]), over the
    pairs whose expert is local (e_off <= id < e_off + E; other ranks' pairs' rows were never
    written, so they are masked, never read); a token with no local pair gets 0. A token's K
    SPLIT rows are consecutive: one [BR, BN] tile a token (BR >= K SPLIT), summed by tl.sum in
    a fixed order (deterministic). ids, wts: the flat top-k ids and routing weights [T K] (any
    float dtype; fp32 math). Shared by `pairs_reduce_kernel` and the GEMV that takes the sum
    in its epilogue (`linear.linear_gemv_kernel`)."""
    o_r = tl.arange(0, BR)
    p = o_t[:, None] * K + o_r[None, :] // SPLIT  # [BT, BR]: the pair of each row
    m_p = m_t[:, None] & (o_r < K * SPLIT)[None, :]
    e = tl.load(ids + p, mask=m_p, other=0).to(tl.int64) - e_off
    ok = m_p & (e >= 0) & (e < E)
    b_w = tl.load(wts + p, mask=ok, other=0.0).to(tl.float32)
    row = o_t[:, None].to(tl.int64) * (K * SPLIT) + o_r[None, :]
    b_y = tl.load(partial + row[:, :, None] * D + o_n[None, None, :],
                  mask=ok[:, :, None] & m_n[None, None, :], other=0.0)
    return tl.sum(b_y * b_w[:, :, None], 1)


@triton.jit
def pairs_reduce_kernel(partial, ids, wts, out, D, e_off, E, K: tl.constexpr,
                        SPLIT: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr,
                        PDL: tl.constexpr):
    """out[t, n] in out's dtype: program (t, i_n) writes `pair_rows_sum` of token t's BN
    columns from i_n BN. PDL: waits first (`utils.pdl`)."""
    pdl_start(PDL)
    pdl_wait(PDL)
    i_t, i_n = tl.program_id(0), tl.program_id(1)
    o_t = i_t + tl.arange(0, 1)
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < D
    y = pair_rows_sum(partial, ids, wts, e_off, E, o_t, o_t >= 0, o_n, m_n, D, K, SPLIT, BR)
    tl.store(out + o_t.to(tl.int64)[:, None] * D + o_n[None, :], y.to(out.dtype.element_ty),
             mask=m_n[None, :])


class PairRows(NamedTuple):
    """The routed experts' output of T <= PAIRS_MAX_TOKENS tokens before its last sum (the
    pairs path's scratch): row p * split + s of `partial` [T k split, D] fp32 is local pair p's
    unweighted part of K split s (rows of other ranks' pairs are never written); `ids`,
    `weights`: the flat top-k ids and routing weights [T k]; `dtype`: the sum's. `reduce`
    sums it (`pairs_reduce_kernel`); a GEMV with it as `add` sums it in its epilogue
    (`linear.linear`), a launch fewer."""
    partial: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor
    k: int
    split: int
    expert_offset: int
    num_local: int
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, int]:
        """[T, D] of the sum."""
        return self.ids.shape[0] // self.k, self.partial.shape[1]

    def reduce(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The sum [T, D] in `dtype` (into `out` if given): w(p) times each local pair's
        rows, in a fixed order; a token with no local pair gets 0."""
        n_tok, d = self.shape
        if out is None:
            out = torch.empty((n_tok, d), dtype=self.dtype, device=self.partial.device)
        br = next_pow2(self.k * self.split)
        bn = max(16, min(next_pow2(d), GEMV_REDUCE_TILE // br))
        on = pdl(self.partial.device, "int4")
        pairs_reduce_kernel[(n_tok, triton.cdiv(d, bn))](
            self.partial, self.ids, self.weights, out, d, self.expert_offset, self.num_local,
            K=self.k, SPLIT=self.split, BR=br, BN=bn, PDL=on, launch_pdl=on,
            num_warps=GEMV_WARPS)
        return out


def rows_per_block(n_tok: int, g13: int, g2: int) -> int:
    """BM of the dot-free variant for T tokens (each expert has at most T rows), 0 for the
    tl.dot variant: the first entry of DECODE_GEMV with T <= its bound (and T <=
    GEMV_MAX_TOKENS). Groups must be multiples of 8 input columns (a code word never straddles
    two groups)."""
    if g13 % 8 or g2 % 8 or n_tok > GEMV_MAX_TOKENS:
        return 0
    return next((bm for max_tok, bm in DECODE_GEMV if n_tok <= max_tok), 0)


def words_aligned(w13, w2) -> bool:
    """Codes viewable as int32 words (the dot-free variant reads words of 8 codes)."""
    return w13[0].storage_offset() % 4 == 0 and w2[0].storage_offset() % 4 == 0


def _w2_split(steps: int, programs: int, device: torch.device) -> int:
    """K splits of the dot-free w2 launch: GEMV_W2_SPLIT if set, else doubled while the
    programs of the blocks that can hold rows stay under GEMV_PROGRAMS_PER_SM per SM and each
    split keeps GEMV_MIN_STEPS steps; always a power of two dividing `steps`."""
    split = 1
    while steps % (2 * split) == 0 and (
            split < GEMV_W2_SPLIT if GEMV_W2_SPLIT else
            steps // (2 * split) >= GEMV_MIN_STEPS
            and 2 * split * programs <= GEMV_PROGRAMS_PER_SM * num_sms(device)):
        split *= 2
    return split


def _w13_columns(inter: int, bm: int, blocks: int, device: torch.device) -> int:
    """Output columns per dot-free w13 program: GEMV_BN13 (halved at 2 rows per block,
    quartered at 4), halved again down to GEMV_BN13_MIN while the `blocks` that can hold rows
    would fill under half of GEMV_PROGRAMS_PER_SM per SM (measured on an H200 at 1 token: BN
    32 0.069 ms vs BN 64 0.072 ms; at 8 and 16 tokens BN 64 is best)."""
    bn = max(8, min(GEMV_BN13 >> bm // 2, next_pow2(inter)))
    while bn > GEMV_BN13_MIN and 2 * blocks * triton.cdiv(inter, bn) <= \
            GEMV_PROGRAMS_PER_SM * num_sms(device):
        bn //= 2
    return bn


def launch(x, w13, w2, g13, g2, bm, blocks, tok32, wts, n_blk, n_hit, limit, out, *,
           pairs=None, tiled: bool = False, warps: int | None = None,
           ahead: int | None = None) -> PairRows | None:
    """The dot-free variant's two launches over n_blk blocks of bm rows (n_hit: experts that
    can hold rows), w2 adding into out [T, D] fp32 (wts: fp32, in sorted order). pairs:
    (k, expert offset, local experts) when blocks are the flat top-k ids (one pair a block,
    bm = 1; act rows and wts in pair order, wts in any float dtype; tok32 unused): then w2
    fills a scratch, returned as PairRows, and unless out is None its `reduce` writes out
    [T, D] in any float dtype, with no need to zero it first. tiled: the codes are in
    `tile_words`' layout. warps, ahead: the w13 and w2 launches' warps and steps ahead
    (default GEMV_WARPS, GEMV_AHEAD)."""
    (q13, s13, z13), (q2, s2, z2) = w13, w2
    warps = GEMV_WARPS if warps is None else warps
    ahead = GEMV_AHEAD if ahead is None else ahead
    d, inter = x.shape[1], q13.shape[1] // 2
    n_pairs = n_blk * bm if pairs else tok32.numel()
    on = pdl(x.device, "int4")
    act = torch.empty((n_pairs, inter), dtype=torch.float32, device=x.device)
    k, e_off, n_local = pairs or (1, 0, q13.shape[0])
    # words (8 codes) per group; steps of BKW words inside one group
    gw13, gw2 = g13 // 8, g2 // 8
    bn = _w13_columns(inter, bm, min(n_blk, n_hit), x.device)
    bkw = min(GEMV_BKW, gw13 & -gw13)
    if tiled and not (bkw == TILE_ROWS and min(gw2 & -gw2, GEMV_BKW) == TILE_ROWS):
        raise ValueError(f"tiled int4 codes need K steps of {TILE_ROWS} words (groups of a "
                         f"multiple of {8 * TILE_ROWS} inputs); groups {g13}, {g2}")
    w13_gemv_kernel[(n_blk, triton.cdiv(inter, bn))](
        x, q13.view(torch.int32), s13, z13, blocks, tok32, act, x.stride(0), inter, d // 8,
        s13.shape[-1], float(limit), ONE_F32_BITS, k, e_off, n_local, GW=gw13, BM=bm, BN=bn,
        BKW=bkw, NS=next_pow2(d // 8 // bkw), PAIRS=pairs is not None, AHEAD=ahead,
        WS=TILE_ROWS if tiled else 1, PDL=on, launch_pdl=on, num_warps=warps)
    bn = max(16, min(GEMV_BN2 >> bm // 2, next_pow2(d)))
    bkw = min(GEMV_BKW, gw2 & -gw2)
    steps = inter // 8 // bkw
    n_n = triton.cdiv(d, bn)
    split = _w2_split(steps, min(n_blk, n_hit) * n_n, x.device)
    # pairs: a row per pair and K split, written only for local pairs (empty: no memset)
    dst = out if pairs is None else torch.empty((n_blk * split, d), dtype=torch.float32,
                                                device=x.device)
    w2_gemv_kernel[(n_blk, n_n, split)](
        act, q2.view(torch.int32), s2, z2, blocks, tok32, wts, dst, d, inter, inter // 8,
        s2.shape[-1], steps // split, ONE_F32_BITS, k, e_off, n_local, GW=gw2, BM=bm, BN=bn,
        BKW=bkw, NS=next_pow2(steps // split), PAIRS=pairs is not None, AHEAD=ahead,
        WS=TILE_ROWS if tiled else 1, PDL=on, launch_pdl=on, num_warps=warps)
    if pairs is None:
        return None
    rows = PairRows(dst, blocks, wts, k, split, e_off, n_local, x.dtype)
    if out is not None:
        rows.reduce(out)
    return rows


def moe_decode_pairs(x, w13, w2, g13, g2, topk_ids, topk_weights, expert_offset, limit,
                     num_experts: int, tiled: bool = False,
                     defer_reduce: bool = False) -> torch.Tensor | PairRows:
    """The dot-free variant on the unsorted pairs (T <= PAIRS_MAX_TOKENS): one block a pair, so
    an expert chosen by several tokens is read once per token, against the sort, searchsorted
    and align launches it saves (~2 us each at decode sizes). Three launches (w13, w2 and the
    reduce, see the module docstring); returns [T, D] in x's dtype, deterministic. Under EP
    the pairs of other ranks' experts exit at once: the launch is sized for the pairs expected
    to be this rank's (E / num_experts of them), so that those fill the SMs (at EP2 and 1
    token, w13's columns per program halve: ~4 live pairs, not 8); one token takes
    GEMV_WARPS_1 and GEMV_AHEAD_1. tiled: w13's and w2's codes in `tile_words`' layout.
    defer_reduce: the scratch is returned as PairRows, for a GEMV to sum (two launches)."""
    n_tok, k = topk_ids.shape
    ids = topk_ids.reshape(-1)
    out = None if defer_reduce else torch.empty((n_tok, x.shape[1]), dtype=x.dtype,
                                                device=x.device)
    n_local = w13[0].shape[0]
    live = max(1, -(-n_tok * k * n_local // num_experts))
    one = n_tok == 1
    rows = launch(x, w13, w2, g13, g2, 1, ids, ids, topk_weights.reshape(-1), n_tok * k,
                  min(n_local, live), limit, out, pairs=(k, expert_offset, n_local),
                  tiled=tiled, warps=GEMV_WARPS_1 if one else None,
                  ahead=GEMV_AHEAD_1 if one else None)
    return rows if defer_reduce else out


def tile_words(q: torch.Tensor) -> torch.Tensor:
    """q: uint8 codes [E, N, K/2] (N and K/8 multiples of TILE_ROWS) in the tiled layout the
    dot-free kernels read with tiled=True: same shape, memory in [E, N/16, K/128, 16 rows,
    16 words] order, so one K step of 16 rows is a contiguous KiB (row-major, it is 64 bytes
    from each of 16 rows KW words apart)."""
    e, n, kh = q.shape
    t = TILE_ROWS
    if n % t or kh % (4 * t):
        raise ValueError(f"tile_words: rows {n} and words {kh // 4} must be multiples of {t}")
    words = q.contiguous().view(torch.int32).view(e, n // t, t, kh // (4 * t), t)
    return words.permute(0, 1, 3, 2, 4).contiguous().view(torch.uint8).view(e, n, kh)
