"""Triton EXL3 kernels (kernels/exl3.py) vs the reference (kernels/ref/exl3.py), small shapes.

exl3_dequant must be bit-exact (torch.equal on the fp16 bits). moe_exl3 feeds fp16 rotated
activations to the exact fp16 What (decode path) or to an fp32 scratch (prefill path on CPU), so
both are held to 2e-3 relative error against the fp32 reference (measured ~5e-4: the fp16
rounding of the rotated inputs).
"""

from __future__ import annotations

import pytest
import torch

from glm53.kernels.ref import exl3 as ref

from .triton_util import DEVICE, needs_triton, rel_err

pytestmark = needs_triton
G = torch.Generator().manual_seed(53)
MOE_TOL = 2e-3


def _trellis(*tiles, bits=4):
    return ref.exl3_pack(torch.randint(0, 2**bits, (*tiles, 256), generator=G), bits)


@pytest.mark.parametrize("shape,bits,codebook", [
    ((2, 3, 5), 4, 1),      # k=32, n=80: a batch of two experts, non-square tile grid
    ((16, 2), 4, 0),        # k=256, n=32
    ((3, 9), 4, 2),         # n = 144: a partial 128-column block
    ((2, 2, 10), 3, 1),     # another K: the state spans two words at varying shifts
    ((1, 4, 8), 1, 2),
    ((4, 3), 8, 0),
])
def test_dequant_bit_exact(shape, bits, codebook):
    from glm53.kernels import exl3

    trellis = _trellis(*shape, bits=bits)
    out = exl3.exl3_dequant(trellis.to(DEVICE), codebook)
    want = ref.exl3_dequant(trellis, codebook)
    assert out.dtype == torch.float16 and out.shape == want.shape
    assert torch.equal(out.cpu().view(torch.int16), want.view(torch.int16))


def test_dequant_rejects_bad_input():
    from glm53.kernels import exl3

    with pytest.raises(ValueError, match="16\\*K"):
        exl3.exl3_dequant(torch.zeros(1, 1, 20, dtype=torch.int16, device=DEVICE), 1)
    with pytest.raises(ValueError, match="codebook"):
        exl3.exl3_dequant(torch.zeros(1, 1, 64, dtype=torch.int16, device=DEVICE), 5)


