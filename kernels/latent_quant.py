"""Triton store of quantised MLA latent rows and the decoders the attention kernel uses (twin
of `kernels/ref/latent_quant.py`, whose docstring states the layouts and rounding rules).

Codes are written as integer bit patterns (int32 bit math, bitcasts, uint8 stores), not through
Triton's fp8 types, whose rounding differs between GPUs and the interpreter: divisions are
`div_rn` (correctly rounded, as torch's), every other step is exact, so the bytes equal the
reference's. Reading, e4m3 codes and scales go through the GPU's exact conversion, e2m1 codes
through bit patterns scaled by powers of two (the attention's tiles spilled under the
where-chains of a decode by value).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .ref.latent_quant import (
    FP8_TILE,
    NVFP4_GROUP,
    check_outer_scale,
    nvfp4_outer_offset,
    row_bytes,
)
from .utils import INTERPRET, next_pow2

__all__ = ["store_latent"]

FORMAT_IDS = {"plain": 0, "fp8": 1, "nvfp4": 2}
# the layouts' tile widths, as the kernels see them
TILE_FP8: tl.constexpr = tl.constexpr(FP8_TILE)
GROUP_NVFP4: tl.constexpr = tl.constexpr(NVFP4_GROUP)
INTERPRETED: tl.constexpr = tl.constexpr(INTERPRET)


@triton.jit
def e4m3_decode(b_c):
    """e4m3 bit patterns (int32 in [0, 255]) -> fp32 (0x7F / 0xFF -> NaN)."""
    s, e, m = (b_c >> 7) & 1, (b_c >> 3) & 15, b_c & 7
    b_n = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    b_v = tl.where(e > 0, b_n, m.to(tl.float32) * 0.001953125)  # subnormal: m * 2^-9
    b_v = tl.where((e == 15) & (m == 7), float("nan"), b_v)
    return tl.where(s == 1, -b_v, b_v)


@triton.jit
def e4m3_encode(b_y):
    """fp32 -> e4m3 bit patterns (int32): nearest-even, saturating at 448, NaN -> 0x7F."""
    sign = (b_y.to(tl.int32, bitcast=True) >> 31) & 1
    b_a = tl.minimum(tl.abs(b_y), 448.0)
    a_bits = b_a.to(tl.int32, bitcast=True)
    # subnormal codes (|y| < 2^-6): nearest-even integer of |y| * 2^9 (adding and removing
    # 2^23 rounds an fp32 in [0, 8) to an integer, ties to even); 8 is the code of 2^-6
    b_sub = ((b_a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    # normal codes: drop 20 mantissa bits with nearest-even, rebias the exponent (127 -> 7)
    b_nrm = ((a_bits + 0x7FFFF + ((a_bits >> 20) & 1)) >> 20) - (120 << 3)
    b_c = tl.where(b_a < 0.015625, b_sub, b_nrm) | (sign << 7)
    return tl.where(b_y != b_y, 0x7F, b_c)


@triton.jit
def e2m1_encode(b_y):
    """fp32 -> e2m1 codes (int32): nearest-even, saturating at 6 (NaN -> 0)."""
    b_a = tl.abs(b_y)
    m = ((b_a > 0.25).to(tl.int32) + (b_a >= 0.75).to(tl.int32) + (b_a > 1.25).to(tl.int32)
         + (b_a >= 1.75).to(tl.int32) + (b_a > 2.5).to(tl.int32) + (b_a >= 3.5).to(tl.int32)
         + (b_a > 5.0).to(tl.int32))
    neg = ((b_y.to(tl.int32, bitcast=True) >> 31) & 1) * (b_y == b_y).to(tl.int32)
    return m + 8 * neg


@triton.jit
def _e4m3_to_f32(b_c):
    """uint8 e4m3 codes -> fp32 through the GPU's conversion (cvt: 2 values an instruction)
    rather than `e4m3_decode`'s bit math, which held the attention's [BW, BO] tiles as int32
    and spilled. e4m3fn's NaN code 0x7F decodes as NaN there; the interpreter reads it as 480."""
    b_v = b_c.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    if INTERPRETED:
        b_v = tl.where((b_c & 0x7F) == 0x7F, float("nan"), b_v)
    return b_v


