"""Quantised MLA latent rows: the byte layouts of `--kv-cache-dtype fp8` and `nvfp4`, packed
and unpacked in pure torch (the Triton store and the in-kernel dequantisation of
`kernels/latent_quant.py` / `kernels/sparse_mla.py` match these bit for bit).

A cache row holds one token's `lc`-wide latent (lc = kv_lora_rank: 512 for GLM-5.3) as uint8:

fp8 (528 B at lc 512): lc e4m3 codes, then one fp32 scale per 128-channel tile (the last tile
  may be narrower). value = e4m3(code) * scale.
nvfp4 (304 B at lc 512): lc/2 bytes of e2m1 codes (channel 2i in the low nibble), lc/16 e4m3
  group scales (16 channels a group), 4 reserved bytes, the fp32 outer scale at the next
  4-byte boundary, zero padding to a multiple of 16. value = e2m1(code) * e4m3(group) * outer.
  The outer scale is the layer's entry of the calibrated scale bank (a power of two), copied
  into every row so the reader needs no bank.

Rounding and special values (one rule set for the reference and the kernels):
- codes round to nearest, ties to even, and saturate: e4m3 at +-448 (torch's float8_e4m3fn
  cast for finite values in range), e2m1 at +-6;
- fp8 tile scales are powers of two, the smallest 2^e with amax <= 448 * 2^e (e clamped to
  [-126, 126]; amax over the tile's finite values), so x * 2^-e is exact and a denormal input
  keeps its precision; a tile without a nonzero finite value stores scale 0;
- nvfp4 group scale = e4m3(amax_group / (6 * outer)) (one correctly rounded division), codes
  e2m1(x / (group * outer)); a group whose scale is 0 stores codes of x itself (only zeros
  and infinities are left there) and dequantises to zeros;
- +-inf saturates to the largest code of its tile or group (+-448 * scale, +-6 * group * outer);
- NaN: fp8 stores the canonical e4m3 NaN 0x7F (unpacks to NaN); e2m1 has no NaN, so a NaN
  makes its whole nvfp4 group scale 0x7F (the 16 values unpack to NaN);
- -0.0 keeps its sign bit.

Pooled indexer keys of a quantised cache ("fp8" pool format, as vLLM stores them): each
pooled key is rotated by the orthonormal Hadamard matrix (Sylvester order, 1/sqrt(d); a fast
Walsh-Hadamard transform, no constant tensor, so CUDA graphs capture it) and packed as an fp8
row (132 B at index_head_dim 128); queries are rotated the same way before scoring, so scores
change only by rounding. H is symmetric and orthonormal: rotating twice gives the input back.
"""

from __future__ import annotations

import torch

