"""The INT4 reference (kernels/ref/int4.py): quantisation round trip, storage layout, and
moe_int4 against the bf16 fused_moe reference on the dequantised weights (fp32, 1e-5)."""

from __future__ import annotations

import pytest
import torch

from glm53.kernels.ref import int4 as ref_int4
from glm53.kernels.ref import moe as ref_moe

EPS16 = 2.0 ** -11  # fp16 rounding (relative) of the stored scale and zero


@pytest.mark.parametrize("shape,g", [((3, 8, 64), 32), ((5, 96), 96), ((2, 4, 48), 16)])
def test_round_trip_error_within_half_a_step(shape, g):
    """|w - deq| <= scale/2, plus the fp16 rounding of zero and of 15 * scale at the clamps."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(shape, generator=gen) * 0.05 + 0.01
    q, scale, zero = ref_int4.quantize_int4(w, g)
    assert q.dtype == torch.uint8 and q.shape == (*shape[:-1], shape[-1] // 2)
    assert scale.dtype == zero.dtype == torch.float16
    assert scale.shape == zero.shape == (*shape[:-1], shape[-1] // g)
    deq = ref_int4.dequantize_int4(q, scale, zero, g)
    assert deq.dtype == torch.float32 and deq.shape == w.shape
    s = scale.float().repeat_interleave(g, -1)
    z = zero.float().repeat_interleave(g, -1)
    bound = s / 2 + EPS16 * (z.abs() + 16 * s) + 1e-7
    assert ((w - deq).abs() <= bound).all()
    # the codes use the whole range: each group's min and max land on codes 0 and 15
    codes = torch.stack((q & 15, q >> 4), -1).reshape(w.shape).reshape(-1, g)
    assert (codes.amin(-1) == 0).all() and (codes.amax(-1) == 15).all()


def test_nibble_order_low_is_even_column():
    # one group of 4 on [0, 15]: codes equal the values; scale 1, zero 0
    w = torch.tensor([[0.0, 15.0, 7.0, 2.0]])
    q, scale, zero = ref_int4.quantize_int4(w, 4)
    assert q.tolist() == [[0 | (15 << 4), 7 | (2 << 4)]]
    assert scale.tolist() == [[1.0]] and zero.tolist() == [[0.0]]
    assert torch.equal(ref_int4.dequantize_int4(q, scale, zero, 4), w)


def test_constant_groups_dequantise_to_the_constant():
    w = torch.tensor([[0.75] * 4 + [-3.0, 1.0, 2.0, 5.0], [-2.5] * 8])
    q, scale, zero = ref_int4.quantize_int4(w, 4)
    deq = ref_int4.dequantize_int4(q, scale, zero, 4)
    assert not deq.isnan().any()
    assert scale[0, 0] == 0 and scale[1].eq(0).all()
    assert torch.equal(deq[0, :4], w[0, :4]) and torch.equal(deq[1], w[1])


@pytest.mark.parametrize("kin,g", [(48, 32), (64, 3), (64, 0)])
def test_bad_group_sizes_raise(kin, g):
    with pytest.raises(ValueError, match=f"in_features {kin}.*group size {g}"):
        ref_int4.quantize_int4(torch.randn(2, kin), g)
    with pytest.raises(ValueError, match=f"in_features {kin}"):
        ref_int4.dequantize_int4(torch.zeros(2, kin // 2, dtype=torch.uint8),
                                 torch.ones(2, 1, dtype=torch.float16),
                                 torch.zeros(2, 1, dtype=torch.float16), g)


def quantized_experts(n_local, d, inter, group_size, gen):
    """Random bf16-scale expert weights quantised per the spec: (int4 tensors, dequantised)."""
    w13 = torch.randn(n_local, 2 * inter, d, generator=gen) * 0.3
    w2 = torch.randn(n_local, d, inter, generator=gen) * 0.3
    g13, g2 = min(group_size, d), min(group_size, inter)
    p13, p2 = ref_int4.quantize_int4(w13, g13), ref_int4.quantize_int4(w2, g2)
    deq = (ref_int4.dequantize_int4(*p13, g13), ref_int4.dequantize_int4(*p2, g2))
    return (*p13, *p2), deq


@pytest.mark.parametrize("expert_offset,group_size", [(0, 16), (3, 128)])
def test_moe_int4_equals_fused_moe_on_dequantised_weights(expert_offset, group_size):
    """EP: with offset 3 the rank holds experts 3..7 of 10; the others are skipped. Group 128
    exceeds both in_features (24, 16): each projection uses its whole row."""
    gen = torch.Generator().manual_seed(2)
    t, d, inter, n_local, k = 9, 32, 16, 5, 3
    packed, (w13, w2) = quantized_experts(n_local, d, inter, group_size, gen)
    x = torch.randn(t, d, generator=gen)
    ids = torch.stack([torch.randperm(10, generator=gen)[:k] for _ in range(t)])
    wts = torch.rand(t, k, generator=gen)
    out = ref_int4.moe_int4(x, *packed, wts, ids, 7.0, expert_offset, group_size)
    want = ref_moe.fused_moe(x, w13, w2, wts, ids, 7.0, expert_offset)
    assert out.dtype == x.dtype and want.abs().max() > 0.1
    assert float((out - want).norm() / want.norm()) < 1e-5
    # bf16 input: the same fp32 math, only the result is rounded to bf16
    xb = x.bfloat16()
    out16 = ref_int4.moe_int4(xb, *packed, wts, ids, 7.0, expert_offset, group_size)
    want16 = ref_int4.moe_int4(xb.float(), *packed, wts, ids, 7.0, expert_offset, group_size)
    assert out16.dtype == torch.bfloat16 and torch.equal(out16, want16.bfloat16())