@triton.jit
def _times_tile_scales(b_x, p_s, o_col, m_row, C: tl.constexpr, TILE: tl.constexpr):
    """b_x [BW, BO] times the fp32 scale of each value's column tile (scales of row r at
    p_s[r] + column // TILE). Where BO is a multiple of TILE, one scale is loaded per row and
    tile and broadcast over the tile's columns: a per-value gather of the scales held BW x BO
    fp32 values in registers (the fp8 attention spilled)."""
    BW: tl.constexpr = b_x.shape[0]
    BO: tl.constexpr = b_x.shape[1]
    if BO % TILE == 0:
        NT: tl.constexpr = BO // TILE
        o_t = tl.min(tl.reshape(o_col, [NT, TILE]), 1) // TILE
        b_s = tl.load(p_s[:, None] + o_t[None, :],
                      mask=m_row[:, None] & (o_t * TILE < C)[None, :], other=0.0)
        return tl.reshape(tl.reshape(b_x, [BW, NT, TILE]) * b_s[:, :, None], [BW, BO])
    else:
        return b_x * tl.load(p_s[:, None] + o_col[None, :] // TILE,
                             mask=m_row[:, None] & (o_col < C)[None, :], other=0.0)


@triton.jit
def latent_tile(kv, kv32, i_row, o_col, m_row, m_col, C: tl.constexpr, RB: tl.constexpr,
                OUTER: tl.constexpr, FMT: tl.constexpr):
    """Values [BW, BO] of columns o_col ([BO], consecutive, from a multiple of BO) of cache rows
    i_row ([BW] int64), masked by rows m_row and columns m_col: the stored values (FMT 0, the
    cache's dtype) or the dequantised fp8 (1) / nvfp4 (2) rows in fp32. kv is the cache (uint8
    when quantised), kv32 the same memory as fp32 words (the scales)."""
    mask = m_row[:, None] & m_col[None, :]
    if FMT == 0:
        b_v = tl.load(kv + i_row[:, None] * C + o_col[None, :], mask=mask, other=0.0)
    elif FMT == 1:
        b_c = tl.load(kv + i_row[:, None] * RB + o_col[None, :], mask=mask, other=0)
        b_v = _times_tile_scales(_e4m3_to_f32(b_c), kv32 + i_row * (RB // 4) + C // 4,
                                 o_col, m_row, C, TILE_FP8)
    else:
        BW: tl.constexpr = i_row.shape[0]
        BO: tl.constexpr = o_col.shape[0]
        p_r = kv + i_row * RB
        # each byte once: two codes, the low nibble the even column
        o_byte = tl.min(tl.reshape(o_col, [BO // 2, 2]), 1) // 2
        b_b = tl.load(p_r[:, None] + o_byte[None, :],
                      mask=m_row[:, None] & (o_byte * 2 < C)[None, :], other=0).to(tl.int32)
        # e2m1 codes as fp32 bit patterns s.ee.m at bits 31, 23-24, 22: the code's value times
        # 2^-126 (the 0.5 of code 1 lands on the subnormal 2^-127), the 2^126 restored by two
        # exact 2^63 factors, one here and one in the group scale
        b_c = tl.reshape(tl.join(b_b, b_b >> 4), [BW, BO])
        b_c = ((b_c & 8) << 28) | ((b_c & 7) << 22)
        b_e = b_c.to(tl.float32, bitcast=True) * 9.223372036854775808e18
        b_o = tl.load(kv32 + i_row * (RB // 4) + OUTER // 4, mask=m_row, other=0.0)
        # the group scales (e4m3 bytes after the codes) times the row's outer scale
        NG: tl.constexpr = BO // GROUP_NVFP4
        o_g = tl.min(tl.reshape(o_col, [NG, GROUP_NVFP4]), 1) // GROUP_NVFP4
        b_g = tl.load(p_r[:, None] + C // 2 + o_g[None, :],
                      mask=m_row[:, None] & (o_g * GROUP_NVFP4 < C)[None, :], other=0)
        b_g = _e4m3_to_f32(b_g) * (b_o * 9.223372036854775808e18)[:, None]
        b_v = tl.reshape(tl.reshape(b_e, [BW, NG, GROUP_NVFP4]) * b_g[:, :, None], [BW, BO])
    return b_v


@triton.jit
def _store_fp8(b_x, m_c, p_row, p_row32, C: tl.constexpr, BC: tl.constexpr,
               TILE: tl.constexpr):
    nt: tl.constexpr = BC // TILE
    b_t = tl.reshape(b_x, [nt, TILE])
    b_amax = tl.max(tl.where(b_t - b_t == 0, tl.abs(b_t), 0.0), 1)  # finite values only
    # scale 2^e, the smallest with amax <= 448 * 2^e: amax = 1.f * 2^(B - 127), and
    # 448 = 1.75 * 2^8, so e = B - 135, one more when 1.f > 1.75; clamped to [-126, 126]
    bits = b_amax.to(tl.int32, bitcast=True)
    e = (bits >> 23) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    e = tl.minimum(tl.maximum(e, -126), 126)
    has = b_amax > 0
    b_scale = tl.where(has, ((e + 127) << 23).to(tl.float32, bitcast=True), 0.0)
    b_inv = tl.where(has, ((127 - e) << 23).to(tl.float32, bitcast=True), 1.0)
    b_c = tl.reshape(e4m3_encode(b_t * b_inv[:, None]), [BC])
    o_c = tl.arange(0, BC)
    tl.store(p_row + o_c, b_c.to(tl.uint8), mask=m_c)
    o_t = tl.arange(0, nt)
    tl.store(p_row32 + C // 4 + o_t, b_scale, mask=o_t * TILE < C)


@triton.jit
def _store_nvfp4(b_x, m_c, p_row, p_row32, outer, C: tl.constexpr, RB: tl.constexpr,
                 OUTER: tl.constexpr, BC: tl.constexpr, BZ: tl.constexpr):
    ng: tl.constexpr = BC // 16
    b_g = tl.reshape(b_x, [ng, 16])
    b_amax = tl.max(tl.where(b_g - b_g == 0, tl.abs(b_g), 0.0), 1)
    b_gc = e4m3_encode(tl.math.div_rn(b_amax, outer * 6.0))
    b_gc = tl.where(tl.max((b_g != b_g).to(tl.int32), 1) > 0, 0x7F, b_gc)  # a NaN in the group
    b_div = e4m3_decode(b_gc) * outer
    b_div = tl.where((b_div == 0) | (b_div != b_div), 1.0, b_div)
    b_c = tl.reshape(e2m1_encode(tl.math.div_rn(b_g, b_div[:, None])), [BC // 2, 2])
    b_lo, b_hi = tl.split(b_c)
    o_h, o_g = tl.arange(0, BC // 2), tl.arange(0, ng)
    tl.store(p_row + o_h, (b_lo | (b_hi << 4)).to(tl.uint8), mask=o_h < C // 2)
    tl.store(p_row + C // 2 + o_g, b_gc.to(tl.uint8), mask=o_g < C // 16)
    # reserved and padding bytes are zero (the outer scale's 4 bytes are stored apart)
    o_z = C // 2 + C // 16 + tl.arange(0, BZ)
    m_z = (o_z < RB) & ((o_z < OUTER) | (o_z >= OUTER + 4))
    tl.store(p_row + o_z, tl.zeros([BZ], dtype=tl.uint8), mask=m_z)
    tl.store(p_row32 + OUTER // 4 + tl.arange(0, 1), tl.zeros([1], dtype=tl.float32) + outer)


@triton.jit
def store_latent_kernel(rows, kv, kv32, slot_mapping, outer, stride_r, dcp_rank,
                        LBS: tl.constexpr, DCP: tl.constexpr, C: tl.constexpr,
                        RB: tl.constexpr, OUTER: tl.constexpr, FMT: tl.constexpr,
                        BC: tl.constexpr, TILE: tl.constexpr, BZ: tl.constexpr):
    """Program t: writes latent row t to its cache row, quantised (FMT 1 fp8, 2 nvfp4) or cast
    to the cache's dtype (FMT 0, plain: as `store_rows`); under DCP a token of another rank
    goes to row 0 of the null block, like `store_rows`."""
    i_t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping + i_t).to(tl.int64)
    if DCP > 1:
        off = slot % (LBS * DCP)
        slot = tl.where(off % DCP == dcp_rank, slot // (LBS * DCP) * LBS + off // DCP, 0)
    o_c = tl.arange(0, BC)
    m_c = o_c < C
    b_r = tl.load(rows + i_t * stride_r + o_c, mask=m_c, other=0.0)
    if FMT == 0:
        tl.store(kv + slot * C + o_c, b_r.to(kv.dtype.element_ty), mask=m_c)
    elif FMT == 1:
        _store_fp8(b_r.to(tl.float32), m_c, kv + slot * RB, kv32 + slot * (RB // 4), C, BC,
                   TILE)
    else:
        _store_nvfp4(b_r.to(tl.float32), m_c, kv + slot * RB, kv32 + slot * (RB // 4), outer,
                     C, RB, OUTER, BC, BZ)


def store_latent(latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
                 dcp_rank: int = 0, dcp_size: int = 1, latent_format: str = "plain",
                 outer_scale: float = 1.0) -> None:
    """latent: [T, Lc]; cache: [B, bs / dcp_size, row] (uint8 rows of `latent_format` "fp8"
    / "nvfp4", or plain values); slot_mapping: [T]. One program per token: plain rows too
    (under DCP torch's indexed copy took ~9 launches of slot arithmetic a layer)."""
    n_tok, lc = latent.shape
    plain = latent_format == "plain"
    rb = lc if plain else row_bytes(latent_format, lc)
    assert cache.shape[-1] == rb and cache.is_contiguous() and latent.stride(1) == 1
    assert plain or cache.dtype == torch.uint8
    if latent_format == "nvfp4":
        check_outer_scale(outer_scale)
    if n_tok == 0:
        return
    bc = next_pow2(lc)
    outer_at = nvfp4_outer_offset(lc)
    store_latent_kernel[(n_tok,)](
        latent, cache, cache if plain else cache.view(torch.float32), slot_mapping,
        float(outer_scale), latent.stride(0), dcp_rank, LBS=cache.shape[1], DCP=dcp_size, C=lc,
        RB=rb, OUTER=outer_at, FMT=FORMAT_IDS[latent_format], BC=bc, TILE=min(FP8_TILE, bc),
        BZ=next_pow2(rb - lc // 2 - lc // NVFP4_GROUP))


def latent_kernel_args(latent_cache: torch.Tensor, lc: int, latent_format: str) -> dict:
    """The cache arguments of `latent_tile` for a cache of `latent_format` rows."""
    fmt = FORMAT_IDS[latent_format]
    if fmt == 0:
        return dict(kv32=latent_cache, RB=lc, OUTER=0, FMT=0)
    rb = row_bytes(latent_format, lc)
    assert latent_cache.dtype == torch.uint8 and latent_cache.shape[-1] == rb
    return dict(kv32=latent_cache.view(torch.float32), RB=rb, OUTER=nvfp4_outer_offset(lc),
                FMT=fmt)
