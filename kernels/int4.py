"""INT4 routed experts (twins of `kernels/ref/int4.py`, whose docstring gives the storage format).

Two paths, both starting like `moe.fused_moe` (but for decode's unsorted pairs at T <= 16,
below): the (token, expert) pairs are stably sorted by local expert (other EP ranks' experts
sort last and are never visited) and `offs[e]` (the end of expert e's rows) comes from a
searchsorted, without a host sync.

Decode (fused): the weights are never dequantised to memory. An align kernel cuts every
expert's rows into blocks of BM rows (a fixed number of blocks, so the grid does not depend on
the routing); then one launch computes gate|up for (block, BN output columns) with the SwiGLU in
its epilogue, and a second launch does down and adds weight * row into the fp32 output with
atomics (the weighted index_add). Each program reads its expert's weight slice once per block,
so at decode sizes the bytes read are the int4 bytes of the experts hit. No host sync, no
data-dependent shape: graph-capturable. Two variants, picked on the host from T alone (an
expert has at most T rows), table `int4_gemv.DECODE_GEMV`:

- dot-free (GEMV), T <= 128: blocks of BM = 1, 2 or 4 rows whose codes meet the activations in
  fp32 registers, one FMA a weight (`kernels/int4_gemv.py`, whose docstring gives the design;
  its constants, the table included, live there). Up to int4_gemv.PAIRS_MAX_TOKENS (16) tokens
  it runs on the unsorted pairs instead: no sort, searchsorted or align launch, and no atomics
  (w2 stores per-pair rows that a reduce launch sums into the output in x's dtype), so exactly
  three launches, deterministic.
- tl.dot, T > 128: blocks of BM = 16 to 64 rows (`dot_rows_per_block`: every block
  dequantises its expert's weights again, so an expert's rows should fill few blocks); unpacks
  the even and odd input columns (low and high nibbles), applies the group scale/zero in fp32
  and multiplies with tl.dot (fp16 operands on CUDA, fp32 accumulation). Measured with blocks
  of 16 on an H200 (benchmarks/moe_4bit.py, 288 experts): 13-27% of the 4.3 TB/s at 1-64
  tokens, 0.8x bf16 at 512: latency-bound (the dequantised tile goes through shared memory
  into tl.dot every K step, unpipelined).

Prefill (dequantise + grouped GEMM): the experts hit are dequantised in chunks into a bf16
scratch (fp32 on CPU) of at most SCRATCH_BYTES (1.5 GiB: 32 experts of 4096 x (4096 + 2048)),
then torch._grouped_mm runs gate|up and down over the chunk's contiguous rows. One host sync
(the expert row counts) sizes the chunks, so this path is never used while capturing.

Switch rule: prefill when the pairs average at least PREFILL_MIN_ROWS_PER_EXPERT (256) rows per
local expert (T * k >= 256 * E_local), decode otherwise or while a CUDA graph is captured.
Dequantising costs 4.5 bytes of traffic per weight (read 0.5, write 2, read 2 again) against
0.5 for the fused path; the cuBLAS grouped GEMM only pays that back once an expert's GEMM is
compute-bound with room to spare: at M rows a weight costs 2M flops, ~3.3e-15 M s at ~600
TFLOP/s, against ~1e-12 s for the extra 4 bytes at 4.3 TB/s, i.e. M ~ 300. Below that the fused
kernel (memory-bound on int4 bytes) is cheaper. At 288 experts this is T >= 9216 tokens (top-8),
at 144 local experts T >= 4608: long prefill chunks only. The dot-free variant does not move
this rule: it only runs at T <= 128 (<= ~3.6 rows per expert on average), where prefill would
pay 9x the bytes; between 128 tokens and the switch the tl.dot variant runs (at T = 512 it
measured 6.1 ms against ~7.6 ms for merely the dequantisation traffic of 288 experts).

Activations meet the weights in fp32 on the dot-free variant; on CUDA in fp16 on the tl.dot
variant (as the seed casts expert inputs to fp16; swiglu outputs are clamped, well inside fp16)
and in bf16 on the prefill path (torch._grouped_mm is bf16-only); down partials and the output
sum are fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import int4_gemv
from .int4_gemv import PairRows
from .moe import swiglu
from .ref.int4 import _check_group
from .utils import INTERPRET, is_sm120, next_pow2

__all__ = ["dequantize_int4", "moe_int4"]

DECODE, PREFILL = "decode", "prefill"
PREFILL_MIN_ROWS_PER_EXPERT = 256
SCRATCH_BYTES = 3 << 29  # 1.5 GiB of dequantised experts on the prefill path
# rows per block of the tl.dot variant: the next power of two of the pairs per local expert
# hit, from 16 (tl.dot's minimum) to DOT_BM_MAX. Every block dequantises its expert's weights
# again: with blocks of 16 at ~57 rows per expert (a 2048-token chunk at EP2) each weight was
# dequantised ~4 times, and w13_swiglu + w2 took 164 of the chunk's 251 ms
# (rank0_l24_h100_int4_a4b1ae6.json). An int: benchmarks/moe_4bit.py --sweep sets it.
DOT_BM_MIN, DOT_BM_MAX = 16, 64
# blocks of at least this many rows dequantise by `int4_tile`'s NIBBLE trick (see there: fewer
# issue slots, more registers, which at 16 rows cost an SM a program); an int to --sweep
DOT_NIBBLE_MIN_ROWS = 32
# fused path, per program: output columns (the wider tile from 512 pairs on), input columns
# per K step, warps. Measured on an H200 with blocks of 16 rows over BN 16-128, BK 128-512, 4
# or 8 warps: time fell with BN at every size (BN 128 best from T*k = 512, 64 below), BK 128
# best, 4 warps best. Blocks of more rows keep BM x BN <= DOT_TILE accumulators a tensor (w13
# holds two: gate and up): at 64 rows BN 64 (sm_90, before the nibble trick: w13's loop 7.2
# instructions a weight at 247 registers, no spills, against 9.5 at BN 32 and 143 registers;
# with it 7.3 at 255): not yet timed.
# SM120 (mma.sync: operands in registers) spills at 64 x 64 and takes 64 x 32.
DECODE_BN, DECODE_BN_WIDE, DECODE_BK, DECODE_WARPS = 64, 128, 128, 4
DOT_TILE, DOT_TILE_SM120 = 64 * 64, 64 * 32
# the interpreter computes on bit patterns: fp32 operands there (see utils.py)
DOT_DTYPE = tl.float32 if INTERPRET else tl.float16


@triton.jit
def dequant_kernel(q, scale, zero, ids, out, N, KH, NG, GH: tl.constexpr, BR: tl.constexpr,
                   BC: tl.constexpr, GROUPS: tl.constexpr):
    """out[s] = dequantised expert ids[s]: [N, 2 KH] from q [E, N, KH] (GH = group / 2), one
    [BR rows, BC bytes] tile a program. GROUPS >= 1: the tile's bytes cover GROUPS whole groups
    (or lie inside one), so a row loads GROUPS scales and zeros; 0: one gathered per byte. The
    low and high nibbles' values are interleaved in registers (tl.join) and stored as one
    contiguous [BR, 2 BC] tile (two stride-2 stores wrote each 32-byte sector twice, half of
    it each time)."""
    i_s, i_r, i_c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    e = tl.load(ids + i_s).to(tl.int64)
    o_r = i_r * BR + tl.arange(0, BR)
    o_c = i_c * BC + tl.arange(0, BC)
    m = (o_r < N)[:, None] & (o_c < KH)[None, :]
    b = tl.load(q + e * N * KH + o_r[:, None] * KH + o_c[None, :], mask=m, other=0)
    if GROUPS == 0:
        o_g = e * N * NG + o_r[:, None] * NG + (o_c // GH)[None, :]
        s = tl.load(scale + o_g, mask=m, other=0.0).to(tl.float32)
        z = tl.load(zero + o_g, mask=m, other=0.0).to(tl.float32)
        lo = (b & 15).to(tl.float32) * s + z
        hi = (b >> 4).to(tl.float32) * s + z
    else:
        o_g = (i_c * BC) // GH + tl.arange(0, GROUPS)
        m_g = (o_r < N)[:, None] & (o_g < NG)[None, :]
        p_g = e * N * NG + o_r[:, None] * NG + o_g[None, :]
        s = tl.load(scale + p_g, mask=m_g, other=0.0).to(tl.float32)[:, :, None]
        z = tl.load(zero + p_g, mask=m_g, other=0.0).to(tl.float32)[:, :, None]
        b3 = tl.reshape(b, [BR, GROUPS, BC // GROUPS])
        lo = tl.reshape((b3 & 15).to(tl.float32) * s + z, [BR, BC])
        hi = tl.reshape((b3 >> 4).to(tl.float32) * s + z, [BR, BC])
    o_w = 2 * i_c * BC + tl.arange(0, 2 * BC)
    p_o = out + i_s.to(tl.int64) * N * 2 * KH + o_r[:, None] * 2 * KH + o_w[None, :]
    tl.store(p_o, tl.reshape(tl.join(lo, hi), [BR, 2 * BC]).to(out.dtype.element_ty),
             mask=(o_r < N)[:, None] & (o_w < 2 * KH)[None, :])


@triton.jit
def align_kernel(offs, blocks, E, NB, BM: tl.constexpr, BE: tl.constexpr, BB: tl.constexpr):
    """Cut each expert's sorted rows [offs[e-1], offs[e]) into blocks of BM rows: block b gets
    (expert, first row, end row) in blocks[b]; blocks past the last are empty (0, 0, 0)."""
    i_b = tl.program_id(0)
    o_e = tl.arange(0, BE)
    m_e = o_e < E
    b_end = tl.load(offs + o_e, mask=m_e, other=0).to(tl.int32)
    b_start = tl.load(offs + o_e - 1, mask=m_e & (o_e > 0), other=0).to(tl.int32)
    b_nblk = (b_end - b_start + BM - 1) // BM
    b_cum = tl.cumsum(b_nblk, 0)  # blocks of experts <= e
    o_b = i_b * BB + tl.arange(0, BB)
    # the block's expert: the number of experts whose blocks all come before it
    e = tl.sum((b_cum[None, :] <= o_b[:, None]).to(tl.int32), 1)
    here = o_e[None, :] == e[:, None]
    first_blk = tl.sum(tl.where(here, (b_cum - b_nblk)[None, :], 0), 1)
    start = tl.sum(tl.where(here, b_start[None, :], 0), 1)
    end = tl.sum(tl.where(here, b_end[None, :], 0), 1)
    r0 = start + (o_b - first_blk) * BM
    live = e < E
    m_b = o_b < NB
    tl.store(blocks + o_b * 3, tl.where(live, e, 0), mask=m_b)
    tl.store(blocks + o_b * 3 + 1, tl.where(live, r0, 0), mask=m_b)
    tl.store(blocks + o_b * 3 + 2, tl.where(live, tl.minimum(end, r0 + BM), 0), mask=m_b)


@triton.jit
def int4_tile(q_e, s_e, z_e, rows, m_n, j, m_j, k0h, KH, NG, one, GH: tl.constexpr,
              GROUPS: tl.constexpr, DT: tl.constexpr, NIBBLE: tl.constexpr):
    """Weight rows `rows` [BN] at byte columns j [BKH] of one expert, dequantised and
    transposed for tl.dot: (even input columns, odd input columns), each [BKH, BN] in DT.
    GROUPS >= 1: the step [2 k0h, 2 k0h + 2 BKH) covers GROUPS whole groups (1: or lies inside
    one), so each row loads GROUPS scales; 0: a scale gathered per element. NIBBLE: each code
    becomes the fp32 1 + code / 16 by a shift and an and-or (`int4_gemv.nibble_f32`'s trick)
    instead of an int-to-float conversion (16 a clock an SM on sm_90, an eighth of the FMA
    rate), and code * s + z = (1 + code / 16) * 16 s + (z - 16 s): one FMA with the same
    single rounding wherever z - 16 s is exact in fp32 (fp16 scale and zero: unless their
    exponents lie 13 apart). sm_90, w13's loop at 64 rows a block: 927 -> 936 instructions
    but 1,909 -> 1,150 issue slots (a conversion counted 8, an IMAD 2); at 16 rows it also
    took registers 168 -> 201 (2 programs an SM, not 3): see DOT_NIBBLE_MIN_ROWS."""
    m = m_j[:, None] & m_n[None, :]
    b = tl.load(q_e + rows[None, :] * KH + j[:, None], mask=m, other=0)
    if NIBBLE:
        b = b.to(tl.int32)
        lo = (((b << 19) & 0x780000) | one).to(tl.float32, bitcast=True)
        hi = (((b << 15) & 0x780000) | one).to(tl.float32, bitcast=True)
    else:
        lo = (b & 15).to(tl.float32)
        hi = (b >> 4).to(tl.float32)
    if GROUPS == 0:
        p_g = rows[None, :] * NG + (j // GH)[:, None]
        s = tl.load(s_e + p_g, mask=m, other=0.0).to(tl.float32)
        z = tl.load(z_e + p_g, mask=m, other=0.0).to(tl.float32)
    else:
        o_g = k0h // GH + tl.arange(0, GROUPS)
        p_g = rows[None, :] * NG + o_g[:, None]
        m_g = (o_g < NG)[:, None] & m_n[None, :]
        s = tl.load(s_e + p_g, mask=m_g, other=0.0).to(tl.float32)[:, None, :]
        z = tl.load(z_e + p_g, mask=m_g, other=0.0).to(tl.float32)[:, None, :]
        shape3: tl.constexpr = [GROUPS, b.shape[0] // GROUPS, b.shape[1]]
        lo, hi = tl.reshape(lo, shape3), tl.reshape(hi, shape3)
    if NIBBLE:
        s = s * 16.0
        z = z - s
    w_even = tl.reshape(lo * s + z, b.shape)
    w_odd = tl.reshape(hi * s + z, b.shape)
    return w_even.to(DT), w_odd.to(DT)


@triton.jit
def even_odd(p_rows, m_rows, c0, C, BKH: tl.constexpr, DT: tl.constexpr,
             ONE_LOAD: tl.constexpr):
    """Columns c0 .. c0 + 2 BKH (of C) of the rows p_rows [BM] (pointers; m_rows: which are
    real) as (even columns, odd columns), each [BM, BKH] in DT. ONE_LOAD: one contiguous load
    a row, split in registers; else two stride-2 loads, an instruction per element. At 64
    rows a block one load took the sm_90 loop of w13 from 912 to 607 instructions, w2's from
    506 to 362; at 16 rows it made w13 spill, so blocks of 16 take the stride-2 loads."""
    if ONE_LOAD:
        o_c = c0 + tl.arange(0, 2 * BKH)
        b = tl.load(p_rows[:, None] + o_c[None, :],
                    mask=m_rows[:, None] & (o_c < C)[None, :], other=0.0)
        even, odd = tl.split(tl.reshape(b, [b.shape[0], BKH, 2]))
    else:
        o_c = c0 + 2 * tl.arange(0, BKH)
        p = p_rows[:, None] + o_c[None, :]
        m = m_rows[:, None] & (o_c < C)[None, :]
        even = tl.load(p, mask=m, other=0.0)
        odd = tl.load(p + 1, mask=m, other=0.0)
    return even.to(DT), odd.to(DT)


@triton.jit
def w13_swiglu_kernel(x, q, scale, zero, blocks, sorted_tok, act, stride_x, INTER, KH, NG,
                      limit, one, GH: tl.constexpr, GROUPS: tl.constexpr, BM: tl.constexpr,
                      BN: tl.constexpr, BKH: tl.constexpr, DT: tl.constexpr,
                      NIBBLE: tl.constexpr):
    """act[r, n] = swiglu(gate, up)[r, n] for the sorted rows r of block program_id(0), output
    columns n of block program_id(1). x: [T, D]; q: [E, 2I, D/2]; act: [T*k, I] fp32."""
    i_b, i_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(blocks + i_b * 3).to(tl.int64)
    r0 = tl.load(blocks + i_b * 3 + 1)
    r1 = tl.load(blocks + i_b * 3 + 2)
    if r0 >= r1:  # past the last block: no rows, read no weights
        return
    o_m = r0 + tl.arange(0, BM)
    m_m = o_m < r1
    tok = tl.load(sorted_tok + o_m, mask=m_m, other=0).to(tl.int64)
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < INTER
    q_e = q + e * 2 * INTER * KH
    s_e = scale + e * 2 * INTER * NG
    z_e = zero + e * 2 * INTER * NG
    acc_g = tl.zeros([BM, BN], dtype=tl.float32)
    acc_u = tl.zeros([BM, BN], dtype=tl.float32)
    for k0h in range(0, KH, BKH):
        j = k0h + tl.arange(0, BKH)
        m_j = j < KH
        x_even, x_odd = even_odd(x + tok * stride_x, m_m, 2 * k0h, 2 * KH, BKH, DT, BM >= 32)
        w_even, w_odd = int4_tile(q_e, s_e, z_e, o_n, m_n, j, m_j, k0h, KH, NG, one, GH,
                                  GROUPS, DT, NIBBLE)
        acc_g = tl.dot(x_odd, w_odd, tl.dot(x_even, w_even, acc_g))
        w_even, w_odd = int4_tile(q_e, s_e, z_e, INTER + o_n, m_n, j, m_j, k0h, KH, NG, one,
                                  GH, GROUPS, DT, NIBBLE)
        acc_u = tl.dot(x_odd, w_odd, tl.dot(x_even, w_even, acc_u))
    b_g = tl.minimum(acc_g, limit)
    b_u = tl.minimum(tl.maximum(acc_u, -limit), limit)
    tl.store(act + o_m[:, None] * INTER + o_n[None, :], b_g * tl.sigmoid(b_g) * b_u,
             mask=m_m[:, None] & m_n[None, :])


@triton.jit
def w2_kernel(act, q, scale, zero, blocks, sorted_tok, sorted_w, out, D, INTER, KH, NG, one,
              GH: tl.constexpr, GROUPS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
              BKH: tl.constexpr, DT: tl.constexpr, NIBBLE: tl.constexpr):
    """out[tok(r), n] += w(r) * (act[r] @ W2[e].T)[n] for the rows r of block program_id(0).
    act: [T*k, I] fp32 (sorted rows); q: [E, D, I/2]; out: [T, D] fp32."""
    i_b, i_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(blocks + i_b * 3).to(tl.int64)
    r0 = tl.load(blocks + i_b * 3 + 1)
    r1 = tl.load(blocks + i_b * 3 + 2)
    if r0 >= r1:
        return
    o_m = r0 + tl.arange(0, BM)
    m_m = o_m < r1
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < D
    q_e = q + e * D * KH
    s_e = scale + e * D * NG
    z_e = zero + e * D * NG
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0h in range(0, KH, BKH):
        j = k0h + tl.arange(0, BKH)
        m_j = j < KH
        a_even, a_odd = even_odd(act + o_m * INTER, m_m, 2 * k0h, INTER, BKH, DT, BM >= 32)
        w_even, w_odd = int4_tile(q_e, s_e, z_e, o_n, m_n, j, m_j, k0h, KH, NG, one, GH,
                                  GROUPS, DT, NIBBLE)
        acc = tl.dot(a_odd, w_odd, tl.dot(a_even, w_even, acc))
    tok = tl.load(sorted_tok + o_m, mask=m_m, other=0).to(tl.int64)
    wt = tl.load(sorted_w + o_m, mask=m_m, other=0.0)
    tl.atomic_add(out + tok[:, None] * D + o_n[None, :], acc * wt[:, None],
                  mask=m_m[:, None] & m_n[None, :])


def _dequant_into(q, scale, zero, group_size, ids, out) -> None:
    """out[s] = dequantised q[ids[s]] (any float dtype). q: [E, N, Kin/2]; ids: [n] int32;
    out: [n, N, Kin] contiguous."""
    _, n_rows, kh = q.shape
    br, bc, gh = min(32, next_pow2(n_rows)), min(128, next_pow2(kh)), group_size // 2
    # whole groups a tile, or a tile inside one group: scales per row; else per byte
    groups = max(1, bc // gh) if bc % gh == 0 or gh % bc == 0 else 0
    grid = (ids.numel(), triton.cdiv(n_rows, br), triton.cdiv(kh, bc))
    if ids.numel():
        dequant_kernel[grid](q, scale, zero, ids, out, n_rows, kh, scale.shape[-1], GH=gh,
                             BR=br, BC=bc, GROUPS=groups)


def dequantize_int4(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int
) -> torch.Tensor:
    """q: uint8 [..., N, Kin/2]; scale, zero: fp16 [..., N, Kin/g]. Returns fp32 [..., N, Kin]
    = code * scale + zero, bit-identical to the reference."""
    *lead, n_rows, kh = q.shape
    _check_group(2 * kh, group_size)
    q3 = q.reshape(-1, n_rows, kh).contiguous()
    out = torch.empty((q3.shape[0], n_rows, 2 * kh), dtype=torch.float32, device=q.device)
    ids = torch.arange(q3.shape[0], dtype=torch.int32, device=q.device)
    _dequant_into(q3, scale.reshape(q3.shape[0], n_rows, -1).contiguous(),
                  zero.reshape(q3.shape[0], n_rows, -1).contiguous(), group_size, ids, out)
    return out.reshape(*lead, n_rows, 2 * kh)


def _k_blocking(group_size: int) -> tuple[int, int]:
    """(bytes per K step, GROUPS of int4_tile). A power-of-two group >= 32: DECODE_BK columns
    per step (long contiguous runs of bytes per row), covering whole groups or inside one;
    another group with a power of two >= 32 dividing it: steps of that many columns inside a
    group; else 32 columns with a scale per element."""
    pow2 = group_size & -group_size
    if pow2 == group_size >= 32:
        return DECODE_BK // 2, max(1, DECODE_BK // group_size)
    if pow2 >= 32:
        return min(pow2, DECODE_BK) // 2, 1
    return 16, 0


def dot_rows_per_block(n_pairs: int, n_hit: int) -> int:
    """BM of the tl.dot variant for n_pairs pairs over n_hit local experts that can hold rows
    (pairs of other EP ranks' experts count too: an overestimate, where larger blocks only pad
    tl.dot's rows): the next power of two of the pairs per expert, DOT_BM_MIN to DOT_BM_MAX."""
    return max(DOT_BM_MIN, min(DOT_BM_MAX, next_pow2(-(-n_pairs // max(1, n_hit)))))


def _moe_decode(x, w13, w2, g13, g2, tok, wts, offs, limit, out) -> None:
    n_pairs, n_local = tok.numel(), offs.numel()
    (q13, s13, z13), (q2, s2, z2) = w13, w2
    d, inter = out.shape[1], q13.shape[1] // 2
    aligned = int4_gemv.words_aligned(w13, w2)
    bm = int4_gemv.rows_per_block(x.shape[0], g13, g2) if aligned else 0
    n_hit = min(n_local, n_pairs)
    bm_blk = bm or dot_rows_per_block(n_pairs, n_hit)
    # sum over experts of ceil(rows / BM) <= (pairs + (BM - 1) * experts hit) / BM
    n_blk = max(1, (n_pairs + (bm_blk - 1) * n_hit) // bm_blk)
    blocks = torch.empty((n_blk, 3), dtype=torch.int32, device=x.device)
    bb = min(64, next_pow2(n_blk))
    align_kernel[(triton.cdiv(n_blk, bb),)](offs, blocks, n_local, n_blk, BM=bm_blk,
                                            BE=next_pow2(n_local), BB=bb)
    tok32 = tok.to(torch.int32)
    if bm:
        int4_gemv.launch(x, w13, w2, g13, g2, bm, blocks, tok32, wts, n_blk, n_hit, limit, out)
        return
    act = torch.empty((n_pairs, inter), dtype=torch.float32, device=x.device)
    nibble = bm_blk >= DOT_NIBBLE_MIN_ROWS
    bkh, groups = _k_blocking(g13)
    tile = DOT_TILE_SM120 if is_sm120(x.device) else DOT_TILE
    bn_max = min(DECODE_BN if n_pairs < 512 else DECODE_BN_WIDE, tile // bm_blk)
    bn = max(16, min(bn_max, next_pow2(inter)))
    w13_swiglu_kernel[(n_blk, triton.cdiv(inter, bn))](
        x, q13, s13, z13, blocks, tok32, act, x.stride(0), inter, d // 2, s13.shape[-1],
        float(limit), int4_gemv.ONE_F32_BITS, GH=g13 // 2, GROUPS=groups, BM=bm_blk, BN=bn,
        BKH=bkh, DT=DOT_DTYPE, NIBBLE=nibble, num_warps=DECODE_WARPS)
    bkh, groups = _k_blocking(g2)
    bn = max(16, min(bn_max, next_pow2(d)))
    w2_kernel[(n_blk, triton.cdiv(d, bn))](
        act, q2, s2, z2, blocks, tok32, wts, out, d, inter, inter // 2, s2.shape[-1],
        int4_gemv.ONE_F32_BITS, GH=g2 // 2, GROUPS=groups, BM=bm_blk, BN=bn, BKH=bkh,
        DT=DOT_DTYPE, NIBBLE=nibble, num_warps=DECODE_WARPS)


def _moe_prefill(x, w13, w2, g13, g2, tok, wts, offs, limit, out) -> None:
    (q13, s13, z13), (q2, s2, z2) = w13, w2
    n_local, two_i, _ = q13.shape
    d, inter = x.shape[1], two_i // 2
    dtype = torch.bfloat16 if x.is_cuda else torch.float32
    ends = offs.tolist()  # this path's one host sync: it sizes the chunks
    starts = [0, *ends[:-1]]
    hit = [e for e in range(n_local) if ends[e] > starts[e]]
    if not hit:
        return
    chunk = max(1, min(len(hit), SCRATCH_BYTES // (3 * inter * d * dtype.itemsize)))
    w13_dq = torch.empty((chunk, two_i, d), dtype=dtype, device=x.device)
    w2_dq = torch.empty((chunk, d, inter), dtype=dtype, device=x.device)
    xs = x[tok[: ends[-1]]].to(dtype)  # the valid pairs' rows, in expert order
    for c in range(0, len(hit), chunk):
        experts = hit[c: c + chunk]
        n = len(experts)
        ids = torch.tensor(experts, dtype=torch.int32, device=x.device)
        _dequant_into(q13, s13, z13, g13, ids, w13_dq)
        _dequant_into(q2, s2, z2, g2, ids, w2_dq)
        r0, r1 = starts[experts[0]], ends[experts[-1]]  # the experts between have no rows
        group_end = torch.tensor([ends[e] - r0 for e in experts], dtype=torch.int32,
                                 device=x.device)
        h = torch._grouped_mm(xs[r0:r1], w13_dq[:n].transpose(1, 2), offs=group_end)
        a = swiglu(h[:, :inter], h[:, inter:], limit)
        y = torch._grouped_mm(a, w2_dq[:n].transpose(1, 2), offs=group_end)
        out.index_add_(0, tok[r0:r1], y.float() * wts[r0:r1, None])


def moe_int4_on_path(
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
    *,
    path: str | None = None,
) -> torch.Tensor | PairRows:
    """x: [T, D] (rows may be strided); w13_q: uint8 [E, 2I, D/2] (gate rows, then up rows),
    w13_scale / w13_zero: fp16 [E, 2I, D/g13]; w2_q: uint8 [E, D, I/2], w2_scale / w2_zero:
    fp16 [E, D, I/g2] (g = min(group_size, in_features)); topk_weights: [T, k] (any float
    dtype; fp32 math); topk_ids: [T, k] global ids (experts outside [expert_offset,
    expert_offset + E) are skipped); num_experts: all EP ranks' experts (None: E), for sizing
    launches only. path: DECODE or PREFILL to force one (default: the switch rule in the module
    docstring; the op `moe_int4` takes that default). Returns [T, D] in x's dtype, or with
    `defer_reduce` on the unsorted-pairs path its last sum undone (`int4_gemv.PairRows`, for
    `linear.linear`'s `add`)."""
    n_tok, k = topk_ids.shape
    n_local, two_i, _ = w13_q.shape
    d, inter = x.shape[1], two_i // 2
    g13, g2 = min(group_size, d), min(group_size, inter)
    _check_group(d, g13)
    _check_group(inter, g2)
    for name, t, groups in (("w13_scale", w13_scale, d // g13), ("w13_zero", w13_zero, d // g13),
                            ("w2_scale", w2_scale, inter // g2), ("w2_zero", w2_zero, inter // g2)):
        if t.shape[-1] != groups:
            raise ValueError(f"moe_int4: {name} has {t.shape[-1]} groups per row, expected "
                             f"{groups} (group size {group_size})")
    if path is None:
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        big = n_tok * k >= PREFILL_MIN_ROWS_PER_EXPERT * n_local
        path = PREFILL if big and not capturing else DECODE
    if path not in (DECODE, PREFILL):
        raise ValueError(f"moe_int4 path must be {DECODE!r} or {PREFILL!r}, not {path!r}")
    if x.stride(1) != 1:
        x = x.contiguous()
    w13 = (w13_q.contiguous(), w13_scale.contiguous(), w13_zero.contiguous())
    w2 = (w2_q.contiguous(), w2_scale.contiguous(), w2_zero.contiguous())
    if (path == DECODE and 0 < n_tok <= int4_gemv.PAIRS_MAX_TOKENS
            and int4_gemv.words_aligned(w13, w2)
            and int4_gemv.rows_per_block(n_tok, g13, g2) == 1):
        # writes its own output in x's dtype: no zeroed fp32 sum, no casts
        return int4_gemv.moe_decode_pairs(x, w13, w2, g13, g2, topk_ids, topk_weights,
                                          expert_offset, swiglu_limit, num_experts or n_local,
                                          defer_reduce=defer_reduce)
    out = torch.zeros((n_tok, d), dtype=torch.float32, device=x.device)
    local = topk_ids.reshape(-1) - expert_offset
    key = torch.where((local >= 0) & (local < n_local), local, n_local)
    order = torch.argsort(key, stable=True)
    # offs[e]: end of expert e's rows in sorted order (searchsorted: no host sync)
    bounds = torch.arange(1, n_local + 1, device=key.device)
    offs = torch.searchsorted(key[order], bounds, right=False)
    tok = order // k
    wts = topk_weights.reshape(-1)[order].float()
    if n_tok:
        run = _moe_prefill if path == PREFILL else _moe_decode
        run(x, w13, w2, g13, g2, tok, wts, offs, swiglu_limit, out)
    return out.to(x.dtype)


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
    """The op, signature of the reference's: `moe_int4_on_path` on the switch rule's path."""
    return moe_int4_on_path(x, w13_q, w13_scale, w13_zero, w2_q, w2_scale, w2_zero,
                            topk_weights, topk_ids, swiglu_limit, expert_offset, group_size,
                            num_experts, defer_reduce)
