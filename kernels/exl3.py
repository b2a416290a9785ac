"""EXL3 (exllamav3) trellis decode and routed experts in Triton (twins of `kernels/ref/exl3.py`).

`exl3_dequant` decodes 16x16 tiles in registers: each output element (r, c) of a tile finds its
symbol i(r, c) by the inverse tile map, gathers the one or two uint32 words its 16-bit state
spans, shifts the state out, hashes it on uint32 lanes and adds the two fp16 halves with one fp16
add (correctly rounded; the exact sum fits fp32, so it equals the spec's fp32-sum-then-round),
which is bit-exact (design/exl3-dflash-spec.md §B.4-B.6). Any integer K in 1..8
decodes with the same arithmetic (K is a compile-time constant).

`moe_exl3` permutes the (token, expert) pairs into local-expert order (stable sort; other EP
ranks' experts sort last and drop out, no host sync) and, per projection, rotates the inputs
((x * suh) . H128, rounded to fp16 as exllamav3 does), multiplies by What and rotates the outputs
((y' . H128) * svh). Two paths share everything but the GEMM:

- decode (T * k <= DECODE_MAX_PAIRS = 512 pairs, i.e. up to 64 tokens at top-8: every CUDA-graph
  decode / verify batch): no dequantised copy of the weights. One launch per projection over a
  (P, N/128, K splits) grid; a program owns up to MR sorted rows of one expert (the first row of
  each MR-row run of an expert leads; the other programs exit at once), a 128-wide output block
  and a K range (split until ~MIN_PROGRAMS programs work: T = 1 has only 8 experts; K splits add
  atomically). K = 4 (`_gemv4_kernel`) decodes in symbol order: per 16x16 tile a thread loads
  each uint32 word once (one 16-byte load for four words; their predecessors come from the same
  load), shifts the 8 states out of (U[t-1] << 32 | U[t]) and multiplies the decoded fp16 values
  (fp32) by the tile's 16 rotated activations, permuted to the symbols' rows instead of permuting
  the weights; no tl.dot, so 1..4 real rows cost 1..4 FMAs per weight (MR by P,
  `_gemv_rows`). Other K decode per element before a tl.dot with 16 (padded) rows
  (`_gemm_kernel`). The rotated activations are fp16 values held in fp32 on this path.
  Graph-capturable. Measured before the K = 4 kernel (H200, 144 experts 4096x2048, top-8, CUDA
  graph): T = 1 0.43 ms, 8 1.8 ms, 64 4.9 ms, 128 5.3 ms; the scratch path 4.7-7.5 ms.
- prefill (more pairs): the fused kernel decodes each expert once per 16 rows, so its cost grows
  with T; the scratch path decodes every local expert once per call (a fixed ~4.5 ms per layer
  for 144 experts of 4096x2048 on an H200) and then runs a dense grouped GEMM
  (`torch._grouped_mm`: bf16 on CUDA, where it has tensor-core kernels; fp32 on CPU).
  Experts go in chunks of PREFILL_SCRATCH_BYTES (1 GiB: 32 experts of 4096x4096 bf16 instead of
  4.8 GB for 144), each chunk's rows rotated to the front by a gather so that no host sync is
  needed. The bf16 rounding of What (2^-9 relative) is far below the 4-bit quantisation noise.

Around the GEMMs, both paths run two fused launches instead of a chain of small ops (at decode
sizes each of those launches costs microseconds): the first projection's output transform,
the SwiGLU and the down projection's input transform in one (`_swiglu_rotate_kernel`), and the
down projection's output transform with the routing weight and the scatter into the tokens' rows
in the other (`_unrotate_scatter_kernel`). Their Hadamards of fp32 values run on tensor cores at
fp32 accuracy (`_hadamard_f32`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .utils import INTERPRET

__all__ = ["exl3_dequant", "moe_exl3"]

DECODE_MAX_PAIRS = 512
PREFILL_SCRATCH_BYTES = 1 << 30
# codebook -> (multiplier, addend) of the uint32 state hash; MUL1's fp16 constants as fp32
_CB_HASH = {0: (89226354, 64248484), 1: (0xCBAC1FED, 0), 2: (0x83DCD12D, 0)}
_MASK, _FLIP = 0x8FFF8FFF, 0x3B603B60  # (x & _MASK) ^ _FLIP: fp16 exponents 0b011xy
_MUL1_SCALE = 0.0067672729492187500  # fp16 0x1EEE
_MUL1_BIAS = -10.3828125  # fp16 0xC931
# rows per GEMM program (tl.dot's minimum), output block (one Hadamard block), K step (two tile
# rows: keeps the per-element window registers few)
_BM, _BN, _BK = 16, 128, 32
_STAGES, _WARPS = 1, 4  # no cp.async pipelining of the word gathers (5x slower on H200)
_EPI_ROWS = 16  # rows per program of the fused transforms between and after the GEMMs
MIN_PROGRAMS = 1024  # fused GEMM: enough programs to fill 132 SMs several times
_UNROLL = 1  # K = 4 GEMV: tile rows per loop trip (amortises the loop and address arithmetic)
_DOT = tl.float32 if INTERPRET else tl.float16  # the interpreter's fp16 dot is slow and inexact
_DOT_BF = tl.float32 if INTERPRET else tl.bfloat16


@triton.jit
def _tile_window(o_r, o_c, BITS: tl.constexpr):
    """Tile row o_r [R, 1] and column o_c [1, C] (0..15) -> (w1, w0, sh) [R, C]: the state of the
    element's symbol is bits sh..sh+15 of (word[w0] << 32 | word[w1]) (words of one tile)."""
    i = 8 * (4 * (o_c % 8) + (o_r % 8) // 2) + 4 * (o_c // 8) + 2 * (o_r // 8) + (o_r % 2)
    end = BITS * (i + 1) + 256 * BITS  # end bit (exclusive), shifted positive for the wrap
    w1 = (end - 1) // 32
    w0 = (end - 16) // 32
    sh = 32 * (w1 + 1) - end
    return w1 % (8 * BITS), w0 % (8 * BITS), sh.to(tl.uint32)


@triton.jit
def _decode(u1, u0, sh, CB: tl.constexpr, MULT: tl.constexpr, ADD: tl.constexpr,
            MUL1_SCALE: tl.constexpr, MUL1_BIAS: tl.constexpr):
    """Words u1 (holds the state's last bit), u0 (the one before) as int32 and the shift sh ->
    fp16 codebook values, bit-exact."""
    u1 = u1.to(tl.uint32, bitcast=True)
    u0 = u0.to(tl.uint32, bitcast=True)
    # (u0 << (32 - sh)) without a 32-bit shift when sh == 0
    state = ((u1 >> sh) | ((u0 << 1) << (31 - sh))) & 0xFFFF
    x = state * tl.full([], MULT, tl.uint32) + tl.full([], ADD, tl.uint32)  # wraps mod 2**32
    return _hash_value(x, CB, MUL1_SCALE, MUL1_BIAS, tl.full([], 0x8FFF8FFF, tl.uint32),
                       tl.full([], 0x3B603B60, tl.uint32))


@triton.jit
def _hash_value(x, CB: tl.constexpr, MUL1_SCALE: tl.constexpr, MUL1_BIAS: tl.constexpr, mask,
                flip):
    """x = state * MULT + ADD (uint32) -> the fp16 codebook value, bit-exact. mask, flip:
    0x8FFF8FFF and 0x3B603B60 (a kernel passes them as runtime scalars so that ptxas keeps
    them in registers and fuses (x & mask) ^ flip into one LOP3; two immediates take two)."""
    if CB == 2:
        s = (x & 255) + ((x >> 8) & 255) + ((x >> 16) & 255) + (x >> 24)
        # fp16(0x6400 + s) == 1024 + s; exact in fp32 until the one rounding
        v = ((s.to(tl.float32) + 1024.0) * MUL1_SCALE + MUL1_BIAS).to(tl.float16)
    else:
        x = (x & mask) ^ flip
        lo = x.to(tl.uint16).to(tl.float16, bitcast=True)
        hi = (x >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
        # one fp16 add: correctly rounded, and the exact sum fits fp32, so it equals the
        # fp32-sum-then-round of the spec (checked over all 65536 states in the tests)
        v = lo + hi
    return v


@triton.jit
def _codebook_kernel(state, out, n, mask, flip, CB: tl.constexpr, MULT: tl.constexpr,
                     ADD: tl.constexpr, MUL1_SCALE: tl.constexpr, MUL1_BIAS: tl.constexpr,
                     BITS: tl.constexpr):
    """Test hook: int32 states [n] -> fp16 values through `_hash_value`."""
    o = tl.program_id(0) * 1024 + tl.arange(0, 1024)
    st = tl.load(state + o, mask=o < n, other=0).to(tl.uint32, bitcast=True) & 0xFFFF
    x = st * tl.full([], MULT, tl.uint32) + tl.full([], ADD, tl.uint32)
    val = _hash_value(x, CB, MUL1_SCALE, MUL1_BIAS, mask, flip.to(tl.uint32))
    tl.store(out + o, val, mask=o < n)


def _codebook(state: torch.Tensor, codebook: int) -> torch.Tensor:
    """int32 states -> fp16 values with the kernels' arithmetic (tests)."""
    state = state.to(torch.int32).contiguous()
    out = torch.empty(state.shape, dtype=torch.float16, device=state.device)
    n = state.numel()
    if n:
        _codebook_kernel[(triton.cdiv(n, 1024),)](state, out, n, _MASK, _FLIP,
                                                  **_const_kwargs(codebook, 4))
    return out


@triton.jit
def _dequant_kernel(tr, out, KT, NT, CB: tl.constexpr, MULT: tl.constexpr, ADD: tl.constexpr,
                    MUL1_SCALE: tl.constexpr, MUL1_BIAS: tl.constexpr, BITS: tl.constexpr,
                    BN: tl.constexpr):
    """One tile row (16 rows) x BN columns of one matrix. tr: int32 words [B, KT, NT, 8*BITS];
    out: [B, 16*KT, 16*NT]."""
    i_ba, i_n = tl.program_id(0), tl.program_id(1)
    o_r = tl.arange(0, 16)[:, None]
    o_n = i_n * BN + tl.arange(0, BN)[None, :]
    m_n = o_n < 16 * NT
    w1, w0, sh = _tile_window(o_r, o_n % 16, BITS)
    p_tile = tr + (i_ba.to(tl.int64) * NT + o_n // 16) * (8 * BITS)
    u1 = tl.load(p_tile + w1, mask=m_n, other=0)
    u0 = tl.load(p_tile + w0, mask=m_n, other=0)
    val = _decode(u1, u0, sh, CB, MULT, ADD, MUL1_SCALE, MUL1_BIAS)
    p_out = out + (i_ba.to(tl.int64) * 16 + o_r) * (16 * NT) + o_n
    tl.store(p_out, val.to(out.dtype.element_ty), mask=m_n)


def _check(trellis: torch.Tensor, codebook: int) -> int:
    if codebook not in _CB_HASH:
        raise ValueError(f"unknown EXL3 codebook {codebook}; expected 0 (3INST), 1 (MCG), 2 (MUL1)")
    words = trellis.shape[-1]
    if trellis.dtype != torch.int16 or words % 16 or not 1 <= words // 16 <= 8:
        raise ValueError(f"EXL3 trellis must be int16 [..., 16*K] with K in 1..8, got "
                         f"{trellis.dtype} [..., {words}]")
    return words // 16


def _const_kwargs(codebook: int, bits: int) -> dict:
    mult, add = _CB_HASH[codebook]
    return dict(CB=codebook, MULT=mult, ADD=add, MUL1_SCALE=_MUL1_SCALE, MUL1_BIAS=_MUL1_BIAS,
                BITS=bits)


def _dequant_into(trellis: torch.Tensor, codebook: int, dtype: torch.dtype) -> torch.Tensor:
    """exl3_dequant written in `dtype` (fp16 is exact; bf16/fp32 for the prefill scratch)."""
    bits = _check(trellis, codebook)
    *batch, kt, nt, _ = trellis.shape
    out = torch.empty((*batch, 16 * kt, 16 * nt), dtype=dtype, device=trellis.device)
    rows = out.numel() // (256 * nt) if nt else 0
    if rows:
        words = trellis.contiguous().view(torch.int32)
        _dequant_kernel[(rows, triton.cdiv(nt, 8))](
            words, out, kt, nt, BN=128, **_const_kwargs(codebook, bits))
    return out


def exl3_dequant(trellis: torch.Tensor, codebook: int) -> torch.Tensor:
    """trellis: int16 [..., k/16, n/16, 16K] -> What fp16 [..., k, n] (rotated basis), bit-exact."""
    return _dequant_into(trellis, codebook, torch.float16)


@triton.jit
def _hadamard_pm1(BH: tl.constexpr):
    """[BH, BH] fp32 natural-order Sylvester matrix: (-1)**popcount(i & j) (BH <= 128)."""
    v = tl.arange(0, BH)[:, None] & tl.arange(0, BH)[None, :]
    v = v ^ (v >> 4)
    v = v ^ (v >> 2)
    v = v ^ (v >> 1)
    return tl.where((v & 1) == 0, 1.0, -1.0)


@triton.jit
def _rotate_kernel(src, src_row, stride_src, scale, expert, stride_se, stride_ss, out, P, M,
                   BM: tl.constexpr, DT: tl.constexpr):
    """out[s, p, blk] = fp16((fp16(src[src_row[p], blk] * scale[expert[p], s, blk]) . H128)
    / sqrt(128)) for a 128-block blk of M; grid (cdiv(P, BM), S * M / 128)."""
    i_p, i_sb = tl.program_id(0), tl.program_id(1)
    n_blk = M // 128
    i_s, i_b = i_sb // n_blk, i_sb % n_blk
    o_p = i_p * BM + tl.arange(0, BM)
    m_p = o_p < P
    o_m = i_b * 128 + tl.arange(0, 128)
    rows = tl.load(src_row + o_p, mask=m_p, other=0)
    e = tl.load(expert + o_p, mask=m_p, other=0)
    b_x = tl.load(src + rows[:, None] * stride_src + o_m[None, :], mask=m_p[:, None], other=0.0)
    b_s = tl.load(scale + e[:, None] * stride_se + i_s * stride_ss + o_m[None, :],
                  mask=m_p[:, None], other=0.0)
    b_v = (b_x.to(tl.float32) * b_s.to(tl.float32)).to(tl.float16)
    h = _hadamard_pm1(128)
    b_y = tl.dot(b_v.to(DT), h.to(DT))  # +-1 in fp16: exact products, fp32 sums
    p_out = out + (i_s * P + o_p[:, None]).to(tl.int64) * M + o_m[None, :]
    b_y = (b_y * 0.08838834764831845).to(tl.float16)  # exllamav3 rounds the inputs to fp16
    tl.store(p_out, b_y.to(out.dtype.element_ty), mask=m_p[:, None])


def _rotate(src: torch.Tensor, src_row: torch.Tensor, scale: torch.Tensor,
            expert: torch.Tensor, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """Input transform of P sorted rows. src [R, M] (row stride free, unit column stride);
    src_row, expert: [P] int; scale [E, S, M] -> [S, P, M] rotated activations, fp16 values
    written in `dtype` (fp32 for the decode GEMV: no conversion in its inner loop)."""
    n_side, m = scale.shape[1], scale.shape[2]
    p = src_row.shape[0]
    out = torch.empty((n_side, p, m), dtype=dtype, device=src.device)
    if p:
        bm = 32
        _rotate_kernel[(triton.cdiv(p, bm), n_side * (m // 128))](
            src, src_row, src.stride(0), scale, expert, scale.stride(0), scale.stride(1), out,
            p, m, BM=bm, DT=_DOT)
    return out


@triton.jit
def _gemm_kernel(a, tr, key, starts, out, P, KD, NT, SIDE_N, E, KS,
                 CB: tl.constexpr, MULT: tl.constexpr, ADD: tl.constexpr,
                 MUL1_SCALE: tl.constexpr, MUL1_BIAS: tl.constexpr, BITS: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr,
                 DT: tl.constexpr):
    """Fused dequant-GEMM over rows sorted by local expert.

    a: [S, P, KD] rotated inputs, fp16 values (side s = n // SIDE_N); tr: int32 words
    [E, KD/16, NT, 8*BITS]; key: [P] sorted local expert (E = not ours); starts: [E + 1] first
    row of each expert; out: fp32 [P, 16*NT] += a @ What. Program (row p, output block n,
    K split s) works iff p starts a BM-row run of its expert; it sums KS rows of K (SPLIT:
    atomically).
    """
    i_p, i_n, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    e = tl.load(key + i_p)
    if e >= E:
        return
    start = tl.load(starts + e)
    if (i_p - start) % BM != 0:
        return
    end = tl.load(starts + e + 1)
    o_p = i_p + tl.arange(0, BM)
    m_p = o_p < end
    o_n = i_n * BN + tl.arange(0, BN)
    side = (i_n * BN) // SIDE_N
    o_k = i_s * KS + tl.arange(0, BK)
    w1, w0, sh = _tile_window(o_k[:, None] % 16, o_n[None, :] % 16, BITS)
    # int32 word offsets inside expert e's trellis for the first K block (few live registers)
    tile = ((o_k[:, None] // 16) * NT + o_n[None, :] // 16) * (8 * BITS)
    off1, off0 = tile + w1, tile + w0
    p_tr = tr + e.to(tl.int64) * (KD // 16) * NT * (8 * BITS)
    p_a = a + (side * P + o_p[:, None]).to(tl.int64) * KD + o_k[None, :]
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, KS, BK):
        step = (k0 // 16) * NT * (8 * BITS)
        w = _decode(tl.load(p_tr + step + off1), tl.load(p_tr + step + off0), sh,
                    CB, MULT, ADD, MUL1_SCALE, MUL1_BIAS)
        b_a = tl.load(p_a + k0, mask=m_p[:, None], other=0.0)
        acc += tl.dot(b_a.to(DT), w.to(DT))
    p_out = out + o_p[:, None].to(tl.int64) * (16 * NT) + o_n[None, :]
    if SPLIT:
        tl.atomic_add(p_out, acc, mask=m_p[:, None])
    else:
        tl.store(p_out, acc, mask=m_p[:, None])


@triton.jit
def _half_sum_f32(x):
    """fp32(fp16(lo16(x)) + fp16(hi16(x))) with one scalar fp16 add (ptxas otherwise pairs the
    adds into HFMA2s that need extra PRMT/shift repacking) and one conversion."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 l, h; mov.b32 {l, h}, $1; add.rn.f16 l, l, h; cvt.f32.f16 $0, l; }",
        "=f,r", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _gemv4_kernel(a, tr, key, starts, out, P, KD, NT, SIDE_N, E, KTS, mask, flip,
                  CB: tl.constexpr, MULT: tl.constexpr, ADD: tl.constexpr,
                  MUL1_SCALE: tl.constexpr, MUL1_BIAS: tl.constexpr, BITS: tl.constexpr,
                  MR: tl.constexpr, BN: tl.constexpr, SPLIT: tl.constexpr, ASM: tl.constexpr,
                  UNROLL: tl.constexpr):
    """K = 4 fused dequant-GEMV in symbol order: `_gemm_kernel`'s contract (rows sorted by local
    expert; a program leads iff its row starts an MR-row run of its expert), no tl.dot.

    A tile's 32 uint32 words U[t]: symbol 8t + j (j = 4 ch + 2 r_hi + r_lo) has the state
    (U[t-1] << 32 | U[t]) >> 4(7 - j), i.e. sel >> (12 - 4(2 r_hi + r_lo)) & 0xFFFF with
    sel = U[t] (ch = 1) or (U[t-1] << 16 | U[t] >> 16) (ch = 0), and sits at tile row
    8 r_hi + 2 r_pair + r_lo, column 8 ch + c_lo where t = 4 c_lo + r_pair. The 128-column block
    is a lane axis C2 = (ch, d0 = 8 tile + c_lo) of 128 and the 16 rows of a tile row are
    registers [r_hi, r_pair, r_lo]: each thread loads the 4 words (and their predecessors) of
    its column once per tile row, decodes 16 weights and multiplies them by the 16 activations
    of the tile row (the same for all threads), fp32 accumulate; rows reduce once at the end.
    KTS tile rows of K per program (SPLIT: atomic adds).
    """
    i_p, i_n, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    e = tl.load(key + i_p)
    if e >= E:
        return
    start = tl.load(starts + e)
    if (i_p - start) % MR != 0:
        return
    end = tl.load(starts + e + 1)
    D: tl.constexpr = BN // 2  # (tile, c_lo) columns per ch
    o_c2 = tl.arange(0, BN)
    ch = o_c2 // D
    d0 = o_c2 % D
    # words of this N block inside one tile row: 4 d0 + r_pair (tiles along N are contiguous)
    o_w = 4 * d0[None, :] + tl.arange(0, 4)[:, None]  # [4, BN]
    o_prev = o_w - 1 + tl.where(o_w % 32 == 0, 32, 0)  # U[t - 1], wrapping inside the tile
    sel_hi = (ch == 0)[None, :]
    # shift of symbol (r_hi, r_lo): [2, 1, 2, 1]; activation rows 8 r_hi + 2 r_pair + r_lo
    q = 2 * tl.arange(0, 2)[:, None, None, None] + tl.arange(0, 2)[None, None, :, None]
    sh = (12 - 4 * q).to(tl.uint32)
    o_row = (8 * tl.arange(0, 2)[:, None, None, None] + 2 * tl.arange(0, 4)[None, :, None, None]
             + tl.arange(0, 2)[None, None, :, None])  # [2, 4, 2, 1]
    o_m = tl.arange(0, MR)
    side = (i_n * BN) // SIDE_N
    # rows past the run's end read its last row (no masked loads in the loop; not stored)
    row = tl.minimum(i_p + o_m, end - 1)[:, None, None, None, None]
    p_a = (a + (side * P + row).to(tl.int64) * KD
           + o_row[None])  # [MR, 2, 4, 2, 1]
    p_tr = tr + (e.to(tl.int64) * (KD // 16) * NT + i_n * (BN // 16)) * 32
    flip = flip.to(tl.uint32)
    kt0 = i_s * KTS
    kt1 = tl.minimum(kt0 + KTS, KD // 16)
    acc = tl.zeros([MR, 2, 4, 2, BN], dtype=tl.float32)
    p_w = p_tr + kt0.to(tl.int64) * NT * 32
    # register double buffering: the next tile row's words and activations load while this
    # one decodes (the last trip reloads its own row)
    cur = tl.load(p_w + o_w)
    prev = tl.load(p_w + o_prev)
    b_a = tl.load(p_a + kt0 * 16)  # [MR, 2, 4, 2, 1]
    for kt in tl.range(kt0, kt1, loop_unroll_factor=UNROLL):
        nxt = tl.minimum(kt + 1, kt1 - 1)
        p_w += (nxt - kt) * NT * 32
        cur_n = tl.load(p_w + o_w)
        prev_n = tl.load(p_w + o_prev)
        b_a_n = tl.load(p_a + nxt * 16)
        u = cur.to(tl.uint32, bitcast=True)
        sel = tl.where(sel_hi, (prev.to(tl.uint32, bitcast=True) << 16) | (u >> 16), u)
        state = (sel[None, :, None, :] >> sh) & 0xFFFF  # [2, 4, 2, BN]
        x = state * tl.full([], MULT, tl.uint32) + tl.full([], ADD, tl.uint32)
        if CB != 2 and ASM:
            w = _half_sum_f32((x & mask) ^ flip)
        else:
            w = _hash_value(x, CB, MUL1_SCALE, MUL1_BIAS, mask, flip).to(tl.float32)
        acc += b_a.to(tl.float32) * w[None]
        cur, prev, b_a = cur_n, prev_n, b_a_n
    y = tl.sum(tl.sum(tl.sum(acc, axis=3), axis=2), axis=1)  # [MR, BN]
    col = i_n * BN + 16 * (d0 // 8) + 8 * ch + d0 % 8
    p_out = out + (i_p + o_m[:, None]).to(tl.int64) * (16 * NT) + col[None, :]
    m_out = (i_p + o_m < end)[:, None] & (col < 16 * NT)[None, :]  # NT % (BN / 16) == 0
    if SPLIT:
        tl.atomic_add(p_out, y, mask=m_out)
    else:
        tl.store(p_out, y, mask=m_out)


def _gemv_rows(p: int) -> int:
    """Rows per program of the K = 4 GEMV for P routed pairs: each MR-row run of an expert
    decodes its weights once and pays MR multiply-adds per weight (T = 1: one row per expert;
    T = 64 at top-8 over 288 experts: ~1.8 rows per routed expert)."""
    return 1 if p <= 32 else 2 if p <= 512 else 4


def _fused_gemm(a: torch.Tensor, trellis: torch.Tensor, key: torch.Tensor, starts: torch.Tensor,
                codebook: int, rows: int | None = None) -> torch.Tensor:
    """a [S, P, KD] fp16 values in fp16 or fp32 (sorted rows; side s feeds output columns
    [s*N/S, (s+1)*N/S)),
    trellis int16 [E, KD/16, N/16, 16K] -> a @ What fp32 [P, N] (rows of other ranks zero).
    K = 4 runs the symbol-order GEMV (`rows`: its MR, by default `_gemv_rows(P)`), other K
    the tl.dot kernel."""
    n_side, p, kd = a.shape
    n_exp, _, nt, _ = trellis.shape
    # zeros: rows of other ranks' experts stay finite through the SwiGLU; split-K adds into it
    out = torch.zeros((p, 16 * nt), dtype=torch.float32, device=a.device)
    if p:
        n_blk = 16 * nt // _BN
        # split K until ~MIN_PROGRAMS programs work (P bounds the working ones), >= 128 rows each
        split = 1
        while p * n_blk * split < MIN_PROGRAMS and kd % (2 * split * 128) == 0:
            split *= 2
        bits = _check(trellis, codebook)
        if bits == 4 and nt % (_BN // 16) == 0:
            mr = rows if rows is not None else _gemv_rows(p)
            _gemv4_kernel[(p, n_blk, split)](
                a, trellis.view(torch.int32), key, starts, out, p, kd, nt, 16 * nt // n_side,
                n_exp, kd // 16 // split, _MASK, _FLIP, MR=mr, BN=_BN, SPLIT=split > 1,
                ASM=not INTERPRET, UNROLL=_UNROLL,
                num_stages=_STAGES, num_warps=_WARPS, **_const_kwargs(codebook, bits))
            return out
        _gemm_kernel[(p, n_blk, split)](
            a, trellis.view(torch.int32), key, starts, out, p, kd, nt, 16 * nt // n_side,
            n_exp, kd // split, BM=_BM, BN=_BN, BK=_BK, SPLIT=split > 1, DT=_DOT,
            num_stages=_STAGES, num_warps=_WARPS, **_const_kwargs(codebook, bits))
    return out


def _grouped_gemm(a: torch.Tensor, trellis: torch.Tensor, key: torch.Tensor, starts: torch.Tensor,
                  codebook: int) -> torch.Tensor:
    """Prefill twin of `_fused_gemm`: dequantise experts chunk by chunk into a scratch and run
    a grouped GEMM per input side."""
    n_side, p, kd = a.shape
    n_exp, _, nt, _ = trellis.shape
    n = 16 * nt
    ns = n // n_side
    dtype = torch.bfloat16 if a.is_cuda else torch.float32
    chunk = max(1, PREFILL_SCRATCH_BYTES // (kd * n * dtype.itemsize))
    a = a.to(dtype)
    rows = torch.arange(p, device=a.device)
    y = torch.zeros((p, n), dtype=torch.float32, device=a.device)
    for c0 in range(0, n_exp, chunk):
        c1 = min(c0 + chunk, n_exp)
        w = _dequant_into(trellis[c0:c1], codebook, dtype)  # [c, KD, N]
        # rotate the chunk's rows to the front (its first row is data, so gather, not slice)
        shift = starts[c0]
        idx = (rows + shift) % p
        offs = (starts[c0 + 1:c1 + 1] - shift).to(torch.int32)
        part = torch.cat([torch._grouped_mm(a[s][idx], w[:, :, s * ns:(s + 1) * ns], offs=offs)
                          for s in range(n_side)], dim=1)
        mine = (key >= c0) & (key < c1)
        y = torch.where(mine.unsqueeze(1), part[(rows - shift) % p].float(), y)
    return y


@triton.jit
def _hadamard_f32(x, pm1):
    """x [BM, 128] fp32 -> x . H128 (unscaled) at fp32 accuracy on tensor cores: x is split in
    three bf16 parts (8 significant bits each, 24 in all) whose products with the +-1 matrix
    pm1 are exact; the partial sums add in fp32 (a tf32x3 dot, which also splits the +-1
    matrix, spilled registers). pm1: [128, 128] +-1 in _DOT_BF."""
    hi = x.to(tl.bfloat16)
    rest = x - hi.to(tl.float32)
    mid = rest.to(tl.bfloat16)
    lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
    return (tl.dot(hi.to(_DOT_BF), pm1) + tl.dot(mid.to(_DOT_BF), pm1)
            + tl.dot(lo.to(_DOT_BF), pm1))


@triton.jit
def _swiglu_rotate_kernel(h, svh, suh, expert, out, P, INTER, limit, BM: tl.constexpr,
                          OUT_F32: tl.constexpr):
    """Between the projections, one launch: gate / up = (h . H128) * svh (output transform),
    a = silu(min(gate, limit)) * clamp(up, +-limit), then the down projection's input transform
    fp16(fp16(a * suh) . H128 / sqrt(128)). h: fp32 [P, 2I] (gate | up); svh: fp16 [E, 2I];
    suh: fp16 [E, I]; expert: [P]; out: [P, I]. Grid (cdiv(P, BM), I / 128)."""
    i_p, i_b = tl.program_id(0), tl.program_id(1)
    o_p = i_p * BM + tl.arange(0, BM)
    m_p = o_p < P
    o_c = i_b * 128 + tl.arange(0, 128)
    e = tl.load(expert + o_p, mask=m_p, other=0).to(tl.int64)
    pm1 = _hadamard_pm1(128).to(_DOT_BF)  # one +-1 matrix for the three transforms
    scale = 0.08838834764831845
    p_h = h + o_p[:, None].to(tl.int64) * (2 * INTER) + o_c[None, :]
    g = tl.load(p_h, mask=m_p[:, None], other=0.0)
    u = tl.load(p_h + INTER, mask=m_p[:, None], other=0.0)
    g = _hadamard_f32(g, pm1) * scale
    u = _hadamard_f32(u, pm1) * scale
    p_v = svh + e[:, None] * (2 * INTER) + o_c[None, :]
    g = g * tl.load(p_v, mask=m_p[:, None], other=0.0).to(tl.float32)
    u = u * tl.load(p_v + INTER, mask=m_p[:, None], other=0.0).to(tl.float32)
    g = tl.minimum(g, limit)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    a = g * tl.sigmoid(g) * u
    s = tl.load(suh + e[:, None] * INTER + o_c[None, :], mask=m_p[:, None], other=0.0)
    v = (a * s.to(tl.float32)).to(tl.float16).to(tl.float32)  # exllamav3 rounds to fp16
    r = (_hadamard_f32(v, pm1) * scale).to(tl.float16)
    p_out = out + o_p[:, None].to(tl.int64) * INTER + o_c[None, :]
    tl.store(p_out, r.to(tl.float32) if OUT_F32 else r, mask=m_p[:, None])


@triton.jit
def _unrotate_scatter_kernel(y, svh, expert, weight, tok, out, P, D, E, BM: tl.constexpr):
    """After the down projection, one launch: out[tok[p]] += weight[p] * (y[p] . H128) *
    svh[expert[p]] for the rows of this rank's experts (expert < E); fp32 atomics, as
    index_add on CUDA. y: fp32 [P, D]; svh: fp16 [E, D]; out: fp32 [T, D]. Grid
    (cdiv(P, BM), D / 128)."""
    i_p, i_b = tl.program_id(0), tl.program_id(1)
    o_p = i_p * BM + tl.arange(0, BM)
    e = tl.load(expert + o_p, mask=o_p < P, other=E)
    m_p = (o_p < P) & (e < E)
    e = tl.minimum(e, E - 1).to(tl.int64)
    o_c = i_b * 128 + tl.arange(0, 128)
    b_y = tl.load(y + o_p[:, None].to(tl.int64) * D + o_c[None, :], mask=m_p[:, None], other=0.0)
    b_y = _hadamard_f32(b_y, _hadamard_pm1(128).to(_DOT_BF)) * 0.08838834764831845
    b_s = tl.load(svh + e[:, None] * D + o_c[None, :], mask=m_p[:, None], other=0.0)
    w = tl.load(weight + o_p, mask=m_p, other=0.0)
    t = tl.load(tok + o_p, mask=m_p, other=0).to(tl.int64)
    tl.atomic_add(out + t[:, None] * D + o_c[None, :], b_y * b_s.to(tl.float32) * w[:, None],
                  mask=m_p[:, None])


def moe_exl3_on_path(
    x: torch.Tensor,
    w13_trellis: torch.Tensor,
    w13_suh: torch.Tensor,
    w13_svh: torch.Tensor,
    w2_trellis: torch.Tensor,
    w2_suh: torch.Tensor,
    w2_svh: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    swiglu_limit: float,
    expert_offset: int,
    codebook: int,
    *,
    decode: bool | None = None,
) -> torch.Tensor:
    """x: [T, D]; w13_trellis int16 [E, D/16, 2I/16, 16K]; w13_suh fp16 [E, 2, D];
    w13_svh fp16 [E, 2I]; w2_trellis int16 [E, I/16, D/16, 16K]; w2_suh fp16 [E, I];
    w2_svh fp16 [E, D]; topk_weights [T, k]; topk_ids [T, k] int64 (global ids).
    decode: force the fused (True) or the scratch + grouped-GEMM (False) path; None (what the
    op `moe_exl3` does) picks by T * k <= DECODE_MAX_PAIRS. Returns [T, D] in x's dtype."""
    n_tok, k = topk_ids.shape
    n_exp = w13_trellis.shape[0]
    inter = w13_svh.shape[-1] // 2
    if decode is None:
        decode = n_tok * k <= DECODE_MAX_PAIRS
    local = topk_ids.reshape(-1) - expert_offset
    valid = (local >= 0) & (local < n_exp)
    key = torch.where(valid, local, n_exp)
    order = torch.argsort(key, stable=True)
    key = key[order]
    # first row of each expert, and of "not ours" (searchsorted: no host sync)
    starts = torch.searchsorted(key, torch.arange(n_exp + 1, device=key.device)).to(torch.int32)
    tok = order // k
    expert = key.clamp(max=n_exp - 1)
    gemm = _fused_gemm if decode else _grouped_gemm
    a_dtype = torch.float32 if decode else torch.float16
    h = gemm(_rotate(x, tok, w13_suh, expert, a_dtype), w13_trellis, key, starts, codebook)
    p, d = h.shape[0], x.shape[1]
    out = torch.zeros((n_tok, d), dtype=torch.float32, device=x.device)
    if not p:
        return out.to(x.dtype)
    # the transforms around the GEMMs run as two fused launches (the output transform, SwiGLU
    # and the next input transform; the last output transform with the weighted scatter)
    a2 = torch.empty((1, p, inter), dtype=a_dtype, device=x.device)
    _swiglu_rotate_kernel[(triton.cdiv(p, _EPI_ROWS), inter // 128)](
        h, w13_svh, w2_suh, expert, a2, p, inter, float(swiglu_limit), BM=_EPI_ROWS,
        OUT_F32=a_dtype == torch.float32, num_warps=8)  # 4 warps spill its three transforms
    y = gemm(a2, w2_trellis, key, starts, codebook)
    wts = topk_weights.reshape(-1)[order].float()
    _unrotate_scatter_kernel[(triton.cdiv(p, _EPI_ROWS), d // 128)](
        y, w2_svh, key, wts, tok, out, p, d, n_exp, BM=_EPI_ROWS)
    return out.to(x.dtype)


def moe_exl3(
    x: torch.Tensor,
    w13_trellis: torch.Tensor,
    w13_suh: torch.Tensor,
    w13_svh: torch.Tensor,
    w2_trellis: torch.Tensor,
    w2_suh: torch.Tensor,
    w2_svh: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    swiglu_limit: float,
    expert_offset: int,
    codebook: int,
) -> torch.Tensor:
    """The op, signature of the reference's: `moe_exl3_on_path` on the switch rule's path."""
    return moe_exl3_on_path(x, w13_trellis, w13_suh, w13_svh, w2_trellis, w2_suh, w2_svh,
                            topk_weights, topk_ids, swiglu_limit, expert_offset, codebook)
