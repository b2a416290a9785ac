"""EXL3 reference (kernels/ref/exl3.py) against the golden vectors of design/exl3-dflash-spec.md
§B.7 and independent formulations.

Tolerances: decode is exact; the Hadamard algebra in fp64 1e-6 relative (it is ~1e-15); the MoE
against ref fused_moe on the dequantised weights 1e-5 relative in fp32 (summation order).
"""

from __future__ import annotations

import pytest
import torch

from glm53.kernels.ref import exl3, moe
from glm53.kernels.ref.exl3 import _tile_states, _tile_symbol_index

G = torch.Generator().manual_seed(17)


def _symbols(*shape, bits=4):
    return torch.randint(0, 2**bits, (*shape, 256), generator=G)


def _scales(*shape, mag=0.05):
    """fp16 scale vectors: random sign times a magnitude in [0.5, 1.5) * mag."""
    sign = torch.randint(0, 2, shape, generator=G) * 2 - 1
    return ((torch.rand(*shape, generator=G) + 0.5) * sign * mag).half()


def test_packing_fixture_states_positions_and_values():
    """s_i = i mod 16, K = 4 (§B.7.1)."""
    words = exl3.exl3_pack(torch.arange(256) % 16, 4)
    assert words.dtype == torch.int16 and words.shape == (64,)
    assert [int(w) & 0xFFFF for w in words[:4]] == [0x4567, 0x0123, 0xCDEF, 0x89AB]
    states = _tile_states(words, 4)
    assert [int(states[i]) for i in (0, 1, 255)] == [0xDEF0, 0xEF01, 0xCDEF]
    index = _tile_symbol_index()
    assert (int(index[0, 0]), int(index[1, 0]), int(index[15, 15])) == (0, 1, 255)
    assert sorted(index.flatten().tolist()) == list(range(256))
    tile = exl3.exl3_dequant(words.view(1, 1, 64), 1)
    assert tile.dtype == torch.float16 and tile.shape == (16, 16)
    assert [float(tile[r, c]) for r, c in ((0, 0), (1, 0), (15, 15))] == [
        3.43359375, 1.0751953125, -1.1630859375]
    assert float(tile.double().sum()) == 188.8359375


@pytest.mark.parametrize("codebook,golden", [
    (1, [1.84375, 0.134521484375, -0.75927734375, 1.5146484375, 0.85009765625]),
    (0, [0.76806640625, -0.91943359375, 0.931640625, -2.19921875, -0.158203125]),
    (2, [-3.453125, 0.64111328125, -0.448486328125, -0.5771484375, -0.6513671875]),
])
def test_codebook_goldens(codebook, golden):
    vals = exl3.exl3_codebook(torch.tensor([0, 1, 2, 0x1234, 0xFFFF]), codebook)
    assert vals.dtype == torch.float16 and vals.tolist() == golden


@pytest.mark.parametrize("bits", range(1, 9))
def test_pack_then_states_is_the_circular_rolling_state(bits):
    sym = _symbols(3, bits=bits)
    words = exl3.exl3_pack(sym, bits)
    assert words.shape == (3, 16 * bits)
    # rolling state over the circular sequence: after one lap (256 >= 16/K symbols) it is exact
    state, lap = torch.zeros(3, dtype=torch.int64), []
    for i in range(2 * 256):
        state = ((state << bits) | sym[:, i % 256]) & 0xFFFF
        lap.append(state)
    want = torch.stack(lap[256:], dim=1)
    assert torch.equal(_tile_states(words, bits), want)


def test_dequant_places_tiles_and_rejects_bad_widths():
    """A [2, 3]-tile matrix: tile (a, b) lands at rows 16a.., columns 16b.."""
    sym = _symbols(2, 3)
    words = exl3.exl3_pack(sym, 4)
    what = exl3.exl3_dequant(words, 0)
    assert what.shape == (32, 48)
    index = _tile_symbol_index()
    for a in range(2):
        for b in range(3):
            tile = exl3.exl3_dequant(words[a, b].view(1, 1, 64), 0)
            assert torch.equal(what[16 * a:16 * a + 16, 16 * b:16 * b + 16], tile)
            assert torch.equal(tile, exl3.exl3_codebook(_tile_states(words[a, b], 4), 0)[index])
    with pytest.raises(ValueError, match="16\\*K"):
        exl3.exl3_dequant(torch.zeros(1, 1, 72, dtype=torch.int16), 1)
    with pytest.raises(ValueError, match="codebook"):
        exl3.exl3_codebook(torch.tensor([1]), 3)