LATENT_FORMATS = ("plain", "fp8", "nvfp4")
E4M3_MAX = 448.0
E4M3_NAN = 0x7F
FP8_TILE = 128
NVFP4_GROUP = 16
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def fp8_tiles(lc: int) -> int:
    return -(-lc // FP8_TILE)


def fp8_row_bytes(lc: int) -> int:
    """Bytes of one fp8 row: 528 at lc 512."""
    _check_width(lc)
    return lc + 4 * fp8_tiles(lc)


def nvfp4_outer_offset(lc: int) -> int:
    """Byte offset of the fp32 outer scale in an nvfp4 row (292 at lc 512)."""
    _check_width(lc)
    end = lc // 2 + lc // NVFP4_GROUP + 4  # codes, group scales, reserved
    return -(-end // 4) * 4


def nvfp4_row_bytes(lc: int) -> int:
    """Bytes of one nvfp4 row: 304 at lc 512."""
    return -(-(nvfp4_outer_offset(lc) + 4) // 16) * 16


def row_bytes(latent_format: str, lc: int) -> int:
    if latent_format == "fp8":
        return fp8_row_bytes(lc)
    if latent_format == "nvfp4":
        return nvfp4_row_bytes(lc)
    raise ValueError(f"latent format {latent_format!r} has no packed row (fp8 or nvfp4)")


def _check_width(lc: int) -> None:
    if lc <= 0 or lc % NVFP4_GROUP:
        raise ValueError(f"a quantised latent row needs a width that is a positive multiple of "
                         f"{NVFP4_GROUP}, not {lc}")


def check_outer_scale(outer: float) -> None:
    """Outer scales are powers of two in [2^-100, 2^100] (products with codes stay exact)."""
    mantissa, exponent = torch.frexp(torch.tensor(float(outer), dtype=torch.float32))
    if not (float(mantissa) == 0.5 and -99 <= int(exponent) <= 101):
        raise ValueError(f"nvfp4 outer scale {outer!r} is not a power of two in [2^-100, 2^100]")


def _finite_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| over the finite values of the last dim (0 when there are none)."""
    return torch.where(torch.isfinite(x), x.abs(), 0.0).amax(dim=-1)


def e4m3_codes(y: torch.Tensor) -> torch.Tensor:
    """fp32 -> e4m3 bit patterns (uint8): nearest-even, saturating at +-448, NaN -> 0x7F."""
    # the clamp makes saturation explicit: older torch casts turned overflow and inf into NaN
    codes = y.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.where(torch.isnan(y), E4M3_NAN, codes).to(torch.uint8)


def e4m3_values(codes: torch.Tensor) -> torch.Tensor:
    return codes.contiguous().view(torch.float8_e4m3fn).float()


def e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """fp32 -> e2m1 4-bit codes (sign in bit 3): nearest-even, saturating at +-6 (NaN -> 0)."""
    a = y.abs()
    magnitude = ((a > 0.25).int() + (a >= 0.75).int() + (a > 1.25).int() + (a >= 1.75).int()
                 + (a > 2.5).int() + (a >= 3.5).int() + (a > 5.0).int())
    sign = torch.signbit(y) & ~torch.isnan(y)
    return (magnitude + 8 * sign.int()).to(torch.uint8)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(_E2M1_VALUES + tuple(-v for v in _E2M1_VALUES), device=codes.device)
    return table[codes.long()]


def fp8_tile_exponents(amax: torch.Tensor) -> torch.Tensor:
    """The e of each tile's scale 2^e: smallest with amax <= 448 * 2^e, in [-126, 126]."""
    mantissa, exponent = torch.frexp(amax)  # amax = m * 2^E, m in [0.5, 1); 448 = 0.875 * 2^9
    e = torch.where(mantissa <= 0.875, exponent - 9, exponent - 8)
    return e.clamp(-126, 126)


def pack_fp8(x: torch.Tensor) -> torch.Tensor:
    """x: [N, lc] -> fp8 rows [N, fp8_row_bytes(lc)] uint8."""
    n, lc = x.shape
    x = x.float()
    tiles = fp8_tiles(lc)
    padded = torch.nn.functional.pad(x, (0, tiles * FP8_TILE - lc)).view(n, tiles, FP8_TILE)
    amax = _finite_amax(padded)
    e = fp8_tile_exponents(amax)
    scale = torch.where(amax > 0, torch.ldexp(torch.ones_like(amax), e), 0.0)
    inv = torch.where(amax > 0, torch.ldexp(torch.ones_like(amax), -e), 1.0)
    y = (padded * inv.unsqueeze(-1)).view(n, -1)[:, :lc]
    return torch.cat([e4m3_codes(y), scale.contiguous().view(torch.uint8).view(n, 4 * tiles)],
                     dim=1)


def fp8_row_parts(rows: torch.Tensor, lc: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 rows [..., fp8_row_bytes(lc)] uint8 -> (their e4m3 codes as a float8_e4m3fn view
    [..., lc], no copy; their fp32 tile scales [..., fp8_tiles(lc)], a copy of 4 bytes a tile).
    For a reader that converts the codes in a copy it makes anyway and scales it in place."""
    tiles = fp8_tiles(lc)
    scale = rows[..., lc:lc + 4 * tiles].contiguous().view(torch.float32)
    return rows[..., :lc].view(torch.float8_e4m3fn), scale


def unpack_fp8(rows: torch.Tensor, lc: int) -> torch.Tensor:
    """fp8 rows [..., fp8_row_bytes(lc)] uint8 -> values [..., lc] fp32."""
    codes, scale = fp8_row_parts(rows, lc)
    return codes.float() * scale.repeat_interleave(FP8_TILE, dim=-1)[..., :lc]


def pack_nvfp4(x: torch.Tensor, outer: float) -> torch.Tensor:
    """x: [N, lc] -> nvfp4 rows [N, nvfp4_row_bytes(lc)] uint8, outer scale `outer` (power of
    two)."""
    check_outer_scale(outer)
    n, lc = x.shape
    groups = x.float().view(n, lc // NVFP4_GROUP, NVFP4_GROUP)
    outer_t = torch.tensor(outer, dtype=torch.float32, device=x.device)
    group_codes = e4m3_codes(_finite_amax(groups) / (6.0 * outer_t))
    group_codes = torch.where(torch.isnan(groups).any(-1), E4M3_NAN, group_codes).to(torch.uint8)
    divisor = e4m3_values(group_codes) * outer_t
    divisor = torch.where((divisor == 0) | torch.isnan(divisor), 1.0, divisor)
    codes = e2m1_codes(groups / divisor.unsqueeze(-1)).view(n, lc // 2, 2)
    out = torch.zeros(n, nvfp4_row_bytes(lc), dtype=torch.uint8, device=x.device)
    out[:, : lc // 2] = codes[..., 0] | (codes[..., 1] << 4)
    out[:, lc // 2: lc // 2 + lc // NVFP4_GROUP] = group_codes
    at = nvfp4_outer_offset(lc)
    out[:, at:at + 4] = outer_t.reshape(1).view(torch.uint8)
    return out


def unpack_nvfp4(rows: torch.Tensor, lc: int) -> torch.Tensor:
    """nvfp4 rows [..., nvfp4_row_bytes(lc)] uint8 -> values [..., lc] fp32."""
    packed = rows[..., : lc // 2]
    codes = torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2)
    group = e4m3_values(rows[..., lc // 2: lc // 2 + lc // NVFP4_GROUP])
    at = nvfp4_outer_offset(lc)
    outer = rows[..., at:at + 4].contiguous().view(torch.float32)
    return e2m1_values(codes) * (group.repeat_interleave(NVFP4_GROUP, dim=-1) * outer)


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """x [..., d] -> x @ H in fp32, H the orthonormal Sylvester Hadamard matrix (d a power of
    two): log2(d) butterfly stages (a + b, a - b), then one scale by 1/sqrt(d)."""
    d = x.shape[-1]
    if d < 1 or d & (d - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two width, not {d}")
    y, h = x.float().reshape(-1, d), 1
    while h < d:
        pairs = y.view(-1, d // (2 * h), 2, h)
        y = torch.stack([pairs[:, :, 0] + pairs[:, :, 1], pairs[:, :, 0] - pairs[:, :, 1]],
                        dim=2).view(-1, d)
        h *= 2
    return (y * d**-0.5).view(x.shape)


def pack_pool_keys(keys: torch.Tensor) -> torch.Tensor:
    """Pooled keys [P, d] -> fp8 rows of the rotated keys [P, fp8_row_bytes(d)] uint8."""
    return pack_fp8(hadamard_rotate(keys))


def pack_latent(x: torch.Tensor, latent_format: str, outer: float = 1.0) -> torch.Tensor:
    if latent_format == "fp8":
        return pack_fp8(x)
    if latent_format == "nvfp4":
        return pack_nvfp4(x, outer)
    raise ValueError(f"latent format {latent_format!r} is not packed (fp8 or nvfp4)")


def unpack_latent(rows: torch.Tensor, lc: int, latent_format: str) -> torch.Tensor:
    """Cache rows -> fp32 values [..., lc]; "plain" rows are the values themselves."""
    if latent_format == "plain":
        return rows.float()
    if latent_format == "fp8":
        return unpack_fp8(rows, lc)
    if latent_format == "nvfp4":
        return unpack_nvfp4(rows, lc)
    raise ValueError(f"unknown latent format {latent_format!r}; one of {LATENT_FORMATS}")


def store_latent(latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
                 dcp_rank: int = 0, dcp_size: int = 1, latent_format: str = "plain",
                 outer_scale: float = 1.0) -> None:
    """`sparse_mla.store_rows` of MLA latent rows [T, Lc] into a cache of `latent_format`
    rows: "plain" (the values in the cache's dtype) or packed uint8 rows ("fp8", "nvfp4" with
    the layer's outer scale)."""
    from .sparse_mla import store_rows  # imported here: sparse_mla reads rows via this module

    if latent_format != "plain":
        latent = pack_latent(latent, latent_format, outer_scale)
    store_rows(latent, cache, slot_mapping, dcp_rank, dcp_size)
