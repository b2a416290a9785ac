"""Quantised latent rows (kernels/ref/latent_quant.py) against bytes written out by hand.

Each golden row was derived on paper from the rules in the module docstring (nearest-even,
saturating, power-of-two fp8 tile scales, NaN/inf/-0.0/denormal handling); pack must produce
exactly these bytes and unpack exactly these values.
"""

from __future__ import annotations

import math

import pytest
import torch

from glm53.kernels.ref import latent_quant as lq

INF, NAN = math.inf, math.nan
ONE_F32 = [0x00, 0x00, 0x80, 0x3F]  # 1.0 little-endian


def _bytes(rows: torch.Tensor) -> list[int]:
    return rows.flatten().tolist()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values incl. NaN positions and the sign of zero."""
    return (torch.equal(torch.isnan(a), torch.isnan(b))
            and torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))
            and torch.equal(torch.signbit(a), torch.signbit(b)))


def test_row_sizes_of_glm53():
    assert lq.fp8_row_bytes(512) == 528  # 512 e4m3 + 4 fp32 tile scales
    assert lq.nvfp4_row_bytes(512) == 304  # 256 codes + 32 scales + 4 reserved + fp32 + 8 pad
    assert lq.nvfp4_outer_offset(512) == 292


# amax 448 -> scale 2^0; ties 1.0625 -> 1.0 and 1.1875 -> 1.25 (even mantissa); 2^-10 is a
# tie between 0 and the smallest subnormal 2^-9 -> 0; 3 * 2^-10 -> 2^-8; inf saturates
FP8_IN = [1.0, -1.0, 0.5, 448.0, 0.0, -0.0, INF, -INF, NAN, 1.0625, 1.1875, 2**-9, 2**-10,
          3 * 2**-10, 240.0, 2**-6]
FP8_CODES = [0x38, 0xB8, 0x30, 0x7E, 0x00, 0x80, 0x7E, 0xFE, 0x7F, 0x38, 0x3A, 0x01, 0x00,
             0x02, 0x77, 0x08]
FP8_OUT = [1.0, -1.0, 0.5, 448.0, 0.0, -0.0, 448.0, -448.0, NAN, 1.0, 1.25, 2**-9, 0.0, 2**-8,
           240.0, 2**-6]


def test_fp8_golden_special_values():
    rows = lq.pack_fp8(torch.tensor([FP8_IN]))
    assert _bytes(rows) == FP8_CODES + ONE_F32
    assert _same(lq.unpack_fp8(rows, 16)[0], torch.tensor(FP8_OUT))


def test_fp8_golden_zero_tile_and_power_of_two_scale():
    # lc 256: tile 0 all zero (scale 0), tile 1 all 3.0: amax 3 = 0.75 * 2^2 -> e = -7,
    # 3 * 2^7 = 384 = 1.5 * 2^8 -> code 0x7C
    x = torch.cat([torch.zeros(128), torch.full((128,), 3.0)]).unsqueeze(0)
    rows = lq.pack_fp8(x)
    assert _bytes(rows) == [0] * 128 + [0x7C] * 128 + [0, 0, 0, 0] + [0x00, 0x00, 0x00, 0x3C]
    assert torch.equal(lq.unpack_fp8(rows, 256), x)


def test_fp8_golden_denormal_inputs_and_negative_nan():
    # a tile of fp32 denormals takes the floor scale 2^-126: 2^-130 -> 2^-4 = code 0x18,
    # 2^-140 -> 2^-14, below half the smallest e4m3 subnormal -> 0; a NaN with its sign bit
    # set is stored as the canonical 0x7F
    x = torch.tensor([[2.0**-130, -(2.0**-130), 2.0**-140, -NAN] + [0.0] * 12])
    assert torch.signbit(x[0, 3])
    rows = lq.pack_fp8(x)
    assert _bytes(rows) == [0x18, 0x98, 0x00, 0x7F] + [0] * 12 + [0x00, 0x00, 0x80, 0x00]
    assert _same(lq.unpack_fp8(rows, 16)[0],
                 torch.tensor([2.0**-130, -(2.0**-130), 0.0, NAN] + [0.0] * 12))


def test_fp8_all_zero_row_is_zero_bytes():
    # a zeroed cache page already holds valid all-zero rows
    rows = lq.pack_fp8(torch.zeros(2, 512))
    assert rows.shape == (2, 528) and not rows.any()
    assert not lq.unpack_fp8(rows, 512).any()


def test_fp8_codes_match_torch_cast_for_finite_values():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 512, generator=g) * torch.logspace(-30, 30, 64).unsqueeze(1)
    rows = lq.pack_fp8(x)
    scale = rows[:, 512:].contiguous().view(torch.float32)
    y = x / scale.repeat_interleave(128, dim=1)
    assert torch.equal(rows[:, :512], y.to(torch.float8_e4m3fn).view(torch.uint8))
    # a power-of-two scale per tile: relative error of e4m3 (3 mantissa bits) at most 2^-4
    err = (lq.unpack_fp8(rows, 512) - x).abs() / x.abs()
    assert float(err[x.abs() >= scale.repeat_interleave(128, 1) * 2**-6].max()) <= 2**-4


# outer 1, amax 6 -> group scale 1.0 (0x38); ties 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2,
# 2.5 -> 2, 3.5 -> 4, 5 -> 4 (even codes); inf saturates at 6; 0.3 -> 0.5; 2.9 -> 3
NVFP4_IN = [0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.5, INF, -INF, 0.3, 2.9, -0.0,
            1.5]
NVFP4_NIBBLES = [0x00, 0x22, 0x44, 0x66, 0x97, 0xF7, 0x51, 0x38]
NVFP4_OUT = [0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.5, 6.0, -6.0, 0.5, 3.0, -0.0, 1.5]


def test_nvfp4_golden_special_values():
    rows = lq.pack_nvfp4(torch.tensor([NVFP4_IN]), 1.0)
    # lc 16: 8 code bytes, 1 group scale, 4 reserved, fp32 outer at 16, padding to 32
    assert _bytes(rows) == NVFP4_NIBBLES + [0x38] + [0] * 7 + ONE_F32 + [0] * 12
    assert _same(lq.unpack_nvfp4(rows, 16)[0], torch.tensor(NVFP4_OUT))


def test_nvfp4_golden_nan_group_outer_scale_and_zero_row():
    # lc 32, outer 0.5: group 0 holds a NaN (scale 0x7F, all 16 unpack to NaN); group 1 has
    # amax 2.25: 2.25 / 3 = 0.75 = code 0x34; 2.25 / 0.375 = 6 -> 7; -0.75 / 0.375 = -2 -> 0xC
    x = torch.tensor([[1.0, NAN] + [0.0] * 14 + [2.25, -0.75] + [0.0] * 14,
                      [0.0] * 32])
    rows = lq.pack_nvfp4(x, 0.5)
    half = [0x00, 0x00, 0x00, 0x3F]  # 0.5
    row0 = [0x02] + [0] * 7 + [0xC7] + [0] * 7 + [0x7F, 0x34, 0, 0, 0, 0, 0, 0] + half + [0] * 4
    assert rows.shape == (2, 32)
    assert _bytes(rows[0]) == row0
    # an all-zero row: zero codes and scales, the outer scale still recorded
    assert _bytes(rows[1]) == [0] * 24 + half + [0] * 4
    out = lq.unpack_nvfp4(rows, 32)
    assert torch.isnan(out[0, :16]).all()
    assert out[0, 16:].tolist() == [2.25, -0.75] + [0.0] * 14
    assert not out[1].any()


def test_nvfp4_rejects_outer_scales_that_are_not_powers_of_two():
    for bad in (0.0, 3.0, -1.0, INF, NAN, 2.0**-120):
        with pytest.raises(ValueError, match="power of two"):
            lq.pack_nvfp4(torch.zeros(1, 16), bad)


def test_quantised_rows_need_a_width_of_whole_groups():
    with pytest.raises(ValueError, match="multiple of 16"):
        lq.fp8_row_bytes(40)