def _experts(n_local, d, inter, bits=4):
    def scales(*shape, mag):
        sign = torch.randint(0, 2, shape, generator=G) * 2 - 1
        return ((torch.rand(*shape, generator=G) + 0.5) * sign * mag).half()

    return (_trellis(n_local, d // 16, 2 * inter // 16, bits=bits), scales(n_local, 2, d, mag=0.05),
            scales(n_local, 2 * inter, mag=1.0), _trellis(n_local, inter // 16, d // 16, bits=bits),
            scales(n_local, inter, mag=0.05), scales(n_local, d, mag=1.0))


@pytest.mark.parametrize("decode", [True, False])
@pytest.mark.parametrize("t,d,k,n_local,offset,codebook", [
    (1, 128, 3, 3, 0, 1),
    (3, 256, 3, 4, 2, 0),    # EP: experts 2..5 of 8 are ours
    (17, 128, 1, 5, 4, 2),   # several rows per expert, some runs longer than one pair
])
def test_moe_exl3_matches_ref(decode, t, d, k, n_local, offset, codebook):
    from glm53.kernels import exl3

    inter = 128
    params = _experts(n_local, d, inter)
    x = torch.randn(t, d, generator=G)
    ids = torch.stack([torch.randperm(n_local + offset + 2, generator=G)[:k] for _ in range(t)])
    wts = torch.rand(t, k, generator=G)
    want = ref.moe_exl3(x, *params, wts, ids, 7.0, offset, codebook)
    out = exl3.moe_exl3_on_path(*(a.to(DEVICE) for a in (x, *params, wts, ids)), 7.0, offset,
                                codebook, decode=decode)
    assert out.dtype == x.dtype and float(want.norm()) > 0
    assert rel_err(out, want) < MOE_TOL


def test_moe_exl3_prefill_chunks_experts(monkeypatch):
    """A scratch of two experts: three chunks, the later ones rotated to the front by a gather."""
    from glm53.kernels import exl3

    t, d, inter, n_local, k = 9, 128, 128, 5, 2
    params = _experts(n_local, d, inter)
    monkeypatch.setattr(exl3, "PREFILL_SCRATCH_BYTES", 2 * d * 2 * inter * 4)
    x = torch.randn(t, d, generator=G)
    ids = torch.stack([torch.randperm(n_local + 1, generator=G)[:k] for _ in range(t)])
    wts = torch.rand(t, k, generator=G)
    want = ref.moe_exl3(x, *params, wts, ids, 7.0, 1, 1)
    out = exl3.moe_exl3_on_path(*(a.to(DEVICE) for a in (x, *params, wts, ids)), 7.0, 1, 1,
                                decode=False)
    assert rel_err(out, want) < MOE_TOL


@pytest.mark.parametrize("codebook", [0, 1, 2])
def test_codebook_all_states(codebook):
    """The kernels' hash (one fp16 add of the two halves for 3INST/MCG) on all 65536 states."""
    from glm53.kernels import exl3

    states = torch.arange(65536, device=DEVICE)
    out = exl3._codebook(states, codebook).cpu()
    assert torch.equal(out.view(torch.int16),
                       ref.exl3_codebook(states.cpu(), codebook).view(torch.int16))


def _dense_gemm(a, trellis, key, codebook):
    """a [S, P, KD] @ What of each row's expert (side s: its N/S columns); other rows zero."""
    w = ref.exl3_dequant(trellis, codebook).float()  # [E, KD, N]
    n_side, p, _ = a.shape
    ns = w.shape[-1] // n_side
    out = torch.zeros(p, w.shape[-1])
    for i, e in enumerate(key.tolist()):
        if e < w.shape[0]:
            for s in range(n_side):
                out[i, s * ns:(s + 1) * ns] = a[s, i].float() @ w[e, :, s * ns:(s + 1) * ns]
    return out


@pytest.mark.parametrize("rows,bits,runs,codebook", [
    (1, 4, (1, 1, 1), 1),     # T = 1 shape: one row per expert
    (2, 4, (2, 0, 3), 0),     # a run of 3 over two MR = 2 programs, an expert without rows
    (4, 4, (5, 1, 0), 2),     # MR = 4: a run longer than MR, a partial run
    (None, 3, (2, 1, 0), 1),  # K != 4: the tl.dot kernel
])
def test_fused_gemm_k_splits(rows, bits, runs, codebook):
    """The decode GEMM alone on KD = 512 (four K splits, atomic adds), two input sides, rows of
    other ranks' experts at the end."""
    from glm53.kernels import exl3

    n_exp, kd, n = len(runs), 512, 256
    trellis = _trellis(n_exp, kd // 16, n // 16, bits=bits)
    key = torch.cat([torch.full((r,), e) for e, r in enumerate(runs)] + [torch.full((2,), n_exp)])
    starts = torch.searchsorted(key, torch.arange(n_exp + 1)).to(torch.int32)
    a = torch.randn(2, key.numel(), kd, generator=G).half().float()
    out = exl3._fused_gemm(a.to(DEVICE), trellis.to(DEVICE), key.to(DEVICE), starts.to(DEVICE),
                           codebook, rows=rows)
    want = _dense_gemm(a, trellis, key, codebook)
    assert rel_err(out, want) < 1e-5


def test_moe_exl3_decode_multi_row_programs(monkeypatch):
    """The whole decode path with MR = 4 rows per K = 4 GEMV program (runs of 1..several rows)."""
    from glm53.kernels import exl3

    monkeypatch.setattr(exl3, "_gemv_rows", lambda p: 4)
    t, d, inter, n_local, k = 11, 128, 128, 3, 2
    params = _experts(n_local, d, inter)
    x = torch.randn(t, d, generator=G)
    ids = torch.stack([torch.randperm(n_local + 1, generator=G)[:k] for _ in range(t)])
    wts = torch.rand(t, k, generator=G)
    want = ref.moe_exl3(x, *params, wts, ids, 7.0, 1, 1)
    out = exl3.moe_exl3_on_path(*(a.to(DEVICE) for a in (x, *params, wts, ids)), 7.0, 1, 1,
                                decode=True)
    assert rel_err(out, want) < MOE_TOL