def test_hadamard_is_natural_order_orthonormal():
    eye = torch.eye(256, dtype=torch.float64)
    h = exl3.hadamard128(eye)
    assert torch.allclose(h @ h, eye, atol=1e-12)  # symmetric and orthonormal
    assert torch.allclose(h[1, :128] * 128**0.5, torch.tensor([1.0, -1.0] * 64).double())
    assert torch.all(h[:128, 128:] == 0)  # block diagonal
    assert exl3.hadamard128(torch.ones(2, 128, dtype=torch.float16)).dtype == torch.float32


@pytest.mark.parametrize("codebook", [0, 1, 2])
def test_algebra_transform_path_equals_original_basis_weight(codebook):
    """(x * suh) . BH @ What . BH * svh == x @ W in fp64 (§B.7.4)."""
    k, n = 256, 384
    trellis = exl3.exl3_pack(_symbols(k // 16, n // 16), 4)
    suh, svh = _scales(k), _scales(n, mag=1.0)
    x = torch.randn(5, k, generator=G, dtype=torch.float64)
    what = exl3.exl3_dequant(trellis, codebook)
    y = exl3.exl3_linear(x, what, suh, svh)
    assert y.dtype == torch.float64
    w = exl3.exl3_weight(trellis, suh, svh, codebook)
    assert w.dtype == torch.float32 and w.shape == (k, n)
    want = x @ w.double()
    assert float((y - want).norm() / want.norm()) < 1e-6


@pytest.mark.parametrize("codebook,std", [(0, 1.243711), (1, 1.244112), (2, 1.0003)])
def test_codebook_distribution(codebook, std):
    vals = exl3.exl3_codebook(torch.arange(65536), codebook).double()
    assert abs(float(vals.std(unbiased=False)) - std) < 1e-4
    assert abs(float(vals.mean())) < 3e-3 and float(vals.abs().max()) < 4.0


def _experts(n_local, d, inter, bits=4):
    w13 = exl3.exl3_pack(_symbols(n_local, d // 16, 2 * inter // 16, bits=bits), bits)
    w2 = exl3.exl3_pack(_symbols(n_local, inter // 16, d // 16, bits=bits), bits)
    return (w13, _scales(n_local, 2, d), _scales(n_local, 2 * inter, mag=1.0),
            w2, _scales(n_local, inter), _scales(n_local, d, mag=1.0))


@pytest.mark.parametrize("expert_offset,bits", [(0, 4), (3, 4), (2, 3)])
def test_moe_exl3_equals_fused_moe_on_dequantised_weights(expert_offset, bits):
    """EP: with expert_offset 3 the rank holds experts 3..6 of 9; the others are skipped."""
    t, d, inter, n_local, k, cb = 7, 256, 128, 4, 3, 1
    params = _experts(n_local, d, inter, bits)
    w13_trellis, w13_suh, w13_svh, w2_trellis, w2_suh, w2_svh = params
    gate = exl3.exl3_weight(w13_trellis[:, :, :inter // 16], w13_suh[:, 0],
                            w13_svh[:, :inter], cb)
    up = exl3.exl3_weight(w13_trellis[:, :, inter // 16:], w13_suh[:, 1], w13_svh[:, inter:], cb)
    w13 = torch.cat([gate, up], dim=2).transpose(1, 2)  # [E, 2I, D] (HF layout)
    w2 = exl3.exl3_weight(w2_trellis, w2_suh, w2_svh, cb).transpose(1, 2)  # [E, D, I]
    x = torch.randn(t, d, generator=G)
    ids = torch.stack([torch.randperm(n_local + 5, generator=G)[:k] for _ in range(t)])
    wts = torch.rand(t, k, generator=G)
    out = exl3.moe_exl3(x, *params, wts, ids, 7.0, expert_offset, cb)
    want = moe.fused_moe(x, w13, w2, wts, ids, 7.0, expert_offset)
    assert out.dtype == x.dtype and float(want.norm()) > 0
    assert float((out - want).norm() / want.norm()) < 1e-5
